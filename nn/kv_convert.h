#pragma once
// A GPT with n_kv_head = N turned into one with fewer KV heads K (K divides N): MHA -> GQA or
// MQA, or GQA -> fewer groups, after the GQA paper's uptraining recipe (Ainslie et al. 2023).
// New KV head j covers the source's heads j * (N / K) .. (j + 1) * (N / K) - 1, which are the
// KV heads of exactly the query heads that j serves, so every query head keeps reading its own
// group's keys and values.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "nn/gpt.h"

namespace kvlab {

// How a new KV head's rows of attn.k_proj and attn.v_proj (weight and bias) are made from
// its group's: their mean (the paper's choice), the group's first head's, or fresh N(0, 0.02)
// weights with zero biases (a baseline that keeps nothing of the source's keys and values).
enum class KVHeadInit { Mean, First, Random };

// "mean", "first", "random".
std::string kv_head_init_name(KVHeadInit init);
// The KVHeadInit of one of those names; any other is an Error listing them.
KVHeadInit parse_kv_head_init(std::string_view name);

// The source's config with n_kv_head = K (every other setting, dropout included, unchanged)
// after the checks convert_kv_heads makes: an Error says why K does not fit `src` (K < 1,
// K > src.n_kv_head, or K not dividing it).
GPTConfig kv_converted_config(const GPTConfig& src, int64_t n_kv_head);

// A new GPT of kv_converted_config(src.config(), n_kv_head), on src's device and in its
// training mode. Parameters are matched by name (named_parameters()): each attn.k_proj and
// attn.v_proj weight and bias the new model has is made by `init` from the source's (seed
// only draws for KVHeadInit::Random: one generator over the model, in parameter order), and
// every other parameter is copied unchanged. K = N with Mean or First is an exact copy. An
// Error names a parameter the source lacks or whose shape differs.
std::unique_ptr<GPT> convert_kv_heads(const GPT& src, int64_t n_kv_head, KVHeadInit init,
                                      uint64_t seed = 0);

}  // namespace kvlab
