// GPU benchmarks, run by scripts/gpu-check.sh: training tokens/s and MFU for a GPT-2-small-sized
// model at several n_kv_head and for nanoGPT's shakespeare config, and cached decode tokens/s at
// batch 1 and 64 against the memory-bandwidth ceiling. The device's own GEMM rates and copy
// bandwidth are measured in the same run, so every ratio has its baseline next to it.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <vector>

#include "autograd/backend/cuda/runtime.h"
#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "bench/bench_util.h"
#include "infer/engine.h"
#include "infer/measure/bench.h"
#include "nn/adamw.h"
#include "nn/gpt.h"

using namespace kvlab;

namespace {

Tensor random_tokens(int64_t B, int64_t T, int64_t V, Generator& gen) {
  std::vector<int32_t> v(static_cast<size_t>(B * T));
  for (int32_t& x : v) x = static_cast<int32_t>(gen.below(static_cast<uint64_t>(V)));
  return Tensor::from_vector(v, {B, T});
}

struct TrainCase {
  const char* name;
  GPTConfig cfg;
  int64_t batch;
};

GPTConfig config(int64_t L, int64_t NH, int64_t NKV, int64_t C, int64_t T, int64_t V) {
  GPTConfig c;
  c.n_layer = L;
  c.n_head = NH;
  c.n_kv_head = NKV;
  c.n_embd = C;
  c.block_size = T;
  c.vocab_size = V;
  return c;
}

// Median seconds of a training step (forward, backward, clipping, AdamW; the loss is read
// back every step, which synchronises).
double step_seconds(const TrainCase& tc, MatmulPrecision precision, int warmup, int timed) {
  const MatmulPrecisionGuard guard(precision);
  GPT model(tc.cfg, 1);
  model.to(Device::CUDA);
  const NamedTensors params = model.named_parameters();
  AdamW opt(params, {0.9, 0.95, 1e-8, 0.1});
  Generator gen(7);
  std::vector<double> t;
  for (int i = 0; i < warmup + timed; ++i) {
    const Tensor x = random_tokens(tc.batch, tc.cfg.block_size, tc.cfg.vocab_size, gen);
    const Tensor y = random_tokens(tc.batch, tc.cfg.block_size, tc.cfg.vocab_size, gen);
    const double t0 = bench::now_s();
    model.zero_grad();
    Tensor loss = model.loss(x, y);
    loss.backward();
    opt.step(3e-4, clip_factor(global_grad_norm(params), 1.0));
    bench::keep(loss.item());
    if (i >= warmup) t.push_back(bench::now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

namespace {
int run(int argc, char** argv) {
  CLI::App app{"kvlab GPU benchmarks (training MFU, decode against the bandwidth ceiling)"};
  std::string json_path;
  int warmup = 2, timed = 5;
  int64_t gpt2_batch = 8;
  app.add_option("--json", json_path, "Write the figures here");
  app.add_option("--warmup", warmup)->capture_default_str();
  app.add_option("--steps", timed, "Timed training steps per config")->capture_default_str();
  app.add_option("--gpt2-batch", gpt2_batch, "Batch of the GPT-2-small configs")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  check_device_available(Device::CUDA);

  const double bf16_tflops = cuda::gemm_tflops(DType::BF16, 8192);
  const double f32_tflops = cuda::gemm_tflops(DType::F32, 8192);
  const double gbps = cuda::copy_gbps(size_t{2} << 30);
  bench::Table dev("device", {"measure", "value"});
  dev.add_row({"bf16 GEMM TFLOP/s (8192^3)", bench::fmt(bf16_tflops, 1)});
  dev.add_row({"f32 GEMM TFLOP/s (8192^3, no TF32)", bench::fmt(f32_tflops, 1)});
  dev.add_row({"device copy GB/s (2 GiB)", bench::fmt(gbps, 0)});
  dev.print();
  bench::Json out = {
      {"bf16_gemm_tflops", bf16_tflops}, {"f32_gemm_tflops", f32_tflops}, {"copy_gbps", gbps}};

  // Training in f32 and with bf16 products (f32 master weights); MFU against both peaks.
  const std::vector<TrainCase> cases = {
      {"gpt2-small NKV 12", config(12, 12, 12, 768, 1024, 50304), gpt2_batch},
      {"gpt2-small NKV 4", config(12, 12, 4, 768, 1024, 50304), gpt2_batch},
      {"gpt2-small NKV 1", config(12, 12, 1, 768, 1024, 50304), gpt2_batch},
      {"shakespeare 6/6/384", config(6, 6, 6, 384, 256, 65), 64},
  };
  bench::Table train("training step on the GPU", {"config", "dtype", "tokens/s", "step ms",
                                                  "TFLOP/s", "MFU vs bf16", "vs f32 GEMM"});
  out["train"] = bench::Json::array();
  for (const TrainCase& tc : cases)
    for (const MatmulPrecision precision : {MatmulPrecision::F32, MatmulPrecision::BF16}) {
      const char* dtype = precision == MatmulPrecision::BF16 ? "bf16" : "f32";
      const double s = step_seconds(tc, precision, warmup, timed);
      const GPTConfig& c = tc.cfg;
      const double tokens = static_cast<double>(tc.batch * c.block_size);
      // 6 x matmul parameters (position table excluded, tied head counted once) + attention
      // (QK^T and PV forward and backward, causal half: 6 L T C per token).
      const double params = static_cast<double>(count_parameters(c) - c.block_size * c.n_embd);
      const double flops = tokens * (6.0 * params + 6.0 * c.n_layer * c.block_size * c.n_embd);
      const double tflops = flops / s / 1e12;
      train.add_row({tc.name, dtype, bench::fmt(tokens / s, 0), bench::fmt(s * 1e3, 1),
                     bench::fmt(tflops, 1), bench::fmt(tflops / bf16_tflops, 3),
                     bench::fmt(tflops / f32_tflops, 2)});
      out["train"].push_back({{"config", tc.name},
                              {"dtype", dtype},
                              {"tokens_per_s", tokens / s},
                              {"step_ms", s * 1e3},
                              {"tflops", tflops},
                              {"mfu_bf16", tflops / bf16_tflops},
                              {"fraction_of_f32_gemm", tflops / f32_tflops}});
    }
  train.print();

  // Decode: greedy, 16-token prompts, 128 new tokens, GPT-2-small shape with random weights,
  // f32 weights and an f32 cache; at batch 64, where the cache is a large part of each step's
  // reads, also a bf16 cache.
  bench::Table dec("cached decode, f32 weights", {"NKV", "batch", "cache", "tokens/s", "ms/step",
                                                  "ceiling ms/step", "step / ceiling"});
  out["decode"] = bench::Json::array();
  const Tokenizer tok = synthetic_tokenizer(50304);
  for (int64_t nkv : {12, 4, 1}) {
    GPT model(config(12, 12, nkv, 768, 1024, 50304), 3);
    model.set_training(false);
    model.to(Device::CUDA);
    const double weight_bytes = 4.0 * static_cast<double>(model.num_parameters());
    for (const auto& [batch, kv_dtype] : {std::pair{int64_t{1}, DType::F32},
                                          std::pair{int64_t{64}, DType::F32},
                                          std::pair{int64_t{64}, DType::BF16}}) {
      Engine engine(model, tok, kv_dtype, std::nullopt);  // CUDA: the contiguous cache
      Generator gen(11);
      std::vector<std::vector<int32_t>> prompts;
      for (int64_t b = 0; b < batch; ++b) {
        std::vector<int32_t> p(16);
        for (int32_t& x : p) x = static_cast<int32_t>(gen.below(50304));
        prompts.push_back(p);
      }
      GenerateOptions o;
      o.max_new_tokens = 128;
      o.sampling.temperature = 0;
      engine.generate_ids(prompts, o);  // warm-up
      const GenerationResult r = engine.generate_ids(prompts, o);
      std::vector<double> steps = r.stats.step_s;
      std::sort(steps.begin(), steps.end());
      const double step = steps[steps.size() / 2];
      // Every step reads the weights once and each row's cache up to its length (mean 80).
      const double cache_bytes = static_cast<double>(batch) * 2.0 * 12 * 80 * nkv * 64 *
                                 static_cast<double>(dtype_size(kv_dtype));
      const double ceiling = (weight_bytes + cache_bytes) / (gbps * 1e9);
      dec.add_row({std::to_string(nkv), std::to_string(batch), dtype_name(kv_dtype),
                   bench::fmt(r.stats.decode_tokens_per_s(), 0), bench::fmt(step * 1e3, 3),
                   bench::fmt(ceiling * 1e3, 3), bench::fmt(step / ceiling, 2)});
      out["decode"].push_back({{"n_kv_head", nkv},
                               {"batch", batch},
                               {"cache_dtype", dtype_name(kv_dtype)},
                               {"tokens_per_s", r.stats.decode_tokens_per_s()},
                               {"step_ms", step * 1e3},
                               {"ceiling_step_ms", ceiling * 1e3},
                               {"cache_bytes", r.stats.cache_bytes}});
    }
  }
  dec.print();
  if (!json_path.empty() && !bench::write_json(json_path, out)) return 1;
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cuda: error: %s\n", e.what());
    return 1;
  }
}
