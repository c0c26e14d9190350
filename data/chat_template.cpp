#include "data/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <set>
#include <utility>

namespace kvlab {

namespace {

// ---------------------------------------------------------------------------------------------
// Values, as Jinja2 sees Python's: undefined, None, bool, int, float, str, list, dict (in
// insertion order), a namespace (a dict whose attributes `set` may change) and callables.

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;
struct Args;
using Function = std::function<Value(Args&)>;

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, Str, List, Dict, Func };
  Kind kind = Kind::Undefined;
  bool namespace_ = false;
  bool tuple = false;  // a list Python would print as a tuple
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // a str; an undefined value's description, for errors
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<const Function> fn;
  int depth = 0;                 // a list's or dict's nesting
  bool holds_namespace = false;  // a namespace, or a list or dict holding one

  // Bounds on what a template may build, so that a hostile one fails instead of taking the
  // memory or the stack (printing and freeing a value recurse through it).
  static constexpr size_t kMaxText = 64u << 20;
  static constexpr size_t kMaxItems = 1u << 20;
  static constexpr int kMaxDepth = 256;

  static Value undefined(std::string why) {
    Value v;
    v.s = std::move(why);
    return v;
  }
  static Value none() { return of(Kind::None); }
  static Value boolean(bool x) {
    Value v = of(Kind::Bool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = of(Kind::Int);
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v = of(Kind::Float);
    v.f = x;
    return v;
  }
  static Value str(std::string x) {
    if (x.size() > kMaxText) throw TemplateError("the template makes a text over 64 MiB");
    Value v = of(Kind::Str);
    v.s = std::move(x);
    return v;
  }
  static Value make_list(List x = {}) {
    Value v = of(Kind::List);
    for (const Value& e : x) v.hold(e);
    v.check_size(x.size());
    v.list = std::make_shared<List>(std::move(x));
    return v;
  }
  static Value make_dict(Dict x = {}) {
    Value v = of(Kind::Dict);
    for (const auto& kv : x) v.hold(kv.second);
    v.check_size(x.size());
    v.dict = std::make_shared<Dict>(std::move(x));
    return v;
  }
  void hold(const Value& e) {
    depth = std::max(depth, e.depth + 1);
    holds_namespace = holds_namespace || e.holds_namespace;
  }
  void check_size(size_t n) const {
    if (n > kMaxItems) throw TemplateError("the template makes a list of over a million items");
    if (depth > kMaxDepth) throw TemplateError("the template's values nest over 256 deep");
  }
  static Value func(Function x) {
    Value v = of(Kind::Func);
    v.fn = std::make_shared<const Function>(std::move(x));
    return v;
  }
  static Value pair(Value a, Value b) {
    Value v = make_list({std::move(a), std::move(b)});
    v.tuple = true;
    return v;
  }
  static Value of(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }

  bool defined() const { return kind != Kind::Undefined; }
  bool is_number() const { return kind == Kind::Bool || kind == Kind::Int || kind == Kind::Float; }
  double number() const { return kind == Kind::Float ? f : kind == Kind::Int ? double(i) : b; }
  const Value* find(std::string_view key) const {
    if (kind != Kind::Dict) return nullptr;
    for (const auto& [k, v] : *dict)
      if (k == key) return &v;
    return nullptr;
  }
};

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return "undefined";
    case Value::Kind::None:
      return "none";
    case Value::Kind::Bool:
      return "bool";
    case Value::Kind::Int:
      return "int";
    case Value::Kind::Float:
      return "float";
    case Value::Kind::Str:
      return "str";
    case Value::Kind::List:
      return "list";
    case Value::Kind::Dict:
      return v.namespace_ ? "namespace" : "dict";
    case Value::Kind::Func:
      return "function";
  }
  return "?";
}

[[noreturn]] void fail(int line, const std::string& message) {
  throw TemplateError(detail::cat("line ", line, ": ", message));
}

Value from_json(const nlohmann::ordered_json& j, int depth = 0) {
  if (depth > 256) throw TemplateError("the variables are nested more than 256 deep");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& e : j) l.push_back(from_json(e, depth + 1));
      return Value::make_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, e] : j.items()) d.emplace_back(k, from_json(e, depth + 1));
      return Value::make_dict(std::move(d));
    }
    default:
      return Value::none();
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return false;
    case Value::Kind::Bool:
      return v.b;
    case Value::Kind::Int:
      return v.i != 0;
    case Value::Kind::Float:
      return v.f != 0;
    case Value::Kind::Str:
      return !v.s.empty();
    case Value::Kind::List:
      return !v.list->empty();
    case Value::Kind::Dict:
      return v.namespace_ || !v.dict->empty();
    case Value::Kind::Func:
      return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Text as Python prints it.

// str(float): the shortest digits that read back, fixed between 1e-4 and 1e16, else d.ddde+XX.
std::string python_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  const size_t e = sci.find('e');
  const int exp = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : sci.substr(0, e))
    if (c >= '0' && c <= '9') digits += c;
  const std::string sign = x < 0 ? "-" : "";
  if (exp < -4 || exp >= 16) {
    std::string m = digits.substr(0, 1);
    if (digits.size() > 1) m += "." + digits.substr(1);
    const std::string ex = std::to_string(std::abs(exp));
    return sign + m + "e" + (exp < 0 ? "-" : "+") + (ex.size() < 2 ? "0" : "") + ex;
  }
  std::string out;
  if (exp < 0) {
    out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else {
    const auto point = static_cast<size_t>(exp) + 1;
    if (digits.size() <= point) {
      out = digits + std::string(point - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, point) + "." + digits.substr(point);
    }
  }
  return sign + out;
}

std::string repr(const Value& v);

std::string python_str_repr(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (const char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + q;
}

// What {{ value }} prints: str(value), but nothing for an undefined one.
std::string to_text(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return "";
    case Value::Kind::None:
      return "None";
    case Value::Kind::Bool:
      return v.b ? "True" : "False";
    case Value::Kind::Int:
      return std::to_string(v.i);
    case Value::Kind::Float:
      return python_float(v.f);
    case Value::Kind::Str:
      return v.s;
    default:
      return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Str:
      return python_str_repr(v.s);
    case Value::Kind::List: {
      std::string out = v.tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      return out + (!v.tuple ? "]" : v.list->size() == 1 ? ",)" : ")");
    }
    case Value::Kind::Dict: {
      std::string out = v.namespace_ ? "<Namespace {" : "{";
      for (size_t k = 0; k < v.dict->size(); ++k)
        out += (k ? ", " : "") + python_str_repr((*v.dict)[k].first) + ": " +
               repr((*v.dict)[k].second);
      return out + (v.namespace_ ? "}>" : "}");
    }
    case Value::Kind::Func:
      return "<function>";
    default:
      return to_text(v);
  }
}

// json.dumps(value, ensure_ascii=False, indent=indent), as Hugging Face's tojson calls it.
void append_json(std::string& out, const Value& v, int indent, int depth, int line) {
  const auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  const char* item_sep = indent < 0 ? ", " : ",";
  switch (v.kind) {
    case Value::Kind::None:
      out += "null";
      return;
    case Value::Kind::Bool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::Int:
      out += std::to_string(v.i);
      return;
    case Value::Kind::Float:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity")
                               : python_float(v.f);
      return;
    case Value::Kind::Str: {
      out += '"';
      for (const char c : v.s) {
        switch (c) {
          case '"':
            out += "\\\"";
            break;
          case '\\':
            out += "\\\\";
            break;
          case '\n':
            out += "\\n";
            break;
          case '\r':
            out += "\\r";
            break;
          case '\t':
            out += "\\t";
            break;
          case '\b':
            out += "\\b";
            break;
          case '\f':
            out += "\\f";
            break;
          default:
            if (static_cast<unsigned char>(c) < 0x20) {
              char buf[8];
              std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
              out += buf;
            } else {
              out += c;
            }
        }
      }
      out += '"';
      return;
    }
    case Value::Kind::List:
    case Value::Kind::Dict: {
      const bool list = v.kind == Value::Kind::List;
      const size_t n = list ? v.list->size() : v.dict->size();
      out += list ? '[' : '{';
      for (size_t k = 0; k < n; ++k) {
        if (k) out += item_sep;
        newline(depth + 1);
        if (!list) {
          append_json(out, Value::str((*v.dict)[k].first), indent, depth + 1, line);
          out += ": ";
        }
        append_json(out, list ? (*v.list)[k] : (*v.dict)[k].second, indent, depth + 1, line);
      }
      if (n > 0) newline(depth);
      out += list ? ']' : '}';
      return;
    }
    default:
      fail(line, detail::cat("tojson: a value of type ", type_name(v), " is not JSON"));
  }
}

// ---------------------------------------------------------------------------------------------
// Strings by code point, as Python indexes them.

std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (size_t k = 0; k < s.size();) {
    size_t n = 1;
    while (k + n < s.size() && (static_cast<unsigned char>(s[k + n]) & 0xC0) == 0x80) ++n;
    out.push_back(s.substr(k, n));
    k += n;
  }
  return out;
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Python's str.isspace() for one character (its UTF-8 bytes).
bool is_python_space(std::string_view ch) {
  static const std::set<std::string_view> kWide = {
      "\u0085", "\u00a0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004",
      "\u2005", "\u2006", "\u2007", "\u2008", "\u2009", "\u200a", "\u2028", "\u2029",
      "\u202f", "\u205f", "\u3000"};
  if (ch.size() == 1) return is_space(ch[0]) || (ch[0] >= 0x1c && ch[0] <= 0x1f);
  return kWide.contains(ch);
}

// str.strip(chars): by character, whitespace as Python's where no chars are given.
std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::vector<std::string> cs = code_points(s);
  const std::vector<std::string> set =
      chars.kind == Value::Kind::Str ? code_points(chars.s) : std::vector<std::string>{};
  const auto drop = [&](const std::string& ch) {
    return chars.kind == Value::Kind::Str ? std::find(set.begin(), set.end(), ch) != set.end()
                                          : is_python_space(ch);
  };
  size_t a = 0, b = cs.size();
  while (left && a < b && drop(cs[a])) ++a;
  while (right && b > a && drop(cs[b - 1])) --b;
  std::string out;
  for (size_t k = a; k < b; ++k) out += cs[k];
  return out;
}

std::string map_chars(std::string s, int (*f)(int)) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(c));
  return s;
}

