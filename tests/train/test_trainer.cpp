#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "checkpoints/model_io.h"
#include "tests/test_dir.h"
#include "tests/train/train_test_util.h"
#include "train/output_dir.h"
#include "train/trainer.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

// A small synthetic corpus: enough structure to learn, no dependency on shared data.
class TrainerTest : public testing::TestDirFixture {
 protected:
  TrainerTest() : TestDirFixture("kvlab_train") {}
  void SetUp() override {
    TestDirFixture::SetUp();
    testing::write_tiny_corpus(dir_);
  }

  TrainConfig config(const std::string& out, double dropout = 0.0) const {
    return testing::tiny_config(dir_, out, dropout);
  }
};

using testing::run_all;

// The message of the Error that f() throws; a test failure when it throws none.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

// MQAR (data/mqar.h) is learnt by a 2-layer multi-head model to near-perfect accuracy within a
// few hundred steps, through its attention: with the attention outputs zeroed it is at chance.
TEST_F(TrainerTest, MqarIsLearntByATwoLayerModelThroughItsAttention) {
  TrainConfig c;
  c.task = "mqar";
  c.tokenizer = "byte";
  c.mqar.vocab = 32;
  c.mqar.pairs = 4;
  c.model.n_layer = 2;
  c.model.n_head = c.model.n_kv_head = 4;
  c.model.n_embd = 64;
  c.model.block_size = 32;
  c.model.pos = "rope";
  c.model.norm = "rmsnorm";
  c.model.mlp = "swiglu";
  c.model.bias = false;
  c.model.dropout = 0;
  c.batch_size = 64;
  c.iters = 600;
  c.lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup = 50;
  c.eval_interval = 600;
  c.eval_iters = 8;
  Trainer t(c);
  const std::vector<StepRecord> recs = testing::run_all(t);
  ASSERT_TRUE(recs.front().val_accuracy && recs.back().val_accuracy);
  EXPECT_LT(*recs.front().val_accuracy, 0.1);  // the untrained model: chance is 1/16
  const Trainer::Evaluation learnt = t.evaluate_all();
  EXPECT_GE(*learnt.accuracy, 0.95) << "loss " << learnt.loss;
  EXPECT_EQ(*learnt.accuracy, *recs.back().val_accuracy);
  // Without attention each answer is a guess among the 16 values.
  for (auto& [name, p] : t.model().named_parameters())
    if (name.find(".attn.c_proj.") != std::string::npos)
      std::fill(p.data<float>(), p.data<float>() + p.numel(), 0.0f);
  const Trainer::Evaluation blind = t.evaluate_all();
  EXPECT_LT(*blind.accuracy, 0.2);
  EXPECT_GT(blind.loss, learnt.loss + 1);
}

// A task's run logs its accuracy beside the loss, names the task's corpus, and refuses a
// tokenizer other than the task's.
TEST_F(TrainerTest, AnMqarRunLogsItsAccuracy) {
  TrainConfig c = config("mqar");
  c.task = "mqar";
  c.tokenizer = "byte";
  c.mqar.train_examples = 50;
  c.mqar.val_examples = 20;
  Trainer t(c);
  EXPECT_EQ(t.corpus().path, "mqar(vocab=32,pairs=4,train=50,val=20,seed=0),length=17");
  EXPECT_EQ(t.config().model.vocab_size, 256);
  testing::run_all(t);
  std::ifstream log(dir_ / "mqar" / "log.jsonl");
  int evaluations = 0;
  for (std::string line; std::getline(log, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("val_loss")) continue;
    ++evaluations;
    ASSERT_TRUE(j.contains("val_accuracy")) << line;
    EXPECT_GE(j["val_accuracy"].get<double>(), 0.0);
    EXPECT_LE(j["val_accuracy"].get<double>(), 1.0);
  }
  EXPECT_EQ(evaluations, 4);  // steps 0, 4, 8, 12
  // A text run logs none.
  Trainer text(config("text"));
  testing::run_all(text);
  std::ifstream text_log(dir_ / "text" / "log.jsonl");
  for (std::string line; std::getline(text_log, line);)
    EXPECT_EQ(line.find("val_accuracy"), std::string::npos) << line;
  c.tokenizer = "char";
  EXPECT_THROW({ Trainer refused(c); }, Error);
}

