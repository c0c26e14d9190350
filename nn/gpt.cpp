#include "nn/gpt.h"

#include <algorithm>
#include <cmath>

#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "platform/ggml_blocks.h"
#include "platform/memory.h"

namespace kvlab {

namespace {
// count_parameters in double, which cannot overflow for any config (exact below 2^53).
double parameters_of(const GPTConfig& c) {
  const auto C = static_cast<double>(c.n_embd), H = static_cast<double>(c.hidden());
  const double kv = static_cast<double>(c.n_kv_head) * static_cast<double>(c.head_size());
  const double b = c.bias ? 1 : 0, bqkv = c.bias || c.qkv_bias ? 1 : 0;
  double attn = (C * C + bqkv * C) + (C * C + b * C) + (C * kv + bqkv * kv) * 2;
  if (c.mla()) {
    const auto R = static_cast<double>(c.kv_lora_rank), D = static_cast<double>(c.rope_head_dim);
    const double NH = static_cast<double>(c.n_head), HS = static_cast<double>(c.head_size());
    const double q = NH * (HS + D), up = 2 * NH * HS, RQ = static_cast<double>(c.q_lora_rank);
    const double q_path = RQ > 0 ? (C * RQ + b * RQ) + RQ + (RQ * q + b * q) : C * q + b * q;
    attn = q_path + (C * (R + D) + b * (R + D)) + R + (R * up + b * up) + (C * C + b * C);
  }
  const double mlp = c.swiglu() ? 2 * (C * H + b * H) + (H * C + b * C)
                                : (C * H + b * H) + (H * C + b * C);
  const double norm = C * (c.bias && !c.rms() ? 2 : 1);
  const double block = attn + mlp + 2 * norm;
  return static_cast<double>(c.vocab_size) * C * (c.tied ? 1 : 2) +
         (c.rope() ? 0 : static_cast<double>(c.block_size) * C) +
         static_cast<double>(c.n_layer) * block + norm;
}
}  // namespace

void GPTConfig::validate() const {
  KVLAB_CHECK(vocab_size > 0, "config: vocab_size must be positive, got ", vocab_size);
  KVLAB_CHECK(block_size >= 1, "config: block_size must be >= 1, got ", block_size);
  KVLAB_CHECK(n_layer >= 1, "config: n_layer must be >= 1, got ", n_layer);
  KVLAB_CHECK(n_head >= 1, "config: n_head must be >= 1, got ", n_head);
  KVLAB_CHECK(n_embd >= 1, "config: n_embd must be >= 1, got ", n_embd);
  KVLAB_CHECK(n_embd % n_head == 0, "config: n_embd = ", n_embd,
              " is not divisible by n_head = ", n_head);
  KVLAB_CHECK(n_kv_head >= 1 && n_kv_head <= n_head, "config: n_kv_head = ", n_kv_head,
              " must be in [1, n_head = ", n_head, "]");
  KVLAB_CHECK(n_head % n_kv_head == 0, "config: n_head = ", n_head,
              " is not divisible by n_kv_head = ", n_kv_head);
  KVLAB_CHECK(mlp_hidden >= 0, "config: mlp_hidden must be >= 0, got ", mlp_hidden);
  KVLAB_CHECK(dropout >= 0 && dropout < 1, "config: dropout ", dropout, " outside [0, 1)");
  KVLAB_CHECK(pos == "learned" || pos == "rope", "config: pos '", pos,
              "' is not one of learned, rope");
  KVLAB_CHECK(norm == "layernorm" || norm == "rmsnorm", "config: norm '", norm,
              "' is not one of layernorm, rmsnorm");
  KVLAB_CHECK(mlp == "gelu" || mlp == "swiglu", "config: mlp '", mlp,
              "' is not one of gelu, swiglu");
  KVLAB_CHECK(attn == "gqa" || attn == "mla", "config: attn '", attn,
              "' is not one of gqa, mla");
  KVLAB_CHECK(!(qkv_bias && mla()), "config: qkv_bias is grouped-query attention's (Qwen2's); "
              "MLA has no q, k and v projections");
  if (mla()) {
    KVLAB_CHECK(rope(), "config: MLA's rotary key needs pos rope, not ", pos);
    KVLAB_CHECK(n_kv_head == n_head, "config: MLA rebuilds a key and value for every head: "
                "n_kv_head must equal n_head = ", n_head, ", got ", n_kv_head);
    KVLAB_CHECK(kv_lora_rank >= 1 && kv_lora_rank <= n_embd, "config: kv_lora_rank ",
                kv_lora_rank, " must be in [1, n_embd = ", n_embd, "]");
    KVLAB_CHECK(rope_head_dim >= 2 && rope_head_dim <= n_embd && rope_head_dim % 2 == 0,
                "config: rope_head_dim ", rope_head_dim, " must be even and in [2, n_embd = ",
                n_embd, "]");
    KVLAB_CHECK(q_lora_rank >= 0 && q_lora_rank <= n_embd, "config: q_lora_rank ", q_lora_rank,
                " must be 0 (no query compression) or in [1, n_embd = ", n_embd, "]");
  } else {
    KVLAB_CHECK(kv_lora_rank == 0 && rope_head_dim == 0 && q_lora_rank == 0, "config: "
                "kv_lora_rank, rope_head_dim and q_lora_rank are MLA's (attn mla); got ",
                kv_lora_rank, ", ", rope_head_dim, " and ", q_lora_rank, " with attn ", attn);
    KVLAB_CHECK(!rope() || head_size() % 2 == 0, "config: RoPE needs an even head size, got ",
                head_size(), " (n_embd ", n_embd, " / n_head ", n_head, ")");
  }
  KVLAB_CHECK(!rope() || (rope_theta > 1 && std::isfinite(rope_theta)), "config: rope_theta ",
              rope_theta, " must be a finite number above 1");
  KVLAB_CHECK(rope_scale > 0 && std::isfinite(rope_scale) && (rope() || rope_scale == 1),
              "config: rope_scale ", rope_scale, " must be a finite number above 0 (and 1 without "
              "RoPE)");
  KVLAB_CHECK(rope_freqs.empty() || (rope() && static_cast<int64_t>(rope_freqs.size()) * 2 ==
                                                   rope_dim()),
              "config: ", rope_freqs.size(), " rope_freqs, but RoPE turns ", rope_dim(),
              " channels (", rope_dim() / 2, " frequencies)");
  for (const float f : rope_freqs)
    KVLAB_CHECK(f > 0 && std::isfinite(f), "config: a rope_freqs factor is ", f,
                ", not a finite number above 0");
  KVLAB_CHECK(norm_eps > 0 && norm_eps < 1, "config: norm_eps ", norm_eps,
              " must be above 0 and below 1");
  // The layers are allocated one by one, each small: a model far past memory would grow
  // until the system kills the process rather than fail one large allocation.
  const double params = parameters_of(*this);
  const double memory = host_memory_bytes();
  KVLAB_CHECK(memory <= 0 || 4 * params <= memory, "config: the model would have ", params,
              " parameters, ", 4 * params / 1e9, " GB of f32 weights: more than this machine's ",
              memory / 1e9, " GB of memory (n_layer ", n_layer, ", n_embd ", n_embd,
              ", block_size ", block_size, ")");
}

int64_t GPTConfig::hidden() const {
  if (mlp_hidden > 0) return mlp_hidden;
  if (!swiglu()) return 4 * n_embd;
  return std::max<int64_t>(8, (8 * n_embd / 3 + 4) / 8 * 8);
}

namespace {
// Dropout sites get independent masks: seed of site k in layer l = hash(forward seed, site).
uint64_t site_seed(const ForwardContext& ctx, int layer, int site) {
  return hash64(ctx.dropout_seed, static_cast<uint64_t>(layer) * 8 + static_cast<uint64_t>(site));
}
Tensor maybe_dropout(const Tensor& x, double p, const ForwardContext& ctx, int layer, int site) {
  return ctx.dropout_on && p > 0 ? dropout(x, p, site_seed(ctx, layer, site)) : x;
}
}  // namespace

CausalSelfAttention::CausalSelfAttention(const GPTConfig& cfg)
    : q_proj(cfg.n_embd, cfg.n_embd, cfg.bias || cfg.qkv_bias),
      k_proj(cfg.n_embd, cfg.n_kv_head * cfg.head_size(), cfg.bias || cfg.qkv_bias),
      v_proj(cfg.n_embd, cfg.n_kv_head * cfg.head_size(), cfg.bias || cfg.qkv_bias),
      c_proj(cfg.n_embd, cfg.n_embd, cfg.bias),
      n_head(cfg.n_head),
      n_kv_head(cfg.n_kv_head),
      head_size(cfg.head_size()),
      dropout(cfg.dropout) {
  register_module("q_proj", q_proj);
  register_module("k_proj", k_proj);
  register_module("v_proj", v_proj);
  register_module("c_proj", c_proj);
}

Tensor CausalSelfAttention::forward(const Tensor& x, const ForwardContext& ctx, int layer) const {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  // Projections stay in (B, T, H, HS) memory; the attention op reads them through
  // transposed (B, H, T, HS) views, so no transposing copy is made.
  Tensor q = reshape(q_proj.forward(x), {B, T, n_head, head_size});
  Tensor k = reshape(k_proj.forward(x), {B, T, n_kv_head, head_size});
  if (ctx.rope_table.defined()) {  // keys are cached rotated, at their absolute positions
    q = rope(q, ctx.rope_positions, ctx.rope_table);
    k = rope(k, ctx.rope_positions, ctx.rope_table);
  }
  q = transpose(q, 1, 2);
  k = transpose(k, 1, 2);
  Tensor v = transpose(reshape(v_proj.forward(x), {B, T, n_kv_head, head_size}), 1, 2);
  AttentionOptions opts;
  if (ctx.cache != nullptr) {
    auto [kc, vc] = ctx.cache->append(layer, k, v);  // (B, NKV, S, HS)
    opts.kv_lengths = ctx.kv_lengths;
    opts.kv_blocks = ctx.cache->kv_blocks();
    opts.kv_scales = ctx.cache->kv_scales(layer);
    k = kc;
    v = vc;
  }
  if (ctx.dropout_on && dropout > 0) {
    opts.dropout = dropout;
    opts.seed = site_seed(ctx, layer, 0);
  }
  Tensor y = causal_attention(q, k, v, opts);  // (B, NH, T, HS)
  y = reshape(transpose(y, 1, 2), {B, T, C});  // a view: y is (B, T, NH, HS) in memory
  return maybe_dropout(c_proj.forward(y), dropout, ctx, layer, 1);
}

LatentAttention::LatentAttention(const GPTConfig& cfg)
    : q_down(cfg.q_lora_rank > 0 ? std::make_unique<Linear>(cfg.n_embd, cfg.q_lora_rank, cfg.bias)
                                 : nullptr),
      q_norm(cfg.q_lora_rank > 0 ? std::make_unique<LayerNorm>(cfg.q_lora_rank, cfg.norm_eps, true, false)
                                 : nullptr),
      q_proj(cfg.q_lora_rank > 0 ? cfg.q_lora_rank : cfg.n_embd,
             cfg.n_head * (cfg.head_size() + cfg.rope_head_dim), cfg.bias),
      kv_down(cfg.n_embd, cfg.kv_lora_rank + cfg.rope_head_dim, cfg.bias),
      kv_norm(cfg.kv_lora_rank, cfg.norm_eps, true, false),
      kv_up(cfg.kv_lora_rank, 2 * cfg.n_head * cfg.head_size(), cfg.bias),
      c_proj(cfg.n_embd, cfg.n_embd, cfg.bias),
      n_head(cfg.n_head),
      head_size(cfg.head_size()),
      rank(cfg.kv_lora_rank),
      rope_dim(cfg.rope_head_dim),
      dropout(cfg.dropout) {
  if (q_down) {
    register_module("q_down", *q_down);
    register_module("q_norm", *q_norm);
  }
  register_module("q_proj", q_proj);
  register_module("kv_down", kv_down);
  register_module("kv_norm", kv_norm);
  register_module("kv_up", kv_up);
  register_module("c_proj", c_proj);
}

// Composed from the ops every backend has. Without a cache (training): the shared rotary key
// is concatenated to each head's key, and the values are padded with zeros to the keys' width
// so that one attention call (same head size for q, k and v) serves; the padding's outputs
// are cut off. With a cache, see forward_latent.
Tensor LatentAttention::forward(const Tensor& x, const ForwardContext& ctx, int layer) const {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const int64_t NH = n_head, HS = head_size, D = rope_dim;
  const Tensor q =
      reshape(q_proj.forward(q_down ? q_norm->forward(q_down->forward(x)) : x), {B, T, NH, HS + D});
  const Tensor q_rot = rope(narrow(q, 3, HS, D), ctx.rope_positions, ctx.rope_table);
  const Tensor kv = kv_down.forward(x);  // (B, T, R + D)
  const Tensor latent = kv_norm.forward(narrow(kv, 2, 0, rank));
  const Tensor k_rot =
      rope(reshape(narrow(kv, 2, rank, D), {B, T, 1, D}), ctx.rope_positions, ctx.rope_table);
  if (ctx.cache != nullptr)
    return forward_latent(narrow(q, 3, 0, HS), q_rot, latent, k_rot, ctx, layer);
  const Tensor up = reshape(kv_up.forward(latent), {B, T, NH, 2 * HS});
  const Tensor k = concat({narrow(up, 3, 0, HS), concat(std::vector<Tensor>(NH, k_rot), 2)}, 3);
  const Tensor pad = Tensor::zeros({B, T, NH, D}, x.dtype(), x.device());
  const Tensor v = concat({narrow(up, 3, HS, HS), pad}, 3);
  AttentionOptions opts;
  if (ctx.dropout_on && dropout > 0) {
    opts.dropout = dropout;
    opts.seed = site_seed(ctx, layer, 0);
  }
  // (B, NH, T, HS + D)
  Tensor y = causal_attention(transpose(concat({narrow(q, 3, 0, HS), q_rot}, 3), 1, 2),
                              transpose(k, 1, 2), transpose(v, 1, 2), opts);
  y = reshape(narrow(transpose(y, 1, 2), 3, 0, HS), {B, T, C});
  return maybe_dropout(c_proj.forward(y), dropout, ctx, layer, 1);
}

// Inference in latent form. The cache holds, per position, the normed latent and the rotated
// shared key: one row of R + D values serving as key and value (values_are_keys). Each head's
// query is carried into that space, its HS part through the head's key rows W_uk of kv_up
// (q . W_uk c = (W_uk^T q) . c), so one attention over the cached rows, a single KV head for
// every query head, gives each head its softmax-weighted sum of latents (the rows' first R
// values), which the head's value rows W_uv of kv_up turn into its output. The key rows' bias
// moves every score of a query equally, which softmax ignores; the value rows' bias is added
// after, the weights summing to 1. The queries are scaled so that the attention's
// 1 / sqrt(R + D) becomes training's 1 / sqrt(HS + D).
Tensor LatentAttention::forward_latent(const Tensor& q_nope, const Tensor& q_rot,
                                       const Tensor& latent, const Tensor& k_rot,
                                       const ForwardContext& ctx, int layer) const {
  const int64_t B = q_nope.size(0), T = q_nope.size(1), NH = n_head, HS = head_size, R = rank;
  const Tensor row = concat({reshape(latent, {B, T, 1, R}), k_rot}, 3);  // (B, T, 1, R + D)
  auto [kc, vc] = ctx.cache->append(layer, transpose(row, 1, 2), transpose(row, 1, 2));
  const Tensor w = reshape(kv_up.weight, {NH, 2 * HS, R});
  // (NH, B T, HS) @ W_uk (NH, HS, R) -> (NH, B T, R) -> (B, NH, T, R)
  const Tensor per_head =
      reshape(transpose(reshape(q_nope, {B * T, NH, HS}), 0, 1), {NH, B * T, HS});
  const Tensor q_lat =
      transpose(reshape(matmul(per_head, narrow(w, 1, 0, HS)), {NH, B, T, R}), 0, 1);
  const Tensor q = scale(concat({q_lat, transpose(q_rot, 1, 2)}, 3),
                         std::sqrt(static_cast<double>(R + rope_dim) / (HS + rope_dim)));
  AttentionOptions opts;
  opts.kv_lengths = ctx.kv_lengths;
  opts.kv_blocks = ctx.cache->kv_blocks();
  opts.kv_scales = ctx.cache->kv_scales(layer);
  const Tensor o = narrow(causal_attention(q, kc, vc, opts), 3, 0, R);  // (B, NH, T, R)
  // (NH, B T, R) @ W_uv^T -> (NH, B T, HS) -> (B, T, NH, HS)
  const Tensor sums = reshape(transpose(o, 0, 1), {NH, B * T, R});
  const Tensor heads = reshape(matmul(sums, narrow(w, 1, HS, HS), false, true), {NH, B, T, HS});
  Tensor y = reshape(transpose(transpose(heads, 0, 1), 1, 2), {B, T, NH * HS});
  if (kv_up.bias.defined())
    y = add(y, reshape(narrow(reshape(kv_up.bias, {NH, 2 * HS}), 1, HS, HS), {NH * HS}));
  return c_proj.forward(y);
}

Block::Block(const GPTConfig& cfg)
    : ln_1(cfg.n_embd, cfg.norm_eps, cfg.rms(), cfg.bias),
      ln_2(cfg.n_embd, cfg.norm_eps, cfg.rms(), cfg.bias),
      mlp(cfg.n_embd, cfg.hidden(), cfg.swiglu(), cfg.bias),
      dropout(cfg.dropout) {
  register_module("ln_1", ln_1);
  if (cfg.mla()) {
    mla = std::make_unique<LatentAttention>(cfg);
    register_module("attn", *mla);
  } else {
    attn = std::make_unique<CausalSelfAttention>(cfg);
    register_module("attn", *attn);
  }
  register_module("ln_2", ln_2);
  register_module("mlp", mlp);
}

Tensor Block::forward(const Tensor& x_in, const ForwardContext& ctx, int layer) const {
  const Tensor h = ln_1.forward(x_in);
  Tensor x = add(x_in, mla ? mla->forward(h, ctx, layer) : attn->forward(h, ctx, layer));
  return add(x, maybe_dropout(mlp.forward(ln_2.forward(x)), dropout, ctx, layer, 2));
}

GPT::GPT(const GPTConfig& cfg, uint64_t seed) : GPT(cfg, WeightsToLoad{}) {
  dropout_gen_.reseed(hash64(seed, 0x64726f70));
  // Each parameter draws from its own stream, seeded by (seed, name): variants that differ
  // only in n_kv_head start from identical values for every parameter they share.
  const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
  for (auto& [name, t] : named_parameters()) {
    if (t.dim() < 2) continue;                    // biases stay 0, LayerNorm weights 1
    uint64_t name_hash = 1469598103934665603ull;  // FNV-1a
    for (unsigned char ch : name) name_hash = (name_hash ^ ch) * 1099511628211ull;
    Generator gen(hash64(seed, name_hash));
    const bool resid = name.ends_with("c_proj.weight");
    Tensor p = t;
    normal_(p, gen, resid ? resid_std : 0.02);
  }
}

GPT::GPT(const GPTConfig& cfg, WeightsToLoad)
    : wte((cfg.validate(), cfg.vocab_size), cfg.n_embd),
      ln_f(cfg.n_embd, cfg.norm_eps, cfg.rms(), cfg.bias),
      cfg_(cfg),
      dropout_gen_(hash64(0, 0x64726f70)) {
  register_module("wte", wte);
  if (!cfg.rope()) {
    wpe = std::make_unique<Embedding>(cfg.block_size, cfg.n_embd);
    register_module("wpe", *wpe);
  }
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    blocks.push_back(std::make_unique<Block>(cfg));
    register_module("blocks." + std::to_string(l), *blocks.back());
  }
  register_module("ln_f", ln_f);
  if (!cfg.tied) {
    lm_head = std::make_unique<Linear>(cfg.n_embd, cfg.vocab_size, false);
    register_module("lm_head", *lm_head);
  }
}

