#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/cpu/vec_math.h"
#include "autograd/backend/kernels.h"
#include "platform/kv_rows.h"
#include "platform/random.h"
#include "platform/scalar_codecs.h"

namespace kvlab::cpu {

// Fused causal attention with grouped K/V heads. One (T, S_b) score tile per query head lives
// in a per-thread scratch buffer; nothing of size (B, NH, T, S) is kept: backward recomputes
// the probabilities from q and k exactly as forward did. (Rebuilding them from a saved
// log-sum-exp instead puts the lse's rounding, ~1e-6 relative in f32, on every probability,
// and the softmax backward amplifies it where dP - rowsum(P dP) cancels.)
namespace {

template <class T>
T* scratch(size_t n, int slot) {
  thread_local std::vector<T> buf[3];
  if (buf[slot].size() < n) buf[slot].resize(n);
  return buf[slot].data();
}

struct Dropout {
  uint64_t threshold;
  double keep_scale;
  bool on;
  explicit Dropout(double p)
      : threshold(p >= 1.0 ? ~0ull : static_cast<uint64_t>(p * 18446744073709551616.0)),
        keep_scale(p < 1.0 ? 1.0 / (1.0 - p) : 0.0),
        on(p > 0) {}
  // Multiplier of probability (b, h, t, j): 0 or 1/(1-p).
  double factor(uint64_t seed, int64_t idx) const {
    return hash64(seed, static_cast<uint64_t>(idx)) < threshold ? 0.0 : keep_scale;
  }
};

// How KV group g's rows read: for quantised storage its dtype and fp8 scales (KVQuant).
KVQuant kv_quant(const AttentionShape& s, int64_t g) {
  KVQuant q{s.kv_dtype};
  if (s.kv_scales != nullptr) {
    q.k_scale = s.kv_scales[g];
    q.v_scale = s.kv_scales[s.NKV + g];
  }
  return q;
}

// K or V rows [0, rows) of one KV head, read as T: the stored rows themselves (row stride
// `st`), or for bf16 or quantised storage a widened copy in `widened` (rows * HS, row stride
// HS). `fmt` says how a quantised row reads; `value` picks its value scale over its key one.
template <class T, class KV>
const T* kv_rows(const KV* src, int64_t st, int64_t rows, int64_t HS, T* widened, int64_t& out_st,
                 const KVQuant& fmt, bool value) {
  if constexpr (std::is_same_v<KV, T>) {
    out_st = st;
    return src;
  } else if constexpr (std::is_same_v<KV, uint8_t>) {
    static_assert(std::is_same_v<T, float>);
    for (int64_t r = 0; r < rows; ++r)
      dequantise_kv_row(fmt.dtype, widened + r * HS, src + r * st, HS,
                        value ? fmt.v_scale : fmt.k_scale);
    out_st = HS;
    return widened;
  } else {
    static_assert(std::is_same_v<T, float> && std::is_same_v<KV, uint16_t>);
    float* dst = widened;
    for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
      for (int64_t d = 0; d < HS; ++d) dst[r * HS + d] = bf16_to_f32(src[r * st + d]);
    out_st = HS;
    return dst;
  }
}

inline int64_t kv_len(const AttentionShape& s, int64_t b) {
  return s.kv_lengths ? s.kv_lengths[b] : s.S;
}

// Scores p (Tq, Sb) turned into probabilities: softmax under the causal mask (query t sees keys
// 0 .. Sb - Tq + t), zero past each query's last visible key.
template <class T>
void causal_softmax(T* p, int64_t Tq, int64_t Sb) {
  for (int64_t t = 0; t < Tq; ++t) {
    T* row = p + t * Sb;
    const int64_t n = Sb - Tq + t + 1;  // visible keys
    const T inv = static_cast<T>(1.0 / exp_shift_inplace(row, n, row_max(row, n)));
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    std::fill(row + n, row + Sb, T(0));
  }
}

// Probabilities of query head (b, h): p (T, Sb) = softmax(scale q k^T) under the causal mask,
// zero past each query's last visible key.
template <class T>
void probabilities(T* p, const T* qh, int64_t qst, const T* kg, int64_t kst, int64_t Tq,
                   int64_t Sb, int64_t HS, T scale) {
  gemm<T>(false, true, Tq, Sb, HS, scale, qh, qst, kg, kst, T(0), p, Sb);
  causal_softmax(p, Tq, Sb);
}

// The rows of KV head g of batch row b of a paged operand (s.kv_blocks), hv its HeadView.
template <class KV>
BlockRows<KV> block_rows(const KV* pool, HeadView hv, const AttentionShape& s, int64_t b,
                         int64_t g) {
  return BlockRows<KV>::of(pool + g * hv.sh, *s.kv_blocks, b, hv.st);
}

// out (Tq, HS at row stride ost) = the causal attention of Tq queries (qh, row stride qst) over
// the n keys and values of a paged row, block by block: each block's scores are written into
// their columns of p (Tq, n), the softmax runs over all of them, and each block's values are
// added into out. A bf16 or quantised block is widened into `widened` (block_len * HS) before
// its product.
// The scores are the general path's; the values are summed one block at a time rather than in
// one product over all n keys, which changes the order of that sum and with it the f32
// rounding of out (the contiguous path's results within rounding, not its bits).
template <class T, class KV>
void attend_blocks(T* out, int64_t ost, const T* qh, int64_t qst, int64_t Tq,
                   const BlockRows<KV>& k, const BlockRows<KV>& v, int64_t n, int64_t HS, T scale,
                   T* p, T* widened, const KVQuant& fmt) {
  const int64_t len = k.block_len();
  for (int64_t j = 0; j < n; j += len) {
    const int64_t m = std::min(len, n - j);
    int64_t kst;
    const T* kb = kv_rows<T>(k(j), k.pos_stride, m, HS, widened, kst, fmt, false);
    gemm<T>(false, true, Tq, m, HS, scale, qh, qst, kb, kst, T(0), p + j, n);
  }
  causal_softmax(p, Tq, n);
  for (int64_t j = 0; j < n; j += len) {
    const int64_t m = std::min(len, n - j);
    int64_t vst;
    const T* vb = kv_rows<T>(v(j), v.pos_stride, m, HS, widened, vst, fmt, true);
    gemm<T>(false, false, Tq, HS, m, T(1), p + j, n, vb, vst, T(j == 0 ? 0 : 1), out, ost);
  }
}

template <class T>
void apply_dropout(T* p, const Dropout& d, uint64_t seed, int64_t base, int64_t Tq, int64_t Sb,
                   int64_t S) {
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t j = 0; j < Sb; ++j)
      p[t * Sb + j] *= static_cast<T>(d.factor(seed, (base + t) * S + j));
}

// Runs fn(task) for every task. With at least one task per thread they run in parallel with a
// single-threaded BLAS inside; otherwise in turn, outside any parallel region, so the BLAS
// can use the threads itself (an inactive `parallel if(false)` region still makes OpenBLAS
// start a nested team per call, docs/bench-log/code-figures.md).
template <class F>
void for_each_task(int64_t tasks, F&& fn) {
  if (tasks >= omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) fn(t);
  } else {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
  }
}

}  // namespace

