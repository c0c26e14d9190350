// DecodeStep: the Engine's decode step on the CPU, fused. Op by op (GPT::forward), a batch-1 step
// opens dozens of parallel regions of a few microseconds each (matrix-vector products under a
// megabyte), and opening and closing them, plus the workers' wake-ups, cost as much as the products
// themselves; the same products in one region with a barrier between them ran faster
// (docs/bench-log/code-figures.md). So here one parallel region runs the whole step. Every thread
// computes its own share of each product's output rows and writes its share of the new keys and
// values straight into the cache (DecodeKVCache::layer_rows, taken before the region); the small
// row-wise work (LayerNorm) is done by every thread on its own copy, so that the only waits are the
// barriers where one stage needs another's complete output: four a layer when the KV groups share
// out evenly between the threads (a thread's q, k and v rows are then its groups', and it goes
// straight on to their attention), five otherwise (cpu::SpinBarrier: cheaper to cross than
// libgomp's, docs/benchmarks.md). It calls the op path's CPU kernels in the op path's order (the
// bias before the product, as `linear` does); the products' rows, and with few KV groups a group's
// query heads, are split differently between the threads, which can change the rounding (the tests
// bound the difference).
//
// While a PackGuard lives, the products read copies of the weights packed as one sequential
// stream each (cpu::pack_weight), once for all the batch's rows: faster than row-major weights
// at batch 1 and much faster than the BLAS at a few rows (docs/benchmarks.md). Each thread's
// rows of each matrix are packed on their own, and one thread's parts lie one after another
// in the order the step reads them, so that each thread reads one stream from the first layer
// to the LM head: its prefetchers do not start afresh at every product (docs/benchmarks.md).
// Engine::generate packs at the start of each call, so weights changed between calls are
// always seen. A matrix whose values are all bf16 (GPT::round_matrices_to_bf16) is packed in
// bf16, which batch-1 decode, bound by reading the weights, reads in half the bytes for the
// same results.
//
// MLA's attention has a branch of its own (in latent form, as LatentAttention::forward_latent):
// its q_proj and kv_down are split and packed like the other products; its kv_up is read whole
// by every thread, to carry each head's query into latent form and its output back.
//
// This writes the block's forward a second time, for this one case; the op path (the modules'
// forward) stays the reference, and the tests compare the two at every step.
#include "infer/decode_step.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "autograd/backend/cpu/bf16.h"
#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/backend/kernels.h"
#include "autograd/backend/kv_format.h"
#include "platform/parallel.h"
#include "autograd/graph.h"

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

// A LayerNorm's or RMSNorm's weight, bias (or null) and eps.
struct NormRef {
  const float* w;
  const float* b;
  double eps;
  bool rms;
  explicit NormRef(const LayerNorm& n)
      : w(n.weight.data<float>()),
        b(n.bias.defined() ? n.bias.data<float>() : nullptr),
        eps(n.eps),
        rms(n.rms) {}
};

// A block's matrices in the order they are packed (decode_matrices): q, k, v, the attention's
// c_proj, c_fc, the MLP's c_proj, then SwiGLU's c_up (null without one); MLA's q_proj, kv_down
// and kv_up take the places of q, k and v. A fixed array: an unpacked step takes these for
// every block, and must not allocate for it.
std::array<const Linear*, 7> block_linears(const Block& b) {
  if (b.mla)
    return {&b.mla->q_proj, &b.mla->kv_down, &b.mla->kv_up,   &b.mla->c_proj,
            &b.mlp.c_fc,    &b.mlp.c_proj,   b.mlp.c_up.get()};
  return {&b.attn->q_proj, &b.attn->k_proj, &b.attn->v_proj, &b.attn->c_proj,
          &b.mlp.c_fc,    &b.mlp.c_proj,  b.mlp.c_up.get()};
}
size_t matrices_per_block(const GPTConfig& cfg) { return cfg.swiglu() ? 7 : 6; }

// parts: the parts of the block's matrices in block_linears's order, `threads` a matrix, or
// null.
struct BlockRef {
  NormRef ln_1, ln_2;
  LinearRef q, k, v, proj, fc, fc_proj;
  std::optional<LinearRef> up;  // SwiGLU's
  // MLA's (q, k and v are then q_proj, kv_down and kv_up): the latent's norm, and the query
  // compression's down-projection and norm where it has one.
  std::optional<NormRef> kv_norm, q_norm;
  std::optional<LinearRef> q_down;
  BlockRef(const Block& b, const PackRef* parts, int threads)
      : BlockRef(b, block_linears(b), parts, threads) {
    if (!b.mla) return;
    kv_norm.emplace(b.mla->kv_norm);
    if (b.mla->q_down) {
      q_down.emplace(*b.mla->q_down, nullptr);
      q_norm.emplace(*b.mla->q_norm);
    }
  }

