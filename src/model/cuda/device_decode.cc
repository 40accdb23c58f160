// The device route with the CUDA backend: a DeviceKvCache per session and paged_decode per
// (step, layer).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attention/cuda/device_layer_params.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "attention/cuda/sparse_decode_cuda.h"
#include "cache/cuda/device_kv_cache.h"
#include "core/cuda_status.h"
#include "gate/meter.h"
#include "index/rabitq.h"
#include "index/top_p.h"
#include "model/device_decode.h"

namespace certkv::model {
namespace {

using attention::cuda::PageFormat;
using cache::cuda::DeviceBuffer;
using cache::cuda::PinnedBuffer;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

class CudaDeviceDecoder final : public DeviceDecoder {
 public:
  explicit CudaDeviceDecoder(const DeviceDecoderConfig& config) : config_(config) {
    refuse_unserved(config);
    if (attention::cuda::device_count() < 1)
      fail(StatusCode::kUnsupported, "device cuda: no CUDA device is visible to this process");
    cache::cuda::DeviceKvCacheConfig kc;
    kc.n_layers = config.n_layers;
    kc.n_kv_heads = config.n_kv_heads;
    kc.head_dim = config.head_dim;
    kc.block_tokens = config.block_tokens;
    kc.max_tokens = config.max_tokens;
    kc.scheme = config.scheme;
    kc.gaac_calibration = config.gaac_calibration;
    kc.rope_pairing = config.rope_pairing;
    kc.outlier_pairs = config.outlier_pairs;
    kc.fixed_outlier_pairs = config.fixed_outlier_pairs;
    kc.witness = config.witness;
    // Refuse a shape the kernels do not serve (head_dim, block_tokens, GQA ratio: the checks
    // that come before any buffer's) before device memory is taken.
    attention::cuda::PagedDecodeParams probe = params_template();
    probe.table_stride = 1;
    probe.max_seq_len = 1;
    const CudaStatus shape = attention::cuda::check(probe);
    if (!shape.ok && shape.code == StatusCode::kUnsupported) fail(shape.code, "device cuda: " + shape.message);
    throw_if_failed(cache::cuda::DeviceKvCache::create(kc, &cache_));
    throw_if_failed(DeviceBuffer::allocate(sizeof(float) * size_t(config.n_q_heads) * config.head_dim, &q_));
    throw_if_failed(DeviceBuffer::allocate(sizeof(float) * size_t(config.n_q_heads) * config.head_dim, &out_));
    if (metered_) throw_if_failed(DeviceBuffer::allocate(sizeof(float) * 3 * size_t(config.n_q_heads), &meters_));
    // Page-locked staging of a dense call: the query in, the output, the meters and the error
    // word out, so that the copies are enqueued with the launches and the call waits once.
    throw_if_failed(PinnedBuffer::allocate(q_.size() + out_.size() + meters_.size() + sizeof(uint32_t), &staging_));
  }

  void write(int layer, int64_t pos, const float* k, const float* v, int64_t n) override {
    const auto t0 = Clock::now();
    if (cache_->written(layer) != pos)
      fail(StatusCode::kInternal, "device cuda: the device KV cache holds " + std::to_string(cache_->written(layer)) +
                                      " tokens of layer " + std::to_string(layer) + " but the step writes at " +
                                      std::to_string(pos) + " (an earlier step failed halfway): reset the session");
    throw_if_failed(cache_->write(layer, k, v, n));
    write_seconds_ += seconds_since(t0);
  }

