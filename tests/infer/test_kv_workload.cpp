#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "infer/measure/kv_workload.h"
#include "platform/error.h"

namespace kvlab {
namespace {

KVWorkloadOptions workload(int64_t requests, int64_t context, int64_t samples = 1,
                           int64_t system_prompt = 0, uint64_t seed = 0) {
  KVWorkloadOptions o;
  o.requests = requests;
  o.context = context;
  o.samples = samples;
  o.system_prompt = system_prompt;
  o.seed = seed;
  return o;
}

// A budget counted in positions (one byte each).
KVSimOptions budget(int64_t positions, int64_t context, int64_t block_size = 16,
                    bool prefix_caching = false) {
  KVSimOptions o;
  o.budget_bytes = positions;
  o.bytes_per_position = 1;
  o.context = context;
  o.kv_block_size = block_size;
  o.prefix_caching = prefix_caching;
  return o;
}

template <class F>
void expect_error_naming(F&& f, const std::string& value) {
  try {
    f();
    ADD_FAILURE() << "no kvlab::Error naming " << value;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(value), std::string::npos) << e.what();
  }
}

double median(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[v.size() / 2]);
}

double mean(const std::vector<int64_t>& v) {
  return static_cast<double>(std::accumulate(v.begin(), v.end(), int64_t{0})) /
         static_cast<double>(v.size());
}

TEST(KVWorkload, IsDeterministicPerSeed) {
  const auto a = make_kv_workload(workload(64, 256, 2, 10, 7));
  const auto b = make_kv_workload(workload(64, 256, 2, 10, 7));
  const auto c = make_kv_workload(workload(64, 256, 2, 10, 8));
  ASSERT_EQ(a.size(), 64u);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_EQ(a[i].output_tokens, b[i].output_tokens);
    EXPECT_EQ(a[i].samples, 2);
    differs |= a[i].prompt != c[i].prompt || a[i].output_tokens != c[i].output_tokens;
  }
  EXPECT_TRUE(differs);
}

TEST(KVWorkload, LengthsAreBoundedLogNormalAndLongTailed) {
  const int64_t ctx = 1024;
  const auto reqs = make_kv_workload(workload(4000, ctx));
  std::vector<int64_t> prompts, outputs;
  int64_t longest = 0;
  for (const KVRequest& q : reqs) {
    const auto p = static_cast<int64_t>(q.prompt.size());
    ASSERT_GE(p, 1);
    ASSERT_GE(q.output_tokens, 1);
    ASSERT_LE(p + q.output_tokens, ctx);
    for (const int32_t t : q.prompt) ASSERT_TRUE(t >= 0 && t < 65) << t;
    prompts.push_back(p);
    outputs.push_back(q.output_tokens);
    longest = std::max(longest, p + q.output_tokens);
  }
  // Medians exp(mu) = context / 8 and / 6 (clipping moves only the tail); the long right tail
  // pulls the means above them and reaches the context.
  EXPECT_NEAR(median(prompts), ctx / 8.0, 0.15 * ctx / 8.0);
  EXPECT_NEAR(median(outputs), ctx / 6.0, 0.15 * ctx / 6.0);
  EXPECT_GT(mean(prompts), 1.2 * median(prompts));
  EXPECT_GT(mean(outputs), 1.2 * median(outputs));
  EXPECT_EQ(longest, ctx);
  EXPECT_EQ(*std::max_element(prompts.begin(), prompts.end()), ctx - 1);
}

TEST(KVWorkload, EveryPromptStartsWithTheSameSystemPrompt) {
  const int64_t ctx = 256, sys = 100;
  const auto reqs = make_kv_workload(workload(200, ctx, 1, sys));
  const std::vector<int32_t> first(reqs[0].prompt.begin(), reqs[0].prompt.begin() + sys);
  for (const KVRequest& q : reqs) {
    ASSERT_GE(static_cast<int64_t>(q.prompt.size()), sys + 1);
    EXPECT_TRUE(std::equal(first.begin(), first.end(), q.prompt.begin()));
    EXPECT_LE(static_cast<int64_t>(q.prompt.size()) + q.output_tokens, ctx);
  }
}

