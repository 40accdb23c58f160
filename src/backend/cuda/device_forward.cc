#include "backend/cuda/device_forward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "backend/cuda/forward_kernels.h"
#include "backend/cuda/sample_kernels.h"
#include "core/cuda_status.h"
#include "core/status.h"

// The forward's stream is ordered with the null stream (attention, the KV cache) by the legacy
// default stream's implicit synchronization: a per-thread default stream would drop that order.
#ifdef CUDA_API_PER_THREAD_DEFAULT_STREAM
#error "the device forward pass relies on the legacy default stream (no --default-stream per-thread)"
#endif

namespace certkv::backend::cuda {

using cache::cuda::DeviceBuffer;
using cache::cuda::PinnedBuffer;
using model::ModelConfig;

namespace {


DeviceBuffer upload_floats(const std::vector<float>& v) {
  DeviceBuffer b;
  if (v.empty()) return b;
  throw_if_failed(DeviceBuffer::allocate(sizeof(float) * v.size(), &b));
  throw_if_failed(b.upload(0, v.data(), sizeof(float) * v.size()));
  return b;
}

DeviceMatrix upload(const model::WeightMatrix& w) {
  DeviceMatrix m;
  throw_if_failed(upload_matrix(w, &m));
  return m;
}

const float* floats(const DeviceBuffer& b) { return reinterpret_cast<const float*>(b.data()); }
float* floats_mut(const DeviceBuffer& b) { return reinterpret_cast<float*>(b.data()); }

void grow(DeviceBuffer& b, size_t bytes) {
  if (b.size() < bytes) throw_if_failed(DeviceBuffer::allocate(bytes, &b));
}

}  // namespace

uint64_t device_weight_bytes(const model::Model& model) {
  const ModelConfig& c = model.config();
  const bool tied = model.output().data == model.token_embedding().data;
  uint64_t bytes = device_matrix_bytes(model.token_embedding()) + uint64_t(c.dim) * 4;
  if (!tied) bytes += device_matrix_bytes(model.output());
  for (int l = 0; l < c.n_layers; ++l) {
    const model::LayerWeights& w = model.layer(l);
    for (const model::WeightMatrix* m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down})
      bytes += device_matrix_bytes(*m);
    for (const std::vector<float>* v : {&w.attn_norm, &w.ffn_norm, &w.bq, &w.bk, &w.bv, &w.q_norm, &w.k_norm})
      bytes += 4 * uint64_t(v->size());
  }
  return bytes;
}

std::unique_ptr<DeviceForward> DeviceForward::create(const model::Model& model, bool graphs, bool fused) {
  const uint64_t need = device_weight_bytes(model);
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess)
    fail(StatusCode::kInternal, "the device's free memory could not be read");
  if (need > free_bytes)
    fail(StatusCode::kOutOfMemory, "the model's weights take " + std::to_string(need >> 20) +
                                       " MiB on the device (two bf16 terms a weight), and the device has " +
                                       std::to_string(free_bytes >> 20) + " MiB free of " +
                                       std::to_string(total_bytes >> 20));
  std::unique_ptr<DeviceForward> f(new DeviceForward(model, graphs, fused));
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) fail(StatusCode::kInternal, "the device forward's stream could not be made");
  f->stream_ = stream;
  throw_if_failed(DeviceMatmul::create(stream, &f->matmul_, ProductKernel::kPinned));
  const ModelConfig& c = model.config();
  f->layers_.resize(size_t(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    const model::LayerWeights& w = model.layer(l);
    Layer& d = f->layers_[size_t(l)];
    throw_if_failed(upload_stacked({&w.wq, &w.wk, &w.wv}, &d.wqkv));
    d.wo = upload(w.wo);
    throw_if_failed(upload_stacked({&w.w_gate, &w.w_up}, &d.w_gate_up));
    d.w_down = upload(w.w_down);
    d.attn_norm = upload_floats(w.attn_norm);
    d.ffn_norm = upload_floats(w.ffn_norm);
    d.bq = upload_floats(w.bq);
    d.bk = upload_floats(w.bk);
    d.bv = upload_floats(w.bv);
    d.q_norm = upload_floats(w.q_norm);
    d.k_norm = upload_floats(w.k_norm);
  }
  // The embedding rows come from a two-term table: the output matrix's when the model ties them.
  f->output_ = upload(model.output());
  if (model.output().data != model.token_embedding().data) f->embedding_ = upload(model.token_embedding());
  f->output_norm_ = upload_floats(model.output_norm());
  // Every product's shape reserved now (its algorithm pinned, the scratch grown to the widest):
  // the scratch never moves afterwards, so captured segments stay valid. Where cuBLASLt cannot pin
  // a shape, every product takes the heuristic kernel in its short chunks instead.
  std::vector<const DeviceMatrix*> shapes = {&f->output_};
  for (const Layer& d : f->layers_)
    for (const DeviceMatrix* m : {&d.wqkv, &d.wo, &d.w_gate_up, &d.w_down}) shapes.push_back(m);
  auto reserve_all = [&]() -> CudaStatus {
    for (const DeviceMatrix* m : shapes)
      if (CudaStatus s = f->matmul_->reserve(m->n_in, m->n_out); !s.ok) return s;
    return {};
  };
  if (const CudaStatus s = reserve_all(); !s.ok) {
    std::fprintf(stderr, "certkv: the device forward's products take cuBLAS's heuristic kernel: %s\n", s.message.c_str());
    throw_if_failed(DeviceMatmul::create(stream, &f->matmul_, ProductKernel::kHeuristic));
    throw_if_failed(reserve_all());
  }
  f->weight_bytes_ = need;
  return f;
}

