#pragma once
// The decode step's grouped-query attention: this thread's rows of q, k and v (RoPE turning
// q and k), its new keys and values stored straight into the cache, then its attention tasks,
// each at one row's own cache pointers (cpu::attention_decode_task, as the op path's at
// T = 1). When the KV groups share out evenly between the threads (StepRows::own_groups), a
// thread's q, k and v rows are those of its own groups and it goes straight on to their
// attention with no barrier; otherwise q, k and v are one range of rows split evenly, and
// barriers stand where a thread needs rows another computed.
#include <cstdint>
#include <type_traits>

#include "infer/decode/step.h"

namespace kvlab::decode {

// This thread's rows of q, k and v from ts.ln, RoPE turning q and k (keys are stored rotated,
// at the row's position). With own groups nothing ends it (the thread's groups' heads are
// whole here); otherwise its rotation runs between two barriers of its own, since a head's
// rows may come from two threads.
static inline void gqa_project(const ThreadStep& ts, const BlockRef& blk) {
  const Step& s = ts.st;
  const int64_t B = s.B, C = s.C, NH = s.NH, NKV = s.NKV, HS = s.HS, KVD = s.KVD, G = s.G;
  const int64_t g0 = ts.rows.g0, g1 = ts.rows.g1;
  linear_rows(s.buf.q, C, ts.ln, B, blk.q, ts.rows.q.first, ts.rows.q.second, ts.part(blk.q));
  linear_rows(s.buf.k, KVD, ts.ln, B, blk.k, ts.rows.k.first, ts.rows.k.second, ts.part(blk.k));
  linear_rows(s.buf.v, KVD, ts.ln, B, blk.v, ts.rows.v.first, ts.rows.v.second, ts.part(blk.v));
  if (s.rope == nullptr) return;
  auto rotate = [&](float* x, int64_t b, int64_t heads) {
    cpu::rope_forward<float>(x, x, s.positions + b, s.rope, 1, heads, HS, false);
  };
  if (ts.rows.own_groups) {  // this thread's groups' heads are whole here
    for (int64_t b = 0; b < B && g0 < g1; ++b) {
      rotate(s.buf.q + b * C + g0 * G * HS, b, (g1 - g0) * G);
      rotate(s.buf.k + b * KVD + g0 * HS, b, g1 - g0);
    }
  } else {  // a head's rows may come from two threads: rotate once all are computed
    s.barrier.wait();
    for (int64_t i = ts.t; i < B * (NH + NKV); i += ts.nt) {
      const int64_t b = i / (NH + NKV), h = i % (NH + NKV);
      rotate(h < NH ? s.buf.q + b * C + h * HS : s.buf.k + b * KVD + (h - NH) * HS, b, 1);
    }
    s.barrier.wait();
  }
}

// This step's keys and values into layer l's cache rows kv, of element type KV. f32 and bf16
// rows take this thread's elements of k and v; a quantised row (KV uint8_t) takes its head's
// whole key or value at once: with own groups this thread computed its groups' heads;
// otherwise the heads are dealt out once every thread's rows are computed, and stored before
// anyone attends. With own groups nothing ends it; otherwise a barrier of its own (both
// barriers, for a quantised row) ends it, so that every key and value is stored before the
// attention reads them.
template <class KV>
static inline void gqa_store(const ThreadStep& ts, const CacheRef& kv, size_t l) {
  const Step& s = ts.st;
  const int64_t B = s.B, NKV = s.NKV, HS = s.HS, KVD = s.KVD;
  const int64_t g0 = ts.rows.g0, g1 = ts.rows.g1;
  if constexpr (std::is_same_v<KV, uint8_t>) {
    auto store_head = [&](int64_t b, int64_t h) {
      for (int which = 0; which < 2; ++which)
        if (!store_new_quantised(kv, which, which == 0 ? s.buf.k : s.buf.v, b, h, KVD, HS,
                                 s.lengths))
          ts.note_nonfinite((static_cast<int64_t>(l) * B + b) * NKV + h);
    };
    if (ts.rows.own_groups) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = g0; h < g1; ++h) store_head(b, h);
    } else {
      s.barrier.wait();
      for (int64_t i = ts.t; i < B * NKV; i += ts.nt) store_head(i / NKV, i % NKV);
      s.barrier.wait();
    }
  } else {
    store_new<KV>(kv.rows.k, kv, s.buf.k, B, KVD, HS, s.lengths, ts.rows.k.first, ts.rows.k.second);
    store_new<KV>(kv.rows.v, kv, s.buf.v, B, KVD, HS, s.lengths, ts.rows.v.first, ts.rows.v.second);
    if (!ts.rows.own_groups) s.barrier.wait();
  }
}

// This thread's attention tasks over rows of element type KV: its own groups' of every row,
// or every nt-th task of the batch. Task i of the batch: row b = i / (NKV * parts), and that
// row's task i % (NKV * parts). Ended by the driver's barrier after the attention stage.
template <class KV>
static inline void gqa_attend(const ThreadStep& ts, RowAttention& att, const CacheRef& kv) {
  const Step& s = ts.st;
  const int64_t B = s.B, C = s.C, NKV = s.NKV, parts = ts.parts;
  const bool paged = kv.rows.blocks != nullptr;
  auto task = [&](int64_t i) {
    const int64_t b = i / (NKV * parts);
    att.shape.kv_lengths = s.lengths + b;
    if (paged) att.row_blocks.table = kv.rows.blocks->table + b * att.row_blocks.width;
    cpu::attention_decode_task<float, KV>(s.buf.att + b * C, s.qv, s.buf.q + b * C, s.qv,
                                          static_cast<const KV*>(kv.rows.k[b]), kv.k_strides,
                                          static_cast<const KV*>(kv.rows.v[b]), kv.v_strides,
                                          att.shape, i - b * NKV * parts, parts, ts.work);
  };
  if (ts.rows.own_groups)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = ts.rows.g0; g < ts.rows.g1; ++g) task(b * NKV + g);
  else
    for (int64_t i = ts.t; i < B * NKV * parts; i += ts.nt) task(i);
}

// Layer l's attention from ts.ln: its output y (B, C) in buf.att, which it returns. Ended by
// the driver's barrier after it: c_proj reads every thread's heads.
static inline const float* attend_gqa(const ThreadStep& ts, RowAttention& att, const BlockRef& blk,
                                      const CacheRef& kv, size_t l) {
  att.layer(kv);
  gqa_project(ts, blk);
  kv.typed([&](auto tag) {
    using KV = typename decltype(tag)::type;
    gqa_store<KV>(ts, kv, l);
    gqa_attend<KV>(ts, att, kv);
  });
  return ts.st.buf.att;
}

}  // namespace kvlab::decode
