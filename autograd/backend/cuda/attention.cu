// Fused causal attention with grouped K/V heads, flash style: scores exist only in registers,
// one tile of keys at a time under an online softmax, and nothing of size (T, S) is stored.
// Backward recomputes the probabilities from q and k, as the CPU backend does, in two kernels:
//   dq:   per (b, h, query tile). A forward-like pass finds each row's max m, 1/sum and
//         D = rowsum(P * dP) (= dO . O), written to a (3, B, NH, T) buffer; a second pass over
//         the same keys accumulates dq.
//   dkdv: per (b, g, key tile). Sums the group's query heads and query tiles in order into
//         registers: no atomics, so the result is deterministic.
// Probabilities are rebuilt as exp(s - m) * (1/sum), the CPU's formula, not from a log-sum-exp
// (whose rounding the softmax backward amplifies; see cpu/attention.cpp).
// Decode (T == 1, no dropout) has its own split-K forward: a block per (b, KV head, key split)
// serves all the group's query heads from one read of K and V, and a second kernel merges the
// splits' partial softmax states.
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/kernels.h"
#include "platform/random.h"

namespace kvlab::cuda {
namespace {

constexpr int kWarps = 4;  // warps of every attention block
constexpr int kBlockThreads = kWarps * 32;
// forward and dq: a warp owns kRowsPerWarp query rows, a lane one key of the staged tile.
constexpr int kRowsPerWarp = 4;
constexpr int kQueryTile = kWarps * kRowsPerWarp;
constexpr int kKeyTile = 32;
// dkdv: a warp owns kKeysPerWarp keys, a lane one query row of the staged tile.
constexpr int kKeysPerWarp = 4;
constexpr int kKvTile = kWarps * kKeysPerWarp;
constexpr int kRowTile = 32;
// In both layouts a lane also owns head dims lane + 32 i, i < DPL (dims per lane).
constexpr int kMaxHeadSize = 256;
// kv_lengths travel in the kernel arguments up to this batch size, else in a device buffer.
constexpr int kInlineLengths = 64;
constexpr size_t kDefaultSharedBytes = 48 * 1024;
// decode: each key split covers at least kDecodeMinKeys keys; splits are added until the grid
// has kDecodeBlocksPerSm blocks per SM.
constexpr int64_t kDecodeMinKeys = 64;
constexpr int kDecodeBlocksPerSm = 4;

__host__ __device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A (B, H, L, HS) operand: row (b, h, t) starts at p + b sb + h sh + t st.
template <class P>
struct View {
  P* p;
  HeadView v;
  __device__ P* row(int64_t b, int64_t h, int64_t t) const {
    return p + b * v.sb + h * v.sh + t * v.st;
  }
};

// The shape and options every kernel reads, by value.
template <class T>
struct Params {
  int64_t batch, nh, nkv, nq, nk, hs, group;  // B, NH, NKV, T, S, HS, NH / NKV
  int kpad;  // row stride of tiles read one row per lane: odd, so the lanes hit distinct banks
  T scale;
  bool drop;
  T keep;  // 1 / (1 - p)
  uint64_t seed, threshold;
  bool has_lengths;
  const int64_t* lengths;  // (B) on the device when B > kInlineLengths, else null
  int64_t inline_lengths[kInlineLengths];

  __device__ int64_t kv_len(int64_t b) const {
    if (!has_lengths) return nk;
    return lengths ? lengths[b] : inline_lengths[b];
  }
  // Dropout multiplier of probability (b, h, t, j), row = (b NH + h) T + t: the CPU's draw.
  __device__ T factor(int64_t row, int64_t j) const {
    return hash64(seed, static_cast<uint64_t>(row * nk + j)) < threshold ? T(0) : keep;
  }
};

// An element of an operand as T: itself, or bf16 storage (a bf16 KV cache's keys and values,
// uint16_t) widened to f32, which is exact.
template <class T, class S>
__device__ inline T load_as(S x) {
  if constexpr (std::is_same_v<S, uint16_t>) {
    static_assert(std::is_same_v<T, float>);
    return __uint_as_float(static_cast<unsigned>(x) << 16);
  } else {
    return x;
  }
}

// Copies rows [0, rows) of a strided (.., hs) source into a (capacity, hs) shared tile of row
// stride `stride`, zero-filling rows [rows, capacity): keys past a row's length may hold
// anything, and 0 * NaN would leak into the sums. S: the source's element type (T or bf16).
template <class T, class S>
__device__ inline void load_rows(T* dst, int stride, const S* src, int64_t src_stride, int rows,
                                 int capacity, int hs) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int r = warp; r < capacity; r += kWarps) {
    T* d = dst + r * stride;
    if (r < rows) {
      const S* s = src + r * src_stride;
      for (int c = lane; c < hs; c += 32) d[c] = load_as<T>(s[c]);
    } else {
      for (int c = lane; c < hs; c += 32) d[c] = T(0);
    }
  }
}

