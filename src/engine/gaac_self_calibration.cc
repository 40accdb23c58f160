#include "engine/gaac_self_calibration.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "backend/session.h"
#include "core/status.h"
#include "format/fp8.h"
#include "format/numeric.h"

namespace certkv::engine {

extern const char kGaacCalibrationText[];  // generated from gaac_calibration_text.txt

namespace {

uint64_t fnv1a(uint64_t h, const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= uint8_t(p[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

// A hash of the file's size and of its first and last MiB.
uint64_t file_fingerprint(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(StatusCode::kIo, "cannot read " + path.string() + " to fingerprint it");
  const uint64_t size = std::filesystem::file_size(path);
  uint64_t h = fnv1a(0xcbf29ce484222325ull, reinterpret_cast<const char*>(&size), sizeof size);
  const size_t span = size_t(std::min<uint64_t>(size, 1u << 20));
  std::vector<char> buf(span);
  in.read(buf.data(), std::streamsize(span));
  h = fnv1a(h, buf.data(), span);
  in.seekg(std::streamoff(size - span));
  in.read(buf.data(), std::streamsize(span));
  return fnv1a(h, buf.data(), span);
}

codec::GaacShape calibration_shape(const model::Model& model, format::GaacElement element,
                                   int block_tokens) {
  const model::ModelConfig& c = model.config();
  codec::GaacShape shape;
  shape.n_layers = c.n_layers;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  shape.block_tokens = block_tokens;
  shape.element = element;
  return shape;
}

}  // namespace

std::string_view gaac_calibration_text() { return kGaacCalibrationText; }

codec::GaacCalibration calibrate_gaac_from_text(const model::Model& model, format::GaacElement element,
                                                int block_tokens, int n_threads) {
  const model::ModelConfig& c = model.config();
  std::vector<int32_t> tokens = model.tokenizer().encode(gaac_calibration_text(), true, false);
  const int64_t n = std::min<int64_t>({int64_t(tokens.size()), kGaacCalibrationTokens, c.context_length});
  if (n < block_tokens)
    fail(StatusCode::kInvalidArgument, "the GAAC calibration text is shorter than one block of " +
                                           std::to_string(block_tokens) + " tokens for this model");
  tokens.resize(size_t(n));
  backend::BackendConfig bc;
  bc.context_tokens = n;
  bc.n_threads = n_threads;
  bc.block_tokens = block_tokens;
  backend::Session session(model, bc);
  session.prefill(tokens.data(), n, nullptr);
  codec::GaacCalibrator calibrator(calibration_shape(model, element, block_tokens));
  std::vector<float> rows(size_t(n) * size_t(c.head_dim));
  std::vector<uint16_t> bf16(rows.size());
  std::vector<uint8_t> fp8(rows.size());
  for (int layer = 0; layer < c.n_layers; ++layer)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < c.n_kv_heads; ++h) {
        // The cache holds bf16 values, so the floats it returns round back exactly.
        session.kv_cache().read_token_range_ref(session.sequence(), layer, cache::KvTensor(kv), h, 0,
                                                n, rows.data());
        for (size_t i = 0; i < rows.size(); ++i) bf16[i] = format::float_to_bf16(rows[i]);
        if (element == format::GaacElement::kBf16) {
          calibrator.add_bf16(layer, kv, h, bf16.data(), int(n));
        } else {
          for (size_t i = 0; i < bf16.size(); ++i)
            fp8[i] = element == format::GaacElement::kFp8E5M2 ? format::bf16_to_fp8_e5m2_ref(bf16[i])
                                                               : format::bf16_to_fp8_e4m3_ref(bf16[i]);
          calibrator.add_fp8(layer, kv, h, fp8.data(), int(n));
        }
      }
  return calibrator.finish();
}

std::string gaac_calibration_cache_path(const model::Model& model, format::GaacElement element,
                                        int block_tokens) {
  namespace fs = std::filesystem;
  const fs::path model_path(model.path());
  const bool folder = fs::is_directory(model_path);
  const uint64_t fingerprint = file_fingerprint(folder ? model_path / "config.json" : model_path);
  fs::path dir = folder ? model_path : model_path.parent_path();
  if (const char* env = std::getenv("CERTKV_CACHE_DIR"); env != nullptr && env[0] != '\0') dir = env;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fingerprint));
  const std::string name = (folder ? std::string("model") : model_path.filename().string()) + "." + hex +
                           ".gaac-" + codec::gaac_element_name(element) + "-b" +
                           std::to_string(block_tokens) + ".safetensors";
  return (dir / name).string();
}

std::shared_ptr<const codec::GaacCalibration> self_calibrated_gaac(const model::Model& model,
                                                                   format::GaacElement element,
                                                                   int block_tokens, int n_threads,
                                                                   bool* computed) {
  const codec::GaacShape shape = calibration_shape(model, element, block_tokens);
  const std::string path = gaac_calibration_cache_path(model, element, block_tokens);
  if (computed) *computed = false;
  if (std::filesystem::exists(path)) {
    try {
      auto cached = std::make_shared<const codec::GaacCalibration>(codec::GaacCalibration::load(path, shape));
      // One made by an earlier window rule is replaced too: its bases decode and encode, but the
      // calibrator's windows are the better ones (docs/gaac.md, "Windows with headroom").
      if (cached->windows() == codec::GaacCalibration::kWindows) return cached;
    } catch (const Error&) {
      // A corrupt or foreign cache file is replaced below.
    }
  }
  auto calibration = std::make_shared<const codec::GaacCalibration>(
      calibrate_gaac_from_text(model, element, block_tokens, n_threads));
  if (computed) *computed = true;
  try {
    const std::string tmp = path + ".tmp";
    calibration->save(tmp);
    std::filesystem::rename(tmp, path);
  } catch (const std::exception&) {
    // Not cached: the next run calibrates again.
  }
  return calibration;
}

}  // namespace certkv::engine
