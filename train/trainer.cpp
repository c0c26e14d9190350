#include "train/trainer.h"

#ifdef KVLAB_WITH_NCCL
#include "autograd/backend/collectives.h"
#endif

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>
#include <sstream>

#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "checkpoints/model_io.h"

namespace kvlab {

namespace fs = std::filesystem;

void TrainConfig::validate() const {
  KVLAB_CHECK(tokenizer != "bpe" || model.vocab_size >= 257, "train: --tokenizer bpe needs "
              "--vocab-size N of at least 257 (the 256 bytes and <|endoftext|>), got ",
              model.vocab_size);
  model.validate();
  // inf passes every range check below (an infinite lr or weight decay would train to NaN).
  for (const auto& [name, value] : {std::pair<const char*, double>{"lr", lr},
                                    {"min_lr", min_lr},
                                    {"beta1", beta1},
                                    {"beta2", beta2},
                                    {"weight_decay", weight_decay},
                                    {"grad_clip", grad_clip},
                                    {"dropout", model.dropout},
                                    {"val_fraction", val_fraction}})
    KVLAB_CHECK(std::isfinite(value), "train: ", name, " must be a finite number, got ", value);
  KVLAB_CHECK(task == "text" || task == "mqar", "train: task must be text or mqar, got ", task);
  KVLAB_CHECK(task == "text" || tokenizer == "byte",
              "train: --task mqar carries its tokens byte-level; drop --tokenizer ", tokenizer);
  if (task == "mqar") mqar.validate(model.block_size + 1);
  KVLAB_CHECK(task != "text" || !corpus.empty(), "train: no corpus given (--corpus FILE)");
  KVLAB_CHECK(batch_size >= 1, "train: batch_size must be >= 1, got ", batch_size);
  KVLAB_CHECK(grad_accum >= 1, "train: grad_accum must be >= 1, got ", grad_accum);
  KVLAB_CHECK(iters >= 1, "train: iters must be >= 1, got ", iters);
  KVLAB_CHECK(lr > 0 && min_lr >= 0 && min_lr <= lr,
              "train: need 0 <= min_lr <= lr and lr > 0, got lr ", lr, ", min_lr ", min_lr);
  KVLAB_CHECK(warmup >= 0, "train: warmup must be >= 0, got ", warmup);
  KVLAB_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "train: betas must be in [0, 1)");
  KVLAB_CHECK(weight_decay >= 0, "train: weight_decay must be >= 0, got ", weight_decay);
  KVLAB_CHECK(grad_clip >= 0, "train: grad_clip must be >= 0 (0 disables), got ", grad_clip);
  KVLAB_CHECK(eval_interval >= 1 && eval_iters >= 1,
              "train: eval_interval and eval_iters must be >= 1");
  KVLAB_CHECK(ckpt_interval >= 0, "train: ckpt_interval must be >= 0");
  // The data layer counts tokens of a window and windows of a batch in int.
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  KVLAB_CHECK(model.block_size <= kIntMax, "train: block_size ", model.block_size,
              " is past the largest supported, ", kIntMax);
  KVLAB_CHECK(batch_size <= kIntMax, "train: batch_size ", batch_size,
              " is past the largest supported, ", kIntMax);
  KVLAB_CHECK(eval_iters <= kIntMax / batch_size, "train: eval_iters ", eval_iters,
              " x batch_size ", batch_size, " validation windows is past the largest supported, ",
              kIntMax);
  KVLAB_CHECK(val_fraction > 0 && val_fraction < 1, "train: val_fraction must be in (0, 1), got ",
              val_fraction);
  KVLAB_CHECK(zero == 0 || zero == 1, "train: zero must be 0 or 1 (ZeRO stage 1), got ", zero);
  check_device_available(device);
  KVLAB_CHECK(precision == MatmulPrecision::F32 || device == Device::CUDA,
              "train: bf16 needs the cuda device (the CPU computes in f32)");
}

