// GAAC measured on real KV dumps (docs/format/kv_dump.md): calibrates on some dumps (or loads a
// saved calibration), encodes every page of another dump, checks the bit-exact round trip and
// tallies the stored size, the mode mix and the codec speed (docs/gaac.md). What `certkv codec`
// reports, through the C API's certkv_gaac_measure.
// Thread safety: measure_gaac is reentrant; it times the codec with the calling thread's CPU time.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace certkv::eval {

// The figures of a set of pages: one (layer, K/V), a whole dump, or a position segment.
struct GaacTally {
  uint64_t bf16_bytes = 0;     // the KV as BF16
  uint64_t element_bytes = 0;  // the KV in the codec's element, raw (== bf16_bytes for gaac)
  uint64_t stored_bytes = 0;   // slots, raw fallbacks, raw tail, block-table entries, bases
  uint64_t elements = 0;
  uint64_t pages = 0, raw_pages = 0;
  uint64_t groups[3] = {0, 0, 0};
  uint64_t escape_bytes = 0;   // escape bytes the pages need (fitting or not)
  // Every complete page at its exact encoded size (fixed part + the escapes it needs), without
  // slots, raw fallbacks, block table or bases: the seed's compression ratio.
  uint64_t content_bytes = 0, content_bf16_bytes = 0;
  uint64_t exponent_histogram[256] = {};
  double encode_seconds = 0, decode_seconds = 0;
  uint64_t coded_bytes = 0;    // element bytes that went through the timed encode and decode
  uint64_t failed_pages = 0;   // pages that did not come back bit for bit (or where _ref disagrees)
  std::string first_failure;

  void add(const GaacTally& o) {
    bf16_bytes += o.bf16_bytes;
    element_bytes += o.element_bytes;
    stored_bytes += o.stored_bytes;
    elements += o.elements;
    pages += o.pages;
    raw_pages += o.raw_pages;
    for (int m = 0; m < 3; ++m) groups[m] += o.groups[m];
    escape_bytes += o.escape_bytes;
    content_bytes += o.content_bytes;
    content_bf16_bytes += o.content_bf16_bytes;
    for (int i = 0; i < 256; ++i) exponent_histogram[i] += o.exponent_histogram[i];
    encode_seconds += o.encode_seconds;
    decode_seconds += o.decode_seconds;
    coded_bytes += o.coded_bytes;
    failed_pages += o.failed_pages;
    if (first_failure.empty()) first_failure = o.first_failure;
  }
  double ratio() const { return stored_bytes ? double(bf16_bytes) / double(stored_bytes) : 0.0; }
  double content_ratio() const {
    return content_bytes ? double(content_bf16_bytes) / double(content_bytes) : 0.0;
  }
  double bits_per_element() const { return elements ? 8.0 * double(stored_bytes) / double(elements) : 0.0; }
  uint64_t total_groups() const { return groups[0] + groups[1] + groups[2]; }
  double mode_fraction(int m) const {
    return total_groups() ? double(groups[m]) / double(total_groups()) : 0.0;
  }
  double raw_block_fraction() const { return pages ? double(raw_pages) / double(pages) : 0.0; }
  // Empirical entropy of the exponent stream (Shannon, bits per element).
  double exponent_entropy_bits() const {
    uint64_t n = 0;
    for (uint64_t c : exponent_histogram) n += c;
    double h = 0;
    for (uint64_t c : exponent_histogram)
      if (c) h -= double(c) / double(n) * std::log2(double(c) / double(n));
    return h;
  }
  double encode_gbps() const { return encode_seconds > 0 ? coded_bytes / encode_seconds / 1e9 : 0.0; }
  double decode_gbps() const { return decode_seconds > 0 ? coded_bytes / decode_seconds / 1e9 : 0.0; }
  double escape_bytes_per_page() const { return pages ? double(escape_bytes) / double(pages) : 0.0; }
};

struct GaacMeasureParams {
  std::string codec = "gaac";    // "gaac", "gaac-e4m3", "gaac-e5m2"
  std::string calibration;       // comma list of KV dumps, or one saved calibration file
  std::string in;                // the KV dump to encode; empty: calibrate only
  std::string save_calibration;  // where to write the calibration; empty: nowhere
  int block_tokens = 16;
  int passes = 3;                // timed encode/decode passes; the fastest counts
  int segment_tokens = 1024;     // position segment of the drift breakdown
  bool cross_check_ref = false;  // also run the _ref encoder and decoder on every page
};

struct GaacLayerTally {
  int layer = 0;
  GaacTally k, v;
  size_t k_escape_capacity_bytes = 0, v_escape_capacity_bytes = 0;
};

struct GaacMeasurement {
  std::string codec, element, kernel;
  std::string calibration_description;  // "2 KV dumps (2048 tokens)" or "calibration file PATH"
  double calibrate_seconds = 0;
  bool encoded = false;                 // false: calibrated only (no `in`)
  std::string in;
  int n_kv_heads = 0, head_dim = 0;
  int64_t n_tokens = 0;
  int block_tokens = 0, segment_tokens = 0;
  bool cross_check_ref = false;
  GaacTally total, by_kv[2];            // by_kv[0]: K, by_kv[1]: V
  std::vector<GaacLayerTally> layers;   // the dump's layers, ascending
  std::vector<GaacTally> segments[2];   // [K/V][position segment]
};

// Throws certkv::Error: kInvalidArgument for an unknown codec, no calibration source, a
// calibration of another shape or element, a file that is neither a KV dump nor a calibration,
// block_tokens, passes or segment_tokens below 1, neither `in` nor `save_calibration`;
// kCorrupt / kNotFound / kIo from the files (the message names the file); kUnsupported for a
// head_dim that does not split into GAAC tiles. A page that does not round-trip is not an error:
// total.failed_pages counts it and total.first_failure names the first.
GaacMeasurement measure_gaac(const GaacMeasureParams& params);

}  // namespace certkv::eval
