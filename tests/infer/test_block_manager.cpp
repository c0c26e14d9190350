#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "infer/block_manager.h"
#include "platform/error.h"

namespace kvlab {
namespace {

constexpr int64_t kBS = 16;

std::vector<int32_t> iota_tokens(int64_t n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + static_cast<int32_t>(i);
  return t;
}

// Adds `id`, takes what the prefix cache has of `tokens`, and stores the rest.
int64_t add_prompt(BlockManager& m, SeqId id, const std::vector<int32_t>& tokens) {
  m.add(id);
  const int64_t taken = m.take_prefix(id, tokens);
  const int64_t rest = static_cast<int64_t>(tokens.size()) - taken;
  EXPECT_TRUE(m.reserve(id, rest).has_value());
  m.commit(id, std::span(tokens).subspan(static_cast<size_t>(taken)));
  return taken;
}

TEST(BlockManager, TablesGrowByWholeBlocks) {
  BlockManager m(8, kBS, 1, true);
  m.add(0);
  ASSERT_TRUE(m.reserve(0, 20).has_value());
  EXPECT_EQ(m.table(0).size(), 2u);
  m.commit(0, iota_tokens(20, 0));
  EXPECT_EQ(m.length(0), 20);
  const BlockStats st = m.stats();
  EXPECT_EQ(st.in_use, 2);
  EXPECT_EQ(st.free, 6);
  EXPECT_EQ(st.positions, 20);
  // Room for 12 more fits the partly filled block: no new block.
  ASSERT_TRUE(m.reserve(0, 12).has_value());
  EXPECT_EQ(m.table(0).size(), 2u);
  EXPECT_EQ(m.blocks_needed(0, 13), 1);
}

TEST(BlockManager, ForkSharesBlocksAndCopiesOnlyASharedPartBlockOnWrite) {
  BlockManager m(8, kBS, 1, true);
  add_prompt(m, 0, iota_tokens(20, 0));  // a full block and 4 positions of the next
  m.fork(0, 1);
  EXPECT_EQ(m.table(1), m.table(0));
  for (const BlockId b : m.table(0)) EXPECT_EQ(m.ref_count(b), 2);
  EXPECT_EQ(m.stats().in_use, 2);  // the sample holds nothing of its own yet

  const BlockId shared_part = m.table(0)[1];
  EXPECT_EQ(m.blocks_needed(1, 1), 1);  // the copy
  const auto copies = m.reserve(1, 1);
  ASSERT_TRUE(copies.has_value());
  ASSERT_EQ(copies->size(), 1u);
  EXPECT_EQ((*copies)[0].src, shared_part);
  EXPECT_EQ((*copies)[0].dst, m.table(1)[1]);
  EXPECT_EQ((*copies)[0].positions, 4);
  EXPECT_NE(m.table(1)[1], shared_part);
  EXPECT_EQ(m.table(1)[0], m.table(0)[0]);  // the full block stays shared
  EXPECT_EQ(m.ref_count(shared_part), 1);
  // The parent's block is its own again: no copy for it.
  const auto parent_copies = m.reserve(0, 1);
  ASSERT_TRUE(parent_copies.has_value());
  EXPECT_TRUE(parent_copies->empty());
}

// Forks decoding together need one copy fewer than the sum of their own needs: the last of
// them to reserve finds the shared block its own. With a pool of exactly that, both fit.
TEST(BlockManager, ForksReservingTogetherCountTheSharedBlockOnce) {
  BlockManager m(3, kBS, 1, true);
  add_prompt(m, 0, iota_tokens(4, 0));  // one part-filled block
  m.fork(0, 1);
  m.fork(0, 2);
  const std::vector<SeqId> all = {0, 1, 2}, two = {1, 2};
  EXPECT_EQ(m.blocks_needed(all, 1), 2);  // three holders, two copies
  EXPECT_EQ(m.blocks_needed(two, 1), 2);  // a holder outside: both copy
  for (const SeqId id : all) ASSERT_TRUE(m.reserve(id, 1).has_value()) << "sequence " << id;
  EXPECT_EQ(m.stats().free, 0);
  EXPECT_NE(m.table(0)[0], m.table(1)[0]);
  EXPECT_NE(m.table(1)[0], m.table(2)[0]);
  EXPECT_NE(m.table(0)[0], m.table(2)[0]);
}

TEST(BlockManager, AForkOfWholeBlocksCopiesNothing) {
  BlockManager m(8, kBS, 1, true);
  add_prompt(m, 0, iota_tokens(32, 0));
  m.fork(0, 1);
  const auto copies = m.reserve(1, 1);
  ASSERT_TRUE(copies.has_value());
  EXPECT_TRUE(copies->empty());
  EXPECT_EQ(m.table(1).size(), 3u);
  EXPECT_EQ(m.ref_count(m.table(1)[2]), 1);
}

TEST(BlockManager, PrefixCacheTakesWholeMatchingBlocksAndLeavesTheLastToken) {
  BlockManager m(8, kBS, 1, true);
  const std::vector<int32_t> prompt = iota_tokens(40, 100);
  EXPECT_EQ(add_prompt(m, 0, prompt), 0);
  m.free(0);
  EXPECT_EQ(m.stats().cached, 2);  // its two full blocks; the partial one is free
  EXPECT_EQ(m.stats().in_use, 0);

  EXPECT_EQ(add_prompt(m, 1, prompt), 32);
  EXPECT_EQ(m.stats().prefix_hit_positions, 32);
  EXPECT_EQ(m.stats().cached, 0);
  // An in-use block is shared as well, and a prompt of exactly 32 tokens takes one block:
  // its last token is computed.
  EXPECT_EQ(add_prompt(m, 2, iota_tokens(32, 100)), 16);
  EXPECT_EQ(m.ref_count(m.table(1)[0]), 2);
  // A different first block: its second block is not reused either (the key is chained).
  std::vector<int32_t> other = prompt;
  other[3] = 7;
  EXPECT_EQ(add_prompt(m, 3, other), 0);
}

TEST(BlockManager, DifferentModelsDoNotShareKeys) {
  // The same tokens under another model key are another chain: nothing to compare but the
  // keys, so check that the first block's keys differ through a hit that must not happen.
  BlockManager a(4, kBS, 1, true), b(4, kBS, 2, true);
  add_prompt(a, 0, iota_tokens(17, 0));
  add_prompt(b, 0, iota_tokens(17, 0));
  a.free(0);
  b.free(0);
  EXPECT_EQ(add_prompt(a, 1, iota_tokens(17, 0)), 16);
  EXPECT_EQ(add_prompt(b, 1, iota_tokens(17, 0)), 16);
}

TEST(BlockManager, CachedBlocksAreReclaimedLeastRecentlyReleasedFirst) {
  BlockManager m(4, kBS, 1, true);
  for (SeqId id = 0; id < 3; ++id) add_prompt(m, id, iota_tokens(kBS, 1000 * (id + 1)));
  for (SeqId id = 0; id < 3; ++id) m.free(id);  // released 0, 1, 2
  EXPECT_EQ(m.stats().cached, 3);
  EXPECT_EQ(m.stats().free, 1);
  m.add(9);
  ASSERT_TRUE(m.reserve(9, 2 * kBS).has_value());  // the free block, then sequence 0's
  EXPECT_EQ(m.stats().evicted, 1);
  m.add(10);
  EXPECT_EQ(m.take_prefix(10, iota_tokens(kBS + 1, 1000)), 0);  // sequence 0's is gone
  m.add(11);
  EXPECT_EQ(m.take_prefix(11, iota_tokens(kBS + 1, 2000)), kBS);  // sequence 1's is kept
}

TEST(BlockManager, OutOfBlocksIsReportedAndChangesNothing) {
  BlockManager m(2, kBS, 1, true);
  m.add(0);
  EXPECT_FALSE(m.reserve(0, 2 * kBS + 1).has_value());
  EXPECT_TRUE(m.table(0).empty());
  EXPECT_EQ(m.stats().free, 2);
  ASSERT_TRUE(m.reserve(0, 2 * kBS).has_value());
  m.add(1);
  EXPECT_FALSE(m.reserve(1, 1).has_value());
  EXPECT_EQ(m.blocks_available(), 0);
}

// A slide drops whole blocks from the front: they lose a holder (a fork keeps them), the
// sequence goes on from the next, and what it fills from then on is not offered to prompts.
TEST(BlockManager, DropFrontReleasesWholeBlocksAndStopsKeying) {
  BlockManager m(8, kBS, 1, true);
  const std::vector<int32_t> prompt = iota_tokens(40, 100);
  add_prompt(m, 0, prompt);
  m.fork(0, 1);
  const std::vector<BlockId> before = m.table(0);
  m.drop_front(0, 2);
  EXPECT_EQ(m.length(0), 8);
  EXPECT_EQ(m.offset(0), 32);
  EXPECT_EQ(m.table(0), std::vector<BlockId>{before[2]});
  EXPECT_EQ(m.ref_count(before[0]), 1);  // still the fork's
  EXPECT_EQ(m.offset(1), 0);
  EXPECT_THROW(m.drop_front(0, 1), Error);  // 8 positions: no whole block
  EXPECT_THROW(m.drop_front(0, 0), Error);
  // Filling on: the block it fills is not keyed, while the prompt's first blocks stay cached.
  const std::vector<int32_t> more = iota_tokens(8, 140);
  ASSERT_TRUE(m.reserve(0, 8).has_value());  // copies the shared partly filled block
  m.commit(0, more);
  EXPECT_EQ(m.length(0), 16);
  m.free(0);
  m.free(1);
  EXPECT_EQ(m.stats().cached, 2);
  std::vector<int32_t> longer = prompt;
  longer.insert(longer.end(), more.begin(), more.end());
  longer.push_back(1);
  EXPECT_EQ(add_prompt(m, 2, longer), 32);
}

TEST(BlockManager, BadInputIsAClearError) {
  EXPECT_THROW(BlockManager(8, 12, 1, true), Error);  // not a power of two
  EXPECT_THROW(BlockManager(0, kBS, 1, true), Error);
  BlockManager m(4, kBS, 1, true);
  m.add(0);
  EXPECT_THROW(m.add(0), Error);
  EXPECT_THROW(m.fork(5, 6), Error);
  EXPECT_THROW(m.free(5), Error);
  EXPECT_THROW(m.commit(0, iota_tokens(1, 0)), Error);  // nothing reserved
  ASSERT_TRUE(m.reserve(0, 3).has_value());
  EXPECT_THROW(m.commit(0, iota_tokens(kBS + 1, 0)), Error);  // past the room reserved
  EXPECT_THROW(m.take_prefix(0, iota_tokens(3, 0)), Error);   // the sequence holds blocks
  try {
    BlockManager(8, 24, 1, true);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("24"), std::string::npos) << e.what();
  }
}

// Thousands of random adds (taking cached prefixes), forks, appends and frees. The test keeps
// its own copy of each block's positions (what the cache's memory would hold: written by
// commits, copied by the copies reserve hands out) and of each sequence's tokens, and checks
// after every operation that every sequence reads its own tokens through its table, that
// reference counts equal table references, and that each block is exactly one of free, in
// use or cached.
void random_operations(bool prefix_caching, uint32_t seed) {
  constexpr int64_t kBlocks = 48;
  BlockManager m(kBlocks, kBS, 7, prefix_caching);
  std::vector<std::vector<int32_t>> memory(kBlocks, std::vector<int32_t>(kBS, -1));
  std::map<SeqId, std::vector<int32_t>> tokens;
  std::mt19937 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
  // Prompts share one of a few beginnings, so prefixes repeat.
  const std::vector<std::vector<int32_t>> stems = {iota_tokens(40, 0), iota_tokens(23, 500),
                                                    iota_tokens(64, 900)};
  SeqId next = 0;

  auto write = [&](SeqId id, const std::vector<int32_t>& add) {
    const auto copies = m.reserve(id, static_cast<int64_t>(add.size()));
    if (!copies) return false;
    for (const BlockCopy& c : *copies)
      for (int64_t p = 0; p < c.positions; ++p)
        memory[static_cast<size_t>(c.dst)][static_cast<size_t>(p)] =
            memory[static_cast<size_t>(c.src)][static_cast<size_t>(p)];
    const int64_t start = m.length(id);
    for (size_t i = 0; i < add.size(); ++i) {
      const int64_t p = start + static_cast<int64_t>(i);
      const BlockId b = m.table(id)[static_cast<size_t>(p / kBS)];
      memory[static_cast<size_t>(b)][static_cast<size_t>(p % kBS)] = add[i];
    }
    m.commit(id, add);
    auto& mine = tokens[id];
    mine.insert(mine.end(), add.begin(), add.end());
    return true;
  };

  auto check = [&](int op) {
    std::vector<int> refs(kBlocks, 0);
    for (const SeqId id : m.sequences()) {
      const auto& table = m.table(id);
      ASSERT_GE(static_cast<int64_t>(table.size()) * kBS, m.length(id));
      ASSERT_EQ(m.length(id), static_cast<int64_t>(tokens[id].size())) << "op " << op;
      for (const BlockId b : table) ++refs[static_cast<size_t>(b)];
      for (int64_t p = 0; p < m.length(id); ++p)
        ASSERT_EQ(memory[static_cast<size_t>(table[static_cast<size_t>(p / kBS)])]
                        [static_cast<size_t>(p % kBS)],
                  tokens[id][static_cast<size_t>(p)])
            << "op " << op << ": sequence " << id << " position " << p;
    }
    // A block's written positions are its holders' reach into it (a shared block is written
    // only before it is shared; a reserved block beyond a length holds none).
    std::vector<int64_t> filled(kBlocks, 0);
    for (const SeqId id : m.sequences()) {
      const auto& table = m.table(id);
      for (size_t i = 0; i < table.size(); ++i)
        filled[static_cast<size_t>(table[i])] =
            std::max(filled[static_cast<size_t>(table[i])],
                     std::clamp<int64_t>(m.length(id) - static_cast<int64_t>(i) * kBS, 0, kBS));
    }
    int64_t in_use = 0, positions = 0;
    for (BlockId b = 0; b < kBlocks; ++b) {
      positions += filled[static_cast<size_t>(b)];
      ASSERT_EQ(m.ref_count(b), refs[static_cast<size_t>(b)]) << "op " << op << " block " << b;
      const int states = int(m.is_free(b)) + int(m.ref_count(b) > 0) + int(m.is_cached(b));
      ASSERT_EQ(states, 1) << "op " << op << " block " << b;
      in_use += m.ref_count(b) > 0;
    }
    const BlockStats st = m.stats();
    ASSERT_EQ(st.in_use, in_use);
    ASSERT_EQ(st.positions, positions) << "op " << op;
    ASSERT_EQ(st.free + st.in_use + st.cached, kBlocks);
    if (!prefix_caching) {
      ASSERT_EQ(st.cached, 0);
    }
  };

  for (int op = 0; op < 4000; ++op) {
    const auto live = m.sequences();
    const int kind = live.empty() ? 0 : pick(10);
    if (kind <= 2) {  // a new request
      const SeqId id = next++;
      std::vector<int32_t> prompt = stems[static_cast<size_t>(pick(3))];
      prompt.resize(static_cast<size_t>(1 + pick(static_cast<int>(prompt.size()))));
      m.add(id);
      tokens[id];
      const int64_t taken = m.take_prefix(id, prompt);
      ASSERT_EQ(taken % kBS, 0);
      ASSERT_LT(taken, static_cast<int64_t>(prompt.size()));
      tokens[id].assign(prompt.begin(), prompt.begin() + taken);
      if (!write(id, {prompt.begin() + taken, prompt.end()})) {  // no room: the request ends
        m.free(id);
        tokens.erase(id);
      }
    } else if (kind <= 4) {  // fork
      const SeqId parent = live[static_cast<size_t>(pick(static_cast<int>(live.size())))];
      const SeqId child = next++;
      m.fork(parent, child);
      tokens[child] = tokens[parent];
    } else if (kind <= 7) {  // append
      const SeqId id = live[static_cast<size_t>(pick(static_cast<int>(live.size())))];
      std::vector<int32_t> add(static_cast<size_t>(1 + pick(20)));
      for (int32_t& t : add) t = 2000 + pick(50);
      write(id, add);  // out of blocks leaves it as it was
    } else if (kind == 8) {  // a slide: drop some of its whole blocks
      const SeqId id = live[static_cast<size_t>(pick(static_cast<int>(live.size())))];
      if (m.length(id) >= kBS) {
        const int64_t n = 1 + pick(static_cast<int>(m.length(id) / kBS));
        m.drop_front(id, n);
        tokens[id].erase(tokens[id].begin(), tokens[id].begin() + n * kBS);
      }
    } else {  // end
      const SeqId id = live[static_cast<size_t>(pick(static_cast<int>(live.size())))];
      m.free(id);
      tokens.erase(id);
    }
    check(op);
    if (testing::Test::HasFatalFailure()) return;
  }
  for (const SeqId id : m.sequences()) m.free(id);
  tokens.clear();
  check(-1);
  const BlockStats st = m.stats();
  EXPECT_EQ(st.in_use, 0);
  EXPECT_EQ(st.free + st.cached, kBlocks);
  if (prefix_caching) {
    EXPECT_GT(st.prefix_hit_blocks, 0);
    EXPECT_GT(st.evicted, 0);
  } else {
    EXPECT_EQ(st.free, kBlocks);
  }
}

TEST(BlockManager, RandomOperationsKeepEveryInvariant) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(seed);
    random_operations(true, seed);
    random_operations(false, seed);
  }
}

}  // namespace
}  // namespace kvlab