 private:
  BlockRef(const Block& b, const std::array<const Linear*, 7>& l, const PackRef* p, int n)
      : ln_1(b.ln_1),
        ln_2(b.ln_2),
        q(*l[0], p),
        k(*l[1], p ? p + n : nullptr),
        v(*l[2], p ? p + 2 * n : nullptr),
        proj(*l[3], p ? p + 3 * n : nullptr),
        fc(*l[4], p ? p + 4 * n : nullptr),
        fc_proj(*l[5], p ? p + 5 * n : nullptr) {
    if (l[6] != nullptr) up.emplace(*l[6], p ? p + 6 * n : nullptr);
  }
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
// MLA's q (q_proj, NH (HS + D) rows) and k (kv_down, R + D rows) are one range split evenly
// too, never own groups; qd are its rows of q_down. It has no v rows: its kv_up is read whole,
// row-major, by every thread (never packed).
struct StepRows {
  bool own_groups;
  int64_t g0, g1;  // the KV groups whose attention this thread computes, when own_groups
  std::pair<int64_t, int64_t> q, k, v;
  std::pair<int64_t, int64_t> c;  // of the attention's and the MLP's output projections
  std::pair<int64_t, int64_t> h;  // of the MLP's c_fc (and c_up)
  std::pair<int64_t, int64_t> o;  // of the LM head
  std::pair<int64_t, int64_t> qd;  // of MLA's q_down
  StepRows(const GPTConfig& cfg, int t, int nt) {
    const int64_t C = cfg.n_embd, NKV = cfg.n_kv_head, HS = cfg.head_size(), KVD = NKV * HS;
    const int64_t G = cfg.n_head / NKV;
    c = thread_rows(C, t, nt);
    h = thread_rows(cfg.hidden(), t, nt);
    o = thread_rows(cfg.vocab_size, t, nt);
    if (cfg.mla()) {
      const int64_t Q = cfg.n_head * (HS + cfg.rope_head_dim), K = cfg.cache_width();
      const auto [r0, r1] = thread_rows(Q + K, t, nt);
      own_groups = false;
      g0 = g1 = 0;
      q = {std::min(r0, Q), std::min(r1, Q)};
      k = {std::clamp<int64_t>(r0 - Q, 0, K), std::clamp<int64_t>(r1 - Q, 0, K)};
      v = {0, 0};
      qd = thread_rows(cfg.q_lora_rank, t, nt);
      return;
    }
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
  }
  // The rows of matrix i of decode_matrices (the last one the LM head), per_block a block.
  std::pair<int64_t, int64_t> of_matrix(size_t i, size_t count, size_t per_block) const {
    if (i + 1 == count) return o;
    const std::array<std::pair<int64_t, int64_t>, 7> block{q, k, v, c, h, c, h};
    return block[i % per_block];
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
  cpu::layernorm_forward<float>(out, ln.rms ? nullptr : stats, stats + B, x, ln.w, ln.b, B, C,
                                ln.eps);
}

// One layer's rows of the cache for this step (DecodeKVCache::layer_rows): host memory, f32,
// bf16 or quantised (kv_format.h), B rows of NKV heads of HS contiguous elements with room for every row's length (which
// counts this step's position), checked before the parallel region; the threads write their
// new keys and values straight into them. A paged cache's rows (KVRows::blocks) are reached
// through their block tables: the new position's block for the stores, every block for the
// attention, in place.
struct CacheRef {
  KVRows rows;
  HeadView k_strides, v_strides;  // within a row (its sb unused: each row has its own pointer)
  int64_t S;
  bool bf16, quantised;
  CacheRef(const KVRows& r, int64_t B, int64_t NKV, int64_t HS, std::span<const int64_t> lengths)
      : rows(r) {
    const bool ok =
        r.device == Device::CPU && kv_dtype_problem(r.dtype, HS).empty() &&
        (r.dtype != DType::FP8 || r.scales != nullptr) &&
        r.rows == B && r.n_kv_head == NKV && r.head_size == HS &&
        std::all_of(lengths.begin(), lengths.end(), [&](int64_t n) { return n <= r.positions; });
    const std::string shape = shape_str(Shape{r.rows, r.n_kv_head, r.positions, r.head_size});
    KVLAB_CHECK(ok, "decode step: the KV cache returned k ", shape, " ", dtype_name(r.dtype),
                " on ", device_name(r.device), ", v ", shape, " ", dtype_name(r.dtype),
                "; the CPU decode step writes and reads host (B, NKV, S, HS) rows of f32, bf16, "
                "fp8 (with its scales), int8 or int4 with contiguous heads");
    if (r.blocks != nullptr) {
      // The attention reads a paged row block by block (cpu::BlockRows, block_len a power of
      // two); the table must hold the block each row's new position lies in.
      const KVBlocks& kb = *r.blocks;
      const bool pow2 = kb.block_len > 0 && (kb.block_len & (kb.block_len - 1)) == 0;
      KVLAB_CHECK(pow2 && kb.table != nullptr, "decode step: the KV cache's blocks of ",
                  kb.block_len, " positions are not a power of two, or it has no block table");
      for (int64_t b = 0; b < B; ++b) {
        const int64_t block = (lengths[static_cast<size_t>(b)] - 1) / kb.block_len;
        KVLAB_CHECK(block < kb.width && kb.table[b * kb.width + block] >= 0, "decode step: row ",
                    b, "'s block table has no block for position ",
                    lengths[static_cast<size_t>(b)] - 1, " (reserve the positions first)");
      }
    }
    k_strides = v_strides = {0, r.head_stride, r.pos_stride};
    S = r.positions;
    bf16 = r.dtype == DType::BF16;
    quantised = is_quantised(r.dtype);
  }
  // Where position p of row b lies from the row's pointer, in elements (head 0).
  int64_t position(int64_t b, int64_t p) const {
    if (rows.blocks == nullptr) return p * rows.pos_stride;
    const KVBlocks& kb = *rows.blocks;
    return kb.table[b * kb.width + p / kb.block_len] * kb.block_stride +
           p % kb.block_len * rows.pos_stride;
  }
  // fn(tag) with tag's ::type the rows' elements: float, uint16_t for bf16, or uint8_t for a
  // quantised row's bytes.
  template <class F>
  void typed(F&& fn) const {
    if (bf16)
      fn(std::type_identity<uint16_t>{});
    else if (quantised)
      fn(std::type_identity<uint8_t>{});
    else
      fn(std::type_identity<float>{});
  }
};

// Row b's new keys (which 0) or values (1) of KV head h, src (B, NKV * HS), quantised into
// the cache at the row's last position (length - 1). False where they are not finite.
bool store_new_quantised(const CacheRef& kv, int which, const float* src, int64_t b, int64_t h,
                         int64_t KVD, int64_t HS, const int64_t* lengths) {
  const KVRows& r = kv.rows;
  auto* row = static_cast<uint8_t*>((which == 0 ? r.k : r.v)[b]) +
              kv.position(b, lengths[b] - 1) + h * r.head_stride;
  const float scale = r.scales != nullptr ? r.scales[which * r.n_kv_head + h] : 0.0f;
  return store_kv_row(r.dtype, row, src + b * KVD + h * HS, 1, HS, scale);
}

// Elements [lo, hi) of each row's new keys (or values) src (B, NKV * HS) into the cache rows
// dst (a pointer per row, laid out as kv says) at the row's last position (length - 1); a
// bf16 cache rounds them as append would.
template <class KV>
void store_new(void* const* dst, const CacheRef& kv, const float* src, int64_t B, int64_t KVD,
               int64_t HS, const int64_t* lengths, int64_t lo, int64_t hi) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t at = kv.position(b, lengths[b] - 1);
    for (int64_t j = lo; j < hi;) {  // a run of one head's elements at a time
      const int64_t head = j / HS, n = std::min(hi, (head + 1) * HS) - j;
      KV* out = static_cast<KV*>(dst[b]) + at + head * kv.rows.head_stride + j % HS;
      store_kv_row(kv.rows.dtype, out, src + b * KVD + j, 1, n, 0.0f);  // f32 or bf16: any run
      j += n;
    }
  }
}

