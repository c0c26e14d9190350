// Training throughput of kvlab at nanoGPT's CPU "baby" config (4 layers, 4 heads, n_embd 128,
// block 64, batch 12): tokens/s, model FLOP/s as a fraction of the machine's measured sgemm
// rate at the model's own GEMM shapes (same run), and peak resident memory.
// bench/compare_train.sh runs this next to PyTorch (bench/torch_train.py) in one sitting.
#include <cblas.h>
#include <omp.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>

#include "autograd/backend/kernels.h"
#include "bench/bench_util.h"
#include "platform/threads.h"
#include "train/trainer.h"

using namespace kvlab;

namespace {

// Median sgemm GFLOP/s over the GEMMs of one training step (forward, and both backward
// products of every Linear), weighted by their FLOPs.
double sgemm_rate(const GPTConfig& c, int64_t rows) {
  struct Shape3 { int64_t m, k, n; bool ta, tb; };
  const int64_t C = c.n_embd, H = c.hidden(), kv = c.n_kv_head * c.head_size(), V = c.vocab_size;
  std::vector<Shape3> shapes;
  auto linear = [&](int64_t in, int64_t out) {
    shapes.push_back({rows, in, out, false, true});   // y = x w^T
    shapes.push_back({rows, out, in, false, false});  // dx = dy w
    shapes.push_back({out, rows, in, true, false});   // dw = dy^T x
  };
  for (int l = 0; l < c.n_layer; ++l) {
    linear(C, C);   // q
    linear(C, kv);  // k
    linear(C, kv);  // v
    linear(C, C);   // c_proj
    linear(C, H);   // c_fc
    if (c.swiglu()) linear(C, H);  // c_up
    linear(H, C);   // mlp c_proj
  }
  linear(C, V);  // LM head
  double flops = 0, secs = 0;
  for (const auto& s : shapes) {
    std::vector<float> a(s.m * s.k, 0.5f), b(s.k * s.n, 0.25f), out(s.m * s.n);
    const int64_t lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    // Each shape's faster way of driving the BLAS: one threaded call, or kvlab's split of the
    // rows into one single-threaded call per thread (cpu::gemm); samples interleaved.
    const std::vector<bench::Timing> t = bench::time_interleaved(
        {[&] {
           cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans,
                       s.tb ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, 1.0f, a.data(), lda,
                       b.data(), ldb, 0.0f, out.data(), s.n);
         },
         [&] {
           cpu::gemm<float>(s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                            out.data(), s.n);
         }},
        {.reps = 15, .warmup = 3, .min_sample_s = 0});
    flops += 2.0 * s.m * s.n * s.k;
    secs += std::min(t[0].median_s, t[1].median_s);
  }
  return flops / secs / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  apply_thread_wait_policy(argv);  // the same threading setup as the kvlab CLI
  CLI::App app{"kvlab training throughput at the baby config"};
  TrainConfig cfg;
  int64_t warmup_iters = 5;
  std::string json_path;
  app.add_option("--corpus", cfg.corpus,
                 "Text to train on (nanoGPT's published figures use tinyshakespeare.txt)")
      ->required();
  app.add_option("--iters", cfg.iters, "Timed steps (after the warm-up)")->default_val(60);
  app.add_option("--warmup-iters", warmup_iters)->capture_default_str();
  app.add_option("--n-layer", cfg.model.n_layer)->capture_default_str();
  app.add_option("--n-head", cfg.model.n_head)->capture_default_str();
  app.add_option("--n-kv-head", cfg.model.n_kv_head)->capture_default_str();
  app.add_option("--n-embd", cfg.model.n_embd)->capture_default_str();
  app.add_option("--block-size", cfg.model.block_size)->capture_default_str();
  app.add_option("--batch-size", cfg.batch_size)->capture_default_str();
  std::string arch = "gpt2";
  app.add_option("--arch", arch,
                 "gpt2 (learned positions, LayerNorm, GELU, biases) or llama (RoPE, RMSNorm, "
                 "SwiGLU at 8/3 n-embd, no biases)")
      ->check(CLI::IsMember({"gpt2", "llama"}))
      ->capture_default_str();
  app.add_option("--json", json_path, "Write the figures here");
  CLI11_PARSE(app, argc, argv);
  if (arch == "llama") {
    cfg.model.pos = "rope";
    cfg.model.norm = "rmsnorm";
    cfg.model.mlp = "swiglu";
    cfg.model.bias = false;
  }
  const int64_t timed = cfg.iters;
  cfg.iters = timed + warmup_iters;
  cfg.eval_interval = cfg.iters + 1;  // no evaluation inside the timed loop (one at the end)
  cfg.eval_iters = 1;
  Trainer trainer(cfg);
  std::vector<double> step_s;
  double last_loss = 0;
  trainer.run([&](const StepRecord& r) {
    if (r.step > warmup_iters) step_s.push_back(static_cast<double>(cfg.batch_size * cfg.model.block_size) / r.tokens_per_s);
    if (r.step > 0) last_loss = r.train_loss;
    return true;
  });
  std::sort(step_s.begin(), step_s.end());
  const double med = step_s[step_s.size() / 2];
  const int64_t tokens = cfg.batch_size * cfg.model.block_size;
  const GPTConfig& mc = trainer.model().config();
  // Model FLOPs per token: 6 x (parameters used in matmuls, LM head included) + attention
  // (QK^T and PV, forward and backward, causal half): 6 L T C.
  const double matmul_params = static_cast<double>(
      count_parameters(mc) - (mc.rope() ? 0 : mc.block_size * mc.n_embd));
  const double flops_per_token = 6.0 * matmul_params + 6.0 * mc.n_layer * mc.block_size * mc.n_embd;
  const double achieved = flops_per_token * tokens / med / 1e9;
  const double gemm = sgemm_rate(mc, tokens);
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  bench::Json out = {{"tokens_per_s", tokens / med},
                     {"step_ms", med * 1e3},
                     {"model_gflops", achieved},
                     {"sgemm_gflops_same_shapes", gemm},
                     {"fraction_of_sgemm", achieved / gemm},
                     {"peak_rss_mib", ru.ru_maxrss / 1024.0},
                     {"final_train_loss", last_loss},
                     {"threads", omp_get_max_threads()},
                     {"gomp_spincount", std::getenv("GOMP_SPINCOUNT") ? std::getenv("GOMP_SPINCOUNT") : "default"},
                     {"parameters", trainer.model().num_parameters()},
                     {"arch", arch},
                     {"model_gflop_per_step", flops_per_token * tokens / 1e9},
                     {"machine", bench::machine_info()}};
  bench::Table t("kvlab training step (baby config, " + arch + " block)", {"metric", "value"});
  t.add_row({"tokens/s", bench::fmt(tokens / med, 0)});
  t.add_row({"step ms (median)", bench::fmt(med * 1e3, 2)});
  t.add_row({"model GFLOP/s", bench::fmt(achieved, 1)});
  t.add_row({"sgemm GFLOP/s (same shapes)", bench::fmt(gemm, 1)});
  t.add_row({"fraction of sgemm", bench::fmt(achieved / gemm, 2)});
  t.add_row({"peak RSS MiB", bench::fmt(ru.ru_maxrss / 1024.0, 1)});
  t.add_row({"threads", std::to_string(omp_get_max_threads())});
  t.print();
  if (!json_path.empty() && !bench::write_json(json_path, out)) return 1;
  return 0;
}
