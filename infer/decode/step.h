#pragma once
// What the decode step's threads share (Step, fixed before the parallel region) and what each
// keeps of its own (ThreadStep), with the row-wise pieces every stage uses: a thread's rows of
// a product, the residual add and LayerNorm. Only decode_step.cpp includes this and the stage
// headers (attend_gqa.h, attend_mla.h, block_stages.h), whose functions are static inline so
// that the whole step compiles as one function, as before it was split into stages.
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <span>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/kernels.h"
#include "infer/decode/cache_rows.h"
#include "infer/decode/packed_weights.h"
#include "infer/decode/thread_rows.h"
#include "nn/gpt.h"
#include "platform/parallel.h"

namespace kvlab::decode {

// The step's buffers, carved from one block that the step keeps (making tensors each step
// cost time a step can measure), each on 64-byte lines of its own.
// MLA's: q (B, NH (HS + D)), then its attention's output y (B, C); k the latent rows (B, R + D);
// v the queries carried into latent form (B, NH, R + D); att the attention's (B, NH, R + D); d
// first q_down's output (B, q_lora_rank).
struct StepBuffers {
  float* x;     // (B, C) the residual stream
  float* q;     // (B, C): this step's queries, (B, 1, NH, HS)
  float* k;     // (B, KVD) this step's keys, KVD = NKV * HS
  float* v;     // (B, KVD) this step's values
  float* att;   // (B, C): the attention's output y, (B, 1, NH, HS)
  float* d;     // (B, C): a block's update to x
  float* h;     // (B, H): the MLP's hidden (SwiGLU's gate, then silu(gate) * up)
  float* up;    // (B, H): SwiGLU's up projection (no words otherwise)
  float* own;   // (threads, own_size): per thread its LayerNorm output (B, C), mean and rstd (B)
  float* work;  // (threads, work_size): per thread the attention's work memory
  static constexpr size_t kCount = 10;
  // The buffers' sizes in f32 words, in the order above.
  // q_w, k_w, v_w, att_w: the widths of q, k, v and att (C, KVD, KVD, C; MLA's above).
  static std::array<int64_t, kCount> sizes(int64_t B, int64_t C, int64_t q_w, int64_t k_w,
                                           int64_t v_w, int64_t att_w, int64_t H, bool swiglu,
                                           int threads, int64_t own_size, int64_t work_size) {
    const int64_t BC = B * C;
    return {BC,
            B * q_w,
            B * k_w,
            B * v_w,
            B * att_w,
            BC,
            B * H,
            swiglu ? B * H : 0,
            threads * own_size,
            threads * work_size};
  }
  // Carves them from `block` in that order (members are initialised in declaration order).
  StepBuffers(float* block, const std::array<int64_t, kCount>& n)
      : x(carve(block, n[0])),
        q(carve(block, n[1])),
        k(carve(block, n[2])),
        v(carve(block, n[3])),
        att(carve(block, n[4])),
        d(carve(block, n[5])),
        h(carve(block, n[6])),
        up(carve(block, n[7])),
        own(carve(block, n[8])),
        work(carve(block, n[9])) {}

