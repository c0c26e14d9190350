#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include "checkpoints/checkpoint.h"
#include "tests/test_dir.h"
#include "tests/train/train_test_util.h"
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

}  // namespace
}  // namespace kvlab
