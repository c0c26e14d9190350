#include "apps/ablate/ablate.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "apps/ablate/generation_quality.h"
#include "apps/ablate/measure_variant.h"
#include "apps/ablate/train_runs.h"
#include "apps/ablate/uptrain.h"
#include "apps/train_progress.h"
#include "checkpoints/model_io.h"
#include "infer/measure/bench.h"
#include "platform/blas_core.h"
#include "platform/cpu.h"
#include "report/report.h"
#include "train/output_dir.h"

namespace kvlab {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path run_dir(const AblateConfig& cfg, const AblateVariant& var, int seed_index) {
  return ablation_run_dir(cfg, var, seed_index);
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

}  // namespace

std::string variant_label(const AblateVariant& var) {
  return var.mla_rank > 0 ? detail::cat("MLA rank ", var.mla_rank)
                          : detail::cat("n_kv_head=", var.n_kv_head);
}

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
    if (j.contains("val_accuracy")) curve.back()["val_accuracy"] = j["val_accuracy"];
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
