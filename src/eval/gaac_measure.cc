#include "eval/gaac_measure.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "codec/gaac.h"
#include "core/status.h"
#include "format/gaac_layout.h"
#include "format/page.h"
#include "format/safetensors.h"

namespace certkv::eval {
namespace {

using codec::GaacCalibration;
using codec::GaacElement;
using codec::GaacShape;
using Tally = GaacTally;

constexpr const char* kKvDumpFormat = "certkv-kv-dump/1";

// ---------------------------------------------------------------------------------------------
// KV dumps.

struct KvDump {
  std::string path;
  std::unique_ptr<format::SafetensorsFile> file;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  int64_t n_tokens = 0;
  std::vector<int> layers;  // dumped layers, ascending

  bool has_layer(int layer) const {
    return std::binary_search(layers.begin(), layers.end(), layer);
  }
  // The bf16 rows of (layer, K/V) as [n_kv_heads][n_tokens][head_dim], copied out of the mapping
  // (safetensors data need not be aligned).
  std::vector<uint16_t> read(int layer, int kv) const {
    const std::string name = "layer" + std::to_string(layer) + (kv == codec::kGaacKey ? ".k" : ".v");
    const format::SafetensorsTensor* t = file->find(name);
    std::vector<uint16_t> out(size_t(n_kv_heads) * size_t(n_tokens) * size_t(head_dim));
    std::memcpy(out.data(), t->data, out.size() * 2);
    return out;
  }
};

int metadata_int(const format::SafetensorsFile& f, const std::string& key, int64_t lo, int64_t hi) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end())
    fail(StatusCode::kCorrupt, "KV dump '" + f.name() + "': metadata has no '" + key + "'");
  char* end = nullptr;
  const long long v = strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || v < lo || v > hi)
    fail(StatusCode::kCorrupt, "KV dump '" + f.name() + "': metadata '" + key + "' = '" +
                                   it->second + "' is not an integer in [" + std::to_string(lo) +
                                   ", " + std::to_string(hi) + "]");
  return int(v);
}

std::string metadata_format(const format::SafetensorsFile& f) {
  auto it = f.metadata().find("format");
  return it == f.metadata().end() ? std::string("(none)") : it->second;
}

KvDump open_kv_dump(std::unique_ptr<format::SafetensorsFile> file) {
  KvDump d;
  d.path = file->name();
  d.file = std::move(file);
  const format::SafetensorsFile& f = *d.file;
  d.n_layers = metadata_int(f, "n_layers", 1, 4096);
  d.n_kv_heads = metadata_int(f, "n_kv_heads", 1, 4096);
  d.head_dim = metadata_int(f, "head_dim", 1, 65536);
  d.n_tokens = metadata_int(f, "n_tokens", 1, int64_t(1) << 31);
  auto it = f.metadata().find("layers");
  if (it == f.metadata().end())
    fail(StatusCode::kCorrupt, "KV dump '" + d.path + "': metadata has no 'layers'");
  std::stringstream ss(it->second);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long v = strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 0 || v >= d.n_layers)
      fail(StatusCode::kCorrupt, "KV dump '" + d.path + "': metadata 'layers' has '" + item +
                                     "', not a layer in [0, " + std::to_string(d.n_layers) + ")");
    d.layers.push_back(int(v));
  }
  std::sort(d.layers.begin(), d.layers.end());
  if (d.layers.empty() || std::adjacent_find(d.layers.begin(), d.layers.end()) != d.layers.end())
    fail(StatusCode::kCorrupt, "KV dump '" + d.path + "': metadata 'layers' is empty or repeats a layer");
  const std::vector<int64_t> want = {d.n_kv_heads, d.n_tokens, d.head_dim};
  for (int layer : d.layers) {
    for (const char* suffix : {".k", ".v"}) {
      const std::string name = "layer" + std::to_string(layer) + suffix;
      const format::SafetensorsTensor* t = f.find(name);
      if (t == nullptr) fail(StatusCode::kCorrupt, "KV dump '" + d.path + "': no tensor '" + name + "'");
      if (t->dtype != "BF16" || t->shape != want)
        fail(StatusCode::kCorrupt, "KV dump '" + d.path + "': tensor '" + name +
                                       "' is not BF16 [n_kv_heads, n_tokens, head_dim] = [" +
                                       std::to_string(d.n_kv_heads) + ", " +
                                       std::to_string(d.n_tokens) + ", " +
                                       std::to_string(d.head_dim) + "]");
    }
  }
  return d;
}

