// The key index on the device against its references on the host: the key centroid against the
// CPU backend's mean (double sum in token order), every record against index::rabitq_encode_keys
// over the same bf16 keys, byte for byte, and every quantized query against
// device_rabitq_query(index::rabitq_quantize_query), field by field and bit for bit; Haar and
// randomized Hadamard rotations, head_dim 64 and 128, ragged lengths (1, 3, 17, 129, 501 tokens,
// a partial last block), ranges that start mid-sequence, rows read through permuted table rows;
// bad input (refusals before launch, and bad keys, rows and margins counted on the device); the
// sums behind a query centroid against index::rabitq_add_query_sums, bit for bit.
// Needs a CUDA device for everything but the refusals.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention/cuda/device_kv.h"
#include "attention/cuda/key_index_cuda.h"
#include "core/cuda_test_support.h"
#include "format/numeric.h"
#include "index/rabitq.h"
#include "index/rotation.h"

namespace certkv::attention::cuda {
namespace {

using cache::cuda::DeviceBuffer;

uint32_t bits_of(float f) { return format::float_to_bits(f); }

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer d;
  EXPECT_TRUE(DeviceBuffer::allocate(std::max<size_t>(v.size() * sizeof(T), 16), &d).ok);
  if (!v.empty()) {
    EXPECT_TRUE(d.upload(0, v.data(), v.size() * sizeof(T)).ok);
  }
  return d;
}

// The rotation's parameters on the device.
struct Rotation {
  index::Rotation host;
  DeviceBuffer params;
  DeviceRotation device;
  Rotation(index::RotationKind kind, int d, uint64_t seed) : host(kind, d, seed) {
    params = upload(kind == index::RotationKind::kHaar ? host.p_transpose() : host.signs());
    device.kind = kind;
    (kind == index::RotationKind::kHaar ? device.p_transpose : device.signs) =
        reinterpret_cast<const float*>(params.data());
  }
};

struct Case {
  int head_dim, n_kv_heads;
  std::vector<int64_t> lens;
  index::RotationKind rotation;
  uint32_t seed;
};

// Keys of a few strong directions plus noise (as real post-RoPE keys are far from centered).
HostLayerKv make_keys(const Case& c) {
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int D = c.head_dim;
  std::vector<float> directions(size_t(4) * D);
  for (float& x : directions) x = 2.f * normal(rng);
  HostLayerKv kv;
  kv.batch = int(c.lens.size());
  kv.n_kv_heads = c.n_kv_heads;
  kv.head_dim = D;
  kv.lens = c.lens;
  for (int64_t len : c.lens) {
    const size_t n = size_t(c.n_kv_heads) * size_t(len) * static_cast<size_t>(D);
    kv.k.emplace_back(n);
    kv.v.emplace_back(n);
    for (size_t i = 0; i < n; i += static_cast<size_t>(D)) {
      const int dir = int(rng() % 4);
      for (int d = 0; d < D; ++d) {
        kv.k.back()[i + size_t(d)] = format::float_to_bf16(directions[size_t(dir) * D + d] + normal(rng));
        kv.v.back()[i + size_t(d)] = format::float_to_bf16(normal(rng));
      }
    }
  }
  return kv;
}

template <int D>
void check_records(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "D " << D << " heads " << c.n_kv_heads << " rotation "
                                    << index::rotation_kind_name(c.rotation));
  const int B = int(c.lens.size()), H = c.n_kv_heads;
  const HostLayerKv kv = make_keys(c);
  DeviceKv dkv;
  ASSERT_TRUE(DeviceKv::build(kv, DeviceKvOptions{}, &dkv).ok);
  PagedDecodeParams pp;
  dkv.describe(&pp);
  Rotation rot(c.rotation, D, 99 + c.seed);

