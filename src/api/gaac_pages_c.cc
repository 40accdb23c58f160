// The C API's GAAC page codec: calibration, encoding and decoding of single pages of one stream
// (codec/gaac.h), and encoding of many pages in CUDA device memory (backend/cuda/
// device_page_codecs.h), for front ends that hold KV rows themselves (the Python package's
// certkv.codec and torch operators).
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "api/api_status.h"
#include "backend/cuda/device_page_codecs.h"
#include "certkv/certkv.h"
#include "codec/gaac.h"

using certkv::api::guarded;
using certkv::api::set_error;
using certkv::codec::GaacBases;
using certkv::codec::GaacElement;

namespace {

// The element named by `name` ("bf16", "e4m3", "e5m2"); false for another name or null.
bool parse_element(const char* name, GaacElement* element) {
  if (name == nullptr) return false;
  for (GaacElement e : {GaacElement::kBf16, GaacElement::kFp8E4M3, GaacElement::kFp8E5M2})
    if (std::strcmp(name, certkv::codec::gaac_element_name(e)) == 0) {
      *element = e;
      return true;
    }
  return false;
}

std::string element_error(const char* where, const char* name) {
  return std::string(where) + ": element '" + (name ? name : "(null)") +
         "' is not bf16, e4m3 or e5m2";
}

std::string shape_error(const char* where, int32_t block_tokens, int32_t head_dim) {
  if (block_tokens < 1) return std::string(where) + ": block_tokens " + std::to_string(block_tokens) + " is below 1";
  return std::string(where) + ": head_dim " + std::to_string(head_dim) +
         " is not one GAAC tiles (a multiple of 8 splitting into equal tiles of at most 128)";
}

bool shape_ok(int32_t block_tokens, int32_t head_dim) {
  return block_tokens >= 1 && certkv::format::gaac_tile_channels(head_dim) != 0;
}

// The codec's element and bases, checked; fails with a message naming the function.
certkv_status read_codec(const char* where, const certkv_gaac_page_codec* codec, GaacElement* element,
                         GaacBases* bases) {
  CERTKV_REQUIRE(codec != nullptr, std::string(where) + ": null codec");
  CERTKV_REQUIRE(parse_element(codec->element, element), element_error(where, codec->element));
  CERTKV_REQUIRE(shape_ok(codec->block_tokens, codec->head_dim),
                 shape_error(where, codec->block_tokens, codec->head_dim));
  CERTKV_REQUIRE(codec->b3 != nullptr && codec->b4 != nullptr, std::string(where) + ": null b3 or b4");
  const size_t d = size_t(codec->head_dim);
  bases->b3.assign(codec->b3, codec->b3 + d);
  bases->b4.assign(codec->b4, codec->b4 + d);
  return CERTKV_OK;
}

}  // namespace

