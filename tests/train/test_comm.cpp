// The single-process side of data-parallel training: the local communicator, the per-rank
// seeds, the gradient reducer and ZeRO-1's sharded AdamW with one rank. The multi-rank cases
// run under mpirun (mpi_train_main.cpp, label `mpi`).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>

#include "autograd/ops/ops.h"
#include "checkpoints/checkpoint.h"
#include "train/comm.h"
#include "train/trainer.h"
#include "train/zero.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

TEST(CommTest, LocalCommunicatorIsRankZeroOfOne) {
  auto comm = local_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->backend(), "local");
  std::vector<float> f{1.5f, -2.0f};
  comm->allreduce_mean(f, "test");
  EXPECT_EQ(f, (std::vector<float>{1.5f, -2.0f}));
  const std::vector<uint64_t> words{7, 8, 9};
  EXPECT_EQ(comm->gather(words, 0, "test"), words);
  std::vector<float> out(2);
  const std::vector<int64_t> counts{2};
  comm->allgatherv(f, out, counts, "test");
  EXPECT_EQ(out, f);
  std::byte b[4] = {};
  EXPECT_THROW(comm->broadcast(b, 1, "test"), Error);
}

TEST(CommTest, WithoutALauncherTheWorldIsLocal) {
  if (launched_by_mpi()) GTEST_SKIP() << "running under mpirun";
  EXPECT_EQ(world_communicator()->backend(), "local");
  EXPECT_EQ(launcher_world_size(), 1);
  EXPECT_THROW(world_communicator(0.0), Error);
}

TEST(CommTest, RankZeroKeepsTheSingleProcessStreams) {
  EXPECT_EQ(sampler_seed(1337, 0), hash64(1337, 0x73616d70));
  EXPECT_EQ(dropout_seed(1337, 0), hash64(1337, 0x64726f70));
  EXPECT_NE(sampler_seed(1337, 1), sampler_seed(1337, 0));
  EXPECT_NE(sampler_seed(1337, 1), sampler_seed(1337, 2));
  EXPECT_NE(dropout_seed(1337, 1), dropout_seed(1337, 0));
}

TEST(CommTest, GradientReducerLeavesOneRankAlone) {
  Tensor w = Tensor::from_vector(std::vector<float>{1, 2, 3}, {3});
  w.set_requires_grad();
  sum(mul(w, w)).backward();
  GradientReducer reducer(8);  // 2 floats per bucket
  reducer.allreduce_mean(*local_communicator(), {{"w", w}});
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{2, 4, 6}));
}

// ZeRO-1 over one rank (one shard holding everything) updates exactly as AdamW does, and
// gathers the moments in AdamW's layout.
TEST(CommTest, ShardedAdamWWithOneShardEqualsAdamW) {
  auto make = [](uint64_t seed) {
    NamedTensors ps;
    Generator gen(seed);
    for (auto shape : {Shape{5, 7}, Shape{7}, Shape{3, 2, 4}}) {
      Tensor t = Tensor::zeros(shape);
      normal_(t, gen, 1.0);
      t.set_requires_grad();
      ps.emplace_back(detail::cat("p", ps.size()), t);
    }
    return ps;
  };
  NamedTensors a = make(1), b = make(1);
  const AdamWConfig cfg{0.9, 0.95, 1e-8, 0.1};
  AdamW plain(a, cfg);
  ShardedAdamW sharded(b, cfg, local_communicator(), 16);  // 4 floats per bucket
  for (int step = 0; step < 3; ++step) {
    for (NamedTensors* ps : {&a, &b}) {
      Tensor loss = Tensor::scalar(0.0);
      for (auto& [name, p] : *ps) loss = add(loss, sum(mul(p, p)));
      for (auto& [name, p] : *ps) p.zero_grad();
      loss.backward();
    }
    plain.step(1e-2, 0.7);
    sharded.step(1e-2, 0.7);
  }
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << a[i].first;
  NamedArrays m, v;
  sharded.gather_moments(m, v);
  ASSERT_EQ(m.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(m[i].second.data, plain.exp_avg()[i].second.to_vector<float>());
    EXPECT_EQ(v[i].second.data, plain.exp_avg_sq()[i].second.to_vector<float>());
  }
}

// The sharded optimizer loads moments through the same checks as every other load: a NaN
// moment (a run that diverged) is refused, naming the file and the dataset.
TEST(CommTest, ShardedAdamWRefusesNonFiniteMoments) {
  NamedTensors ps;
  ps.emplace_back("w", Tensor::zeros({2, 3}));
  ShardedAdamW sharded(ps, AdamWConfig{0.9, 0.95, 1e-8, 0.1}, local_communicator());
  const NamedArrays good{{"w", ArrayF32{{2, 3}, std::vector<float>(6, 0.5f)}}};
  NamedArrays bad = good;
  bad[0].second.data[4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NO_THROW(sharded.load_moments(good, good, 3, "c.h5"));
  try {
    sharded.load_moments(good, bad, 3, "c.h5");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint c.h5: tensor optimizer/v/w holds non-finite"),
              std::string::npos)
        << e.what();
  }
}

// Passing a local communicator is the same as passing none, and a checkpoint of a
// single-process run records world_size 1 and one rank's 8 generator words.
TEST(CommTest, TrainerWithALocalCommunicatorIsTheSingleProcessTrainer) {
  const fs::path dir = fs::temp_directory_path() / ("kvlab_comm_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "corpus.txt");
    for (int i = 0; i < 300; ++i)
      f << "pack my box with five dozen liquor jugs " << (i % 5) << "\n";
  }
  TrainConfig c;
  c.corpus = (dir / "corpus.txt").string();
  c.model.n_layer = 1;
  c.model.n_head = 2;
  c.model.n_kv_head = 1;
  c.model.n_embd = 16;
  c.model.block_size = 8;
  c.batch_size = 2;
  c.iters = 3;
  c.eval_interval = 3;
  c.eval_iters = 2;
  c.zero = 1;  // no effect with one rank
  c.out_dir = (dir / "run").string();
  Trainer a(c, local_communicator());
  c.out_dir.clear();
  Trainer b(c);
  EXPECT_EQ(a.world_size(), 1);
  a.run([](const StepRecord&) { return true; });
  b.run([](const StepRecord&) { return true; });
  const auto pa = a.model().named_parameters(), pb = b.model().named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(pa[i].second.to_vector<float>(), pb[i].second.to_vector<float>()) << pa[i].first;
  const Checkpoint ck = load_checkpoint(dir / "run" / "final.h5");
  EXPECT_EQ(std::get<int64_t>(ck.train_extra.at("world_size")), 1);
  EXPECT_EQ(ck.rng_state.size(), 8u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvlab
