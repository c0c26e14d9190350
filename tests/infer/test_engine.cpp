#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <tuple>

#include "autograd/backend/allocator.h"
#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/graph.h"
#include "checkpoints/model_io.h"
#include "infer/engine.h"
#include "infer/measure/bench.h"
#include "infer_test_util.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

using test::tiny_model;
using test::tiny_tokenizer;

std::vector<int32_t> random_ids(int64_t n, uint64_t seed, int64_t V = 11) {
  Generator g(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = static_cast<int32_t>(g.below(static_cast<uint64_t>(V)));
  return ids;
}

GenerateOptions greedy(int64_t max_new, bool use_cache = true) {
  GenerateOptions o;
  o.max_new_tokens = max_new;
  o.sampling.temperature = 0;
  o.use_cache = use_cache;
  return o;
}

// Logits of a full recompute (no cache) of `window`, last position only.
std::vector<float> recompute(GPT& model, std::span<const int32_t> window) {
  const Tensor t = Tensor::from_vector(std::vector<int32_t>(window.begin(), window.end()),
                                       {1, static_cast<int64_t>(window.size())});
  return model.forward(t, nullptr, true).to_vector<float>();
}

template <class F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    FAIL() << "no error, expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// ---- cache equals recompute --------------------------------------------------------------

// (n_kv_head, prompt lengths of the batch's rows, block: gpt2 or llama, the matrices' dtype).
// With RoPE the keys are cached rotated, so a row continuing at the wrong position fails here.
// With q8_0 or q4_0 matrices the cached decode reads the packed blocks and the recompute the
// rounded f32 weights: the same values, so the same bound.
using CacheCase = std::tuple<int64_t, std::vector<int64_t>, std::string, WeightDtype>;
class CacheEqualsRecompute : public ::testing::TestWithParam<CacheCase> {};

TEST_P(CacheEqualsRecompute, AtEveryStepAndSameGreedyText) {
  const auto& [nkv, lengths, arch, weights] = GetParam();
  // Seed 2 for llama: random weights that, greedily decoded, do not repeat one token.
  auto model = tiny_model(nkv, arch == "llama" ? 2 : 7, 16, arch);
  model->round_matrices(weights);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t b = 0; b < lengths.size(); ++b) prompts.push_back(random_ids(lengths[b], 10 + b));

  GenerateOptions o = greedy(16);  // prompts of 1 reach the context limit at 16 new tokens
  int64_t checks = 0;
  double worst = 0, scale = 0;
  o.on_logits = [&](int64_t, std::span<const int32_t> window, std::span<const float> logits) {
    const std::vector<float> ref = recompute(*model, window);
    ASSERT_EQ(ref.size(), logits.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::fabs(ref[i] - logits[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(ref[i])));
    }
    ++checks;
  };
  const GenerationResult cached = engine.generate_ids(prompts, o);
  // The cache's products have other heights than the recompute's, so f32 rounding differs.
  // SwiGLU multiplies two projections, so the random llama's activations and their rounding
  // are larger; a key at the wrong position moves the logits by O(1).
  EXPECT_LE(worst, arch == "llama" ? 2e-5 : 1e-5) << "logit scale " << scale;
  int64_t expected_checks = 0;
  for (const auto& r : cached.rows) expected_checks += static_cast<int64_t>(r.tokens.size());
  EXPECT_EQ(checks, expected_checks);

  const GenerationResult plain = engine.generate_ids(prompts, greedy(16, false));
  ASSERT_EQ(cached.rows.size(), plain.rows.size());
  for (size_t b = 0; b < prompts.size(); ++b) {
    const auto& c = cached.rows[b];
    EXPECT_EQ(c.tokens, plain.rows[b].tokens) << "row " << b;
    EXPECT_EQ(c.text, plain.rows[b].text) << "row " << b;
    EXPECT_EQ(c.text, tok.decode(c.tokens));
    // 16 new tokens, or the context limit: prompt + generated = block_size + 1.
    const int64_t P = lengths[b];
    const int64_t expect = std::min<int64_t>(16, 16 - P + 1);
    EXPECT_EQ(static_cast<int64_t>(c.tokens.size()), expect) << "row " << b;
    EXPECT_EQ(c.stop_reason, P + 16 > 17 ? StopReason::ContextLimit : StopReason::MaxNewTokens);
    EXPECT_EQ(c.stop_reason, plain.rows[b].stop_reason);
  }
  // Non-trivial text: the model does not emit one token forever.
  std::set<int32_t> distinct(cached.rows[0].tokens.begin(), cached.rows[0].tokens.end());
  if (cached.rows[0].tokens.size() > 8) {
    EXPECT_GT(distinct.size(), 1u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    NkvBatchPrompt, CacheEqualsRecompute,
    ::testing::Combine(::testing::Values(4, 2, 1),
                       ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{7},
                                         std::vector<int64_t>{15}, std::vector<int64_t>{1, 7, 15},
                                         std::vector<int64_t>{15, 1, 7, 7}),
                       ::testing::Values("gpt2", "llama"), ::testing::Values(WeightDtype::F32)));
INSTANTIATE_TEST_SUITE_P(
    QuantisedMatrices, CacheEqualsRecompute,
    ::testing::Combine(::testing::Values(2), ::testing::Values(std::vector<int64_t>{1, 7, 15}),
                       ::testing::Values("gpt2", "llama"),
                       ::testing::Values(WeightDtype::Q8_0, WeightDtype::Q4_0)));

// ---- paged cache equals contiguous ------------------------------------------------------

// Every row's logits at every step (row, then step order).
struct PagedRun {
  GenerationResult result;
  std::vector<std::vector<float>> logits;
};

PagedRun run_engine(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
               GenerateOptions o) {
  PagedRun run;
  std::vector<std::vector<std::vector<float>>> per_row(prompts.size() *
                                                      static_cast<size_t>(o.n));
  o.on_logits = [&](int64_t r, std::span<const int32_t>, std::span<const float> l) {
    per_row[static_cast<size_t>(r)].emplace_back(l.begin(), l.end());
  };
  run.result = engine.generate_ids(prompts, o);
  for (auto& row : per_row)
    for (auto& l : row) run.logits.push_back(std::move(l));
  return run;
}

void expect_same_generation(const PagedRun& paged, const PagedRun& contiguous, double tol) {
  ASSERT_EQ(paged.result.rows.size(), contiguous.result.rows.size());
  for (size_t b = 0; b < paged.result.rows.size(); ++b) {
    EXPECT_EQ(paged.result.rows[b].tokens, contiguous.result.rows[b].tokens) << "row " << b;
    EXPECT_EQ(paged.result.rows[b].text, contiguous.result.rows[b].text) << "row " << b;
    EXPECT_EQ(paged.result.rows[b].stop_reason, contiguous.result.rows[b].stop_reason);
    EXPECT_EQ(paged.result.rows[b].slides, contiguous.result.rows[b].slides);
  }
  ASSERT_EQ(paged.logits.size(), contiguous.logits.size());
  double worst = 0;
  for (size_t i = 0; i < paged.logits.size(); ++i)
    for (size_t j = 0; j < paged.logits[i].size(); ++j)
      worst = std::max(worst, static_cast<double>(
                                  std::fabs(paged.logits[i][j] - contiguous.logits[i][j])));
  EXPECT_LE(worst, tol);
}

double logit_scale(const PagedRun& run) {
  double scale = 0;
  for (const auto& l : run.logits)
    for (const float x : l) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  return scale;
}

// (n_kv_head, prompt lengths, cache dtype, block): a context of 64 in blocks of 16 positions,
// so that prompts end before, on and after block boundaries and decoding crosses them; batches
// of 1, 3 and 8 rows.
// (The matrices' dtype last: q8_0 and q4_0 ones read packed by every decode step.)
using PagedCase = std::tuple<int64_t, std::vector<int64_t>, DType, std::string, WeightDtype>;
class PagedEqualsContiguous : public ::testing::TestWithParam<PagedCase> {};

// int8_products: both engines' decode steps multiply the q8_0/q4_0 matrices in integers.
void expect_paged_equals_contiguous(int64_t nkv, const std::vector<int64_t>& lengths, DType dtype,
                                    const std::string& arch, WeightDtype weights,
                                    bool int8_products) {
  auto model = tiny_model(nkv, 7, 64, arch);
  model->round_matrices(weights);
  const Tokenizer tok = tiny_tokenizer();
  Engine contiguous(*model, tok, dtype, std::nullopt);
  // Prefix caching off: the second generation below must compute what the first did.
  Engine paged(*model, tok, dtype, PagedCacheOptions{.prefix_caching = false});
  contiguous.decode_step().int8_products = paged.decode_step().int8_products = int8_products;
  std::vector<std::vector<int32_t>> prompts;
  for (size_t b = 0; b < lengths.size(); ++b) prompts.push_back(random_ids(lengths[b], 30 + b));
  const PagedRun c = run_engine(contiguous, prompts, greedy(20));
  const PagedRun p = run_engine(paged, prompts, greedy(20));
  // A prefill's attention reads the keys block by block, so its sums are split differently
  // from the contiguous cache's: within 1e-6 of the logits' scale. A bf16 cache may then
  // round a later layer's key to the neighbouring bf16 value: within 1e-5 of it.
  const double tol = (dtype == DType::BF16 ? 1e-5 : 1e-6) * logit_scale(c);
  expect_same_generation(p, c, tol);
  // Rows leave the batch as they finish: the paged cache then holds no more than the
  // contiguous one at its fullest, rounded up to whole blocks per row.
  const int64_t B = static_cast<int64_t>(prompts.size()), S = c.result.stats.cache_capacity;
  EXPECT_GT(p.result.stats.cache_bytes, 0);
  EXPECT_LE(p.result.stats.cache_bytes,
            c.result.stats.cache_bytes / (B * S) * B * ((S + 15) / 16 * 16));
  // Reused for a second generation: its rows start empty again.
  expect_same_generation(run_engine(paged, prompts, greedy(5)),
                         run_engine(contiguous, prompts, greedy(5)), tol);
  if (int8_products) {  // and they were integer products, not the exact ones
    Engine exact(*model, tok, dtype, std::nullopt);
    EXPECT_NE(run_engine(exact, prompts, greedy(20)).logits, c.logits);
  }
}

TEST_P(PagedEqualsContiguous, SameGreedyTextTokensAndLogits) {
  const auto& [nkv, lengths, dtype, arch, weights] = GetParam();
  expect_paged_equals_contiguous(nkv, lengths, dtype, arch, weights, false);
}

// A row's integer products depend on that row alone (cpu::gemm_packed_int8), so the paged
// cache's batches give the contiguous one's results within the same bound (the cases of
// QuantisedMatrices below).
TEST(Engine, PagedEqualsContiguousWithIntegerProducts) {
  if (cpu::packed_weight_bytes(WeightDtype::Q8_0, 8, 32) == 0)
    GTEST_SKIP() << "no packed kernel in this build: no integer products";
  for (const std::string arch : {"gpt2", "llama"})
    for (const DType dtype : {DType::F32, DType::BF16})
      for (const WeightDtype weights : {WeightDtype::Q8_0, WeightDtype::Q4_0}) {
        SCOPED_TRACE(arch + " " + dtype_name(dtype) + " cache, " + weight_dtype_name(weights));
        expect_paged_equals_contiguous(2, {33, 1, 16, 17, 15, 33, 16, 17}, dtype, arch, weights,
                                       true);
      }
}

INSTANTIATE_TEST_SUITE_P(
    NkvBatchDtype, PagedEqualsContiguous,
    ::testing::Combine(::testing::Values(4, 2, 1),
                       ::testing::Values(std::vector<int64_t>{1}, std::vector<int64_t>{15, 16, 17},
                                         std::vector<int64_t>{33, 1, 16, 17, 15, 33, 16, 17}),
                       ::testing::Values(DType::F32, DType::BF16),
                       ::testing::Values("gpt2", "llama"), ::testing::Values(WeightDtype::F32)));
INSTANTIATE_TEST_SUITE_P(
    QuantisedMatrices, PagedEqualsContiguous,
    ::testing::Combine(::testing::Values(2),
                       ::testing::Values(std::vector<int64_t>{33, 1, 16, 17, 15, 33, 16, 17}),
                       ::testing::Values(DType::F32, DType::BF16),
                       ::testing::Values("gpt2", "llama"),
                       ::testing::Values(WeightDtype::Q8_0, WeightDtype::Q4_0)));

TEST(Engine, PagedCacheSlidesLikeTheContiguousOne) {
  for (const std::string arch : {"gpt2", "llama"})
  for (const int64_t nkv : {4, 1}) {
    SCOPED_TRACE(arch);
    auto model = tiny_model(nkv, 7, 16, arch);
    const Tokenizer tok = tiny_tokenizer();
    Engine contiguous(*model, tok, DType::F32, std::nullopt);
    Engine paged(*model, tok, DType::F32,
                 PagedCacheOptions{.kv_block_size = 8, .prefix_caching = false});
    GenerateOptions o = greedy(30);
    o.slide = true;
    const std::vector<std::vector<int32_t>> prompts = {random_ids(7, 1), random_ids(2, 2),
                                                       random_ids(20, 3)};
    const PagedRun p = run_engine(paged, prompts, o);
    const PagedRun c = run_engine(contiguous, prompts, o);
    expect_same_generation(p, c, 1e-6 * logit_scale(c));
    EXPECT_GT(p.result.rows[0].slides, 0);
  }
}

// MLA caches one latent row a position (rank + rotary width values, for keys and values alike)
// and attends in latent form, the up-projections folded into the queries and the output: every
// step's logits equal the recomputation's, which rebuilds every head's keys and values (the
// expanded form), for batch 1 and 3, on both caches (blocks of 4: prompts and decoding cross
// their boundaries), in bf16, and with biases (the key bias drops out of the folded queries,
// the value bias is added to the output), and the cache measures the latent's bytes.
TEST(Engine, MlaLatentCacheEqualsTheExpandedRecompute) {
  const int64_t R = 12, D = 4, L = 2;  // R + D differs from a head's key width, 8 + D
  for (const bool paged : {false, true})
    for (const auto& lengths : {std::vector<int64_t>{5}, std::vector<int64_t>{7, 2, 12}})
      for (const DType dtype : {DType::F32, DType::BF16})
        for (const bool bias : {false, true}) {
          SCOPED_TRACE(::testing::Message() << (paged ? "paged" : "contiguous") << " batch "
                                            << lengths.size() << " " << dtype_name(dtype)
                                            << (bias ? " biases" : ""));
          // With biases, the queries compressed too.
          GPTConfig cfg = test::tiny_config(4, 16, bias ? "mla_q" : "mla");
          cfg.bias = bias;
          auto model = test::random_model(cfg, 5);
          const Tokenizer tok = tiny_tokenizer();
          Engine engine(*model, tok, dtype,
                        paged ? std::optional(PagedCacheOptions{.kv_block_size = 4})
                              : std::nullopt);
          std::vector<std::vector<int32_t>> prompts;
          for (size_t b = 0; b < lengths.size(); ++b)
            prompts.push_back(random_ids(lengths[b], 40 + b));
          GenerateOptions o = greedy(12);
          double worst = 0, scale = 0;
          int64_t checks = 0;
          o.on_logits = [&](int64_t, std::span<const int32_t> window,
                            std::span<const float> logits) {
            const std::vector<float> ref = recompute(*model, window);
            for (size_t i = 0; i < ref.size(); ++i) {
              worst = std::max(worst, static_cast<double>(std::fabs(ref[i] - logits[i])));
              scale = std::max(scale, static_cast<double>(std::fabs(ref[i])));
            }
            ++checks;
          };
          const GenerationResult r = engine.generate_ids(prompts, o);
          int64_t made = 0;
          for (const auto& row : r.rows) made += static_cast<int64_t>(row.tokens.size());
          EXPECT_EQ(checks, made);
          EXPECT_GE(made, 5 * static_cast<int64_t>(lengths.size()));
          // bf16 rounds the cached latents: the logits move by about its precision.
          EXPECT_LE(worst, (dtype == DType::BF16 ? 2e-2 : 1e-5) * scale) << "scale " << scale;
          if (!paged) {  // the whole allocation: every row's capacity of latent rows
            const int64_t S = r.stats.cache_capacity, B = static_cast<int64_t>(lengths.size());
            EXPECT_EQ(engine.cache()->bytes(),
                      L * B * S * (R + D) * static_cast<int64_t>(dtype_size(dtype)));
          }
        }
}

// A naive double-precision forward of a llama-block model (RoPE, RMSNorm, SwiGLU, no biases;
// grouped-query or MLA attention, MLA's keys and values expanded per head) over a whole
// sequence in which token s attends to tokens start[s] .. s at their own positions: a sliding
// window recomputed from scratch, sharing no code with the engine. Every position's logits.
std::vector<std::vector<double>> sliding_window_logits(const GPT& m,
                                                       const std::vector<int32_t>& ids,
                                                       const std::vector<int64_t>& start) {
  const GPTConfig& c = m.config();
  const auto T = static_cast<int64_t>(ids.size());
  const int64_t C = c.n_embd, NH = c.n_head, NKV = c.n_kv_head, HS = c.head_size();
  const int64_t H = c.hidden(), V = c.vocab_size, G = NH / NKV, KVD = NKV * HS;
  const int64_t R = c.kv_lora_rank, D = c.rope_head_dim;
  const int64_t QW = c.mla() ? HS + D : HS;  // a query's and a key's width
  using Vec = std::vector<double>;
  auto weights = [](const Tensor& t) {
    const std::vector<float> f = t.contiguous().to_vector<float>();
    return Vec(f.begin(), f.end());
  };
  auto matvec = [](const Vec& W, const Vec& x, int64_t out) {  // W (out, in) x
    const auto in = static_cast<int64_t>(x.size());
    Vec y(static_cast<size_t>(out), 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[o] += W[o * in + i] * x[i];
    return y;
  };
  auto rms = [](const Vec& x, const Vec& g) {
    double ms = 0;
    for (double v : x) ms += v * v / static_cast<double>(x.size());
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] / std::sqrt(ms + 1e-5) * g[i];
    return y;
  };
  auto rotate = [&](double* v, int64_t w, int64_t p) {  // halves form: pair (j, j + w / 2)
    for (int64_t j = 0; j < w / 2; ++j) {
      const double a = static_cast<double>(p) * std::pow(c.rope_theta, -2.0 * j / w);
      const double x1 = v[j], x2 = v[j + w / 2];
      v[j] = x1 * std::cos(a) - x2 * std::sin(a);
      v[j + w / 2] = x2 * std::cos(a) + x1 * std::sin(a);
    }
  };
  const Vec wte = weights(m.wte.weight);
  std::vector<Vec> x(static_cast<size_t>(T));
  for (int64_t s = 0; s < T; ++s)
    x[s].assign(wte.begin() + ids[s] * C, wte.begin() + (ids[s] + 1) * C);
  for (const auto& blk : m.blocks) {
    const Vec g1 = weights(blk->ln_1.weight), g2 = weights(blk->ln_2.weight);
    const Vec wg = weights(blk->mlp.c_fc.weight), wu = weights(blk->mlp.c_up->weight);
    const Vec wd = weights(blk->mlp.c_proj.weight);
    // Per position: NH queries of QW, and the heads' keys (QW) and values (HS).
    std::vector<Vec> q(T), k(T), v(T);
    Vec wo;
    if (c.mla()) {
      const LatentAttention& a = *blk->mla;
      const Vec wq = weights(a.q_proj.weight), wdown = weights(a.kv_down.weight);
      const Vec gkv = weights(a.kv_norm.weight), wup = weights(a.kv_up.weight);
      const Vec wqd = a.q_down ? weights(a.q_down->weight) : Vec();
      const Vec gq = a.q_down ? weights(a.q_norm->weight) : Vec();
      wo = weights(a.c_proj.weight);
      for (int64_t s = 0; s < T; ++s) {
        const Vec h = rms(x[s], g1);
        q[s] = matvec(wq, a.q_down ? rms(matvec(wqd, h, c.q_lora_rank), gq) : h, NH * QW);
        for (int64_t hd = 0; hd < NH; ++hd) rotate(q[s].data() + hd * QW + HS, D, s);
        Vec kv = matvec(wdown, h, R + D);
        rotate(kv.data() + R, D, s);
        const Vec up = matvec(wup, rms(Vec(kv.begin(), kv.begin() + R), gkv), NH * 2 * HS);
        for (int64_t hd = 0; hd < NH; ++hd) {
          const auto at = up.begin() + hd * 2 * HS;
          k[s].insert(k[s].end(), at, at + HS);
          k[s].insert(k[s].end(), kv.begin() + R, kv.end());
          v[s].insert(v[s].end(), at + HS, at + 2 * HS);
        }
      }
    } else {
      const CausalSelfAttention& a = *blk->attn;
      const Vec wq = weights(a.q_proj.weight), wk = weights(a.k_proj.weight);
      const Vec wv = weights(a.v_proj.weight);
      wo = weights(a.c_proj.weight);
      for (int64_t s = 0; s < T; ++s) {
        const Vec h = rms(x[s], g1);
        q[s] = matvec(wq, h, C);
        k[s] = matvec(wk, h, KVD);
        v[s] = matvec(wv, h, KVD);
        for (int64_t hd = 0; hd < NH; ++hd) rotate(q[s].data() + hd * HS, HS, s);
        for (int64_t g = 0; g < NKV; ++g) rotate(k[s].data() + g * HS, HS, s);
      }
    }
    for (int64_t s = 0; s < T; ++s) {
      Vec y(static_cast<size_t>(C), 0.0);
      for (int64_t h = 0; h < NH; ++h) {
        const int64_t g = c.mla() ? h : h / G;
        Vec score;
        double top = -1e300;
        for (int64_t j = start[s]; j <= s; ++j) {
          double d = 0;
          for (int64_t i = 0; i < QW; ++i) d += q[s][h * QW + i] * k[j][g * QW + i];
          score.push_back(d / std::sqrt(static_cast<double>(QW)));
          top = std::max(top, score.back());
        }
        double sum = 0;
        for (double& e : score) sum += (e = std::exp(e - top));
        for (int64_t j = start[s]; j <= s; ++j)
          for (int64_t i = 0; i < HS; ++i)
            y[h * HS + i] += score[j - start[s]] / sum * v[j][g * HS + i];
      }
      const Vec o = matvec(wo, y, C);
      for (int64_t i = 0; i < C; ++i) x[s][i] += o[i];
    }
    for (int64_t s = 0; s < T; ++s) {
      const Vec h = rms(x[s], g2), gate = matvec(wg, h, H), up = matvec(wu, h, H);
      Vec a(static_cast<size_t>(H));
      for (int64_t i = 0; i < H; ++i) a[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
      const Vec o = matvec(wd, a, C);
      for (int64_t i = 0; i < C; ++i) x[s][i] += o[i];
    }
  }
  const Vec gf = weights(m.ln_f.weight), head = weights(m.lm_head_weight());
  std::vector<Vec> logits;
  for (int64_t s = 0; s < T; ++s) logits.push_back(matvec(head, rms(x[s], gf), V));
  return logits;
}

// Past the context with RoPE, cached: each token attends to the positions its row's cache
// kept, which drops its oldest `drop` whenever it holds block_size and a token is to be fed.
// Token s's first visible position, for a row prefilled with P tokens.
std::vector<int64_t> rolling_starts(int64_t P, int64_t n, int64_t block, int64_t drop) {
  std::vector<int64_t> start(static_cast<size_t>(n), 0);
  int64_t first = 0;
  for (int64_t s = P; s < n; ++s) {
    if (s - first == block) first += drop;
    start[static_cast<size_t>(s)] = first;
  }
  return start;
}

// A RoPE model slides on past its context without re-prefilling: every token's logits are the
// naive sliding-window recompute's, for every n_kv_head and for MLA's latent cache (queries
// compressed too; it decodes op by op), a batch of 3 whose rows slide at different steps (one
// prompt longer than the context), both caches (blocks of 4: drops free whole blocks) and both
// decode paths, with positions far past block_size.
TEST(Engine, RopeSlideEqualsASlidingWindowRecompute) {
  const int64_t block = 16, max_new = 40;
  const std::vector<std::vector<int32_t>> prompts = {random_ids(7, 1), random_ids(2, 2),
                                                     random_ids(20, 3)};
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"llama", 4}, {"llama", 2}, {"llama", 1}, {"mla_q", 4}};
  for (const auto& [arch, nkv] : cases)
    for (const bool paged : {false, true})
      for (const bool fused : {true, false}) {
        SCOPED_TRACE(::testing::Message() << arch << " nkv " << nkv
                                          << (paged ? " paged" : " contiguous")
                                          << (fused ? " fused" : " op by op"));
        auto model = tiny_model(nkv, 9, block, arch);
        const Tokenizer tok = tiny_tokenizer();
        Engine engine(*model, tok, DType::F32,
                      paged ? std::optional(PagedCacheOptions{.kv_block_size = 4})
                            : std::nullopt);
        engine.decode_step().enabled = fused;
        EXPECT_EQ(engine.slide_drop(), paged ? 4 : 8);
        GenerateOptions o = greedy(max_new);
        o.slide = true;
        std::vector<std::vector<std::vector<float>>> seen(prompts.size());
        o.on_logits = [&](int64_t r, std::span<const int32_t>, std::span<const float> logits) {
          seen[static_cast<size_t>(r)].emplace_back(logits.begin(), logits.end());
        };
        const GenerationResult res = engine.generate_ids(prompts, o);
        double worst = 0, window_matters = 0;
        for (size_t r = 0; r < prompts.size(); ++r) {
          const auto& row = res.rows[r];
          ASSERT_EQ(seen[r].size(), static_cast<size_t>(max_new));
          EXPECT_GT(row.slides, 0);
          // What the row was prefilled with: a longer prompt's last block_size - 1 tokens.
          const auto P = static_cast<int64_t>(std::min<size_t>(prompts[r].size(), block - 1));
          std::vector<int32_t> seq(prompts[r].end() - P, prompts[r].end());
          seq.insert(seq.end(), row.tokens.begin(), row.tokens.end());
          const auto n = static_cast<int64_t>(seq.size());
          const auto ref =
              sliding_window_logits(*model, seq, rolling_starts(P, n, block, engine.slide_drop()));
          const auto whole = sliding_window_logits(*model, seq, std::vector<int64_t>(n, 0));
          for (int64_t k = 0; k < max_new; ++k)
            for (size_t i = 0; i < seen[r][k].size(); ++i) {
              const size_t s = static_cast<size_t>(P - 1 + k);
              worst = std::max(worst, std::fabs(ref[s][i] - seen[r][k][i]));
              window_matters = std::max(window_matters, std::fabs(whole[s][i] - ref[s][i]));
            }
        }
        EXPECT_LE(worst, 1e-4);
        // The reference tells windows apart: attending to the whole history differs.
        EXPECT_GT(window_matters, 1e-2);
      }
}

