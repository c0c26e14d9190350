#pragma once
// How the decode step shares its work out between its threads: each thread's rows of every
// product (StepRows), which the packing (packed_weights.cpp) and the step (decode_step.cpp)
// both follow, so that a thread reads back exactly the rows it packed.
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "nn/gpt.h"
#include "platform/parallel.h"

namespace kvlab::decode {

// n f32 words rounded up to whole 64-byte lines: each packed part and each of the step's
// buffers starts on a line of its own.
static inline int64_t whole_lines(int64_t n) { return (n + 15) / 16 * 16; }

// This thread's rows [lo, hi) of n, in blocks of a multiple of 16 (the BLAS kernels' tile).
static inline std::pair<int64_t, int64_t> thread_rows(int64_t n, int t, int nt) {
  return cpu::split_range(n, t, nt, 16);
}

// Thread t's rows of each of the step's products, of nt threads. When the KV groups share out
// evenly (own_groups), each thread computes the q, k and v rows of its own groups and then
// their attention, with no barrier between. Otherwise the q, k and v rows, one range of
// C + 2 KVD, are split evenly.
// MLA's q (q_proj, NH (HS + D) rows) and k (kv_down, R + D rows) are one range split evenly
// too, never own groups; qd are its rows of q_down. It has no v rows: its kv_up is read whole,
// row-major, by every thread (never packed).
struct StepRows {
  bool own_groups;
  int64_t g0, g1;  // the KV groups whose attention this thread computes, when own_groups
  std::pair<int64_t, int64_t> q, k, v;
  std::pair<int64_t, int64_t> c;   // of the attention's and the MLP's output projections
  std::pair<int64_t, int64_t> h;   // of the MLP's c_fc (and c_up)
  std::pair<int64_t, int64_t> o;   // of the LM head
  std::pair<int64_t, int64_t> qd;  // of MLA's q_down
  StepRows(const GPTConfig& cfg, int t, int nt) {
    const int64_t C = cfg.n_embd, NKV = cfg.n_kv_head, HS = cfg.head_size(), KVD = NKV * HS;
    const int64_t G = cfg.n_head / NKV;
    c = thread_rows(C, t, nt);
    h = thread_rows(cfg.hidden(), t, nt);
    o = thread_rows(cfg.vocab_size, t, nt);
    if (cfg.mla()) {
      const int64_t Q = cfg.n_head * (HS + cfg.rope_head_dim), K = cfg.cache_width();
      const auto [r0, r1] = thread_rows(Q + K, t, nt);
      own_groups = false;
      g0 = g1 = 0;
      q = {std::min(r0, Q), std::min(r1, Q)};
      k = {std::clamp<int64_t>(r0 - Q, 0, K), std::clamp<int64_t>(r1 - Q, 0, K)};
      v = {0, 0};
      qd = thread_rows(cfg.q_lora_rank, t, nt);
      return;
    }
    own_groups = NKV % nt == 0;
    g0 = NKV * t / nt;
    g1 = NKV * (t + 1) / nt;
    const auto [r0, r1] = thread_rows(C + 2 * KVD, t, nt);
    if (own_groups) {
      q = {g0 * G * HS, g1 * G * HS};
      k = v = {g0 * HS, g1 * HS};
    } else {
      q = {std::min(r0, C), std::min(r1, C)};
      k = {std::clamp<int64_t>(r0 - C, 0, KVD), std::clamp<int64_t>(r1 - C, 0, KVD)};
      v = {std::clamp<int64_t>(r0 - C - KVD, 0, KVD), std::clamp<int64_t>(r1 - C - KVD, 0, KVD)};
    }
  }
  // The rows of matrix i of decode_matrices (the last one the LM head), per_block a block.
  std::pair<int64_t, int64_t> of_matrix(size_t i, size_t count, size_t per_block) const {
    if (i + 1 == count) return o;
    const std::array<std::pair<int64_t, int64_t>, 7> block{q, k, v, c, h, c, h};
    return block[i % per_block];
  }
};

}  // namespace kvlab::decode
