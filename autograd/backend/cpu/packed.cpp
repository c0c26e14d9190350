// The packed-weight format of the decode products (cpu/decode_kernels.h): packing, and the
// products of a few rows against it, over dot_simd.h's dot_block.
#include <algorithm>

#include "autograd/backend/cpu/bf16.h"
#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/cpu/dot_simd.h"
#include "platform/error.h"

namespace kvlab::cpu {

#if defined(KVLAB_ROW_KERNELS)
namespace {

// How far ahead of a row's pair of bf16 chunks to prefetch, in bytes (0: not at all). The bf16
// products do twice the arithmetic of the f32 ones per line read, and on Intel's Emerald Rapids
// the hardware prefetchers then keep too few lines in flight, and fetching 2 KB ahead made
// batch-1 decode with bf16 matrices faster. On AMD's EPYC, prefetching weights in software
// slowed decode, so other CPUs are left to their hardware (docs/bench-log/code-figures.md).
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

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

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

}  // namespace kvlab::cpu