// Without a cache there is nothing to go on from: a RoPE model's slide re-prefills, so each
// token's logits are the recomputation of the window it was conditioned on, at positions 0 ..
TEST(Engine, RopeSlideWithoutCacheRecomputesTheWindow) {
  auto model = tiny_model(2, 9, 16, "llama");
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  GenerateOptions o = greedy(30, false);
  o.slide = true;
  double worst = 0;
  int64_t checks = 0;
  o.on_logits = [&](int64_t, std::span<const int32_t> window, std::span<const float> logits) {
    EXPECT_LE(static_cast<int64_t>(window.size()), 16);
    const std::vector<float> ref = recompute(*model, window);
    for (size_t i = 0; i < ref.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(ref[i] - logits[i])));
    ++checks;
  };
  const GenerationResult r = engine.generate_ids({random_ids(7, 1), random_ids(20, 3)}, o);
  EXPECT_EQ(worst, 0.0);
  EXPECT_EQ(checks, 60);
  for (const auto& row : r.rows) EXPECT_GT(row.slides, 0);
}

// n samples of a prompt: forks of its one prefill. Each equals the row of a run given the
// prompt n times (same seeds, so the same draws), whatever its siblings write.
TEST(Engine, ForkedSamplesEqualIndependentRowsAndShareThePromptsBlocks) {
  for (const int64_t nkv : {4, 1}) {
    SCOPED_TRACE(nkv);
    auto model = tiny_model(nkv);
    const Tokenizer tok = tiny_tokenizer();
    Engine paged(*model, tok, DType::F32, PagedCacheOptions{.kv_block_size = 4});
    Engine contiguous(*model, tok, DType::F32, std::nullopt);
    const std::vector<int32_t> prompt = random_ids(9, 8);
    const int64_t N = 4, P = 9, bs = 4, shared = P / bs;
    GenerateOptions o;
    o.max_new_tokens = 6;
    o.sampling.temperature = 1.5;  // the samples diverge
    o.sampling.seed = 5;
    GenerateOptions forked = o;
    forked.n = N;
    std::vector<int64_t> in_use;
    forked.on_decode_step = [&](int64_t) { in_use.push_back(paged.block_stats()->in_use); };
    const PagedRun f = run_engine(paged, {prompt}, forked);
    const PagedRun independent = run_engine(contiguous, {prompt, prompt, prompt, prompt}, o);
    // The fork's rows and the independent ones prefill the prompt in GEMMs of different
    // heights: the same sums, which OpenBLAS may split differently, so allow rounding.
    expect_same_generation(f, independent, 1e-6 * logit_scale(independent));
    std::set<std::vector<int32_t>> texts;
    for (const auto& r : f.result.rows) {
      EXPECT_EQ(r.prompt, prompt);
      texts.insert(r.tokens);
    }
    EXPECT_GT(texts.size(), 1u) << "the samples should differ";
    // After decode step k every sample holds P + k + 1 positions: the prompt's whole blocks
    // once, and each sample its own copy of the prompt's last, partly filled block and what
    // followed.
    ASSERT_EQ(in_use.size(), 5u);
    for (int64_t k = 0; k < 5; ++k)
      EXPECT_EQ(in_use[static_cast<size_t>(k)], shared + N * ((P + k + 1 + bs - 1) / bs - shared))
          << "step " << k;
    // Every block is handed back (the prompt's whole blocks stay cached for later prompts).
    const BlockStats end = *paged.block_stats();
    EXPECT_EQ(end.in_use, 0);
    EXPECT_EQ(end.free + end.cached, end.total);
  }
}

