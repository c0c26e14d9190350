// GPT::forward's decode step on the CPU, fused. Op by op, a batch-1 step is ~45 parallel
// regions of a few microseconds each (matrix-vector products of 0.25-1 MB), and opening and
// closing them, plus the worker's wake-ups, cost as much as the products themselves: the same
// products in one region with a barrier between them ran 1.3-1.8x faster (docs/benchmarks.md).
// So here one parallel region runs the whole step. Every thread computes its own share of
// each product's output rows; the small row-wise work (LayerNorm) is done by every thread on
// its own copy, so that the only waits are the barriers where one stage needs another's
// complete output. It calls the op path's CPU kernels in the op path's order (the bias
// before the product, as `linear` does); the products' rows, and with few KV groups a
// group's query heads, are split differently between the threads, which can change the
// rounding (the tests bound the difference).
//
// While a DecodePackGuard lives, the products read copies of the weights packed as one
// sequential stream each (cpu::pack_weight), once for all the batch's rows: faster than
// row-major weights at batch 1 and much faster than the BLAS at a few rows
// (docs/benchmarks.md). Engine::generate packs at the start of each call (1-2 ms for 20 MB),
// so weights changed between calls are always seen.
//
// This writes the block's forward a second time, for this one case; the op path (the modules'
// forward) stays the reference, and the tests compare the two at every step.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <span>

#include "autograd/backend/cpu/kernels.h"
#include "autograd/backend/cpu/parallel.h"
#include "nn/gpt.h"

namespace kvlab {

namespace {

// A product's f32 weight (out, in), bias (out, or null) and, while packed, the weight in
// cpu::pack_weight's form, taken before the parallel region: nothing inside it may throw.
struct LinearRef {
  const float* w;
  const float* b;
  int64_t in;
  const float* packed;
  LinearRef(const Tensor& weight, const Tensor* bias, const Tensor* pack)
      : w(weight.data<float>()),
        b(bias != nullptr && bias->defined() ? bias->data<float>() : nullptr),
        in(weight.size(1)),
        packed(pack != nullptr ? pack->data<float>() : nullptr) {}
  LinearRef(const Linear& l, const Tensor* pack) : LinearRef(l.weight, &l.bias, pack) {}
};

struct NormRef {
  const float* w;
  const float* b;
  double eps;
  explicit NormRef(const LayerNorm& n)
      : w(n.weight.data<float>()), b(n.bias.data<float>()), eps(n.eps) {}
};

// The block's six matrices in decode_pack_'s order.
constexpr size_t kPackedPerBlock = 6;
std::array<const Linear*, kPackedPerBlock> block_linears(const Block& b) {
  return {&b.attn.q_proj, &b.attn.k_proj, &b.attn.v_proj,
          &b.attn.c_proj, &b.mlp.c_fc,    &b.mlp.c_proj};
}

// pack: the block's kPackedPerBlock packed weights in block_linears's order, or null.
struct BlockRef {
  NormRef ln_1, ln_2;
  LinearRef q, k, v, proj, fc, fc_proj;
  BlockRef(const Block& b, const Tensor* pack)
      : BlockRef(b, block_linears(b), [pack](size_t i) { return pack ? pack + i : nullptr; }) {}

