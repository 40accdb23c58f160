#include "model/matmul_tiles.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/thread_pool.h"
#include "format/numeric.h"
#include "model/ggml_type.h"
#include "model/matmul.h"
#include "model/model.h"
#include "model/quantized_dot.h"

namespace certkv::model {
namespace {

using format::GgmlType;

const GgmlType kTileTypes[] = {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                               GgmlType::kQ8_0};
const GgmlType kSuperBlockTypes[] = {GgmlType::kQ4_K, GgmlType::kQ5_K};

bool k_quant(GgmlType t) { return t == GgmlType::kQ4_K || t == GgmlType::kQ5_K; }

// Random codes, scales d in +-[0.001, 0.1] (mins in [-0.1, 0.1] for Q4_1, Q5_1); every 7th block gets
// an extreme scale (65504, a subnormal, or 0) so that the products' float terms cover the range.
std::vector<uint8_t> random_weights(GgmlType type, int64_t n_in, int64_t n_out, std::mt19937& rng) {
  const size_t block_bytes = ggml_block_bytes(type);
  std::vector<uint8_t> data(ggml_row_bytes(type, n_in) * size_t(n_out));
  for (auto& b : data) b = uint8_t(rng());
  std::uniform_real_distribution<float> scale(0.001f, 0.1f), min(-0.1f, 0.1f);
  const float extreme[] = {65504.f, 3e-7f, 0.f};
  for (size_t b = 0; b < data.size() / block_bytes; ++b) {
    uint8_t* p = data.data() + b * block_bytes;
    const float d = b % 7 == 3 ? extreme[(b / 7) % 3] : (rng() % 2 ? 1.f : -1.f) * scale(rng);
    const uint16_t h = format::float_to_fp16(d);
    std::memcpy(p, &h, 2);
    if (type == GgmlType::kQ4_1 || type == GgmlType::kQ5_1 || k_quant(type)) {
      const uint16_t m = format::float_to_fp16(k_quant(type) ? std::fabs(min(rng)) : min(rng));
      std::memcpy(p + 2, &m, 2);
    }
  }
  return data;
}

// Activations over six decades, with an all-zero block of 32 in every token row past the first.
std::vector<float> random_activations(int64_t n_tokens, int64_t n_in, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> decade(-3.f, 3.f);
  std::vector<float> x(size_t(n_tokens * n_in));
  for (auto& v : x) v = normal(rng) * std::pow(10.f, decade(rng));
  for (int64_t t = 1; t < n_tokens; ++t) {
    const int64_t b = t % (n_in / 32);
    std::fill_n(x.begin() + t * n_in + 32 * b, 32, 0.f);
  }
  return x;
}

// Same float bits (NaN equal to NaN of any payload).
bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  uint32_t ua, ub;
  std::memcpy(&ua, &a, 4);
  std::memcpy(&ub, &b, 4);
  return ua == ub;
}

// The product read back from the records alone, in plain code: each record's codes and scales
// decoded from the layout of model/matmul_tiles.h, then the reference's expression block by
// block. It needs no tile instructions, so the layout is checked on every CPU.
std::vector<float> product_from_records_k(const WeightMatrix& w, const std::vector<uint8_t>& tiles,
                                          const float* x, int64_t n_tokens);

std::vector<float> product_from_records(const WeightMatrix& w, const std::vector<uint8_t>& tiles,
                                        const float* x, int64_t n_tokens) {
  if (k_quant(w.type)) return product_from_records_k(w, tiles, x, n_tokens);
  const int64_t nb = w.n_in / 32;
  const bool q8 = w.type == GgmlType::kQ8_0;
  const bool has_min = w.type == GgmlType::kQ4_1 || w.type == GgmlType::kQ5_1;
  const bool q5 = w.type == GgmlType::kQ5_0 || w.type == GgmlType::kQ5_1;
  const int offset = w.type == GgmlType::kQ4_0 ? 8 : w.type == GgmlType::kQ5_0 ? 16 : 0;
  const size_t codes = q8 ? 512 : q5 ? 320 : 256, record = codes + (has_min ? 128 : 64);
  std::vector<float> y(size_t(n_tokens * w.n_out));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const QuantizedActivation a = quantize_activation_ref(x + t * w.n_in, w.n_in, 32);
    for (int64_t o = 0; o < w.n_out; ++o) {
      const int64_t g = o / 16, n = o % 16;
      float sum = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* rec = tiles.data() + size_t(g * nb + b) * record;
        int32_t isum = 0;
        for (int k = 0; k < 32; ++k) {
          int c;
          if (q8) {
            c = int8_t(rec[64 * (k / 4) + 4 * n + k % 4]);
          } else {
            const uint8_t byte = rec[64 * ((k % 16) / 4) + 4 * n + k % 4];
            c = k < 16 ? byte & 0xF : byte >> 4;
            if (q5) {
              const int p = 64 * (k / 4) + 4 * int(n) + k % 4;  // the code's byte in the B tile
              c |= ((rec[256 + p / 8] >> (p % 8)) & 1) << 4;
            }
            c -= offset;
          }
          isum += c * a.q[size_t(32 * b + k)];
        }
        float dw, mw = 0;
        std::memcpy(&dw, rec + codes + 4 * n, 4);
        if (has_min) std::memcpy(&mw, rec + codes + 64 + 4 * n, 4);
        float term = (dw * a.d[size_t(b)]) * float(isum);
        if (has_min) term = term + mw * a.s[size_t(b)];
        sum = sum + term;
      }
      y[size_t(t * w.n_out + o)] = sum;
    }
  }
  return y;
}

