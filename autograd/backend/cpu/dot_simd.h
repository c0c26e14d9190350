#pragma once
// The vector primitives and the one dot-product loop the CPU backend's row kernels share:
// gemm's products of a few rows (gemm.cpp), the products against packed weights (packed.cpp)
// and the decode attention's row kernel (attend_row.cpp). Only those files include it.
//
// Everything here sits in an unnamed namespace, as it did when one file held all of it: each
// includer gets its own internal copies, which the compiler inlines and lays out as before
// (the same code, the same speed), and nothing of it is visible to the link.
#include <algorithm>
#include <cstdint>
#include <type_traits>

// The row kernels (gemm's few-row products, the packed products and the attention row) are
// written once over a few vector primitives, for AVX-512 or for AVX2 with FMA, whichever the
// build targets (-march=native by default); without either, products go to the BLAS, nothing
// is packed and attention takes the general products.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVLAB_ROW_KERNELS 1
#include <immintrin.h>
#endif

namespace kvlab::cpu {

namespace {

#if defined(KVLAB_ROW_KERNELS)
#if defined(__AVX512F__)
using Vec = __m512;     // 16 f32 lanes
using Words = __m512i;  // 16 32-bit words
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vbroadcast(float x) { return _mm512_set1_ps(x); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm512_store_ps(p, v); }
// The lanes [lo, hi) of a vector as a mask (0 <= lo < hi <= kLanes).
inline __mmask16 lane_mask(int64_t lo, int64_t hi) {
  return static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
}
// Lanes [lo, hi) of p, the rest zero: nothing else is read.
inline Vec vload_lanes(const float* p, int64_t lo, int64_t hi) {
  return _mm512_maskz_loadu_ps(lane_mask(lo, hi), p);
}
// Lanes [lo, hi) of v to the same lanes at p; nothing else is written.
inline void vstore_lanes(float* p, Vec v, int64_t lo, int64_t hi) {
  _mm512_mask_storeu_ps(p, lane_mask(lo, hi), v);
}
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Words wload(const uint32_t* p) { return _mm512_loadu_si512(p); }
// The f32 value of each word's low or high bf16 half: a shift or a mask (bf16 is the top half
// of an f32), exact. (The shift is the zero-masking form under a full mask: GCC 12 warns of an
// uninitialised value inside the plain one.)
inline Vec bf16_low(Words w) { return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16)); }
inline Vec bf16_high(Words w) {
  return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536)));
}
// The f32 values of the 16 int8 lanes of `bytes` (h: which vector of a chunk, only 0 here).
// (Zero-masking forms under a full mask, as bf16_low: GCC 12 warns inside the plain ones.)
inline Vec i8_to_f32(__m128i bytes, int64_t) {
  return _mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepi8_epi32(0xffff, bytes));
}

// Lane i < 8 of the result is the sum of the 16 lanes of v[i]: a tree of two-source permutes and
// adds that halves the lanes per row at each level, one pass for eight rows instead of eight
// separate horizontal sums.
Vec sum_lanes8(const Vec v[8]) {
  // Sum of the lanes idx and idx + step of the pair (a, b) (indices >= 16 select from b).
  auto level = [](__m512 a, __m512 b, __m512i idx, int step) {
    return _mm512_add_ps(
        _mm512_permutex2var_ps(a, idx, b),
        _mm512_permutex2var_ps(a, _mm512_add_epi32(idx, _mm512_set1_epi32(step)), b));
  };
  // 16 -> 8 lanes a row: two rows a vector.
  const __m512i l1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512 r01 = level(v[0], v[1], l1, 8), r23 = level(v[2], v[3], l1, 8);
  const __m512 r45 = level(v[4], v[5], l1, 8), r67 = level(v[6], v[7], l1, 8);
  // 8 -> 4: four rows a vector.
  const __m512i l2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512 r0123 = level(r01, r23, l2, 4), r4567 = level(r45, r67, l2, 4);
  // 4 -> 2: eight rows, two lanes each.
  const __m512i l3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512 pairs = level(r0123, r4567, l3, 2);
  // 2 -> 1: row i in lane i.
  const __m512i l4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return level(pairs, pairs, l4, 1);
}
#else
using Vec = __m256;     // 8 f32 lanes
using Words = __m256i;  // 8 32-bit words
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vbroadcast(float x) { return _mm256_set1_ps(x); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm256_store_ps(p, v); }
// The lanes [lo, hi) of a vector as a mask (0 <= lo < hi <= kLanes).
inline __m256i lane_mask(int64_t lo, int64_t hi) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(hi)), lane),
                          _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(lo) - 1)));
}
inline Vec vload_lanes(const float* p, int64_t lo, int64_t hi) {
  return _mm256_maskload_ps(p, lane_mask(lo, hi));
}
inline void vstore_lanes(float* p, Vec v, int64_t lo, int64_t hi) {
  _mm256_maskstore_ps(p, lane_mask(lo, hi), v);
}
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Words wload(const uint32_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// The f32 value of each word's low or high bf16 half (bf16 is the top half of an f32), exact.
inline Vec bf16_low(Words w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline Vec bf16_high(Words w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
}
// The f32 values of the int8 lanes [8 h, 8 h + 8) of `bytes` (h: which vector of a chunk).
inline Vec i8_to_f32(__m128i bytes, int64_t h) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h == 0 ? bytes : _mm_srli_si128(bytes, 8)));
}

