#include "cache/kv_scheme.h"

#include <string>

#include "core/status.h"

namespace certkv::cache {

namespace {

using format::GaacElement;
using format::StorageClass;
using codec::LossyScheme;

constexpr codec::WitnessCode kFp16 = codec::WitnessCode::kFp16;
constexpr LossyScheme kNotLossy = LossyScheme::kFp8E4M3;  // unread where lossy is false

// scheme, name, summary, element, full blocks, lossless, gaac, lossy, codec,
// tier, default window, cuda route, batch invariant, cuda sparse, cuda fragment pages, default witness
constexpr KvSchemeInfo kTable[kNumKvSchemes] = {
    {KvScheme::kBf16, "bf16", "raw bf16 pages (the reference)", GaacElement::kBf16,
     StorageClass::kBf16, true, false, false, kNotLossy, MeterTier::kNone, 0, true, true, true, false, kFp16},
    {KvScheme::kGaac, "gaac", "lossless: full blocks in GAAC slots, every bf16 bit kept",
     GaacElement::kBf16, StorageClass::kGaac, true, true, false, kNotLossy, MeterTier::kNone, 0,
     true, true, false, true, kFp16},
    {KvScheme::kFp8PagesE4M3, "fp8-e4m3-pages", "every page cast to fp8 e4m3 (lossy, unmetered)",
     GaacElement::kFp8E4M3, StorageClass::kFp8, false, false, false, kNotLossy, MeterTier::kNone, 0,
     false, true, false, false, kFp16},
    {KvScheme::kFp8PagesE5M2, "fp8-e5m2-pages", "every page cast to fp8 e5m2 (lossy, unmetered)",
     GaacElement::kFp8E5M2, StorageClass::kFp8, false, false, false, kNotLossy, MeterTier::kNone, 0,
     false, true, false, false, kFp16},
    {KvScheme::kGaacE4M3, "gaac-e4m3", "fp8 e4m3 pages, full blocks GAAC-coded (as fp8-e4m3-pages)",
     GaacElement::kFp8E4M3, StorageClass::kGaacFp8, false, true, false, kNotLossy, MeterTier::kNone,
     0, false, true, false, false, kFp16},
    {KvScheme::kGaacE5M2, "gaac-e5m2", "fp8 e5m2 pages, full blocks GAAC-coded (as fp8-e5m2-pages)",
     GaacElement::kFp8E5M2, StorageClass::kGaacFp8, false, true, false, kNotLossy, MeterTier::kNone,
     0, true, true, false, false, kFp16},
    {KvScheme::kFp8E4M3, "fp8-e4m3", "certified tier: raw fp8 e4m3 cast, Tier A meter",
     GaacElement::kBf16, StorageClass::kLossy, false, false, true, LossyScheme::kFp8E4M3,
     MeterTier::kA, 0, true, true, false, false, kFp16},
    {KvScheme::kFp8E5M2, "fp8-e5m2", "certified tier: raw fp8 e5m2 cast, Tier A meter",
     GaacElement::kBf16, StorageClass::kLossy, false, false, true, LossyScheme::kFp8E5M2,
     MeterTier::kA, 0, true, true, false, false, kFp16},
    {KvScheme::kFp8E4M3Scaled, "fp8-e4m3-scaled", "certified tier: per-token scaled fp8, Tier A meter",
     GaacElement::kBf16, StorageClass::kLossy, false, false, true, LossyScheme::kFp8E4M3Scaled,
     MeterTier::kA, 0, false, true, false, false, kFp16},
    {KvScheme::kRtn8, "rtn8", "certified tier: 8-bit round to nearest, Tier A meter",
     GaacElement::kBf16, StorageClass::kLossy, false, false, true, LossyScheme::kRtn8,
     MeterTier::kA, 0, false, true, false, false, kFp16},
    {KvScheme::kRtn4, "rtn4", "certified tier: 4-bit round to nearest, Tier A meter",
     GaacElement::kBf16, StorageClass::kLossy, false, false, true, LossyScheme::kRtn4,
     MeterTier::kA, 0, false, true, false, false, kFp16},
    {KvScheme::kKivi2, "kivi2", "certified tier: 2-bit KIVI, 128 newest tokens bf16, Tier A meter",
     GaacElement::kBf16, StorageClass::kLossy, false, false, true, LossyScheme::kKivi2,
     MeterTier::kA, 128, false, true, false, false, kFp16},
    {KvScheme::kDither8, "dither8", "certified tier: dithered int8, Tier B certificate",
     GaacElement::kBf16, StorageClass::kDither8, false, false, true, LossyScheme::kDither8,
     MeterTier::kB, 0, true, true, false, true, kFp16},
};

constexpr bool table_in_enum_order() {
  for (int i = 0; i < kNumKvSchemes; ++i)
    if (int(kTable[i].scheme) != i) return false;
  return true;
}
static_assert(table_in_enum_order(), "the scheme table is indexed by KvScheme");

}  // namespace

std::span<const KvSchemeInfo> kv_schemes() { return kTable; }

const KvSchemeInfo& kv_scheme_info(KvScheme scheme) {
  const int i = int(scheme);
  if (i < 0 || i >= kNumKvSchemes)
    fail(StatusCode::kInvalidArgument, "KV scheme " + std::to_string(i) + " is not in the table");
  return kTable[i];
}

KvScheme parse_kv_scheme(std::string_view name) {
  for (const KvSchemeInfo& s : kTable)
    if (name == s.name) return s.scheme;
  fail(StatusCode::kInvalidArgument,
       "unknown KV scheme '" + std::string(name) + "' (available: " +
           kv_scheme_names([](const KvSchemeInfo&) { return true; }) + ")");
}

std::string kv_scheme_names(bool (*pick)(const KvSchemeInfo&)) {
  std::string out;
  for (const KvSchemeInfo& s : kTable)
    if (pick(s)) out += (out.empty() ? "" : ", ") + std::string(s.name);
  return out;
}

codec::LossyScheme kv_scheme_lossy(KvScheme scheme) {
  const KvSchemeInfo& s = kv_scheme_info(scheme);
  if (!s.lossy)
    fail(StatusCode::kInvalidArgument, std::string("KV scheme ") + s.name + " is not a lossy scheme");
  return s.lossy_codec;
}

bool kv_scheme_takes_witness(KvScheme scheme, codec::WitnessCode witness) {
  const KvSchemeInfo& s = kv_scheme_info(scheme);
  return s.tier == MeterTier::kA && codec::lossy_witness_supported(s.lossy_codec, witness);
}

bool kv_scheme_device_fragment_pages(KvScheme scheme, codec::WitnessCode witness) {
  return kv_scheme_info(scheme).cuda_fragment_pages ||
         (scheme == KvScheme::kFp8E4M3 && witness == codec::WitnessCode::kExponent);
}

namespace {

// "a, b" of the schemes that take `witness`.
std::string schemes_taking(codec::WitnessCode witness) {
  std::string out;
  for (const KvSchemeInfo& s : kTable)
    if (kv_scheme_takes_witness(s.scheme, witness)) out += (out.empty() ? "" : ", ") + std::string(s.name);
  return out;
}

[[noreturn]] void fail_witness(const KvSchemeInfo& s, codec::WitnessCode witness, std::string_view field) {
  const std::string name = codec::witness_code_name(witness);
  if (s.tier != MeterTier::kA) {
    fail(StatusCode::kInvalidArgument, std::string(field) + " " + name + " applies to the Tier A lossy schemes (" +
                                           schemes_taking(witness) + "), not kv " + s.name +
                                           (s.tier == MeterTier::kB ? " (its bound comes from its scales)" : ""));
  }
  fail(StatusCode::kInvalidArgument,
       std::string(field) + " " + name + " is not sound for kv " + s.name + " (schemes that take it: " +
           schemes_taking(witness) + "; " +
           (witness == codec::WitnessCode::kExponent ? "only the raw fp8-e4m3 cast's codes bound their own rounding"
                                                     : "its codec refuses it") +
           ")");
}

}  // namespace

void check_kv_witness(KvScheme scheme, codec::WitnessCode witness, std::string_view field) {
  const KvSchemeInfo& s = kv_scheme_info(scheme);
  // A scheme that keeps no witness has the default code in its config: nothing was asked.
  if (kv_scheme_takes_witness(scheme, witness) || (s.tier != MeterTier::kA && witness == s.default_witness)) return;
  fail_witness(s, witness, field);
}

codec::WitnessCode resolve_kv_witness(KvScheme scheme, const char* name, std::string_view field) {
  const KvSchemeInfo& s = kv_scheme_info(scheme);
  if (name == nullptr) return s.default_witness;
  codec::WitnessCode witness;
  if (!codec::parse_witness_code(name, &witness)) {
    std::string known;
    for (int i = 0; i < codec::kNumWitnessCodes; ++i)
      known += (i ? ", " : "") + std::string(codec::witness_code_name(codec::WitnessCode(i)));
    fail(StatusCode::kInvalidArgument, std::string(field) + ": '" + name + "' is not a witness (" + known + ")");
  }
  if (!kv_scheme_takes_witness(scheme, witness)) fail_witness(s, witness, field);
  return witness;
}

}  // namespace certkv::cache
