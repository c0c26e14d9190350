// Engine benchmarks: GEMM through the engine against direct OpenBLAS calls, fused causal
// attention against a naive graph of engine ops, and the memory-bound ops (LayerNorm, GELU,
// cross-entropy) against a copy of the same number of bytes. Every figure is a ratio against a
// baseline measured in the same run; tables go to stdout and everything to JSON (--json).
//
//   build/bench/bench_engine --json build/bench_engine.json [--reps N] [--quick]
#include <cblas.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "autograd/tensor.h"
#include "bench/bench_util.h"

namespace {

using kvlab::NoGradGuard;
using kvlab::Shape;
using kvlab::Tensor;
using kvlab::bench::fmt;
using kvlab::bench::Json;
using kvlab::bench::Table;
using kvlab::bench::time_interleaved;
using kvlab::bench::TimerOptions;
using kvlab::bench::Timing;

struct Config {
  int reps = 11;
  bool quick = false;
  TimerOptions timer() const {
    TimerOptions t;
    t.reps = reps;
    t.warmup = quick ? 1 : 2;
    t.min_sample_s = quick ? 1e-3 : 2e-3;
    return t;
  }
};

// Uniform values in [-a, a] from a counter hash: fast enough for 50M-element tensors.
void fill_uniform(float* p, int64_t n, uint64_t seed, float a) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    p[i] = a * (static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

Tensor rand_tensor(const Shape& s, uint64_t seed, float a = 1.0f) {
  Tensor t = Tensor::empty(s);
  fill_uniform(t.data<float>(), t.numel(), seed, a);
  return t;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  if (x.size() != y.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(double(x[i]) - double(y[i])));
  return m;
}

double max_abs_diff(const float* a, const float* b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

std::string shape3(int64_t a, int64_t b, int64_t c) {
  return std::to_string(a) + "x" + std::to_string(b) + "x" + std::to_string(c);
}

// ---- 1. GEMM -------------------------------------------------------------------------------
// Engine ops (NoGradGuard, f32, output allocated per call by the engine's caching allocator)
// against the same cblas call on buffers allocated once. linear(x, w) is x (M, K) @ w^T with
// w (N, K) as nn.Linear stores it: cblas NoTrans/Trans. matmul(a, b) is a (M, K) @ b (K, N):
// NoTrans/NoTrans. GFLOP/s count 2*M*N*K.
Json bench_gemm(const Config& cfg) {
  struct S {
    int64_t M, K, N;
  };
  const std::vector<S> shapes = {
      {768, 128, 384}, {768, 128, 128}, {768, 512, 128}, {3072, 384, 1536}};
  Json rows = Json::array();
  Table table("GEMM f32, M x K x N: engine vs direct cblas_sgemm (ratio target >= 0.9)",
              {"op", "M x K x N", "engine GFLOP/s", "direct GFLOP/s", "engine/direct"});
  uint64_t seed = 1;
  for (const S& s : shapes) {
    const Tensor x = rand_tensor({s.M, s.K}, seed++), w = rand_tensor({s.N, s.K}, seed++);
    const Tensor b = rand_tensor({s.K, s.N}, seed++);
    Tensor c = Tensor::zeros({s.M, s.N});
    const float *px = x.data<float>(), *pw = w.data<float>(), *pb = b.data<float>();
    float* pc = c.data<float>();
    const double flops = 2.0 * s.M * s.N * s.K;
    for (const std::string op : {"linear", "matmul"}) {
      const bool lin = op == "linear";
      auto engine = [&] {
        NoGradGuard ng;
        Tensor y = lin ? kvlab::linear(x, w) : kvlab::matmul(x, b);
        kvlab::bench::keep(y);
      };
      auto direct = [&] {
        if (lin)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.M, s.N, s.K, 1.0f, px, s.K, pw,
                      s.K, 0.0f, pc, s.N);
        else
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.M, s.N, s.K, 1.0f, px, s.K, pb,
                      s.N, 0.0f, pc, s.N);
      };
      double diff;
      {
        NoGradGuard ng;
        direct();
        const Tensor y = lin ? kvlab::linear(x, w) : kvlab::matmul(x, b);
        diff = max_abs_diff(y.data<float>(), pc, s.M * s.N);
      }
      const auto t = time_interleaved({engine, direct}, cfg.timer());
      const double ge = flops / t[0].median_s * 1e-9, gd = flops / t[1].median_s * 1e-9;
      table.add_row({op, shape3(s.M, s.K, s.N), fmt(ge, 1), fmt(gd, 1), fmt(ge / gd, 3)});
      rows.push_back({{"op", op},
                      {"M", s.M},
                      {"K", s.K},
                      {"N", s.N},
                      {"engine_gflops", ge},
                      {"direct_gflops", gd},
                      {"ratio_engine_direct", ge / gd},
                      {"max_abs_diff", diff},
                      {"engine", t[0].json()},
                      {"direct", t[1].json()}});
    }
  }
  table.print();
  return rows;
}

// M = 1 (decode): engine linear (x (1, K) @ w^T, which the engine sends to GEMV) against
// cblas_sgemm with M = 1 and against cblas_sgemv on the same w (N, K). GB/s count the weight
// bytes, which dominate: 4*N*K.
Json bench_decode_gemv(const Config& cfg) {
  struct S {
    int64_t K, N;
  };
  const std::vector<S> shapes = {{256, 768}, {1024, 4096}};
  Json rows = Json::array();
  Table table(
      "M = 1 (decode), 1 x K x N: GFLOP/s (weight GB/s in brackets)",
      {"1 x K x N", "engine", "direct sgemm", "direct sgemv", "engine/sgemv", "engine/sgemm"});
  uint64_t seed = 100;
  for (const S& s : shapes) {
    const Tensor x = rand_tensor({1, s.K}, seed++), w = rand_tensor({s.N, s.K}, seed++);
    Tensor c = Tensor::zeros({1, s.N}), c2 = Tensor::zeros({1, s.N});
    const float *px = x.data<float>(), *pw = w.data<float>();
    float *pc = c.data<float>(), *pc2 = c2.data<float>();
    auto engine = [&] {
      NoGradGuard ng;
      Tensor y = kvlab::linear(x, w);
      kvlab::bench::keep(y);
    };
    auto gemm = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 1, s.N, s.K, 1.0f, px, s.K, pw, s.K,
                  0.0f, pc, s.N);
    };
    auto gemv = [&] {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, s.N, s.K, 1.0f, pw, s.K, px, 1, 0.0f, pc2, 1);
    };
    double diff;
    {
      NoGradGuard ng;
      gemm();
      gemv();
      const Tensor y = kvlab::linear(x, w);
      diff = std::max(max_abs_diff(y.data<float>(), pc, s.N), max_abs_diff(pc2, pc, s.N));
    }
    const auto t = time_interleaved({engine, gemm, gemv}, cfg.timer());
    const double flops = 2.0 * s.K * s.N, bytes = 4.0 * s.K * s.N;
    auto cell = [&](const Timing& tm) {
      return fmt(flops / tm.median_s * 1e-9, 1) + " (" + fmt(bytes / tm.median_s * 1e-9, 1) + ")";
    };
    table.add_row({shape3(1, s.K, s.N), cell(t[0]), cell(t[1]), cell(t[2]),
                   fmt(t[2].median_s / t[0].median_s, 3), fmt(t[1].median_s / t[0].median_s, 2)});
    rows.push_back({{"M", 1},
                    {"K", s.K},
                    {"N", s.N},
                    {"engine_gflops", flops / t[0].median_s * 1e-9},
                    {"sgemm_gflops", flops / t[1].median_s * 1e-9},
                    {"sgemv_gflops", flops / t[2].median_s * 1e-9},
                    {"ratio_engine_sgemv", t[2].median_s / t[0].median_s},
                    {"ratio_engine_sgemm", t[1].median_s / t[0].median_s},
                    {"max_abs_diff", diff},
                    {"engine", t[0].json()},
                    {"sgemm", t[1].json()},
                    {"sgemv", t[2].json()}});
  }
  table.print();
  return rows;
}

