// The fused CPU decode step (infer/decode/decode_step.cpp) against the op path it replaces
// (GPT::forward with a cache): the same logits and the same cache contents at every step, for
// every n_kv_head, every cache dtype and thread counts that split the products unevenly.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>

#include "autograd/backend/allocator.h"
#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/graph.h"
#include "infer/decode/decode_step.h"
#include "infer/engine.h"
#include "infer/kv_cache.h"
#include "infer/measure/bench.h"
#include "infer/measure/kv_quality.h"
#include "infer_test_util.h"
#include "platform/kv_rows.h"
#include "platform/scalar_codecs.h"

namespace kvlab {
namespace {

// C = 64, NH = 8, H = 256, V = 67: with 3 threads the q/k/v rows split off the q/k/v
// boundaries (n_kv_head 2 and 1), and the vocabulary leaves the last thread a short block.
GPTConfig decode_config(int64_t n_kv_head, const std::string& arch = "gpt2") {
  GPTConfig c = test::tiny_config(n_kv_head, 24, arch);
  c.vocab_size = 67;
  c.n_head = 8;
  c.n_embd = 64;
  if (c.mla()) c.n_kv_head = c.n_head;  // MLA's is n_head, whatever n_kv_head says
  return c;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
  return d;
}

// Restores the OpenMP thread count when the test ends.
struct ThreadCount {
  int saved = omp_get_max_threads();
  explicit ThreadCount(int n) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved); }
};

// Decode steps of `tokens` through both caches, fused then op by op: the largest logit
// difference and the logits' scale.
struct StepDiff {
  double worst = 0, scale = 0;
};
StepDiff fused_against_op(GPT& model, DecodeStep& step, ContiguousKVCache& fused,
                          ContiguousKVCache& plain, const std::vector<Tensor>& tokens) {
  StepDiff d;
  for (const Tensor& t : tokens) {
    const std::vector<float> a = step.forward(t, fused).to_vector<float>();
    const std::vector<float> b = model.forward(t, &plain, true).to_vector<float>();
    d.worst = std::max(d.worst, max_diff(a, b));
    d.scale = std::max(d.scale, max_abs(b));
  }
  return d;
}

// The same keys and values in every layer of both caches, within tol of their scale.
void expect_same_cache(const ContiguousKVCache& fused, const ContiguousKVCache& plain,
                       int64_t n_layer, double tol) {
  for (int layer = 0; layer < n_layer; ++layer)
    for (const bool is_k : {true, false}) {
      const auto y = test::cached(plain, layer, is_k);
      EXPECT_LE(max_diff(test::cached(fused, layer, is_k), y), tol * std::max(1.0, max_abs(y)))
          << "layer " << layer << (is_k ? " K" : " V");
    }
}

// Row b of both caches prefilled op by op, in one pass, with its own random prompt of
// lengths[b] tokens.
void prefill_rows(GPT& model, ContiguousKVCache& fused, ContiguousKVCache& plain,
                  const std::vector<int64_t>& lengths, Generator& gen) {
  for (size_t b = 0; b < lengths.size(); ++b) {
    const Tensor p = test::random_tokens(gen, model.config().vocab_size, 1, lengths[b]);
    model.forward(p, &fused.rows(static_cast<int64_t>(b), 1), true);
    model.forward(p, &plain.rows(static_cast<int64_t>(b), 1), true);
  }
}

// (n_kv_head, cache dtype, threads, prompt lengths of the rows, block: gpt2 or llama)
class FusedDecode
    : public ::testing::TestWithParam<
          std::tuple<int64_t, DType, int, std::vector<int64_t>, std::string>> {};

