// The packed-weight forms of the decode products (cpu/decode_kernels.h): packing, and the
// products of a few rows against them, over dot_simd.h's dot_block.
#include <algorithm>
#include <cstring>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/cpu/dot_simd.h"
#include "platform/error.h"
#include "platform/ggml_blocks.h"
#include "platform/scalar_codecs.h"

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

// QuantPairs: pack_weight's q8_0 (kNibbles false) or q4_0 form. A block of 8 rows is K / 32
// units of `unit` bytes, unit p holding columns 32 p .. 32 p + 31: the 8 rows' scales as f32,
// then each row's codes, 32 int8 (q8_0) or 16 bytes of nibbles (q4_0: byte j's low nibble is
// column j, its high one column j + 16, each code 8 above its value). A row's chunks 2p and
// 2p + 1 are its block p, widened exactly: code * scale has at most 19 significant bits.
template <bool kNibbles>
struct QuantPairs {
  static constexpr int64_t kScaleBytes = QuantUnit<kNibbles>::kScaleBytes;
  static constexpr int64_t kRowBytes = QuantUnit<kNibbles>::kRowBytes;
  static constexpr int64_t kUnit = QuantUnit<kNibbles>::kBytes;
  const char* w;
  template <bool kOdd>
  [[gnu::always_inline]] Chunk load(int64_t i, int64_t c, int64_t) const {
    const ChunkPair p = pair(i, c & ~int64_t{1});  // K is whole blocks: never a short chunk
    return kOdd ? p.odd : p.even;
  }
  [[gnu::always_inline]] ChunkPair pair(int64_t i, int64_t c) const {
    const char* u = w + (c >> 1) * kUnit;
    float scale;
    std::memcpy(&scale, u + i * 4, 4);
    const Vec d = vbroadcast(scale);
    const auto* codes = reinterpret_cast<const __m128i*>(u + kScaleBytes + i * kRowBytes);
#if defined(__AVX512F__)
    if constexpr (kNibbles) {
      // The 16 values a code can stand for, (code - 8) * scale (exact), looked up by each
      // lane's code: vpermps reads only an index's low 4 bits, so a byte widened whole (its
      // other nibble above them) indexes by its low nibble. Cheaper than widening and
      // converting each code.
      const Vec table =
          vmul(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), d);
      const __m128i b = _mm_loadu_si128(codes);
      auto look_up = [&](__m128i bytes) {  // (zero-masking forms: as bf16_low)
        return _mm512_maskz_permutexvar_ps(0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, bytes), table);
      };
      ChunkPair out;
      out.even.v[0] = look_up(b);
      out.odd.v[0] = look_up(_mm_srli_epi16(b, 4));
      return out;
    }
#endif
    __m128i even, odd;  // the two chunks' values as int8
    if constexpr (kNibbles) {
      const __m128i b = _mm_loadu_si128(codes), low = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
      even = _mm_sub_epi8(_mm_and_si128(b, low), eight);
      odd = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), eight);
    } else {
      even = _mm_loadu_si128(codes);
      odd = _mm_loadu_si128(codes + 1);
    }
    ChunkPair out;
    for (int64_t h = 0; h < kParts; ++h) {
      out.even.v[h] = vmul(i8_to_f32(even, h), d);
      out.odd.v[h] = vmul(i8_to_f32(odd, h), d);
    }
    return out;
  }
};

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Bytes of a q8_0 or q4_0 block of 8 rows.
template <bool kNibbles>
int64_t quant_block_bytes(int64_t K) {
  return K / kGgmlBlock * QuantPairs<kNibbles>::kUnit;
}

