#pragma once
// The file types kvlab export writes, each one of llama-quantize's (llama.h's llama_ftype): a
// type for the matrices, and llama.cpp's rules for the tensors that take another
// (src/llama-quant.cpp: llama_tensor_get_type_impl, tensor_type_fallback; docs/gguf.md). With
// ggml's reference quantisers (what llama-quantize runs without an importance matrix), kvlab's
// `--dtype q4_k_m` file holds the tensor types, and the bytes, that llama-quantize's Q4_K_M of
// the same f32 weights holds.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoints/gguf.h"

namespace kvlab {

struct GgufMix {
  const char* name;   // --dtype's spelling
  int32_t file_type;  // general.file_type: llama.h's llama_ftype
  GgmlType matrices;  // a matrix's type where no rule gives another
  bool more_bits;     // the _M mixes: attn_v and ffn_down at Q6_K in use_more_bits layers
};

inline constexpr GgufMix kGgufMixes[] = {
    {"f32", 0, GgmlType::F32, false},     {"f16", 1, GgmlType::F16, false},
    {"bf16", 32, GgmlType::BF16, false},  {"q8_0", 7, GgmlType::Q8_0, false},
    {"q4_0", 2, GgmlType::Q4_0, false},   {"q4_k_m", 15, GgmlType::Q4_K, true},
    {"q5_k_m", 17, GgmlType::Q5_K, true}, {"q6_k", 18, GgmlType::Q6_K, false},
};

// The mix named `name` (an Error naming the choices otherwise), or whose matrices are `t`.
const GgufMix& gguf_mix(std::string_view name);
const GgufMix& gguf_mix(GgmlType matrices);
std::vector<std::string> gguf_mix_names();

// What the rules read of the model besides each tensor's name and shape.
struct MixModel {
  std::string arch;  // general.architecture
  int64_t n_layer = 0, n_head = 0, n_kv_head = 0;
};

struct TensorShape {
  std::string name;
  std::vector<int64_t> dims;  // ggml order: dims[0] is a row's length
};

// Each tensor's type, in the file's order (llama.cpp counts the attn_v-like and ffn_down
// tensors as it meets them). Tensors llama-quantize leaves alone (norms, biases, position
// embeddings) are f32. pure: every other matrix in mix.matrices, as llama-quantize --pure.
// Where no block type fits a row, llama.cpp writes f16 and kvlab bf16, the values kvlab's
// own --weight-dtype computes with (GPT::round_matrices).
std::vector<GgmlType> mix_types(const GgufMix& mix, const MixModel& model,
                                const std::vector<TensorShape>& tensors, bool pure);

}  // namespace kvlab