// A prompt beginning with whole blocks an earlier one computed takes them and prefills only
// the rest, with the logits a fresh engine computes.
TEST(Engine, PrefixCachingPrefillsOnlyTheUncachedTail) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  // A pool with room to keep every block computed here (a smaller one reclaims the least
  // recently released first: BlockManager's tests).
  Engine cached(*model, tok, DType::F32,
                PagedCacheOptions{.kv_block_size = 4, .pool_blocks = 16});
  const std::vector<int32_t> first = random_ids(13, 21);
  std::vector<int32_t> second(first.begin(), first.begin() + 9);
  for (const int32_t t : {3, 1, 4}) second.push_back(t);  // 12 tokens, 9 shared: 2 whole blocks
  const PagedRun a = run_engine(cached, {first}, greedy(3));
  EXPECT_EQ(a.result.stats.prefix_hit_positions, 0);
  EXPECT_EQ(a.result.stats.prefill_positions, 13);

  const PagedRun b = run_engine(cached, {second}, greedy(3));
  EXPECT_EQ(b.result.stats.prefix_hit_positions, 8);
  EXPECT_EQ(b.result.stats.prefill_positions, 4);
  Engine fresh(*model, tok, DType::F32,
               PagedCacheOptions{.kv_block_size = 4, .prefix_caching = false});
  const PagedRun ref = run_engine(fresh, {second}, greedy(3));
  EXPECT_EQ(ref.result.stats.prefill_positions, 12);
  // The tail's projections run in a shorter GEMM than the whole prompt's: allow rounding.
  expect_same_generation(b, ref, 1e-6 * logit_scale(ref));

  // The same prompt again: every whole block but the one holding its last token.
  const PagedRun again = run_engine(cached, {first}, greedy(3));
  EXPECT_EQ(again.result.stats.prefix_hit_positions, 12);
  EXPECT_EQ(again.result.stats.prefill_positions, 1);
  expect_same_generation(again, a, 1e-6 * logit_scale(a));
  EXPECT_EQ(cached.block_stats()->prefix_hit_positions, 20);

  // Other weights, other keys: nothing is taken from blocks the old weights computed.
  Tensor w = model->parameters().front();
  w.data<float>()[0] += 1.0f;
  EXPECT_EQ(run_engine(cached, {first}, greedy(3)).result.stats.prefix_hit_positions, 0);
}

