// Chat templates: kvlab's Jinja subset against Jinja2 itself (tests/data/render_chat.py renders
// as Hugging Face's apply_chat_template does), on the real families' templates that llama.cpp
// ships (models/templates) and on constructs one by one.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "data/chat_template.h"
#include "tests/error_of.h"
#include "tests/llama_cpp_source.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Job {
  fs::path templ;
  ojson variables;
};
struct Rendered {
  bool ok = false;
  std::string text;  // or the error
};

// Jinja2's renderings of the jobs, in order; empty with `why` where Python or Jinja2 is missing.
std::vector<Rendered> jinja2(const std::vector<Job>& jobs, const fs::path& dir, std::string& why) {
  const std::string python = KVLAB_PYTHON3;
  if (std::system((python + " -c 'import jinja2' 2>/dev/null").c_str()) != 0) {
    why = "python3 with Jinja2 (Debian: python3-jinja2) is missing";
    return {};
  }
  ojson in = {{"jobs", ojson::array()}};
  for (const Job& j : jobs)
    in["jobs"].push_back({{"template", j.templ.string()}, {"variables", j.variables}});
  std::ofstream(dir / "jobs.json") << in.dump();
  const std::string cmd = python + " " + KVLAB_SOURCE_DIR + "/tests/data/render_chat.py < '" +
                          (dir / "jobs.json").string() + "' > '" + (dir / "out.json").string() +
                          "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<Rendered> out;
  for (const auto& r : ojson::parse(read_file(dir / "out.json")))
    out.push_back(r.contains("text") ? Rendered{true, r["text"]} : Rendered{false, r["error"]});
  EXPECT_EQ(out.size(), jobs.size());
  return out;
}

Rendered kvlab_render(const fs::path& templ, const ojson& variables) {
  try {
    return {true, ChatTemplate(read_file(templ), templ.filename().string()).render(variables)};
  } catch (const Error& e) {
    return {false, e.what()};
  }
}

// Conversations as a client sends them: a system prompt or none, several turns, text that
// looks like template syntax, quotes, newlines, non-ASCII.
std::vector<ojson> conversations() {
  return {
      ojson::array({{{"role", "user"}, {"content", "Hello!"}}}),
      ojson::array({{{"role", "system"}, {"content", "You are terse.\n"}},
                    {{"role", "user"}, {"content", "  What is 2+2? "}}}),
      ojson::array({{{"role", "system"}, {"content", "Answer in French."}},
                    {{"role", "user"}, {"content", "Say \"hi\" {{ not a tag }} {% if %}"}},
                    {{"role", "assistant"}, {"content", "Salut ! Ça va ?"}},
                    {{"role", "user"}, {"content", "Et le café ☕, l'été ?\n\nMerci."}}}),
      ojson::array({{{"role", "user"}, {"content", "Tell me a joke."}},
                    {{"role", "assistant"}, {"content", "<think>hmm</think>Why did the GPU..."}},
                    {{"role", "user"}, {"content", "Another one."}}}),
  };
}

std::vector<Job> chat_jobs(const fs::path& templ, const std::string& bos, const std::string& eos) {
  std::vector<Job> jobs;
  for (const ojson& messages : conversations())
    for (const bool gen : {true, false})
      jobs.push_back({templ,
                      {{"messages", messages},
                       {"tools", nullptr},
                       {"documents", nullptr},
                       {"add_generation_prompt", gen},
                       {"bos_token", bos},
                       {"eos_token", eos}}});
  return jobs;
}

class ChatTemplates : public testing::TestDirFixture {
 protected:
  ChatTemplates() : TestDirFixture("kvlab-chat") {}
  void SetUp() override {
    TestDirFixture::SetUp();
    std::string why;
    src_ = test::llama_cpp_source(why);
    if (src_.empty()) GTEST_SKIP() << why;
  }
  fs::path templates() const { return src_ / "models" / "templates"; }
  fs::path src_;
};

