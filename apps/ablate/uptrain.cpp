#include "apps/ablate/uptrain.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include "apps/train_progress.h"
#include "checkpoints/model_io.h"
#include "nn/kv_convert.h"
#include "train/output_dir.h"

namespace kvlab {

namespace fs = std::filesystem;
using nlohmann::json;

int64_t uptrain_steps(double fraction, int64_t iters) {
  return std::llround(fraction * static_cast<double>(iters));
}

std::string uptrain_problem(double fraction, int64_t iters, const std::vector<int64_t>& kv_heads,
                            int64_t n_head) {
  if (!(fraction > 0 && fraction <= 1))
    return detail::cat("--uptrain ", fraction,
                       " must be a fraction of the sweep's steps in (0, 1], e.g. 0.05");
  if (std::find(kv_heads.begin(), kv_heads.end(), n_head) == kv_heads.end())
    return detail::cat("--uptrain converts the multi-head run (n_kv_head = n_head = ", n_head,
                       "), which the sweep does not train: add ", n_head, " to --kv-heads");
  if (std::none_of(kv_heads.begin(), kv_heads.end(), [&](int64_t k) { return k < n_head; }))
    return detail::cat("--uptrain needs an n_kv_head below n_head = ", n_head,
                       " in the sweep to convert to");
  if (uptrain_steps(fraction, iters) < 1)
    return detail::cat("--uptrain ", fraction, " of ", iters,
                       " iters rounds to 0 steps; give a larger fraction");
  return "";
}

TrainConfig uptrain_run_config(const TrainConfig& mha_run, int64_t kv, double fraction,
                               const fs::path& out_dir) {
  TrainConfig c = mha_run;
  c.model = kv_converted_config(mha_run.model, kv);
  c.iters = uptrain_steps(fraction, mha_run.iters);
  c.warmup = std::llround(fraction * static_cast<double>(mha_run.warmup));
  c.eval_interval = std::max<int64_t>(1, c.iters / 5);
  c.ckpt_interval = 0;
  c.out_dir = out_dir.string();
  c.init_from.clear();
  c.init_from_hash.clear();
  return c;
}

namespace {

fs::path uptrain_dir(const AblateConfig& cfg, int64_t kv, KVHeadInit method, int seed_index) {
  return fs::path(cfg.out_dir) / "runs" / "uptrain" /
         ("kv" + std::to_string(kv) + "_" + kv_head_init_name(method) + "_seed" +
          std::to_string(seed_index));
}

std::string attr_text(const Attrs& a, const std::string& key) {
  const auto it = a.find(key);
  if (it == a.end()) return "";
  const std::string* s = std::get_if<std::string>(&it->second);
  return s ? *s : "";
}

// The converted weights, as `kvlab convert` writes them: a weights-only checkpoint whose
// /config records the source's content hash and the method.
void write_converted(const LoadedModel& src, const std::string& src_hash, int64_t kv,
                     KVHeadInit method, uint64_t seed, const fs::path& file) {
  const std::unique_ptr<GPT> dst = convert_kv_heads(*src.model, kv, method, seed);
  Checkpoint c;
  put_gpt_config(c.config, dst->config());
  c.config["converted_from"] = src_hash;
  c.config["convert_method"] = kv_head_init_name(method);
  c.config["converted_from_n_kv_head"] = src.model->config().n_kv_head;
  if (method == KVHeadInit::Random) c.config["convert_seed"] = static_cast<int64_t>(seed);
  put_tokenizer(c, src.tokenizer);
  c.model = to_arrays(dst->named_parameters());
  save_checkpoint(file, c);
}

// Whether `init` holds the conversion of the source with content hash `src_hash` by `method`.
bool init_matches(const fs::path& init, const std::string& src_hash, KVHeadInit method) {
  if (!fs::exists(init)) return false;
  try {
    const Checkpoint c = load_checkpoint(init, false);
    return attr_text(c.config, "converted_from") == src_hash &&
           attr_text(c.config, "convert_method") == kv_head_init_name(method);
  } catch (const Error&) {
    return false;
  }
}

// One uptrain run: reused when finished from this source by this method with this config,
// resumed from last.h5 when stopped, else converted afresh and trained.
void uptrain_one(const TrainConfig& planned, const LoadedModel& src, const std::string& src_hash,
                 KVHeadInit method, const std::string& label, AblateStats& stats) {
  const fs::path dir = planned.out_dir, init = dir / "init.h5", final_ckpt = dir / "final.h5",
                 last = dir / "last.h5";
  const int64_t kv = planned.model.n_kv_head;
  if (fs::exists(final_ckpt) && init_matches(init, src_hash, method)) {
    TrainConfig want = planned;
    want.init_from = init.string();
    want.init_from_hash = file_content_hash(init);
    const auto diffs =
        config_differences(load_checkpoint(final_ckpt, false).config, want.to_attrs());
    if (diffs.empty()) {
      ++stats.uptrain_runs_reused;
      std::fprintf(stderr, "%s: finished earlier, reusing %s\n", label.c_str(),
                   final_ckpt.string().c_str());
      return;
    }
    std::string msg;
    for (const auto& d : diffs) msg += (msg.empty() ? "" : "; ") + d;
    KVLAB_CHECK(false, "ablate: ", final_ckpt.string(),
                " was uptrained with a different config (checkpoint vs now): ", msg,
                ". Use another --out, or delete that folder to retrain");
  }
  fs::create_directories(dir);
  const OutputDirLock hold(dir, "ablate");
  clear_checkpoint_temporaries(dir, label);
  // A conversion of another source (the MHA run was retrained) or none: start over.
  const bool fresh = !init_matches(init, src_hash, method);
  if (fresh) {
    for (const char* f : {"final.h5", "last.h5", "best.h5", "log.jsonl"}) fs::remove(dir / f);
    write_converted(src, src_hash, kv, method, planned.seed, init);
  }
  Trainer trainer(planned);
  int64_t from = 0;
  if (!fresh && fs::exists(last)) {
    try {
      trainer.resume(last);
    } catch (const Error& e) {
      KVLAB_CHECK(false, "ablate: ", e.what(), ". Use another --out, or delete ", dir.string(),
                  " to retrain");
    }
    from = trainer.step();
    if (from > 0) ++stats.uptrain_runs_resumed;
  } else {
    trainer.init_from(init);
  }
  const bool done = train_with_progress(trainer, label);
  stats.uptrain_steps_trained += trainer.step() - from;
  if (!done)
    throw Interrupted(detail::cat("ablate: interrupted during ", label,
                                  "; rerun the same command to continue where it stopped"),
                      stop_signal());
}

// Each seed's MHA run converted to every target n_kv_head by every method and uptrained (or
// reused, or resumed): each run's curve and its loss converted and uptrained, by (kv, method,
// seed).
using UptrainRuns = std::map<std::tuple<int64_t, int, int>, json>;
UptrainRuns train_uptrain_runs(const AblateConfig& cfg, const std::vector<TrainConfig>& runs,
                               const std::vector<int64_t>& targets, int64_t steps,
                               AblateStats& stats) {
  const int64_t nh = cfg.base.model.n_head;
  UptrainRuns seed_runs;
  int done = 0;
  for (int s = 0; s < cfg.seeds; ++s) {
    const auto mha = std::find_if(runs.begin(), runs.end(), [&](const TrainConfig& c) {
      return c.model.n_kv_head == nh && c.seed == cfg.base.seed + static_cast<uint64_t>(s);
    });
    KVLAB_CHECK(mha != runs.end(), "ablate: --uptrain: the sweep has no multi-head run");
    const fs::path src_file = fs::path(mha->out_dir) / "final.h5";
    const std::string src_hash = file_content_hash(src_file);
    const LoadedModel src = load_model(src_file);
    for (int64_t kv : targets)
      for (size_t m = 0; m < cfg.uptrain_methods.size(); ++m) {
        const KVHeadInit method = cfg.uptrain_methods[m];
        const TrainConfig c =
            uptrain_run_config(*mha, kv, cfg.uptrain, uptrain_dir(cfg, kv, method, s));
        const std::string label =
            detail::cat("uptrain ", ++done, "/", stats.uptrain_runs_total, " kv=", kv, " ",
                        kv_head_init_name(method), " seed=", c.seed);
        uptrain_one(c, src, src_hash, method, label, stats);
        json run{{"seed", c.seed}, {"curve", read_curve(c.out_dir)}};
        const json& curve = run["curve"];
        KVLAB_CHECK(curve.size() >= 2 && curve.front()["step"] == 0 &&
                        curve.back()["step"] == steps,
                    "ablate: ", (fs::path(c.out_dir) / "log.jsonl").string(),
                    " does not hold the uptrain's evaluations from step 0 to ", steps);
        run["val_loss_converted"] = curve.front()["val_loss"];
        run["val_loss_uptrained"] = curve.back()["val_loss"];
        seed_runs[{kv, static_cast<int>(m), s}] = std::move(run);
      }
  }
  return seed_runs;
}

// One entry per (target n_kv_head, method): the seeds' losses converted and uptrained beside
// the from-scratch variant's, with each side's parameters, steps and tokens.
json uptrain_entries(const AblateConfig& cfg, const std::vector<TrainConfig>& runs,
                     const json& variants, const std::vector<int64_t>& targets, int64_t steps,
                     UptrainRuns& seed_runs) {
  const TrainConfig& b = cfg.base;
  const int64_t tokens_per_step = b.batch_size * b.model.block_size * b.grad_accum;
  json entries = json::array();
  for (int64_t kv : targets) {
    const json* scratch = nullptr;
    for (const json& v : variants)
      if (v.value("n_kv_head", json()) == kv) scratch = &v;
    KVLAB_CHECK(scratch != nullptr, "ablate: --uptrain: no from-scratch variant at n_kv_head ", kv);
    // A converted model keeps the multi-head MLP; with --param-matched the from-scratch one is
    // wider: the report says so where the counts differ.
    const int64_t converted_params =
        count_parameters(uptrain_run_config(runs.front(), kv, cfg.uptrain, "").model);
    for (size_t m = 0; m < cfg.uptrain_methods.size(); ++m) {
      json e{{"n_kv_head", kv}, {"method", kv_head_init_name(cfg.uptrain_methods[m])}};
      std::vector<double> conv, up;
      for (int s = 0; s < cfg.seeds; ++s) {
        json& r = seed_runs.at({kv, static_cast<int>(m), s});
        conv.push_back(r["val_loss_converted"].get<double>());
        up.push_back(r["val_loss_uptrained"].get<double>());
        e["runs"].push_back(std::move(r));
      }
      const auto [cm, cs] = mean_std(conv);
      const auto [um, us] = mean_std(up);
      e["val_loss_converted_mean"] = cm;
      e["val_loss_converted_std"] = cs;
      e["val_loss_uptrained_mean"] = um;
      e["val_loss_uptrained_std"] = us;
      e["val_loss_scratch_mean"] = (*scratch)["val_loss_mean"];
      e["val_loss_scratch_std"] = (*scratch)["val_loss_std"];
      e["params_uptrained"] = converted_params;
      e["params_scratch"] = (*scratch)["params"];
      e["uptrain_steps"] = steps;
      e["scratch_steps"] = b.iters;
      e["scratch_tokens"] = b.iters * tokens_per_step;
      e["uptrained_steps"] = b.iters + steps;  // the MHA run's and the uptraining's
      e["uptrained_tokens"] = (b.iters + steps) * tokens_per_step;
      entries.push_back(std::move(e));
    }
  }
  return entries;
}

}  // namespace

json run_uptrain(const AblateConfig& cfg, const std::vector<TrainConfig>& runs,
                 const json& variants, AblateStats& stats) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int64_t nh = cfg.base.model.n_head;
  std::vector<int64_t> targets;
  for (int64_t k : cfg.kv_heads)
    if (k < nh) targets.push_back(k);
  const int64_t steps = uptrain_steps(cfg.uptrain, cfg.base.iters);
  stats.uptrain_runs_total =
      static_cast<int>(targets.size() * cfg.uptrain_methods.size()) * cfg.seeds;
  UptrainRuns seed_runs = train_uptrain_runs(cfg, runs, targets, steps, stats);
  const json entries = uptrain_entries(cfg, runs, variants, targets, steps, seed_runs);
  json methods = json::array();
  for (KVHeadInit m : cfg.uptrain_methods) methods.push_back(kv_head_init_name(m));
  json mha_loss;
  for (const json& v : variants)
    if (v.value("n_kv_head", json()) == nh) mha_loss = {{"mean", v["val_loss_mean"]}, {"std", v["val_loss_std"]}};
  const TrainConfig& b = cfg.base;
  const TrainConfig shape = uptrain_run_config(runs.front(), 1, cfg.uptrain, "");
  return {{"fraction", cfg.uptrain},
          {"steps", steps},
          {"source_n_kv_head", nh},
          {"source_val_loss", mha_loss},
          {"methods", methods},
          {"warmup", shape.warmup},
          {"eval_interval", shape.eval_interval},
          {"lr", b.lr},
          {"min_lr", b.min_lr},
          {"lr_schedule",
           detail::cat("the sweep's schedule scaled to the ", steps, " steps: linear warmup over ",
                       shape.warmup, " steps to lr ", b.lr, ", cosine decay to ", b.min_lr,
                       "; a new AdamW, batch size ", b.batch_size)},
          {"tokens_per_step", b.batch_size * b.model.block_size * b.grad_accum},
          {"entries", entries},
          {"runs", stats.uptrain_runs_total},
          {"reused", stats.uptrain_runs_reused},
          {"resumed", stats.uptrain_runs_resumed},
          {"steps_trained", stats.uptrain_steps_trained},
          {"wall_s", std::chrono::duration<double>(Clock::now() - t0).count()}};
}

}  // namespace kvlab
