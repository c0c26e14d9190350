// PyTorch parity: logits, loss, every gradient and 5 AdamW steps of a tiny GPT against
// fixtures written by tests/reference/make_fixtures.py (PyTorch f32), for MHA, GQA and MQA,
// with GPT-2's block and with the llama preset (RoPE, RMSNorm, SwiGLU, no biases), and for
// multi-head latent attention in the llama preset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "nn/adamw.h"
#include "nn/gpt.h"
#include "tests/nn/h5_fixture.h"

namespace kvlab {
namespace {

using testing::H5Fixture;

// max |a - b| relative to max |b| (each tensor against its own scale).
double rel_err(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  EXPECT_EQ(va.size(), vb.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    scale = std::max(scale, std::abs(vb[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

double abs_err(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double diff = 0;
  for (size_t i = 0; i < va.size(); ++i) diff = std::max(diff, std::abs(va[i] - vb[i]));
  return diff;
}

struct Loaded {
  std::unique_ptr<GPT> model;
  Tensor x, y;
};

Loaded load(const H5Fixture& f) {
  GPTConfig cfg;
  cfg.vocab_size = f.attr_int("vocab_size");
  cfg.block_size = f.attr_int("block_size");
  cfg.n_layer = f.attr_int("n_layer");
  cfg.n_head = f.attr_int("n_head");
  cfg.n_kv_head = f.attr_int("n_kv_head");
  cfg.n_embd = f.attr_int("n_embd");
  cfg.mlp_hidden = f.attr_int("mlp_hidden");
  cfg.tied = f.attr_int("tied") != 0;
  if (f.has_attr("pos")) {  // the llama fixtures' block (absent: GPT-2's)
    cfg.pos = f.attr_string("pos");
    cfg.norm = f.attr_string("norm");
    cfg.mlp = f.attr_string("mlp");
    cfg.bias = f.attr_int("bias") != 0;
    cfg.rope_theta = f.attr_double("rope_theta");
  }
  if (f.has_attr("attn")) {  // the MLA fixture's attention (absent: grouped-query)
    cfg.attn = f.attr_string("attn");
    cfg.kv_lora_rank = f.attr_int("kv_lora_rank");
    cfg.rope_head_dim = f.attr_int("rope_head_dim");
    if (f.has_attr("q_lora_rank")) cfg.q_lora_rank = f.attr_int("q_lora_rank");
  }
  Loaded l{std::make_unique<GPT>(cfg, 0), f.read("/batch/x", DType::I32),
           f.read("/batch/y", DType::I32)};
  for (auto& [name, p] : l.model->named_parameters()) {
    Tensor ref = f.read("/model/" + name);
    EXPECT_EQ(ref.sizes(), p.sizes()) << name;
    Tensor dst = p;
    dst.copy_from(ref);
  }
  return l;
}

class Parity : public ::testing::TestWithParam<const char*> {
 protected:
  std::string path() const {
    return std::string(KVLAB_SOURCE_DIR) + "/tests/reference/gpt_" + GetParam() + ".h5";
  }
};

TEST_P(Parity, LogitsLossAndEveryGradient) {
  H5Fixture f(path());
  Loaded l = load(f);
  Tensor logits = l.model->forward(l.x);
  EXPECT_LE(rel_err(logits, f.read("/logits")), 1e-5);       // PyTorch f32
  EXPECT_LE(rel_err(logits, f.read("/logits64", DType::F64)), 1e-5);  // PyTorch f64 (truth)
  Tensor loss = cross_entropy(logits, l.y);
  EXPECT_NEAR(loss.item(), f.read("/loss").item(), 1e-5 * std::abs(f.read("/loss").item()));
  loss.backward();
  const auto params = l.model->named_parameters();
  // Every parameter the fixture has, and only those.
  const std::string names = f.attr_string("param_names");
  ASSERT_EQ(params.size(), static_cast<size_t>(std::count(names.begin(), names.end(), ',') + 1));
  // MLA's: 22, and 4 more (q_down and q_norm, 2 layers) with its queries compressed.
  const GPTConfig& c = l.model->config();
  ASSERT_EQ(params.size(), c.mla() ? (c.q_lora_rank ? 26u : 22u) : c.bias ? 36u : 20u);
  for (auto& [name, p] : params) {
    ASSERT_TRUE(f.has("/grads64/" + name)) << name;
    ASSERT_TRUE(p.grad().defined()) << name;
    // Judged against PyTorch's f64 gradients (the exact values). The bound is 1e-5 relative,
    // or twice PyTorch f32's own error where f32 rounding alone exceeds that: with the
    // fixtures' peaked attention the small k_proj gradients carry ~1e-5 of rounding noise in
    // any f32 implementation (PyTorch f32 reaches 9.9e-6 on the GQA fixture).
    const Tensor truth = f.read("/grads64/" + name, DType::F64);
    if (name.ends_with("k_proj.bias")) {
      // Analytically zero (softmax ignores a per-row shift); both sides hold rounding noise.
      EXPECT_LE(abs_err(p.grad(), truth), 1e-7) << name;
      continue;
    }
    const double torch_f32_err = rel_err(f.read("/grads/" + name), truth);
    EXPECT_LE(rel_err(p.grad(), truth), std::max(1e-5, 2 * torch_f32_err)) << name;
  }
}

TEST_P(Parity, FiveAdamWStepsWithClipping) {
  H5Fixture f(path());
  Loaded l = load(f);
  AdamWConfig acfg;
  acfg.beta1 = f.attr_double("beta1");
  acfg.beta2 = f.attr_double("beta2");
  acfg.eps = f.attr_double("eps");
  acfg.weight_decay = f.attr_double("weight_decay");
  const double lr = f.attr_double("lr"), clip = f.attr_double("grad_clip");
  const auto params = l.model->named_parameters();
  AdamW opt(params, acfg);
  const auto ref_losses = f.read("/steps/loss").to_vector<double>();
  const auto ref_norms = f.read("/steps/grad_norm").to_vector<double>();
  for (size_t i = 0; i < ref_losses.size(); ++i) {
    l.model->zero_grad();
    Tensor loss = l.model->loss(l.x, l.y);
    EXPECT_NEAR(loss.item(), ref_losses[i], 1e-5 * std::abs(ref_losses[i])) << "step " << i;
    loss.backward();
    const double norm = global_grad_norm(params);
    // After the first AdamW step the weights carry AdamW-amplified rounding (see the final
    // weights below): PyTorch's own f32 and f64 finals differ by up to 5.5e-5 on llama_mqa.
    EXPECT_NEAR(norm, ref_norms[i], (i == 0 ? 1e-5 : 1e-4) * ref_norms[i]) << "step " << i;
    opt.step(lr, clip_factor(norm, clip));
  }
  for (auto& [name, p] : params) {
    const Tensor ref = f.read("/final/" + name);
    // k_proj.bias moves only by AdamW-amplified rounding noise (see tests/reference/README.md).
    if (name.ends_with("k_proj.bias")) continue;
    // Adam divides each gradient element by its own RMS, so elements whose gradient is near
    // rounding level move by up to ~lr per step in either implementation; they, not the
    // update rule, bound this comparison (the step losses above are the 1e-5 check).
    EXPECT_LE(rel_err(p, ref), 2e-4) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Gpt, Parity,
                         ::testing::Values("mha", "gqa", "mqa", "llama_mha", "llama_gqa",
                                           "llama_mqa", "mla", "mla_q"));

}  // namespace
}  // namespace kvlab
