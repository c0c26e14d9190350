#pragma once
// The decode step's stages around the attention: the embedding, a block's norm, its output
// projection and MLP with their residual adds, and the head. Each runs on every thread of the
// step's one parallel region, on the thread's own rows (ThreadStep::rows); the barrier that
// ends each is the driver's (decode_step.cpp), named in its comment.
#include <cstdint>

#include "infer/decode/step.h"

namespace kvlab::decode {

// x = the tokens' embeddings (plus their positions' without RoPE), this thread's columns.
// Ended by the implicit barrier of the driver's `omp single`.
static inline void embed(const ThreadStep& ts) {
  const Step& s = ts.st;
  const int64_t B = s.B, C = s.C;
  const auto [c0, c1] = ts.rows.c;  // also this thread's columns of x
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = c0; c < c1; ++c)
      s.buf.x[b * C + c] =
          s.wte[s.ids[b] * C + c] + (s.wpe != nullptr ? s.wpe[(s.lengths[b] - 1) * C + c] : 0.0f);
}

// ts.ln = norm(x): the small row-wise work is done by every thread on its own copy, so that
// it needs no barrier after it.
static inline void norm(const ThreadStep& ts, const NormRef& n) {
  layer_norm(ts.ln, ts.stats, ts.st.buf.x, n, ts.st.B, ts.st.C);
}

// x += c_proj(y) on this thread's columns, y the attention's output (B, C). Ended by the
// driver's barrier after it: ln_2 reads the whole of x.
static inline void project_residual(const ThreadStep& ts, const BlockRef& blk, const float* y) {
  const Step& s = ts.st;
  const auto [c0, c1] = ts.rows.c;
  linear_rows(s.buf.d, s.C, y, s.B, blk.proj, c0, c1, ts.part(blk.proj));
  add_rows(s.buf.x, s.buf.d, s.B, s.C, c0, c1);  // x += c_proj(y)
}

// x += mlp(ln_2(x)) on this thread's columns: its rows of the hidden (c_fc, with SwiGLU's
// c_up, and the activation), a barrier (c_proj reads every thread's hidden), then its rows of
// c_proj. Ended by the driver's barrier after it: the next layer's ln_1 (or the final norm)
// reads the whole of x.
static inline void mlp(const ThreadStep& ts, const BlockRef& blk) {
  const Step& s = ts.st;
  const int64_t B = s.B, C = s.C, H = s.H;
  const auto [h0, h1] = ts.rows.h;
  const auto [c0, c1] = ts.rows.c;
  layer_norm(ts.ln, ts.stats, s.buf.x, blk.ln_2, B, C);
  linear_rows(s.buf.h, H, ts.ln, B, blk.fc, h0, h1, ts.part(blk.fc));
  if (blk.up) {
    linear_rows(s.buf.up, H, ts.ln, B, *blk.up, h0, h1, ts.part(*blk.up));
    for (int64_t b = 0; b < B && h0 < h1; ++b)
      cpu::swiglu_forward<float>(s.buf.h + b * H + h0, s.buf.h + b * H + h0, s.buf.up + b * H + h0,
                                 h1 - h0);
  } else {
    for (int64_t b = 0; b < B && h0 < h1; ++b)
      cpu::gelu_forward<float>(s.buf.h + b * H + h0, s.buf.h + b * H + h0, h1 - h0);
  }
  s.barrier.wait();
  linear_rows(s.buf.d, C, s.buf.h, B, blk.fc_proj, c0, c1, ts.part(blk.fc_proj));
  add_rows(s.buf.x, s.buf.d, B, C, c0, c1);  // x += mlp(ln_2(x))
}

// The logits' rows of this thread: the final norm, then the LM head. Ended by the parallel
// region's own closing barrier.
static inline void head(const ThreadStep& ts) {
  const Step& s = ts.st;
  layer_norm(ts.ln, ts.stats, s.buf.x, s.refs.final_norm, s.B, s.C);
  linear_rows(s.out, s.V, ts.ln, s.B, s.refs.head, ts.rows.o.first, ts.rows.o.second,
              ts.part(s.refs.head));
}

}  // namespace kvlab::decode
