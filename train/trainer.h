#pragma once
// The training loop: data, model, AdamW with warmup + cosine LR, gradient accumulation and
// clipping, evaluation on fixed validation windows, JSONL logging and checkpoints from which
// a run resumes bit-exactly (same thread count).
//
// Data parallel (a Communicator with world_size > 1, e.g. under `mpirun -np N kvlab train`):
// batch_size is per rank; rank r draws its batches from its own stream (sampler_seed(seed, r);
// rank 0's is the single-process stream), gradients are averaged over the ranks after the
// micro-steps and before clipping and AdamW, so every rank holds the same weights. Evaluation
// is split over the ranks (batch i on rank i % W) and its per-batch losses all-reduced, so
// val_loss equals the single-process value and is the same on every rank. Rank 0 alone writes
// log.jsonl and checkpoints; a checkpoint records world_size and every rank's generator
// states, and resuming needs the same world size. Every rank must call run(), evaluate() and
// resume() together, and on_step must return the same value on every rank.
#include <atomic>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "checkpoints/checkpoint.h"
#include "data/corpus.h"
#include "data/mqar.h"
#include "data/sampler.h"
#include "nn/adamw.h"
#include "autograd/ops/ops.h"
#include "nn/gpt.h"
#include "train/comm.h"
#include "train/zero.h"

namespace kvlab {

struct TrainConfig {
  // text: the corpus file; mqar: multi-query associative recall (data/mqar.h), generated from
  // `mqar` (the corpus file is not read; the tokenizer is byte-level).
  std::string task = "text";
  MqarSettings mqar;
  std::string corpus;
  // fnv1a64 of the corpus file's bytes (Corpus::content_hash), stored in checkpoints so a run
  // resumes (or an ablation reuses a run) only on the same text. 0: not known yet; the Trainer
  // sets it from the corpus it reads.
  uint64_t corpus_hash = 0;
  std::string tokenizer = "char";
  double val_fraction = 0.1;
  // vocab_size comes from the corpus for char and byte; for bpe it is the vocabulary to learn
  // from the training split (the kvlab pre-split pattern).
  GPTConfig model;
  // Called after each merge while a bpe vocabulary is learnt (a progress bar). Not in
  // to_attrs().
  BpeProgress tokenizer_progress;
  int64_t batch_size = 12;
  int64_t grad_accum = 1;
  int64_t iters = 2000;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup = 100;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  int64_t eval_interval = 250;
  int64_t eval_iters = 200;  // fixed validation batches of batch_size windows
  int64_t ckpt_interval = 0;  // 0: at every evaluation
  uint64_t seed = 1337;
  std::string out_dir;
  // 1: ZeRO stage 1, the AdamW moments sharded over the ranks (train/zero.h); same weights as
  // plain data parallelism, and no effect with one rank. Not part of to_attrs(): a run may be
  // resumed with or without it.
  int64_t zero = 0;
  // Where the model, its gradients and the optimizer state live. Not part of to_attrs(): a
  // checkpoint written on one device resumes or generates on the other.
  Device device = Device::CPU;
  // GEMM precision on a GPU: bf16 multiplies bf16-rounded operands with f32 accumulation;
  // weights, optimizer state and checkpoints stay f32 (autograd/ops/ops.h). Not in to_attrs().
  MatmulPrecision precision = MatmulPrecision::F32;
  // The checkpoint whose weights the run started from (Trainer::init_from; empty: from
  // GPT's initialisation) and its content hash (model_io.h's file_content_hash), recorded in
  // /config as init_from and init_from_hash. Set by init_from, kept by resume.
  std::string init_from, init_from_hash;

