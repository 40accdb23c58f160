#include "backend/session.h"

#include <algorithm>
#include <string>

#include "core/status.h"

namespace certkv::backend {

Session::Session(const model::Model& model, const BackendConfig& config) : backend_(model, config) {
  seq_ = backend_.create_sequence();
}

Session::~Session() = default;

void Session::prefill(const int32_t* tokens, int64_t n, float* last_logits, float* all_logits,
                      const ProgressFn& progress) {
  const model::ModelConfig& c = model().config();
  if (n < 1) fail(StatusCode::kInvalidArgument, "prefill needs at least one token");
  if (n_past() + n > context_tokens())
    fail(StatusCode::kOutOfRange, "the prompt (" + std::to_string(n) + " tokens, " +
                                      std::to_string(n_past()) +
                                      " already in the cache) is longer than the context (" +
                                      std::to_string(context_tokens()) + " tokens)");
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.n_vocab)
      fail(StatusCode::kInvalidArgument, "token id " + std::to_string(tokens[i]) +
                                             " is outside the vocabulary (" +
                                             std::to_string(c.n_vocab) + ")");
  const int64_t chunk = config().prefill_chunk_tokens;
  for (int64_t done = 0; done < n; done += chunk) {
    const int64_t m = std::min(chunk, n - done);
    const bool last = done + m == n;
    BatchItem item;
    item.seq = seq_;
    item.tokens = tokens + done;
    item.n = m;
    item.last_logits = last ? last_logits : nullptr;
    item.all_logits = all_logits ? all_logits + done * c.n_vocab : nullptr;
    item.end_of_input = last;
    backend_.forward({&item, 1});
    if (progress) progress(done + m, n);
  }
}

void Session::decode(int32_t token, float* logits) { prefill(&token, 1, logits); }

void Session::reset() {
  seq_ = backend_.restart_sequence(seq_);
}

}  // namespace certkv::backend
