#include "model/unicode.h"

namespace certkv::model {

size_t utf8_sequence_length(uint8_t lead) {
  static constexpr uint8_t kLengthByHighNibble[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLengthByHighNibble[lead >> 4];
}

namespace {

bool is_continuation(uint8_t b) { return (b & 0xC0) == 0x80; }

// Decodes one sequence at text[pos]; returns its length, 0 when it is malformed.
size_t decode_one(std::string_view text, size_t pos, uint32_t& cp) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[pos + i]); };
  const uint8_t lead = byte(0);
  size_t n = 0;
  if (lead < 0x80) {
    cp = lead;
    return 1;
  } else if ((lead & 0xE0) == 0xC0) {
    n = 2;
    cp = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    n = 3;
    cp = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    n = 4;
    cp = lead & 0x07;
  } else {
    return 0;
  }
  if (pos + n > text.size()) return 0;
  for (size_t i = 1; i < n; ++i) {
    if (!is_continuation(byte(i))) return 0;
    cp = (cp << 6) | (byte(i) & 0x3F);
  }
  return n;
}

}  // namespace

std::vector<uint32_t> utf8_to_codepoints(std::string_view text) {
  std::vector<uint32_t> cps;
  cps.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    uint32_t cp = 0;
    const size_t n = decode_one(text, pos, cp);
    if (n == 0) {
      cps.push_back(kReplacementCharacter);
      pos += 1;
    } else {
      cps.push_back(cp);
      pos += n;
    }
  }
  return cps;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace certkv::model
