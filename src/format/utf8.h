// UTF-8 text produced piece by piece (a token's bytes may end inside a character): where whole
// characters end, and a string made valid by replacing what is malformed with U+FFFD.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace certkv::format {

// Length of the longest prefix of s that ends on a character boundary: s without a trailing
// lead byte and the continuation bytes after it that do not yet complete its character (a
// malformed byte counts as whole: it is replaced, never waited for).
size_t complete_utf8_prefix(std::string_view s);

// s with every malformed sequence (a stray continuation byte, a cut or overlong character, a
// surrogate, a code point above U+10FFFF) replaced by U+FFFD, one per byte dropped.
std::string valid_utf8(std::string_view s);

}  // namespace certkv::format
