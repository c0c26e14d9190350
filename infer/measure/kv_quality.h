#pragma once
// What a KV cache's element type, or the matrices' (weight_quality), costs in quality. The cache type is an inference choice, so
// a trained model is evaluated at each: every validation window is prefilled into a fresh
// cache of that dtype and its next-token distributions are read from that cached forward, so
// its keys and values pass through the cache's quantisation exactly as a cached decoder reads
// them (tests/infer/test_kv_quality.cpp checks that token-by-token cached decoding gives the
// same logits). Each dtype is compared with the f32 cache on the same windows.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "autograd/backend/device.h"
#include "checkpoints/model_io.h"
#include "data/corpus.h"
#include "infer/kv_scales.h"
#include "nn/gpt.h"

namespace kvlab {

// A validation split as the measurements read it: its ids and, for a task's split
// (Corpus::val_targets and example_tokens), the scored targets and the example length. Windows
// are then whole examples and only the targets are scored.
struct ValidationSplit {
  std::vector<int32_t> ids, targets;
  int64_t period = 0;
};
ValidationSplit validation_split(const Corpus& corpus);

// The evaluation mode's forward: tokens (B, T) prefilled into a fresh contiguous cache of
// `dtype` (fp8 with fp8_kv_scales), returning every position's logits (B, T, V), without
// gradients. Keys and values reach the attention as the cache holds them.
Tensor cached_prefill_logits(GPT& model, const Tensor& tokens, DType dtype);

struct KVQuality {
  DType dtype = DType::F32;
  int64_t bytes_per_token = 0;  // 2 L NKV kv_row_bytes(dtype, HS): K and V of every layer
  double loss = 0;              // mean next-token cross-entropy (nats) with this cache
  double delta_loss = 0;        // loss minus the f32 cache's, on the same windows
  double kl = 0;                // mean KL(p_f32 || p_dtype) of the next-token distributions
  double top1 = 0;              // fraction of positions whose argmax is the f32 cache's
  int64_t positions = 0;        // predictions compared
};

// x and y (N, T) row-major, y the next tokens (data/sampler.h's fill_windows), on a CPU model
// with T <= block_size: one KVQuality per dtype, in order, each against the f32 cache. Forwards
// `batch` windows at a time, without gradients. Throws where a dtype cannot hold the model's
// keys and values (kv_dtype_problem) or a quantised cache meets a non-finite value.
std::vector<KVQuality> kv_cache_quality(GPT& model, std::span<const int32_t> x,
                                        std::span<const int32_t> y, int64_t T,
                                        std::span<const DType> dtypes, int64_t batch = 16);

// What the products' matrices' type costs (GPT::round_matrices): the same measures, each
// WeightDtype's model (a copy of `model`, its matrices rounded) against `model` itself, both
// through an f32 cache. decode_weight_bytes: what a fused CPU decode step reads of that
// model's weights (DecodeStep::weight_bytes). int8_products: the q8_0 and q4_0 models are
// scored through the fused decode step with integer products (DecodeStep::int8_products),
// each window position by position, as serving them computes; the others as above.
struct WeightQuality {
  WeightDtype dtype = WeightDtype::F32;
  bool int8_products = false;
  int64_t decode_weight_bytes = 0;
  double loss = 0, delta_loss = 0, kl = 0, top1 = 0;
  int64_t positions = 0;
};
std::vector<WeightQuality> weight_quality(const GPT& model, std::span<const int32_t> x,
                                          std::span<const int32_t> y, int64_t T,
                                          std::span<const WeightDtype> dtypes,
                                          bool int8_products = false, int64_t batch = 16);
// weight_quality on kv_cache_quality_on's windows.
std::vector<WeightQuality> weight_quality_on(const GPT& model, const ValidationSplit& split,
                                             std::span<const WeightDtype> dtypes, int windows,
                                             bool int8_products = false, uint64_t seed = 4321);
// Logits (B, T, V) of tokens (B, T), every position one fused decode step into an f32 cache
// (int8_products: DecodeStep's), as a decoder computes them token by token.
Tensor stepwise_logits(const GPT& model, const Tensor& tokens, bool int8_products);

// kv_cache_quality over `windows` fixed windows of block_size + 1 tokens of `ids` (a corpus's
// validation split; data/sampler.h's fixed_windows with `seed`, the same for every model).
std::vector<KVQuality> kv_cache_quality_on(GPT& model, const ValidationSplit& split,
                                           std::span<const DType> dtypes, int windows,
                                           uint64_t seed = 4321);

// The validation split of a checkpoint trained on a task (train --task mqar; /config says so)
// when no `data` is given: the task's examples, their scored targets and their length.
// Otherwise the text split below, with no targets and period 0. data_flag: the flag that gives
// `data` on the caller's command line, named by the error when neither says which text to read.
ValidationSplit checkpoint_validation_split(const LoadedModel& loaded, const std::string& data,
                                            std::string* used = nullptr,
                                            std::string_view data_flag = "--data");
// The validation split a checkpoint was trained against, in its own tokenizer's ids: `data`,
// else the corpus its /config names, split by its val_fraction (0.1 if it records none) and
// tokenized by its tokenizer kind. Characters the checkpoint never saw are an error that lists
// them. Sets *used to the corpus file read.
std::vector<int32_t> checkpoint_validation_ids(const LoadedModel& loaded, const std::string& data,
                                               std::string* used = nullptr,
                                               std::string_view data_flag = "--data");

}  // namespace kvlab