std::string title(std::string s, bool every_word) {
  bool start = true;
  for (char& c : s) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0;
    c = static_cast<char>(start ? std::toupper(c) : std::tolower(c));
    start = every_word ? !alpha : false;
  }
  return s;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count) {
  if (from.empty()) return s;  // Python inserts `to` between characters; no template does
  std::string out;
  size_t at = 0;
  for (size_t hit; count != 0 && (hit = s.find(from, at)) != std::string::npos; --count) {
    out += s.substr(at, hit - at) + to;
    at = hit + from.size();
  }
  return out + s.substr(at);
}

List split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (sep.kind != Value::Kind::Str) {  // runs of whitespace, none empty
    size_t k = 0;
    while (true) {
      while (k < s.size() && is_space(s[k])) ++k;
      if (k == s.size()) break;
      if (maxsplit == 0) {
        size_t end = s.size();
        while (end > k && is_space(s[end - 1])) --end;
        out.push_back(Value::str(s.substr(k, end - k)));
        break;
      }
      size_t e = k;
      while (e < s.size() && !is_space(s[e])) ++e;
      out.push_back(Value::str(s.substr(k, e - k)));
      k = e;
      --maxsplit;
    }
    return out;
  }
  if (sep.s.empty()) throw TemplateError("split: empty separator");
  size_t at = 0;
  for (size_t hit; maxsplit != 0 && (hit = s.find(sep.s, at)) != std::string::npos; --maxsplit) {
    out.push_back(Value::str(s.substr(at, hit - at)));
    at = hit + sep.s.size();
  }
  out.push_back(Value::str(s.substr(at)));
  return out;
}

// Python's slice bounds for a sequence of n items.
std::vector<int64_t> slice_indices(int64_t n, const Value& start, const Value& stop,
                                   const Value& step, int line) {
  const auto as_int = [&](const Value& v, const char* what) -> std::optional<int64_t> {
    if (!v.defined() || v.kind == Value::Kind::None) return std::nullopt;
    if (v.kind != Value::Kind::Int) fail(line, detail::cat("a slice's ", what, " is not an int"));
    return v.i;
  };
  const int64_t st = as_int(step, "step").value_or(1);
  if (st == 0) fail(line, "a slice's step is 0");
  const auto clamp = [&](std::optional<int64_t> x, int64_t fallback) {
    if (!x) return fallback;
    int64_t v = *x < 0 ? *x + n : *x;
    return st > 0 ? std::clamp<int64_t>(v, 0, n) : std::clamp<int64_t>(v, -1, n - 1);
  };
  const int64_t a = clamp(as_int(start, "start"), st > 0 ? 0 : n - 1);
  const int64_t b = clamp(as_int(stop, "stop"), st > 0 ? n : -1);
  std::vector<int64_t> idx;
  for (int64_t k = a; st > 0 ? k < b : k > b; k += st) idx.push_back(k);
  return idx;
}

// ---------------------------------------------------------------------------------------------
// Comparison and arithmetic.

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.number() == b.number();
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return true;
    case Value::Kind::Str:
      return a.s == b.s;
    case Value::Kind::List:
      return a.list->size() == b.list->size() &&
             std::equal(a.list->begin(), a.list->end(), b.list->begin(), equal);
    case Value::Kind::Dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* o = b.find(k);
        if (o == nullptr || !equal(v, *o)) return false;
      }
      return true;
    default:
      return a.fn == b.fn;
  }
}

// <0, 0, >0; numbers with numbers, strings with strings (by code point, as UTF-8 bytes order).
int compare(const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number())
    return a.number() < b.number() ? -1 : a.number() > b.number() ? 1 : 0;
  if (a.kind == Value::Kind::Str && b.kind == Value::Kind::Str) return a.s.compare(b.s);
  fail(line, detail::cat("cannot order ", type_name(a), " and ", type_name(b)));
}

bool contains(const Value& container, const Value& item, int line) {
  switch (container.kind) {
    case Value::Kind::Str:
      if (item.kind != Value::Kind::Str)
        fail(line, detail::cat("'in <str>' needs a str, not ", type_name(item)));
      return container.s.find(item.s) != std::string::npos;
    case Value::Kind::List:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& v) { return equal(v, item); });
    case Value::Kind::Dict:
      return item.kind == Value::Kind::Str && container.find(item.s);
    case Value::Kind::Undefined:
      return false;
    default:
      fail(line, detail::cat("'in' on a value of type ", type_name(container)));
  }
}

void check_defined(const Value& v, int line) {
  if (!v.defined()) fail(line, v.s.empty() ? "a value is undefined" : v.s);
}

// Python's int arithmetic in 64 bits: an overflow is an error, never undefined behaviour.
Value integer_arithmetic(const std::string& op, int64_t x, int64_t y, int line) {
  const auto overflow = [&] { fail(line, detail::cat("'", op, "' overflows a 64-bit integer")); };
  int64_t r = 0;
  if (op == "+" && __builtin_add_overflow(x, y, &r)) overflow();
  if (op == "-" && __builtin_sub_overflow(x, y, &r)) overflow();
  if (op == "*" && __builtin_mul_overflow(x, y, &r)) overflow();
  if (op == "+" || op == "-" || op == "*") return Value::integer(r);
  if (op == "**") {
    if (y < 0) return Value::real(std::pow(static_cast<double>(x), static_cast<double>(y)));
    r = 1;  // by squaring: at most 63 rounds
    for (int64_t base = x, e = y; e > 0; e >>= 1) {
      if ((e & 1) != 0 && __builtin_mul_overflow(r, base, &r)) overflow();
      if (e > 1 && __builtin_mul_overflow(base, base, &base)) overflow();
    }
    return Value::integer(r);
  }
  if (y == 0) fail(line, "division by zero");
  if (op == "/") return Value::real(static_cast<double>(x) / static_cast<double>(y));
  if (x == INT64_MIN && y == -1) overflow();
  if (op == "//") return Value::integer(x / y - ((x % y != 0) && ((x < 0) != (y < 0))));
  if (op == "%") {
    const int64_t m = x % y;
    return Value::integer(m != 0 && ((m < 0) != (y < 0)) ? m + y : m);
  }
  fail(line, detail::cat("unknown operator ", op));
}

Value arithmetic(const std::string& op, const Value& a, const Value& b, int line) {
  check_defined(a, line);
  check_defined(b, line);
  if (op == "+") {
    if (a.kind == Value::Kind::Str && b.kind == Value::Kind::Str) return Value::str(a.s + b.s);
    if (a.kind == Value::Kind::List && b.kind == Value::Kind::List) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::make_list(std::move(l));
    }
  }
  if (op == "*") {
    for (const auto& [seq, n] : {std::pair{&a, &b}, std::pair{&b, &a}})
      if (n->kind == Value::Kind::Int && seq->kind == Value::Kind::Str) {
        std::string out;
        for (int64_t k = 0; k < n->i && out.size() <= Value::kMaxText; ++k) out += seq->s;
        return Value::str(std::move(out));
      }
  }
  if (!a.is_number() || !b.is_number())
    fail(line, detail::cat("cannot apply '", op, "' to ", type_name(a), " and ", type_name(b)));
  if (a.kind != Value::Kind::Float && b.kind != Value::Kind::Float)
    return integer_arithmetic(op, a.kind == Value::Kind::Int ? a.i : a.b,
                              b.kind == Value::Kind::Int ? b.i : b.b, line);
  const double x = a.number(), y = b.number();
  if (op == "+") return Value::real(x + y);
  if (op == "-") return Value::real(x - y);
  if (op == "*") return Value::real(x * y);
  if (op == "**") return Value::real(std::pow(x, y));
  if (y == 0) fail(line, "division by zero");
  if (op == "/") return Value::real(x / y);
  if (op == "//") return Value::real(std::floor(x / y));
  if (op == "%") return Value::real(x - std::floor(x / y) * y);
  fail(line, detail::cat("unknown operator ", op));
}

// ---------------------------------------------------------------------------------------------
// Calls: positional and keyword arguments.

struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  int line = 0;
  const char* callee = "";

  // The argument at `index`, or the keyword `name`, or undefined.
  Value get(size_t index, std::string_view name) const {
    for (const auto& [k, v] : keyword)
      if (k == name) return v;
    return index < positional.size() ? positional[index] : Value::undefined("");
  }
  std::string str(size_t index, std::string_view name) const {
    const Value v = get(index, name);
    if (v.kind != Value::Kind::Str)
      fail(line, detail::cat(callee, ": argument '", name, "' must be a str, not ", type_name(v)));
    return v.s;
  }
  int64_t integer(size_t index, std::string_view name, int64_t fallback) const {
    const Value v = get(index, name);
    if (!v.defined() || v.kind == Value::Kind::None) return fallback;
    if (v.kind != Value::Kind::Int && v.kind != Value::Kind::Bool)
      fail(line, detail::cat(callee, ": argument '", name, "' must be an int"));
    return v.kind == Value::Kind::Bool ? v.b : v.i;
  }
};

List iterate(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return {};
    case Value::Kind::List:
      return *v.list;
    case Value::Kind::Dict: {
      List keys;
      for (const auto& kv : *v.dict) keys.push_back(Value::str(kv.first));
      return keys;
    }
    case Value::Kind::Str: {
      List chars;
      for (std::string& c : code_points(v.s)) chars.push_back(Value::str(std::move(c)));
      return chars;
    }
    default:
      fail(line, detail::cat("a value of type ", type_name(v), " is not iterable"));
  }
}

int64_t length(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return 0;
    case Value::Kind::Str:
      return static_cast<int64_t>(code_points(v.s).size());
    case Value::Kind::List:
      return static_cast<int64_t>(v.list->size());
    case Value::Kind::Dict:
      return static_cast<int64_t>(v.dict->size());
    default:
      fail(line, detail::cat("a value of type ", type_name(v), " has no length"));
  }
}

// obj.name as Jinja2 looks it up: a method first, then an item; a missing one is undefined.
Value method(const Value& obj, const std::string& name);

Value attribute(const Value& obj, const std::string& name, int line) {
  if (!obj.defined())
    fail(line, detail::cat(obj.s.empty() ? "an undefined value" : obj.s, " has no attribute '",
                           name, "'"));
  if (!obj.namespace_)
    if (Value m = method(obj, name); m.defined()) return m;
  if (const Value* v = obj.find(name)) return *v;
  if (obj.kind != Value::Kind::Dict)  // Python's str and list have methods kvlab lacks
    return Value::undefined(detail::cat("'", type_name(obj), " object' has no attribute '", name,
                                        "' (or a method not in kvlab's Jinja subset)"));
  return Value::undefined(
      detail::cat("'", type_name(obj), " object' has no attribute '", name, "'"));
}

