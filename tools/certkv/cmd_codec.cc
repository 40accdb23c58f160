#include "cmd_codec.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "certkv/certkv.hpp"
#include "cli_json.h"
#include "options.h"

namespace certkv::tools {
namespace {

std::string fixed(double v, int digits) {
  char buf[64];
  snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// A tally's figures; speeds only where they are meaningful (totals).
JsonObject tally_json(const certkv_gaac_tally& t, bool fp8, bool with_speed) {
  JsonObject o;
  o.add("ratio", t.ratio);
  if (fp8) o.add("ratio_vs_fp8", t.ratio_vs_fp8);
  o.add("bits_per_element", t.bits_per_element).add("content_ratio", t.content_ratio);
  JsonObject modes;
  modes.add("3bit", t.mode_fraction_3bit).add("4bit", t.mode_fraction_4bit).add("raw", t.mode_fraction_raw);
  o.add("mode_fraction", modes);
  o.add("raw_block_fraction", t.raw_block_fraction)
      .add("exponent_entropy_bits", t.exponent_entropy_bits)
      .add("escape_bytes_per_page", t.escape_bytes_per_page);
  if (with_speed) o.add("encode_gbps", t.encode_gbps).add("decode_gbps", t.decode_gbps);
  o.add("bf16_bytes", t.bf16_bytes).add("stored_bytes", t.stored_bytes).add("pages", t.pages)
      .add("raw_pages", t.raw_pages);
  return o;
}

std::string tally_line(const certkv_gaac_tally& t) {
  return "ratio " + fixed(t.ratio, 4) + " (content " + fixed(t.content_ratio, 4) + ")  bits/elem " +
         fixed(t.bits_per_element, 3) + "  3bit " + fixed(100 * t.mode_fraction_3bit, 2) + "%  4bit " +
         fixed(100 * t.mode_fraction_4bit, 2) + "%  raw " + fixed(100 * t.mode_fraction_raw, 3) +
         "%  raw blocks " + fixed(100 * t.raw_block_fraction, 2) + "%  entropy " +
         fixed(t.exponent_entropy_bits, 3) + "  escapes/page " + fixed(t.escape_bytes_per_page, 1);
}

}  // namespace

int cmd_codec(int argc, char** argv) {
  Flags flags(kCodec);
  flags.parse(argc, argv, 2);
  if (!flags.has("codec")) throw UsageError{"flag --codec is required (gaac, gaac-e4m3, gaac-e5m2)"};
  if (!flags.has("calib")) throw UsageError{"flag --calib is required"};
  if (!flags.has("in") && !flags.has("save-calibration"))
    throw UsageError{"give --in (a KV dump to encode) or --save-calibration (or both)"};
  const std::string codec_name = flags.str("codec"), calib = flags.str("calib"), in = flags.str("in"),
                    save = flags.str("save-calibration");
  certkv_gaac_measure_params params = certkv_gaac_measure_default_params();
  params.codec = codec_name.c_str();
  params.calibration = calib.c_str();
  params.in = flags.has("in") ? in.c_str() : nullptr;
  params.save_calibration = flags.has("save-calibration") ? save.c_str() : nullptr;
  params.block_tokens = int32_t(flags.integer("block-tokens", 1, 4096));
  params.passes = int32_t(flags.integer("passes", 1, 100));
  params.segment_tokens = int32_t(flags.integer("segment-tokens", 1, 1 << 30));
  params.verify_ref = flags.has("verify") ? 1 : 0;
  const bool json = flags.has("json");

  certkv_gaac_report* raw = nullptr;
  check(certkv_gaac_measure(&params, &raw));
  const std::unique_ptr<certkv_gaac_report, void (*)(certkv_gaac_report*)> report(raw, certkv_gaac_report_free);
  certkv_gaac_report_info r;
  check(certkv_gaac_report_get_info(report.get(), &r));
  if (!r.encoded) {
    fprintf(stderr, "certkv codec: calibrated on %s in %.2f s, wrote %s\n", r.calibration, r.calibrate_seconds,
            save.c_str());
    return 0;
  }
  const bool fp8 = std::string(r.element) != "bf16";
  std::vector<certkv_gaac_layer_report> layers(static_cast<size_t>(r.n_layers));
  for (int32_t i = 0; i < r.n_layers; ++i) check(certkv_gaac_report_layer(report.get(), i, &layers[size_t(i)]));
  std::vector<certkv_gaac_tally> segments[2];
  for (int32_t s = 0; s < r.n_segments; ++s) {
    certkv_gaac_tally k, v;
    check(certkv_gaac_report_segment(report.get(), s, &k, &v));
    segments[0].push_back(k);
    segments[1].push_back(v);
  }

  if (json) {
    JsonObject o;
    o.add("codec", codec_name)
        .add("element", r.element)
        .add("kernel", r.kernel)
        .add("calibration", r.calibration)
        .add("in", r.in)
        .add("n_layers", int64_t(r.n_layers))
        .add("n_kv_heads", int64_t(r.n_kv_heads))
        .add("head_dim", int64_t(r.head_dim))
        .add("n_tokens", r.n_tokens)
        .add("block_tokens", int64_t(r.block_tokens))
        .add("verify_ok", r.verify_ok != 0)
        .add("ref_cross_checked", r.ref_cross_checked != 0)
        .add("failed_pages", r.total.failed_pages)
        .add("calibrate_seconds", r.calibrate_seconds);
    const JsonObject total = tally_json(r.total, fp8, true);
    for (const auto& [key, value] : total.json().items()) o.add(key, value);
    JsonObject kv_split;
    kv_split.add("k", tally_json(r.k, fp8, true)).add("v", tally_json(r.v, fp8, true));
    o.add("by_kv", kv_split);
    Json layers_json = Json::array();
    for (const certkv_gaac_layer_report& l : layers) {
      JsonObject lo;
      lo.add("layer", int64_t(l.layer))
          .add("k", tally_json(l.k, fp8, false))
          .add("v", tally_json(l.v, fp8, false))
          .add("k_escape_capacity_bytes", l.k_escape_capacity_bytes)
          .add("v_escape_capacity_bytes", l.v_escape_capacity_bytes);
      layers_json.push_back(lo.json());
    }
    o.add("layers", layers_json);
    Json segments_json = Json::array();
    for (size_t s = 0; s < segments[0].size(); ++s) {
      JsonObject g;
      g.add("first_token", int64_t(s) * r.segment_tokens)
          .add("k_escape_bytes_per_page", segments[0][s].escape_bytes_per_page)
          .add("v_escape_bytes_per_page", segments[1][s].escape_bytes_per_page)
          .add("k_raw_block_fraction", segments[0][s].raw_block_fraction)
          .add("v_raw_block_fraction", segments[1][s].raw_block_fraction)
          .add("k_3bit_fraction", segments[0][s].mode_fraction_3bit)
          .add("v_3bit_fraction", segments[1][s].mode_fraction_3bit);
      segments_json.push_back(g.json());
    }
    o.add("segment_tokens", int64_t(r.segment_tokens)).add("segments", segments_json);
    printf("%s\n", o.str().c_str());
  } else {
    printf("codec %s (%s kernel), calibrated on %s in %.2f s\n", codec_name.c_str(), r.kernel, r.calibration,
           r.calibrate_seconds);
    printf("KV %s: %d layers x K/V x %d kv heads x %lld tokens, head_dim %d, %d-token blocks\n", r.in,
           r.n_layers, r.n_kv_heads, (long long)r.n_tokens, r.head_dim, r.block_tokens);
    printf("ratio %.4f  bits_per_element %.3f  content_ratio %.4f", r.total.ratio, r.total.bits_per_element,
           r.total.content_ratio);
    if (fp8) printf("  ratio_vs_fp8 %.4f", r.total.ratio_vs_fp8);
    printf("\nmode_fraction 3bit %.4f 4bit %.4f raw %.5f  raw_block_fraction %.4f  exponent_entropy_bits %.3f\n",
           r.total.mode_fraction_3bit, r.total.mode_fraction_4bit, r.total.mode_fraction_raw,
           r.total.raw_block_fraction, r.total.exponent_entropy_bits);
    printf("encode_gbps %.3f  decode_gbps %.3f  (one core, %s bytes)  verify_ok %s%s\n", r.total.encode_gbps,
           r.total.decode_gbps, r.element, r.verify_ok ? "true" : "false",
           r.ref_cross_checked ? " (and _ref agrees)" : "");
    printf("K: %s\nV: %s\n", tally_line(r.k).c_str(), tally_line(r.v).c_str());
    for (const certkv_gaac_layer_report& l : layers)
      for (int kv = 0; kv < 2; ++kv)
        printf("layer %2d %c cap %3llu  %s\n", l.layer, kv == 0 ? 'K' : 'V',
               (unsigned long long)(kv == 0 ? l.k_escape_capacity_bytes : l.v_escape_capacity_bytes),
               tally_line(kv == 0 ? l.k : l.v).c_str());
    for (size_t s = 0; s < segments[0].size(); ++s)
      printf("tokens %6lld-: K escapes/page %6.1f raw blocks %6.2f%% | V escapes/page %6.1f raw blocks %6.2f%%\n",
             (long long)(int64_t(s) * r.segment_tokens), segments[0][s].escape_bytes_per_page,
             100 * segments[0][s].raw_block_fraction, segments[1][s].escape_bytes_per_page,
             100 * segments[1][s].raw_block_fraction);
  }
  if (!r.verify_ok) {
    fprintf(stderr, "certkv codec: round trip failed on %llu pages, first: %s\n",
            (unsigned long long)r.total.failed_pages, r.first_failure);
    return 1;
  }
  return 0;
}

}  // namespace certkv::tools
