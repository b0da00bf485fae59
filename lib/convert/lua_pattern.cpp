#include "convert/lua_pattern.hpp"

#include <cstddef>

namespace vramd::convert {
namespace {

// Thrown for anything lua_gsub leaves to Lua.
struct Unsupported {};

constexpr int kMaxCaptures = 32;  // LUA_MAXCAPTURES
constexpr int kMaxDepth = 150;    // nesting before leaving the work to Lua (LuaJIT stops at 200)
constexpr ptrdiff_t kOpen = -1;   // a capture whose ')' has not been matched yet

// Character classes as LuaJIT defines them: ASCII only, whatever the C locale.
bool in_class(unsigned char c, char cls) {
  bool result;
  switch (cls | 0x20) {  // lower case
    case 'a': result = (c | 0x20) >= 'a' && (c | 0x20) <= 'z'; break;
    case 'c': result = c < 32 || c == 127; break;
    case 'd': result = c >= '0' && c <= '9'; break;
    case 'g': result = c >= 33 && c <= 126; break;
    case 'l': result = c >= 'a' && c <= 'z'; break;
    case 'p': result = (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126); break;
    case 's': result = c == ' ' || (c >= 9 && c <= 13); break;
    case 'u': result = c >= 'A' && c <= 'Z'; break;
    case 'w': result = in_class(c, 'a') || in_class(c, 'd'); break;
    case 'x': result = in_class(c, 'd') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'f'); break;
    case 'z': result = c == 0; break;
    default: return static_cast<unsigned char>(cls) == c;  // %. %% %( ...: the character itself
  }
  return (cls >= 'A' && cls <= 'Z') ? !result : result;
}

class Matcher {
 public:
  Matcher(std::string_view subject, std::string_view pattern, uint64_t max_steps)
      : begin_(subject.data()), end_(subject.data() + subject.size()), pattern_end_(pattern.data() + pattern.size()),
        steps_left_(max_steps) {}

  // The end of a match of `p` starting at `s`, or null.
  const char* match(const char* s, const char* p, int depth = 0) {
    if (depth >= kMaxDepth) throw Unsupported{};
    while (p != pattern_end_) {
      if (--steps_left_ == 0) throw PatternTooComplex("pattern too complex");
      switch (*p) {
        case '(':
          if (p + 1 != pattern_end_ && p[1] == ')') throw Unsupported{};  // position capture
          return open_capture(s, p + 1, depth);
        case ')': return close_capture(s, p + 1, depth);
        case '$':
          if (p + 1 == pattern_end_) return s == end_ ? s : nullptr;
          break;
        case '%':
          if (p + 1 != pattern_end_ && (p[1] == 'b' || p[1] == 'f' || (p[1] >= '0' && p[1] <= '9'))) throw Unsupported{};
          break;
        default: break;
      }
      const char* next = class_end(p);
      const bool here = s != end_ && single(static_cast<unsigned char>(*s), p, next);
      const char op = next != pattern_end_ ? *next : '\0';
      if (op == '?') {
        if (here)
          if (const char* e = match(s + 1, next + 1, depth + 1)) return e;
        p = next + 1;
      } else if (op == '*') {
        return longest(s, p, next, depth);
      } else if (op == '+') {
        return here ? longest(s + 1, p, next, depth) : nullptr;
      } else if (op == '-') {
        return shortest(s, p, next, depth);
      } else {
        if (!here) return nullptr;
        ++s;
        p = next;
      }
    }
    return s;
  }

  // Appends `replacement` for the match [s, e) to `out`, expanding %0-%9.
  void replace(std::string& out, const char* s, const char* e, std::string_view replacement) const {
    for (size_t i = 0; i < replacement.size(); ++i) {
      const char c = replacement[i];
      if (c != '%') {
        out += c;
        continue;
      }
      if (++i == replacement.size()) throw Unsupported{};  // a trailing '%'
      const char d = replacement[i];
      if (d < '0' || d > '9') {
        out += d;
      } else if (d == '0' || (d == '1' && captures_ == 0)) {
        out.append(s, e);
      } else {
        const int index = d - '1';
        if (index >= captures_ || capture_[index].length == kOpen) throw Unsupported{};
        out.append(capture_[index].start, static_cast<size_t>(capture_[index].length));
      }
    }
  }

  void reset() { captures_ = 0; }
  // string.find, which rename() calls first, fails on a match that leaves a capture open.
  void check_closed() const {
    for (int i = 0; i < captures_; ++i)
      if (capture_[i].length == kOpen) throw Unsupported{};
  }
  const char* begin() const { return begin_; }
  const char* end() const { return end_; }