Value item(const Value& obj, const Value& key, int line) {
  if (!obj.defined())
    fail(line,
         detail::cat(obj.s.empty() ? "an undefined value" : obj.s, " has no item ", repr(key)));
  if (obj.kind == Value::Kind::Dict && key.kind == Value::Kind::Str) {
    if (const Value* v = obj.find(key.s)) return *v;
    return Value::undefined(detail::cat("'dict object' has no attribute ", repr(key)));
  }
  if ((obj.kind == Value::Kind::List || obj.kind == Value::Kind::Str) &&
      (key.kind == Value::Kind::Int || key.kind == Value::Kind::Bool)) {
    const List seq = obj.kind == Value::Kind::List ? List{} : iterate(obj, line);
    const List& items = obj.kind == Value::Kind::List ? *obj.list : seq;
    int64_t k = key.kind == Value::Kind::Bool ? key.b : key.i;
    const auto n = static_cast<int64_t>(items.size());
    if (k < 0) k += n;
    if (k >= 0 && k < n) return items[static_cast<size_t>(k)];
    return Value::undefined(detail::cat(type_name(obj), " index ", key.i, " out of range"));
  }
  if (obj.kind == Value::Kind::Str && key.kind == Value::Kind::Str)
    return attribute(obj, key.s, line);
  return Value::undefined(detail::cat("'", type_name(obj), " object' has no item ", repr(key)));
}

