#include "nn/kv_convert.h"

#include <algorithm>
#include <map>
#include <vector>

namespace kvlab {

namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The parameters whose rows are KV heads: (NKV * HS, C) weights and (NKV * HS) biases.
bool is_kv_projection(const std::string& name) {
  for (const char* suffix :
       {".attn.k_proj.weight", ".attn.k_proj.bias", ".attn.v_proj.weight", ".attn.v_proj.bias"})
    if (ends_with(name, suffix)) return true;
  return false;
}

// The new tensor's values from the source's, both of rows (heads * head_size, ...) row-major.
std::vector<float> convert_rows(const std::string& name, const std::vector<float>& src,
                                int64_t n_src, int64_t n_dst, int64_t head_size, int64_t numel,
                                KVHeadInit init, Generator& gen) {
  std::vector<float> out(static_cast<size_t>(numel));
  if (init == KVHeadInit::Random) {
    // Weights N(0, 0.02) as GPT's initialisation draws them; biases zero.
    if (ends_with(name, ".weight"))
      for (float& v : out) v = static_cast<float>(gen.normal() * 0.02);
    return out;
  }
  const int64_t group = n_src / n_dst;
  const int64_t head = numel / n_dst;  // values of one head: head_size rows
  KVLAB_CHECK(head % head_size == 0 && static_cast<int64_t>(src.size()) == head * n_src,
              "convert: ", name, " does not hold ", n_src, " heads of ", head_size, " rows");
  for (int64_t j = 0; j < n_dst; ++j) {
    float* dst = out.data() + j * head;
    const float* first = src.data() + j * group * head;
    if (init == KVHeadInit::First || group == 1) {
      std::copy(first, first + head, dst);
      continue;
    }
    for (int64_t i = 0; i < head; ++i) {
      double sum = 0;  // in double: a group of equal rows gives back exactly their value
      for (int64_t g = 0; g < group; ++g) sum += first[g * head + i];
      dst[i] = static_cast<float>(sum / static_cast<double>(group));
    }
  }
  return out;
}

}  // namespace

std::string kv_head_init_name(KVHeadInit init) {
  switch (init) {
    case KVHeadInit::Mean:
      return "mean";
    case KVHeadInit::First:
      return "first";
    case KVHeadInit::Random:
      return "random";
  }
  return "?";
}

KVHeadInit parse_kv_head_init(std::string_view name) {
  for (const KVHeadInit init : {KVHeadInit::Mean, KVHeadInit::First, KVHeadInit::Random})
    if (name == kv_head_init_name(init)) return init;
  KVLAB_CHECK(false, "convert: unknown method '", std::string(name),
              "' (methods: mean, first, random)");
  return KVHeadInit::Mean;  // unreachable
}

GPTConfig kv_converted_config(const GPTConfig& src, int64_t k) {
  const int64_t n = src.n_kv_head;
  KVLAB_CHECK(!src.mla(), "convert: the source is an MLA model, which has no KV heads to merge");
  KVLAB_CHECK(k >= 1, "convert: n_kv_head must be >= 1, got ", k);
  KVLAB_CHECK(k <= n, "convert: n_kv_head ", k, " is more than the source's ", n,
              " (a conversion merges KV heads; it cannot split them)");
  KVLAB_CHECK(n % k == 0, "convert: n_kv_head ", k, " does not divide the source's n_kv_head ", n,
              " (each new KV head covers n_kv_head / K whole source heads)");
  GPTConfig c = src;
  c.n_kv_head = k;
  c.validate();
  return c;
}

std::unique_ptr<GPT> convert_kv_heads(const GPT& src, int64_t n_kv_head, KVHeadInit init,
                                      uint64_t seed) {
  const GPTConfig& from = src.config();
  auto dst = std::make_unique<GPT>(kv_converted_config(from, n_kv_head), seed);
  std::map<std::string, Tensor> source;
  for (const auto& [name, t] : src.named_parameters()) source.emplace(name, t);
  Generator gen(seed);
  for (auto& [name, t] : dst->named_parameters()) {
    const auto it = source.find(name);
    KVLAB_CHECK(it != source.end(), "convert: the source model has no parameter ", name);
    const Tensor& s = it->second;
    Tensor target = t;  // shares the model's storage
    if (!is_kv_projection(name)) {
      KVLAB_CHECK(s.sizes() == t.sizes(), "convert: ", name, " has shape ", s.shape_str(),
                  " in the source, ", t.shape_str(), " in the converted model");
      target.copy_from(s);
      continue;
    }
    const std::vector<float> values =
        convert_rows(name, s.to_vector<float>(), from.n_kv_head, n_kv_head, from.head_size(),
                     t.numel(), init, gen);
    target.copy_from(Tensor::from_vector(values, t.sizes()));
  }
  dst->to(src.device());
  dst->set_training(src.training());
  return dst;
}

}  // namespace kvlab
