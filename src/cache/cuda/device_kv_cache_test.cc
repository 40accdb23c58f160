// DeviceKvCache against the host KvCache: the same writes (ragged chunks, single decode steps)
// leave every page with the host's class and bytes, for bf16, gaac and gaac-e5m2, with pools
// that grow, and for the lossy schemes fp8-e4m3, fp8-e5m2 and dither8 every lossy page the bytes
// of the reference encoder over the host's exact block at the device's slot, and every page kept
// exact (not finite, a scale past fp16) the host's; reset empties it; bad input is refused with a
// status. The refusals run anywhere;
// the rest needs a CUDA device (skipped otherwise).
#include "cache/cuda/device_kv_cache.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/cuda/append_rows_cuda.h"
#include "cache/cuda/place_encoded_cuda.h"
#include "codec/gaac.h"
#include "codec/gaac_fragments.h"
#include "codec/lossy_page.h"
#include "core/cuda_test_support.h"
#include "format/fp8.h"
#include "format/fragment_layout.h"
#include "format/gaac_layout.h"
#include "format/numeric.h"

namespace certkv::cache::cuda {
namespace {

constexpr int kLayers = 2, kHeads = 3, kDim = 64, kT = 16;

// Rows like a model's keys: per-channel scales spanning several binades, a few large channels.
std::vector<float> random_rows(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(size_t(n) * kHeads * kDim);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = int(i % kDim);
    const float scale = std::ldexp(1.f, (c * 7) % 9 - 4) * (c % 29 == 3 ? 40.f : 1.f);
    x[i] = normal(rng) * scale;
  }
  return x;
}

std::shared_ptr<const codec::GaacCalibration> calibration(KvScheme scheme) {
  const format::GaacElement element =
      scheme == KvScheme::kGaacE5M2 ? format::GaacElement::kFp8E5M2 : format::GaacElement::kBf16;
  codec::GaacCalibrator cal(codec::GaacShape{kLayers, kHeads, kDim, kT, element});
  std::mt19937 rng(7);
  const int n = 256;
  for (int l = 0; l < kLayers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<float> x = random_rows(rng, n);
      for (int h = 0; h < kHeads; ++h) {
        std::vector<uint16_t> bf16(size_t(n) * kDim);
        std::vector<uint8_t> fp8(bf16.size());
        for (int t = 0; t < n; ++t)
          for (int c = 0; c < kDim; ++c) {
            const uint16_t b = format::float_to_bf16(x[(size_t(t) * kHeads + h) * kDim + c]);
            bf16[size_t(t) * kDim + c] = b;
            fp8[size_t(t) * kDim + c] = format::bf16_to_fp8_e5m2_ref(b);
          }
        if (element == format::GaacElement::kBf16) cal.add_bf16(l, kv, h, bf16.data(), n);
        else cal.add_fp8(l, kv, h, fp8.data(), n);
      }
    }
  return std::make_shared<codec::GaacCalibration>(cal.finish());
}

DeviceKvCacheConfig config_of(KvScheme scheme, int64_t max_tokens) {
  DeviceKvCacheConfig c;
  c.n_layers = kLayers;
  c.n_kv_heads = kHeads;
  c.head_dim = kDim;
  c.block_tokens = kT;
  c.max_tokens = max_tokens;
  c.scheme = scheme;
  if (kv_scheme_is_gaac(scheme)) c.gaac_calibration = calibration(scheme);
  return c;
}

// Every written block of every (layer, K/V, kv_head): the device's class and bytes are the host's
// (a slot's used bytes, fixed part and escapes, counted from the host slot's own tags).
// A scheme the table marks cuda_fragment_pages (gaac) stores GAAC device pages instead
// (codec/gaac_fragments.h): a device page exactly where gaac_fragment_encode_page_ref takes the
// host's rows of a full block, its bytes that encoder's, and raw pages the host's rows
// fragment-major.
void expect_same_gaac_device_pages(const DeviceKvCache& dev, const KvCache& host, SeqId seq, int64_t n, int* slots) {
  for (int l = 0; l < kLayers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < kHeads; ++h) {
        const format::PageRef* table = host.block_table(seq, l, KvTensor(kv), h);
        const std::vector<uint8_t>& b4 = host.config().gaac_calibration->bases(l, kv, h).b4;
        for (int64_t b = 0; b * kT < n; ++b) {
          SCOPED_TRACE("layer " + std::to_string(l) + " kv " + std::to_string(kv) + " head " + std::to_string(h) +
                       " block " + std::to_string(b));
          DevicePageBytes page;
          const CudaStatus s = dev.read_page(l, KvTensor(kv), h, b, &page);
          ASSERT_TRUE(s.ok) << s.message;
          std::vector<uint16_t> rows(size_t(kT) * kDim, 0);
          if (table[b].storage == format::StorageClass::kGaac) {
            codec::gaac_decode_page_ref(host.page_bytes_of(table[b]), host.config().gaac_calibration->slot_bytes(l, kv), kT,
                                        kDim, host.config().gaac_calibration->bases(l, kv, h), rows.data());
          } else {  // the live rows (a host tail's later rows are not defined; the device's are zero)
            std::memcpy(rows.data(), host.page_bytes_of(table[b]), size_t(std::min<int64_t>(kT, n - b * kT)) * kDim * 2);
          }
          const bool full = (b + 1) * kT <= n;
          std::vector<uint8_t> want(size_t(format::fragment::gaac_page_bytes(kDim)));
          const bool coded = full && codec::gaac_fragment_encode_page_ref(rows.data(), kv == 0, kDim, b4.data(), want.data());
          ASSERT_EQ(page.gaac_slot, coded);
          if (coded) {
            ASSERT_EQ(page.stored, want);
            ASSERT_EQ(page.bytes, want);
          } else {
            std::vector<uint16_t> fragments(rows.size());
            format::fragment::bf16_page_to_fragments(kv == 0, kDim, rows.data(), fragments.data());
            ASSERT_EQ(page.stored.size(), rows.size() * 2);
            ASSERT_EQ(std::memcmp(page.stored.data(), fragments.data(), page.stored.size()), 0);
          }
          *slots += page.gaac_slot;
        }
      }
}

void expect_same_pages(const DeviceKvCache& dev, const KvCache& host, SeqId seq, int64_t n, int* slots) {
  if (kv_scheme_info(host.scheme()).cuda_fragment_pages) return expect_same_gaac_device_pages(dev, host, seq, n, slots);
  const format::GaacElement element = kv_scheme_element(host.scheme());
  const size_t elem = size_t(format::gaac_element_bytes(element));
  for (int l = 0; l < kLayers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < kHeads; ++h) {
        const format::PageRef* table = host.block_table(seq, l, KvTensor(kv), h);
        for (int64_t b = 0; b * kT < n; ++b) {
          DevicePageBytes page;
          const CudaStatus s = dev.read_page(l, KvTensor(kv), h, b, &page);
          ASSERT_TRUE(s.ok) << s.message;
          const bool host_slot = table[b].storage == format::StorageClass::kGaac ||
                                 table[b].storage == format::StorageClass::kGaacFp8;
          ASSERT_EQ(page.gaac_slot, host_slot) << "layer " << l << " kv " << kv << " head " << h << " block " << b;
          size_t compare = size_t(std::min<int64_t>(kT, n - b * kT)) * kDim * elem;
          if (page.gaac_slot) {
            const size_t slot_bytes = host.config().gaac_calibration->slot_bytes(l, kv);
            compare = format::gaac_page_fixed_bytes(element, kT, kDim) +
                      codec::gaac_count_modes(element, host.page_bytes_of(table[b]), slot_bytes, kT, kDim).escape_bytes;
            ASSERT_EQ(page.bytes.size(), compare) << "used bytes, layer " << l << " kv " << kv << " block " << b;
          }
          ASSERT_LE(compare, page.bytes.size());
          ASSERT_TRUE(std::equal(page.bytes.begin(), page.bytes.begin() + ptrdiff_t(compare),
                                 host.page_bytes_of(table[b])))
              << "layer " << l << " kv " << kv << " head " << h << " block " << b;
          if (!page.gaac_slot) {  // a tail's rows not written yet are zero (recycled pages too)
            ASSERT_TRUE(std::all_of(page.bytes.begin() + ptrdiff_t(compare), page.bytes.end(),
                                    [](uint8_t x) { return x == 0; }))
                << "layer " << l << " kv " << kv << " head " << h << " block " << b;
          }
          *slots += page.gaac_slot;
        }
      }
}

TEST(DeviceKvCache, RaggedWritesLeaveTheHostCachesPages) {
  CERTKV_NEED_CUDA_DEVICE();
  for (KvScheme scheme : {KvScheme::kBf16, KvScheme::kGaac, KvScheme::kGaacE5M2}) {
    SCOPED_TRACE(kv_scheme_name(scheme));
    const int64_t max_tokens = 2000;
    const DeviceKvCacheConfig dc = config_of(scheme, max_tokens);
    std::unique_ptr<DeviceKvCache> dev;
    CudaStatus s = DeviceKvCache::create(dc, &dev);
    ASSERT_TRUE(s.ok) << s.message;
    KvCacheConfig hc;
    hc.n_layers = kLayers;
    hc.n_kv_heads = kHeads;
    hc.head_dim = kDim;
    hc.block_tokens = kT;
    hc.max_tokens = max_tokens;
    hc.scheme = scheme;
    hc.gaac_calibration = dc.gaac_calibration;
    KvCache host(hc);
    std::mt19937 rng(11);
    for (int round = 0; round < 2; ++round) {
      const SeqId seq = host.create_sequence();
      // Chunks that start and end inside blocks, whole blocks, single steps, long prefills
      // (the raw pool grows while pages are taken; 1,100 tokens finalize 68 blocks per head in one
      // write, past the slot pools' first 64, so they grow in the middle of an encode).
      const std::vector<int64_t> chunks = round == 0 ? std::vector<int64_t>{37, 1, 1, 16, 5, 700, 1, 1, 1, 13, 3}
                                                     : std::vector<int64_t>{16, 1, 1100};
      int64_t n = 0;
      int slots = 0;
      for (int64_t m : chunks) {
        const std::vector<float> k = random_rows(rng, m), v = random_rows(rng, m);
        host.reserve(seq, m);
        for (int l = 0; l < kLayers; ++l) {
          host.write(seq, l, k.data(), v.data(), m);
          s = dev->write(l, k.data(), v.data(), m);
          ASSERT_TRUE(s.ok) << s.message;
        }
        host.commit(seq, m);
        n += m;
        for (int l = 0; l < kLayers; ++l) {
          EXPECT_EQ(dev->written(l), n);
          EXPECT_EQ(dev->view(l).host_length, n);
        }
        slots = 0;
        expect_same_pages(*dev, host, seq, n, &slots);
      }
      const DeviceKvStats st = dev->stats();
      const int64_t blocks = int64_t(kLayers) * 2 * kHeads * ((n + kT - 1) / kT);
      EXPECT_EQ(st.slots_in_use + st.raw_pages_in_use, blocks);
      if (scheme == KvScheme::kBf16) EXPECT_EQ(slots, 0);
      else EXPECT_GT(slots, blocks / 2) << "most blocks should fit their calibrated slots";
      host.free_sequence(seq);
      s = dev->reset();
      ASSERT_TRUE(s.ok) << s.message;
      EXPECT_EQ(dev->stats().slots_in_use, 0);
      EXPECT_EQ(dev->stats().raw_pages_in_use, 0);
      EXPECT_EQ(dev->written(0), 0);
    }
    // Past the capacity, and layers outside the model: refused, nothing written.
    const std::vector<float> big = random_rows(rng, max_tokens + 1);
    s = dev->write(0, big.data(), big.data(), max_tokens + 1);
    EXPECT_FALSE(s.ok);
    EXPECT_EQ(s.code, StatusCode::kOutOfRange);
    EXPECT_NE(s.message.find("capacity"), std::string::npos) << s.message;
    EXPECT_EQ(dev->written(0), 0);
    s = dev->write(kLayers, big.data(), big.data(), 1);
    EXPECT_EQ(s.code, StatusCode::kOutOfRange);
    DevicePageBytes page;
    s = dev->read_page(0, KvTensor::kKey, 0, 0, &page);
    EXPECT_EQ(s.code, StatusCode::kOutOfRange) << "nothing written yet";
  }
}

// Every written block of a lossy cache: a lossy page on the device exactly where the host has
// one, its bytes those of lossy_encode_page_ref over the host's exact block at the device's slot
// (the dither8 counter; the fp8 casts do not depend on it, so there the host's own bytes too);
// raw pages (tails, pages kept exact) the host's rows.
void expect_same_lossy_pages(const DeviceKvCache& dev, const KvCache& host, SeqId seq, int64_t n, int* lossy) {
  std::vector<uint16_t> exact(size_t(kT) * kDim);
  for (int l = 0; l < kLayers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < kHeads; ++h) {
        const format::PageRef* table = host.block_table(seq, l, KvTensor(kv), h);
        for (int64_t b = 0; b * kT < n; ++b) {
          SCOPED_TRACE("layer " + std::to_string(l) + " kv " + std::to_string(kv) + " head " + std::to_string(h) +
                       " block " + std::to_string(b));
          DevicePageBytes page;
          const CudaStatus s = dev.read_page(l, KvTensor(kv), h, b, &page);
          ASSERT_TRUE(s.ok) << s.message;
          const bool host_lossy = table[b].storage == format::StorageClass::kLossy ||
                                  table[b].storage == format::StorageClass::kDither8;
          ASSERT_EQ(page.lossy_page, host_lossy);
          ASSERT_FALSE(page.gaac_slot);
          // A fragment-major scheme (dither8, fp8-e4m3 with the exponent witness) stores what the
          // fragment kernel reads: the codec's page (bytes) transcoded (format/fragment_layout.h;
          // attention's FragmentLayout tests hold these transcodings to dither8_fragment_page,
          // fp8_fragment_page and fragment_page_from_rows bit for bit).
          ASSERT_EQ(page.stored.size(), page.bytes.size());
          if (kv_scheme_device_fragment_pages(host.scheme(), host.config().witness)) {
            std::vector<uint8_t> want(page.bytes.size());
            if (host_lossy && host.scheme() == KvScheme::kDither8) {
              const codec::LossyPageSpec spec = host.lossy_spec(l, KvTensor(kv), h);
              format::fragment::dither8_page_to_fragments(kv == 0, kDim, kDim / codec::kQuantGroup,
                                                          spec.n_outlier_pairs, page.bytes.data(), want.data());
            } else if (host_lossy) {
              format::fragment::fp8_page_to_fragments(kv == 0, kDim, page.bytes.data(), want.data());
            } else {
              format::fragment::bf16_page_to_fragments(kv == 0, kDim, reinterpret_cast<const uint16_t*>(page.bytes.data()),
                                                       reinterpret_cast<uint16_t*>(want.data()));
            }
            ASSERT_EQ(page.stored, want) << "fragment-major on the device";
          } else {
            ASSERT_EQ(page.stored, page.bytes);
          }
          if (!host_lossy) {
            const size_t rows = size_t(std::min<int64_t>(kT, n - b * kT)) * kDim * 2;
            ASSERT_EQ(page.bytes.size(), size_t(kT) * kDim * 2);
            ASSERT_TRUE(std::equal(page.bytes.begin(), page.bytes.begin() + ptrdiff_t(rows), host.page_bytes_of(table[b])));
            ASSERT_TRUE(std::all_of(page.bytes.begin() + ptrdiff_t(rows), page.bytes.end(), [](uint8_t x) { return x == 0; }))
                << "a tail's rows not written yet are zero";
            continue;
          }
          ++*lossy;
          ASSERT_GE(page.slot, 0);
          const codec::LossyPageSpec spec = host.lossy_spec(l, KvTensor(kv), h);
          ASSERT_EQ(page.bytes.size(), codec::lossy_page_bytes(spec));
          host.read_exact_page(table[b], l, KvTensor(kv), h, exact.data());
          std::vector<uint8_t> want(page.bytes.size());
          ASSERT_TRUE(codec::lossy_encode_page_ref(spec, uint32_t(b), exact.data(), want.data()));
          ASSERT_EQ(page.bytes, want);
          // dither8 too: its dither is keyed by the block's position, not by the slot.
          ASSERT_TRUE(std::equal(want.begin(), want.end(), host.page_bytes_of(table[b])));
        }
      }
}

TEST(DeviceKvCache, RaggedWritesLeaveTheHostCachesLossyPages) {
  CERTKV_NEED_CUDA_DEVICE();
  // fp8-e4m3 twice: with its fp16 witness (token-major pages) and the exponent witness (fragment-
  // major pages of the codes alone; a K block with a value past 464 kept exact, as the host keeps it).
  const std::pair<KvScheme, codec::WitnessCode> schemes[] = {{KvScheme::kFp8E4M3, codec::WitnessCode::kFp16},
                                                             {KvScheme::kFp8E5M2, codec::WitnessCode::kFp16},
                                                             {KvScheme::kDither8, codec::WitnessCode::kFp16},
                                                             {KvScheme::kFp8E4M3, codec::WitnessCode::kExponent}};
  for (auto [scheme, witness] : schemes) {
    // The first writes: shorter than a block until it completes (dither8 chooses its outlier pairs
    // from the first block's bf16 rows then), longer than a block (from that write's float rows),
    // or shorter and then a long one before the first block completes (from the long write's rows,
    // poisoned ones included, as KvCache does).
    const std::vector<std::vector<int64_t>> first_writes = {
        {5, 1, 1, 9, 16, 5, 300, 1, 13, 3}, {37, 1, 1, 9, 16, 5, 300, 1, 13, 3}, {5, 300, 1, 13, 3}};
    for (size_t plan = 0; plan < first_writes.size(); ++plan) {
      SCOPED_TRACE(std::string(kv_scheme_name(scheme)) + " witness " + codec::witness_code_name(witness) +
                   ", writes plan " + std::to_string(plan));
      const int64_t max_tokens = 1600;
      DeviceKvCacheConfig dc = config_of(scheme, max_tokens);
      dc.rope_pairing = plan % 2 == 0 ? codec::RopePairing::kInterleaved : codec::RopePairing::kHalfSplit;
      dc.witness = witness;
      std::unique_ptr<DeviceKvCache> dev;
      CudaStatus s = DeviceKvCache::create(dc, &dev);
      ASSERT_TRUE(s.ok) << s.message;
      KvCacheConfig hc;
      hc.n_layers = kLayers;
      hc.n_kv_heads = kHeads;
      hc.head_dim = kDim;
      hc.block_tokens = kT;
      hc.max_tokens = max_tokens;
      hc.scheme = scheme;
      hc.rope_pairing = dc.rope_pairing;
      hc.witness = witness;
      KvCache host(hc);
      std::mt19937 rng(13);
      for (int round = 0; round < 2; ++round) {
        const SeqId seq = host.create_sequence();
        const uint64_t host_exact_before = host.memory_stats().exact_fallback_blocks;
        const std::vector<int64_t> chunks =
            round == 0 ? first_writes[plan]
                       : std::vector<int64_t>{16, 1, 1100};  // lossy pools grow in the middle of an encode
        int64_t n = 0;
        int lossy = 0;
        for (int64_t m : chunks) {
          std::vector<float> k = random_rows(rng, m), v = random_rows(rng, m);
          // The exponent witness: keys a quarter as large, so that most K pages stay within the
          // saturation limit (464) and a few do not (the large channel's 2.9-deviation values).
          if (witness == codec::WitnessCode::kExponent)
            for (float& x : k) x *= 0.25f;
          if (m == 300) {  // pages the encoders refuse: not finite, a scale past fp16 / E5M2's range
            k[(size_t(40) * kHeads + 1) * kDim + 3] = INFINITY;
            k[(size_t(200) * kHeads + 0) * kDim + 0] = NAN;
            v[(size_t(100) * kHeads + 2) * kDim + 5] = 1e7f;
          }
          host.reserve(seq, m);
          for (int l = 0; l < kLayers; ++l) {
            host.write(seq, l, k.data(), v.data(), m);
            s = dev->write(l, k.data(), v.data(), m);
            ASSERT_TRUE(s.ok) << s.message;
          }
          host.commit(seq, m);
          n += m;
          lossy = 0;
          expect_same_lossy_pages(*dev, host, seq, n, &lossy);
        }
        const DeviceKvStats st = dev->stats();
        const int64_t blocks = int64_t(kLayers) * 2 * kHeads * ((n + kT - 1) / kT);
        EXPECT_EQ(st.lossy_pages_in_use, lossy);
        EXPECT_EQ(st.lossy_pages_in_use + st.raw_pages_in_use, blocks);
        EXPECT_EQ(st.slots_in_use, 0);
        EXPECT_EQ(uint64_t(st.pages_kept_exact), host.memory_stats().exact_fallback_blocks - host_exact_before);
        if (round == 0) {
          EXPECT_GT(st.pages_kept_exact, 0) << "the poisoned rows must keep pages exact";
        }
        EXPECT_GT(lossy, blocks / 2);
        host.free_sequence(seq);
        s = dev->reset();
        ASSERT_TRUE(s.ok) << s.message;
        EXPECT_EQ(dev->stats().lossy_pages_in_use, 0);
        EXPECT_EQ(dev->stats().raw_pages_in_use, 0);
      }
      const DeviceLayerView view = dev->view(0);
      EXPECT_NE(view.raw_pages, nullptr);
      if (scheme == KvScheme::kDither8) {
        EXPECT_NE(view.dither_keys, nullptr);
        EXPECT_EQ(view.n_outlier_pairs, kDefaultOutlierPairs);
        // The kernels' channel list is the host's pairs, channel a then b.
        std::vector<int32_t> channels(size_t(kHeads) * 2 * kDefaultOutlierPairs);
        ASSERT_EQ(cudaMemcpy(channels.data(), view.outlier_channels, channels.size() * sizeof(int32_t),
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
        for (int h = 0; h < kHeads; ++h) {
          const codec::LossyPageSpec spec = host.lossy_spec(0, KvTensor::kKey, h);
          for (int j = 0; j < kDefaultOutlierPairs; ++j)
            for (int which = 0; which < 2; ++which)
              EXPECT_EQ(channels[size_t(h) * 2 * kDefaultOutlierPairs + 2 * j + which],
                        codec::rope_pair_channel(dc.rope_pairing, kDim, spec.outlier_pairs[j], which));
        }
      } else {
        EXPECT_EQ(view.n_outlier_pairs, 0);
      }
    }
  }
}

// The gate's repair on the device: a lossy block's K and V pages become raw pages holding the
// exact rows given (the lossy pages go back to the pool), an exact page stays as it is, and the
// bad calls are refused.
TEST(DeviceKvCache, StoreExactBlockReplacesLossyPages) {
  CERTKV_NEED_CUDA_DEVICE();
  for (KvScheme scheme : {KvScheme::kFp8E4M3, KvScheme::kDither8}) {
    SCOPED_TRACE(kv_scheme_name(scheme));
    std::unique_ptr<DeviceKvCache> dev;
    CudaStatus s = DeviceKvCache::create(config_of(scheme, 256), &dev);
    ASSERT_TRUE(s.ok) << s.message;
    std::mt19937 rng(17);
    const int64_t n = 100;  // 6 whole blocks and a tail
    const std::vector<float> k = random_rows(rng, n), v = random_rows(rng, n);
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(dev->write(l, k.data(), v.data(), n).ok);
    const DeviceKvStats before = dev->stats();
    std::vector<uint16_t> kx(size_t(kT) * kDim), vx(kx.size());
    for (size_t i = 0; i < kx.size(); ++i) {
      kx[i] = format::float_to_bf16(float(i % 97) * 0.25f);
      vx[i] = format::float_to_bf16(-float(i % 89) * 0.5f);
    }
    uint64_t bytes = 0;
    s = dev->store_exact_block(1, 2, 3, kx.data(), vx.data(), &bytes);
    ASSERT_TRUE(s.ok) << s.message;
    EXPECT_EQ(bytes, 2 * kx.size() * 2);
    for (int kv = 0; kv < 2; ++kv) {
      DevicePageBytes page;
      ASSERT_TRUE(dev->read_page(1, KvTensor(kv), 2, 3, &page).ok);
      EXPECT_FALSE(page.lossy_page);
      const std::vector<uint16_t>& want = kv == 0 ? kx : vx;
      ASSERT_EQ(page.bytes.size(), want.size() * 2);
      EXPECT_EQ(std::memcmp(page.bytes.data(), want.data(), page.bytes.size()), 0) << "kv " << kv;
      ASSERT_TRUE(dev->read_page(1, KvTensor(kv), 2, 2, &page).ok);  // its neighbour is untouched
      EXPECT_TRUE(page.lossy_page);
    }
    const DeviceKvStats after = dev->stats();
    EXPECT_EQ(after.lossy_pages_in_use, before.lossy_pages_in_use - 2);
    EXPECT_EQ(after.raw_pages_in_use, before.raw_pages_in_use + 2);
    s = dev->store_exact_block(1, 2, 3, kx.data(), vx.data(), &bytes);  // exact already
    ASSERT_TRUE(s.ok) << s.message;
    EXPECT_EQ(bytes, 0u);
    EXPECT_EQ(dev->store_exact_block(0, 0, 6, kx.data(), vx.data(), &bytes).code, StatusCode::kInvalidArgument)
        << "the tail block is not whole";
    EXPECT_EQ(dev->store_exact_block(kLayers, 0, 0, kx.data(), vx.data(), &bytes).code, StatusCode::kInvalidArgument);
    EXPECT_EQ(dev->store_exact_block(0, kHeads, 0, kx.data(), vx.data(), &bytes).code, StatusCode::kInvalidArgument);
    // A block index whose token count would overflow, and missing arrays.
    EXPECT_EQ(dev->store_exact_block(0, 0, int64_t(1) << 60, kx.data(), vx.data(), &bytes).code,
              StatusCode::kInvalidArgument);
    EXPECT_EQ(dev->store_exact_block(0, 0, 0, nullptr, vx.data(), &bytes).code, StatusCode::kInvalidArgument);
    EXPECT_EQ(dev->store_exact_block(0, 0, 0, kx.data(), vx.data(), nullptr).code, StatusCode::kInvalidArgument);
    EXPECT_EQ(dev->write(0, nullptr, v.data(), 1).code, StatusCode::kInvalidArgument);
    ASSERT_TRUE(dev->write(0, k.data(), v.data(), 1).ok) << "the refusals above leave the cache usable";
  }
  std::unique_ptr<DeviceKvCache> bf16;
  ASSERT_TRUE(DeviceKvCache::create(config_of(KvScheme::kBf16, 64), &bf16).ok);
  std::vector<uint16_t> rows(size_t(kT) * kDim);
  uint64_t bytes = 0;
  EXPECT_EQ(bf16->store_exact_block(0, 0, 0, rows.data(), rows.data(), &bytes).code, StatusCode::kInvalidArgument);
}

// Sequences in slots share the layer pools; a forked prefix shares its parent's whole blocks,
// ref-counted, so a page returns to its free list only when the last table naming it lets go; a
// sequence's pages equal those of the same rows written alone.
TEST(DeviceKvCache, SequencesShareThePoolsAndForkedBlocksAreRefCounted) {
  CERTKV_NEED_CUDA_DEVICE();
  for (KvScheme scheme : {KvScheme::kBf16, KvScheme::kGaac, KvScheme::kFp8E4M3}) {
    SCOPED_TRACE(kv_scheme_name(scheme));
    DeviceKvCacheConfig dc = config_of(scheme, 256);
    dc.sequences = 0;
    std::unique_ptr<DeviceKvCache> dev, alone;
    ASSERT_TRUE(DeviceKvCache::create(dc, &dev).ok);
    ASSERT_TRUE(DeviceKvCache::create(config_of(scheme, 256), &alone).ok);
    int a = -1, b = -1, c = -1;
    ASSERT_TRUE(dev->create_sequence(&a).ok);
    ASSERT_TRUE(dev->create_sequence(&b).ok);
    ASSERT_NE(a, b);
    std::mt19937 rng(23);
    const std::vector<float> ka = random_rows(rng, 40), va = random_rows(rng, 40);
    const std::vector<float> kb = random_rows(rng, 20), vb = random_rows(rng, 20);
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(dev->write(a, l, ka.data(), va.data(), 40).ok);
      ASSERT_TRUE(dev->write(b, l, kb.data(), vb.data(), 20).ok);
      ASSERT_TRUE(alone->write(l, kb.data(), vb.data(), 20).ok);
    }
    const int64_t per_block = int64_t(kLayers) * 2 * kHeads;
    auto pages = [&] {
      const DeviceKvStats st = dev->stats();
      return st.raw_pages_in_use + st.slots_in_use + st.lossy_pages_in_use;
    };
    EXPECT_EQ(pages(), (3 + 2) * per_block);
    // b's pages are those of the same rows written alone.
    for (int l = 0; l < kLayers; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < kHeads; ++h)
          for (int64_t blk = 0; blk < 2; ++blk) {
            DevicePageBytes x, y;
            ASSERT_TRUE(dev->read_page(b, l, KvTensor(kv), h, blk, &x).ok);
            ASSERT_TRUE(alone->read_page(l, KvTensor(kv), h, blk, &y).ok);
            EXPECT_EQ(x.bytes, y.bytes);
            EXPECT_EQ(x.gaac_slot, y.gaac_slot);
            EXPECT_EQ(x.lossy_page, y.lossy_page);
          }
    EXPECT_EQ(dev->fork_prefix(a, 20, &c).code, StatusCode::kInvalidArgument) << "not whole blocks";
    EXPECT_EQ(dev->fork_prefix(a, 48, &c).code, StatusCode::kInvalidArgument) << "past what a holds";
    ASSERT_TRUE(dev->fork_prefix(a, 32, &c).ok);
    EXPECT_EQ(pages(), (3 + 2) * per_block) << "the fork shares a's two whole blocks";
    EXPECT_EQ(dev->written(c, 0), 32);
    DevicePageBytes x, y;
    ASSERT_TRUE(dev->read_page(a, 1, KvTensor::kValue, 2, 1, &x).ok);
    ASSERT_TRUE(dev->read_page(c, 1, KvTensor::kValue, 2, 1, &y).ok);
    EXPECT_EQ(x.bytes, y.bytes);
    const std::vector<float> kc = random_rows(rng, 5), vc = random_rows(rng, 5);
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(dev->write(c, l, kc.data(), vc.data(), 5).ok);
    EXPECT_EQ(pages(), (3 + 2 + 1) * per_block) << "c's own tail";
    ASSERT_TRUE(dev->free_sequence(a).ok);
    EXPECT_EQ(pages(), (2 + 2 + 1) * per_block) << "the shared blocks stay with c";
    ASSERT_TRUE(dev->read_page(c, 1, KvTensor::kValue, 2, 1, &y).ok);
    EXPECT_EQ(x.bytes, y.bytes) << "c's shared page outlives a";
    EXPECT_EQ(dev->write(a, 0, kc.data(), vc.data(), 1).code, StatusCode::kInvalidArgument) << "a is freed";
    EXPECT_EQ(dev->free_sequence(a).code, StatusCode::kInvalidArgument);
    ASSERT_TRUE(dev->free_sequence(c).ok);
    ASSERT_TRUE(dev->free_sequence(b).ok);
    EXPECT_EQ(pages(), 0);
    // Slots come back; more sequences than the first table rows grow the tables.
    std::vector<int> slots(9);
    for (int& s : slots) ASSERT_TRUE(dev->create_sequence(&s).ok);
    for (int s : slots) ASSERT_TRUE(dev->write(s, 0, kb.data(), vb.data(), 3).ok);
    EXPECT_EQ(dev->stats().sequences, 9);
    EXPECT_GE(dev->view(0).n_table_rows, 9);
  }
}

// The bytes of the page a device table entry names: a coded page (entry >= 0) of the layer's
// K or V pool, `coded_bytes` of them, else the raw page it names, whole.
std::vector<uint8_t> device_page(const DeviceKvCache& dev, int layer, int kv, int32_t entry, size_t coded_bytes) {
  const DeviceLayerView v = dev.view(layer);
  const uint8_t* src = nullptr;
  size_t bytes = 0;
  if (entry >= 0) {
    src = (kv == 0 ? v.k_pages : v.v_pages) + size_t(entry) * size_t(kv == 0 ? v.k_page_stride : v.v_page_stride);
    bytes = coded_bytes;
  } else {
    src = v.raw_pages + size_t(-int64_t(entry) - 1) * size_t(v.raw_page_stride);
    bytes = size_t(kT) * kDim * size_t(format::gaac_element_bytes(kv_scheme_element(dev.config().scheme)));
  }
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// One slot's [2][kHeads][table_stride] device tables of a layer, or rows of a device copy.
std::vector<int32_t> device_rows(const int32_t* tables, size_t entries) {
  std::vector<int32_t> out(entries);
  EXPECT_EQ(cudaMemcpy(out.data(), tables, entries * sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// row: a [2][kHeads][table_stride] table row of `dev` (device or host copy). Every block b <
// blocks of every (K/V, kv_head) names a page of the class and bytes of the reference's page of
// `ref_slot` (a cache that waits for its encode results: its tables are its host's). Blocks in
// `raw_blocks` must name raw pages equal to the raw page of `raw_ref` at the same place instead
// (the own-block tables' exact pages).
void expect_tables_name_reference_pages(const DeviceKvCache& dev, int layer, const std::vector<int32_t>& row,
                                        const DeviceKvCache& ref, int ref_slot, int64_t blocks, int64_t raw_block,
                                        const std::vector<int32_t>* raw_ref, const std::string& what) {
  const int64_t stride = dev.view(layer).table_stride;
  for (int kv = 0; kv < 2; ++kv)
    for (int h = 0; h < kHeads; ++h)
      for (int64_t b = 0; b < blocks; ++b) {
        SCOPED_TRACE(what + ": layer " + std::to_string(layer) + " kv " + std::to_string(kv) + " head " +
                     std::to_string(h) + " block " + std::to_string(b));
        const int32_t entry = row[size_t((kv * kHeads + h) * stride + b)];
        if (b == raw_block) {
          ASSERT_LT(entry, 0) << "an own block reads its exact raw page";
          const int32_t want = (*raw_ref)[size_t((kv * kHeads + h) * stride + b)];
          ASSERT_LT(want, 0);
          ASSERT_EQ(device_page(dev, layer, kv, entry, 0), device_page(ref, layer, kv, want, 0));
          continue;
        }
        DevicePageBytes page;
        const CudaStatus s = ref.read_page(ref_slot, layer, KvTensor(kv), h, b, &page);
        ASSERT_TRUE(s.ok) << s.message;
        ASSERT_EQ(entry >= 0, page.gaac_slot || page.lossy_page);
        // The device's bytes: fragment-major for a fragment-major scheme (`bytes` is the codec's
        // order, read back through the transcoding).
        ASSERT_EQ(device_page(dev, layer, kv, entry, page.stored.size()), page.stored);
      }
}

// Deferred encode results against a cache that waits for them, over forward-step-shaped writes
// (every layer written once a step by one write_rows of several sequences, ragged prefill chunks
// then decode steps, blocks completed in the middle of a step by some sequences only): after
// each layer's write, before any reconcile, the device tables name pages of the class and bytes
// of the waiting cache's (blocks that do not fit and pages kept exact included), and so do the
// own-block tables of copy_exact_block_tables; after reconcile_encodes the host tables are the
// device's, entry for entry, and the counters and every page are the waiting cache's. Host calls
// in the middle of a step (fork_prefix, free_sequence) reconcile first; read_page refuses while
// results are pending.
TEST(DeviceKvCache, DeferredEncodeResultsPlaceThePagesOfWaitingOnes) {
  CERTKV_NEED_CUDA_DEVICE();
  constexpr int kSeqs = 4;
  for (KvScheme scheme : {KvScheme::kGaac, KvScheme::kFp8E4M3, KvScheme::kDither8}) {
    SCOPED_TRACE(kv_scheme_name(scheme));
    const bool lossy = !kv_scheme_is_gaac(scheme);
    DeviceKvCacheConfig dc = config_of(scheme, 512);
    dc.sequences = kSeqs;
    dc.hold_completed_exact = lossy;  // as the cuda backend holds them
    std::unique_ptr<DeviceKvCache> ref, dev;
    ASSERT_TRUE(DeviceKvCache::create(dc, &ref).ok);
    dc.defer_encode_results = true;
    CudaStatus s = DeviceKvCache::create(dc, &dev);
    ASSERT_TRUE(s.ok) << s.message;
    const int64_t stride = dev->view(0).table_stride;
    const size_t row = size_t(2) * kHeads * size_t(stride);
    DeviceBuffer exact_tables, ref_exact_tables;
    ASSERT_TRUE(DeviceBuffer::allocate(row * sizeof(int32_t) * 64, &exact_tables).ok);
    ASSERT_TRUE(DeviceBuffer::allocate(row * sizeof(int32_t) * 64, &ref_exact_tables).ok);
    // Per step, the tokens of each sequence: ragged prefills, a second chunk of three blocks for
    // sequence 1 among decode steps, then decode steps (every sequence crosses block boundaries,
    // not all in the same step).
    std::vector<std::vector<int64_t>> steps = {{37, 5, 16, 100}, {1, 1, 1, 1}, {1, 1, 0, 1}, {1, 48, 1, 1}};
    for (int i = 0; i < 36; ++i) steps.push_back({1, 1, 1, 1});
    std::mt19937 rng(31);
    int64_t written[kSeqs] = {0, 0, 0, 0};
    for (size_t step = 0; step < steps.size(); ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      std::vector<std::vector<float>> k(kSeqs), v(kSeqs);
      for (int q = 0; q < kSeqs; ++q) {
        k[size_t(q)] = random_rows(rng, steps[step][size_t(q)]);
        v[size_t(q)] = random_rows(rng, steps[step][size_t(q)]);
      }
      if (step == 0) {
        // Sequence 3's prefill: blocks the encoders refuse. Lossy: values not finite, a scale past
        // fp16. GAAC: rows of head 1 in block 2 spread over 2^120, past any escape capacity.
        std::vector<float>& k3 = k[3];
        std::vector<float>& v3 = v[3];
        if (lossy) {
          k3[(size_t(40) * kHeads + 1) * kDim + 3] = INFINITY;
          k3[(size_t(70) * kHeads + 0) * kDim + 0] = NAN;
          v3[(size_t(90) * kHeads + 2) * kDim + 5] = 1e7f;
        } else {
          for (int t = 32; t < 48; ++t)
            for (int c = 0; c < kDim; ++c) {
              k3[(size_t(t) * kHeads + 1) * kDim + c] = std::ldexp(1.5f, (c * 37 + t * 11) % 120 - 60);
              v3[(size_t(t) * kHeads + 1) * kDim + c] = std::ldexp(-1.25f, (c * 53 + t * 7) % 120 - 60);
            }
        }
      }
      std::vector<DeviceKvCache::SlotRows> writes;
      for (int q = 0; q < kSeqs; ++q)
        if (steps[step][size_t(q)] > 0)
          writes.push_back({q, k[size_t(q)].data(), v[size_t(q)].data(), steps[step][size_t(q)]});
      for (int l = 0; l < kLayers; ++l) {
        SCOPED_TRACE("layer " + std::to_string(l));
        s = ref->write_rows(l, writes.data(), writes.size());
        ASSERT_TRUE(s.ok) << s.message;
        s = dev->write_rows(l, writes.data(), writes.size());
        ASSERT_TRUE(s.ok) << s.message;
        EXPECT_EQ(ref->pending_encodes(), 0u) << "a cache that waits never has results pending";
        // The blocks this write completed (the own blocks of the prompt rows).
        std::vector<std::pair<int, int64_t>> own;
        for (const DeviceKvCache::SlotRows& w : writes)
          for (int64_t b = written[w.slot] / kT; b < (written[w.slot] + w.n) / kT; ++b) own.emplace_back(w.slot, b);
        if (!own.empty()) {
          EXPECT_GE(dev->pending_encodes(), own.size() * 2 * kHeads);
          DevicePageBytes page;
          EXPECT_EQ(dev->read_page(own[0].first, l, KvTensor::kKey, 0, own[0].second, &page).code,
                    StatusCode::kInvalidArgument)
              << "read_page refuses while results are pending";
        }
        // The device tables, before the host has read a result.
        for (int q = 0; q < kSeqs; ++q) {
          const DeviceLayerView view = dev->view(l);
          const std::vector<int32_t> tables =
              device_rows(view.k_table + size_t(q) * size_t(view.table_row_stride), row);
          expect_tables_name_reference_pages(*dev, l, tables, *ref, q, (written[q] + steps[step][size_t(q)]) / kT, -1,
                                             nullptr, "device tables before reconcile, sequence " + std::to_string(q));
        }
        if (lossy && !own.empty()) {
          ASSERT_LE(own.size(), 64u);
          s = dev->copy_exact_block_tables(l, own, reinterpret_cast<int32_t*>(exact_tables.data()),
                                           exact_tables.size() / sizeof(int32_t));
          ASSERT_TRUE(s.ok) << s.message;
          s = ref->copy_exact_block_tables(l, own, reinterpret_cast<int32_t*>(ref_exact_tables.data()),
                                           ref_exact_tables.size() / sizeof(int32_t));
          ASSERT_TRUE(s.ok) << s.message;
          const std::vector<int32_t> mine =
              device_rows(reinterpret_cast<const int32_t*>(exact_tables.data()), own.size() * row);
          const std::vector<int32_t> theirs =
              device_rows(reinterpret_cast<const int32_t*>(ref_exact_tables.data()), own.size() * row);
          for (size_t j = 0; j < own.size(); ++j) {
            // The waiting cache's own-block table as the backend made it from the host tables.
            const int32_t* ref_row = ref->host_table_row(own[j].first, l);
            std::vector<int32_t> host_made(ref_row, ref_row + row);
            for (const CompletedExactPage& p : ref->completed_exact(l))
              if (p.slot == own[j].first && p.block == own[j].second)
                host_made[size_t((p.kv * kHeads + p.kv_head) * stride + p.block)] = -p.raw_page - 1;
            const std::vector<int32_t> theirs_j(theirs.begin() + ptrdiff_t(j * row),
                                                theirs.begin() + ptrdiff_t((j + 1) * row));
            EXPECT_EQ(theirs_j, host_made) << "copy_exact_block_tables of a waiting cache: the host-made tables";
            const std::vector<int32_t> mine_j(mine.begin() + ptrdiff_t(j * row),
                                              mine.begin() + ptrdiff_t((j + 1) * row));
            expect_tables_name_reference_pages(*dev, l, mine_j, *ref, own[j].first, own[j].second + 1, own[j].second,
                                               &host_made, "own-block tables " + std::to_string(j));
          }
        }
        ref->release_completed_exact(l);
        dev->release_completed_exact(l);
      }
      for (const DeviceKvCache::SlotRows& w : writes) written[w.slot] += w.n;
      if (step == 3) {
        // A host call in the middle of a step (every layer written, the results not read):
        // fork_prefix reads the host tables, so it reconciles first (the tables grow too: every
        // slot is taken); the child's pages are the waiting cache's.
        ASSERT_GT(dev->pending_encodes(), 0u);
        int child = -1, ref_child = -1;
        s = dev->fork_prefix(1, 48, &child);
        ASSERT_TRUE(s.ok) << s.message;
        EXPECT_EQ(dev->pending_encodes(), 0u);
        ASSERT_TRUE(ref->fork_prefix(1, 48, &ref_child).ok);
        for (int l = 0; l < kLayers; ++l)
          for (int64_t b = 0; b < 3; ++b) {
            DevicePageBytes x, y;
            ASSERT_TRUE(dev->read_page(child, l, KvTensor::kValue, 2, b, &x).ok);
            ASSERT_TRUE(ref->read_page(ref_child, l, KvTensor::kValue, 2, b, &y).ok);
            EXPECT_EQ(x.bytes, y.bytes);
            EXPECT_EQ(x.lossy_page || x.gaac_slot, y.lossy_page || y.gaac_slot);
          }
        ASSERT_TRUE(dev->free_sequence(child).ok);
        ASSERT_TRUE(ref->free_sequence(ref_child).ok);
      }
      // The end of the step: one copy of every result, then the host catches up.
      s = dev->download_encode_results();
      ASSERT_TRUE(s.ok) << s.message;
      s = dev->reconcile_encodes();
      ASSERT_TRUE(s.ok) << s.message;
      ASSERT_EQ(dev->pending_encodes(), 0u);
      for (int l = 0; l < kLayers; ++l)
        for (int q = 0; q < kSeqs; ++q) {
          const DeviceLayerView view = dev->view(l);
          const std::vector<int32_t> tables =
              device_rows(view.k_table + size_t(q) * size_t(view.table_row_stride), row);
          const int32_t* host = dev->host_table_row(q, l);
          for (int kv = 0; kv < 2; ++kv)
            for (int h = 0; h < kHeads; ++h)
              for (int64_t b = 0; b < (written[q] + kT - 1) / kT; ++b) {
                const size_t at = size_t((kv * kHeads + h) * stride + b);
                ASSERT_EQ(tables[at], host[at]) << "host and device tables after reconcile: layer " << l << " sequence "
                                                << q << " kv " << kv << " head " << h << " block " << b;
              }
          expect_tables_name_reference_pages(*dev, l, tables, *ref, q, (written[q] + kT - 1) / kT, -1, nullptr,
                                             "after reconcile, sequence " + std::to_string(q));
        }
      const DeviceKvStats a = ref->stats(), b = dev->stats();
      EXPECT_EQ(a.slots_in_use, b.slots_in_use);
      EXPECT_EQ(a.lossy_pages_in_use, b.lossy_pages_in_use);
      EXPECT_EQ(a.raw_pages_in_use, b.raw_pages_in_use);
      EXPECT_EQ(a.blocks_not_fitting, b.blocks_not_fitting);
      EXPECT_EQ(a.pages_kept_exact, b.pages_kept_exact);
      EXPECT_EQ(a.bytes_in_use, b.bytes_in_use);
      if (HasFatalFailure()) return;
    }
    const DeviceKvStats st = dev->stats();
    if (lossy) {
      EXPECT_GT(st.pages_kept_exact, 0) << "the poisoned rows must keep pages exact";
      EXPECT_GT(st.lossy_pages_in_use, st.raw_pages_in_use);
    } else {
      EXPECT_GT(st.blocks_not_fitting, 0) << "the spread rows must not fit their slots";
      EXPECT_GT(st.slots_in_use, st.raw_pages_in_use);
    }
    // A free and a reset with results pending: the pages all come back.
    const std::vector<float> one = random_rows(rng, 16);
    ASSERT_TRUE(dev->write(0, 0, one.data(), one.data(), 16).ok);
    ASSERT_GT(dev->pending_encodes(), 0u);
    ASSERT_TRUE(dev->free_sequence(0).ok);
    EXPECT_EQ(dev->pending_encodes(), 0u);
    ASSERT_TRUE(dev->write(1, 0, one.data(), one.data(), 16).ok);
    ASSERT_GT(dev->pending_encodes(), 0u);
    ASSERT_TRUE(dev->reset().ok);
    EXPECT_EQ(dev->pending_encodes(), 0u);
    EXPECT_EQ(dev->stats().raw_pages_in_use, 0);
    EXPECT_EQ(dev->stats().slots_in_use + dev->stats().lossy_pages_in_use, 0);
    EXPECT_EQ(dev->stats().blocks_not_fitting + dev->stats().pages_kept_exact, 0);
  }
}

// The placement launch's refusals (no device needed).
TEST(PlaceEncodedPages, BadArgumentsAreRefusedBeforeAnyLaunch) {
  PlaceEncodedArgs a;
  a.n = -1;
  EXPECT_EQ(check_place_encoded_pages(a).code, StatusCode::kInvalidArgument);
  a.n = 0;
  EXPECT_TRUE(check_place_encoded_pages(a).ok) << "nothing to place";
  a.n = 3;
  EXPECT_EQ(check_place_encoded_pages(a).code, StatusCode::kInvalidArgument) << "null arrays";
  int32_t fake = 0;
  TablePlacement p;
  a.tables = &fake;
  a.placements = &p;
  a.kind = EncodeResult::kLossyStatus;
  EXPECT_EQ(check_place_encoded_pages(a).code, StatusCode::kInvalidArgument) << "no results for a kind that reads them";
  a.kind = EncodeResult(7);
  EXPECT_EQ(check_place_encoded_pages(a).code, StatusCode::kInvalidArgument) << "an unknown kind";
  a.kind = EncodeResult::kAlways;
  EXPECT_TRUE(check_place_encoded_pages(a).ok);
  CopyTableRowsArgs c;
  c.n = -2;
  EXPECT_EQ(copy_table_rows(c, nullptr).code, StatusCode::kInvalidArgument);
  c.n = 2;
  c.row_entries = 4;
  EXPECT_EQ(copy_table_rows(c, nullptr).code, StatusCode::kInvalidArgument) << "null arrays";
}

TEST(DeviceKvCache, BadConfigurationsAreRefusedBeforeAnyAllocation) {
  std::unique_ptr<DeviceKvCache> dev;
  DeviceKvCacheConfig c = config_of(KvScheme::kBf16, 64);
  c.scheme = KvScheme::kRtn8;
  CudaStatus s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("rtn8"), std::string::npos) << s.message;
  c.scheme = KvScheme::kDither8;
  c.outlier_pairs = kMaxOutlierPairsOnDevice + 1;
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("outlier pairs"), std::string::npos) << s.message;
  c.scheme = KvScheme::kFp8E4M3;
  c.outlier_pairs = 2;
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("dither8 only"), std::string::npos) << s.message;
  // dither8's device pages are fragment-major (the scheme table's cuda_fragment_pages): pages of
  // 16 tokens only, refused by name otherwise.
  c.scheme = KvScheme::kDither8;
  c.outlier_pairs = -1;
  c.block_tokens = 32;
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("dither8 stores fragment-major pages of 16 tokens"), std::string::npos) << s.message;
  c.block_tokens = kT;
  c.scheme = KvScheme::kFp8E4M3;
  c.outlier_pairs = -1;
  c.head_dim = 48;  // lossy pages need head_dim a multiple of 32
  s = DeviceKvCache::create(c, &dev);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.message.find("head_dim"), std::string::npos) << s.message;
  c = config_of(KvScheme::kBf16, 64);
  c.scheme = KvScheme::kGaac;  // no calibration
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("calibration"), std::string::npos) << s.message;
  c.gaac_calibration = calibration(KvScheme::kGaacE5M2);  // another element
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  c = config_of(KvScheme::kBf16, 0);
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  c = config_of(KvScheme::kGaacE5M2, 64);
  c.head_dim = 60;  // no GAAC tiling
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("does not split into GAAC tiles"), std::string::npos) << s.message;
  if (kv_scheme_info(KvScheme::kGaac).cuda_fragment_pages) {  // gaac in GAAC device pages
    c = config_of(KvScheme::kGaac, 64);
    c.head_dim = 60;  // fragment-major: head_dim a multiple of 16
    s = DeviceKvCache::create(c, &dev);
    EXPECT_EQ(s.code, StatusCode::kUnsupported);
    EXPECT_NE(s.message.find("stores fragment-major pages"), std::string::npos) << s.message;
    c = config_of(KvScheme::kGaac, 64);
    c.head_dim = 32;  // a multiple of 16, but no GAAC device page at 32
    s = DeviceKvCache::create(c, &dev);
    EXPECT_EQ(s.code, StatusCode::kUnsupported);
  }
  c = config_of(KvScheme::kBf16, 64);
  c.index_record_bytes = 20;  // not a RaBitQ record's size
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("index_record_bytes 20"), std::string::npos) << s.message;
  c = config_of(KvScheme::kBf16, int64_t(1) << 31);  // lengths are int32 on the device
  s = DeviceKvCache::create(c, &dev);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("2^31"), std::string::npos) << s.message;
  EXPECT_EQ(dev, nullptr);
}

}  // namespace
}  // namespace certkv::cache::cuda