// Q4_K and Q5_K records (model/matmul_tiles.cc, k_scales_at): the sub-blocks' nibbles in pairs,
// Q5_K's fifth bits, the scales and mins as bytes, d and dmin as floats.
std::vector<float> product_from_records_k(const WeightMatrix& w, const std::vector<uint8_t>& tiles,
                                          const float* x, int64_t n_tokens) {
  const int64_t nsb = w.n_in / 256;
  const bool q5 = w.type == GgmlType::kQ5_K;
  const size_t scales = q5 ? 2560 : 2048, record = scales + 384;
  std::vector<float> y(size_t(n_tokens * w.n_out));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const QuantizedActivation a = quantize_activation_ref(x + t * w.n_in, w.n_in, 256);
    for (int64_t o = 0; o < w.n_out; ++o) {
      const int64_t g = o / 16, n = o % 16;
      float sum = 0;
      for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t* rec = tiles.data() + size_t(g * nsb + b) * record;
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t sub = 0;
          for (int l = 0; l < 32; ++l) {
            const int byte = 64 * (l / 4) + 4 * int(n) + l % 4;
            const uint8_t packed = rec[512 * (j / 2) + byte];
            int c = j % 2 ? packed >> 4 : packed & 0xF;
            if (q5) c |= ((rec[2048 + 64 * j + byte / 8] >> (byte % 8)) & 1) << 4;
            sub += c * a.q[size_t(256 * b + 32 * j + l)];
          }
          isum += int32_t(rec[scales + 16 * j + n]) * sub;
          msum += int32_t(rec[scales + 128 + 16 * j + n]) * a.sum32[size_t(8 * b + j)];
        }
        float d, dmin;
        std::memcpy(&d, rec + scales + 256 + 4 * n, 4);
        std::memcpy(&dmin, rec + scales + 320 + 4 * n, 4);
        sum = sum + ((d * a.d[size_t(b)]) * float(isum) - (dmin * a.d[size_t(b)]) * float(msum));
      }
      y[size_t(t * w.n_out + o)] = sum;
    }
  }
  return y;
}

struct Shape {
  int64_t n_in, n_out, n_tokens;
};
// The same for super-blocks: 1, 2, 3 and 6 of them a row.
const Shape kSuperBlockShapes[] = {{256, 1, 1},  {256, 16, 16}, {512, 17, 3}, {768, 15, 17},
                                   {1536, 40, 1}, {1536, 33, 8}, {512, 64, 70}};
