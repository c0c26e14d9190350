#pragma once
// The decode step's references to the model's weights and to their packed copies.
//
// While a DecodeStep::PackGuard lives, the products read copies of the weights packed as one
// sequential stream each (cpu::pack_weight), once for all the batch's rows: faster than
// row-major weights at batch 1 and much faster than the BLAS at a few rows
// (docs/benchmarks.md). Each thread's rows of each matrix (StepRows) are packed on their own,
// and one thread's parts lie one after another in the order the step reads them, so that each
// thread reads one stream from the first layer to the LM head: its prefetchers do not start
// afresh at every product (docs/benchmarks.md). Engine::generate packs at the start of each
// call, so weights changed between calls are always seen. A matrix whose values a smaller form
// holds exactly (GPT::round_matrices: bf16, q8_0 or q4_0; exact_form) is packed in it, which
// batch-1 decode, bound by reading the weights, reads in fewer bytes for the same results. MLA's q_proj and kv_down are split
// and packed like the other products; its kv_up is read whole by every thread (never packed).
//
// DecodeStep::pack, its guard and DecodeStep::weight_bytes are in packed_weights.cpp.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/tensor.h"
#include "nn/gpt.h"

namespace kvlab::decode {

// Rows of a matrix packed in one of cpu::pack_weight's forms, or none.
struct PackRef {
  const void* data = nullptr;
  WeightDtype form = WeightDtype::F32;
  bool int8 = false;  // q8_0 or q4_0 rows multiplied in integers (cpu::gemm_packed_int8)
};

// The form a matrix is packed in: the fewest bytes that hold its values exactly, so that the
// step gives the bits of the f32 form whatever the form (cpu/decode_kernels.h): q4_0, then
// q8_0 (values as GPT::round_matrices or a GGUF file's blocks leave them), bf16, else f32.
// A matrix of other values is told apart in its first block.
WeightDtype exact_form(const Tensor& w);

// A product's f32 weight (out, in), bias (out, or null) and, while packed, each thread's
// rows of the weight (StepRows) packed on their own, a PackRef per thread (else null);
// taken before the parallel region: nothing inside it may throw.
struct LinearRef {
  const float* w;
  const float* b;
  int64_t in;
  const PackRef* parts;
  LinearRef(const Tensor& weight, const Tensor* bias, const PackRef* parts)
      : w(weight.data<float>()),
        b(bias != nullptr && bias->defined() ? bias->data<float>() : nullptr),
        in(weight.size(1)),
        parts(parts) {}
  LinearRef(const Linear& l, const PackRef* parts) : LinearRef(l.weight, &l.bias, parts) {}
};

// A LayerNorm's or RMSNorm's weight, bias (or null) and eps.
struct NormRef {
  const float* w;
  const float* b;
  double eps;
  bool rms;
  explicit NormRef(const LayerNorm& n)
      : w(n.weight.data<float>()),
        b(n.bias.defined() ? n.bias.data<float>() : nullptr),
        eps(n.eps),
        rms(n.rms) {}
};

// A block's matrices in the order they are packed (decode_matrices): q, k, v, the attention's
// c_proj, c_fc, the MLP's c_proj, then SwiGLU's c_up (null without one); MLA's q_proj, kv_down
// and kv_up take the places of q, k and v. A fixed array: an unpacked step takes these for
// every block, and must not allocate for it.
std::array<const Linear*, 7> block_linears(const Block& b);
size_t matrices_per_block(const GPTConfig& cfg);

// The matrices the step reads packed, in the packing's order: each block's (block_linears),
// then the LM head.
std::vector<const Tensor*> decode_matrices(const GPT& m);

// parts: the parts of the block's matrices in block_linears's order, `threads` a matrix, or
// null.
struct BlockRef {
  NormRef ln_1, ln_2;
  LinearRef q, k, v, proj, fc, fc_proj;
  std::optional<LinearRef> up;  // SwiGLU's
  // MLA's (q, k and v are then q_proj, kv_down and kv_up): the latent's norm, and the query
  // compression's down-projection and norm where it has one.
  std::optional<NormRef> kv_norm, q_norm;
  std::optional<LinearRef> q_down;
  BlockRef(const Block& b, const PackRef* parts, int threads);

 private:
  BlockRef(const Block& b, const std::array<const Linear*, 7>& l, const PackRef* p, int n);
};

// The step's pointers into the model: taking them costs some hundred calls into Tensor, so
// pack() takes them once for all the steps of a generation. parts: the packed parts of
// the matrices of decode_matrices, `threads` a matrix (thread t's rows, StepRows, at t), or none
// (threads 0); a step on another number of threads reads the row-major weights.
struct DecodeRefs {
  const std::vector<PackRef> parts;
  const int threads;
  std::vector<BlockRef> layers;
  NormRef final_norm;
  LinearRef head;
  DecodeRefs(const GPT& m, std::vector<PackRef> packed, int packed_threads);

 private:
  const PackRef* part(size_t matrix) const {  // matrix's first part, or null
    return parts.empty() ? nullptr : &parts[matrix * static_cast<size_t>(threads)];
  }
};

}  // namespace kvlab::decode