// Lane i of the result is the sum of the 8 lanes of v[i]: horizontal adds pair the rows up
// within each 128-bit half (rows 0-3 from v[0..3], rows 4-7 from v[4..7]), then the halves
// are added.
Vec sum_lanes8(const Vec v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

constexpr int64_t kRows = 8, kCols = 16;  // a block of w: 8 rows, in chunks of 16 columns

// The packed q8_0 (kNibbles false) and q4_0 forms' unit of 8 rows x 32 columns (packed.cpp's
// QuantPairs, read by gemm_packed and gemm_packed_int8): the rows' scales as f32, then each
// row's codes.
template <bool kNibbles>
struct QuantUnit {
  static constexpr int64_t kScaleBytes = kRows * 4, kRowBytes = kNibbles ? 16 : 32;
  static constexpr int64_t kBytes = kScaleBytes + kRows * kRowBytes;
};
constexpr int64_t kParts = kCols / kLanes;  // vectors a chunk

// 16 columns of one row, as kParts vectors.
struct Chunk {
  Vec v[kParts];
};
[[gnu::always_inline]] inline Chunk load_chunk(const float* p) {
  Chunk c;
  for (int64_t h = 0; h < kParts; ++h) c.v[h] = vload(p + h * kLanes);
  return c;
}
// The first n <= kCols columns at p, the rest zero: nothing past them is read.
[[gnu::always_inline]] inline Chunk load_chunk_first(const float* p, int64_t n) {
  Chunk c;
  for (int64_t h = 0; h < kParts; ++h) {
    const int64_t m = n - h * kLanes;  // of this vector's lanes
    c.v[h] = m >= kLanes ? vload(p + h * kLanes)
             : m > 0     ? vload_lanes(p + h * kLanes, 0, m)
                         : vzero();
  }
  return c;
}

// Row i's chunks c and c + 1 of a block of 8 rows, as dot_block reads them together.
struct ChunkPair {
  Chunk even, odd;
};

// Where dot_block reads the weights: row i's chunk c (16 columns) of a block of 8 rows, of
// which the first n are there (a short last chunk), and (pair) a row's whole chunks c and
// c + 1 for an even c. F32Rows here; packed.cpp's forms (Bf16Pairs, QuantPairs) alike.
// F32Rows: at w + i * row_step + c * chunk_step (row-major w has (ldw, 16), the packed form
// (16, 128)); a short chunk loads under a mask.
struct F32Rows {
  const float* w;
  int64_t row_step, chunk_step;
  template <bool kOdd>
  [[gnu::always_inline]] Chunk load(int64_t i, int64_t c, int64_t n) const {
    const float* p = w + i * row_step + c * chunk_step;
    return n < kCols ? load_chunk_first(p, n) : load_chunk(p);
  }
  [[gnu::always_inline]] ChunkPair pair(int64_t i, int64_t c) const {
    const float* p = w + i * row_step + c * chunk_step;
    return {load_chunk(p), load_chunk(p + chunk_step)};
  }
};

// Rows [i0, i1) of one block of 8 rows of w: y[r, i] = alpha * dot(w[i, :], a[r, :]) +
// beta * y[r, i] for r < R (y at stride ldy, a at stride lda), w read through `src` (F32Rows
// or Bf16Pairs). Rows at or past `rows` are neither read nor written (kAllRows: all 8 are
// there). The eight rows stream at once, each into its own accumulator vector per row of a
// (a chunk's vectors in turn), reduced by one lane tree; the last K % 16 columns of a load
// under a mask. This is the one dot product of gemm<float> at a few rows and of the packed
// products, in one order whatever the weights' form, so they give the same bits on the same
// values. Always inlined: as a call per block it cost decode ~10%, where attention's q k^T has
// K = HS = 32.
template <int R, bool kAllRows, class Src>
[[gnu::always_inline]] inline void dot_block(float* y, int64_t ldy, const float* a, int64_t lda,
                                             const Src& src, int64_t rows, int64_t K, int64_t i0,
                                             int64_t i1, float alpha, float beta) {
  Vec acc[R][kRows];
  for (auto& row : acc)
    for (auto& v : row) v = vzero();
  // acc[r][i] += w chunk . a chunk, vector by vector.
  auto fma = [&](int r, int i, const Chunk& w, const Chunk& x) {
    for (int64_t h = 0; h < kParts; ++h) acc[r][i] = vfmadd(w.v[h], x.v[h], acc[r][i]);
  };
  // Chunk c of every row, of which the first n columns are there; odd is a bool_constant.
  auto chunk = [&](int64_t c, auto odd, int64_t n) {
    Chunk x[R];
    for (int r = 0; r < R; ++r) x[r] = load_chunk_first(a + r * lda + c * kCols, n);
    for (int i = 0; i < kRows && (kAllRows || i < rows); ++i) {
      const Chunk wv = src.template load<odd()>(i, c, n);
      for (int r = 0; r < R; ++r) fma(r, i, wv, x[r]);
    }
  };
  // Whole chunks c (even) and c + 1: each accumulator takes chunk c's product, then chunk
  // c + 1's, as two chunk() calls would, but a row's two chunks are read together: in bf16
  // one load instead of two.
  auto pair = [&](int64_t c) {
    Chunk x0[R], x1[R];
    for (int r = 0; r < R; ++r) {
      x0[r] = load_chunk(a + r * lda + c * kCols);
      x1[r] = load_chunk(a + r * lda + (c + 1) * kCols);
    }
    for (int i = 0; i < kRows && (kAllRows || i < rows); ++i) {
      const ChunkPair wv = src.pair(i, c);
      for (int r = 0; r < R; ++r) fma(r, i, wv.even, x0[r]);
      for (int r = 0; r < R; ++r) fma(r, i, wv.odd, x1[r]);
    }
  };
  const std::false_type even;
  const std::true_type odd;
  const int64_t full = K / kCols, tail = K % kCols;
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) pair(c);
  if (c < full) {
    chunk(c, even, kCols);
    if (tail != 0) chunk(c + 1, odd, tail);
  } else if (tail != 0) {
    chunk(c, even, tail);
  }
  // A block's results in one masked vector store (lanes [i0, i1) of the 8): going through
  // memory, one result at a time or in a vector loop, slowed attention's q k^T (K = HS = 32,
  // two FMAs an accumulator) down to half its speed (docs/bench-log/code-figures.md).
  const Vec va = vbroadcast(alpha), vb = vbroadcast(beta);
  for (int r = 0; r < R; ++r) {
    const Vec dot = vmul(va, sum_lanes8(acc[r]));
    float* yr = y + r * ldy;
    vstore_lanes(yr, beta == 0.0f ? dot : vfmadd(vb, vload_lanes(yr, i0, i1), dot), i0, i1);
  }
}