extern "C" {

certkv_status certkv_gaac_calibrate(const char* element, int32_t block_tokens, int32_t head_dim,
                                    const void* rows, int64_t n_tokens, uint8_t* b3, uint8_t* b4,
                                    uint64_t* escape_capacity_bytes) {
  const char* where = "certkv_gaac_calibrate";
  GaacElement e;
  CERTKV_REQUIRE(parse_element(element, &e), element_error(where, element));
  CERTKV_REQUIRE(shape_ok(block_tokens, head_dim), shape_error(where, block_tokens, head_dim));
  CERTKV_REQUIRE(n_tokens >= 1 && n_tokens <= INT_MAX,
                 std::string(where) + ": n_tokens " + std::to_string(n_tokens) + " is not in [1, 2^31)");
  CERTKV_REQUIRE(rows && b3 && b4 && escape_capacity_bytes, std::string(where) + ": null argument");
  return guarded([&] {
    certkv::codec::GaacShape shape;
    shape.n_layers = 1;
    shape.n_kv_heads = 1;
    shape.head_dim = head_dim;
    shape.block_tokens = block_tokens;
    shape.element = e;
    certkv::codec::GaacCalibrator calibrator(shape);
    if (e == GaacElement::kBf16)
      calibrator.add_bf16(0, certkv::codec::kGaacKey, 0, static_cast<const uint16_t*>(rows), int(n_tokens));
    else
      calibrator.add_fp8(0, certkv::codec::kGaacKey, 0, static_cast<const uint8_t*>(rows), int(n_tokens));
    const certkv::codec::GaacCalibration calibration = calibrator.finish();
    const GaacBases& bases = calibration.bases(0, certkv::codec::kGaacKey, 0);
    std::memcpy(b3, bases.b3.data(), size_t(head_dim));
    std::memcpy(b4, bases.b4.data(), size_t(head_dim));
    *escape_capacity_bytes = calibration.escape_capacity_bytes(0, certkv::codec::kGaacKey);
  });
}

certkv_status certkv_gaac_slot_bytes(const certkv_gaac_page_codec* codec, size_t* slot_bytes) {
  GaacElement e;
  GaacBases bases;
  if (const certkv_status s = read_codec("certkv_gaac_slot_bytes", codec, &e, &bases); s != CERTKV_OK) return s;
  CERTKV_REQUIRE(slot_bytes != nullptr, "certkv_gaac_slot_bytes: null slot_bytes");
  *slot_bytes = certkv::format::gaac_slot_bytes(e, codec->block_tokens, codec->head_dim,
                                                size_t(codec->escape_capacity_bytes));
  return CERTKV_OK;
}

certkv_status certkv_gaac_encode_page(const certkv_gaac_page_codec* codec, const void* page,
                                      uint8_t* slot, size_t* used_bytes) {
  GaacElement e;
  GaacBases bases;
  if (const certkv_status s = read_codec("certkv_gaac_encode_page", codec, &e, &bases); s != CERTKV_OK) return s;
  CERTKV_REQUIRE(page && slot && used_bytes, "certkv_gaac_encode_page: null argument");
  return guarded([&] {
    const size_t capacity = size_t(codec->escape_capacity_bytes);
    const size_t used =
        e == GaacElement::kBf16
            ? certkv::codec::gaac_encode_page(static_cast<const uint16_t*>(page), codec->block_tokens,
                                              codec->head_dim, bases, capacity, slot)
            : certkv::codec::gaac_encode_page_fp8_ref(e, static_cast<const uint8_t*>(page),
                                                      codec->block_tokens, codec->head_dim, bases,
                                                      capacity, slot);
    *used_bytes = used == certkv::codec::kGaacDoesNotFit ? 0 : used;
  });
}

certkv_status certkv_gaac_decode_page(const certkv_gaac_page_codec* codec, const uint8_t* slot,
                                      size_t slot_bytes, void* out) {
  GaacElement e;
  GaacBases bases;
  if (const certkv_status s = read_codec("certkv_gaac_decode_page", codec, &e, &bases); s != CERTKV_OK) return s;
  CERTKV_REQUIRE(slot && out, "certkv_gaac_decode_page: null argument");
  return guarded([&] {
    if (e == GaacElement::kBf16)
      certkv::codec::gaac_decode_page(slot, slot_bytes, codec->block_tokens, codec->head_dim, bases,
                                      static_cast<uint16_t*>(out));
    else
      certkv::codec::gaac_decode_page_fp8_ref(e, slot, slot_bytes, codec->block_tokens,
                                              codec->head_dim, bases, static_cast<uint8_t*>(out));
  });
}

certkv_status certkv_gaac_encode_pages_device(const certkv_gaac_page_codec* codec, const void* pages, int64_t n_pages,
                                              uint8_t* slots, uint32_t* used_bytes, void* cuda_stream) {
  const char* where = "certkv_gaac_encode_pages_device";
  GaacElement e;
  GaacBases bases;
  if (const certkv_status s = read_codec(where, codec, &e, &bases); s != CERTKV_OK) return s;
  CERTKV_REQUIRE(n_pages >= 0, std::string(where) + ": n_pages " + std::to_string(n_pages) + " is negative");
  CERTKV_REQUIRE(n_pages == 0 || (pages && slots && used_bytes), std::string(where) + ": null pages, slots or used_bytes");
  return guarded([&] {
    // The arguments checked here, where every build can: a build without CUDA refuses after them.
    certkv::codec::validate_gaac_bases(e, codec->block_tokens, codec->head_dim, bases);
    if (n_pages == 0) return;  // nothing to launch, in any build
    certkv::backend::cuda::DeviceGaacPages c;
    c.element = e;
    c.block_tokens = codec->block_tokens;
    c.head_dim = codec->head_dim;
    c.b3 = bases.b3;
    c.b4 = bases.b4;
    c.escape_capacity_bytes = codec->escape_capacity_bytes;
    certkv::backend::cuda::encode_gaac_pages_on_device(c, pages, n_pages, slots, used_bytes, cuda_stream);
  });
}

}  // extern "C"
