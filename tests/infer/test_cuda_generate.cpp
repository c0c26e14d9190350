// The model on the GPU: a short training run matches the CPU's losses, AdamW matches step for
// step, cached decode equals recompute (and a bf16 cache stays within bf16 rounding of it),
// weights trained on the GPU generate the CPU's greedy text, and bf16 matrices round as on the
// CPU. Label `cuda`: skipped when no GPU is visible.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <vector>

#include "autograd/backend/cuda/runtime.h"
#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "checkpoints/checkpoint.h"
#include "checkpoints/model_io.h"
#include "infer/engine.h"
#include "infer/kv_cache.h"
#include "nn/adamw.h"
#include "nn/gpt.h"

namespace kvlab {
namespace {

#define REQUIRE_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA GPU is visible"

GPTConfig small(int64_t nkv) {
  GPTConfig c;
  c.vocab_size = 37;
  c.block_size = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = nkv;
  c.n_embd = 64;
  return c;
}

Tensor tokens_of(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  Generator gen(seed);
  std::vector<int32_t> v(static_cast<size_t>(B * T));
  for (int32_t& x : v) x = static_cast<int32_t>(gen.below(static_cast<uint64_t>(V)));
  return Tensor::from_vector(v, {B, T});
}

// Losses of `steps` AdamW steps on fixed random batches; the model starts from seed 1 weights.
std::vector<double> train_losses(Device device, int64_t nkv, int steps,
                                 MatmulPrecision precision = MatmulPrecision::F32) {
  const MatmulPrecisionGuard guard(precision);
  GPT model(small(nkv), 1);
  model.to(device);
  const NamedTensors params = model.named_parameters();
  AdamW opt(params, {0.9, 0.99, 1e-8, 0.1});
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    const Tensor x = tokens_of(4, 32, 37, 100 + s), y = tokens_of(4, 32, 37, 200 + s);
    model.zero_grad();
    Tensor loss = model.loss(x, y);
    losses.push_back(loss.item());
    loss.backward();
    const double norm = global_grad_norm(params);
    opt.step(1e-3, clip_factor(norm, 1.0));
  }
  return losses;
}

TEST(CudaGpt, TwentyTrainingStepsMatchTheCpu) {
  REQUIRE_GPU();
  for (int64_t nkv : {4, 2, 1}) {
    const std::vector<double> cpu = train_losses(Device::CPU, nkv, 20);
    const std::vector<double> gpu = train_losses(Device::CUDA, nkv, 20);
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_NEAR(gpu[i], cpu[i], 1e-4) << "NKV " << nkv << " step " << i;
  }
}

TEST(CudaGpt, Bf16TrainingStaysWithinTwoPercentOfTheCpu) {
  REQUIRE_GPU();
  const std::vector<double> cpu = train_losses(Device::CPU, 2, 20);
  const std::vector<double> gpu = train_losses(Device::CUDA, 2, 20, MatmulPrecision::BF16);
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_NEAR(gpu[i], cpu[i], 0.02 * cpu[i]) << "step " << i;
}

TEST(CudaGpt, AdamWMatchesTheCpu) {
  REQUIRE_GPU();
  Generator gen(8);
  std::vector<float> w(64 * 33), g(64 * 33);
  for (auto* v : {&w, &g})
    for (float& x : *v) x = static_cast<float>(gen.normal());
  NamedTensors on_cpu{{"w", Tensor::from_vector(w, {64, 33})}};
  NamedTensors on_gpu{{"w", Tensor::from_vector(w, {64, 33}).to(Device::CUDA)}};
  on_cpu[0].second.set_requires_grad(true);
  on_gpu[0].second.set_requires_grad(true);
  AdamW cpu_opt(on_cpu, {0.9, 0.99, 1e-8, 0.1}), gpu_opt(on_gpu, {0.9, 0.99, 1e-8, 0.1});
  for (int step = 0; step < 5; ++step) {
    const Tensor gs = scale(Tensor::from_vector(g, {64, 33}), 1.0 + step);
    on_cpu[0].second.set_grad(gs);
    on_gpu[0].second.set_grad(gs.to(Device::CUDA));
    const double n_cpu = global_grad_norm(on_cpu), n_gpu = global_grad_norm(on_gpu);
    EXPECT_NEAR(n_gpu, n_cpu, 1e-9 * n_cpu);
    cpu_opt.step(1e-2, clip_factor(n_cpu, 1.0));
    gpu_opt.step(1e-2, clip_factor(n_gpu, 1.0));
  }
  const std::vector<float> a = on_gpu[0].second.to_vector<float>();
  const std::vector<float> b = on_cpu[0].second.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6) << i;
}

TEST(CudaGpt, CachedDecodeEqualsRecomputeOnTheGpu) {
  REQUIRE_GPU();
  NoGradGuard no_grad;
  for (int64_t nkv : {4, 2, 1}) {
    GPT model(small(nkv), 3);
    model.set_training(false);
    model.to(Device::CUDA);
    const Tensor seq = tokens_of(3, 20, 37, 7);
    ContiguousKVCache cache(2, 3, 32, nkv, 16, DType::F32, Device::CUDA);
    model.forward(narrow(seq, 1, 0, 7), &cache);  // prefill 7
    for (int64_t t = 7; t < 20; ++t) {
      const Tensor step = model.forward(narrow(seq, 1, t, 1), &cache).to(Device::CPU);
      const Tensor full = model.forward(narrow(seq, 1, 0, t + 1)).to(Device::CPU);
      const std::vector<float> a = step.to_vector<float>();
      const std::vector<float> b = narrow(full, 1, t, 1).to_vector<float>();
      for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5) << "NKV " << nkv;
    }
    EXPECT_EQ(cache.bytes(), kv_cache_formula_bytes(2, 3, 32, nkv, 16, DType::F32));
  }
}

