// Data-parallel training under MPI: run as `mpirun --oversubscribe -np 2 mpi_train_main`
// (OMP_NUM_THREADS=1). Without arguments it runs the GoogleTest cases below on every rank, in
// lockstep (each case calls the same collectives on every rank). With --fail hang|exit it
// plays a rank that stops answering (rank 1 hangs, or exits without MPI_Finalize) so the test
// can check that rank 0 fails with a clear message within the timeout instead of hanging.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "autograd/ops/ops.h"
#include "checkpoints/checkpoint.h"
#include "data/corpus.h"
#include "data/sampler.h"
#include "tests/train/train_test_util.h"
#include "train/comm.h"
#include "train/trainer.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

std::shared_ptr<Communicator> g_comm;
fs::path g_dir;  // shared by the ranks (same machine)

TrainConfig tiny_config(const std::string& out, double dropout = 0.0) {
  TrainConfig c = kvlab::testing::tiny_config(g_dir, out, dropout);
  c.batch_size = 3;  // per rank
  c.iters = 8;
  c.warmup = 2;
  c.grad_clip = 0.5;  // clipping is active in these runs
  return c;
}

using kvlab::testing::run_all;

std::vector<std::vector<float>> weights(GPT& model) {
  std::vector<std::vector<float>> w;
  for (const auto& [name, p] : model.named_parameters()) w.push_back(p.to_vector<float>());
  return w;
}

uint64_t weights_hash(GPT& model) {
  uint64_t h = hash_bytes(nullptr, 0);
  for (const auto& v : weights(model)) h = hash_bytes(v.data(), v.size() * sizeof(float), h);
  return h;
}

// Every rank's hash, on every rank.
std::vector<uint64_t> all_hashes(uint64_t mine) {
  std::vector<uint64_t> all = g_comm->gather(std::span<const uint64_t>(&mine, 1), 0, "test gather");
  all.resize(static_cast<size_t>(g_comm->world_size()));
  g_comm->broadcast(std::as_writable_bytes(std::span<uint64_t>(all)), 0, "test broadcast");
  return all;
}

int rank() { return g_comm->rank(); }

// (a) 2 ranks with batch b equal 1 rank with batch 2b over the same windows: rank 0's then
// rank 1's, every step. The single-process reference is built here from the same pieces the
// Trainer uses (GPT, AdamW, BatchSampler with the per-rank seeds, the LR schedule, clipping).
TEST(MpiTrain, TwoRanksEqualOneRankOverTheSameWindows) {
  const TrainConfig cfg = tiny_config("");
  Trainer dp(cfg, g_comm);
  const auto recs = run_all(dp);
  ASSERT_EQ(recs.size(), static_cast<size_t>(cfg.iters + 1));
  const auto hashes = all_hashes(weights_hash(dp.model()));
  EXPECT_EQ(hashes[0], hashes[1]) << "the ranks hold different weights";

  if (rank() == 0) {
    Corpus corpus = load_run_corpus(cfg);
    GPTConfig mc = cfg.model;
    mc.vocab_size = corpus.tokenizer.vocab_size();
    GPT ref(mc, cfg.seed);
    ref.set_training(true);
    AdamW opt(ref.named_parameters(), {cfg.beta1, cfg.beta2, 1e-8, cfg.weight_decay});
    const int b = static_cast<int>(cfg.batch_size), T = static_cast<int>(cfg.model.block_size);
    BatchSampler s0(corpus.train, b, T, sampler_seed(cfg.seed, 0));
    BatchSampler s1(corpus.train, b, T, sampler_seed(cfg.seed, 1));
    std::vector<int32_t> x0, y0, x1, y1;
    for (int64_t step = 0; step < cfg.iters; ++step) {
      ref.zero_grad();
      s0.next(x0, y0);
      s1.next(x1, y1);
      x0.insert(x0.end(), x1.begin(), x1.end());
      y0.insert(y0.end(), y1.begin(), y1.end());
      Tensor loss =
          ref.loss(Tensor::from_vector(x0, {2 * b, T}), Tensor::from_vector(y0, {2 * b, T}));
      const double l = loss.item();
      loss.backward();
      const double norm = global_grad_norm(ref.named_parameters());
      opt.step(learning_rate(cfg, step), clip_factor(norm, cfg.grad_clip));
      const StepRecord& r = recs[static_cast<size_t>(step + 1)];
      EXPECT_NEAR(r.train_loss, l, 1e-5) << "step " << step + 1;
      EXPECT_NEAR(r.grad_norm, norm, 1e-5 * std::max(1.0, norm)) << "step " << step + 1;
    }
    const auto wa = weights(dp.model()), wb = weights(ref);
    double max_diff = 0, moved = 0;
    GPT init(mc, cfg.seed);
    const auto w0 = weights(init);
    for (size_t i = 0; i < wa.size(); ++i)
      for (size_t j = 0; j < wa[i].size(); ++j) {
        max_diff = std::max(max_diff, static_cast<double>(std::fabs(wa[i][j] - wb[i][j])));
        moved = std::max(moved, static_cast<double>(std::fabs(wa[i][j] - w0[i][j])));
      }
    EXPECT_LE(max_diff, 1e-5);
    EXPECT_GT(moved, 1e-3) << "training did not change the weights";
  }
  g_comm->barrier("test barrier");
}