// The chat templates of the families kvlab loads (Llama 3.x, Qwen2.5, Phi-3.5, Mistral, the
// DeepSeek R1 distills of Llama and Qwen): every conversation, with and without the generation
// prompt, renders as Jinja2 renders it.
TEST_F(ChatTemplates, FamilyTemplatesRenderAsJinja2Does) {
  const std::vector<std::tuple<std::string, std::string, std::string>> families = {
      {"meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>"},
      {"meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>"},
      {"meta-llama-Llama-3.3-70B-Instruct", "<|begin_of_text|>", "<|eot_id|>"},
      {"Qwen-Qwen2.5-7B-Instruct", "", "<|im_end|>"},
      {"microsoft-Phi-3.5-mini-instruct", "<s>", "<|endoftext|>"},
      {"mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>"},
      {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "<｜begin▁of▁sentence｜>",
       "<｜end▁of▁sentence｜>"},
      {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "<｜begin▁of▁sentence｜>",
       "<｜end▁of▁sentence｜>"},
  };
  std::vector<Job> jobs;
  for (const auto& [name, bos, eos] : families) {
    const std::vector<Job> more = chat_jobs(templates() / (name + ".jinja"), bos, eos);
    jobs.insert(jobs.end(), more.begin(), more.end());
  }
  std::string why;
  const std::vector<Rendered> want = jinja2(jobs, dir_, why);
  if (want.empty()) GTEST_SKIP() << why;
  for (size_t k = 0; k < jobs.size(); ++k) {
    const Rendered got = kvlab_render(jobs[k].templ, jobs[k].variables);
    ASSERT_TRUE(want[k].ok) << jobs[k].templ << ": " << want[k].text;
    ASSERT_TRUE(got.ok) << got.text;
    EXPECT_EQ(got.text, want[k].text) << jobs[k].templ.filename() << " job " << k;
  }
}

// Every template llama.cpp ships, with the same conversations: kvlab renders it as Jinja2 does,
// fails where Jinja2 fails (raise_exception), or refuses it when parsed, naming the construct
// outside its subset. Never a different prompt.
TEST_F(ChatTemplates, EveryShippedTemplateRendersAsJinja2OrIsRefusedByName) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(templates()))
    if (e.path().extension() == ".jinja") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 20u);
  std::vector<Job> jobs;
  for (const fs::path& f : files) {
    const std::vector<Job> more = chat_jobs(f, "<s>", "</s>");
    jobs.insert(jobs.end(), more.begin(), more.end());
  }
  std::string why;
  const std::vector<Rendered> want = jinja2(jobs, dir_, why);
  if (want.empty()) GTEST_SKIP() << why;
  int same = 0, both_fail = 0, refused = 0;
  std::set<fs::path> refused_files;
  for (size_t k = 0; k < jobs.size(); ++k) {
    const Rendered got = kvlab_render(jobs[k].templ, jobs[k].variables);
    if (!got.ok && got.text.find("not in kvlab's Jinja subset") != std::string::npos) {
      ++refused;
      refused_files.insert(jobs[k].templ.filename());
      continue;
    }
    if (!want[k].ok) {
      EXPECT_FALSE(got.ok) << jobs[k].templ.filename() << " job " << k << ": Jinja2 failed ("
                           << want[k].text << ") but kvlab rendered:\n"
                           << got.text;
      both_fail += !got.ok;
      continue;
    }
    ASSERT_TRUE(got.ok) << jobs[k].templ.filename() << " job " << k << ": " << got.text;
    EXPECT_EQ(got.text, want[k].text) << jobs[k].templ.filename() << " job " << k;
    same += got.text == want[k].text;
  }
  std::string names;
  for (const fs::path& f : refused_files) names += " " + f.string();
  std::printf(
      "%zu templates, %zu jobs: %d render as Jinja2, %d fail as in Jinja2, %d refused by "
      "name (%zu templates:%s)\n",
      files.size(), jobs.size(), same, both_fail, refused, refused_files.size(), names.c_str());
}