TEST_P(FusedDecode, EqualsOpByOpAtEveryStep) {
  const auto [nkv, dtype, threads, prompt_len, arch] = GetParam();
  const ThreadCount tc(threads);
  auto model = test::random_model(decode_config(nkv, arch), 5);
  const GPTConfig& c = model->config();
  DecodeStep step(*model);
  NoGradGuard no_grad;
  // Rows of different lengths: each prefilled on its own, the same way in both caches. With
  // one row and fewer KV groups than threads, the threads share a group's query heads.
  const int64_t B = static_cast<int64_t>(prompt_len.size()), V = c.vocab_size;
  const std::vector<float> scales = kv_cache_scales(*model, dtype);
  ContiguousKVCache fused(c.n_layer, B, c.block_size, c.cache_heads(), c.cache_width(), dtype,
                          Device::CPU, scales, c.mla());
  ContiguousKVCache plain(c.n_layer, B, c.block_size, c.cache_heads(), c.cache_width(), dtype,
                          Device::CPU, scales, c.mla());
  Generator gen(17);
  prefill_rows(*model, fused, plain, prompt_len, gen);

  double worst = 0, scale = 0;
  uint64_t fused_requests = 0, plain_requests = 0;
  const int steps = 12;
  for (int i = 0; i < steps; ++i) {
    const Tensor tokens = test::random_tokens(gen, V, B);
    Allocator& alloc = allocator_for(Device::CPU);
    uint64_t r0 = alloc.stats().requests;
    const std::vector<float> a = step.forward(tokens, fused).to_vector<float>();
    fused_requests += alloc.stats().requests - r0;
    r0 = alloc.stats().requests;
    const std::vector<float> b = model->forward(tokens, &plain, true).to_vector<float>();
    plain_requests += alloc.stats().requests - r0;
    ASSERT_EQ(a.size(), static_cast<size_t>(B * V));
    worst = std::max(worst, max_diff(a, b));
    scale = std::max(scale, max_abs(b));
  }
  // The same kernels in the same order; only the products' rows (and, with one row, a KV
  // group's query heads) are split differently between the threads: at most f32 rounding,
  // relative to the logits' scale. With a bf16 cache the bound holds only because both paths
  // compute the same f32 keys and values (the op path's decode attention is the step's, at
  // every n_kv_head): a key rounded the other way moves by up to 2^-8 of itself, and two such
  // keys moved the logits here by 3.7e-5 of their scale, which this bound is meant to catch.
  EXPECT_LE(worst, 1e-5 * std::max(1.0, scale)) << "logit scale " << scale;
  EXPECT_GT(scale, 1.0);  // the logits are far from zero: the comparison means something
  EXPECT_EQ(fused.lengths(), plain.lengths());
  for (int64_t b = 0; b < B; ++b)
    EXPECT_EQ(fused.lengths()[static_cast<size_t>(b)], prompt_len[static_cast<size_t>(b)] + steps);
  // Same keys and values in the caches (a bf16 cache may round a value the other way; a
  // quantised one holds the same bytes, compared as numbers). MLA's attention carries its
  // queries into latent form and its outputs back in another order than the op path's
  // products, so from the second layer on its latents differ in their last bits, which can
  // move a quantised code: its quantised caches are compared in the first layer, whose latents
  // come from the embeddings alone.
  expect_same_cache(fused, plain, c.mla() && is_quantised(dtype) ? 1 : c.n_layer,
                    dtype == DType::BF16 ? 1.0 / 128 : is_quantised(dtype) ? 0.0 : 1e-5);
  // The fused step really ran: it asks the allocator for its own few buffers, where the
  // op-by-op step makes a tensor per op.
  EXPECT_LE(fused_requests, 16u * steps);
  EXPECT_GT(plain_requests, 30u * steps);
}

std::string fused_case_name(
    const testing::TestParamInfo<FusedDecode::ParamType>& info) {
  return std::get<4>(info.param) + "_nkv" + std::to_string(std::get<0>(info.param)) + "_" +
         dtype_name(std::get<1>(info.param)) + "_threads" +
         std::to_string(std::get<2>(info.param)) + "_rows" +
         std::to_string(std::get<3>(info.param).size());
}

INSTANTIATE_TEST_SUITE_P(
    NkvDtypeThreads, FusedDecode,
    ::testing::Combine(::testing::Values(8, 2, 1),
                       ::testing::Values(DType::F32, DType::BF16, DType::FP8, DType::INT8,
                                         DType::INT4),
                       ::testing::Values(1, 2, 3),
                       ::testing::Values(std::vector<int64_t>{1, 6, 3}, std::vector<int64_t>{5}),
                       ::testing::Values("gpt2")),
    fused_case_name);

// RoPE (q and k rotated by each thread for its own groups, or after a barrier), RMSNorm,
// SwiGLU and no biases.
INSTANTIATE_TEST_SUITE_P(
    Llama, FusedDecode,
    ::testing::Combine(::testing::Values(8, 2, 1),
                       ::testing::Values(DType::F32, DType::FP8, DType::INT8),
                       ::testing::Values(1, 2, 3),
                       ::testing::Values(std::vector<int64_t>{1, 6, 3}, std::vector<int64_t>{5}),
                       ::testing::Values("llama")),
    fused_case_name);

