// Scheduler (infer/scheduler.h): continuous batching gives each request what the engine gives
// it alone, under a token budget and a sequence cap, through chunked prefill and preemption.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "infer/engine.h"
#include "infer/scheduler.h"
#include "infer_test_util.h"
#include "platform/random.h"

namespace kvlab {
namespace {

using test::tiny_model;
using test::tiny_tokenizer;

std::vector<int32_t> random_ids(int64_t n, uint64_t seed) {
  Generator g(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = static_cast<int32_t>(g.below(11));
  return ids;
}

GenerateOptions options(int64_t max_new, double temperature, uint64_t seed) {
  GenerateOptions o;
  o.max_new_tokens = max_new;
  o.sampling.temperature = temperature;
  o.sampling.seed = seed;
  return o;
}

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text;
  bool finished = false;
  StopReason reason = StopReason::MaxNewTokens;
};

// Runs the scheduler until idle; check(stats, decoding before the step) sees every step, and
// on_step(step, events) its events.
std::map<RequestId, Outcome> run(
    Scheduler& s, const std::function<void(const SchedulerStepStats&, int64_t)>& check = {},
    const std::function<void(int, const std::vector<SchedulerEvent>&)>& on_step = {}) {
  std::map<RequestId, Outcome> out;
  int64_t decoding = 0;  // requests that have made a token and not ended
  for (int steps = 0; !s.idle(); ++steps) {
    EXPECT_LT(steps, 10000) << "the scheduler does not drain";
    if (steps >= 10000) break;
    const std::vector<SchedulerEvent> events = s.step();
    if (check) check(s.last_step(), decoding);
    if (on_step) on_step(steps, events);
    for (const SchedulerEvent& e : events) {
      Outcome& o = out[e.request];
      EXPECT_FALSE(o.finished) << "request " << e.request << " went on after it ended";
      if (e.token >= 0) {
        if (o.tokens.empty()) ++decoding;
        o.tokens.push_back(e.token);
      }
      o.text += e.text;
      if (e.finished) {
        o.finished = true;
        o.reason = e.reason;
        if (!o.tokens.empty()) --decoding;
      }
    }
  }
  return out;
}

struct Case {
  std::vector<int32_t> prompt;
  GenerateOptions options;
};

std::vector<Case> cases(double temperature) {
  std::vector<Case> c;
  const int64_t lengths[] = {1, 15, 17, 33, 9, 40, 2};
  for (size_t i = 0; i < std::size(lengths); ++i)
    c.push_back({random_ids(lengths[i], 50 + i),
                 options(static_cast<int64_t>(6 + 3 * i), temperature, 9 + i)});
  c[5].options.max_new_tokens = 100;  // reaches the context (64) first
  return c;
}

// What the engine makes of each request alone (its contiguous cache: another layout, the same
// tokens).
std::vector<GenerationResult> alone(Engine& engine, const std::vector<Case>& cs) {
  std::vector<GenerationResult> r;
  for (const Case& c : cs) r.push_back(engine.generate_ids({c.prompt}, c.options));
  return r;
}

void expect_same(const std::map<RequestId, Outcome>& got, const std::vector<RequestId>& ids,
                 const std::vector<GenerationResult>& want) {
  ASSERT_EQ(got.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const Outcome& o = got.at(ids[i]);
    const RowResult& w = want[i].rows[0];
    EXPECT_TRUE(o.finished) << "request " << i;
    EXPECT_EQ(o.tokens, w.tokens) << "request " << i;
    EXPECT_EQ(o.text, w.text) << "request " << i;
    EXPECT_EQ(o.reason, w.stop_reason) << "request " << i;
  }
}

// The models served: GPT-2's block at n_kv_head 4, 2 and 1, and MLA (its latent rows in the
// paged pool, one per position and layer).
struct Served {
  int64_t n_kv_head;
  const char* arch;
};
constexpr Served kServed[] = {{4, "gpt2"}, {2, "gpt2"}, {1, "gpt2"}, {4, "mla"}};

// Small budgets: prompts of 33 and 40 prefill over several steps, beside other requests'
// decodes; three requests at most are admitted, so the rest wait their turn.
TEST(Scheduler, EachRequestGetsWhatTheEngineGivesItAlone) {
  for (const auto [nkv, arch] : kServed) {
    for (const double temperature : {0.0, 1.0}) {
      SCOPED_TRACE(testing::Message()
                   << arch << " n_kv_head " << nkv << ", temperature " << temperature);
      auto model = tiny_model(nkv, 7, 64, arch);
      const Tokenizer tok = tiny_tokenizer();
      Engine engine(*model, tok, DType::F32, std::nullopt);
      const std::vector<Case> cs = cases(temperature);
      const std::vector<GenerationResult> want = alone(engine, cs);
      Scheduler s(engine, {.max_seqs = 3, .max_batch_tokens = 8, .cache = {.kv_block_size = 8}});
      std::vector<RequestId> ids;
      for (const Case& c : cs) ids.push_back(s.add(c.prompt, c.options));
      int64_t chunked_steps = 0;
      const auto got = run(s, [&](const SchedulerStepStats& st, int64_t decoding) {
        EXPECT_LE(st.decode_rows + st.prefill_tokens, 8);
        EXPECT_LE(st.admitted, 3);
        // Decodes first: every request that had made a token and not ended advanced.
        EXPECT_EQ(st.decode_rows, decoding);
        if (st.decode_rows > 0 && st.prefill_tokens > 0) ++chunked_steps;
      });
      expect_same(got, ids, want);
      EXPECT_GT(chunked_steps, 0) << "no step mixed decodes with a prefill chunk";
      EXPECT_EQ(got.at(ids[5]).reason, StopReason::ContextLimit);
      EXPECT_EQ(s.preemptions(), 0);
      const BlockStats end = s.block_stats();
      EXPECT_EQ(end.in_use, 0);
      EXPECT_EQ(end.free + end.cached, end.total);
    }
  }
}

// The static policy: a batch is admitted only when none runs, its prompts prefill whole in
// that step (a budget of 8 positions does not cut the 33- and 40-token ones), and a request
// added while a batch runs waits for the next; each still makes what it makes alone.
TEST(Scheduler, TheStaticPolicyRunsEachBatchToItsEndBeforeTheNext) {
  for (const double temperature : {0.0, 1.0}) {
    SCOPED_TRACE(testing::Message() << "temperature " << temperature);
    auto model = tiny_model(2, 7, 64, "gpt2");
    const Tokenizer tok = tiny_tokenizer();
    Engine engine(*model, tok, DType::F32, std::nullopt);
    const std::vector<Case> cs = cases(temperature);
    const std::vector<GenerationResult> want = alone(engine, cs);
    Scheduler s(engine, {.policy = BatchPolicy::Static,
                         .max_seqs = 3,
                         .max_batch_tokens = 8,
                         .cache = {.kv_block_size = 8}});
    std::vector<RequestId> ids;
    for (size_t i = 0; i < 2; ++i) ids.push_back(s.add(cs[i].prompt, cs[i].options));
    std::map<RequestId, int> first_step, end_step;
    int64_t most_prefilled = 0;
    const auto got = run(
        s,
        [&](const SchedulerStepStats& st, int64_t) {
          most_prefilled = std::max(most_prefilled, st.prefill_tokens);
          EXPECT_LE(st.admitted, 3);
        },
        [&](int step, const std::vector<SchedulerEvent>& events) {
          if (step == 0)  // the rest arrive while the first batch of two runs
            for (size_t i = 2; i < cs.size(); ++i)
              ids.push_back(s.add(cs[i].prompt, cs[i].options));
          for (const SchedulerEvent& e : events) {
            if (e.token >= 0) first_step.emplace(e.request, step);
            if (e.finished) end_step[e.request] = step;
          }
        });
    expect_same(got, ids, want);
    EXPECT_GE(most_prefilled, 40) << "a batch's prompts were prefilled in chunks";
    // Every request that began before another had ended by the step that one began in.
    for (const auto& [b, fb] : first_step)
      for (const auto& [a, fa] : first_step)
        if (fa < fb) {
          EXPECT_LE(end_step.at(a), fb) << "request " << b << " joined " << a << "'s batch";
        }
    EXPECT_EQ(first_step.at(ids[2]), std::max(end_step.at(ids[0]), end_step.at(ids[1])))
        << "the next batch was not admitted as the first ended";
  }
}

// A pool of the context plus a few blocks cannot hold the running requests' growth: the most
// recently admitted ones are preempted, prefilled again later, and still make what they make
// alone, draws included.
TEST(Scheduler, PreemptionLeavesEveryOutputAsItWas) {
  for (const auto& [nkv, arch, temperature] :
       {std::tuple{2, "gpt2", 0.0}, {2, "gpt2", 1.0}, {4, "mla", 0.0}, {4, "mla", 1.0}}) {
    SCOPED_TRACE(testing::Message() << arch << ", temperature " << temperature);
    auto model = tiny_model(nkv, 7, 64, arch);
    const Tokenizer tok = tiny_tokenizer();
    Engine engine(*model, tok, DType::F32, std::nullopt);
    const std::vector<Case> cs = cases(temperature);
    const std::vector<GenerationResult> want = alone(engine, cs);
    Scheduler s(engine, {.max_seqs = 6,
                         .max_batch_tokens = 32,
                         .cache = {.kv_block_size = 8, .pool_blocks = 11}});
    std::vector<RequestId> ids;
    for (const Case& c : cs) ids.push_back(s.add(c.prompt, c.options));
    expect_same(run(s), ids, want);
    EXPECT_GT(s.preemptions(), 0);
    EXPECT_EQ(s.block_stats().in_use, 0);
  }
}

// The second request with a prompt takes its whole blocks from the first's prefill, and
// greedy, makes the first's tokens.
TEST(Scheduler, ALaterRequestTakesACachedPromptsBlocks) {
  for (const auto [nkv, arch] : {Served{2, "gpt2"}, Served{4, "mla"}}) {
    SCOPED_TRACE(arch);
    auto model = tiny_model(nkv, 7, 64, arch);
    const Tokenizer tok = tiny_tokenizer();
    Engine engine(*model, tok, DType::F32, std::nullopt);
    Scheduler s(engine, {.max_seqs = 4, .max_batch_tokens = 64, .cache = {.kv_block_size = 8}});
    const std::vector<int32_t> prompt = random_ids(30, 3);
    std::map<RequestId, std::vector<int32_t>> made;
    auto keep = [&](const std::vector<SchedulerEvent>& events) {
      for (const SchedulerEvent& e : events)
        if (e.token >= 0) made[e.request].push_back(e.token);
    };
    const RequestId a = s.add(prompt, options(4, 0, 0));
    keep(s.step());  // a's prompt prefilled, its blocks keyed
    const RequestId b = s.add(prompt, options(4, 0, 0));
    keep(s.step());
    EXPECT_EQ(s.last_step().prefill_tokens, 30 - 24);  // 3 whole blocks taken
    EXPECT_EQ(s.block_stats().prefix_hit_positions, 24);
    const auto got = run(s);
    for (const RequestId id : {a, b}) {
      EXPECT_TRUE(got.at(id).finished);
      made[id].insert(made[id].end(), got.at(id).tokens.begin(), got.at(id).tokens.end());
    }
    EXPECT_EQ(made[a].size(), 4u);
    EXPECT_EQ(made[a], made[b]);
    EXPECT_EQ(s.block_stats().in_use, 0);
  }
}

TEST(Scheduler, AnAbortedRequestEndsAndGivesItsBlocksBack) {
  auto model = tiny_model(2, 7, 64);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok, DType::F32, std::nullopt);
  Scheduler s(engine, {.max_seqs = 4, .max_batch_tokens = 64, .cache = {.kv_block_size = 8}});
  const RequestId a = s.add(random_ids(20, 1), options(40, 0, 0));
  const RequestId b = s.add(random_ids(20, 2), options(40, 0, 0));
  s.step();
  s.step();
  EXPECT_GT(s.block_stats().in_use, 0);
  s.abort(a);
  const std::vector<SchedulerEvent> events = s.step();
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front().request, a);
  EXPECT_TRUE(events.front().finished);
  EXPECT_EQ(events.front().token, -1);
  s.abort(b);
  s.abort(b);  // already ended: nothing happens
  s.step();
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(s.block_stats().in_use, 0);
}

