#pragma once
// The scales an fp8 KV cache stores its keys and values by, computed from a model's weights.
#include <vector>

#include "autograd/backend/device.h"
#include "nn/gpt.h"

namespace kvlab {

// fp8 scales of a model's KV cache, (L, 2 NKV) as KVRows::scales reads them: per layer and KV
// head, a bound on every key (value) the head can produce over 448, E4M3's largest value, so
// that no cached value saturates. The bound follows from the block: ln_1's output has norm at
// most sqrt(C) before its gain, so |k_j| <= sqrt(C) * ||W_k[j] * gamma|| + |W_k[j] . beta +
// b_k[j]| (Cauchy-Schwarz), the maximum over the head's rows taken. MLA: one scale per layer,
// given as the key's and the value's (its latent row is both), bounding the normed latent and
// the rotary key. Computed from the weights alone: the same model always gets the same
// scales, whatever it is fed.
std::vector<float> fp8_kv_scales(const GPT& model);
// The scales a cache of `dtype` takes for `model`: fp8_kv_scales for fp8, none otherwise.
std::vector<float> kv_cache_scales(const GPT& model, DType dtype);

}  // namespace kvlab