template <class T>
void attend_one_query(T* out, const T* q, const T* k, int64_t kst, const T* v, int64_t vst,
                      int64_t n, int64_t HS, T scale, T* p) {
  if constexpr (std::is_same_v<T, float>)
    if (attend_one_query_kernel(out, q, k, kst, v, vst, n, HS, scale, p)) return;
  probabilities(p, q, HS, k, kst, 1, n, HS, scale);
  gemm<T>(false, false, 1, HS, n, T(1), p, n, v, vst, T(0), out, HS);
}

template <class T>
void attend_one_query(T* out, const T* q, const BlockRows<T>& k, const BlockRows<T>& v, int64_t n,
                      int64_t HS, T scale, T* p) {
  if constexpr (std::is_same_v<T, float>)
    if (attend_one_query_kernel(out, q, k, v, n, HS, scale, p)) return;
  attend_blocks<T, T>(out, HS, q, HS, 1, k, v, n, HS, scale, p, nullptr, KVQuant{DType::F32});
}

namespace {

// Heads of one tile of attend_latent's products: gemm<float> keeps up to 4 rows of a on its
// row kernels (its kFewRowsWt).
constexpr int64_t kLatentTile = 4;

// attend_latent over rows that lie in runs: rows(j) is row j, and the rows.run() rows from a
// multiple of it lie rows.stride() apart.
template <class Rows>
void attend_latent_runs(float* y, const float* q, int64_t G, const Rows& rows, int64_t n,
                        int64_t KW, int64_t R, float scale, float* p) {
  for (int64_t g = 0; g < G; g += kLatentTile) {
    const int64_t m = std::min(kLatentTile, G - g);
    float* pg = p + g * n;
    for (int64_t j = 0; j < n; j += rows.run())
      gemm<float>(false, true, m, std::min(rows.run(), n - j), KW, scale, q + g * KW, KW, rows(j),
                  rows.stride(), 0.0f, pg + j, n);
    for (int64_t h = 0; h < m; ++h) {
      float* ph = pg + h * n;
      const auto inv = static_cast<float>(1.0 / exp_shift_inplace(ph, n, row_max(ph, n)));
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) ph[j] *= inv;
    }
    for (int64_t j = 0; j < n; j += rows.run())
      gemm<float>(false, false, m, R, std::min(rows.run(), n - j), 1.0f, pg + j, n, rows(j),
                  rows.stride(), j == 0 ? 0.0f : 1.0f, y + g * KW, KW);
  }
}

