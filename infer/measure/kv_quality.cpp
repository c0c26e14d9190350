#include "infer/measure/kv_quality.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "autograd/graph.h"
#include "data/corpus.h"
#include "data/sampler.h"
#include "infer/decode/decode_step.h"
#include "infer/kv_cache.h"
#include "infer/measure/model_eval.h"
#include "platform/error.h"
#include "platform/kv_rows.h"

namespace kvlab {

Tensor cached_prefill_logits(GPT& model, const Tensor& tokens, DType dtype) {
  const GPTConfig& c = model.config();
  KVLAB_CHECK(tokens.dim() == 2, "kv cache quality: tokens must be (B, T), got ",
              tokens.shape_str());
  const NoGradGuard no_grad;
  ContiguousKVCache cache(kv_cache_layout(c, dtype), tokens.size(0), tokens.size(1), Device::CPU,
                          kv_cache_scales(model, dtype));
  return model.forward(tokens, &cache).contiguous();
}

Tensor stepwise_logits(const GPT& model, const Tensor& tokens, bool int8_products) {
  const GPTConfig& c = model.config();
  const int64_t B = tokens.size(0), T = tokens.size(1), V = c.vocab_size;
  DecodeStep step(model);
  step.int8_products = int8_products;
  const DecodeStep::PackGuard pack = step.pack();
  const NoGradGuard no_grad;
  ContiguousKVCache cache(kv_cache_layout(c, DType::F32), B, T, Device::CPU,
                          kv_cache_scales(model, DType::F32));
  Tensor out = Tensor::empty({B, T, V});
  const Tensor ids = tokens.contiguous();
  std::vector<int32_t> column(static_cast<size_t>(B));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < B; ++b) column[static_cast<size_t>(b)] = ids.data<int32_t>()[b * T + t];
    const Tensor logits = step.forward(Tensor::from_vector(column, {B, 1}), cache).contiguous();
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(logits.data<float>() + b * V, V, out.data<float>() + (b * T + t) * V);
  }
  return out;
}

namespace {

// A copy of `model` (its config and every parameter's values) with its matrices rounded.
std::unique_ptr<GPT> rounded_copy(const GPT& model, WeightDtype dtype) {
  auto copy = std::make_unique<GPT>(model.config(), GPT::WeightsToLoad{});
  std::map<std::string, Tensor> source;
  for (const auto& [name, t] : const_cast<GPT&>(model).named_parameters()) source.emplace(name, t);
  for (auto& [name, t] : copy->named_parameters()) t.copy_from(source.at(name));
  copy->round_matrices(dtype);
  return copy;
}

// The windows (N, T) of x and y, checked as kv_cache_quality checks them.
void check_windows(const GPT& model, std::span<const int32_t> x, std::span<const int32_t> y,
                   int64_t T, int64_t batch, const char* what) {
  KVLAB_CHECK(model.wte.weight.device() == Device::CPU, what, ": the model must be on the CPU");
  KVLAB_CHECK(T >= 1 && T <= model.config().block_size && x.size() == y.size() && !x.empty() &&
                  x.size() % static_cast<size_t>(T) == 0 && batch >= 1,
              what, ": ", x.size(), " inputs and ", y.size(), " targets are not (N, T) windows of T = ",
              T, " <= block_size ", model.config().block_size);
}

// `windows` fixed windows of block_size T over ids and their targets, the same for every
// model measured (data/sampler.h's fixed_windows and fill_windows).
struct QualityWindows {
  int64_t T;
  std::vector<int32_t> x, y;
  QualityWindows(const GPT& model, const ValidationSplit& split, int windows, uint64_t seed)
      : T(model.config().block_size) {
    const std::vector<int32_t>& ids = split.ids;
    KVLAB_CHECK(windows >= 1, "quality: windows must be >= 1, got ", windows);
    KVLAB_CHECK(static_cast<int64_t>(ids.size()) > T + 1, "quality: ", ids.size(),
                " validation tokens hold no window of block_size ", T, " and its targets");
    const auto t = static_cast<int>(T);
    fill_windows(ids,
                 fixed_windows(static_cast<int64_t>(ids.size()), t, windows, seed, split.period),
                 t, x, y, split.targets.empty() ? nullptr : &split.targets);
  }
};

// Predictions a window set scores (a task's: its targets alone).
int64_t scored_positions(std::span<const int32_t> y) {
  return std::count_if(y.begin(), y.end(), [](int32_t t) { return t >= 0; });
}

}  // namespace

std::vector<KVQuality> kv_cache_quality(GPT& model, std::span<const int32_t> x,
                                        std::span<const int32_t> y, int64_t T,
                                        std::span<const DType> dtypes, int64_t batch) {
  const GPTConfig& c = model.config();
  check_windows(model, x, y, T, batch, "kv cache quality");
  for (const DType d : dtypes) {
    const std::string problem = kv_dtype_problem(d, c.cache_width());
    KVLAB_CHECK(problem.empty(), "kv cache quality: ", problem);
  }
  // The f32 cache is the reference every dtype's KL and top-1 agreement are taken against.
  auto with_cache = [&model](DType d) -> LogitsFn {
    return [&model, d](const Tensor& tokens) { return cached_prefill_logits(model, tokens, d); };
  };
  std::vector<LogitsFn> caches{with_cache(DType::F32)};
  for (const DType d : dtypes) caches.push_back(with_cache(d));
  const std::vector<WindowScores> scores = score_windows(caches, x, y, T, c.vocab_size, batch);
  const double ref_loss = scored_mean(scores[0].token_loss);
  std::vector<KVQuality> out(dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    KVQuality& q = out[i];
    const WindowScores& s = scores[i + 1];
    q.dtype = dtypes[i];
    q.bytes_per_token = kv_bytes_per_token(c, q.dtype);
    q.loss = scored_mean(s.token_loss);
    q.delta_loss = q.loss - ref_loss;
    q.kl = s.kl;
    q.top1 = s.top1;
    q.positions = scored_positions(y);
  }
  return out;
}


