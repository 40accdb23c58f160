// GAAC without a calibration step: the model's calibration made from a public-domain text that
// ships with certkv (a passage of Dickens' A Tale of Two Cities, gaac_calibration_text.txt),
// run through the model once, and cached in a file so that later runs load it.
// A calibration from the text beat one made online from the first prefill on the held-out KV of
// other books (docs/engine.md, bench/gaac_self_calibration.sh), so there is no online mode.
//
// The calibration is the one `certkv codec --calib` makes from a KV dump of the same text: the
// post-RoPE K and the V of every (layer, kv_head) of one prefill of up to 4,096 tokens (fewer when
// the model's context is shorter), as BF16 rows, or cast to the FP8 element of the scheme.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "codec/gaac.h"
#include "model/model.h"

namespace certkv::engine {

// The text (UTF-8).
std::string_view gaac_calibration_text();

// Tokens of the text the calibration prefills (at most).
inline constexpr int kGaacCalibrationTokens = 4096;

// Runs the text through the model (n_threads) and calibrates pages of block_tokens tokens of
// `element`. Throws certkv::Error as the forward pass does.
codec::GaacCalibration calibrate_gaac_from_text(const model::Model& model, format::GaacElement element,
                                                int block_tokens, int n_threads);

// Where the cached calibration of this model lives: `dir`/<model file name>.<fingerprint>.gaac-
// <element>-b<block_tokens>.safetensors, the fingerprint a hash of the model file's size and of
// its first and last MiB (a Hugging Face folder: of its config.json). dir: $CERTKV_CACHE_DIR when
// set, else the model file's folder (the folder itself for a Hugging Face model).
std::string gaac_calibration_cache_path(const model::Model& model, format::GaacElement element,
                                        int block_tokens);

// The cached calibration when the cache file holds a valid one of this shape; else calibrates,
// writes the cache file (a write that fails leaves the calibration in memory only) and returns it.
// *computed (may be null) tells which happened.
std::shared_ptr<const codec::GaacCalibration> self_calibrated_gaac(const model::Model& model,
                                                                   format::GaacElement element,
                                                                   int block_tokens, int n_threads,
                                                                   bool* computed = nullptr);

}  // namespace certkv::engine
