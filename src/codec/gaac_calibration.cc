// GAAC calibration: exponent windows per channel, escape capacity per (layer, K/V), and the
// calibration file (docs/format/gaac.md, "Calibration file").
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

#include "codec/gaac.h"
#include "codec/gaac_page.h"
#include "core/status.h"
#include "format/safetensors.h"

namespace certkv::codec {

namespace {

void check_shape(const GaacShape& shape) {
  if (shape.n_layers < 1 || shape.n_kv_heads < 1) {
    fail(StatusCode::kInvalidArgument,
         "GAAC calibration: n_layers and n_kv_heads must be positive, got " +
             std::to_string(shape.n_layers) + " and " + std::to_string(shape.n_kv_heads));
  }
  detail::page_geometry(shape.element, shape.block_tokens, shape.head_dim);
}

void check_stream(const GaacShape& shape, int layer, int kv, int kv_head) {
  if (layer < 0 || layer >= shape.n_layers || (kv != kGaacKey && kv != kGaacValue) ||
      kv_head < 0 || kv_head >= shape.n_kv_heads) {
    fail(StatusCode::kOutOfRange,
         "GAAC calibration: (layer " + std::to_string(layer) + ", kv " + std::to_string(kv) +
             ", kv_head " + std::to_string(kv_head) + ") outside " +
             std::to_string(shape.n_layers) + " layers x 2 x " +
             std::to_string(shape.n_kv_heads) + " kv heads");
  }
}

size_t n_exponents(const GaacShape& shape) {
  return size_t(1) << format::gaac_exponent_bits(shape.element);
}

// The base of the `width`-wide window covering the most samples, a sample counting four times at
// its exponent and once at the exponent above it (4 h[e] + h[e - 1]); the lowest base on ties.
// KV beyond the calibration's largest magnitudes is more common than KV at a window's floor
// (2^-7 or 2^-15 below its top): a window pinned at the calibration's largest exponent makes every
// larger value an escape, and its pages raw. Measured on a held-out book (docs/gaac.md, "Windows
// with headroom"): bf16 pages stored 0.3-6.4% smaller with 3-8x fewer raw pages, and on the device
// layout 30-68% fewer exceptions; the smaller the calibration, the larger the gain.
uint8_t best_window(const uint64_t* histogram, size_t n_bins, size_t width) {
  auto weight = [&](size_t e) { return 4 * histogram[e] + (e > 0 ? histogram[e - 1] : 0); };
  uint64_t covered = 0;
  for (size_t e = 0; e < width; ++e) covered += weight(e);
  uint64_t best = covered;
  size_t best_base = 0;
  for (size_t base = 1; base + width <= n_bins; ++base) {
    covered += weight(base + width - 1);
    covered -= weight(base - 1);
    if (covered > best) {
      best = covered;
      best_base = base;
    }
  }
  return static_cast<uint8_t>(best_base);
}

// 64-bit FNV-1a over the tensor data, stored in the metadata to detect corrupted files.
uint64_t fnv1a(uint64_t hash, const uint8_t* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    hash ^= data[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;

std::string hex64(uint64_t v) {
  char buf[17];
  snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

std::string tensor_name(int layer, int kv, const char* which) {
  return "layer" + std::to_string(layer) + (kv == kGaacKey ? ".k." : ".v.") + which;
}

}  // namespace

GaacCalibration::GaacCalibration(const GaacShape& shape) : shape_(shape) {
  check_shape(shape);
  const size_t n_streams = size_t(shape.n_layers) * 2 * size_t(shape.n_kv_heads);
  bases_.assign(n_streams, GaacBases{std::vector<uint8_t>(size_t(shape.head_dim), 0),
                                     std::vector<uint8_t>(size_t(shape.head_dim), 0)});
  escape_capacity_bytes_.assign(
      size_t(shape.n_layers) * 2,
      format::gaac_page_max_escape_bytes(shape.element, shape.block_tokens, shape.head_dim));
}

size_t GaacCalibration::index(int layer, int kv, int kv_head) const {
  check_stream(shape_, layer, kv, kv_head);
  return (size_t(layer) * 2 + size_t(kv)) * size_t(shape_.n_kv_heads) + size_t(kv_head);
}

const GaacBases& GaacCalibration::bases(int layer, int kv, int kv_head) const {
  return bases_[index(layer, kv, kv_head)];
}

GaacBases& GaacCalibration::bases(int layer, int kv, int kv_head) {
  return bases_[index(layer, kv, kv_head)];
}

size_t GaacCalibration::escape_capacity_bytes(int layer, int kv) const {
  index(layer, kv, 0);
  return escape_capacity_bytes_[size_t(layer) * 2 + size_t(kv)];
}

void GaacCalibration::set_escape_capacity_bytes(int layer, int kv, size_t bytes) {
  index(layer, kv, 0);
  const size_t max_bytes =
      format::gaac_page_max_escape_bytes(shape_.element, shape_.block_tokens, shape_.head_dim);
  if (bytes > max_bytes) {
    fail(StatusCode::kInvalidArgument, "GAAC calibration: escape capacity " +
                                           std::to_string(bytes) + " exceeds the page maximum " +
                                           std::to_string(max_bytes));
  }
  escape_capacity_bytes_[size_t(layer) * 2 + size_t(kv)] = bytes;
}

size_t GaacCalibration::slot_bytes(int layer, int kv) const {
  return format::gaac_slot_bytes(shape_.element, shape_.block_tokens, shape_.head_dim,
                                 escape_capacity_bytes(layer, kv));
}

void GaacCalibration::save(const std::string& path) const {
  check_shape(shape_);
  const size_t per_tensor = size_t(shape_.n_kv_heads) * size_t(shape_.head_dim);
  // Bases gathered per (layer, K/V, b3/b4) into [n_kv_heads][head_dim] blocks.
  std::vector<uint8_t> base_bytes(size_t(shape_.n_layers) * 4 * per_tensor);
  std::vector<format::SafetensorsTensorView> tensors;
  uint64_t hash = kFnvOffset;
  for (int layer = 0; layer < shape_.n_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int which = 0; which < 2; ++which) {
        uint8_t* block = base_bytes.data() + (size_t(layer) * 4 + size_t(kv) * 2 + size_t(which)) *
                                                 per_tensor;
        for (int head = 0; head < shape_.n_kv_heads; ++head) {
          const GaacBases& b = bases(layer, kv, head);
          memcpy(block + size_t(head) * size_t(shape_.head_dim),
                 (which == 0 ? b.b3 : b.b4).data(), size_t(shape_.head_dim));
        }
        hash = fnv1a(hash, block, per_tensor);
        tensors.push_back({tensor_name(layer, kv, which == 0 ? "b3" : "b4"), "U8",
                           {shape_.n_kv_heads, shape_.head_dim}, block, per_tensor});
      }
    }
  }
  std::vector<uint64_t> capacities(escape_capacity_bytes_.begin(), escape_capacity_bytes_.end());
  hash = fnv1a(hash, reinterpret_cast<const uint8_t*>(capacities.data()),
               capacities.size() * sizeof(uint64_t));
  tensors.push_back({"escape_capacity_bytes", "U64", {shape_.n_layers, 2}, capacities.data(),
                     capacities.size() * sizeof(uint64_t)});
  std::map<std::string, std::string> metadata = {
      {"format", kFormat},
      {"element", gaac_element_name(shape_.element)},
      {"n_layers", std::to_string(shape_.n_layers)},
      {"n_kv_heads", std::to_string(shape_.n_kv_heads)},
      {"head_dim", std::to_string(shape_.head_dim)},
      {"block_tokens", std::to_string(shape_.block_tokens)},
      {"data_fnv1a64", hex64(hash)},
  };
  if (!windows_.empty()) metadata["windows"] = windows_;
  format::write_safetensors(path, tensors, metadata);
}

GaacCalibration GaacCalibration::load(const std::string& path, const GaacShape& expected) {
  check_shape(expected);
  const auto file = format::SafetensorsFile::open(path);
  const auto& meta = file->metadata();
  auto meta_value = [&](const std::string& key) -> const std::string& {
    const auto it = meta.find(key);
    if (it == meta.end()) {
      fail(StatusCode::kCorrupt, path + ": GAAC calibration metadata lacks \"" + key + "\"");
    }
    return it->second;
  };
  const std::string& format_name = meta_value("format");
  if (format_name != kFormat) {
    fail(StatusCode::kCorrupt, path + ": format is \"" + format_name + "\", expected \"" +
                                   kFormat + "\"");
  }
  auto check_value = [&](const std::string& key, const std::string& want) {
    const std::string& got = meta_value(key);
    if (got != want) {
      fail(StatusCode::kInvalidArgument, path + ": calibration " + key + " is " + got +
                                             ", the model has " + want);
    }
  };
  check_value("element", gaac_element_name(expected.element));
  check_value("n_layers", std::to_string(expected.n_layers));
  check_value("n_kv_heads", std::to_string(expected.n_kv_heads));
  check_value("head_dim", std::to_string(expected.head_dim));
  check_value("block_tokens", std::to_string(expected.block_tokens));

  auto tensor = [&](const std::string& name, const char* dtype,
                    const std::vector<int64_t>& shape) -> const format::SafetensorsTensor& {
    const format::SafetensorsTensor* t = file->find(name);
    if (t == nullptr) fail(StatusCode::kCorrupt, path + ": tensor " + name + " is missing");
    if (t->dtype != dtype || t->shape != shape) {
      fail(StatusCode::kCorrupt, path + ": tensor " + name + " has dtype " + t->dtype +
                                     " and the wrong shape or type (expected " + dtype + ")");
    }
    return *t;
  };

  GaacCalibration cal(expected);
  if (const auto it = meta.find("windows"); it != meta.end()) cal.set_windows(it->second);
  const size_t per_tensor = size_t(expected.n_kv_heads) * size_t(expected.head_dim);
  const int n_bins = 1 << format::gaac_exponent_bits(expected.element);
  uint64_t hash = kFnvOffset;
  for (int layer = 0; layer < expected.n_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int which = 0; which < 2; ++which) {
        const std::string name = tensor_name(layer, kv, which == 0 ? "b3" : "b4");
        const auto& t = tensor(name, "U8", {expected.n_kv_heads, expected.head_dim});
        hash = fnv1a(hash, t.data, per_tensor);
        const int width = which == 0 ? 8 : 16;
        for (int head = 0; head < expected.n_kv_heads; ++head) {
          GaacBases& b = cal.bases(layer, kv, head);
          std::vector<uint8_t>& dst = which == 0 ? b.b3 : b.b4;
          memcpy(dst.data(), t.data + size_t(head) * size_t(expected.head_dim),
                 size_t(expected.head_dim));
          for (int c = 0; c < expected.head_dim; ++c) {
            if (dst[size_t(c)] + width > n_bins) {
              fail(StatusCode::kCorrupt,
                   path + ": tensor " + name + " head " + std::to_string(head) + " channel " +
                       std::to_string(c) + " has base " + std::to_string(dst[size_t(c)]) +
                       ", outside the exponent range");
            }
          }
        }
      }
    }
  }
  const auto& caps = tensor("escape_capacity_bytes", "U64", {expected.n_layers, 2});
  hash = fnv1a(hash, caps.data, caps.n_bytes);
  const size_t max_bytes = format::gaac_page_max_escape_bytes(
      expected.element, expected.block_tokens, expected.head_dim);
  for (int layer = 0; layer < expected.n_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      uint64_t bytes;
      memcpy(&bytes, caps.data + (size_t(layer) * 2 + size_t(kv)) * sizeof bytes, sizeof bytes);
      if (bytes > max_bytes) {
        fail(StatusCode::kCorrupt, path + ": escape capacity " + std::to_string(bytes) +
                                       " of layer " + std::to_string(layer) +
                                       " exceeds the page maximum " + std::to_string(max_bytes));
      }
      cal.escape_capacity_bytes_[size_t(layer) * 2 + size_t(kv)] = size_t(bytes);
    }
  }
  const std::string& recorded = meta_value("data_fnv1a64");
  if (recorded != hex64(hash)) {
    fail(StatusCode::kCorrupt, path + ": tensor data checksum " + hex64(hash) +
                                   " does not match the recorded " + recorded +
                                   " (corrupted file)");
  }
  return cal;
}