// MLA: the queries carried into latent form, one attention over the latent rows for every
// query head (its heads shared out between threads where rows are few), the values' up-
// projection after; "mla_q" with the queries compressed too. Every cache dtype MLA has.
INSTANTIATE_TEST_SUITE_P(
    Mla, FusedDecode,
    ::testing::Combine(::testing::Values(8),
                       ::testing::Values(DType::F32, DType::BF16, DType::FP8, DType::INT8,
                                         DType::INT4),
                       ::testing::Values(1, 2, 3),
                       ::testing::Values(std::vector<int64_t>{1, 6, 3}, std::vector<int64_t>{5}),
                       ::testing::Values("mla", "mla_q")),
    fused_case_name);

// n_kv_head 3 on 3 threads: each thread computes its own group's q, k and v and goes straight
// on to that group's attention, with no barrier between; rows of different lengths, both
// cache dtypes.
TEST(FusedDecode, ThreeThreadsEachWithAGroupOfTheirOwn) {
  const ThreadCount tc(3);
  GPTConfig c = decode_config(3);
  c.n_head = 6;
  c.n_embd = 48;
  auto model = test::random_model(c, 13);
  DecodeStep step(*model);
  NoGradGuard no_grad;
  for (const DType dtype : {DType::F32, DType::BF16}) {
    const int64_t B = 3;
    ContiguousKVCache fused(c.n_layer, B, c.block_size, 3, c.head_size(), dtype);
    ContiguousKVCache plain(c.n_layer, B, c.block_size, 3, c.head_size(), dtype);
    Generator gen(29);
    prefill_rows(*model, fused, plain, {2, 3, 4}, gen);
    std::vector<Tensor> tokens;
    for (int i = 0; i < 8; ++i) tokens.push_back(test::random_tokens(gen, c.vocab_size, B));
    const StepDiff d = fused_against_op(*model, step, fused, plain, tokens);
    EXPECT_GT(d.scale, 1.0);
    EXPECT_LE(d.worst, 1e-5 * d.scale) << dtype_name(dtype);
    expect_same_cache(fused, plain, c.n_layer, dtype == DType::BF16 ? 1.0 / 128 : 1e-5);
  }
}

// The fused step rounds the new keys and values it writes into a bf16 cache to nearest even,
// as append does: in layer 0 they are the same f32 numbers as in an f32 run (they depend
// only on this step's token), so the two caches' new position is compared bit for bit.
TEST(FusedDecode, Bf16CacheHoldsTheNewKeysRoundedToNearestEven) {
  for (const int threads : {1, 2}) {
    const ThreadCount tc(threads);
    auto model = test::random_model(decode_config(2), 7);
    const GPTConfig& c = model->config();
    DecodeStep step(*model);
    NoGradGuard no_grad;
    const Tensor prompt = Tensor::from_vector(std::vector<int32_t>{4, 9, 1}, {1, 3});
    const Tensor token = Tensor::from_vector(std::vector<int32_t>{12}, {1, 1});
    ContiguousKVCache f32(c.n_layer, 1, c.block_size, 2, c.head_size());
    ContiguousKVCache bf16(c.n_layer, 1, c.block_size, 2, c.head_size(), DType::BF16);
    for (ContiguousKVCache* cache : {&f32, &bf16}) {
      model->forward(prompt, cache, true);
      step.forward(token, *cache);
    }
    int64_t rounded_away = 0;  // values where rounding to nearest differs from truncating
    for (const bool is_k : {true, false}) {
      const Tensor& wide = is_k ? f32.k_buffer(0) : f32.v_buffer(0);
      const Tensor& narrow = is_k ? bf16.k_buffer(0) : bf16.v_buffer(0);
      const auto* n = static_cast<const uint16_t*>(narrow.raw_data());
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < c.head_size(); ++i) {
          const int64_t at = (h * c.block_size + 3) * c.head_size() + i;  // position 3
          const float x = wide.data<float>()[at];
          EXPECT_EQ(n[at], f32_to_bf16(x)) << "threads " << threads << " head " << h;
          uint32_t bits;
          std::memcpy(&bits, &x, 4);
          rounded_away += f32_to_bf16(x) != static_cast<uint16_t>(bits >> 16);
        }
    }
    EXPECT_GT(rounded_away, 0);  // truncation would have failed the comparison
  }
}

