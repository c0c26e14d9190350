#pragma once
// ggml's block formats q8_0, q4_0, q5_0 and q5_1 (the types of llama.cpp's GGUF files), value by value as
// ggml's reference quantiser and dequantiser define them, and IEEE half, their scale's type.
// One definition for the GGUF reader and writer (checkpoints/gguf.*), for GPT::round_matrices
// and for the decode step's packed weights (autograd/backend/cpu/packed.cpp).
//
// A block is 32 consecutive values of a row, with one f16 scale d:
//  - q8_0: d = max|x| / 127, codes q = round(x / d) in int8; the value is q * d.
//  - q4_0: d = m / -8 where m is the value of largest magnitude (the first such), codes
//    min(15, trunc(x / d + 8.5)) in 4 bits; the value is (q - 8) * d. In the file's 16 bytes
//    byte j holds value j in its low nibble and value j + 16 in its high one.
//  - q5_0 (22 bytes): as q4_0 with 5-bit codes, d = m / -16, min(31, trunc(x / d + 16.5)),
//    value (q - 16) * d; after d, 4 bytes hold bit 4 of code j at bit j (little-endian), then
//    the low nibbles as q4_0's.
//  - q5_1 (24 bytes): d = (max - min) / 31 and the f16 minimum m, codes trunc((x - min) / d +
//    0.5), value q * d + m; the high bits and nibbles as q5_0's. Only GGUF tensors take these
//    two: llama-quantize writes them where a Q4_K or Q5_K matrix's rows are not whole
//    super-blocks.
// Both quantisers are idempotent: quantising a block's values a second time gives the same
// scale and codes (but where the f16 scale underflows to zero: round_to_* settles those), so
// the dequantised values of a file (or of round_to_*) are told apart from other values by
// quantising them again (exact_q8_0, exact_q4_0). Not the values of files quantised another
// way (an importance matrix's scales): those are exact f32 values, not recognised blocks.
// ggml_blocks.cpp compiles without FMA contraction, as ggml's reference does: q4_0's
// x / d + 8.5 rounded twice, not fused, gives its codes bit for bit.
#include <cstdint>
#include <cstring>

#include "platform/formats.h"

namespace kvlab {

inline constexpr int64_t kGgmlBlock = format(Fmt::Q8_0).block_values;  // a q8_0 or q4_0 block's
static_assert(format(Fmt::Q4_0).block_values == kGgmlBlock);

// A value (a scale, a sum) at an unaligned place in a block's bytes, read or written as them.
template <class T>
T load_unaligned(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store_unaligned(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// f32 <-> IEEE half, rounding to nearest even (overflow gives an infinity).
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

// One block of 32 values x: its f16 scale, and codes q (32 int8) or qs (16 bytes, the file's
// nibble order).
uint16_t quantise_q8_0(const float* x, int8_t* q);
uint16_t quantise_q4_0(const float* x, uint8_t* qs);
// x (32) = the block's values.
void dequantise_q8_0(uint16_t d, const int8_t* q, float* x);
void dequantise_q4_0(uint16_t d, const uint8_t* qs, float* x);
// One q5_0 or q5_1 block: x (32 values) -> block (its bytes, scales included), and back.
void quantise_q5_0(const float* x, uint8_t* block);
void quantise_q5_1(const float* x, uint8_t* block);
void dequantise_q5_0(const uint8_t* block, float* x);
void dequantise_q5_1(const uint8_t* block, float* x);

// x (n, a multiple of 32) rounded in place, block by block, to the values the format holds.
void round_to_q8_0(float* x, int64_t n);
void round_to_q4_0(float* x, int64_t n);
// Whether each block of x (n, a multiple of 32) holds exactly the values its quantisation
// gives back; stops at the first block that does not (a matrix of other values is told apart
// in its first block).
bool exact_q8_0(const float* x, int64_t n);
bool exact_q4_0(const float* x, int64_t n);

}  // namespace kvlab