DeviceForward::~DeviceForward() {
  drop_graphs();
  matmul_.reset();
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void DeviceForward::drop_graphs() {
  for (auto& [n, execs] : graphs_)
    for (void* e : execs) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(e));
  graphs_.clear();
}

void DeviceForward::ensure_buffers(int64_t rows, int64_t logit_rows) {
  const ModelConfig& c = model_.config();
  // At least a graph step's rows: a batch that grows up to it captures its segments once.
  rows = std::max(rows, kMaxGraphRows);
  if (rows > buffer_rows_) {
    const size_t n = size_t(rows);
    const size_t q_dim = size_t(c.n_heads) * size_t(c.head_dim), kv_dim = size_t(c.n_kv_heads) * size_t(c.head_dim);
    throw_if_failed(cache::cuda::synchronize_stream(stream_));  // a running step may read the old buffers
    drop_graphs();  // they name the old buffers
    throw_if_failed(PinnedBuffer::allocate(n * (sizeof(int32_t) + sizeof(float) * size_t(c.head_dim)), &staging_));
    grow(tokens_, n * sizeof(int32_t));
    grow(angles_, n * sizeof(float) * size_t(c.head_dim));  // cos, then sin: [2][rows][head_dim / 2]
    grow(x_, n * sizeof(float) * size_t(c.dim));
    grow(xn_, n * sizeof(float) * size_t(c.dim));
    grow(qkv_, n * sizeof(float) * (q_dim + 2 * kv_dim));
    grow(q_, n * sizeof(float) * q_dim);
    grow(k_, n * sizeof(float) * kv_dim);
    grow(v_, n * sizeof(float) * kv_dim);
    grow(attn_, n * sizeof(float) * q_dim);
    grow(proj_, n * sizeof(float) * size_t(c.dim));
    grow(gate_up_, n * sizeof(float) * 2 * size_t(c.ffn_dim));
    grow(act_, n * sizeof(float) * size_t(c.ffn_dim));
    buffer_rows_ = rows;
  }
  if (logit_rows > buffer_logit_rows_) {
    const size_t n = size_t(logit_rows);
    throw_if_failed(cache::cuda::synchronize_stream(stream_));  // a running step may read the old buffers
    grow(logit_index_, n * sizeof(int32_t));
    grow(logit_x_, n * sizeof(float) * size_t(c.dim));
    grow(logits_, n * sizeof(float) * size_t(c.n_vocab));
    throw_if_failed(PinnedBuffer::allocate(n * (sizeof(int32_t) + sizeof(float) * size_t(c.n_vocab)), &logits_host_));
    buffer_logit_rows_ = logit_rows;
  }
}

