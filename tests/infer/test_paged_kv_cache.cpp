// PagedKVCache (infer/paged_kv_cache.h): the op path over a paged cache gives the logits of the
// op path over a ContiguousKVCache, through prompts that end inside, at and past a block's end,
// and decode steps after them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/error.h"
#include "autograd/graph.h"
#include "infer/paged_kv_cache.h"
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

}  // namespace
}  // namespace kvlab
