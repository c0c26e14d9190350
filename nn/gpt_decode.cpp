// GPT::forward's decode step on the CPU, fused. Op by op, a batch-1 step is ~45 parallel
// regions of a few microseconds each (matrix-vector products of 0.25-1 MB), and opening and
// closing them, plus the worker's wake-ups, cost as much as the products themselves: the same
// products in one region with a barrier between them ran 1.3-1.8x faster (docs/benchmarks.md).
// So here one parallel region runs the whole step. Every thread computes its own share of
// each product's output rows and writes its share of the new keys and values straight into
// the cache (KVCache::slots, taken before the region); the small row-wise work (LayerNorm) is
// done by every thread on its own copy, so that the only waits are the barriers where one
// stage needs another's complete output: four a layer when the KV groups share out evenly
// between the threads (a thread's q, k and v rows are then its groups', and it goes straight
// on to their attention), five otherwise (cpu::SpinBarrier: a seventh of libgomp's cost to
// cross). It calls the op path's CPU kernels in the op path's order (the bias before the
// product, as `linear` does); the products' rows, and with few KV groups a group's query
// heads, are split differently between the threads, which can change the rounding (the tests
// bound the difference).
//
// While a DecodePackGuard lives, the products read copies of the weights packed as one
// sequential stream each (cpu::pack_weight), once for all the batch's rows: faster than
// row-major weights at batch 1 and much faster than the BLAS at a few rows
// (docs/benchmarks.md). Engine::generate packs at the start of each call (1-2 ms for 20 MB),
// so weights changed between calls are always seen. A matrix whose values are all bf16
// (GPT::round_matrices_to_bf16) is packed in bf16, which batch-1 decode, bound by reading
// the weights, reads in half the bytes for the same results.
//
// This writes the block's forward a second time, for this one case; the op path (the modules'
// forward) stays the reference, and the tests compare the two at every step.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>

#include "autograd/backend/cpu/bf16.h"
#include "autograd/backend/cpu/kernels.h"
#include "autograd/backend/cpu/parallel.h"
#include "nn/gpt.h"

namespace kvlab {

namespace {

// A matrix packed in one of cpu::pack_weight's forms (f32, or bf16 values), or none.
struct PackRef {
  const void* data = nullptr;
  bool bf16 = false;
};

// A product's f32 weight (out, in), bias (out, or null) and, while packed, the packed weight,
// taken before the parallel region: nothing inside it may throw.
struct LinearRef {
  const float* w;
  const float* b;
  int64_t in;
  PackRef packed;
  LinearRef(const Tensor& weight, const Tensor* bias, PackRef pack)
      : w(weight.data<float>()),
        b(bias != nullptr && bias->defined() ? bias->data<float>() : nullptr),
        in(weight.size(1)),
        packed(pack) {}
  LinearRef(const Linear& l, PackRef pack) : LinearRef(l.weight, &l.bias, pack) {}
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
  BlockRef(const Block& b, const PackRef* pack) : BlockRef(b, block_linears(b), pack) {}