Attrs TrainConfig::to_attrs() const {
  Attrs a;
  put_gpt_config(a, model);
  a["corpus"] = corpus;
  if (corpus_hash != 0) a["corpus_hash"] = hash_hex(corpus_hash);
  a["tokenizer"] = tokenizer;
  a["val_fraction"] = val_fraction;
  a["batch_size"] = batch_size;
  a["grad_accum"] = grad_accum;
  a["iters"] = iters;
  a["lr"] = lr;
  a["min_lr"] = min_lr;
  a["warmup"] = warmup;
  a["beta1"] = beta1;
  a["beta2"] = beta2;
  a["weight_decay"] = weight_decay;
  a["grad_clip"] = grad_clip;
  a["eval_interval"] = eval_interval;
  a["eval_iters"] = eval_iters;
  a["seed"] = static_cast<int64_t>(seed);
  if (task == "mqar") put_mqar_settings(a, mqar);  // a text run's keys stay as before tasks
  if (!init_from.empty()) {
    a["init_from"] = init_from;
    a["init_from_hash"] = init_from_hash;
  }
  return a;
}

double learning_rate(const TrainConfig& c, int64_t step) {
  if (step < c.warmup)
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup + 1);
  if (step >= c.iters) return c.min_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, c.iters - c.warmup));
  const double ratio = static_cast<double>(step - c.warmup) / span;
  return c.min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)) * (c.lr - c.min_lr);
}

namespace {
// Rank 0 keeps the single-process stream; rank r > 0 gets one derived from it.
uint64_t rank_stream(uint64_t base, int rank) {
  return rank == 0 ? base : hash64(base, 0x72616e6b00000000ull + static_cast<uint64_t>(rank));
}
}  // namespace

uint64_t sampler_seed(uint64_t seed, int rank) {
  return rank_stream(hash64(seed, 0x73616d70), rank);
}
uint64_t dropout_seed(uint64_t seed, int rank) {
  return rank_stream(hash64(seed, 0x64726f70), rank);
}

namespace {
std::string attr_str(const AttrValue& v) {
  std::ostringstream os;
  std::visit([&](const auto& x) { os << x; }, v);
  return os.str();
}
// Settings that describe where things are, not what is computed; the corpus's content is
// compared through corpus_hash, reported as "corpus".
bool informational(const std::string& key) { return key == "corpus" || key == "corpus_hash"; }

std::string corpus_desc(const Attrs& a) {
  const auto path = a.find("corpus");
  return detail::cat(path == a.end() ? "(no path)" : attr_str(path->second), " (content ",
                     attr_str(a.at("corpus_hash")), ")");
}
}  // namespace

void ensure_writable_dir(const fs::path& dir, const std::string& who) {
  std::error_code ec;
  KVLAB_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec), who, ": output folder ",
              dir.string(), " is a file, not a folder");
  fs::create_directories(dir, ec);
  KVLAB_CHECK(!ec, who, ": output folder ", dir.string(),
              " is not writable (creating it: ", ec.message(), ")");
  const fs::path probe = dir / ".kvlab-write-test";
  errno = 0;
  std::ofstream f(probe);
  KVLAB_CHECK(f.good(), who, ": output folder ", dir.string(), " is not writable",
              errno != 0 ? detail::cat(" (", std::strerror(errno), ")") : std::string());
  f.close();
  fs::remove(probe, ec);
}

