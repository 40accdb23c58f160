// The C API's lossy page codecs (certkv_lossy_*): one page of one (layer, K/V, kv_head) stream at
// a time through codec/lossy_page.h, with the spec a KV store's layer cache would give the page
// (cache/kv_scheme.h's witness rule, codec::dither8_key's dither key), for front ends that hold
// KV rows themselves (the Python package's certkv.codec and torch operators).
#include <string>

#include "api/api_status.h"
#include "backend/cuda/device_page_codecs.h"
#include "cache/kv_scheme.h"
#include "certkv/certkv.h"
#include "codec/lossy_page.h"
#include "core/status.h"

namespace cache = certkv::cache;
namespace codec = certkv::codec;
using certkv::api::guarded;

namespace {

// The codec's page spec; throws certkv::Error naming the field (kInvalidArgument, kUnsupported).
codec::LossyPageSpec spec_of(const char* where, const certkv_lossy_page_codec& c) {
  const std::string w = where;
  const std::string kv = c.kv ? c.kv : "(null)";
  cache::KvScheme scheme;
  try {
    scheme = cache::parse_kv_scheme(kv);
  } catch (const certkv::Error& e) {
    certkv::fail(certkv::StatusCode::kInvalidArgument, w + ": kv: " + e.what());
  }
  if (!cache::kv_scheme_is_lossy(scheme))
    certkv::fail(certkv::StatusCode::kInvalidArgument,
                 w + ": kv " + kv + " is not a lossy scheme (" + cache::kv_scheme_names([](const cache::KvSchemeInfo& i) { return i.lossy; }) + " are)");
  codec::LossyPageSpec spec;
  spec.scheme = cache::kv_scheme_lossy(scheme);
  spec.key = c.key != 0;
  spec.block_tokens = c.block_tokens;
  spec.head_dim = c.head_dim;
  if (c.rope_layout != nullptr && !codec::parse_rope_pairing(c.rope_layout, &spec.pairing))
    certkv::fail(certkv::StatusCode::kInvalidArgument,
                 w + ": rope_layout '" + c.rope_layout + "' is not interleaved or half-split");
  spec.witness = cache::resolve_kv_witness(scheme, c.witness, w + ": witness");
  if (c.n_outlier_pairs < 0)
    certkv::fail(certkv::StatusCode::kInvalidArgument, w + ": n_outlier_pairs is negative");
  if (c.n_outlier_pairs > 0 && c.outlier_pairs == nullptr)
    certkv::fail(certkv::StatusCode::kInvalidArgument, w + ": null outlier_pairs");
  spec.n_outlier_pairs = c.n_outlier_pairs;
  spec.outlier_pairs = c.outlier_pairs;
  if (spec.scheme == codec::LossyScheme::kDither8) spec.dither_key = codec::dither8_key(c.layer, spec.key, c.kv_head);
  codec::validate_lossy_page_spec(spec);
  return spec;
}

}  // namespace

extern "C" {

certkv_status certkv_lossy_page_bytes(const certkv_lossy_page_codec* codec, size_t* page_bytes) {
  CERTKV_REQUIRE(codec && page_bytes, "certkv_lossy_page_bytes: null argument");
  return guarded([&] { *page_bytes = codec::lossy_page_bytes(spec_of("certkv_lossy_page_bytes", *codec)); });
}

certkv_status certkv_lossy_encode_page(const certkv_lossy_page_codec* codec, uint32_t block, const uint16_t* rows,
                                       uint8_t* page, int* encoded) {
  CERTKV_REQUIRE(codec && rows && page && encoded, "certkv_lossy_encode_page: null argument");
  return guarded([&] {
    *encoded = codec::lossy_encode_page(spec_of("certkv_lossy_encode_page", *codec), block, rows, page) ? 1 : 0;
  });
}

certkv_status certkv_lossy_decode_page(const certkv_lossy_page_codec* codec, uint32_t block, const uint8_t* page,
                                       float* out) {
  CERTKV_REQUIRE(codec && page && out, "certkv_lossy_decode_page: null argument");
  return guarded([&] { codec::lossy_decode_page(spec_of("certkv_lossy_decode_page", *codec), block, page, out); });
}

certkv_status certkv_lossy_encode_pages_device(const certkv_lossy_page_codec* codec, uint32_t first_block,
                                               const uint16_t* pages, int64_t n_pages, uint8_t* out, uint8_t* encoded,
                                               void* cuda_stream) {
  const char* where = "certkv_lossy_encode_pages_device";
  CERTKV_REQUIRE(codec, std::string(where) + ": null codec");
  CERTKV_REQUIRE(n_pages >= 0, std::string(where) + ": n_pages " + std::to_string(n_pages) + " is negative");
  CERTKV_REQUIRE(n_pages == 0 || (pages && out && encoded), std::string(where) + ": null pages, out or encoded");
  return guarded([&] {
    const codec::LossyPageSpec spec = spec_of(where, *codec);
    // The device encodes the schemes the table routes to it (checked here, where every build can).
    const cache::KvSchemeInfo& info = cache::kv_scheme_info(cache::parse_kv_scheme(codec->kv));
    if (!info.cuda_route)
      certkv::fail(certkv::StatusCode::kUnsupported,
                   std::string(where) + ": " + info.name + " pages are encoded on the host only (the device encodes " +
                       cache::kv_scheme_names([](const cache::KvSchemeInfo& i) { return i.cuda_route && i.lossy; }) +
                       ")");
    if (n_pages == 0) return;  // nothing to launch, in any build
    certkv::backend::cuda::encode_lossy_pages_on_device(spec, first_block, pages, n_pages, out, encoded, cuda_stream);
  });
}

}  // extern "C"
