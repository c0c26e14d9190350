// PagedKVCache (infer/paged_kv_cache.h): the op path over a paged cache gives the logits of the
// op path over a ContiguousKVCache, through prompts that end inside, at and past a block's end,
// and decode steps after them; so does the fused decode step (infer/decode/decode_step.h), which
// writes and reads the blocks through their tables.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/graph.h"
#include "infer/decode/decode_step.h"
#include "infer/paged_kv_cache.h"
#include "platform/error.h"
#include "tests/infer/infer_test_util.h"

namespace kvlab {
namespace {

constexpr int64_t kBlock = 16;  // kv_block_size
constexpr int64_t kContext = 64;

// Whether this build has the decode row kernel for HS (attend_row.cpp).
bool row_kernel(int64_t HS) {
  std::vector<float> x(static_cast<size_t>(HS), 1.0f), out(x.size()), p(1);
  return cpu::attend_one_query_kernel(out.data(), x.data(), x.data(), HS, x.data(), HS, 1, HS,
                                      1.0f, p.data());
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (const float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return d;
}

std::vector<int32_t> prompt_of(int64_t len, int64_t row) {
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i)
    p[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + row * 3 + 1) % 11);
  return p;
}

// Prefills each row's prompt on its own (rows of different lengths), then decodes `steps`
// tokens for all rows at once, through GPT::forward with a ContiguousKVCache and with a
// PagedKVCache; compares the logits of every forward.
// An f32 cache prefills each prompt in one forward. The paged cache's prefill sums the
// attention's values block by block (attention.cpp's attend_blocks), a different f32 order
// than the contiguous product: the logits agree within 1e-6 of their scale, not bit for bit.
// A bf16 cache would round a key that differs by that much the other way now and then, a whole
// bf16 step, so it prefills one token a forward: at T = 1 the paged cache's attention reads
// the same keys and values in the contiguous one's order, and where this build has the decode
// row kernel the logits are the same bits (1e-6 of their scale otherwise).
void check(int64_t n_kv_head, const std::vector<int64_t>& prompts, DType dtype, int steps = 5) {
  NoGradGuard no_grad;
  auto model = test::tiny_model(n_kv_head, 7, kContext);
  const GPTConfig& c = model->config();
  const int64_t B = static_cast<int64_t>(prompts.size()), HS = c.n_embd / c.n_head;
  ContiguousKVCache plain(c.n_layer, B, kContext, n_kv_head, HS, dtype);
  // Room for every row, with blocks to spare so that rows' blocks interleave.
  BlockManager manager(B * (kContext / kBlock) + 2, kBlock, 1, false);
  PagedKVCache paged(manager, c.n_layer, n_kv_head, HS, kContext, dtype);
  std::vector<SeqId> ids;
  for (int64_t b = 0; b < B; ++b) {
    ids.push_back(100 + b);
    manager.add(ids.back());
  }
  const bool exact = row_kernel(HS);
  double worst = 0;
  auto compare = [&](const Tensor& a, const Tensor& b, const std::string& what) {
    const auto x = a.to_vector<float>(), y = b.to_vector<float>();
    ASSERT_EQ(x.size(), y.size());
    const double d = max_diff(x, y);
    worst = std::max(worst, d / max_abs(y));
    EXPECT_LE(d, 1e-6 * max_abs(y)) << what;
    if (dtype == DType::BF16 && exact) {
      EXPECT_EQ(x, y) << what;
    }
  };
  for (int64_t b = 0; b < B; ++b) {
    const auto p = prompt_of(prompts[static_cast<size_t>(b)], b);
    const int64_t n = static_cast<int64_t>(p.size()), per = dtype == DType::BF16 ? 1 : n;
    paged.set_rows({ids[static_cast<size_t>(b)]});
    for (int64_t i = 0; i < n; i += per) {
      const std::vector<int32_t> part(p.begin() + i, p.begin() + i + per);
      const Tensor t = Tensor::from_vector(part, {1, per});
      const Tensor want = model->forward(t, &plain.rows(b, 1));
      ASSERT_TRUE(paged.reserve(part));
      compare(model->forward(t, &paged), want,
              "prefill of row " + std::to_string(b) + " at " + std::to_string(i));
    }
  }
  paged.set_rows(ids);
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> next;
    for (int64_t b = 0; b < B; ++b)
      next.push_back(static_cast<int32_t>((s * 5 + b * 2 + 3) % 11));
    const Tensor t = Tensor::from_vector(next, {B, 1});
    const Tensor want = model->forward(t, &plain);
    ASSERT_TRUE(paged.reserve(next));
    compare(model->forward(t, &paged), want, "decode step " + std::to_string(s));
  }
  for (int64_t b = 0; b < B; ++b)
    EXPECT_EQ(paged.lengths()[static_cast<size_t>(b)], plain.lengths()[static_cast<size_t>(b)]);
  ::testing::Test::RecordProperty("worst_relative_difference", std::to_string(worst));
}

