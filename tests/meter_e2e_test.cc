// The meter, the audit and the gate end to end on the embedded default (SmolLM2-135M-Instruct)
// through the C API: a 512-token passage prefilled, then 16 teacher-forced decode steps whose every
// (layer, head) cell is metered and audited against the true total variation; zero violations for
// every lossy scheme; the gate brings every cell of the broken raw FP8 cast under tau and pages in
// exact blocks; telemetry and bad parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "certkv/certkv.h"
#include "certkv/certkv.hpp"
#include "format/safetensors.h"
#include "gaac_e2e_support.h"
#include "test_paths.h"

namespace {

using certkv::testing::book_tokens;
using certkv::testing::smollm2_gguf;
using certkv::testing::temp_path;

constexpr int kPrefix = 512;
constexpr int kSteps = 16;

// A session of scheme kv with the given Tier A witness, audited on every cell over MeterEndToEnd::run(): its
// audit, the lossy class's pages and bytes, and whether it was metered.
struct AuditedRun {
  certkv_audit_stats audit;
  uint64_t lossy_bytes = 0, lossy_pages = 0;
  int metered = 0;
};

class MeterEndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::ifstream(smollm2_gguf()).good()) return;
    model_ = std::make_unique<certkv::Model>(smollm2_gguf());
  }
  static void TearDownTestSuite() { model_.reset(); }
  void SetUp() override {
    if (!model_) GTEST_FAIL() << smollm2_gguf() << " is missing: run scripts/fetch_models.sh";
  }

  static certkv_session_params params(const char* kv) {
    certkv_session_params p = certkv_session_default_params();
    p.context_tokens = kPrefix + kSteps;
    p.kv = kv;
    p.meter_planned_steps = kSteps;
    return p;
  }

  // Prefill kPrefix tokens of Dracula, then kSteps teacher-forced decode steps.
  static void run(certkv::Session& session) {
    const std::vector<int32_t> tokens = book_tokens(*model_, "stoker-dracula.txt", kPrefix + kSteps);
    std::vector<float> logits(size_t(model_->info().n_vocab));
    session.prefill(std::vector<int32_t>(tokens.begin(), tokens.begin() + kPrefix), logits.data());
    for (int i = kPrefix; i < kPrefix + kSteps; ++i) session.decode(tokens[size_t(i)], logits.data());
  }

  static AuditedRun audited_run(const char* kv, const char* witness) {
    certkv_session_params p = params(kv);
    p.witness = witness;
    certkv::Session session(*model_, p);
    certkv::check(certkv_session_audit_enable(session.get(), 0, 1));
    run(session);
    AuditedRun r;
    r.audit = session.audit_stats();
    r.metered = session.meter_stats().metered;
    const certkv_kv_stats kvs = session.kv_stats();
    for (int i = 0; i < kvs.n_classes; ++i)
      if (std::string(kvs.by_class[i].storage) == "lossy") {
        r.lossy_bytes = kvs.by_class[i].page_bytes_in_use;
        r.lossy_pages = kvs.by_class[i].pages_in_use;
      }
    return r;
  }

  static std::unique_ptr<certkv::Model> model_;
};

std::unique_ptr<certkv::Model> MeterEndToEnd::model_;

TEST_F(MeterEndToEnd, AuditFindsNoViolationForAnyLossyScheme) {
  const certkv_model_info info = model_->info();
  const int64_t cells = int64_t(kSteps) * info.n_layers * info.n_heads;
  for (const char* kv : {"fp8-e4m3", "fp8-e5m2", "fp8-e4m3-scaled", "rtn8", "rtn4", "kivi2", "dither8"}) {
    certkv::Session session(*model_, params(kv));
    certkv::check(certkv_session_audit_enable(session.get(), 0, 1));
    run(session);
    const certkv_audit_stats a = session.audit_stats();
    const certkv_meter_stats m = session.meter_stats();
    EXPECT_EQ(a.cells, cells) << kv;
    EXPECT_EQ(a.violations, 0) << kv << ": worst margin " << a.worst_margin;
    EXPECT_LT(a.worst_margin, 0) << kv;
    EXPECT_GT(a.max_tv, 0) << kv << ": the compressed cache must differ from the exact one";
    EXPECT_EQ(m.metered, 1);
    EXPECT_EQ(m.cells, cells) << kv;
    EXPECT_EQ(std::string(m.tier), std::string(kv) == "dither8" ? "B" : "A");
    EXPECT_NEAR(m.coverage, a.coverage, 1e-12) << kv;
    if (std::string(kv) == "rtn8" || std::string(kv) == "dither8") {
      EXPECT_GT(a.coverage, 0.5) << kv << ": 8-bit schemes are mostly certified at tau 0.2";
      EXPECT_GT(a.tightness_q50, 1.0) << kv;
    }
  }
}

