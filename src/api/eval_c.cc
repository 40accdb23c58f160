// The C API's evaluations: teacher-forced quality, needle tasks, GAAC measured on KV dumps.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "api/api_status.h"
#include "certkv/certkv.h"
#include "eval/gaac_measure.h"
#include "eval/needle.h"
#include "eval/quality.h"

struct certkv_needle_task {
  certkv::eval::NeedleTask task;
};

struct certkv_gaac_report {
  certkv::eval::GaacMeasurement measurement;
  std::string first_failure;
};

namespace {

using certkv::api::guarded;
using certkv::api::set_error;

certkv_gaac_tally to_c_tally(const certkv::eval::GaacTally& t, bool fp8, bool with_speed) {
  certkv_gaac_tally c{};
  c.ratio = t.ratio();
  c.ratio_vs_fp8 = fp8 && t.stored_bytes ? double(t.element_bytes) / double(t.stored_bytes) : 0.0;
  c.bits_per_element = t.bits_per_element();
  c.content_ratio = t.content_ratio();
  c.mode_fraction_3bit = t.mode_fraction(0);
  c.mode_fraction_4bit = t.mode_fraction(1);
  c.mode_fraction_raw = t.mode_fraction(2);
  c.raw_block_fraction = t.raw_block_fraction();
  c.exponent_entropy_bits = t.exponent_entropy_bits();
  c.escape_bytes_per_page = t.escape_bytes_per_page();
  c.encode_gbps = with_speed ? t.encode_gbps() : 0.0;
  c.decode_gbps = with_speed ? t.decode_gbps() : 0.0;
  c.bf16_bytes = t.bf16_bytes;
  c.element_bytes = t.element_bytes;
  c.stored_bytes = t.stored_bytes;
  c.pages = t.pages;
  c.raw_pages = t.raw_pages;
  c.failed_pages = t.failed_pages;
  return c;
}

}  // namespace