TEST_F(TrainerTest, LossDecreasesAndLogIsWritten) {
  Trainer t(config("run"));
  const auto recs = run_all(t);
  ASSERT_EQ(recs.size(), 13u);  // the step-0 evaluation, then 12 steps
  ASSERT_TRUE(recs.front().val_loss.has_value());
  EXPECT_NEAR(*recs.front().val_loss, std::log(t.corpus().tokenizer.vocab_size()), 0.3);
  EXPECT_LT(*recs.back().val_loss, *recs.front().val_loss - 0.5);
  EXPECT_TRUE(fs::exists(dir_ / "run" / "final.h5"));
  EXPECT_TRUE(fs::exists(dir_ / "run" / "best.h5"));
  std::ifstream log(dir_ / "run" / "log.jsonl");
  int lines = 0;
  for (std::string line; std::getline(log, line);) ++lines;
  EXPECT_EQ(lines, 13);
}

// Training 0 -> N in one go equals 0 -> k, stop, resume, k -> N: bit-identical losses at every
// step and identical final weights (dropout on, so the dropout stream is restored too).
TEST_F(TrainerTest, ResumeIsBitExact) {
  Trainer full(config("full", 0.1));
  const auto a = run_all(full);
  {
    Trainer first(config("split", 0.1));
    run_all(first, 5);  // stops after step 5 (not a checkpoint interval): last.h5 written
    EXPECT_EQ(first.step(), 5);
  }
  Trainer second(config("split", 0.1));
  second.resume(dir_ / "split" / "last.h5");
  EXPECT_EQ(second.step(), 5);
  const auto b = run_all(second);
  ASSERT_EQ(b.size(), 7u);
  for (const auto& r : b) {
    const auto& ref = a[static_cast<size_t>(r.step)];
    ASSERT_EQ(ref.step, r.step);
    EXPECT_EQ(ref.train_loss, r.train_loss) << "step " << r.step;  // bit-identical
    EXPECT_EQ(ref.grad_norm, r.grad_norm) << "step " << r.step;
    EXPECT_EQ(ref.val_loss.has_value(), r.val_loss.has_value());
    if (r.val_loss) {
      EXPECT_EQ(*ref.val_loss, *r.val_loss);
    }
  }
  const auto pa = full.model().named_parameters(), pb = second.model().named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(pa[i].second.to_vector<float>(), pb[i].second.to_vector<float>()) << pa[i].first;
  // The log keeps one line per step: nothing duplicated by the interruption.
  std::ifstream log(dir_ / "split" / "log.jsonl");
  int lines = 0;
  for (std::string line; std::getline(log, line);) ++lines;
  EXPECT_EQ(lines, 13);
}

TEST_F(TrainerTest, ResumeRefusesADifferentConfigAndNamesTheKeys) {
  Trainer first(config("run"));
  run_all(first, 2);
  TrainConfig other = config("run");
  other.model.n_kv_head = 1;
  other.lr = 1e-3;
  Trainer second(other);
  const std::string msg = error_of([&] { second.resume(dir_ / "run" / "last.h5"); });
  EXPECT_NE(msg.find("n_kv_head: 2 vs 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lr:"), std::string::npos) << msg;
}

// Lines of `log` whose "step" is `step`.
int log_lines_at_step(const fs::path& log, int64_t step) {
  std::ifstream in(log);
  int n = 0;
  const std::string key = "\"step\":" + std::to_string(step) + ",";
  for (std::string line; std::getline(in, line);) n += line.find(key) != std::string::npos;
  return n;
}

TEST_F(TrainerTest, ResumeRefusesAnotherCorpusNamingBoth) {
  Trainer first(config("run"));
  run_all(first, 2);
  // Another text under another name, and another text under the same name.
  std::ofstream(dir_ / "other.txt") << std::ifstream(dir_ / "corpus.txt").rdbuf() << "the end.\n";
  TrainConfig other = config("run");
  other.corpus = (dir_ / "other.txt").string();
  for (int pass = 0; pass < 2; ++pass) {
    Trainer second(other);
    const std::string msg = error_of([&] { second.resume(dir_ / "run" / "last.h5"); });
    const std::string want = "corpus: " + (dir_ / "corpus.txt").string() + " (content " +
                             hash_hex(first.corpus().content_hash) + ") vs " + other.corpus +
                             " (content " + hash_hex(second.corpus().content_hash) + ")";
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
    if (pass == 0) {  // the new text replaces the old one under its name
      fs::rename(dir_ / "other.txt", dir_ / "corpus.txt");
      other.corpus = (dir_ / "corpus.txt").string();
    }
  }
}

