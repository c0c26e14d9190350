#pragma once
// The decode step's multi-head latent attention, in latent form as
// LatentAttention::forward_latent (nn/gpt.cpp): each head's query carried into the latent
// space through its key rows of kv_up, one attention over the cache's latent rows (a single KV
// head for every query head), and each head's weighted latents carried back through its value
// rows. q_proj and kv_down are split between the threads and packed like the other products;
// kv_up (NH 2 HS, R: per head its key rows, then its value rows) is read whole, row-major, by
// every thread.
// Buffers: q the queries (B, NH QW), then the attention's output y (B, C); k the latent rows
// (B, KW); v the queries in latent form (B, NH, KW); att the attention's (B, NH, KW); d
// first q_down's output (B, RQ).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "infer/decode/step.h"

namespace kvlab::decode {

// This thread's rows of the queries (q_proj: from ts.ln, or through the compressed query
// latent, each thread norming its own copy of it after a barrier of this stage's) and of the
// latent and rotary key (kv_down). Ended by attend_mla's first barrier.
static inline void mla_project(const ThreadStep& ts, const BlockRef& blk) {
  const Step& s = ts.st;
  const int64_t B = s.B, RQ = s.RQ;
  const float* q_in = ts.ln;
  if (blk.q_down) {
    linear_rows(s.buf.d, RQ, ts.ln, B, *blk.q_down, ts.rows.qd.first, ts.rows.qd.second, nullptr);
    s.barrier.wait();
    layer_norm(ts.scratch, ts.stats, s.buf.d, *blk.q_norm, B, RQ);
    q_in = ts.scratch;
  }
  linear_rows(s.buf.q, s.NH * s.QW, q_in, B, blk.q, ts.rows.q.first, ts.rows.q.second,
              ts.part(blk.q));
  linear_rows(s.buf.k, s.KW, ts.ln, B, blk.k, ts.rows.k.first, ts.rows.k.second,
              ts.part(blk.k));  // kv_down: latent, rotary key
}

// Task b * (NH + 1) + h: for h < NH, head h's rotary query turned and its HS query carried
// into latent form through its key rows of kv_up, W_uk (HS, R): q W_uk, then the rotary query
// after it (forward_latent's queries, unscaled: the attention's scale is training's); for
// h = NH, row b's latent normed, its rotary key turned, and the row stored into layer l's
// cache rows kv. Ended by attend_mla's second barrier. always_inline here and on attend_mla:
// GCC otherwise leaves one of them out of line, where the rest of the step compiles into the
// driver's region as one function.
[[gnu::always_inline]] static inline void mla_fold(const ThreadStep& ts, const BlockRef& blk,
                                                   const CacheRef& kv, size_t l) {
  const Step& s = ts.st;
  const int64_t B = s.B, NH = s.NH, HS = s.HS, R = s.R, D = s.D, QW = s.QW, KW = s.KW;
  const float* w_up = blk.v.w;  // kv_up (NH 2 HS, R): per head its key rows, then value rows
  for (int64_t i = ts.t; i < B * (NH + 1); i += ts.nt) {
    const int64_t b = i / (NH + 1), h = i % (NH + 1);
    if (h == NH) {
      float* row = s.buf.k + b * KW;
      layer_norm(ts.scratch, ts.stats, row, *blk.kv_norm, 1, R);
      std::copy(ts.scratch, ts.scratch + R, row);
      cpu::rope_forward<float>(row + R, row + R, s.positions + b, s.rope, 1, 1, D, false);
      kv.typed([&](auto tag) {
        using KV = typename decltype(tag)::type;
        KV* dst = static_cast<KV*>(kv.rows.k[b]) + kv.position(b, s.lengths[b] - 1);
        const float fp8_scale = kv.rows.scales != nullptr ? kv.rows.scales[0] : 0.0f;
        if (!store_kv_row(kv.rows.dtype, dst, row, 1, KW, fp8_scale))
          ts.note_nonfinite(static_cast<int64_t>(l) * B + b);
      });
      continue;
    }
    float* q = s.buf.q + b * NH * QW + h * QW;
    cpu::rope_forward<float>(q + HS, q + HS, s.positions + b, s.rope, 1, 1, D, false);
    float* qa = s.buf.v + (b * NH + h) * KW;
    std::fill(qa, qa + R, 0.0f);
    const float* wk = w_up + h * 2 * HS * R;
    for (int64_t j = 0; j < HS; ++j) {
      const float qj = q[j];
      const float* wj = wk + j * R;
#pragma omp simd
      for (int64_t r = 0; r < R; ++r) qa[r] += qj * wj[r];
    }
    std::copy(q + HS, q + QW, qa + R);
  }
}

// One KV head for all NH query heads, its heads shared out where rows are few. f32 rows take
// cpu::attend_latent (a tile of heads through gemm's few-row products, so that each row is
// read once a tile); bf16 and quantised ones, which it cannot read, the row kernel. Ended by
// attend_mla's third barrier.
static inline void mla_attend(const ThreadStep& ts, RowAttention& att, const CacheRef& kv) {
  const Step& s = ts.st;
  const int64_t B = s.B, NH = s.NH, R = s.R, KW = s.KW;
  const bool paged = kv.rows.blocks != nullptr;
  const int64_t parts = std::clamp<int64_t>(ts.nt / B, 1, NH);
  kv.typed([&](auto tag) {
    using KV = typename decltype(tag)::type;
    for (int64_t i = ts.t; i < B * parts; i += ts.nt) {
      const int64_t b = i / parts;
      if constexpr (std::is_same_v<KV, float>) {
        const int64_t part = i - b * parts, h0 = NH * part / parts;
        float* y = s.buf.att + (b * NH + h0) * KW;
        const float* q = s.buf.v + (b * NH + h0) * KW;
        const int64_t heads = NH * (part + 1) / parts - h0;
        const auto* rows = static_cast<const float*>(kv.rows.k[b]);
        const auto scale = static_cast<float>(att.shape.scale);
        if (paged) {
          const auto br = cpu::BlockRows<float>::of(rows, *kv.rows.blocks, b, kv.rows.pos_stride);
          cpu::attend_latent(y, q, heads, br, s.lengths[b], KW, R, scale, ts.work);
        } else {
          cpu::attend_latent(y, q, heads, rows, kv.rows.pos_stride, s.lengths[b], KW, R, scale,
                             ts.work);
        }
      } else {
        att.shape.kv_lengths = s.lengths + b;
        if (paged) att.row_blocks.table = kv.rows.blocks->table + b * att.row_blocks.width;
        cpu::attention_decode_task<float, KV>(s.buf.att + b * NH * KW, s.qv, s.buf.v + b * NH * KW,
                                              s.qv, static_cast<const KV*>(kv.rows.k[b]),
                                              kv.k_strides, static_cast<const KV*>(kv.rows.v[b]),
                                              kv.v_strides, att.shape, i - b * parts, parts,
                                              ts.work);
      }
    }
  });
}

// Each head's weighted latents (the first R of its output) through its value rows of kv_up,
// W_uv (HS, R), and their bias: y (B, C) in q's buffer, whose queries are spent. Ended by the
// driver's barrier after the attention stage.
static inline void mla_unfold(const ThreadStep& ts, const BlockRef& blk) {
  const Step& s = ts.st;
  const int64_t B = s.B, C = s.C, NH = s.NH, HS = s.HS, R = s.R, KW = s.KW;
  const float* w_up = blk.v.w;
  const float* b_up = blk.v.b;
  for (int64_t i = ts.t; i < B * NH; i += ts.nt) {
    const int64_t b = i / NH, h = i % NH;
    const float* o = s.buf.att + (b * NH + h) * KW;
    float* yh = s.buf.q + b * C + h * HS;
    for (int64_t j = 0; j < HS; ++j) {
      const float* wv = w_up + (h * 2 * HS + HS + j) * R;
      float acc = b_up != nullptr ? b_up[h * 2 * HS + HS + j] : 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t r = 0; r < R; ++r) acc += o[r] * wv[r];
      yh[j] = acc;
    }
  }
}

// Layer l's latent attention from ts.ln: its output y (B, C) in buf.q, which it returns.
// Ended by the driver's barrier after it: c_proj reads every thread's heads.
[[gnu::always_inline]] static inline const float* attend_mla(const ThreadStep& ts,
                                                             RowAttention& att, const BlockRef& blk,
                                                             const CacheRef& kv, size_t l) {
  att.layer(kv);
  mla_project(ts, blk);
  ts.st.barrier.wait();  // the fold reads whole queries and latent rows
  mla_fold(ts, blk, kv, l);
  ts.st.barrier.wait();  // the attention reads every head's latent query and the stored row
  mla_attend(ts, att, kv);
  ts.st.barrier.wait();  // a head's output may be another thread's
  mla_unfold(ts, blk);
  return ts.st.buf.q;
}

}  // namespace kvlab::decode