TEST(Engine, PagedCacheOutOfBlocksIsAClearError) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  // Two blocks of 4 positions: a prompt of 9 and 3 more tokens fed need three.
  Engine tiny(*model, tok, DType::F32, PagedCacheOptions{.kv_block_size = 4, .pool_blocks = 2});
  expect_error([&] { tiny.generate_ids({random_ids(9, 4)}, greedy(4)); },
               "a paged KV cache of 2 blocks (2048 bytes) cannot hold one sequence of 12 "
               "positions, which takes 3 blocks of 4 positions (1024 bytes each)");
  // Four blocks hold either row, not both: the pool runs out when they cross into a third.
  Engine small(*model, tok, DType::F32, PagedCacheOptions{.kv_block_size = 4, .pool_blocks = 4});
  expect_error([&] { small.generate_ids({random_ids(5, 4), random_ids(5, 6)}, greedy(8)); },
               "needs 2 more blocks of 4 positions, but the pool of 4 blocks has 0 available");
  // Recoverable: the engine generates what fits, and hands every block back.
  Engine contiguous(*model, tok, DType::F32, std::nullopt);
  const PagedRun c = run_engine(contiguous, {random_ids(5, 5)}, greedy(8));
  expect_same_generation(run_engine(small, {random_ids(5, 5)}, greedy(8)), c,
                         1e-6 * logit_scale(c));
  EXPECT_EQ(small.block_stats()->in_use, 0);
  expect_error(
      [&] { Engine(*model, tok, DType::F32, PagedCacheOptions{.kv_block_size = 12}); },
      "kv_block_size 12 is not a power of two");
  expect_error(
      [&] { Engine(*model, tok, DType::F32, PagedCacheOptions{.kv_block_size = 32}); },
      "kv_block_size 32 is larger than the context (16)");
  GenerateOptions none = greedy(4);
  none.n = 0;
  expect_error([&] { small.generate_ids({random_ids(5, 4)}, none); },
               "n (samples per prompt) must be >= 1, got 0");
}