GaacCalibrator::GaacCalibrator(const GaacShape& shape) : shape_(shape) {
  check_shape(shape);
  const size_t n_streams = size_t(shape.n_layers) * 2 * size_t(shape.n_kv_heads);
  histograms_.assign(n_streams * size_t(shape.head_dim) * n_exponents(shape), 0);
  page_exponents_.resize(n_streams);
}

void GaacCalibrator::add_exponents(int layer, int kv, int kv_head,
                                   const std::vector<uint8_t>& exponents, int n_tokens) {
  const size_t stream =
      (size_t(layer) * 2 + size_t(kv)) * size_t(shape_.n_kv_heads) + size_t(kv_head);
  const size_t n_bins = n_exponents(shape_);
  const size_t d = size_t(shape_.head_dim);
  uint64_t* hist = histograms_.data() + stream * d * n_bins;
  for (size_t t = 0; t < size_t(n_tokens); ++t) {
    for (size_t c = 0; c < d; ++c) ++hist[c * n_bins + exponents[t * d + c]];
  }
  const size_t complete = size_t(n_tokens) / size_t(shape_.block_tokens) *
                          size_t(shape_.block_tokens);
  auto& pages = page_exponents_[stream];
  pages.insert(pages.end(), exponents.begin(), exponents.begin() + ptrdiff_t(complete * d));
}