// Contiguous rows: one run.
struct OneRun {
  const float* base;
  int64_t n, st;
  const float* operator()(int64_t j) const { return base + j * st; }
  int64_t run() const { return n; }
  int64_t stride() const { return st; }
};

}  // namespace

void attend_latent(float* y, const float* q, int64_t G, const float* rows, int64_t st, int64_t n,
                   int64_t KW, int64_t R, float scale, float* p) {
  attend_latent_runs(y, q, G, OneRun{rows, n, st}, n, KW, R, scale, p);
}

void attend_latent(float* y, const float* q, int64_t G, const BlockRows<float>& rows, int64_t n,
                   int64_t KW, int64_t R, float scale, float* p) {
  attend_latent_runs(y, q, G, rows, n, KW, R, scale, p);
}

template <class T, class KV>
void attention_decode_task(T* out, HeadView ov, const T* q, HeadView qv, const KV* k, HeadView kv,
                           const KV* v, HeadView vv, const AttentionShape& s, int64_t task,
                           int64_t parts, T* work) {
  // The query heads of one KV group (or of a part of it) run one after another over the
  // group's K and V: read from memory for the first, from L1 for the rest (with parts > 1 the
  // group's cache is read from memory once per part, in parallel). A single query sees every
  // cached key: no mask.
  const int64_t group = s.NH / s.NKV, part = task % parts, b = task / parts / s.NKV;
  const int64_t g = task / parts % s.NKV, Sb = kv_len(s, b);
  const int64_t r0 = group * part / parts, rows = group * (part + 1) / parts - r0;
  if (rows == 0) return;
  const int64_t h0 = g * group + r0;  // first query head of this part
  const T scale = static_cast<T>(s.scale);
  T* p = work;  // (Sb), then K and V widened from bf16 or quantised rows
  T* widened = std::is_same_v<KV, T> ? nullptr : work + Sb;
  const KVQuant fmt = kv_quant(s, g);
  T* wk = widened;
  T* wv = widened ? widened + Sb * s.HS : nullptr;
  if (s.kv_blocks != nullptr) {
    const BlockRows<KV> kr = block_rows(k, kv, s, b, g), vr = block_rows(v, vv, s, b, g);
    if constexpr (std::is_same_v<KV, T>) {
      for (int64_t r = h0; r < h0 + rows; ++r)
        attend_one_query<T>(out + b * ov.sb + r * ov.sh, q + b * qv.sb + r * qv.sh, kr, vr, Sb,
                            s.HS, scale, p);
      return;
    }
    if constexpr (std::is_same_v<KV, uint8_t>) {
      bool done = true;
      for (int64_t r = h0; r < h0 + rows && done; ++r)
        done = attend_one_query_kernel(out + b * ov.sb + r * ov.sh, q + b * qv.sb + r * qv.sh, kr,
                                       vr, Sb, s.HS, scale, p, fmt);
      if (done) return;
    }
    // Widened block by block into the work memory where a contiguous row's keys and values
    // are widened, and attended there as they are: the same bits, with the group's query
    // heads sharing one widening.
    int64_t st;
    for (int64_t j = 0; j < Sb; j += kr.block_len()) {
      const int64_t m = std::min(kr.block_len(), Sb - j);
      kv_rows<T>(kr(j), kr.pos_stride, m, s.HS, wk + j * s.HS, st, fmt, false);
      kv_rows<T>(vr(j), vr.pos_stride, m, s.HS, wv + j * s.HS, st, fmt, true);
    }
    for (int64_t r = h0; r < h0 + rows; ++r)
      attend_one_query<T>(out + b * ov.sb + r * ov.sh, q + b * qv.sb + r * qv.sh, wk, s.HS, wv,
                          s.HS, Sb, s.HS, scale, p);
    return;
  }
  const KV* kg = k + b * kv.sb + g * kv.sh;
  const KV* vg = v + b * vv.sb + g * vv.sh;
  if constexpr (std::is_same_v<KV, uint8_t>) {
    // The row kernel has a form for every query head or for none (it depends on HS alone).
    bool done = true;
    for (int64_t r = h0; r < h0 + rows && done; ++r)
      done = attend_one_query_kernel(out + b * ov.sb + r * ov.sh, q + b * qv.sb + r * qv.sh, kg,
                                     kv.st, vg, vv.st, Sb, s.HS, scale, p, fmt);
    if (done) return;
  }
  int64_t kst, vst;
  const T* kw = kv_rows<T>(kg, kv.st, Sb, s.HS, wk, kst, fmt, false);
  const T* vw = kv_rows<T>(vg, vv.st, Sb, s.HS, wv, vst, fmt, true);
  for (int64_t r = h0; r < h0 + rows; ++r)
    attend_one_query<T>(out + b * ov.sb + r * ov.sh, q + b * qv.sb + r * qv.sh, kw, kst, vw, vst,
                        Sb, s.HS, scale, p);
}

