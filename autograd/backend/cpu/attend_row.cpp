// The decode attention's row kernel (attend_one_query_kernel, cpu/decode_kernels.h): one f32
// query over a few hundred cached keys, contiguous or read through a paged cache's block table,
// f32 or quantised (each row dequantised in registers as it is read), over dot_simd.h's
// primitives.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/cpu/dot_simd.h"
#include "autograd/backend/cpu/kv_quant.h"
#include "autograd/backend/cpu/vec_math.h"  // attend_rows's softmax

namespace kvlab::cpu {

#if defined(KVLAB_ROW_KERNELS)
namespace {

// Vectors of kLanes a row of HS columns takes, up to which attend_one_query_kernel runs the
// row kernel below (HS 128 with AVX-512, 64 with AVX2); longer rows take the general
// attention's products (attend_one_query, attention.cpp).
constexpr int64_t kAttendMaxVectors = 8;

// Row j of a contiguous cache's keys or values (a BlockRows's counterpart).
template <class E>
struct StridedRows {
  const E* base;
  int64_t st;
  const E* operator()(int64_t j) const { return base + j * st; }
  int64_t run() const { return INT64_MAX; }
  int64_t stride() const { return st; }
};

// Vector h of an f32 row of NV vectors, the last one's first `last` lanes.
template <int NV>
struct F32Row {
  int64_t last;
  Vec operator()(const float* row, int h) const {
    return h < NV - 1 || last == kLanes ? vload(row + h * kLanes)
                                        : vload_lanes(row + h * kLanes, 0, last);
  }
};

// Vector h of a quantised row (backend/kv_format.h), dequantised with kv_quant.h's operations:
// the lanes' codes widened to f32, then int8's code * scale, int4's fma(code, scale, min) or
// fp8's exact value times its head's scale. Rows are whole vectors, and an int4 group a whole
// number of them.
struct QuantRow {
  DType dtype;
  float fp8_scale;  // the KV head's (fp8)
  int64_t groups;   // int4 groups a row
  int64_t group;    // channels an int4 group
  Vec operator()(const uint8_t* row, int h) const {
    if (dtype == DType::INT8)
      return vmul(codes_i8(row + 4 + h * kLanes), vbroadcast(int8_row_scale(row)));
    if (dtype == DType::INT4) {
      const int64_t g = h * kLanes / group;
      return vfmadd(codes_u4(row + 4 * groups + h * kLanes / 2), vbroadcast(int4_scale(row, g)),
                    vbroadcast(int4_min(row, g)));
    }
    return vmul(vmul(fp8_bits(row + h * kLanes), vbroadcast(0x1p120f)), vbroadcast(fp8_scale));
  }

 private:
  // kLanes / 2 bytes of nibbles as kLanes bytes in channel order: byte i's low nibble, then
  // its high one.
  static __m128i nibbles(__m128i bytes) {
    const __m128i w = _mm_cvtepu8_epi16(bytes);
    return _mm_or_si128(_mm_and_si128(w, _mm_set1_epi16(0x0F)),
                        _mm_and_si128(_mm_slli_epi16(w, 4), _mm_set1_epi16(0x0F00)));
  }
#if defined(__AVX512F__)
  // The conversions are the zero-masking forms under a full mask: GCC 12 warns of an
  // uninitialised value inside the plain ones (as dot_simd.h's bf16_low says).
  static constexpr __mmask16 kAll = 0xFFFF;
  static __m128i load16(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  static Vec codes_i8(const uint8_t* p) {
    return _mm512_maskz_cvtepi32_ps(kAll, _mm512_maskz_cvtepi8_epi32(kAll, load16(p)));
  }
  static Vec codes_u4(const uint8_t* p) {
    return _mm512_maskz_cvtepi32_ps(
        kAll, _mm512_maskz_cvtepu8_epi32(
                  kAll, nibbles(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  }
  // E4M3 bytes' sign, exponent and mantissa in an f32's places: 2^-120 times their values.
  static Vec fp8_bits(const uint8_t* p) {
    const __m512i w = _mm512_maskz_cvtepu8_epi32(kAll, load16(p));
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_maskz_slli_epi32(kAll, _mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24),
        _mm512_maskz_slli_epi32(kAll, _mm512_and_si512(w, _mm512_set1_epi32(0x7F)), 20)));
  }
#else
  static __m128i load8(const uint8_t* p) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  }
  static Vec codes_i8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p)));
  }
  static Vec codes_u4(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, sizeof four);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles(_mm_cvtsi32_si128(four))));
  }
  static Vec fp8_bits(const uint8_t* p) {
    const __m256i w = _mm256_cvtepu8_epi32(load8(p));
    return _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24),
                        _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7F)), 20)));
  }
#endif
};

