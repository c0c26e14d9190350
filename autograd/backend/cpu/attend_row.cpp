// The decode attention's row kernel (attend_one_query_kernel, cpu/decode_kernels.h): one f32
// query over a few hundred cached keys, contiguous or read through a paged cache's block table,
// f32 or quantised (each row dequantised in registers as it is read), over dot_simd.h's
// primitives.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/cpu/dot_simd.h"
#include "autograd/backend/cpu/vec_math.h"  // attend_rows's softmax
#include "platform/kv_rows.h"

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

// How the row kernel reads a row: reader(row, h) is vector h of it (or reader.read(row, x)
// all of them, read_row), the values themselves or, for quantised rows, their codes as f32. A reader with kPerRow has each row's values as
// code * scale(row) + offset(row) (int8's scale; int4's scale and minimum, its row one group),
// applied once a row's product is summed (a score) or to the row's weight (a value); one with
// kHead has them times `head` (fp8's scale of the KV head), applied to the scores and the
// output. Both give platform/kv_rows.h's values up to f32 rounding.
template <int NV>
struct F32Row {
  static constexpr bool kPerRow = false, kHead = false;
  int64_t last;  // lanes of the last vector
  float head = 1;
  Vec operator()(const float* row, int h) const {
    return h < NV - 1 || last == kLanes ? vload(row + h * kLanes)
                                        : vload_lanes(row + h * kLanes, 0, last);
  }
  static float scale(const float*) { return 1; }
  static float offset(const float*) { return 0; }
};

#if defined(__AVX512F__)
// The conversions are the zero-masking forms under a full mask: GCC 12 warns of an
// uninitialised value inside the plain ones (as dot_simd.h's bf16_low says).
constexpr __mmask16 kAll = 0xFFFF;
inline Vec widen_i8(const uint8_t* p) {
  return _mm512_maskz_cvtepi32_ps(
      kAll, _mm512_maskz_cvtepi8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m128i load_lane_bytes(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
// kLanes bytes at p, a word each.
inline Words widen_bytes(const uint8_t* p) {
  return _mm512_maskz_cvtepu8_epi32(kAll, load_lane_bytes(p));
}
// The nibble at bit `shift` (0 or 4) of each word, as f32.
inline Vec nibble_values(Words w, int shift) {
  return _mm512_maskz_cvtepi32_ps(
      kAll, _mm512_and_si512(_mm512_maskz_srl_epi32(kAll, w, _mm_cvtsi32_si128(shift)),
                             _mm512_set1_epi32(0xF)));
}
// kLanes / 2 bytes' low nibbles, then their high ones, as f32.
inline Vec both_nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m512i w =
      _mm512_maskz_srlv_epi32(kAll, _mm512_maskz_cvtepu8_epi32(kAll, _mm_unpacklo_epi64(b, b)),
                              _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4));
  return _mm512_maskz_cvtepi32_ps(kAll, _mm512_and_si512(w, _mm512_set1_epi32(0xF)));
}
// E4M3 bytes' exact values: sign, exponent and mantissa moved into an f32's places (2^-120
// times the value), scaled back.
inline Vec fp8_values(const uint8_t* p) {
  const __m512i w = _mm512_maskz_cvtepu8_epi32(kAll, load_lane_bytes(p));
  const __m512i bits = _mm512_or_si512(
      _mm512_maskz_slli_epi32(kAll, _mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24),
      _mm512_maskz_slli_epi32(kAll, _mm512_and_si512(w, _mm512_set1_epi32(0x7F)), 20));
  return vmul(_mm512_castsi512_ps(bits), vbroadcast(0x1p120f));
}
#else
inline __m128i load_lane_bytes(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline Vec widen_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_lane_bytes(p)));
}
inline Words widen_bytes(const uint8_t* p) { return _mm256_cvtepu8_epi32(load_lane_bytes(p)); }
inline Vec nibble_values(Words w, int shift) {
  return _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(0xF)));
}
inline Vec both_nibbles(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const __m128i b = _mm_cvtsi32_si128(four);
  const __m256i w = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi32(b, b)),
                                      _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xF)));
}
inline Vec fp8_values(const uint8_t* p) {
  const __m256i w = _mm256_cvtepu8_epi32(load_lane_bytes(p));
  const __m256i bits =
      _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24),
                      _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7F)), 20));
  return vmul(_mm256_castsi256_ps(bits), vbroadcast(0x1p120f));
}
#endif

