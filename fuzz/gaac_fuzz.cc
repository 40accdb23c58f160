// libFuzzer target for the GAAC page decoders: any slot bytes must either decode or throw
// certkv::Error kCorrupt, never read past the slot (ASan), and every code path (plain, AVX2,
// AVX-512) must agree, as BF16 bits and as floats. Also checks that encoding the decoded page
// and decoding again gives the same values (the codec is lossless for any bases).
// Input: 4 parameter bytes (element, block_tokens, head_dim choice, row range), 2 base bytes,
// then the slot.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "codec/gaac.h"
#include "core/status.h"

using certkv::codec::GaacBases;
using certkv::codec::GaacKernel;
using certkv::format::GaacElement;

namespace {

constexpr int kHeadDims[] = {8, 24, 64, 128, 192, 256};

// Decodes rows [t0, t1) with `kernel`; false when it threw kCorrupt (anything else aborts).
bool decode(GaacElement element, const std::vector<uint8_t>& slot, int t, int d,
            const GaacBases& bases, int t0, int t1, GaacKernel kernel, std::vector<uint8_t>* out) {
  try {
    if (element != GaacElement::kBf16) {
      out->assign(size_t(t) * size_t(d), 0);
      certkv::codec::gaac_decode_page_fp8_ref(element, slot.data(), slot.size(), t, d, bases,
                                              out->data());
      return true;
    }
    std::vector<uint16_t> rows(size_t(t1 - t0) * size_t(d));
    const certkv::codec::GaacRowDecoder decoder(t, d, bases, kernel);
    decoder.decode_rows(slot.data(), slot.size(), t0, t1, rows.data());
    // The float rows must throw alike (they decode first) and be the BF16 bits shifted up by 16.
    std::vector<float> floats(rows.size());
    decoder.decode_rows(slot.data(), slot.size(), t0, t1, floats.data());
    for (size_t i = 0; i < rows.size(); ++i) {
      uint32_t bits;
      memcpy(&bits, &floats[i], sizeof bits);
      if (bits != uint32_t(rows[i]) << 16) abort();
    }
    out->resize(rows.size() * 2);
    memcpy(out->data(), rows.data(), out->size());
    return true;
  } catch (const certkv::Error& e) {
    if (e.code() != certkv::StatusCode::kCorrupt) abort();
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 6) return 0;
  const GaacElement element = static_cast<GaacElement>(data[0] % 3);
  const int t = 1 + data[1] % 17;
  const int d = kHeadDims[data[2] % 6];
  int t0 = (data[3] & 0x0f) % (t + 1);
  int t1 = (data[3] >> 4) % (t + 1);
  if (t0 > t1) std::swap(t0, t1);
  const int n_exponents = element == GaacElement::kBf16 ? 256 : element == GaacElement::kFp8E4M3 ? 16 : 32;
  GaacBases bases{std::vector<uint8_t>(size_t(d)), std::vector<uint8_t>(size_t(d))};
  for (int c = 0; c < d; ++c) {
    bases.b3[size_t(c)] = uint8_t((data[4] + 7 * c) % (n_exponents - 7));
    bases.b4[size_t(c)] = uint8_t((data[5] + 3 * c) % (n_exponents - 15));
  }
  const std::vector<uint8_t> slot(data + 6, data + size);  // exact size: overreads are caught

  std::vector<uint8_t> first;
  const bool ok = decode(element, slot, t, d, bases, t0, t1, GaacKernel::kRef, &first);
  if (element == GaacElement::kBf16) {
    for (GaacKernel k : {GaacKernel::kAvx2, GaacKernel::kAvx512}) {
      if (!certkv::codec::gaac_kernel_supported(k)) continue;
      std::vector<uint8_t> other;
      if (decode(element, slot, t, d, bases, t0, t1, k, &other) != ok) abort();
      if (ok && other != first) abort();
    }
  }
  // A whole page that decodes must survive encode -> decode unchanged.
  std::vector<uint8_t> page;
  if (!decode(element, slot, t, d, bases, 0, t, GaacKernel::kRef, &page)) return 0;
  const size_t capacity = certkv::format::gaac_page_max_escape_bytes(element, t, d);
  std::vector<uint8_t> encoded(certkv::format::gaac_slot_bytes(element, t, d, capacity));
  size_t used;
  if (element == GaacElement::kBf16) {
    std::vector<uint16_t> values(page.size() / 2);
    memcpy(values.data(), page.data(), page.size());
    used = certkv::codec::gaac_encode_page(values.data(), t, d, bases, capacity, encoded.data());
  } else {
    used = certkv::codec::gaac_encode_page_fp8_ref(element, page.data(), t, d, bases, capacity,
                                                   encoded.data());
  }
  if (used == certkv::codec::kGaacDoesNotFit) abort();
  std::vector<uint8_t> again;
  if (!decode(element, encoded, t, d, bases, 0, t, GaacKernel::kRef, &again) || again != page) {
    abort();
  }
  return 0;
}
