#pragma once
// Tiny random-weight models for the inference tests: L = 2, NH = 4, C = 32, block_size 16,
// vocab 11. Weights are drawn much larger than GPT-2's 0.02 so that attention is far from
// uniform and positions matter: a cache that misplaces a key changes the logits visibly.
#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "infer/kv_cache.h"
#include "nn/adamw.h"
#include "nn/gpt.h"
#include "platform/random.h"

namespace kvlab::test {

// `steps` of AdamW (lr 3e-3) on batches of B random windows of T tokens of `ids`, so that a test
// model's text has structure; the model is left in eval mode.
inline void train_briefly(GPT& model, const std::vector<int32_t>& ids, int steps, int64_t B,
                          int64_t T) {
  AdamW opt(model.named_parameters(), AdamWConfig{});
  Generator gen(1);
  model.set_training(true);
  for (int step = 0; step < steps; ++step) {
    std::vector<int32_t> xs, ys;
    for (int64_t b = 0; b < B; ++b) {
      const auto at = static_cast<int64_t>(gen.below(ids.size() - T - 1));
      xs.insert(xs.end(), ids.begin() + at, ids.begin() + at + T);
      ys.insert(ys.end(), ids.begin() + at + 1, ids.begin() + at + T + 1);
    }
    model.zero_grad();
    Tensor loss = model.loss(Tensor::from_vector(xs, {B, T}), Tensor::from_vector(ys, {B, T}));
    loss.backward();
    opt.step(3e-3);
  }
  model.set_training(false);
}

// arch "llama": RoPE, RMSNorm, SwiGLU and no biases instead of GPT-2's block; "mla" that block
// with multi-head latent attention (latent rank 12, rotary width 4; n_kv_head must be 4);
// "mla_q" that with its queries compressed too (q_lora_rank 6).
inline GPTConfig tiny_config(int64_t n_kv_head = 4, int64_t block_size = 16,
                             const std::string& arch = "gpt2") {
  GPTConfig c;
  if (arch == "mla" || arch == "mla_q") {
    c.attn = "mla";
    c.kv_lora_rank = 12;
    c.rope_head_dim = 4;
    c.q_lora_rank = arch == "mla_q" ? 6 : 0;
  }
  if (arch != "gpt2") {
    c.pos = "rope";
    c.norm = "rmsnorm";
    c.mlp = "swiglu";
    c.bias = false;
  }
  c.vocab_size = 11;
  c.block_size = block_size;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = n_kv_head;
  c.n_embd = 32;
  return c;
}

// A model of config `c` with the large random weights described above.
inline std::unique_ptr<GPT> random_model(const GPTConfig& c, uint64_t seed) {
  auto m = std::make_unique<GPT>(c, seed);
  Generator gen(seed * 31 + 5);
  for (auto& [name, t] : m->named_parameters()) {
    Tensor p = t;
    if (t.dim() >= 2) {
      normal_(p, gen, 0.35);
    } else {
      normal_(p, gen, 0.1);
      if (name.ends_with("ln_1.weight") || name.ends_with("ln_2.weight") ||
          name.ends_with("ln_f.weight") || name.ends_with("kv_norm.weight")) {
        float* d = p.data<float>();
        for (int64_t i = 0; i < p.numel(); ++i) d[i] += 1.0f;
      }
    }
  }
  m->set_training(false);
  return m;
}

inline std::unique_ptr<GPT> tiny_model(int64_t n_kv_head = 4, uint64_t seed = 7,
                                       int64_t block_size = 16, const std::string& arch = "gpt2") {
  return random_model(tiny_config(n_kv_head, block_size, arch), seed);
}

// A (rows, T) batch of token ids drawn from gen.
inline Tensor random_tokens(Generator& gen, int64_t vocab, int64_t rows, int64_t T = 1) {
  std::vector<int32_t> ids(static_cast<size_t>(rows * T));
  for (auto& t : ids) t = static_cast<int32_t>(gen.below(static_cast<uint64_t>(vocab)));
  return Tensor::from_vector(ids, {rows, T});
}

// 11 symbols: "a".."j" and space.
inline Tokenizer tiny_tokenizer() { return Tokenizer::build_char("abcdefghij "); }

// Every cached key (or value) of a layer as f32, (B_max, NKV, S_max, HS) flattened.
inline std::vector<float> cached(const ContiguousKVCache& cache, int layer, bool keys) {
  const Tensor& buf = keys ? cache.k_buffer(layer) : cache.v_buffer(layer);
  return buf.to(DType::F32).to_vector<float>();
}

}  // namespace kvlab::test
