// One variant of the sweep measured (measure_variant.h): its losses, cache, serving, the cost
// of each cache and matrix dtype, decode speed and samples.
#include "apps/ablate/measure_variant.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>

#include "apps/progress.h"
#include "autograd/graph.h"
#include "checkpoints/model_io.h"
#include "data/sampler.h"
#include "infer/decode/decode_step.h"
#include "infer/engine.h"
#include "infer/kv_cache.h"
#include "infer/kv_scales.h"
#include "infer/measure/bench.h"
#include "infer/measure/kv_quality.h"
#include "infer/measure/kv_workload.h"

namespace kvlab {

namespace fs = std::filesystem;
using nlohmann::json;

double mean_train_tokens_per_s(const fs::path& dir) {
  std::ifstream log(dir / "log.jsonl");
  double sum = 0;
  int n = 0;
  for (std::string line; std::getline(log, line);) {
    const json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || j.value("step", 0) < 2) continue;  // the first steps warm caches
    sum += j.value("tokens_per_s", 0.0);
    ++n;
  }
  return n ? sum / n : 0.0;
}

namespace {

// What n_kv_head buys a server: the serving workload (infer/measure/kv_workload.h; 256 requests,
// lengths scaled to the context) at one KV memory for every variant, that of 16 full-context
// sequences of the multi-head model, through the paged and the contiguous layouts. Blocks of
// 16 positions, fewer for a short context (at most a sixteenth of it): a sequence's last
// block is its only waste, so blocks must be small beside the sequences.
// Returns the memory and block size it used.
KVSimOptions record_kv_workload(json& v, const GPTConfig& mc, int64_t bytes_per_position,
                                DType dtype) {
  GPTConfig mha = mc;
  mha.attn = "gqa";
  mha.n_kv_head = mc.n_head;
  KVSimOptions so;
  so.budget_bytes = 16 * kv_bytes_per_token(mha, dtype) * mc.block_size;
  so.bytes_per_position = bytes_per_position;
  so.context = mc.block_size;
  so.kv_block_size = 1;
  while (so.kv_block_size < 16 && so.kv_block_size * 32 <= mc.block_size) so.kv_block_size *= 2;
  const std::vector<KVRequest> requests =
      make_kv_workload({.context = mc.block_size, .vocab_size = mc.vocab_size});
  const KVLayoutComparison cmp = compare_kv_layouts(requests, so);
  v["kv_workload_budget_bytes"] = so.budget_bytes;
  v["kv_block_size"] = so.kv_block_size;
  v["kv_workload_peak_sequences_paged"] = cmp.paged.peak_resident;
  v["kv_workload_peak_sequences_contiguous"] = cmp.contiguous.peak_resident;
  v["kv_workload_utilisation_paged"] = cmp.paged.utilisation_mean;
  v["kv_workload_utilisation_contiguous"] = cmp.contiguous.utilisation_mean;
  v["kv_workload_steps_paged"] = cmp.paged.steps;
  v["kv_workload_steps_contiguous"] = cmp.contiguous.steps;
  return so;
}

// The serving sweep's arrival rates are these multiples of the first variant's all-at-once
// throughput (the same rates for every variant), each served kServeSweepRuns times so that the
// report can tell a difference from the host's run-to-run spread. A rate is sustained when the
// requests/s served keep up with it (kServeKeepUp of it) and the p99 TTFT stays within
// kServeTtftBoundMs, both as means over the runs.
constexpr double kServeRateFactors[] = {0.4, 0.8, 1.2, 1.6, 2.0};
constexpr int kServeSweepRuns = 2;
constexpr double kServeKeepUp = 0.9;
constexpr double kServeTtftBoundMs = 1000;

// And what continuous batching makes of that memory with the trained model itself: the
// workload's 256 requests, all at once, served by the scheduler's continuous batching over
// the paged cache and by its static batching, as over contiguous caches (bench_serve; one run
// each, so its rates move with the host while its peak concurrency does not); then the
// continuous side alone at the sweep's Poisson rates (set by the first variant measured, in
// `rates`).
void record_serving(json& v, GPT& model, const Tokenizer& tokenizer, const KVSimOptions& so,
                    const AblateConfig& cfg, std::vector<double>& rates) {
  BenchServeOptions o;
  o.requests = 256;
  o.budget_bytes = so.budget_bytes;
  o.kv_block_size = so.kv_block_size;
  o.cache_dtype = cfg.kv_dtype;
  o.int8_products = cfg.int8_products;
  const json r = bench_serve(model, tokenizer, o)["runs"][0];
  for (const auto& [side, name] : {std::pair{"continuous_paged", "continuous"},
                                   std::pair{"static_contiguous", "static"}}) {
    const json& x = r[side];
    v[detail::cat("serve_requests_per_s_", name)] = x["requests_per_s"];
    v[detail::cat("serve_peak_sequences_", name)] = x["peak_sequences"];
    v[detail::cat("serve_ttft_p99_ms_", name)] = x["ttft_ms"]["p99"];
  }
  if (rates.empty())
    for (const double f : kServeRateFactors)
      rates.push_back(f * r["continuous_paged"]["requests_per_s"].get<double>());
  o.rates = rates;
  o.with_static = false;
  std::vector<json> runs;
  for (int i = 0; i < kServeSweepRuns; ++i) runs.push_back(bench_serve(model, tokenizer, o)["runs"]);
  json sweep = json::array();
  double sustained = 0;
  for (size_t k = 0; k < rates.size(); ++k) {
    json point{{"rate", rates[k]}, {"requests_per_s", json::array()},
               {"ttft_p99_ms", json::array()}, {"peak_sequences", json::array()}};
    double served = 0, ttft = 0;
    for (const json& run : runs) {
      const json& x = run[k]["continuous_paged"];
      point["requests_per_s"].push_back(x["requests_per_s"]);
      point["ttft_p99_ms"].push_back(x["ttft_ms"]["p99"]);
      point["peak_sequences"].push_back(x["peak_sequences"]);
      served += x["requests_per_s"].get<double>() / kServeSweepRuns;
      ttft += x["ttft_ms"]["p99"].get<double>() / kServeSweepRuns;
    }
    if (served >= kServeKeepUp * rates[k] && ttft <= kServeTtftBoundMs)
      sustained = std::max(sustained, rates[k]);
    sweep.push_back(point);
  }
  v["serve_sweep"] = sweep;
  v["serve_sustained_rate"] = sustained;
  v["serve_ttft_bound_ms"] = kServeTtftBoundMs;
}

// Per dtype (each seed's list in one order), head(seed 0's figures) and the seeds' mean,
// standard deviation and per-seed values of loss, delta_loss, kl and top1 (KVQuality's or
// WeightQuality's), as <name>_mean, <name>_std and <name>_seeds.
template <class Q, class Head>
json seed_stats(const std::vector<std::vector<Q>>& seeds, Head head) {
  json out = json::array();
  for (size_t d = 0; d < seeds[0].size(); ++d) {
    json e = head(seeds[0][d]);
    for (const auto& [name, field] :
         {std::pair{"loss", &Q::loss}, std::pair{"delta_loss", &Q::delta_loss},
          std::pair{"kl", &Q::kl}, std::pair{"top1", &Q::top1}}) {
      std::vector<double> per_seed;
      for (const auto& q : seeds) per_seed.push_back(q[d].*field);
      const auto [mean, sd] = mean_std(per_seed);
      e[std::string(name) + "_mean"] = mean;
      e[std::string(name) + "_std"] = sd;
      e[std::string(name) + "_seeds"] = per_seed;
    }
    out.push_back(e);
  }
  return out;
}

// What each cache dtype of cfg.kv_dtypes (kv_cache_quality) and each matrix type of
// cfg.weight_dtypes (weight_quality) costs the variant's every seed, on the same fixed
// validation windows: per dtype, its bytes (per token of cache; of weights a decode step
// reads) and the seeds' mean and standard deviation of the loss, its delta to f32, the mean
// KL and top-1 agreement. Into v's kv_quality and weight_quality (with the f32 model's
// decode_weight_bytes_f32); either list empty leaves its key out. `dtypes`: cfg.kv_dtypes,
// or none where the caches cannot run (on CUDA).
void record_quality(const AblateConfig& cfg, const AblateVariant& var,
                    const std::vector<DType>& dtypes, json& v) {
  const std::vector<WeightDtype>& wdtypes = cfg.weight_dtypes;
  if (dtypes.empty() && wdtypes.empty()) return;
  const Corpus corpus = load_run_corpus(cfg.base);
  std::vector<std::vector<KVQuality>> kv_seeds;
  std::vector<std::vector<WeightQuality>> weight_seeds;
  int64_t f32_weight_bytes = 0;
  for (int s = 0; s < cfg.seeds; ++s) {
    LoadedModel lm = load_model(ablation_run_dir(cfg, var, s) / "final.h5");
    if (!dtypes.empty()) {
      std::fprintf(stderr, "%s seed %d: cache quality at %zu dtypes\n",
                   variant_label(var).c_str(), s, dtypes.size());
      kv_seeds.push_back(
          kv_cache_quality_on(*lm.model, validation_split(corpus), dtypes, cfg.quality_windows));
    }
    if (!wdtypes.empty()) {
      std::fprintf(stderr, "%s seed %d: weight quality at %zu dtypes\n",
                   variant_label(var).c_str(), s, wdtypes.size());
      weight_seeds.push_back(weight_quality_on(*lm.model, validation_split(corpus), wdtypes,
                                               cfg.quality_windows, cfg.int8_products));
      f32_weight_bytes = DecodeStep(*lm.model).weight_bytes();
    }
  }
  if (!dtypes.empty())
    v["kv_quality"] = seed_stats(kv_seeds, [](const KVQuality& q) {
      return json{{"dtype", dtype_name(q.dtype)},
                  {"bytes_per_token", q.bytes_per_token},
                  {"positions", q.positions}};
    });
  if (!wdtypes.empty()) {
    v["decode_weight_bytes_f32"] = f32_weight_bytes;
    v["weight_quality"] = seed_stats(weight_seeds, [](const WeightQuality& q) {
      return json{{"dtype", weight_dtype_name(q.dtype)},
                  {"int8_products", q.int8_products},
                  {"decode_weight_bytes", q.decode_weight_bytes},
                  {"positions", q.positions}};
    });
  }
}

// Its runs' validation curves and losses: per seed, and the seeds' mean and spread, in nats
// per token and in bits per byte of the validation text (comparable across tokenizers).
void record_losses(const AblateConfig& cfg, const AblateVariant& var, double tokens_per_byte,
                   json& v) {
  std::vector<double> vals, bpbs, accuracies;
  double train_tps = 0;
  for (int s = 0; s < cfg.seeds; ++s) {
    const fs::path dir = ablation_run_dir(cfg, var, s);
    json run;
    run["seed"] = cfg.base.seed + static_cast<uint64_t>(s);
    run["curve"] = read_curve(dir);
    KVLAB_CHECK(!run["curve"].empty(), "ablate: ", (dir / "log.jsonl").string(),
                " holds no validation loss");
    const double val = run["curve"].back()["val_loss"].get<double>();
    run["val_loss"] = val;
    run["train_tokens_per_s"] = mean_train_tokens_per_s(dir);
    train_tps += run["train_tokens_per_s"].get<double>();
    run["val_bpb"] = bits_per_byte(val, tokens_per_byte);
    vals.push_back(val);
    bpbs.push_back(run["val_bpb"].get<double>());
    if (const json& last = run["curve"].back(); last.contains("val_accuracy")) {
      run["val_accuracy"] = last["val_accuracy"];
      accuracies.push_back(last["val_accuracy"].get<double>());
    }
    v["runs"].push_back(run);
  }
  const auto [mean, sd] = mean_std(vals);
  v["val_loss_mean"] = mean;
  v["val_loss_std"] = sd;
  v["bpc"] = mean / std::log(2.0);  // bits per token: per character for a char tokenizer
  const auto [bpb_mean, bpb_sd] = mean_std(bpbs);
  v["val_bpb_mean"] = bpb_mean;
  v["val_bpb_std"] = bpb_sd;
  if (accuracies.size() == vals.size()) {  // a task's runs: the answers' accuracy
    const auto [acc_mean, acc_sd] = mean_std(accuracies);
    v["val_accuracy_mean"] = acc_mean;
    v["val_accuracy_std"] = acc_sd;
  }
  v["val_tokens_per_byte"] = tokens_per_byte;
  v["train_tokens_per_s"] = train_tps / cfg.seeds;
}

// The cache, measured by the inference engine's cache for one full-context sequence against
// its formula, and the serving workload at one KV memory (record_kv_workload), whose memory
// and block size it returns.
KVSimOptions record_cache(const AblateConfig& cfg, const GPT& model, double tokens_per_byte,
                          json& v) {
  const GPTConfig& mc = model.config();
  ContiguousKVCache cache(kv_cache_layout(mc, cfg.kv_dtype), 1, mc.block_size, cfg.base.device,
                          kv_cache_scales(model, cfg.kv_dtype));
  const int64_t measured = cache.bytes();
  v["cache_bytes_context_measured"] = measured;
  v["cache_bytes_context_formula"] = kv_cache_formula_bytes(mc, 1, mc.block_size, cfg.kv_dtype);
  v["cache_bytes_per_token"] = measured / mc.block_size;
  // What the cache holds per byte of text: fewer, longer tokens hold more text a row.
  v["cache_bytes_per_byte"] =
      static_cast<double>(measured) / static_cast<double>(mc.block_size) * tokens_per_byte;
  v["sequences_in_budget"] = cfg.kv_budget_bytes / measured;
  return record_kv_workload(v, mc, measured / mc.block_size, cfg.kv_dtype);
}

// Batch-1 decode speed with and without the cache, over the rest of the context.
void record_decode_speed(const AblateConfig& cfg, const AblateVariant& var, LoadedModel& lm,
                         int64_t prompt_len, const std::optional<PagedCacheOptions>& paged,
                         json& v) {
  BenchGenerateOptions bo;
  bo.prompt_tokens = prompt_len;
  bo.new_tokens = {lm.model->config().block_size - prompt_len};
  bo.runs = cfg.bench_runs;
  bo.position_points = 0;
  bo.cache_dtype = cfg.kv_dtype;
  bo.int8_products = cfg.int8_products;
  bo.paged = paged;
  if (bo.paged) bo.paged->prefix_caching = false;  // each run feeds the same prompts
  TaskBars bars(variant_label(var) + " decode: ", "tok");
  bo.on_tokens = std::bind_front(&TaskBars::update, &bars);
  const json b = bench_generate(*lm.model, lm.tokenizer, bo);
  const json& r = b["results"][0];
  v["decode_tokens_per_s_cache"] = r["cache"]["tokens_per_s"];
  v["decode_tokens_per_s_nocache"] = r["no_cache"]["tokens_per_s"];
  v["ttft_ms"] = r["cache"]["ttft_ms"];
  v["tpot_ms"] = r["cache"]["tpot_mean_ms"];
  v["tpot_p99_ms"] = r["cache"]["tpot_p99_ms"];
  v["bench_new_tokens"] = r["new_tokens"];
}

// Greedy and sampled continuations of the sweep's prompts (cfg.prompts, else two fixed windows
// of the validation split).
void record_samples(const AblateConfig& cfg, LoadedModel& lm, int64_t prompt_len,
                    const std::optional<PagedCacheOptions>& paged, json& v) {
  Engine engine(*lm.model, lm.tokenizer, cfg.kv_dtype, paged);
  engine.decode_step().int8_products = cfg.int8_products;
  std::vector<std::string> prompts = cfg.prompts;
  if (prompts.empty()) {
    const Corpus corpus = load_run_corpus(cfg.base);
    for (int64_t start : fixed_windows(static_cast<int64_t>(corpus.val.size()),
                                       static_cast<int>(prompt_len), 2, 99)) {
      const std::span<const int32_t> ids(corpus.val.data() + start, static_cast<size_t>(prompt_len));
      prompts.push_back(corpus.tokenizer.decode(ids));
    }
  }
  GenerateOptions greedy;
  greedy.max_new_tokens =
      std::min<int64_t>(cfg.sample_tokens, lm.model->config().block_size - prompt_len);
  greedy.sampling.temperature = 0;
  GenerateOptions sampled = greedy;
  sampled.sampling.temperature = 0.8;
  sampled.sampling.seed = 1;
  const auto g = engine.generate(prompts, greedy);
  const auto s = engine.generate(prompts, sampled);
  for (size_t p = 0; p < prompts.size(); ++p)
    v["samples"].push_back({{"prompt", prompts[p]}, {"greedy", g.rows[p].text},
                            {"sampled", s.rows[p].text}, {"seed", 1}, {"temperature", 0.8}});
}

}  // namespace