Value method(const Value& obj, const std::string& name) {
  using K = Value::Kind;
  const auto bind = [&](Function f) { return Value::func(std::move(f)); };
  if (obj.kind == K::Str) {
    const std::string s = obj.s;
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return bind([s, name](Args& a) {
        return Value::str(strip(s, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
      });
    if (name == "split")
      return bind([s](Args& a) {
        return Value::make_list(split(s, a.get(0, "sep"), a.integer(1, "maxsplit", -1)));
      });
    if (name == "startswith" || name == "endswith")
      return bind([s, name](Args& a) {
        const Value p = a.get(0, "prefix");
        const List options = p.kind == K::List ? *p.list : List{p};
        for (const Value& o : options) {
          if (o.kind != K::Str) fail(a.line, detail::cat(name, ": needs a str"));
          const bool hit = name == "startswith" ? s.starts_with(o.s) : s.ends_with(o.s);
          if (hit) return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    if (name == "upper") return bind([s](Args&) { return Value::str(map_chars(s, ::toupper)); });
    if (name == "lower") return bind([s](Args&) { return Value::str(map_chars(s, ::tolower)); });
    if (name == "title") return bind([s](Args&) { return Value::str(title(s, true)); });
    if (name == "capitalize") return bind([s](Args&) { return Value::str(title(s, false)); });
    if (name == "replace")
      return bind([s](Args& a) {
        return Value::str(
            replace_all(s, a.str(0, "old"), a.str(1, "new"), a.integer(2, "count", -1)));
      });
    if (name == "find")
      return bind([s](Args& a) {
        const size_t at = s.find(a.str(0, "sub"));
        return Value::integer(at == std::string::npos
                                  ? -1
                                  : static_cast<int64_t>(code_points(s.substr(0, at)).size()));
      });
    if (name == "join")
      return bind([s](Args& a) {
        std::string out;
        const List items = iterate(a.get(0, "iterable"), a.line);
        for (size_t k = 0; k < items.size(); ++k) out += (k ? s : "") + to_text(items[k]);
        return Value::str(std::move(out));
      });
  }
  if (obj.kind == K::Dict) {
    const Value d = obj;
    if (name == "items")
      return bind([d](Args&) {
        List l;
        for (const auto& [k, v] : *d.dict) l.push_back(Value::pair(Value::str(k), v));
        return Value::make_list(std::move(l));
      });
    if (name == "keys" || name == "values")
      return bind([d, name](Args&) {
        List l;
        for (const auto& [k, v] : *d.dict) l.push_back(name == "keys" ? Value::str(k) : v);
        return Value::make_list(std::move(l));
      });
    if (name == "get")
      return bind([d](Args& a) {
        const Value* v = d.find(a.str(0, "key"));
        if (v != nullptr) return *v;
        const Value fallback = a.get(1, "default");
        return fallback.defined() ? fallback : Value::none();
      });
  }
  return Value::undefined("");
}

// ---------------------------------------------------------------------------------------------
// The render state: scopes (a for loop's body and a macro's have their own), loop controls, and
// a budget that stops a runaway template.

struct Context {
  std::vector<std::map<std::string, Value, std::less<>>> frames;
  enum class Jump { None, Break, Continue } jump = Jump::None;
  int64_t steps = 0;
  int macro_depth = 0;

  Value lookup(std::string_view name) const {
    for (auto f = frames.rbegin(); f != frames.rend(); ++f)
      if (auto it = f->find(name); it != f->end()) return it->second;
    return Value::undefined(detail::cat("'", name, "' is undefined"));
  }
  void set(const std::string& name, Value v) { frames.back()[name] = std::move(v); }
};

constexpr int64_t kMaxSteps = 2'000'000;
constexpr size_t kMaxOutput = 64u << 20;

// Work a step of the budget does not cover (a loop's items, a filter's over a list), counted
// against the same budget.
void charge(Context& c, size_t n, int line) {
  c.steps += static_cast<int64_t>(std::min<size_t>(n, kMaxSteps + 1));
  if (c.steps > kMaxSteps) fail(line, "the template runs too long");
}

// What sort and unique compare: the item or its attribute, a str lowercased unless
// case_sensitive.
Value sort_key(const Value& x, const Value& attr, bool cased, int line) {
  Value k = attr.kind == Value::Kind::Str ? attribute(x, attr.s, line) : x;
  if (!cased && k.kind == Value::Kind::Str) k.s = map_chars(k.s, ::tolower);
  return k;
}

// ---------------------------------------------------------------------------------------------
// Expressions.

struct Expr {
  int line = 0;
  int depth = 1;  // of the tree below it: evaluating and freeing it recurse that deep
  virtual ~Expr() = default;
  virtual Value eval(Context& c) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct CallArgs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
  Args eval(Context& c, int line, const char* callee) const {
    Args a;
    a.line = line;
    a.callee = callee;
    for (const ExprPtr& e : positional) a.positional.push_back(e->eval(c));
    for (const auto& [k, e] : keyword) a.keyword.emplace_back(k, e->eval(c));
    return a;
  }
};

struct Literal : Expr {
  Value v;
  Value eval(Context&) const override { return v; }
};
struct Name : Expr {
  std::string name;
  Value eval(Context& c) const override { return c.lookup(name); }
};
struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Context& c) const override {
    List l;
    for (const ExprPtr& e : items) l.push_back(e->eval(c));
    Value v = Value::make_list(std::move(l));
    v.tuple = tuple;
    return v;
  }
};
struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Context& c) const override {
    Dict d;
    for (const auto& [k, v] : items) {
      const Value key = k->eval(c);
      if (key.kind != Value::Kind::Str)
        fail(line, detail::cat("a dict key of type ", type_name(key),
                               " is not in kvlab's Jinja subset (str keys only)"));
      auto it = std::find_if(d.begin(), d.end(), [&](const auto& kv) { return kv.first == key.s; });
      if (it != d.end())
        it->second = v->eval(c);
      else
        d.emplace_back(key.s, v->eval(c));
    }
    return Value::make_dict(std::move(d));
  }
};
struct Attr : Expr {
  ExprPtr obj;
  std::string name;
  Value eval(Context& c) const override { return attribute(obj->eval(c), name, line); }
};
struct Item : Expr {
  ExprPtr obj, key;
  Value eval(Context& c) const override { return item(obj->eval(c), key->eval(c), line); }
};
struct Slice : Expr {
  ExprPtr obj, start, stop, step;
  Value eval(Context& c) const override {
    const Value o = obj->eval(c);
    const auto part = [&](const ExprPtr& e) { return e ? e->eval(c) : Value::none(); };
    if (o.kind != Value::Kind::List && o.kind != Value::Kind::Str) {
      check_defined(o, line);
      fail(line, detail::cat("cannot slice a value of type ", type_name(o)));
    }
    const List items = iterate(o, line);
    List out;
    for (const int64_t k : slice_indices(static_cast<int64_t>(items.size()), part(start),
                                         part(stop), part(step), line))
      out.push_back(items[static_cast<size_t>(k)]);
    if (o.kind == Value::Kind::List) return Value::make_list(std::move(out));
    std::string s;
    for (const Value& ch : out) s += ch.s;
    return Value::str(std::move(s));
  }
};
struct Call : Expr {
  ExprPtr callee;
  CallArgs args;
  std::string what;  // the callee as written, for errors
  Value eval(Context& c) const override {
    const Value f = callee->eval(c);
    if (f.kind != Value::Kind::Func) {
      if (!f.defined() && f.s.empty())
        fail(line, detail::cat("'", what, "' is not a function kvlab's Jinja subset has"));
      check_defined(f, line);
      fail(line, detail::cat("'", what, "' is a ", type_name(f), ", not a function"));
    }
    Args a = args.eval(c, line, what.c_str());
    return (*f.fn)(a);
  }
};
struct Unary : Expr {
  char op;
  ExprPtr a;
  Value eval(Context& c) const override {
    const Value v = a->eval(c);
    if (op == '!') return Value::boolean(!truthy(v));
    return arithmetic(op == '-' ? "-" : "+", Value::integer(0), v, line);
  }
};
struct Binary : Expr {
  std::string op;
  ExprPtr a, b;
  Value eval(Context& c) const override {
    if (op == "and") {
      Value l = a->eval(c);
      return truthy(l) ? b->eval(c) : l;
    }
    if (op == "or") {
      Value l = a->eval(c);
      return truthy(l) ? l : b->eval(c);
    }
    const Value l = a->eval(c), r = b->eval(c);
    if (op == "~") return Value::str(to_text(l) + to_text(r));
    return arithmetic(op, l, r, line);
  }
};
// a op1 b op2 c ...: Python's chained comparison.
struct Compare : Expr {
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;
  Value eval(Context& c) const override {
    Value l = first->eval(c);
    for (const auto& [op, e] : rest) {
      Value r = e->eval(c);
      bool ok;
      if (op == "==")
        ok = equal(l, r);
      else if (op == "!=")
        ok = !equal(l, r);
      else if (op == "in")
        ok = contains(r, l, line);
      else if (op == "not in")
        ok = !contains(r, l, line);
      else {
        const int k = compare(l, r, line);
        ok = op == "<" ? k < 0 : op == ">" ? k > 0 : op == "<=" ? k <= 0 : k >= 0;
      }
      if (!ok) return Value::boolean(false);
      l = std::move(r);
    }
    return Value::boolean(true);
  }
};
struct Cond : Expr {
  ExprPtr then, cond, otherwise;
  Value eval(Context& c) const override {
    if (truthy(cond->eval(c))) return then->eval(c);
    return otherwise ? otherwise->eval(c) : Value::undefined("");
  }
};

// Tests (x is name(args)) and filters (x | name(args)), resolved by name when parsed.
using TestFn = bool (*)(const Value&, const Args&);
using FilterFn = Value (*)(const Value&, Args&, Context&);

bool run_test(const std::string& name, const Value& v, const Args& a);

const std::map<std::string, TestFn, std::less<>>& tests() {
  using K = Value::Kind;
  static const std::map<std::string, TestFn, std::less<>> t = {
      {"defined", [](const Value& v, const Args&) { return v.defined(); }},
      {"undefined", [](const Value& v, const Args&) { return !v.defined(); }},
      {"none", [](const Value& v, const Args&) { return v.kind == K::None; }},
      {"boolean", [](const Value& v, const Args&) { return v.kind == K::Bool; }},
      {"true", [](const Value& v, const Args&) { return v.kind == K::Bool && v.b; }},
      {"false", [](const Value& v, const Args&) { return v.kind == K::Bool && !v.b; }},
      {"string", [](const Value& v, const Args&) { return v.kind == K::Str; }},
      {"number", [](const Value& v, const Args&) { return v.is_number(); }},
      {"integer", [](const Value& v, const Args&) { return v.kind == K::Int; }},
      {"float", [](const Value& v, const Args&) { return v.kind == K::Float; }},
      {"mapping", [](const Value& v, const Args&) { return v.kind == K::Dict && !v.namespace_; }},
      {"iterable",
       [](const Value& v, const Args&) {
         return v.kind == K::Undefined || v.kind == K::Str || v.kind == K::List ||
                (v.kind == K::Dict && !v.namespace_);
       }},
      {"sequence",
       [](const Value& v, const Args&) {
         return v.kind == K::Undefined || v.kind == K::Str || v.kind == K::List ||
                (v.kind == K::Dict && !v.namespace_);
       }},
      {"callable", [](const Value& v, const Args&) { return v.kind == K::Func; }},
      {"equalto", [](const Value& v, const Args& a) { return equal(v, a.get(0, "other")); }},
      {"eq", [](const Value& v, const Args& a) { return equal(v, a.get(0, "other")); }},
      {"==", [](const Value& v, const Args& a) { return equal(v, a.get(0, "other")); }},
      {"ne", [](const Value& v, const Args& a) { return !equal(v, a.get(0, "other")); }},
      {"!=", [](const Value& v, const Args& a) { return !equal(v, a.get(0, "other")); }},
      {"lt",
       [](const Value& v, const Args& a) { return compare(v, a.get(0, "other"), a.line) < 0; }},
      {"gt",
       [](const Value& v, const Args& a) { return compare(v, a.get(0, "other"), a.line) > 0; }},
      {"le",
       [](const Value& v, const Args& a) { return compare(v, a.get(0, "other"), a.line) <= 0; }},
      {"ge",
       [](const Value& v, const Args& a) { return compare(v, a.get(0, "other"), a.line) >= 0; }},
      {"in", [](const Value& v, const Args& a) { return contains(a.get(0, "seq"), v, a.line); }},
      {"odd", [](const Value& v, const Args&) { return v.kind == K::Int && v.i % 2 != 0; }},
      {"even", [](const Value& v, const Args&) { return v.kind == K::Int && v.i % 2 == 0; }},
      {"divisibleby",
       [](const Value& v, const Args& a) {
         const int64_t n = a.integer(0, "num", 0);
         return v.kind == K::Int && n != 0 && v.i % n == 0;
       }},
      {"lower", [](const Value& v,
                   const Args&) { return v.kind == K::Str && map_chars(v.s, ::tolower) == v.s; }},
      {"upper", [](const Value& v,
                   const Args&) { return v.kind == K::Str && map_chars(v.s, ::toupper) == v.s; }},
      {"sameas",
       [](const Value& v, const Args& a) {
         const Value o = a.get(0, "other");
         return v.kind == o.kind &&
                (v.kind == K::None || v.kind == K::Undefined || (v.kind == K::Bool && v.b == o.b));
       }},
  };
  return t;
}

bool run_test(const std::string& name, const Value& v, const Args& a) {
  const auto it = tests().find(name);
  if (it == tests().end())
    fail(a.line, detail::cat("test '", name, "' is not in kvlab's Jinja subset"));
  return it->second(v, a);
}

Value apply_filter(const std::string& name, const Value& v, Args& a, Context& c);

// select/reject/selectattr/rejectattr: the items whose value (or attribute) passes the test
// (truthiness without one).
Value select_items(const Value& seq, Args& a, Context& c, bool by_attr, bool keep) {
  const std::string attr = by_attr ? a.str(0, "attribute") : "";
  const size_t first_test = by_attr ? 1 : 0;
  const Value test = a.get(first_test, "test");
  Args test_args;
  test_args.line = a.line;
  test_args.callee = a.callee;
  for (size_t k = first_test + 1; k < a.positional.size(); ++k)
    test_args.positional.push_back(a.positional[k]);
  List out;
  if (!truthy(seq)) return Value::make_list();  // Jinja2 iterates a falsy value (None) as empty
  const List items = iterate(seq, a.line);
  charge(c, items.size(), a.line);
  for (const Value& x : items) {
    const Value subject = by_attr ? attribute(x, attr, a.line) : x;
    const bool pass = test.defined() ? run_test(test.s, subject, test_args) : truthy(subject);
    if (pass == keep) out.push_back(x);
  }
  return Value::make_list(std::move(out));
}

const std::map<std::string, FilterFn, std::less<>>& filters() {
  using K = Value::Kind;
  static const std::map<std::string, FilterFn, std::less<>> f = {
      {"trim",
       [](const Value& v, Args& a, Context&) {
         return Value::str(strip(to_text(v), a.get(0, "chars"), true, true));
       }},
      {"length",
       [](const Value& v, Args& a, Context&) { return Value::integer(length(v, a.line)); }},
      {"count",
       [](const Value& v, Args& a, Context&) { return Value::integer(length(v, a.line)); }},
      {"string", [](const Value& v, Args&, Context&) { return Value::str(to_text(v)); }},
      {"safe", [](const Value& v, Args&, Context&) { return v; }},
      {"tojson",
       [](const Value& v, Args& a, Context&) {
         std::string out;
         const int64_t indent = a.integer(0, "indent", -1);
         if (indent > 64) fail(a.line, "tojson: an indent over 64");
         append_json(out, v, static_cast<int>(indent), 0, a.line);
         return Value::str(std::move(out));
       }},
      {"list",
       [](const Value& v, Args& a, Context&) { return Value::make_list(iterate(v, a.line)); }},
      {"first",
       [](const Value& v, Args& a, Context&) {
         const List l = iterate(v, a.line);
         return l.empty() ? Value::undefined("first: an empty sequence") : l.front();
       }},
      {"last",
       [](const Value& v, Args& a, Context&) {
         const List l = iterate(v, a.line);
         return l.empty() ? Value::undefined("last: an empty sequence") : l.back();
       }},
      {"reverse",
       [](const Value& v, Args& a, Context&) {
         List l = iterate(v, a.line);
         std::reverse(l.begin(), l.end());
         if (v.kind != K::Str) return Value::make_list(std::move(l));
         std::string s;
         for (const Value& ch : l) s += ch.s;
         return Value::str(std::move(s));
       }},
      {"upper", [](const Value& v, Args&,
                   Context&) { return Value::str(map_chars(to_text(v), ::toupper)); }},
      {"lower", [](const Value& v, Args&,
                   Context&) { return Value::str(map_chars(to_text(v), ::tolower)); }},
      {"title",
       [](const Value& v, Args&, Context&) { return Value::str(title(to_text(v), true)); }},
      {"capitalize",
       [](const Value& v, Args&, Context&) { return Value::str(title(to_text(v), false)); }},
      {"replace",
       [](const Value& v, Args& a, Context&) {
         return Value::str(
             replace_all(to_text(v), a.str(0, "old"), a.str(1, "new"), a.integer(2, "count", -1)));
       }},
      {"default",
       [](const Value& v, Args& a, Context&) {
         const bool boolean = truthy(a.get(1, "boolean"));
         if (boolean ? truthy(v) : v.defined()) return v;
         const Value d = a.get(0, "default_value");
         return d.defined() ? d : Value::str("");
       }},
      {"join",
       [](const Value& v, Args& a, Context& c) {
         const Value sep = a.get(0, "d");
         const Value attr = a.get(1, "attribute");
         std::string out;
         const List items = iterate(v, a.line);
         charge(c, items.size(), a.line);
         for (size_t k = 0; k < items.size(); ++k) {
           if (k) out += sep.kind == K::Str ? sep.s : "";
           out += to_text(attr.kind == K::Str ? attribute(items[k], attr.s, a.line) : items[k]);
         }
         return Value::str(std::move(out));
       }},
      {"items",
       [](const Value& v, Args& a, Context&) {
         if (v.kind != K::Dict) fail(a.line, "items: needs a dict");
         List l;
         for (const auto& [k, x] : *v.dict) l.push_back(Value::pair(Value::str(k), x));
         return Value::make_list(std::move(l));
       }},
      {"dictsort",
       [](const Value& v, Args& a, Context&) {
         if (v.kind != K::Dict) fail(a.line, "dictsort: needs a dict");
         Dict d = *v.dict;
         std::stable_sort(d.begin(), d.end(), [](const auto& x, const auto& y) {
           return map_chars(x.first, ::tolower) < map_chars(y.first, ::tolower);
         });
         List l;
         for (auto& [k, x] : d) l.push_back(Value::pair(Value::str(k), x));
         return Value::make_list(std::move(l));
       }},
      {"selectattr",
       [](const Value& v, Args& a, Context& c) { return select_items(v, a, c, true, true); }},
      {"rejectattr",
       [](const Value& v, Args& a, Context& c) { return select_items(v, a, c, true, false); }},
      {"select", [](const Value& v, Args& a, Context& c) { return select_items(v, a, c, false, true); }},
      {"reject",
       [](const Value& v, Args& a, Context& c) { return select_items(v, a, c, false, false); }},
      {"map",
       [](const Value& v, Args& a, Context& c) {
         List out;
         const Value attr = a.get(99, "attribute");
         const List items = truthy(v) ? iterate(v, a.line) : List{};
         charge(c, items.size(), a.line);
         for (const Value& x : items) {
           if (attr.kind == K::Str) {
             Value got = attribute(x, attr.s, a.line);
             const Value d = a.get(99, "default");
             out.push_back(!got.defined() && d.defined() ? d : got);
             continue;
           }
           Args rest;
           rest.line = a.line;
           rest.callee = a.callee;
           rest.positional.assign(a.positional.begin() + 1, a.positional.end());
           out.push_back(apply_filter(a.str(0, "filter"), x, rest, c));
         }
         return Value::make_list(std::move(out));
       }},
      {"unique",
       [](const Value& v, Args& a, Context& c) {
         const List items = iterate(v, a.line);
         charge(c, items.size() * items.size(), a.line);
         const bool cased = truthy(a.get(0, "case_sensitive"));
         const Value attr = a.get(1, "attribute");
         List out, keys;
         for (const Value& x : items) {
           const Value k = sort_key(x, attr, cased, a.line);
           if (std::none_of(keys.begin(), keys.end(), [&](const Value& y) { return equal(k, y); })) {
             keys.push_back(k);
             out.push_back(x);
           }
         }
         return Value::make_list(std::move(out));
       }},
      {"sort",
       [](const Value& v, Args& a, Context& c) {
         List l = iterate(v, a.line);
         charge(c, l.size() * 32, a.line);
         const bool reverse = truthy(a.get(0, "reverse"));
         const bool cased = truthy(a.get(1, "case_sensitive"));
         const Value attr = a.get(2, "attribute");
         // Python's sorted(reverse=True) keeps equal items in their order, as this does.
         std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
           const int k = compare(sort_key(x, attr, cased, a.line), sort_key(y, attr, cased, a.line),
                                 a.line);
           return reverse ? k > 0 : k < 0;
         });
         return Value::make_list(std::move(l));
       }},
      {"int",
       [](const Value& v, Args& a, Context&) {
         if (v.kind == K::Int || v.kind == K::Bool) return Value::integer(v.kind == K::Int ? v.i : v.b);
         if (v.kind == K::Float) {
           if (!(std::fabs(v.f) < 9.2e18)) fail(a.line, "int: the number is out of range");
           return Value::integer(static_cast<int64_t>(v.f));
         }
         try {
           return Value::integer(std::stoll(v.s));
         } catch (const std::exception&) {
           return Value::integer(0);
         }
       }},
      {"float",
       [](const Value& v, Args&, Context&) {
         if (v.is_number()) return Value::real(v.number());
         try {
           return Value::real(std::stod(v.s));
         } catch (const std::exception&) {
           return Value::real(0);
         }
       }},
      {"abs",
       [](const Value& v, Args& a, Context&) {
         if (v.kind == K::Int) {
           if (v.i == INT64_MIN) fail(a.line, "abs: overflows a 64-bit integer");
           return Value::integer(std::abs(v.i));
         }
         if (!v.is_number()) fail(a.line, "abs: needs a number");
         return Value::real(std::fabs(v.number()));
       }},
      {"indent",  // as Jinja2's do_indent, which splits the text + "\n" into lines
       [](const Value& v, Args& a, Context&) {
         const int64_t width = a.integer(0, "width", 4);
         if (width > 1024) fail(a.line, "indent: a width over 1024");
         const std::string pad(static_cast<size_t>(std::max<int64_t>(width, 0)), ' ');
         const bool first = truthy(a.get(1, "first")), blank = truthy(a.get(2, "blank"));
         std::vector<std::string> lines;
         const std::string s = to_text(v) + "\n";
         for (size_t at = 0; at < s.size();) {
           const size_t end = s.find_first_of("\r\n", at);
           lines.push_back(s.substr(at, end - at));
           at = end + (s.compare(end, 2, "\r\n") == 0 ? 2 : 1);
         }
         std::string out = lines[0];
         for (size_t k = 1; k < lines.size(); ++k)
           out += "\n" + (blank || !lines[k].empty() ? pad : std::string()) + lines[k];
         return Value::str(first ? pad + out : out);
       }},
  };
  return f;
}