// out[r] = sum over d < hs, in order, of x[r x_step + d] * y[r y_step + d] (a step of 0 is a
// row shared by all r).
template <class T, int R>
__device__ inline void row_dots(T (&out)[R], const T* x, int x_step, const T* y, int y_step,
                                int hs) {
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = T(0);
#pragma unroll 4
  for (int d = 0; d < hs; ++d) {
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] += x[r * x_step + d] * y[r * y_step + d];
  }
}

// acc[r] += w[r] of lane jj times row jj of a staged (n, hs) tile with rows `ld` apart, for
// jj < n, in order; a lane holds head dims lane + 32 i. Probabilities times V in the forward
// and decode kernels, ds times K for dq in the backward.
template <class T, int R, int DPL>
__device__ void accumulate_rows(T (&acc)[R][DPL], const T (&w)[R], const T* tile, int ld, int n,
                                int hs, int lane) {
  for (int jj = 0; jj < n; ++jj) {
    T row[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      row[i] = d < hs ? tile[jj * ld + d] : T(0);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const T wj = __shfl_sync(0xffffffffu, w[r], jj);
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[r][i] += wj * row[i];
    }
  }
}

// The online softmax of R query rows that one warp owns, a lane holding one key of each staged
// tile and head dims lane + 32 i of the output: the running max m, this lane's share l of the
// sum of exp, and the unnormalised output acc. The flash forward and the decode kernel share it.
template <class T, int R, int DPL>
struct OnlineSoftmax {
  T m[R], l[R], acc[R][DPL];

  __device__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      m[r] = -INFINITY;
      l[r] = T(0);
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[r][i] = T(0);
    }
  }
  // Row r meets this lane's scaled score x (visible or not; warp-uniform call): the row's
  // state moves to the new max and this lane's unnormalised probability is returned. The
  // caller guarantees a visible key in the warp, so the new max is finite and exp(m - m_new)
  // never sees -inf - -inf.
  __device__ T add(int r, T x, bool vis) {
    const T m_new = max(m[r], warp_max(vis ? x : T(-INFINITY)));
    const T corr = exp_t(m[r] - m_new);
    const T e = vis ? exp_t(x - m_new) : T(0);
    l[r] = l[r] * corr + e;
    m[r] = m_new;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[r][i] *= corr;
    return e;
  }
  // acc[r] += w[r] of lane jj times row jj of the (n, hs) tile vs, for jj < n, in order.
  __device__ void accumulate(const T (&w)[R], const T* vs, int n, int hs, int lane) {
    accumulate_rows(acc, w, vs, hs, n, hs, lane);
  }
  // Row r's output, acc / sum, to o (hs wide).
  __device__ void write(int r, T* o, T sum, int hs, int lane) const {
    const T inv = T(1) / sum;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hs) o[d] = acc[r][i] * inv;
    }
  }
};

// Block x covers query tile `tile` of head (b, h); the longest tiles (last rows) come first.
struct QueryBlock {
  int64_t b, h, t0;
  int rows;  // valid rows of the tile
};
template <class T>
__device__ inline QueryBlock query_block(const Params<T>& p) {
  const int64_t heads = p.batch * p.nh, tiles = ceil_div(p.nq, kQueryTile);
  const int64_t x = blockIdx.x, bh = x % heads, tile = tiles - 1 - x / heads;
  QueryBlock q;
  q.b = bh / p.nh;
  q.h = bh % p.nh;
  q.t0 = tile * kQueryTile;
  q.rows = static_cast<int>(min64(kQueryTile, p.nq - q.t0));
  return q;
}

// Shared memory (kQueryTile, hs) q + (kKeyTile, kpad) k + (kKeyTile, hs) v.
template <class T>
size_t forward_shared_bytes(int64_t hs, int64_t kpad) {
  return static_cast<size_t>(kQueryTile * hs + kKeyTile * kpad + kKeyTile * hs) * sizeof(T);
}

