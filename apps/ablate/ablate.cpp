#include "apps/ablate/ablate.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>

#include "apps/ablate/generation_quality.h"
#include "apps/ablate/train_runs.h"
#include "apps/ablate/uptrain.h"
#include "apps/progress.h"
#include "report/report.h"
#include "apps/train_progress.h"
#include "autograd/graph.h"
#include "checkpoints/model_io.h"
#include "data/sampler.h"
#include "infer/decode/decode_step.h"
#include "infer/engine.h"
#include "infer/kv_cache.h"
#include "infer/measure/bench.h"
#include "infer/measure/kv_quality.h"
#include "infer/measure/kv_workload.h"
#include "platform/blas_core.h"
#include "platform/cpu.h"
#include "train/output_dir.h"

namespace kvlab {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path run_dir(const AblateConfig& cfg, const AblateVariant& var, int seed_index) {
  return ablation_run_dir(cfg, var, seed_index);
}

// How progress lines name a variant.
std::string variant_label(const AblateVariant& var) {
  return var.mla_rank > 0 ? detail::cat("MLA rank ", var.mla_rank)
                          : detail::cat("n_kv_head=", var.n_kv_head);
}

// MLP width that brings `c` closest to `target` parameters (the count is linear in it).
int64_t matched_hidden(GPTConfig c, int64_t target) {
  c.mlp_hidden = 1;
  const int64_t at1 = count_parameters(c);
  c.mlp_hidden = 2;
  const int64_t per_unit = count_parameters(c) - at1;
  const double h = 1.0 + static_cast<double>(target - at1) / static_cast<double>(per_unit);
  return std::max<int64_t>(1, std::llround(h));
}

std::string now_iso() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

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

}  // namespace

json read_curve(const fs::path& dir) {
  json curve = json::array();
  std::ifstream log(dir / "log.jsonl");
  for (std::string line; std::getline(log, line);) {
    const json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("val_loss")) continue;
    // train_loss is null at step 0, which trained nothing.
    curve.push_back({{"step", j["step"]},
                     {"val_loss", j["val_loss"]},
                     {"val_bpb", j.value("val_bpb", json())},
                     {"train_loss", j.value("train_loss", json())}});
  }
  return curve;
}

std::pair<double, double> mean_std(const std::vector<double>& xs) {
  double sum = 0, sum2 = 0;
  for (double x : xs) sum += x, sum2 += x * x;
  const double n = static_cast<double>(xs.size()), mean = sum / n;
  const double sd = n > 1 ? std::sqrt(std::max(0.0, (sum2 - n * mean * mean) / (n - 1))) : 0.0;
  return {mean, sd};
}

std::string AblateVariant::name() const {
  return mla_rank > 0 ? "mla" + std::to_string(mla_rank) : "kv" + std::to_string(n_kv_head);
}

std::vector<AblateVariant> ablation_variants(const AblateConfig& cfg) {
  std::vector<AblateVariant> out;
  for (int64_t kv : cfg.kv_heads) out.push_back({kv, 0});
  for (int64_t r : cfg.mla_ranks) out.push_back({cfg.base.model.n_head, r});
  return out;
}

fs::path ablation_run_dir(const AblateConfig& cfg, const AblateVariant& var, int seed_index) {
  return fs::path(cfg.out_dir) / "runs" / (var.name() + "_seed" + std::to_string(seed_index));
}

std::string mla_ranks_problem(const std::vector<int64_t>& ranks, const GPTConfig& base) {
  const int64_t n_embd = base.n_embd;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 1 || ranks[i] > n_embd)
      return detail::cat("MLA rank ", ranks[i], " must be in [1, n_embd = ", n_embd, "]");
    if (std::find(ranks.begin(), ranks.begin() + static_cast<std::ptrdiff_t>(i), ranks[i]) !=
        ranks.begin() + static_cast<std::ptrdiff_t>(i))
      return detail::cat("MLA rank ", ranks[i], " is listed twice");
  }
  if (!ranks.empty() && !base.rope())
    return "MLA needs rotary positions (--pos rope or --arch llama): its decoupled key is "
           "rotary, and the GQA variants then use RoPE too, so that only the attention differs";
  return "";
}