struct Case {
  int64_t n_kv_head;
  DType dtype;
};

class PagedKVCacheTest : public ::testing::TestWithParam<Case> {};

TEST_P(PagedKVCacheTest, EqualsContiguousOneRowAtEachPromptLength) {
  for (const int64_t len : {1, 15, 16, 17, 33}) {
    SCOPED_TRACE("prompt " + std::to_string(len));
    check(GetParam().n_kv_head, {len}, GetParam().dtype);
  }
}

TEST_P(PagedKVCacheTest, EqualsContiguousThreeRowsOfDifferentLengths) {
  check(GetParam().n_kv_head, {15, 1, 33}, GetParam().dtype);
  check(GetParam().n_kv_head, {16, 17, 1}, GetParam().dtype, 18);  // a decode fills a block
}

INSTANTIATE_TEST_SUITE_P(
    KVHeads, PagedKVCacheTest,
    ::testing::Values(Case{4, DType::F32}, Case{2, DType::F32}, Case{1, DType::F32},
                      Case{4, DType::BF16}, Case{2, DType::BF16}, Case{1, DType::BF16}),
    [](const auto& info) {
      return "nkv" + std::to_string(info.param.n_kv_head) + "_" + dtype_name(info.param.dtype);
    });

// A forked sequence shares its parent's blocks; writing past the shared partly filled block
// copies it first (copy-on-write), so the parent's keys stay as they were.
TEST(PagedKVCache, ForkCopiesTheSharedBlockBeforeWriting) {
  NoGradGuard no_grad;
  auto model = test::tiny_model(2, 7, kContext);
  const GPTConfig& c = model->config();
  const int64_t HS = c.n_embd / c.n_head;
  BlockManager manager(8, kBlock, 1, false);
  PagedKVCache paged(manager, c.n_layer, 2, HS, kContext);
  ContiguousKVCache plain(c.n_layer, 2, kContext, 2, HS);
  manager.add(1);
  const auto p = prompt_of(20, 0);
  const Tensor t = Tensor::from_vector(p, {1, 20});
  paged.set_rows({1});
  ASSERT_TRUE(paged.reserve(p));
  model->forward(t, &paged);
  model->forward(t, &plain.rows(0, 1));
  model->forward(t, &plain.rows(1, 1));
  manager.fork(1, 2);
  paged.set_rows({1, 2});
  const std::vector<int32_t> next{4, 9};
  ASSERT_TRUE(paged.reserve(next));
  EXPECT_NE(manager.table(1)[1], manager.table(2)[1]);
  EXPECT_EQ(manager.table(1)[0], manager.table(2)[0]);
  const Tensor tn = Tensor::from_vector(next, {2, 1});
  const auto got = model->forward(tn, &paged).to_vector<float>();
  const auto want = model->forward(tn, &plain).to_vector<float>();
  EXPECT_LE(max_diff(got, want), 1e-6 * max_abs(want));
}

// Restores the OpenMP thread count when the test ends.
struct ThreadCount {
  int saved = omp_get_max_threads();
  explicit ThreadCount(int n) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved); }
};