// (b) Stop after step 5, resume on both ranks, finish: bit-identical to the uninterrupted
// 2-rank run (dropout on, so every rank's dropout stream is restored too).
TEST(MpiTrain, ResumeReproducesTheUninterruptedRun) {
  Trainer full(tiny_config("full", 0.1), g_comm);
  const auto a = run_all(full);
  {
    Trainer first(tiny_config("split", 0.1), g_comm);
    run_all(first, 5);
    EXPECT_EQ(first.step(), 5);
  }
  Trainer second(tiny_config("split", 0.1), g_comm);
  second.resume(g_dir / "split" / "last.h5");
  ASSERT_EQ(second.step(), 5);
  const auto b = run_all(second);
  ASSERT_EQ(b.size(), 3u);
  for (const auto& r : b) {
    const auto& ref = a[static_cast<size_t>(r.step)];
    EXPECT_EQ(ref.train_loss, r.train_loss) << "step " << r.step;
    EXPECT_EQ(ref.grad_norm, r.grad_norm) << "step " << r.step;
    ASSERT_EQ(ref.val_loss.has_value(), r.val_loss.has_value());
    if (r.val_loss) {
      EXPECT_EQ(*ref.val_loss, *r.val_loss);
    }
  }
  EXPECT_EQ(weights(full.model()), weights(second.model()));
  if (rank() == 0) {
    // Rank 0 alone writes the log: one line per step, with the communication time.
    std::ifstream log(g_dir / "split" / "log.jsonl");
    int lines = 0;
    for (std::string line; std::getline(log, line); ++lines) {
      const auto j = nlohmann::json::parse(line);
      if (j["step"].get<int64_t>() > 0) {
        EXPECT_TRUE(j.contains("comm_s")) << line;
        EXPECT_GE(j["comm_frac"].get<double>(), 0.0);
        EXPECT_LE(j["comm_frac"].get<double>(), 1.0);
      }
    }
    EXPECT_EQ(lines, 9);
    const Checkpoint c = load_checkpoint(g_dir / "split" / "final.h5");
    EXPECT_EQ(std::get<int64_t>(c.train_extra.at("world_size")), 2);
    EXPECT_EQ(c.rng_state.size(), 16u);
    EXPECT_NE(std::vector<uint64_t>(c.rng_state.begin(), c.rng_state.begin() + 4),
              std::vector<uint64_t>(c.rng_state.begin() + 8, c.rng_state.begin() + 12))
        << "the ranks share a sampler stream";
  }
  g_comm->barrier("test barrier");
}

// (c) ZeRO-1 gives the same weights as plain data parallelism (bit-identical), through a
// stop and resume; its checkpoint holds the full moments, equal to plain DP's.
TEST(MpiTrain, ZeroOneEqualsPlainDataParallel) {
  Trainer plain(tiny_config("plain"), g_comm);
  run_all(plain);
  TrainConfig zc = tiny_config("zero");
  zc.zero = 1;
  {
    Trainer first(zc, g_comm);
    run_all(first, 3);
  }
  Trainer zero(zc, g_comm);
  zero.resume(g_dir / "zero" / "last.h5");
  run_all(zero);
  EXPECT_EQ(weights(plain.model()), weights(zero.model()));
  if (rank() == 0) {
    const Checkpoint p = load_checkpoint(g_dir / "plain" / "final.h5");
    const Checkpoint z = load_checkpoint(g_dir / "zero" / "final.h5");
    ASSERT_TRUE(z.has_optimizer);
    EXPECT_EQ(p.optimizer_step, z.optimizer_step);
    ASSERT_EQ(p.optimizer_m.size(), z.optimizer_m.size());
    for (size_t i = 0; i < p.optimizer_m.size(); ++i) {
      EXPECT_EQ(p.optimizer_m[i].second.shape, z.optimizer_m[i].second.shape);
      EXPECT_EQ(p.optimizer_m[i].second.data, z.optimizer_m[i].second.data)
          << p.optimizer_m[i].first;
      EXPECT_EQ(p.optimizer_v[i].second.data, z.optimizer_v[i].second.data)
          << p.optimizer_v[i].first;
    }
  }
  g_comm->barrier("test barrier");
}

