#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "autograd/backend/cpu/bf16.h"
#include "autograd/backend/cpu/kernels.h"
#include "autograd/host/parallel.h"
#include "autograd/backend/cpu/vec_math.h"  // attend_rows's softmax
#include "autograd/error.h"

// The row kernels below (the one-row GEMV and the packed products) are written once over a
// few vector primitives, for AVX-512 or for AVX2 with FMA, whichever the build targets
// (-march=native by default); without either, products go to the BLAS and nothing is packed.
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
// c + 1 for an even c.
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
// How far ahead of a row's pair of bf16 chunks to prefetch, in bytes (0: not at all). The bf16
// products do twice the arithmetic of the f32 ones per line read, and on Intel's Emerald Rapids
// the hardware prefetchers then keep too few lines in flight (a core reads its L3 at ~26 GB/s):
// fetching 2 KB ahead made batch-1 decode with bf16 matrices 0.98-1.36x as fast on a 350 MB
// model there (medians +11%) and 1-8% faster on a 10 MB one (docs/benchmarks.md). On AMD's
// EPYC, prefetching weights in software slowed decode (same file), so other CPUs are left to
// their hardware.
const int64_t bf16_prefetch_bytes = [] {
  __builtin_cpu_init();  // this initializer may run before libgcc's
  return __builtin_cpu_is("intel") ? int64_t{2048} : int64_t{0};
}();