// f(std::integral_constant<int, min(n, kMax)>()) for n >= 1: a tile's rows of a as a
// compile-time count, so that its accumulators can stay in registers.
template <int64_t kMax, class F>
void with_rows(int64_t n, F&& f) {
  if constexpr (kMax > 1)
    if (n < kMax) return with_rows<kMax - 1>(n, f);
  f(std::integral_constant<int, static_cast<int>(kMax)>());
}

// Rows of a that share one pass over a block of w: 8 accumulators each, plus their 16
// columns of a and one of w, within AVX-512's 32 vector registers; AVX2 has 16, which one
// row's 8 accumulators and two chunks of 2 vectors already fill.
constexpr int64_t kTileRows = kParts == 1 ? 3 : 1;

// y[m, n] = alpha * dot(w[n, :], a[m, :]) + beta * y[m, n] for m < M and n in [n0, n1), w
// block by block: `block_src(nb)` is the dot_block source of rows 8 nb .. 8 nb + 7, of which
// those below n_w are there (a packed form pads its last block; a row-major w ends with its
// last row). A block is read once from memory and again from L1/L2 for each further tile of
// kTileRows rows of a. The products against packed weights and those of a few rows of a with
// a row-major w^T (gemm<float>) are this one loop.
template <class BlockSrc>
void row_blocks(float* y, int64_t ldy, const float* a, int64_t lda, BlockSrc block_src, int64_t M,
                int64_t K, int64_t n0, int64_t n1, int64_t n_w, float alpha, float beta) {
  for (int64_t nb = n0 / kRows; nb * kRows < n1; ++nb) {
    const auto src = block_src(nb);
    const int64_t rows = std::min(kRows, n_w - nb * kRows);
    // This block's rows of [n0, n1), relative to its first.
    const int64_t i0 = std::max(n0, nb * kRows) - nb * kRows;
    const int64_t i1 = std::min(n1, (nb + 1) * kRows) - nb * kRows;
    float* yb = y + nb * kRows;
    // One row of a (batch-1 decode) calls dot_block straight, not through the tile's lambda,
    // which GCC leaves out of line: a call a block costs a one-row q k^T a sixth of its time.
    if (M == 1) {
      if (rows == kRows)
        dot_block<1, true>(yb, ldy, a, lda, src, rows, K, i0, i1, alpha, beta);
      else
        dot_block<1, false>(yb, ldy, a, lda, src, rows, K, i0, i1, alpha, beta);
      continue;
    }
    for (int64_t m = 0; m < M; m += kTileRows) {
      auto tile = [&](auto rows_of_a) {  // an integral_constant: the tile's rows of a
        if (rows == kRows)  // with a fixed row count the accumulators stay in registers
          dot_block<rows_of_a(), true>(yb + m * ldy, ldy, a + m * lda, lda, src, rows, K, i0, i1,
                                       alpha, beta);
        else
          dot_block<rows_of_a(), false>(yb + m * ldy, ldy, a + m * lda, lda, src, rows, K, i0, i1,
                                        alpha, beta);
      };
      with_rows<kTileRows>(M - m, tile);
    }
  }
}
#endif

}  // namespace

}  // namespace kvlab::cpu
