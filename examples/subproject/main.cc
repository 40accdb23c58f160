// A program that builds certkv as its subproject and links certkv::certkv: the library's version
// and one comparison of two next-token distributions with a known answer.
#include <cmath>
#include <cstdio>

#include "certkv/certkv.hpp"

int main() {
  std::printf("certkv %s (built as a subproject)\n", certkv_version());
  // Identical logits: KL 0, the same top-1 and all of the top 5 shared.
  const float logits[6] = {0.5f, -1.0f, 2.0f, 0.0f, 1.5f, -3.0f};
  certkv_position_quality q;
  certkv::check(certkv_compare_logits(logits, logits, 6, &q));
  std::printf("KL of a distribution with itself: %g, top-5 overlap %g\n", q.kl, q.top5_overlap);
  if (std::fabs(q.kl) > 1e-12 || q.top1_agree != 1 || q.top5_overlap != 1.0) {
    std::fprintf(stderr, "subproject_demo: expected KL 0, top-1 agreement and top-5 overlap 1\n");
    return 1;
  }
  // A non-finite logit is refused with a message naming it.
  const float bad[2] = {0.0f, NAN};
  try {
    certkv::check(certkv_compare_logits(logits, bad, 2, &q));
    std::fprintf(stderr, "subproject_demo: a NaN logit was not refused\n");
    return 1;
  } catch (const certkv::ApiError& e) {
    std::printf("refused: %s\n", e.what());
    if (e.status() != CERTKV_ERR_INVALID_ARGUMENT) return 1;
  }
  std::printf("subproject_demo: ok\n");
  return 0;
}