// KV: the element type of k and v, T or bf16 storage (uint16_t) widened as it is staged.
template <class T, int DPL, class KV>
__global__ void __launch_bounds__(kBlockThreads)
    attention_forward_kernel(View<T> out, View<const T> q, View<const KV> k, View<const KV> v,
                             Params<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int hs = static_cast<int>(p.hs), kpad = p.kpad;
  T* qs = reinterpret_cast<T*>(smem);  // (kQueryTile, hs)
  T* ks = qs + kQueryTile * hs;        // (kKeyTile, kpad)
  T* vs = ks + kKeyTile * kpad;        // (kKeyTile, hs)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const QueryBlock blk = query_block(p);
  const int64_t g = blk.h / p.group;
  const int64_t shift = p.kv_len(blk.b) - p.nq;    // query t sees keys 0 .. shift + t
  const int64_t kend = shift + blk.t0 + blk.rows;  // past the last key the tile sees
  // This warp's rows: local rows warp R + r, r < wrows; row r sees keys up to first_last + r.
  const int wrows = static_cast<int>(max64(0, min64(kRowsPerWarp, blk.rows - warp * kRowsPerWarp)));
  const int64_t first_last = shift + blk.t0 + warp * kRowsPerWarp;
  const int64_t head_row = (blk.b * p.nh + blk.h) * p.nq + blk.t0 + warp * kRowsPerWarp;

  load_rows(qs, hs, q.row(blk.b, blk.h, blk.t0), q.v.st, blk.rows, kQueryTile, hs);
  OnlineSoftmax<T, kRowsPerWarp, DPL> sm;

  for (int64_t j0 = 0; j0 < kend; j0 += kKeyTile) {
    const int nk = static_cast<int>(min64(kKeyTile, kend - j0));
    __syncthreads();  // the previous tile is consumed
    load_rows(ks, kpad, k.row(blk.b, g, j0), k.v.st, nk, kKeyTile, hs);
    load_rows(vs, hs, v.row(blk.b, g, j0), v.v.st, nk, kKeyTile, hs);
    __syncthreads();
    if (wrows == 0 || j0 > first_last + wrows - 1) continue;  // warp-uniform: nothing visible
    T sc[kRowsPerWarp];
    row_dots(sc, qs + warp * kRowsPerWarp * hs, hs, ks + lane * kpad, 0, hs);
    const int64_t j = j0 + lane;
    T w[kRowsPerWarp];  // this lane's dropped-out probability, unnormalised, per row
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      w[r] = T(0);
      const int64_t last = first_last + r;
      // Warp-uniform; the first processed tile of a row holds its key j0 <= last.
      if (r < wrows && j0 <= last) {
        const bool vis = j <= last;
        const T e = sm.add(r, sc[r] * p.scale, vis);
        w[r] = p.drop && vis ? e * p.factor(head_row + r, j) : e;
      }
    }
    // Keys past the warp's last visible one have w = 0 in every row.
    sm.accumulate(w, vs, static_cast<int>(min64(nk, first_last + wrows - j0)), hs, lane);
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (r >= wrows) continue;  // warp-uniform
    sm.write(r, out.row(blk.b, blk.h, blk.t0 + warp * kRowsPerWarp + r), warp_sum(sm.l[r]), hs,
             lane);
  }
}

// Shared memory (kQueryTile, hs) q and dO + (kKeyTile, kpad) k and v.
template <class T>
size_t dq_shared_bytes(int64_t hs, int64_t kpad) {
  return static_cast<size_t>(2 * kQueryTile * hs + 2 * kKeyTile * kpad) * sizeof(T);
}

