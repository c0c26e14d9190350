#pragma once
// The n_kv_head ablation behind `kvlab ablate`: the same model trained at several n_kv_head
// settings and seeds, then measured (val loss, KV-cache bytes, decode speed, samples) and
// written as results.json, CSV, Markdown, SVG plots and one HTML page.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/gpt.h"
#include "nn/kv_convert.h"
#include "train/comm.h"
#include "train/trainer.h"

namespace kvlab {

struct AblateConfig {
  TrainConfig base;               // its n_kv_head and seed are set per run
  std::vector<int64_t> kv_heads;  // empty: every divisor of n_head, largest first
  // MLA variants beside them, one per latent rank (kv_lora_rank), each with a rotary key of
  // mla_rope_head_dim values (0: half the head size, even, at least 2) and queries compressed
  // to mla_q_lora_rank (0: none). They need base's positions to be RoPE's.
  std::vector<int64_t> mla_ranks;
  int64_t mla_rope_head_dim = 0;
  int64_t mla_q_lora_rank = 0;
  int seeds = 2;                  // seed index i trains with base.seed + i
  // Under MPI: ranks training each run data-parallel (train_runs.h); the runs' batch_size is
  // base's divided by it, each rank's share, so the sweep trains on as many tokens.
  int ranks_per_run = 1;
  bool param_matched = false;     // widen the MLP so every variant has MHA's parameter count
  int64_t kv_budget_bytes = int64_t{1} << 30;
  DType kv_dtype = DType::F32;       // of the KV cache measured, benchmarked and sampled with
  // The matrices' of the model served, benchmarked and sampled (GPT::round_matrices); the
  // quality figures always start from the trained f32 weights.
  WeightDtype weight_dtype = WeightDtype::F32;
  // The fused decode's products of q8_0/q4_0 matrices in integers (DecodeStep::int8_products)
  // where the model is served, benchmarked and sampled, and in the quality of weight_dtypes.
  bool int8_products = false;
  // The cache dtypes every trained model's quality is measured at (kv_cache_quality on the
  // validation split, every seed): the memory-quality frontier. Empty: none (and on CUDA).
  std::vector<DType> kv_dtypes = {DType::F32, DType::BF16, DType::FP8, DType::INT8, DType::INT4};
  // The matrices' types every trained model's quality is measured at (weight_quality on the
  // same windows, every seed), each against the model's f32 matrices. Empty: none.
  std::vector<WeightDtype> weight_dtypes = {WeightDtype::BF16, WeightDtype::Q8_0,
                                            WeightDtype::Q4_0};
  int quality_windows = 256;
  std::vector<std::string> prompts;  // empty: the first characters of fixed validation windows
  int64_t sample_tokens = 160;
  int bench_runs = 3;
  std::string out_dir;
  std::string command;  // recorded in results.json
  // > 0: after the sweep, each seed's MHA run converted to every smaller n_kv_head by each of
  // uptrain_methods and trained round(uptrain * iters) steps more (apps/ablate/uptrain.h).
  double uptrain = 0;
  std::vector<KVHeadInit> uptrain_methods = {KVHeadInit::Mean, KVHeadInit::First,
                                             KVHeadInit::Random};
};

struct AblateStats {
  int runs_total = 0;
  int runs_reused = 0;   // finished earlier with a matching config
  int runs_resumed = 0;  // continued from their last checkpoint
  int64_t steps_trained = 0;
  // The uptraining runs (--uptrain), counted the same way.
  int uptrain_runs_total = 0;
  int uptrain_runs_reused = 0;
  int uptrain_runs_resumed = 0;
  int64_t uptrain_steps_trained = 0;
};

// One variant of the sweep: n_kv_head key/value heads (MHA, GQA or MQA), or with mla_rank > 0
// multi-head latent attention with a latent of that rank.
struct AblateVariant {
  int64_t n_kv_head = 0;
  int64_t mla_rank = 0;
  std::string name() const;  // "kv4" or "mla32": its runs' folders
};

// How progress lines name a variant ("n_kv_head=4", "MLA rank 32").
std::string variant_label(const AblateVariant& var);

// The sweep's variants: kv_heads as given, then the MLA ranks.
std::vector<AblateVariant> ablation_variants(const AblateConfig& cfg);

// Every variant's config, checked before anything trains: kv heads that do not divide n_head,
// an empty list, an unwritable output folder or a corpus too short for the block size are
// errors, and so is an uptrain the sweep cannot serve (uptrain_problem) or MLA ranks the model
// cannot take (mla_ranks_problem). With param_matched, mlp_hidden is chosen per variant
// (parameters within 1% of MHA).
std::vector<TrainConfig> plan_ablation(AblateConfig& cfg);

// What is wrong with a list of n_kv_head values for n_head heads (each in [1, n_head], dividing
// it, listed once), or "" when nothing is: one check for plan_ablation and the CLI, each of
// which reports it as its own kind of error.
std::string kv_heads_problem(const std::vector<int64_t>& kv_heads, int64_t n_head);

// What is wrong with a list of MLA latent ranks for the sweep's base model (each in
// [1, n_embd], listed once; the base's positions rotary, as MLA's decoupled key is), or ""
// when nothing is.
std::string mla_ranks_problem(const std::vector<int64_t>& ranks, const GPTConfig& base);

// The rotary width of the sweep's MLA variants (cfg.mla_rope_head_dim or its default).
int64_t ablation_rope_head_dim(const AblateConfig& cfg);

// Where run (variant, seed index seed_index) of the sweep lives: out_dir/runs/<name>_seed<i>.
std::filesystem::path ablation_run_dir(const AblateConfig& cfg, const AblateVariant& variant,
                                       int seed_index);

// The validation curve of a run, read back from its log.jsonl: [{step, val_loss, train_loss}].
nlohmann::json read_curve(const std::filesystem::path& dir);
// Mean and sample standard deviation (0 for one value) of xs, over seeds.
std::pair<double, double> mean_std(const std::vector<double>& xs);

// Trains (or reuses / resumes) every run, measures, writes the report into cfg.out_dir and
// returns results.json's document. Progress goes to stderr. With `comm` of several MPI ranks
// (every rank calls it) the runs are spread over the ranks (apps/ablate/train_runs.h); rank 0
// then measures them alone, on the whole machine, and writes the report; the other ranks
// return null once no run is left for them.
nlohmann::json run_ablation(AblateConfig cfg, AblateStats* stats = nullptr,
                            Communicator* comm = nullptr);

}  // namespace kvlab