// Checkpoints written before the corpus hash was stored still resume.
TEST_F(TrainerTest, ResumeAcceptsACheckpointWithoutCorpusHash) {
  Trainer first(config("run"));
  run_all(first, 2);
  const fs::path last = dir_ / "run" / "last.h5";
  Checkpoint c = load_checkpoint(last, true);
  ASSERT_EQ(std::get<std::string>(c.config.at("corpus_hash")),
            hash_hex(first.corpus().content_hash));
  c.config.erase("corpus_hash");
  save_checkpoint(last, c);
  Trainer second(config("run"));
  EXPECT_NO_THROW(second.resume(last));
  EXPECT_EQ(second.step(), 2);
}

// init_from: a new run (step 0, a new AdamW) from another run's weights. Its step-0 val loss
// is the source's whatever its seed; /config records the file and its hash, and a resume of
// the new run keeps them.
TEST_F(TrainerTest, InitFromStartsANewRunFromTheWeights) {
  Trainer source(config("src"));
  run_all(source);
  const double source_val = source.evaluate();
  const fs::path file = dir_ / "src" / "final.h5";
  TrainConfig c = config("init");
  c.seed = 4242;
  c.iters = 4;
  c.model.dropout = 0.1;  // a training setting: the file's 0 does not bind the run
  {
    Trainer t(c);
    t.init_from(file);
    EXPECT_EQ(t.step(), 0);
    const auto ps = source.model().named_parameters(), pt = t.model().named_parameters();
    ASSERT_EQ(ps.size(), pt.size());
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_EQ(ps[i].second.to_vector<float>(), pt[i].second.to_vector<float>()) << ps[i].first;
    const auto recs = run_all(t, 2);
    ASSERT_FALSE(recs.empty());
    EXPECT_EQ(recs.front().step, 0);
    ASSERT_TRUE(recs.front().val_loss.has_value());
    EXPECT_EQ(*recs.front().val_loss, source_val);
  }
  const Checkpoint last = load_checkpoint(dir_ / "init" / "last.h5", true);
  EXPECT_EQ(std::get<std::string>(last.config.at("init_from")), file.string());
  EXPECT_EQ(std::get<std::string>(last.config.at("init_from_hash")), file_content_hash(file));
  EXPECT_EQ(last.iteration, 2);
  EXPECT_EQ(last.optimizer_step, 2);  // not the source's 12 + 2
  Trainer resumed(c);                 // no init_from of its own: the checkpoint's is kept
  resumed.resume(dir_ / "init" / "last.h5");
  EXPECT_EQ(resumed.config().init_from, file.string());
  run_all(resumed);
  const Checkpoint final_ckpt = load_checkpoint(dir_ / "init" / "final.h5", false);
  EXPECT_EQ(std::get<std::string>(final_ckpt.config.at("init_from")), file.string());
}

TEST_F(TrainerTest, InitFromRefusesAnotherModelOrTokenizerOrALateStart) {
  Trainer source(config("src"));
  run_all(source, 1);
  const fs::path file = dir_ / "src" / "last.h5";
  TrainConfig other = config("");
  other.model.n_kv_head = 1;
  other.model.n_layer = 1;
  Trainer t(other);
  std::string msg = error_of([&] { t.init_from(file); });
  EXPECT_NE(msg.find("holds another model than this run's (checkpoint vs run): n_kv_head: 2 vs 1; "
                     "n_layer: 2 vs 1"),
            std::string::npos)
      << msg;
  // The same text plus a character the file's vocabulary lacks.
  std::ofstream(dir_ / "other.txt") << std::ifstream(dir_ / "corpus.txt").rdbuf() << "Zed.\n";
  TrainConfig corpus = config("");
  corpus.corpus = (dir_ / "other.txt").string();
  Trainer u(corpus);
  msg = error_of([&] { u.init_from(file); });
  EXPECT_NE(msg.find("has another tokenizer (char, " +
                     std::to_string(source.corpus().tokenizer.vocab_size()) + " symbols) than " +
                     corpus.corpus + " gives (char, " +
                     std::to_string(u.corpus().tokenizer.vocab_size()) + " symbols)"),
            std::string::npos)
      << msg;
  Trainer late(config(""));
  run_all(late, 1);
  msg = error_of([&] { late.init_from(file); });
  EXPECT_NE(msg.find("before its first step, not at step 1"), std::string::npos) << msg;
}