// One query head per thread (a group of 2 heads split in 2 at batch 1) and an LM head of
// its own: the attention kernel runs on single query rows, and the logits come from lm_head.
TEST(FusedDecode, OneQueryHeadPerThreadAndAnUntiedHead) {
  const ThreadCount tc(2);
  GPTConfig c = decode_config(1);
  c.n_head = 2;
  c.tied = false;
  auto model = test::random_model(c, 9);
  DecodeStep step(*model);
  NoGradGuard no_grad;
  ContiguousKVCache fused(c.n_layer, 1, c.block_size, 1, c.head_size());
  ContiguousKVCache plain(c.n_layer, 1, c.block_size, 1, c.head_size());
  Generator gen(4);
  std::vector<Tensor> tokens;
  for (int i = 0; i < 10; ++i) tokens.push_back(test::random_tokens(gen, c.vocab_size, 1));
  const StepDiff d = fused_against_op(*model, step, fused, plain, tokens);
  EXPECT_GT(d.scale, 1.0);
  EXPECT_LE(d.worst, 1e-5 * d.scale);
}

// ---- with the weights packed (DecodeStep::pack) ----

// decode_config with NH = 4, C = 40 (HS 10: K has a 16-column tail) and hidden 100: with 3
// threads the threads' shares of k and v start inside 8-row blocks of the packed weights.
GPTConfig odd_config(int64_t n_kv_head, const std::string& arch = "gpt2") {
  GPTConfig c = decode_config(n_kv_head, arch);
  c.n_head = 4;
  c.n_embd = 40;
  c.mlp_hidden = 100;
  if (c.mla()) c.n_kv_head = c.n_head;
  return c;
}

// Logits of one decode step, fused (through `step`) or op by op, after an op-path prefill of
// `prompt` into a fresh cache.
std::vector<float> step_logits(GPT& model, DecodeStep& step, bool fused,
                               const std::vector<int32_t>& prompt, int32_t token) {
  const GPTConfig& c = model.config();
  ContiguousKVCache cache(c.n_layer, 1, c.block_size, c.n_kv_head, c.head_size());
  model.forward(Tensor::from_vector(prompt, {1, static_cast<int64_t>(prompt.size())}), &cache,
                true);
  const Tensor t = Tensor::from_vector(std::vector<int32_t>{token}, {1, 1});
  return (fused ? step.forward(t, cache) : model.forward(t, &cache, true)).to_vector<float>();
}

// (odd sizes, n_kv_head, threads, rows, block: gpt2 or llama, whose SwiGLU adds c_up)
class PackedDecode
    : public ::testing::TestWithParam<std::tuple<bool, int64_t, int, int64_t, std::string>> {
 protected:
  // Twelve packed fused steps against the op path, from prompts of 3, 4, 5... tokens; the
  // model's matrices rounded first to `matrices` and so packed in its form.
  // With int8_products the step rounds each product's input to q8_0 blocks, which the op path
  // does not: within `bound` of the logits' scale.
  void check(WeightDtype matrices, bool int8_products = false, double bound = 1e-5) {
    const auto [odd, nkv, threads, B, arch] = GetParam();
    const ThreadCount tc(threads);
    auto model = test::random_model(odd ? odd_config(nkv, arch) : decode_config(nkv, arch), 5);
    model->round_matrices(matrices);
    const GPTConfig& c = model->config();
    DecodeStep step(*model);
    step.int8_products = int8_products;
    NoGradGuard no_grad;
    ContiguousKVCache fused(c.n_layer, B, c.block_size, c.cache_heads(), c.cache_width(),
                            DType::F32, Device::CPU, {}, c.mla());
    ContiguousKVCache plain(c.n_layer, B, c.block_size, c.cache_heads(), c.cache_width(),
                            DType::F32, Device::CPU, {}, c.mla());
    Generator gen(23);
    for (int64_t b = 0; b < B; ++b)  // op by op into both caches
      for (int64_t i = 0; i < 3 + b; ++i) {
        const Tensor t = test::random_tokens(gen, c.vocab_size, 1);
        model->forward(t, &fused.rows(b, 1), true);
        model->forward(t, &plain.rows(b, 1), true);
      }
    const DecodeStep::PackGuard pack = step.pack();
    std::vector<Tensor> tokens;
    for (int i = 0; i < 12; ++i) tokens.push_back(test::random_tokens(gen, c.vocab_size, B));
    const StepDiff d = fused_against_op(*model, step, fused, plain, tokens);
    EXPECT_GT(d.scale, 1.0);
    EXPECT_LE(d.worst, bound * d.scale) << "logit scale " << d.scale;
    // Integer products round the activations: they cannot give the op path's bits.
    if (step.multiplies_in_integers()) {
      EXPECT_GT(d.worst, 0.0);
    }
    expect_same_cache(fused, plain, c.n_layer, bound);
  }
};