template <class T, class KV>
void attention_forward(T* out, HeadView ov, const T* q, HeadView qv, const KV* k, HeadView kv,
                       const KV* v, HeadView vv, const AttentionShape& s) {
  const int64_t group = s.NH / s.NKV, tasks = s.B * s.NH;
  const Dropout drop(s.dropout);
  const T scale = static_cast<T>(s.scale);
  // Decode (T = 1): the fused CPU decode step's attention, at every group size, one query head
  // a group included, so that the op path gives the step's bits. (The general path below
  // normalises the probabilities before weighing the values and sums in another order: a
  // difference of f32 rounding, which a bf16 KV cache can round into a whole bf16 step.)
  // A paged operand (forward without dropout only) takes the same task at T = 1.
  if (s.T == 1 && !drop.on) {
    const auto work = static_cast<size_t>(attention_decode_work<T, KV>(s));
    for_each_task(s.B * s.NKV, [&](int64_t task) {
      attention_decode_task<T, KV>(out, ov, q, qv, k, kv, v, vv, s, task, 1, scratch<T>(work, 0));
    });
    return;
  }
  if (s.kv_blocks != nullptr) {
    // A paged row's keys and values are gathered block by block into work memory (widened
    // where a contiguous row's are widened) and attended there by the contiguous path's
    // products: the same bits. Attending block by block summed the values in another order,
    // and a bf16 cache rounded that f32 difference into whole bf16 steps of the next layer's
    // keys (logits 1e-4 of their scale apart with the AVX2 kernels).
    for_each_task(tasks, [&](int64_t task) {
      const int64_t b = task / s.NH, h = task % s.NH, g = h / group;
      const int64_t Sb = kv_len(s, b);
      const KVQuant fmt = kv_quant(s, g);
      auto gather = [&](const BlockRows<KV>& rows, int slot, bool value) {
        T* dst = scratch<T>(static_cast<size_t>(Sb * s.HS), slot);
        for (int64_t j = 0; j < Sb; j += rows.block_len()) {
          const int64_t m = std::min(rows.block_len(), Sb - j);
          int64_t st;
          const T* src =
              kv_rows<T>(rows(j), rows.pos_stride, m, s.HS, dst + j * s.HS, st, fmt, value);
          if (src != dst + j * s.HS)  // rows of T are read in place: copied
            for (int64_t r = 0; r < m; ++r)
              std::copy(src + r * st, src + r * st + s.HS, dst + (j + r) * s.HS);
        }
        return dst;
      };
      const T* kg = gather(block_rows(k, kv, s, b, g), 1, false);
      const T* vg = gather(block_rows(v, vv, s, b, g), 2, true);
      T* p = scratch<T>(static_cast<size_t>(s.T * Sb), 0);
      probabilities(p, q + b * qv.sb + h * qv.sh, qv.st, kg, s.HS, s.T, Sb, s.HS, scale);
      gemm<T>(false, false, s.T, s.HS, Sb, T(1), p, Sb, vg, s.HS, T(0), out + b * ov.sb + h * ov.sh,
              ov.st);
    });
    return;
  }
  for_each_task(tasks, [&](int64_t task) {
    const int64_t b = task / s.NH, h = task % s.NH, g = h / group;
    const int64_t Sb = kv_len(s, b);
    T* p = scratch<T>(static_cast<size_t>(s.T * Sb), 0);
    const T* qh = q + b * qv.sb + h * qv.sh;
    int64_t kst, vst;
    const auto widened = [&](int slot) {
      return std::is_same_v<KV, T> ? nullptr : scratch<T>(static_cast<size_t>(Sb * s.HS), slot);
    };
    const KVQuant fmt = kv_quant(s, g);
    const T* kg = kv_rows<T>(k + b * kv.sb + g * kv.sh, kv.st, Sb, s.HS, widened(1), kst, fmt, false);
    const T* vg = kv_rows<T>(v + b * vv.sb + g * vv.sh, vv.st, Sb, s.HS, widened(2), vst, fmt, true);
    probabilities(p, qh, qv.st, kg, kst, s.T, Sb, s.HS, scale);
    if (drop.on) apply_dropout(p, drop, s.seed, task * s.T, s.T, Sb, s.S);
    gemm<T>(false, false, s.T, s.HS, Sb, T(1), p, Sb, vg, vst, T(0), out + b * ov.sb + h * ov.sh,
            ov.st);
  });
}