// stats (3, B, NH, T): each row's max scaled score, 1 / sum of exp, D = sum_j p_j dp_j.
template <class T, int DPL>
__global__ void __launch_bounds__(kBlockThreads)
    attention_dq_kernel(View<T> dq, T* stats, View<const T> dout, View<const T> q, View<const T> k,
                        View<const T> v, Params<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int hs = static_cast<int>(p.hs), kpad = p.kpad;
  T* qs = reinterpret_cast<T*>(smem);  // (kQueryTile, hs)
  T* os = qs + kQueryTile * hs;        // (kQueryTile, hs) dO
  T* ks = os + kQueryTile * hs;        // (kKeyTile, kpad)
  T* vs = ks + kKeyTile * kpad;        // (kKeyTile, kpad)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const QueryBlock blk = query_block(p);
  const int64_t g = blk.h / p.group;
  const int64_t shift = p.kv_len(blk.b) - p.nq;
  const int64_t kend = shift + blk.t0 + blk.rows;
  const int wrows = static_cast<int>(max64(0, min64(kRowsPerWarp, blk.rows - warp * kRowsPerWarp)));
  const int64_t first_last = shift + blk.t0 + warp * kRowsPerWarp;
  const int64_t head_row = (blk.b * p.nh + blk.h) * p.nq + blk.t0 + warp * kRowsPerWarp;
  const int64_t n_rows = p.batch * p.nh * p.nq;

  load_rows(qs, hs, q.row(blk.b, blk.h, blk.t0), q.v.st, blk.rows, kQueryTile, hs);
  load_rows(os, hs, dout.row(blk.b, blk.h, blk.t0), dout.v.st, blk.rows, kQueryTile, hs);

  // Pass 1: m, l = sum exp(x - m) and sum exp(x - m) dp online; l and dd are lane partials.
  T m[kRowsPerWarp], l[kRowsPerWarp], dd[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = T(0);
    dd[r] = T(0);
  }
  for (int64_t j0 = 0; j0 < kend; j0 += kKeyTile) {
    const int nk = static_cast<int>(min64(kKeyTile, kend - j0));
    __syncthreads();
    load_rows(ks, kpad, k.row(blk.b, g, j0), k.v.st, nk, kKeyTile, hs);
    load_rows(vs, kpad, v.row(blk.b, g, j0), v.v.st, nk, kKeyTile, hs);
    __syncthreads();
    if (wrows == 0 || j0 > first_last + wrows - 1) continue;
    T sc[kRowsPerWarp], dpo[kRowsPerWarp];  // q . k_j and dO . v_j, j = this lane's key
    row_dots(sc, qs + warp * kRowsPerWarp * hs, hs, ks + lane * kpad, 0, hs);
    row_dots(dpo, os + warp * kRowsPerWarp * hs, hs, vs + lane * kpad, 0, hs);
    const int64_t j = j0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t last = first_last + r;
      if (r < wrows && j0 <= last) {  // warp-uniform, as in the forward kernel
        const bool vis = j <= last;
        const T x = vis ? sc[r] * p.scale : T(-INFINITY);
        const T m_new = max(m[r], warp_max(x));
        const T corr = exp_t(m[r] - m_new);
        const T e = vis ? exp_t(x - m_new) : T(0);
        const T dp = p.drop && vis ? dpo[r] * p.factor(head_row + r, j) : dpo[r];
        l[r] = l[r] * corr + e;
        dd[r] = dd[r] * corr + e * dp;
        m[r] = m_new;
      }
    }
  }
  T inv[kRowsPerWarp], dsum[kRowsPerWarp];  // 1 / sum, D
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    inv[r] = T(0);
    dsum[r] = T(0);
    if (r >= wrows) continue;  // warp-uniform
    inv[r] = T(1) / warp_sum(l[r]);
    dsum[r] = warp_sum(dd[r]) * inv[r];
    if (lane == 0) {
      stats[head_row + r] = m[r];
      stats[n_rows + head_row + r] = inv[r];
      stats[2 * n_rows + head_row + r] = dsum[r];
    }
  }

  // Pass 2: ds = p (dp - D), dq = scale ds k.
  T acc[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[r][i] = T(0);
  }
  for (int64_t j0 = 0; j0 < kend; j0 += kKeyTile) {
    const int nk = static_cast<int>(min64(kKeyTile, kend - j0));
    __syncthreads();
    load_rows(ks, kpad, k.row(blk.b, g, j0), k.v.st, nk, kKeyTile, hs);
    load_rows(vs, kpad, v.row(blk.b, g, j0), v.v.st, nk, kKeyTile, hs);
    __syncthreads();
    if (wrows == 0 || j0 > first_last + wrows - 1) continue;
    T sc[kRowsPerWarp], dpo[kRowsPerWarp];
    row_dots(sc, qs + warp * kRowsPerWarp * hs, hs, ks + lane * kpad, 0, hs);
    row_dots(dpo, os + warp * kRowsPerWarp * hs, hs, vs + lane * kpad, 0, hs);
    const int64_t j = j0 + lane;
    T ds[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const bool vis = r < wrows && j <= first_last + r;
      ds[r] = T(0);
      if (vis) {  // divergent, but no shuffle inside
        const T pr = exp_t(sc[r] * p.scale - m[r]) * inv[r];
        const T dp = p.drop ? dpo[r] * p.factor(head_row + r, j) : dpo[r];
        ds[r] = pr * (dp - dsum[r]);
      }
    }
    const int n = static_cast<int>(min64(nk, first_last + wrows - j0));
    accumulate_rows(acc, ds, ks, kpad, n, hs, lane);
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (r >= wrows) continue;
    T* o = dq.row(blk.b, blk.h, blk.t0 + warp * kRowsPerWarp + r);
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hs) o[d] = acc[r][i] * p.scale;
    }
  }
}

// Shared memory (kKvTile, hs) k and v + (kRowTile, kpad) q and dO.
template <class T>
size_t dkdv_shared_bytes(int64_t hs, int64_t kpad) {
  return static_cast<size_t>(2 * kKvTile * hs + 2 * kRowTile * kpad) * sizeof(T);
}

