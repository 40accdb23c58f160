// The C API's RaBitQ key index and Top-p selection on caller-held arrays (docs/sparse.md): the
// index layer's records, estimates and selection, for studying the sparse tier outside a session.
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "api/api_status.h"
#include "cache/key_index.h"
#include "certkv/certkv.h"
#include "core/status.h"
#include "index/rabitq.h"
#include "index/top_p.h"

using certkv::api::guarded;
using certkv::api::set_error;

namespace {

// Calls f(std::integral_constant<int, D>) for the head_dims the index is instantiated for;
// false for any other.
template <typename F>
bool with_index_dim(int32_t head_dim, F&& f) {
  switch (head_dim) {
    case 32: f(std::integral_constant<int, 32>{}); return true;
    case 64: f(std::integral_constant<int, 64>{}); return true;
    case 96: f(std::integral_constant<int, 96>{}); return true;
    case 128: f(std::integral_constant<int, 128>{}); return true;
    case 256: f(std::integral_constant<int, 256>{}); return true;
    default: return false;
  }
}

bool all_finite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

std::string head_dim_message(const std::string& where, int32_t head_dim) {
  return where + ": head_dim " + std::to_string(head_dim) + " is not one the index serves (32, 64, 96, 128, 256)";
}

// The checks of a head shared by the index functions; names the function and the field.
certkv_status check_head(const std::string& where, const certkv_rabitq_head* head) {
  CERTKV_REQUIRE(head != nullptr, where + ": null head");
  CERTKV_REQUIRE(with_index_dim(head->head_dim, [](auto) {}), head_dim_message(where, head->head_dim));
  CERTKV_REQUIRE(head->c_q != nullptr && head->c_k != nullptr, where + ": head has a null c_q or c_k");
  CERTKV_REQUIRE(all_finite(head->c_q, size_t(head->head_dim)), where + ": head.c_q has a non-finite value");
  CERTKV_REQUIRE(all_finite(head->c_k, size_t(head->head_dim)), where + ": head.c_k has a non-finite value");
  CERTKV_REQUIRE(head->rotation != nullptr, where + ": head.rotation is null (haar or hadamard)");
  return CERTKV_OK;
}

certkv::index::RabitqHead make_head(const certkv_rabitq_head& h) {
  const int d = h.head_dim;
  return certkv::index::RabitqHead(std::vector<float>(h.c_q, h.c_q + d), std::vector<float>(h.c_k, h.c_k + d),
                           certkv::index::Rotation(certkv::cache::parse_rotation_kind(h.rotation), d, h.rotation_seed));
}

}  // namespace

extern "C" {

certkv_status certkv_rabitq_record_bytes(int32_t head_dim, size_t* record_bytes) {
  CERTKV_REQUIRE(record_bytes != nullptr, "certkv_rabitq_record_bytes: null record_bytes");
  CERTKV_REQUIRE(with_index_dim(head_dim,
                                [&](auto dim) { *record_bytes = certkv::index::rabitq_bytes_per_token<decltype(dim)::value>(); }),
                 head_dim_message("certkv_rabitq_record_bytes", head_dim));
  return CERTKV_OK;
}

certkv_status certkv_rabitq_encode_keys(const certkv_rabitq_head* head, const float* k, int64_t n_tokens,
                                        void* records) {
  const std::string where = "certkv_rabitq_encode_keys";
  if (const certkv_status s = check_head(where, head); s != CERTKV_OK) return s;
  CERTKV_REQUIRE(n_tokens >= 0, where + ": n_tokens " + std::to_string(n_tokens) + " is negative");
  CERTKV_REQUIRE(n_tokens == 0 || (k != nullptr && records != nullptr), where + ": null k or records");
  CERTKV_REQUIRE(all_finite(k, size_t(n_tokens) * size_t(head->head_dim)), where + ": k has a non-finite value");
  return guarded([&] {
    const certkv::index::RabitqHead h = make_head(*head);
    with_index_dim(head->head_dim, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      // The records are written through a buffer of the struct: the caller's may be unaligned.
      std::vector<certkv::index::RabitqRecord<D>> out(static_cast<size_t>(n_tokens));
      certkv::index::rabitq_encode_keys<D>(h, k, n_tokens, out.data());
      if (n_tokens > 0) std::memcpy(records, out.data(), out.size() * sizeof(out[0]));
    });
  });
}

certkv_status certkv_rabitq_estimate_scores(const certkv_rabitq_head* head, const void* records, int64_t n_tokens,
                                            const float* q, uint64_t rounding_seed, float* scores,
                                            float* scores_ref) {
  const std::string where = "certkv_rabitq_estimate_scores";
  if (const certkv_status s = check_head(where, head); s != CERTKV_OK) return s;
  CERTKV_REQUIRE(n_tokens >= 0, where + ": n_tokens " + std::to_string(n_tokens) + " is negative");
  CERTKV_REQUIRE(q != nullptr, where + ": null q");
  CERTKV_REQUIRE(n_tokens == 0 || (records != nullptr && scores != nullptr), where + ": null records or scores");
  CERTKV_REQUIRE(all_finite(q, size_t(head->head_dim)), where + ": q has a non-finite value");
  return guarded([&] {
    const certkv::index::RabitqHead h = make_head(*head);
    with_index_dim(head->head_dim, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      std::vector<certkv::index::RabitqRecord<D>> in(static_cast<size_t>(n_tokens));
      if (n_tokens > 0) std::memcpy(in.data(), records, in.size() * sizeof(in[0]));
      for (size_t t = 0; t < in.size(); ++t)
        if (const char* problem = certkv::index::rabitq_record_problem<D>(in[t]))
          certkv::fail(certkv::StatusCode::kInvalidArgument,
                       where + ": record " + std::to_string(t) + ": " + problem);
      const certkv::index::RabitqQuery<D> query = certkv::index::rabitq_quantize_query<D>(h, q, rounding_seed);
      certkv::index::rabitq_estimate_scores_popcount<D>(h, query, in.data(), n_tokens, scores);
      if (scores_ref != nullptr) certkv::index::rabitq_estimate_scores_ref<D>(h, query, in.data(), n_tokens, scores_ref);
    });
  });
}

certkv_status certkv_top_p_select(const float* logits, int64_t n, double p, uint8_t* mask,
                                  certkv_top_p_selection* out) {
  const std::string where = "certkv_top_p_select";
  CERTKV_REQUIRE(out != nullptr, where + ": null out");
  CERTKV_REQUIRE(n >= 1, where + ": n " + std::to_string(n) + " is below 1");
  CERTKV_REQUIRE(logits != nullptr && mask != nullptr, where + ": null logits or mask");
  CERTKV_REQUIRE(p > 0 && p <= 1, where + ": p " + std::to_string(p) + " is not in (0, 1]");
  CERTKV_REQUIRE(all_finite(logits, size_t(n)), where + ": logits has a non-finite value");
  return guarded([&] {
    const certkv::index::TopPSelection s = certkv::index::top_p_select(logits, n, p, mask);
    *out = {s.threshold, s.bucket, s.n_selected, s.mass, s.n_boundary};
  });
}

}  // extern "C"
