#pragma once
// The GPT: token + learned position embeddings, pre-norm blocks of grouped-query attention
// and an MLP, a final LayerNorm and an LM head tied to the token embedding by default.
// Training calls forward without a cache; inference calls it in a no-grad scope with one.
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "autograd/random.h"
#include "nn/kv_cache.h"
#include "nn/layers.h"

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

  int64_t head_size() const { return n_embd / n_head; }
  int64_t hidden() const { return mlp_hidden > 0 ? mlp_hidden : 4 * n_embd; }
  // Throws kvlab::Error naming the offending setting.
  void validate() const;
};

// Per-forward settings shared by every layer.
struct ForwardContext {
  KVCache* cache = nullptr;
  std::span<const int64_t> kv_lengths;  // (B) with a cache: each row's length after this step
  uint64_t dropout_seed = 0;  // each dropout site derives its own mask seed from it
  bool dropout_on = false;
};

class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(int64_t n_embd, int64_t n_head, int64_t n_kv_head, double dropout);
  Tensor forward(const Tensor& x, const ForwardContext& ctx, int layer) const;  // (B, T, C)
  Linear q_proj, k_proj, v_proj, c_proj;  // k, v: (NKV * HS, C)
  int64_t n_head, n_kv_head, head_size;
  double dropout;
};

class Block : public Module {
 public:
  explicit Block(const GPTConfig& cfg);
  Tensor forward(const Tensor& x, const ForwardContext& ctx, int layer) const;
  LayerNorm ln_1;
  CausalSelfAttention attn;
  LayerNorm ln_2;
  MLP mlp;
  double dropout;
};

class GPT;
struct DecodeRefs;  // the fused step's pointers into a model (nn/gpt_decode.cpp)

// While it lives, the model's fused CPU decode steps read copies of its matrices packed for
// few-row products (cpu::pack_weight), made when GPT::pack_for_decode returned it: the
// weights must not change until it is destroyed, and it must not outlive the model. Empty
// (packing nothing) where the fused step or the packed kernel does not apply. Guards nest:
// the copies are read until the last one ends.
class DecodePackGuard {
 public:
  DecodePackGuard() = default;
  DecodePackGuard(DecodePackGuard&& o) noexcept : model_(std::exchange(o.model_, nullptr)) {}
  DecodePackGuard& operator=(DecodePackGuard&&) = delete;
  ~DecodePackGuard();

 private:
  friend class GPT;
  explicit DecodePackGuard(GPT* model) : model_(model) {}
  GPT* model_ = nullptr;
};

class GPT : public Module {
 public:
  // Parameters drawn with GPT-2's initialisation from `seed`: N(0, 0.02), residual output
  // projections N(0, 0.02 / sqrt(2 L)), zero biases, unit LayerNorm weights.
  GPT(const GPTConfig& cfg, uint64_t seed);

  // tokens (B, T) i32 -> logits (B, T, V), or (B, 1, V) for the last position only. With a
  // cache, positions continue from each row's cached length and the cache is extended.
  Tensor forward(const Tensor& tokens, KVCache* cache = nullptr, bool last_only = false);
  // Mean cross-entropy of forward(tokens) against targets (B, T).
  Tensor loss(const Tensor& tokens, const Tensor& targets);

  const GPTConfig& config() const { return cfg_; }
  const Tensor& lm_head_weight() const;
  // Source of dropout seeds; its state goes into checkpoints so resumed runs repeat exactly.
  Generator& dropout_generator() { return dropout_gen_; }

  Embedding wte, wpe;
  std::vector<std::unique_ptr<Block>> blocks;
  LayerNorm ln_f;
  std::unique_ptr<Linear> lm_head;  // only when untied
  // Decode steps on the CPU (a cache, T = 1, no gradients, f32) run fused in one parallel
  // region (gpt_decode.cpp); false runs them op by op, as the tests and benchmarks compare.
  bool fused_cpu_decode = true;
  // Packs the matrices of the fused decode step (1-2 ms for 20 MB of weights; the buffers are
  // kept for the next call). Engine::generate holds one for each call. A matrix whose values
  // are all bf16 is packed in the bf16 form: half the bytes, the same results.
  [[nodiscard]] DecodePackGuard pack_for_decode();
  // Rounds the matrices of the products (each block's six and the LM head, which tied is the
  // token table) to bf16 in place, to nearest even; biases, LayerNorms and the position table
  // stay f32. The model is then one with bf16 matrices on every path and device, and the
  // fused CPU decode reads them in half the bytes.
  void round_matrices_to_bf16();
  // Bytes of weights a decode step reads: every parameter but the position table and, when
  // the LM head is a matrix of its own, the token table (a row of each); at 2 bytes an element
  // for the matrices the fused CPU step packs as bf16, 4 for the rest.
  int64_t decode_weight_bytes() const;

 private:
  friend class DecodePackGuard;
  // Whether a cached step of T = 1 on this model runs fused (decode_step_cpu).
  bool fused_decode_applies() const;
  // Whether pack_for_decode packs (the fused step applies and this build has the kernel).
  bool packing_applies() const;
  // The matrices the fused step reads packed, in decode_pack_'s order.
  std::vector<const Tensor*> decode_matrices() const;
  // The fused decode step: tokens (B, 1) and positions (B, 1) on the host, the cache's rows
  // already checked for room. Appends to every layer's cache; returns logits (B, 1, V).
  Tensor decode_step_cpu(const Tensor& tokens, const Tensor& pos, KVCache& cache);

  GPTConfig cfg_;
  Generator dropout_gen_;
  std::vector<int64_t> kv_lengths_;  // reused by every cached forward: no allocation per step
  // For each thread of the step (omp_get_max_threads at packing), its rows of each matrix
  // (per layer q, k, v, c_proj, c_fc, mlp c_proj, then the LM head), each packed on their own
  // in one of cpu::pack_weight's forms, one after another in decode_pack_'s f32 words, each
  // from a 64-byte boundary: f32 (packed_weight_size(rows, in) words) or, for a matrix whose
  // values are all bf16, bf16 (packed_weight_bf16_size values, two to a word); read while a
  // DecodePackGuard lives (decode_pack_users_ of them) by steps on that many threads.
  Tensor decode_pack_;
  int decode_pack_users_ = 0;
  // The fused step's pointers into the weights and into decode_pack_, taken by the last
  // pack_for_decode for the steps its guards cover (a step without one takes its own).
  std::shared_ptr<const DecodeRefs> decode_refs_;
};

// Parameter count of a config without building it (for --param-matched search).
int64_t count_parameters(const GPTConfig& cfg);
// The names and shapes of GPT(cfg).named_parameters(), in that order, without allocating them:
// a checkpoint's datasets are compared with them before any weight is read.
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(const GPTConfig& cfg);

}  // namespace kvlab