  int64_t stride = 16;
  for (int64_t len : c.lens) stride = std::max<int64_t>(stride, (len + 15) / 16 * 16);
  // c_q random per (row, head), given to the centroid kernel; c_k computed there.
  std::mt19937 rng(c.seed + 1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> centroids(size_t(B) * H * 2 * D, std::nanf(""));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < D; ++i) centroids[((size_t(b) * H + h) * 2) * D + i] = normal(rng);
  DeviceBuffer centroids_d = upload(std::vector<float>(centroids.size(), std::nanf("")));
  std::vector<float> query_centroids(size_t(B) * H * D);  // one whole-sequence range per row, in row order
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < D; ++i)
        query_centroids[(size_t(b) * H + h) * D + i] = centroids[((size_t(b) * H + h) * 2) * D + i];
  DeviceBuffer query_centroids_d = upload(query_centroids);
  std::vector<uint8_t> poison(size_t(B) * H * size_t(stride) * sizeof(index::RabitqRecord<D>), 0xa5);
  DeviceBuffer records_d = upload(poison);
  DeviceBuffer error_d = upload(std::vector<uint32_t>{0});

  KeyIndexBuildParams p;
  p.n_kv_heads = H;
  p.head_dim = D;
  p.k_pages = pp.k_pages;
  p.k_page_stride = pp.k_page_stride;
  p.n_k_pages = pp.n_k_pages;
  p.k_table = pp.k_table;
  p.table_stride = pp.table_stride;
  p.table_row_stride = pp.table_row_stride > 0 ? pp.table_row_stride : int64_t(H) * pp.table_stride;
  p.n_table_rows = B;
  p.centroids = reinterpret_cast<float*>(centroids_d.data());
  p.query_centroids = reinterpret_cast<const float*>(query_centroids_d.data());
  p.rotation = rot.device;
  p.records = records_d.data();
  p.record_stride = stride;
  p.error_word = reinterpret_cast<uint32_t*>(error_d.data());
  // Centroids over each whole sequence; then records in two ranges per sequence, the second
  // starting at a block boundary inside it (a lazy update's shape).
  std::vector<KeyIndexRange> whole, parts;
  for (int b = 0; b < B; ++b) {
    whole.push_back({b, 0, int32_t(c.lens[size_t(b)])});
    const int32_t cut = int32_t(c.lens[size_t(b)] / 2 / 16 * 16);
    if (cut > 0) parts.push_back({b, 0, cut});
    parts.push_back({b, cut, int32_t(c.lens[size_t(b)])});
  }
  DeviceBuffer whole_d = upload(whole), parts_d = upload(parts);
  p.ranges = reinterpret_cast<const KeyIndexRange*>(whole_d.data());
  p.n_ranges = int(whole.size());
  p.max_range_tokens = stride;
  ASSERT_TRUE(set_key_centroids(p).ok);
  p.ranges = reinterpret_cast<const KeyIndexRange*>(parts_d.data());
  p.n_ranges = int(parts.size());
  const CudaStatus s = build_key_records(p);
  ASSERT_TRUE(s.ok) << s.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  uint32_t errors = 1;
  ASSERT_TRUE(error_d.download(0, &errors, 4).ok);
  EXPECT_EQ(errors, 0u);
  std::vector<float> got_centroids(centroids.size());
  ASSERT_TRUE(centroids_d.download(0, got_centroids.data(), got_centroids.size() * 4).ok);
  std::vector<index::RabitqRecord<D>> got(size_t(B) * H * size_t(stride));
  ASSERT_TRUE(records_d.download(0, got.data(), got.size() * sizeof(got[0])).ok);

  int64_t nonzero_codes = 0, zero_norms = 0, records_checked = 0;
  for (int b = 0; b < B; ++b) {
    const int64_t len = c.lens[size_t(b)];
    for (int h = 0; h < H; ++h) {
      std::vector<float> keys(size_t(len) * D);
      for (size_t i = 0; i < keys.size(); ++i) keys[i] = format::bf16_to_float(kv.k[size_t(b)][size_t(h) * keys.size() + i]);
      // The CPU backend's centroid: the mean of the keys, summed in double in token order.
      std::vector<double> sum(static_cast<size_t>(D), 0.0);
      for (int64_t t = 0; t < len; ++t)
        for (int i = 0; i < D; ++i) sum[size_t(i)] += keys[size_t(t) * D + size_t(i)];
      std::vector<float> c_q(static_cast<size_t>(D)), c_k(static_cast<size_t>(D));
      for (int i = 0; i < D; ++i) {
        c_k[size_t(i)] = float(sum[size_t(i)] / double(len));
        c_q[size_t(i)] = centroids[((size_t(b) * H + h) * 2) * D + size_t(i)];
        ASSERT_EQ(bits_of(got_centroids[((size_t(b) * H + h) * 2) * D + size_t(i)]), bits_of(c_q[size_t(i)]))
            << "c_q, row " << b << " head " << h << " channel " << i;
        ASSERT_EQ(bits_of(got_centroids[((size_t(b) * H + h) * 2 + 1) * D + size_t(i)]), bits_of(c_k[size_t(i)]))
            << "c_k, row " << b << " head " << h << " channel " << i;
      }
      const index::RabitqHead head(c_q, c_k, rot.host);
      std::vector<index::RabitqRecord<D>> want(static_cast<size_t>(len));
      index::rabitq_encode_keys<D>(head, keys.data(), len, want.data());
      for (int64_t t = 0; t < len; ++t) {
        const index::RabitqRecord<D>& g = got[(size_t(b) * H + h) * size_t(stride) + size_t(t)];
        ASSERT_EQ(std::memcmp(&g, &want[size_t(t)], sizeof(g)), 0)
            << "record of row " << b << " head " << h << " token " << t << ": alpha " << g.alpha << " vs "
            << want[size_t(t)].alpha << ", norm " << g.norm_k_centered << " vs " << want[size_t(t)].norm_k_centered
            << ", popcount " << g.code_popcount << " vs " << want[size_t(t)].code_popcount;
        nonzero_codes += g.code[0] != 0;
        zero_norms += g.norm_k_centered == 0.f;
        ++records_checked;
      }
    }
  }
  // Real records: codes set, and the one-token sequence's key is its own centroid (norm 0).
  EXPECT_GT(nonzero_codes, records_checked / 2);
  EXPECT_EQ(zero_norms, int64_t(H));
}

