// The decode attention's row kernel (attend_one_query_kernel, cpu/decode_kernels.h): one f32
// query over a few hundred cached keys, contiguous or read through a paged cache's block table,
// over dot_simd.h's primitives.
#include <algorithm>
#include <cstdint>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/cpu/dot_simd.h"
#include "autograd/backend/cpu/vec_math.h"  // attend_rows's softmax

namespace kvlab::cpu {

#if defined(KVLAB_ROW_KERNELS)
namespace {

// Vectors of kLanes a row of HS columns takes, up to which attend_one_query_kernel runs the
// row kernel below (HS 128 with AVX-512, 64 with AVX2); longer rows take the general
// attention's products (attend_one_query, attention.cpp).
constexpr int64_t kAttendMaxVectors = 8;

// Row j of a contiguous cache's keys or values (a BlockRows's counterpart).
struct StridedRows {
  const float* base;
  int64_t st;
  const float* operator()(int64_t j) const { return base + j * st; }
  int64_t run() const { return INT64_MAX; }
  int64_t stride() const { return st; }
};

// attend_one_query with rows of NV vectors (the last one's first `last` lanes), key and value
// row j at k(j) and v(j). Scores 8 keys
// at a time: each key's product with q in its own accumulator (the first vector multiplied,
// the rest fused in), the 8 reduced by one lane tree, scaled and stored under a mask, in the
// order of dot_block's one-row product. Then the softmax, and the values weighted by the
// unnormalised probabilities in one pass over their rows (U interleaved accumulators: one
// chain of dependent FMAs would leave the FMA units idle), divided by the sum at the end.
// The general products (two calls into gemm and a normalising pass) took a decode step's
// attention much longer (docs/bench-log/code-figures.md).
template <int NV, class Rows>
void attend_rows(float* out, const float* q, const Rows& k, const Rows& v, int64_t n, int64_t last,
                 float scale, float* p) {
  auto load = [&](const float* row, int h) {
    return h < NV - 1 || last == kLanes ? vload(row + h * kLanes)
                                        : vload_lanes(row + h * kLanes, 0, last);
  };
  Vec qv[NV];
  for (int h = 0; h < NV; ++h) qv[h] = load(q, h);
  const Vec vscale = vbroadcast(scale);
  // Groups of rows that lie in one run (a paged cache's block) are reached from the group's
  // first row, not each through the block table.
  const bool k_runs = k.run() >= kRows, v_runs = v.run() >= 8;
  // A run's rows are contiguous but the next run lies elsewhere, where the hardware's
  // prefetcher has not followed: entering a run, fetch the next one's rows.
  const int64_t run_bytes = k.run() < n ? k.run() * k.stride() * 4 : 0;
  auto prefetch_run = [&](const float* first) {
    for (int64_t b = 0; b < run_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(first) + b);
  };
  for (int64_t j = 0; j < n; j += kRows) {
    const int64_t m = std::min(kRows, n - j);  // keys in this block
    const float* k0 = k(j);
    if (run_bytes > 0 && (j & (k.run() - 1)) == 0 && j + k.run() < n) prefetch_run(k(j + k.run()));
    Vec acc[kRows];
    for (int64_t i = 0; i < kRows; ++i) {
      const int64_t r = std::min(i, m - 1);  // past the last key: it again
      const float* kr = k_runs ? k0 + r * k.stride() : k(j + r);
      acc[i] = vmul(load(kr, 0), qv[0]);
      for (int h = 1; h < NV; ++h) acc[i] = vfmadd(load(kr, h), qv[h], acc[i]);
    }
    vstore_lanes(p + j, vmul(vscale, sum_lanes8(acc)), 0, m);
  }
  const float inv = static_cast<float>(1.0 / exp_shift_inplace(p, n, row_max(p, n)));
  constexpr int U = std::max(1, 8 / NV);
  Vec sum[U][NV];
  for (auto& row : sum)
    for (auto& x : row) x = vzero();
  auto add = [&](int u, int64_t j, const float* vr) {
    const Vec pj = vbroadcast(p[j]);
    for (int h = 0; h < NV; ++h) sum[u][h] = vfmadd(pj, load(vr, h), sum[u][h]);
  };
  int64_t j = 0;
  for (; j + U <= n; j += U) {
    const float* v0 = v(j);  // U <= 8 rows from a multiple of U: one run when v_runs
    if (run_bytes > 0 && (j & (v.run() - 1)) == 0 && j + v.run() < n) prefetch_run(v(j + v.run()));
    for (int u = 0; u < U; ++u) add(u, j + u, v_runs ? v0 + u * v.stride() : v(j + u));
  }
  for (; j < n; ++j) add(0, j, v(j));
  for (int h = 0; h < NV; ++h) {
    for (int u = 1; u < U; ++u) sum[0][h] = vadd(sum[0][h], sum[u][h]);
    vstore_lanes(out + h * kLanes, vmul(vbroadcast(inv), sum[0][h]), 0, h < NV - 1 ? kLanes : last);
  }
}

template <class Rows>
bool attend_with(float* out, const float* q, const Rows& k, const Rows& v, int64_t n, int64_t HS,
                 float scale, float* p) {
  const int64_t vectors = (HS + kLanes - 1) / kLanes;
  if (vectors > kAttendMaxVectors) return false;
  with_rows<kAttendMaxVectors>(vectors, [&](auto nv) {
    attend_rows<nv()>(out, q, k, v, n, HS - (nv() - 1) * kLanes, scale, p);
  });
  return true;
}

}  // namespace

bool attend_one_query_kernel(float* out, const float* q, const float* k, int64_t kst,
                             const float* v, int64_t vst, int64_t n, int64_t HS, float scale,
                             float* p) {
  return attend_with(out, q, StridedRows{k, kst}, StridedRows{v, vst}, n, HS, scale, p);
}

bool attend_one_query_kernel(float* out, const float* q, const BlockRows<float>& k,
                             const BlockRows<float>& v, int64_t n, int64_t HS, float scale,
                             float* p) {
  return attend_with(out, q, k, v, n, HS, scale, p);
}
#else
bool attend_one_query_kernel(float*, const float*, const float*, int64_t, const float*, int64_t,
                             int64_t, int64_t, float, float*) {
  return false;
}

bool attend_one_query_kernel(float*, const float*, const BlockRows<float>&,
                             const BlockRows<float>&, int64_t, int64_t, float, float*) {
  return false;
}
#endif

}  // namespace kvlab::cpu