TEST_P(PackedDecode, EqualsOpByOpAtEveryStep) { check(WeightDtype::F32); }

// The bf16 form gives the f32 form's bits on bf16 values (test_gemm.cpp), so the same bound
// holds; the sizes put the products' K (40, 64, 100, 256) at every kind of 32-column tail.
TEST_P(PackedDecode, Bf16MatricesEqualOpByOpAtEveryStep) { check(WeightDtype::BF16); }

// So do the q8_0 and q4_0 forms on their values; at the odd sizes (K 40 and 100, not whole
// blocks) the matrices stay f32, and only the LM head... also stays, its K being n_embd.
TEST_P(PackedDecode, BlockQuantisedMatricesEqualOpByOpAtEveryStep) {
  check(WeightDtype::Q8_0);
  check(WeightDtype::Q4_0);
}

// With integer products each product's input is rounded to q8_0 blocks, which the op path does
// not do, and these small random models amplify it: measured up to 6.4% of the logits' scale
// over twelve steps (a key at the wrong position moves them by their scale). That the rounding
// is llama.cpp's own is held in test_gguf_models.cpp against llama.cpp itself.
TEST_P(PackedDecode, IntegerProductsStayNearOpByOpAtEveryStep) {
  check(WeightDtype::Q8_0, true, 0.1);
  check(WeightDtype::Q4_0, true, 0.1);
}

std::string packed_case_name(const testing::TestParamInfo<PackedDecode::ParamType>& info) {
  std::string name = std::get<4>(info.param) + (std::get<0>(info.param) ? "_odd" : "_even");
  name += "_nkv" + std::to_string(std::get<1>(info.param));
  name += "_threads" + std::to_string(std::get<2>(info.param));
  name += "_rows" + std::to_string(std::get<3>(info.param));
  return name;
}

INSTANTIATE_TEST_SUITE_P(OddNkvThreadsRows, PackedDecode,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(4, 2, 1),
                                            ::testing::Values(1, 2, 3), ::testing::Values(1, 4),
                                            ::testing::Values("gpt2")),
                         packed_case_name);
INSTANTIATE_TEST_SUITE_P(Llama, PackedDecode,
                         ::testing::Combine(::testing::Values(true), ::testing::Values(4, 2, 1),
                                            ::testing::Values(1, 2, 3), ::testing::Values(1, 4),
                                            ::testing::Values("llama")),
                         packed_case_name);
// MLA: q_proj and kv_down packed (their threads' shares start inside the packed blocks at odd
// sizes), kv_up read row-major; q_down (mla_q) too. (n_kv_head: MLA's is n_head.)
INSTANTIATE_TEST_SUITE_P(Mla, PackedDecode,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(4),
                                            ::testing::Values(1, 2, 3), ::testing::Values(1, 4),
                                            ::testing::Values("mla", "mla_q")),
                         packed_case_name);

