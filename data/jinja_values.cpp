#include "data/jinja_values.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <set>

namespace kvlab::jinja {

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

Value from_json(const nlohmann::ordered_json& j, int depth) {
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
  static const std::set<std::string_view> kWide = {"\u0085", "\u00a0", "\u1680", "\u2000", "\u2001",
                                                   "\u2002", "\u2003", "\u2004", "\u2005", "\u2006",
                                                   "\u2007", "\u2008", "\u2009", "\u200a", "\u2028",
                                                   "\u2029", "\u202f", "\u205f", "\u3000"};
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
// Tests and filters, resolved by name when a template is parsed.

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
      {"select",
       [](const Value& v, Args& a, Context& c) { return select_items(v, a, c, false, true); }},
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
           if (std::none_of(keys.begin(), keys.end(),
                            [&](const Value& y) { return equal(k, y); })) {
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
           const int k =
               compare(sort_key(x, attr, cased, a.line), sort_key(y, attr, cased, a.line), a.line);
           return reverse ? k > 0 : k < 0;
         });
         return Value::make_list(std::move(l));
       }},
      {"int",
       [](const Value& v, Args& a, Context&) {
         if (v.kind == K::Int || v.kind == K::Bool)
           return Value::integer(v.kind == K::Int ? v.i : v.b);
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

std::string strftime_now(const std::string& format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[256];
  const size_t n = std::strftime(buf, sizeof buf, format.c_str(), &tm);
  return std::string(buf, n);
}

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

}  // namespace kvlab::jinja
