#include "infer/measure/kv_quality.h"

#include <algorithm>
#include <cmath>

#include "autograd/backend/kv_format.h"
#include "autograd/graph.h"
#include "data/corpus.h"
#include "data/sampler.h"
#include "infer/kv_cache.h"
#include "platform/error.h"

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

namespace {

// log-softmax of one row of V logits into out (double).
void log_softmax(const float* logits, int64_t V, std::vector<double>& out) {
  out.resize(static_cast<size_t>(V));
  const float mx = *std::max_element(logits, logits + V);
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(double(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int64_t i = 0; i < V; ++i) out[static_cast<size_t>(i)] = logits[i] - lse;
}

}  // namespace

std::vector<KVQuality> kv_cache_quality(GPT& model, std::span<const int32_t> x,
                                        std::span<const int32_t> y, int64_t T,
                                        std::span<const DType> dtypes, int64_t batch) {
  const GPTConfig& c = model.config();
  KVLAB_CHECK(model.wte.weight.device() == Device::CPU,
              "kv cache quality: the model must be on the CPU, where the quantised caches are");
  KVLAB_CHECK(T >= 1 && T <= c.block_size && x.size() == y.size() && !x.empty() &&
                  x.size() % static_cast<size_t>(T) == 0 && batch >= 1,
              "kv cache quality: ", x.size(), " inputs and ", y.size(),
              " targets are not (N, T) windows of T = ", T, " <= block_size ", c.block_size);
  for (const DType d : dtypes) {
    const std::string problem = kv_dtype_problem(d, c.cache_width());
    KVLAB_CHECK(problem.empty(), "kv cache quality: ", problem);
  }
  const int64_t N = static_cast<int64_t>(x.size()) / T, V = c.vocab_size;
  std::vector<KVQuality> out(dtypes.size());
  double ref_loss = 0;
  std::vector<double> ref, lp;
  for (int64_t n0 = 0; n0 < N; n0 += batch) {
    const int64_t b = std::min(batch, N - n0);
    const Tensor tokens = Tensor::from_vector(
        std::vector<int32_t>(x.begin() + n0 * T, x.begin() + (n0 + b) * T), {b, T});
    const Tensor f32 = cached_prefill_logits(model, tokens, DType::F32);  // (b, T, V)
    std::vector<Tensor> quant;
    for (const DType d : dtypes) quant.push_back(cached_prefill_logits(model, tokens, d));
    for (int64_t r = 0; r < b * T; ++r) {
      const int32_t target = y[static_cast<size_t>(n0 * T + r)];
      const float* fl = f32.data<float>() + r * V;
      log_softmax(fl, V, ref);
      ref_loss -= ref[static_cast<size_t>(target)];
      const int64_t ref_top = std::max_element(fl, fl + V) - fl;
      for (size_t i = 0; i < dtypes.size(); ++i) {
        const float* ql = quant[i].data<float>() + r * V;
        log_softmax(ql, V, lp);
        double kl = 0;
        for (int64_t v = 0; v < V; ++v) {
          const auto vi = static_cast<size_t>(v);
          kl += std::exp(ref[vi]) * (ref[vi] - lp[vi]);
        }
        out[i].loss -= lp[static_cast<size_t>(target)];
        out[i].kl += kl;
        out[i].top1 += (std::max_element(ql, ql + V) - ql) == ref_top ? 1 : 0;
      }
    }
  }
  const double positions = static_cast<double>(N * T);
  for (size_t i = 0; i < dtypes.size(); ++i) {
    KVQuality& q = out[i];
    q.dtype = dtypes[i];
    q.bytes_per_token = kv_bytes_per_token(c, q.dtype);
    q.loss /= positions;
    q.delta_loss = q.loss - ref_loss / positions;
    q.kl /= positions;
    q.top1 /= positions;
    q.positions = N * T;
  }
  return out;
}

std::vector<KVQuality> kv_cache_quality_on(GPT& model, const std::vector<int32_t>& ids,
                                           std::span<const DType> dtypes, int windows,
                                           uint64_t seed) {
  const auto T = static_cast<int>(model.config().block_size);
  KVLAB_CHECK(windows >= 1, "kv cache quality: windows must be >= 1, got ", windows);
  KVLAB_CHECK(static_cast<int64_t>(ids.size()) > T + 1, "kv cache quality: ", ids.size(),
              " validation tokens hold no window of block_size ", T, " and its targets");
  const std::vector<int64_t> starts =
      fixed_windows(static_cast<int64_t>(ids.size()), T, windows, seed);
  std::vector<int32_t> x, y;
  fill_windows(ids, starts, T, x, y);
  return kv_cache_quality(model, x, y, T, dtypes);
}

std::vector<int32_t> checkpoint_validation_ids(const LoadedModel& loaded, const std::string& data,
                                               std::string* used) {
  const Attrs& config = loaded.checkpoint.config;
  auto text = [&](const char* key) -> std::string {
    const auto it = config.find(key);
    return it != config.end() && std::holds_alternative<std::string>(it->second)
               ? std::get<std::string>(it->second)
               : "";
  };
  const std::string file = data.empty() ? text("corpus") : data;
  KVLAB_CHECK(!file.empty(), "the checkpoint records no corpus: give its data file (--data)");
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
