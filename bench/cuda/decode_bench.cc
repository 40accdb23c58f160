// Decode attention on the GPU: certkv's page formats over real KV tiled to length, timed as
// CUDA-graph replays between CUDA events (as the peers are), with the copy bandwidth measured in the same run. One JSON object per
// line (docs/bench/README.md describes the fields); scripts/cuda_bench.sh runs it with the peers.
//
//   certkv_cuda_decode_bench --kv KV.safetensors --calib CAL.safetensors --out FILE.jsonl
//       [--contexts 8192,32768,65536,131072] [--batches 1,8] [--shapes 32x8,28x4]
//       [--formats bf16,bf16-fragments,fp8-e4m3-fragments[-nometer],dither8-fragments[-nometer],int8-fragments,gaac,gaac-fragments,gaac-e5m2,dither8,fp8-e4m3,fp8-e4m3-nometer,sparse-p0.9,sparse-p0.9-z1.5]
//   fp8-e4m3-u8: fp8-e4m3 with the meter and the u8 Tier A witness (codec::WitnessCode::kPageScaled8)
//       [--reps 7] [--iters 20] [--splits N] [--sparse-splits N] [--contiguous-pages]
//   sparse-pP-zZ: the Top-p set widened by Z estimator deviations; a suffix -est-FORM (popcount,
//   bytes, bits) runs the estimate in that form (default: chosen by the group size), so that the
//   forms are timed in one run; --splits: the dense formats' splits (default: paged_decode's
//   choice); --contiguous-pages: the dense formats' pages in table order instead of shuffled
//   slots; --sparse-splits: the sparse attention's splits per KV head
//   (default: chosen by sparse_decode_cuda's choose_splits)
//
// KV.safetensors (scripts/make_bench_kv.py): k, v BF16 [8][N][128], q F32 [8][7][128] (7 query
// vectors per KV head), metadata "source". CAL.safetensors: k, v of another text, for the GAAC
// calibration. Shape "32x8" uses KV heads 0..7 with queries 0..3 of each; "28x4" KV heads 0..3
// with all 7. Each sequence of a batch is a distinct copy of the real tokens tiled to the context.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "attention/cuda/device_kv.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "attention/cuda/sparse_decode_cuda.h"
#include "format/fp8.h"
#include "format/safetensors.h"
#include "index/rabitq.h"
#include "index/rotation.h"
#include "index/top_p.h"

using namespace certkv;
using namespace certkv::attention::cuda;

namespace {

struct Source {
  int n_kv = 0, n_tokens = 0, head_dim = 0, q_per_kv = 0;
  const uint16_t* k = nullptr;  // [n_kv][n_tokens][head_dim]
  const uint16_t* v = nullptr;
  const float* q = nullptr;     // [n_kv][q_per_kv][head_dim]
  std::string source;
  std::unique_ptr<format::SafetensorsFile> file;
};

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "certkv_cuda_decode_bench: %s\n", message.c_str());
  std::exit(2);
}

// The whole of `text` as a number (no trailing characters), or a clear error naming `what`.
template <typename T>
T number(const std::string& text, const std::string& what) {
  std::istringstream in(text);
  T value{};
  if (!(in >> value) || !in.eof()) die(what + ": '" + text + "' is not a number");
  return value;
}

Source open_source(const std::string& path, bool need_q) {
  Source s;
  s.file = format::SafetensorsFile::open(path);
  const auto* k = s.file->find("k");
  const auto* v = s.file->find("v");
  if (!k || !v || k->dtype != "BF16" || v->dtype != "BF16" || k->shape.size() != 3 || k->shape != v->shape)
    die(path + ": needs BF16 tensors k and v of one shape [n_kv][N][head_dim]");
  s.n_kv = int(k->shape[0]);
  s.n_tokens = int(k->shape[1]);
  s.head_dim = int(k->shape[2]);
  s.k = reinterpret_cast<const uint16_t*>(k->data);
  s.v = reinterpret_cast<const uint16_t*>(v->data);
  if (need_q) {
    const auto* q = s.file->find("q");
    if (!q || q->dtype != "F32" || q->shape.size() != 3 || q->shape[0] != s.n_kv || q->shape[2] != s.head_dim)
      die(path + ": needs F32 tensor q [n_kv][q_per_kv][head_dim]");
    s.q_per_kv = int(q->shape[1]);
    s.q = reinterpret_cast<const float*>(q->data);
  }
  const auto& meta = s.file->metadata();
  if (auto it = meta.find("source"); it != meta.end()) s.source = it->second;
  return s;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    const cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) die(std::string(#x) + ": " + cudaGetErrorString(e_));        \
  } while (0)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Device-to-device copy of 2 GiB: bytes read + written over time, median of 10.
double copy_tb_s() {
  const size_t bytes = size_t(2) << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 13; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) t.push_back(2.0 * double(bytes) / (double(ms) * 1e-3) / 1e12);
  }
  cudaFree(a);
  cudaFree(b);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(t);
}

