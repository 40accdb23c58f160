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
// pre-tokenizer); tokenizer_config may be null.
VocabSpec vocab_from_tokenizer_json(const format::JsonValue& tokenizer,
                                    const format::JsonValue* tokenizer_config,
                                    const std::string& source_name);

// The llama.cpp pre-tokenizer name ("smollm", "llama-bpe", "qwen2", "gpt-2") matching a
// tokenizer.json "pre_tokenizer" value (null: "gpt-2").
std::string pre_tokenizer_name(const format::JsonValue* pre_tokenizer);

}  // namespace certkv::model