 private:
  template <class PackOf>
  BlockRef(const Block& b, const std::array<const Linear*, kPackedPerBlock>& l, PackOf pack_of)
      : ln_1(b.ln_1),
        ln_2(b.ln_2),
        q(*l[0], pack_of(0)),
        k(*l[1], pack_of(1)),
        v(*l[2], pack_of(2)),
        proj(*l[3], pack_of(3)),
        fc(*l[4], pack_of(4)),
        fc_proj(*l[5], pack_of(5)) {}
};

// This thread's rows [lo, hi) of n, in blocks of a multiple of 16 (the BLAS kernels' tile).
std::pair<int64_t, int64_t> thread_rows(int64_t n, int t, int nt) {
  return cpu::split_range(n, t, nt, 16);
}

// y[:, lo:hi] (B rows at stride ldy) = bias[lo:hi] + x (B, in) @ w[lo:hi]^T, in the order the
// linear op uses (bias first, then the product accumulated onto it). Called inside the
// parallel region: the BLAS runs single-threaded on these rows.
void linear_rows(float* y, int64_t ldy, const float* x, int64_t B, const LinearRef& lin, int64_t lo,
                 int64_t hi) {
  if (lo >= hi) return;
  if (lin.b != nullptr)
    for (int64_t b = 0; b < B; ++b) std::copy(lin.b + lo, lin.b + hi, y + b * ldy + lo);
  const float beta = lin.b != nullptr ? 1.0f : 0.0f;
  if (lin.packed != nullptr)
    cpu::gemm_packed(y, ldy, x, lin.in, lin.packed, B, lin.in, lo, hi, beta);
  else
    cpu::gemm<float>(false, true, B, hi - lo, lin.in, 1.0f, x, lin.in, lin.w + lo * lin.in, lin.in,
                     beta, y + lo, ldy);
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

void layer_norm(float* out, float* stats, const float* x, const NormRef& ln, int64_t B, int64_t C) {
  cpu::layernorm_forward<float>(out, stats, stats + B, x, ln.w, ln.b, B, C, ln.eps);
}

// The cache's views of one layer must be what the attention kernel reads: host memory, f32
// or bf16, (B, NKV, S, HS) with contiguous heads and room for every row's length.
void check_cache_views(const Tensor& k, const Tensor& v, int64_t B, int64_t NKV, int64_t HS,
                       std::span<const int64_t> lengths) {
  const bool ok =
      k.device() == Device::CPU && v.device() == Device::CPU && k.dtype() == v.dtype() &&
      (k.dtype() == DType::F32 || k.dtype() == DType::BF16) && k.dim() == 4 &&
      k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == NKV && k.size(3) == HS &&
      k.stride(3) == 1 && v.stride(3) == 1 &&
      std::all_of(lengths.begin(), lengths.end(), [&](int64_t n) { return n <= k.size(2); });
  KVLAB_CHECK(ok, "gpt: the KV cache returned k ", k.shape_str(), " ", dtype_name(k.dtype()),
              " on ", device_name(k.device()), ", v ", v.shape_str(), " ", dtype_name(v.dtype()),
              "; the CPU decode step reads host f32 or bf16 (B, NKV, S, HS) views with "
              "contiguous heads");
}

}  // namespace

bool GPT::fused_decode_applies() const {
  return fused_cpu_decode && wte.weight.device() == Device::CPU && wte.weight.dtype() == DType::F32;
}

DecodePackGuard GPT::pack_for_decode() {
  if (!fused_decode_applies() || cpu::packed_weight_size(1, 1) == 0) return {};
  std::vector<const Tensor*> weights;  // in decode_pack_'s order
  for (const auto& blk : blocks)
    for (const Linear* l : block_linears(*blk)) weights.push_back(&l->weight);
  weights.push_back(&lm_head_weight());
  // Buffers (reused while the sizes fit) and the weights' pointers are taken before the
  // parallel region: nothing inside it may throw.
  struct Job {
    float* packed;
    const float* w;
    int64_t N, K;
  };
  std::vector<Job> jobs;
  decode_pack_.resize(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = *weights[i];
    const int64_t n = cpu::packed_weight_size(w.size(0), w.size(1));
    if (!decode_pack_[i].defined() || decode_pack_[i].numel() != n)
      decode_pack_[i] = Tensor::empty({n});
    jobs.push_back({decode_pack_[i].data<float>(), w.data<float>(), w.size(0), w.size(1)});
  }
  const int64_t count = static_cast<int64_t>(jobs.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) {
    const Job& j = jobs[static_cast<size_t>(i)];
    cpu::pack_weight(j.packed, j.w, j.N, j.K);
  }
  ++decode_pack_users_;
  return DecodePackGuard(this);
}

DecodePackGuard::~DecodePackGuard() {
  if (model_ != nullptr) --model_->decode_pack_users_;
}

Tensor GPT::decode_step_cpu(const Tensor& tokens, const Tensor& pos, KVCache& cache) {
  const int64_t B = tokens.size(0), C = cfg_.n_embd, V = cfg_.vocab_size, H = cfg_.hidden();
  const int64_t NH = cfg_.n_head, NKV = cfg_.n_kv_head, HS = cfg_.head_size(), KVD = NKV * HS;
  const int32_t* ids = tokens.data<int32_t>();
  const int32_t* at = pos.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    KVLAB_CHECK(ids[b] >= 0 && ids[b] < V, "gpt: token id ", ids[b], " in row ", b,
                " is outside [0, ", V, ")");
  const bool packed = decode_pack_users_ > 0;
  KVLAB_ASSERT(!packed || decode_pack_.size() == blocks.size() * kPackedPerBlock + 1,
               "gpt: ", decode_pack_.size(), " packed weights for ", blocks.size(), " blocks");
  std::vector<BlockRef> layers;
  layers.reserve(blocks.size());
  for (size_t l = 0; l < blocks.size(); ++l)
    layers.emplace_back(*blocks[l], packed ? &decode_pack_[l * kPackedPerBlock] : nullptr);
  const NormRef final_norm(ln_f);
  const float* wte_w = wte.weight.data<float>();
  const float* wpe_w = wpe.weight.data<float>();
  const LinearRef head(lm_head_weight(), nullptr, packed ? &decode_pack_.back() : nullptr);
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
  float *xs = x.data<float>(), *qs = q.data<float>(), *ks = k_new.data<float>();
  float *vs = v_new.data<float>(), *ys = y.data<float>(), *ds = d.data<float>();
  float *hs = h.data<float>(), *own_s = own.data<float>(), *out = logits.data<float>();
  // What the appending thread hands the others: the cache's views of this layer.
  Tensor k_all, v_all;  // (B, NKV, S, HS)
  std::exception_ptr failure;
  const Shape kv_shape{B, NKV, 1, HS}, kv_strides{KVD, HS, KVD, 1};
  AttentionShape s{B, NH, NKV, 1, 0, HS, kv_lengths_.data(), 1.0 / std::sqrt(double(HS)), 0.0, 0};
  const HeadView qv{C, HS, C};  // q and y as (B, NH, 1, HS)

  // Inside the region only the cache append and the attention scratch can throw; their
  // errors are carried out of it, every thread leaving the layer loop at the same barrier.
#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    float* ln = own_s + t * (B * C + 2 * B);  // (B, C), then mean and rstd (B)
    float* stats = ln + B * C;
    const auto [c0, c1] = thread_rows(C, t, nt);  // this thread's columns of x
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = c0; c < c1; ++c)
        xs[b * C + c] = wte_w[ids[b] * C + c] + wpe_w[at[b] * C + c];
#pragma omp barrier
    for (size_t l = 0; l < layers.size(); ++l) {
      const BlockRef& blk = layers[l];
      layer_norm(ln, stats, xs, blk.ln_1, B, C);
      // q, k and v as one range of C + 2 KVD output rows, split between the threads.
      const auto [lo, hi] = thread_rows(C + 2 * KVD, t, nt);
      linear_rows(qs, C, ln, B, blk.q, lo, std::min(hi, C));
      linear_rows(ks, KVD, ln, B, blk.k, std::max<int64_t>(lo - C, 0),
                  std::clamp<int64_t>(hi - C, 0, KVD));
      linear_rows(vs, KVD, ln, B, blk.v, std::max<int64_t>(lo - C - KVD, 0),
                  std::clamp<int64_t>(hi - C - KVD, 0, KVD));
#pragma omp barrier
#pragma omp single
      {
        try {
          auto kv = cache.append(static_cast<int>(l), k_new.as_strided(kv_shape, kv_strides, 0),
                                 v_new.as_strided(kv_shape, kv_strides, 0));
          check_cache_views(kv.first, kv.second, B, NKV, HS, kv_lengths_);
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
      const bool bf16 = k_all.dtype() == DType::BF16;
      // With fewer KV groups than threads, each group's query heads are shared out too.
      const int64_t parts = std::clamp<int64_t>(nt / (B * NKV), 1, NH / NKV);
      try {  // the kernel grows its per-thread scratch to the cache's length: it may not fit
        for (int64_t task = t; task < B * NKV * parts; task += nt) {
          if (bf16)
            cpu::attention_decode_task<float, uint16_t>(
                ys, qv, qs, qv, static_cast<const uint16_t*>(k_all.raw_data()), kview,
                static_cast<const uint16_t*>(v_all.raw_data()), vview, s, task, parts);
          else
            cpu::attention_decode_task<float>(
                ys, qv, qs, qv, static_cast<const float*>(k_all.raw_data()), kview,
                static_cast<const float*>(v_all.raw_data()), vview, s, task, parts);
        }
      } catch (...) {
#pragma omp critical(kvlab_decode_failure)
        if (!failure) failure = std::current_exception();
      }
#pragma omp barrier
      if (failure) break;  // as above: every thread sees the same flag after the barrier
      linear_rows(ds, C, ys, B, blk.proj, c0, c1);
      add_rows(xs, ds, B, C, c0, c1);  // x += c_proj(y)
#pragma omp barrier
      layer_norm(ln, stats, xs, blk.ln_2, B, C);
      const auto [h0, h1] = thread_rows(H, t, nt);
      linear_rows(hs, H, ln, B, blk.fc, h0, h1);
      for (int64_t b = 0; b < B && h0 < h1; ++b)
        cpu::gelu_forward<float>(hs + b * H + h0, hs + b * H + h0, h1 - h0);
#pragma omp barrier
      linear_rows(ds, C, hs, B, blk.fc_proj, c0, c1);
      add_rows(xs, ds, B, C, c0, c1);  // x += mlp(ln_2(x))
#pragma omp barrier
    }
    if (!failure) {
      layer_norm(ln, stats, xs, final_norm, B, C);
      const auto [v0, v1] = thread_rows(V, t, nt);
      linear_rows(out, V, ln, B, head, v0, v1);
    }
  }
  if (failure) std::rethrow_exception(failure);
  return logits;
}

}  // namespace kvlab