// Ragged: one block, odd block counts (a lone last block), rows past the last full group of 16,
// token counts on both sides of the tile's 16 and the chunk's 64, SmolLM2's 576 and 1,536.
const Shape kShapes[] = {{32, 1, 1},   {32, 16, 16},  {96, 17, 3},    {160, 15, 17},
                         {576, 40, 1}, {576, 33, 8},  {576, 64, 70},  {1536, 20, 9},
                         {608, 5, 33}, {64, 100, 129}};

TEST(MatmulTiles, RecordsHoldTheMatrix) {
  std::mt19937 rng(1);
  std::vector<std::pair<GgmlType, Shape>> cases;
  for (GgmlType type : kTileTypes)
    for (const Shape& s : kShapes) cases.push_back({type, s});
  for (GgmlType type : kSuperBlockTypes)
    for (const Shape& s : kSuperBlockShapes) cases.push_back({type, s});
  for (const auto& [type, s] : cases) {
    SCOPED_TRACE(std::string(ggml_type_name(type)) + " " + std::to_string(s.n_in) + "x" +
                 std::to_string(s.n_out) + " tokens " + std::to_string(s.n_tokens));
    const std::vector<uint8_t> data = random_weights(type, s.n_in, s.n_out, rng);
    const WeightMatrix w = weight_matrix(type, data.data(), s.n_in, s.n_out);
    std::vector<uint8_t> tiles(matmul_tiles_bytes(w));
    tile_weights(w, tiles.data());
    const std::vector<float> x = random_activations(s.n_tokens, s.n_in, rng);
    std::vector<float> ref(size_t(s.n_tokens * s.n_out));
    matmul_quantized_ref(w, x.data(), s.n_tokens, ref.data());
    const std::vector<float> got = product_from_records(w, tiles, x.data(), s.n_tokens);
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_TRUE(same_float(got[i], ref[i])) << i << ": " << got[i] << " vs " << ref[i];
  }
}

TEST(MatmulTiles, RecordsWithAMovedCodeAreNotTheMatrix) {
  // The check above can fail: swap two rows' codes in the records (Q4_1), or clear the fifth bits
  // of a block (Q5_0), and it no longer holds.
  std::mt19937 rng(2);
  const int64_t n_in = 64, n_out = 16, n_tokens = 2;
  for (GgmlType type : {GgmlType::kQ4_1, GgmlType::kQ5_0}) {
    SCOPED_TRACE(ggml_type_name(type));
    const std::vector<uint8_t> data = random_weights(type, n_in, n_out, rng);
    const WeightMatrix w = weight_matrix(type, data.data(), n_in, n_out);
    std::vector<uint8_t> tiles(matmul_tiles_bytes(w));
    tile_weights(w, tiles.data());
    if (type == GgmlType::kQ4_1)
      std::swap_ranges(tiles.begin() + 4 * 3, tiles.begin() + 4 * 3 + 4, tiles.begin() + 4 * 4);
    else
      std::fill_n(tiles.begin() + 256, 64, uint8_t(0));
    const std::vector<float> x = random_activations(n_tokens, n_in, rng);
    std::vector<float> ref(size_t(n_tokens * n_out));
    matmul_quantized_ref(w, x.data(), n_tokens, ref.data());
    const std::vector<float> got = product_from_records(w, tiles, x.data(), n_tokens);
    int differ = 0;
    for (size_t i = 0; i < ref.size(); ++i) differ += !same_float(got[i], ref[i]);
    EXPECT_GT(differ, 0);
  }
}

