#pragma once
// Differentiable ops. Each records a node (graph.h) when an input requires grad and grad mode
// is on; forward and backward of an op family sit side by side in one file of this folder.
#include <cstdint>
#include <span>
#include <vector>

#include "autograd/backend/kernel_types.h"
#include "autograd/tensor.h"

namespace kvlab {

// ---- elementwise.cpp: broadcasting follows NumPy rules (right-aligned, size 1 stretches) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& x, double s);
Tensor gelu(const Tensor& x);  // tanh form, as GPT-2
// silu(gate) * up elementwise (one shape, no broadcasting), silu(a) = a * sigmoid(a).
Tensor swiglu(const Tensor& gate, const Tensor& up);
// Rotary position embedding (halves form: channel j pairs with j + HS/2) of x (..., H, HS),
// HS even, each (H, HS) slice at its position: positions (i32, on x's device) has one entry
// per slice, in order, each in [0, P) of table (P, HS) from rope_table.
Tensor rope(const Tensor& x, const Tensor& positions, const Tensor& table);
// Each position's HS/2 cosines then HS/2 sines of p * scale * theta^(-2j/HS) / factors[j], p
// in [0, P), computed in double and stored in `dtype` on `device`. scale and factors are
// llama.cpp's scaled RoPE: linear scaling (1 / rope.scaling.factor) and Llama 3.1's
// per-frequency divisors (its rope_freqs tensor, HS/2 of them); none: each 1.
Tensor rope_table(int64_t P, int64_t HS, double theta, DType dtype, Device device,
                  double scale = 1.0, std::span<const float> factors = {});
// Zeroes each element with probability p and scales the rest by 1/(1-p). The mask is a pure
// function of (seed, element index): the same seed gives the same mask. Identity when p == 0.
Tensor dropout(const Tensor& x, double p, uint64_t seed);

// ---- reduce.cpp ----
Tensor sum(const Tensor& x);   // all elements -> scalar
Tensor mean(const Tensor& x);  // all elements -> scalar
// Sums a broadcast result back to `shape` (not differentiable; backward passes use it).
Tensor sum_to(const Tensor& x, const Shape& shape);

// ---- matmul.cpp ----
// op(a) @ op(b) over the last two dims; leading dims must match exactly (batched), or b may be
// 2-D and shared by every batch entry. op = transpose when trans_*.
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// x (..., in) @ w^T + bias: w is (out, in) as torch.nn.Linear stores it; bias (out) optional.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor());

// Input precision of matmul and linear (forward and their backward products) on a GPU. F32:
// plain FP32 products, the path compared against the CPU. BF16: f32 operands rounded to bf16
// and multiplied on the tensor cores with f32 accumulation; outputs, weights and optimizer
// state stay f32 (mixed precision). The CPU always computes in the tensors' dtype.
// Thread-local; a recorded node keeps the precision of its forward.
enum class MatmulPrecision { F32, BF16 };
MatmulPrecision matmul_precision();
class MatmulPrecisionGuard {
 public:
  explicit MatmulPrecisionGuard(MatmulPrecision p);
  ~MatmulPrecisionGuard();
  MatmulPrecisionGuard(const MatmulPrecisionGuard&) = delete;
  MatmulPrecisionGuard& operator=(const MatmulPrecisionGuard&) = delete;

 private:
  MatmulPrecision prev_;
};

// ---- shape.cpp: views share storage where the layout allows ----
Tensor reshape(const Tensor& x, const Shape& shape);  // one size may be -1
Tensor transpose(const Tensor& x, int dim0 = -2, int dim1 = -1);
Tensor narrow(const Tensor& x, int dim, int64_t start, int64_t length);
Tensor concat(const std::vector<Tensor>& xs, int dim);
std::vector<Tensor> split(const Tensor& x, int64_t chunk, int dim);

// ---- norm.cpp ----
// Over the last dim. bias may be undefined: no bias.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// x / sqrt(mean(x^2) + eps) * weight, over the last dim (no centring, no bias).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-5);
Tensor softmax(const Tensor& x);  // over the last dim

// ---- embedding.cpp ----
// ids (...) i32 in [0, V), weight (V, C) -> (..., C)
Tensor embedding(const Tensor& ids, const Tensor& weight);

// ---- loss.cpp ----
// Mean cross-entropy of logits (..., V) against i32 targets (...); targets equal to
// ignore_index take no part (the mean is over the others).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int32_t ignore_index = -1);

// ---- attention.cpp ----
struct AttentionOptions {
  double dropout = 0.0;  // on the attention probabilities
  uint64_t seed = 0;     // dropout mask seed
  // Valid key count per batch row (each <= S, >= T); empty means S for every row. Rows of a
  // batched decode step have different cache lengths. Read during the call only (a recorded
  // node keeps its own copy), so a decode step can pass a buffer it reuses.
  std::span<const int64_t> kv_lengths;
  // K and V of a paged KV cache, or null. When set, k and v are the pools (n_blocks, NKV,
  // block_len, HS) with HS contiguous and kv_blocks->block_stride their stride(0), read through
  // the block tables (one row of width entries per batch row); kv_lengths must be given, and
  // S is their maximum. Inference only: no gradient, no dropout, the CPU. Read during the call.
  const KVBlocks* kv_blocks = nullptr;
  // An fp8 KV cache's scales of this layer (2 NKV: each KV head's keys', then its values'),
  // for k and v of dtype fp8; read during the call.
  std::span<const float> kv_scales;
};
// Causal attention with grouped K/V heads: q (B, NH, T, HS), k and v (B, NKV, S, HS) (for a
// quantised KV cache's k and v, fp8, int8 or int4, HS is its rows' bytes, platform/kv_rows.h),
// NH % NKV == 0; query head h reads KV head h / (NH / NKV), never a repeated copy. The mask is
// bottom-right aligned: the T queries sit at positions S-T .. S-1. Any strides are accepted as
// long as HS is contiguous, so q can be a transposed view of a (B, T, NH, HS) buffer.
// Returns (B, NH, T, HS) as a view of a (B, T, NH, HS) buffer.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionOptions& options = {});

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator*(const Tensor& a, double s) { return scale(a, s); }

}  // namespace kvlab