json measure_variant(const AblateConfig& cfg, const AblateVariant& var, int64_t prompt_len,
                     double tokens_per_byte, std::vector<double>& serve_rates) {
  json v;
  if (var.mla_rank > 0) {
    v["kv_lora_rank"] = var.mla_rank;
    v["rope_head_dim"] = ablation_rope_head_dim(cfg);
  } else {
    v["n_kv_head"] = var.n_kv_head;
  }
  record_losses(cfg, var, tokens_per_byte, v);

  std::fprintf(stderr, "measuring %s: cache, decode speed, samples\n",
               variant_label(var).c_str());
  LoadedModel lm = load_model(ablation_run_dir(cfg, var, 0) / "final.h5");
  lm.model->round_matrices(cfg.weight_dtype);
  lm.model->to(cfg.base.device);  // measured where the runs trained, at their precision
  const MatmulPrecisionGuard precision(cfg.base.precision);
  v["params"] = lm.model->num_parameters();
  v["mlp_hidden"] = lm.model->config().hidden();
  const KVSimOptions workload = record_cache(cfg, *lm.model, tokens_per_byte, v);
  const bool cpu = cfg.base.device == Device::CPU;
  // The scheduler's paged cache and the quantised caches run on the CPU only; the matrices'
  // types are measured on the models as loaded (the CPU).
  if (cpu) record_serving(v, *lm.model, lm.tokenizer, workload, cfg, serve_rates);
  record_quality(cfg, var, cpu ? cfg.kv_dtypes : std::vector<DType>{}, v);
  // Generation's cache: paged on the CPU, contiguous on CUDA (where the paged one is not).
  const std::optional<PagedCacheOptions> paged =
      cpu ? std::optional(PagedCacheOptions{}) : std::nullopt;
  record_decode_speed(cfg, var, lm, prompt_len, paged, v);
  record_samples(cfg, lm, prompt_len, paged, v);
  return v;
}

}  // namespace kvlab