// A shared fraction of 0.25: about a quarter of the prompts start with the system prompt; the
// others hold their user tokens alone (and never the whole system prompt by chance).
TEST(KVWorkload, ASharedFractionOfThePromptsStartWithTheSystemPrompt) {
  const int64_t ctx = 256, sys = 100;
  KVWorkloadOptions o = workload(400, ctx, 1, sys);
  const auto all = make_kv_workload(o);
  const std::vector<int32_t> system(all[0].prompt.begin(), all[0].prompt.begin() + sys);
  o.shared_fraction = 0.25;
  int64_t shared = 0;
  for (const KVRequest& q : make_kv_workload(o)) {
    const bool starts = static_cast<int64_t>(q.prompt.size()) > sys &&
                        std::equal(system.begin(), system.end(), q.prompt.begin());
    shared += starts;
    if (!starts) {
      EXPECT_LE(static_cast<int64_t>(q.prompt.size()), ctx - sys - 1);
    }
  }
  EXPECT_NEAR(static_cast<double>(shared) / 400, 0.25, 0.07);  // binomial sd 0.022
}

TEST(KVWorkload, BadOptionsThrowNamingTheValue) {
  auto bad = [](auto edit, const std::string& value) {
    KVWorkloadOptions o = workload(8, 64);
    edit(o);
    expect_error_naming([&] { make_kv_workload(o); }, value);
  };
  bad([](KVWorkloadOptions& o) { o.requests = 0; }, "not 0");
  bad([](KVWorkloadOptions& o) { o.context = 1; }, "not 1");
  bad([](KVWorkloadOptions& o) { o.samples = -2; }, "not -2");
  bad([](KVWorkloadOptions& o) { o.system_prompt = 63; }, "not 63");
  bad([](KVWorkloadOptions& o) { o.system_prompt = -1; }, "not -1");
  bad([](KVWorkloadOptions& o) { o.vocab_size = 0; }, "not 0");
  bad([](KVWorkloadOptions& o) { o.shared_fraction = 1.5; }, "not 1.5");
}

TEST(KVWorkload, BadSimulationOptionsAndRequestsThrow) {
  const auto reqs = make_kv_workload(workload(8, 64, 2));
  auto sim = [&](const KVSimOptions& o, KVLayout layout) {
    return [&reqs, o, layout] { simulate_kv_cache(reqs, layout, o); };
  };
  KVSimOptions o = budget(4096, 64);
  o.budget_bytes = 0;
  expect_error_naming(sim(o, KVLayout::Paged), "not 0 bytes");
  o = budget(4096, 64);
  o.bytes_per_position = -3;
  expect_error_naming(sim(o, KVLayout::Contiguous), "not -3");
  expect_error_naming(sim(budget(4096, 64, 24), KVLayout::Paged), "not 24");
  expect_error_naming(sim(budget(4096, 1), KVLayout::Paged), "not 1");
  // Less than a block or a slot.
  expect_error_naming(sim(budget(15, 64), KVLayout::Paged), "budget of 15 bytes");
  expect_error_naming(sim(budget(63, 64), KVLayout::Contiguous), "budget of 63 bytes");
  // Two samples need two slots; a pool of one block is too small for any request.
  expect_error_naming(sim(budget(64, 64), KVLayout::Contiguous), "holds 1 contiguous slots");
  expect_error_naming(sim(budget(16, 64), KVLayout::Paged), "the pool has 1");

  expect_error_naming([] { simulate_kv_cache({}, KVLayout::Paged, budget(4096, 64)); },
                      "no requests");
  std::vector<KVRequest> malformed = {{{1, 2, 3}, 62, 1}};
  expect_error_naming([&] { simulate_kv_cache(malformed, KVLayout::Paged, budget(4096, 64)); },
                      "62 output");
  malformed = {{{}, 4, 1}};
  expect_error_naming([&] { simulate_kv_cache(malformed, KVLayout::Contiguous, budget(4096, 64)); },
                      "prompt of 0");
}