std::vector<std::string> config_differences(const Attrs& a, const Attrs& b) {
  std::vector<std::string> diffs;
  const auto ha = a.find("corpus_hash"), hb = b.find("corpus_hash");
  if (ha != a.end() && hb != b.end() && attr_str(ha->second) != attr_str(hb->second))
    diffs.push_back("corpus: " + corpus_desc(a) + " vs " + corpus_desc(b));
  for (const auto& [k, v] : a) {
    if (informational(k)) continue;
    auto it = b.find(k);
    if (it == b.end())
      diffs.push_back(k + ": " + attr_str(v) + " vs (missing)");
    else if (attr_str(v) != attr_str(it->second))
      diffs.push_back(k + ": " + attr_str(v) + " vs " + attr_str(it->second));
  }
  for (const auto& [k, v] : b)
    if (!informational(k) && a.find(k) == a.end())
      diffs.push_back(k + ": (missing) vs " + attr_str(v));
  return diffs;
}

namespace {
// A split's targets for the sampler: null (the next tokens) where the corpus has none.
const std::vector<int32_t>* targets_of(const std::vector<int32_t>& targets) {
  return targets.empty() ? nullptr : &targets;
}

// Every setting is checked before the corpus is read (the vocabulary comes from the corpus).
Corpus validated_corpus(const TrainConfig& cfg) {
  TrainConfig check = cfg;
  if (check.model.vocab_size == 0 && cfg.tokenizer != "bpe") check.model.vocab_size = 1;
  check.validate();
  return load_run_corpus(cfg);
}
}  // namespace

Corpus load_run_corpus(const TrainConfig& cfg) {
  if (cfg.task == "mqar") return mqar_corpus(cfg.mqar, cfg.model.block_size);
  const TokenizerKind kind = Tokenizer::parse_kind(cfg.tokenizer);
  BpeSettings bpe;
  if (kind == TokenizerKind::Bpe) {
    bpe.vocab_size = static_cast<int>(cfg.model.vocab_size);
    bpe.progress = cfg.tokenizer_progress;
  }
  return load_corpus(cfg.corpus, kind, cfg.val_fraction, true, bpe);
}

Trainer::Trainer(const TrainConfig& cfg, std::shared_ptr<Communicator> comm)
    : cfg_(cfg),
      comm_(comm ? std::move(comm) : local_communicator()),
      corpus_(validated_corpus(cfg)) {
  check_corpus_fits(corpus_, static_cast<int>(cfg_.model.block_size));
  cfg_.model.vocab_size = corpus_.tokenizer.vocab_size();
  cfg_.corpus = corpus_.path;
  cfg_.corpus_hash = corpus_.content_hash;
  const int world = comm_->world_size(), rank = comm_->rank();
  if (world > 1) {
    // Every rank must run the same configuration on the same data.
    std::string desc;
    for (const auto& [k, v] : cfg_.to_attrs()) desc += k + "=" + attr_str(v) + ";";
    desc +=
        detail::cat("out_dir=", cfg_.out_dir, ";zero=", cfg_.zero, ";train=", corpus_.train.size(),
                    ";val=", corpus_.val.size(), ";hash=", corpus_.content_hash);
    KVLAB_CHECK(
        same_on_all_ranks(*comm_, hash_bytes(desc.data(), desc.size()), "check of the settings"),
        "train: the ", world,
        " data-parallel ranks were started with different settings "
        "or corpora; start every rank with the same flags");
  }
#ifdef KVLAB_WITH_NCCL
  if (world > 1 && cfg_.device == Device::CUDA) select_device(comm_->local_rank());
#else
  KVLAB_CHECK(world == 1 || cfg_.device == Device::CPU,
              "train: data-parallel training on GPUs needs a build with NCCL; this one reduces "
              "CPU gradients only");
#endif
  KVLAB_CHECK(cfg_.zero == 0 || world == 1 || cfg_.device == Device::CPU,
              "train: --zero 1 shards CPU optimizer state only; drop it for GPU ranks");
  if (!cfg_.out_dir.empty() && rank == 0) ensure_writable_dir(cfg_.out_dir, "train");
  model_ = std::make_unique<GPT>(cfg_.model, cfg_.seed);  // initialised on the CPU, then moved
  model_->to(cfg_.device);
  if (rank != 0) model_->dropout_generator().reseed(dropout_seed(cfg_.seed, rank));
  const AdamWConfig adamw{cfg_.beta1, cfg_.beta2, 1e-8, cfg_.weight_decay};
  if (cfg_.zero == 1 && world > 1)
    zero_ = std::make_unique<ShardedAdamW>(model_->named_parameters(), adamw, comm_);
  else
    opt_ = std::make_unique<AdamW>(model_->named_parameters(), adamw);
  sampler_ = std::make_unique<BatchSampler>(
      corpus_.train, static_cast<int>(cfg_.batch_size), static_cast<int>(cfg_.model.block_size),
      sampler_seed(cfg_.seed, rank), targets_of(corpus_.train_targets), corpus_.example_tokens);
  val_starts_ = fixed_windows(static_cast<int64_t>(corpus_.val.size()),
                              static_cast<int>(cfg_.model.block_size),
                              static_cast<int>(cfg_.eval_iters * cfg_.batch_size), 1234,
                              corpus_.example_tokens);
}