// One call of matrices sharing an input of shape s: one of each of `tiled` with tiles (each a
// row more than the last, so the groups end raggedly), then, if `untiled` is set, a Q8_0 matrix
// without tiles, which takes the other path. Tiled outputs must be the reference's bits; the
// untiled one what that path writes for it alone.
void expect_call_gives_reference_bits(std::span<const GgmlType> tiled, bool untiled, const Shape& s,
                                      ThreadPool& pool, std::mt19937& rng) {
  SCOPED_TRACE(std::to_string(pool.n_threads()) + " threads, " + std::to_string(s.n_in) + "x" +
               std::to_string(s.n_out) + " tokens " + std::to_string(s.n_tokens));
  std::vector<std::vector<uint8_t>> data, tiles;
  std::vector<WeightMatrix> w;
  for (GgmlType type : tiled) {
    const int64_t n_out = s.n_out + int64_t(w.size());
    data.push_back(random_weights(type, s.n_in, n_out, rng));
    w.push_back(weight_matrix(type, data.back().data(), s.n_in, n_out));
    tiles.emplace_back(matmul_tiles_bytes(w.back()));
    tile_weights(w.back(), tiles.back().data());
    w.back().tiles = tiles.back().data();
  }
  if (untiled) {
    data.push_back(random_weights(GgmlType::kQ8_0, s.n_in, s.n_out, rng));
    w.push_back(weight_matrix(GgmlType::kQ8_0, data.back().data(), s.n_in, s.n_out));
  }
  const std::vector<float> x = random_activations(s.n_tokens, s.n_in, rng);
  std::vector<std::vector<float>> y(w.size());
  std::vector<float*> yp;
  for (size_t m = 0; m < w.size(); ++m) {
    y[m].assign(size_t(s.n_tokens * w[m].n_out), -1.f);
    yp.push_back(y[m].data());
  }
  matmul(w, x.data(), s.n_tokens, yp, pool);
  for (size_t m = 0; m < w.size(); ++m) {
    SCOPED_TRACE(ggml_type_name(w[m].type));
    std::vector<float> want(y[m].size());
    if (w[m].tiles == nullptr)
      matmul(w[m], x.data(), s.n_tokens, want.data(), pool);
    else
      matmul_quantized_ref(w[m], x.data(), s.n_tokens, want.data());
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_TRUE(same_float(y[m][i], want[i])) << i << ": " << y[m][i] << " vs " << want[i];
  }
}

// The tile path against the scalar reference, bit for bit, every shape, 1 to 3 threads, with the
// matrices of a call sharing one input (a layer's q, k, v) and a matrix without tiles among them.
TEST(MatmulTiles, EqualTheQuantizedReferenceBitForBit) {
  if (!matmul_tiles_available()) GTEST_SKIP() << "no AMX tiles on this CPU, kernel or build";
  std::mt19937 rng(3);
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (const Shape& s : kShapes) expect_call_gives_reference_bits(kTileTypes, true, s, pool, rng);
  }
}

// Q4_K and Q5_K matrices sharing one input with a Q8_0 one (both activation block lengths in one
// call), against the reference bit for bit.
TEST(MatmulTiles, SuperBlocksEqualTheQuantizedReferenceBitForBit) {
  if (!matmul_tiles_available()) GTEST_SKIP() << "no AMX tiles on this CPU, kernel or build";
  std::mt19937 rng(7);
  const GgmlType types[] = {GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ8_0};
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    for (const Shape& s : kSuperBlockShapes) expect_call_gives_reference_bits(types, false, s, pool, rng);
  }
}

// A token's outputs are the same bits whether it is alone or the k-th of many (batch invariance).
TEST(MatmulTiles, ATokensOutputsDoNotDependOnItsCompany) {
  if (!matmul_tiles_available()) GTEST_SKIP() << "no AMX tiles on this CPU, kernel or build";
  std::mt19937 rng(4);
  ThreadPool pool(2);
  const int64_t n_in = 576, n_out = 49, n_tokens = 37;
  const std::vector<uint8_t> data = random_weights(GgmlType::kQ4_1, n_in, n_out, rng);
  WeightMatrix w = weight_matrix(GgmlType::kQ4_1, data.data(), n_in, n_out);
  std::vector<uint8_t> tiles(matmul_tiles_bytes(w));
  tile_weights(w, tiles.data());
  w.tiles = tiles.data();
  const std::vector<float> x = random_activations(n_tokens, n_in, rng);
  std::vector<float> all(size_t(n_tokens * n_out)), one(static_cast<size_t>(n_out));
  matmul(w, x.data(), n_tokens, all.data(), pool);
  for (int64_t t = 0; t < n_tokens; ++t) {
    matmul(w, x.data() + t * n_in, 1, one.data(), pool);
    for (int64_t o = 0; o < n_out; ++o) ASSERT_TRUE(same_float(one[size_t(o)], all[size_t(t * n_out + o)])) << t << " " << o;
  }
}