// Block x covers key tile x / (B NKV) of KV head (b, g): the first keys, seen by the most
// queries, come first. Writes every row of the tile below S, zeros past kv_len(b).
template <class T, int DPL>
__global__ void __launch_bounds__(kBlockThreads)
    attention_dkdv_kernel(View<T> dk, View<T> dv, const T* stats, View<const T> dout,
                          View<const T> q, View<const T> k, View<const T> v, Params<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int hs = static_cast<int>(p.hs), kpad = p.kpad;
  T* ks = reinterpret_cast<T*>(smem);  // (kKvTile, hs)
  T* vs = ks + kKvTile * hs;           // (kKvTile, hs)
  T* qs = vs + kKvTile * hs;           // (kRowTile, kpad)
  T* os = qs + kRowTile * kpad;        // (kRowTile, kpad) dO
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t heads = p.batch * p.nkv, x = blockIdx.x;
  const int64_t b = (x % heads) / p.nkv, g = (x % heads) % p.nkv;
  const int64_t j0 = x / heads * kKvTile;
  const int keys = static_cast<int>(min64(kKvTile, p.nk - j0));  // rows of the tile below S
  const int64_t kv_len = p.kv_len(b), shift = kv_len - p.nq;
  const int valid = static_cast<int>(max64(0, min64(keys, kv_len - j0)));  // below kv_len
  const int64_t n_rows = p.batch * p.nh * p.nq;
  const int64_t wj0 = j0 + warp * kKeysPerWarp;  // this warp's first key

  load_rows(ks, hs, k.row(b, g, j0), k.v.st, valid, kKvTile, hs);
  load_rows(vs, hs, v.row(b, g, j0), v.v.st, valid, kKvTile, hs);
  T acc_k[kKeysPerWarp][DPL], acc_v[kKeysPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kKeysPerWarp; ++r) {
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc_k[r][i] = acc_v[r][i] = T(0);
  }

  // The first query that sees key j0; none when the tile lies past kv_len (valid == 0).
  const int64_t t_first = valid > 0 ? max64(0, j0 - shift) : p.nq;
  for (int64_t h = g * p.group; h < (g + 1) * p.group; ++h) {
    for (int64_t t0 = t_first; t0 < p.nq; t0 += kRowTile) {
      const int rows = static_cast<int>(min64(kRowTile, p.nq - t0));
      __syncthreads();  // the previous query tile is consumed
      load_rows(qs, kpad, q.row(b, h, t0), q.v.st, rows, kRowTile, hs);
      load_rows(os, kpad, dout.row(b, h, t0), dout.v.st, rows, kRowTile, hs);
      __syncthreads();
      if (warp * kKeysPerWarp >= valid) continue;  // warp-uniform: only keys past kv_len
      const int64_t t = t0 + lane, row = (b * p.nh + h) * p.nq + t;
      const bool row_ok = lane < rows;
      T m = T(0), inv = T(0), dsum = T(0);
      if (row_ok) {
        m = stats[row];
        inv = stats[n_rows + row];
        dsum = stats[2 * n_rows + row];
      }
      T sc[kKeysPerWarp], dpo[kKeysPerWarp];  // q_t . k_j and dO_t . v_j, t = this lane's row
      row_dots(sc, qs + lane * kpad, 0, ks + warp * kKeysPerWarp * hs, hs, hs);
      row_dots(dpo, os + lane * kpad, 0, vs + warp * kKeysPerWarp * hs, hs, hs);
      T pd[kKeysPerWarp], ds[kKeysPerWarp];  // dropped-out p, and ds
#pragma unroll
      for (int r = 0; r < kKeysPerWarp; ++r) {
        const int64_t j = wj0 + r;
        pd[r] = ds[r] = T(0);
        if (row_ok && j <= shift + t) {  // keys past kv_len fail this for every t < T
          const T pr = exp_t(sc[r] * p.scale - m) * inv;
          const T f = p.drop ? p.factor(row, j) : T(1);
          pd[r] = pr * f;
          ds[r] = pr * (dpo[r] * f - dsum);
        }
      }
      for (int tt = 0; tt < rows; ++tt) {
        T qt[DPL], ot[DPL];
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
          const int d = lane + 32 * i;
          qt[i] = d < hs ? qs[tt * kpad + d] : T(0);
          ot[i] = d < hs ? os[tt * kpad + d] : T(0);
        }
#pragma unroll
        for (int r = 0; r < kKeysPerWarp; ++r) {
          const T wv = __shfl_sync(0xffffffffu, pd[r], tt);
          const T wk = __shfl_sync(0xffffffffu, ds[r], tt);
#pragma unroll
          for (int i = 0; i < DPL; ++i) {
            acc_v[r][i] += wv * ot[i];
            acc_k[r][i] += wk * qt[i];
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kKeysPerWarp; ++r) {
    if (warp * kKeysPerWarp + r >= keys) continue;
    T* dkr = dk.row(b, g, wj0 + r);
    T* dvr = dv.row(b, g, wj0 + r);
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hs) {
        dkr[d] = acc_k[r][i] * p.scale;
        dvr[d] = acc_v[r][i];
      }
    }
  }
}

// How decode divides each row's keys: `count` splits of `keys` keys (a multiple of kKeyTile),
// sized by S; a split past a row's kv_len is empty. `chunks` blocks share each (b, KV head,
// split), each serving up to kQueryTile query heads of the group.
struct DecodeSplits {
  int64_t count, keys, chunks;
};

// Stages keys [0, rows) of k and v into (kKeyTile, kpad) ks and (kKeyTile, hs) vs, zeroing rows
// [rows, kKeyTile) as load_rows does. Unlike load_rows, which waits for one row per warp at a
// time, a lane has 16 loads in flight: decode reads each key once, so it waits on memory.
template <class T, int DPL, class KV>
__device__ inline void load_kv_tile(T* ks, int kpad, T* vs, const KV* k, int64_t kst, const KV* v,
                                    int64_t vst, int rows, int hs) {
  constexpr int kRows = DPL >= 8 ? 1 : 8 / DPL;  // rows a warp loads at once
  static_assert(kKeyTile % (kWarps * kRows) == 0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int r0 = warp * kRows; r0 < kKeyTile; r0 += kWarps * kRows) {
    T kx[kRows][DPL], vx[kRows][DPL];
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int r = r0 + rr, d = lane + 32 * i;
        const bool ok = r < rows && d < hs;
        kx[rr][i] = ok ? load_as<T>(k[r * kst + d]) : T(0);
        vx[rr][i] = ok ? load_as<T>(v[r * vst + d]) : T(0);
      }
    }
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int r = r0 + rr, d = lane + 32 * i;
        if (d < hs) {
          ks[r * kpad + d] = kx[rr][i];
          vs[r * hs + d] = vx[rr][i];
        }
      }
    }
  }
}

