// ggml's q8_0 and q4_0 blocks and IEEE half (ggml_blocks.h).
#include "platform/ggml_blocks.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace kvlab {

uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x47800000u)  // 2^16 and past it, infinities and NaNs
    return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x < 0x38800000u) {  // below half's smallest normal: adding 0.5 rounds into the mantissa
    const float r = std::bit_cast<float>(x) + 0.5f;
    return sign | static_cast<uint16_t>(std::bit_cast<uint32_t>(r) - 0x3f000000u);
  }
  const uint32_t odd = (x >> 13) & 1u;  // ties go to the even mantissa
  x += 0xc8000fffu + odd;                // rebias the exponent (127 -> 15) and round
  return sign | static_cast<uint16_t>(x >> 13);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

// The codes are computed with the f32 scale and the f16 one is stored, as ggml does.
uint16_t quantise_q8_0(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int64_t j = 0; j < kGgmlBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t j = 0; j < kGgmlBlock; ++j) q[j] = static_cast<int8_t>(std::round(x[j] * id));
  return f32_to_f16(d);
}

namespace {

// The block's value of largest magnitude, with its sign (the first of equals): q4_0's and
// q5_0's scale is it over minus their codes' offset.
float largest_magnitude(const float* x) {
  float amax = 0.0f, max = 0.0f;
  for (int64_t j = 0; j < kGgmlBlock; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

}  // namespace

uint16_t quantise_q4_0(const float* x, uint8_t* qs) {
  const float d = largest_magnitude(x) / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  auto code = [&](float v) {  // truncation toward zero of a value >= 0.5 - tiny, as ggml's cast
    return static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(v * id + 8.5f))));
  };
  for (int64_t j = 0; j < kGgmlBlock / 2; ++j)
    qs[j] = static_cast<uint8_t>(code(x[j]) | (code(x[j + kGgmlBlock / 2]) << 4));
  return f32_to_f16(d);
}

void dequantise_q8_0(uint16_t d, const int8_t* q, float* x) {
  const float s = f16_to_f32(d);
  for (int64_t j = 0; j < kGgmlBlock; ++j) x[j] = static_cast<float>(q[j]) * s;
}

void dequantise_q4_0(uint16_t d, const uint8_t* qs, float* x) {
  const float s = f16_to_f32(d);
  for (int64_t j = 0; j < kGgmlBlock / 2; ++j) {
    x[j] = static_cast<float>((qs[j] & 0x0f) - 8) * s;
    x[j + kGgmlBlock / 2] = static_cast<float>((qs[j] >> 4) - 8) * s;
  }
}

namespace {

// q5's codes in the file's order: the low nibbles as q4_0 packs them, bit 4 of code j at bit j
// of the 32-bit word after the scales.
void pack_q5_codes(const uint8_t* codes, uint8_t* qh, uint8_t* qs) {
  uint32_t high = 0;
  for (int64_t j = 0; j < kGgmlBlock; ++j) high |= static_cast<uint32_t>(codes[j] >> 4 & 1u) << j;
  for (int64_t j = 0; j < kGgmlBlock / 2; ++j)
    qs[j] = static_cast<uint8_t>((codes[j] & 0x0f) | (codes[j + kGgmlBlock / 2] & 0x0f) << 4);
  store_unaligned(qh, high);
}
void unpack_q5_codes(const uint8_t* qh, const uint8_t* qs, uint8_t* codes) {
  const auto high = load_unaligned<uint32_t>(qh);
  for (int64_t j = 0; j < kGgmlBlock / 2; ++j) {
    codes[j] = static_cast<uint8_t>((qs[j] & 0x0f) | (high >> j & 1u) << 4);
    codes[j + kGgmlBlock / 2] =
        static_cast<uint8_t>((qs[j] >> 4) | (high >> (j + kGgmlBlock / 2) & 1u) << 4);
  }
}

}  // namespace

