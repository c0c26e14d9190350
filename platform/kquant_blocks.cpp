// ggml's K-quant super-blocks (kquant_blocks.h).
#include "platform/kquant_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "platform/ggml_blocks.h"

namespace kvlab {

namespace {

constexpr int kSub = 32;                         // values a Q4_K / Q5_K sub-block holds
constexpr int kSubBlocks = kSuperBlock / kSub;   // 8
constexpr float kGroupMaxEps = 1e-15f;           // ggml's GROUP_MAX_EPS: a group of zeros

// Byte offsets of each super-block's fields (ggml-common.h).
namespace q4k { constexpr int d = 0, dmin = 2, scales = 4, qs = 16; }
namespace q5k { constexpr int d = 0, dmin = 2, scales = 4, qh = 16, qs = 48; }
namespace q6k { constexpr int ql = 0, qh = 128, scales = 192, d = 208; }
namespace q8k { constexpr int d = 0, qs = 4, bsums = 260; }

// ggml's nearest_int: round half to even through the float's mantissa (|f| < 2^22).
int nearest_int(float f) {
  const float v = f + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &v, sizeof i);
  return (i & 0x007fffff) - 0x00400000;
}

// Sub-block j's 6-bit scale and min, as the 12 bytes pack them: j < 4 in the low 6 bits of
// bytes j and j + 4, the others split between a nibble of byte j + 4 and the top 2 bits of
// bytes j - 4 and j.
void scale_min(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// ggml's make_qkx2_quants: codes L (0..nmax) and a scale and min for n values under weights,
// the scale searched over nstep + 1 candidates around nmax / (max - min) by weighted least
// squares. Returns the scale; the_min is the (negated, so >= 0) minimum.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L,
                       float* the_min, uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0];
  float sum_w = weights[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    min = std::min(min, x[i]);
    max = std::max(max, x[i]);
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::fill(L, L + n, uint8_t{0});
    *the_min = -min;
    return 0.f;
  }
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    const float diff = scale * L[i] + min - x[i];
    best_error += weights[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
      Laux[i] = static_cast<uint8_t>(l);
      const float w = weights[i];
      sum_l += w * static_cast<float>(l);
      sum_l2 += w * static_cast<float>(l) * static_cast<float>(l);
      sum_xl += w * static_cast<float>(l) * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * Laux[i] + this_min - x[i];
        cur_error += weights[i] * (diff * diff);
      }
      if (cur_error < best_error) {
        std::copy(Laux, Laux + n, L);
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// ggml's make_qx_quants with rmse_type 1 (weights x^2): signed codes L (0..2 nmax - 1, offset
// by nmax) and the scale of n values, searched over 19 candidates around -nmax / max.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::fill(L, L + n, int8_t{0});
    return 0.f;
  }
  const auto code = [&](float iscale, int i) {
    return std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i])));
  };
  float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = code(iscale, i);
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * static_cast<float>(l);
    suml2 += w * static_cast<float>(l) * static_cast<float>(l);
  }
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = code(iscale, i);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * static_cast<float>(l);
      suml2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(nmax + code(iscale, i));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q4_K's and Q5_K's shared part: each sub-block's scale and min by make_qkx2_quants (weights