// Decode, T == 1: block x covers key split x / (B NKV chunks) of KV head (b, g) for query
// heads h0 .. h0 + heads of its group, R per warp, laid out as the forward kernel's query rows
// (same shared memory). The single query sees all kv_len(b) keys. With one split it writes out;
// else, per head, the split's max m, sum l and unnormalised output to part (B, NH, splits,
// HS + 2) as (acc, m, l), an empty split (m = -inf, l = 0, acc = 0) included.
template <class T, int DPL, int R, class KV>
__global__ void __launch_bounds__(kBlockThreads)
    attention_decode_kernel(View<T> out, T* part, View<const T> q, View<const KV> k,
                            View<const KV> v, Params<T> p, DecodeSplits sp) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int hs = static_cast<int>(p.hs), kpad = p.kpad;
  T* qs = reinterpret_cast<T*>(smem);  // (kWarps R, hs) of a (kQueryTile, hs) region
  T* ks = qs + kQueryTile * hs;        // (kKeyTile, kpad)
  T* vs = ks + kKeyTile * kpad;        // (kKeyTile, hs)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t x = blockIdx.x, c = x % sp.chunks, g = x / sp.chunks % p.nkv;
  const int64_t b = x / (sp.chunks * p.nkv) % p.batch, split = x / (sp.chunks * p.nkv * p.batch);
  const int64_t h0 = g * p.group + c * kWarps * R;
  const int heads = static_cast<int>(min64(kWarps * R, (g + 1) * p.group - h0));
  const int wrows = static_cast<int>(max64(0, min64(R, heads - warp * R)));  // this warp's heads
  const int64_t j_begin = split * sp.keys, j_end = min64(p.kv_len(b), j_begin + sp.keys);

  load_rows(qs, hs, q.row(b, h0, 0), q.v.sh, heads, kWarps * R, hs);
  OnlineSoftmax<T, R, DPL> sm;

  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {  // block-uniform bounds
    const int nk = static_cast<int>(min64(kKeyTile, j_end - j0));
    __syncthreads();  // q is staged, the previous tile consumed
    load_kv_tile<T, DPL>(ks, kpad, vs, k.row(b, g, j0), k.v.st, v.row(b, g, j0), v.v.st, nk, hs);
    __syncthreads();
    if (wrows == 0) continue;  // warp-uniform
    T sc[R];
    row_dots(sc, qs + warp * R * hs, hs, ks + lane * kpad, 0, hs);
    const bool vis = lane < nk;
    T w[R];  // this lane's unnormalised probability, per head
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // Warp-uniform; lane 0's key is valid.
      w[r] = r < wrows ? sm.add(r, sc[r] * p.scale, vis) : T(0);
    }
    sm.accumulate(w, vs, nk, hs, lane);
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= wrows) continue;  // warp-uniform
    const int64_t h = h0 + warp * R + r;
    const T sum = warp_sum(sm.l[r]);
    if (part == nullptr) {  // one split: it holds every key, so sum >= 1
      sm.write(r, out.row(b, h, 0), sum, hs, lane);
    } else {
      T* rec = part + ((b * p.nh + h) * sp.count + split) * (hs + 2);
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < hs) rec[d] = sm.acc[r][i];
      }
      if (lane == 0) {
        rec[hs] = sm.m[r];
        rec[hs + 1] = sum;
      }
    }
  }
}

// Merges the decode splits of part (B, NH, splits, HS + 2) into out, a warp per (b, h), in
// split order: out = sum_i e_i acc_i / sum_i e_i l_i with e_i = exp(m_i - max m). Split 0
// always holds key 0, so the max is finite and an empty split gets e_i = 0.
template <class T, int DPL>
__global__ void __launch_bounds__(kBlockThreads)
    attention_decode_combine_kernel(View<T> out, const T* part, Params<T> p, int64_t splits) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;  // b NH + h
  if (row >= p.batch * p.nh) return;  // warp-uniform, and no barrier follows
  const int hs = static_cast<int>(p.hs);
  const T* rec = part + row * splits * (hs + 2);
  T mx = -INFINITY;
  for (int64_t i = lane; i < splits; i += 32) mx = max(mx, rec[i * (hs + 2) + hs]);
  mx = warp_max(mx);
  T sum = T(0), o[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) o[i] = T(0);
  for (int64_t s = 0; s < splits; ++s) {
    const T* r = rec + s * (hs + 2);
    const T e = exp_t(r[hs] - mx);
    sum += e * r[hs + 1];
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hs) o[i] += e * r[d];
    }
  }
  const T inv = T(1) / sum;
  T* dst = out.row(row / p.nh, row % p.nh, 0);
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = lane + 32 * i;
    if (d < hs) dst[d] = o[i] * inv;
  }
}