// ---- 2. Attention --------------------------------------------------------------------------
// One forward + backward of kvlab::causal_attention (q, k, v leaves with requires_grad, a given
// output gradient) against the same computation written naively with engine ops: K/V heads
// repeated NH/NKV times by narrow + concat copies, scores = q k^T * scale + causal mask
// (-1e9 above the diagonal), softmax, @ v, then backward through that graph. Both compute the
// same gradients (checked). tokens/s = B*T per forward + backward.
Tensor repeat_heads(const Tensor& k, int64_t rep) {
  if (rep == 1) return k;
  std::vector<Tensor> parts;
  for (int64_t g = 0; g < k.size(1); ++g)
    for (int64_t r = 0; r < rep; ++r) parts.push_back(kvlab::narrow(k, 1, g, 1));
  return kvlab::concat(parts, 1);
}

Json bench_attention(const Config& cfg) {
  struct S {
    int64_t B, NH, NKV, T, HS;
  };
  std::vector<S> cases;
  const int64_t small_b = cfg.quick ? 4 : 12, big_b = cfg.quick ? 2 : 12;
  for (int64_t nkv : {4, 2, 1}) cases.push_back({small_b, 4, nkv, 64, 32});
  for (int64_t nkv : {6, 3, 1}) cases.push_back({big_b, 6, nkv, 256, 64});
  Json rows = Json::array();
  Table table("Causal attention f32, forward + backward: fused engine op vs naive engine graph",
              {"B NH NKV T HS", "engine tok/s", "naive tok/s", "engine/naive", "max |diff|"});
  uint64_t seed = 200;
  for (const S& s : cases) {
    Tensor q = rand_tensor({s.B, s.NH, s.T, s.HS}, seed++);
    Tensor k = rand_tensor({s.B, s.NKV, s.T, s.HS}, seed++);
    Tensor v = rand_tensor({s.B, s.NKV, s.T, s.HS}, seed++);
    const Tensor gout = rand_tensor({s.B, s.NH, s.T, s.HS}, seed++);
    q.set_requires_grad();
    k.set_requires_grad();
    v.set_requires_grad();
    std::vector<float> mask_v(static_cast<size_t>(s.T * s.T), 0.0f);
    for (int64_t i = 0; i < s.T; ++i)
      for (int64_t j = i + 1; j < s.T; ++j) mask_v[i * s.T + j] = -1e9f;
    const Tensor mask = Tensor::from_vector(mask_v, {s.T, s.T});
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.HS));
    auto zero = [&] {
      q.zero_grad();
      k.zero_grad();
      v.zero_grad();
    };
    auto engine = [&]() -> Tensor {
      zero();
      Tensor o = kvlab::causal_attention(q, k, v);
      o.backward(gout);
      return o;
    };
    auto naive = [&]() -> Tensor {
      zero();
      const Tensor kr = repeat_heads(k, s.NH / s.NKV), vr = repeat_heads(v, s.NH / s.NKV);
      const Tensor scores = kvlab::matmul(q, kr, false, true) * scale + mask;
      Tensor o = kvlab::matmul(kvlab::softmax(scores), vr);
      o.backward(gout);
      return o;
    };
    // Correctness: outputs and all three gradients agree.
    const Tensor oe = engine().detach();
    const Tensor dqe = q.grad(), dke = k.grad(), dve = v.grad();
    const Tensor on = naive().detach();
    const double diff = std::max({max_abs_diff(oe, on), max_abs_diff(dqe, q.grad()),
                                  max_abs_diff(dke, k.grad()), max_abs_diff(dve, v.grad())});
    const auto t = time_interleaved({[&] { engine(); }, [&] { naive(); }}, cfg.timer());
    const double tokens = static_cast<double>(s.B * s.T);
    const double te = tokens / t[0].median_s, tn = tokens / t[1].median_s;
    const std::string label = std::to_string(s.B) + " " + std::to_string(s.NH) + " " +
                              std::to_string(s.NKV) + " " + std::to_string(s.T) + " " +
                              std::to_string(s.HS);
    table.add_row({label, fmt(te, 0), fmt(tn, 0), fmt(te / tn, 2), fmt(diff, 6)});
    rows.push_back({{"B", s.B},
                    {"NH", s.NH},
                    {"NKV", s.NKV},
                    {"T", s.T},
                    {"S", s.T},
                    {"HS", s.HS},
                    {"engine_tokens_per_s", te},
                    {"naive_tokens_per_s", tn},
                    {"ratio_engine_naive", te / tn},
                    {"max_abs_diff", diff},
                    {"engine", t[0].json()},
                    {"naive", t[1].json()}});
  }
  table.print();
  return rows;
}