// Constructs one by one, each against Jinja2: whitespace control under trim_blocks and
// lstrip_blocks, scopes, loops, filters, tests, methods, literals and Python's printing.
TEST_F(ChatTemplates, ConstructsRenderAsJinja2Does) {
  const std::vector<std::string> snippets = {
      "a\n  {% if true %}\n  b\n  {% endif %}\nc\n",
      "{%- for m in messages -%}\n  [{{ m.role }}]\n{%- endfor %}\n  tail  \n\n",
      "x {#- comment -#} y {# another #}\n  z\n    {# indented #}\nw",
      "{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}"
      "{{ '<' if loop.first }}{{ '>' if loop.last else ',' }}{{ loop.revindex0 }}{% endfor %}",
      "{% for x in [] %}no{% else %}empty{% endfor %}|{% for k, v in d.items() %}{{ k }}={{ v }};"
      "{% endfor %}|{% for k in d %}{{ k }}{% endfor %}|{% for c in 'héllo' %}{{ c }}.{% endfor %}",
      "{% set x = 1 %}{% for i in range(3) %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}",
      "{% set ns = namespace(total=0, seen=false) %}{% for i in range(5) %}{% set ns.total = "
      "ns.total + i %}{% if i == 3 %}{% set ns.seen = true %}{% break %}{% endif %}{% endfor %}"
      "{{ ns.total }} {{ ns.seen }}",
      "{% for i in range(6) %}{% if i is odd %}{% continue %}{% endif %}{{ i }}{% endfor %}",
      "{{ s|trim }}|{{ s|length }}|{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s|upper }}"
      "|{{ s|lower }}|{{ s.title() }}|{{ s|capitalize }}|{{ s.split() }}|{{ 'a,b,,c'.split(',') }}"
      "|{{ 'a,b,c'.split(',', 1) }}|{{ s.replace('i', 'I') }}|{{ s.startswith(' H') }}"
      "|{{ s.endswith(('x', ' ')) }}|{{ 'héllo'[1:3] }}|{{ 'héllo'[-1] }}|{{ 'abc'[::-1] }}",
      "{{ messages|length }} {{ (messages|first).role }} {{ (messages|last)['role'] }} "
      "{{ messages|selectattr('role', 'equalto', 'user')|list|length }} "
      "{{ messages|rejectattr('role', 'eq', 'user')|map(attribute='role')|join(', ') }} "
      "{{ messages[1:]|length }} {{ messages[:-1]|length }} {{ messages[-1].role }}",
      "{{ d|tojson }} {{ d|tojson(indent=2) }} {{ messages[0]|tojson }} {{ [1, 2.5, none, true, "
      "'é\"\\n']|tojson }} {{ {'k': [1, {'z': []}], 'e': {}}|tojson(indent=4) }}",
      "{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 "
      "}}"
      " {{ 1.5 + 1 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1e-5 }} {{ 3.0 }} {{ 'ab' ~ 3 ~ none }} "
      "{{ 'x' * 3 }} {{ [1] + [2] }}",
      "{{ none }} {{ true }} {{ false }} {{ undefined_thing }} {{ [1, 'a', none, {'k': 'v'}] }} "
      "{{ d }} {{ \"it's\" }} {{ 'say \"x\"' }}",
      "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'a' in 'cat' }} {{ 'z' not in 'cat' }} {{ 2 in [1, 2] }} "
      "{{ 'a' in d }} {{ not 'a' in d }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ [1] == [1] }}",
      "{{ x is defined }} {{ d is mapping }} {{ s is string }} {{ s is iterable }} {{ n is number "
      "}}"
      " {{ n is integer }} {{ f is float }} {{ none_ is none }} {{ n is not none }} "
      "{{ messages is sequence }} {{ n is divisibleby 3 }} {{ n is even }} {{ 'abc' is lower }} "
      "{{ d.a is equalto 1 }} {{ messages[0].name is undefined }}",
      "{{ x|default('dflt') }} {{ ''|default('e', true) }} {{ none_|default('kept') }} "
      "{{ d.get('a') }} {{ d.get('q', 'no') }} {{ d.get('q') }} {{ d.keys()|list }} "
      "{{ d.values()|list }} {{ d|dictsort }} {{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) "
      "}}"
      " {{ [1, 1, 2]|unique|list }} {{ [1, 2]|reverse|list }} {{ ' a\nb'|indent(2) }} "
      "{{ '3'|int + 1 }} {{ n|string + 'x' }} {{ -3|abs }} {{ 'x'|safe }} {{ [1, 0, 2]|select|list "
      "}}",
      "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} "
      "{{ greet('b', '?') }} {{ greet(name='c', punct='.') }}",
      "{% set block %}  inner {{ n }}\n{% endset %}[{{ block }}]{% set a, b = [1, 2] %}{{ a + b }}",
      "{% if n > 5 %}big{% elif n > 2 %}mid{% else %}small{% endif %} {{ 'y' if n else 'n' }}"
      " {{ n if n > 10 }}|{{ messages[0]['content'] | trim + '!' }}",
      "{%- generation -%}  gen {{ n }}  {%- endgeneration -%} after",
      "{{ 'tab\\there' }} {{ '\\u00e9\\x41' }} {{ 'a' 'b' }} {{ (1, 2) }} {{ () }} {{ [] }} {{ {} "
      "}}",
      "{{- bos_token -}}\n{%- for message in messages %}\n    {{- message['role'] + ': ' + "
      "message['content'] | trim }}\n    {%- if not loop.last %}\n\n    {% endif %}\n"
      "{%- endfor %}\n",
      "{{ raise_exception('no: ' ~ n) if n > 100 }}{{ s.find('there') }} {{ 'a-b'.replace('-', '') "
      "}}",
      "A\r\n{% if true %}\r\nB\r\n{% endif %}\r\nC\rD\n",
      "{% for i in range(2) %}{{ '[' ~ loop.index + '] ' }}{% endfor %}{{ 1 ~ 2 * 3 }}",
      "{{ 'こん\u3000'|trim }}|{{ '\u00a0x\u2003'|trim }}|{{ '\u3000y '.strip() }}",
      "{{ ['b', 'B', 'a']|sort }} {{ ['b', 'B', 'a']|sort(reverse=true) }} "
      "{{ ['b', 'B', 'a']|sort(case_sensitive=true) }} {{ ['a', 'A', 'b']|unique|list }} "
      "{{ [{'n': 'x'}, {'n': 'X'}]|unique(attribute='n')|list }} "
      "{{ messages|sort(attribute='role')|map(attribute='role')|join(',') }}",
      "{{ ''|indent(2, true) }}|{{ 'a\r\nb'|indent(2) }}|{{ 'x\ny'|indent(-1) }}|"
      "{{ 'a\n\nb'|indent(2, blank=true) }}|{{ 'a\n\nb\n'|indent(3, first=true) }}",
      "{% for x in [] %}{% else %}{% set y = 1 %}{% endfor %}[{{ y }}]"
      "{% macro m() %}<{{ z }}>{% endmacro %}{% set z = 'top' %}{% for z in [1] %}[{{ m() }}]"
      "{% endfor %}",
      "{{ 2 ** 62 }} {{ 9007199254740993 + 0 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ 2 ** -1 }} "
      "{{ (-2) ** 63 }} {{ 3.7|int }} {{ -3.7|int }} {{ tools is defined }} {{ tools is none }}",
  };
  const ojson variables = {{"messages", conversations()[2]},
                           {"bos_token", "<s>"},
                           {"n", 3},
                           {"f", 2.5},
                           {"none_", nullptr},
                           {"s", " Hi there "},
                           {"d", {{"b", 2}, {"a", 1}}},
                           {"tools", nullptr}};
  std::vector<Job> jobs;
  for (size_t k = 0; k < snippets.size(); ++k) {
    const fs::path file = dir_ / ("snippet" + std::to_string(k) + ".jinja");
    std::ofstream(file, std::ios::binary) << snippets[k];
    jobs.push_back({file, variables});
  }
  std::string why;
  const std::vector<Rendered> want = jinja2(jobs, dir_, why);
  if (want.empty()) GTEST_SKIP() << why;
  for (size_t k = 0; k < jobs.size(); ++k) {
    ASSERT_TRUE(want[k].ok) << "snippet " << k << ": " << want[k].text;
    const Rendered got = kvlab_render(jobs[k].templ, variables);
    ASSERT_TRUE(got.ok) << "snippet " << k << ": " << got.text;
    EXPECT_EQ(got.text, want[k].text) << "snippet " << k << ":\n" << snippets[k];
  }
}

