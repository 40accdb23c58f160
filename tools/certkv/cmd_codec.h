// `certkv codec`: GAAC on real KV dumps (docs/format/kv_dump.md). Calibrates on some dumps (or
// loads a saved calibration), encodes every page of another dump, checks the bit-exact round
// trip and reports the stored size, the mode mix and the codec speed (docs/gaac.md).
#pragma once

namespace certkv::tools {

// argv[1] is "codec". Returns the exit status; throws UsageError for a usage mistake and
// certkv::Error for bad files.
int cmd_codec(int argc, char** argv);

}  // namespace certkv::tools