// ---- 3. Memory-bound ops -------------------------------------------------------------------
// Copy bandwidth for a footprint of `bytes` (bytes/2 read, bytes/2 written, counted as
// `bytes`): the best of std::memcpy over one slice per OpenMP thread and an OpenMP copy loop,
// each taken from its fastest sample.
struct Bandwidth {
  double gbs = 0, memcpy_gbs = 0, loop_gbs = 0;
};

Bandwidth copy_bandwidth(size_t bytes, const Config& cfg) {
  const size_t n = std::max<size_t>(bytes / 2 / sizeof(float), 1024);
  std::vector<float> src(n, 1.0f), dst(n, 0.0f);
  float *ps = src.data(), *pd = dst.data();
  auto by_memcpy = [&] {
#pragma omp parallel
    {
      const size_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      const size_t a = n * t / nt, b = n * (t + 1) / nt;
      std::memcpy(pd + a, ps + a, (b - a) * sizeof(float));
    }
  };
  auto by_loop = [&] {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; ++i) pd[i] = ps[i];
  };
  const auto t = time_interleaved({by_memcpy, by_loop}, cfg.timer());
  const double total = 2.0 * n * sizeof(float);
  Bandwidth bw;
  // A peak figure: the fastest sample of each method (the ops get their median).
  bw.memcpy_gbs = total / t[0].min_s * 1e-9;
  bw.loop_gbs = total / t[1].min_s * 1e-9;
  bw.gbs = std::max(bw.memcpy_gbs, bw.loop_gbs);
  return bw;
}