// What the subset lacks is refused when parsed, by name and line; a template that raises gives
// its own message; a runaway one stops.
TEST(ChatTemplate, RefusesByNameAndStopsRunaways) {
  const auto parse_error = [](const std::string& src) {
    return error_of([&] { ChatTemplate t(src, "tmpl"); });
  };
  EXPECT_NE(parse_error("a\n{{ x | wordwrap }}")
                .find("tmpl: line 2: filter 'wordwrap' is not in "
                      "kvlab's Jinja subset"),
            std::string::npos);
  EXPECT_NE(parse_error("{% include 'x' %}").find("the statement 'include' is not in"),
            std::string::npos);
  EXPECT_NE(parse_error("{{ x is prime }}").find("test 'prime' is not in"), std::string::npos);
  EXPECT_NE(parse_error("{% if x %}open").find("ends before 'endif'"), std::string::npos);
  EXPECT_NE(parse_error("{{ x ").find("not closed"), std::string::npos);
  EXPECT_NE(parse_error("{% endfor %}").find("'endfor' without its opening statement"),
            std::string::npos);
  EXPECT_NE(parse_error("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}")
                .find("nested too deep"),
            std::string::npos);

  EXPECT_NE(parse_error("{% if x %}{% break %}{% endif %}").find("'break' outside a for loop"),
            std::string::npos);
  std::string chain = "{{ x";
  for (int k = 0; k < 50000; ++k) chain += " ~ x";
  EXPECT_NE(parse_error(chain + " }}").find("nested too deep"), std::string::npos);
  const auto render_error = [](const std::string& src) {
    return error_of([&] { ChatTemplate(src).render(ojson::object()); });
  };
  EXPECT_NE(render_error("{{ (-4611686018427387904 * 2) // -1 }}").find("overflows"),
            std::string::npos);
  EXPECT_NE(render_error("{{ 9223372036854775807 + 1 }}").find("overflows"), std::string::npos);
  EXPECT_NE(render_error("{% set ns = namespace(v=[]) %}{% for i in range(5000) %}"
                         "{% set ns.v = [ns.v] %}{% endfor %}")
                .find("nest over 256 deep"),
            std::string::npos);
  EXPECT_NE(render_error("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
                .find("over 64 MiB"),
            std::string::npos);
  EXPECT_NE(render_error("{% set ns = namespace() %}{% set ns.me = ns %}").find("a namespace as"),
            std::string::npos);
  EXPECT_NE(render_error("{% for i in range(10000) %}{% set x = range(100000)|join %}{% endfor %}")
                .find("runs too long"),
            std::string::npos);

  const ChatTemplate raises("{{ raise_exception('roles must alternate') }}");
  EXPECT_EQ(error_of([&] { raises.render(ojson::object()); }),
            "chat template: roles must alternate");
  EXPECT_NE(error_of([&] {
              ChatTemplate(
                  "{% for i in range(100000) %}{% for j in range(100000) %}"
                  "{% endfor %}{% endfor %}")
                  .render(ojson::object());
            }).find("runs too long"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { ChatTemplate("{{ x.y }}").render(ojson::object()); }).find("'x' is undefined"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              ChatTemplate("{{ 'a' + 1 }}").render(ojson::object());
            }).find("cannot apply '+' to str and int"),
            std::string::npos);
}

}  // namespace
}  // namespace kvlab
