// certkv batch: many prompts through the engine at once (continuous batching over one KV pool).
#pragma once

namespace certkv::tools {

int cmd_batch(int argc, char** argv);

}  // namespace certkv::tools
