// The quantised caches through the model: cached decoding, token by token, gives the
// evaluation mode's logits (infer/measure/kv_quality.h: the window prefilled into a fresh cache of
// that dtype), so the loss the quality report gives is the loss a user gets; greedy text with
// an int8 cache is f32's on a trained model; the report's figures are what they say.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "data/mqar.h"
#include "infer/block_manager.h"
#include "infer/decode/decode_step.h"
#include "infer/engine.h"
#include "infer/measure/kv_quality.h"
#include "infer/paged_kv_cache.h"
#include "infer_test_util.h"
#include "nn/adamw.h"
#include "platform/kv_rows.h"
#include "platform/random.h"

namespace kvlab {
namespace {

// HS 16: the row kernel's reach on AVX2 and AVX-512 alike. n_kv_head 0: MLA, its latent rows
// of 28 + 4 values.
GPTConfig quality_config(int64_t n_kv_head) {
  GPTConfig c = n_kv_head > 0 ? test::tiny_config(n_kv_head, 24) : test::tiny_config(4, 24, "mla");
  if (n_kv_head == 0) c.kv_lora_rank = 28;
  c.n_embd = 64;
  c.vocab_size = 29;
  return c;
}

// (n_kv_head, 0 for MLA; dtype; batch)
class DecodeEqualsEvaluation
    : public ::testing::TestWithParam<std::tuple<int64_t, DType, int64_t>> {};

// At every step, each of the three cached decoders (the fused step over a contiguous cache,
// the op path over one, the fused step over a paged cache of 4-position blocks) gives the
// evaluation forward's logits for that position. Both read the same quantised keys and values,
// so what differs is f32 rounding (at most 1.8e-6 of the logits' scale in these cases). A key
// whose f32 value the one-row product rounded differently from the prefill's many-row one
// could move a code by a step and exceed the bound: none did here, and the loss agrees.
// MLA's decoders carry the queries into latent form in another order than the prefill, so
// from the second layer on its latents differ in their last bits and do move codes (int8 at
// batch 3: 2.2e-4 of the logits' scale): its bound is 1e-3, still far below what a wrong
// scale or a misplaced row gives (whole logits).
TEST_P(DecodeEqualsEvaluation, AtEveryStep) {
  const auto [nkv, dtype, B] = GetParam();
  auto model = test::random_model(quality_config(nkv), 23);
  const GPTConfig& c = model->config();
  NoGradGuard no_grad;
  const int64_t T = 20, V = c.vocab_size;
  Generator gen(5);
  const Tensor tokens = test::random_tokens(gen, V, B, T);
  const std::vector<float> eval = cached_prefill_logits(*model, tokens, dtype).to_vector<float>();
  const std::vector<float> scales = kv_cache_scales(*model, dtype);
  const int64_t NKV = c.cache_heads(), W = c.cache_width();
  ContiguousKVCache fused(c.n_layer, B, c.block_size, NKV, W, dtype, Device::CPU, scales, c.mla());
  ContiguousKVCache op(c.n_layer, B, c.block_size, NKV, W, dtype, Device::CPU, scales, c.mla());
  BlockManager blocks(B * c.block_size / 4, 4, 0, false);
  PagedKVCache paged(blocks, c.n_layer, NKV, W, c.block_size, dtype, B, scales, c.mla());
  DecodeStep step(*model);
  const std::vector<int32_t> ids = tokens.to_vector<int32_t>();
  double worst = 0, scale = 0, loss_eval = 0, loss_decoded = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> col(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) col[b] = ids[b * T + t];
    const Tensor tok = Tensor::from_vector(col, {B, 1});
    paged.prepare(col);
    const std::vector<std::vector<float>> got = {step.forward(tok, fused).to_vector<float>(),
                                                 model->forward(tok, &op, true).to_vector<float>(),
                                                 step.forward(tok, paged).to_vector<float>()};
    for (int64_t b = 0; b < B; ++b) {
      const float* want = eval.data() + (b * T + t) * V;
      for (const auto& g : got)
        for (int64_t v = 0; v < V; ++v) {
          worst = std::max(worst, double(std::fabs(g[b * V + v] - want[v])));
          scale = std::max(scale, double(std::fabs(want[v])));
        }
      if (t + 1 < T) {  // the next token's log-likelihood, as the report computes it
        const int32_t next = ids[b * T + t + 1];
        auto nll = [&](const float* l) {
          double mx = *std::max_element(l, l + V), s = 0;
          for (int64_t v = 0; v < V; ++v) s += std::exp(l[v] - mx);
          return mx + std::log(s) - l[next];
        };
        loss_eval += nll(want);
        loss_decoded += nll(got[0].data() + b * V);
      }
    }
  }
  EXPECT_GT(scale, 1.0);
  EXPECT_LE(worst, (c.mla() ? 1e-3 : 1e-5) * scale)
      << dtype_name(dtype) << " logit scale " << scale;
  EXPECT_NEAR(loss_eval, loss_decoded, 1e-5 * double(B * (T - 1)));
}

INSTANTIATE_TEST_SUITE_P(
    NkvDtypeBatch, DecodeEqualsEvaluation,
    ::testing::Combine(::testing::Values(4, 2, 1, 0),
                       ::testing::Values(DType::FP8, DType::INT8, DType::INT4),
                       ::testing::Values(1, 3)),
    [](const auto& info) {
      const int64_t nkv = std::get<0>(info.param);
      return (nkv > 0 ? "nkv" + std::to_string(nkv) : std::string("mla")) + "_" +
             dtype_name(std::get<1>(info.param)) + "_batch" +
             std::to_string(std::get<2>(info.param));
    });

// The f32 cache's figure is the model's own loss on those (N, T) windows.
void expect_the_models_loss(GPT& model, const std::vector<int32_t>& x,
                            const std::vector<int32_t>& y, int64_t T, const KVQuality& f32) {
  NoGradGuard no_grad;
  const int64_t N = static_cast<int64_t>(x.size()) / T;
  const double plain =
      model.loss(Tensor::from_vector(x, {N, T}), Tensor::from_vector(y, {N, T})).item();
  EXPECT_NEAR(f32.loss, plain, 1e-5 * plain);
}

// The report's figures: the f32 cache against itself is exact; every dtype's KL is a KL
// (non-negative) and grows as the cache keeps fewer bits; the f32 loss is the model's own
// loss on those windows; bytes per token are the formula's.
TEST(KVQuality, ReportsWhatItSays) {
  auto model = test::random_model(quality_config(2), 31);
  const GPTConfig& c = model->config();
  Generator gen(9);
  const int64_t N = 6, T = 16;
  const std::vector<int32_t> x = test::random_tokens(gen, c.vocab_size, N, T).to_vector<int32_t>();
  const std::vector<int32_t> y = test::random_tokens(gen, c.vocab_size, N, T).to_vector<int32_t>();
  const std::vector<DType> dtypes{DType::F32, DType::BF16, DType::FP8, DType::INT8, DType::INT4};
  const std::vector<KVQuality> q = kv_cache_quality(*model, x, y, T, dtypes, 4);
  ASSERT_EQ(q.size(), dtypes.size());
  EXPECT_EQ(q[0].delta_loss, 0.0);
  EXPECT_EQ(q[0].kl, 0.0);
  EXPECT_EQ(q[0].top1, 1.0);
  expect_the_models_loss(*model, x, y, T, q[0]);
  for (const KVQuality& r : q) {
    EXPECT_GE(r.kl, 0.0) << dtype_name(r.dtype);
    EXPECT_EQ(r.positions, N * T);
    EXPECT_EQ(r.bytes_per_token, kv_bytes_per_token(c.n_layer, c.n_kv_head, c.head_size(), r.dtype));
  }
  EXPECT_LT(q[1].kl, q[3].kl);  // bf16 keeps more bits than int8
  EXPECT_LT(q[3].kl, q[4].kl);  // int8 than int4
  EXPECT_GT(q[4].kl, 0.0);
  EXPECT_THROW(kv_cache_quality(*model, x, y, T + 1, dtypes), Error);
}

// A task's split (MQAR) is measured on its answers alone: whole examples a window, each
// dtype's loss over the scored targets, as many positions as the windows hold answers.
TEST(KVQuality, ATasksSplitIsScoredOnItsAnswers) {
  GPTConfig c = test::tiny_config(2, 32);
  c.vocab_size = 256;
  auto model = test::random_model(c, 5);
  MqarSettings s;
  s.val_examples = 30;
  const ValidationSplit split = validation_split(mqar_corpus(s, 32));
  const std::vector<DType> dtypes{DType::INT8};
  const std::vector<KVQuality> kv = kv_cache_quality_on(*model, split, dtypes, 12);
  EXPECT_EQ(kv[0].positions, 12 * s.pairs);
  EXPECT_TRUE(std::isfinite(kv[0].loss));
  const std::vector<WeightDtype> wdtypes{WeightDtype::Q8_0};
  const std::vector<WeightQuality> w = weight_quality_on(*model, split, wdtypes, 12);
  EXPECT_EQ(w[0].positions, 12 * s.pairs);
  // The same windows as text: every position.
  const ValidationSplit text{split.ids, {}, 0};
  EXPECT_EQ(kv_cache_quality_on(*model, text, dtypes, 12)[0].positions, 12 * 32);
}

// The weights' report: the f32 matrices against themselves are exact and the model's own
// loss, and the model measured is left as it was; each rounding costs something, q4_0 more
// than q8_0 and q8_0 more than bf16, and a decode step reads the matrices in each form's
// bytes (a block of 32: 36 bytes at q8_0 and 20 at q4_0; the q4_0 model's head is q8_0).
TEST(WeightQuality, ReportsWhatItSays) {
  auto model = test::random_model(quality_config(2), 31);
  const GPTConfig& c = model->config();
  const std::vector<float> before = model->blocks[0]->mlp.c_fc.weight.to_vector<float>();
  Generator gen(9);
  const int64_t N = 6, T = 16;
  const std::vector<int32_t> x = test::random_tokens(gen, c.vocab_size, N, T).to_vector<int32_t>();
  const std::vector<int32_t> y = test::random_tokens(gen, c.vocab_size, N, T).to_vector<int32_t>();
  const std::vector<WeightDtype> dtypes{WeightDtype::F32, WeightDtype::BF16, WeightDtype::Q8_0,
                                        WeightDtype::Q4_0};
  const std::vector<WeightQuality> q = weight_quality(*model, x, y, T, dtypes, false, 4);
  ASSERT_EQ(q.size(), dtypes.size());
  EXPECT_EQ(q[0].delta_loss, 0.0);
  EXPECT_EQ(q[0].kl, 0.0);
  EXPECT_EQ(q[0].top1, 1.0);
  EXPECT_EQ(model->blocks[0]->mlp.c_fc.weight.to_vector<float>(), before);
  EXPECT_GT(q[1].kl, 0.0);
  EXPECT_LT(q[1].kl, q[2].kl);
  EXPECT_LT(q[2].kl, q[3].kl);
  for (const WeightQuality& r : q) EXPECT_EQ(r.positions, N * T);
  if (cpu::packed_weight_bytes(WeightDtype::F32, 1, 1) == 0) return;  // nothing packed
  const int64_t head = model->lm_head_weight().numel();
  const int64_t matrices = (q[0].decode_weight_bytes - q[1].decode_weight_bytes) / 2;  // bf16's half
  EXPECT_EQ(q[0].decode_weight_bytes - q[2].decode_weight_bytes, matrices * 4 - matrices / 32 * 36);
  EXPECT_EQ(q[0].decode_weight_bytes - q[3].decode_weight_bytes,
            (matrices - head) * 4 - (matrices - head) / 32 * 20 + head * 4 - head / 32 * 36);
}

// Position by position through the fused decode step, the exact products give the cached
// prefill's logits (within the float rounding of other product heights); with integer
// products the q8_0 and q4_0 rows are scored that way, and their rounding of the activations
// costs more than the exact rows' (q8_0: the weights' own rounding is small beside it).
TEST(WeightQuality, IntegerProductsAreScoredStepByStep) {
  auto model = test::random_model(quality_config(2), 31);
  const GPTConfig c = model->config();  // a copy: the model is made again below
  Generator gen(9);
  const int64_t N = 6, T = 16;
  const Tensor tokens = test::random_tokens(gen, c.vocab_size, N, T);
  model->round_matrices(WeightDtype::Q8_0);
  const std::vector<float> prefill = cached_prefill_logits(*model, tokens, DType::F32).to_vector<float>();
  const std::vector<float> steps = stepwise_logits(*model, tokens, false).to_vector<float>();
  ASSERT_EQ(steps.size(), prefill.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(steps[i] - prefill[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(prefill[i])));
  }
  EXPECT_LE(worst, 1e-5 * scale);
  if (cpu::packed_weight_bytes(WeightDtype::Q8_0, 32, 32) == 0) return;  // no integer kernel
  model = test::random_model(quality_config(2), 31);
  const std::vector<int32_t> x = tokens.to_vector<int32_t>();
  const std::vector<int32_t> y = test::random_tokens(gen, c.vocab_size, N, T).to_vector<int32_t>();
  const std::vector<WeightDtype> dtypes{WeightDtype::BF16, WeightDtype::Q8_0, WeightDtype::Q4_0};
  const std::vector<WeightQuality> exact = weight_quality(*model, x, y, T, dtypes, false, 4);
  const std::vector<WeightQuality> int8 = weight_quality(*model, x, y, T, dtypes, true, 4);
  EXPECT_FALSE(int8[0].int8_products);  // bf16 has no integer products
  EXPECT_EQ(int8[0].kl, exact[0].kl);
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_TRUE(int8[i].int8_products);
    EXPECT_FALSE(exact[i].int8_products);
    EXPECT_GT(int8[i].kl, exact[i].kl) << weight_dtype_name(dtypes[i]);
    EXPECT_EQ(int8[i].decode_weight_bytes, exact[i].decode_weight_bytes);
  }
}