  // Throws UsageError-style kvlab::Error naming the setting.
  void validate() const;
  // Every setting that defines the run, as /config attributes (model keys included).
  Attrs to_attrs() const;
};

// The corpus a run trains on: cfg's file, tokenizer and split (a bpe vocabulary of
// cfg.model.vocab_size tokens learnt from its training split, or found in the token cache),
// or for --task mqar the task's examples at cfg.model.block_size.
Corpus load_run_corpus(const TrainConfig& cfg);

// Linear warmup to lr over `warmup` steps, then cosine decay to min_lr at `iters`.
double learning_rate(const TrainConfig& cfg, int64_t step);

struct StepRecord {
  int64_t step = 0;  // 1-based: the number of updates done
  // At step 0 (the initial weights' evaluation) no step was trained: train_loss is 0 there and
  // means nothing (the log writes null).
  double lr = 0, train_loss = 0, grad_norm = 0, tokens_per_s = 0, elapsed_s = 0;
  std::optional<double> val_loss;
  // With val_loss on a task corpus: the share of scored validation tokens whose argmax is the
  // target (MQAR: answers recalled).
  std::optional<double> val_accuracy;
  // Seconds of this step (evaluation excluded) and of it spent in collectives (gradient
  // all-reduce, loss average, ZeRO all-gather; waiting for slower ranks included). train_loss
  // is the mean over ranks and tokens_per_s counts every rank's tokens.
  double step_s = 0, comm_s = 0;
};

// Seeds of rank `rank`'s batch sampler and dropout generator; rank 0 gets the single-process
// seeds, so a 1-rank run is exactly a run without a Communicator.
uint64_t sampler_seed(uint64_t seed, int rank);
uint64_t dropout_seed(uint64_t seed, int rank);

// Creates `dir` if needed and checks a file can be written in it; the error names `who`.
void ensure_writable_dir(const std::filesystem::path& dir, const std::string& who);

// Keys whose values differ between two /config attribute sets ("n_kv_head: 4 vs 2"). The corpus
// is compared by content, not path ("corpus: a.txt (content 2c44ba6e87467f92) vs b.txt (content
// ...)"), and only when both sets hold its hash (checkpoints written before it was stored do
// not).
std::vector<std::string> config_differences(const Attrs& a, const Attrs& b);

class Trainer {
 public:
  // `comm` null means a single process (local_communicator()).
  explicit Trainer(const TrainConfig& cfg, std::shared_ptr<Communicator> comm = nullptr);

  // Continues from `ckpt` (written by a Trainer with the same config on the same corpus; a
  // differing key or corpus content is an error that names it). A run started by init_from
  // records it in its checkpoints; a Trainer that has no init_from of its own takes it from
  // `ckpt`, so a resumed run still says where its weights came from.
  void resume(const std::filesystem::path& ckpt);
  // Starts this run, before its first step, from the weights of `ckpt` (any kvlab checkpoint
  // of a GPT: a run's, or kvlab convert's weights-only file) instead of GPT's initialisation.
  // The optimizer, the schedule and the step stay new; nothing else of the file is read.
  // Errors name the file and: a tokenizer other than the corpus's, or a model key of its
  // /config (dropout aside, a training setting) other than this run's config.
  void init_from(const std::filesystem::path& ckpt);
  // Trains until cfg.iters, or until `on_step` returns false or `stop` becomes true; a
  // checkpoint (last.h5) is written whenever it stops. Returns true when all iters are done.
  // A run from step 0 (not resumed) starts log.jsonl afresh, dropping what a run that saved no
  // checkpoint left there; each step's line is written before its checkpoints. A step whose
  // loss or gradient norm is not finite throws (naming the step) before the optimizer applies
  // it and before anything is saved; the weights that gave it may already be last.h5 (a
  // checkpoint at the step before), and the message says which step last.h5 holds and what
  // best.h5 holds.
  bool run(const std::function<bool(const StepRecord&)>& on_step,
           const std::atomic<bool>* stop = nullptr);
  // Mean loss over the fixed validation windows (the same for every run of a corpus).
  double evaluate();
  // The same loss, and on a task corpus (Corpus::val_targets) the share of its scored tokens
  // predicted right by the argmax.
  struct Evaluation {
    double loss = 0;
    std::optional<double> accuracy;
  };
  Evaluation evaluate_all();

  int64_t step() const { return step_; }
  double best_val_loss() const { return best_val_; }
  GPT& model() { return *model_; }
  const Corpus& corpus() const { return corpus_; }
  const TrainConfig& config() const { return cfg_; }
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->world_size(); }
  Communicator& communicator() { return *comm_; }
  std::filesystem::path checkpoint_path(const std::string& which) const;  // "last", "best", "final"

 private:
  void save(const std::filesystem::path& file);
  void save_last();  // last.h5, remembering its step
  // What the saved files hold, for the error that a non-finite `what` (the loss or the
  // gradient norm) ends a run with.
  std::string saved_weights_note(const std::string& what) const;
  void append_log(const StepRecord& r);
  // True when `mine` is true on any rank (collective when world_size > 1).
  bool any_rank(bool mine);
  // Throws on every rank unless every rank holds the same weights.
  void check_replicas_agree();

  TrainConfig cfg_;
  std::shared_ptr<Communicator> comm_;
  GradientReducer reducer_;
  std::unique_ptr<ShardedAdamW> zero_;  // --zero 1 with more than one rank (then opt_ is null)
  Corpus corpus_;
  std::unique_ptr<GPT> model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<BatchSampler> sampler_;
  std::vector<int64_t> val_starts_;
  int64_t step_ = 0;
  bool resumed_ = false;     // the log already holds the lines up to step_
  int64_t last_saved_ = -1;  // the step last.h5 holds, when this Trainer saved or resumed it
  double best_val_ = std::numeric_limits<double>::infinity();
  double elapsed_ = 0;  // training seconds so far, evaluation excluded
};

}  // namespace kvlab