// A bf16 cache rounds every cached key and value to 8 mantissa bits: at every step its logits
// stay within a bf16-sized distance of the f32 recompute, and they do differ from it (the
// cache really holds bf16). Its memory is half the f32 cache's.
TEST(Engine, Bf16CacheStaysCloseToRecomputeAtHalfTheBytes) {
  for (int64_t nkv : {4, 1}) {
    SCOPED_TRACE(nkv);
    auto model = tiny_model(nkv);
    const Tokenizer tok = tiny_tokenizer();
    Engine engine(*model, tok, DType::BF16, std::nullopt);  // bytes: the contiguous cache's
    GenerateOptions o = greedy(12);
    double worst = 0, scale = 0;
    int64_t checks = 0;
    o.on_logits = [&](int64_t, std::span<const int32_t> window, std::span<const float> logits) {
      const std::vector<float> ref = recompute(*model, window);
      ASSERT_EQ(ref.size(), logits.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        worst = std::max(worst, static_cast<double>(std::fabs(ref[i] - logits[i])));
        scale = std::max(scale, static_cast<double>(std::fabs(ref[i])));
      }
      ++checks;
    };
    const GenerationResult r = engine.generate_ids({random_ids(5, 3), random_ids(2, 4)}, o);
    EXPECT_GT(checks, 12);
    EXPECT_GT(worst, 1e-5 * scale) << "no rounding: is the cache bf16?";
    // Rounding K and V to bf16 moves them by <= 2^-9 relative; measured 0.4-0.6% of the logits'
    // scale on this model, so 2% leaves room without letting an f32-sized error through unseen.
    EXPECT_LT(worst, 2e-2 * scale) << "worst " << worst << " at logit scale " << scale;
    Engine f32(*model, tok, DType::F32, std::nullopt);
    f32.generate_ids({random_ids(5, 3), random_ids(2, 4)}, greedy(12));
    EXPECT_EQ(2 * engine.cache()->bytes(), f32.cache()->bytes());
    EXPECT_EQ(r.stats.cache_bytes, engine.cache()->bytes());
  }
}

TEST(Engine, SampledTextIsReproducibleAndMatchesWithoutCache) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  GenerateOptions o;
  o.max_new_tokens = 12;
  o.sampling.temperature = 0.9;
  o.sampling.top_k = 6;
  o.sampling.top_p = 0.9;
  o.sampling.seed = 1234;
  const std::vector<std::string> prompts{"abc", "jihg fe", "a"};
  const auto a = engine.generate(prompts, o);
  const auto b = engine.generate(prompts, o);
  o.use_cache = false;
  const auto c = engine.generate(prompts, o);
  o.use_cache = true;
  o.sampling.seed = 99;
  const auto d = engine.generate(prompts, o);
  bool any_differs = false;
  for (size_t r = 0; r < prompts.size(); ++r) {
    EXPECT_EQ(a.rows[r].tokens, b.rows[r].tokens);
    EXPECT_EQ(a.rows[r].tokens, c.rows[r].tokens);
    any_differs |= a.rows[r].tokens != d.rows[r].tokens;
  }
  EXPECT_TRUE(any_differs) << "another seed gave the same text for every row";
  // Row 0 of a batch draws the same stream as a batch of one.
  const auto single = engine.generate({prompts[0]}, [&] {
    GenerateOptions s = o;
    s.sampling.seed = 1234;
    return s;
  }());
  EXPECT_EQ(single.rows[0].tokens, a.rows[0].tokens);
}

TEST(Engine, TopKOneEqualsGreedy) {
  auto model = tiny_model(4);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  GenerateOptions k1;
  k1.max_new_tokens = 10;
  k1.sampling.temperature = 1.5;
  k1.sampling.top_k = 1;
  k1.sampling.seed = 5;
  EXPECT_EQ(engine.generate({"abcabc", "j"}, k1).rows[1].tokens,
            engine.generate({"abcabc", "j"}, greedy(10)).rows[1].tokens);
}

// ---- allocation -------------------------------------------------------------------------

TEST(Engine, NoRawAllocationInTheDecodeLoopAfterTheFirstStep) {
  for (const auto& lengths : {std::vector<int64_t>{5}, std::vector<int64_t>{3, 6, 4}}) {
    auto model = tiny_model(2, 7, 64);
    const Tokenizer tok = tiny_tokenizer();
    Engine engine(*model, tok);
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t n : lengths) prompts.push_back(random_ids(n, static_cast<uint64_t>(n)));
    GenerateOptions o = greedy(40);
    std::vector<uint64_t> raw, requests;
    o.on_decode_step = [&](int64_t) {
      const AllocatorStats s = allocator_for(Device::CPU).stats();
      raw.push_back(s.raw_allocs);
      requests.push_back(s.requests);
    };
    const auto res = engine.generate_ids(prompts, o);
    ASSERT_EQ(raw.size(), 39u);  // 40 tokens: 1 from the prefill, 39 decode steps
    for (size_t i = 1; i < raw.size(); ++i)
      EXPECT_EQ(raw[i], raw[0]) << "decode step " << i << " reached the system allocator ("
                                << lengths.size() << " rows)";
    // The counter does see the loop's allocations: every step asks the caching allocator.
    EXPECT_GT(requests.back(), requests[0]);
    for (const auto& r : res.rows) EXPECT_EQ(r.tokens.size(), 40u);
  }
}

// ---- context limit and slide ---------------------------------------------------------------