// At every step, the positions held but not stored are exactly the unwritten ends of the
// sequences' last blocks, a block shared by forks counted once: every other block in use is
// full. So the waste is below one block per resident sequence.
KVSimResult expect_waste_only_in_last_blocks(const std::vector<KVRequest>& reqs,
                                             const KVSimOptions& o) {
  int64_t checked = 0;
  const KVSimResult res = simulate_kv_cache(reqs, KVLayout::Paged, o, [&](const KVStep& st) {
    ASSERT_NE(st.blocks, nullptr);
    const BlockManager& m = *st.blocks;
    const int64_t bs = m.block_size();
    std::set<BlockId> tails;
    int64_t unwritten = 0;
    const std::vector<SeqId> seqs = m.sequences();
    ASSERT_EQ(static_cast<int64_t>(seqs.size()), st.resident);
    for (const SeqId id : seqs) {
      const int64_t len = m.length(id);
      ASSERT_EQ(static_cast<int64_t>(m.table(id).size()), (len + bs - 1) / bs);
      if (len % bs != 0 && tails.insert(m.table(id).back()).second) unwritten += bs - len % bs;
    }
    ASSERT_EQ(st.positions_held, m.stats().in_use * bs);
    ASSERT_EQ(st.positions_held - st.positions_stored, unwritten) << "step " << st.step;
    ASSERT_LT(st.positions_held - st.positions_stored, st.resident * bs);
    ++checked;
  });
  EXPECT_EQ(checked, res.steps);
  EXPECT_GT(res.utilisation_min, 0.0);
  EXPECT_LE(res.peak_positions_held, o.blocks() * o.kv_block_size);
  return res;
}

TEST(KVWorkload, PagedWasteIsOnlyTheLastPartBlocks) {
  const int64_t ctx = 128;
  // Ample and tight pools (the tight ones preempt), one sample and four, prefix caching on
  // with a shared system prompt and off.
  for (const int64_t samples : {1, 4})
    for (const bool prefix : {false, true})
      for (const int64_t positions : {1 << 14, 16 * 48}) {
        SCOPED_TRACE(testing::Message() << "samples " << samples << " prefix " << prefix
                                        << " positions " << positions);
        const auto reqs = make_kv_workload(workload(64, ctx, samples, prefix ? 40 : 0, 3));
        const KVSimResult res =
            expect_waste_only_in_last_blocks(reqs, budget(positions, ctx, 16, prefix));
        EXPECT_EQ(res.preemptions > 0, positions < (1 << 14));
      }
}

TEST(KVWorkload, ContiguousHoldsAWholeContextPerSample) {
  const int64_t ctx = 128;
  const auto reqs = make_kv_workload(workload(64, ctx, 2));
  const KVSimResult res =
      simulate_kv_cache(reqs, KVLayout::Contiguous, budget(8 * ctx, ctx), [&](const KVStep& st) {
        EXPECT_EQ(st.blocks, nullptr);
        EXPECT_EQ(st.positions_held, st.resident * ctx);
        EXPECT_LE(st.resident, 8);
        EXPECT_LE(st.positions_stored, st.resident * (ctx - 1));
      });
  EXPECT_EQ(res.preemptions, 0);
  EXPECT_EQ(res.peak_bytes, res.peak_positions_held);
  // Each sample holds its own copy of the prompt.
  EXPECT_EQ(res.prompt_positions_stored, 2 * res.prompt_positions);
}

TEST(KVWorkload, EveryBlockIsFreeOrCachedWhenAllRequestsEnd) {
  const int64_t ctx = 128;
  for (const bool prefix : {false, true}) {
    const auto reqs = make_kv_workload(workload(64, ctx, 3, 40, 5));
    const KVSimOptions o = budget(16 * 64, ctx, 16, prefix);
    const BlockStats end = simulate_kv_cache(reqs, KVLayout::Paged, o).blocks_at_end;
    EXPECT_EQ(end.total, o.blocks());
    EXPECT_EQ(end.in_use, 0);
    EXPECT_EQ(end.positions, 0);
    EXPECT_EQ(end.free + end.cached, end.total);
    if (!prefix) {
      EXPECT_EQ(end.cached, 0);
    }
  }
}