TEST(MatmulTiles, NonFiniteActivationPoisonsItsTokenOnly) {
  if (!matmul_tiles_available()) GTEST_SKIP() << "no AMX tiles on this CPU, kernel or build";
  std::mt19937 rng(5);
  ThreadPool pool(2);
  for (GgmlType type : kTileTypes) {
    SCOPED_TRACE(ggml_type_name(type));
    const int64_t n_in = 512, n_out = 9, n_tokens = 3;
    const std::vector<uint8_t> data = random_weights(type, n_in, n_out, rng);
    WeightMatrix w = weight_matrix(type, data.data(), n_in, n_out);
    std::vector<uint8_t> tiles(matmul_tiles_bytes(w));
    tile_weights(w, tiles.data());
    w.tiles = tiles.data();
    std::vector<float> x = random_activations(n_tokens, n_in, rng);
    x[1 * n_in + 300] = INFINITY;
    x[2 * n_in + 7] = NAN;
    std::vector<float> y(size_t(n_tokens * n_out));
    matmul(w, x.data(), n_tokens, y.data(), pool);
    for (int64_t o = 0; o < n_out; ++o) {
      EXPECT_FALSE(std::isnan(y[o])) << o;
      EXPECT_TRUE(std::isnan(y[n_out + o])) << o;
      EXPECT_TRUE(std::isnan(y[2 * n_out + o])) << o;
    }
  }
}

// The real model: with tiles available every layer matrix and the head carry them (SmolLM2 is
// Q4_1 with a Q8_0 head), and a product through them is the reference's; without, none does.
TEST(MatmulTiles, ALoadedModelCarriesTilesOfItsMatrices) {
  const std::string path = std::string(CERTKV_MODELS_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::unique_ptr<Model> model = load_model(path);
  const bool tiles = matmul_tiles_available();
  for (int l = 0; l < model->config().n_layers; ++l) {
    const LayerWeights& w = model->layer(l);
    for (const WeightMatrix* m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down})
      ASSERT_EQ(m->tiles != nullptr, tiles) << "layer " << l;
  }
  ASSERT_EQ(model->output().tiles != nullptr, tiles);
  if (!tiles) GTEST_SKIP() << "no AMX tiles on this CPU, kernel or build: the model has none";
  std::mt19937 rng(6);
  ThreadPool pool(2);
  for (const WeightMatrix* m : {&model->layer(7).w_down, &model->output()}) {
    const int64_t n_tokens = 5;
    const std::vector<float> x = random_activations(n_tokens, m->n_in, rng);
    std::vector<float> got(size_t(n_tokens * m->n_out)), ref(got.size());
    matmul(*m, x.data(), n_tokens, got.data(), pool);
    matmul_quantized_ref(*m, x.data(), n_tokens, ref.data());
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_TRUE(same_float(got[i], ref[i])) << i;
  }
}

TEST(MatmulTilesErrors, TypesAndShapesWithoutALayoutAreRefused) {
  std::vector<uint8_t> data(4096);
  WeightMatrix w = weight_matrix(GgmlType::kQ6_K, data.data(), 256, 2);
  EXPECT_FALSE(matmul_tiles_support(GgmlType::kQ6_K));
  EXPECT_FALSE(matmul_tiles_support(GgmlType::kF32));
  try {
    (void)matmul_tiles_bytes(w);
    FAIL() << "Q6_K has no tile layout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("Q6_K"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(matmul_tiles_fit(w));
  w.type = GgmlType::kQ4_K;
  w.n_in = 288;
  EXPECT_FALSE(matmul_tiles_fit(w));
  w.n_in = 256;
  EXPECT_TRUE(matmul_tiles_fit(w));
  w.n_in = 288;
  try {
    (void)matmul_tiles_bytes(w);
    FAIL() << "288 inputs are not whole super-blocks";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
  }
  w.type = GgmlType::kQ4_1;
  w.n_in = 48;
  try {
    tile_weights(w, data.data());
    FAIL() << "48 inputs are not whole blocks";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace certkv::model