const Tensor& GPT::lm_head_weight() const { return lm_head ? lm_head->weight : wte.weight; }

namespace {

// w's values rounded in place to q8_0 or q4_0 blocks along its rows, on the host (a GPU
// tensor goes there and back); rows that are not whole blocks take bf16 instead.
void round_to_blocks(Tensor& w, WeightDtype dtype) {
  if (w.size(1) % kGgmlBlock != 0) return w.copy_from(w.to(DType::BF16));
  Tensor host = w.to(Device::CPU);  // w itself on the CPU
  float* x = host.data<float>();
  if (dtype == WeightDtype::Q4_0)
    round_to_q4_0(x, host.numel());
  else
    round_to_q8_0(x, host.numel());
  if (w.device() != Device::CPU) w.copy_from(host);
}

}  // namespace

void GPT::round_matrices(WeightDtype dtype) {
  if (dtype == WeightDtype::F32) return;
  std::vector<Tensor> matrices;  // handles on the same storage
  for (const auto& b : blocks) {
    const std::vector<const Linear*> attention =
        b->mla ? std::vector<const Linear*>{b->mla->q_down.get(), &b->mla->q_proj,
                                            &b->mla->kv_down, &b->mla->kv_up, &b->mla->c_proj}
               : std::vector<const Linear*>{&b->attn->q_proj, &b->attn->k_proj, &b->attn->v_proj,
                                            &b->attn->c_proj};
    for (const Linear* l : attention)
      if (l != nullptr) matrices.push_back(l->weight);  // MLA's q_down may be absent
    for (const Linear* l : {&b->mlp.c_fc, b->mlp.c_up.get(), &b->mlp.c_proj})
      if (l != nullptr) matrices.push_back(l->weight);
  }
  Tensor head = lm_head_weight();
  for (Tensor& w : matrices) {
    if (dtype == WeightDtype::BF16)
      w.copy_from(w.to(DType::BF16));
    else
      round_to_blocks(w, dtype);
  }
  if (dtype == WeightDtype::BF16)
    head.copy_from(head.to(DType::BF16));
  else
    round_to_blocks(head, WeightDtype::Q8_0);  // q8_0 for q4_0 too (round_matrices says why)
}