Value apply_filter(const std::string& name, const Value& v, Args& a, Context& c) {
  const auto it = filters().find(name);
  if (it == filters().end())
    fail(a.line, detail::cat("filter '", name, "' is not in kvlab's Jinja subset"));
  return it->second(v, a, c);
}

struct FilterExpr : Expr {
  ExprPtr obj;
  std::string name;
  CallArgs args;
  Value eval(Context& c) const override {
    const Value v = obj->eval(c);
    Args a = args.eval(c, line, name.c_str());
    return apply_filter(name == "d" ? "default" : name, v, a, c);
  }
};
struct TestExpr : Expr {
  ExprPtr obj;
  std::string name;
  bool negated = false;
  CallArgs args;
  Value eval(Context& c) const override {
    const Value v = obj->eval(c);
    const Args a = args.eval(c, line, name.c_str());
    return Value::boolean(run_test(name, v, a) != negated);
  }
};

// ---------------------------------------------------------------------------------------------
// Statements.

struct Stmt {
  int line = 0;
  virtual ~Stmt() = default;
  virtual void run(Context& c, std::string& out) const = 0;
};
using Body = std::vector<std::unique_ptr<Stmt>>;

void run_body(const Body& body, Context& c, std::string& out) {
  for (const auto& s : body) {
    if (++c.steps > kMaxSteps) fail(s->line, "the template runs too long");
    s->run(c, out);
    if (out.size() > kMaxOutput) fail(s->line, "the template's text grows too large");
    if (c.jump != Context::Jump::None) return;
  }
}

struct TextStmt : Stmt {
  std::string text;
  void run(Context&, std::string& out) const override { out += text; }
};
struct PrintStmt : Stmt {
  ExprPtr e;
  void run(Context& c, std::string& out) const override { out += to_text(e->eval(c)); }
};
struct IfStmt : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
  void run(Context& c, std::string& out) const override {
    for (const auto& [cond, body] : branches)
      if (truthy(cond->eval(c))) return run_body(body, c, out);
    run_body(otherwise, c, out);
  }
};
struct ForStmt : Stmt {
  std::vector<std::string> targets;
  ExprPtr iter, filter;
  Body body, otherwise;

  void bind(Context& c, const Value& x) const {
    if (targets.size() == 1) return c.set(targets[0], x);
    const List parts = iterate(x, line);
    if (parts.size() != targets.size())
      fail(line, detail::cat("cannot unpack ", parts.size(), " values into ", targets.size()));
    for (size_t k = 0; k < targets.size(); ++k) c.set(targets[k], parts[k]);
  }
  void run(Context& c, std::string& out) const override {
    List items = iterate(iter->eval(c), line);
    c.frames.emplace_back();
    if (filter) {
      List kept;
      for (const Value& x : items) {
        bind(c, x);
        if (truthy(filter->eval(c))) kept.push_back(x);
      }
      items = std::move(kept);
    }
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      const auto at = [&](int64_t j) {
        return j >= 0 && j < n ? items[static_cast<size_t>(j)] : Value::undefined("");
      };
      if (++c.steps > kMaxSteps) fail(line, "the template runs too long");
      c.frames.back().clear();
      bind(c, items[static_cast<size_t>(k)]);
      c.set("loop", Value::make_dict({{"index0", Value::integer(k)},
                                      {"index", Value::integer(k + 1)},
                                      {"revindex0", Value::integer(n - k - 1)},
                                      {"revindex", Value::integer(n - k)},
                                      {"first", Value::boolean(k == 0)},
                                      {"last", Value::boolean(k == n - 1)},
                                      {"length", Value::integer(n)},
                                      {"previtem", at(k - 1)},
                                      {"nextitem", at(k + 1)}}));
      run_body(body, c, out);
      const Context::Jump jump = c.jump;
      c.jump = Context::Jump::None;
      if (jump == Context::Jump::Break) break;
    }
    if (n == 0) {  // in the loop's scope, as Jinja2 runs it
      c.frames.back().clear();
      run_body(otherwise, c, out);
    }
    c.frames.pop_back();
  }
};
struct SetStmt : Stmt {
  std::vector<std::string> targets;  // a name, names to unpack, or {namespace, attribute}
  bool attribute = false;
  ExprPtr value;
  Body block;  // {% set x %}...{% endset %}
  void run(Context& c, std::string& out) const override {
    (void)out;
    Value v;
    if (value) {
      v = value->eval(c);
    } else {
      std::string text;
      run_body(block, c, text);
      v = Value::str(std::move(text));
    }
    if (attribute) {
      Value ns = c.lookup(targets[0]);
      if (!ns.namespace_)
        fail(line,
             detail::cat("cannot set an attribute of '", targets[0], "': it is not a namespace()"));
      // A namespace inside one could hold itself: a cycle printing would never leave.
      if (v.holds_namespace)
        fail(line, "a namespace as a namespace's attribute is not in kvlab's Jinja subset");
      if (v.depth >= Value::kMaxDepth) fail(line, "the template's values nest over 256 deep");
      auto it = std::find_if(ns.dict->begin(), ns.dict->end(),
                             [&](const auto& kv) { return kv.first == targets[1]; });
      if (it != ns.dict->end())
        it->second = std::move(v);
      else
        ns.dict->emplace_back(targets[1], std::move(v));
      return;
    }
    if (targets.size() == 1) return c.set(targets[0], std::move(v));
    const List parts = iterate(v, line);
    if (parts.size() != targets.size())
      fail(line, detail::cat("cannot unpack ", parts.size(), " values into ", targets.size()));
    for (size_t k = 0; k < targets.size(); ++k) c.set(targets[k], parts[k]);
  }
};
struct JumpStmt : Stmt {
  Context::Jump jump;
  void run(Context& c, std::string&) const override { c.jump = jump; }
};
struct BlockStmt : Stmt {  // {% generation %}: its body, as Hugging Face renders it
  Body body;
  void run(Context& c, std::string& out) const override { run_body(body, c, out); }
};
struct MacroStmt : Stmt {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // default or null
  std::shared_ptr<Body> body;
  void run(Context& c, std::string&) const override {
    const MacroStmt* self = this;
    Context* ctx = &c;
    c.set(name, Value::func([self, ctx](Args& a) {
            Context& cc = *ctx;
            if (++cc.macro_depth > 64)
              fail(a.line, detail::cat("macro '", self->name, "' recurses too deep"));
            std::map<std::string, Value, std::less<>> frame;
            for (size_t k = 0; k < self->params.size(); ++k) {
              const auto& [pname, fallback] = self->params[k];
              Value v = a.get(k, pname);
              if (!v.defined() && fallback) v = fallback->eval(cc);
              frame[pname] =
                  v.defined() ? v : Value::undefined(detail::cat("'", pname, "' is undefined"));
            }
            // The body sees the template's variables and its parameters, not the caller's loops.
            std::vector<std::map<std::string, Value, std::less<>>> caller(
                std::make_move_iterator(cc.frames.begin() + 2),
                std::make_move_iterator(cc.frames.end()));
            cc.frames.resize(2);
            cc.frames.push_back(std::move(frame));
            std::string text;
            run_body(*self->body, cc, text);
            cc.frames.resize(2);
            cc.frames.insert(cc.frames.end(), std::make_move_iterator(caller.begin()),
                             std::make_move_iterator(caller.end()));
            cc.jump = Context::Jump::None;
            --cc.macro_depth;
            return Value::str(std::move(text));
          }));
  }
};