fs::path Trainer::checkpoint_path(const std::string& which) const {
  return fs::path(cfg_.out_dir) / (which + ".h5");
}

void Trainer::resume(const fs::path& file) {
  // The model /config describes is compared with the file's datasets before any is read.
  Checkpoint ckpt = load_checkpoint(file, gpt_load_options(file, true));
  if (cfg_.init_from.empty()) {  // the run this one continues may have begun from a file
    const auto from = ckpt.config.find("init_from"), hash = ckpt.config.find("init_from_hash");
    if (from != ckpt.config.end() && hash != ckpt.config.end()) {
      const std::string* f = std::get_if<std::string>(&from->second);
      const std::string* h = std::get_if<std::string>(&hash->second);
      if (f != nullptr && h != nullptr) {
        cfg_.init_from = *f;
        cfg_.init_from_hash = *h;
      }
    }
  }
  const auto diffs = config_differences(ckpt.config, cfg_.to_attrs());
  if (!diffs.empty()) {
    std::string msg;
    for (const auto& d : diffs) msg += (msg.empty() ? "" : "; ") + d;
    KVLAB_CHECK(false, "resume: ", file.string(),
                " was trained with a different config (checkpoint vs now): ", msg);
  }
  KVLAB_CHECK(ckpt.has_train_state, "resume: ", file.string(), " has no complete /train state");
  const std::vector<std::string> problems = training_state_problems(ckpt);
  if (!problems.empty()) {
    std::string msg;
    for (const auto& p : problems) msg += (msg.empty() ? "" : "; ") + p;
    KVLAB_CHECK(false, "resume: ", file.string(), ": ", msg);
  }
  const int world = comm_->world_size();
  const int64_t ckpt_world = static_cast<int64_t>(ckpt.rng_state.size() / 8);  // checked above
  KVLAB_CHECK(ckpt_world == world, "resume: ", file.string(), " was written by a run with ",
              ckpt_world, " rank(s) and this run has ", world,
              " rank(s); every rank's batch stream is saved, so resume with the same number of "
              "ranks (mpirun -np ",
              ckpt_world, ckpt_world == 1 ? ", or without mpirun)" : ")");
  KVLAB_CHECK(get_tokenizer(ckpt, file) == corpus_.tokenizer, "resume: ", file.string(),
              " was trained with a different tokenizer vocabulary than ", cfg_.corpus, " gives");
  KVLAB_CHECK(ckpt.iteration >= 0 && ckpt.iteration <= cfg_.iters, "resume: ", file.string(),
              ": /train attribute iteration = ", ckpt.iteration,
              " is outside [0, iters = ", cfg_.iters, "]");
  copy_into(model_->named_parameters(), ckpt.model, "model", file);
  if (zero_) {
    KVLAB_CHECK(ckpt.has_optimizer, "checkpoint ", file.string(),
                ": no /optimizer group, cannot resume training from it");
    zero_->load_moments(ckpt.optimizer_m, ckpt.optimizer_v, ckpt.optimizer_step, file);
  } else {
    get_optimizer(*opt_, ckpt, file);
  }
  step_ = ckpt.iteration;
  resumed_ = true;
  std::error_code ec;
  if (fs::equivalent(file, checkpoint_path("last"), ec)) last_saved_ = step_;
  best_val_ = ckpt.best_val_loss;
  // Rank r's words: rng_state[8 r, 8 r + 4) sampler, [8 r + 4, 8 r + 8) dropout.
  const auto words = ckpt.rng_state.begin() + 8 * comm_->rank();
  Generator::State s{}, d{};
  std::copy_n(words, 4, s.begin());
  std::copy_n(words + 4, 4, d.begin());
  sampler_->set_state(s);
  model_->dropout_generator().set_state(d);
  if (auto it = ckpt.train_extra.find("elapsed_s"); it != ckpt.train_extra.end())
    if (const double* e = std::get_if<double>(&it->second)) elapsed_ = *e;
  // Drop log lines written after this checkpoint (a crash between checkpoints).
  const fs::path log = fs::path(cfg_.out_dir) / "log.jsonl";
  if (!cfg_.out_dir.empty() && comm_->rank() == 0 && fs::exists(log)) {
    std::ifstream in(log);
    std::string line, kept;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t{0}) <= step_) kept += line + "\n";
    }
    in.close();
    std::ofstream(log, std::ios::trunc) << kept;
  }
}