// MLA's latent cache through the same report: the f32 latent cache against itself is exact
// and is the model's own loss; bf16, fp8, int8 and int4 latents cost something, int8 and int4
// each more than the one with more bits, fp8 more than bf16; bytes per token are one latent
// row a layer (R + D values), which is what the cache the report reads through takes (fp8's
// one scale a layer aside).
TEST(KVQuality, MlaReadsItsLatentCache) {
  GPTConfig mc = test::tiny_config(4, 24, "mla");
  mc.kv_lora_rank = 28;  // R + D = 32: int4's groups and the row kernels' widths
  auto model = test::random_model(mc, 37);
  const GPTConfig& c = model->config();
  Generator gen(10);
  const int64_t N = 5, T = 16;
  const std::vector<int32_t> x = test::random_tokens(gen, c.vocab_size, N, T).to_vector<int32_t>();
  const std::vector<int32_t> y = test::random_tokens(gen, c.vocab_size, N, T).to_vector<int32_t>();
  const std::vector<DType> dtypes{DType::F32, DType::BF16, DType::FP8, DType::INT8, DType::INT4};
  const std::vector<KVQuality> q = kv_cache_quality(*model, x, y, T, dtypes, 2);
  EXPECT_EQ(q[0].kl, 0.0);
  expect_the_models_loss(*model, x, y, T, q[0]);
  for (const KVQuality& r : q) {
    const std::vector<float> scales = kv_cache_scales(*model, r.dtype);
    ContiguousKVCache cache(c.n_layer, 1, T, 1, c.cache_width(), r.dtype, Device::CPU, scales,
                            true);
    EXPECT_EQ(r.bytes_per_token * T + 4 * static_cast<int64_t>(scales.size()), cache.bytes())
        << dtype_name(r.dtype);
    EXPECT_EQ(r.bytes_per_token, c.n_layer * kv_row_bytes(r.dtype, 32)) << dtype_name(r.dtype);
    EXPECT_EQ(kv_cache_formula_bytes(c, 1, T, r.dtype), cache.bytes()) << dtype_name(r.dtype);
  }
  EXPECT_GT(q[1].kl, 0.0);
  EXPECT_LT(q[1].kl, q[2].kl);
  EXPECT_LT(q[1].kl, q[3].kl);
  EXPECT_LT(q[3].kl, q[4].kl);
}