// Stream-ordered device scratch, freed on the stream after the kernels queued before it.
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    if (bytes > 0) CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream()));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (ptr_) (void)cudaFreeAsync(ptr_, stream());  // reached only when a launch threw
  }
  void release() {
    void* p = ptr_;
    ptr_ = nullptr;
    if (p) CUDA_CHECK(cudaFreeAsync(p, stream()));
  }
  template <class U>
  U* as() const {
    return static_cast<U*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

void check_shape(const AttentionShape& s) {
  KVLAB_CHECK(s.HS <= kMaxHeadSize, "causal_attention (cuda): head size ", s.HS,
              " above the supported ", kMaxHeadSize);
  KVLAB_ASSERT(s.NKV > 0 && s.NH % s.NKV == 0 && s.T <= s.S);
  if (s.kv_lengths)
    for (int64_t b = 0; b < s.B; ++b)
      KVLAB_ASSERT(s.kv_lengths[b] >= s.T && s.kv_lengths[b] <= s.S, "kv_lengths[", b, "]");
}

size_t device_lengths_bytes(const AttentionShape& s) {
  return s.kv_lengths && s.B > kInlineLengths ? static_cast<size_t>(s.B) * sizeof(int64_t) : 0;
}

// dev_lengths: a device buffer of device_lengths_bytes(s) bytes, or null when that is 0.
template <class T>
Params<T> make_params(const AttentionShape& s, int64_t* dev_lengths) {
  Params<T> p{};
  p.batch = s.B;
  p.nh = s.NH;
  p.nkv = s.NKV;
  p.nq = s.T;
  p.nk = s.S;
  p.hs = s.HS;
  p.group = s.NH / s.NKV;
  p.kpad = static_cast<int>(s.HS | 1);
  p.scale = static_cast<T>(s.scale);
  // The CPU backend's Dropout, value for value.
  p.drop = s.dropout > 0;
  p.threshold =
      s.dropout >= 1.0 ? ~0ull : static_cast<uint64_t>(s.dropout * 18446744073709551616.0);
  p.keep = static_cast<T>(s.dropout < 1.0 ? 1.0 / (1.0 - s.dropout) : 0.0);
  p.seed = s.seed;
  p.has_lengths = s.kv_lengths != nullptr;
  p.lengths = dev_lengths;
  if (dev_lengths) {
    // From pageable memory: returns once the source is staged, so the caller may reuse it.
    CUDA_CHECK(cudaMemcpyAsync(dev_lengths, s.kv_lengths,
                               static_cast<size_t>(s.B) * sizeof(int64_t), cudaMemcpyHostToDevice,
                               stream()));
  } else if (s.kv_lengths) {
    for (int64_t b = 0; b < s.B; ++b) p.inline_lengths[b] = s.kv_lengths[b];
  }
  return p;
}

// Calls f(std::integral_constant<int, DPL>) with the dims per lane HS needs.
template <class F>
void with_head_size(int64_t hs, F&& f) {
  if (hs <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (hs <= 64) {
    f(std::integral_constant<int, 2>{});
  } else if (hs <= 128) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

unsigned grid_size(int64_t blocks) {
  KVLAB_CHECK(blocks <= INT_MAX, "causal_attention (cuda): ", blocks, " blocks exceed the grid");
  return static_cast<unsigned>(blocks);
}

// Lets `kernel` take `bytes` of dynamic shared memory (beyond 48 KiB only by opting in).
template <class Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultSharedBytes) return;
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  KVLAB_CHECK(bytes <= static_cast<size_t>(optin), "causal_attention (cuda): this head size needs ",
              bytes, " bytes of shared memory per block, the device allows ", optin);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

int sm_count() {
  static const int sms = [] {
    int device = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  }();
  return sms;
}

// Calls f(std::integral_constant<int, R>) with the query heads per warp (1, 2 or 4) that spread
// min(group, kQueryTile) heads over the block's warps.
template <class F>
void with_decode_rows(int64_t group, F&& f) {
  const int64_t per_warp = ceil_div(min64(group, kQueryTile), kWarps);
  if (per_warp <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (per_warp <= 2) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, kRowsPerWarp>{});
  }
}

// Splits by S, not by each row's kv_len, so boundaries depend only on the shape (and the
// device's SM count): results are deterministic.
DecodeSplits decode_splits(int64_t kv_heads, int64_t chunks, int64_t S) {
  const int64_t want =
      ceil_div(static_cast<int64_t>(kDecodeBlocksPerSm) * sm_count(), kv_heads * chunks);
  const int64_t count = max64(1, min64(want, S / kDecodeMinKeys));
  const int64_t keys = ceil_div(ceil_div(S, count), kKeyTile) * kKeyTile;
  return {ceil_div(S, keys), keys, chunks};
}

// The flash kernel would give each (b, h) of a decode step a block with one busy warp walking
// all keys; here blocks split the keys, and a KV head's K and V serve its whole group at once.
template <class T, class KV>
void decode_forward(View<T> out, View<const T> q, View<const KV> k, View<const KV> v,
                    const Params<T>& p) {
  const size_t smem = forward_shared_bytes<T>(p.hs, p.kpad);
  with_decode_rows(p.group, [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    const int64_t chunks = ceil_div(p.group, kWarps * R);
    const DecodeSplits sp = decode_splits(p.batch * p.nkv, chunks, p.nk);
    // part (B, NH, splits, HS + 2): each split's acc, m, l; none with one split
    const int64_t part_elems = sp.count > 1 ? p.batch * p.nh * sp.count * (p.hs + 2) : 0;
    Scratch part(static_cast<size_t>(part_elems) * sizeof(T));
    with_head_size(p.hs, [&](auto dpl) {
      constexpr int DPL = decltype(dpl)::value;
      const auto kernel = attention_decode_kernel<T, DPL, R, KV>;
      allow_shared(kernel, smem);
      kernel<<<grid_size(p.batch * p.nkv * chunks * sp.count), kBlockThreads, smem, stream()>>>(
          out, part.as<T>(), q, k, v, p, sp);
      KVLAB_LAUNCH_CHECK();
      if (sp.count > 1) {
        attention_decode_combine_kernel<T, DPL>
            <<<grid_size(ceil_div(p.batch * p.nh, kWarps)), kBlockThreads, 0, stream()>>>(
                out, part.as<T>(), p, sp.count);
        KVLAB_LAUNCH_CHECK();
      }
    });
    part.release();
  });
}

}  // namespace