void Trainer::init_from(const fs::path& file) {
  KVLAB_CHECK(step_ == 0 && !resumed_, "init-from: ", file.string(),
              ": a run starts from a checkpoint's weights before its first step, not at step ",
              step_);
  // The model /config describes is compared with the file's datasets before any is read.
  Checkpoint ckpt = load_model_file(file, gpt_load_options(file, false));
  const Tokenizer tok = get_tokenizer(ckpt, file);
  const Tokenizer& ours = corpus_.tokenizer;
  KVLAB_CHECK(tok == ours, "init-from: ", file.string(), " has another tokenizer (",
              tok.kind_name(), ", ", tok.vocab_size(), " symbols) than ", cfg_.corpus, " gives (",
              ours.kind_name(), ", ", ours.vocab_size(),
              " symbols): its token ids would stand for other text");
  Attrs theirs, mine;
  put_gpt_config(theirs, get_gpt_config(ckpt.config, file));
  put_gpt_config(mine, cfg_.model);
  theirs.erase("dropout");  // a training setting: the run's own
  mine.erase("dropout");
  const auto diffs = config_differences(theirs, mine);
  if (!diffs.empty()) {
    std::string msg;
    for (const auto& d : diffs) msg += (msg.empty() ? "" : "; ") + d;
    KVLAB_CHECK(false, "init-from: ", file.string(),
                " holds another model than this run's (checkpoint vs run): ", msg);
  }
  copy_into(model_->named_parameters(), ckpt.model, "model", file);
  cfg_.init_from = file.string();
  cfg_.init_from_hash = file_content_hash(file);
}

void Trainer::save(const fs::path& file) {
  if (cfg_.out_dir.empty()) return;
  const int world = comm_->world_size();
  const auto s = sampler_->state();
  const auto d = model_->dropout_generator().state();
  std::vector<uint64_t> words(s.begin(), s.end());
  words.insert(words.end(), d.begin(), d.end());
  Checkpoint c;
  if (world > 1) {  // collectives first: every rank takes part, rank 0 writes
    check_replicas_agree();
    words = comm_->gather(words, 0, "gather of the sampler states");
    if (zero_) zero_->gather_moments(c.optimizer_m, c.optimizer_v);
    if (comm_->rank() != 0) return;
  }
  c.config = cfg_.to_attrs();
  put_tokenizer(c, corpus_.tokenizer);
  c.model = to_arrays(model_->named_parameters());
  if (zero_) {
    c.has_optimizer = true;
    c.optimizer_step = zero_->step_count();
    c.train_extra["zero"] = cfg_.zero;
  } else {
    put_optimizer(c, *opt_);
  }
  c.has_train_state = true;
  c.iteration = step_;
  c.best_val_loss = best_val_;
  c.rng_state = std::move(words);  // 8 words per rank, in rank order
  c.train_extra["elapsed_s"] = elapsed_;
  // What turns a val loss into bits per byte (inspect, the ablation report).
  c.train_extra["val_tokens_per_byte"] = val_tokens_per_byte(corpus_);
  c.train_extra["world_size"] = static_cast<int64_t>(world);
  save_checkpoint(file, c);
}