// fp8_kv_scales bounds every key and value the model caches (so none saturates): GPT-2's
// block, llama's (RMSNorm, rotated keys) and MLA's latent rows, on random tokens, the
// norms' gains scaled up so that values are far from zero (MLA's latent norm's the most, so
// that its bound, not the rotary key's, sets the scale). MLA's two scales a layer are
// equal: one latent row is its key and its value.
TEST(KVQuality, Fp8ScalesBoundEveryCachedValue) {
  for (const std::string arch : {"gpt2", "llama", "mla"}) {
    auto model = test::random_model(test::tiny_config(arch == "mla" ? 4 : 2, 24, arch), 41);
    const GPTConfig& c = model->config();
    NoGradGuard no_grad;
    for (auto& [name, t] : model->named_parameters())
      if (name.ends_with("ln_1.weight") || name.ends_with("kv_norm.weight")) {
        Generator g(hash64(7, name.size()));
        Tensor p = t;
        normal_(p, g, name.ends_with("kv_norm.weight") ? 30.0 : 3.0);  // the latent's bound leads
      }
    const std::vector<float> scales = fp8_kv_scales(*model);
    const int64_t NKV = c.cache_heads(), W = c.cache_width(), B = 3, T = 24;
    ASSERT_EQ(scales.size(), static_cast<size_t>(2 * c.n_layer * NKV)) << arch;
    ContiguousKVCache cache(c.n_layer, B, T, NKV, W, DType::F32, Device::CPU, {}, c.mla());
    Generator gen(3);
    model->forward(test::random_tokens(gen, c.vocab_size, B, T), &cache);
    double tightest = 0;  // the largest |value| / bound over every head
    for (int l = 0; l < c.n_layer; ++l)
      for (int which = 0; which < 2; ++which) {
        const std::vector<float> v =
            (which == 0 ? cache.k_buffer(l) : cache.v_buffer(l)).to_vector<float>();
        for (int64_t h = 0; h < NKV; ++h) {
          const float s = scales[static_cast<size_t>((l * 2 + which) * NKV + h)];
          if (c.mla()) {
            EXPECT_EQ(s, scales[static_cast<size_t>((l * 2 + 1 - which) * NKV + h)]);
          }
          double top = 0;
          for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < T * W; ++i)
              top = std::max(top,
                             double(std::fabs(v[static_cast<size_t>((b * NKV + h) * T * W + i)])));
          EXPECT_LE(top, 448.0 * s) << arch << " layer " << l << (which ? " values" : " keys");
          tightest = std::max(tightest, top / (448.0 * s));
        }
      }
    EXPECT_GT(tightest, 0.02) << arch << ": the bound is far looser than the values";
  }
}