// ---------------------------------------------------------------------------------------------
// Elements: BF16, or BF16 cast to FP8.

GaacElement element_of_codec(const std::string& name) {
  if (name == "gaac") return GaacElement::kBf16;
  if (name == "gaac-e4m3") return GaacElement::kFp8E4M3;
  if (name == "gaac-e5m2") return GaacElement::kFp8E5M2;
  fail(StatusCode::kInvalidArgument, "unknown codec '" + name + "' (available: gaac, gaac-e4m3, gaac-e5m2)");
}

// The coded exponent field of one element (bf16 bits, or an fp8 byte in the low 8 bits).
int exponent_of(GaacElement e, uint16_t x) {
  const int mantissa_bits = format::gaac_sign_mantissa_bits(e) - 1;
  return (x >> mantissa_bits) & ((1 << format::gaac_exponent_bits(e)) - 1);
}

// The KV of one (layer, K/V) in the codec's element: bf16 as is, or cast to fp8 bytes.
struct ElementRows {
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> fp8;
};

// BF16 -> OCP FP8 (E4M3: bias 7, largest 448, no infinities; E5M2: bias 15, largest 57344),
// round to nearest even, finite values beyond the largest saturate to it, NaN stays NaN, E5M2
// keeps infinities. (OCP 8-bit Floating Point Specification, 2023.)
uint8_t fp8_from_bf16(GaacElement e, uint16_t bf16) {
  const int ebits = format::gaac_exponent_bits(e), mbits = format::gaac_sign_mantissa_bits(e) - 1;
  const int bias = (1 << (ebits - 1)) - 1;
  const bool e4m3 = e == GaacElement::kFp8E4M3;
  const int max_exponent_field = e4m3 ? 15 : 30, max_mantissa = e4m3 ? 6 : 3;
  const uint8_t sign = uint8_t((bf16 >> 15) << 7);
  const uint8_t largest = uint8_t(sign | max_exponent_field << mbits | max_mantissa);
  const float f = format::bf16_to_float(bf16);
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  const float a = std::fabs(f);
  if (std::isinf(a)) return e4m3 ? largest : uint8_t(sign | 0x7c);
  if (a == 0.0f) return sign;
  int x = 0;
  std::frexp(a, &x);                           // a = m * 2^x, m in [0.5, 1)
  int exponent = std::max(x - 1, 1 - bias);    // subnormals share the smallest normal's quantum
  float q = std::nearbyint(std::ldexp(a, mbits - exponent));  // exact scaling, ties to even
  if (q >= float(2 << mbits)) q /= 2, exponent += 1;
  const int mantissa_with_lead = int(q);
  const bool subnormal = mantissa_with_lead < (1 << mbits);
  const int field = subnormal ? 0 : exponent + bias;
  const int mantissa = subnormal ? mantissa_with_lead : mantissa_with_lead - (1 << mbits);
  if (field > max_exponent_field || (field == max_exponent_field && mantissa > max_mantissa)) return largest;
  return uint8_t(sign | field << mbits | mantissa);
}

