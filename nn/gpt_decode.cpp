// GPT::forward's decode step on the CPU, fused. Op by op, a batch-1 step is ~45 parallel
// regions of a few microseconds each (matrix-vector products of 0.25-1 MB), and opening and
// closing them, plus the worker's wake-ups, cost as much as the products themselves: the same
// products in one region with a barrier between them ran 1.3-1.8x faster (docs/benchmarks.md).
// So here one parallel region runs the whole step. Every thread computes its own share of
// each product's output rows; the small row-wise work (LayerNorm) is done by every thread on
// its own copy, so that the only waits are the barriers where one stage needs another's
// complete output. The arithmetic is that of the op-by-op path, with the same CPU kernels in
// the same order; only the rows of each product are split differently between the threads
// (the tests bound the difference).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>

#include "autograd/backend/cpu/kernels.h"
#include "nn/gpt.h"

namespace kvlab {

namespace {

// Rows [lo, hi) of n for thread t of nt, in blocks of a multiple of 16 rows (the BLAS
// kernels' tile).
std::pair<int64_t, int64_t> thread_rows(int64_t n, int t, int nt) {
  const int64_t block = (n + 16 * nt - 1) / (16 * nt) * 16;
  const int64_t lo = std::min(n, t * block);
  return {lo, std::min(n, lo + block)};
}

// y[:, lo:hi] (B rows at stride ldy) = bias[lo:hi] + x (B, K) @ w[lo:hi]^T, in the order the
// linear op uses (bias first, then the product accumulated onto it). Called inside the
// parallel region: the BLAS runs single-threaded on these rows.
void linear_rows(float* y, int64_t ldy, const float* x, int64_t B, const Linear& lin, int64_t lo,
                 int64_t hi) {
  if (lo >= hi) return;
  const int64_t K = lin.weight.size(1);
  if (lin.bias.defined()) {
    const float* bias = lin.bias.data<float>();
    for (int64_t b = 0; b < B; ++b) std::copy(bias + lo, bias + hi, y + b * ldy + lo);
  }
  cpu::gemm<float>(false, true, B, hi - lo, K, 1.0f, x, K, lin.weight.data<float>() + lo * K, K,
                   lin.bias.defined() ? 1.0f : 0.0f, y + lo, ldy);
}

// x[:, lo:hi] += d[:, lo:hi], both (B, C): the residual connection on this thread's columns.
void add_rows(float* x, const float* d, int64_t B, int64_t C, int64_t lo, int64_t hi) {
  for (int64_t b = 0; b < B; ++b) {
    float* xb = x + b * C;
    const float* db = d + b * C;
#pragma omp simd
    for (int64_t j = lo; j < hi; ++j) xb[j] += db[j];
  }
}

void layer_norm(float* out, float* stats, const float* x, const LayerNorm& ln, int64_t B,
                int64_t C) {
  cpu::layernorm_forward<float>(out, stats, stats + B, x, ln.weight.data<float>(),
                                ln.bias.data<float>(), B, C, ln.eps);
}

}  // namespace

Tensor GPT::decode_step_cpu(const Tensor& tokens, const Tensor& pos, KVCache& cache) {
  const int64_t B = tokens.size(0), C = cfg_.n_embd, V = cfg_.vocab_size, H = cfg_.hidden();
  const int64_t NH = cfg_.n_head, NKV = cfg_.n_kv_head, HS = cfg_.head_size(), KVD = NKV * HS;
  const int32_t* ids = tokens.data<int32_t>();
  const int32_t* at = pos.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    KVLAB_CHECK(ids[b] >= 0 && ids[b] < V, "gpt: token id ", ids[b], " in row ", b,
                " is outside [0, ", V, ")");
  const int threads = omp_get_max_threads();
  Tensor x = Tensor::empty({B, C});                      // (B, C) the residual stream
  Tensor q = Tensor::empty({B, C});                      // (B, 1, NH, HS)
  Tensor k_new = Tensor::empty({B, 1, NKV, HS});         // this step's keys
  Tensor v_new = Tensor::empty({B, 1, NKV, HS});         // and values
  Tensor y = Tensor::empty({B, C});                      // (B, 1, NH, HS) attention out
  Tensor d = Tensor::empty({B, C});                      // (B, C) a block's update to x
  Tensor h = Tensor::empty({B, H});                      // (B, H) MLP hidden
  Tensor own = Tensor::empty({threads, B * C + 2 * B});  // per thread: LayerNorm out, stats
  Tensor logits = Tensor::empty({B, 1, V});              // (B, 1, V)
  const Tensor& head = lm_head_weight();
  // What the single appending thread hands the others: the cache's views of this layer.
  Tensor k_all, v_all;  // (B, NKV, S, HS)
  std::exception_ptr failure;
  const Shape kv_shape{B, NKV, 1, HS}, kv_strides{KVD, HS, KVD, 1};
  AttentionShape s{B, NH, NKV, 1, 0, HS, kv_lengths_.data(), 1.0 / std::sqrt(double(HS)), 0.0, 0};
  const HeadView qv{C, HS, C};  // q and y as (B, NH, 1, HS)

#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    float* xs = x.data<float>();
    float* ln = own.data<float>() + t * (B * C + 2 * B);  // (B, C), then mean and rstd (B)
    float* stats = ln + B * C;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * C; ++i) {
      const int64_t b = i / C, c = i % C;
      xs[i] = wte.weight.data<float>()[ids[b] * C + c] + wpe.weight.data<float>()[at[b] * C + c];
    }  // implicit barrier: x is complete
    for (size_t l = 0; l < blocks.size(); ++l) {
      const Block& blk = *blocks[l];
      const CausalSelfAttention& attn = blk.attn;
      layer_norm(ln, stats, xs, blk.ln_1, B, C);
      // q, k and v as one range of C + 2 KVD output rows, split between the threads.
      const auto [lo, hi] = thread_rows(C + 2 * KVD, t, nt);
      linear_rows(q.data<float>(), C, ln, B, attn.q_proj, lo, std::min(hi, C));
      linear_rows(k_new.data<float>(), KVD, ln, B, attn.k_proj, std::max<int64_t>(lo - C, 0),
                  std::clamp<int64_t>(hi - C, 0, KVD));
      linear_rows(v_new.data<float>(), KVD, ln, B, attn.v_proj, std::max<int64_t>(lo - C - KVD, 0),
                  std::clamp<int64_t>(hi - C - KVD, 0, KVD));
#pragma omp barrier
#pragma omp single
      {
        try {
          auto kv = cache.append(static_cast<int>(l), k_new.as_strided(kv_shape, kv_strides, 0),
                                 v_new.as_strided(kv_shape, kv_strides, 0));
          k_all = kv.first;
          v_all = kv.second;
          s.S = k_all.size(2);
        } catch (...) {
          failure = std::current_exception();
        }
      }                    // implicit barrier: the cache holds this step's keys and values
      if (failure) break;  // every thread sees the same flag after the barrier
      const HeadView kview{k_all.stride(0), k_all.stride(1), k_all.stride(2)};
      const HeadView vview{v_all.stride(0), v_all.stride(1), v_all.stride(2)};
      // With fewer KV groups than threads, each group's query heads are shared out too.
      const int64_t parts = std::clamp<int64_t>(nt / (B * NKV), 1, NH / NKV);
      for (int64_t task = t; task < B * NKV * parts; task += nt) {
        if (k_all.dtype() == DType::BF16)
          cpu::attention_decode_task<float, uint16_t>(
              y.data<float>(), qv, q.data<float>(), qv,
              static_cast<const uint16_t*>(k_all.raw_data()), kview,
              static_cast<const uint16_t*>(v_all.raw_data()), vview, s, task, parts);
        else
          cpu::attention_decode_task<float>(y.data<float>(), qv, q.data<float>(), qv,
                                            k_all.data<float>(), kview, v_all.data<float>(), vview,
                                            s, task, parts);
      }
#pragma omp barrier
      const auto [c0, c1] = thread_rows(C, t, nt);
      linear_rows(d.data<float>(), C, y.data<float>(), B, attn.c_proj, c0, c1);
      add_rows(xs, d.data<float>(), B, C, c0, c1);  // x += c_proj(y)
#pragma omp barrier
      layer_norm(ln, stats, xs, blk.ln_2, B, C);
      const auto [h0, h1] = thread_rows(H, t, nt);
      linear_rows(h.data<float>(), H, ln, B, blk.mlp.c_fc, h0, h1);
      for (int64_t b = 0; b < B && h0 < h1; ++b) {
        float* hb = h.data<float>() + b * H + h0;
        cpu::gelu_forward<float>(hb, hb, h1 - h0);
      }
#pragma omp barrier
      linear_rows(d.data<float>(), C, h.data<float>(), B, blk.mlp.c_proj, c0, c1);
      add_rows(xs, d.data<float>(), B, C, c0, c1);  // x += mlp(ln_2(x))
#pragma omp barrier
    }
    if (!failure) {
      layer_norm(ln, stats, xs, ln_f, B, C);
      const auto [v0, v1] = thread_rows(V, t, nt);
      if (v0 < v1)
        cpu::gemm<float>(false, true, B, v1 - v0, C, 1.0f, ln, C, head.data<float>() + v0 * C, C,
                         0.0f, logits.data<float>() + v0, V);
    }
  }
  if (failure) std::rethrow_exception(failure);
  return logits;
}

}  // namespace kvlab
