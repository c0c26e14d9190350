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
// (docs/benchmarks.md). Each thread's rows of each matrix are packed on their own, and one
// thread's parts lie one after another in the order the step reads them, so that each thread
// reads one stream from the first layer to the LM head: its prefetchers do not start afresh
// at every product (a pass over the weights of 6L/8H/256 with the step's barriers took
// 0.93-0.97 of the time it takes matrix after matrix; batch-1 decode, medians of 6
// alternations, 0.99-1.05x at n_kv_head 8 to 1, docs/benchmarks.md). Engine::generate packs
// at the start of each call (1-2 ms for 20 MB), so weights changed between calls are always
// seen. A matrix whose values are all bf16 (GPT::round_matrices_to_bf16) is packed in bf16,
// which batch-1 decode, bound by reading the weights, reads in half the bytes for the same
// results.
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

// Rows of a matrix packed in one of cpu::pack_weight's forms (f32, or bf16 values), or none.
struct PackRef {
  const void* data = nullptr;
  bool bf16 = false;
};

// A product's f32 weight (out, in), bias (out, or null) and, while packed, each thread's
// rows of the weight (StepRows) packed on their own, a PackRef per thread (else null);
// taken before the parallel region: nothing inside it may throw.
struct LinearRef {
  const float* w;
  const float* b;
  int64_t in;
  const PackRef* parts;
  LinearRef(const Tensor& weight, const Tensor* bias, const PackRef* parts)
      : w(weight.data<float>()),
        b(bias != nullptr && bias->defined() ? bias->data<float>() : nullptr),
        in(weight.size(1)),
        parts(parts) {}
  LinearRef(const Linear& l, const PackRef* parts) : LinearRef(l.weight, &l.bias, parts) {}
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

// parts: the parts of the block's kPackedPerBlock matrices in block_linears's order, `threads`
// a matrix, or null.
struct BlockRef {
  NormRef ln_1, ln_2;
  LinearRef q, k, v, proj, fc, fc_proj;
  BlockRef(const Block& b, const PackRef* parts, int threads)
      : BlockRef(b, block_linears(b), parts, threads) {}

