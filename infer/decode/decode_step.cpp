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
// This file holds the checks and allocations before the region and the driver: per layer the
// stages norm (block_stages.h), attention (attend_gqa.h or attend_mla.h), output projection
// and residual, MLP, then the head. The stages are static inline and compile into the driver;
// the barriers between them are the driver's, those within one stage its own, and each stage
// says which barrier ends it. The packed weights the products read are packed_weights.h's.
//
// This writes the block's forward a second time, for this one case; the op path (the modules'
// forward) stays the reference, and the tests compare the two at every step.
#include "infer/decode/decode_step.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "autograd/backend/cpu/decode_kernels.h"
#include "autograd/graph.h"
#include "infer/decode/attend_gqa.h"
#include "infer/decode/attend_mla.h"
#include "infer/decode/block_stages.h"
#include "infer/decode/cache_rows.h"
#include "infer/decode/packed_weights.h"
#include "infer/decode/step.h"
#include "platform/kv_rows.h"
#include "platform/parallel.h"

namespace kvlab {

using decode::CacheRef;
using decode::DecodeRefs;
using decode::PackRef;
using decode::Step;
using decode::StepBuffers;
using decode::ThreadStep;

DecodeStep::DecodeStep(const GPT& model) : model_(model) {}

DecodeStep::~DecodeStep() = default;

bool DecodeStep::runs_on_model() const {
  const Tensor& w = model_.wte.weight;
  return enabled && w.device() == Device::CPU && w.dtype() == DType::F32;
}

bool DecodeStep::applies(const Tensor& tokens) const {
  return runs_on_model() && tokens.dim() == 2 && tokens.size(1) == 1 && !grad_enabled();
}
namespace {

// lengths[b]: row b's length after this step, its new position included, checked against the
// context limit and the cache's capacity.
void row_lengths(const GPTConfig& cfg, const DecodeKVCache& cache, int64_t B,
                 std::vector<int64_t>& lengths) {
  lengths.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = cache.lengths()[static_cast<size_t>(b)];
    KVLAB_CHECK(len + 1 <= cfg.block_size && len + 1 <= cache.capacity(), "decode step: row ", b,
                " would reach position ", len + 1, " past the context limit (block_size ",
                cfg.block_size, ", cache capacity ", cache.capacity(), ")");
    lengths[static_cast<size_t>(b)] = len + 1;
  }
}

// RoPE: positions[b], row b's position (this step's: past its slots by what it dropped).
// Returns one past the largest, the rows the RoPE table must have.
int64_t row_positions(const GPTConfig& cfg, const DecodeKVCache& cache,
                      const std::vector<int64_t>& lengths, std::vector<int32_t>& positions) {
  positions.resize(lengths.size());
  int64_t max_position = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    const int64_t first = cache.position_offsets()[b];
    KVLAB_CHECK(first == 0 || cfg.rope(), "decode step: row ", b,
                " of the cache dropped its first ", first,
                " positions, which only RoPE positions go on past");
    positions[b] = static_cast<int32_t>(first + lengths[b] - 1);
    max_position = std::max<int64_t>(max_position, positions[b] + 1);
  }
  return max_position;
}

// Per thread, the attention's work memory over the longest layer, so that nothing inside the
// region allocates or throws; sized by the cache's capacity, so that step after step the
// buffers fit the same block.
int64_t attention_work_size(const GPTConfig& cfg, const AttentionShape& s, int64_t capacity,
                            std::span<const CacheRef> caches) {
  AttentionShape longest = s;
  longest.S = capacity;
  bool any_widened = false;  // bf16 or quantised rows, which may be widened into work memory
  for (const CacheRef& c : caches) {
    longest.S = std::max(longest.S, c.S);
    any_widened = any_widened || c.bf16 || c.quantised;
  }
  // MLA over f32 rows: every query head's probabilities (cpu::attend_latent).
  return std::max(cfg.mla() ? cfg.n_head * longest.S : 0,
                  any_widened ? cpu::attention_decode_work<float, uint16_t>(longest)
                              : cpu::attention_decode_work<float>(longest));
}

// The step's buffers' sizes (StepBuffers::sizes): MLA's q, k, v and att are wider (step.h).
std::array<int64_t, StepBuffers::kCount> buffer_sizes(const GPTConfig& cfg, int64_t B, int threads,
                                                      int64_t own_size, int64_t work_size) {
  const int64_t C = cfg.n_embd, H = cfg.hidden(), NH = cfg.n_head;
  const int64_t KVD = cfg.n_kv_head * cfg.head_size(), KW = cfg.cache_width();
  const int64_t QW = cfg.head_size() + cfg.rope_head_dim;
  return cfg.mla() ? StepBuffers::sizes(B, C, NH * QW, KW, NH * KW, NH * KW, H, cfg.swiglu(),
                                        threads, own_size, work_size)
                   : StepBuffers::sizes(B, C, C, KVD, KVD, C, H, cfg.swiglu(), threads, own_size,
                                        work_size);
}

