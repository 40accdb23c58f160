// `certkv eval teacher-forced`, `certkv eval needle` and `certkv audit`: the quality and soundness
// evaluations of a KV scheme against the bf16 cache of the same model (docs/meter.md).
#pragma once

namespace certkv::tools {

// argv[1] is "eval" / "audit". Return the exit status; throw UsageError for a usage mistake.
int cmd_eval(int argc, char** argv);
int cmd_audit(int argc, char** argv);

}  // namespace certkv::tools
