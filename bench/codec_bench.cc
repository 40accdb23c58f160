// GAAC beside two general-purpose lossless compressors, zstd (level 1) and lz4 (default
// acceleration), on the same BF16 KV bytes of a real KV dump (docs/format/kv_dump.md), one core.
//
//   CERTKV_BENCH_KV=KV.safetensors            the KV to code (required; `certkv dump-kv` writes it)
//   CERTKV_BENCH_GAAC_CALIBRATION=CAL.safetensors
//                                             a GAAC calibration (`certkv codec --save-calibration`);
//                                             without it GAAC calibrates on the KV itself
//
// Every benchmark codes all complete 16-token pages of every (layer, K/V, kv_head) of the dump
// once per iteration, into buffers allocated before timing. Counters: GBps = BF16 bytes per CPU
// second of the benchmark thread (input of encode, output of decode),
// ratio = BF16 bytes / stored bytes. GAAC's stored bytes are its slots and raw fallbacks (as in
// `certkv codec`, without block-table entries and bases). zstd and lz4 compress chunks of
// chunk_bytes (one page, 2 KiB, is what a paged cache could use; larger chunks are their best
// case) and store each chunk's compressed size.
#include <benchmark/benchmark.h>
#include <lz4.h>
#include <zstd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codec/gaac.h"
#include "format/gaac_layout.h"
#include "format/safetensors.h"