// Where each vector of an int4 row's codes lies (platform/kv_rows.h: in a group of G, byte i holds
// channel i and i + G / 2): vector h is the low (shift 0) or high (4) nibbles of the kLanes
// bytes at byte[h], which vector shared[h] (or none, -1) read before it, or, where a vector is
// a whole group (`both`), the kLanes / 2 bytes' low nibbles then their high ones. Worked out
// once a call, not per row. readable(G): every vector lies in one half of a group, or is one
// whole group.
struct Int4Layout {
  int64_t byte[kAttendMaxVectors];
  int shift[kAttendMaxVectors];
  int shared[kAttendMaxVectors];
  bool both;
  Int4Layout(int64_t HS, int64_t G) : both(kLanes == G) {
    const int64_t half = G / 2;
    for (int64_t h = 0; h < HS / kLanes; ++h) {
      const int64_t c = h * kLanes, l = c % G;
      byte[h] = c / G * half + (both ? 0 : l % half);
      shift[h] = both ? 0 : static_cast<int>(l / half * 4);
      shared[h] = -1;
      for (int64_t e = 0; e < h && !both; ++e)
        if (byte[e] == byte[h]) shared[h] = static_cast<int>(e);
    }
  }
  static bool readable(int64_t G) { return kLanes == G || (G / 2) % kLanes == 0; }
  // Every vector's codes of a row, each byte widened once for both its nibbles.
  template <int NV>
  void codes(const uint8_t* codes, Vec (&x)[NV]) const {
    Words w[NV]{};  // (zeroed for the compiler: each is written before it is read)
    for (int h = 0; h < NV; ++h) {
      if (both) {
        x[h] = both_nibbles(codes + byte[h]);
        continue;
      }
      w[h] = shared[h] >= 0 ? w[shared[h]] : widen_bytes(codes + byte[h]);
      x[h] = nibble_values(w[h], shift[h]);
    }
  }
};

// Every vector of a row: reader.read(row, x) where the reader reads a row at once, else
// reader(row, h) a vector at a time.
template <int NV, class Reader, class E>
inline void read_row(const Reader& reader, const E* row, Vec (&x)[NV]) {
  if constexpr (requires { reader.read(row, x); })
    reader.read(row, x);
  else
    for (int h = 0; h < NV; ++h) x[h] = reader(row, h);
}

struct Int8Row {
  static constexpr bool kPerRow = true, kHead = false;
  float head = 1;
  Vec operator()(const uint8_t* row, int h) const { return widen_i8(row + 4 + h * kLanes); }
  static float scale(const uint8_t* row) { return int8_row_scale(row); }
  static float offset(const uint8_t*) { return 0; }
};

// An int4 row of one group.
struct Int4Row {
  static constexpr bool kPerRow = true, kHead = false;
  Int4Layout layout;
  float head = 1;
  template <int NV>
  void read(const uint8_t* row, Vec (&x)[NV]) const {
    layout.codes(row + 4, x);
  }
  static float scale(const uint8_t* row) { return int4_scale(row, 0); }
  static float offset(const uint8_t* row) { return int4_min(row, 0); }
};

// An int4 row of several groups: each vector dequantised with its group's scale and minimum.
struct Int4GroupsRow {
  static constexpr bool kPerRow = false, kHead = false;
  Int4Layout layout;
  int64_t groups;
  int64_t group_of[kAttendMaxVectors];  // vector h's group
  float head = 1;
  Int4GroupsRow(int64_t HS, int64_t G) : layout(HS, G), groups(HS / G) {
    for (int64_t h = 0; h < HS / kLanes; ++h) group_of[h] = h * kLanes / G;
  }
  template <int NV>
  void read(const uint8_t* row, Vec (&x)[NV]) const {
    layout.codes(row + 4 * groups, x);
    for (int h = 0; h < NV; ++h)
      x[h] = vfmadd(x[h], vbroadcast(int4_scale(row, group_of[h])),
                    vbroadcast(int4_min(row, group_of[h])));
  }
  static float scale(const uint8_t*) { return 1; }
  static float offset(const uint8_t*) { return 0; }
};

struct Fp8Row {
  static constexpr bool kPerRow = false, kHead = true;
  float head;  // the KV head's scale
  Vec operator()(const uint8_t* row, int h) const { return fp8_values(row + h * kLanes); }
  static float scale(const uint8_t*) { return 1; }
  static float offset(const uint8_t*) { return 0; }
};

