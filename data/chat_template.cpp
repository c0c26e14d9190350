#include "data/chat_template.h"

#include <algorithm>
#include <map>
#include <utility>

#include "data/jinja_values.h"

namespace kvlab {

namespace {

using namespace jinja;  // NOLINT: the values and built-ins this file parses templates over

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