TEST(Scheduler, BadOptionsAndRequestsAreClearErrors) {
  auto model = tiny_model(2, 7, 64);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok, DType::F32, std::nullopt);
  auto error_of = [](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of([&] { Scheduler(engine, {.max_seqs = 0, .cache = {}}); }).find("max_seqs must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Scheduler(engine, {.max_seqs = 8, .max_batch_tokens = 4, .cache = {}}); })
                .find("max_batch_tokens (4) must be at least max_seqs (8)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              Scheduler(engine, {.cache = {.kv_block_size = 8, .pool_blocks = 7}});
            }).find("cannot hold one sequence of 64 positions, which takes 8 blocks of 8"),
            std::string::npos);
  Scheduler s(engine, {});
  GenerateOptions two = options(4, 0, 0);
  two.n = 2;
  EXPECT_NE(error_of([&] { s.add(random_ids(3, 1), two); }).find("one sequence"),
            std::string::npos);
  EXPECT_NE(error_of([&] { s.add({}, options(4, 0, 0)); }).find("is empty"), std::string::npos);
  EXPECT_TRUE(s.idle());
}

// A token of the tokenizer's end-of-generation set ends a sample where it is made, in the
// engine (contiguous and paged) and the scheduler alike: the token is the last of its tokens,
// its text is not part of the text, and the reason says so; with ignore_eos it goes on as if
// the set were empty. A tokenizer that asks for BOS has a prompt's text begin with it.
TEST(Scheduler, AnEndOfGenerationTokenEndsASampleAsTheEngineEndsIt) {
  auto model = tiny_model(2, 7, 64, "gpt2");
  const Tokenizer plain = tiny_tokenizer();
  const std::vector<int32_t> prompt = random_ids(9, 3);
  GenerateOptions o = options(16, 0.0, 0);
  Engine free_running(*model, plain, DType::F32, std::nullopt);
  const std::vector<int32_t> all = free_running.generate_ids({prompt}, o).rows[0].tokens;
  // The first token made that was not made before it: the sample must end right there.
  size_t k = 1;
  while (k < all.size() && std::count(all.begin(), all.begin() + k, all[k]) > 0) ++k;
  ASSERT_LT(k, all.size()) << "the greedy sample repeats one token";
  Tokenizer ending = plain;
  ending.set_controls(
      {.bos = 3, .eos = all[k], .add_bos = true, .user_defined = {}, .eog = {all[k]}});
  const std::vector<int32_t> want(all.begin(), all.begin() + static_cast<int64_t>(k) + 1);
  const std::string text = plain.decode({all.data(), k});
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    Engine engine(*model, ending, DType::F32,
                  paged ? std::optional<PagedCacheOptions>(PagedCacheOptions{}) : std::nullopt);
    const RowResult r = engine.generate_ids({prompt}, o).rows[0];
    EXPECT_EQ(r.tokens, want);
    EXPECT_EQ(r.text, text);
    EXPECT_EQ(r.stop_reason, StopReason::EndOfGeneration);
    GenerateOptions ignoring = o;
    ignoring.ignore_eos = true;
    EXPECT_EQ(engine.generate_ids({prompt}, ignoring).rows[0].tokens, all);
    std::vector<int32_t> with_bos = plain.encode("abc");
    with_bos.insert(with_bos.begin(), 3);
    EXPECT_EQ(engine.encode("abc"), with_bos);
  }
  Engine engine(*model, ending, DType::F32, std::nullopt);
  Scheduler s(engine, {.max_seqs = 2, .cache = {.kv_block_size = 8}});
  const RequestId id = s.add(prompt, o);
  const auto got = run(s);
  EXPECT_EQ(got.at(id).tokens, want);
  EXPECT_EQ(got.at(id).text, text);
  EXPECT_EQ(got.at(id).reason, StopReason::EndOfGeneration);
  // Controls that name ids outside the vocabulary, or an EOS that does not end, are refused.
  Tokenizer t = plain;
  EXPECT_THROW(t.set_controls({.bos = 11, .user_defined = {}, .eog = {}}), Error);
  EXPECT_THROW(t.set_controls({.user_defined = {}, .eog = {4, 2}}), Error);
  EXPECT_THROW(t.set_controls({.eos = 2, .user_defined = {}, .eog = {4}}), Error);
  EXPECT_THROW(t.set_controls({.add_bos = true, .user_defined = {}, .eog = {}}), Error);
}

}  // namespace
}  // namespace kvlab