  void attend(int layer, const float* q, float* out, attention::HeadMeter* meters) override {
    const auto t0 = Clock::now();
    attention::cuda::PagedDecodeParams p = layer_params(cache_->view(layer));
    p.q = reinterpret_cast<const float*>(q_.data());
    p.out = reinterpret_cast<float*>(out_.data());
    const size_t H = size_t(config_.n_q_heads);
    if (metered_) {  // [3][n_q_heads]: the meter, A - 1, the value side
      float* m = reinterpret_cast<float*>(meters_.data());
      p.meter = m;
      p.a_minus_1 = m + H;
      p.value_rho = m + 2 * H;
    }
    p.n_splits = attention::cuda::choose_splits(p);  // planned once for the call's four uses
    const size_t need = attention::cuda::workspace_bytes(p);
    if (workspace_.size() < need) throw_if_failed(DeviceBuffer::allocate(need, &workspace_));
    p.workspace = workspace_.data();
    p.workspace_size = workspace_.size();
    // One wait per call: the query goes up, the kernels run, and the output, the meters and the
    // error word come back to page-locked staging, all enqueued on the cache's stream.
    uint8_t* host_q = staging_.data();
    float* host_out = reinterpret_cast<float*>(host_q + q_.size());
    float* host_meters = reinterpret_cast<float*>(host_q + q_.size() + out_.size());
    uint32_t* host_error = reinterpret_cast<uint32_t*>(host_q + q_.size() + out_.size() + meters_.size());
    std::memcpy(host_q, q, q_.size());
    // The error word's place in the workspace follows the split plan, which follows the length:
    // zero it for every call.
    throw_if_failed(attention::cuda::reset_error_word(p));
    throw_if_failed(q_.upload_async(0, host_q, q_.size(), p.stream));
    throw_if_failed(attention::cuda::paged_decode(p));
    throw_if_failed(attention::cuda::copy_error_word_async(p, host_error));
    throw_if_failed(out_.download_async(0, host_out, out_.size(), p.stream));
    const bool want_meters = metered_ && meters != nullptr;
    if (want_meters) throw_if_failed(meters_.download_async(0, host_meters, meters_.size(), p.stream));
    throw_if_failed(cache::cuda::synchronize_stream(p.stream));
    if (*host_error != 0)
      fail(StatusCode::kCorrupt, "device cuda: the decode kernels found " + std::to_string(*host_error) +
                                     " corrupt page entries, slots or lengths in layer " + std::to_string(layer));
    std::memcpy(out, host_out, out_.size());
    if (want_meters) {
      const float* m = host_meters;
      for (size_t h = 0; h < H; ++h) {
        attention::HeadMeter& hm = meters[h];
        hm = attention::HeadMeter{};
        const double a_minus_1 = double(m[H + h]);  // lifted on the device
        hm.log_a = std::isfinite(a_minus_1) ? std::log1p(std::max(a_minus_1, 0.0)) : INFINITY;
        hm.meter = gate::meter_from_log_a(hm.log_a);
        hm.value_rho = std::isfinite(m[2 * H + h]) ? double(m[2 * H + h]) : INFINITY;
      }
    }
    ++attention_calls_;
    attention_seconds_ += seconds_since(t0);
  }