 private:
  BlockRef(const Block& b, const std::array<const Linear*, kPackedPerBlock>& l, const PackRef* p,
           int n)
      : ln_1(b.ln_1),
        ln_2(b.ln_2),
        q(*l[0], p),
        k(*l[1], p ? p + n : nullptr),
        v(*l[2], p ? p + 2 * n : nullptr),
        proj(*l[3], p ? p + 3 * n : nullptr),
        fc(*l[4], p ? p + 4 * n : nullptr),
        fc_proj(*l[5], p ? p + 5 * n : nullptr) {}
};

// n f32 words rounded up to whole 64-byte lines: each packed part and each of the step's
// buffers starts on a line of its own.
int64_t whole_lines(int64_t n) { return (n + 15) / 16 * 16; }

// This thread's rows [lo, hi) of n, in blocks of a multiple of 16 (the BLAS kernels' tile).
std::pair<int64_t, int64_t> thread_rows(int64_t n, int t, int nt) {
  return cpu::split_range(n, t, nt, 16);
}

// Thread t's rows of each of the step's products, of nt threads. When the KV groups share out
// evenly (own_groups), each thread computes the q, k and v rows of its own groups and then
// their attention, with no barrier between. Otherwise the q, k and v rows, one range of
// C + 2 KVD, are split evenly.
struct StepRows {
  bool own_groups;
  int64_t g0, g1;  // the KV groups whose attention this thread computes, when own_groups
  std::pair<int64_t, int64_t> q, k, v;
  std::pair<int64_t, int64_t> c;  // of the attention's and the MLP's output projections
  std::pair<int64_t, int64_t> h;  // of the MLP's c_fc
  std::pair<int64_t, int64_t> o;  // of the LM head
  StepRows(const GPTConfig& cfg, int t, int nt) {
    const int64_t C = cfg.n_embd, NKV = cfg.n_kv_head, HS = cfg.head_size(), KVD = NKV * HS;
    const int64_t G = cfg.n_head / NKV;
    own_groups = NKV % nt == 0;
    g0 = NKV * t / nt;
    g1 = NKV * (t + 1) / nt;
    const auto [r0, r1] = thread_rows(C + 2 * KVD, t, nt);
    if (own_groups) {
      q = {g0 * G * HS, g1 * G * HS};
      k = v = {g0 * HS, g1 * HS};
    } else {
      q = {std::min(r0, C), std::min(r1, C)};
      k = {std::clamp<int64_t>(r0 - C, 0, KVD), std::clamp<int64_t>(r1 - C, 0, KVD)};
      v = {std::clamp<int64_t>(r0 - C - KVD, 0, KVD), std::clamp<int64_t>(r1 - C - KVD, 0, KVD)};
    }
    c = thread_rows(C, t, nt);
    h = thread_rows(cfg.hidden(), t, nt);
    o = thread_rows(cfg.vocab_size, t, nt);
  }
  // The rows of matrix i of GPT::decode_matrices (the last one the LM head).
  std::pair<int64_t, int64_t> of_matrix(size_t i, size_t count) const {
    if (i + 1 == count) return o;
    const std::array<std::pair<int64_t, int64_t>, kPackedPerBlock> block{q, k, v, c, h, c};
    return block[i % kPackedPerBlock];
  }
};

// y[:, lo:hi] (B rows at stride ldy) = bias[lo:hi] + x (B, in) @ w[lo:hi]^T, in the order the
// linear op uses (bias first, then the product accumulated onto it), reading `part` (the rows
// [lo, hi) of w packed on their own) where given. Called inside the parallel region: the BLAS
// runs single-threaded on these rows.
void linear_rows(float* y, int64_t ldy, const float* x, int64_t B, const LinearRef& lin, int64_t lo,
                 int64_t hi, const PackRef* part) {
  if (lo >= hi) return;
  if (lin.b != nullptr)
    for (int64_t b = 0; b < B; ++b) std::copy(lin.b + lo, lin.b + hi, y + b * ldy + lo);
  const float beta = lin.b != nullptr ? 1.0f : 0.0f;
  if (part != nullptr && part->bf16)
    cpu::gemm_packed(y + lo, ldy, x, lin.in, static_cast<const uint16_t*>(part->data), B, lin.in, 0,
                     hi - lo, beta);
  else if (part != nullptr)
    cpu::gemm_packed(y + lo, ldy, x, lin.in, static_cast<const float*>(part->data), B, lin.in, 0,
                     hi - lo, beta);
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

// One layer's cache views for this step (cache.slot_views): host memory, f32 or bf16,
// (B, NKV, S, HS) with contiguous heads and room for every row's length (which counts this
// step's position), checked before the parallel region; the threads write their new keys and
// values straight into them.
struct CacheRef {
  SlotView k_view, v_view;  // held for the step
  HeadView k_strides, v_strides;
  int64_t S;
  bool bf16;
  CacheRef(std::pair<SlotView, SlotView> views, int64_t B, int64_t NKV, int64_t HS,
           std::span<const int64_t> lengths)
      : k_view(std::move(views.first)), v_view(std::move(views.second)) {
    const SlotView &kt = k_view, &vt = v_view;
    const bool ok =
        kt.device == Device::CPU && vt.device == Device::CPU && kt.dtype == vt.dtype &&
        (kt.dtype == DType::F32 || kt.dtype == DType::BF16) && kt.dim == 4 && vt.dim == 4 &&
        kt.sizes == vt.sizes && kt.sizes[0] == B && kt.sizes[1] == NKV && kt.sizes[3] == HS &&
        kt.strides[3] == 1 && vt.strides[3] == 1 &&
        std::all_of(lengths.begin(), lengths.end(), [&](int64_t n) { return n <= kt.sizes[2]; });
    auto shape = [](const SlotView& s) {
      return shape_str(Shape(s.sizes.begin(), s.sizes.begin() + std::min<int64_t>(s.dim, 4)));
    };
    KVLAB_CHECK(ok, "gpt: the KV cache returned k ", shape(kt), " ", dtype_name(kt.dtype), " on ",
                device_name(kt.device), ", v ", shape(vt), " ", dtype_name(vt.dtype),
                "; the CPU decode step writes and reads host f32 or bf16 (B, NKV, S, HS) views "
                "with contiguous heads");
    k_strides = {kt.strides[0], kt.strides[1], kt.strides[2]};
    v_strides = {vt.strides[0], vt.strides[1], vt.strides[2]};
    S = kt.sizes[2];
    bf16 = kt.dtype == DType::BF16;
  }
  // fn(k, v) with the data as its elements: float, or uint16_t for bf16.
  template <class F>
  void typed(F&& fn) const {
    if (bf16)
      fn(static_cast<uint16_t*>(k_view.data), static_cast<uint16_t*>(v_view.data));
    else
      fn(static_cast<float*>(k_view.data), static_cast<float*>(v_view.data));
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
// Tensor), so pack_for_decode takes them once for all the steps of a generation. parts: the
// packed parts of the matrices of GPT::decode_matrices, `threads` a matrix (thread t's rows,
// StepRows, at t), or none (threads 0); a step on another number of threads reads the
// row-major weights.
struct DecodeRefs {
  const std::vector<PackRef> parts;
  const int threads;
  std::vector<BlockRef> layers;
  NormRef final_norm;
  LinearRef head;
  DecodeRefs(const GPT& m, std::vector<PackRef> packed, int packed_threads)
      : parts(std::move(packed)),
        threads(packed_threads),
        final_norm(m.ln_f),
        head(m.lm_head_weight(), nullptr, part(m.blocks.size() * kPackedPerBlock)) {
    KVLAB_ASSERT(
        parts.size() == (m.blocks.size() * kPackedPerBlock + 1) * static_cast<size_t>(threads),
        "gpt: ", parts.size(), " packed parts for ", m.blocks.size(), " blocks and ", threads,
        " threads");
    layers.reserve(m.blocks.size());
    for (size_t l = 0; l < m.blocks.size(); ++l)
      layers.emplace_back(*m.blocks[l], part(l * kPackedPerBlock), threads);
  }

 private:
  const PackRef* part(size_t matrix) const {  // matrix's first part, or null
    return parts.empty() ? nullptr : &parts[matrix * static_cast<size_t>(threads)];
  }
};

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
  // parallel region: nothing inside it may throw. All the parts lie in one block, so that the
  // step's streams of weights take huge pages (cpu_raw_alloc): thread t's parts of every
  // matrix in the order the step reads them, then thread t + 1's.
  const int threads = omp_get_max_threads();
  const size_t parts = weights.size() * static_cast<size_t>(threads);
  std::vector<int64_t> offset(parts);  // of matrix i's part t at i * threads + t, in words
  std::vector<std::pair<int64_t, int64_t>> rows(parts);
  int64_t words = 0;
  for (int t = 0; t < threads; ++t) {
    const StepRows step(cfg_, t, threads);
    for (size_t i = 0; i < weights.size(); ++i) {
      const size_t at = i * static_cast<size_t>(threads) + static_cast<size_t>(t);
      rows[at] = step.of_matrix(i, weights.size());
      const int64_t n = rows[at].second - rows[at].first, k = weights[i]->size(1);
      if (n <= 0) continue;
      offset[at] = words;
      const int64_t size =
          bf16[i] ? (cpu::packed_weight_bf16_size(n, k) + 1) / 2 : cpu::packed_weight_size(n, k);
      words += whole_lines(size);
    }
  }
  if (!decode_pack_.defined() || decode_pack_.numel() != words)
    decode_pack_ = Tensor::empty({words});
  float* buffer = decode_pack_.data<float>();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t j = 0; j < static_cast<int64_t>(parts); ++j) {
    const size_t at = static_cast<size_t>(j), i = at / static_cast<size_t>(threads);
    const auto [lo, hi] = rows[at];
    if (lo >= hi) continue;
    const Tensor& w = *weights[i];
    const float* src = w.data<float>() + lo * w.size(1);
    float* p = buffer + offset[at];
    if (bf16[i])
      cpu::pack_weight(reinterpret_cast<uint16_t*>(p), src, hi - lo, w.size(1));
    else
      cpu::pack_weight(p, src, hi - lo, w.size(1));
  }
  std::vector<PackRef> pack(parts);
  for (size_t at = 0; at < parts; ++at)
    if (rows[at].first < rows[at].second)
      pack[at] = {buffer + offset[at], bf16[at / static_cast<size_t>(threads)] != 0};
  decode_refs_ = std::make_shared<const DecodeRefs>(*this, std::move(pack), threads);
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
      packed ? decode_refs_ : std::make_shared<const DecodeRefs>(*this, std::vector<PackRef>(), 0);
  const std::vector<BlockRef>& layers = refs->layers;
  const NormRef& final_norm = refs->final_norm;
  const LinearRef& head = refs->head;
  std::vector<CacheRef> caches;
  caches.reserve(blocks.size());
  for (size_t l = 0; l < blocks.size(); ++l)
    caches.emplace_back(cache.slot_views(static_cast<int>(l), 1), B, NKV, HS, kv_lengths_);
  const float* wte_w = wte.weight.data<float>();
  const float* wpe_w = wpe.weight.data<float>();
  const int threads = omp_get_max_threads();
  Tensor logits = Tensor::empty({B, 1, V});  // (B, 1, V)
  float* out = logits.data<float>();
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
  // The step's buffers, carved from one block, each on 64-byte lines of its own (eleven tensors
  // a step cost ~1 us to make and free): the residual stream x (B, C), q (B, 1, NH, HS), this
  // step's keys and values (B, KVD), the attention's output y (B, 1, NH, HS), a block's update
  // d to x (B, C), the MLP's hidden h (B, H), and per thread its LayerNorm output and stats
  // (own_size) and the attention's work memory.
  const int64_t own_size = B * C + 2 * B;
  const std::array<int64_t, 9> sizes{
      B * C, B * C, B * KVD, B * KVD, B * C, B * C, B * H, threads * own_size, threads * work_size};
  int64_t words = 0;
  for (int64_t n : sizes) words += whole_lines(n);
  Tensor step_buffer = Tensor::empty({words});
  std::array<float*, sizes.size()> buf{};
  float* next = step_buffer.data<float>();
  for (size_t i = 0; i < sizes.size(); ++i) {
    buf[i] = next;
    next += whole_lines(sizes[i]);
  }
  const auto [xs, qs, ks, vs, ys, ds, hs, own_s, work_s] = buf;
  cpu::SpinBarrier barrier;

#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    float* ln = own_s + t * own_size;  // (B, C), then mean and rstd (B)
    float* stats = ln + B * C;
    float* my_work = work_s + t * work_size;
    AttentionShape shape = s;                     // S set per layer
    const StepRows rows(cfg_, t, nt);
    const auto [c0, c1] = rows.c;  // also this thread's columns of x
    const auto [q0, q1] = rows.q;
    const auto [k0, k1] = rows.k;
    const auto [v0, v1] = rows.v;
    const auto [h0, h1] = rows.h;
    const int64_t g0 = rows.g0, g1 = rows.g1;
    const bool own_groups = rows.own_groups;
    // Without own groups, with fewer KV groups than threads a group's query heads are shared
    // out too.
    const int64_t parts = own_groups ? 1 : std::clamp<int64_t>(nt / (B * NKV), 1, G);
    // This thread's part of a packed matrix, where the packing was for nt threads.
    const bool packed_for_nt = refs->threads == nt;
    auto part = [&](const LinearRef& lin) { return packed_for_nt ? lin.parts + t : nullptr; };
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = c0; c < c1; ++c)
        xs[b * C + c] = wte_w[ids[b] * C + c] + wpe_w[at[b] * C + c];
#pragma omp single
    barrier.reset(nt);  // its implicit barrier also ends the embedding
    for (size_t l = 0; l < layers.size(); ++l) {
      const BlockRef& blk = layers[l];
      const CacheRef& kv = caches[l];
      layer_norm(ln, stats, xs, blk.ln_1, B, C);
      linear_rows(qs, C, ln, B, blk.q, q0, q1, part(blk.q));
      linear_rows(ks, KVD, ln, B, blk.k, k0, k1, part(blk.k));
      linear_rows(vs, KVD, ln, B, blk.v, v0, v1, part(blk.v));
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
      linear_rows(ds, C, ys, B, blk.proj, c0, c1, part(blk.proj));
      add_rows(xs, ds, B, C, c0, c1);  // x += c_proj(y)
      barrier.wait();
      layer_norm(ln, stats, xs, blk.ln_2, B, C);
      linear_rows(hs, H, ln, B, blk.fc, h0, h1, part(blk.fc));
      for (int64_t b = 0; b < B && h0 < h1; ++b)
        cpu::gelu_forward<float>(hs + b * H + h0, hs + b * H + h0, h1 - h0);
      barrier.wait();
      linear_rows(ds, C, hs, B, blk.fc_proj, c0, c1, part(blk.fc_proj));
      add_rows(xs, ds, B, C, c0, c1);  // x += mlp(ln_2(x))
      barrier.wait();
    }
    layer_norm(ln, stats, xs, final_norm, B, C);
    linear_rows(out, V, ln, B, head, rows.o.first, rows.o.second, part(head));
  }
  return logits;
}

}  // namespace kvlab