// Resuming with another world size is refused, naming both sizes.
TEST(MpiTrain, ResumeWithAnotherWorldSizeIsRefused) {
  {
    Trainer two(tiny_config("two"), g_comm);
    run_all(two, 2);
  }
  if (rank() == 0) {
    Trainer one(tiny_config("two"));  // a single process
    try {
      one.resume(g_dir / "two" / "last.h5");
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("with 2 rank(s) and this run has 1 rank(s)"), std::string::npos) << msg;
    }
    Trainer single(tiny_config("one"));
    run_all(single, 2);
  }
  g_comm->barrier("test barrier");
  Trainer two(tiny_config("one"), g_comm);
  try {
    two.resume(g_dir / "one" / "last.h5");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("with 1 rank(s) and this run has 2 rank(s)"), std::string::npos) << msg;
  }
  g_comm->barrier("test barrier");
}

// A rank that stops answering: rank 1 hangs (or exits without MPI_Finalize) at step 3; rank 0
// must end with an error within the timeout. Returns the process exit code.
int fail_scenario(const std::string& how) {
  TrainConfig cfg = tiny_config("");
  cfg.iters = 100000;
  try {
    Trainer t(cfg, g_comm);
    g_comm->barrier("test barrier");  // both ranks hold the corpus now: its folder can go
    if (rank() == 0) fs::remove_all(g_dir);
    t.run([&](const StepRecord& r) {
      if (rank() == 1 && r.step == 3) {
        std::fprintf(stderr, "rank 1: %s at step 3 (test)\n",
                     how == "hang" ? "hanging" : "exiting");
        std::fflush(stderr);
        if (how == "exit") std::_Exit(3);
        std::this_thread::sleep_for(std::chrono::seconds(60));
      }
      return true;
    });
  } catch (const Error& e) {
    std::fprintf(stderr, "kvlab: error: %s\n", e.what());
    g_comm->fail();
    return 1;
  }
  std::fprintf(stderr, "rank %d: training finished, but a rank should have failed\n", rank());
  return 0;
}

// Prints only failures, prefixed with the rank (used on ranks other than 0).
class FailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank(),
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
};

}  // namespace
}  // namespace kvlab

int main(int argc, char** argv) {
  using namespace kvlab;
  std::string fail;
  double timeout = 30;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--fail") == 0 && i + 1 < argc) fail = argv[++i];
    if (std::strcmp(argv[i], "--comm-timeout") == 0 && i + 1 < argc) timeout = std::atof(argv[++i]);
  }
  if (!launched_by_mpi()) {
    std::fprintf(stderr, "mpi_train_main: run me with mpirun -np 2\n");
    return 1;
  }
  g_comm = world_communicator(timeout);
  if (g_comm->world_size() != 2) {
    std::fprintf(stderr, "mpi_train_main: needs exactly 2 ranks, got %d\n", g_comm->world_size());
    return 1;
  }
  // A folder both ranks use: rank 0 names it and writes the corpus.
  char name[512] = {};
  if (rank() == 0) {
    const fs::path d = fs::temp_directory_path() / ("kvlab_mpi_" + std::to_string(::getpid()) +
                                                    "_" + (fail.empty() ? "t" : fail));
    std::snprintf(name, sizeof name, "%s", d.c_str());
    fs::remove_all(d);
    fs::create_directories(d);
    kvlab::testing::write_tiny_corpus(d);
  }
  g_comm->broadcast(std::as_writable_bytes(std::span<char>(name, sizeof name)), 0, "test setup");
  g_dir = name;
  int rc = 0;
  if (!fail.empty()) {
    rc = fail_scenario(fail);
  } else {
    ::testing::InitGoogleTest(&argc, argv);
    if (rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter);
    }
    double failed = RUN_ALL_TESTS() != 0 ? 1.0 : 0.0;
    g_comm->allreduce_sum(std::span<double>(&failed, 1), "test result");
    rc = failed > 0 ? 1 : 0;
  }
  if (rank() == 0 && rc == 0) fs::remove_all(g_dir);
  return rc;
}