 private:
  BlockRef(const Block& b, const std::array<const Linear*, kPackedPerBlock>& l, const PackRef* p)
      : ln_1(b.ln_1),
        ln_2(b.ln_2),
        q(*l[0], p ? p[0] : PackRef{}),
        k(*l[1], p ? p[1] : PackRef{}),
        v(*l[2], p ? p[2] : PackRef{}),
        proj(*l[3], p ? p[3] : PackRef{}),
        fc(*l[4], p ? p[4] : PackRef{}),
        fc_proj(*l[5], p ? p[5] : PackRef{}) {}
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
  if (lin.packed.bf16)
    cpu::gemm_packed(y, ldy, x, lin.in, static_cast<const uint16_t*>(lin.packed.data), B, lin.in,
                     lo, hi, beta);
  else if (lin.packed.data != nullptr)
    cpu::gemm_packed(y, ldy, x, lin.in, static_cast<const float*>(lin.packed.data), B, lin.in, lo,
                     hi, beta);
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

// One layer's cache views for this step (cache.slots): host memory, f32 or bf16,
// (B, NKV, S, HS) with contiguous heads and room for every row's length (which counts this
// step's position), checked before the parallel region; the threads write their new keys and
// values straight into them.
struct CacheRef {
  Tensor k_view, v_view;  // held for the step
  void *k, *v;            // their data
  HeadView k_strides, v_strides;
  int64_t S;
  bool bf16;
  CacheRef(std::pair<Tensor, Tensor> views, int64_t B, int64_t NKV, int64_t HS,
           std::span<const int64_t> lengths)
      : k_view(std::move(views.first)), v_view(std::move(views.second)) {
    const Tensor &kt = k_view, &vt = v_view;
    const bool ok =
        kt.device() == Device::CPU && vt.device() == Device::CPU && kt.dtype() == vt.dtype() &&
        (kt.dtype() == DType::F32 || kt.dtype() == DType::BF16) && kt.dim() == 4 &&
        kt.sizes() == vt.sizes() && kt.size(0) == B && kt.size(1) == NKV && kt.size(3) == HS &&
        kt.stride(3) == 1 && vt.stride(3) == 1 &&
        std::all_of(lengths.begin(), lengths.end(), [&](int64_t n) { return n <= kt.size(2); });
    KVLAB_CHECK(ok, "gpt: the KV cache returned k ", kt.shape_str(), " ", dtype_name(kt.dtype()),
                " on ", device_name(kt.device()), ", v ", vt.shape_str(), " ",
                dtype_name(vt.dtype()),
                "; the CPU decode step writes and reads host f32 or bf16 (B, NKV, S, HS) views "
                "with contiguous heads");
    k = kt.raw_data();
    v = vt.raw_data();
    k_strides = {kt.stride(0), kt.stride(1), kt.stride(2)};
    v_strides = {vt.stride(0), vt.stride(1), vt.stride(2)};
    S = kt.size(2);
    bf16 = kt.dtype() == DType::BF16;
  }
  // fn(k, v) with the data as its elements: float, or uint16_t for bf16.
  template <class F>
  void typed(F&& fn) const {
    if (bf16)
      fn(static_cast<uint16_t*>(k), static_cast<uint16_t*>(v));
    else
      fn(static_cast<float*>(k), static_cast<float*>(v));
  }
};

// Elements [lo, hi) of each row's new keys (or values) src (B, NKV * HS) into the cache view
// dst at the row's last position (length - 1); a bf16 cache rounds them as append would.
template <class KV>
void store_new(KV* dst, HeadView view, const float* src, int64_t B, int64_t KVD, int64_t HS,
               const int64_t* lengths, int64_t lo, int64_t hi) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = lo; j < hi;) {  // a run of one head's elements at a time
      const int64_t head = j / HS, n = std::min(hi, (head + 1) * HS) - j;
      KV* out = dst + b * view.sb + head * view.sh + (lengths[b] - 1) * view.st + j % HS;
      const float* in = src + b * KVD + j;
      for (int64_t i = 0; i < n; ++i) {
        if constexpr (std::is_same_v<KV, float>)
          out[i] = in[i];
        else
          out[i] = cpu::f32_to_bf16(in[i]);
      }
      j += n;
    }
}

}  // namespace

// The step's pointers into the model: taking them costs ~2 us a step (some hundred calls into
// Tensor), so pack_for_decode takes them once for all the steps of a generation.
struct DecodeRefs {
  std::vector<BlockRef> layers;
  NormRef final_norm;
  LinearRef head;
};

namespace {
// pack: the packed matrices in GPT::decode_matrices's order, or null for none.
std::shared_ptr<const DecodeRefs> make_decode_refs(const GPT& m, const std::vector<PackRef>* pack) {
  KVLAB_ASSERT(!pack || pack->size() == m.blocks.size() * kPackedPerBlock + 1,
               "gpt: ", pack->size(), " packed weights for ", m.blocks.size(), " blocks");
  std::vector<BlockRef> layers;
  layers.reserve(m.blocks.size());
  for (size_t l = 0; l < m.blocks.size(); ++l)
    layers.emplace_back(*m.blocks[l], pack ? &(*pack)[l * kPackedPerBlock] : nullptr);
  return std::make_shared<const DecodeRefs>(
      DecodeRefs{std::move(layers), NormRef(m.ln_f),
                 LinearRef(m.lm_head_weight(), nullptr, pack ? pack->back() : PackRef{})});
}
}  // namespace

bool GPT::fused_decode_applies() const {
  return fused_cpu_decode && wte.weight.device() == Device::CPU && wte.weight.dtype() == DType::F32;
}

bool GPT::packing_applies() const {
  return fused_decode_applies() && cpu::packed_weight_size(1, 1) > 0;
}

std::vector<const Tensor*> GPT::decode_matrices() const {
  std::vector<const Tensor*> m;
  for (const auto& blk : blocks)
    for (const Linear* l : block_linears(*blk)) m.push_back(&l->weight);
  m.push_back(&lm_head_weight());
  return m;
}

DecodePackGuard GPT::pack_for_decode() {
  if (!packing_applies()) return {};
  const std::vector<const Tensor*> weights = decode_matrices();
  const auto count = static_cast<int64_t>(weights.size());
  std::vector<char> bf16(weights.size());  // which matrices take the bf16 form
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) {
    const Tensor& w = *weights[static_cast<size_t>(i)];
    bf16[static_cast<size_t>(i)] = cpu::all_bf16(w.data<float>(), w.numel());
  }
  // The buffer (reused while its size fits) and the weights' pointers are taken before the
  // parallel region: nothing inside it may throw. The matrices lie one after another in one
  // block, so that the step's stream of weights takes huge pages (cpu_raw_alloc).
  std::vector<int64_t> offset;  // of each matrix, in words
  int64_t words = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = *weights[i];
    offset.push_back(words);
    const int64_t n = bf16[i] ? (cpu::packed_weight_bf16_size(w.size(0), w.size(1)) + 1) / 2
                              : cpu::packed_weight_size(w.size(0), w.size(1));
    words += (n + 15) / 16 * 16;  // each matrix on a 64-byte line of its own
  }
  if (!decode_pack_.defined() || decode_pack_.numel() != words)
    decode_pack_ = Tensor::empty({words});
  float* buffer = decode_pack_.data<float>();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) {
    const Tensor& w = *weights[static_cast<size_t>(i)];
    float* p = buffer + offset[static_cast<size_t>(i)];
    if (bf16[static_cast<size_t>(i)])
      cpu::pack_weight(reinterpret_cast<uint16_t*>(p), w.data<float>(), w.size(0), w.size(1));
    else
      cpu::pack_weight(p, w.data<float>(), w.size(0), w.size(1));
  }
  std::vector<PackRef> pack;
  for (size_t i = 0; i < weights.size(); ++i) pack.push_back({buffer + offset[i], bf16[i] != 0});
  decode_refs_ = make_decode_refs(*this, &pack);
  ++decode_pack_users_;
  return DecodePackGuard(this);
}

void GPT::round_matrices_to_bf16() {
  for (const Tensor* m : decode_matrices()) {
    Tensor w = *m;  // a handle on the same storage
    w.copy_from(w.to(DType::BF16));
  }
}

int64_t GPT::decode_weight_bytes() const {
  const int64_t tables = wpe.weight.numel() + (lm_head ? wte.weight.numel() : 0);
  int64_t matrices = 0, bytes = 0;
  const bool packs = packing_applies();
  for (const Tensor* w : decode_matrices()) {
    const bool half = packs && cpu::all_bf16(w->data<float>(), w->numel());
    matrices += w->numel();
    bytes += w->numel() * (half ? 2 : 4);
  }
  return bytes + (num_parameters() - tables - matrices) * 4;
}

DecodePackGuard::~DecodePackGuard() {
  if (model_ != nullptr) --model_->decode_pack_users_;
}

