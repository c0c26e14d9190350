#pragma once
// The values a chat template computes with, as Jinja2 sees Python's, and the built-ins that act on
// them: printing, comparison and arithmetic, attribute and item access, the string, dict and list
// methods, the tests and filters, and the global functions. data/chat_template.cpp parses and
// runs templates over them. Internal to data/.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_template.h"

namespace kvlab::jinja {

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

[[noreturn]] void fail(int line, const std::string& message);  // a TemplateError at `line`
const char* type_name(const Value& v);
bool is_space(char c);  // ASCII whitespace

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

Value from_json(const nlohmann::ordered_json& j, int depth = 0);
bool truthy(const Value& v);
std::string to_text(const Value& v);  // what {{ value }} prints
std::string repr(const Value& v);     // Python's repr
bool equal(const Value& a, const Value& b);
int compare(const Value& a, const Value& b, int line);  // <0, 0, >0
bool contains(const Value& container, const Value& item, int line);
void check_defined(const Value& v, int line);
Value arithmetic(const std::string& op, const Value& a, const Value& b, int line);
List iterate(const Value& v, int line);
int64_t length(const Value& v, int line);
Value attribute(const Value& obj, const std::string& name, int line);  // obj.name
Value item(const Value& obj, const Value& key, int line);              // obj[key]
// Python's slice bounds for a sequence of n items.
std::vector<int64_t> slice_indices(int64_t n, const Value& start, const Value& stop,
                                   const Value& step, int line);
void charge(Context& c, size_t n, int line);

// Tests (x is name(args)) and filters (x | name(args)), by name.
using TestFn = bool (*)(const Value&, const Args&);
using FilterFn = Value (*)(const Value&, Args&, Context&);
const std::map<std::string, TestFn, std::less<>>& tests();
const std::map<std::string, FilterFn, std::less<>>& filters();
bool run_test(const std::string& name, const Value& v, const Args& a);
Value apply_filter(const std::string& name, const Value& v, Args& a, Context& c);
// The functions a template may call (Hugging Face's globals and Jinja2's).
std::map<std::string, Value, std::less<>> globals();

}  // namespace kvlab::jinja