// Row b's cached keys (or values) of a layer as f32, (NKV, len, HS) flattened: from the paged
// cache through sequence id's block table, and from a contiguous cache's row.
std::vector<float> paged_row(const PagedKVCache& cache, const BlockManager& manager, SeqId id,
                             int layer, bool keys) {
  const std::vector<float> pool =
      (keys ? cache.k_pool(layer) : cache.v_pool(layer)).to(DType::F32).to_vector<float>();
  const int64_t NKV = cache.k_pool(layer).size(1), HS = cache.k_pool(layer).size(3);
  const int64_t L = cache.kv_block_size(), len = manager.length(id);
  std::vector<float> out;
  for (int64_t h = 0; h < NKV; ++h)
    for (int64_t p = 0; p < len; ++p) {
      const int64_t block = manager.table(id)[static_cast<size_t>(p / L)];
      const auto at = pool.begin() + ((block * NKV + h) * L + p % L) * HS;
      out.insert(out.end(), at, at + HS);
    }
  return out;
}

std::vector<float> contiguous_row(const ContiguousKVCache& cache, int64_t b, int64_t len,
                                  int layer, bool keys) {
  const std::vector<float> all = test::cached(cache, layer, keys);
  const int64_t NKV = cache.n_kv_head(), HS = cache.head_size(), S = cache.capacity();
  std::vector<float> out;
  for (int64_t h = 0; h < NKV; ++h) {
    const auto at = all.begin() + ((b * NKV + h) * S) * HS;
    out.insert(out.end(), at, at + len * HS);
  }
  return out;
}

// Feeds each row's prompt one token a forward through GPT::forward into each cache: at T = 1
// the op path's attention is the decode step's (attention_decode_task), which reads a paged
// row's keys and values in a contiguous row's order, so every cache holds the same keys and
// values wherever the logits below are compared bit for bit.
void prefill_by_tokens(GPT& model, const std::vector<std::vector<int32_t>>& prompts,
                       PagedKVCache& paged, const std::vector<SeqId>& ids,
                       std::vector<ContiguousKVCache*> plain) {
  for (size_t b = 0; b < prompts.size(); ++b) {
    paged.set_rows({ids[b]});
    for (const int32_t tok : prompts[b]) {
      const std::vector<int32_t> one{tok};
      const Tensor t = Tensor::from_vector(one, {1, 1});
      for (ContiguousKVCache* c : plain) model.forward(t, &c->rows(static_cast<int64_t>(b), 1));
      ASSERT_TRUE(paged.reserve(one));
      model.forward(t, &paged);
    }
  }
}

// Whether DecodeStep over a paged cache gives the same bits as over a contiguous one: where the
// paged row kernel reads the blocks in the contiguous order (f32 with the row kernel), or the
// blocks are widened into one contiguous run first (bf16).
bool fused_exact(DType dtype, int64_t HS) { return dtype == DType::BF16 || row_kernel(HS); }