TEST(Engine, StopsAtTheContextLimitAndSays) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  // Any max_new past the context gives the same: the largest one once overflowed the cache's
  // capacity, and reserving it asked for all of memory.
  for (auto [cache, max_new] : {std::pair{true, int64_t{40}}, std::pair{false, int64_t{40}},
                                std::pair{true, std::numeric_limits<int64_t>::max()},
                                std::pair{false, std::numeric_limits<int64_t>::max()}}) {
    SCOPED_TRACE(::testing::Message() << "cache " << cache << ", max_new " << max_new);
    const auto r = engine.generate({"abcdefg"}, greedy(max_new, cache));
    // The cache fills at block_size = 16 positions; the token predicted from the last one is
    // the last: 7 + 10 = block_size + 1.
    EXPECT_EQ(r.rows[0].tokens.size(), 10u);
    EXPECT_EQ(r.rows[0].stop_reason, StopReason::ContextLimit);
    EXPECT_STREQ(stop_reason_name(r.rows[0].stop_reason), "context_limit");
    EXPECT_EQ(r.rows[0].slides, 0);
  }
  // A prompt of exactly block_size tokens still yields one token.
  const auto full = engine.generate({"abcdefghijabcdef"}, greedy(5));
  EXPECT_EQ(full.rows[0].tokens.size(), 1u);
  EXPECT_EQ(full.rows[0].stop_reason, StopReason::ContextLimit);
}

TEST(Engine, SlideContinuesPastTheContextLimit) {
  auto model = tiny_model(1);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  GenerateOptions o = greedy(30);
  o.slide = true;
  double worst = 0;
  size_t longest = 0;
  o.on_logits = [&](int64_t, std::span<const int32_t> window, std::span<const float> logits) {
    longest = std::max(longest, window.size());
    const auto ref = recompute(*model, window);
    for (size_t i = 0; i < ref.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(ref[i] - logits[i])));
  };
  const auto cached = engine.generate({"abcdefg", "ab"}, o);
  EXPECT_LE(worst, 1e-5);
  EXPECT_EQ(longest, 16u);  // never more than block_size positions
  for (const auto& r : cached.rows) {
    EXPECT_EQ(r.tokens.size(), 30u);
    EXPECT_EQ(r.stop_reason, StopReason::MaxNewTokens);
  }
  // Row 0 fills the cache after 10 tokens; each later token slides once.
  EXPECT_EQ(cached.rows[0].slides, 30 - 10);
  EXPECT_EQ(cached.rows[1].slides, 30 - 15);
  o.on_logits = nullptr;
  o.use_cache = false;
  const auto plain = engine.generate({"abcdefg", "ab"}, o);
  for (size_t b = 0; b < 2; ++b) {
    EXPECT_EQ(cached.rows[b].tokens, plain.rows[b].tokens);
    EXPECT_EQ(cached.rows[b].slides, plain.rows[b].slides);
  }
}

TEST(Engine, PromptLongerThanTheContext) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  const std::string long_prompt = "abcdefghij abcdefghij";  // 21 tokens > 16
  expect_error([&] { engine.generate({long_prompt}, greedy(3)); },
               "prompt has 21 tokens, more than the model's context of block_size = 16 tokens "
               "(shorten it, or use --slide to keep its last 15)");
  // A long prompt with a token outside the vocabulary gets that error, without the length's
  // advice.
  std::vector<int32_t> bad(21, 0);
  bad[3] = static_cast<int32_t>(tok.vocab_size());
  try {
    engine.generate_ids({bad}, greedy(3));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("token id " + std::to_string(tok.vocab_size()) + " outside"),
              std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("--slide"), std::string::npos) << msg;
  }
  GenerateOptions o = greedy(3);
  o.slide = true;
  const auto r = engine.generate({long_prompt}, o);
  EXPECT_EQ(r.rows[0].tokens.size(), 3u);
  EXPECT_EQ(r.rows[0].prompt.size(), 21u);
  // The same as generating from its last block_size - 1 tokens.
  const auto tail = engine.generate({long_prompt.substr(21 - 15)}, o);
  EXPECT_EQ(r.rows[0].tokens, tail.rows[0].tokens);
}

// ---- stop strings and streaming --------------------------------------------------------------

TEST(Engine, StopStringEndsARowAndIsNotStreamed) {
  auto model = tiny_model(4);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  const std::vector<std::string> prompts{"abc", "hij", "e"};
  const auto free_run = engine.generate(prompts, greedy(12));
  const std::string text0 = free_run.rows[0].text;
  ASSERT_GE(text0.size(), 6u);
  const std::string stop = text0.substr(3, 2);
  GenerateOptions o = greedy(12);
  o.stop = {stop, "zz-never"};
  std::vector<std::string> streamed(prompts.size());
  o.on_text = [&](int64_t row, std::string_view piece) {
    streamed[static_cast<size_t>(row)] += piece;
  };
  const auto res = engine.generate(prompts, o);
  EXPECT_EQ(res.rows[0].stop_reason, StopReason::StopString);
  EXPECT_EQ(res.rows[0].text, text0.substr(0, text0.find(stop)));
  for (size_t b = 0; b < prompts.size(); ++b) {
    EXPECT_EQ(streamed[b], res.rows[b].text) << "row " << b;
    const std::string& full = free_run.rows[b].text;
    const size_t at = full.find(stop);
    // Every row stops on its own: at its own first occurrence, or after 12 tokens.
    EXPECT_EQ(res.rows[b].text, at == std::string::npos ? full : full.substr(0, at));
    EXPECT_EQ(res.rows[b].stop_reason,
              at == std::string::npos ? StopReason::MaxNewTokens : StopReason::StopString);
  }
}

TEST(Engine, StreamsEveryTokenAsItIsMade) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok, DType::F32, std::nullopt);  // bytes: the contiguous cache's
  GenerateOptions o = greedy(9);
  std::vector<std::vector<std::string>> pieces(2);
  o.on_text = [&](int64_t row, std::string_view p) {
    pieces[static_cast<size_t>(row)].emplace_back(p);
  };
  const auto res = engine.generate({"a", "bbbbbb"}, o);
  for (size_t b = 0; b < 2; ++b) {
    ASSERT_EQ(pieces[b].size(), 9u);
    std::string joined;
    for (const auto& p : pieces[b]) joined += p;
    EXPECT_EQ(joined, res.rows[b].text);
  }
  const auto& st = res.stats;
  EXPECT_EQ(st.step_s.size(), 8u);
  EXPECT_EQ(st.new_tokens, 18);
  EXPECT_GT(st.ttft_s, 0);
  EXPECT_GE(st.total_s, st.ttft_s);
  EXPECT_LE(st.tpot_quantile_s(0.5), st.tpot_quantile_s(0.99));
  EXPECT_EQ(st.cache_bytes, kv_cache_formula_bytes(2, 2, st.cache_capacity, 2, 8, DType::F32));
  EXPECT_EQ(st.cache_capacity, 6 + 9 - 1);  // the longest prompt plus the tokens it feeds
  EXPECT_EQ(engine.cache()->bytes(), st.cache_bytes);
}

// ---- bad input -------------------------------------------------------------------------------

TEST(Engine, BadInputGivesClearErrors) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  Engine engine(*model, tok);
  expect_error([&] { engine.generate({"abcXYz!"}, greedy(3)); }, "prompt");
  try {
    engine.generate({"abcXYz!"}, greedy(3));
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* c : {"X", "Y", "z", "!"}) EXPECT_NE(m.find(c), std::string::npos) << m;
  }
  expect_error([&] { engine.generate({"abc", "aQ"}, greedy(3)); }, "prompt 2");
  expect_error([&] { engine.generate({""}, greedy(3)); }, "prompt is empty");
  expect_error([&] { engine.generate({"abc"}, greedy(0)); }, "max-new must be >= 1, got 0");
  expect_error([&] { engine.generate({"abc"}, greedy(-4)); }, "max-new must be >= 1, got -4");
  GenerateOptions o = greedy(3);
  o.sampling.temperature = -1;
  expect_error([&] { engine.generate({"abc"}, o); }, "temperature must be >= 0");
  o.sampling.temperature = 1;
  o.sampling.top_p = 0;
  expect_error([&] { engine.generate({"abc"}, o); }, "top-p must be in (0, 1]");
  o.sampling.top_p = 1.01;
  expect_error([&] { engine.generate({"abc"}, o); }, "top-p must be in (0, 1]");
  o.sampling.top_p = 1;
  o.sampling.top_k = -2;
  expect_error([&] { engine.generate({"abc"}, o); }, "top-k must be >= 0");
  o.sampling.top_k = 0;
  o.stop = {""};
  expect_error([&] { engine.generate({"abc"}, o); }, "stop strings must not be empty");
  expect_error([&] { engine.generate_ids({{1, 11}}, greedy(3)); }, "token id 11 outside");
  expect_error([&] { engine.generate_ids({}, greedy(3)); }, "no prompts");
  // The engine is still usable after errors.
  EXPECT_EQ(engine.generate({"abc"}, greedy(3)).rows[0].tokens.size(), 3u);
}

