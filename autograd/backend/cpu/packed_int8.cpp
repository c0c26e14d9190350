// The integer products of packed q8_0 and q4_0 weights (cpu/decode_kernels.h's
// gemm_packed_int8): each row of a rounded to q8_0 blocks as llama.cpp's x86 path rounds it,
// then per block of 32 columns an exact integer dot product of the two blocks' codes, scaled
// by the product of their scales and summed in f32, lane by lane. AVX-512 with VNNI multiplies
// 64 byte pairs an instruction; AVX2 (and AVX-512 without VNNI) pairs bytes into 16-bit sums.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/cpu/dot_simd.h"
#include "platform/error.h"
#include "platform/ggml_blocks.h"

namespace kvlab::cpu {

#if defined(KVLAB_ROW_KERNELS)
namespace {

// Bytes of a unit of 8 rows x 32 columns, and of its scales, which its codes follow.
template <bool kNibbles>
constexpr int64_t kUnit = QuantUnit<kNibbles>::kBytes;
template <bool kNibbles>
constexpr int64_t kScales = QuantUnit<kNibbles>::kScaleBytes;

// A q8_0 row of activations: codes (K) and each block's scale as f32.
struct Q8Row {
  const int8_t* codes;
  const float* scales;
};

// Each thread's rows of a rounded to q8_0 (M rows of K), kept for its next call: null where
// it cannot grow (this runs inside the decode step's parallel region, which must not throw).
Q8Row* rounded_rows(const float* a, int64_t lda, int64_t M, int64_t K) {
  struct Scratch {
    std::unique_ptr<char[]> bytes;
    size_t size = 0;
  };
  thread_local Scratch s;
  const size_t blocks = static_cast<size_t>(M * K / kGgmlBlock);
  const size_t need = static_cast<size_t>(M) * sizeof(Q8Row) + blocks * sizeof(float) +
                      static_cast<size_t>(M * K);
  if (need > s.size) {
    s.bytes.reset(new (std::nothrow) char[need]);
    s.size = s.bytes ? need : 0;
    if (!s.bytes) return nullptr;
  }
  auto* rows = reinterpret_cast<Q8Row*>(s.bytes.get());
  auto* scales = reinterpret_cast<float*>(rows + M);
  auto* codes = reinterpret_cast<int8_t*>(scales + blocks);
  for (int64_t m = 0; m < M; ++m) {
    rows[m] = {codes + m * K, scales + m * K / kGgmlBlock};
    quantise_q8_activations(a + m * lda, K, codes + m * K, scales + m * K / kGgmlBlock);
  }
  return rows;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Row i of an 8-row block in lane i: each accumulator holds `per` rows, 16 / per lanes each.
inline Vec rows_of(const __m512* acc, int per) {
  Vec v[kRows];
  for (int i = 0; i < kRows; ++i) {
    const int lanes = 16 / per, first = (i % per) * lanes;
    v[i] = _mm512_maskz_mov_ps(lane_mask(first, first + lanes), acc[i / per]);
  }
  return sum_lanes8(v);
}

// The 8 dot products of one 8-row block (`blocks` units at w) with one row of activations.
template <bool kNibbles>
Vec block_dots(const char* w, Q8Row x, int64_t blocks) {
  constexpr int per = kNibbles ? 4 : 2;  // rows a 64-byte load holds
  constexpr int kVecs = kRows / per;
  // Which of the block's 8 scales each lane of each accumulator takes: its row's.
  __m512i idx[kVecs];
  for (int j = 0; j < kVecs; ++j) {
    alignas(64) int32_t lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = j * per + l / (16 / per);
    idx[j] = _mm512_load_si512(lanes);
  }
  __m512 acc[kVecs];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  // Accumulator j takes the block's integer sums, each lane times its row's two scales.
  auto accumulate = [&](int j, __m512i sum, __m512 scales) {
    acc[j] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xffff, sum),
                             _mm512_maskz_permutexvar_ps(0xffff, idx[j], scales), acc[j]);
  };
  // 16 activation codes from p, in each 128-bit lane.
  auto codes16 = [](const int8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_maskz_broadcast_i32x4(0xffff, v);
  };
  for (int64_t p = 0; p < blocks; ++p) {
    const char* u = w + p * kUnit<kNibbles>;
    const __m512 scales =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(0x00ff, reinterpret_cast<const float*>(u)),
                      _mm512_set1_ps(x.scales[p]));
    const int8_t* xc = x.codes + p * kGgmlBlock;
    if constexpr (kNibbles) {
      // Codes 0..15 stand for -8..7: dot(code, x) - 8 * sum(x), the correction starting
      // each lane's sum. A 128-bit lane is a row: its low nibbles meet columns 0-15, the high
      // ones 16-31.
      const __m512i lo_x = codes16(xc), hi_x = codes16(xc + 16);
      const __m512i eights = _mm512_set1_epi8(8), low = _mm512_set1_epi8(0x0f);
      const __m512i start = _mm512_sub_epi32(
          zero, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, eights, lo_x), eights, hi_x));
      for (int j = 0; j < kVecs; ++j) {
        const __m512i b = _mm512_loadu_si512(u + kScales<kNibbles> + j * 64);
        const __m512i lo = _mm512_and_si512(b, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, lo_x), hi, hi_x);
        accumulate(j, sum, scales);
      }
    } else {
      // Signed by signed as unsigned by signed: |w| times x with w's sign (|-128| reads as 128).
      // A 256-bit half is a row.
      const __m512i xv = _mm512_maskz_broadcast_i64x4(
          0xff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)));
      for (int j = 0; j < kVecs; ++j) {
        const __m512i wv = _mm512_loadu_si512(u + kScales<kNibbles> + j * 64);
        const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), zero, xv);
        const __m512i sum = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), sx);
        accumulate(j, sum, scales);
      }
    }
  }
  return rows_of(acc, per);
}
#else
// Row i's 8 lanes (acc[i]) summed into lane i.
inline Vec rows_of(const __m256* acc) {
#if defined(__AVX512F__)  // without VNNI: the 256-bit sums, widened for AVX-512's lane tree
  Vec v[kRows];
  for (int i = 0; i < kRows; ++i)
    v[i] = _mm512_maskz_mov_ps(0x00ff, _mm512_castps256_ps512(acc[i]));
  return sum_lanes8(v);
#else
  return sum_lanes8(acc);
#endif
}