const Tensor& GPT::rope_table(int64_t positions) const {
  if (!cfg_.rope()) return rope_table_;  // undefined
  const Tensor& w = wte.weight;
  const bool fits = rope_table_.defined() && rope_table_.device() == w.device() &&
                    rope_table_.dtype() == w.dtype() && rope_table_.size(0) >= positions;
  if (!fits) {
    int64_t P = std::max(cfg_.block_size, positions);
    if (rope_table_.defined() && positions > rope_table_.size(0))
      P = std::max(P, 2 * rope_table_.size(0));
    rope_table_ = Tensor();  // free first
    rope_table_ = kvlab::rope_table(P, cfg_.rope_dim(), cfg_.rope_theta, w.dtype(), w.device(),
                                    cfg_.rope_scale, cfg_.rope_freqs);
  }
  return rope_table_;
}

Tensor GPT::forward(const Tensor& tokens_in, KVCache* cache, bool last_only) {
  KVLAB_CHECK(tokens_in.dtype() == DType::I32 && tokens_in.dim() == 2,
              "gpt: tokens must be (B, T) i32, got ", tokens_in.shape_str(), " ",
              dtype_name(tokens_in.dtype()));
  const Device dev = wte.weight.device();
  const Tensor tokens = tokens_in.to(dev);  // callers may pass host tokens to a GPU model
  const int64_t B = tokens.size(0), T = tokens.size(1);
  KVLAB_CHECK(T >= 1, "gpt: empty sequence");
  ForwardContext ctx;
  ctx.cache = cache;
  ctx.dropout_on = training() && cfg_.dropout > 0 && grad_enabled();
  if (ctx.dropout_on) ctx.dropout_seed = dropout_gen_.next_u64();
  Tensor pos;  // (T) shared by all rows, or (B, T) with RoPE or rows continuing from a cache
  int64_t max_position = T;  // one past the last position any row reaches
  if (cache == nullptr) {
    KVLAB_CHECK(T <= cfg_.block_size, "gpt: sequence of ", T, " tokens exceeds block_size ",
                cfg_.block_size);
    // RoPE rotates each (row, step) at its own entry; the position table is shared by rows.
    const int64_t rows = cfg_.rope() ? B : 1;
    pos = Tensor::empty(cfg_.rope() ? Shape{B, T} : Shape{T}, DType::I32);
    for (int64_t i = 0; i < rows * T; ++i) pos.data<int32_t>()[i] = static_cast<int32_t>(i % T);
  } else {
    KVLAB_CHECK(cache->batch() == B, "gpt: cache holds ", cache->batch(), " rows, tokens have ", B);
    pos = Tensor::empty({B, T}, DType::I32);
    kv_lengths_.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = cache->lengths()[b], first = cache->position_offsets()[b];
      KVLAB_CHECK(len + T <= cfg_.block_size && len + T <= cache->capacity(), "gpt: row ", b,
                  " would reach position ", len + T, " past the context limit (block_size ",
                  cfg_.block_size, ", cache capacity ", cache->capacity(), ")");
      KVLAB_CHECK(first == 0 || cfg_.rope(), "gpt: row ", b, " of the cache dropped its first ",
                  first, " positions, which only RoPE positions go on past");
      for (int64_t t = 0; t < T; ++t)
        pos.data<int32_t>()[b * T + t] = static_cast<int32_t>(first + len + t);
      kv_lengths_[static_cast<size_t>(b)] = len + T;
      max_position = std::max(max_position, first + len + T);
    }
    ctx.kv_lengths = kv_lengths_;
  }
  Tensor x = wte.forward(tokens);  // (B, T, C)
  if (cfg_.rope()) {
    ctx.rope_positions = pos.to(dev);
    ctx.rope_table = rope_table(max_position);
  } else {
    x = add(x, wpe->forward(pos.to(dev)));
  }
  x = maybe_dropout(x, cfg_.dropout, ctx, static_cast<int>(cfg_.n_layer), 3);
  for (size_t l = 0; l < blocks.size(); ++l) x = blocks[l]->forward(x, ctx, static_cast<int>(l));
  if (cache != nullptr) cache->advance(T);
  if (last_only && T > 1) x = narrow(x, 1, T - 1, 1);
  x = ln_f.forward(x);
  return linear(x, lm_head_weight());
}