ElementRows to_element(GaacElement e, std::vector<uint16_t> bf16) {
  ElementRows r;
  if (e == GaacElement::kBf16) {
    r.bf16 = std::move(bf16);
  } else {
    r.fp8.resize(bf16.size());
    for (size_t i = 0; i < bf16.size(); ++i) r.fp8[i] = fp8_from_bf16(e, bf16[i]);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Calibration.

GaacShape shape_of(const KvDump& d, int block_tokens, GaacElement e) {
  GaacShape s;
  s.n_layers = d.n_layers;
  s.n_kv_heads = d.n_kv_heads;
  s.head_dim = d.head_dim;
  s.block_tokens = block_tokens;
  s.element = e;
  return s;
}

std::string shape_text(const GaacShape& s) {
  return std::to_string(s.n_layers) + " layers, " + std::to_string(s.n_kv_heads) + " kv heads, head_dim " +
         std::to_string(s.head_dim);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

struct CalibrationSource {
  GaacCalibration calibration;
  std::string description;
  GaacShape shape;
};

// `calib`: a comma list of KV dumps, or one calibration file. `in`: the dump to encode (may be
// null); its shape is the one the calibration must have.
CalibrationSource make_calibration(const std::string& calib, const KvDump* in, int block_tokens,
                                   GaacElement element) {
  const std::vector<std::string> paths = split_commas(calib);
  if (paths.empty()) fail(StatusCode::kInvalidArgument, "calibration: no file given");
  std::vector<std::unique_ptr<format::SafetensorsFile>> files;
  for (const std::string& p : paths) files.push_back(format::SafetensorsFile::open(p));
  const std::string first_format = metadata_format(*files[0]);
  // Any version of the calibration format goes to the loader, which names the version it reads.
  const std::string family = std::string(GaacCalibration::kFormat).substr(0, std::string(GaacCalibration::kFormat).find('/') + 1);
  if (first_format.rfind(family, 0) == 0) {
    if (paths.size() != 1)
      fail(StatusCode::kInvalidArgument, "calibration: give one calibration file, or KV dumps only");
    if (in == nullptr)
      fail(StatusCode::kInvalidArgument, "calibration '" + paths[0] + "' is already a calibration; give a KV dump to encode with it");
    const GaacShape expected = shape_of(*in, block_tokens, element);
    return {GaacCalibration::load(paths[0], expected), "calibration file " + paths[0], expected};
  }
  std::vector<KvDump> dumps;
  for (auto& f : files) {
    const std::string fmt = metadata_format(*f);
    if (fmt != kKvDumpFormat)
      fail(StatusCode::kInvalidArgument,
           "calibration source '" + f->name() + "' is neither a KV dump (" + kKvDumpFormat +
               ") nor a GAAC calibration (" + GaacCalibration::kFormat + "): metadata format is '" +
               fmt + "'");
    dumps.push_back(open_kv_dump(std::move(f)));
  }
  const GaacShape shape = shape_of(in != nullptr ? *in : dumps[0], block_tokens, element);
  for (const KvDump& d : dumps) {
    const GaacShape s = shape_of(d, block_tokens, element);
    if (!(s == shape))
      fail(StatusCode::kInvalidArgument,
           "calibration dump '" + d.path + "' has " + shape_text(s) + " but " +
               (in != nullptr ? "KV dump '" + in->path + "'" : "'" + dumps[0].path + "'") + " has " +
               shape_text(shape) + ": a calibration of another model");
    if (in != nullptr)
      for (int layer : in->layers)
        if (!d.has_layer(layer))
          fail(StatusCode::kInvalidArgument, "calibration dump '" + d.path + "' lacks layer " +
                                                 std::to_string(layer) + " of '" + in->path + "'");
  }
  codec::GaacCalibrator calibrator(shape);
  int64_t tokens = 0;
  for (const KvDump& d : dumps) {
    tokens += d.n_tokens;
    for (int layer : d.layers) {
      for (int kv = 0; kv < 2; ++kv) {
        const ElementRows rows = to_element(element, d.read(layer, kv));
        const size_t head_elems = size_t(d.n_tokens) * size_t(d.head_dim);
        for (int h = 0; h < d.n_kv_heads; ++h) {
          if (element == GaacElement::kBf16)
            calibrator.add_bf16(layer, kv, h, rows.bf16.data() + h * head_elems, int(d.n_tokens));
          else
            calibrator.add_fp8(layer, kv, h, rows.fp8.data() + h * head_elems, int(d.n_tokens));
        }
      }
    }
  }
  std::string description = std::to_string(dumps.size()) + " KV dump" + (dumps.size() > 1 ? "s" : "") +
                            " (" + std::to_string(tokens) + " tokens)";
  return {calibrator.finish(), description, shape};
}

// ---------------------------------------------------------------------------------------------
// Encoding, decoding and accounting.

struct Options {
  GaacElement element = GaacElement::kBf16;
  codec::GaacKernel kernel = codec::GaacKernel::kRef;
  int block_tokens = 16;
  int passes = 3;
  int segment_tokens = 1024;
  bool cross_check_ref = false;
};

// CPU time of the calling thread: the codec speeds are per core, and this machine may be shared.
double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Encodes, decodes and checks every page of one (layer, K/V). `rows`: [n_kv_heads][n_tokens]
// [head_dim] elements. Adds per-position-segment figures to `segments` (grown as needed).
Tally code_layer_kv(const Options& opt, const GaacCalibration& cal, int layer, int kv,
                    const KvDump& in, const ElementRows& rows, std::vector<Tally>& segments) {
  const GaacElement e = opt.element;
  const int bt = opt.block_tokens, hd = in.head_dim, n_heads = in.n_kv_heads;
  const int64_t n_tokens = in.n_tokens;
  const bool bf16 = e == GaacElement::kBf16;
  const size_t elem_bytes = size_t(format::gaac_element_bytes(e));
  const size_t page_elems = size_t(bt) * size_t(hd);
  const size_t raw_bytes = format::gaac_page_raw_bytes(e, bt, hd);
  const size_t capacity = cal.escape_capacity_bytes(layer, kv);
  const size_t slot_bytes = cal.slot_bytes(layer, kv);
  const size_t max_escape = format::gaac_page_max_escape_bytes(e, bt, hd);
  const int64_t pages_per_head = n_tokens / bt;
  const size_t n_pages = size_t(pages_per_head) * size_t(n_heads);
  const size_t head_elems = size_t(n_tokens) * size_t(hd);
  auto src = [&](size_t i) -> const uint8_t* {  // page i = (head i / pages_per_head, block i % ...)
    const size_t h = i / size_t(pages_per_head), p = i % size_t(pages_per_head);
    const size_t off = h * head_elems + p * page_elems;
    return bf16 ? reinterpret_cast<const uint8_t*>(rows.bf16.data() + off) : rows.fp8.data() + off;
  };
  auto bases = [&](size_t i) -> const codec::GaacBases& {
    return cal.bases(layer, kv, int(i / size_t(pages_per_head)));
  };
  auto encode = [&](size_t i, size_t cap, uint8_t* out, bool ref) -> size_t {
    if (bf16) {
      const auto* p = reinterpret_cast<const uint16_t*>(src(i));
      return ref ? codec::gaac_encode_page_ref(p, bt, hd, bases(i), cap, out)
                 : codec::gaac_encode_page(p, bt, hd, bases(i), cap, out, opt.kernel);
    }
    return codec::gaac_encode_page_fp8_ref(e, src(i), bt, hd, bases(i), cap, out);
  };
  auto decode = [&](size_t i, const uint8_t* slot, uint8_t* out, bool ref) {
    if (bf16) {
      auto* o = reinterpret_cast<uint16_t*>(out);
      if (ref)
        codec::gaac_decode_page_ref(slot, slot_bytes, bt, hd, bases(i), o);
      else
        codec::gaac_decode_page(slot, slot_bytes, bt, hd, bases(i), o, opt.kernel);
    } else {
      codec::gaac_decode_page_fp8_ref(e, slot, slot_bytes, bt, hd, bases(i), out);
    }
  };
  auto where = [&](size_t i) {
    return "layer " + std::to_string(layer) + (kv == codec::kGaacKey ? " K" : " V") + " kv_head " +
           std::to_string(i / size_t(pages_per_head)) + " block " + std::to_string(i % size_t(pages_per_head));
  };

  std::vector<uint8_t> slots(n_pages * slot_bytes), raw(n_pages * raw_bytes), decoded(n_pages * raw_bytes);
  std::vector<uint8_t> fits(n_pages);
  Tally t;
  // Timed passes: the fastest counts. A page that does not fit is copied to raw storage, as the
  // cache would; decoding copies it back.
  double best_encode = INFINITY, best_decode = INFINITY;
  for (int pass = 0; pass < opt.passes; ++pass) {
    double t0 = thread_cpu_seconds();
    for (size_t i = 0; i < n_pages; ++i) {
      const size_t used = encode(i, capacity, slots.data() + i * slot_bytes, false);
      fits[i] = used != codec::kGaacDoesNotFit;
      if (!fits[i]) std::memcpy(raw.data() + i * raw_bytes, src(i), raw_bytes);
    }
    best_encode = std::min(best_encode, thread_cpu_seconds() - t0);
    t0 = thread_cpu_seconds();
    for (size_t i = 0; i < n_pages; ++i) {
      if (fits[i])
        decode(i, slots.data() + i * slot_bytes, decoded.data() + i * raw_bytes, false);
      else
        std::memcpy(decoded.data() + i * raw_bytes, raw.data() + i * raw_bytes, raw_bytes);
    }
    best_decode = std::min(best_decode, thread_cpu_seconds() - t0);
  }
  if (n_pages > 0) {
    t.encode_seconds = best_encode;
    t.decode_seconds = best_decode;
  }
  t.coded_bytes = n_pages * raw_bytes;

  std::vector<uint8_t> scratch(format::gaac_slot_bytes(e, bt, hd, max_escape));
  std::vector<uint8_t> scratch_out(raw_bytes);
  auto failed = [&](size_t i, const std::string& what) {
    if (t.failed_pages++ == 0) t.first_failure = where(i) + ": " + what;
  };
  for (size_t i = 0; i < n_pages; ++i) {
    if (std::memcmp(decoded.data() + i * raw_bytes, src(i), raw_bytes) != 0)
      failed(i, "did not decode to its original bytes");
    if (opt.cross_check_ref) {
      const size_t used = encode(i, capacity, scratch.data(), true);
      if ((used != codec::kGaacDoesNotFit) != bool(fits[i]) ||
          (fits[i] && std::memcmp(scratch.data(), slots.data() + i * slot_bytes, used) != 0))
        failed(i, std::string("the _ref encoder and the ") + codec::gaac_kernel_name(opt.kernel) +
                      " encoder disagree");
      if (fits[i]) {
        decode(i, slots.data() + i * slot_bytes, scratch_out.data(), true);
        if (std::memcmp(scratch_out.data(), src(i), raw_bytes) != 0)
          failed(i, "the _ref decoder did not return the original bytes");
      }
    }
    // The mode mix is the codec's choice for every page, fitting or not: a page that does not
    // fit is encoded again with room for every escape to read its tags.
    const uint8_t* slot = slots.data() + i * slot_bytes;
    size_t this_slot_bytes = slot_bytes;
    if (!fits[i]) {
      encode(i, max_escape, scratch.data(), false);
      slot = scratch.data();
      this_slot_bytes = scratch.size();
    }
    const codec::GaacModeCounts mc = codec::gaac_count_modes(e, slot, this_slot_bytes, bt, hd);
    const size_t block = i % size_t(pages_per_head);
    const size_t seg = block * size_t(bt) / size_t(opt.segment_tokens);
    if (segments.size() <= seg) segments.resize(seg + 1);
    for (Tally* x : {&t, &segments[seg]}) {
      x->pages += 1;
      x->raw_pages += fits[i] ? 0 : 1;
      for (int m = 0; m < 3; ++m) x->groups[m] += mc.groups[m];
      x->escape_bytes += mc.escape_bytes;
      x->content_bytes += format::gaac_page_fixed_bytes(e, bt, hd) + mc.escape_bytes;
      x->content_bf16_bytes += page_elems * 2;
    }
  }

  // Exponent histogram over every element (the tail included).
  const size_t total_elems = size_t(n_heads) * head_elems;
  for (size_t j = 0; j < total_elems; ++j) {
    const uint16_t x = bf16 ? rows.bf16[j] : rows.fp8[j];
    t.exponent_histogram[exponent_of(e, x)] += 1;
  }
  // Stored bytes: a slot per fitting page, raw bytes per fallback page, the incomplete tail block
  // raw, a block-table entry per block, and this (layer, K/V)'s bases (b3 and b4, one byte per
  // channel each) and escape capacity (8 bytes).
  const int64_t tail_tokens = n_tokens - pages_per_head * bt;
  const uint64_t fitting = n_pages - t.raw_pages;
  const uint64_t blocks = uint64_t(n_heads) * uint64_t(pages_per_head + (tail_tokens > 0 ? 1 : 0));
  t.stored_bytes = fitting * slot_bytes + t.raw_pages * raw_bytes +
                   uint64_t(n_heads) * uint64_t(tail_tokens) * uint64_t(hd) * elem_bytes +
                   blocks * sizeof(format::PageRef) + uint64_t(n_heads) * uint64_t(hd) * 2 + 8;
  t.elements = total_elems;
  t.bf16_bytes = total_elems * 2;
  t.element_bytes = total_elems * elem_bytes;
  return t;
}

}  // namespace

GaacMeasurement measure_gaac(const GaacMeasureParams& params) {
  if (params.block_tokens < 1 || params.passes < 1 || params.segment_tokens < 1)
    fail(StatusCode::kInvalidArgument, "GAAC measurement: block_tokens " + std::to_string(params.block_tokens) +
                                           ", passes " + std::to_string(params.passes) + " and segment_tokens " +
                                           std::to_string(params.segment_tokens) + " must be >= 1");
  if (params.in.empty() && params.save_calibration.empty())
    fail(StatusCode::kInvalidArgument, "GAAC measurement: give a KV dump to encode or a path to save the "
                                       "calibration to (or both)");
  Options opt;
  opt.element = element_of_codec(params.codec);
  opt.block_tokens = params.block_tokens;
  opt.passes = params.passes;
  opt.segment_tokens = params.segment_tokens;
  opt.cross_check_ref = params.cross_check_ref;
  opt.kernel = opt.element == GaacElement::kBf16 ? codec::gaac_best_kernel() : codec::GaacKernel::kRef;

  std::unique_ptr<KvDump> in;
  if (!params.in.empty()) {
    auto file = format::SafetensorsFile::open(params.in);
    const std::string fmt = metadata_format(*file);
    if (fmt != kKvDumpFormat)
      fail(StatusCode::kInvalidArgument, "'" + params.in + "' (to encode) is not a KV dump: metadata format is '" +
                                             fmt + "', expected '" + kKvDumpFormat + "'");
    in = std::make_unique<KvDump>(open_kv_dump(std::move(file)));
    if (format::gaac_tile_channels(in->head_dim) == 0)
      fail(StatusCode::kUnsupported, "KV dump '" + in->path + "': head_dim " + std::to_string(in->head_dim) +
                                         " does not split into GAAC tiles (multiples of 8, at most 128)");
  }

  GaacMeasurement m;
  m.codec = params.codec;
  m.element = codec::gaac_element_name(opt.element);
  m.kernel = codec::gaac_kernel_name(opt.kernel);
  m.block_tokens = opt.block_tokens;
  m.segment_tokens = opt.segment_tokens;
  m.cross_check_ref = opt.cross_check_ref;
  const auto calibrate_start = std::chrono::steady_clock::now();
  CalibrationSource source = make_calibration(params.calibration, in.get(), opt.block_tokens, opt.element);
  m.calibrate_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - calibrate_start).count();
  m.calibration_description = source.description;
  if (!params.save_calibration.empty()) source.calibration.save(params.save_calibration);
  if (!in) return m;

  m.encoded = true;
  m.in = in->path;
  m.n_kv_heads = in->n_kv_heads;
  m.head_dim = in->head_dim;
  m.n_tokens = in->n_tokens;
  for (int layer : in->layers) {
    GaacLayerTally& l = m.layers.emplace_back();
    l.layer = layer;
    for (int kv = 0; kv < 2; ++kv) {
      const ElementRows rows = to_element(opt.element, in->read(layer, kv));
      const Tally t = code_layer_kv(opt, source.calibration, layer, kv, *in, rows, m.segments[kv]);
      (kv == 0 ? l.k : l.v) = t;
      (kv == 0 ? l.k_escape_capacity_bytes : l.v_escape_capacity_bytes) =
          source.calibration.escape_capacity_bytes(layer, kv);
      m.by_kv[kv].add(t);
      m.total.add(t);
    }
  }
  // Both segment lists cover the same positions.
  const size_t n_segments = std::max(m.segments[0].size(), m.segments[1].size());
  m.segments[0].resize(n_segments);
  m.segments[1].resize(n_segments);
  return m;
}

}  // namespace certkv::eval