// A model trained briefly on text with structure: greedy decoding with an int8 cache gives the
// f32 cache's tokens for the first 32 (the paged cache, prompts of several lengths, batched).
TEST(KVQuality, GreedyTextWithAnInt8CacheIsF32s) {
  GPTConfig c = test::tiny_config(2, 64);
  c.n_embd = 64;
  auto model = std::make_unique<GPT>(c, 3);
  const Tokenizer tok = test::tiny_tokenizer();
  // "abc defg hij" patterns with a counter's digits spelled as letters: predictable, not
  // periodic in a few characters.
  std::string text;
  for (int i = 0; text.size() < 6000; ++i)
    text += std::string("abc ") + char('a' + i % 10) + char('a' + (i / 10) % 10) + " defg hij ";
  const std::vector<int32_t> ids = tok.encode(text);
  test::train_briefly(*model, ids, 250, 8, c.block_size);
  const std::vector<std::string> prompts{"abc ba defg", "hij abc c", "defg hij abc dd defg h"};
  GenerateOptions greedy;
  greedy.max_new_tokens = 32;
  greedy.sampling.temperature = 0;
  Engine f32(*model, tok, DType::F32);
  Engine int8(*model, tok, DType::INT8);
  const GenerationResult a = f32.generate(prompts, greedy), b = int8.generate(prompts, greedy);
  for (size_t p = 0; p < prompts.size(); ++p) {
    ASSERT_EQ(a.rows[p].tokens.size(), 32u);
    EXPECT_EQ(b.rows[p].tokens, a.rows[p].tokens) << prompts[p] << ": " << a.rows[p].text
                                                  << " | " << b.rows[p].text;
  }
}

}  // namespace
}  // namespace kvlab