struct FormatChoice {
  std::string name;
  PageFormat format;
  bool meter;
  codec::WitnessCode witness = codec::WitnessCode::kFp16;  // fp8 K pages
};

FormatChoice parse_format(const std::string& name) {
  if (name == "bf16") return {name, PageFormat::kBf16, false};
  if (name == "bf16-fragments") return {name, PageFormat::kBf16Fragments, false};
  if (name == "fp8-e4m3-fragments") return {name, PageFormat::kFp8Fragments, true};
  if (name == "fp8-e4m3-fragments-nometer") return {name, PageFormat::kFp8Fragments, false};
  if (name == "dither8-fragments") return {name, PageFormat::kDither8Fragments, true};
  if (name == "dither8-fragments-nometer") return {name, PageFormat::kDither8Fragments, false};
  if (name == "int8-fragments") return {name, PageFormat::kInt8Fragments, false};
  if (name == "gaac") return {name, PageFormat::kGaacBf16, false};
  if (name == "gaac-fragments") return {name, PageFormat::kGaacFragments, false};
  if (name == "gaac-e5m2") return {name, PageFormat::kGaacE5M2, false};
  if (name == "dither8") return {name, PageFormat::kDither8, true};
  if (name == "dither8-nometer") return {name, PageFormat::kDither8, false};
  if (name == "fp8-e4m3") return {name, PageFormat::kFp8E4M3, true};
  if (name == "fp8-e4m3-nometer") return {name, PageFormat::kFp8E4M3, false};
  if (name == "fp8-e4m3-u8") return {name, PageFormat::kFp8E4M3, true, codec::WitnessCode::kPageScaled8};
  if (name == "fp8-e5m2") return {name, PageFormat::kFp8E5M2, true};
  die("unknown format " + name);
}

codec::GaacCalibration calibrate(const Source& cal, format::GaacElement element, int n_kv) {
  codec::GaacShape shape;
  shape.n_layers = 1;
  shape.n_kv_heads = n_kv;
  shape.head_dim = cal.head_dim;
  shape.block_tokens = 16;
  shape.element = element;
  codec::GaacCalibrator calibrator(shape);
  std::vector<uint8_t> fp8(size_t(cal.n_tokens) * cal.head_dim);
  for (int which = 0; which < 2; ++which)
    for (int h = 0; h < n_kv; ++h) {
      const uint16_t* rows = (which == 0 ? cal.k : cal.v) + size_t(h) * cal.n_tokens * cal.head_dim;
      if (element == format::GaacElement::kBf16) {
        calibrator.add_bf16(0, which, h, rows, cal.n_tokens);
      } else {
        for (size_t i = 0; i < fp8.size(); ++i) fp8[i] = format::bf16_to_fp8_e5m2_ref(rows[i]);
        calibrator.add_fp8(0, which, h, fp8.data(), cal.n_tokens);
      }
    }
  return calibrator.finish();
}

// Timed like the peers: one CUDA graph of `iters` rounds of fn (its launches on `stream`),
// replayed reps times between events. Before the timing, the output buffer `out` (bytes) is
// poisoned and the graph replayed once: its output must equal what an eager round left there.
// Returns microseconds per round, one per repetition.
template <typename Fn>
std::vector<double> time_graph(cudaStream_t stream, int iters, int reps, void* out, size_t bytes,
                               const std::string& what, Fn fn) {
  fn();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint8_t> eager(bytes), replayed(bytes);
  CHECK_CUDA(cudaMemcpy(eager.data(), out, bytes, cudaMemcpyDeviceToHost));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int it = 0; it < iters; ++it) fn();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaMemsetAsync(out, 0xff, bytes, stream));  // NaN
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaMemcpy(replayed.data(), out, bytes, cudaMemcpyDeviceToHost));
  if (replayed != eager) die(what + ": the graph's output differs from an eager call's");
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(double(ms) * 1e3 / double(iters));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return us;
}

