#pragma once
// DecodeStep: the Engine's decode step on the CPU (a cache, T = 1, no gradients, f32), fused
// in one OpenMP parallel region instead of GPT::forward's op by op (decode_step.cpp says how
// and why; its stages are the other files of infer/decode/). It is an inference concern built from
// a const GPT&: it reads the model's weights and never changes the model. GPT::forward stays the
// reference, which prefill, training, the GPU and recompute use; since this writes the block's
// forward a second time, tests/infer/test_decode_step.cpp compares the two at every step, so that a
// change to the model that is not made here too fails there.
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "autograd/tensor.h"
#include "infer/kv_cache.h"
#include "nn/gpt.h"

namespace kvlab {

namespace decode {
struct DecodeRefs;  // the step's pointers into the model and its packed weights (packed_weights.h)
}

class DecodeStep {
 public:
  // Borrows the model, which must outlive the step.
  explicit DecodeStep(const GPT& model);
  ~DecodeStep();
  DecodeStep(const DecodeStep&) = delete;
  DecodeStep& operator=(const DecodeStep&) = delete;

  // While it lives, the step's products read copies of the model's matrices packed for
  // few-row products (cpu::pack_weight), made when pack() returned it: the weights must not
  // change until it is destroyed, and it must not outlive the step. Empty (packing nothing)
  // where the step or the packed kernel does not apply. Guards nest: the copies are read until
  // the last one ends.
  class PackGuard {
   public:
    PackGuard() = default;
    PackGuard(PackGuard&& o) noexcept : step_(std::exchange(o.step_, nullptr)) {}
    PackGuard& operator=(PackGuard&&) = delete;
    ~PackGuard();

   private:
    friend class DecodeStep;
    explicit PackGuard(DecodeStep* step) : step_(step) {}
    DecodeStep* step_ = nullptr;
  };

  // false: nothing applies or is packed, and the Engine runs every decode step op by op
  // (kvlab bench generate --op-by-op, the step's baseline).
  bool enabled = true;
  // With q8_0 or q4_0 matrices, multiply them in integers as llama.cpp does: each product's
  // input rounded to q8_0 blocks (cpu::gemm_packed_int8). Faster, and no longer the bits of
  // GPT::forward. Taken by the next pack().
  bool int8_products = false;
  // Whether the step's products are integer ones: int8_products, the packed kernels in this
  // build, and a matrix whose values q8_0 or q4_0 blocks hold (decode::exact_form).
  bool multiplies_in_integers() const;

  // Whether a cached forward of `tokens` runs here rather than through GPT::forward: enabled,
  // the model on the CPU in f32, T = 1 and no gradients recorded.
  bool applies(const Tensor& tokens) const;
  // Packs the model's matrices (the buffer is kept for the next call). Engine::generate holds
  // one for each call, so that weights changed between calls are seen. A matrix whose values
  // a smaller form holds exactly (bf16, q8_0 or q4_0: GPT::round_matrices) is packed in it:
  // fewer bytes, the same results (decode::exact_form).
  [[nodiscard]] PackGuard pack();
  // tokens (B, 1) i32 on the host -> logits (B, 1, V). Writes every layer's new keys and
  // values into the cache and advances it by one; on an error (a bad token id, a row without
  // room, a cache it cannot use) nothing is written and the cache does not advance.
  Tensor forward(const Tensor& tokens, DecodeKVCache& cache);
  // Bytes of weights a decode step reads: every parameter but the position table and, when
  // the LM head is a matrix of its own, the token table (a row of each); the matrices this
  // step packs at their form's bytes (bf16 2 an element, q8_0 36 a block of 32 and q4_0 20,
  // their scales f32), 4 for the rest (MLA's kv_up: never packed).
  int64_t weight_bytes() const;

 private:
  // Whether the step can run on this model (enabled, on the CPU in f32).
  bool runs_on_model() const;
  // Whether pack() packs (the step runs on the model and this build has the kernel).
  bool packing_applies() const;

  const GPT& model_;
  std::vector<int64_t> lengths_;    // each row's, this step's position included
  std::vector<int32_t> positions_;  // each row's new position (length - 1), for RoPE
  // For each thread of the step (omp_get_max_threads at packing), its rows of each matrix
  // (per layer q, k, v, c_proj, c_fc, mlp c_proj, SwiGLU's c_up, then the LM head), each
  // packed on their own in one of cpu::pack_weight's forms (decode::exact_form's), one after
  // another in pack_'s f32 words, each from a 64-byte boundary; read while a
  // PackGuard lives (pack_users_ of them) by steps on that many threads.
  Tensor pack_;
  int pack_users_ = 0;
  // The step's pointers into the weights and into pack_, taken by the last pack() for the
  // steps its guards cover (a step without one takes its own).
  std::shared_ptr<const decode::DecodeRefs> refs_;
  // The block the step's buffers (StepBuffers) are carved from, grown when a step needs more.
  Tensor buffers_;
};

}  // namespace kvlab
