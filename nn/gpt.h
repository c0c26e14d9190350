#pragma once
// The GPT: token embeddings (+ learned position embeddings, or rotary ones applied to each
// block's queries and keys), pre-norm blocks of attention and an MLP, a final norm and an LM
// head tied to the token embedding by default. GPT-2's block (learned positions, LayerNorm,
// GELU, biases) is the default; GPTConfig's pos, norm, mlp and bias switch each part to
// Llama's (rope, rmsnorm, swiglu, no biases) on its own. Attention is grouped-query (n_kv_head
// groups: MHA to MQA) or DeepSeek-V2's multi-head latent attention (attn "mla").
// Training calls forward without a cache; inference calls it in a no-grad scope with one.
// forward runs op by op, on every device: it is the reference that infer/'s fused CPU decode
// step (infer/decode/decode_step.h) is tested against.
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "nn/kv_cache_interface.h"
#include "nn/layers.h"
#include "platform/random.h"

namespace kvlab {

struct GPTConfig {
  int64_t vocab_size = 0;
  int64_t block_size = 64;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_kv_head = 4;
  int64_t n_embd = 128;
  int64_t mlp_hidden = 0;  // 0: 4 * n_embd
  double dropout = 0.0;
  bool tied = true;
  std::string pos = "learned";  // learned | rope
  double rope_theta = 10000.0;  // RoPE's base: channel pair j turns at theta^(-2j / head_size)
  // Scaled RoPE, as a GGUF file states it: positions times rope_scale (linear scaling, 1 /
  // rope.scaling.factor), pair j's frequency divided by rope_freqs[j] (Llama 3.1's rope_freqs
  // tensor: rope_dim() / 2 factors, or none).
  double rope_scale = 1.0;
  std::vector<float> rope_freqs;
  std::string norm = "layernorm";  // layernorm | rmsnorm
  double norm_eps = 1e-5;          // every norm's epsilon (a GGUF file may state another)
  std::string mlp = "gelu";        // gelu | swiglu (gate c_fc, up c_up, down c_proj)
  bool bias = true;                // biases of every Linear and LayerNorm
  bool qkv_bias = false;           // biases of q, k and v alone, without `bias` (Qwen2's block)
  // gqa: n_kv_head key/value heads; mla: keys and values rebuilt per head from a latent of
  // kv_lora_rank values, plus a rotary key of rope_head_dim values shared by every head (RoPE
  // only; n_kv_head = n_head).
  std::string attn = "gqa";
  int64_t kv_lora_rank = 0;
  int64_t rope_head_dim = 0;
  // MLA's query compression: 0 projects the queries from x (q_proj); otherwise through a
  // latent of q_lora_rank values (q_down, then its RMSNorm q_norm, then q_proj).
  int64_t q_lora_rank = 0;

  int64_t head_size() const { return n_embd / n_head; }
  bool rope() const { return pos == "rope"; }
  bool rms() const { return norm == "rmsnorm"; }
  bool swiglu() const { return mlp == "swiglu"; }
  bool mla() const { return attn == "mla"; }
  // The width RoPE turns: a head's (head_size), or MLA's rotary part (rope_head_dim).
  int64_t rope_dim() const { return mla() ? rope_head_dim : head_size(); }
  // What a KV cache holds per layer and position: cache_heads() rows of cache_width() values
  // for the keys and as many for the values; MLA's one latent row serves as both.
  int64_t cache_heads() const { return mla() ? 1 : n_kv_head; }
  int64_t cache_width() const { return mla() ? kv_lora_rank + rope_head_dim : head_size(); }
  // mlp_hidden, or by default 4 n_embd for GELU and, for SwiGLU's three matrices, 8/3 n_embd
  // rounded to a multiple of 8: the same parameters as GELU's two within a few.
  int64_t hidden() const;
  // Throws kvlab::Error naming the offending setting.
  void validate() const;
};

// Per-forward settings shared by every layer.
struct ForwardContext {
  KVCache* cache = nullptr;
  std::span<const int64_t> kv_lengths;  // (B) with a cache: each row's length after this step
  uint64_t dropout_seed = 0;            // each dropout site derives its own mask seed from it
  bool dropout_on = false;
  // With RoPE: each (row, step)'s position (B * T, i32 on the model's device) and the table.
  Tensor rope_positions, rope_table;
};

class CausalSelfAttention : public Module {
 public:
  explicit CausalSelfAttention(const GPTConfig& cfg);
  Tensor forward(const Tensor& x, const ForwardContext& ctx, int layer) const;  // (B, T, C)
  Linear q_proj, k_proj, v_proj, c_proj;  // k, v: (NKV * HS, C)
  int64_t n_head, n_kv_head, head_size;
  double dropout;
};

// DeepSeek-V2's multi-head latent attention. Per token: q_proj gives each head a query of
// head_size + rope_head_dim (the second part rotated), from x or, with q_lora_rank, from x's
// compressed query latent (q_down, normed by q_norm);
// kv_down gives a latent of kv_lora_rank (normed by kv_norm) and a rotary key of
// rope_head_dim shared by every head; kv_up rebuilds each head's key (head_size, then the
// shared rotary key appended) and value (head_size) from the latent. Scores are scaled by
// 1 / sqrt(head_size + rope_head_dim). With a cache it caches the latent and the rotary key
// (kv_lora_rank + rope_head_dim values a position) and attends in latent form, the
// up-projections folded into the query and the output (forward_latent).
class LatentAttention : public Module {
 public:
  explicit LatentAttention(const GPTConfig& cfg);
  Tensor forward(const Tensor& x, const ForwardContext& ctx, int layer) const;  // (B, T, C)
  std::unique_ptr<Linear> q_down;     // (Rq, C), with q_lora_rank only
  std::unique_ptr<LayerNorm> q_norm;  // RMSNorm over Rq, weight only
  Linear q_proj;   // (NH * (HS + D), C or Rq): per head its HS query, then its D rotary query
  Linear kv_down;  // (R + D, C): the latent, then the rotary key
  LayerNorm kv_norm;  // RMSNorm over R, weight only
  Linear kv_up;    // (NH * 2 HS, R): per head its key, then its value
  Linear c_proj;
  int64_t n_head, head_size, rank, rope_dim;
  double dropout;

