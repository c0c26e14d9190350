#pragma once
// ggml's K-quant super-blocks (llama.cpp's Q4_K, Q5_K, Q6_K and Q8_K), value by value as ggml's
// reference quantisers and dequantisers define them (ggml-common.h's block layouts,
// ggml-quants.c's quantize_row_*_K_ref and dequantize_row_*_K): the quantisers are the ones
// llama-quantize runs without an importance matrix, so the same input gives the same bytes.
//
// A super-block is 256 consecutive values of a row:
//  - Q4_K (144 bytes): f16 d and dmin, 12 bytes packing 8 sub-blocks' 6-bit scales and mins,
//    then 128 bytes of 4-bit codes; value = d * scale * q - dmin * min, per sub-block of 32.
//  - Q5_K (176 bytes): as Q4_K, with 32 bytes of high bits making 5-bit codes.
//  - Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one
//    per 16 values) and f16 d; value = d * scale * (q - 32).
//  - Q8_K (292 bytes): f32 d, 256 int8 codes and 16 int16 sums of 16 codes each (what the
//    integer products of the K-quants take their activations in); value = d * q.
// kquant_blocks.cpp compiles without FMA contraction, as ggml's reference does (ggml-base is
// built for the baseline ISA): a fused multiply-add would round some codes differently.
#include <cstdint>

namespace kvlab {

inline constexpr int64_t kSuperBlock = 256;  // values a K-quant super-block holds

// One super-block: x (256 values) -> block (the format's bytes), and back.
void quantise_q4_k(const float* x, uint8_t* block);
void quantise_q5_k(const float* x, uint8_t* block);
void quantise_q6_k(const float* x, uint8_t* block);
void quantise_q8_k(const float* x, uint8_t* block);
void dequantise_q4_k(const uint8_t* block, float* x);
void dequantise_q5_k(const uint8_t* block, float* x);
void dequantise_q6_k(const uint8_t* block, float* x);
void dequantise_q8_k(const uint8_t* block, float* x);

}  // namespace kvlab