void Trainer::save_last() {
  save(checkpoint_path("last"));
  last_saved_ = step_;
}

std::string Trainer::saved_weights_note(const std::string& what) const {
  if (cfg_.out_dir.empty()) return "";
  std::string note = last_saved_ < 0        ? std::string(". No last.h5 saved yet")
                     : last_saved_ == step_ ? detail::cat(". last.h5 holds step ", step_,
                                                          ", the weights that gave this ", what)
                                            : detail::cat(". last.h5 holds step ", last_saved_);
  if (std::isfinite(best_val_))
    note += detail::cat("; best.h5 holds the weights of the lowest val loss, ", best_val_);
  return note;
}

void Trainer::check_replicas_agree() {
  uint64_t h = hash_bytes(nullptr, 0);
  for (const auto& [name, p] : model_->named_parameters()) {
    const Tensor host = p.to(Device::CPU);
    h = hash_bytes(host.data<float>(), static_cast<size_t>(host.numel()) * sizeof(float), h);
  }
  KVLAB_CHECK(same_on_all_ranks(*comm_, h, "check of the replicas"), "train: at step ", step_,
              " the ", comm_->world_size(), " data-parallel ranks hold different weights");
}

bool Trainer::any_rank(bool mine) {
  if (comm_->world_size() == 1) return mine;
  double v = mine ? 1.0 : 0.0;
  comm_->allreduce_sum(std::span<double>(&v, 1), "agreement on stopping");
  return v > 0;
}

void Trainer::append_log(const StepRecord& r) {
  if (cfg_.out_dir.empty() || comm_->rank() != 0) return;
  // Step 0 has no training loss: null, not 0.
  nlohmann::json j = {{"step", r.step},
                      {"lr", r.lr},
                      {"train_loss", r.step > 0 ? nlohmann::json(r.train_loss) : nullptr},
                      {"grad_norm", r.grad_norm},
                      {"tokens_per_s", r.tokens_per_s},
                      {"elapsed_s", r.elapsed_s}};
  if (r.val_loss) {
    j["val_loss"] = *r.val_loss;
    j["val_bpb"] = bits_per_byte(*r.val_loss, val_tokens_per_byte(corpus_));
  }
  if (r.val_accuracy) j["val_accuracy"] = *r.val_accuracy;
  if (comm_->world_size() > 1 && r.step > 0) {
    j["comm_s"] = r.comm_s;
    j["comm_frac"] = r.step_s > 0 ? r.comm_s / r.step_s : 0.0;
  }
  // The step-0 line starts a fresh run's log: what a run that saved no checkpoint left goes.
  std::ofstream(fs::path(cfg_.out_dir) / "log.jsonl", r.step == 0 ? std::ios::trunc : std::ios::app)
      << j.dump() << "\n";
}

double Trainer::evaluate() { return evaluate_all().loss; }