Tensor GPT::decode_step_cpu(const Tensor& tokens, const Tensor& pos, KVCache& cache) {
  const int64_t B = tokens.size(0), C = cfg_.n_embd, V = cfg_.vocab_size, H = cfg_.hidden();
  const int64_t NH = cfg_.n_head, NKV = cfg_.n_kv_head, HS = cfg_.head_size(), KVD = NKV * HS;
  const int64_t G = NH / NKV;  // query heads per KV head
  const int32_t* ids = tokens.data<int32_t>();
  const int32_t* at = pos.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    KVLAB_CHECK(ids[b] >= 0 && ids[b] < V, "gpt: token id ", ids[b], " in row ", b,
                " is outside [0, ", V, ")");
  const bool packed = decode_pack_users_ > 0;
  const std::shared_ptr<const DecodeRefs> refs =
      packed ? decode_refs_ : make_decode_refs(*this, nullptr);
  const std::vector<BlockRef>& layers = refs->layers;
  const NormRef& final_norm = refs->final_norm;
  const LinearRef& head = refs->head;
  std::vector<CacheRef> caches;
  caches.reserve(blocks.size());
  for (size_t l = 0; l < blocks.size(); ++l)
    caches.emplace_back(cache.slots(static_cast<int>(l), 1), B, NKV, HS, kv_lengths_);
  const float* wte_w = wte.weight.data<float>();
  const float* wpe_w = wpe.weight.data<float>();
  const int threads = omp_get_max_threads();
  Tensor x = Tensor::empty({B, C});                      // (B, C) the residual stream
  Tensor q = Tensor::empty({B, C});                      // (B, 1, NH, HS)
  Tensor k_new = Tensor::empty({B, KVD});                // this step's keys
  Tensor v_new = Tensor::empty({B, KVD});                // and values
  Tensor y = Tensor::empty({B, C});                      // (B, 1, NH, HS) attention out
  Tensor d = Tensor::empty({B, C});                      // (B, C) a block's update to x
  Tensor h = Tensor::empty({B, H});                      // (B, H) MLP hidden
  Tensor own = Tensor::empty({threads, B * C + 2 * B});  // per thread: LayerNorm out, stats
  Tensor logits = Tensor::empty({B, 1, V});              // (B, 1, V)
  float *xs = x.data<float>(), *qs = q.data<float>(), *ks = k_new.data<float>();
  float *vs = v_new.data<float>(), *ys = y.data<float>(), *ds = d.data<float>();
  float *hs = h.data<float>(), *own_s = own.data<float>(), *out = logits.data<float>();
  const int64_t* lengths = kv_lengths_.data();  // each row's, this step's position included
  const AttentionShape s{B, NH, NKV, 1, 0, HS, lengths, 1.0 / std::sqrt(double(HS)), 0.0, 0};
  const HeadView qv{C, HS, C};  // q and y as (B, NH, 1, HS)
  // Per thread, the attention's work memory over the longest layer, so that nothing inside the
  // region allocates or throws; sized by the cache's capacity, so that step after step the
  // caching allocator hands back the same block.
  AttentionShape longest = s;
  longest.S = cache.capacity();
  bool any_bf16 = false;
  for (const CacheRef& c : caches) {
    longest.S = std::max(longest.S, c.S);
    any_bf16 = any_bf16 || c.bf16;
  }
  const int64_t work_size = any_bf16 ? cpu::attention_decode_work<float, uint16_t>(longest)
                                     : cpu::attention_decode_work<float>(longest);
  Tensor work = Tensor::empty({threads, work_size});
  float* work_s = work.data<float>();
  cpu::SpinBarrier barrier;

#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    float* ln = own_s + t * (B * C + 2 * B);  // (B, C), then mean and rstd (B)
    float* stats = ln + B * C;
    float* my_work = work_s + t * work_size;
    AttentionShape shape = s;                     // S set per layer
    const auto [c0, c1] = thread_rows(C, t, nt);  // this thread's columns of x
    // When the KV groups share out evenly, each thread computes the q, k and v rows of its
    // own groups and then their attention, with no barrier between. Otherwise the q, k and v
    // rows, one range of C + 2 KVD, are split evenly, and with fewer KV groups than threads a
    // group's query heads are shared out too.
    const bool own_groups = NKV % nt == 0;
    const int64_t g0 = NKV * t / nt, g1 = NKV * (t + 1) / nt;
    const auto [r0, r1] = thread_rows(C + 2 * KVD, t, nt);
    const int64_t q0 = own_groups ? g0 * G * HS : std::min(r0, C);
    const int64_t q1 = own_groups ? g1 * G * HS : std::min(r1, C);
    const int64_t k0 = own_groups ? g0 * HS : std::clamp<int64_t>(r0 - C, 0, KVD);
    const int64_t k1 = own_groups ? g1 * HS : std::clamp<int64_t>(r1 - C, 0, KVD);
    const int64_t v0 = own_groups ? k0 : std::clamp<int64_t>(r0 - C - KVD, 0, KVD);
    const int64_t v1 = own_groups ? k1 : std::clamp<int64_t>(r1 - C - KVD, 0, KVD);
    const int64_t parts = own_groups ? 1 : std::clamp<int64_t>(nt / (B * NKV), 1, G);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = c0; c < c1; ++c)
        xs[b * C + c] = wte_w[ids[b] * C + c] + wpe_w[at[b] * C + c];