// The block the buffers are carved from: `buffers`, grown first where it is short of them.
float* buffer_block(Tensor& buffers, const std::array<int64_t, StepBuffers::kCount>& sizes) {
  int64_t words = 0;
  for (int64_t n : sizes) words += decode::whole_lines(n);
  if (!buffers.defined() || buffers.numel() < words) {
    buffers = Tensor();  // free first: the allocator can hand the same block back
    buffers = Tensor::empty({words});
  }
  return buffers.data<float>();
}

}  // namespace

Tensor DecodeStep::forward(const Tensor& tokens_in, DecodeKVCache& cache) {
  const GPTConfig& cfg = model_.config();
  KVLAB_CHECK(tokens_in.dtype() == DType::I32 && tokens_in.dim() == 2 && tokens_in.size(1) == 1 &&
                  tokens_in.device() == Device::CPU,
              "decode step: tokens must be (B, 1) i32 on the host, got ", tokens_in.shape_str(),
              " ", dtype_name(tokens_in.dtype()), " on ", device_name(tokens_in.device()));
  const Tensor tokens = tokens_in.contiguous();
  const int64_t B = tokens.size(0), C = cfg.n_embd, V = cfg.vocab_size;
  const int64_t NH = cfg.n_head, NKV = cfg.n_kv_head, HS = cfg.head_size();
  const bool mla = cfg.mla();
  const int64_t RQ = cfg.q_lora_rank, QW = HS + cfg.rope_head_dim, KW = cfg.cache_width();
  KVLAB_CHECK(cache.batch() == B, "decode step: cache holds ", cache.batch(), " rows, tokens have ",
              B);
  row_lengths(cfg, cache, B, lengths_);
  const int32_t* ids = tokens.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    KVLAB_CHECK(ids[b] >= 0 && ids[b] < V, "decode step: token id ", ids[b], " in row ", b,
                " is outside [0, ", V, ")");
  const std::shared_ptr<const DecodeRefs> refs =
      pack_users_ > 0 ? refs_
                      : std::make_shared<const DecodeRefs>(model_, std::vector<PackRef>(), 0);
  std::vector<CacheRef> caches;
  caches.reserve(refs->layers.size());
  for (size_t l = 0; l < refs->layers.size(); ++l)
    caches.emplace_back(cache.layer_rows(static_cast<int>(l), 1), B, cfg.cache_heads(), KW,
                        lengths_);
  const int64_t max_position = row_positions(cfg, cache, lengths_, positions_);
  const float* rope = cfg.rope() ? model_.rope_table(max_position).data<float>() : nullptr;
  const int threads = omp_get_max_threads();
  Tensor logits = Tensor::empty({B, 1, V});  // (B, 1, V)
  const int64_t* lengths = lengths_.data();
  const AttentionShape s =
      mla ? AttentionShape{1, NH, 1, 1, 0, KW, lengths, 1.0 / std::sqrt(double(QW)), 0.0, 0}
          : AttentionShape{1, NH, NKV, 1, 0, HS, lengths, 1.0 / std::sqrt(double(HS)), 0.0, 0};
  const int64_t work_size = attention_work_size(cfg, s, cache.capacity(), caches);
  // Per thread: ln_1's output, its mean and rstd, and MLA's scratch (the normed query latents
  // (B, RQ), or a latent row being normed).
  const int64_t own_size = B * C + 2 * B + (mla ? std::max(B * RQ, KW) : 0);
  const auto sizes = buffer_sizes(cfg, B, threads, own_size, work_size);
  float* block = buffer_block(buffers_, sizes);
  cpu::SpinBarrier barrier;
  std::atomic<int64_t> nonfinite{-1};                       // Step::nonfinite
  const HeadView qv = mla ? HeadView{NH * KW, KW, NH * KW}  // q and y as (B, NH, 1, KW)
                          : HeadView{C, HS, C};             // as (B, NH, 1, HS)
  const Step step(decode::StepDims(cfg, B), cfg, ids, lengths, positions_.data(), rope,
                  model_.wte.weight.data<float>(),
                  model_.wpe ? model_.wpe->weight.data<float>() : nullptr, *refs, caches,
                  StepBuffers(block, sizes), s, qv, own_size, work_size, logits.data<float>(),
                  barrier, nonfinite);

  // The driver. Per layer the barriers between stages stand where the next stage reads rows
  // other threads computed; the stages' own (the non-own-groups q/k/v and stores, MLA's three,
  // the MLP's one) are theirs.
#pragma omp parallel num_threads(threads)
  {
    const ThreadStep ts(step, omp_get_thread_num(), omp_get_num_threads());
    decode::RowAttention att(step.s);
    decode::embed(ts);
#pragma omp single
    barrier.reset(ts.nt);  // its implicit barrier also ends the embedding
    for (size_t l = 0; l < step.refs.layers.size(); ++l) {
      const decode::BlockRef& blk = step.refs.layers[l];
      const CacheRef& kv = step.caches[l];
      decode::norm(ts, blk.ln_1);
      const float* y =
          mla ? decode::attend_mla(ts, att, blk, kv, l) : decode::attend_gqa(ts, att, blk, kv, l);
      barrier.wait();  // c_proj reads every thread's heads
      decode::project_residual(ts, blk, y);
      barrier.wait();  // ln_2 reads the whole of x
      decode::mlp(ts, blk);
      barrier.wait();  // the next ln_1 (or the final norm) reads the whole of x
    }
    decode::head(ts);
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