Tensor GPT::loss(const Tensor& tokens, const Tensor& targets) {
  return cross_entropy(forward(tokens), targets.to(wte.weight.device()));
}

int64_t count_parameters(const GPTConfig& c) { return static_cast<int64_t>(parameters_of(c)); }

std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(const GPTConfig& c) {
  c.validate();
  const int64_t C = c.n_embd, kv = c.n_kv_head * c.head_size(), H = c.hidden();
  std::vector<std::pair<std::string, std::vector<int64_t>>> s;
  const auto linear = [&](const std::string& name, int64_t in, int64_t out, bool bias) {
    s.push_back({name + ".weight", {out, in}});
    if (bias) s.push_back({name + ".bias", {out}});
  };
  const auto norm = [&](const std::string& name) {
    s.push_back({name + ".weight", {C}});
    if (c.bias && !c.rms()) s.push_back({name + ".bias", {C}});
  };
  s.push_back({"wte.weight", {c.vocab_size, C}});
  if (!c.rope()) s.push_back({"wpe.weight", {c.block_size, C}});
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    norm(b + "ln_1");
    if (c.mla()) {
      const int64_t R = c.kv_lora_rank, D = c.rope_head_dim, NH = c.n_head, HS = c.head_size();
      const int64_t RQ = c.q_lora_rank;
      if (RQ > 0) {
        linear(b + "attn.q_down", C, RQ, c.bias);
        s.push_back({b + "attn.q_norm.weight", {RQ}});
      }
      linear(b + "attn.q_proj", RQ > 0 ? RQ : C, NH * (HS + D), c.bias);
      linear(b + "attn.kv_down", C, R + D, c.bias);
      s.push_back({b + "attn.kv_norm.weight", {R}});
      linear(b + "attn.kv_up", R, 2 * NH * HS, c.bias);
    } else {
      const bool qkv = c.bias || c.qkv_bias;
      linear(b + "attn.q_proj", C, C, qkv);
      linear(b + "attn.k_proj", C, kv, qkv);
      linear(b + "attn.v_proj", C, kv, qkv);
    }
    linear(b + "attn.c_proj", C, C, c.bias);
    norm(b + "ln_2");
    linear(b + "mlp.c_fc", C, H, c.bias);
    if (c.swiglu()) linear(b + "mlp.c_up", C, H, c.bias);
    linear(b + "mlp.c_proj", H, C, c.bias);
  }
  norm("ln_f");
  if (!c.tied) s.push_back({"lm_head.weight", {c.vocab_size, C}});
  return s;
}

}  // namespace kvlab