Trainer::Evaluation Trainer::evaluate_all() {
  NoGradGuard no_grad;
  MatmulPrecisionGuard precision(cfg_.precision);
  const bool was_training = model_->training();
  model_->set_training(false);
  const int64_t B = cfg_.batch_size, T = cfg_.model.block_size;
  const std::vector<int32_t>* targets = targets_of(corpus_.val_targets);
  std::vector<int32_t> x, y;
  Tensor xt = Tensor::empty({B, T}, DType::I32), yt = Tensor::empty({B, T}, DType::I32);
  const int world = comm_->world_size(), rank = comm_->rank();
  // Per batch: its loss, and on a task corpus its scored tokens and those the argmax got right.
  // With several ranks, batch i is evaluated on rank i % world and the figures are all-reduced
  // (adding zeros is exact), then summed in order: the single-process value.
  const auto n = static_cast<size_t>(cfg_.eval_iters);
  std::vector<double> losses(n, 0.0), scored(targets ? n : 0, 0.0), right(scored.size(), 0.0);
  for (size_t i = 0; i < n; ++i) {
    if (world > 1 && static_cast<int>(i % static_cast<size_t>(world)) != rank) continue;
    fill_windows(corpus_.val,
                 std::span<const int64_t>(val_starts_).subspan(i * static_cast<size_t>(B),
                                                               static_cast<size_t>(B)),
                 static_cast<int>(T), x, y, targets);
    std::copy(x.begin(), x.end(), xt.data<int32_t>());
    std::copy(y.begin(), y.end(), yt.data<int32_t>());
    if (targets == nullptr) {
      losses[i] = model_->loss(xt, yt).item();
      continue;
    }
    const Tensor logits = model_->forward(xt);
    losses[i] = cross_entropy(logits, yt.to(logits.device())).item();
    const Tensor host = logits.to(Device::CPU);
    const int64_t V = host.size(-1);
    const float* row = host.data<float>();
    for (size_t t = 0; t < y.size(); ++t, row += V) {
      if (y[t] < 0) continue;
      scored[i] += 1;
      right[i] += std::max_element(row, row + V) - row == y[t] ? 1 : 0;
    }
  }
  if (world > 1) {
    comm_->allreduce_sum(losses, "all-reduce of validation losses");
    if (targets) comm_->allreduce_sum(scored, "all-reduce of validation accuracy");
    if (targets) comm_->allreduce_sum(right, "all-reduce of validation accuracy");
  }
  model_->set_training(was_training);
  Evaluation out;
  for (double l : losses) out.loss += l;
  out.loss /= static_cast<double>(n);
  if (targets) {
    double s = 0, r = 0;
    for (size_t i = 0; i < n; ++i) s += scored[i], r += right[i];
    out.accuracy = s > 0 ? r / s : 0.0;
  }
  return out;
}

namespace {
// "nan", "inf" or "-inf" (iostreams may print a NaN's sign bit: "-nan").
std::string non_finite_str(double v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }
}  // namespace