// attend_one_query with rows of NV vectors (the last one's first `last` lanes), key and value
// row j at k(j) and v(j), vector h of a key row read by kload(row, h), of a value row by
// vload_row(row, h). Scores 8 keys
// at a time: each key's product with q in its own accumulator (the first vector multiplied,
// the rest fused in), the 8 reduced by one lane tree, scaled and stored under a mask, in the
// order of dot_block's one-row product. Then the softmax, and the values weighted by the
// unnormalised probabilities in one pass over their rows (U interleaved accumulators: one
// chain of dependent FMAs would leave the FMA units idle), divided by the sum at the end.
// The general products (two calls into gemm and a normalising pass) took a decode step's
// attention much longer (docs/bench-log/code-figures.md).
template <int NV, class Rows, class KLoad, class VLoad>
void attend_rows(float* out, const float* q, const Rows& k, const Rows& v, const KLoad& kload,
                 const VLoad& vload_row, int64_t n, int64_t last, float scale, float* p) {
  const F32Row<NV> qload{last};
  Vec qv[NV];
  for (int h = 0; h < NV; ++h) qv[h] = qload(q, h);
  const Vec vscale = vbroadcast(scale);
  // Groups of rows that lie in one run (a paged cache's block) are reached from the group's
  // first row, not each through the block table.
  const bool k_runs = k.run() >= kRows, v_runs = v.run() >= 8;
  // A run's rows are contiguous but the next run lies elsewhere, where the hardware's
  // prefetcher has not followed: entering a run, fetch the next one's rows.
  const int64_t elem = sizeof *k(0);
  const int64_t run_bytes = k.run() < n ? k.run() * k.stride() * elem : 0;
  auto prefetch_run = [&](const void* first) {
    for (int64_t b = 0; b < run_bytes; b += 64)
      __builtin_prefetch(static_cast<const char*>(first) + b);
  };
  for (int64_t j = 0; j < n; j += kRows) {
    const int64_t m = std::min(kRows, n - j);  // keys in this block
    const auto* k0 = k(j);
    if (run_bytes > 0 && (j & (k.run() - 1)) == 0 && j + k.run() < n) prefetch_run(k(j + k.run()));
    Vec acc[kRows];
    for (int64_t i = 0; i < kRows; ++i) {
      const int64_t r = std::min(i, m - 1);  // past the last key: it again
      const auto* kr = k_runs ? k0 + r * k.stride() : k(j + r);
      acc[i] = vmul(kload(kr, 0), qv[0]);
      for (int h = 1; h < NV; ++h) acc[i] = vfmadd(kload(kr, h), qv[h], acc[i]);
    }
    vstore_lanes(p + j, vmul(vscale, sum_lanes8(acc)), 0, m);
  }
  const float inv = static_cast<float>(1.0 / exp_shift_inplace(p, n, row_max(p, n)));
  constexpr int U = std::max(1, 8 / NV);
  Vec sum[U][NV];
  for (auto& row : sum)
    for (auto& x : row) x = vzero();
  auto add = [&](int u, int64_t j, const auto* vr) {
    const Vec pj = vbroadcast(p[j]);
    for (int h = 0; h < NV; ++h) sum[u][h] = vfmadd(pj, vload_row(vr, h), sum[u][h]);
  };
  int64_t j = 0;
  for (; j + U <= n; j += U) {
    const auto* v0 = v(j);  // U <= 8 rows from a multiple of U: one run when v_runs
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
    const int64_t last = HS - (nv() - 1) * kLanes;
    const F32Row<nv()> load{last};
    attend_rows<nv()>(out, q, k, v, load, load, n, last, scale, p);
  });
  return true;
}

template <class Rows>
bool attend_quant_with(float* out, const float* q, const Rows& k, const Rows& v, int64_t n,
                       int64_t HS, float scale, float* p, const KVQuant& fmt) {
  const int64_t vectors = HS / kLanes, group = kv_int4_group(HS);
  if (HS % kLanes != 0 || vectors > kAttendMaxVectors ||
      (fmt.dtype == DType::INT4 && group % kLanes != 0))
    return false;
  const QuantRow kload{fmt.dtype, fmt.k_scale, HS / group, group};
  const QuantRow vload_row{fmt.dtype, fmt.v_scale, HS / group, group};
  with_rows<kAttendMaxVectors>(vectors, [&](auto nv) {
    attend_rows<nv()>(out, q, k, v, kload, vload_row, n, kLanes, scale, p);
  });
  return true;
}

}  // namespace

bool attend_one_query_kernel(float* out, const float* q, const float* k, int64_t kst,
                             const float* v, int64_t vst, int64_t n, int64_t HS, float scale,
                             float* p) {
  return attend_with(out, q, StridedRows<float>{k, kst}, StridedRows<float>{v, vst}, n, HS, scale,
                     p);
}

bool attend_one_query_kernel(float* out, const float* q, const BlockRows<float>& k,
                             const BlockRows<float>& v, int64_t n, int64_t HS, float scale,
                             float* p) {
  return attend_with(out, q, k, v, n, HS, scale, p);
}

bool attend_one_query_kernel(float* out, const float* q, const uint8_t* k, int64_t kst,
                             const uint8_t* v, int64_t vst, int64_t n, int64_t HS, float scale,
                             float* p, const KVQuant& fmt) {
  return attend_quant_with(out, q, StridedRows<uint8_t>{k, kst}, StridedRows<uint8_t>{v, vst}, n,
                           HS, scale, p, fmt);
}

bool attend_one_query_kernel(float* out, const float* q, const BlockRows<uint8_t>& k,
                             const BlockRows<uint8_t>& v, int64_t n, int64_t HS, float scale,
                             float* p, const KVQuant& fmt) {
  return attend_quant_with(out, q, k, v, n, HS, scale, p, fmt);
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

bool attend_one_query_kernel(float*, const float*, const uint8_t*, int64_t, const uint8_t*, int64_t,
                             int64_t, int64_t, float, float*, const KVQuant&) {
  return false;
}

bool attend_one_query_kernel(float*, const float*, const BlockRows<uint8_t>&,
                             const BlockRows<uint8_t>&, int64_t, int64_t, float, float*,
                             const KVQuant&) {
  return false;
}
#endif

}  // namespace kvlab::cpu