// The matrices the step reads packed, in pack_'s order: each block's (block_linears), then the
// LM head.
std::vector<const Tensor*> decode_matrices(const GPT& m) {
  std::vector<const Tensor*> out;
  for (const auto& blk : m.blocks)
    for (const Linear* l : block_linears(*blk))
      if (l != nullptr) out.push_back(&l->weight);
  out.push_back(&m.lm_head_weight());
  return out;
}

// The step's buffers, carved from one block that the step keeps (making tensors each step
// cost time a step can measure), each on 64-byte lines of its own.
// MLA's: q (B, NH (HS + D)), then its attention's output y (B, C); k the latent rows (B, R + D);
// v the queries carried into latent form (B, NH, R + D); att the attention's (B, NH, R + D); d
// first q_down's output (B, q_lora_rank).
struct StepBuffers {
  float* x;     // (B, C) the residual stream
  float* q;     // (B, C): this step's queries, (B, 1, NH, HS)
  float* k;     // (B, KVD) this step's keys, KVD = NKV * HS
  float* v;     // (B, KVD) this step's values
  float* att;   // (B, C): the attention's output y, (B, 1, NH, HS)
  float* d;     // (B, C): a block's update to x
  float* h;     // (B, H): the MLP's hidden (SwiGLU's gate, then silu(gate) * up)
  float* up;    // (B, H): SwiGLU's up projection (no words otherwise)
  float* own;   // (threads, own_size): per thread its LayerNorm output (B, C), mean and rstd (B)
  float* work;  // (threads, work_size): per thread the attention's work memory
  static constexpr size_t kCount = 10;
  // The buffers' sizes in f32 words, in the order above.
  // q_w, k_w, v_w, att_w: the widths of q, k, v and att (C, KVD, KVD, C; MLA's above).
  static std::array<int64_t, kCount> sizes(int64_t B, int64_t C, int64_t q_w, int64_t k_w,
                                           int64_t v_w, int64_t att_w, int64_t H, bool swiglu,
                                           int threads, int64_t own_size, int64_t work_size) {
    const int64_t BC = B * C;
    return {BC, B * q_w, B * k_w, B * v_w, B * att_w, BC, B * H, swiglu ? B * H : 0,
            threads * own_size, threads * work_size};
  }
  // Carves them from `block` in that order (members are initialised in declaration order).
  StepBuffers(float* block, const std::array<int64_t, kCount>& n)
      : x(carve(block, n[0])),
        q(carve(block, n[1])),
        k(carve(block, n[2])),
        v(carve(block, n[3])),
        att(carve(block, n[4])),
        d(carve(block, n[5])),
        h(carve(block, n[6])),
        up(carve(block, n[7])),
        own(carve(block, n[8])),
        work(carve(block, n[9])) {}