namespace certkv::cache::cuda {
namespace {

// append_rows refuses, before any launch, what its kernel would index past (runs without a device:
// no pointer below is dereferenced).
TEST(AppendRows, BadArgumentsAreRefusedBeforeAnyLaunch) {
  auto address = [](uintptr_t a) { return reinterpret_cast<uint8_t*>(a); };
  AppendRowsArgs good;
  good.k_rows = reinterpret_cast<const float*>(address(0x1000));
  good.v_rows = reinterpret_cast<const float*>(address(0x1800));
  good.n = 20;
  good.first = 5;
  good.n_kv_heads = 2;
  good.head_dim = 64;
  good.block_tokens = 16;
  good.tables = reinterpret_cast<const int32_t*>(address(0x2000));
  good.table_stride = 2;  // 32 tokens
  good.raw_pages = address(0x3000);
  good.raw_page_stride = 16 * 64 * 2;
  good.n_raw_pages = 4;
  good.length = reinterpret_cast<int32_t*>(address(0x4000));
  EXPECT_TRUE(check_append_rows(good).ok) << check_append_rows(good).message;
  auto refused = [&](auto change, const char* what) {
    AppendRowsArgs a = good;
    change(a);
    const CudaStatus s = check_append_rows(a);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << what;
    EXPECT_EQ(append_rows(a, nullptr).code, StatusCode::kInvalidArgument) << what << ": refused before the launch";
  };
  refused([](AppendRowsArgs& a) { a.n = -1; }, "negative n");
  refused([](AppendRowsArgs& a) { a.v_rows = nullptr; }, "no V rows");
  {
    AppendRowsArgs two[2] = {good, good};
    two[1].k_rows = nullptr;
    EXPECT_EQ(append_rows_batch(two, 2, nullptr).code, StatusCode::kInvalidArgument) << "a bad write in a batch";
    EXPECT_EQ(append_rows_batch(two, kMaxAppendBatch + 1, nullptr).code, StatusCode::kInvalidArgument) << "too many";
  }
  refused([](AppendRowsArgs& a) { a.block_tokens = 0; }, "block_tokens 0");
  refused([](AppendRowsArgs& a) { a.head_dim = 0; }, "head_dim 0");
  refused([](AppendRowsArgs& a) { a.n_kv_heads = 0; }, "no kv heads");
  refused([](AppendRowsArgs& a) { a.first = 13; }, "rows past the tables (13 + 20 > 32)");
  refused([](AppendRowsArgs& a) { a.raw_page_stride = 16 * 64 * 2 - 16; }, "raw stride below a bf16 page");
  refused([](AppendRowsArgs& a) { a.element = format::GaacElement::kFp8E4M3; }, "E4M3 rows");
  refused([](AppendRowsArgs& a) { a.tables = nullptr; }, "no tables");
  refused([](AppendRowsArgs& a) { a.length = nullptr; }, "no length");
  AppendRowsArgs e5m2 = good;
  e5m2.element = format::GaacElement::kFp8E5M2;
  e5m2.raw_page_stride = 16 * 64;  // one byte per element
  EXPECT_TRUE(check_append_rows(e5m2).ok) << check_append_rows(e5m2).message;
  // Fragment-major raw pages (dither8's): bf16 pages of 16 tokens, head_dim a multiple of 16.
  AppendRowsArgs fragments = good;
  fragments.fragment_major = true;
  EXPECT_TRUE(check_append_rows(fragments).ok) << check_append_rows(fragments).message;
  refused([](AppendRowsArgs& a) { a.fragment_major = true; a.element = format::GaacElement::kFp8E5M2; a.raw_page_stride = 16 * 64; },
          "fragment-major E5M2 pages");
  refused([](AppendRowsArgs& a) { a.fragment_major = true; a.block_tokens = 8; a.table_stride = 4; },
          "fragment-major pages of 8 tokens");
  refused([](AppendRowsArgs& a) { a.fragment_major = true; a.head_dim = 40; a.raw_page_stride = 16 * 40 * 2; },
          "fragment-major pages of head_dim 40");
  AppendRowsArgs eight = fragments;
  eight.block_tokens = 8;
  eight.table_stride = 4;
  const CudaStatus s = check_append_rows(eight);
  EXPECT_NE(s.message.find("fragment-major raw pages are bf16 pages of 16 tokens"), std::string::npos) << s.message;
}

// The key index's records reserved per (slot, kv head) grow on demand: every slot's records are
// kept through a growth (one strided copy), the stride doubles in whole blocks up to the context,
// and a reservation past the context is refused, the records unchanged.
TEST(DeviceKvCache, IndexRecordsGrowKeepingEverySlotsRecords) {
  CERTKV_NEED_CUDA_DEVICE();
  DeviceKvCacheConfig c = config_of(KvScheme::kBf16, 256);
  c.sequences = 3;
  c.index_record_bytes = 32;
  c.index_record_tokens = 20;  // two blocks
  std::unique_ptr<DeviceKvCache> dev;
  ASSERT_TRUE(DeviceKvCache::create(c, &dev).ok);
  DeviceLayerView v = dev->view(1);
  ASSERT_EQ(v.index_record_stride, 32);
  const size_t rows = 3 * kHeads;  // (slot, kv head) lists
  std::vector<uint8_t> bytes(rows * 32 * 32);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 37 + 11);
  ASSERT_EQ(cudaMemcpy(v.index_records, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_TRUE(dev->reserve_index_records(32).ok);  // already reserved: nothing moves
  EXPECT_EQ(dev->view(1).index_records, v.index_records);
  ASSERT_TRUE(dev->reserve_index_records(33).ok);  // doubled: 64
  v = dev->view(1);
  ASSERT_EQ(v.index_record_stride, 64);
  std::vector<uint8_t> back(rows * 64 * 32);
  ASSERT_EQ(cudaMemcpy(back.data(), v.index_records, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t r = 0; r < rows; ++r)
    ASSERT_EQ(std::memcmp(&back[r * 64 * 32], &bytes[r * 32 * 32], 32 * 32), 0) << "list " << r;
  ASSERT_TRUE(dev->reserve_index_records(200).ok);  // past a doubling: whole blocks, 208
  EXPECT_EQ(dev->view(0).index_record_stride, 208);
  ASSERT_TRUE(dev->reserve_index_records(256).ok);  // capped at the context
  EXPECT_EQ(dev->view(0).index_record_stride, 256);
  EXPECT_EQ(dev->reserve_index_records(257).code, StatusCode::kInvalidArgument);
  v = dev->view(1);
  back.assign(rows * 256 * 32, 0);
  ASSERT_EQ(cudaMemcpy(back.data(), v.index_records, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t r = 0; r < rows; ++r)
    ASSERT_EQ(std::memcmp(&back[r * 256 * 32], &bytes[r * 32 * 32], 32 * 32), 0) << "list " << r;
  // More slots after a growth: the lists keep the grown stride and every record.
  for (int i = 0; i < 8; ++i) {
    int more = -1;
    ASSERT_TRUE(dev->create_sequence(&more).ok);
  }
  v = dev->view(1);
  EXPECT_EQ(v.index_record_stride, 256);
  ASSERT_EQ(cudaMemcpy(back.data(), v.index_records, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t r = 0; r < rows; ++r)
    ASSERT_EQ(std::memcmp(&back[r * 256 * 32], &bytes[r * 32 * 32], 32 * 32), 0) << "list " << r;
}

// The asynchronous copies through page-locked staging: a round trip after one wait, and copies
// past a buffer refused before any CUDA call (that part runs without a device).
TEST(DeviceBuffer, AsyncCopiesThroughPinnedStagingRoundTrip) {
  DeviceBuffer empty;
  uint8_t byte = 0;
  EXPECT_EQ(empty.upload_async(0, &byte, 1, nullptr).code, StatusCode::kOutOfRange);
  EXPECT_EQ(empty.download_async(0, &byte, 1, nullptr).code, StatusCode::kOutOfRange);
  CERTKV_NEED_CUDA_DEVICE();
  constexpr size_t kBytes = 4096 + 12;
  DeviceBuffer dev;
  ASSERT_TRUE(DeviceBuffer::allocate(kBytes, &dev).ok);
  PinnedBuffer staging;
  ASSERT_TRUE(PinnedBuffer::allocate(2 * kBytes, &staging).ok);
  ASSERT_GE(staging.size(), 2 * kBytes);
  for (size_t i = 0; i < kBytes; ++i) staging.data()[i] = uint8_t(i * 131 + 7);
  std::memset(staging.data() + kBytes, 0, kBytes);
  ASSERT_TRUE(dev.upload_async(0, staging.data(), kBytes, nullptr).ok);
  ASSERT_TRUE(dev.download_async(12, staging.data() + kBytes, kBytes - 12, nullptr).ok);
  ASSERT_TRUE(synchronize_stream(nullptr).ok);
  for (size_t i = 0; i + 12 < kBytes; ++i) ASSERT_EQ(staging.data()[kBytes + i], uint8_t((i + 12) * 131 + 7)) << i;
  EXPECT_EQ(dev.download_async(12, staging.data(), kBytes - 11, nullptr).code, StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace certkv::cache::cuda