// The f32 form: packed (ceil(N / 8), ceil(K / 16), 8, 16): block nb, chunk c, row i, column j
// holds w[8 nb + i, 16 c + j].
void pack_f32(float* packed, const float* w, int64_t N, int64_t K) {
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

// The bf16 form: packed (ceil(N / 8), ceil(K / 32), 8, 16, 2): block nb, pair p, row i, word j
// holds w[8 nb + i, 32 p + j] then w[8 nb + i, 32 p + 16 + j] (the low half of the
// little-endian word first), rounded to nearest even.
void pack_bf16(uint16_t* packed, const float* w, int64_t N, int64_t K) {
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

// The q8_0 and q4_0 forms (QuantPairs), each block quantised by ggml's quantiser; rows past N
// are zero.
template <bool kNibbles>
void pack_quant(char* packed, const float* w, int64_t N, int64_t K) {
  using Q = QuantPairs<kNibbles>;
  const int64_t blocks = K / kGgmlBlock;
  for (int64_t nb = 0; nb * kRows < N; ++nb)
    for (int64_t p = 0; p < blocks; ++p) {
      char* u = packed + (nb * blocks + p) * Q::kUnit;
      std::fill_n(u, Q::kUnit, char{0});
      for (int64_t i = 0; i < kRows && nb * kRows + i < N; ++i) {
        const float* x = w + (nb * kRows + i) * K + p * kGgmlBlock;
        char* codes = u + Q::kScaleBytes + i * Q::kRowBytes;
        const uint16_t d = kNibbles ? quantise_q4_0(x, reinterpret_cast<uint8_t*>(codes))
                                    : quantise_q8_0(x, reinterpret_cast<int8_t*>(codes));
        const float scale = f16_to_f32(d);
        std::memcpy(u + i * 4, &scale, 4);
      }
    }
}

}  // namespace

int64_t packed_weight_bytes(WeightDtype form, int64_t N, int64_t K) {
  const int64_t blocks_of_rows = round_up(N, kRows) / kRows;
  switch (form) {
    case WeightDtype::F32: return round_up(N, kRows) * round_up(K, kCols) * 4;
    case WeightDtype::BF16: return round_up(N, kRows) * round_up(K, 2 * kCols) * 2;
    case WeightDtype::Q8_0:
      return K % kGgmlBlock == 0 ? blocks_of_rows * quant_block_bytes<false>(K) : 0;
    case WeightDtype::Q4_0:
      return K % kGgmlBlock == 0 ? blocks_of_rows * quant_block_bytes<true>(K) : 0;
  }
  return 0;
}

void pack_weight(WeightDtype form, void* packed, const float* w, int64_t N, int64_t K) {
  KVLAB_ASSERT(packed_weight_bytes(form, N, K) > 0, "pack_weight: the ", weight_dtype_name(form),
               " form cannot hold a (", N, ", ", K, ") weight");
  switch (form) {
    case WeightDtype::F32: return pack_f32(static_cast<float*>(packed), w, N, K);
    case WeightDtype::BF16: return pack_bf16(static_cast<uint16_t*>(packed), w, N, K);
    case WeightDtype::Q8_0: return pack_quant<false>(static_cast<char*>(packed), w, N, K);
    case WeightDtype::Q4_0: return pack_quant<true>(static_cast<char*>(packed), w, N, K);
  }
}

void gemm_packed(WeightDtype form, float* y, int64_t ldy, const float* a, int64_t lda,
                 const void* packed, int64_t M, int64_t K, int64_t n0, int64_t n1, float beta) {
  // Each form's source of the 8-row block nb, through the one loop.
  auto run = [&](auto block_src) {
    row_blocks(y, ldy, a, lda, block_src, M, K, n0, n1, round_up(n1, kRows), 1.0f, beta);
  };
  switch (form) {
    case WeightDtype::F32: {
      const int64_t block = round_up(K, kCols) * kRows;
      const auto* w = static_cast<const float*>(packed);
      return run([&](int64_t nb) { return F32Rows{w + nb * block, kCols, kRows * kCols}; });
    }
    case WeightDtype::BF16: {
      const int64_t block = round_up(K, 2 * kCols) * kRows / 2;  // words
      const auto* words = static_cast<const uint32_t*>(packed);
      return run([&](int64_t nb) { return Bf16Pairs{words + nb * block, bf16_prefetch_bytes}; });
    }
    case WeightDtype::Q8_0: {
      const auto* w = static_cast<const char*>(packed);
      return run([&](int64_t nb) { return QuantPairs<false>{w + nb * quant_block_bytes<false>(K)}; });
    }
    case WeightDtype::Q4_0: {
      const auto* w = static_cast<const char*>(packed);
      return run([&](int64_t nb) { return QuantPairs<true>{w + nb * quant_block_bytes<true>(K)}; });
    }
  }
}
#else
int64_t packed_weight_bytes(WeightDtype, int64_t, int64_t) { return 0; }
void pack_weight(WeightDtype, void*, const float*, int64_t, int64_t) {
  KVLAB_ASSERT(false, "pack_weight: this build has no packed kernel (packed_weight_bytes is 0)");
}
void gemm_packed(WeightDtype, float*, int64_t, const float*, int64_t, const void*, int64_t, int64_t,
                 int64_t, int64_t, float) {
  KVLAB_ASSERT(false, "gemm_packed: this build has no packed kernel (packed_weight_bytes is 0)");
}
#endif

}  // namespace kvlab::cpu