std::vector<WeightQuality> weight_quality(const GPT& model, std::span<const int32_t> x,
                                          std::span<const int32_t> y, int64_t T,
                                          std::span<const WeightDtype> dtypes,
                                          bool int8_products, int64_t batch) {
  check_windows(model, x, y, T, batch, "weight quality");
  std::vector<std::unique_ptr<GPT>> models;
  models.push_back(rounded_copy(model, WeightDtype::F32));  // the reference
  for (const WeightDtype d : dtypes) models.push_back(rounded_copy(model, d));
  std::vector<char> in_integers(models.size());  // models[i] scored with integer products
  for (size_t i = 1; i < models.size(); ++i) {
    DecodeStep step(*models[i]);
    step.int8_products = int8_products;
    in_integers[i] = step.multiplies_in_integers();
  }
  std::vector<LogitsFn> fns;
  for (size_t i = 0; i < models.size(); ++i)
    if (in_integers[i] != 0)
      fns.push_back([&m = *models[i]](const Tensor& t) { return stepwise_logits(m, t, true); });
    else
      fns.push_back([&m = *models[i]](const Tensor& t) { return cached_prefill_logits(m, t, DType::F32); });
  const std::vector<WindowScores> scores =
      score_windows(fns, x, y, T, model.config().vocab_size, batch);
  const double ref_loss = scored_mean(scores[0].token_loss);
  std::vector<WeightQuality> out(dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const WindowScores& s = scores[i + 1];
    const double loss = scored_mean(s.token_loss);
    out[i] = {dtypes[i],        in_integers[i + 1] != 0, DecodeStep(*models[i + 1]).weight_bytes(),
              loss,             loss - ref_loss,         s.kl,
              s.top1,           scored_positions(y)};
  }
  return out;
}

std::vector<WeightQuality> weight_quality_on(const GPT& model, const ValidationSplit& split,
                                             std::span<const WeightDtype> dtypes, int windows,
                                             bool int8_products, uint64_t seed) {
  const QualityWindows w(model, split, windows, seed);
  return weight_quality(model, w.x, w.y, w.T, dtypes, int8_products);
}

std::vector<KVQuality> kv_cache_quality_on(GPT& model, const ValidationSplit& split,
                                           std::span<const DType> dtypes, int windows,
                                           uint64_t seed) {
  const QualityWindows w(model, split, windows, seed);
  return kv_cache_quality(model, w.x, w.y, w.T, dtypes);
}

ValidationSplit validation_split(const Corpus& corpus) {
  return {corpus.val, corpus.val_targets, corpus.example_tokens};
}

ValidationSplit checkpoint_validation_split(const LoadedModel& loaded, const std::string& data,
                                            std::string* used, std::string_view data_flag) {
  const std::optional<MqarSettings> task =
      data.empty() ? get_mqar_settings(loaded.checkpoint.config, loaded.path) : std::nullopt;
  if (!task) return {checkpoint_validation_ids(loaded, data, used, data_flag), {}, 0};
  const Corpus c = mqar_corpus(*task, loaded.model->config().block_size);
  if (used != nullptr) *used = c.path;
  return validation_split(c);
}

std::vector<int32_t> checkpoint_validation_ids(const LoadedModel& loaded, const std::string& data,
                                               std::string* used, std::string_view data_flag) {
  const Attrs& config = loaded.checkpoint.config;
  auto text = [&](const char* key) -> std::string {
    const auto it = config.find(key);
    return it != config.end() && std::holds_alternative<std::string>(it->second)
               ? std::get<std::string>(it->second)
               : "";
  };
  const std::string file = data.empty() ? text("corpus") : data;
  KVLAB_CHECK(!file.empty(), loaded.path.string(),
              " records no training corpus (an imported or GGUF model): give the text to score (",
              data_flag, ")");
  const auto vf = config.find("val_fraction");
  const double val_fraction = vf != config.end() && std::holds_alternative<double>(vf->second)
                                  ? std::get<double>(vf->second)
                                  : 0.1;
  const std::string kind = text("tokenizer");
  BpeSettings bpe;  // a bpe run's split is the one its vocabulary was learnt beside
  if (const BpeTokenizer* vocab = loaded.tokenizer.bpe(); vocab != nullptr)
    bpe = {vocab->vocab_size(), vocab->pattern(), {}};
  const Corpus corpus = load_corpus(file, Tokenizer::parse_kind(kind.empty() ? "char" : kind),
                                    val_fraction, true, bpe);
  if (used != nullptr) *used = file;
  return loaded.tokenizer.encode(corpus.tokenizer.decode(corpus.val), "the validation text");
}

}  // namespace kvlab