// Prefills the rows (distinct lengths allowed), then decodes `steps` tokens for all of them at
// once with DecodeStep over a PagedKVCache, DecodeStep over a ContiguousKVCache and GPT::forward
// over a ContiguousKVCache, on `threads` threads, the weights packed or not. The two fused steps
// give the same logits (bits where fused_exact) and leave the same keys and values; the op path
// stays within test_decode_step.cpp's bound of them.
void check_fused(int64_t n_kv_head, const std::vector<int64_t>& prompts, DType dtype, bool pack,
                 int threads, int steps) {
  const ThreadCount tc(threads);
  NoGradGuard no_grad;
  auto model = test::tiny_model(n_kv_head, 7, kContext);
  const GPTConfig& c = model->config();
  const int64_t B = static_cast<int64_t>(prompts.size()), HS = c.n_embd / c.n_head;
  ContiguousKVCache fused(c.n_layer, B, kContext, n_kv_head, HS, dtype);
  ContiguousKVCache plain(c.n_layer, B, kContext, n_kv_head, HS, dtype);
  BlockManager manager(B * (kContext / kBlock) + 2, kBlock, 1, false);
  PagedKVCache paged(manager, c.n_layer, n_kv_head, HS, kContext, dtype);
  std::vector<SeqId> ids;
  std::vector<std::vector<int32_t>> tokens;
  for (int64_t b = 0; b < B; ++b) {
    ids.push_back(100 + b);
    manager.add(ids.back());
    tokens.push_back(prompt_of(prompts[static_cast<size_t>(b)], b));
  }
  prefill_by_tokens(*model, tokens, paged, ids, {&fused, &plain});
  paged.set_rows(ids);
  DecodeStep step(*model);
  std::optional<DecodeStep::PackGuard> guard;
  if (pack) guard.emplace(step.pack());
  const bool exact = fused_exact(dtype, HS);
  double worst = 0, scale = 0;
  for (int s = 0; s < steps; ++s) {
    std::vector<int32_t> next;
    for (int64_t b = 0; b < B; ++b)
      next.push_back(static_cast<int32_t>((s * 5 + b * 2 + 3) % 11));
    const Tensor t = Tensor::from_vector(next, {B, 1});
    const auto want = step.forward(t, fused).to_vector<float>();
    ASSERT_TRUE(paged.reserve(next));
    const auto got = step.forward(t, paged).to_vector<float>();
    const auto op = model->forward(t, &plain).to_vector<float>();
    if (exact)
      ASSERT_EQ(got, want) << "step " << s;
    else
      ASSERT_LE(max_diff(got, want), 1e-6 * max_abs(want)) << "step " << s;
    worst = std::max(worst, max_diff(got, op));
    scale = std::max(scale, max_abs(op));
  }
  EXPECT_LE(worst, 1e-5 * std::max(1.0, scale)) << "logit scale " << scale;
  EXPECT_GT(scale, 1.0);  // the logits are far from zero: the comparison means something
  EXPECT_EQ(paged.lengths(), fused.lengths());
  for (int layer = 0; layer < c.n_layer; ++layer)
    for (const bool keys : {true, false})
      for (int64_t b = 0; b < B; ++b) {
        const auto want = contiguous_row(fused, b, fused.lengths()[static_cast<size_t>(b)],
                                         layer, keys);
        const auto got = paged_row(paged, manager, ids[static_cast<size_t>(b)], layer, keys);
        if (exact)
          EXPECT_EQ(got, want) << "layer " << layer << " row " << b << (keys ? " K" : " V");
        else
          EXPECT_LE(max_diff(got, want), 1e-5 * std::max(1.0, max_abs(want)));
      }
}

TEST_P(PagedKVCacheTest, FusedDecodeEqualsContiguousAndOpPath) {
  for (const bool pack : {false, true})
    for (const int threads : {1, 3}) {
      SCOPED_TRACE(std::string(pack ? "packed" : "row-major") + ", threads " +
                   std::to_string(threads));
      for (const int64_t len : {1, 15, 16, 17, 33}) {
        SCOPED_TRACE("prompt " + std::to_string(len));
        check_fused(GetParam().n_kv_head, {len}, GetParam().dtype, pack, threads, 18);
      }
      check_fused(GetParam().n_kv_head, {15, 1, 33}, GetParam().dtype, pack, threads, 18);
      check_fused(GetParam().n_kv_head, {16, 17, 1}, GetParam().dtype, pack, threads, 18);
    }
}