int64_t ablation_rope_head_dim(const AblateConfig& cfg) {
  if (cfg.mla_rope_head_dim > 0) return cfg.mla_rope_head_dim;
  // DeepSeek-V2's proportion: a rotary key of half a head.
  return std::max<int64_t>(2, cfg.base.model.head_size() / 4 * 2);
}

std::string kv_heads_problem(const std::vector<int64_t>& kv_heads, int64_t n_head) {
  for (size_t i = 0; i < kv_heads.size(); ++i) {
    const int64_t k = kv_heads[i];
    if (k < 1 || k > n_head)
      return detail::cat("n_kv_head = ", k, " must be in [1, ", n_head, "] (n_head = ", n_head,
                         ")");
    if (n_head % k != 0)
      return detail::cat("n_head = ", n_head, " is not divisible by n_kv_head = ", k,
                         " (use divisors of n_head, e.g. ", n_head, ",",
                         n_head / 2 > 0 ? n_head / 2 : 1, ",1)");
    if (std::find(kv_heads.begin(), kv_heads.begin() + static_cast<std::ptrdiff_t>(i), k) !=
        kv_heads.begin() + static_cast<std::ptrdiff_t>(i))
      return detail::cat("n_kv_head = ", k, " is listed twice");
  }
  return "";
}