// ---------------------------------------------------------------------------------------------
// Scanning: the source cut into text, {{ expressions }} and {% statements %}, with Jinja2's
// whitespace rules under trim_blocks and lstrip_blocks.

struct Segment {
  enum class Kind { Text, Print, Statement } kind;
  std::string text;
  int line;
};

class Syntax : public Error {
 public:
  Syntax(int line, const std::string& message) : Error(detail::cat("line ", line, ": ", message)) {}
};

// Where the tag's closing `close` (two characters) is, past string literals and brackets.
size_t find_close(std::string_view src, size_t from, std::string_view close, int line) {
  int depth = 0;
  for (size_t k = from; k < src.size(); ++k) {
    const char ch = src[k];
    if (ch == '\'' || ch == '"') {
      for (++k; k < src.size() && src[k] != ch; ++k)
        if (src[k] == '\\') ++k;
      continue;
    }
    if (depth == 0 && src.substr(k, 2) == close) return k;
    if (ch == '(' || ch == '[' || ch == '{') ++depth;
    if ((ch == ')' || ch == ']' || ch == '}') && depth > 0) --depth;
  }
  throw Syntax(line, detail::cat("a tag is not closed with '", close, "'"));
}

std::vector<Segment> scan(std::string_view source) {
  std::string normalized;  // Jinja2 reads \r\n and \r as \n
  normalized.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r' && k + 1 < source.size() && source[k + 1] == '\n') continue;
    normalized += source[k] == '\r' ? '\n' : source[k];
  }
  std::string_view src = normalized;
  if (src.ends_with('\n')) src.remove_suffix(1);  // Jinja2 drops the template's last newline
  std::vector<Segment> out;
  size_t pos = 0;
  int line = 1;
  size_t line_pos = 0;  // line counts newlines before line_pos
  const auto line_at = [&](size_t p) {
    line += static_cast<int>(std::count(src.begin() + static_cast<ptrdiff_t>(line_pos),
                                        src.begin() + static_cast<ptrdiff_t>(p), '\n'));
    line_pos = p;
    return line;
  };
  bool line_starting = true, strip_next = false;
  while (true) {
    size_t open = pos;
    while ((open = src.find('{', open)) != std::string_view::npos && open + 1 < src.size() &&
           src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')
      ++open;
    if (open != std::string_view::npos && open + 1 >= src.size()) open = std::string_view::npos;
    std::string text(src.substr(pos, open == std::string_view::npos ? open : open - pos));
    if (strip_next)
      text.erase(0, text.find_first_not_of(" \t\n\r\f\v") == std::string::npos
                        ? text.size()
                        : text.find_first_not_of(" \t\n\r\f\v"));
    strip_next = false;
    if (open == std::string_view::npos) {
      if (!text.empty()) out.push_back({Segment::Kind::Text, std::move(text), line_at(pos)});
      return out;
    }
    const char kind = src[open + 1];
    const char sign = open + 2 < src.size() ? src[open + 2] : '\0';
    if (sign == '-') {
      text.erase(text.find_last_not_of(" \t\n\r\f\v") + 1);
    } else if (sign != '+' && kind != '{') {  // lstrip_blocks
      const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
          text.find_first_not_of(" \t\f\v\r", l_pos) == std::string::npos)
        text.erase(l_pos);
    }
    const int tag_line = line_at(open);
    if (!text.empty()) out.push_back({Segment::Kind::Text, std::move(text), tag_line});
    const size_t inner = open + 2 + (sign == '-' || sign == '+' ? 1 : 0);
    const size_t close = kind == '#' ? src.find("#}", inner)
                                     : find_close(src, inner, kind == '{' ? "}}" : "%}", tag_line);
    if (close == std::string_view::npos)
      throw Syntax(tag_line, "a comment is not closed with '#}'");
    const char end_sign = close > inner ? src[close - 1] : '\0';
    const size_t inner_end = end_sign == '-' || end_sign == '+' ? close - 1 : close;
    if (kind != '#')
      out.push_back({kind == '{' ? Segment::Kind::Print : Segment::Kind::Statement,
                     std::string(src.substr(inner, inner_end - inner)), tag_line});
    pos = close + 2;
    line_starting = false;
    if (end_sign == '-') {
      strip_next = true;
    } else if (end_sign != '+' && kind != '{' && pos < src.size() && src[pos] == '\n') {
      ++pos;  // trim_blocks
      line_starting = true;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tokens of one tag, and the expression grammar (Jinja2's precedence).

struct Token {
  enum class Kind { Name, Str, Int, Float, Op, End } kind;
  std::string text;  // a name, an operator, a string's value
  int64_t i = 0;
  double f = 0;
};


// A string literal's value, with Python's escapes.
std::string unescape(std::string_view body, int line) {
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    if (body[k] != '\\' || k + 1 == body.size()) {
      out += body[k];
      continue;
    }
    const char e = body[++k];
    const auto hex = [&](size_t n) {
      uint32_t cp = 0;
      for (size_t j = 1; j <= n; ++j) {
        const char h = k + j < body.size() ? body[k + j] : 'g';
        const int d = h >= '0' && h <= '9'   ? h - '0'
                      : h >= 'a' && h <= 'f' ? h - 'a' + 10
                      : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                             : -1;
        if (d < 0) throw Syntax(line, "a malformed \\x, \\u or \\U escape");
        cp = cp * 16 + static_cast<uint32_t>(d);
      }
      k += n;
      if (cp > 0x10FFFF) throw Syntax(line, "an escape beyond U+10FFFF");
      append_utf8(out, cp);
    };
    switch (e) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case '0':
        out += '\0';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'v':
        out += '\v';
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case '\n':
        break;
      case 'x':
        hex(2);
        break;
      case 'u':
        hex(4);
        break;
      case 'U':
        hex(8);
        break;
      default:
        out += '\\';
        out += e;
    }
  }
  return out;
}

std::vector<Token> lex(std::string_view s, int line) {
  static const char* const kOps[] = {"==", "!=", "<=", ">=", "//", "**", "<", ">", "+",
                                     "-",  "*",  "/",  "%",  "~",  "(",  ")", "[", "]",
                                     "{",  "}",  ".",  ",",  ":",  "|",  "="};
  std::vector<Token> out;
  for (size_t k = 0; k < s.size();) {
    const char ch = s[k];
    if (is_space(ch)) {
      ++k;
    } else if (std::isalpha(static_cast<unsigned char>(ch)) || ch == '_') {
      size_t e = k;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Token::Kind::Name, std::string(s.substr(k, e - k))});
      k = e;
    } else if (std::isdigit(static_cast<unsigned char>(ch))) {
      size_t e = k;
      bool real = false;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        real = true;
        for (++e; e < s.size() && std::isdigit(static_cast<unsigned char>(s[e])); ++e) {
        }
      }
      if (e < s.size() && (s[e] == 'e' || s[e] == 'E')) {
        size_t x = e + 1;
        if (x < s.size() && (s[x] == '+' || s[x] == '-')) ++x;
        if (x < s.size() && std::isdigit(static_cast<unsigned char>(s[x]))) {
          real = true;
          for (e = x; e < s.size() && std::isdigit(static_cast<unsigned char>(s[e])); ++e) {
          }
        }
      }
      std::string digits;
      for (const char d : s.substr(k, e - k))
        if (d != '_') digits += d;
      Token t{real ? Token::Kind::Float : Token::Kind::Int, digits};
      try {
        if (real)
          t.f = std::stod(digits);
        else
          t.i = std::stoll(digits);
      } catch (const std::exception&) {
        throw Syntax(line, detail::cat("the number ", digits, " is out of range"));
      }
      out.push_back(std::move(t));
      k = e;
    } else if (ch == '\'' || ch == '"') {
      size_t e = k + 1;
      for (; e < s.size() && s[e] != ch; ++e)
        if (s[e] == '\\') ++e;
      if (e >= s.size()) throw Syntax(line, "a string literal is not closed");
      out.push_back({Token::Kind::Str, unescape(s.substr(k + 1, e - k - 1), line)});
      k = e + 1;
    } else {
      const char* const* op = std::find_if(std::begin(kOps), std::end(kOps), [&](const char* o) {
        return s.substr(k).starts_with(o);
      });
      if (op == std::end(kOps))
        throw Syntax(line, detail::cat("the character '", std::string(1, ch),
                                       "' is not in kvlab's Jinja subset"));
      out.push_back({Token::Kind::Op, *op});
      k += std::string_view(*op).size();
    }
  }
  out.push_back({Token::Kind::End, ""});
  return out;
}

// Counts the parser's recursion, which a hostile template could otherwise take past the stack.
class Nesting {
 public:
  Nesting(int& depth, int line) : depth_(depth) {
    if (++depth_ > 200) throw Syntax(line, "expressions or statements nested too deep");
  }
  ~Nesting() { --depth_; }
  Nesting(const Nesting&) = delete;
  Nesting& operator=(const Nesting&) = delete;

 private:
  int& depth_;
};

class ExprParser {
 public:
  ExprParser(std::vector<Token> tokens, int line) : t_(std::move(tokens)), line_(line) {}

  bool at_end() const { return t_[p_].kind == Token::Kind::End; }
  bool at_op(std::string_view op) const {
    return t_[p_].kind == Token::Kind::Op && t_[p_].text == op;
  }
  bool at_name(std::string_view n) const {
    return t_[p_].kind == Token::Kind::Name && t_[p_].text == n;
  }
  bool accept_op(std::string_view op) { return at_op(op) ? (++p_, true) : false; }
  bool accept_name(std::string_view n) { return at_name(n) ? (++p_, true) : false; }
  void expect_op(std::string_view op) {
    if (!accept_op(op)) throw Syntax(line_, detail::cat("expected '", op, "', found ", here()));
  }
  std::string name() {
    if (t_[p_].kind != Token::Kind::Name)
      throw Syntax(line_, detail::cat("expected a name, found ", here()));
    return t_[p_++].text;
  }
  std::string here() const {
    return at_end() ? "the end of the tag" : detail::cat("'", t_[p_].text, "'");
  }
  void expect_end() {
    if (!at_end()) throw Syntax(line_, detail::cat("unexpected ", here()));
  }