 private:
  static float* carve(float*& block, int64_t n) {
    float* p = block;
    block += whole_lines(n);
    return p;
  }
};

}  // namespace

// The step's pointers into the model: taking them costs some hundred calls into Tensor, so
// pack() takes them once for all the steps of a generation. parts: the packed parts of
// the matrices of decode_matrices, `threads` a matrix (thread t's rows, StepRows, at t), or none
// (threads 0); a step on another number of threads reads the row-major weights.
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
        head(m.lm_head_weight(), nullptr,
             part(m.blocks.size() * matrices_per_block(m.config()))) {
    const size_t per_block = matrices_per_block(m.config());
    KVLAB_ASSERT(parts.size() == (m.blocks.size() * per_block + 1) * static_cast<size_t>(threads),
                 "decode step: ", parts.size(), " packed parts for ", m.blocks.size(),
                 " blocks and ", threads, " threads");
    layers.reserve(m.blocks.size());
    for (size_t l = 0; l < m.blocks.size(); ++l)
      layers.emplace_back(*m.blocks[l], part(l * per_block), threads);
  }

 private:
  const PackRef* part(size_t matrix) const {  // matrix's first part, or null
    return parts.empty() ? nullptr : &parts[matrix * static_cast<size_t>(threads)];
  }
};

DecodeStep::DecodeStep(const GPT& model) : model_(model) {}

DecodeStep::~DecodeStep() = default;

bool DecodeStep::runs_on_model() const {
  const Tensor& w = model_.wte.weight;
  return enabled && w.device() == Device::CPU && w.dtype() == DType::F32;
}

bool DecodeStep::applies(const Tensor& tokens) const {
  return runs_on_model() && tokens.dim() == 2 && tokens.size(1) == 1 && !grad_enabled();
}

bool DecodeStep::packing_applies() const {
  return runs_on_model() && cpu::packed_weight_size(1, 1) > 0;
}

DecodeStep::PackGuard DecodeStep::pack() {
  if (!packing_applies()) return {};
  const std::vector<const Tensor*> weights = decode_matrices(model_);
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
    const StepRows step(model_.config(), t, threads);
    for (size_t i = 0; i < weights.size(); ++i) {
      const size_t at = i * static_cast<size_t>(threads) + static_cast<size_t>(t);
      rows[at] = step.of_matrix(i, weights.size(), matrices_per_block(model_.config()));
      const int64_t n = rows[at].second - rows[at].first, k = weights[i]->size(1);
      if (n <= 0) continue;
      offset[at] = words;
      const int64_t size =
          bf16[i] ? (cpu::packed_weight_bf16_size(n, k) + 1) / 2 : cpu::packed_weight_size(n, k);
      words += whole_lines(size);
    }
  }
  if (!pack_.defined() || pack_.numel() != words) pack_ = Tensor::empty({words});
  float* buffer = pack_.data<float>();
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
  refs_ = std::make_shared<const DecodeRefs>(model_, std::move(pack), threads);
  ++pack_users_;
  return PackGuard(this);
}

DecodeStep::PackGuard::~PackGuard() {
  if (step_ != nullptr) --step_->pack_users_;
}

int64_t DecodeStep::weight_bytes() const {
  const int64_t tables =
      (model_.wpe ? model_.wpe->weight.numel() : 0) + (model_.lm_head ? model_.wte.weight.numel() : 0);
  int64_t matrices = 0, bytes = 0;
  const bool packs = packing_applies();
  const std::vector<const Tensor*> weights = decode_matrices(model_);
  const size_t per_block = matrices_per_block(model_.config());
  const int threads = omp_get_max_threads();
  std::vector<StepRows> steps;
  for (int t = 0; t < threads; ++t) steps.emplace_back(model_.config(), t, threads);
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor* w = weights[i];
    // A matrix no thread has rows of is read as it is, never packed (pack(): MLA's kv_up).
    const bool unpacked = std::all_of(steps.begin(), steps.end(), [&](const StepRows& s) {
      const auto [lo, hi] = s.of_matrix(i, weights.size(), per_block);
      return lo >= hi;
    });
    const bool half = packs && !unpacked && cpu::all_bf16(w->data<float>(), w->numel());
    matrices += w->numel();
    bytes += w->numel() * (half ? 2 : 4);
  }
  return bytes + (model_.num_parameters() - tables - matrices) * 4;
}

