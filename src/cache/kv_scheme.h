// The KV scheme table: one record per way the cache can store complete blocks, read by every
// layer that needs to know what a scheme is (the cache, the backends and the device route, the C
// API, the CLI's validation and help). A new scheme is one entry here.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "codec/lossy_page.h"
#include "format/gaac_layout.h"
#include "format/page.h"

namespace certkv::cache {

enum class KvScheme : int {
  kBf16 = 0,
  kGaac = 1,
  kFp8PagesE4M3 = 2,  // every page raw FP8 (the uncoded counterpart of gaac-e4m3); no meter
  kFp8PagesE5M2 = 3,
  kGaacE4M3 = 4,
  kGaacE5M2 = 5,
  // Lossy schemes (codec/lossy_page.h): bf16 tails, full blocks in lossy pages of their class,
  // the exact blocks in the backing store, the meter's side data in each page.
  kFp8E4M3 = 6,
  kFp8E5M2 = 7,
  kFp8E4M3Scaled = 8,
  kRtn8 = 9,
  kRtn4 = 10,
  kKivi2 = 11,
  kDither8 = 12,
};
inline constexpr int kNumKvSchemes = 13;

// Which bound the meter of a scheme's pages is (DESIGN.md section 4).
enum class MeterTier : uint8_t {
  kNone = 0,  // no meter: lossless, or an unmetered cast (fp8-*-pages)
  kA = 1,     // the witness bound, valid for any query
  kB = 2,     // the dither8 certificate, valid for non-adaptive queries
};

struct KvSchemeInfo {
  KvScheme scheme;
  const char* name;     // what --kv and certkv_session_params.kv take
  const char* summary;  // one line for the CLI's help
  format::GaacElement element;       // of raw pages (every page, or the tails and fallbacks)
  format::StorageClass full_blocks;  // the class a complete block goes to
  bool lossless;  // every bf16 bit written is read back
  bool gaac;      // complete blocks GAAC-coded: needs the model's calibration of `element`
  bool lossy;     // complete blocks quantized, their exact copies in the backing store
  codec::LossyScheme lossy_codec;  // the page codec (lossy schemes)
  MeterTier tier;
  int default_window_tokens;  // lossy: newest tokens kept bf16 unless configured
  bool cuda_route;            // the CUDA device route serves it (model/device_decode.h)
  // A sequence's logits do not depend on which other sequences share the pool. dither8 holds
  // it with its outlier pairs fixed for the model (BackendConfig::outlier_pair_table, which the
  // engine sets); its dither is keyed by the block's position (docs/format/dither8.md).
  bool batch_invariant;
  // The device's sparse decode reads its pages (attention/cuda/sparse_decode_cuda.h gathers rows
  // of raw bf16 pages): sparse decode on the cuda backend and the device route takes these only.
  bool cuda_sparse;
  // The device stores the scheme's pages fragment-major (format/fragment_layout.h): raw bf16 pages
  // (tails, exact pages) in the mma operand order from append on, and a complete block's pages
  // transcoded when the device encoder finalizes it. The one place that decides it: the device KV
  // cache writes these pages and attention::cuda::page_format_of names their PageFormat from it.
  bool cuda_fragment_pages;
  // Tier A schemes: the witness K pages keep when none is asked for (certkv_session_params.witness
  // null); kFp16 for the others, which keep none.
  codec::WitnessCode default_witness;
};

// Every scheme, in KvScheme order.
std::span<const KvSchemeInfo> kv_schemes();
// REQUIRES: a KvScheme value (certkv::Error kInvalidArgument otherwise).
const KvSchemeInfo& kv_scheme_info(KvScheme scheme);
// Throws certkv::Error kInvalidArgument naming the unknown scheme and the known ones.
KvScheme parse_kv_scheme(std::string_view name);
// "a, b, c" of the schemes whose `pick` is true, in table order.
std::string kv_scheme_names(bool (*pick)(const KvSchemeInfo&));

inline const char* kv_scheme_name(KvScheme scheme) { return kv_scheme_info(scheme).name; }
inline bool kv_scheme_is_gaac(KvScheme scheme) { return kv_scheme_info(scheme).gaac; }
inline bool kv_scheme_is_lossy(KvScheme scheme) { return kv_scheme_info(scheme).lossy; }
inline format::GaacElement kv_scheme_element(KvScheme scheme) { return kv_scheme_info(scheme).element; }
// The codec scheme of a lossy KV scheme. REQUIRES: kv_scheme_is_lossy(scheme) (certkv::Error).
codec::LossyScheme kv_scheme_lossy(KvScheme scheme);
// Whether a scheme's K pages can keep `witness`: the Tier A schemes, each the witness codes its
// codec supports soundly (codec::lossy_witness_supported: the exponent witness only for fp8-e4m3).
bool kv_scheme_takes_witness(KvScheme scheme, codec::WitnessCode witness);
// Throws certkv::Error kInvalidArgument naming the scheme and the witness (and the schemes that
// take it) when !kv_scheme_takes_witness(scheme, witness); the one check of every front end, the
// C API and the cache. `field` names what was set ("config.witness", "certkv_session_params.witness").
void check_kv_witness(KvScheme scheme, codec::WitnessCode witness, std::string_view field);
// The witness a scheme's K pages keep: `name` when given (null: the scheme's default_witness).
// Throws as check_kv_witness, and kInvalidArgument for a name that is no witness code (naming the
// known ones).
codec::WitnessCode resolve_kv_witness(KvScheme scheme, const char* name, std::string_view field);
// Whether the device stores a scheme's pages fragment-major (format/fragment_layout.h) when its K
// pages keep `witness` (the witness is read for the Tier A schemes only): the table's
// cuda_fragment_pages, or fp8-e4m3 with the exponent witness, whose K pages are the codes alone
// (the fragment kernel's zero-byte meter reads them). The one place the device's byte order is
// decided: the device KV cache writes these pages, attention::cuda::page_format_of names their
// PageFormat.
bool kv_scheme_device_fragment_pages(KvScheme scheme, codec::WitnessCode witness);

}  // namespace certkv::cache