  void attend_sparse(int layer, const float* q, float* out, const cache::KeyIndex& index, double p,
                     double deviations, uint64_t rounding_seed, attention::SparseHeadStats* stats) override {
    const auto t0 = Clock::now();
    if (!config_.sparse) fail(StatusCode::kInvalidArgument, "device cuda: this session was not configured for sparse decode");
    const int H = config_.n_kv_heads, Hq = config_.n_q_heads, D = config_.head_dim, T = config_.block_tokens;
    const int group = Hq / H;
    const cache::cuda::DeviceLayerView v = cache_->view(layer);
    const int64_t n_indexed = index.indexed_tokens(layer, 0);
    for (int h = 1; h < H; ++h)
      if (index.indexed_tokens(layer, h) != n_indexed)
        fail(StatusCode::kInvalidArgument, "device cuda: the kv heads of layer " + std::to_string(layer) +
                                               " are indexed to different lengths");
    if (n_indexed < T || n_indexed % T != 0 || n_indexed > v.host_length)
      fail(StatusCode::kInvalidArgument, "device cuda: an indexed prefix of " + std::to_string(n_indexed) +
                                             " tokens is not whole blocks within the " + std::to_string(v.host_length) +
                                             " tokens written");
    const size_t record_bytes = index.record_bytes();
    // The records, copied once: a head's tokens [uploaded, n_indexed) after its earlier ones.
    SparseLayer& sl = sparse_layers_[size_t(layer)];
    const int64_t capacity = (config_.max_tokens + T - 1) / T * T;
    if (sl.records.size() == 0) throw_if_failed(DeviceBuffer::allocate(size_t(H) * size_t(capacity) * record_bytes, &sl.records));
    if (sl.uploaded > n_indexed) sl.uploaded = 0;  // the index was rebuilt
    for (int h = 0; h < H && n_indexed > sl.uploaded; ++h)
      throw_if_failed(sl.records.upload((size_t(h) * size_t(capacity) + size_t(sl.uploaded)) * record_bytes,
                                        index.records(layer, h) + size_t(sl.uploaded) * record_bytes,
                                        size_t(n_indexed - sl.uploaded) * record_bytes));
    sl.uploaded = n_indexed;
    // Each query head's quantized query, as the CPU path draws it.
    std::vector<attention::cuda::DeviceRabitqQuery> queries(static_cast<size_t>(Hq));
    for (int hq = 0; hq < Hq; ++hq) {
      const index::RabitqHead& rh = index.head(layer, hq / group);
      const uint64_t seed = attention::sparse_head_rounding_seed(rounding_seed, hq);
      const float* qh = q + size_t(hq) * size_t(D);
      if (D == 64) {
        const index::RabitqQuery<64> rq = index::rabitq_quantize_query<64>(rh, qh, seed);
        queries[size_t(hq)] = attention::cuda::device_rabitq_query<64>(
            rh, rq, index::rabitq_logit_deviation_scale(deviations, config_.scale, rq.norm_q_centered, D));
      } else {
        const index::RabitqQuery<128> rq = index::rabitq_quantize_query<128>(rh, qh, seed);
        queries[size_t(hq)] = attention::cuda::device_rabitq_query<128>(
            rh, rq, index::rabitq_logit_deviation_scale(deviations, config_.scale, rq.norm_q_centered, D));
      }
    }
    if (queries_.size() == 0) {
      throw_if_failed(DeviceBuffer::allocate(sizeof(attention::cuda::DeviceRabitqQuery) * size_t(Hq), &queries_));
      const std::vector<uint64_t>& w = index::top_p_bucket_weights();  // one table for every length
      throw_if_failed(DeviceBuffer::allocate(sizeof(uint64_t) * w.size(), &topp_weights_));
      throw_if_failed(topp_weights_.upload(0, w.data(), sizeof(uint64_t) * w.size()));
      throw_if_failed(DeviceBuffer::allocate(sizeof(int32_t), &n_indexed_));
      throw_if_failed(DeviceBuffer::allocate(sizeof(int64_t) * size_t(Hq), &n_selected_));
      throw_if_failed(DeviceBuffer::allocate(sizeof(int64_t) * size_t(Hq), &n_widened_));
      throw_if_failed(DeviceBuffer::allocate(sizeof(double) * size_t(Hq), &mass_));
    }
    throw_if_failed(queries_.upload(0, queries.data(), queries_.size()));
    const int32_t n32 = int32_t(n_indexed);
    throw_if_failed(n_indexed_.upload(0, &n32, sizeof(n32)));
    throw_if_failed(q_.upload(0, q, q_.size()));

    attention::cuda::SparseDecodeParams sp;
    attention::cuda::describe_pages(layer_params(v), &sp);  // bf16 pages: no raw or codec fields
    sp.n_q_heads = Hq;
    sp.sm_scale = config_.scale;
    sp.p = p;
    sp.records = sl.records.data();
    sp.record_stride = capacity;
    sp.n_indexed = reinterpret_cast<const int32_t*>(n_indexed_.data());
    sp.max_indexed = n_indexed;
    sp.max_window = v.host_length - n_indexed;
    sp.queries = reinterpret_cast<const attention::cuda::DeviceRabitqQuery*>(queries_.data());
    sp.topp_weights = reinterpret_cast<const uint64_t*>(topp_weights_.data());
    sp.q = reinterpret_cast<const float*>(q_.data());
    sp.out = reinterpret_cast<float*>(out_.data());
    sp.n_selected = reinterpret_cast<int64_t*>(n_selected_.data());
    sp.n_widened = reinterpret_cast<int64_t*>(n_widened_.data());
    sp.mass = reinterpret_cast<double*>(mass_.data());
    const size_t need = attention::cuda::workspace_bytes(sp);
    if (workspace_.size() < need) throw_if_failed(DeviceBuffer::allocate(need, &workspace_));
    sp.workspace = workspace_.data();
    sp.workspace_size = workspace_.size();
    throw_if_failed(attention::cuda::sparse_decode(sp));
    throw_if_failed(out_.download(0, out, out_.size()));
    if (stats != nullptr) {
      std::vector<int64_t> selected(static_cast<size_t>(Hq)), widened(static_cast<size_t>(Hq));
      std::vector<double> mass(static_cast<size_t>(Hq));
      throw_if_failed(n_selected_.download(0, selected.data(), n_selected_.size()));
      throw_if_failed(n_widened_.download(0, widened.data(), n_widened_.size()));
      throw_if_failed(mass_.download(0, mass.data(), mass_.size()));
      for (int hq = 0; hq < Hq; ++hq) {
        attention::SparseHeadStats& st = stats[hq];
        st = attention::SparseHeadStats{};
        st.n_indexed = n_indexed;
        st.n_selected = selected[size_t(hq)];
        st.n_widened = widened[size_t(hq)];
        st.n_attended = st.n_selected + (v.host_length - n_indexed);
        st.estimated_mass = mass[size_t(hq)];
      }
    }
    ++attention_calls_;
    ++sparse_calls_;
    attention_seconds_ += seconds_since(t0);
  }