void DeviceForward::multiply(const DeviceMatrix& w, const float* x, int64_t rows, float* y) {
  throw_if_failed(matmul_->multiply(w, x, rows, y));
}

void DeviceForward::segment(int l, int64_t n) {
  const ModelConfig& c = model_.config();
  const int hd = c.head_dim, half = hd / 2;
  const int64_t q_dim = int64_t(c.n_heads) * hd, kv_dim = int64_t(c.n_kv_heads) * hd;
  const float eps = c.rms_eps;
  float* x = floats_mut(x_);
  float* xn = floats_mut(xn_);
  float* q = floats_mut(q_);
  float* k = floats_mut(k_);
  float* v = floats_mut(v_);
  float* proj = floats_mut(proj_);
  // Steps the pinned products take in one chunk run the fused forms (forward_kernels.h): the same
  // bits in about 40% fewer launches.
  if (fused_ && matmul_->kernel() == ProductKernel::kPinned && n <= kPinnedProductRows) {
    fused_segment(l, n);
    return;
  }
  if (l > 0) {  // the end of layer l - 1: attention's output through W_o, then the FFN
    const Layer& w = layers_[size_t(l - 1)];
    float* gate_up = floats_mut(gate_up_);
    float* act = floats_mut(act_);
    multiply(w.wo, floats(attn_), n, proj);
    throw_if_failed(add_rows(x, proj, n * c.dim, stream_));
    throw_if_failed(rms_norm_rows(x, n, c.dim, floats(w.ffn_norm), eps, xn, stream_));
    multiply(w.w_gate_up, xn, n, gate_up);
    throw_if_failed(swiglu_rows(gate_up, gate_up + c.ffn_dim, n, c.ffn_dim, 2 * int64_t(c.ffn_dim), act, stream_));
    multiply(w.w_down, act, n, proj);
    throw_if_failed(add_rows(x, proj, n * c.dim, stream_));
  }
  if (l == c.n_layers) return;
  // The start of layer l: its queries, keys and values.
  const Layer& w = layers_[size_t(l)];
  const float* dcos = floats(angles_);
  const float* dsin = dcos + n * half;
  const bool half_split = c.rope_layout == model::RopeLayout::kHalfSplit;
  float* qkv = floats_mut(qkv_);
  const ColumnPart qkv_parts[3] = {{q, 0, int(q_dim)}, {k, int(q_dim), int(kv_dim)}, {v, int(q_dim + kv_dim), int(kv_dim)}};
  throw_if_failed(rms_norm_rows(x, n, c.dim, floats(w.attn_norm), eps, xn, stream_));
  multiply(w.wqkv, xn, n, qkv);
  throw_if_failed(split_columns(qkv, n, int(q_dim + 2 * kv_dim), qkv_parts, 3, stream_));
  if (c.qkv_bias) {
    throw_if_failed(add_bias_rows(q, floats(w.bq), n, int(q_dim), stream_));
    throw_if_failed(add_bias_rows(k, floats(w.bk), n, int(kv_dim), stream_));
    throw_if_failed(add_bias_rows(v, floats(w.bv), n, int(kv_dim), stream_));
  }
  if (c.qk_norm) {  // each head a row
    throw_if_failed(rms_norm_rows(q, n * c.n_heads, hd, floats(w.q_norm), eps, q, stream_));
    throw_if_failed(rms_norm_rows(k, n * c.n_kv_heads, hd, floats(w.k_norm), eps, k, stream_));
  }
  throw_if_failed(rope_rows(q, n, c.n_heads, hd, half_split, dcos, dsin, stream_));
  throw_if_failed(rope_rows(k, n, c.n_kv_heads, hd, half_split, dcos, dsin, stream_));
}