extern "C" {

certkv_status certkv_compare_logits(const float* ref, const float* test, int32_t n_vocab,
                                    certkv_position_quality* out) {
  CERTKV_REQUIRE(out != nullptr, "certkv_compare_logits: null out");
  return guarded([&] {
    const certkv::eval::PositionQuality q = certkv::eval::compare_logits(ref, test, n_vocab);
    out->kl = q.kl;
    out->top1_agree = q.top1_agree ? 1 : 0;
    out->top5_overlap = q.top5_overlap;
  });
}

certkv_status certkv_quality_summarize(const certkv_position_quality* positions, size_t n,
                                       certkv_quality_summary* out) {
  CERTKV_REQUIRE(out != nullptr, "certkv_quality_summarize: null out");
  CERTKV_REQUIRE(positions != nullptr || n == 0, "certkv_quality_summarize: null positions");
  return guarded([&] {
    certkv::eval::QualityAccumulator acc;
    for (size_t i = 0; i < n; ++i)
      acc.add({positions[i].kl, positions[i].top1_agree != 0, positions[i].top5_overlap});
    const certkv::eval::QualitySummary s = acc.summary();
    *out = {s.n_positions, s.mean_kl, s.max_kl, s.p99_kl, s.top1, s.top5};
  });
}

certkv_needle_params certkv_needle_default_params(void) {
  certkv_needle_params p{};
  p.variant = nullptr;
  p.target_tokens = 4096;
  return p;
}

certkv_status certkv_needle_check_variant(const char* variant) {
  CERTKV_REQUIRE(variant != nullptr, "certkv_needle_check_variant: null variant");
  return guarded([&] { certkv::eval::parse_needle_variant(variant); });
}

certkv_status certkv_needle_task_create(const certkv_needle_params* params,
                                        certkv_count_tokens_fn count_tokens, void* user,
                                        certkv_needle_task** out) {
  CERTKV_REQUIRE(params != nullptr && count_tokens != nullptr && out != nullptr,
                 "certkv_needle_task_create: null argument");
  CERTKV_REQUIRE(params->corpus_paths != nullptr || params->n_corpus_paths == 0,
                 "certkv_needle_task_create: null corpus_paths");
  *out = nullptr;
  return guarded([&] {
    certkv::eval::NeedleParams np;
    if (params->variant != nullptr) np.variant = certkv::eval::parse_needle_variant(params->variant);
    for (size_t i = 0; i < params->n_corpus_paths; ++i) {
      if (params->corpus_paths[i] == nullptr)
        certkv::fail(certkv::StatusCode::kInvalidArgument,
                     "certkv_needle_task_create: corpus path " + std::to_string(i) + " is null");
      np.corpus_paths.push_back(params->corpus_paths[i]);
    }
    np.haystack = np.corpus_paths.empty() ? certkv::eval::NeedleHaystack::kNoise
                                          : certkv::eval::NeedleHaystack::kCorpus;
    np.target_tokens = params->target_tokens;
    np.seed = params->seed;
    const certkv::eval::CountTokens count = [&](std::string_view text) {
      const int64_t n = count_tokens(user, text.data(), text.size());
      if (n < 0) certkv::fail(certkv::StatusCode::kInvalidArgument, "certkv_needle_task_create: count_tokens failed");
      return n;
    };
    auto task = std::make_unique<certkv_needle_task>();
    task->task = certkv::eval::generate_needle_task(np, count);
    *out = task.release();
  });
}

void certkv_needle_task_free(certkv_needle_task* task) { delete task; }

certkv_status certkv_needle_task_get_info(const certkv_needle_task* task,
                                          certkv_needle_task_info* info) {
  CERTKV_REQUIRE(task != nullptr && info != nullptr, "certkv_needle_task_get_info: null argument");
  const certkv::eval::NeedleTask& t = task->task;
  info->context = t.context.c_str();
  info->question = t.question.c_str();
  info->answer_prefix = t.answer_prefix.c_str();
  info->first_answer = t.answers.empty() ? "" : t.answers[0].c_str();
  info->n_answers = int32_t(t.answers.size());
  info->depth = t.depth;
  info->prompt_tokens = t.prompt_tokens;
  return CERTKV_OK;
}

certkv_status certkv_needle_score(const certkv_needle_task* task, const char* generated,
                                  size_t n_bytes, int* exact_match, double* recall) {
  CERTKV_REQUIRE(task != nullptr, "certkv_needle_score: null task");
  CERTKV_REQUIRE(generated != nullptr || n_bytes == 0, "certkv_needle_score: null generated text");
  return guarded([&] {
    const std::string_view text(generated ? generated : "", n_bytes);
    if (exact_match) *exact_match = certkv::eval::needle_exact_match(task->task, text) ? 1 : 0;
    if (recall) *recall = certkv::eval::needle_recall(task->task, text);
  });
}

certkv_gaac_measure_params certkv_gaac_measure_default_params(void) {
  certkv_gaac_measure_params p{};
  p.codec = nullptr;
  p.block_tokens = 16;
  p.passes = 3;
  p.segment_tokens = 1024;
  return p;
}

certkv_status certkv_gaac_measure(const certkv_gaac_measure_params* params, certkv_gaac_report** out) {
  CERTKV_REQUIRE(params != nullptr && out != nullptr, "certkv_gaac_measure: null argument");
  CERTKV_REQUIRE(params->calibration != nullptr, "certkv_gaac_measure: no calibration (KV dumps or a calibration file)");
  *out = nullptr;
  return guarded([&] {
    certkv::eval::GaacMeasureParams p;
    if (params->codec != nullptr) p.codec = params->codec;
    p.calibration = params->calibration;
    if (params->in != nullptr) p.in = params->in;
    if (params->save_calibration != nullptr) p.save_calibration = params->save_calibration;
    p.block_tokens = params->block_tokens;
    p.passes = params->passes;
    p.segment_tokens = params->segment_tokens;
    p.cross_check_ref = params->verify_ref != 0;
    auto report = std::make_unique<certkv_gaac_report>();
    report->measurement = certkv::eval::measure_gaac(p);
    *out = report.release();
  });
}

void certkv_gaac_report_free(certkv_gaac_report* report) { delete report; }

certkv_status certkv_gaac_report_get_info(const certkv_gaac_report* report,
                                          certkv_gaac_report_info* info) {
  CERTKV_REQUIRE(report != nullptr && info != nullptr, "certkv_gaac_report_get_info: null argument");
  const certkv::eval::GaacMeasurement& m = report->measurement;
  const bool fp8 = m.element != "bf16";
  *info = {};
  info->codec = m.codec.c_str();
  info->element = m.element.c_str();
  info->kernel = m.kernel.c_str();
  info->calibration = m.calibration_description.c_str();
  info->calibrate_seconds = m.calibrate_seconds;
  info->encoded = m.encoded ? 1 : 0;
  info->in = m.in.c_str();
  info->n_layers = int32_t(m.layers.size());
  info->n_kv_heads = m.n_kv_heads;
  info->head_dim = m.head_dim;
  info->n_tokens = m.n_tokens;
  info->block_tokens = m.block_tokens;
  info->segment_tokens = m.segment_tokens;
  info->n_segments = int32_t(m.segments[0].size());
  info->ref_cross_checked = m.cross_check_ref ? 1 : 0;
  info->verify_ok = m.total.failed_pages == 0 ? 1 : 0;
  info->first_failure = m.total.first_failure.c_str();
  info->total = to_c_tally(m.total, fp8, true);
  info->k = to_c_tally(m.by_kv[0], fp8, true);
  info->v = to_c_tally(m.by_kv[1], fp8, true);
  return CERTKV_OK;
}

certkv_status certkv_gaac_report_layer(const certkv_gaac_report* report, int32_t index,
                                       certkv_gaac_layer_report* out) {
  CERTKV_REQUIRE(report != nullptr && out != nullptr, "certkv_gaac_report_layer: null argument");
  const certkv::eval::GaacMeasurement& m = report->measurement;
  if (index < 0 || size_t(index) >= m.layers.size())
    return set_error(CERTKV_ERR_OUT_OF_RANGE, "certkv_gaac_report_layer: index " + std::to_string(index) +
                                                  " is not in [0, " + std::to_string(m.layers.size()) + ")");
  const certkv::eval::GaacLayerTally& l = m.layers[size_t(index)];
  const bool fp8 = m.element != "bf16";
  out->layer = l.layer;
  out->k = to_c_tally(l.k, fp8, false);
  out->v = to_c_tally(l.v, fp8, false);
  out->k_escape_capacity_bytes = l.k_escape_capacity_bytes;
  out->v_escape_capacity_bytes = l.v_escape_capacity_bytes;
  return CERTKV_OK;
}

certkv_status certkv_gaac_report_segment(const certkv_gaac_report* report, int32_t index,
                                         certkv_gaac_tally* k, certkv_gaac_tally* v) {
  CERTKV_REQUIRE(report != nullptr && k != nullptr && v != nullptr, "certkv_gaac_report_segment: null argument");
  const certkv::eval::GaacMeasurement& m = report->measurement;
  if (index < 0 || size_t(index) >= m.segments[0].size())
    return set_error(CERTKV_ERR_OUT_OF_RANGE, "certkv_gaac_report_segment: index " + std::to_string(index) +
                                                  " is not in [0, " + std::to_string(m.segments[0].size()) + ")");
  const bool fp8 = m.element != "bf16";
  *k = to_c_tally(m.segments[0][size_t(index)], fp8, false);
  *v = to_c_tally(m.segments[1][size_t(index)], fp8, false);
  return CERTKV_OK;
}

}  // extern "C"