TEST(KVWorkload, PagedHoldsMoreSequencesThanContiguousInTheSameMemory) {
  const int64_t ctx = 256;
  for (const int64_t samples : {1, 4}) {
    const auto reqs = make_kv_workload(workload(128, ctx, samples, 0, 11));
    KVSimOptions o = budget(16 * ctx, ctx);
    o.bytes_per_position = 3;
    o.budget_bytes *= 3;
    const KVLayoutComparison c = compare_kv_layouts(reqs, o);
    EXPECT_EQ(c.slots, 16);
    EXPECT_EQ(c.blocks, 16 * ctx / 16);
    EXPECT_GE(c.paged.peak_resident, c.contiguous.peak_resident);
    EXPECT_GT(c.paged.mean_resident, c.contiguous.mean_resident);
    EXPECT_GT(c.paged.utilisation_mean, c.contiguous.utilisation_mean);
    EXPECT_LE(c.contiguous.peak_resident, c.slots);
    EXPECT_LE(c.paged.peak_bytes, o.budget_bytes);
    EXPECT_LE(c.contiguous.peak_bytes, o.budget_bytes);
    EXPECT_EQ(c.paged.peak_bytes, 3 * c.paged.peak_positions_held);
    // The same inputs give the same run.
    const KVSimResult again = simulate_kv_cache(reqs, KVLayout::Paged, o);
    EXPECT_EQ(again.steps, c.paged.steps);
    EXPECT_EQ(again.utilisation_mean, c.paged.utilisation_mean);
    EXPECT_EQ(again.preemptions, c.paged.preemptions);
  }
}

TEST(KVWorkload, ForkedSamplesHoldThePromptsFullBlocksOnce) {
  // A prompt of two full blocks and 8 positions, four samples of 5 tokens.
  std::vector<int32_t> prompt(40);
  std::iota(prompt.begin(), prompt.end(), 0);
  const std::vector<KVRequest> one = {{prompt, 5, 4}};
  std::vector<int64_t> in_use, stored;
  simulate_kv_cache(one, KVLayout::Paged, budget(16 * 32, 64), [&](const KVStep& st) {
    EXPECT_EQ(st.resident, 4);
    const BlockManager& m = *st.blocks;
    for (const SeqId id : m.sequences())
      for (size_t b = 0; b < 2; ++b) EXPECT_EQ(m.table(id)[b], m.table(m.sequences()[0])[b]);
    in_use.push_back(m.stats().in_use);
    stored.push_back(st.positions_stored);
  });
  // Step 0: the prompt once (3 blocks). Then each sample has its own last block (three copies
  // of the shared part block, the fourth keeps it) and the two full blocks stay shared.
  EXPECT_EQ(in_use, (std::vector<int64_t>{3, 6, 6, 6, 6}));
  EXPECT_EQ(stored, (std::vector<int64_t>{40, 32 + 4 * 9, 32 + 4 * 10, 32 + 4 * 11, 32 + 4 * 12}));

  // Over a workload: the positions stored grow by each prompt once, not once per sample.
  const auto reqs = make_kv_workload(workload(64, 128, 4, 0, 2));
  const KVLayoutComparison c = compare_kv_layouts(reqs, budget(16 * 128, 128));
  EXPECT_EQ(c.paged.prompt_positions_stored, c.paged.prompt_positions);
  EXPECT_EQ(c.contiguous.prompt_positions_stored, 4 * c.contiguous.prompt_positions);
}