// A damaged step count is refused before anything is loaded or logged.
TEST_F(TrainerTest, ResumeRefusesAnIterationOutsideTheRun) {
  Trainer first(config("run"));
  run_all(first, 2);
  const fs::path last = dir_ / "run" / "last.h5";
  for (int64_t bad : {int64_t{-5}, int64_t{1} << 50}) {
    Checkpoint c = load_checkpoint(last, true);
    c.iteration = bad;
    save_checkpoint(dir_ / "bad.h5", c);
    Trainer second(config("run"));
    const std::string msg = error_of([&] { second.resume(dir_ / "bad.h5"); });
    EXPECT_NE(msg.find("iteration = " + std::to_string(bad) + " is outside [0, iters"),
              std::string::npos)
        << msg;
  }
}

// A diverging step stops the run with an error naming the step, before the optimizer applies
// it and before any checkpoint is written: last.h5 keeps the last good weights.
TEST_F(TrainerTest, NonFiniteLossStopsAtItsStepAndKeepsTheLastCheckpoint) {
  {
    Trainer first(config("run"));
    run_all(first, 4);  // step 4 is a checkpoint (eval_interval 4)
  }
  const fs::path last = dir_ / "run" / "last.h5";
  const auto before = fs::last_write_time(last);
  Trainer second(config("run"));
  second.resume(last);
  // Poison one weight: the loss of the next step (5) is NaN.
  Tensor w = second.model().named_parameters()[0].second;
  std::vector<float> v = w.to_vector<float>();
  v[0] = std::numeric_limits<float>::quiet_NaN();
  w.copy_from(Tensor::from_vector(v, w.sizes()));
  const std::string msg = error_of([&] { run_all(second); });
  EXPECT_NE(msg.find("train: loss is not finite at step 5 (nan)"), std::string::npos) << msg;
  EXPECT_EQ(second.step(), 4);
  EXPECT_EQ(fs::last_write_time(last), before);
  EXPECT_FALSE(fs::exists(dir_ / "run" / "final.h5"));
  const Checkpoint c = load_checkpoint(last, true);
  EXPECT_EQ(c.iteration, 4);
  for (const auto& [name, array] : c.model)
    for (float x : array.data) ASSERT_TRUE(std::isfinite(x)) << name;
  EXPECT_EQ(log_lines_at_step(dir_ / "run" / "log.jsonl", 5), 0);
}