// attend_one_query with rows of NV vectors (the last one's first `last` lanes), key and value
// row j at k(j) and v(j), read by kread and vread. Scores 8 keys
// at a time: each key's product with q in its own accumulator (the first vector multiplied,
// the rest fused in), the 8 reduced by one lane tree, scaled and stored under a mask, in the
// order of dot_block's one-row product. Then the softmax, and the values weighted by the
// unnormalised probabilities in one pass over their rows (U interleaved accumulators: one
// chain of dependent FMAs would leave the FMA units idle), divided by the sum at the end.
// The general products (two calls into gemm and a normalising pass) took a decode step's
// attention much longer (docs/bench-log/code-figures.md).
template <int NV, class Rows, class Reader>
void attend_rows(float* out, const float* q, const Rows& k, const Rows& v, const Reader& kread,
                 const Reader& vread, int64_t n, int64_t last, float scale, float* p) {
  const F32Row<NV> qload{last};
  Vec qv[NV];
  for (int h = 0; h < NV; ++h) qv[h] = qload(q, h);
  // A row's offset adds offset * sum(q) to its score (rows of kPerRow readers are whole
  // vectors).
  float qsum = 0;
  if constexpr (Reader::kPerRow)
    for (int64_t i = 0; i < NV * kLanes; ++i) qsum += q[i];
  const Vec vscale = vbroadcast(Reader::kHead ? scale * kread.head : scale);
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
    alignas(64) float row_scale[kLanes] = {}, row_offset[kLanes] = {};
    for (int64_t i = 0; i < kRows; ++i) {
      const int64_t r = std::min(i, m - 1);  // past the last key: it again
      const auto* kr = k_runs ? k0 + r * k.stride() : k(j + r);
      Vec x[NV];
      read_row(kread, kr, x);
      acc[i] = vmul(x[0], qv[0]);
      for (int h = 1; h < NV; ++h) acc[i] = vfmadd(x[h], qv[h], acc[i]);
      if constexpr (Reader::kPerRow) {
        row_scale[i] = Reader::scale(kr);
        row_offset[i] = Reader::offset(kr) * qsum;
      }
    }
    Vec dots = sum_lanes8(acc);
    if constexpr (Reader::kPerRow) dots = vfmadd(dots, vload(row_scale), vload(row_offset));
    vstore_lanes(p + j, vmul(vscale, dots), 0, m);
  }
  const float inv = static_cast<float>(1.0 / exp_shift_inplace(p, n, row_max(p, n)));
  constexpr int U = std::max(1, 8 / NV);
  Vec sum[U][NV];
  for (auto& row : sum)
    for (auto& x : row) x = vzero();
  float offsets = 0;  // sum of p_j offset_j: every channel's share of the rows' offsets
  auto add = [&](int u, int64_t j, const auto* vr) {
    float w = p[j];
    if constexpr (Reader::kPerRow) {
      offsets += w * Reader::offset(vr);
      w *= Reader::scale(vr);
    }
    const Vec pj = vbroadcast(w);
    Vec x[NV];
    read_row(vread, vr, x);
    for (int h = 0; h < NV; ++h) sum[u][h] = vfmadd(pj, x[h], sum[u][h]);
  };
  int64_t j = 0;
  for (; j + U <= n; j += U) {
    const auto* v0 = v(j);  // U <= 8 rows from a multiple of U: one run when v_runs
    if (run_bytes > 0 && (j & (v.run() - 1)) == 0 && j + v.run() < n) prefetch_run(v(j + v.run()));
    for (int u = 0; u < U; ++u) add(u, j + u, v_runs ? v0 + u * v.stride() : v(j + u));
  }
  for (; j < n; ++j) add(0, j, v(j));
  const float factor = Reader::kHead ? inv * vread.head : inv;
  for (int h = 0; h < NV; ++h) {
    for (int u = 1; u < U; ++u) sum[0][h] = vadd(sum[0][h], sum[u][h]);
    if constexpr (Reader::kPerRow) sum[0][h] = vadd(sum[0][h], vbroadcast(offsets));
    vstore_lanes(out + h * kLanes, vmul(vbroadcast(factor), sum[0][h]), 0,
                 h < NV - 1 ? kLanes : last);
  }
}

template <class Rows>
bool attend_with(float* out, const float* q, const Rows& k, const Rows& v, int64_t n, int64_t HS,
                 float scale, float* p) {
  const int64_t vectors = (HS + kLanes - 1) / kLanes;
  if (vectors > kAttendMaxVectors) return false;
  with_rows<kAttendMaxVectors>(vectors, [&](auto nv) {
    const int64_t last = HS - (nv() - 1) * kLanes;
    const F32Row<nv()> read{last};
    attend_rows<nv()>(out, q, k, v, read, read, n, last, scale, p);
  });
  return true;
}

template <class Rows>
bool attend_quant_with(float* out, const float* q, const Rows& k, const Rows& v, int64_t n,
                       int64_t HS, float scale, float* p, const KVQuant& fmt) {
  const int64_t vectors = HS / kLanes, group = kv_int4_group(HS);
  if (HS % kLanes != 0 || vectors > kAttendMaxVectors ||
      (fmt.dtype == DType::INT4 && !Int4Layout::readable(group)))
    return false;
  with_rows<kAttendMaxVectors>(vectors, [&](auto nv) {
    auto run = [&](const auto& kread, const auto& vread) {
      attend_rows<nv()>(out, q, k, v, kread, vread, n, kLanes, scale, p);
    };
    if (fmt.dtype == DType::INT8)
      run(Int8Row{}, Int8Row{});
    else if (fmt.dtype == DType::FP8)
      run(Fp8Row{fmt.k_scale}, Fp8Row{fmt.v_scale});
    else if (group == HS)
      run(Int4Row{Int4Layout(HS, group)}, Int4Row{Int4Layout(HS, group)});
    else
      run(Int4GroupsRow(HS, group), Int4GroupsRow(HS, group));
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
