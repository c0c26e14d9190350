// llama-quantize's file types and their rules (gguf_mix.h). Only the rules of the mixes in
// kGgufMixes are here, for the dense models kvlab writes (no experts, not Falcon).
#include "checkpoints/gguf_mix.h"

#include "platform/error.h"

namespace kvlab {

const GgufMix& gguf_mix(std::string_view name) {
  for (const GgufMix& m : kGgufMixes)
    if (name == m.name) return m;
  std::string names;
  for (const std::string& n : gguf_mix_names()) names += (names.empty() ? "" : ", ") + n;
  throw Error(detail::cat("export: no file type '", name, "' (", names, " are)"));
}

const GgufMix& gguf_mix(GgmlType matrices) {
  for (const GgufMix& m : kGgufMixes)
    if (m.matrices == matrices) return m;
  throw Error(detail::cat("export: no file type holds its matrices as ", ggml_type_name(matrices)));
}

std::vector<std::string> gguf_mix_names() {
  std::vector<std::string> names;
  for (const GgufMix& m : kGgufMixes) names.emplace_back(m.name);
  return names;
}

namespace {

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

// llama.cpp's tensor categories, those its rules for these mixes tell apart.
enum class Category { TokenEmbd, Output, AttnVLike, FfnDown, Other };

Category category_of(const std::string& name) {
  if (name == "output.weight") return Category::Output;
  if (name == "token_embd.weight") return Category::TokenEmbd;
  if (contains(name, "attn_qkv.weight") || contains(name, "attn_kv_b.weight") ||
      contains(name, "attn_v.weight"))
    return Category::AttnVLike;
  return contains(name, "ffn_down") ? Category::FfnDown : Category::Other;
}

// Matrices llama-quantize quantises: names ending in "weight" of two or more dimensions, but
// norms and position embeddings.
bool quantisable(const TensorShape& t) {
  const std::string_view tail = "weight";
  return t.dims.size() >= 2 && t.name.size() >= tail.size() &&
         t.name.compare(t.name.size() - tail.size(), tail.size(), tail) == 0 &&
         !contains(t.name, "_norm.weight") && t.name != "position_embd.weight";
}

bool quantised(GgmlType t) { return format_of(t).block_values > 1; }
int64_t block_of(GgmlType t) { return format_of(t).block_values; }

// The layers where the K-quant mixes spend more bits: the first and last eighth, and every
// third layer between.
bool use_more_bits(int64_t i, int64_t n) {
  return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

// The rules' running state: llama.cpp counts the tensors of two categories as it meets them.
struct MixState {
  const GgufMix& mix;
  const MixModel& model;
  bool tied;
  int64_t n_attn_v = 0, i_attn_v = 0, i_ffn_down = 0;
};

// llama_tensor_get_type_impl for these mixes: the output matrix (and the token table it is
// tied to) at 6 bits, and in the K-quant mixes the attn_v-like and ffn_down matrices of the
// use_more_bits layers at Q6_K.
GgmlType mixed_type(MixState& s, const TensorShape& t, GgmlType type) {
  const Category c = category_of(t.name);
  if (c == Category::Output || (s.tied && c == Category::TokenEmbd)) {
    if (t.dims[0] % block_of(type) != 0) return GgmlType::Q8_0;
    return type == GgmlType::Q8_0 ? GgmlType::Q8_0 : GgmlType::Q6_K;
  }
  if (c == Category::AttnVLike) {
    if (s.mix.more_bits && use_more_bits(s.i_attn_v, s.n_attn_v)) type = GgmlType::Q6_K;
    // llama.cpp's 70B (80 llama layers, grouped queries): its small attn_v gets more bits.
    const bool is_70b =
        s.model.arch == "llama" && s.model.n_layer == 80 && s.model.n_head != s.model.n_kv_head;
    if (is_70b && type == GgmlType::Q4_K) type = GgmlType::Q5_K;
    ++s.i_attn_v;
  } else if (c == Category::FfnDown) {
    if (s.mix.more_bits && use_more_bits(s.i_ffn_down, s.model.n_layer)) type = GgmlType::Q6_K;
    ++s.i_ffn_down;
  }
  return type;
}

// tensor_type_fallback: a type whose blocks do not divide the rows gives way to a 32-value
// type, and where none divides them, to a 2-byte float (bf16 here, f16 in llama.cpp).
GgmlType fallback(GgmlType type, int64_t row) {
  if (row % block_of(type) == 0) return type;
  if (type == GgmlType::Q4_K) type = GgmlType::Q5_0;
  if (type == GgmlType::Q5_K) type = GgmlType::Q5_1;
  if (type == GgmlType::Q6_K) type = GgmlType::Q8_0;
  return row % block_of(type) == 0 ? type : GgmlType::BF16;
}

}  // namespace

std::vector<GgmlType> mix_types(const GgufMix& mix, const MixModel& model,
                                const std::vector<TensorShape>& tensors, bool pure) {
  MixState s{mix, model, true};
  for (const TensorShape& t : tensors) {
    if (t.name == "output.weight") s.tied = false;
    if (category_of(t.name) == Category::AttnVLike) ++s.n_attn_v;
  }
  std::vector<GgmlType> types;
  for (const TensorShape& t : tensors) {
    GgmlType type = quantisable(t) ? mix.matrices : GgmlType::F32;
    if (quantised(type)) type = fallback(pure ? type : mixed_type(s, t, type), t.dims[0]);
    types.push_back(type);
  }
  return types;
}

}  // namespace kvlab