template <class T, class KV>
void attention_forward(T* out, HeadView out_v, const T* q, HeadView q_v, const KV* k, HeadView k_v,
                       const KV* v, HeadView v_v, const AttentionShape& s) {
  // The kernels read (B, NKV, S, HS) operands only; block tables are read on the CPU.
  KVLAB_CHECK(s.kv_blocks == nullptr,
              "causal_attention (cuda): paged KV cache is not supported on CUDA");
  if (s.B * s.NH * s.T == 0 || s.HS == 0) return;
  check_shape(s);
  Scratch lengths(device_lengths_bytes(s));
  const Params<T> p = make_params<T>(s, lengths.as<int64_t>());
  if (s.T == 1 && !p.drop) {
    decode_forward<T, KV>({out, out_v}, {q, q_v}, {k, k_v}, {v, v_v}, p);
  } else {
    const unsigned blocks = grid_size(s.B * s.NH * ceil_div(s.T, kQueryTile));
    const size_t smem = forward_shared_bytes<T>(s.HS, p.kpad);
    with_head_size(s.HS, [&](auto dpl) {
      const auto kernel = attention_forward_kernel<T, decltype(dpl)::value, KV>;
      allow_shared(kernel, smem);
      kernel<<<blocks, kBlockThreads, smem, stream()>>>({out, out_v}, {q, q_v}, {k, k_v}, {v, v_v},
                                                        p);
      KVLAB_LAUNCH_CHECK();
    });
  }
  lengths.release();
}

template <class T>
void attention_backward(T* dq, HeadView dq_v, T* dk, HeadView dk_v, T* dv, HeadView dv_v,
                        const T* dout, HeadView dout_v, const T* q, HeadView q_v, const T* k,
                        HeadView k_v, const T* v, HeadView v_v, const AttentionShape& s) {
  if (s.B == 0 || s.HS == 0) return;  // dq, dk and dv are all empty
  check_shape(s);
  Scratch lengths(device_lengths_bytes(s));
  const Params<T> p = make_params<T>(s, lengths.as<int64_t>());
  const int64_t n_rows = s.B * s.NH * s.T;
  Scratch stats(static_cast<size_t>(3 * n_rows) * sizeof(T));  // (3, B, NH, T) m, 1/sum, D
  with_head_size(s.HS, [&](auto dpl) {
    constexpr int DPL = decltype(dpl)::value;
    if (n_rows > 0) {
      const auto kernel = attention_dq_kernel<T, DPL>;
      const size_t smem = dq_shared_bytes<T>(s.HS, p.kpad);
      allow_shared(kernel, smem);
      kernel<<<grid_size(n_rows / s.T * ceil_div(s.T, kQueryTile)), kBlockThreads, smem,
               stream()>>>({dq, dq_v}, stats.as<T>(), {dout, dout_v}, {q, q_v}, {k, k_v}, {v, v_v},
                           p);
      KVLAB_LAUNCH_CHECK();
    }
    // Also with T == 0 (or NH == 0): dk and dv are then all zeros.
    if (s.NKV * s.S > 0) {
      const auto kernel = attention_dkdv_kernel<T, DPL>;
      const size_t smem = dkdv_shared_bytes<T>(s.HS, p.kpad);
      allow_shared(kernel, smem);
      kernel<<<grid_size(s.B * s.NKV * ceil_div(s.S, kKvTile)), kBlockThreads, smem, stream()>>>(
          {dk, dk_v}, {dv, dv_v}, stats.as<T>(), {dout, dout_v}, {q, q_v}, {k, k_v}, {v, v_v}, p);
      KVLAB_LAUNCH_CHECK();
    }
  });
  stats.release();
  lengths.release();
}

KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_INSTANTIATE, float, float)
KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_INSTANTIATE, double, double)
KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_INSTANTIATE, float, uint16_t)
KVLAB_ATTENTION_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_ATTENTION_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cuda