// rms + |x|), both quantised to 6 bits against the largest, packed into `scales`, d and dmin
// stored, and the codes L (0..nmax) recomputed with the stored scales.
void quantise_scaled_sub_blocks(const float* x, int nmax, float rmin, int nstep, uint8_t* block,
                                int off_d, int off_dmin, int off_scales, uint8_t* L) {
  float scales[kSubBlocks], mins[kSubBlocks], weights[kSub];
  uint8_t Laux[kSub];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < kSubBlocks; ++j) {
    const float* xs = x + kSub * j;
    float sum_x2 = 0;
    for (int l = 0; l < kSub; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / kSub);
    for (int l = 0; l < kSub; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = make_qkx2_quants(kSub, nmax, xs, weights, L + kSub * j, &mins[j], Laux, rmin,
                                 0.1f, nstep);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t* sc = block + off_scales;
  std::fill(sc, sc + 12, uint8_t{0});
  for (int j = 0; j < kSubBlocks; ++j) {
    // As ggml: the int converted to uint8_t, then capped at 63.
    const auto ls = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
    const auto lm = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      sc[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      sc[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  const uint16_t d16 = f32_to_f16(max_scale / 63.f), dmin16 = f32_to_f16(max_min / 63.f);
  store_unaligned(block + off_d, d16);
  store_unaligned(block + off_dmin, dmin16);
  for (int j = 0; j < kSubBlocks; ++j) {
    uint8_t s, m;
    scale_min(j, sc, s, m);
    const float d = f16_to_f32(d16) * s;
    if (d == 0) continue;
    const float dm = f16_to_f32(dmin16) * m;
    for (int i = 0; i < kSub; ++i) {
      const int l = nearest_int((x[kSub * j + i] + dm) / d);
      L[kSub * j + i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    }
  }
}

// Q4_K's and Q5_K's values: per sub-block d * scale * code - dmin * min, codes from `code`.
template <class Code>
void dequantise_scaled_sub_blocks(const uint8_t* block, int off_d, int off_dmin, int off_scales,
                                  float* x, Code code) {
  const float d = f16_to_f32(load_unaligned<uint16_t>(block + off_d));
  const float min = f16_to_f32(load_unaligned<uint16_t>(block + off_dmin));
  for (int j = 0; j < kSubBlocks; ++j) {
    uint8_t s, m;
    scale_min(j, block + off_scales, s, m);
    const float d1 = d * s, m1 = min * m;
    for (int i = 0; i < kSub; ++i) x[kSub * j + i] = d1 * static_cast<float>(code(j, i)) - m1;
  }
}

}  // namespace

// Sub-blocks 2k and 2k + 1 share 32 bytes of codes: the first in the low nibbles, the second in
// the high ones; Q5_K's fifth bits are bits 2k and 2k + 1 of qh[i].
void quantise_q4_k(const float* x, uint8_t* block) {
  uint8_t L[kSuperBlock];
  quantise_scaled_sub_blocks(x, 15, -1.f, 20, block, q4k::d, q4k::dmin, q4k::scales, L);
  uint8_t* q = block + q4k::qs;
  for (int j = 0; j < kSuperBlock; j += 64, q += 32)
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
}

void dequantise_q4_k(const uint8_t* block, float* x) {
  const uint8_t* q = block + q4k::qs;
  dequantise_scaled_sub_blocks(block, q4k::d, q4k::dmin, q4k::scales, x, [&](int j, int i) {
    const uint8_t b = q[j / 2 * 32 + i];
    return j % 2 == 0 ? b & 0xF : b >> 4;
  });
}

void quantise_q5_k(const float* x, uint8_t* block) {
  uint8_t L[kSuperBlock];
  quantise_scaled_sub_blocks(x, 31, -0.5f, 15, block, q5k::d, q5k::dmin, q5k::scales, L);
  uint8_t* qh = block + q5k::qh;
  uint8_t* ql = block + q5k::qs;
  std::fill(qh, qh + 32, uint8_t{0});
  uint8_t m1 = 1, m2 = 2;
  for (int n = 0; n < kSuperBlock; n += 64, ql += 32) {
    for (int j = 0; j < 32; ++j) {
      int l1 = L[n + j], l2 = L[n + j + 32];
      if (l1 > 15) {
        l1 -= 16;
        qh[j] |= m1;
      }
      if (l2 > 15) {
        l2 -= 16;
        qh[j] |= m2;
      }
      ql[j] = static_cast<uint8_t>(l1 | (l2 << 4));
    }
    m1 = static_cast<uint8_t>(m1 << 2);
    m2 = static_cast<uint8_t>(m2 << 2);
  }
}

void dequantise_q5_k(const uint8_t* block, float* x) {
  const uint8_t* ql = block + q5k::qs;
  const uint8_t* qh = block + q5k::qh;
  dequantise_scaled_sub_blocks(block, q5k::d, q5k::dmin, q5k::scales, x, [&](int j, int i) {
    const uint8_t b = ql[j / 2 * 32 + i];
    const int low = j % 2 == 0 ? b & 0xF : b >> 4;
    return low + ((qh[i] >> j) & 1) * 16;
  });
}

// Q6_K: per 128 values, 64 bytes of low nibbles (values l and l + 64 share byte l, values
// l + 32 and l + 96 byte l + 32) and 32 bytes of high 2-bit pairs (value l + 32 k in bits 2k).
void quantise_q6_k(const float* x, uint8_t* block) {
  int8_t L[kSuperBlock];
  float scales[kSuperBlock / 16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < kSuperBlock / 16; ++ib) {
    scales[ib] = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
    if (std::fabs(scales[ib]) > max_abs_scale) {
      max_abs_scale = std::fabs(scales[ib]);
      max_scale = scales[ib];
    }
  }
  std::fill(block, block + 210, uint8_t{0});
  if (max_abs_scale < kGroupMaxEps) return;  // all zero, d included
  const float iscale = -128.f / max_scale;
  const uint16_t d16 = f32_to_f16(1 / iscale);
  store_unaligned(block + q6k::d, d16);
  auto* sc = reinterpret_cast<int8_t*>(block + q6k::scales);
  for (int ib = 0; ib < kSuperBlock / 16; ++ib)
    sc[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
  for (int j = 0; j < kSuperBlock / 16; ++j) {
    const float d = f16_to_f32(d16) * sc[j];
    if (d == 0) continue;
    for (int i = 0; i < 16; ++i) {
      const int l = std::max(-32, std::min(31, nearest_int(x[16 * j + i] / d)));
      L[16 * j + i] = static_cast<int8_t>(l + 32);
    }
  }
  uint8_t* ql = block + q6k::ql;
  uint8_t* qh = block + q6k::qh;
  for (int j = 0; j < kSuperBlock; j += 128, ql += 64, qh += 32)
    for (int l = 0; l < 32; ++l) {
      const auto q = [&](int k) { return static_cast<uint8_t>(L[j + l + 32 * k]); };
      ql[l] = static_cast<uint8_t>((q(0) & 0xF) | ((q(2) & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((q(1) & 0xF) | ((q(3) & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) |
                                   ((q(3) >> 4) << 6));
    }
}

void dequantise_q6_k(const uint8_t* block, float* x) {
  const float d = f16_to_f32(load_unaligned<uint16_t>(block + q6k::d));
  const auto* sc = reinterpret_cast<const int8_t*>(block + q6k::scales);
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = block + q6k::ql + 64 * n;
    const uint8_t* qh = block + q6k::qh + 32 * n;
    for (int l = 0; l < 32; ++l)
      for (int k = 0; k < 4; ++k) {
        const int low = (ql[l + 32 * (k % 2)] >> (4 * (k / 2))) & 0xF;
        const int q = (low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
        x[128 * n + l + 32 * k] = d * static_cast<float>(sc[8 * n + l / 16 + 2 * k]) * q;
      }
  }
}

void quantise_q8_k(const float* x, uint8_t* block) {
  float max = 0, amax = 0;
  for (int j = 0; j < kSuperBlock; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  std::fill(block, block + 292, uint8_t{0});
  if (amax == 0) return;
  const float iscale = -127.f / max;
  auto* qs = reinterpret_cast<int8_t*>(block + q8k::qs);
  for (int j = 0; j < kSuperBlock; ++j)
    qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
  for (int j = 0; j < kSuperBlock / 16; ++j) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += qs[16 * j + i];
    store_unaligned(block + q8k::bsums + 2 * j, static_cast<int16_t>(sum));
  }
  store_unaligned(block + q8k::d, 1 / iscale);
}

void dequantise_q8_k(const uint8_t* block, float* x) {
  const float d = load_unaligned<float>(block + q8k::d);
  const auto* qs = reinterpret_cast<const int8_t*>(block + q8k::qs);
  for (int j = 0; j < kSuperBlock; ++j) x[j] = d * static_cast<float>(qs[j]);
}

}  // namespace kvlab