TEST_F(TrainerTest, HugeLearningRateDivergesWithAnError) {
  TrainConfig c = config("");
  c.lr = 1e6;
  c.warmup = 0;
  Trainer t(c);
  const std::string msg = error_of([&] { run_all(t); });
  EXPECT_NE(msg.find("is not finite at step"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lower --lr"), std::string::npos) << msg;
}

TEST_F(TrainerTest, NonFiniteSettingsAreRejected) {
  TrainConfig good = config("");
  good.model.vocab_size = 10;  // the corpus sets it
  EXPECT_NO_THROW(good.validate());
  for (const double bad : {double{INFINITY}, double{-INFINITY}, std::nan("")}) {
    for (int which = 0; which < 7; ++which) {
      TrainConfig c = good;
      double* fields[] = {&c.lr,           &c.min_lr,    &c.beta1,        &c.beta2,
                          &c.weight_decay, &c.grad_clip, &c.model.dropout};
      *fields[which] = bad;
      if (which == 0 && bad > 0) c.min_lr = 1e-4;  // lr inf passed every range check
      EXPECT_THROW(c.validate(), Error) << "field " << which << " = " << bad;
    }
  }
}

// Stopped right after the step-0 evaluation, the run resumes from a step-0 checkpoint; the
// evaluation is not repeated in the log.
TEST_F(TrainerTest, ResumeFromStepZeroLogsStepZeroOnce) {
  {
    Trainer first(config("run"));
    std::atomic<bool> stop{true};
    EXPECT_FALSE(first.run([](const StepRecord&) { return true; }, &stop));
    EXPECT_EQ(first.step(), 0);
  }
  Trainer second(config("run"));
  second.resume(dir_ / "run" / "last.h5");
  EXPECT_EQ(second.step(), 0);
  const auto recs = run_all(second);
  EXPECT_EQ(recs.size(), 12u);  // steps 1..12 only
  const fs::path log = dir_ / "run" / "log.jsonl";
  EXPECT_EQ(log_lines_at_step(log, 0), 1);
  std::ifstream in(log);
  int lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  EXPECT_EQ(lines, 13);
}

// A stop during a long gradient accumulation ends the run within a micro-batch, and its
// checkpoint is the one a stop before that step writes (weights, AdamW state, the sampler's
// and dropout's streams), so resume stays exact. The step has 100,000 micro-batches (tens of
// seconds), the stop comes after 200 ms.
TEST_F(TrainerTest, StopDuringGradientAccumulationKeepsTheCheckpointOfTheStepBefore) {
  TrainConfig c = config("before", 0.1);
  c.grad_accum = 100'000;
  c.iters = 1;
  {
    Trainer t(c);
    std::atomic<bool> stop{true};  // seen before the first micro-batch
    EXPECT_FALSE(t.run([](const StepRecord&) { return true; }, &stop));
  }
  c.out_dir = (dir_ / "during").string();
  {
    Trainer t(c);
    std::atomic<bool> stop{false};
    std::thread stopper;
    // Set from another thread well after the step has begun, as a signal handler would.
    EXPECT_FALSE(t.run(
        [&](const StepRecord&) {
          if (!stopper.joinable())
            stopper = std::thread([&] {
              std::this_thread::sleep_for(std::chrono::milliseconds(200));
              stop.store(true);
            });
          return true;
        },
        &stop));
    stopper.join();
    EXPECT_EQ(t.step(), 0);
  }
  const Checkpoint a = load_checkpoint(dir_ / "before" / "last.h5", true);
  const Checkpoint b = load_checkpoint(dir_ / "during" / "last.h5", true);
  EXPECT_EQ(a.iteration, 0);
  EXPECT_EQ(b.iteration, 0);
  EXPECT_EQ(a.rng_state, b.rng_state);
  EXPECT_EQ(a.optimizer_step, b.optimizer_step);
  const std::pair<const NamedArrays*, const NamedArrays*> parts[] = {
      {&a.model, &b.model}, {&a.optimizer_m, &b.optimizer_m}, {&a.optimizer_v, &b.optimizer_v}};
  for (const auto& [x, y] : parts) {
    ASSERT_EQ(x->size(), y->size());
    for (size_t i = 0; i < x->size(); ++i) {
      EXPECT_EQ((*x)[i].first, (*y)[i].first);
      EXPECT_EQ((*x)[i].second.data, (*y)[i].second.data) << (*x)[i].first;
    }
  }
}

TEST_F(TrainerTest, LearningRateScheduleWarmupThenCosine) {
  TrainConfig c = config("");
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup = 4;
  c.iters = 104;
  EXPECT_NEAR(learning_rate(c, 0), 1.0 / 5, 1e-12);
  EXPECT_NEAR(learning_rate(c, 3), 4.0 / 5, 1e-12);
  EXPECT_NEAR(learning_rate(c, 4), 1.0, 1e-12);
  EXPECT_NEAR(learning_rate(c, 54), 0.55, 1e-12);  // halfway through the decay
  EXPECT_NEAR(learning_rate(c, 104), 0.1, 1e-12);
  for (int64_t s = 5; s < 104; ++s) EXPECT_LE(learning_rate(c, s), learning_rate(c, s - 1));
}

TEST_F(TrainerTest, BadInputGivesClearErrors) {
  TrainConfig c = config("");
  c.corpus = (dir_ / "missing.txt").string();
  EXPECT_THROW(Trainer{c}, Error);
  std::ofstream(dir_ / "short.txt") << "abc";
  c.corpus = (dir_ / "short.txt").string();
  const std::string msg = error_of([&] { Trainer t(c); });
  EXPECT_NE(msg.find("block"), std::string::npos) << msg;
  c = config("");
  c.model.n_kv_head = 3;
  EXPECT_THROW(Trainer{c}, Error);
  c = config("");
  c.iters = 0;
  EXPECT_THROW(Trainer{c}, Error);
}

TEST_F(TrainerTest, GradientAccumulationMatchesALargerBatch) {
  // 2 micro-batches of 2 rows average to the same gradient as their 4 rows at once only if
  // the rows are the same; the sampler draws B windows per micro-batch in order, so
  // accum=2 x B=2 consumes the same windows as accum=1 x B=4.
  TrainConfig big = config(""), small = config("");
  big.iters = small.iters = 3;
  small.batch_size = 2;
  small.grad_accum = 2;
  Trainer tb(big), ts(small);
  const auto rb = run_all(tb), rs = run_all(ts);
  for (size_t i = 1; i < rb.size(); ++i) EXPECT_NEAR(rb[i].train_loss, rs[i].train_loss, 1e-5);
}

// The "step" of every line of `log`, in order.
std::vector<int64_t> log_steps(const fs::path& log) {
  std::vector<int64_t> steps;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);)
    steps.push_back(nlohmann::json::parse(line).at("step").get<int64_t>());
  return steps;
}