// Bf16Pairs: pack_weight's bf16 form. Chunks 2p and 2p + 1 of row i share the 16 words at
// w + (p * 8 + i) * 16, the first in their low halves, the second in their high halves. The
// padding past K is zero, so nothing needs a mask. A prefetch past the end of the form is
// harmless: it never faults.
struct Bf16Pairs {
  const uint32_t* w;
  int64_t prefetch;  // bf16_prefetch_bytes
  template <bool kOdd>
  [[gnu::always_inline]] Chunk load(int64_t i, int64_t c, int64_t) const {
    const uint32_t* p = w + ((c >> 1) * kRows + i) * kCols;
    Chunk out;
    for (int64_t h = 0; h < kParts; ++h) {
      const Words words = wload(p + h * kLanes);
      out.v[h] = kOdd ? bf16_high(words) : bf16_low(words);
    }
    return out;
  }
  [[gnu::always_inline]] ChunkPair pair(int64_t i, int64_t c) const {  // one load for both
    const uint32_t* p = w + ((c >> 1) * kRows + i) * kCols;
    if (prefetch != 0) _mm_prefetch(reinterpret_cast<const char*>(p) + prefetch, _MM_HINT_T0);
    ChunkPair out;
    for (int64_t h = 0; h < kParts; ++h) {
      const Words words = wload(p + h * kLanes);
      out.even.v[h] = bf16_low(words);
      out.odd.v[h] = bf16_high(words);
    }
    return out;
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
  // one load instead of two (2-3% off the products of a decode step).
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
  // memory, one result at a time, made attention's q k^T (K = HS = 32, two FMAs an
  // accumulator) 1.7x as slow, and a vector loop over them still 2x.
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

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

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
    // One row of a (batch-1 decode) calls dot_block straight: through the tile's lambda, a
    // call a block that GCC leaves out of line, attention's one-row q k^T over 144 keys took
    // 0.21 us instead of 0.18.
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

// Rows of A up to which gemm<float> runs the row kernels rather than the BLAS, for a @ w^T
// and for a @ b. Over attention's cached keys and values (144 of them, HS 32) the first took
// 0.39-0.79 us at 2-4 rows against OpenBLAS's sgemm's 0.95-0.99 (8 rows would take two 4-row
// passes, against its 1.34); the second 0.11-0.39 us at 1-8 rows against 0.19-0.94
// (docs/benchmarks.md).
constexpr int64_t kFewRowsWt = 4, kFewRowsB = 8;

// y (M, N) = alpha * a (M, K) @ w^T + beta * y for a few rows of a, w (N, K) row-major at
// stride ldw: the rows of w split across the threads (in blocks of 8). At M = 1 it made
// batch-1 decode 14-23% faster than OpenBLAS's sgemv did (docs/benchmarks.md).
void few_rows_times_wt(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
                       const float* w, int64_t ldw, float beta, float* y, int64_t ldy) {
  // Short rows of w (attention's keys, K = HS <= 64) take one row of a at a time: a block read
  // again from L1 costs less than a tile's registers there (0.39 us against 0.59 for two rows
  // over 144 keys of HS 32, 0.58 against 0.76 at HS 64; at HS 128 the tiles win).
  const int64_t step = K <= 64 ? 1 : M;
  auto rows = [&](int64_t n0, int64_t n1) {
    auto src = [&](int64_t nb) { return F32Rows{w + nb * kRows * ldw, ldw, kCols}; };
    for (int64_t m = 0; m < M; m += step)
      row_blocks(y + m * ldy, ldy, a + m * lda, lda, src, std::min(step, M - m), K, n0, n1, N,
                 alpha, beta);
  };
  parallel_blocks(N, kRows, N * K, rows);
}

// Rows of a a tile of the product with b takes: one chunk of accumulators each, 8 vectors.
constexpr int64_t kAxpyTileRows = 8 / kParts;

// Columns [0, n) (n <= 16) of rows [0, R) of y = alpha * a (R, K) @ b (K, n) + beta * y, b's
// rows read in order, once. Row r's sum over k runs in U interleaved accumulators (k mod U),
// added at the end: one chain of dependent FMAs a row would leave the FMA units idle at a few
// rows (a one-row product ran at a third of OpenBLAS's sgemv speed).
template <int R>
[[gnu::always_inline]] inline void axpy_tile(float* y, int64_t ldy, const float* a, int64_t lda,
                                             const float* b, int64_t ldb, int64_t K, int64_t n,
                                             float alpha, float beta) {
  constexpr int64_t U = std::max<int64_t>(1, 8 / (R * kParts));
  Chunk acc[U][R];
  for (auto& row : acc)
    for (auto& c : row)
      for (auto& v : c.v) v = vzero();
  auto step = [&](int64_t k, int64_t u, auto whole) {  // whole: a bool_constant, n == 16
    const float* bk = b + k * ldb;
    const Chunk w = whole() ? load_chunk(bk) : load_chunk_first(bk, n);
    for (int r = 0; r < R; ++r) {
      const Vec x = vbroadcast(a[r * lda + k]);
      for (int64_t h = 0; h < kParts; ++h) acc[u][r].v[h] = vfmadd(x, w.v[h], acc[u][r].v[h]);
    }
  };
  auto run = [&](auto whole) {
    int64_t k = 0;
    for (; k + U <= K; k += U)
      for (int64_t u = 0; u < U; ++u) step(k + u, u, whole);
    for (; k < K; ++k) step(k, 0, whole);
  };
  if (n == kCols)
    run(std::true_type());
  else
    run(std::false_type());
  for (int r = 0; r < R; ++r) {
    for (int64_t u = 1; u < U; ++u)
      for (int64_t h = 0; h < kParts; ++h) acc[0][r].v[h] = vadd(acc[0][r].v[h], acc[u][r].v[h]);
    alignas(64) float out[kCols];
    for (int64_t h = 0; h < kParts; ++h) vstore(out + h * kLanes, acc[0][r].v[h]);
    float* yr = y + r * ldy;
    for (int64_t j = 0; j < n; ++j)
      yr[j] = beta == 0.0f ? alpha * out[j] : alpha * out[j] + beta * yr[j];
  }
}

// Columns [n0, n1) of y (M, N) = alpha * a (M, K) @ b (K, N) + beta * y, b row-major at
// stride ldb, 16 columns and a tile of rows of a at a time.
void axpy_columns(int64_t M, int64_t K, float alpha, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float beta, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t j = n0; j < n1; j += kCols) {
    const int64_t n = std::min(kCols, n1 - j);
    for (int64_t m = 0; m < M; m += kAxpyTileRows) {
      auto tile = [&](auto rows_of_a) {
        axpy_tile<rows_of_a()>(y + m * ldy + j, ldy, a + m * lda, lda, b + j, ldb, K, n, alpha,
                               beta);
      };
      with_rows<kAxpyTileRows>(M - m, tile);
    }
  }
}

// y (M, N) = alpha * a (M, K) @ b (K, N) + beta * y for a few rows of a (attention's
// probabilities times the cached values): the columns split across the threads (in chunks of
// 16).
void few_rows_times_b(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda,
                      const float* b, int64_t ldb, float beta, float* y, int64_t ldy) {
  parallel_blocks(N, kCols, N * K, [&](int64_t lo, int64_t hi) {
    axpy_columns(M, K, alpha, a, lda, b, ldb, beta, y, ldy, lo, hi);
  });
}

// Vectors of kLanes a row of HS columns takes, up to which attend_one_query_kernel runs the
// row kernel below (HS 128 with AVX-512, 64 with AVX2); longer rows take the general
// attention's products (attend_one_query, attention.cpp).
constexpr int64_t kAttendMaxVectors = 8;

// attend_one_query with rows of NV vectors (the last one's first `last` lanes). Scores 8 keys
// at a time: each key's product with q in its own accumulator (the first vector multiplied,
// the rest fused in), the 8 reduced by one lane tree, scaled and stored under a mask, in the
// order of dot_block's one-row product. Then the softmax, and the values weighted by the
// unnormalised probabilities in one pass over their rows (U interleaved accumulators: one
// chain of dependent FMAs would leave the FMA units idle), divided by the sum at the end.
// Through the general products (two calls into gemm and a normalising pass), one query over
// 144 keys at HS 32 took 0.36 us against 0.21 hot in cache, and a decode step's attention
// 1.3-1.5x as long (docs/benchmarks.md).
template <int NV>
void attend_rows(float* out, const float* q, const float* k, int64_t kst, const float* v,
                 int64_t vst, int64_t n, int64_t last, float scale, float* p) {
  auto load = [&](const float* row, int h) {
    return h < NV - 1 || last == kLanes ? vload(row + h * kLanes)
                                        : vload_lanes(row + h * kLanes, 0, last);
  };
  Vec qv[NV];
  for (int h = 0; h < NV; ++h) qv[h] = load(q, h);
  const Vec vscale = vbroadcast(scale);
  for (int64_t j = 0; j < n; j += kRows) {
    const int64_t m = std::min(kRows, n - j);  // keys in this block
    Vec acc[kRows];
    for (int64_t i = 0; i < kRows; ++i) {
      const float* kr = k + (j + std::min(i, m - 1)) * kst;  // past the last key: it again
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
  auto add = [&](int u, int64_t j) {
    const Vec pj = vbroadcast(p[j]);
    for (int h = 0; h < NV; ++h) sum[u][h] = vfmadd(pj, load(v + j * vst, h), sum[u][h]);
  };
  int64_t j = 0;
  for (; j + U <= n; j += U)
    for (int u = 0; u < U; ++u) add(u, j + u);
  for (; j < n; ++j) add(0, j);
  for (int h = 0; h < NV; ++h) {
    for (int u = 1; u < U; ++u) sum[0][h] = vadd(sum[0][h], sum[u][h]);
    vstore_lanes(out + h * kLanes, vmul(vbroadcast(inv), sum[0][h]), 0, h < NV - 1 ? kLanes : last);
  }
}
#endif

}  // namespace

#if defined(KVLAB_ROW_KERNELS)
bool attend_one_query_kernel(float* out, const float* q, const float* k, int64_t kst,
                             const float* v, int64_t vst, int64_t n, int64_t HS, float scale,
                             float* p) {
  const int64_t vectors = (HS + kLanes - 1) / kLanes;
  if (vectors > kAttendMaxVectors) return false;
  with_rows<kAttendMaxVectors>(vectors, [&](auto nv) {
    attend_rows<nv()>(out, q, k, kst, v, vst, n, HS - (nv() - 1) * kLanes, scale, p);
  });
  return true;
}

int64_t packed_weight_size(int64_t N, int64_t K) { return round_up(N, kRows) * round_up(K, kCols); }
int64_t packed_weight_bf16_size(int64_t N, int64_t K) {
  return round_up(N, kRows) * round_up(K, 2 * kCols);
}

// packed (ceil(N / 8), ceil(K / 16), 8, 16): block nb, chunk c, row i, column j holds
// w[8 nb + i, 16 c + j].
void pack_weight(float* packed, const float* w, int64_t N, int64_t K) {
  const int64_t chunks = round_up(K, kCols) / kCols;
  for (int64_t nb = 0; nb * kRows < N; ++nb)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t i = 0; i < kRows; ++i) {
        float* out = packed + ((nb * chunks + c) * kRows + i) * kCols;
        const int64_t n = nb * kRows + i, k = c * kCols;
        const int64_t cols = n < N ? std::min(kCols, K - k) : 0;
        if (cols > 0) std::copy_n(w + n * K + k, cols, out);
        std::fill(out + cols, out + kCols, 0.0f);
      }
}

// packed (ceil(N / 8), ceil(K / 32), 8, 16, 2): block nb, pair p, row i, word j holds
// w[8 nb + i, 32 p + j] then w[8 nb + i, 32 p + 16 + j] (the low half of the little-endian
// word first), rounded to nearest even.
void pack_weight(uint16_t* packed, const float* w, int64_t N, int64_t K) {
  const int64_t pairs = round_up(K, 2 * kCols) / (2 * kCols);
  for (int64_t nb = 0; nb * kRows < N; ++nb)
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t i = 0; i < kRows; ++i) {
        uint16_t* out = packed + ((nb * pairs + p) * kRows + i) * 2 * kCols;
        const int64_t n = nb * kRows + i;
        auto at = [&](int64_t k) -> uint16_t {
          return n < N && k < K ? f32_to_bf16(w[n * K + k]) : uint16_t{0};
        };
        for (int64_t j = 0; j < kCols; ++j) {
          out[2 * j] = at(2 * kCols * p + j);
          out[2 * j + 1] = at(2 * kCols * p + kCols + j);
        }
      }
}