namespace {

namespace codec = certkv::codec;
namespace format = certkv::format;

constexpr int kBlockTokens = 16;

struct KvPages {
  std::string error;                  // why the KV could not be loaded ("" when loaded)
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  int64_t pages_per_head = 0;
  std::vector<uint16_t> bf16;         // [layer][K/V][kv_head][page][block_tokens][head_dim]
  std::vector<int> layers;            // the dump's layers, in page order
  codec::GaacCalibration calibration;
  size_t page_elems() const { return size_t(kBlockTokens) * size_t(head_dim); }
  size_t n_pages() const { return bf16.size() / page_elems(); }
  // (layer, K/V, kv_head) of page i.
  void owner(size_t i, int& layer, int& kv, int& head) const {
    const size_t per_kv = size_t(pages_per_head) * size_t(n_kv_heads);
    layer = layers[i / (2 * per_kv)];
    kv = int(i / per_kv % 2);
    head = int(i / size_t(pages_per_head) % size_t(n_kv_heads));
  }
};

int metadata_int(const format::SafetensorsFile& f, const char* key) {
  auto it = f.metadata().find(key);
  return it == f.metadata().end() ? 0 : std::atoi(it->second.c_str());
}

KvPages load_pages() {
  KvPages k;
  const char* path = std::getenv("CERTKV_BENCH_KV");
  if (path == nullptr) {
    k.error = "set CERTKV_BENCH_KV to a KV dump (certkv dump-kv --text-file F --tokens N --out F.safetensors)";
    return k;
  }
  try {
    auto f = format::SafetensorsFile::open(path);
    k.n_layers = metadata_int(*f, "n_layers");
    k.n_kv_heads = metadata_int(*f, "n_kv_heads");
    k.head_dim = metadata_int(*f, "head_dim");
    const int64_t n_tokens = metadata_int(*f, "n_tokens");
    k.pages_per_head = n_tokens / kBlockTokens;
    codec::GaacShape shape;
    shape.n_layers = k.n_layers;
    shape.n_kv_heads = k.n_kv_heads;
    shape.head_dim = k.head_dim;
    shape.block_tokens = kBlockTokens;
    codec::GaacCalibrator calibrator(shape);
    const size_t head_elems = size_t(n_tokens) * size_t(k.head_dim);
    const size_t kept_elems = size_t(k.pages_per_head) * k.page_elems();
    for (int layer = 0; layer < k.n_layers; ++layer) {
      const format::SafetensorsTensor* t[2] = {f->find("layer" + std::to_string(layer) + ".k"),
                                               f->find("layer" + std::to_string(layer) + ".v")};
      if (t[0] == nullptr || t[1] == nullptr) continue;
      k.layers.push_back(layer);
      for (int kv = 0; kv < 2; ++kv) {
        if (t[kv]->n_bytes != size_t(k.n_kv_heads) * head_elems * 2) {
          k.error = std::string(path) + ": " + t[kv]->name + " is not [n_kv_heads, n_tokens, head_dim] BF16";
          return k;
        }
        for (int h = 0; h < k.n_kv_heads; ++h) {
          const size_t at = k.bf16.size();
          k.bf16.resize(at + kept_elems);
          std::memcpy(k.bf16.data() + at, t[kv]->data + h * head_elems * 2, kept_elems * 2);
          calibrator.add_bf16(layer, kv, h, k.bf16.data() + at, int(k.pages_per_head * kBlockTokens));
        }
      }
    }
    if (k.bf16.empty()) {
      k.error = std::string(path) + ": no complete 16-token page";
      return k;
    }
    const char* cal = std::getenv("CERTKV_BENCH_GAAC_CALIBRATION");
    k.calibration = cal != nullptr ? codec::GaacCalibration::load(cal, shape) : calibrator.finish();
  } catch (const std::exception& e) {
    k.error = e.what();
  }
  return k;
}

const KvPages& pages() {
  static const KvPages p = load_pages();
  return p;
}

void set_counters(benchmark::State& state, double bf16_bytes, double stored_bytes) {
  state.counters["GBps"] = benchmark::Counter(bf16_bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ratio"] = stored_bytes > 0 ? bf16_bytes / stored_bytes : 0.0;
}

// GAAC: every page into its (layer, K/V) slot; a page whose escapes overflow is copied raw.
struct GaacEncoded {
  std::vector<size_t> slot_offset;  // per page
  std::vector<uint8_t> fits;
  std::vector<uint8_t> bytes;
  double stored_bytes = 0;
};

// Lays out one slot (or raw page, whichever is larger) per page.
GaacEncoded gaac_layout(const KvPages& k) {
  GaacEncoded e;
  const size_t n = k.n_pages(), raw_bytes = k.page_elems() * 2;
  e.slot_offset.resize(n);
  e.fits.resize(n);
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    int layer, kv, head;
    k.owner(i, layer, kv, head);
    e.slot_offset[i] = total;
    total += std::max(k.calibration.slot_bytes(layer, kv), raw_bytes);
  }
  e.bytes.resize(total);
  return e;
}

void gaac_encode_all(const KvPages& k, codec::GaacKernel kernel, GaacEncoded& e) {
  const size_t raw_bytes = k.page_elems() * 2;
  e.stored_bytes = 0;
  for (size_t i = 0; i < k.n_pages(); ++i) {
    int layer, kv, head;
    k.owner(i, layer, kv, head);
    uint8_t* out = e.bytes.data() + e.slot_offset[i];
    const uint16_t* page = k.bf16.data() + i * k.page_elems();
    const size_t used = codec::gaac_encode_page(page, kBlockTokens, k.head_dim, k.calibration.bases(layer, kv, head),
                                                k.calibration.escape_capacity_bytes(layer, kv), out, kernel);
    e.fits[i] = used != codec::kGaacDoesNotFit;
    if (!e.fits[i]) std::memcpy(out, page, raw_bytes);
    e.stored_bytes += e.fits[i] ? double(k.calibration.slot_bytes(layer, kv)) : double(raw_bytes);
  }
}

void BM_GaacEncode(benchmark::State& state, codec::GaacKernel kernel) {
  const KvPages& k = pages();
  if (!k.error.empty()) return state.SkipWithError(k.error.c_str());
  if (!codec::gaac_kernel_supported(kernel)) return state.SkipWithError("kernel not supported on this CPU");
  GaacEncoded e = gaac_layout(k);
  for (auto _ : state) {
    gaac_encode_all(k, kernel, e);
    benchmark::DoNotOptimize(e.bytes.data());
  }
  set_counters(state, double(k.bf16.size()) * 2, e.stored_bytes);
}

void BM_GaacDecode(benchmark::State& state, codec::GaacKernel kernel) {
  const KvPages& k = pages();
  if (!k.error.empty()) return state.SkipWithError(k.error.c_str());
  if (!codec::gaac_kernel_supported(kernel)) return state.SkipWithError("kernel not supported on this CPU");
  GaacEncoded e = gaac_layout(k);
  gaac_encode_all(k, codec::GaacKernel::kRef, e);
  std::vector<uint16_t> out(k.bf16.size());
  const size_t raw_bytes = k.page_elems() * 2;
  for (auto _ : state) {
    for (size_t i = 0; i < k.n_pages(); ++i) {
      int layer, kv, head;
      k.owner(i, layer, kv, head);
      uint16_t* dst = out.data() + i * k.page_elems();
      if (e.fits[i])
        codec::gaac_decode_page(e.bytes.data() + e.slot_offset[i], k.calibration.slot_bytes(layer, kv), kBlockTokens,
                                k.head_dim, k.calibration.bases(layer, kv, head), dst, kernel);
      else
        std::memcpy(dst, e.bytes.data() + e.slot_offset[i], raw_bytes);
    }
    benchmark::DoNotOptimize(out.data());
  }
  if (out != k.bf16) return state.SkipWithError("GAAC round trip is not bit-exact");
  set_counters(state, double(k.bf16.size()) * 2, e.stored_bytes);
}

// zstd / lz4 on chunks of state.range(0) bytes.
struct Compressor {
  const char* name;
  size_t (*bound)(size_t n);
  // Returns the compressed size (0 on failure).
  size_t (*compress)(const uint8_t* src, size_t n, uint8_t* dst, size_t cap);
  // Returns the decompressed size (0 on failure).
  size_t (*decompress)(const uint8_t* src, size_t n, uint8_t* dst, size_t cap);
};

ZSTD_CCtx* zstd_cctx() {
  static ZSTD_CCtx* c = ZSTD_createCCtx();
  return c;
}
ZSTD_DCtx* zstd_dctx() {
  static ZSTD_DCtx* d = ZSTD_createDCtx();
  return d;
}

const Compressor kZstd1 = {
    "zstd-1", [](size_t n) { return ZSTD_compressBound(n); },
    [](const uint8_t* s, size_t n, uint8_t* d, size_t cap) -> size_t {
      const size_t r = ZSTD_compressCCtx(zstd_cctx(), d, cap, s, n, 1);
      return ZSTD_isError(r) ? 0 : r;
    },
    [](const uint8_t* s, size_t n, uint8_t* d, size_t cap) -> size_t {
      const size_t r = ZSTD_decompressDCtx(zstd_dctx(), d, cap, s, n);
      return ZSTD_isError(r) ? 0 : r;
    }};

const Compressor kLz4 = {
    "lz4", [](size_t n) { return size_t(LZ4_compressBound(int(n))); },
    [](const uint8_t* s, size_t n, uint8_t* d, size_t cap) -> size_t {
      const int r = LZ4_compress_default(reinterpret_cast<const char*>(s), reinterpret_cast<char*>(d), int(n), int(cap));
      return r > 0 ? size_t(r) : 0;
    },
    [](const uint8_t* s, size_t n, uint8_t* d, size_t cap) -> size_t {
      const int r = LZ4_decompress_safe(reinterpret_cast<const char*>(s), reinterpret_cast<char*>(d), int(n), int(cap));
      return r > 0 ? size_t(r) : 0;
    }};

struct ChunkEncoded {
  std::vector<uint8_t> bytes;  // chunk i at i * bound(chunk)
  std::vector<size_t> sizes;
  double stored_bytes = 0;
  bool ok = true;
};

ChunkEncoded chunk_layout(const Compressor& c, size_t n, size_t chunk) {
  ChunkEncoded e;
  const size_t n_chunks = (n + chunk - 1) / chunk;
  e.bytes.resize(n_chunks * c.bound(chunk));
  e.sizes.resize(n_chunks);
  return e;
}

void compress_all(const Compressor& c, const uint8_t* src, size_t n, size_t chunk, ChunkEncoded& e) {
  const size_t cap = c.bound(chunk);
  e.ok = true;
  e.stored_bytes = 0;
  for (size_t i = 0; i < e.sizes.size(); ++i) {
    const size_t len = std::min(chunk, n - i * chunk);
    e.sizes[i] = c.compress(src + i * chunk, len, e.bytes.data() + i * cap, cap);
    e.ok = e.ok && e.sizes[i] != 0;
    e.stored_bytes += double(e.sizes[i]);
  }
}

void BM_Compress(benchmark::State& state, const Compressor* c) {
  const KvPages& k = pages();
  if (!k.error.empty()) return state.SkipWithError(k.error.c_str());
  const auto* src = reinterpret_cast<const uint8_t*>(k.bf16.data());
  const size_t n = k.bf16.size() * 2, chunk = size_t(state.range(0));
  ChunkEncoded e = chunk_layout(*c, n, chunk);
  for (auto _ : state) {
    compress_all(*c, src, n, chunk, e);
    benchmark::DoNotOptimize(e.bytes.data());
  }
  if (!e.ok) return state.SkipWithError("compression failed");
  set_counters(state, double(n), e.stored_bytes);
}

void BM_Decompress(benchmark::State& state, const Compressor* c) {
  const KvPages& k = pages();
  if (!k.error.empty()) return state.SkipWithError(k.error.c_str());
  const auto* src = reinterpret_cast<const uint8_t*>(k.bf16.data());
  const size_t n = k.bf16.size() * 2, chunk = size_t(state.range(0));
  ChunkEncoded e = chunk_layout(*c, n, chunk);
  compress_all(*c, src, n, chunk, e);
  if (!e.ok) return state.SkipWithError("compression failed");
  const size_t cap = c->bound(chunk);
  std::vector<uint8_t> out(n);
  bool ok = true;
  for (auto _ : state) {
    for (size_t i = 0; i < e.sizes.size(); ++i) {
      const size_t len = std::min(chunk, n - i * chunk);
      ok = ok && c->decompress(e.bytes.data() + i * cap, e.sizes[i], out.data() + i * chunk, len) == len;
    }
    benchmark::DoNotOptimize(out.data());
  }
  if (!ok || std::memcmp(out.data(), src, n) != 0) return state.SkipWithError("round trip is not bit-exact");
  set_counters(state, double(n), e.stored_bytes);
}

void register_all() {
  const codec::GaacKernel kernels[] = {codec::GaacKernel::kRef, codec::GaacKernel::kAvx2, codec::GaacKernel::kAvx512};
  for (codec::GaacKernel kernel : kernels) {
    const std::string name = codec::gaac_kernel_name(kernel);
    benchmark::RegisterBenchmark(("gaac_encode/" + name).c_str(), BM_GaacEncode, kernel)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("gaac_decode/" + name).c_str(), BM_GaacDecode, kernel)->Unit(benchmark::kMillisecond);
  }
  for (const Compressor* c : {&kZstd1, &kLz4}) {
    benchmark::RegisterBenchmark((std::string(c->name) + "_compress").c_str(), BM_Compress, c)
        ->ArgName("chunk_bytes")->Arg(2048)->Arg(1 << 20)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((std::string(c->name) + "_decompress").c_str(), BM_Decompress, c)
        ->ArgName("chunk_bytes")->Arg(2048)->Arg(1 << 20)->Unit(benchmark::kMillisecond);
  }
}

const bool registered = (register_all(), true);

}  // namespace