  ExprPtr expression() {
    const Nesting n(depth_, line_);
    ExprPtr e = or_expr();
    if (!accept_name("if")) return e;
    auto c = node<Cond>();
    c->then = std::move(e);
    c->cond = or_expr();
    if (accept_name("else")) c->otherwise = expression();
    settle(*c, {c->then.get(), c->cond.get(), c->otherwise.get()});
    return c;
  }
  // A for loop's iterable: no `if`, which filters its items.
  ExprPtr or_expr() {
    ExprPtr l = and_expr();
    while (accept_name("or")) l = binary("or", std::move(l), and_expr());
    return l;
  }

 private:
  template <class T>
  std::unique_ptr<T> node() {
    auto n = std::make_unique<T>();
    n->line = line_;
    return n;
  }
  // A node's depth from its children's: a tree deeper than 256 is refused here, before
  // anything recurses through it.
  void settle(Expr& n, std::initializer_list<const Expr*> kids) const {
    for (const Expr* k : kids)
      if (k != nullptr) n.depth = std::max(n.depth, k->depth + 1);
    if (n.depth > 256) throw Syntax(line_, "expressions nested too deep");
  }
  void settle(Expr& n, const CallArgs& args) const {
    for (const ExprPtr& e : args.positional) settle(n, {e.get()});
    for (const auto& kv : args.keyword) settle(n, {kv.second.get()});
  }
  ExprPtr binary(std::string op, ExprPtr a, ExprPtr b) {
    auto n = node<Binary>();
    n->op = std::move(op);
    n->a = std::move(a);
    n->b = std::move(b);
    settle(*n, {n->a.get(), n->b.get()});
    return n;
  }
  ExprPtr and_expr() {
    ExprPtr l = not_expr();
    while (accept_name("and")) l = binary("and", std::move(l), not_expr());
    return l;
  }
  ExprPtr not_expr() {
    const Nesting guard(depth_, line_);
    if (!accept_name("not")) return compare_expr();
    auto n = node<Unary>();
    n->op = '!';
    n->a = not_expr();
    settle(*n, {n->a.get()});
    return n;
  }
  ExprPtr compare_expr() {
    ExprPtr first = sum();
    std::unique_ptr<Compare> cmp;
    while (true) {
      std::string op;
      for (const char* o : {"==", "!=", "<", ">", "<=", ">="})
        if (accept_op(o)) op = o;
      if (op.empty() && accept_name("in")) op = "in";
      if (op.empty() && at_name("not") && t_[p_ + 1].kind == Token::Kind::Name &&
          t_[p_ + 1].text == "in") {
        p_ += 2;
        op = "not in";
      }
      if (op.empty()) break;
      if (!cmp) {
        cmp = node<Compare>();
        cmp->first = std::move(first);
      }
      cmp->rest.emplace_back(op, sum());
      settle(*cmp, {cmp->first.get(), cmp->rest.back().second.get()});
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  // Jinja2's order: + and - bind looser than ~, which binds looser than * and /.
  ExprPtr concat() {
    ExprPtr l = product();
    while (accept_op("~")) l = binary("~", std::move(l), product());
    return l;
  }
  ExprPtr sum() {
    ExprPtr l = concat();
    while (at_op("+") || at_op("-")) {
      const std::string op = t_[p_++].text;
      l = binary(op, std::move(l), concat());
    }
    return l;
  }
  ExprPtr product() {
    ExprPtr l = power();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const std::string op = t_[p_++].text;
      l = binary(op, std::move(l), power());
    }
    return l;
  }
  ExprPtr power() {
    ExprPtr l = unary(true);
    while (accept_op("**")) l = binary("**", std::move(l), unary(true));
    return l;
  }
  ExprPtr unary(bool with_filter) {
    const Nesting guard(depth_, line_);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      auto n = node<Unary>();
      n->op = t_[p_++].text[0];
      n->a = unary(false);
      settle(*n, {n->a.get()});
      e = std::move(n);
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    return with_filter ? filter_expr(std::move(e)) : std::move(e);
  }
  ExprPtr primary() {
    const Token& tok = t_[p_];
    if (tok.kind == Token::Kind::Name) {
      ++p_;
      auto lit = node<Literal>();
      if (tok.text == "true" || tok.text == "True")
        lit->v = Value::boolean(true);
      else if (tok.text == "false" || tok.text == "False")
        lit->v = Value::boolean(false);
      else if (tok.text == "none" || tok.text == "None")
        lit->v = Value::none();
      else {
        auto n = node<Name>();
        n->name = tok.text;
        return n;
      }
      return lit;
    }
    if (tok.kind == Token::Kind::Str) {
      std::string s;
      while (t_[p_].kind == Token::Kind::Str) s += t_[p_++].text;  // adjacent literals join
      auto lit = node<Literal>();
      lit->v = Value::str(std::move(s));
      return lit;
    }
    if (tok.kind == Token::Kind::Int || tok.kind == Token::Kind::Float) {
      ++p_;
      auto lit = node<Literal>();
      lit->v = tok.kind == Token::Kind::Int ? Value::integer(tok.i) : Value::real(tok.f);
      return lit;
    }
    if (accept_op("(")) {
      auto tuple = node<ListExpr>();
      tuple->tuple = true;
      if (accept_op(")")) return tuple;
      ExprPtr e = expression();
      if (!at_op(",")) {
        expect_op(")");
        return e;
      }
      tuple->items.push_back(std::move(e));
      while (accept_op(",") && !at_op(")")) tuple->items.push_back(expression());
      expect_op(")");
      for (const ExprPtr& item : tuple->items) settle(*tuple, {item.get()});
      return tuple;
    }
    if (accept_op("[")) {
      auto l = node<ListExpr>();
      while (!at_op("]")) {
        l->items.push_back(expression());
        if (!accept_op(",")) break;
      }
      expect_op("]");
      for (const ExprPtr& item : l->items) settle(*l, {item.get()});
      return l;
    }
    if (accept_op("{")) {
      auto d = node<DictExpr>();
      while (!at_op("}")) {
        ExprPtr k = expression();
        expect_op(":");
        d->items.emplace_back(std::move(k), expression());
        if (!accept_op(",")) break;
      }
      expect_op("}");
      for (const auto& [k, v] : d->items) settle(*d, {k.get(), v.get()});
      return d;
    }
    throw Syntax(line_, detail::cat("unexpected ", here()));
  }
  ExprPtr postfix(ExprPtr e) {
    while (true) {
      if (accept_op(".")) {
        if (t_[p_].kind == Token::Kind::Int) {
          auto it = node<Item>();
          it->obj = std::move(e);
          auto lit = node<Literal>();
          lit->v = Value::integer(t_[p_++].i);
          it->key = std::move(lit);
          settle(*it, {it->obj.get()});
          e = std::move(it);
          continue;
        }
        auto a = node<Attr>();
        a->obj = std::move(e);
        a->name = name();
        settle(*a, {a->obj.get()});
        e = std::move(a);
      } else if (accept_op("[")) {
        e = subscript(std::move(e));
      } else if (at_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }
  ExprPtr subscript(ExprPtr obj) {
    ExprPtr start;
    if (!at_op(":")) start = expression();
    if (accept_op("]")) {
      auto it = node<Item>();
      it->obj = std::move(obj);
      it->key = std::move(start);
      settle(*it, {it->obj.get(), it->key.get()});
      return it;
    }
    auto s = node<Slice>();
    s->obj = std::move(obj);
    s->start = std::move(start);
    expect_op(":");
    if (!at_op(":") && !at_op("]")) s->stop = expression();
    if (accept_op(":") && !at_op("]")) s->step = expression();
    expect_op("]");
    settle(*s, {s->obj.get(), s->start.get(), s->stop.get(), s->step.get()});
    return s;
  }
  CallArgs call_args() {
    CallArgs a;
    expect_op("(");
    while (!at_op(")")) {
      if (t_[p_].kind == Token::Kind::Name && t_[p_ + 1].kind == Token::Kind::Op &&
          t_[p_ + 1].text == "=") {
        std::string k = name();
        ++p_;
        a.keyword.emplace_back(std::move(k), expression());
      } else {
        if (!a.keyword.empty()) throw Syntax(line_, "a positional argument after a keyword one");
        a.positional.push_back(expression());
      }
      if (!accept_op(",")) break;
    }
    expect_op(")");
    return a;
  }
  static std::string describe(const Expr& e) {
    if (const auto* n = dynamic_cast<const Name*>(&e)) return n->name;
    if (const auto* a = dynamic_cast<const Attr*>(&e)) return describe(*a->obj) + "." + a->name;
    return "expression";
  }
  ExprPtr call(ExprPtr callee) {
    auto c = node<Call>();
    c->what = describe(*callee);
    c->callee = std::move(callee);
    c->args = call_args();
    settle(*c, {c->callee.get()});
    settle(*c, c->args);
    return c;
  }
  ExprPtr filter_expr(ExprPtr e) {
    while (true) {
      if (accept_op("|")) {
        auto f = node<FilterExpr>();
        f->obj = std::move(e);
        f->name = name();
        if (f->name != "d" && !filters().contains(f->name))
          throw Syntax(line_, detail::cat("filter '", f->name, "' is not in kvlab's Jinja subset"));
        if (at_op("(")) f->args = call_args();
        settle(*f, {f->obj.get()});
        settle(*f, f->args);
        e = std::move(f);
      } else if (accept_name("is")) {
        auto t = node<TestExpr>();
        t->obj = std::move(e);
        t->negated = accept_name("not");
        t->name =
            t_[p_].kind == Token::Kind::Op && (at_op("==") || at_op("!=")) ? t_[p_++].text : name();
        if (!tests().contains(t->name))
          throw Syntax(line_, detail::cat("test '", t->name, "' is not in kvlab's Jinja subset"));
        if (at_op("(")) {
          t->args = call_args();
        } else if (starts_argument()) {
          t->args.positional.push_back(postfix(primary()));
        }
        settle(*t, {t->obj.get()});
        settle(*t, t->args);
        e = std::move(t);
      } else if (at_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }
  bool starts_argument() const {
    const Token& tok = t_[p_];
    if (tok.kind == Token::Kind::Name)
      return tok.text != "else" && tok.text != "or" && tok.text != "and" && tok.text != "if" &&
             tok.text != "is" && tok.text != "in" && tok.text != "not";
    return tok.kind == Token::Kind::Str || tok.kind == Token::Kind::Int ||
           tok.kind == Token::Kind::Float || at_op("[") || at_op("{");
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  int line_;
  int depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Statements from segments.

class Parser {
 public:
  explicit Parser(std::vector<Segment> segments) : s_(std::move(segments)) {}

  // Statements up to one whose keyword is in `ends` (returned, its parser left after the
  // keyword), or to the end of the template where `ends` is empty.
  Body body(std::initializer_list<std::string_view> ends, std::string* end_keyword,
            std::unique_ptr<ExprParser>* end_rest) {
    Body out;
    while (k_ < s_.size()) {
      const Segment& seg = s_[k_++];
      if (seg.kind == Segment::Kind::Text) {
        auto t = std::make_unique<TextStmt>();
        t->line = seg.line;
        t->text = seg.text;
        out.push_back(std::move(t));
        continue;
      }
      auto ep = std::make_unique<ExprParser>(lex(seg.text, seg.line), seg.line);
      if (seg.kind == Segment::Kind::Print) {
        auto p = std::make_unique<PrintStmt>();
        p->line = seg.line;
        p->e = ep->expression();
        ep->expect_end();
        out.push_back(std::move(p));
        continue;
      }
      const std::string keyword = ep->name();
      if (std::find(ends.begin(), ends.end(), keyword) != ends.end()) {
        *end_keyword = keyword;
        *end_rest = std::move(ep);
        return out;
      }
      if (keyword.starts_with("end") || keyword == "elif" || keyword == "else")
        throw Syntax(seg.line, detail::cat("'", keyword, "' without its opening statement"));
      const Nesting guard(depth_, seg.line);
      out.push_back(statement(keyword, *ep, seg.line));
    }
    if (ends.size() != 0)
      throw Syntax(s_.empty() ? 1 : s_.back().line,
                   detail::cat("the template ends before '", *(ends.end() - 1), "'"));
    return out;
  }

 private:
  Body until(std::initializer_list<std::string_view> ends, std::string& which,
             std::unique_ptr<ExprParser>& rest) {
    return body(ends, &which, &rest);
  }

  std::unique_ptr<Stmt> statement(const std::string& keyword, ExprParser& ep, int line) {
    std::string end;
    std::unique_ptr<ExprParser> rest;
    if (keyword == "if") {
      auto s = std::make_unique<IfStmt>();
      ExprPtr cond = ep.expression();
      ep.expect_end();
      while (true) {
        Body b = until({"elif", "else", "endif"}, end, rest);
        s->branches.emplace_back(std::move(cond), std::move(b));
        if (end != "elif") break;
        cond = rest->expression();
        rest->expect_end();
      }
      if (end == "else") {
        rest->expect_end();
        s->otherwise = until({"endif"}, end, rest);
      }
      rest->expect_end();
      s->line = line;
      return s;
    }
    if (keyword == "for") {
      auto s = std::make_unique<ForStmt>();
      do s->targets.push_back(ep.name());
      while (ep.accept_op(","));
      if (!ep.accept_name("in")) throw Syntax(line, "expected 'in' in a for loop");
      s->iter = ep.or_expr();
      if (ep.at_op(","))
        throw Syntax(line, "a for loop over a tuple literal is not in kvlab's subset");
      if (ep.accept_name("if")) s->filter = ep.expression();
      if (ep.at_name("recursive"))
        throw Syntax(line, "'recursive' loops are not in kvlab's Jinja subset");
      ep.expect_end();
      ++loops_;
      s->body = until({"else", "endfor"}, end, rest);
      --loops_;
      if (end == "else") {
        rest->expect_end();
        s->otherwise = until({"endfor"}, end, rest);
      }
      rest->expect_end();
      s->line = line;
      return s;
    }
    if (keyword == "set") {
      auto s = std::make_unique<SetStmt>();
      s->targets.push_back(ep.name());
      if (ep.accept_op(".")) {
        s->attribute = true;
        s->targets.push_back(ep.name());
      } else {
        while (ep.accept_op(",")) s->targets.push_back(ep.name());
      }
      if (ep.accept_op("=")) {
        s->value = ep.expression();
        ep.expect_end();
      } else {
        ep.expect_end();
        s->block = until({"endset"}, end, rest);
        rest->expect_end();
      }
      s->line = line;
      return s;
    }
    if (keyword == "macro") {
      auto s = std::make_unique<MacroStmt>();
      s->name = ep.name();
      ep.expect_op("(");
      while (!ep.at_op(")")) {
        std::string p = ep.name();
        s->params.emplace_back(p, ep.accept_op("=") ? ep.expression() : nullptr);
        if (!ep.accept_op(",")) break;
      }
      ep.expect_op(")");
      ep.expect_end();
      const int loops = std::exchange(loops_, 0);  // a loop around a macro is not its own
      s->body = std::make_shared<Body>(until({"endmacro"}, end, rest));
      loops_ = loops;
      s->line = line;
      return s;
    }
    if (keyword == "break" || keyword == "continue") {
      ep.expect_end();
      if (loops_ == 0) throw Syntax(line, detail::cat("'", keyword, "' outside a for loop"));
      auto s = std::make_unique<JumpStmt>();
      s->jump = keyword == "break" ? Context::Jump::Break : Context::Jump::Continue;
      s->line = line;
      return s;
    }
    if (keyword == "generation") {
      ep.expect_end();
      auto s = std::make_unique<BlockStmt>();
      s->body = until({"endgeneration"}, end, rest);
      rest->expect_end();
      s->line = line;
      return s;
    }
    throw Syntax(line, detail::cat("the statement '", keyword, "' is not in kvlab's Jinja subset"));
  }

  std::vector<Segment> s_;
  size_t k_ = 0;
  int depth_ = 0;
  int loops_ = 0;  // for loops around the statement being parsed
};

std::string strftime_now(const std::string& format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[256];
  const size_t n = std::strftime(buf, sizeof buf, format.c_str(), &tm);
  return std::string(buf, n);
}

// The functions a template may call (Hugging Face's globals and Jinja2's).
std::map<std::string, Value, std::less<>> globals() {
  std::map<std::string, Value, std::less<>> g;
  g["raise_exception"] =
      Value::func([](Args& a) -> Value { throw TemplateError(to_text(a.get(0, "message"))); });
  g["strftime_now"] =
      Value::func([](Args& a) { return Value::str(strftime_now(a.str(0, "format"))); });
  g["namespace"] = Value::func([](Args& a) {
    Value ns = Value::make_dict();
    ns.namespace_ = ns.holds_namespace = true;
    for (const Value& d : a.positional)
      if (d.kind == Value::Kind::Dict) *ns.dict = *d.dict;
    for (auto& [k, v] : a.keyword) ns.dict->emplace_back(k, v);
    return ns;
  });
  g["dict"] = Value::func([](Args& a) {
    Dict d;
    for (auto& [k, v] : a.keyword) d.emplace_back(k, v);
    return Value::make_dict(std::move(d));
  });
  g["range"] = Value::func([](Args& a) {
    const bool one = a.positional.size() == 1;
    const int64_t start = one ? 0 : a.integer(0, "start", 0);
    const int64_t stop = one ? a.integer(0, "stop", 0) : a.integer(1, "stop", 0);
    const int64_t step = a.integer(2, "step", 1);
    if (step == 0) fail(a.line, "range: step is 0");
    List l;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if (l.size() >= 100'000) fail(a.line, "range: more than 100,000 items");
      l.push_back(Value::integer(k));
    }
    return Value::make_list(std::move(l));
  });
  return g;
}

}  // namespace

struct ChatTemplate::Program {
  Body body;
};

ChatTemplate::ChatTemplate(std::string_view source, std::string what) : what_(std::move(what)) {
  try {
    Parser parser(scan(source));
    auto program = std::make_shared<Program>();
    program->body = parser.body({}, nullptr, nullptr);
    program_ = std::move(program);
  } catch (const Error& e) {
    throw Error(detail::cat(what_, ": ", e.what()));
  }
}

std::string ChatTemplate::render(const nlohmann::ordered_json& variables) const {
  Context c;
  c.frames.push_back(globals());
  c.frames.emplace_back();
  if (variables.is_object())
    for (const auto& [k, v] : variables.items()) c.set(k, from_json(v));
  std::string out;
  try {
    run_body(program_->body, c, out);
  } catch (const TemplateError& e) {
    throw TemplateError(detail::cat(what_, ": ", e.what()));
  }
  return out;
}

namespace {

// A message as templates expect it: content a string (text parts joined) or null.
nlohmann::ordered_json normalized_message(const nlohmann::ordered_json& m, size_t index) {
  const std::string where = detail::cat("messages[", index, "]");
  if (!m.is_object()) throw TemplateError(where + " is not an object");
  if (!m.contains("role") || !m["role"].is_string())
    throw TemplateError(where + " has no string 'role'");
  nlohmann::ordered_json out = m;
  if (!m.contains("content")) return out;
  const nlohmann::ordered_json& content = m["content"];
  if (content.is_array()) {
    std::string text;
    for (const auto& part : content) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string())
        throw TemplateError(where +
                            ".content: kvlab takes text parts only ({\"type\": "
                            "\"text\", \"text\": ...})");
      if (!text.empty()) text += '\n';
      text += part["text"].get<std::string>();
    }
    out["content"] = text;
  } else if (!content.is_string() && !content.is_null()) {
    throw TemplateError(where + ".content must be a string, a list of text parts or null");
  }
  return out;
}

std::string token_text(const Tokenizer& tok, int32_t id) {
  return id < 0 ? std::string() : tok.decode_one(id);
}

}  // namespace

ChatPrompt chat_prompt(const ChatTemplate& tmpl, const Tokenizer& tok,
                       const nlohmann::ordered_json& messages, bool add_generation_prompt) {
  if (!messages.is_array() || messages.empty())
    throw TemplateError("'messages' must be a non-empty list of messages");
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) list.push_back(normalized_message(messages[i], i));
  ChatPrompt p;
  // As transformers renders: tools and documents are None where a request has none.
  p.text = tmpl.render({{"messages", list},
                        {"tools", nullptr},
                        {"documents", nullptr},
                        {"add_generation_prompt", add_generation_prompt},
                        {"bos_token", token_text(tok, tok.controls().bos)},
                        {"eos_token", token_text(tok, tok.controls().eos)}});
  p.ids = tok.encode_chat(p.text);
  return p;
}

}  // namespace kvlab