class CheckpointFiles : public testing::TestDirFixture {
 protected:
  CheckpointFiles() : TestDirFixture("kvlab-infer-test") {}
};

TEST_F(CheckpointFiles, LoadedModelGeneratesLikeTheOriginalAndBadFilesFailCleanly) {
  auto model = tiny_model(2);
  const Tokenizer tok = tiny_tokenizer();
  Checkpoint ckpt;
  put_gpt_config(ckpt.config, model->config());
  put_tokenizer(ckpt, tok);
  ckpt.model = to_arrays(model->named_parameters());
  const auto good = dir_ / "tiny.h5";
  save_checkpoint(good, ckpt);

  LoadedModel loaded = load_model(good);
  Engine original(*model, tok);
  Engine restored(*loaded.model, loaded.tokenizer);
  EXPECT_EQ(restored.generate({"abc"}, greedy(8)).rows[0].text,
            original.generate({"abc"}, greedy(8)).rows[0].text);

  const auto missing = dir_ / "nope.h5";
  expect_error([&] { load_model(missing); }, missing.string());
  // A truncated copy: an error naming the file, never a crash.
  const auto size = std::filesystem::file_size(good);
  for (const auto cut : {size / 2, size - 16, uintmax_t{100}}) {
    const auto bad = dir_ / ("cut_" + std::to_string(cut) + ".h5");
    std::filesystem::copy_file(good, bad);
    std::filesystem::resize_file(bad, cut);
    expect_error([&] { load_model(bad); }, bad.string());
  }
  // Not HDF5 at all.
  const auto text = dir_ / "text.h5";
  std::ofstream(text) << "not a checkpoint\n";
  expect_error([&] { load_model(text); }, text.string());
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// Fewer decode steps than sample points: each step is one point, not several.
TEST(Bench, PositionCurveNamesEachStepOnce) {
  auto model = test::random_model(test::tiny_config(1, 48), 3);
  BenchGenerateOptions o;
  o.prompt_tokens = 4;
  o.new_tokens = {4};  // the first comes from the prefill: three decode steps
  o.runs = 1;
  o.position_points = 8;
  const nlohmann::json curve = bench_generate(*model, tiny_tokenizer(), o)["time_vs_position"];
  for (const char* side : {"cache", "no_cache"}) {
    SCOPED_TRACE(side);
    ASSERT_EQ(curve[side].size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(curve[side][i]["position"], 4 + i);
  }
}

// Each setting reports from 0 up to its total, every row's tokens of the warm-up and the runs,
// one call per token step (the prefill's first token arrives with the first decode step).
TEST(Bench, ReportsEachSettingsTokensUpToItsTotal) {
  struct Call {
    std::string setting;
    int64_t done, total;
  };
  std::vector<Call> calls;
  BenchGenerateOptions o;
  o.batch = 2;
  o.prompt_tokens = 4;
  o.new_tokens = {5, 40};  // 40: a warm-up of 32
  o.runs = 2;
  o.on_tokens = [&](const std::string& s, int64_t done, int64_t total) {
    calls.push_back({s, done, total});
  };
  auto model = test::random_model(test::tiny_config(2, 48), 5);
  bench_generate(*model, tiny_tokenizer(), o);
  bench_decode_by_kv_heads(test::tiny_config(2, 48), {2, 1}, 6, o);
  struct Expected {
    const char* setting;
    int64_t warm, n;
  };
  const Expected expected[] = {{"new tokens 5, cache on", 5, 5},
                               {"new tokens 5, cache off", 5, 5},
                               {"new tokens 40, cache on", 32, 40},
                               {"new tokens 40, cache off", 32, 40},
                               {"n_kv_head 2", 6, 6},
                               {"n_kv_head 1", 6, 6}};
  size_t i = 0;
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.setting);
    const int64_t total = 2 * (e.warm + 2 * e.n);
    const size_t first = i;
    for (; i < calls.size() && calls[i].setting == e.setting; ++i) {
      EXPECT_EQ(calls[i].total, total);
      if (i > first) {
        EXPECT_GT(calls[i].done, calls[i - 1].done);
      }
    }
    // 0, then one call per decode step: warm - 1 and n - 1 per run
    ASSERT_EQ(i - first, static_cast<size_t>(1 + (e.warm - 1) + 2 * (e.n - 1)));
    EXPECT_EQ(calls[first].done, 0);
    EXPECT_EQ(calls[i - 1].done, total);
  }
  EXPECT_EQ(i, calls.size());
}

// bench kv-memory's figures on a tiny model: what the workload, the engine's allocator and
// the prefix cache must show whatever the timings.
TEST(Bench, KVMemoryComparesTheLayoutsAtOneBudget) {
  GPTConfig cfg = test::tiny_config(4, 128);
  auto model = test::random_model(cfg, 7);
  const Tokenizer tok = tiny_tokenizer();
  BenchKVMemoryOptions o;
  o.kv_heads = {4, 1};
  o.kv_block_size = 8;
  o.requests = 64;
  o.rounds = 1;
  o.decode_batches = {2};
  o.decode_prompt = 20;
  o.decode_new_tokens = 12;
  const nlohmann::json j = bench_kv_memory(*model, tok, o);
  // The default budget: 16 full-context sequences of the multi-head model.
  EXPECT_EQ(j["budget_bytes"], kv_cache_formula_bytes(2, 16, 128, 4, 8, DType::F32));
  EXPECT_EQ(j["workload"]["system_prompt"], 32);
  ASSERT_EQ(j["memory"].size(), 2u);
  for (const auto& m : j["memory"]) {
    SCOPED_TRACE(m["n_kv_head"].get<int64_t>());
    EXPECT_EQ(m["slots"], 16 * 4 / m["n_kv_head"].get<int64_t>());
    for (const char* name : {"plain", "samples", "system_prompt"}) {
      const auto& p = m[name]["paged"];
      const auto& c = m[name]["contiguous"];
      EXPECT_GE(p["peak_sequences"].get<int64_t>(), c["peak_sequences"].get<int64_t>()) << name;
      EXPECT_GT(p["utilisation_mean"].get<double>(), c["utilisation_mean"].get<double>()) << name;
      EXPECT_LE(c["peak_sequences"].get<int64_t>(), m["slots"].get<int64_t>());
    }
    EXPECT_DOUBLE_EQ(m["samples"]["contiguous"]["prompt_copies"].get<double>(), 4.0);
    EXPECT_LE(m["samples"]["paged"]["prompt_copies"].get<double>(), 1.0);
    EXPECT_LT(m["system_prompt"]["paged"]["prefill_positions"].get<int64_t>(),
              m["system_prompt"]["paged_no_prefix_caching"]["prefill_positions"].get<int64_t>());
  }
  // The engine's prefix cache: the system prompt's whole blocks (32 positions) are taken.
  EXPECT_EQ(j["prefix_caching"]["prefill_positions"]["off"], 32 + 32);
  EXPECT_EQ(j["prefix_caching"]["prefill_positions"]["on"], 32);
  // 4 samples of a 20-token prompt with 12 new tokens each feed 31 positions: forked, the
  // prompt's 2 whole blocks once and each sample's own 2; as independent rows, 4 x 4 blocks.
  const auto& s = j["samples"];
  const int64_t block = s["block_bytes"].get<int64_t>();
  EXPECT_EQ(s["forked_bytes"].get<int64_t>(), (2 + 4 * 2) * block);
  EXPECT_EQ(s["independent_bytes"].get<int64_t>(), 4 * 4 * block);
  EXPECT_EQ(s["contiguous_bytes"].get<int64_t>(), kv_cache_formula_bytes(2, 4, 31, 4, 8, DType::F32));
  ASSERT_EQ(j["decode"].size(), 1u);
  EXPECT_GT(j["decode"][0]["ratio"]["median"].get<double>(), 0);
}