void DeviceForward::fused_segment(int l, int64_t n) {
  const ModelConfig& c = model_.config();
  const int hd = c.head_dim, half = hd / 2;
  const int64_t q_dim = int64_t(c.n_heads) * hd, kv_dim = int64_t(c.n_kv_heads) * hd;
  const float eps = c.rms_eps;
  float* x = floats_mut(x_);
  float* q = floats_mut(q_);
  float* k = floats_mut(k_);
  float* v = floats_mut(v_);
  uint16_t* terms = matmul_->input_terms();
  const float *t = nullptr, *u = nullptr;
  if (l > 0) {  // the end of layer l - 1: W_o and the residual, then the FFN
    const Layer& w = layers_[size_t(l - 1)];
    throw_if_failed(split_bf16_rows(floats(attn_), n, int(q_dim), terms, stream_));
    throw_if_failed(matmul_->products(w.wo, terms, n, &t, &u));
    throw_if_failed(sum_split_add_rows(t, u, n, c.dim, x, stream_));
    throw_if_failed(rms_norm_split_rows(x, n, c.dim, floats(w.ffn_norm), eps, terms, stream_));
    throw_if_failed(matmul_->products(w.w_gate_up, terms, n, &t, &u));
    throw_if_failed(sum_split_swiglu_split_rows(t, u, n, c.ffn_dim, terms, stream_));
    throw_if_failed(matmul_->products(w.w_down, terms, n, &t, &u));
    throw_if_failed(sum_split_add_rows(t, u, n, c.dim, x, stream_));
  }
  if (l == c.n_layers) return;
  const Layer& w = layers_[size_t(l)];
  const float* dcos = floats(angles_);
  const float* dsin = dcos + n * half;
  const bool half_split = c.rope_layout == model::RopeLayout::kHalfSplit;
  throw_if_failed(rms_norm_split_rows(x, n, c.dim, floats(w.attn_norm), eps, terms, stream_));
  throw_if_failed(matmul_->products(w.wqkv, terms, n, &t, &u));
  throw_if_failed(sum_split_qkv_rows(t, u, n, int(q_dim), int(kv_dim), c.qkv_bias ? floats(w.bq) : nullptr,
                                     c.qkv_bias ? floats(w.bk) : nullptr, c.qkv_bias ? floats(w.bv) : nullptr, q, k, v,
                                     stream_));
  if (c.qk_norm) {  // each head a row
    throw_if_failed(rms_norm_rows(q, n * c.n_heads, hd, floats(w.q_norm), eps, q, stream_));
    throw_if_failed(rms_norm_rows(k, n * c.n_kv_heads, hd, floats(w.k_norm), eps, k, stream_));
  }
  throw_if_failed(rope_rows(q, n, c.n_heads, hd, half_split, dcos, dsin, stream_));
  throw_if_failed(rope_rows(k, n, c.n_kv_heads, hd, half_split, dcos, dsin, stream_));
}

const std::vector<void*>& DeviceForward::graphs_of(int64_t n) {
  if (graph_generation_ != matmul_->scratch_generation()) drop_graphs();
  for (const auto& [rows, execs] : graphs_)
    if (rows == n) return execs;
  graph_generation_ = matmul_->scratch_generation();
  std::vector<void*> execs;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  for (int l = 0; l <= model_.config().n_layers; ++l) {
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) {
      try {
        segment(l, n);
      } catch (...) {
        cudaStreamEndCapture(stream, &graph);
        if (graph) cudaGraphDestroy(graph);
        for (void* x : execs) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(x));
        throw;
      }
      e = cudaStreamEndCapture(stream, &graph);
    }
    cudaGraphExec_t exec = nullptr;
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
      for (void* x : execs) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(x));
      fail(StatusCode::kInternal, std::string("device forward: capturing a step of ") + std::to_string(n) +
                                      " rows: " + cudaGetErrorString(e));
    }
    execs.push_back(exec);
  }
  graphs_.emplace_back(n, std::move(execs));
  return graphs_.back().second;
}