 private:
  struct Capture {
    const char* start;
    ptrdiff_t length;
  };

  // One past the single-character class at p: a character, %x or [set].
  const char* class_end(const char* p) const {
    const char c = *p++;
    if (c == '%') {
      if (p == pattern_end_) throw Unsupported{};
      return p + 1;
    }
    if (c != '[') return p;
    if (p != pattern_end_ && *p == '^') ++p;
    do {  // the first character of a set is never its end, so "[]]" is a set of ']'
      if (p == pattern_end_) throw Unsupported{};
      if (*p++ == '%') {
        if (p == pattern_end_) throw Unsupported{};
        ++p;
      }
      if (p == pattern_end_) throw Unsupported{};
    } while (*p != ']');
    return p + 1;
  }

  bool single(unsigned char c, const char* p, const char* next) const {
    switch (*p) {
      case '.': return true;
      case '%': return in_class(c, p[1]);
      case '[': return in_set(c, p, next - 1);
      default: return static_cast<unsigned char>(*p) == c;
    }
  }

  // `p` at '[', `close` at the set's ']'.
  static bool in_set(unsigned char c, const char* p, const char* close) {
    bool wanted = true;
    if (*++p == '^') {
      wanted = false;
      ++p;
    }
    for (; p < close; ++p) {
      if (*p == '%') {
        if (in_class(c, *++p)) return wanted;
      } else if (p + 2 < close && p[1] == '-') {
        if (static_cast<unsigned char>(p[0]) <= c && c <= static_cast<unsigned char>(p[2])) return wanted;
        p += 2;
      } else if (static_cast<unsigned char>(*p) == c) {
        return wanted;
      }
    }
    return !wanted;
  }

  const char* longest(const char* s, const char* p, const char* next, int depth) {
    ptrdiff_t count = 0;
    while (s + count != end_ && single(static_cast<unsigned char>(s[count]), p, next)) ++count;
    for (; count >= 0; --count)
      if (const char* e = match(s + count, next + 1, depth + 1)) return e;
    return nullptr;
  }

  const char* shortest(const char* s, const char* p, const char* next, int depth) {
    for (;; ++s) {
      if (const char* e = match(s, next + 1, depth + 1)) return e;
      if (s == end_ || !single(static_cast<unsigned char>(*s), p, next)) return nullptr;
    }
  }

  const char* open_capture(const char* s, const char* p, int depth) {
    if (captures_ == kMaxCaptures) throw Unsupported{};
    capture_[captures_++] = {s, kOpen};
    const char* e = match(s, p, depth + 1);
    if (!e) --captures_;
    return e;
  }

  const char* close_capture(const char* s, const char* p, int depth) {
    int index = captures_ - 1;
    while (index >= 0 && capture_[index].length != kOpen) --index;
    if (index < 0) throw Unsupported{};  // ')' without '('
    capture_[index].length = s - capture_[index].start;
    const char* e = match(s, p, depth + 1);
    if (!e) capture_[index].length = kOpen;
    return e;
  }

  const char* begin_;
  const char* end_;
  const char* pattern_end_;
  Capture capture_[kMaxCaptures];
  int captures_ = 0;
  uint64_t steps_left_;
};

}  // namespace

std::optional<Substitution> lua_gsub(std::string_view subject, std::string_view pattern,
                                     std::string_view replacement, uint64_t max_steps) {
  const bool anchored = !pattern.empty() && pattern[0] == '^';
  if (anchored) pattern.remove_prefix(1);
  Substitution result;
  try {
    Matcher matcher(subject, pattern, max_steps);
    const char* s = matcher.begin();
    const char* copied = s;  // the subject up to here is in result.text
    for (;;) {
      matcher.reset();
      const char* e = matcher.match(s, pattern.data());
      if (e) {
        matcher.check_closed();
        ++result.count;
        result.text.append(copied, s);
        matcher.replace(result.text, s, e, replacement);
        copied = e;
      }
      if (e && e > s) {
        s = e;
      } else if (s != matcher.end()) {
        ++s;  // nothing matched here, or only the empty string: step over one character
      } else {
        break;
      }
      if (anchored) break;
    }
    if (result.count == 0) return result;
    result.text.append(copied, matcher.end());
  } catch (const Unsupported&) {
    return std::nullopt;
  }
  return result;
}

}  // namespace vramd::convert