#pragma omp single
    barrier.reset(nt);  // its implicit barrier also ends the embedding
    for (size_t l = 0; l < layers.size(); ++l) {
      const BlockRef& blk = layers[l];
      const CacheRef& kv = caches[l];
      layer_norm(ln, stats, xs, blk.ln_1, B, C);
      linear_rows(qs, C, ln, B, blk.q, q0, q1);
      linear_rows(ks, KVD, ln, B, blk.k, k0, k1);
      linear_rows(vs, KVD, ln, B, blk.v, v0, v1);
      shape.S = kv.S;
      kv.typed([&](auto* kd, auto* vd) {
        using KV = std::remove_pointer_t<decltype(kd)>;
        store_new(kd, kv.k_strides, ks, B, KVD, HS, lengths, k0, k1);
        store_new(vd, kv.v_strides, vs, B, KVD, HS, lengths, v0, v1);
        if (!own_groups) barrier.wait();
        auto task = [&](int64_t i) {
          cpu::attention_decode_task<float, KV>(ys, qv, qs, qv, kd, kv.k_strides, vd, kv.v_strides,
                                                shape, i, parts, my_work);
        };
        if (own_groups)
          for (int64_t b = 0; b < B; ++b)
            for (int64_t g = g0; g < g1; ++g) task(b * NKV + g);
        else
          for (int64_t i = t; i < B * NKV * parts; i += nt) task(i);
      });
      barrier.wait();
      linear_rows(ds, C, ys, B, blk.proj, c0, c1);
      add_rows(xs, ds, B, C, c0, c1);  // x += c_proj(y)
      barrier.wait();
      layer_norm(ln, stats, xs, blk.ln_2, B, C);
      const auto [h0, h1] = thread_rows(H, t, nt);
      linear_rows(hs, H, ln, B, blk.fc, h0, h1);
      for (int64_t b = 0; b < B && h0 < h1; ++b)
        cpu::gelu_forward<float>(hs + b * H + h0, hs + b * H + h0, h1 - h0);
      barrier.wait();
      linear_rows(ds, C, hs, B, blk.fc_proj, c0, c1);
      add_rows(xs, ds, B, C, c0, c1);  // x += mlp(ln_2(x))
      barrier.wait();
    }
    layer_norm(ln, stats, xs, final_norm, B, C);
    const auto [o0, o1] = thread_rows(V, t, nt);
    linear_rows(out, V, ln, B, head, o0, o1);
  }
  return logits;
}

}  // namespace kvlab