void DeviceForward::run(const StepRows& rows, const DeviceLayerAttention& attention,
                        const std::function<void()>& host_work) {
  const ModelConfig& c = model_.config();
  const std::span<const BatchItem> items = rows.items;
  const int64_t n = rows.n_rows;
  last_wait_seconds_ = 0;
  if (n == 0) return;
  // The rows whose logits are computed: first those that come down, in the order of their
  // destinations, then the last rows of the items that only draw a token.
  struct LogitRow {
    int64_t row;
    float* dst;  // null: only sampled
  };
  std::vector<LogitRow> wanted;
  std::vector<int32_t> last_logit_row(items.size(), -1);  // an item's last row among them
  for (size_t i = 0; i < items.size(); ++i) {
    const BatchItem& it = items[i];
    if (it.all_logits) {
      for (int64_t t = 0; t < it.n; ++t) wanted.push_back({rows.row0[i] + t, it.all_logits + t * c.n_vocab});
    } else if (it.last_logits) {
      wanted.push_back({rows.row0[i] + it.n - 1, it.last_logits});
    } else {
      continue;
    }
    last_logit_row[i] = int32_t(wanted.size() - 1);
  }
  const int64_t m_download = int64_t(wanted.size());
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].token && last_logit_row[i] < 0) {
      wanted.push_back({rows.row0[i] + items[i].n - 1, nullptr});
      last_logit_row[i] = int32_t(wanted.size() - 1);
    }
  ensure_buffers(n, int64_t(wanted.size()));
  const int hd = c.head_dim, half = hd / 2;

  // Tokens and angles up.
  int32_t* tokens = reinterpret_cast<int32_t*>(staging_.data());
  float* cos = reinterpret_cast<float*>(tokens + buffer_rows_);
  float* sin = cos + n * half;
  const std::vector<float>& inv_freq = model_.rope_inv_freq();
  for (size_t i = 0; i < items.size(); ++i)
    for (int64_t t = 0; t < items[i].n; ++t) {
      const int64_t r = rows.row0[i] + t;
      tokens[r] = items[i].tokens[t];
      for (int j = 0; j < half; ++j) {
        const double angle = double(rows.pos0[i] + t) * inv_freq[size_t(j)];
        cos[r * half + j] = float(std::cos(angle));
        sin[r * half + j] = float(std::sin(angle));
      }
    }
  throw_if_failed(tokens_.upload_async(0, tokens, sizeof(int32_t) * size_t(n), stream_));
  throw_if_failed(angles_.upload_async(0, cos, sizeof(float) * size_t(n) * size_t(hd), stream_));

  const DeviceMatrix& embedding = embedding_.data.data() ? embedding_ : output_;
  const uint16_t* table = reinterpret_cast<const uint16_t*>(embedding.data.data());
  throw_if_failed(embed_rows(reinterpret_cast<const int32_t*>(tokens_.data()), n, table, table + embedding.n_in * embedding.n_out,
                             c.n_vocab, c.dim, floats_mut(x_), stream_));
  const std::vector<void*>* graphs = nullptr;
  if (use_graphs_ && n <= kMaxGraphRows) {
    try {
      graphs = &graphs_of(n);
    } catch (const Error& e) {
      // A capture this device or driver refuses: the same launches, eagerly, from now on.
      std::fprintf(stderr, "certkv: the device forward runs without CUDA graphs: %s\n", e.what());
      cudaGetLastError();
      use_graphs_ = false;
    }
  }
  for (int l = 0; l <= c.n_layers; ++l) {
    if (graphs) {
      const cudaError_t e = cudaGraphLaunch(static_cast<cudaGraphExec_t>((*graphs)[size_t(l)]),
                                            static_cast<cudaStream_t>(stream_));
      if (e != cudaSuccess) fail(StatusCode::kInternal, std::string("device forward: graph launch: ") + cudaGetErrorString(e));
    } else {
      segment(l, n);
    }
    if (l < c.n_layers) attention(l, floats_mut(q_), floats(k_), floats(v_), floats_mut(attn_));
  }
  const float eps = c.rms_eps;
  float* x = floats_mut(x_);
  const auto wait = [&]() {
    if (host_work) host_work();
    const auto t0 = std::chrono::steady_clock::now();
    throw_if_failed(cache::cuda::synchronize_stream(stream_));
    last_wait_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (wanted.empty()) {
    wait();
    return;
  }
  const int64_t m = int64_t(wanted.size());
  int32_t* index = reinterpret_cast<int32_t*>(logits_host_.data());
  for (int64_t j = 0; j < m; ++j) index[j] = int32_t(wanted[size_t(j)].row);
  throw_if_failed(logit_index_.upload_async(0, index, sizeof(int32_t) * size_t(m), stream_));
  float* lx = floats_mut(logit_x_);
  throw_if_failed(gather_rows(x, reinterpret_cast<const int32_t*>(logit_index_.data()), m, c.dim, lx, stream_));
  throw_if_failed(rms_norm_rows(lx, m, c.dim, floats(output_norm_), eps, lx, stream_));
  multiply(output_, lx, m, floats_mut(logits_));
  float* host = reinterpret_cast<float*>(index + buffer_logit_rows_);
  if (m_download > 0)
    throw_if_failed(logits_.download_async(0, host, sizeof(float) * size_t(m_download) * size_t(c.n_vocab), stream_));
  const std::vector<size_t> drawing = draw_tokens(items, last_logit_row);
  wait();
  for (int64_t j = 0; j < m_download; ++j)
    std::memcpy(wanted[size_t(j)].dst, host + j * c.n_vocab, sizeof(float) * size_t(c.n_vocab));
  for (const BatchItem& it : items)
    if (it.all_logits && it.last_logits)
      std::memcpy(it.last_logits, it.all_logits + (it.n - 1) * c.n_vocab, sizeof(float) * size_t(c.n_vocab));
  const int32_t* drawn = sample_host_tokens(drawing.size());
  for (size_t j = 0; j < drawing.size(); ++j) *items[drawing[j]].token = drawn[j];
}

}  // namespace certkv::backend::cuda

