// Loads a Hugging Face model folder: config.json, one or more *.safetensors files (F32, F16 or
// BF16 weights, used in place from the mapping) and a byte-level BPE tokenizer.json (with
// tokenizer_config.json for special tokens and the chat template when present).
#pragma once

#include <string>

#include "format/json.h"
#include "model/model_builder.h"
#include "model/tokenizer.h"

namespace certkv::model {

// REQUIRES: dir is a directory. Throws certkv::Error naming the file and the problem.
void load_hf_folder(ModelBuilder& builder, const std::string& dir);

// The vocabulary of a byte-level BPE tokenizer.json (model.type "BPE", ByteLevel
// pre-tokenizer); tokenizer_config may be null. `architecture` picks the pre-tokenizer.
VocabSpec vocab_from_tokenizer_json(const format::JsonValue& tokenizer,
                                    const format::JsonValue* tokenizer_config,
                                    const std::string& architecture, const std::string& source_name);

}  // namespace certkv::model