void quantise_q5_0(const float* x, uint8_t* block) {
  const float d = largest_magnitude(x) / -16.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  uint8_t codes[kGgmlBlock];
  for (int64_t j = 0; j < kGgmlBlock; ++j) {  // truncated as ggml's cast to int8 truncates
    const int code = static_cast<int8_t>(x[j] * id + 16.5f);
    codes[j] = static_cast<uint8_t>(std::min(31, code));
  }
  store_unaligned(block, f32_to_f16(d));
  pack_q5_codes(codes, block + 2, block + 6);
}

void quantise_q5_1(const float* x, uint8_t* block) {
  float min = std::numeric_limits<float>::max(), max = -min;
  for (int64_t j = 0; j < kGgmlBlock; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
  const float d = (max - min) / 31.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  uint8_t codes[kGgmlBlock];
  for (int64_t j = 0; j < kGgmlBlock; ++j)
    codes[j] = static_cast<uint8_t>((x[j] - min) * id + 0.5f);
  store_unaligned(block, f32_to_f16(d));
  store_unaligned(block + 2, f32_to_f16(min));
  pack_q5_codes(codes, block + 4, block + 8);
}

void dequantise_q5_0(const uint8_t* block, float* x) {
  const float d = f16_to_f32(load_unaligned<uint16_t>(block));
  uint8_t codes[kGgmlBlock];
  unpack_q5_codes(block + 2, block + 6, codes);
  for (int64_t j = 0; j < kGgmlBlock; ++j) x[j] = static_cast<float>(codes[j] - 16) * d;
}

void dequantise_q5_1(const uint8_t* block, float* x) {
  const float d = f16_to_f32(load_unaligned<uint16_t>(block));
  const float m = f16_to_f32(load_unaligned<uint16_t>(block + 2));
  uint8_t codes[kGgmlBlock];
  unpack_q5_codes(block + 4, block + 8, codes);
  for (int64_t j = 0; j < kGgmlBlock; ++j) x[j] = static_cast<float>(codes[j]) * d + m;
}

namespace {

// Each block of x through quantise then dequantise: in place (round) or compared (exact).
// Rounding runs twice: where a block's scale underflows to a zero f16 its codes are not zero,
// and the values come out as +0 and -0 mixed, which the second pass settles (a fixed point
// from then on, so that exact accepts every rounded block). A block with a value that is not
// finite is left as it is, and is not exact: its codes would be undefined.
template <bool kRound, class Quantise, class Dequantise>
bool through_blocks(float* x, int64_t n, Quantise quantise, Dequantise dequantise) {
  for (int64_t b = 0; b < n; b += kGgmlBlock) {
    if (!std::all_of(x + b, x + b + kGgmlBlock, [](float v) { return std::isfinite(v); })) {
      if constexpr (kRound) continue;
      return false;
    }
    int8_t codes[kGgmlBlock];
    float back[kGgmlBlock];
    dequantise(quantise(x + b, codes), codes, back);
    if constexpr (kRound) {
      dequantise(quantise(back, codes), codes, x + b);
    } else if (std::memcmp(back, x + b, sizeof back) != 0) {
      return false;
    }
  }
  return true;
}

auto q8 = [](const float* x, int8_t* q) { return quantise_q8_0(x, q); };
auto q8_back = [](uint16_t d, const int8_t* q, float* x) { dequantise_q8_0(d, q, x); };
auto q4 = [](const float* x, int8_t* q) { return quantise_q4_0(x, reinterpret_cast<uint8_t*>(q)); };
auto q4_back = [](uint16_t d, const int8_t* q, float* x) {
  dequantise_q4_0(d, reinterpret_cast<const uint8_t*>(q), x);
};

}  // namespace

void round_to_q8_0(float* x, int64_t n) { through_blocks<true>(x, n, q8, q8_back); }
void round_to_q4_0(float* x, int64_t n) { through_blocks<true>(x, n, q4, q4_back); }
bool exact_q8_0(const float* x, int64_t n) {
  return through_blocks<false>(const_cast<float*>(x), n, q8, q8_back);
}
bool exact_q4_0(const float* x, int64_t n) {
  return through_blocks<false>(const_cast<float*>(x), n, q4, q4_back);
}

}  // namespace kvlab