// A forked sequence decoded on its own by DecodeStep: its first step copies the shared partly
// filled block (reserve's copy-on-write) before the step writes, so it decodes as an own copy
// of the prompt would, and the parent, decoded afterwards, as if it had never been forked.
TEST(PagedKVCache, FusedDecodeOfAForkLeavesItsParentAsItWas) {
  for (const DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    NoGradGuard no_grad;
    auto model = test::tiny_model(2, 7, kContext);
    const GPTConfig& c = model->config();
    const int64_t HS = c.n_embd / c.n_head;
    BlockManager manager(8, kBlock, 1, false);
    PagedKVCache paged(manager, c.n_layer, 2, HS, kContext, dtype);
    ContiguousKVCache fused(c.n_layer, 2, kContext, 2, HS, dtype);
    ContiguousKVCache plain(c.n_layer, 2, kContext, 2, HS, dtype);
    manager.add(1);
    const auto p = prompt_of(20, 0);
    // The contiguous caches hold the prompt in both rows: row 0 the parent's, row 1 the fork's.
    prefill_by_tokens(*model, {p}, paged, {1}, {&fused, &plain});
    for (const int32_t tok : p) {
      const Tensor t = Tensor::from_vector(std::vector<int32_t>{tok}, {1, 1});
      model->forward(t, &fused.rows(1, 1));
      model->forward(t, &plain.rows(1, 1));
    }
    manager.fork(1, 2);
    DecodeStep step(*model);
    const bool exact = fused_exact(dtype, HS);
    auto decode = [&](SeqId id, int64_t row, int steps) {
      paged.set_rows({id});
      for (int s = 0; s < steps; ++s) {
        const std::vector<int32_t> next{static_cast<int32_t>((s * 3 + row + 2) % 11)};
        const Tensor t = Tensor::from_vector(next, {1, 1});
        const auto want = step.forward(t, fused.rows(row, 1)).to_vector<float>();
        ASSERT_TRUE(paged.reserve(next));
        const auto got = step.forward(t, paged).to_vector<float>();
        const auto op = model->forward(t, &plain.rows(row, 1)).to_vector<float>();
        if (exact)
          ASSERT_EQ(got, want) << "sequence " << id << " step " << s;
        else
          ASSERT_LE(max_diff(got, want), 1e-6 * max_abs(want));
        EXPECT_LE(max_diff(got, op), 1e-5 * std::max(1.0, max_abs(op)));
      }
    };
    decode(2, 1, 14);  // past the shared block's end, into a block of its own
    EXPECT_NE(manager.table(1)[1], manager.table(2)[1]);
    EXPECT_EQ(manager.table(1)[0], manager.table(2)[0]);
    decode(1, 0, 3);
    EXPECT_EQ(manager.length(1), 23);
    EXPECT_EQ(manager.length(2), 34);
  }
}

TEST(PagedKVCache, MisuseIsAClearError) {
  BlockManager manager(2, kBlock, 1, false);
  PagedKVCache paged(manager, 1, 1, 4, 32);
  manager.add(0);
  EXPECT_THROW(paged.set_rows({0, 0}), Error);
  EXPECT_THROW(paged.set_rows({5}), Error);
  paged.set_rows({0});
  EXPECT_THROW(paged.append(0, Tensor::zeros({1, 1, 1, 4}), Tensor::zeros({1, 1, 1, 4})), Error);
  EXPECT_THROW(paged.reserve(std::vector<int32_t>(33, 1)), Error);  // past the capacity
  manager.add(1);
  paged.set_rows({0, 1});
  // 4 blocks for 2 rows of 17 positions: the pool has 2, and nothing changes.
  EXPECT_FALSE(paged.reserve(std::vector<int32_t>(34, 1)));
  EXPECT_EQ(manager.stats().free, 2);
  EXPECT_THROW(PagedKVCache(manager, 1, 1, 4, 32, DType::F64), Error);
}

// DecodeStep asks for the rows of positions reserve() has not made room for: an error before
// anything is written, and the sequence keeps its length.
TEST(PagedKVCache, DecodeStepWithoutReserveIsAClearError) {
  NoGradGuard no_grad;
  auto model = test::tiny_model(2, 7, kContext);
  const GPTConfig& c = model->config();
  BlockManager manager(4, kBlock, 1, false);
  PagedKVCache paged(manager, c.n_layer, 2, c.n_embd / c.n_head, kContext);
  manager.add(0);
  paged.set_rows({0});
  DecodeStep step(*model);
  const std::vector<int32_t> one{3};
  const Tensor t = Tensor::from_vector(one, {1, 1});
  EXPECT_THROW(step.forward(t, paged), Error);
  EXPECT_EQ(manager.length(0), 0);
  ASSERT_TRUE(paged.reserve(one));
  step.forward(t, paged);
  EXPECT_EQ(manager.length(0), 1);
  EXPECT_EQ(paged.lengths()[0], 1);
}

}  // namespace
}  // namespace kvlab