 private:
  static float* carve(float*& block, int64_t n) {
    float* p = block;
    block += whole_lines(n);
    return p;
  }
};

// The step's sizes.
struct StepDims {
  // B rows, C channels, V the vocabulary, H the MLP's hidden width; NH query heads, NKV KV
  // heads of HS, KVD = NKV * HS, G = NH / NKV query heads per KV head.
  int64_t B, C, V, H, NH, NKV, HS, KVD, G;
  // MLA: R the latent's rank, D the rotary width, RQ the query latent's rank (0: none); a
  // query of QW = HS + D a head, one latent row of KW = R + D a position (the cache's single
  // KV head), and queries in latent form of KW a head.
  bool mla;
  int64_t R, D, RQ, QW, KW;
  StepDims(const GPTConfig& cfg, int64_t rows)
      : B(rows),
        C(cfg.n_embd),
        V(cfg.vocab_size),
        H(cfg.hidden()),
        NH(cfg.n_head),
        NKV(cfg.n_kv_head),
        HS(cfg.head_size()),
        KVD(NKV * HS),
        G(NH / NKV),
        mla(cfg.mla()),
        R(cfg.kv_lora_rank),
        D(cfg.rope_head_dim),
        RQ(cfg.q_lora_rank),
        QW(HS + D),
        KW(cfg.cache_width()) {}
};

// What every thread of the step reads, set before the parallel region: nothing inside it may
// throw or allocate.
struct Step : StepDims {
  const GPTConfig& cfg;
  const int32_t* ids;        // (B) this step's tokens
  const int64_t* lengths;    // each row's, this step's position included
  const int32_t* positions;  // each row's new position (past its slots by what it dropped)
  const float* rope;         // RoPE's table, rotating q and k in place, or null
  const float* wte;
  const float* wpe;  // null with RoPE
  const DecodeRefs& refs;
  std::span<const CacheRef> caches;  // each layer's rows
  StepBuffers buf;
  // One row's attention: the kernel's tasks of row b are those of a batch of 1 at row b's
  // pointers (its own cache rows, q and y at b * C, its length). MLA's is over the latent rows,
  // one KV head for every query head, scaled as training's 1 / sqrt(HS + D).
  AttentionShape s;
  HeadView qv;  // q and y as (B, NH, 1, HS); MLA's as (B, NH, 1, KW)
  // Per thread, words of buf.own (ln_1's output, its mean and rstd, and MLA's scratch) and of
  // buf.work (the attention's work memory).
  int64_t own_size, work_size;
  float* out;  // the logits (B, V)
  cpu::SpinBarrier& barrier;
  // The first (layer, row, KV head) whose new key or value a quantised cache could not store,
  // as l * B * NKV + b * NKV + h (MLA: l * B + b, its one latent row), or -1: nothing inside
  // the region may throw, so the step reports it after the region, before the cache advances.
  std::atomic<int64_t>& nonfinite;
};

// One thread's part of the step: its rows of each product and its own memory.
struct ThreadStep {
  const Step& st;
  const int nt, t;
  float* ln;       // (B, C): its copy of a LayerNorm's output
  float* stats;    // its mean and rstd (B each)
  float* scratch;  // MLA's: the normed query latents (B, RQ), or a latent row being normed
  float* work;     // the attention's work memory
  const StepRows rows;
  // Without own groups, with fewer KV groups than threads a group's query heads are shared
  // out too.
  const int64_t parts;
  // Whether the packing was for nt threads: only then does thread t read its packed parts.
  const bool packed_for_nt;
  ThreadStep(const Step& step, int t_, int nt_)
      : st(step),
        nt(nt_),
        t(t_),
        ln(step.buf.own + t_ * step.own_size),
        stats(ln + step.B * step.C),
        scratch(stats + 2 * step.B),
        work(step.buf.work + t_ * step.work_size),
        rows(step.cfg, t_, nt_),
        parts(rows.own_groups ? 1 : std::clamp<int64_t>(nt_ / (step.B * step.NKV), 1, step.G)),
        packed_for_nt(step.refs.threads == nt_) {}
  // This thread's part of a packed matrix, or null (the row-major weight).
  const PackRef* part(const LinearRef& lin) const {
    return packed_for_nt ? lin.parts + t : nullptr;
  }
  // Records where a quantised store failed, if no failure is recorded yet.
  void note_nonfinite(int64_t at) const {
    int64_t none = -1;
    st.nonfinite.compare_exchange_strong(none, at);
  }
};

// One thread's attention shape, pointed at each row in turn (apart from ThreadStep, which no
// stage changes).
struct RowAttention {
  AttentionShape shape;   // S set per layer, kv_lengths per row
  KVBlocks row_blocks{};  // a paged layer's block tables, table at the row being attended
  explicit RowAttention(const AttentionShape& s) : shape(s) {}
  // Points the shape at a layer's cache rows (a paged row is attended as a batch of 1 at its
  // own block table).
  void layer(const CacheRef& kv) {
    shape.S = kv.S;
    const bool paged = kv.rows.blocks != nullptr;
    if (paged) row_blocks = *kv.rows.blocks;
    shape.kv_blocks = paged ? &row_blocks : nullptr;
    shape.kv_dtype = kv.rows.dtype;
    shape.kv_scales = kv.rows.scales;
  }
};

// y[:, lo:hi] (B rows at stride ldy) = bias[lo:hi] + x (B, in) @ w[lo:hi]^T, in the order the
// linear op uses (bias first, then the product accumulated onto it), reading `part` (the rows
// [lo, hi) of w packed on their own) where given. Called inside the parallel region: the BLAS
// runs single-threaded on these rows.
static inline void linear_rows(float* y, int64_t ldy, const float* x, int64_t B,
                               const LinearRef& lin, int64_t lo, int64_t hi, const PackRef* part) {
  if (lo >= hi) return;
  if (lin.b != nullptr)
    for (int64_t b = 0; b < B; ++b) std::copy(lin.b + lo, lin.b + hi, y + b * ldy + lo);
  const float beta = lin.b != nullptr ? 1.0f : 0.0f;
  if (part != nullptr)
    (part->int8 ? cpu::gemm_packed_int8 : cpu::gemm_packed)(part->form, y + lo, ldy, x, lin.in,
                                                             part->data, B, lin.in, 0, hi - lo, beta);
  else
    cpu::gemm<float>(false, true, B, hi - lo, lin.in, 1.0f, x, lin.in, lin.w + lo * lin.in, lin.in,
                     beta, y + lo, ldy);
}

// x[:, lo:hi] += d[:, lo:hi], both (B, C): the residual connection on this thread's columns.
static inline void add_rows(float* x, const float* d, int64_t B, int64_t C, int64_t lo,
                            int64_t hi) {
  for (int64_t b = 0; b < B; ++b) {
    float* xb = x + b * C;
    const float* db = d + b * C;
#pragma omp simd
    for (int64_t j = lo; j < hi; ++j) xb[j] += db[j];
  }
}

static inline void layer_norm(float* out, float* stats, const float* x, const NormRef& ln,
                              int64_t B, int64_t C) {
  cpu::layernorm_forward<float>(out, ln.rms ? nullptr : stats, stats + B, x, ln.w, ln.b, B, C,
                                ln.eps);
}

}  // namespace kvlab::decode