// The step reads the packed copies while the guard lives, and the weights again once it is
// gone: a weight changed in between (against the guard's contract) shows only afterwards.
// The second packing reuses the first one's buffers.
TEST(PackedDecode, ReadsThePackOnlyWhileItsGuardLives) {
  auto model = test::random_model(decode_config(2), 5);
  DecodeStep step(*model);
  NoGradGuard no_grad;
  const std::vector<int32_t> prompt{4, 9, 1};
  const std::vector<float> before = step_logits(*model, step, false, prompt, 7);
  std::optional<DecodeStep::PackGuard> pack(step.pack());
  if (cpu::packed_weight_bytes(WeightDtype::F32, 1, 1) == 0) GTEST_SKIP() << "no packed kernel in this build";
  EXPECT_LE(max_diff(step_logits(*model, step, true, prompt, 7), before), 1e-5 * max_abs(before));
  Tensor w = model->blocks[1]->mlp.c_fc.weight;  // changed under the guard
  for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] *= -1.0f;
  const std::vector<float> after = step_logits(*model, step, false, prompt, 7);
  ASSERT_GT(max_diff(after, before), 0.1);  // the change matters
  // The packed c_fc is the old one: the step matches neither the new op path nor the old one
  // (its cache was filled with the new weights), and differs by much more than rounding.
  EXPECT_GT(max_diff(step_logits(*model, step, true, prompt, 7), after), 0.1);
  pack.reset();
  EXPECT_LE(max_diff(step_logits(*model, step, true, prompt, 7), after), 1e-5 * max_abs(after));
  Allocator& alloc = allocator_for(Device::CPU);
  const uint64_t r0 = alloc.stats().requests;
  pack.emplace(step.pack());
  EXPECT_EQ(alloc.stats().requests - r0, 0u);
  EXPECT_LE(max_diff(step_logits(*model, step, true, prompt, 7), after), 1e-5 * max_abs(after));
  // Nothing is packed for the op path: a fused step under a guard made while the step was
  // disabled reads the weights (here restored), not the last pack.
  pack.reset();
  step.enabled = false;
  pack.emplace(step.pack());
  for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] *= -1.0f;
  EXPECT_LE(max_diff(step_logits(*model, step, true, prompt, 7), before), 1e-5 * max_abs(before));
}

// Each thread's rows are packed on their own, for the thread count at packing: a step on
// another number of threads reads the row-major weights (so a weight changed under the guard
// shows there), and one on that number reads the copies again.
TEST(PackedDecode, AStepOnOtherThreadsThanThePackReadsTheWeights) {
  auto model = test::random_model(odd_config(2), 5);
  DecodeStep step(*model);
  NoGradGuard no_grad;
  if (cpu::packed_weight_bytes(WeightDtype::F32, 1, 1) == 0) GTEST_SKIP() << "no packed kernel in this build";
  const std::vector<int32_t> prompt{4, 9, 1};
  const std::vector<float> before = step_logits(*model, step, false, prompt, 7);
  std::optional<DecodeStep::PackGuard> pack;
  {
    const ThreadCount three(3);
    pack.emplace(step.pack());
  }
  const ThreadCount two(2);
  EXPECT_LE(max_diff(step_logits(*model, step, true, prompt, 7), before), 1e-5 * max_abs(before));
  Tensor w = model->blocks[0]->attn->q_proj.weight;  // changed under the guard
  for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] *= -1.0f;
  const std::vector<float> after = step_logits(*model, step, false, prompt, 7);
  ASSERT_GT(max_diff(after, before), 0.1);
  EXPECT_LE(max_diff(step_logits(*model, step, true, prompt, 7), after), 1e-5 * max_abs(after));
  const ThreadCount three(3);
  EXPECT_GT(max_diff(step_logits(*model, step, true, prompt, 7), after), 0.1);  // the copies
}

// Guards nest (a generate call inside another's callback): the copies are read until the last
// guard ends, not the first.
TEST(PackedDecode, GuardsNest) {
  auto model = test::random_model(decode_config(2), 5);
  DecodeStep step(*model);
  NoGradGuard no_grad;
  if (cpu::packed_weight_bytes(WeightDtype::F32, 1, 1) == 0) GTEST_SKIP() << "no packed kernel in this build";
  const std::vector<int32_t> prompt{4, 9, 1};
  std::optional<DecodeStep::PackGuard> outer(step.pack());
  std::optional<DecodeStep::PackGuard> inner(step.pack());
  inner.reset();
  Tensor w = model->blocks[0]->attn->c_proj.weight;  // changed under the outer guard
  for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] *= -1.0f;
  const std::vector<float> now = step_logits(*model, step, false, prompt, 7);
  EXPECT_GT(max_diff(step_logits(*model, step, true, prompt, 7), now), 0.1);  // still the copies
  outer.reset();
  EXPECT_LE(max_diff(step_logits(*model, step, true, prompt, 7), now), 1e-5 * max_abs(now));
}