void GaacCalibrator::add_bf16(int layer, int kv, int kv_head, const uint16_t* rows,
                              int n_tokens) {
  if (shape_.element != GaacElement::kBf16) {
    fail(StatusCode::kInvalidArgument, std::string("GAAC calibrator for ") +
                                           gaac_element_name(shape_.element) +
                                           " given BF16 rows");
  }
  check_stream(shape_, layer, kv, kv_head);
  if (n_tokens < 0) fail(StatusCode::kInvalidArgument, "GAAC calibrator: negative n_tokens");
  std::vector<uint8_t> exponents(size_t(n_tokens) * size_t(shape_.head_dim));
  for (size_t i = 0; i < exponents.size(); ++i) exponents[i] = uint8_t(rows[i] >> 7);
  add_exponents(layer, kv, kv_head, exponents, n_tokens);
}

void GaacCalibrator::add_fp8(int layer, int kv, int kv_head, const uint8_t* rows, int n_tokens) {
  if (shape_.element == GaacElement::kBf16) {
    fail(StatusCode::kInvalidArgument, "GAAC calibrator for bf16 given FP8 rows");
  }
  check_stream(shape_, layer, kv, kv_head);
  if (n_tokens < 0) fail(StatusCode::kInvalidArgument, "GAAC calibrator: negative n_tokens");
  const int mantissa_bits = format::gaac_sign_mantissa_bits(shape_.element) - 1;
  const unsigned exponent_mask = (1u << format::gaac_exponent_bits(shape_.element)) - 1;
  std::vector<uint8_t> exponents(size_t(n_tokens) * size_t(shape_.head_dim));
  for (size_t i = 0; i < exponents.size(); ++i) {
    exponents[i] = uint8_t((rows[i] >> mantissa_bits) & exponent_mask);
  }
  add_exponents(layer, kv, kv_head, exponents, n_tokens);
}