namespace certkv::backend::cuda {

std::vector<size_t> DeviceForward::draw_tokens(std::span<const BatchItem> items,
                                               const std::vector<int32_t>& last_logit_row) {
  // The rows to sample, the greedy ones first (sample_rows' order), and the items they belong to.
  std::vector<size_t> drawing;
  for (int greedy = 1; greedy >= 0; --greedy)
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].token && model::sample_greedy(items[i].sampling) == bool(greedy)) drawing.push_back(i);
  if (drawing.empty()) return drawing;
  const int m = int(drawing.size());
  int n_greedy = 0;
  while (n_greedy < m && model::sample_greedy(items[drawing[size_t(n_greedy)]].sampling)) ++n_greedy;
  const int32_t n_vocab = model_.config().n_vocab;
  const size_t host_bytes = size_t(m) * (sizeof(SampleRow) + sizeof(int32_t));
  if (sample_host_.size() < host_bytes) {
    throw_if_failed(cache::cuda::synchronize_stream(stream_));  // an earlier step may read the old one
    throw_if_failed(PinnedBuffer::allocate(host_bytes, &sample_host_));
  }
  grow(sample_rows_, size_t(m) * sizeof(SampleRow));
  grow(sampled_, size_t(m) * sizeof(int32_t));
  grow(sample_workspace_, sample_rows_workspace_bytes(m - n_greedy, n_vocab));
  SampleRow* rows = reinterpret_cast<SampleRow*>(sample_host_.data());
  for (int j = 0; j < m; ++j) {
    const BatchItem& it = items[drawing[size_t(j)]];
    rows[j] = SampleRow{last_logit_row[drawing[size_t(j)]], it.sampling.top_k, it.sampling.temperature,
                        it.sampling.top_p, model::sample_uniform(it.sampling.seed, it.draw)};
  }
  throw_if_failed(sample_rows_.upload_async(0, rows, size_t(m) * sizeof(SampleRow), stream_));
  throw_if_failed(sample_rows(floats(logits_), n_vocab, reinterpret_cast<const SampleRow*>(sample_rows_.data()), m,
                              n_greedy, reinterpret_cast<int32_t*>(sampled_.data()), sample_workspace_.data(),
                              sample_workspace_.size(), stream_));
  throw_if_failed(sampled_.download_async(0, sample_host_tokens(size_t(m)), size_t(m) * sizeof(int32_t), stream_));
  return drawing;
}

int32_t* DeviceForward::sample_host_tokens(size_t m) const {
  // After the m rows in the same page-locked buffer (draw_tokens sized it for both).
  return reinterpret_cast<int32_t*>(sample_host_.data() + m * sizeof(SampleRow));
}

}  // namespace certkv::backend::cuda