Tensor DecodeStep::forward(const Tensor& tokens_in, DecodeKVCache& cache) {
  const GPTConfig& cfg = model_.config();
  KVLAB_CHECK(tokens_in.dtype() == DType::I32 && tokens_in.dim() == 2 && tokens_in.size(1) == 1 &&
                  tokens_in.device() == Device::CPU,
              "decode step: tokens must be (B, 1) i32 on the host, got ", tokens_in.shape_str(),
              " ", dtype_name(tokens_in.dtype()), " on ", device_name(tokens_in.device()));
  const Tensor tokens = tokens_in.contiguous();
  const int64_t B = tokens.size(0), C = cfg.n_embd, V = cfg.vocab_size, H = cfg.hidden();
  const int64_t NH = cfg.n_head, NKV = cfg.n_kv_head, HS = cfg.head_size(), KVD = NKV * HS;
  const int64_t G = NH / NKV;  // query heads per KV head
  // MLA: a query of QW = HS + D a head, one latent row of KW = R + D a position (the cache's
  // single KV head), and queries in latent form of KW a head.
  const bool mla = cfg.mla();
  const int64_t R = cfg.kv_lora_rank, D = cfg.rope_head_dim, RQ = cfg.q_lora_rank;
  const int64_t QW = HS + D, KW = cfg.cache_width();
  KVLAB_CHECK(cache.batch() == B, "decode step: cache holds ", cache.batch(), " rows, tokens have ",
              B);
  lengths_.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = cache.lengths()[static_cast<size_t>(b)];
    KVLAB_CHECK(len + 1 <= cfg.block_size && len + 1 <= cache.capacity(), "decode step: row ", b,
                " would reach position ", len + 1, " past the context limit (block_size ",
                cfg.block_size, ", cache capacity ", cache.capacity(), ")");
    lengths_[static_cast<size_t>(b)] = len + 1;
  }
  const int32_t* ids = tokens.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    KVLAB_CHECK(ids[b] >= 0 && ids[b] < V, "decode step: token id ", ids[b], " in row ", b,
                " is outside [0, ", V, ")");
  const bool packed = pack_users_ > 0;
  const std::shared_ptr<const DecodeRefs> refs =
      packed ? refs_ : std::make_shared<const DecodeRefs>(model_, std::vector<PackRef>(), 0);
  const std::vector<BlockRef>& layers = refs->layers;
  const NormRef& final_norm = refs->final_norm;
  const LinearRef& head = refs->head;
  std::vector<CacheRef> caches;
  caches.reserve(layers.size());
  for (size_t l = 0; l < layers.size(); ++l)
    caches.emplace_back(cache.layer_rows(static_cast<int>(l), 1), B, cfg.cache_heads(), KW,
                        lengths_);
  const float* wte_w = model_.wte.weight.data<float>();
  const float* wpe_w = model_.wpe ? model_.wpe->weight.data<float>() : nullptr;
  // RoPE: each row's position (this step's: past its slots by what it dropped) and the table,
  // rotating q and k in place.
  positions_.resize(static_cast<size_t>(B));
  int64_t max_position = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = cache.position_offsets()[static_cast<size_t>(b)];
    KVLAB_CHECK(first == 0 || cfg.rope(), "decode step: row ", b,
                " of the cache dropped its first ", first,
                " positions, which only RoPE positions go on past");
    positions_[static_cast<size_t>(b)] =
        static_cast<int32_t>(first + lengths_[static_cast<size_t>(b)] - 1);
    max_position = std::max<int64_t>(max_position, positions_[static_cast<size_t>(b)] + 1);
  }
  const int32_t* positions = positions_.data();
  const float* rope = cfg.rope() ? model_.rope_table(max_position).data<float>() : nullptr;
  const int threads = omp_get_max_threads();
  Tensor logits = Tensor::empty({B, 1, V});  // (B, 1, V)
  float* out = logits.data<float>();
  const int64_t* lengths = lengths_.data();  // each row's, this step's position included
  // One row's attention: the kernel's tasks of row b are those of a batch of 1 at row b's
  // pointers (its own cache rows, q and y at b * C, its length). MLA's is over the latent rows,
  // one KV head for every query head, scaled as training's 1 / sqrt(HS + D).
  const AttentionShape s =
      mla ? AttentionShape{1, NH, 1, 1, 0, KW, lengths, 1.0 / std::sqrt(double(QW)), 0.0, 0}
          : AttentionShape{1, NH, NKV, 1, 0, HS, lengths, 1.0 / std::sqrt(double(HS)), 0.0, 0};
  const HeadView qv = mla ? HeadView{NH * KW, KW, NH * KW}  // q and y as (B, NH, 1, KW)
                          : HeadView{C, HS, C};            // as (B, NH, 1, HS)
  // Per thread, the attention's work memory over the longest layer, so that nothing inside the
  // region allocates or throws; sized by the cache's capacity, so that step after step the
  // buffers fit the same block.
  AttentionShape longest = s;
  longest.S = cache.capacity();
  bool any_widened = false;  // bf16 or quantised rows, which may be widened into work memory
  for (const CacheRef& c : caches) {
    longest.S = std::max(longest.S, c.S);
    any_widened = any_widened || c.bf16 || c.quantised;
  }
  // MLA over f32 rows: every query head's probabilities (cpu::attend_latent).
  const int64_t work_size = std::max(
      mla ? NH * longest.S : 0, any_widened ? cpu::attention_decode_work<float, uint16_t>(longest)
                                            : cpu::attention_decode_work<float>(longest));
  // The first (layer, row, KV head) whose new key or value a quantised cache could not store,
  // as l * B * NKV + b * NKV + h (MLA: l * B + b, its one latent row), or -1: nothing inside
  // the region may throw, so the step reports it after the region, before the cache advances.
  std::atomic<int64_t> nonfinite{-1};
  // Per thread: ln_1's output, its mean and rstd, and MLA's scratch (the normed query latents
  // (B, RQ), or a latent row being normed).
  const int64_t own_size = B * C + 2 * B + (mla ? std::max(B * RQ, KW) : 0);
  const auto sizes =
      mla ? StepBuffers::sizes(B, C, NH * QW, KW, NH * KW, NH * KW, H, cfg.swiglu(), threads,
                               own_size, work_size)
          : StepBuffers::sizes(B, C, C, KVD, KVD, C, H, cfg.swiglu(), threads, own_size,
                               work_size);
  int64_t words = 0;
  for (int64_t n : sizes) words += whole_lines(n);
  if (!buffers_.defined() || buffers_.numel() < words) {
    buffers_ = Tensor();  // free first: the allocator can hand the same block back
    buffers_ = Tensor::empty({words});
  }
  const StepBuffers buf(buffers_.data<float>(), sizes);
  cpu::SpinBarrier barrier;