void gemm_packed(float* y, int64_t ldy, const float* a, int64_t lda, const float* packed, int64_t M,
                 int64_t K, int64_t n0, int64_t n1, float beta) {
  const int64_t block = round_up(K, kCols) * kRows;
  row_blocks(
      y, ldy, a, lda,
      [&](int64_t nb) {
        return F32Rows{packed + nb * block, kCols, kRows * kCols};
      },
      M, K, n0, n1, round_up(n1, kRows), 1.0f, beta);
}

void gemm_packed(float* y, int64_t ldy, const float* a, int64_t lda, const uint16_t* packed,
                 int64_t M, int64_t K, int64_t n0, int64_t n1, float beta) {
  const int64_t block = round_up(K, 2 * kCols) * kRows;  // bf16 values
  const auto* words = reinterpret_cast<const uint32_t*>(packed);
  row_blocks(
      y, ldy, a, lda,
      [&](int64_t nb) {
        return Bf16Pairs{words + nb * block / 2, bf16_prefetch_bytes};
      },
      M, K, n0, n1, round_up(n1, kRows), 1.0f, beta);
}
#else
bool attend_one_query_kernel(float*, const float*, const float*, int64_t, const float*, int64_t,
                             int64_t, int64_t, float, float*) {
  return false;
}
int64_t packed_weight_size(int64_t, int64_t) { return 0; }
int64_t packed_weight_bf16_size(int64_t, int64_t) { return 0; }
void pack_weight(float*, const float*, int64_t, int64_t) {
  KVLAB_ASSERT(false, "pack_weight: this build has no packed kernel (packed_weight_size is 0)");
}
void pack_weight(uint16_t*, const float*, int64_t, int64_t) {
  KVLAB_ASSERT(false, "pack_weight: this build has no packed kernel (packed_weight_size is 0)");
}
void gemm_packed(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                 int64_t, float) {
  KVLAB_ASSERT(false, "gemm_packed: this build has no packed kernel (packed_weight_size is 0)");
}
void gemm_packed(float*, int64_t, const float*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                 int64_t, float) {
  KVLAB_ASSERT(false, "gemm_packed: this build has no packed kernel (packed_weight_size is 0)");
}
#endif