// Sparse decode (bf16 pages + RaBitQ index, Top-p p, a window of kWindow newest tokens): the
// index is built on the host from the source's unique tokens (c_k their mean, c_q the mean of the
// KV head's query vectors, a Haar rotation), tiled like the KV; queries quantized on the host
// (not timed). Recall: the exact softmax mass (double, over the whole tiled context) of the
// tokens attended, per query head of sequence 0.
// Wall-clock seconds since t0 (where a cell's device time goes besides its timed launches).
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct SparseCell {
  double us = 0, us_min = 0, us_max = 0, recall_mean = 0, recall_min = 0, budget_mean = 0;
  double prep_s = 0;  // from the call to the first timed replay: index, pages, buffers, warm-up
  int64_t bytes = 0;
  int n_sets = 0, splits = 0;
  const char* estimate_form = "";  // the form that ran (estimate_form_of)
};

SparseCell run_sparse(const Source& src, const HostLayerKv& kv, const std::vector<float>& q, int n_q, double top_p,
                      double deviations, EstimateForm estimate_form, int sparse_splits, int reps, int iters,
                      cache::cuda::DeviceBuffer& q_d, cache::cuda::DeviceBuffer& out_d) {
  const auto start = std::chrono::steady_clock::now();
  constexpr int D = 128;
  constexpr int64_t kWindow = 128;
  const int B = kv.batch, H = kv.n_kv_heads, G = n_q / H;
  const int64_t ctx = kv.lens[0], n_idx = ctx - kWindow, N = src.n_tokens;
  // Host index of the unique tokens, per KV head; records of the tiled context.
  std::vector<index::RabitqRecord<D>> unique(size_t(H) * size_t(N));
  std::vector<DeviceRabitqQuery> queries(size_t(B) * n_q);
  std::vector<std::vector<double>> exact(static_cast<size_t>(n_q));  // exact logits of the unique tokens
  for (int h = 0; h < H; ++h) {
    std::vector<float> keys(static_cast<size_t>(N) * D), c_k(static_cast<size_t>(D), 0.f), c_q(static_cast<size_t>(D), 0.f);
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = format::bf16_to_float(src.k[size_t(h) * size_t(N) * D + i]);
    for (int64_t t = 0; t < N; ++t)
      for (int d = 0; d < D; ++d) c_k[size_t(d)] += keys[size_t(t) * D + size_t(d)] / float(N);
    for (int g = 0; g < src.q_per_kv; ++g)
      for (int d = 0; d < D; ++d) c_q[size_t(d)] += src.q[(size_t(h) * src.q_per_kv + size_t(g)) * D + size_t(d)] / float(src.q_per_kv);
    const index::RabitqHead head(c_q, c_k, index::Rotation(index::RotationKind::kHaar, D, 11 + uint64_t(h)));
    index::rabitq_encode_keys<D>(head, keys.data(), N, unique.data() + size_t(h) * size_t(N));
    for (int g = 0; g < G; ++g) {
      const int hh = h * G + g;
      const float* qv = q.data() + size_t(hh) * D;  // sequence 0 (all sequences hold the same queries)
      const index::RabitqQuery<D> rq = index::rabitq_quantize_query<D>(head, qv, 77 + uint64_t(hh));
      const float margin = index::rabitq_logit_deviation_scale(deviations, 1.f / std::sqrt(float(D)), rq.norm_q_centered, D);
      for (int b = 0; b < B; ++b) queries[size_t(b) * n_q + size_t(hh)] = device_rabitq_query<D>(head, rq, margin);
      std::vector<double>& e = exact[size_t(hh)];
      e.resize(size_t(N));
      for (int64_t t = 0; t < N; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += double(format::bf16_to_float(format::float_to_bf16(qv[d]))) * keys[size_t(t) * D + size_t(d)];
        e[size_t(t)] = dot / std::sqrt(double(D));
      }
    }
  }
  std::vector<index::RabitqRecord<D>> records(size_t(B) * H * size_t(n_idx));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int64_t t = 0; t < n_idx; ++t)
        records[(size_t(b) * H + size_t(h)) * size_t(n_idx) + size_t(t)] = unique[size_t(h) * size_t(N) + size_t(t % N)];
  const std::vector<uint64_t>& weights = index::top_p_bucket_weights();
  std::vector<int32_t> n_indexed(static_cast<size_t>(B), static_cast<int32_t>(n_idx));

  DeviceKvOptions opt;
  opt.format = PageFormat::kBf16;
  std::vector<DeviceKv> sets(1);
  if (!DeviceKv::build(kv, opt, &sets[0]).ok) die("sparse: bf16 pages");
  const int64_t dense_bytes = sets[0].bytes_read();
  const int64_t index_bytes = int64_t(records.size() * sizeof(records[0]));
  const int n_sets = int(std::max<int64_t>(1, (int64_t(256) << 20) / std::max<int64_t>(index_bytes + dense_bytes / 8, 1) + 1));
  for (int i = 1; i < n_sets; ++i) {
    sets.emplace_back();
    opt.seed = uint32_t(i + 1);
    if (!DeviceKv::build(kv, opt, &sets.back()).ok) die("sparse: bf16 pages");
  }
  cache::cuda::DeviceBuffer q_rab, w_d, nidx_d, thr_d, nsel_d;
  std::vector<cache::cuda::DeviceBuffer> rec_d(static_cast<size_t>(n_sets)), ws_d(static_cast<size_t>(n_sets));
  if (!cache::cuda::DeviceBuffer::allocate(queries.size() * sizeof(queries[0]), &q_rab).ok ||
      !q_rab.upload(0, queries.data(), queries.size() * sizeof(queries[0])).ok ||
      !cache::cuda::DeviceBuffer::allocate(weights.size() * 8, &w_d).ok || !w_d.upload(0, weights.data(), weights.size() * 8).ok ||
      !cache::cuda::DeviceBuffer::allocate(n_indexed.size() * 4, &nidx_d).ok ||
      !nidx_d.upload(0, n_indexed.data(), n_indexed.size() * 4).ok ||
      !cache::cuda::DeviceBuffer::allocate(size_t(B) * n_q * 4, &thr_d).ok ||
      !cache::cuda::DeviceBuffer::allocate(size_t(B) * n_q * 8, &nsel_d).ok)
    die("sparse: device buffers");
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<SparseDecodeParams> params(static_cast<size_t>(n_sets));
  for (int i = 0; i < n_sets; ++i) {
    if (!cache::cuda::DeviceBuffer::allocate(records.size() * sizeof(records[0]), &rec_d[size_t(i)]).ok ||
        !rec_d[size_t(i)].upload(0, records.data(), records.size() * sizeof(records[0])).ok)
      die("sparse: index records");
    PagedDecodeParams pp;
    sets[size_t(i)].describe(&pp);
    SparseDecodeParams& p = params[size_t(i)];
    describe_pages(pp, &p);
    p.n_q_heads = n_q;
    p.sm_scale = 1.f / std::sqrt(float(D));
    p.p = top_p;
    p.records = rec_d[size_t(i)].data();
    p.record_stride = n_idx;
    p.n_indexed = reinterpret_cast<const int32_t*>(nidx_d.data());
    p.max_indexed = n_idx;
    p.max_window = kWindow;
    p.queries = reinterpret_cast<const DeviceRabitqQuery*>(q_rab.data());
    p.n_splits = sparse_splits;
    p.estimate_form = estimate_form;
    p.topp_weights = reinterpret_cast<const uint64_t*>(w_d.data());
    p.q = reinterpret_cast<const float*>(q_d.data());
    p.out = reinterpret_cast<float*>(out_d.data());
    p.threshold = reinterpret_cast<float*>(thr_d.data());
    p.n_selected = reinterpret_cast<int64_t*>(nsel_d.data());
    p.stream = stream;
    const size_t ws = workspace_bytes(p);
    if (!cache::cuda::DeviceBuffer::allocate(ws, &ws_d[size_t(i)]).ok) die("sparse: workspace");
    p.workspace = ws_d[size_t(i)].data();
    p.workspace_size = ws;
  }
  for (int w2 = 0; w2 < 2; ++w2)
    for (auto& p : params) {
      const CudaStatus st = sparse_decode(p);
      if (!st.ok) die("sparse: " + st.message);
    }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  SparseCell cell;
  cell.n_sets = n_sets;
  cell.splits = sparse_splits > 0 ? sparse_splits : choose_splits(params[0]);
  cell.estimate_form = estimate_form_name(estimate_form_of(params[0]));
  cell.prep_s = seconds_since(start);
  const std::vector<double> us = time_graph(stream, iters, reps, out_d.data(), q.size() * 4, "sparse", [&] {
    for (auto& p : params)
      if (const CudaStatus st = sparse_decode(p); !st.ok) die("sparse: " + st.message);
  });
  const int calls = n_sets;
  std::vector<double> per_call;
  for (double u : us) per_call.push_back(u / calls);
  cell.us = median(per_call);
  cell.us_min = *std::min_element(per_call.begin(), per_call.end());
  cell.us_max = *std::max_element(per_call.begin(), per_call.end());

  // What the last call selected (set 0 ran first; every set holds the same KV): recall of each
  // query head of sequence 0, the budget, the bytes read (index + selected rows + window rows).
  CHECK_CUDA(cudaStreamSynchronize(stream));
  if (const CudaStatus st = sparse_decode(params[0]); !st.ok) die("sparse: " + st.message);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  // The attended set as the kernels attend it: the selection lists (entries token | heads << 24)
  // of sequence 0, then the window.
  const int64_t chunks = selection_chunks(params[0]);
  std::vector<int32_t> counts(size_t(B) * H * size_t(chunks));
  std::vector<uint32_t> entries(size_t(H) * size_t(chunks) * kSparseChunkTokens);
  CHECK_CUDA(cudaMemcpy(counts.data(), selection_counts(params[0]), counts.size() * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(entries.data(), selection_entries(params[0]), entries.size() * 4, cudaMemcpyDeviceToHost));
  int64_t rows = 0;
  for (int32_t c : counts) rows += c;
  rows += int64_t(B) * H * kWindow;
  cell.bytes = index_bytes + rows * 2 * D * 2;
  std::vector<std::vector<uint8_t>> taken(static_cast<size_t>(n_q), std::vector<uint8_t>(size_t(ctx), 0));
  for (int h = 0; h < H; ++h)
    for (int64_t c = 0; c < chunks; ++c) {
      const size_t list = size_t(h) * size_t(chunks) + size_t(c);
      for (int32_t i = 0; i < counts[list]; ++i) {
        const uint32_t e = entries[list * kSparseChunkTokens + size_t(i)];
        for (int g = 0; g < G; ++g)
          if ((e >> (24 + g)) & 1u) taken[size_t(h * G + g)][e & 0xffffffu] = 1;
      }
    }
  cell.recall_min = 1.0;
  for (int hh = 0; hh < n_q; ++hh) {
    const std::vector<double>& e = exact[size_t(hh)];
    const double mx = *std::max_element(e.begin(), e.end());
    double z = 0, got = 0;
    int64_t attended = 0;
    for (int64_t t = 0; t < ctx; ++t) {
      const double pt = std::exp(e[size_t(t % N)] - mx);
      z += pt;
      if (t >= n_idx || taken[size_t(hh)][size_t(t)]) {
        got += pt;
        ++attended;
      }
    }
    const double recall = got / z;
    cell.recall_mean += recall / n_q;
    cell.recall_min = std::min(cell.recall_min, recall);
    cell.budget_mean += double(attended) / double(ctx) / n_q;
  }
  cudaStreamDestroy(stream);
  return cell;
}

}  // namespace