#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    float* ln = buf.own + t * own_size;  // (B, C), then mean and rstd (B)
    float* stats = ln + B * C;
    float* scratch = stats + 2 * B;  // MLA's
    float* my_work = buf.work + t * work_size;
    AttentionShape shape = s;  // S set per layer, kv_lengths per row
    KVBlocks row_blocks{};     // a paged layer's block tables, table at the row being attended
    const StepRows rows(cfg, t, nt);
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
        buf.x[b * C + c] =
            wte_w[ids[b] * C + c] + (wpe_w != nullptr ? wpe_w[(lengths[b] - 1) * C + c] : 0.0f);
#pragma omp single
    barrier.reset(nt);  // its implicit barrier also ends the embedding
    for (size_t l = 0; l < layers.size(); ++l) {
      const BlockRef& blk = layers[l];
      const CacheRef& kv = caches[l];
      layer_norm(ln, stats, buf.x, blk.ln_1, B, C);
      shape.S = kv.S;
      // A paged row is attended as a batch of 1 at its own block table.
      const bool paged = kv.rows.blocks != nullptr;
      if (paged) row_blocks = *kv.rows.blocks;
      shape.kv_blocks = paged ? &row_blocks : nullptr;
      shape.kv_dtype = kv.rows.dtype;
      shape.kv_scales = kv.rows.scales;
      const float* y = buf.att;  // the attention's output (B, C)
      if (mla) {
        // The queries: from ln_1's output, or through the compressed query latent, each
        // thread norming its own copy of it.
        const float* q_in = ln;
        if (blk.q_down) {
          linear_rows(buf.d, RQ, ln, B, *blk.q_down, rows.qd.first, rows.qd.second, nullptr);
          barrier.wait();
          layer_norm(scratch, stats, buf.d, *blk.q_norm, B, RQ);
          q_in = scratch;
        }
        linear_rows(buf.q, NH * QW, q_in, B, blk.q, q0, q1, part(blk.q));
        linear_rows(buf.k, KW, ln, B, blk.k, k0, k1, part(blk.k));  // kv_down: latent, rotary key
        barrier.wait();
        // Task b * (NH + 1) + h: for h < NH, head h's rotary query turned and its HS query
        // carried into latent form through its key rows of kv_up, W_uk (HS, R): q W_uk, then
        // the rotary query after it (forward_latent's queries, unscaled: the attention's
        // scale is training's); for h = NH, row b's latent normed, its rotary key turned, and
        // the row stored.
        const float* w_up = blk.v.w;  // kv_up (NH 2 HS, R): per head its key rows, then value rows
        for (int64_t i = t; i < B * (NH + 1); i += nt) {
          const int64_t b = i / (NH + 1), h = i % (NH + 1);
          if (h == NH) {
            float* row = buf.k + b * KW;
            layer_norm(scratch, stats, row, *blk.kv_norm, 1, R);
            std::copy(scratch, scratch + R, row);
            cpu::rope_forward<float>(row + R, row + R, positions + b, rope, 1, 1, D, false);
            kv.typed([&](auto tag) {
              using KV = typename decltype(tag)::type;
              KV* dst = static_cast<KV*>(kv.rows.k[b]) + kv.position(b, lengths[b] - 1);
              const float fp8_scale = kv.rows.scales != nullptr ? kv.rows.scales[0] : 0.0f;
              if (!store_kv_row(kv.rows.dtype, dst, row, 1, KW, fp8_scale)) {
                int64_t none = -1;
                nonfinite.compare_exchange_strong(none, static_cast<int64_t>(l) * B + b);
              }
            });
            continue;
          }
          float* q = buf.q + b * NH * QW + h * QW;
          cpu::rope_forward<float>(q + HS, q + HS, positions + b, rope, 1, 1, D, false);
          float* qa = buf.v + (b * NH + h) * KW;
          std::fill(qa, qa + R, 0.0f);
          const float* wk = w_up + h * 2 * HS * R;
          for (int64_t j = 0; j < HS; ++j) {
            const float qj = q[j];
            const float* wj = wk + j * R;
#pragma omp simd
            for (int64_t r = 0; r < R; ++r) qa[r] += qj * wj[r];
          }
          std::copy(q + HS, q + QW, qa + R);
        }
        barrier.wait();
        // One KV head for all NH query heads, its heads shared out where rows are few. f32
        // rows take attend_latent; bf16 and quantised ones, which it cannot read, the row
        // kernel.
        const int64_t parts = std::clamp<int64_t>(nt / B, 1, NH);
        kv.typed([&](auto tag) {
          using KV = typename decltype(tag)::type;
          for (int64_t i = t; i < B * parts; i += nt) {
            const int64_t b = i / parts;
            if constexpr (std::is_same_v<KV, float>) {
              const int64_t part = i - b * parts, h0 = NH * part / parts;
              float* y = buf.att + (b * NH + h0) * KW;
              const float* q = buf.v + (b * NH + h0) * KW;
              const int64_t heads = NH * (part + 1) / parts - h0;
              const auto* rows = static_cast<const float*>(kv.rows.k[b]);
              const auto scale = static_cast<float>(shape.scale);
              if (paged) {
                const auto br =
                    cpu::BlockRows<float>::of(rows, *kv.rows.blocks, b, kv.rows.pos_stride);
                cpu::attend_latent(y, q, heads, br, lengths[b], KW, R, scale, my_work);
              } else {
                cpu::attend_latent(y, q, heads, rows, kv.rows.pos_stride, lengths[b], KW, R, scale,
                                   my_work);
              }
            } else {
              shape.kv_lengths = lengths + b;
              if (paged) row_blocks.table = kv.rows.blocks->table + b * row_blocks.width;
              cpu::attention_decode_task<float, KV>(
                  buf.att + b * NH * KW, qv, buf.v + b * NH * KW, qv,
                  static_cast<const KV*>(kv.rows.k[b]), kv.k_strides,
                  static_cast<const KV*>(kv.rows.v[b]), kv.v_strides, shape, i - b * parts, parts,
                  my_work);
            }
          }
        });
        barrier.wait();
        // Each head's weighted latents (the first R of its output) through its value rows of
        // kv_up, W_uv (HS, R), and their bias: y (B, C) in q's buffer, whose queries are spent.
        const float* b_up = blk.v.b;
        for (int64_t i = t; i < B * NH; i += nt) {
          const int64_t b = i / NH, h = i % NH;
          const float* o = buf.att + (b * NH + h) * KW;
          float* yh = buf.q + b * C + h * HS;
          for (int64_t j = 0; j < HS; ++j) {
            const float* wv = w_up + (h * 2 * HS + HS + j) * R;
            float acc = b_up != nullptr ? b_up[h * 2 * HS + HS + j] : 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t r = 0; r < R; ++r) acc += o[r] * wv[r];
            yh[j] = acc;
          }
        }
        y = buf.q;
      } else {
        linear_rows(buf.q, C, ln, B, blk.q, q0, q1, part(blk.q));
        linear_rows(buf.k, KVD, ln, B, blk.k, k0, k1, part(blk.k));
        linear_rows(buf.v, KVD, ln, B, blk.v, v0, v1, part(blk.v));
        if (rope != nullptr) {  // keys are stored rotated, at the row's position
          auto rotate = [&](float* x, int64_t b, int64_t heads) {
            cpu::rope_forward<float>(x, x, positions + b, rope, 1, heads, HS, false);
          };
          if (own_groups) {  // this thread's groups' heads are whole here
            for (int64_t b = 0; b < B && g0 < g1; ++b) {
              rotate(buf.q + b * C + g0 * G * HS, b, (g1 - g0) * G);
              rotate(buf.k + b * KVD + g0 * HS, b, g1 - g0);
            }
          } else {  // a head's rows may come from two threads: rotate once all are computed
            barrier.wait();
            for (int64_t i = t; i < B * (NH + NKV); i += nt) {
              const int64_t b = i / (NH + NKV), h = i % (NH + NKV);
              rotate(h < NH ? buf.q + b * C + h * HS : buf.k + b * KVD + (h - NH) * HS, b, 1);
            }
            barrier.wait();
          }
        }
        kv.typed([&](auto tag) {
          using KV = typename decltype(tag)::type;
          if constexpr (std::is_same_v<KV, uint8_t>) {
            // A quantised row takes its head's whole key or value at once: with own groups this
            // thread computed its groups' heads; otherwise the heads are dealt out once every
            // thread's rows are computed, and stored before anyone attends.
            auto store_head = [&](int64_t b, int64_t h) {
              for (int which = 0; which < 2; ++which)
                if (!store_new_quantised(kv, which, which == 0 ? buf.k : buf.v, b, h, KVD, HS,
                                         lengths)) {
                  int64_t none = -1;
                  nonfinite.compare_exchange_strong(
                      none, (static_cast<int64_t>(l) * B + b) * NKV + h);
                }
            };
            if (own_groups) {
              for (int64_t b = 0; b < B; ++b)
                for (int64_t h = g0; h < g1; ++h) store_head(b, h);
            } else {
              barrier.wait();
              for (int64_t i = t; i < B * NKV; i += nt) store_head(i / NKV, i % NKV);
              barrier.wait();
            }
          } else {
            store_new<KV>(kv.rows.k, kv, buf.k, B, KVD, HS, lengths, k0, k1);
            store_new<KV>(kv.rows.v, kv, buf.v, B, KVD, HS, lengths, v0, v1);
            if (!own_groups) barrier.wait();
          }
          // Task i of the batch: row b = i / (NKV * parts), and that row's task i % (NKV * parts).
          auto task = [&](int64_t i) {
            const int64_t b = i / (NKV * parts);
            shape.kv_lengths = lengths + b;
            if (paged) row_blocks.table = kv.rows.blocks->table + b * row_blocks.width;
            cpu::attention_decode_task<float, KV>(buf.att + b * C, qv, buf.q + b * C, qv,
                                                  static_cast<const KV*>(kv.rows.k[b]), kv.k_strides,
                                                  static_cast<const KV*>(kv.rows.v[b]), kv.v_strides,
                                                  shape, i - b * NKV * parts, parts, my_work);
          };
          if (own_groups)
            for (int64_t b = 0; b < B; ++b)
              for (int64_t g = g0; g < g1; ++g) task(b * NKV + g);
          else
            for (int64_t i = t; i < B * NKV * parts; i += nt) task(i);
        });
      }
      barrier.wait();
      linear_rows(buf.d, C, y, B, blk.proj, c0, c1, part(blk.proj));
      add_rows(buf.x, buf.d, B, C, c0, c1);  // x += c_proj(y)
      barrier.wait();
      layer_norm(ln, stats, buf.x, blk.ln_2, B, C);
      linear_rows(buf.h, H, ln, B, blk.fc, h0, h1, part(blk.fc));
      if (blk.up) {
        linear_rows(buf.up, H, ln, B, *blk.up, h0, h1, part(*blk.up));
        for (int64_t b = 0; b < B && h0 < h1; ++b)
          cpu::swiglu_forward<float>(buf.h + b * H + h0, buf.h + b * H + h0, buf.up + b * H + h0,
                                     h1 - h0);
      } else {
        for (int64_t b = 0; b < B && h0 < h1; ++b)
          cpu::gelu_forward<float>(buf.h + b * H + h0, buf.h + b * H + h0, h1 - h0);
      }
      barrier.wait();
      linear_rows(buf.d, C, buf.h, B, blk.fc_proj, c0, c1, part(blk.fc_proj));
      add_rows(buf.x, buf.d, B, C, c0, c1);  // x += mlp(ln_2(x))
      barrier.wait();
    }
    layer_norm(ln, stats, buf.x, final_norm, B, C);
    linear_rows(out, V, ln, B, head, rows.o.first, rows.o.second, part(head));
  }
  if (const int64_t at = nonfinite.load(); at >= 0) {
    const int64_t heads = cfg.cache_heads(), b = at / heads % B;
    kv_nonfinite_error(caches[0].rows.dtype, static_cast<int>(at / heads / B), b, at % heads,
                       lengths[b] - 1);
  }
  cache.advance(1);
  return logits;
}

}  // namespace kvlab