bool Trainer::run(const std::function<bool(const StepRecord&)>& on_step,
                  const std::atomic<bool>* stop) {
  using Clock = std::chrono::steady_clock;
  const int64_t B = cfg_.batch_size, T = cfg_.model.block_size;
  const int64_t ckpt_every = cfg_.ckpt_interval > 0 ? cfg_.ckpt_interval : cfg_.eval_interval;
  const int world = comm_->world_size();
  MatmulPrecisionGuard precision(cfg_.precision);
  model_->set_training(true);
  if (step_ == 0 && !resumed_) {  // the curve starts at the initial weights (logged once)
    StepRecord r;
    const Evaluation e = evaluate_all();
    r.val_loss = e.loss;
    r.val_accuracy = e.accuracy;
    append_log(r);
    if (any_rank(!on_step(r))) return false;
  }
  std::vector<int32_t> x, y;
  Tensor xt = Tensor::empty({B, T}, DType::I32), yt = Tensor::empty({B, T}, DType::I32);
  const NamedTensors params = model_->named_parameters();
  Generator& dropout = model_->dropout_generator();
  while (step_ < cfg_.iters) {
    const auto t0 = Clock::now();
    model_->zero_grad();
    // Where this step's batches and dropout masks start. A stop part-way through the gradient
    // accumulation (a step of many micro-batches can take minutes) puts them back, so that its
    // checkpoint is the one a stop before the step writes and resume stays exact.
    const Generator::State sampler_at = sampler_->state(), dropout_at = dropout.state();
    double loss_sum = 0;
    for (int64_t micro = 0; micro < cfg_.grad_accum; ++micro) {
      // With several ranks a stop request is agreed on after each step (below).
      if (world == 1 && stop != nullptr && stop->load()) {
        sampler_->set_state(sampler_at);
        dropout.set_state(dropout_at);
        save_last();
        return false;
      }
      sampler_->next(x, y);
      std::copy(x.begin(), x.end(), xt.data<int32_t>());
      std::copy(y.begin(), y.end(), yt.data<int32_t>());
      Tensor loss = model_->loss(xt, yt);
      if (cfg_.grad_accum > 1) loss = scale(loss, 1.0 / static_cast<double>(cfg_.grad_accum));
      loss_sum += loss.item();
      loss.backward();
    }
    StepRecord r;
    if (world > 1) {
      const auto c0 = Clock::now();
      reducer_.allreduce_mean(*comm_, params);
      r.comm_s += std::chrono::duration<double>(Clock::now() - c0).count();
    }
    r.grad_norm = global_grad_norm(params);
    if (world > 1) {  // before the update, so every rank checks the same loss below
      const auto c0 = Clock::now();
      comm_->allreduce_sum(std::span<double>(&loss_sum, 1), "all-reduce of the training loss");
      loss_sum /= static_cast<double>(world);
      r.comm_s += std::chrono::duration<double>(Clock::now() - c0).count();
    }
    r.lr = learning_rate(cfg_, step_);
    // A diverged step stops the run before AdamW spreads it into the weights and before any
    // checkpoint could store them; the loss and the norm are the same on every rank.
    for (const auto& [what, value] :
         {std::pair<const char*, double>{"loss", loss_sum}, {"gradient norm", r.grad_norm}})
      KVLAB_CHECK(std::isfinite(value), "train: ", what, " is not finite at step ", step_ + 1, " (",
                  non_finite_str(value), "); lower --lr (now ", cfg_.lr,
                  ") or lengthen --warmup and train again in another --out (resuming would "
                  "repeat this step)",
                  saved_weights_note(what));
    if (zero_)
      r.comm_s += zero_->step(r.lr, clip_factor(r.grad_norm, cfg_.grad_clip));
    else
      opt_->step(r.lr, clip_factor(r.grad_norm, cfg_.grad_clip));
    ++step_;
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    elapsed_ += dt;
    r.step = step_;
    r.train_loss = loss_sum;
    r.tokens_per_s = static_cast<double>(B * T * cfg_.grad_accum * world) / dt;
    r.elapsed_s = elapsed_;
    r.step_s = dt;
    const bool last = step_ == cfg_.iters;
    if (step_ % cfg_.eval_interval == 0 || last) {
      const Evaluation e = evaluate_all();
      r.val_loss = e.loss;
      r.val_accuracy = e.accuracy;
    }
    // The step's line goes to the log before its checkpoints: a process that dies in between
    // leaves the log ahead of last.h5, which resume() trims, never behind it.
    append_log(r);
    if (r.val_loss && *r.val_loss < best_val_) {
      best_val_ = *r.val_loss;
      save(checkpoint_path("best"));
    }
    if (step_ % ckpt_every == 0 || last) save_last();
    const bool go_on = on_step(r);
    const bool halt = world == 1 ? !go_on : any_rank(!go_on || (stop != nullptr && stop->load()));
    if (halt && !last) {
      save_last();
      return false;
    }
  }
  if (!cfg_.out_dir.empty()) save(checkpoint_path("final"));
  return true;
}

}  // namespace kvlab