std::vector<TrainConfig> plan_ablation(AblateConfig& cfg) {
  TrainConfig& base = cfg.base;
  const int64_t nh = base.model.n_head;
  KVLAB_CHECK(nh >= 1, "ablate: n_head must be >= 1, got ", nh);
  KVLAB_CHECK(!base.model.mla(), "ablate: the sweep's base attention is GQA's; MLA variants "
              "are added by their ranks (--mla-ranks)");
  if (cfg.kv_heads.empty())
    for (int64_t k = nh; k >= 1; --k)
      if (nh % k == 0) cfg.kv_heads.push_back(k);
  KVLAB_CHECK(!cfg.kv_heads.empty(), "ablate: the list of n_kv_head values is empty");
  const std::string problem = kv_heads_problem(cfg.kv_heads, nh);
  KVLAB_CHECK(problem.empty(), "ablate: ", problem);
  std::sort(cfg.kv_heads.begin(), cfg.kv_heads.end(), std::greater<>());
  KVLAB_CHECK(cfg.seeds >= 1, "ablate: --seeds must be >= 1, got ", cfg.seeds);
  KVLAB_CHECK(cfg.ranks_per_run >= 1 && base.batch_size % cfg.ranks_per_run == 0,
              "ablate: --ranks-per-run ", cfg.ranks_per_run, " must divide --batch-size ",
              base.batch_size, " (each rank trains on its share of the batch)");
  if (cfg.uptrain != 0) {
    const std::string up = uptrain_problem(cfg.uptrain, base.iters, cfg.kv_heads, nh);
    KVLAB_CHECK(up.empty(), "ablate: ", up);
    KVLAB_CHECK(!cfg.uptrain_methods.empty(), "ablate: --uptrain-methods is empty");
  }
  if (!cfg.mla_ranks.empty()) {
    const std::string problem = mla_ranks_problem(cfg.mla_ranks, base.model);
    KVLAB_CHECK(problem.empty(), "ablate: --mla-ranks: ", problem);
    std::sort(cfg.mla_ranks.begin(), cfg.mla_ranks.end(), std::greater<>());
  } else {
    KVLAB_CHECK(cfg.mla_rope_head_dim == 0 && cfg.mla_q_lora_rank == 0,
                "ablate: MLA settings (rotary width ", cfg.mla_rope_head_dim, ", query rank ",
                cfg.mla_q_lora_rank, ") without --mla-ranks");
  }
  KVLAB_CHECK(cfg.kv_budget_bytes > 0, "ablate: --kv-budget must be positive");
  KVLAB_CHECK(!cfg.out_dir.empty(), "ablate: no output folder");
  ensure_writable_dir(cfg.out_dir, "ablate");
  // The corpus is read (and its token cache written) once here; every run reuses the cache.
  const Corpus corpus = load_run_corpus(base);
  check_corpus_fits(corpus, static_cast<int>(base.model.block_size));
  base.model.vocab_size = corpus.tokenizer.vocab_size();
  // Runs record the corpus's content: a finished run is reused only on the same text.
  base.corpus_hash = corpus.content_hash;
  // The samples come after all training: their prompts are checked now, as the engine will.
  for (size_t p = 0; p < cfg.prompts.size(); ++p) {
    const std::string name = prompt_name(static_cast<int64_t>(p), std::ssize(cfg.prompts));
    const std::string problem = prompt_problem(corpus.tokenizer.encode(cfg.prompts[p], name),
                                               base.model.vocab_size, base.model.block_size, false);
    KVLAB_CHECK(problem.empty(), name, problem);
  }
  GPTConfig mha = base.model;
  mha.n_kv_head = nh;
  const int64_t target = count_parameters(mha);
  std::vector<TrainConfig> runs;
  for (const AblateVariant& var : ablation_variants(cfg)) {
    for (int s = 0; s < cfg.seeds; ++s) {
      TrainConfig c = base;
      c.model.n_kv_head = var.n_kv_head;
      if (var.mla_rank > 0) {
        c.model.attn = "mla";
        c.model.kv_lora_rank = var.mla_rank;
        c.model.rope_head_dim = ablation_rope_head_dim(cfg);
        c.model.q_lora_rank = cfg.mla_q_lora_rank;
      }
      c.seed = base.seed + static_cast<uint64_t>(s);
      c.batch_size = base.batch_size / cfg.ranks_per_run;
      if (cfg.param_matched) {
        c.model.mlp_hidden = matched_hidden(c.model, target);
        const double off = std::abs(static_cast<double>(count_parameters(c.model) - target)) / target;
        KVLAB_CHECK(off <= 0.01, "ablate: cannot match MHA's parameter count within 1% at ",
                    variant_label(var), " (off by ", off * 100, "%)");
      }
      c.out_dir = run_dir(cfg, var, s).string();
      try {
        c.validate();
      } catch (const Error& e) {
        KVLAB_CHECK(false, "ablate: ", variant_label(var), ": ", e.what());
      }
      runs.push_back(c);
    }
  }
  return runs;
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
// workload's 256 requests, all at once, served by the scheduler over the paged cache and
// by static batching over contiguous caches (bench_serve; one run each, so its rates move with
// the host while its peak concurrency does not); then the continuous side alone at the sweep's
// Poisson rates (set by the first variant measured, in `rates`).
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
    LoadedModel lm = load_model(run_dir(cfg, var, s) / "final.h5");
    if (!dtypes.empty()) {
      std::fprintf(stderr, "%s seed %d: cache quality at %zu dtypes\n",
                   variant_label(var).c_str(), s, dtypes.size());
      kv_seeds.push_back(kv_cache_quality_on(*lm.model, corpus.val, dtypes, cfg.quality_windows));
    }
    if (!wdtypes.empty()) {
      std::fprintf(stderr, "%s seed %d: weight quality at %zu dtypes\n",
                   variant_label(var).c_str(), s, wdtypes.size());
      weight_seeds.push_back(weight_quality_on(*lm.model, corpus.val, wdtypes,
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

// One variant's figures: its runs' validation curves and losses, then, from its first seed's
// final checkpoint, parameters, cache bytes, decode speed and sample continuations, and from
// every seed's, the cost of each cache dtype and of each matrix type.
json measure_variant(const AblateConfig& cfg, const AblateVariant& var, int64_t prompt_len,
                     double tokens_per_byte, std::vector<double>& serve_rates) {
  json v;
  if (var.mla_rank > 0) {
    v["kv_lora_rank"] = var.mla_rank;
    v["rope_head_dim"] = ablation_rope_head_dim(cfg);
  } else {
    v["n_kv_head"] = var.n_kv_head;
  }
  std::vector<double> vals, bpbs;
  double train_tps = 0;
  for (int s = 0; s < cfg.seeds; ++s) {
    const fs::path dir = run_dir(cfg, var, s);
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
    v["runs"].push_back(run);
  }
  const auto [mean, sd] = mean_std(vals);
  v["val_loss_mean"] = mean;
  v["val_loss_std"] = sd;
  v["bpc"] = mean / std::log(2.0);  // bits per token: per character for a char tokenizer
  // Bits per byte of the validation text, comparable across tokenizers.
  const auto [bpb_mean, bpb_sd] = mean_std(bpbs);
  v["val_bpb_mean"] = bpb_mean;
  v["val_bpb_std"] = bpb_sd;
  v["val_tokens_per_byte"] = tokens_per_byte;
  v["train_tokens_per_s"] = train_tps / cfg.seeds;

  std::fprintf(stderr, "measuring %s: cache, decode speed, samples\n",
               variant_label(var).c_str());
  LoadedModel lm = load_model(run_dir(cfg, var, 0) / "final.h5");
  lm.model->round_matrices(cfg.weight_dtype);
  lm.model->to(cfg.base.device);  // measured where the runs trained, at their precision
  const MatmulPrecisionGuard precision(cfg.base.precision);
  const GPTConfig& mc = lm.model->config();
  KVSimOptions workload;
  // Generation's cache: paged on the CPU, contiguous on CUDA (where the paged one is not).
  const std::optional<PagedCacheOptions> paged =
      cfg.base.device == Device::CPU ? std::optional(PagedCacheOptions{}) : std::nullopt;
  v["params"] = lm.model->num_parameters();
  v["mlp_hidden"] = mc.hidden();
  {
    // Measured by the inference engine's cache for one full-context sequence.
    ContiguousKVCache cache(kv_cache_layout(mc, cfg.kv_dtype), 1, mc.block_size, cfg.base.device,
                            kv_cache_scales(*lm.model, cfg.kv_dtype));
    const int64_t measured = cache.bytes();
    const int64_t formula = kv_cache_formula_bytes(mc, 1, mc.block_size, cfg.kv_dtype);
    v["cache_bytes_context_measured"] = measured;
    v["cache_bytes_context_formula"] = formula;
    v["cache_bytes_per_token"] = measured / mc.block_size;
    // What the cache holds per byte of text: fewer, longer tokens hold more text a row.
    v["cache_bytes_per_byte"] =
        static_cast<double>(measured) / static_cast<double>(mc.block_size) * tokens_per_byte;
    v["sequences_in_budget"] = cfg.kv_budget_bytes / measured;
    workload = record_kv_workload(v, mc, measured / mc.block_size, cfg.kv_dtype);
  }
  // The scheduler's paged cache and the quantised caches run on the CPU only.
  if (cfg.base.device == Device::CPU)
    record_serving(v, *lm.model, lm.tokenizer, workload, cfg, serve_rates);
  // The cache dtypes on the CPU only; the matrices' types on the models as loaded (the CPU).
  record_quality(cfg, var, cfg.base.device == Device::CPU ? cfg.kv_dtypes : std::vector<DType>{},
                 v);
  {
    BenchGenerateOptions bo;
    bo.prompt_tokens = prompt_len;
    bo.new_tokens = {mc.block_size - prompt_len};
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
  {
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
    greedy.max_new_tokens = std::min<int64_t>(cfg.sample_tokens, mc.block_size - prompt_len);
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
  return v;
}

// results.json: the variants with their cache ratio to MHA, the config, machine and sweep.
json assemble_results(const AblateConfig& cfg, json variants, const AblateStats& stats,
                      const std::string& started, double wall_s) {
  // Cache ratio to the MHA variant (n_kv_head = n_head) when it is part of the sweep, else
  // to the largest n_kv_head measured.
  json mha_bytes = variants[0]["cache_bytes_context_measured"];
  for (const json& v : variants)
    if (v.value("n_kv_head", json()) == cfg.base.model.n_head)
      mha_bytes = v["cache_bytes_context_measured"];
  for (json& v : variants)
    v["vs_mha"] = v["cache_bytes_context_measured"].get<double>() / mha_bytes.get<double>();

  json results;
  results["command"] = cfg.command;
  results["started"] = started;
  json config;
  for (const auto& [k, val] : cfg.base.to_attrs()) std::visit([&](const auto& x) { config[k] = x; }, val);
  for (const char* per_variant :
       {"n_kv_head", "mlp_hidden", "attn", "kv_lora_rank", "rope_head_dim", "q_lora_rank"})
    config.erase(per_variant);
  config["kv_heads"] = cfg.kv_heads;
  if (!cfg.mla_ranks.empty()) {
    config["mla_ranks"] = cfg.mla_ranks;
    config["mla_rope_head_dim"] = ablation_rope_head_dim(cfg);
    config["mla_q_lora_rank"] = cfg.mla_q_lora_rank;
  }
  config["seeds"] = cfg.seeds;
  config["param_matched"] = cfg.param_matched;
  if (cfg.uptrain != 0) config["uptrain"] = cfg.uptrain;
  results["config"] = config;
  results["machine"] = {{"cpu", host_cpu_model()}, {"threads", omp_get_max_threads()}};
  results["versions"] = {{"kvlab", KVLAB_VERSION},
                         {"compiler", __VERSION__},
                         {"openblas", kvlab::blas_config()},
                         {"openblas_kernels", kvlab::blas_kernels()}};
  results["kv_budget_bytes"] = cfg.kv_budget_bytes;
  results["kv_dtype"] = dtype_name(cfg.kv_dtype);
  results["weight_dtype"] = weight_dtype_name(cfg.weight_dtype);
  results["int8_products"] = cfg.int8_products;
  results["dtype_bytes"] = dtype_size(cfg.kv_dtype);
  results["quality_windows"] = cfg.quality_windows;
  results["param_matched"] = cfg.param_matched;
  results["variants"] = variants;
  results["sweep"] = {{"runs", stats.runs_total}, {"reused", stats.runs_reused},
                      {"resumed", stats.runs_resumed}, {"steps_trained", stats.steps_trained}};
  results["wall_s"] = wall_s;
  return results;
}

}  // namespace

json run_ablation(AblateConfig cfg, AblateStats* stats_out, Communicator* comm) {
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  const std::string started = now_iso();
  const bool ranks = comm != nullptr && comm->world_size() > 1;
  const bool rank0 = !ranks || comm->rank() == 0;
  // Held by rank 0 until the report is written: a second sweep on the same folder refuses at
  // once, every rank of it.
  std::optional<OutputDirLock> hold;
  std::string refused;
  if (rank0) {
    try {
      hold.emplace(cfg.out_dir, "ablate");
    } catch (const Error& e) {
      if (!ranks) throw;
      refused = e.what();
    }
  }
  if (ranks) {
    std::array<std::byte, 1> ok{std::byte(refused.empty() ? 1 : 0)};
    comm->broadcast(ok, 0, "the sweep folder's lock");
    KVLAB_CHECK(ok[0] == std::byte(1), rank0 ? refused
                                             : "ablate: rank 0 could not take the output folder "
                                               "(its message says why)");
  }
  const std::vector<TrainConfig> runs = plan_ablation(cfg);
  AblateStats stats;
  train_runs(runs, stats, comm, cfg.ranks_per_run);
  stats.runs_total = static_cast<int>(runs.size());
  if (!rank0) {  // rank 0 measures every run and writes the report
    if (stats_out) *stats_out = stats;
    return json();
  }
  // The other ranks are done: rank 0 measures on the whole machine, as one process would
  // (at OMP_NUM_THREADS where the user set it, as one process would too).
  if (ranks && std::getenv("OMP_NUM_THREADS") == nullptr) omp_set_num_threads(omp_get_num_procs());

  json variants = json::array();
  const int64_t prompt_len =
      std::max<int64_t>(1, std::min<int64_t>(16, cfg.base.model.block_size / 4));
  std::vector<double> serve_rates;  // the serving sweep's, set by the first variant
  // Every run shares the corpus (and its cache): the validation split's tokens per byte once.
  const double tokens_per_byte = val_tokens_per_byte(load_run_corpus(cfg.base));
  for (const AblateVariant& var : ablation_variants(cfg))
    variants.push_back(measure_variant(cfg, var, prompt_len, tokens_per_byte, serve_rates));
  json quality = record_generation_quality(cfg);  // on the CPU, where load_model puts them
  json uptrain;
  if (cfg.uptrain != 0) uptrain = run_uptrain(cfg, runs, variants, stats);
  json results = assemble_results(cfg, std::move(variants), stats, started,
                                  std::chrono::duration<double>(Clock::now() - t_start).count());
  results["generation_quality"] = std::move(quality);
  if (!uptrain.is_null()) results["uptrain"] = std::move(uptrain);
  if (ranks) {
    results["sweep"]["ranks"] = comm->world_size();
    results["sweep"]["ranks_per_run"] = cfg.ranks_per_run;
  }
  write_report(results, cfg.out_dir);
  if (stats_out) *stats_out = stats;
  return results;
}

}  // namespace kvlab
