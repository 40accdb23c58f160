/* A C program on certkv's installed C API: the library's version, one computation with a known
 * answer and two error paths, each result checked. It loads no model. */
#include <stdio.h>
#include <string.h>

#include "certkv/certkv.h"

static int failures = 0;

#define EXPECT(cond)                                                                \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "c_consumer: line %d: expected %s\n", __LINE__, #cond);     \
      ++failures;                                                                   \
    }                                                                               \
  } while (0)

int main(void) {
  printf("certkv %s\n", certkv_version());
#ifdef CERTKV_EXPECTED_VERSION
  EXPECT(strcmp(certkv_version(), CERTKV_EXPECTED_VERSION) == 0);
#endif

  /* KL(softmax(ref) || softmax(test)) for p = (1/2, 1/2) and q = (3/4, 1/4): (1/2) ln(4/3). */
  const float ref[2] = {0.0f, 0.0f};
  const float test[2] = {1.0986123f /* ln 3 */, 0.0f};
  certkv_position_quality q;
  EXPECT(certkv_compare_logits(ref, test, 2, &q) == CERTKV_OK);
  const double kl_expected = 0.14384103622589045;
  const double kl_error = q.kl > kl_expected ? q.kl - kl_expected : kl_expected - q.kl;
  EXPECT(kl_error < 1e-6);
  EXPECT(q.top1_agree == 1);
  printf("KL((1/2, 1/2) || (3/4, 1/4)) = %.6f nats\n", q.kl);

  /* A missing model file: a clean error with a message naming the file, no model. */
  const char* missing = "/nonexistent/certkv-c-consumer/model.gguf";
  certkv_model* model = NULL;
  certkv_status status = certkv_model_load(missing, &model);
  EXPECT(status == CERTKV_ERR_NOT_FOUND);
  EXPECT(model == NULL);
  EXPECT(strstr(certkv_last_error(), missing) != NULL);
  printf("certkv_model_load(missing): %s: %s\n", certkv_status_string(status), certkv_last_error());

  /* A null argument is refused, not dereferenced. */
  EXPECT(certkv_compare_logits(ref, NULL, 2, &q) == CERTKV_ERR_INVALID_ARGUMENT);

  if (failures != 0) {
    fprintf(stderr, "c_consumer: %d check(s) failed\n", failures);
    return 1;
  }
  printf("c_consumer: ok\n");
  return 0;
}