Json bench_memory_ops(const Config& cfg) {
  // Bytes are the compulsory traffic: every input element read once and every output written
  // once (f32 = 4 bytes, i32 targets 4 bytes). Re-reads from cache inside a row, and the extra
  // read of a destination line that a store without streaming hints causes (write-allocate),
  // are not counted, so the GB/s is what the op achieves on the data it must move.
  //   LayerNorm fwd: read x (N*C), w, b (2C); write y (N*C), mean, rstd (2N)
  //   LayerNorm bwd: read dy, x (2*N*C), w (C), mean, rstd (2N); write dx (N*C), dw, db (2C)
  //   GELU fwd: read x, write y (2n);  GELU bwd: read dy, x, write dx (3n)
  //   CE fwd: read logits (N*V), targets (N); write lse (N) (+ the scalar loss)
  //   CE bwd: read logits (N*V), lse, targets (2N); write dlogits (N*V)
  // Backward is timed by calling the op's recorded node directly (Node::backward), with the
  // forward done once beforehand; forward runs in grad mode, recording its node as training does.
  struct Case {
    std::string op;
    int64_t N, C;  // C is V for cross-entropy
  };
  const int64_t bigN = cfg.quick ? 4096 : 16384;
  const int64_t ceN = cfg.quick ? 128 : 512;
  const std::vector<Case> cases = {{"layer_norm", 768, 128},     {"layer_norm", bigN, 768},
                                   {"gelu", 768, 128},           {"gelu", bigN, 768},
                                   {"cross_entropy", 768, 65},   {"cross_entropy", bigN, 65},
                                   {"cross_entropy", ceN, 50304}};
  std::map<size_t, Bandwidth> bw_cache;
  auto bandwidth = [&](size_t bytes) {
    auto it = bw_cache.find(bytes);
    if (it == bw_cache.end()) it = bw_cache.emplace(bytes, copy_bandwidth(bytes, cfg)).first;
    return it->second;
  };
  Json rows = Json::array();
  Table table("Memory-bound ops f32: GB/s of compulsory traffic vs a copy of the same bytes",
              {"op", "N x C", "pass", "MB", "time ms", "GB/s", "copy GB/s", "fraction"});
  uint64_t seed = 300;
  for (const Case& c : cases) {
    const double N = static_cast<double>(c.N), C = static_cast<double>(c.C);
    Tensor x, w, b, targets, out;
    // The output gradient: (N, C) for LayerNorm and GELU, 1 for the scalar loss.
    Tensor dout = c.op == "cross_entropy" ? Tensor::scalar(1.0) : rand_tensor({c.N, c.C}, seed++);
    std::function<Tensor()> forward;
    double fwd_bytes = 0, bwd_bytes = 0;
    if (c.op == "layer_norm") {
      x = rand_tensor({c.N, c.C}, seed++, 2.0f).set_requires_grad();
      w = rand_tensor({c.C}, seed++).set_requires_grad();
      b = rand_tensor({c.C}, seed++).set_requires_grad();
      forward = [&] { return kvlab::layer_norm(x, w, b); };
      fwd_bytes = 4 * (2 * N * C + 2 * C + 2 * N);
      bwd_bytes = 4 * (3 * N * C + 3 * C + 2 * N);
    } else if (c.op == "gelu") {
      x = rand_tensor({c.N, c.C}, seed++, 3.0f).set_requires_grad();
      forward = [&] { return kvlab::gelu(x); };
      fwd_bytes = 4 * (2 * N * C);
      bwd_bytes = 4 * (3 * N * C);
    } else {
      x = rand_tensor({c.N, c.C}, seed++, 4.0f).set_requires_grad();
      std::vector<int32_t> tv(static_cast<size_t>(c.N));
      for (int64_t i = 0; i < c.N; ++i) tv[i] = static_cast<int32_t>((i * 7919) % c.C);
      targets = Tensor::from_vector(tv, {c.N});
      forward = [&] { return kvlab::cross_entropy(x, targets); };
      fwd_bytes = 4 * (N * C + 2 * N);
      bwd_bytes = 4 * (2 * N * C + 2 * N);
    }
    out = forward();
    const std::shared_ptr<kvlab::Node> node = out.grad_fn();
    const auto t = time_interleaved({[&] {
                                       Tensor y = forward();
                                       kvlab::bench::keep(y);
                                     },
                                     [&] {
                                       std::vector<Tensor> g = node->backward(dout);
                                       kvlab::bench::keep(g);
                                     }},
                                    cfg.timer());
    Json entry = {{"op", c.op}, {"N", c.N}, {c.op == "cross_entropy" ? "V" : "C", c.C}};
    for (int pass = 0; pass < 2; ++pass) {
      const double bytes = pass ? bwd_bytes : fwd_bytes;
      const Bandwidth bw = bandwidth(static_cast<size_t>(bytes));
      const double gbs = bytes / t[pass].median_s * 1e-9;
      table.add_row({c.op, std::to_string(c.N) + " x " + std::to_string(c.C), pass ? "bwd" : "fwd",
                     fmt(bytes * 1e-6, 1), fmt(t[pass].median_s * 1e3, 3), fmt(gbs, 1),
                     fmt(bw.gbs, 1), fmt(gbs / bw.gbs, 2)});
      entry[pass ? "backward" : "forward"] = {{"bytes", bytes},
                                              {"gbs", gbs},
                                              {"copy_gbs", bw.gbs},
                                              {"copy_memcpy_gbs", bw.memcpy_gbs},
                                              {"copy_loop_gbs", bw.loop_gbs},
                                              {"fraction_of_copy", gbs / bw.gbs},
                                              {"timing", t[pass].json()}};
    }
    rows.push_back(entry);
  }
  table.print();
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvlab engine benchmarks: GEMM, attention, memory-bound ops"};
  std::string json_path;
  Config cfg;
  bool reps_given = false;
  std::vector<std::string> only;
  app.add_option("--json", json_path, "write all figures to this JSON file");
  app.add_option_function<int>(
         "--reps",
         [&](const int& r) {
           cfg.reps = r;
           reps_given = true;
         },
         "timed samples per measurement; the median is reported (default 11, 5 with --quick)")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--quick", cfg.quick, "fewer samples and smaller large shapes (< 10 s)");
  app.add_option("--only", only, "sections to run: gemm, attention, memory (default all)")
      ->check(CLI::IsMember({"gemm", "attention", "memory"}));
  CLI11_PARSE(app, argc, argv);
  if (cfg.quick && !reps_given) cfg.reps = 5;
  if (!json_path.empty() && !kvlab::bench::write_json(json_path, Json::object())) return 1;
  const std::set<std::string> sections(only.begin(), only.end());
  auto want = [&](const char* s) { return sections.empty() || sections.count(s) > 0; };

  Json machine = kvlab::bench::machine_info();
  machine["openblas_num_threads"] = openblas_get_num_threads();
  kvlab::bench::print_machine(machine);
  std::cout << "openblas: " << openblas_get_config()
            << ", openblas_get_num_threads() = " << openblas_get_num_threads() << '\n';
  std::cout << "reps " << cfg.reps << (cfg.quick ? " (quick)" : "") << ", medians reported\n";

  // Wake the cores, OpenBLAS's buffers and the OpenMP pool before the first measurement.
  {
    const int64_t n = 512;
    std::vector<float> a(n * n, 1.0f), c(n * n);
    const double until = kvlab::bench::now_s() + (cfg.quick ? 0.1 : 0.3);
    while (kvlab::bench::now_s() < until)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, a.data(),
                  n, 0.0f, c.data(), n);
  }
  const double t0 = kvlab::bench::now_s();
  Json result = {{"benchmark", "engine"},
                 {"machine", machine},
                 {"options", {{"reps", cfg.reps}, {"quick", cfg.quick}}}};
  Json section_s = Json::object();
  auto run = [&](const char* name, auto&& body) {
    if (!want(name)) return;
    const double ts = kvlab::bench::now_s();
    body();
    section_s[name] = kvlab::bench::now_s() - ts;
    std::cout << "(" << name << ": " << fmt(section_s[name].get<double>(), 1) << " s)\n";
  };
  run("gemm", [&] {
    result["gemm"] = bench_gemm(cfg);
    result["gemv_decode"] = bench_decode_gemv(cfg);
  });
  run("attention", [&] { result["attention"] = bench_attention(cfg); });
  run("memory", [&] { result["memory_bound"] = bench_memory_ops(cfg); });
  result["section_s"] = section_s;
  result["total_s"] = kvlab::bench::now_s() - t0;
  std::cout << "\ntotal " << fmt(result["total_s"].get<double>(), 1) << " s\n";
  if (!json_path.empty()) {
    if (!kvlab::bench::write_json(json_path, result)) return 1;
    std::cout << "wrote " << json_path << '\n';
  }
  return 0;
}