 private:
  // The cached path: queries in latent form over the cache's latent rows.
  Tensor forward_latent(const Tensor& q_nope, const Tensor& q_rot, const Tensor& latent,
                        const Tensor& k_rot, const ForwardContext& ctx, int layer) const;
};

class Block : public Module {
 public:
  explicit Block(const GPTConfig& cfg);
  Tensor forward(const Tensor& x, const ForwardContext& ctx, int layer) const;
  LayerNorm ln_1;
  // Exactly one is set: grouped-query attention, or MLA's (both named "attn").
  std::unique_ptr<CausalSelfAttention> attn;
  std::unique_ptr<LatentAttention> mla;
  LayerNorm ln_2;
  MLP mlp;
  double dropout;
};

// The type of the products' matrices at inference (--weight-dtype; GPT::round_matrices).

class GPT : public Module {
 public:
  // Parameters drawn with GPT-2's initialisation from `seed`: N(0, 0.02), residual output
  // projections N(0, 0.02 / sqrt(2 L)), zero biases, unit LayerNorm weights.
  GPT(const GPTConfig& cfg, uint64_t seed);
  // Parameters left as the modules make them (matrices uninitialised, zero biases, unit norms),
  // for weights about to be loaded: a real-size model's random draws take longer than reading
  // its file.
  struct WeightsToLoad {};
  GPT(const GPTConfig& cfg, WeightsToLoad);

  // tokens (B, T) i32 -> logits (B, T, V), or (B, 1, V) for the last position only. With a
  // cache, positions continue from each row's cached length and the cache is extended.
  Tensor forward(const Tensor& tokens, KVCache* cache = nullptr, bool last_only = false);
  // Mean cross-entropy of forward(tokens) against targets (B, T).
  Tensor loss(const Tensor& tokens, const Tensor& targets);

  const GPTConfig& config() const { return cfg_; }
  const Tensor& lm_head_weight() const;
  // Source of dropout seeds; its state goes into checkpoints so resumed runs repeat exactly.
  Generator& dropout_generator() { return dropout_gen_; }

  Embedding wte;
  std::unique_ptr<Embedding> wpe;  // only with learned positions
  std::vector<std::unique_ptr<Block>> blocks;
  LayerNorm ln_f;
  std::unique_ptr<Linear> lm_head;  // only when untied
  // Rounds the matrices of the products (each block's six, seven with SwiGLU, MLA's, and the
  // LM head, which tied is the token table) in place to the values `dtype` holds; biases,
  // norms and the position table stay f32. bf16: to nearest even. q8_0 and q4_0: ggml's
  // blocks of 32 along each row (platform/ggml_blocks.h), a matrix whose rows are not whole
  // blocks taking bf16 (as `kvlab export` writes it); with q4_0 the LM head takes q8_0, as llama.cpp's quantiser keeps its
  // output matrix at a higher precision: every token's logits come from it. The model is then
  // one with those values on every path and device, and the fused CPU decode step
  // (infer/decode/decode_step.h) reads them in the form's bytes (2, 1.125 or 0.625 a value).
  void round_matrices(WeightDtype dtype);
  // RoPE's table (rope_table, of config().rope_dim()) in the model's dtype on its device,
  // made once per device and dtype: block_size positions, or at least `positions` for a cache row that dropped its front
  // and goes on past the context (grown by doubling, so a long generation remakes it a few
  // times). Undefined without RoPE. A reference into the model: valid until the next call.
  const Tensor& rope_table(int64_t positions = 0) const;

 private:
  mutable Tensor rope_table_;
  GPTConfig cfg_;
  Generator dropout_gen_;
  std::vector<int64_t> kv_lengths_;  // reused by every cached forward: no allocation per step
};

// Parameter count of a config without building it (for --param-matched search).
int64_t count_parameters(const GPTConfig& cfg);
// The names and shapes of GPT(cfg).named_parameters(), in that order, without allocating them:
// a checkpoint's datasets are compared with them before any weight is read.
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(const GPTConfig& cfg);

}  // namespace kvlab