GaacCalibration GaacCalibrator::finish() const {
  GaacCalibration cal(shape_);
  cal.set_windows(GaacCalibration::kWindows);
  const size_t n_bins = n_exponents(shape_);
  const size_t d = size_t(shape_.head_dim);
  const detail::PageGeometry g =
      detail::page_geometry(shape_.element, shape_.block_tokens, shape_.head_dim);
  const size_t page_elements = size_t(shape_.block_tokens) * d;
  const size_t raw_bytes =
      format::gaac_page_raw_bytes(shape_.element, shape_.block_tokens, shape_.head_dim);
  for (int layer = 0; layer < shape_.n_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<size_t> needs;  // escape bytes of every calibration page of this (layer, K/V)
      for (int head = 0; head < shape_.n_kv_heads; ++head) {
        const size_t stream =
            (size_t(layer) * 2 + size_t(kv)) * size_t(shape_.n_kv_heads) + size_t(head);
        GaacBases& b = cal.bases(layer, kv, head);
        for (size_t c = 0; c < d; ++c) {
          const uint64_t* hist = histograms_.data() + (stream * d + c) * n_bins;
          b.b3[c] = best_window(hist, n_bins, 8);
          b.b4[c] = best_window(hist, n_bins, 16);
        }
        const auto& pages = page_exponents_[stream];
        for (size_t p = 0; p + page_elements <= pages.size(); p += page_elements) {
          const uint8_t* e = pages.data() + p;
          size_t need = 0;
          for (size_t t = 0; t < size_t(shape_.block_tokens); ++t) {
            for (size_t c0 = 0; c0 < d; c0 += 8) {
              bool fits3 = true;
              bool fits4 = format::gaac_mode_valid(shape_.element, format::kGaacMode4Bit);
              for (size_t j = 0; j < 8; ++j) {
                const int x = e[t * d + c0 + j];
                fits3 = fits3 && x - b.b3[c0 + j] >= 0 && x - b.b3[c0 + j] < 8;
                fits4 = fits4 && x - b.b4[c0 + j] >= 0 && x - b.b4[c0 + j] < 16;
              }
              const uint8_t mode = fits3   ? format::kGaacMode3Bit
                                   : fits4 ? format::kGaacMode4Bit
                                           : format::kGaacModeRaw;
              need += size_t(format::gaac_mode_escape_bytes(shape_.element, mode));
            }
          }
          needs.push_back(need);
        }
      }
      // Stored bytes at capacity `cap`: a full slot for each page that fits, its raw size for
      // each page that does not. Only capacities equal to some page's need (or 0) can be best.
      std::sort(needs.begin(), needs.end());
      size_t best_capacity = 0;
      size_t best_bytes = SIZE_MAX;
      for (size_t i = 0; i <= needs.size(); ++i) {
        const size_t cap = i == 0 ? 0 : needs[i - 1];
        if (i > 1 && needs[i - 1] == needs[i - 2]) continue;
        const size_t n_fit = size_t(std::upper_bound(needs.begin(), needs.end(), cap) -
                                    needs.begin());
        const size_t bytes =
            n_fit * (g.page_fixed_bytes + cap) + (needs.size() - n_fit) * raw_bytes;
        if (bytes < best_bytes) {
          best_bytes = bytes;
          best_capacity = cap;
        }
      }
      cal.set_escape_capacity_bytes(layer, kv, best_capacity);
    }
  }
  return cal;
}

}  // namespace certkv::codec