TEST(KVWorkload, PrefixCachingSkipsTheSharedSystemPromptsFullBlocks) {
  const int64_t ctx = 256, sys = 100, n = 64;
  const auto reqs = make_kv_workload(workload(n, ctx, 1, sys, 4));
  // Room for every request at once: no preemption, the same admissions either way.
  const KVSimResult off = simulate_kv_cache(reqs, KVLayout::Paged, budget(n * ctx, ctx, 16, false));
  const KVSimResult on = simulate_kv_cache(reqs, KVLayout::Paged, budget(n * ctx, ctx, 16, true));
  ASSERT_EQ(off.preemptions, 0);
  ASSERT_EQ(on.preemptions, 0);
  int64_t prompts = 0;
  for (const KVRequest& q : reqs) prompts += static_cast<int64_t>(q.prompt.size());
  EXPECT_EQ(off.prefill_positions, prompts);
  EXPECT_EQ(off.prefix_hit_positions, 0);
  // Every request after the first takes the system prompt's 6 full blocks.
  const int64_t saved = (n - 1) * (sys / 16) * 16;
  EXPECT_EQ(on.prefix_hit_positions, saved);
  EXPECT_EQ(off.prefill_positions - on.prefill_positions, saved);
  // Held once while its holders overlap.
  EXPECT_EQ(on.prompt_positions_stored, on.prompt_positions - saved);
}

TEST(KVWorkload, ATightPoolPreemptsAndStillDrains) {
  const int64_t ctx = 128;
  for (const bool prefix : {false, true}) {
    const auto reqs = make_kv_workload(workload(96, ctx, 2, prefix ? 32 : 0, 9));
    const KVSimOptions o = budget(16 * 24, ctx, 16, prefix);
    const KVSimResult tight = simulate_kv_cache(reqs, KVLayout::Paged, o);
    const KVSimResult ample = simulate_kv_cache(reqs, KVLayout::Paged, budget(1 << 16, ctx));
    EXPECT_GT(tight.preemptions, 0);
    EXPECT_EQ(ample.preemptions, 0);
    EXPECT_GT(tight.steps, ample.steps);
    // Preempted requests are prefilled again, with the tokens they had made.
    EXPECT_GT(tight.prefill_positions + tight.prefix_hit_positions, ample.prefill_positions);
    EXPECT_EQ(tight.blocks_at_end.in_use, 0);
    EXPECT_EQ(tight.blocks_at_end.free + tight.blocks_at_end.cached, o.blocks());
  }
}

TEST(KVWorkload, EverySampleReachesItsFullLengthDespitePreemption) {
  const int64_t ctx = 128;
  const auto reqs = make_kv_workload(workload(96, ctx, 2, 0, 9));
  std::vector<int64_t> longest(2 * reqs.size(), 0);  // per sequence r * 2 + s
  const KVSimResult res =
      simulate_kv_cache(reqs, KVLayout::Paged, budget(16 * 24, ctx), [&](const KVStep& st) {
        for (const SeqId id : st.blocks->sequences())
          longest[static_cast<size_t>(id)] =
              std::max(longest[static_cast<size_t>(id)], st.blocks->length(id));
      });
  EXPECT_GT(res.preemptions, 0);
  for (size_t r = 0; r < reqs.size(); ++r)
    for (size_t s = 0; s < 2; ++s)
      EXPECT_EQ(longest[2 * r + s],
                static_cast<int64_t>(reqs[r].prompt.size()) + reqs[r].output_tokens - 1)
          << "request " << r << " sample " << s;
}

// Preemption reaching a request admitted this step whose one output token the prefill made
// ends it rather than queueing it again (found with blocks of one position over a small
// vocabulary, where prefixes are shared and the pool is tight).
TEST(KVWorkload, PreemptionEndsARequestThatHasMadeAllItsTokens) {
  for (const int64_t bs : {1, 2, 4}) {
    SCOPED_TRACE(bs);
    const std::vector<KVRequest> reqs = make_kv_workload({.context = 16, .vocab_size = 5});
    KVSimOptions o;
    o.budget_bytes = 256;
    o.bytes_per_position = 1;
    o.context = 16;
    o.kv_block_size = bs;
    const KVSimResult res = simulate_kv_cache(reqs, KVLayout::Paged, o);
    EXPECT_GT(res.preemptions, 0);
    EXPECT_EQ(res.blocks_at_end.in_use, 0);
  }
}

}  // namespace
}  // namespace kvlab