// The page-scaled 8-bit witness (certkv_session_params.witness "u8"): every Tier A scheme audited
// sound on every cell, the K pages' side data halved (the lossy class's pages smaller by the
// bytes saved), and the meter within a few percent of the fp16 witness's: coverage at tau and the
// median tightness (meter / TV) of the same cells.
TEST_F(MeterEndToEnd, PageScaledWitnessIsSoundAndNearlyAsTight) {
  const certkv_model_info info = model_->info();
  const int64_t cells = int64_t(kSteps) * info.n_layers * info.n_heads;
  for (const char* kv : {"fp8-e4m3", "rtn8", "kivi2"}) {  // a raw cast, per-token and per-channel scales
    certkv_audit_stats a[2];
    uint64_t lossy_bytes[2] = {0, 0};
    for (int coded = 0; coded < 2; ++coded) {
      const AuditedRun r = audited_run(kv, coded ? "u8" : "fp16");
      a[coded] = r.audit;
      lossy_bytes[coded] = r.lossy_bytes;
    }
    SCOPED_TRACE(kv);
    EXPECT_EQ(a[1].cells, cells);
    EXPECT_EQ(a[1].violations, 0) << "worst margin " << a[1].worst_margin;
    EXPECT_GT(lossy_bytes[0], 0u);
    EXPECT_LT(lossy_bytes[1], lossy_bytes[0]) << "the coded witness must take fewer bytes";
    // Close to the fp16 witness on the same cells. (Not ordered cell by cell: a code's value can
    // land between a bound and that bound rounded up to fp16.)
    EXPECT_NEAR(a[1].coverage, a[0].coverage, 0.02);
    EXPECT_NEAR(a[1].tightness_q50, a[0].tightness_q50, 0.05 * a[0].tightness_q50);
  }
}

// The exponent witness (certkv_session_params.witness "exponent", fp8-e4m3 only): no witness bytes
// in the K pages, the bound made from the codes; every cell of the audit sound, the lossy class's
// pages smaller by the fp16 witness's 32 bytes per K token, and the meter looser than the fp16
// witness's by a bounded factor (c_t about 1.3x on real KV, docs/meter.md section 7).
TEST_F(MeterEndToEnd, ExponentWitnessIsSoundWithNoWitnessBytes) {
  const certkv_model_info info = model_->info();
  const int64_t cells = int64_t(kSteps) * info.n_layers * info.n_heads;
  certkv_audit_stats a[2];
  uint64_t lossy_bytes[2] = {0, 0}, lossy_pages[2] = {0, 0};
  for (int exponent = 0; exponent < 2; ++exponent) {
    const AuditedRun r = audited_run("fp8-e4m3", exponent ? "exponent" : "fp16");
    a[exponent] = r.audit;
    lossy_bytes[exponent] = r.lossy_bytes;
    lossy_pages[exponent] = r.lossy_pages;
    EXPECT_EQ(r.metered, 1);
  }
  EXPECT_EQ(a[1].cells, cells);
  EXPECT_EQ(a[1].violations, 0) << "worst margin " << a[1].worst_margin;
  EXPECT_GT(a[1].max_tv, 0) << "the compressed cache must differ from the exact one";
  // Half the lossy pages are K pages; each keeps 16 tokens x 16 bands x 2 bytes less.
  ASSERT_EQ(lossy_pages[1], lossy_pages[0]) << "no block may fall back to exact on this text";
  EXPECT_EQ(lossy_bytes[0] - lossy_bytes[1], lossy_pages[0] / 2 * 16 * 16 * 2);
  // Looser than the fp16 witness on the same cells, not by an order of magnitude.
  EXPECT_GE(a[1].tightness_q50, a[0].tightness_q50 * 0.95);
  EXPECT_LE(a[1].tightness_q50, a[0].tightness_q50 * 3.0);
  EXPECT_LE(a[1].coverage, a[0].coverage + 0.02);
  RecordProperty("coverage_fp16", std::to_string(a[0].coverage));
  RecordProperty("coverage_exponent", std::to_string(a[1].coverage));
  RecordProperty("tightness_q50_fp16", std::to_string(a[0].tightness_q50));
  RecordProperty("tightness_q50_exponent", std::to_string(a[1].tightness_q50));
}