int main(int argc, char** argv) {
  std::string kv_path, cal_path, out_path;
  std::vector<std::string> contexts = {"8192", "32768", "65536", "131072"}, batches = {"1", "8"},
                           shapes = {"32x8", "28x4"},
                           formats = {"bf16", "gaac", "gaac-e5m2", "dither8", "fp8-e4m3", "fp8-e4m3-nometer",
                                      "sparse-p0.9"};
  int reps = 7, iters = 20, sparse_splits = 0, splits = 0;
  bool contiguous = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--kv") kv_path = next();
    else if (a == "--calib") cal_path = next();
    else if (a == "--out") out_path = next();
    else if (a == "--contexts") contexts = split(next(), ',');
    else if (a == "--batches") batches = split(next(), ',');
    else if (a == "--shapes") shapes = split(next(), ',');
    else if (a == "--formats") formats = split(next(), ',');
    else if (a == "--splits") splits = number<int>(next(), "--splits");
    else if (a == "--contiguous-pages") contiguous = true;
    else if (a == "--reps") reps = number<int>(next(), "--reps");
    else if (a == "--iters") iters = number<int>(next(), "--iters");
    else if (a == "--sparse-splits") sparse_splits = number<int>(next(), "--sparse-splits");
    else die("unknown flag " + a);
  }
  if (kv_path.empty() || cal_path.empty() || out_path.empty()) die("--kv, --calib and --out are required");
  const Source src = open_source(kv_path, true);
  const Source cal = open_source(cal_path, false);
  if (src.head_dim != 128 || cal.head_dim != 128 || cal.n_kv < src.n_kv || src.n_tokens % 16 != 0)
    die("the KV files must hold head_dim-128 heads, the calibration as many heads, N a multiple of 16");

  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  const double copy = copy_tb_s();
  std::ofstream out(out_path);
  char line[4096];
  std::snprintf(line, sizeof line,
                "{\"kind\": \"env\", \"gpu\": \"%s\", \"sms\": %d, \"l2_bytes\": %d, \"copy_tb_s\": %.4f, "
                "\"kv_source\": \"%s\", \"kv_tokens\": %d}",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize, copy, src.source.c_str(), src.n_tokens);
  out << line << "\n";
  std::printf("%s\n", line);

  const codec::GaacCalibration cal_bf16 = calibrate(cal, format::GaacElement::kBf16, src.n_kv);
  const codec::GaacCalibration cal_e5m2 = calibrate(cal, format::GaacElement::kFp8E5M2, src.n_kv);
  std::printf("%-6s %5s %7s %-30s %10s %10s %8s %8s\n", "shape", "batch", "ctx", "format", "us", "MB", "TB/s", "%copy");

  for (const std::string& shape_name : shapes) {
    const auto hw = split(shape_name, 'x');
    if (hw.size() != 2) die("bad shape " + shape_name);
    const int n_q = number<int>(hw[0], "shape " + shape_name), n_kv = number<int>(hw[1], "shape " + shape_name);
    if (n_q < 1 || n_kv < 1) die("shape " + shape_name + ": head counts must be positive");
    const int group = n_q / n_kv;
    if (n_kv > src.n_kv || group > src.q_per_kv || n_q % n_kv != 0) die("shape " + shape_name + " does not fit the KV file");
    for (const std::string& batch_s : batches) {
      const int batch = number<int>(batch_s, "batch");
      for (const std::string& ctx_s : contexts) {
        const int64_t ctx = number<int64_t>(ctx_s, "context");
        const auto fill_start = std::chrono::steady_clock::now();
        HostLayerKv kv;
        kv.batch = batch;
        kv.n_kv_heads = n_kv;
        kv.head_dim = 128;
        kv.lens.assign(size_t(batch), ctx);
        kv.period_blocks = src.n_tokens / 16;
        for (int b = 0; b < batch; ++b) {
          kv.k.emplace_back(size_t(n_kv) * size_t(ctx) * 128);
          kv.v.emplace_back(size_t(n_kv) * size_t(ctx) * 128);
          for (int h = 0; h < n_kv; ++h)
            for (int64_t t = 0; t < ctx; ++t) {
              const size_t from = (size_t(h) * src.n_tokens + size_t(t % src.n_tokens)) * 128;
              const size_t to = (size_t(h) * size_t(ctx) + size_t(t)) * 128;
              std::memcpy(kv.k.back().data() + to, src.k + from, 256);
              std::memcpy(kv.v.back().data() + to, src.v + from, 256);
            }
        }
        std::vector<float> q(size_t(batch) * n_q * 128);
        for (int b = 0; b < batch; ++b)
          for (int h = 0; h < n_q; ++h)
            std::memcpy(q.data() + (size_t(b) * n_q + h) * 128,
                        src.q + (size_t(h / group) * src.q_per_kv + size_t(h % group)) * 128, 512);
        cache::cuda::DeviceBuffer q_d, out_d, meter_d, am1_d;
        if (!cache::cuda::DeviceBuffer::allocate(q.size() * 4, &q_d).ok || !q_d.upload(0, q.data(), q.size() * 4).ok ||
            !cache::cuda::DeviceBuffer::allocate(q.size() * 4, &out_d).ok ||
            !cache::cuda::DeviceBuffer::allocate(size_t(batch) * n_q * 4, &meter_d).ok ||
            !cache::cuda::DeviceBuffer::allocate(size_t(batch) * n_q * 4, &am1_d).ok)
          die("device buffers for the queries");
        const double fill_s = seconds_since(fill_start);  // the host KV of this (shape, batch, context)

        for (const std::string& fname : formats) {
          const auto cell_start = std::chrono::steady_clock::now();
          if (fname.rfind("sparse-p", 0) == 0) {
            // sparse-pP, sparse-pP-zZ (the Top-p set widened by Z deviations), either with -est-FORM.
            const size_t est_at = fname.find("-est-", 8);
            EstimateForm estimate_form = EstimateForm::kChosen;
            if (est_at != std::string::npos &&
                !parse_estimate_form(fname.substr(est_at + 5).c_str(), &estimate_form))
              die("format " + fname + ": the estimate form is popcount, bytes or bits");
            const std::string set = fname.substr(0, est_at);
            const size_t z_at = set.find("-z", 8);
            const double top_p = number<double>(set.substr(8, z_at == std::string::npos ? std::string::npos : z_at - 8), "format " + fname);
            const double deviations = z_at == std::string::npos ? 0.0 : number<double>(set.substr(z_at + 2), "format " + fname);
            const SparseCell c =
                run_sparse(src, kv, q, n_q, top_p, deviations, estimate_form, sparse_splits, reps, iters, q_d, out_d);
            const double tb_s = double(c.bytes) / (c.us * 1e-6) / 1e12;
            std::snprintf(line, sizeof line,
                          "{\"kind\": \"certkv\", \"format\": \"%s\", \"shape\": \"%s\", \"batch\": %d, \"ctx\": %lld, "
                          "\"us\": %.3f, \"us_min\": %.3f, \"us_max\": %.3f, \"bytes\": %lld, \"tb_s\": %.4f, "
                          "\"copy_tb_s\": %.4f, \"pct_copy\": %.2f, \"n_sets\": %d, \"splits\": %d, \"p\": %.3f, \"deviations\": %.3f, "
                          "\"window\": 128, \"recall_mean\": %.4f, \"recall_min\": %.4f, \"budget_mean\": %.4f, "
                          "\"estimate_form\": \"%s\", \"host_fill_s\": %.3f, \"prep_s\": %.3f, \"cell_s\": %.3f, "
                          "\"timing\": \"graph\"}",
                          fname.c_str(), shape_name.c_str(), batch, (long long)ctx, c.us, c.us_min, c.us_max,
                          (long long)c.bytes, tb_s, copy, 100.0 * tb_s / copy, c.n_sets, c.splits, top_p, deviations, c.recall_mean,
                          c.recall_min, c.budget_mean, c.estimate_form, fill_s, c.prep_s, seconds_since(cell_start));
            out << line << "\n";
            out.flush();
            std::printf("%-6s %5d %7lld %-30s %10.2f %10.1f %8.3f %8.1f  recall %.3f (min %.3f) budget %.3f\n",
                        shape_name.c_str(), batch, (long long)ctx, fname.c_str(), c.us, double(c.bytes) / 1e6, tb_s,
                        100.0 * tb_s / copy, c.recall_mean, c.recall_min, c.budget_mean);
            std::fflush(stdout);
            continue;
          }
          const FormatChoice fc = parse_format(fname);
          DeviceKvOptions opt;
          opt.format = fc.format;
          opt.gaac = fc.format == PageFormat::kGaacE5M2 ? &cal_e5m2 : &cal_bf16;
          opt.n_outlier_pairs = page_format_dither8_bytes(fc.format) ? 4 : 0;
          opt.witness = fc.witness;
          opt.pairing = codec::RopePairing::kHalfSplit;
          opt.contiguous_slots = contiguous;
          // Enough independent copies that the rotation never runs from L2 (256 MB).
          std::vector<DeviceKv> sets(1);
          opt.seed = 1;
          CudaStatus s = DeviceKv::build(kv, opt, &sets[0]);
          if (!s.ok) die(fname + ": " + s.message);
          // What the launch reads: without the meter, not the fp8 pages' witness and rho.
          const int64_t bytes = sets[0].bytes_read() - (fc.meter ? 0 : sets[0].meter_side_bytes());
          const int n_sets = int(std::max<int64_t>(1, (int64_t(256) << 20) / std::max<int64_t>(bytes, 1) + 1));
          for (int i = 1; i < n_sets; ++i) {
            sets.emplace_back();
            opt.seed = uint32_t(i + 1);
            s = DeviceKv::build(kv, opt, &sets.back());
            if (!s.ok) die(fname + ": " + s.message);
          }
          std::vector<PagedDecodeParams> params(static_cast<size_t>(n_sets));
          std::vector<cache::cuda::DeviceBuffer> workspaces(static_cast<size_t>(n_sets));
          for (int i = 0; i < n_sets; ++i) {
            PagedDecodeParams& p = params[size_t(i)];
            sets[size_t(i)].describe(&p);
            p.n_q_heads = n_q;
            p.n_splits = splits;
            p.sm_scale = 1.f / std::sqrt(128.f);
            p.q = reinterpret_cast<const float*>(q_d.data());
            p.out = reinterpret_cast<float*>(out_d.data());
            if (fc.meter) {
              p.meter = reinterpret_cast<float*>(meter_d.data());
              p.a_minus_1 = reinterpret_cast<float*>(am1_d.data());
            }
            p.delta_loc = 1e-2 / (28.0 * 28.0 * 1024.0);
            const size_t ws = workspace_bytes(p);
            if (!cache::cuda::DeviceBuffer::allocate(ws, &workspaces[size_t(i)]).ok) die("workspace");
            p.workspace = workspaces[size_t(i)].data();
            p.workspace_size = ws;
            if (!reset_error_word(p).ok) die("workspace reset");
          }
          // A round is one call per set (both kernels of each call): time_graph.
          cudaStream_t stream;
          CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
          for (auto& p : params) p.stream = stream;
          for (int w = 0; w < 3; ++w)
            for (auto& p : params)
              if (!(s = paged_decode(p)).ok) die(fname + ": " + s.message);
          const double prep_s = seconds_since(cell_start);
          std::vector<double> us = time_graph(stream, iters, reps, out_d.data(), q.size() * 4, fname, [&] {
            for (auto& p : params)
              if (!(s = paged_decode(p)).ok) die(fname + ": " + s.message);
          });
          for (double& u : us) u /= double(n_sets);
          for (auto& p : params) {
            uint32_t corrupt = 0;
            if (!read_error_word(p, &corrupt).ok || corrupt != 0) die(fname + ": corrupt pages reported");
          }
          std::vector<float> meters(size_t(batch) * n_q, 0.f);
          if (fc.meter) CHECK_CUDA(cudaMemcpy(meters.data(), meter_d.data(), meters.size() * 4, cudaMemcpyDeviceToHost));
          const double med = median(us);
          const double tb_s = double(bytes) / (med * 1e-6) / 1e12;
          std::snprintf(line, sizeof line,
                        "{\"kind\": \"certkv\", \"format\": \"%s\", \"shape\": \"%s\", \"batch\": %d, \"ctx\": %lld, "
                        "\"us\": %.3f, \"us_min\": %.3f, \"us_max\": %.3f, \"bytes\": %lld, \"tb_s\": %.4f, "
                        "\"copy_tb_s\": %.4f, \"pct_copy\": %.2f, \"n_sets\": %d, \"splits\": %d, "
                        "\"raw_pages\": %lld, \"meter_max\": %.6g, \"host_fill_s\": %.3f, \"prep_s\": %.3f, "
                        "\"cell_s\": %.3f, \"timing\": \"graph\"}",
                        fname.c_str(), shape_name.c_str(), batch, (long long)ctx, med,
                        *std::min_element(us.begin(), us.end()), *std::max_element(us.begin(), us.end()),
                        (long long)bytes, tb_s, copy, 100.0 * tb_s / copy, n_sets, planned_splits(params[0]),
                        (long long)sets[0].raw_pages(), double(*std::max_element(meters.begin(), meters.end())), fill_s,
                        prep_s, seconds_since(cell_start));
          out << line << "\n";
          out.flush();
          std::printf("%-6s %5d %7lld %-30s %10.2f %10.1f %8.3f %8.1f\n", shape_name.c_str(), batch, (long long)ctx,
                      fname.c_str(), med, double(bytes) / 1e6, tb_s, 100.0 * tb_s / copy);
          std::fflush(stdout);
          cudaStreamDestroy(stream);
        }
      }
    }
  }
  return 0;
}