// OpenBLAS (OpenMP build) behind one function: it shares libgomp's pool with our kernels and
// runs single-threaded when called from inside a parallel region. A product with a few rows
// of A goes to our row kernels where AVX-512 or AVX2 is available (decode: a Linear's a @ W^T
// at batch 1, attention's q k^T and p v over the cache), else one row to the BLAS's GEMV,
// which is ~10x faster than its GEMM at M = 1.
template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // the BLAS rejects zero-length GEMV operands: C = beta * C by hand
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
#if defined(KVLAB_ROW_KERNELS)
  if (!ta && tb && M <= kFewRowsWt) {
    few_rows_times_wt(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (!ta && !tb && M <= kFewRowsB) {
    few_rows_times_b(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
#endif
  if (M == 1) {  // c (1, N) = a (1, K) @ op(B): y = op(B)^T a
    // op(B) is (K, N); as a row-major matrix B is (K, N) when !tb, (N, K) when tb.
    cblas_sgemv(CblasRowMajor, tb ? CblasNoTrans : CblasTrans, tb ? N : K, tb ? K : N, alpha, B,
                ldb, A, ta ? lda : 1, beta, C, 1);
    return;
  }
  if (N == 1 && ldc >= 1) {  // c (M, 1) = op(A) (M, K) @ b (K, 1)
    cblas_sgemv(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, ta ? K : M, ta ? M : K, alpha, A,
                lda, B, tb ? 1 : ldb, beta, C, ldc);
    return;
  }
  // OpenBLAS's own threading shares packed panels between its threads and loses 20-50% to
  // their synchronisation at a small model's shapes (768 x 128..512 x 128..512 on two threads:
  // 80-155 GFLOP/s against 145-200 when each thread runs a single-threaded product on its own
  // block of rows, see docs/benchmarks.md). So the pool splits the rows of C (or, for a few
  // rows, its columns) and each thread calls the BLAS on its block, which inside the parallel
  // region runs single-threaded. Every element is still one BLAS dot product in the BLAS's order.
  auto call = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                m1 - m0, n1 - n0, K, alpha, ta ? A + m0 : A + m0 * lda, lda,
                tb ? B + n0 * ldb : B + n0, ldb, beta, C + m0 * ldc + n0, ldc);
  };
  constexpr int64_t kMinBlock = 32;  // rows (or columns) per thread worth a product of its own
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool by_rows = M >= 2 * kMinBlock;
  const int64_t extent = by_rows ? M : N;
  const int64_t parts = std::min<int64_t>(threads, extent / kMinBlock);
  if (parts < 2) {
    call(0, M, 0, N);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static, 1)
  for (int64_t p = 0; p < parts; ++p) {
    // Blocks of a multiple of 16 rows/columns (the kernels' register tile).
    const auto [lo, hi] = split_range(extent, p, parts, 16);
    if (lo >= hi) continue;
    if (by_rows)
      call(lo, hi, 0, N);
    else
      call(0, M, lo, hi);
  }
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                  const double* A, int64_t lda, const double* B, int64_t ldb, double beta,
                  double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M,
              N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Small products in parallel with a single-threaded BLAS each; otherwise one by one with the
// BLAS's threads (no parallel region around it: see for_each_task in attention.cpp).
template <class T>
void gemm_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                  int64_t lda, int64_t sa, const T* B, int64_t ldb, int64_t sb, T beta, T* C,
                  int64_t ldc, int64_t sc, int64_t batch) {
  auto one = [&](int64_t i) {
    gemm<T>(ta, tb, M, N, K, alpha, A + i * sa, lda, B + i * sb, ldb, beta, C + i * sc, ldc);
  };
  if (batch >= omp_get_max_threads()) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; ++i) one(i);
  } else {
    for (int64_t i = 0; i < batch; ++i) one(i);
  }
}

template void gemm_batched<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*,
                                  int64_t, int64_t, const float*, int64_t, int64_t, float,
                                  float*, int64_t, int64_t, int64_t);
template void gemm_batched<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                   int64_t, int64_t, const double*, int64_t, int64_t, double,
                                   double*, int64_t, int64_t, int64_t);

}  // namespace kvlab::cpu
