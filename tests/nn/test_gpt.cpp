#include "nn/gpt.h"

#include <gtest/gtest.h>

#include <cmath>

#include "autograd/graph.h"
#include "autograd/ops/ops.h"

namespace kvlab {
namespace {

GPTConfig tiny(int64_t nkv = 2) {
  GPTConfig c;
  c.vocab_size = 13;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = nkv;
  c.n_embd = 16;
  return c;
}

template <class F>
void expect_config_error(F mutate, const std::string& needle) {
  GPTConfig c = tiny();
  mutate(c);
  try {
    c.validate();
    FAIL() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GptConfig, ValidationNamesTheSetting) {
  expect_config_error([](GPTConfig& c) { c.n_embd = 18; }, "not divisible by n_head");
  expect_config_error([](GPTConfig& c) { c.n_kv_head = 3; }, "not divisible by n_kv_head");
  expect_config_error([](GPTConfig& c) { c.n_kv_head = 8; }, "n_kv_head = 8");
  expect_config_error([](GPTConfig& c) { c.n_kv_head = 0; }, "n_kv_head = 0");
  expect_config_error([](GPTConfig& c) { c.block_size = 0; }, "block_size");
  expect_config_error([](GPTConfig& c) { c.vocab_size = 0; }, "vocab_size");
  expect_config_error([](GPTConfig& c) { c.n_layer = -1; }, "n_layer");
  expect_config_error([](GPTConfig& c) { c.dropout = 1.0; }, "dropout");
  // A model past the machine's memory is refused before any layer is allocated.
  expect_config_error([](GPTConfig& c) { c.n_layer = int64_t{1} << 40; }, "GB of f32 weights");
  EXPECT_THROW(GPT(GPTConfig{}, 0), Error);  // vocab_size 0
  expect_config_error([](GPTConfig& c) { c.pos = "alibi"; }, "pos 'alibi'");
  expect_config_error([](GPTConfig& c) { c.norm = "batchnorm"; }, "norm 'batchnorm'");
  expect_config_error([](GPTConfig& c) { c.mlp = "relu"; }, "mlp 'relu'");
  expect_config_error(
      [](GPTConfig& c) {
        c.pos = "rope";
        c.n_embd = 12;  // head size 3
      },
      "RoPE needs an even head size");
  expect_config_error(
      [](GPTConfig& c) {
        c.pos = "rope";
        c.rope_theta = 1.0;
      },
      "rope_theta");
}

TEST(Gpt, ParameterNamesFollowTheModuleTree) {
  GPT m(tiny(2), 1);
  const auto params = m.named_parameters();
  std::vector<std::string> names;
  for (auto& [n, t] : params) names.push_back(n);
  ASSERT_EQ(names.size(), 4u + 2 * 16u);
  EXPECT_EQ(names[0], "wte.weight");
  EXPECT_EQ(names[1], "wpe.weight");
  EXPECT_EQ(names[2], "blocks.0.ln_1.weight");
  EXPECT_EQ(names[4], "blocks.0.attn.q_proj.weight");
  EXPECT_EQ(names[6], "blocks.0.attn.k_proj.weight");
  EXPECT_EQ(names.back(), "ln_f.bias");
  EXPECT_EQ(params[6].second.sizes(), (Shape{2 * 4, 16}));  // NKV * HS rows
  EXPECT_EQ(m.num_parameters(), count_parameters(tiny(2)));
  GPTConfig untied = tiny(1);
  untied.tied = false;
  GPT mu(untied, 1);
  EXPECT_EQ(mu.named_parameters().back().first, "lm_head.weight");
  EXPECT_EQ(mu.num_parameters(), count_parameters(untied));
  EXPECT_EQ(mu.num_parameters() - count_parameters(tiny(1)), 13 * 16);
}

// parameter_shapes is what a checkpoint is checked against before its weights are read: it
// must list exactly the model's parameters, in order, with their shapes.
TEST(Gpt, ParameterShapesAreThoseOfTheBuiltModel) {
  for (const bool tied : {true, false}) {
    for (const int64_t nkv : {4, 2, 1}) {
      GPTConfig c = tiny(nkv);
      c.tied = tied;
      c.mlp_hidden = tied ? 0 : 40;
      c.n_layer = 3;
      const auto shapes = parameter_shapes(c);
      const auto params = GPT(c, 1).named_parameters();
      ASSERT_EQ(shapes.size(), params.size()) << "tied " << tied << " nkv " << nkv;
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(shapes[i].first, params[i].first);
        EXPECT_EQ(shapes[i].second, params[i].second.sizes()) << params[i].first;
      }
    }
  }
  GPTConfig bad = tiny(3);  // 4 heads do not share out over 3 KV heads
  EXPECT_THROW(parameter_shapes(bad), Error);
}

// Every combination of the block's parts: the built model's parameters are parameter_shapes's
// and count_parameters's, and the model runs forward and backward.
GPTConfig tiny_mla(int64_t rank = 8, int64_t rope_dim = 4) {
  GPTConfig c = tiny(4);
  c.pos = "rope";
  c.norm = "rmsnorm";
  c.mlp = "swiglu";
  c.bias = false;
  c.attn = "mla";
  c.kv_lora_rank = rank;
  c.rope_head_dim = rope_dim;
  return c;
}

TEST(GptConfig, MlaSettingsAreChecked) {
  auto mla_error = [](auto mutate, const std::string& needle) {
    expect_config_error(
        [&](GPTConfig& c) {
          c = tiny_mla();
          mutate(c);
        },
        needle);
  };
  mla_error([](GPTConfig& c) { c.kv_lora_rank = 0; }, "kv_lora_rank 0 must be in [1, n_embd = 16]");
  mla_error([](GPTConfig& c) { c.kv_lora_rank = 17; }, "kv_lora_rank 17");
  mla_error([](GPTConfig& c) { c.rope_head_dim = 0; }, "rope_head_dim 0 must be even");
  mla_error([](GPTConfig& c) { c.rope_head_dim = 3; }, "rope_head_dim 3 must be even");
  mla_error([](GPTConfig& c) { c.rope_head_dim = 18; }, "rope_head_dim 18");
  mla_error([](GPTConfig& c) { c.pos = "learned"; }, "MLA's rotary key needs pos rope");
  mla_error([](GPTConfig& c) { c.n_kv_head = 2; }, "n_kv_head must equal n_head = 4, got 2");
  mla_error([](GPTConfig& c) { c.attn = "mqa"; }, "attn 'mqa' is not one of gqa, mla");
  mla_error([](GPTConfig& c) { c.q_lora_rank = 17; }, "q_lora_rank 17 must be 0 (no query "
                                                      "compression) or in [1, n_embd = 16]");
  mla_error([](GPTConfig& c) { c.q_lora_rank = -1; }, "q_lora_rank -1");
  expect_config_error([](GPTConfig& c) { c.kv_lora_rank = 8; }, "are MLA's (attn mla)");
  expect_config_error([](GPTConfig& c) { c.q_lora_rank = 8; }, "are MLA's (attn mla)");
  tiny_mla().validate();
}

// A model of config c has the parameters parameter_shapes and count_parameters say, and a
// backward reaches every one of them.
void expect_shapes_count_and_gradients(const GPTConfig& c) {
  GPT m(c, 1);
  const auto shapes = parameter_shapes(c);
  const auto params = m.named_parameters();
  ASSERT_EQ(shapes.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(shapes[i].first, params[i].first);
    EXPECT_EQ(shapes[i].second, params[i].second.sizes()) << params[i].first;
  }
  EXPECT_EQ(m.num_parameters(), count_parameters(c));
  EXPECT_EQ(params[1].first == "wpe.weight", c.pos == "learned");
  EXPECT_EQ(m.blocks[0]->attn == nullptr, c.mla());
  EXPECT_EQ(m.blocks[0]->mla != nullptr, c.mla());
  const Tensor x = Tensor::from_vector(std::vector<int32_t>{1, 2, 3, 4, 5, 6}, {2, 3});
  m.loss(x, x).backward();
  for (auto& [name, t] : params) EXPECT_TRUE(t.grad().defined()) << name;
}

TEST(Gpt, MlaHasTheShapesAndCountItsConfigSaysAndLearns) {
  for (const bool bias : {false, true})
    for (const int64_t q_rank : {0, 6}) {
      GPTConfig c = tiny_mla();
      c.bias = bias;
      c.q_lora_rank = q_rank;
      expect_shapes_count_and_gradients(c);
      const GPT m(c, 1);
      const LatentAttention& a = *m.blocks[0]->mla;
      EXPECT_EQ(a.kv_down.weight.sizes(), (std::vector<int64_t>{8 + 4, 16}));
      // The queries come from x, or from its compressed latent of q_lora_rank.
      EXPECT_EQ(a.q_proj.weight.sizes(), (std::vector<int64_t>{4 * (4 + 4), q_rank ? q_rank : 16}));
      EXPECT_EQ(a.q_down != nullptr, q_rank > 0);
      if (q_rank) {
        EXPECT_EQ(a.q_norm->weight.sizes(), (std::vector<int64_t>{q_rank}));
      }
    }
}

// MLA with the latent at full rank reproduces an MHA layer whose key and value weights factor
// through it: W_k = W_uk Q and W_v = W_uv Q with Q orthogonal (so the latent's RMSNorm, after
// ln_1's, is the identity), the rotary parts zero and the queries scaled to MLA's
// 1 / sqrt(HS + D). The MHA model has no position signal either (its position table zero).
TEST(Gpt, MlaAtFullRankReproducesAFactoredMhaLayer) {
  GPTConfig mha = tiny(4);
  mha.norm = "rmsnorm";
  mha.mlp = "swiglu";
  mha.bias = false;
  const GPTConfig mla = tiny_mla(16, 4);
  GPT a(mha, 3), b(mla, 4);
  const int64_t C = 16, NH = 4, HS = 4, D = 4;
  // Q: orthogonal (C, C) by Gram-Schmidt on a random matrix.
  Generator gen(9);
  std::vector<double> q(static_cast<size_t>(C * C));
  for (double& v : q) v = gen.normal();
  for (int64_t i = 0; i < C; ++i) {
    double* r = q.data() + i * C;
    for (int64_t j = 0; j < i; ++j) {
      const double* o = q.data() + j * C;
      double d = 0;
      for (int64_t k = 0; k < C; ++k) d += r[k] * o[k];
      for (int64_t k = 0; k < C; ++k) r[k] -= d * o[k];
    }
    double n = 0;
    for (int64_t k = 0; k < C; ++k) n += r[k] * r[k];
    for (int64_t k = 0; k < C; ++k) r[k] /= std::sqrt(n);
  }
  auto set = [](Tensor t, const std::vector<double>& v) {
    t.copy_from(Tensor::from_vector(std::vector<float>(v.begin(), v.end()), t.sizes()));
  };
  auto get = [](const Tensor& t) {
    const std::vector<float> f = t.to_vector<float>();
    return std::vector<double>(f.begin(), f.end());
  };
  set(a.wpe->weight, std::vector<double>(static_cast<size_t>(mha.block_size * C), 0.0));
  b.wte.weight.copy_from(a.wte.weight);
  b.ln_f.weight.copy_from(a.ln_f.weight);
  for (size_t l = 0; l < a.blocks.size(); ++l) {
    Block& x = *a.blocks[l];
    Block& y = *b.blocks[l];
    // Unit gains and no epsilon to speak of: ln_1's output has RMS 1 exactly, so has Q's
    // image of it, and the latent's RMSNorm leaves it as it is.
    for (LayerNorm* n : {&x.ln_1, &y.ln_1, &y.mla->kv_norm}) {
      set(n->weight, std::vector<double>(static_cast<size_t>(n->weight.numel()), 1.0));
      n->eps = 1e-30;  // as good as none (the op wants it positive)
    }
    y.ln_2.weight.copy_from(x.ln_2.weight);
    y.mlp.c_fc.weight.copy_from(x.mlp.c_fc.weight);
    y.mlp.c_up->weight.copy_from(x.mlp.c_up->weight);
    y.mlp.c_proj.weight.copy_from(x.mlp.c_proj.weight);
    y.mla->c_proj.weight.copy_from(x.attn->c_proj.weight);
    const std::vector<double> wq = get(x.attn->q_proj.weight), wk = get(x.attn->k_proj.weight),
                              wv = get(x.attn->v_proj.weight);
    std::vector<double> q_mla(static_cast<size_t>(NH * (HS + D) * C), 0.0);
    std::vector<double> down(static_cast<size_t>((C + D) * C), 0.0);
    std::vector<double> up(static_cast<size_t>(NH * 2 * HS * C), 0.0);
    const double s = std::sqrt(static_cast<double>(HS + D) / HS);
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < HS; ++i)
        for (int64_t k = 0; k < C; ++k) {
          q_mla[((h * (HS + D)) + i) * C + k] = s * wq[(h * HS + i) * C + k];
          double uk = 0, uv = 0;  // (W Q^T)[row, k]
          for (int64_t m = 0; m < C; ++m) {
            uk += wk[(h * HS + i) * C + m] * q[k * C + m];
            uv += wv[(h * HS + i) * C + m] * q[k * C + m];
          }
          up[(h * 2 * HS + i) * C + k] = uk;
          up[(h * 2 * HS + HS + i) * C + k] = uv;
        }
    for (size_t i = 0; i < q.size(); ++i) down[i] = q[i];  // rows 0..C-1; the rotary rows 0
    set(y.mla->q_proj.weight, q_mla);
    set(y.mla->kv_down.weight, down);
    set(y.mla->kv_up.weight, up);
  }
  a.set_training(false);
  b.set_training(false);
  const Tensor x =
      Tensor::from_vector(std::vector<int32_t>{1, 5, 2, 7, 3, 3, 9, 12, 0, 4, 6, 8}, {2, 6});
  const std::vector<float> la = a.forward(x).to_vector<float>();
  const std::vector<float> lb = b.forward(x).to_vector<float>();
  ASSERT_EQ(la.size(), lb.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(la[i] - lb[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(la[i])));
  }
  EXPECT_LE(worst, 1e-5 * scale) << "scale " << scale;
  // A factor off (the value's rows taken for the key's) is visible.
  std::vector<double> wrong = get(b.blocks[0]->mla->kv_up.weight);
  std::swap_ranges(wrong.begin(), wrong.begin() + HS * C, wrong.begin() + HS * C);
  set(b.blocks[0]->mla->kv_up.weight, wrong);
  const std::vector<float> lw = b.forward(x).to_vector<float>();
  double moved = 0;
  for (size_t i = 0; i < la.size(); ++i)
    moved = std::max(moved, static_cast<double>(std::fabs(la[i] - lw[i])));
  EXPECT_GT(moved, 1e-3 * scale);
}

TEST(Gpt, EveryBlockVariantHasTheShapesAndCountItsConfigSays) {
  for (const char* pos : {"learned", "rope"})
    for (const char* norm : {"layernorm", "rmsnorm"})
      for (const char* mlp : {"gelu", "swiglu"})
        for (const bool bias : {true, false})
          for (const bool qkv_bias : {false, true}) {  // Qwen2's: q, k and v alone
            GPTConfig c = tiny(2);
            c.pos = pos;
            c.norm = norm;
            c.mlp = mlp;
            c.bias = bias;
            c.qkv_bias = qkv_bias;
            SCOPED_TRACE(testing::Message() << pos << " " << norm << " " << mlp << " bias " << bias
                                            << " qkv_bias " << qkv_bias);
            expect_shapes_count_and_gradients(c);
            const GPT m(c, 1);
            EXPECT_EQ(m.blocks[0]->attn->k_proj.bias.defined(), bias || qkv_bias);
            EXPECT_EQ(m.blocks[0]->attn->c_proj.bias.defined(), bias);
          }
}

// SwiGLU's default width keeps GELU's MLP parameters within a few: at the baby config the
// llama preset has the GPT-2 block's parameters less the position table, within 1%.
TEST(Gpt, SwigluDefaultWidthMatchesGeluParameters) {
  GPTConfig g = tiny(4);
  g.vocab_size = 65;
  g.block_size = 64;
  g.n_layer = 4;
  g.n_embd = 128;
  GPTConfig l = g;
  l.pos = "rope";
  l.norm = "rmsnorm";
  l.mlp = "swiglu";
  l.bias = false;
  EXPECT_EQ(l.hidden(), 344);  // 8/3 of 128 = 341.3, to a multiple of 8
  const double gpt2 = static_cast<double>(count_parameters(g) - 64 * 128);
  EXPECT_NEAR(static_cast<double>(count_parameters(l)) / gpt2, 1.0, 0.01);
}

TEST(Gpt, Gpt2Initialisation) {
  GPTConfig c = tiny(4);
  c.n_embd = 64;
  c.vocab_size = 512;
  GPT m(c, 7);
  auto stdev = [](const Tensor& t) {
    double s = 0, s2 = 0;
    for (double v : t.to_vector<double>()) {
      s += v;
      s2 += v * v;
    }
    const double n = static_cast<double>(t.numel());
    return std::sqrt(s2 / n - (s / n) * (s / n));
  };
  EXPECT_NEAR(stdev(m.wte.weight), 0.02, 0.001);
  EXPECT_NEAR(stdev(m.blocks[0]->mlp.c_fc.weight), 0.02, 0.001);
  EXPECT_NEAR(stdev(m.blocks[0]->attn->c_proj.weight), 0.02 / 2.0, 0.001);  // 1/sqrt(2*2)
  EXPECT_EQ(m.blocks[0]->ln_1.weight.to_vector<float>()[0], 1.0f);
  EXPECT_EQ(m.blocks[0]->attn->q_proj.bias.to_vector<float>()[3], 0.0f);
  GPT same(c, 7), other(c, 8);
  EXPECT_EQ(same.wte.weight.to_vector<float>(), m.wte.weight.to_vector<float>());
  EXPECT_NE(other.wte.weight.to_vector<float>(), m.wte.weight.to_vector<float>());
  // Variants that differ only in n_kv_head share the initial values of shared parameters.
  GPTConfig mqa = c;
  mqa.n_kv_head = 1;
  GPT m1(mqa, 7);
  EXPECT_EQ(m1.blocks[1]->attn->q_proj.weight.to_vector<float>(),
            m.blocks[1]->attn->q_proj.weight.to_vector<float>());
  EXPECT_EQ(m1.blocks[1]->mlp.c_fc.weight.to_vector<float>(),
            m.blocks[1]->mlp.c_fc.weight.to_vector<float>());
}

TEST(Gpt, ForwardShapesAndErrors) {
  GPT m(tiny(1), 3);
  Tensor tok = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(m.forward(tok).sizes(), (Shape{2, 3, 13}));
  EXPECT_EQ(m.forward(tok, nullptr, true).sizes(), (Shape{2, 1, 13}));
  Tensor too_long = Tensor::zeros({1, 9}, DType::I32);
  EXPECT_THROW(m.forward(too_long), Error);
  Tensor bad_id = Tensor::from_vector<int32_t>({1, 13}, {1, 2});
  EXPECT_THROW(m.forward(bad_id), Error);
  EXPECT_THROW(m.forward(Tensor::zeros({2, 3})), Error);  // f32 tokens
}

TEST(Gpt, DropoutOnlyInTrainingAndReproducible) {
  GPTConfig c = tiny(2);
  c.dropout = 0.2;
  Tensor tok = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {1, 6});
  GPT a(c, 5), b(c, 5);
  const auto la = a.forward(tok).to_vector<float>();
  const auto lb = b.forward(tok).to_vector<float>();
  EXPECT_EQ(la, lb);  // same seed, same masks
  EXPECT_NE(la, a.forward(tok).to_vector<float>());  // next forward, new masks
  a.set_training(false);
  const auto e1 = a.forward(tok).to_vector<float>();
  EXPECT_EQ(e1, a.forward(tok).to_vector<float>());  // eval: deterministic, no dropout
}

}  // namespace
}  // namespace kvlab