template <class T>
void attention_backward(T* dq, HeadView dqv, T* dk, HeadView dkv, T* dv, HeadView dvv,
                        const T* dout, HeadView dov, const T* q, HeadView qv,
                        const T* k, HeadView kv, const T* v, HeadView vv,
                        const AttentionShape& s) {
  const int64_t group = s.NH / s.NKV, tasks = s.B * s.NKV;
  const Dropout drop(s.dropout);
  const T scale = static_cast<T>(s.scale);
  // One task per KV head: it owns dk and dv of that head and sums its query heads in order,
  // so there are no races and the result does not depend on the thread count.
  for_each_task(tasks, [&](int64_t task) {
    const int64_t b = task / s.NKV, g = task % s.NKV;
    const int64_t Sb = kv_len(s, b);
    const T* kg = k + b * kv.sb + g * kv.sh;
    const T* vg = v + b * vv.sb + g * vv.sh;
    T* dkg = dk + b * dkv.sb + g * dkv.sh;
    T* dvg = dv + b * dvv.sb + g * dvv.sh;
    for (int64_t r = 0; r < s.S; ++r) {
      std::fill_n(dkg + r * dkv.st, s.HS, T(0));
      std::fill_n(dvg + r * dvv.st, s.HS, T(0));
    }
    T* p = scratch<T>(static_cast<size_t>(s.T * Sb), 0);
    T* dp = scratch<T>(static_cast<size_t>(s.T * Sb), 1);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const int64_t head = b * s.NH + h;
      const T* qh = q + b * qv.sb + h * qv.sh;
      const T* doh = dout + b * dov.sb + h * dov.sh;
      probabilities(p, qh, qv.st, kg, kv.st, s.T, Sb, s.HS, scale);
      // dp = dO v^T (gradient of the dropped-out probabilities)
      gemm<T>(false, true, s.T, Sb, s.HS, T(1), doh, dov.st, vg, vv.st, T(0), dp, Sb);
      if (drop.on) {
        // With dropout, dv takes the dropped probabilities and dp the same mask.
        T* pd = scratch<T>(static_cast<size_t>(s.T * Sb), 2);
        for (int64_t t = 0; t < s.T; ++t)
          for (int64_t j = 0; j < Sb; ++j) {
            const T f = static_cast<T>(drop.factor(s.seed, (head * s.T + t) * s.S + j));
            pd[t * Sb + j] = p[t * Sb + j] * f;
            dp[t * Sb + j] *= f;
          }
        gemm<T>(true, false, Sb, s.HS, s.T, T(1), pd, Sb, doh, dov.st, T(1), dvg, dvv.st);
      } else {
        gemm<T>(true, false, Sb, s.HS, s.T, T(1), p, Sb, doh, dov.st, T(1), dvg, dvv.st);
      }
      // ds = p * (dp - rowsum(p * dp)), written over dp
      for (int64_t t = 0; t < s.T; ++t) {
        T* pr = p + t * Sb;
        T* dr = dp + t * Sb;
        double dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < Sb; ++j) dot += pr[j] * dr[j];
        const T d = static_cast<T>(dot);
#pragma omp simd
        for (int64_t j = 0; j < Sb; ++j) dr[j] = pr[j] * (dr[j] - d);
      }
      gemm<T>(false, false, s.T, s.HS, Sb, scale, dp, Sb, kg, kv.st, T(0),
              dq + b * dqv.sb + h * dqv.sh, dqv.st);
      gemm<T>(true, false, Sb, s.HS, s.T, scale, dp, Sb, qh, qv.st, T(1), dkg, dkv.st);
    }
  });
}

KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_INSTANTIATE, float, float)
KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_INSTANTIATE, double, double)
KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_INSTANTIATE, float, uint16_t)
KVLAB_ATTENTION_FORWARD_KERNELS(KVLAB_INSTANTIATE, float, uint8_t)  // quantised: the CPU only
KVLAB_ATTENTION_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_ATTENTION_KERNELS(KVLAB_INSTANTIATE, double)
template void attend_one_query<float>(float*, const float*, const float*, int64_t, const float*,
                                      int64_t, int64_t, int64_t, float, float*);
template void attend_one_query<double>(double*, const double*, const double*, int64_t,
                                       const double*, int64_t, int64_t, int64_t, double, double*);
template void attend_one_query<float>(float*, const float*, const BlockRows<float>&,
                                      const BlockRows<float>&, int64_t, int64_t, float, float*);
template void attend_one_query<double>(double*, const double*, const BlockRows<double>&,
                                       const BlockRows<double>&, int64_t, int64_t, double,
                                       double*);
template void attention_decode_task<float, float>(float*, HeadView, const float*, HeadView,
                                                  const float*, HeadView, const float*, HeadView,
                                                  const AttentionShape&, int64_t, int64_t, float*);
template void attention_decode_task<float, uint16_t>(float*, HeadView, const float*, HeadView,
                                                     const uint16_t*, HeadView, const uint16_t*,
                                                     HeadView, const AttentionShape&, int64_t,
                                                     int64_t, float*);
template void attention_decode_task<float, uint8_t>(float*, HeadView, const float*, HeadView,
                                                    const uint8_t*, HeadView, const uint8_t*,
                                                    HeadView, const AttentionShape&, int64_t,
                                                    int64_t, float*);

}  // namespace kvlab::cpu