// round_matrices rounds the six matrices of each block and the (tied) LM head to
// nearest even bf16 and nothing else; a decode step then reads them at 2 bytes an element.
TEST(PackedDecode, RoundMatricesToBf16RoundsTheMatricesOnly) {
  auto model = test::random_model(odd_config(2), 5);
  const GPTConfig& c = model->config();
  ASSERT_TRUE(c.tied);
  std::vector<std::vector<float>> before;
  for (const Tensor& p : model->parameters()) before.push_back(p.to_vector<float>());
  DecodeStep step(*model);
  const int64_t f32_bytes = step.weight_bytes();
  model->round_matrices(WeightDtype::BF16);
  std::vector<Tensor> matrices;
  for (const auto& b : model->blocks)
    for (const Linear* l : {&b->attn->q_proj, &b->attn->k_proj, &b->attn->v_proj, &b->attn->c_proj,
                            &b->mlp.c_fc, &b->mlp.c_proj})
      matrices.push_back(l->weight);
  matrices.push_back(model->wte.weight);
  int64_t rounded_elements = 0, others = 0;
  const std::vector<Tensor> params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const bool matrix = std::any_of(matrices.begin(), matrices.end(), [&](const Tensor& m) {
      return m.raw_data() == params[i].raw_data();
    });
    const std::vector<float> now = params[i].to_vector<float>();
    for (size_t j = 0; j < now.size(); ++j) {
      const float expect = matrix ? bf16_to_f32(f32_to_bf16(before[i][j])) : before[i][j];
      ASSERT_EQ(std::memcmp(&now[j], &expect, 4), 0) << "parameter " << i << " element " << j;
    }
    (matrix ? rounded_elements : others) += params[i].numel();
  }
  int64_t matrix_elements = 0;
  for (const Tensor& m : matrices) matrix_elements += m.numel();
  EXPECT_EQ(rounded_elements, matrix_elements);           // every matrix is a parameter, once
  const int64_t rest = others - c.block_size * c.n_embd;  // the position table is not read
  EXPECT_EQ(f32_bytes, 4 * (matrix_elements + rest));
  const bool packs = cpu::packed_weight_bytes(WeightDtype::BF16, 1, 1) > 0;
  EXPECT_EQ(step.weight_bytes(), (packs ? 2 : 4) * matrix_elements + 4 * rest);
  step.enabled = false;  // the op path reads the f32 storage
  EXPECT_EQ(step.weight_bytes(), f32_bytes);
}

// MLA's kv_up is read as it is stored, never packed: rounded to bf16 it still counts 4 bytes an
// element, where the matrices the step packs count 2.
TEST(PackedDecode, MlaWeightBytesCountKvUpAsStored) {
  auto model = test::random_model(decode_config(8, "mla"), 5);
  DecodeStep step(*model);
  const int64_t f32_bytes = step.weight_bytes();
  model->round_matrices(WeightDtype::BF16);
  int64_t packed = model->lm_head_weight().numel();
  for (const auto& b : model->blocks)
    for (const Linear* l : {&b->mla->q_proj, &b->mla->kv_down, &b->mla->c_proj, &b->mlp.c_fc,
                            b->mlp.c_up.get(), &b->mlp.c_proj})
      if (l != nullptr) packed += l->weight.numel();
  const bool packs = cpu::packed_weight_bytes(WeightDtype::BF16, 1, 1) > 0;
  EXPECT_EQ(step.weight_bytes(), f32_bytes - (packs ? 2 * packed : 0));
}