TEST(KeyIndexCuda, CentroidsAndRecordsAreTheCpuRecordsBitForBit) {
  CERTKV_NEED_CUDA_DEVICE();
  const std::vector<int64_t> lens{1, 3, 17, 129, 501};
  for (index::RotationKind rot : {index::RotationKind::kHaar, index::RotationKind::kRandomizedHadamard}) {
    check_records<64>({64, 3, lens, rot, 11});
    check_records<128>({128, 2, lens, rot, 12});
  }
}

template <int D>
void check_queries(index::RotationKind kind, double deviations, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "D " << D << " rotation " << index::rotation_kind_name(kind) << " deviations "
                                    << deviations);
  const int B = 5, H = 3, G = 3, Hq = H * G, rows = 7;
  const float scale = 1.f / std::sqrt(float(D));
  Rotation rot(kind, D, 5 + seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> centroids(size_t(rows) * H * 2 * D);
  for (float& x : centroids) x = normal(rng);
  const std::vector<int32_t> table_rows{6, 0, 3, 3, 1};  // permuted, one row twice
  std::vector<float> q(size_t(B) * Hq * D);
  for (float& x : q) x = 1.5f * normal(rng) + 0.5f;
  // Row 1's head 4 equals its centroid: norm 0, no levels.
  for (int i = 0; i < D; ++i) q[(size_t(1) * Hq + 4) * D + i] = centroids[((size_t(0) * H + 4 / G) * 2) * D + i];
  std::vector<uint64_t> seeds(size_t(B) * Hq);
  for (uint64_t& s : seeds) s = (uint64_t(rng()) << 32) | rng();
  DeviceBuffer centroids_d = upload(centroids), rows_d = upload(table_rows), q_d = upload(q), seeds_d = upload(seeds);
  DeviceBuffer out_d = upload(std::vector<uint8_t>(size_t(B) * Hq * sizeof(DeviceRabitqQuery), 0xa5));
  DeviceBuffer error_d = upload(std::vector<uint32_t>{0});
  QueryQuantizeParams p;
  p.batch = B;
  p.n_q_heads = Hq;
  p.n_kv_heads = H;
  p.head_dim = D;
  p.q = reinterpret_cast<const float*>(q_d.data());
  p.table_rows = reinterpret_cast<const int32_t*>(rows_d.data());
  p.n_table_rows = rows;
  p.centroids = reinterpret_cast<const float*>(centroids_d.data());
  p.rotation = rot.device;
  p.rounding_seeds = reinterpret_cast<const uint64_t*>(seeds_d.data());
  p.deviations = deviations;
  p.sm_scale = scale;
  p.queries = reinterpret_cast<DeviceRabitqQuery*>(out_d.data());
  p.error_word = reinterpret_cast<uint32_t*>(error_d.data());
  const CudaStatus s = quantize_queries(p);
  ASSERT_TRUE(s.ok) << s.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  uint32_t errors = 1;
  ASSERT_TRUE(error_d.download(0, &errors, 4).ok);
  EXPECT_EQ(errors, 0u);
  std::vector<DeviceRabitqQuery> got(size_t(B) * Hq);
  ASSERT_TRUE(out_d.download(0, got.data(), got.size() * sizeof(got[0])).ok);
  int64_t levels = 0;
  for (int b = 0; b < B; ++b)
    for (int hq = 0; hq < Hq; ++hq) {
      const float* c = centroids.data() + (size_t(table_rows[size_t(b)]) * H + size_t(hq / G)) * 2 * D;
      const index::RabitqHead head(std::vector<float>(c, c + D), std::vector<float>(c + D, c + 2 * D), rot.host);
      const float* qh = q.data() + (size_t(b) * Hq + size_t(hq)) * D;
      const index::RabitqQuery<D> rq = index::rabitq_quantize_query<D>(head, qh, seeds[size_t(b) * Hq + size_t(hq)]);
      const DeviceRabitqQuery want = device_rabitq_query<D>(
          head, rq, index::rabitq_logit_deviation_scale(deviations, scale, rq.norm_q_centered, D));
      const DeviceRabitqQuery& g = got[size_t(b) * Hq + size_t(hq)];
      SCOPED_TRACE(::testing::Message() << "row " << b << " head " << hq);
      for (int bit = 0; bit < index::kRabitqQueryBits; ++bit)
        for (int w = 0; w < 2; ++w) EXPECT_EQ(g.planes[bit][w], want.planes[bit][w]) << "plane " << bit << " word " << w;
      EXPECT_EQ(g.sum_q_u, want.sum_q_u);
      EXPECT_EQ(bits_of(g.delta), bits_of(want.delta));
      EXPECT_EQ(bits_of(g.q_l), bits_of(want.q_l));
      EXPECT_EQ(bits_of(g.norm_q_centered), bits_of(want.norm_q_centered));
      EXPECT_EQ(bits_of(g.q_dot_ck), bits_of(want.q_dot_ck));
      EXPECT_EQ(bits_of(g.cq_dot_ck), bits_of(want.cq_dot_ck));
      EXPECT_EQ(bits_of(g.margin_scale), bits_of(want.margin_scale));
      levels += want.sum_q_u;
      if (b == 1 && hq == 4) {
        EXPECT_EQ(want.norm_q_centered, 0.f);
      }
    }
  EXPECT_GT(levels, int64_t(B) * Hq * D);  // real quantized queries, not zeros
}