// A bf16 cache on the GPU: the decode kernels widen its keys and values as they stage them.
// Decode logits stay within bf16 distance of an f32 recompute, agree with the CPU's bf16 cache
// (both round the same keys, up to the f32 rounding of the projections), and the cache holds
// half the f32 bytes.
TEST(CudaGpt, Bf16CacheDecodeOnTheGpu) {
  REQUIRE_GPU();
  NoGradGuard no_grad;
  for (int64_t nkv : {4, 1}) {
    GPT gpu(small(nkv), 3), cpu(small(nkv), 3);
    gpu.set_training(false);
    cpu.set_training(false);
    gpu.to(Device::CUDA);
    const Tensor seq = tokens_of(3, 20, 37, 7);
    ContiguousKVCache gc(2, 3, 32, nkv, 16, DType::BF16, Device::CUDA);
    ContiguousKVCache cc(2, 3, 32, nkv, 16, DType::BF16, Device::CPU);
    gpu.forward(narrow(seq, 1, 0, 7), &gc);
    cpu.forward(narrow(seq, 1, 0, 7), &cc);
    for (int64_t t = 7; t < 20; ++t) {
      const Tensor col = narrow(seq, 1, t, 1);
      const std::vector<float> g = gpu.forward(col, &gc).to(Device::CPU).to_vector<float>();
      const std::vector<float> c = cpu.forward(col, &cc).to_vector<float>();
      const Tensor full = gpu.forward(narrow(seq, 1, 0, t + 1)).to(Device::CPU);
      const std::vector<float> r = narrow(full, 1, t, 1).to_vector<float>();
      double scale = 0, to_ref = 0, to_cpu = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        scale = std::max(scale, static_cast<double>(std::fabs(r[i])));
        to_ref = std::max(to_ref, static_cast<double>(std::fabs(g[i] - r[i])));
        to_cpu = std::max(to_cpu, static_cast<double>(std::fabs(g[i] - c[i])));
      }
      EXPECT_LE(to_ref, 2e-2 * scale) << "NKV " << nkv << " step " << t;
      EXPECT_LE(to_cpu, 1e-3 * scale) << "NKV " << nkv << " step " << t;
    }
    EXPECT_EQ(gc.bytes(), kv_cache_formula_bytes(2, 3, 32, nkv, 16, DType::BF16));
  }
}

TEST(CudaGpt, GpuTrainedWeightsGenerateTheSameGreedyTextOnTheCpu) {
  REQUIRE_GPU();
  GPT model(small(2), 5);
  model.to(Device::CUDA);
  const NamedTensors params = model.named_parameters();
  AdamW opt(params, {0.9, 0.99, 1e-8, 0.1});
  for (int s = 0; s < 10; ++s) {
    model.zero_grad();
    Tensor loss = model.loss(tokens_of(4, 32, 37, 300 + s), tokens_of(4, 32, 37, 400 + s));
    loss.backward();
    opt.step(1e-3, clip_factor(global_grad_norm(params), 1.0));
  }
  model.set_training(false);
  const std::vector<uint32_t> vocab = [] {
    std::vector<uint32_t> v;
    for (uint32_t c = 'a'; c < 'a' + 37; ++c) v.push_back(c);
    return v;
  }();
  const Tokenizer chars = Tokenizer::from_vocab(TokenizerKind::Char, vocab);
  // Through a checkpoint file, as a user would move a GPU-trained model to a CPU.
  Checkpoint ckpt;
  put_gpt_config(ckpt.config, model.config());
  put_tokenizer(ckpt, chars);
  ckpt.model = to_arrays(params);
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("kvlab_cuda_" + std::to_string(::getpid()) + ".h5");
  save_checkpoint(file, ckpt);
  LoadedModel on_cpu = load_model(file);
  std::filesystem::remove(file);
  GenerateOptions o;
  o.max_new_tokens = 24;
  o.sampling.temperature = 0;
  Engine gpu_engine(model, chars, DType::F32, std::nullopt);  // CUDA: the contiguous cache
  Engine cpu_engine(*on_cpu.model, on_cpu.tokenizer);
  const GenerationResult g = gpu_engine.generate({"abc", "hello"}, o);
  const GenerationResult c = cpu_engine.generate({"abc", "hello"}, o);
  for (size_t r = 0; r < 2; ++r) EXPECT_EQ(g.rows[r].tokens, c.rows[r].tokens) << "row " << r;
}

// round_matrices on the GPU rounds as the CPU does (to nearest even): the two models'
// parameters are equal bit for bit afterwards, and differ from the f32 ones.
TEST(CudaGpt, RoundMatricesToBf16MatchesTheCpu) {
  REQUIRE_GPU();
  GPT cpu(small(2), 1), gpu(small(2), 1);
  gpu.to(Device::CUDA);
  const std::vector<float> before = cpu.blocks[0]->mlp.c_fc.weight.to_vector<float>();
  cpu.round_matrices(WeightDtype::BF16);
  gpu.round_matrices(WeightDtype::BF16);
  const std::vector<Tensor> c = cpu.parameters(), g = gpu.parameters();
  ASSERT_EQ(c.size(), g.size());
  for (size_t i = 0; i < c.size(); ++i)
    EXPECT_EQ(c[i].to_vector<float>(), g[i].to(Device::CPU).to_vector<float>())
        << "parameter " << i;
  EXPECT_NE(cpu.blocks[0]->mlp.c_fc.weight.to_vector<float>(), before);
}

}  // namespace
}  // namespace kvlab