// A cache whose rows the fused step cannot write or read (f64 rows, from the cache's own
// buffers, or from another implementation in the last layer only) is an error naming them,
// raised before anything is written: no layer's buffers change and the cache does not
// advance.
TEST(FusedDecode, ACacheTheStepCannotUseIsAnError) {
  // A cache whose last layer's rows are f64: a DecodeKVCache may be any implementation.
  struct F64LastLayer final : DecodeKVCache {
    ContiguousKVCache inner;
    explicit F64LastLayer(const GPTConfig& c)
        : inner(c.n_layer, 1, c.block_size, c.n_kv_head, c.head_size()) {}
    int64_t batch() const override { return inner.batch(); }
    int64_t capacity() const override { return inner.capacity(); }
    const std::vector<int64_t>& lengths() const override { return inner.lengths(); }
    const std::vector<int64_t>& position_offsets() const override {
      return inner.position_offsets();
    }
    std::pair<Tensor, Tensor> append(int layer, const Tensor& k, const Tensor& v) override {
      return inner.append(layer, k, v);
    }
    KVRows layer_rows(int layer, int64_t T) override {
      KVRows rows = inner.layer_rows(layer, T);
      if (layer + 1 == inner.n_layer()) rows.dtype = DType::F64;
      return rows;
    }
    void advance(int64_t T) override { inner.advance(T); }
  };
  // Every buffer of every layer still all zeros.
  auto untouched = [](const ContiguousKVCache& cache) {
    for (int l = 0; l < cache.n_layer(); ++l)
      for (const Tensor* buf : {&cache.k_buffer(l), &cache.v_buffer(l)}) {
        const std::vector<double> x = buf->to(DType::F64).to_vector<double>();
        if (std::any_of(x.begin(), x.end(), [](double e) { return e != 0.0; })) return false;
      }
    return true;
  };
  const ThreadCount tc(2);
  auto model = test::random_model(decode_config(2), 5);
  const GPTConfig& c = model->config();
  DecodeStep step(*model);
  NoGradGuard no_grad;
  const Tensor tok = Tensor::from_vector(std::vector<int32_t>{3}, {1, 1});
  ContiguousKVCache f64(c.n_layer, 1, c.block_size, 2, c.head_size(), DType::F64);
  try {
    step.forward(tok, f64);
    FAIL() << "the step wrote f32 keys into an f64 cache";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the KV cache returned k (1, 2, 1, 8) f64"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(f64.lengths(), std::vector<int64_t>{0});
  EXPECT_TRUE(untouched(f64));
  F64LastLayer last(c);
  try {
    step.forward(tok, last);
    FAIL() << "f64 cache rows were read as f32";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the KV cache returned"), std::string::npos) << e.what();
  }
  EXPECT_EQ(last.lengths(), std::vector<int64_t>{0});
  EXPECT_TRUE(untouched(last.inner));  // layer 0's rows were fine, and still not written
}

// The engine runs the fused step only where it applies: with gradients on, a decode step goes
// op by op (its graph is recorded), which shows in the allocator's count.
TEST(FusedDecode, GradientsTakeTheOpPath) {
  auto model = test::random_model(decode_config(2), 5);
  const GPTConfig& c = model->config();
  const Tokenizer tokenizer = synthetic_tokenizer(c.vocab_size);
  Engine engine(*model, tokenizer);
  ContiguousKVCache cache(c.n_layer, 1, c.block_size, 2, c.head_size());
  const Tensor tok = Tensor::from_vector(std::vector<int32_t>{3}, {1, 1});
  Allocator& alloc = allocator_for(Device::CPU);
  uint64_t r0 = alloc.stats().requests;
  const Tensor with_grad = engine.forward_cached(tok, cache);
  const uint64_t op_requests = alloc.stats().requests - r0;
  EXPECT_NE(with_grad.grad_fn(), nullptr);  // a graph was recorded
  NoGradGuard no_grad;
  r0 = alloc.stats().requests;
  engine.forward_cached(tok, cache);
  EXPECT_LE(alloc.stats().requests - r0, 16u);
  EXPECT_GT(op_requests, 30u);
}

// A bad token id is an error naming it, and the cache is left as it was.
TEST(FusedDecode, BadTokenIsAClearErrorAndTheCacheIsUntouched) {
  auto model = test::random_model(decode_config(2), 5);
  const GPTConfig& c = model->config();
  DecodeStep step(*model);
  NoGradGuard no_grad;
  ContiguousKVCache cache(c.n_layer, 1, c.block_size, 2, c.head_size());
  model->forward(Tensor::from_vector(std::vector<int32_t>{1, 2, 3}, {1, 3}), &cache, true);
  const std::vector<float> before = test::cached(cache, 0, true);
  try {
    step.forward(Tensor::from_vector(std::vector<int32_t>{67}, {1, 1}), cache);
    FAIL() << "token 67 of a 67-symbol vocabulary was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 67"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.lengths(), std::vector<int64_t>{3});
  EXPECT_EQ(test::cached(cache, 0, true), before);
}

}  // namespace
}  // namespace kvlab