TEST_F(MeterEndToEnd, GateRepairsTheRawFp8CastUnderTau) {
  certkv_session_params p = params("fp8-e4m3");
  p.gate = 1;
  p.meter_tau = 0.05;
  certkv::Session gated(*model_, p);
  certkv::check(certkv_session_audit_enable(gated.get(), 0, 1));
  run(gated);
  const certkv_meter_stats m = gated.meter_stats();
  EXPECT_GT(m.repairs, 0);
  EXPECT_EQ(uint64_t(m.repairs) * 16 * uint64_t(model_->info().head_dim) * 2, m.pagein_bytes);
  // Every repaired block of the sequence is now exact bf16.
  const certkv_kv_stats kvs = gated.kv_stats();
  uint64_t bf16_pages = 0;
  for (int i = 0; i < kvs.n_classes; ++i)
    if (std::string(kvs.by_class[i].storage) == "bf16") bf16_pages = kvs.by_class[i].pages_in_use;
  EXPECT_GE(bf16_pages, uint64_t(m.repairs));

  certkv_session_params q = params("fp8-e4m3");
  certkv::Session ungated(*model_, q);
  run(ungated);
  EXPECT_EQ(ungated.meter_stats().repairs, 0);
}

TEST_F(MeterEndToEnd, AuditDumpHoldsCellsAnIndependentCheckCanRecompute) {
  certkv::Session session(*model_, params("rtn4"));
  certkv::check(certkv_session_audit_enable(session.get(), 4, 7));
  run(session);
  const std::string path = temp_path("meter_audit_dump.safetensors");
  certkv::check(certkv_session_audit_dump(session.get(), path.c_str()));
  const std::unique_ptr<certkv::format::SafetensorsFile> file = certkv::format::SafetensorsFile::open(path);
  const certkv::format::SafetensorsFile& f = *file;
  auto tensor = [&](const std::string& name) -> const certkv::format::SafetensorsTensor& {
    const certkv::format::SafetensorsTensor* t = f.find(name);
    if (t == nullptr) throw std::runtime_error("no tensor " + name);
    return *t;
  };
  const int d = int(model_->info().head_dim);
  int recomputed = 0;
  for (int i = 0; i < 6; ++i) {
    const std::string c = "cell" + std::to_string(i);
    const auto& q = tensor(c + ".q");
    const auto& k = tensor(c + ".k");
    const auto& k_hat = tensor(c + ".k_hat");
    ASSERT_EQ(q.shape, (std::vector<int64_t>{d}));
    ASSERT_EQ(k.shape, k_hat.shape);
    const float* qp = reinterpret_cast<const float*>(q.data);
    const float* kp = reinterpret_cast<const float*>(k.data);
    const float* kh = reinterpret_cast<const float*>(k_hat.data);
    float scale;
    double meter;
    std::memcpy(&scale, tensor(c + ".scale").data, 4);
    std::memcpy(&meter, tensor(c + ".meter").data, 8);
    const int64_t s = k.shape[0];
    std::vector<double> a(static_cast<size_t>(s)), b(static_cast<size_t>(s));
    double ma = -1e300, mb = -1e300;
    for (int64_t t = 0; t < s; ++t) {
      double x = 0, y = 0;
      for (int e = 0; e < d; ++e) {
        x += double(qp[e]) * kp[t * d + e];
        y += double(qp[e]) * kh[t * d + e];
      }
      a[size_t(t)] = scale * x;
      b[size_t(t)] = scale * y;
      ma = std::max(ma, a[size_t(t)]);
      mb = std::max(mb, b[size_t(t)]);
    }
    double za = 0, zb = 0;
    for (int64_t t = 0; t < s; ++t) {
      za += std::exp(a[size_t(t)] - ma);
      zb += std::exp(b[size_t(t)] - mb);
    }
    double tv = 0;
    for (int64_t t = 0; t < s; ++t) tv += std::fabs(std::exp(a[size_t(t)] - ma) / za - std::exp(b[size_t(t)] - mb) / zb);
    tv *= 0.5;
    EXPECT_GE(meter, tv - 1e-9) << c;
    ++recomputed;
  }
  EXPECT_EQ(recomputed, 6);
  EXPECT_EQ(f.metadata().at("scheme"), "rtn4");
  std::remove(path.c_str());
}

TEST_F(MeterEndToEnd, BadMeterParametersAreClearErrors) {
  certkv_session* s = nullptr;
  certkv_session_params p = params("dither8");
  p.meter_tau = 0;
  EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("tau"), std::string::npos) << certkv_last_error();
  p = params("dither8");
  p.meter_delta = 1.5;
  EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT);
  p = params("dither8");
  p.outlier_pairs = 33;  // head_dim 64: 32 pairs
  EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT);
  p = params("int3");
  EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(certkv_last_error()).find("dither8"), std::string::npos);
  // The witness code: a name it knows, on a Tier A scheme. On the device the u8 witness is
  // served with the fp8 schemes; rtn8 with it is refused there for its scheme.
  for (const auto& [kv, witness] : std::vector<std::pair<const char*, const char*>>{
           {"rtn8", "u16"}, {"rtn8", "U8"}, {"rtn8", ""}, {"dither8", "u8"}, {"bf16", "u8"}, {"fp8-e4m3-pages", "u8"}}) {
    p = params(kv);
    p.witness = witness;
    EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT) << kv << " " << witness;
    EXPECT_NE(std::string(certkv_last_error()).find("witness"), std::string::npos) << certkv_last_error();
  }
  // The exponent witness is sound for the raw fp8-e4m3 cast only: the error names it and the scheme.
  for (const char* kv : {"fp8-e5m2", "fp8-e4m3-scaled", "rtn8", "rtn4", "kivi2", "dither8", "bf16", "fp8-e4m3-pages"}) {
    p = params(kv);
    p.witness = "exponent";
    EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT) << kv;
    const std::string error = certkv_last_error();
    EXPECT_NE(error.find("witness exponent"), std::string::npos) << error;
    EXPECT_NE(error.find(kv), std::string::npos) << error;
  }
  // The device route serves the exponent witness (fp8-e4m3 fragment-major pages): where the session
  // is not made, it is for want of a device in this build or process, never for the witness.
  p = params("fp8-e4m3");
  p.witness = "exponent";
  p.device = "cuda";
  if (certkv_session_create(model_->get(), &p, &s) == CERTKV_OK) {
    certkv_session_free(s);
    s = nullptr;
  } else {
    const std::string error = certkv_last_error();
    EXPECT_EQ(error.find("witness"), std::string::npos) << error;
    EXPECT_NE(error.find("device"), std::string::npos) << error;
  }
  p = params("rtn8");
  p.witness = "u8";
  p.device = "cuda";
  EXPECT_NE(certkv_session_create(model_->get(), &p, &s), CERTKV_OK);
  EXPECT_NE(std::string(certkv_last_error()).find("rtn8"), std::string::npos) << certkv_last_error();
  p = params("dither8");
  p.witness = "fp16";  // even the default, named, on a scheme without a witness
  EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT);
  p = params("rtn8");
  p.witness = "fp16";
  certkv::Session named_default(*model_, p);
  p = params("bf16");
  p.gate = 1;
  EXPECT_EQ(certkv_session_create(model_->get(), &p, &s), CERTKV_ERR_INVALID_ARGUMENT);
  p = params("bf16");
  certkv::Session bf16(*model_, p);
  EXPECT_EQ(certkv_session_audit_enable(bf16.get(), 0, 1), CERTKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bf16.meter_stats().metered, 0);
  EXPECT_EQ(std::string(bf16.meter_stats().tier), "none");
}

}  // namespace