std::vector<int64_t> steps_0_to(int64_t n) {
  std::vector<int64_t> steps;
  for (int64_t s = 0; s <= n; ++s) steps.push_back(s);
  return steps;
}

// Step 0 evaluates the initial weights and trains nothing: its train_loss is null, not 0.
TEST_F(TrainerTest, StepZeroLogsNoTrainingLoss) {
  Trainer t(config("run"));
  run_all(t, 2);
  std::ifstream in(dir_ / "run" / "log.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_TRUE(lines[0].at("train_loss").is_null()) << lines[0];
  EXPECT_TRUE(lines[0].at("val_loss").is_number()) << lines[0];
  for (size_t i = 1; i < lines.size(); ++i) {
    ASSERT_TRUE(lines[i].at("train_loss").is_number()) << lines[i];
    EXPECT_GT(lines[i].at("train_loss").get<double>(), 0.0) << lines[i];
  }
}

// A process that dies after a step's log line and before its checkpoint (here: the save of
// last.h5 at step 4 fails, as a kill there would stop it) leaves the log ahead of last.h5,
// never behind: the resumed run trims the extra lines and every step is logged exactly once.
TEST_F(TrainerTest, TheLogLineComesBeforeTheCheckpointSoResumeLogsEveryStepOnce) {
  TrainConfig c = config("run");
  c.ckpt_interval = 2;  // last.h5 at steps 2, 4, ...; evaluation at 4, 8, 12
  const fs::path run = dir_ / "run", last = run / "last.h5", kept = dir_ / "step2.h5";
  {
    Trainer t(c);
    const std::string msg = error_of([&] {
      t.run([&](const StepRecord& r) {
        if (r.step == 2) {  // last.h5 holds step 2; make the next save of it fail
          fs::copy_file(last, kept);
          fs::remove(last);
          fs::create_directories(last / "in-the-way");
        }
        return true;
      });
    });
    EXPECT_NE(msg.find("last.h5"), std::string::npos) << msg;
    EXPECT_EQ(t.step(), 4);
  }
  EXPECT_EQ(log_steps(run / "log.jsonl"), steps_0_to(4));  // step 4's line came first
  fs::remove_all(last);
  fs::rename(kept, last);
  Trainer resumed(c);
  resumed.resume(last);
  EXPECT_EQ(resumed.step(), 2);
  run_all(resumed);
  EXPECT_EQ(log_steps(run / "log.jsonl"), steps_0_to(12));
}

// A run from step 0 owns the log: the lines of an earlier run in the folder that was stopped
// before its first checkpoint are dropped, not continued.
TEST_F(TrainerTest, AFreshRunStartsTheLogOver) {
  fs::create_directories(dir_ / "run");
  std::ofstream(dir_ / "run" / "log.jsonl") << "{\"step\": 0, \"val_loss\": 9.0}\n"
                                               "{\"step\": 1, \"train_loss\": 9.0}\n";
  Trainer t(config("run"));
  run_all(t);
  EXPECT_EQ(log_steps(dir_ / "run" / "log.jsonl"), steps_0_to(12));
}

// With a checkpoint at every step, the weights that give a non-finite loss are already in
// last.h5 (saved at the step before): the error says so, and that resuming repeats the step.
TEST_F(TrainerTest, ANonFiniteLossSaysWhatTheCheckpointsHold) {
  TrainConfig c = config("run");
  c.lr = 1e6;
  c.warmup = 0;
  c.ckpt_interval = 1;
  std::string msg;
  int64_t failed_at = 0;
  {
    Trainer t(c);
    msg = error_of([&] { run_all(t); });
    failed_at = t.step() + 1;
  }
  ASSERT_GE(failed_at, 2);  // the initial weights give a finite loss
  const std::string step = std::to_string(failed_at - 1);
  EXPECT_NE(msg.find("is not finite at step " + std::to_string(failed_at)), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("resuming would repeat this step"), std::string::npos) << msg;
  EXPECT_NE(msg.find("last.h5 holds step " + step + ", the weights that gave this"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("best.h5") != std::string::npos, fs::exists(dir_ / "run" / "best.h5")) << msg;
  EXPECT_EQ(load_checkpoint(dir_ / "run" / "last.h5", true).iteration, failed_at - 1);
  // The claim holds: resumed, the run fails at the same step, and says the same of last.h5.
  Trainer again(c);
  again.resume(dir_ / "run" / "last.h5");
  const std::string again_msg = error_of([&] { run_all(again); });
  EXPECT_NE(again_msg.find("is not finite at step " + std::to_string(failed_at)), std::string::npos)
      << again_msg;
  EXPECT_NE(again_msg.find("last.h5 holds step " + step + ", the weights"), std::string::npos)
      << again_msg;
}

// Without a checkpoint at the step before, the error names the step last.h5 does hold.
TEST_F(TrainerTest, ANonFiniteLossNamesAnEarlierLastCheckpoint) {
  TrainConfig c = config("run");
  c.ckpt_interval = 2;
  Trainer t(c);
  const std::string msg = error_of([&] {
    t.run([&](const StepRecord& r) {
      if (r.step == 3) {  // poison one weight: the loss of step 4 is NaN
        Tensor w = t.model().named_parameters()[0].second;
        std::vector<float> v = w.to_vector<float>();
        v[0] = std::numeric_limits<float>::quiet_NaN();
        w.copy_from(Tensor::from_vector(v, w.sizes()));
      }
      return true;
    });
  });
  EXPECT_NE(msg.find("is not finite at step 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find(". last.h5 holds step 2"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("the weights that gave this"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("best.h5"), std::string::npos) << msg;  // no evaluation after a step yet
}

// One process at a time holds an output folder; the refusal names the holder's pid, and the
// folder is free again once the holder is gone.
TEST_F(TrainerTest, AnOutputFolderHasOneHolder) {
  const fs::path out = dir_ / "out";
  {
    const OutputDirLock first(out, "train");
    // A second open of the lock file conflicts like another process's would (flock locks
    // belong to the open file, not to the process).
    const std::string msg = error_of([&] { OutputDirLock second(out, "ablate"); });
    EXPECT_NE(
        msg.find("ablate: output folder " + out.string() +
                 " is in use by another kvlab process (pid " + std::to_string(::getpid()) + ")"),
        std::string::npos)
        << msg;
  }
  EXPECT_NO_THROW(OutputDirLock(out, "train"));
  std::ofstream(dir_ / "afile") << "x";
  EXPECT_NE(error_of([&] { OutputDirLock held(dir_ / "afile", "train"); }).find("is a file"),
            std::string::npos);
}

// What a run killed while saving leaves: <name>.h5.tmp-<pid>. Only those go.
TEST_F(TrainerTest, CheckpointTemporariesAreRemoved) {
  const fs::path out = dir_ / "out";
  fs::create_directories(out / "best.h5.tmp-77");  // a folder: not a file a writer left
  for (const char* name : {"last.h5.tmp-12345", "final.h5.tmp-9", "last.h5", "log.jsonl",
                           "last.h5.tmp-", "last.h5.tmp-12x", "notes.tmp-3"})
    std::ofstream(out / name) << "x";
  std::vector<std::string> removed = remove_checkpoint_temporaries(out);
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<std::string>{"final.h5.tmp-9", "last.h5.tmp-12345"}));
  for (const char* gone : {"last.h5.tmp-12345", "final.h5.tmp-9"})
    EXPECT_FALSE(fs::exists(out / gone)) << gone;
  for (const char* kept :
       {"best.h5.tmp-77", "last.h5", "log.jsonl", "last.h5.tmp-", "last.h5.tmp-12x", "notes.tmp-3"})
    EXPECT_TRUE(fs::exists(out / kept)) << kept;
}

}  // namespace
}  // namespace kvlab