template <bool kNibbles>
Vec block_dots(const char* w, Q8Row x, int64_t blocks) {
  __m256 acc[kRows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < blocks; ++p) {
    const char* u = w + p * kUnit<kNibbles>;
    const __m256 scales = _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(u)),
                                        _mm256_set1_ps(x.scales[p]));
    const __m256i xv =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes + p * kGgmlBlock));
    // Codes 0..15 stand for -8..7: dot(code, x) - 8 * sum(x), in the same 4-column lanes.
    const __m256i correction =
        kNibbles ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), xv), ones)
                 : _mm256_setzero_si256();
    for (int i = 0; i < kRows; ++i) {
      __m256i sum;
      if constexpr (kNibbles) {
        const char* row = u + kScales<kNibbles> + i * 16;
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        const __m128i low = _mm_set1_epi8(0x0f);
        const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low),
                                               _mm_and_si128(b, low));
        sum = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), ones),
                               correction);
      } else {
        // |w| times x with w's sign: a pair's sum is at most 2 * 128 * 127, within int16.
        const __m256i wv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + kScales<kNibbles> + i * 32));
        sum = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)), ones);
      }
      const __m256 s = _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(i));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc[i]);
    }
  }
  return rows_of(acc);
}
#endif

// y[m, n] for one form over its 8-row blocks, every row of a against a block while it is in
// L1.
template <bool kNibbles>
void products(float* y, int64_t ldy, const Q8Row* rows, int64_t M, const char* packed,
              int64_t K, int64_t n0, int64_t n1, float beta) {
  const int64_t blocks = K / kGgmlBlock, block_bytes = blocks * kUnit<kNibbles>;
  for (int64_t nb = n0 / kRows; nb * kRows < n1; ++nb) {
    const int64_t i0 = std::max(n0, nb * kRows) - nb * kRows;
    const int64_t i1 = std::min(n1, (nb + 1) * kRows) - nb * kRows;
    for (int64_t m = 0; m < M; ++m) {
      alignas(64) float dots[16];  // lane i: row i of the block
      vstore(dots, block_dots<kNibbles>(packed + nb * block_bytes, rows[m], blocks));
      float* ym = y + m * ldy + nb * kRows;
      for (int64_t i = i0; i < i1; ++i) ym[i] = beta == 0.0f ? dots[i] : beta * ym[i] + dots[i];
    }
  }
}

}  // namespace

void quantise_q8_activations(const float* x, int64_t K, int8_t* codes, float* scales) {
  for (int64_t p = 0; p < K / kGgmlBlock; ++p) {
    const float* xb = x + p * kGgmlBlock;
    float amax = 0;
    bool finite = true;
    for (int64_t j = 0; j < kGgmlBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      finite = finite && std::isfinite(xb[j]);
    }
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t j = 0; j < kGgmlBlock; ++j) {
      // The current rounding mode (nearest, ties to even), as cvtps2dq rounds. Within
      // [-127, 127] but where x * id is not a number (a non-finite block, or one so small
      // that id overflows): 0.
      const float q = std::nearbyint(xb[j] * id);
      codes[p * kGgmlBlock + j] = q >= -127.0f && q <= 127.0f ? static_cast<int8_t>(q) : 0;
    }
    // A NaN scale carries a non-finite block into every product, as the exact products do.
    scales[p] = finite ? f16_to_f32(f32_to_f16(amax / 127.0f)) : std::nanf("");
  }
}

void gemm_packed_int8(WeightDtype form, float* y, int64_t ldy, const float* a, int64_t lda,
                      const void* packed, int64_t M, int64_t K, int64_t n0, int64_t n1,
                      float beta) {
  KVLAB_ASSERT((form == WeightDtype::Q8_0 || form == WeightDtype::Q4_0) && K % kGgmlBlock == 0,
               "gemm_packed_int8: a ", weight_dtype_name(form), " weight of K ", K);
  const Q8Row* rows = rounded_rows(a, lda, M, K);
  // Out of memory for a few rows of codes: the exact products, rather than an exception
  // inside the decode step's parallel region.
  if (rows == nullptr) return gemm_packed(form, y, ldy, a, lda, packed, M, K, n0, n1, beta);
  const auto* w = static_cast<const char*>(packed);
  if (form == WeightDtype::Q8_0)
    products<false>(y, ldy, rows, M, w, K, n0, n1, beta);
  else
    products<true>(y, ldy, rows, M, w, K, n0, n1, beta);
}
#else
void quantise_q8_activations(const float*, int64_t, int8_t*, float*) {
  KVLAB_ASSERT(false, "quantise_q8_activations: this build has no packed kernel");
}
void gemm_packed_int8(WeightDtype, float*, int64_t, const float*, int64_t, const void*, int64_t,
                      int64_t, int64_t, int64_t, float) {
  KVLAB_ASSERT(false, "gemm_packed_int8: this build has no packed kernel");
}
#endif

}  // namespace kvlab::cpu