// bench serve's figures on a tiny model: both batchings serve every request at one memory.
TEST(Bench, ServeRunsBothBatchingsAtOneMemory) {
  GPTConfig cfg = test::tiny_config(2, 64);
  auto model = test::random_model(cfg, 7);
  const Tokenizer tok = tiny_tokenizer();
  BenchServeOptions o;
  o.requests = 24;
  o.rates = {2000.0};
  o.kv_block_size = 8;
  o.max_batch_tokens = 32;
  const nlohmann::json j = bench_serve(*model, tok, o);
  EXPECT_EQ(j["budget_bytes"], kv_cache_formula_bytes(2, 16, 64, 2, 8, DType::F32));
  EXPECT_EQ(j["static_slots"], 16);
  EXPECT_EQ(j["max_seqs"], 24);
  ASSERT_EQ(j["runs"].size(), 1u);
  const auto& run = j["runs"][0];
  EXPECT_EQ(run["rate"], 2000.0);
  for (const char* side : {"static_contiguous", "continuous_paged"}) {
    SCOPED_TRACE(side);
    const auto& x = run[side];
    EXPECT_GT(x["requests_per_s"].get<double>(), 0);
    EXPECT_GT(x["output_tokens_per_s"].get<double>(), x["requests_per_s"].get<double>());
    EXPECT_GE(x["ttft_ms"]["p99"].get<double>(), x["ttft_ms"]["p50"].get<double>());
    EXPECT_GE(x["itl_ms"]["p99"].get<double>(), x["itl_ms"]["p50"].get<double>());
    EXPECT_GT(x["itl_ms"]["p50"].get<double>(), 0);
    EXPECT_GT(x["kv_utilisation"].get<double>(), 0);
    EXPECT_LE(x["kv_utilisation"].get<double>(), 1);
    EXPECT_GE(x["peak_sequences"].get<int64_t>(), 1);
  }
  // Paged blocks hold what is stored but a last block's tail; contiguous rows hold the batch's
  // longest generation.
  EXPECT_GT(run["continuous_paged"]["kv_utilisation"].get<double>(),
            run["static_contiguous"]["kv_utilisation"].get<double>());
  EXPECT_LE(run["static_contiguous"]["peak_sequences"].get<int64_t>(), 16);
  EXPECT_DOUBLE_EQ(run["throughput_ratio"].get<double>(),
                   run["continuous_paged"]["requests_per_s"].get<double>() /
                       run["static_contiguous"]["requests_per_s"].get<double>());

  // The continuous side alone; two samples a request sharing a system prompt, and a count of
  // the sequences finished.
  o.with_static = false;
  o.system_prompt = 8;
  o.samples = 2;
  int64_t last_done = -1;
  o.on_requests = [&](const std::string& side, int64_t done, int64_t total) {
    EXPECT_EQ(side, "continuous");
    EXPECT_EQ(total, 48);
    EXPECT_GE(done, last_done);
    last_done = done;
  };
  const nlohmann::json alone = bench_serve(*model, tok, o)["runs"][0];
  EXPECT_FALSE(alone.contains("static_contiguous"));
  EXPECT_FALSE(alone.contains("throughput_ratio"));
  EXPECT_EQ(last_done, 48);
  int64_t tokens = 0;
  for (const KVRequest& r : make_kv_workload({.requests = 24, .context = 64, .samples = 2,
                                              .system_prompt = 8, .vocab_size = 11}))
    tokens += 2 * r.output_tokens;
  const auto& x = alone["continuous_paged"];
  EXPECT_NEAR(x["output_tokens_per_s"].get<double>() * x["duration_s"].get<double>(),
              static_cast<double>(tokens), 1e-6 * static_cast<double>(tokens));
}

TEST(Bench, ReportsBothModesAndTheCacheFormula) {
  for (const auto& [tied, batch] : {std::pair{true, 1}, std::pair{false, 1}, std::pair{true, 3}}) {
    SCOPED_TRACE(detail::cat(tied ? "tied" : "untied", " LM head, batch ", batch));
    GPTConfig cfg = test::tiny_config(2, 48);
    cfg.tied = tied;
    auto model = test::random_model(cfg, 7);
    const Tokenizer tok = tiny_tokenizer();
    BenchGenerateOptions o;
    o.batch = batch;
    o.prompt_tokens = 8;
    o.new_tokens = {16, 64};  // 64 is capped at block_size - prompt = 40
    o.runs = 1;
    o.position_points = 3;
    const nlohmann::json j = bench_generate(*model, tok, o);
    ASSERT_EQ(j["results"].size(), 2u);
    EXPECT_EQ(j["batch"], batch);
    EXPECT_EQ(j["results"][1]["new_tokens"], 40);
    // The weights a step reads: each block's LayerNorms and products, the final LayerNorm
    // and the V x C LM head (tied: the token table itself; untied: only one row of it is read,
    // for the embedding, and the position table likewise).
    const int64_t C = cfg.n_embd, H = cfg.hidden(), KVD = cfg.n_kv_head * cfg.head_size();
    const int64_t per_block =
        4 * C + 2 * (C * C + C) + 2 * (C * KVD + KVD) + (C * H + H) + (H * C + C);
    const double weights =
        4.0 * static_cast<double>(cfg.n_layer * per_block + 2 * C + cfg.vocab_size * C);
    for (const auto& r : j["results"]) {
      EXPECT_GT(r["cache"]["tokens_per_s"].get<double>(), 0);
      EXPECT_GT(r["no_cache"]["tokens_per_s"].get<double>(), 0);
      EXPECT_EQ(r["cache"]["cache_bytes"], r["cache"]["cache_bytes_formula"]);
      EXPECT_TRUE(r.contains("speedup"));
      // Plus each row's K and V at the mean position; the ceiling is `batch` tokens per time
      // to read that at this run's read rate.
      const nlohmann::json& c = r["cache"];
      const double mean_pos = 8.0 + r["new_tokens"].get<double>() / 2;
      const double bytes =
          weights + 2.0 * 4.0 * static_cast<double>(batch * cfg.n_layer * KVD) * mean_pos;
      EXPECT_DOUBLE_EQ(c["bytes_read_per_step"].get<double>(), bytes);
      EXPECT_NEAR(c["read_GB_per_s"].get<double>(),  // bytes per step times steps per second
                  bytes * c["tokens_per_s"].get<double>() / batch / 1e9,
                  1e-12 * c["read_GB_per_s"].get<double>());
      EXPECT_GT(c["read_bandwidth_GB_per_s"].get<double>(), 0);
      EXPECT_NEAR(c["ceiling_tokens_per_s"].get<double>() * bytes,
                  batch * c["read_bandwidth_GB_per_s"].get<double>() * 1e9,
                  1e-9 * batch * c["read_bandwidth_GB_per_s"].get<double>() * 1e9);
      // The cache holds every row: the formula at B = batch.
      EXPECT_EQ(c["cache_bytes"].get<int64_t>(),
                kv_cache_formula_bytes(cfg.n_layer, batch, c["cache_positions"].get<int64_t>(),
                                       cfg.n_kv_head, cfg.head_size(), DType::F32));
      EXPECT_NEAR(c["fraction_of_ceiling"].get<double>(),
                  c["tokens_per_s"].get<double>() / c["ceiling_tokens_per_s"].get<double>(), 1e-12);
    }
    EXPECT_EQ(j["time_vs_position"]["cache"].size(), 3u);
    EXPECT_EQ(j["time_vs_position"]["cache"][0]["position"], 8);
  }

  const nlohmann::json rep = kv_cache_report(test::tiny_config(4), {4, 2, 1});
  ASSERT_EQ(rep.size(), 3u);
  for (const auto& r : rep) {
    EXPECT_EQ(r["measured_bytes"], r["formula_bytes"]);
    EXPECT_DOUBLE_EQ(r["ratio_to_mha"].get<double>(), r["expected_ratio"].get<double>());
  }
  EXPECT_DOUBLE_EQ(rep[2]["ratio_to_mha"].get<double>(), 0.25);
  EXPECT_THROW(kv_cache_report(test::tiny_config(4), {3}), Error);
}

}  // namespace
}  // namespace kvlab