  uint64_t repair_block(int layer, int kv_head, int64_t block, const uint16_t* k_rows,
                        const uint16_t* v_rows) override {
    uint64_t bytes = 0;
    throw_if_failed(cache_->store_exact_block(layer, kv_head, block, k_rows, v_rows, &bytes));
    return bytes;
  }

  void reset() override {
    throw_if_failed(cache_->reset());
    for (SparseLayer& sl : sparse_layers_) sl.uploaded = 0;
  }

  DeviceDecodeStats stats() const override {
    const cache::cuda::DeviceKvStats k = cache_->stats();
    DeviceDecodeStats s;
    s.attention_calls = attention_calls_;
    s.sparse_calls = sparse_calls_;
    s.attention_seconds = attention_seconds_;
    s.write_seconds = write_seconds_;
    s.slots_in_use = k.slots_in_use;
    s.raw_pages_in_use = k.raw_pages_in_use;
    s.blocks_not_fitting = k.blocks_not_fitting;
    s.lossy_pages_in_use = k.lossy_pages_in_use;
    s.pages_kept_exact = k.pages_kept_exact;
    s.kv_bytes_in_use = k.bytes_in_use;
    s.kv_bytes_reserved = k.bytes_reserved;
    return s;
  }

  DevicePage read_page(int layer, cache::KvTensor kv, int kv_head, int64_t block) const override {
    cache::cuda::DevicePageBytes b;
    throw_if_failed(cache_->read_page(layer, kv, kv_head, block, &b));
    return DevicePage{b.gaac_slot, b.lossy_page, b.slot, std::move(b.bytes)};
  }

 private:
  // The kernels' view of one layer of the device cache (pools, tables, lengths, codec fields).
  attention::cuda::PagedDecodeParams layer_params(const cache::cuda::DeviceLayerView& v) const {
    attention::cuda::PagedDecodeParams p = params_template();
    attention::cuda::set_layer_pages(v, p);
    p.seq_lens = v.length;
    p.max_seq_len = v.host_length;
    return p;
  }

  attention::cuda::PagedDecodeParams params_template() const {
    attention::cuda::PagedDecodeParams p;
    p.format = attention::cuda::page_format_of(config_.scheme, config_.witness);
    p.batch = 1;
    p.n_q_heads = config_.n_q_heads;
    p.n_kv_heads = config_.n_kv_heads;
    p.head_dim = config_.head_dim;
    p.block_tokens = config_.block_tokens;
    p.sm_scale = config_.scale;
    p.rope_half_split = config_.rope_pairing == codec::RopePairing::kHalfSplit;
    p.witness = config_.witness;
    p.delta_loc = config_.delta_loc;
    return p;
  }

  DeviceDecoderConfig config_;
  std::unique_ptr<cache::cuda::DeviceKvCache> cache_;
  const bool metered_ = config_.meter && attention::cuda::page_format_metered(attention::cuda::page_format_of(config_.scheme, config_.witness));
  DeviceBuffer q_, out_, workspace_;
  DeviceBuffer meters_;  // lossy schemes: [3][n_q_heads] floats (meter, A - 1, value side)
  PinnedBuffer staging_;  // a dense call's query, output, meters and error word on the host
  // Sparse decode: per layer the key index records ([n_kv_heads][max_tokens] records) and how many
  // tokens of each head are there; the step's quantized queries, the Top-p bucket weights
  // (index::top_p_bucket_weights, uploaded once), indexed length and per-head outputs.
  struct SparseLayer {
    DeviceBuffer records;
    int64_t uploaded = 0;
  };
  std::vector<SparseLayer> sparse_layers_ = std::vector<SparseLayer>(size_t(config_.n_layers));
  DeviceBuffer queries_, topp_weights_, n_indexed_, n_selected_, n_widened_, mass_;
  int64_t sparse_calls_ = 0;
  int64_t attention_calls_ = 0;
  double attention_seconds_ = 0, write_seconds_ = 0;
};

}  // namespace

std::unique_ptr<DeviceDecoder> make_device_decoder(const DeviceDecoderConfig& config) {
  return std::make_unique<CudaDeviceDecoder>(config);
}

}  // namespace certkv::model