TEST(KeyIndexCuda, QueriesAreTheCpuQuantizationBitForBit) {
  CERTKV_NEED_CUDA_DEVICE();
  for (index::RotationKind kind : {index::RotationKind::kHaar, index::RotationKind::kRandomizedHadamard})
    for (double deviations : {0.0, 1.5}) {
      check_queries<64>(kind, deviations, 21);
      check_queries<128>(kind, deviations, 22);
    }
}

// add_query_sums against index::rabitq_add_query_sums: sequences of ragged rows (0, 1, 17, 300)
// taken from several places of q (not in order, one skipped), GQA 1, 4 and 7, head_dims 64, 128
// and 96, the sums starting from earlier values and taking two calls: the same doubles, bit for bit.
TEST(KeyIndexCuda, QuerySumsAreTheCpuSumsBitForBit) {
  CERTKV_NEED_CUDA_DEVICE();
  struct QueryCase {
    int n_kv_heads, group, head_dim;
  };
  for (const QueryCase& c : {QueryCase{3, 1, 64}, QueryCase{2, 4, 128}, QueryCase{2, 7, 96}}) {
    SCOPED_TRACE(::testing::Message() << "kv heads " << c.n_kv_heads << " group " << c.group << " D " << c.head_dim);
    const int Hq = c.n_kv_heads * c.group, D = c.head_dim;
    const size_t qrow = size_t(Hq) * size_t(D), srow = size_t(c.n_kv_heads) * size_t(D);
    std::mt19937 rng(uint32_t(Hq * 1000 + D));
    std::normal_distribution<float> normal(0.f, 1.f);
    // Rows of q: [0, 300) sequence 3's, [300, 317) sequence 0's, [317, 318) sequence 1's; sequence
    // 2 has none (an empty range).
    const std::vector<int64_t> ranges{300, 317, 317, 318, 318, 318, 0, 300};
    std::vector<float> q(318 * qrow);
    for (size_t i = 0; i < q.size(); ++i) q[i] = (i % 5 == 0 ? 3.f : 0.f) + normal(rng);
    std::vector<double> want(4 * srow);
    for (double& x : want) x = double(normal(rng)) * 100.0;  // sums noted before
    DeviceBuffer q_d = upload(q), ranges_d = upload(ranges), sums_d = upload(want);
    for (int call = 0; call < 2; ++call) {
      for (int b = 0; b < 4; ++b)
        index::rabitq_add_query_sums(q.data() + size_t(ranges[size_t(2 * b)]) * qrow,
                                     ranges[size_t(2 * b + 1)] - ranges[size_t(2 * b)], Hq, c.n_kv_heads, D,
                                     want.data() + size_t(b) * srow);
      QuerySumParams p;
      p.n_seqs = 4;
      p.n_q_heads = Hq;
      p.n_kv_heads = c.n_kv_heads;
      p.head_dim = D;
      p.q = reinterpret_cast<const float*>(q_d.data());
      p.row_ranges = reinterpret_cast<const int64_t*>(ranges_d.data());
      p.sums = reinterpret_cast<double*>(sums_d.data());
      ASSERT_TRUE(add_query_sums(p).ok);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    std::vector<double> got(want.size());
    ASSERT_TRUE(sums_d.download(0, got.data(), got.size() * sizeof(double)).ok);
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += std::memcmp(&got[i], &want[i], sizeof(double)) != 0;
    EXPECT_EQ(differ, 0u) << "of " << got.size();
  }
}

TEST(KeyIndexCuda, BadValuesOnTheDeviceAreCountedNotUsed) {
  CERTKV_NEED_CUDA_DEVICE();
  constexpr int D = 64;
  Case c{D, 1, {40}, index::RotationKind::kHaar, 31};
  HostLayerKv kv = make_keys(c);
  kv.k[0][size_t(20) * D + 5] = 0x7f80;  // +inf in token 20
  DeviceKv dkv;
  ASSERT_TRUE(DeviceKv::build(kv, DeviceKvOptions{}, &dkv).ok);
  PagedDecodeParams pp;
  dkv.describe(&pp);
  Rotation rot(index::RotationKind::kHaar, D, 3);
  DeviceBuffer centroids_d = upload(std::vector<float>(2 * D, 0.25f));
  DeviceBuffer records_d = upload(std::vector<uint8_t>(48 * sizeof(index::RabitqRecord<D>), 0));
  DeviceBuffer error_d = upload(std::vector<uint32_t>{0});
  // Token 20's key, and a range of a row outside the tables.
  DeviceBuffer ranges_d = upload(std::vector<KeyIndexRange>{{0, 16, 32}, {5, 0, 16}});
  KeyIndexBuildParams p;
  p.n_kv_heads = 1;
  p.head_dim = D;
  p.k_pages = pp.k_pages;
  p.k_page_stride = pp.k_page_stride;
  p.n_k_pages = pp.n_k_pages;
  p.k_table = pp.k_table;
  p.table_stride = pp.table_stride;
  p.table_row_stride = pp.table_stride;
  p.n_table_rows = 1;
  p.ranges = reinterpret_cast<const KeyIndexRange*>(ranges_d.data());
  p.n_ranges = 2;
  p.max_range_tokens = 48;
  p.centroids = reinterpret_cast<float*>(centroids_d.data());
  p.rotation = rot.device;
  p.records = records_d.data();
  p.record_stride = 48;
  p.error_word = reinterpret_cast<uint32_t*>(error_d.data());
  ASSERT_TRUE(build_key_records(p).ok);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  uint32_t errors = 0;
  ASSERT_TRUE(error_d.download(0, &errors, 4).ok);
  EXPECT_EQ(errors, 2u);  // the key, the row
  std::vector<index::RabitqRecord<D>> got(48);
  ASSERT_TRUE(records_d.download(0, got.data(), got.size() * sizeof(got[0])).ok);
  EXPECT_EQ(got[20].alpha, 0.f);  // left unwritten
  EXPECT_GT(got[21].alpha, 0.f);  // its neighbours written
}

TEST(KeyIndexCuda, RefusesBadParametersBeforeLaunch) {
  KeyIndexBuildParams b;
  b.n_kv_heads = 1;
  b.head_dim = 96;
  b.n_ranges = 1;
  CudaStatus s = check(b);
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("head_dim 96"), std::string::npos) << s.message;
  b.head_dim = 64;
  s = check(b);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.message.find("null"), std::string::npos) << s.message;
  QueryQuantizeParams q;
  q.batch = 1;
  q.n_q_heads = 9;
  q.n_kv_heads = 3;
  q.head_dim = 64;
  q.sm_scale = 0.125f;
  q.deviations = -1;
  s = check(q);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.message.find("deviations"), std::string::npos) << s.message;
  q.deviations = 0;
  q.n_q_heads = 8;
  s = check(q);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.message.find("not integral"), std::string::npos) << s.message;
  QuerySumParams sums;
  sums.n_seqs = 1;
  sums.n_q_heads = 8;
  sums.n_kv_heads = 3;
  sums.head_dim = 64;
  s = add_query_sums(sums);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.message.find("multiple of n_kv_heads"), std::string::npos) << s.message;
  sums.n_q_heads = 9;
  sums.head_dim = 2048;
  s = add_query_sums(sums);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.message.find("head_dim"), std::string::npos) << s.message;
  sums.head_dim = 64;
  s = add_query_sums(sums);
  EXPECT_FALSE(s.ok);
  EXPECT_NE(s.message.find("null"), std::string::npos) << s.message;
  sums.n_seqs = 0;  // nothing to do
  EXPECT_TRUE(add_query_sums(sums).ok);
}

}  // namespace
}  // namespace certkv::attention::cuda
