// kvlab ablate: the n_kv_head sweep (the main job).
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "apps/ablate/ablate.h"
#include "apps/ablate/uptrain.h"
#include "apps/cli.h"
#include "apps/train_flags.h"
#include "apps/train_progress.h"
#include "platform/kv_rows.h"
#include "report/report.h"
#include "train/comm.h"

namespace kvlab {

namespace {

struct AblateArgs {
  TrainFlags flags;
  std::string kv_heads;   // "8,4,2,1": parsed by parse_counts
  std::string mla_ranks;  // "32,64"
  int seeds = 3;
  bool param_matched = false;
  int64_t kv_budget = int64_t{1} << 30;
  std::string kv_dtype = "f32";
  std::string weight_dtype = "f32";
  bool int8_products = false;
  std::string kv_dtypes = "f32,bf16,fp8,int8,int4";
  std::string weight_dtypes = "bf16,q8_0,q4_0";
  std::vector<std::string> prompts;
  int64_t sample_tokens = 160;
  int bench_runs = 3;
  std::string out = "out/ablate";
  bool quick = false;
  double uptrain = 0;
  std::string uptrain_methods = "mean,first,random";
  double comm_timeout = 120;
  int ranks_per_run = 1;
  std::string command;
};

// Under an MPI launcher, OpenMP threads a rank: OMP_NUM_THREADS where set, else Slurm's
// cpus-per-task, else this machine's cores shared by the ranks the launcher put on it.
int threads_per_rank() {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return omp_get_max_threads();
  auto env_int = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::atoi(v) : 0;
  };
  if (const int cpus = env_int("SLURM_CPUS_PER_TASK"); cpus > 0) return cpus;
  int local = env_int("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local <= 0) local = env_int("MPI_LOCALNRANKS");
  if (local <= 0) local = env_int("SLURM_NTASKS_PER_NODE");
  return std::max(1, omp_get_num_procs() / std::max(1, local));
}

// Defaults of the sweep: 4 layers, 8 heads, n_embd 128, block 64 -> n_kv_head 8, 4, 2, 1 with
// 3 seeds, 600 steps each: about 5 minutes of training and measuring on 2 cores.
void set_sweep_defaults(TrainConfig& c) {
  c.model.n_layer = 4;
  c.model.n_head = 8;
  c.model.n_embd = 128;
  c.model.block_size = 64;
  c.batch_size = 12;
  c.iters = 600;
  c.warmup = 50;
  c.eval_interval = 100;
  c.eval_iters = 50;
}

// --quick: a smoke test in well under a minute. Only flags the user did not give change.
void apply_quick(CLI::App* cmd, AblateArgs& a) {
  TrainConfig& c = a.flags.cfg;
  auto unset = [&](const char* flag) { return cmd->count(flag) == 0; };
  if (unset("--n-layer")) c.model.n_layer = 2;
  if (unset("--n-head")) c.model.n_head = 4;
  if (unset("--n-embd")) c.model.n_embd = 64;
  if (unset("--block-size")) c.model.block_size = 32;
  if (unset("--batch-size")) c.batch_size = 8;
  if (unset("--iters")) c.iters = 300;
  if (unset("--warmup")) c.warmup = 10;
  if (unset("--eval-interval")) c.eval_interval = 100;
  if (unset("--eval-iters")) c.eval_iters = 10;
  if (unset("--sample-tokens")) a.sample_tokens = 48;
  if (unset("--bench-runs")) a.bench_runs = 1;
}

// --kv-heads or --mla-ranks as given: one comma-separated argument (CLI11's own list
// splitting drops empty items and, for ",", goes on to take the next flag as a value). Every
// item must be a decimal integer; what the list must be is the caller's check.
std::vector<int64_t> parse_counts(const char* flag, const std::string& text) {
  auto trim = [](const std::string& s) {
    const auto b = s.find_first_not_of(" \t");
    return b == std::string::npos ? std::string() : s.substr(b, s.find_last_not_of(" \t") - b + 1);
  };
  KVLAB_USAGE_CHECK(!trim(text).empty(), flag, ": the list is empty");
  const CLI::Validator integer = integer_of<int64_t>();
  std::vector<int64_t> ks;
  size_t begin = 0;
  for (int item = 1;; ++item) {
    const size_t comma = text.find(',', begin);
    std::string word = trim(text.substr(begin, comma - begin));
    KVLAB_USAGE_CHECK(!word.empty(), flag, " '", text, "': item ", item,
                      " is empty (write comma-separated counts, e.g. 8,4,2,1)");
    const std::string bad = integer(word);
    KVLAB_USAGE_CHECK(bad.empty(), flag, ": ", bad);
    ks.push_back(std::stoll(word));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return ks;
}

// --uptrain-methods: comma-separated conversion methods, each once.
std::vector<KVHeadInit> parse_uptrain_methods(const std::string& text) {
  std::vector<KVHeadInit> out;
  size_t begin = 0;
  for (;;) {
    const size_t comma = text.find(',', begin);
    const std::string word = text.substr(begin, comma - begin);
    KVLAB_USAGE_CHECK(word == "mean" || word == "first" || word == "random", "--uptrain-methods '",
                      text, "': '", word, "' is not a method (mean, first, random)");
    const KVHeadInit m = parse_kv_head_init(word);
    KVLAB_USAGE_CHECK(std::find(out.begin(), out.end(), m) == out.end(), "--uptrain-methods: ",
                      word, " is listed twice");
    out.push_back(m);
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

// The MLA variants' settings given as the base model's flags (--rope-head-dim,
// --q-lora-rank), taken off it: the base model stays GQA's.
struct MlaSettings {
  int64_t rope_head_dim = 0, q_lora_rank = 0;
};
MlaSettings take_mla_settings(CLI::App* cmd, AblateArgs& a) {
  KVLAB_USAGE_CHECK(cmd->count("--attn") == 0 && cmd->count("--kv-lora-rank") == 0,
                    "ablate: --attn and --kv-lora-rank set one model's attention; the sweep adds "
                    "MLA variants with --mla-ranks R1,R2 (and --rope-head-dim, --q-lora-rank)");
  const auto take = [&](const char* flag, int64_t& value, int64_t min) {
    if (cmd->count(flag) == 0) return int64_t{0};
    KVLAB_USAGE_CHECK(cmd->count("--mla-ranks") > 0, "ablate: ", flag,
                      " is the MLA variants'; give --mla-ranks");
    KVLAB_USAGE_CHECK(value >= min, flag, " must be >= ", min, ", got ", value);
    return std::exchange(value, 0);
  };
  MlaSettings m;
  m.rope_head_dim = take("--rope-head-dim", a.flags.cfg.model.rope_head_dim, 1);
  m.q_lora_rank = take("--q-lora-rank", a.flags.cfg.model.q_lora_rank, 0);
  return m;
}

// --kv-heads and --mla-ranks: the sweep's variants.
void set_variants(CLI::App* cmd, const AblateArgs& a, const MlaSettings& mla, AblateConfig& cfg) {
  if (cmd->count("--kv-heads") > 0) {
    cfg.kv_heads = parse_counts("--kv-heads", a.kv_heads);
    const std::string problem = kv_heads_problem(cfg.kv_heads, cfg.base.model.n_head);
    KVLAB_USAGE_CHECK(problem.empty(), "--kv-heads: ", problem);
  }
  if (cmd->count("--mla-ranks") > 0) {
    cfg.mla_ranks = parse_counts("--mla-ranks", a.mla_ranks);
    const std::string problem = mla_ranks_problem(cfg.mla_ranks, cfg.base.model);
    KVLAB_USAGE_CHECK(problem.empty(), "--mla-ranks: ", problem);
    cfg.mla_rope_head_dim = mla.rope_head_dim;
    cfg.mla_q_lora_rank = mla.q_lora_rank;
  }
}

// What the sweep measures of each variant: seeds, cache and matrix dtypes, samples, speed.
void set_measurements(const AblateArgs& a, AblateConfig& cfg) {
  KVLAB_USAGE_CHECK(a.seeds >= 1, "--seeds must be >= 1, got ", a.seeds);
  KVLAB_USAGE_CHECK(a.kv_budget > 0, "--kv-budget must be positive");
  KVLAB_USAGE_CHECK(a.sample_tokens >= 1, "--sample-tokens must be >= 1");
  KVLAB_USAGE_CHECK(a.bench_runs >= 1, "--bench-runs must be >= 1");
  KVLAB_USAGE_CHECK(a.ranks_per_run == 1 || launched_by_mpi(), "--ranks-per-run ", a.ranks_per_run,
                    " needs ranks: run under mpirun or srun");
  cfg.seeds = a.seeds;
  cfg.ranks_per_run = a.ranks_per_run;
  cfg.param_matched = a.param_matched;
  cfg.kv_budget_bytes = a.kv_budget;
  cfg.kv_dtype = parse_storage_dtype(a.kv_dtype);
  cfg.weight_dtype = parse_weight_dtype(a.weight_dtype);
  cfg.int8_products = a.int8_products;
  cfg.kv_dtypes = a.kv_dtypes == "none" ? std::vector<DType>{} : parse_kv_dtypes(a.kv_dtypes);
  cfg.weight_dtypes = a.weight_dtypes == "none" ? std::vector<WeightDtype>{}
                                                : parse_weight_dtypes(a.weight_dtypes);
  KVLAB_USAGE_CHECK(cfg.base.device == Device::CPU || !is_quantised(cfg.kv_dtype),
                    "--kv-dtype ", a.kv_dtype, " is a CPU cache; on CUDA, f32 or bf16");
  cfg.prompts = a.prompts;
  cfg.sample_tokens = a.sample_tokens;
  cfg.bench_runs = a.bench_runs;
  cfg.out_dir = a.out;
  cfg.command = a.command;
}

// --uptrain F: each MHA run converted and uptrained for a fraction of the sweep's steps.
void set_uptrain(CLI::App* cmd, const AblateArgs& a, AblateConfig& cfg) {
  if (cmd->count("--uptrain") == 0) {
    KVLAB_USAGE_CHECK(cmd->count("--uptrain-methods") == 0,
                      "--uptrain-methods names the conversions --uptrain F trains; give --uptrain");
    return;
  }
  std::vector<int64_t> sweep = cfg.kv_heads;
  if (sweep.empty())  // plan_ablation's default: every divisor of n_head
    for (int64_t k = cfg.base.model.n_head; k >= 1; --k)
      if (cfg.base.model.n_head % k == 0) sweep.push_back(k);
  const std::string problem =
      uptrain_problem(a.uptrain, cfg.base.iters, sweep, cfg.base.model.n_head);
  KVLAB_USAGE_CHECK(problem.empty(), problem);
  cfg.uptrain = a.uptrain;
  cfg.uptrain_methods = parse_uptrain_methods(a.uptrain_methods);
}

// Under mpirun or srun the runs are spread over the ranks; MPI is never started otherwise
// (null then).
std::shared_ptr<Communicator> sweep_communicator(const AblateArgs& a) {
  KVLAB_USAGE_CHECK(a.comm_timeout > 0 && a.comm_timeout <= 1e9,
                    "--comm-timeout must be a number of seconds in (0, 1e9], got ", a.comm_timeout);
  if (!launched_by_mpi()) return nullptr;
  std::shared_ptr<Communicator> comm = world_communicator(a.comm_timeout);
  KVLAB_USAGE_CHECK(comm->world_size() % a.ranks_per_run == 0, "--ranks-per-run ",
                    a.ranks_per_run, " does not divide the ", comm->world_size(),
                    " ranks of this job");
  omp_set_num_threads(threads_per_rank());
  std::fprintf(stderr, "kvlab ablate: rank %d of %d on %d threads\n", comm->rank(),
               comm->world_size(), omp_get_max_threads());
  return comm;
}

void run_ablate(CLI::App* cmd, AblateArgs& a) {
  if (a.quick) apply_quick(cmd, a);
  KVLAB_USAGE_CHECK(!a.out.empty(), "ablate: no output folder (--out is empty)");
  const MlaSettings mla = take_mla_settings(cmd, a);
  // Before the corpus is read: a fraction out of range is wrong whatever the sweep.
  if (cmd->count("--uptrain") > 0)
    KVLAB_USAGE_CHECK(a.uptrain > 0 && a.uptrain <= 1, "--uptrain ", a.uptrain,
                      " must be a fraction of the sweep's steps in (0, 1], e.g. 0.05");
  AblateConfig cfg;
  cfg.base = finish_train_flags(a.flags);
  cfg.base.tokenizer_progress = bpe_progress_bar("bpe");
  set_variants(cmd, a, mla, cfg);
  set_measurements(a, cfg);
  set_uptrain(cmd, a, cfg);
  const std::shared_ptr<Communicator> comm = sweep_communicator(a);
  const bool rank0 = comm == nullptr || comm->rank() == 0;
  if (const std::string note = blas_kernels_note(); rank0 && !note.empty())
    std::fprintf(stderr, "kvlab ablate: note: %s\n", note.c_str());
  nlohmann::json results;
  try {
    results = run_ablation(cfg, nullptr, comm.get());
  } catch (...) {
    // A rank that fails ends the whole job at exit: no rank waits for it in MPI_Finalize.
    if (comm != nullptr && comm->world_size() > 1) comm->fail();
    throw;
  }
  if (!rank0) return;
  std::printf("\n%s\n", format_table(results).c_str());
  std::printf("sweep wall time %.0f s; report: %s/report.html (also report.md, results.json, "
              "results.csv, *.svg)\n",
              results["wall_s"].get<double>(), a.out.c_str());
}

}  // namespace

void add_ablate_command(CLI::App& root) {
  auto args = std::make_shared<AblateArgs>();
  CLI::App* cmd = root.add_subcommand(
      "ablate", "Train the same GPT at several n_kv_head settings and compare loss, cache and speed");
  set_sweep_defaults(args->flags.cfg);
  add_train_flags(cmd, args->flags, false);
  cmd->add_option("--kv-heads", args->kv_heads,
                  "n_kv_head values, comma separated, e.g. 8,2,1 (default: every divisor of "
                  "n-head)");
  cmd->add_option("--mla-ranks", args->mla_ranks,
                  "Also train multi-head latent attention (DeepSeek-V2's MLA) at these latent "
                  "ranks, comma separated, e.g. 32,64, each with a rotary key of --rope-head-dim "
                  "values (default: half a head): rows of every table and points of every plot, "
                  "and each compared with the GQA variant of the nearest cache bytes per token. "
                  "Needs --pos rope or --arch llama");
  add_number(cmd, "--seeds", args->seeds, "Seeds per variant (mean +- std over them)");
  cmd->add_flag("--param-matched", args->param_matched,
                "Widen each variant's MLP to MHA's parameter count (within 1%)");
  cmd->add_option("--kv-budget", args->kv_budget,
                  "Memory for the sequences-that-fit figure, e.g. 1GiB")
      ->transform(CLI::AsSizeValue(false))
      ->check(integer_of<int64_t>())
      ->capture_default_str();
  add_kv_dtype_flag(cmd, args->kv_dtype);
  add_weight_dtype_flag(cmd, args->weight_dtype, args->int8_products);
  cmd->add_option("--kv-dtypes", args->kv_dtypes,
                  "Cache dtypes every trained model's quality is measured at (val loss, KL and "
                  "top-1 against the f32 cache, every seed), for the report's memory-quality "
                  "frontier; comma separated, or none. CPU only")
      ->capture_default_str();
  cmd->add_option("--weight-dtypes", args->weight_dtypes,
                  "Matrix types every trained model's quality is measured at (its matrices rounded "
                  "as generate's --weight-dtype rounds them: val loss, KL and top-1 against its "
                  "f32 matrices, every seed, on the validation windows --kv-dtypes uses; and the "
                  "bytes a decode step reads); comma separated from f32, bf16, q8_0, q4_0, or "
                  "none to measure none")
      ->capture_default_str();
  cmd->add_option("--prompt", args->prompts, "Prompt for the samples (repeatable; default: "
                                              "the start of two fixed validation windows)");
  add_number(cmd, "--sample-tokens", args->sample_tokens, "New tokens per sample");
  add_number(cmd, "--bench-runs", args->bench_runs, "Timed decode runs per variant (median)");
  cmd->add_option("--out", args->out, "Output folder (runs/, results.json, report.html, ...)")
      ->capture_default_str();
  cmd->add_option("--uptrain", args->uptrain,
                  "The GQA paper's conversion experiment: after the sweep, each seed's multi-head "
                  "run (n_kv_head = n_head, which the sweep must include) is converted to every "
                  "smaller n_kv_head of the sweep by each --uptrain-methods (KV heads merged by "
                  "their mean, the first of each group, or random new heads), evaluated, then "
                  "trained round(F * iters) more steps (the sweep's LR schedule scaled to them, a "
                  "new AdamW), and compared in the report with training from scratch. F in (0, 1], "
                  "e.g. 0.05; default: off")
      ->check(finite_number());
  cmd->add_option("--uptrain-methods", args->uptrain_methods,
                  "Conversions --uptrain compares, comma separated: mean, first, random")
      ->capture_default_str();
  add_number(cmd, "--comm-timeout", args->comm_timeout,
             "Under mpirun or srun: seconds a rank waits for the others (at the sweep's start, "
             "and in a run's collectives with --ranks-per-run) before the job fails naming "
             "them; at most 1e9");
  cmd->add_option("--ranks-per-run", args->ranks_per_run,
                  "Under mpirun or srun: ranks training each run data-parallel, dividing the "
                  "job's ranks and --batch-size (each rank trains on its share of the batch)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--quick", args->quick,
                "Smoke-test size (2 layers, n_embd 64, 300 steps): under a minute");
  cmd->callback([cmd, args] {
    args->command = command_line();
    run_ablate(cmd, *args);
  });
}

// Rewrites an ablation's report from its results.json (after the report code changed, say)
// without training or measuring anything again.
void add_report_command(CLI::App& root) {
  auto results = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  CLI::App* cmd = root.add_subcommand(
      "report", "Write an ablation's report files again from its results.json (nothing is rerun)");
  cmd->add_option("results", *results, "results.json of a finished `kvlab ablate`")->required();
  cmd->add_option("--out", *out, "Output folder (default: the folder of the results file)");
  cmd->callback([results, out] {
    std::ifstream in(*results, std::ios::binary);
    KVLAB_USAGE_CHECK(in.good(), "report: cannot read ", *results);
    nlohmann::json r;
    try {
      r = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      KVLAB_USAGE_CHECK(false, "report: ", *results, " is not JSON: ", e.what());
    }
    const std::filesystem::path dir =
        out->empty() ? std::filesystem::absolute(*results).parent_path() : std::filesystem::path(*out);
    write_report(r, dir);
    std::printf("%s\nreport: %s/report.html (also report.md, results.csv, *.svg)\n",
                format_table(r).c_str(), dir.c_str());
  });
}

}  // namespace kvlab
