#include "infer/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include <zlib.h>

#include "autograd/graph.h"
#include "infer/kv_scales.h"
#include "platform/kv_rows.h"
#include "platform/random.h"

namespace kvlab {

namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
// The end of the error about an empty prompt, after its name.
constexpr const char* kEmptyPrompt = " is empty: at least one token is needed to condition on";
}  // namespace

std::string prompt_name(int64_t b, int64_t B) {
  return B == 1 ? std::string("prompt") : detail::cat("prompt ", b + 1);
}

std::string prompt_problem(std::span<const int32_t> ids, int64_t vocab_size, int64_t block_size,
                           bool slide) {
  if (ids.empty()) return kEmptyPrompt;
  for (int32_t id : ids)
    if (id < 0 || id >= vocab_size)
      return detail::cat(": token id ", id, " outside the vocabulary [0, ", vocab_size, ")");
  if (static_cast<int64_t>(ids.size()) > block_size && !slide)
    return detail::cat(" has ", ids.size(),
                       " tokens, more than the model's context of block_size = ", block_size,
                       " tokens");
  return "";
}

void GenerateOptions::validate() const {
  KVLAB_CHECK(max_new_tokens >= 1, "max-new must be >= 1, got ", max_new_tokens);
  KVLAB_CHECK(n >= 1, "n (samples per prompt) must be >= 1, got ", n);
  sampling.validate();
  for (const auto& s : stop) KVLAB_CHECK(!s.empty(), "stop strings must not be empty");
}

// ---- statistics --------------------------------------------------------------------------

double GenerationStats::decode_s() const {
  return std::accumulate(step_s.begin(), step_s.end(), 0.0);
}

double GenerationStats::utilisation_mean() const {
  return utilisation.empty() ? 0.0
                             : std::accumulate(utilisation.begin(), utilisation.end(), 0.0) /
                                   static_cast<double>(utilisation.size());
}

double GenerationStats::decode_tokens_per_s() const {
  const double t = decode_s();
  const int64_t n = std::accumulate(step_rows.begin(), step_rows.end(), int64_t{0});
  return t > 0 ? static_cast<double>(n) / t : 0.0;
}

double GenerationStats::tokens_per_s() const {
  return total_s > 0 ? static_cast<double>(new_tokens) / total_s : 0.0;
}

double GenerationStats::tpot_mean_s() const {
  return step_s.empty() ? 0.0 : decode_s() / static_cast<double>(step_s.size());
}

double GenerationStats::tpot_quantile_s(double q) const {
  if (step_s.empty()) return 0.0;
  std::vector<double> s(step_s);
  std::sort(s.begin(), s.end());
  // Nearest rank: the smallest value with at least q of the samples at or below it.
  const double rank = std::ceil(q * static_cast<double>(s.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(s.size()))) - 1;
  return s[i];
}

// ---- engine ------------------------------------------------------------------------------

namespace {
// A row is its sequence and what the result reports of it.
struct Row : Sequence {
  bool done = false;
  StopReason reason = StopReason::MaxNewTokens;
  int64_t slides = 0;
  double ttft_s = 0;
  std::string text;  // released text

  Row(std::span<const int32_t> prompt, const GenerateOptions& o, uint64_t row,
      std::span<const int32_t> eog)
      : Sequence(prompt, o.sampling, row, o.stop, o.max_new_tokens, eog) {}
};
}  // namespace

// One generate_ids call: its rows, what each step does to them, and the loops that drive the
// model with a cache (prefill, then batched decode steps) or without one (recompute).
class Engine::Generation {
 public:
  Generation(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
             const GenerateOptions& opts);

  void prefill_cached(GenerationKVCache& cache);
  void decode_cached(GenerationKVCache& cache);
  void prefill_recompute();
  void decode_recompute();
  GenerationResult result(const std::vector<std::vector<int32_t>>& prompts);

  // What a row can make from a window of this many tokens: without --slide the context ends
  // it (the last sampled token is never fed), so a huge max_new reserves only that; with
  // --slide, reserving is capped and the vectors grow past it as usual.
  int64_t reachable(int64_t window) const {
    return opts_.slide ? std::min<int64_t>(opts_.max_new_tokens, int64_t{1} << 20)
                       : std::min(opts_.max_new_tokens, std::max<int64_t>(1, block_ - window + 1));
  }
  int64_t max_window() const { return max_window_; }
  GenerationStats& stats() { return result_.stats; }

 private:
  Row& row(int64_t r) { return rows_[static_cast<size_t>(r)]; }
  void release(int64_t r, std::string_view piece);
  void finish(int64_t r, StopReason why);
  // Samples row r's next token from its logits (V), appends it, streams its text.
  void take(int64_t r, const float* logits);
  // (1, T) of row's tokens[from:].
  Tensor window_tensor(const Row& row, int64_t from) const;
  void record_step(int64_t step, Clock::time_point t0, int64_t rows);
  // Samples the cache's utilisation and keeps its most bytes (and a paged cache's counts then).
  void observe(const GenerationKVCache& cache);

  Engine& engine_;
  const GenerateOptions& opts_;
  const int64_t block_, V_;
  const int64_t keep_;  // known tokens a slide re-prefills (the pending one follows)
  // A cached slide of a RoPE model drops the oldest drop_ positions instead (Engine::slide_drop).
  const int64_t drop_;
  const bool rolling_;
  std::vector<Row> rows_;
  int64_t max_window_ = 0;
  GenerationResult result_;
  Clock::time_point t_start_;
};

Engine::Engine(GPT& model, const Tokenizer& tokenizer, DType cache_dtype,
               std::optional<PagedCacheOptions> paged)
    : model_(model), tokenizer_(tokenizer), cache_dtype_(cache_dtype), paged_(paged),
      step_(model) {
  KVLAB_CHECK(tokenizer.vocab_size() == model.config().vocab_size, "engine: tokenizer has ",
              tokenizer.vocab_size(), " symbols, the model's vocab_size is ",
              model.config().vocab_size);
  const std::string problem = kv_dtype_problem(cache_dtype, model.config().cache_width());
  KVLAB_CHECK(problem.empty(), "engine: ", problem);
  KVLAB_CHECK(!is_quantised(cache_dtype) || model.device() == Device::CPU, "engine: KV cache dtype ",
              dtype_name(cache_dtype), " is CPU-only (on CUDA: f32 or bf16)");
  if (paged) {
    check_kv_block_size(paged->kv_block_size, model.config().block_size, "engine");
    KVLAB_CHECK(paged->pool_blocks >= 0 && paged->pool_bytes >= 0,
                "engine: the paged cache's pool size must not be negative");
    KVLAB_CHECK(model.device() == Device::CPU,
                "engine: the paged KV cache runs on the CPU only (the contiguous one on CUDA)");
  }
}

Engine::~Engine() = default;

std::vector<int32_t> Engine::encode(std::string_view text, std::string_view what) const {
  KVLAB_CHECK(!text.empty(), what, kEmptyPrompt);
  return tokenizer_.encode_prompt(text, what);
}

Tensor Engine::forward_cached(const Tensor& tokens, DecodeKVCache& cache, bool all_positions) {
  const Tensor host = tokens.to(Device::CPU).contiguous();
  cache.prepare({host.data<int32_t>(), static_cast<size_t>(host.numel())});
  if (all_positions) return model_.forward(tokens, &cache, false);
  return step_.applies(tokens) ? step_.forward(tokens, cache)
                               : model_.forward(tokens, &cache, true);
}

std::vector<float> Engine::cache_scales() const { return kv_cache_scales(model_, cache_dtype_); }

GenerationKVCache& Engine::cache_for(int64_t batch, int64_t capacity) {
  if (paged_) return paged_cache_for(batch, capacity);
  std::vector<float> scales = cache_scales();
  if (!cache_ || cache_batch_ != batch || cache_capacity_ != capacity || scales != cache_scales_) {
    cache_.reset();  // free first
    // The layout is fixed for the engine's life: only B and S vary.
    cache_ = std::make_unique<ContiguousKVCache>(kv_cache_layout(model_.config(), cache_dtype_),
                                                 batch, capacity, model_.device(), scales);
    cache_batch_ = batch;
    cache_capacity_ = capacity;
    cache_scales_ = std::move(scales);
  }
  cache_->reset();
  return *cache_;
}

// The parameters are summed in parallel: about a millisecond per 10 MB of weights here, taken
// once per generate call as DecodeStep::pack reads them.
uint64_t model_cache_key(const GPT& model) {
  const GPTConfig& c = model.config();
  uint64_t h = 0;
  for (const int64_t v : {c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.block_size, c.vocab_size})
    h = hash64(h, static_cast<uint64_t>(v));
  std::vector<Tensor> params;
  for (const Tensor& p : model.parameters()) params.push_back(p.to(Device::CPU).contiguous());
  std::vector<uint64_t> crc(params.size());
  const auto n = static_cast<int64_t>(params.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& t = params[static_cast<size_t>(i)];
    const size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
    crc[static_cast<size_t>(i)] =
        crc32_z(0, static_cast<const Bytef*>(t.raw_data()), bytes) ^ (uint64_t{bytes} << 32);
  }
  for (const uint64_t v : crc) h = hash64(h, v);
  return h;
}

GenerationKVCache& Engine::paged_cache_for(int64_t batch, int64_t capacity) {
  const KVCacheLayout layout = kv_cache_layout(model_.config(), cache_dtype_);
  const KVPoolSize size = kv_pool_size(*paged_, layout, batch, capacity);
  check_holds_one_sequence(size, capacity, paged_->kv_block_size, "engine");
  const uint64_t key = paged_->prefix_caching ? model_cache_key(model_) : 0;
  std::vector<float> scales = cache_scales();
  if (!blocks_ || key != model_key_ || scales != cache_scales_ ||
      (size.fixed ? blocks_->total_blocks() != size.blocks
                  : blocks_->total_blocks() < size.blocks)) {
    cache_.reset();  // free first: the new pools may take the same memory
    paged_cache_ = nullptr;
    blocks_.reset();
    KVPool pool = make_kv_pool(layout, *paged_, size.blocks, key, scales);
    blocks_ = std::move(pool.blocks);
    paged_cache_ = pool.cache.get();
    cache_ = std::move(pool.cache);
    model_key_ = key;
    cache_scales_ = std::move(scales);
  }
  paged_cache_->reset_rows(batch);
  return *cache_;
}

int64_t Engine::slide_drop() const {
  const int64_t block = model_.config().block_size;
  if (!model_.config().rope()) return 0;
  if (paged_) return 2 * paged_->kv_block_size <= block ? paged_->kv_block_size : 0;
  return std::min(PagedCacheOptions{}.kv_block_size, std::max<int64_t>(1, block / 2));
}

std::optional<BlockStats> Engine::block_stats() const {
  if (!blocks_) return std::nullopt;
  return blocks_->stats();
}

GenerationResult Engine::generate(const std::vector<std::string>& prompts,
                                  const GenerateOptions& options) {
  std::vector<std::vector<int32_t>> ids;
  ids.reserve(prompts.size());
  for (size_t b = 0; b < prompts.size(); ++b)
    ids.push_back(encode(
        prompts[b], prompt_name(static_cast<int64_t>(b), static_cast<int64_t>(prompts.size()))));
  return generate_ids(ids, options);
}

void Engine::validate(const std::vector<std::vector<int32_t>>& prompts,
                      const GenerateOptions& opts) const {
  opts.validate();
  KVLAB_CHECK(!prompts.empty(), "generate: no prompts");
  const int64_t block = model_.config().block_size, V = model_.config().vocab_size;
  const int64_t B = static_cast<int64_t>(prompts.size());
  for (int64_t b = 0; b < B; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    const std::string problem = prompt_problem(p, V, block, opts.slide);
    if (problem.empty()) continue;
    // When only its length is wrong (sliding would take it), say how to fix that.
    const bool only_length = prompt_problem(p, V, block, true).empty();
    KVLAB_CHECK(false, prompt_name(b, B), problem,
                only_length ? detail::cat(" (shorten it, or use --slide to keep its last ",
                                          std::max<int64_t>(1, block - 1), ")")
                            : std::string());
  }
}

Engine::Generation::Generation(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                               const GenerateOptions& opts)
    : engine_(engine),
      opts_(opts),
      block_(engine.model_.config().block_size),
      V_(engine.model_.config().vocab_size),
      keep_(block_ - 1),
      drop_(engine.slide_drop()),
      rolling_(opts.slide && opts.use_cache && drop_ > 0) {
  const int64_t prompt_keep = std::max<int64_t>(1, keep_);  // of a prompt longer than block
  const int64_t R = static_cast<int64_t>(prompts.size()) * opts.n;
  rows_.reserve(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const auto& p = prompts[static_cast<size_t>(r / opts.n)];
    const int64_t P = static_cast<int64_t>(p.size());
    Row& row = rows_.emplace_back(p, opts, static_cast<uint64_t>(r), engine.end_tokens(opts));
    row.window_start = P > block_ ? P - prompt_keep : 0;
    const int64_t room = reachable(P - row.window_start);
    row.tokens.reserve(static_cast<size_t>(P + room));
    row.text.reserve(static_cast<size_t>(room) * 2);
    max_window_ = std::max(max_window_, row.window_len());
  }
  int64_t min_window = max_window_;
  for (const Row& row : rows_) min_window = std::min(min_window, row.window_len());
  stats().step_s.reserve(static_cast<size_t>(reachable(min_window)));
  stats().step_rows.reserve(static_cast<size_t>(reachable(min_window)));
  t_start_ = Clock::now();
}

void Engine::Generation::release(int64_t r, std::string_view piece) {
  if (piece.empty()) return;
  row(r).text += piece;
  if (opts_.on_text) opts_.on_text(r, piece);
}

void Engine::Generation::finish(int64_t r, StopReason why) {
  Row& rw = row(r);
  if (rw.done) return;
  rw.done = true;
  rw.reason = why;
  release(r, rw.flush());
  if (opts_.on_finish) opts_.on_finish(r, rw.text, why);
}

void Engine::Generation::take(int64_t r, const float* logits) {
  Row& rw = row(r);
  const std::span<const float> l(logits, static_cast<size_t>(V_));
  if (opts_.on_logits) opts_.on_logits(r, rw.window(), l);
  rw.sample(l);
  if (rw.made == 1) rw.ttft_s = seconds(t_start_, Clock::now());
  release(r, rw.release_last(engine_.tokenizer_));
  // A full context ends the row, or slides it, before the next step's forward (decode_cached,
  // decode_recompute).
  const std::optional<StopReason> why = rw.stop_reason(block_);
  if (why && *why != StopReason::ContextLimit) finish(r, *why);
}

Tensor Engine::Generation::window_tensor(const Row& row, int64_t from) const {
  Tensor t = Tensor::empty({1, static_cast<int64_t>(row.tokens.size()) - from}, DType::I32);
  std::copy(row.tokens.begin() + from, row.tokens.end(), t.data<int32_t>());
  return t;
}

void Engine::Generation::record_step(int64_t step, Clock::time_point t0, int64_t rows) {
  stats().step_s.push_back(seconds(t0, Clock::now()));
  stats().step_rows.push_back(rows);
  if (opts_.on_decode_step) opts_.on_decode_step(step);
}

// Each prompt is prefilled once, into the row of its first sample, after whatever prefix the
// cache already holds for it; its other samples are forks of that row and sample their first
// token from the same logits. Runs of adjacent prefilled rows (so only when n = 1) with the
// same prefix and prompt lengths go through the model in one forward each.
void Engine::Generation::prefill_cached(GenerationKVCache& cache) {
  const int64_t R = static_cast<int64_t>(rows_.size()), N = opts_.n;
  std::vector<int64_t> hit(rows_.size(), 0);
  for (int64_t r = 0; r < R; r += N) {
    hit[static_cast<size_t>(r)] = cache.reuse_prefix(r, row(r).window());
    stats().prefix_hit_positions += hit[static_cast<size_t>(r)];
  }
  for (int64_t r0 = 0; r0 < R;) {
    const int64_t h = hit[static_cast<size_t>(r0)], P = row(r0).window_len(), T = P - h;
    int64_t r1 = r0 + 1;
    while (N == 1 && r1 < R && row(r1).window_len() == P && hit[static_cast<size_t>(r1)] == h)
      ++r1;
    Tensor tokens = Tensor::empty({r1 - r0, T}, DType::I32);
    for (int64_t r = r0; r < r1; ++r) {
      const auto w = row(r).window().subspan(static_cast<size_t>(h));
      std::copy(w.begin(), w.end(), tokens.data<int32_t>() + (r - r0) * T);
    }
    const Tensor logits =
        engine_.forward_cached(tokens, cache.rows(r0, r1 - r0)).to(Device::CPU);  // (n, 1, V)
    stats().prefill_positions += (r1 - r0) * T;
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = logits.data<float>() + (r - r0) * V_;
      take(r, l);
      for (int64_t i = 1; i < N; ++i) {
        cache.fork_row(r, r + i);
        take(r + i, l);
      }
    }
    r0 = r1 + N - 1;
  }
  observe(cache);
  stats().prefill_s = stats().ttft_s = seconds(t_start_, Clock::now());
}

void Engine::Generation::observe(const GenerationKVCache& cache) {
  const int64_t held = cache.positions_held(), bytes = cache.bytes();
  stats().utilisation.push_back(
      held > 0 ? static_cast<double>(cache.positions_stored()) / static_cast<double>(held) : 0.0);
  if (bytes > stats().cache_bytes || !stats().blocks) {
    stats().cache_bytes = std::max(stats().cache_bytes, bytes);
    stats().blocks = engine_.block_stats();
  }
}

// Cache row s holds row slot_row[s]; finished rows leave the batch.
void Engine::Generation::decode_cached(GenerationKVCache& cache) {
  std::vector<int64_t> slot_row(rows_.size());
  std::iota(slot_row.begin(), slot_row.end(), int64_t{0});
  auto compact = [&] {
    int64_t n = static_cast<int64_t>(slot_row.size());
    for (int64_t s = 0; s < n;) {
      if (!row(slot_row[static_cast<size_t>(s)]).done) {
        ++s;
        continue;
      }
      --n;
      if (s != n) {
        cache.move_row(n, s);
        slot_row[static_cast<size_t>(s)] = slot_row[static_cast<size_t>(n)];
      }
      slot_row.pop_back();
    }
    cache.truncate_batch(n);
  };
  compact();
  Tensor tokens;  // (n, 1), reused while the number of running rows stays the same
  for (int64_t step = 0; !slot_row.empty(); ++step) {
    const auto t0 = Clock::now();
    // A full cache: stop, or slide: drop the oldest positions with RoPE, else re-prefill the
    // last block_size - 1 known tokens; the pending token is then fed by the batched step
    // below like any other row's.
    for (size_t s = 0; s < slot_row.size(); ++s) {
      const int64_t r = slot_row[s];
      Row& rw = row(r);
      if (!rw.context_full(block_)) continue;
      if (!opts_.slide) {
        finish(r, StopReason::ContextLimit);
        continue;
      }
      ++rw.slides;
      if (rolling_) {  // RoPE: forget the oldest positions and go on from the cache
        cache.drop_front(static_cast<int64_t>(s), drop_);
        rw.window_start += drop_;
        continue;
      }
      const int64_t n_seq = static_cast<int64_t>(rw.tokens.size());
      rw.window_start = n_seq - 1 - keep_;
      cache.reset_row(static_cast<int64_t>(s));
      if (keep_ == 0) continue;  // block_size 1: nothing to re-prefill
      Tensor known = Tensor::empty({1, keep_}, DType::I32);
      std::copy(rw.tokens.end() - 1 - keep_, rw.tokens.end() - 1, known.data<int32_t>());
      engine_.forward_cached(known, cache.rows(static_cast<int64_t>(s), 1));
    }
    compact();
    if (slot_row.empty()) break;
    const int64_t n = static_cast<int64_t>(slot_row.size());
    if (!tokens.defined() || tokens.size(0) != n) tokens = Tensor::empty({n, 1}, DType::I32);
    int32_t* tp = tokens.data<int32_t>();
    for (int64_t s = 0; s < n; ++s) tp[s] = row(slot_row[static_cast<size_t>(s)]).tokens.back();
    const Tensor logits = engine_.forward_cached(tokens, cache).to(Device::CPU);  // (n, 1, V)
    const float* lp = logits.data<float>();
    for (int64_t s = 0; s < n; ++s) take(slot_row[static_cast<size_t>(s)], lp + s * V_);
    observe(cache);
    record_step(step, t0, n);
    compact();
  }
}

void Engine::Generation::prefill_recompute() {
  for (int64_t r = 0; r < static_cast<int64_t>(rows_.size()); ++r) {
    const Row& rw = row(r);
    const Tensor logits =
        engine_.model_.forward(window_tensor(rw, rw.window_start), nullptr, true).to(Device::CPU);
    take(r, logits.data<float>());
  }
  stats().prefill_s = stats().ttft_s = seconds(t_start_, Clock::now());
}

// Every step runs the model over each row's whole window: the same windows as the cached path.
void Engine::Generation::decode_recompute() {
  for (int64_t step = 0;; ++step) {
    const auto t0 = Clock::now();
    int64_t n = 0;
    for (int64_t r = 0; r < static_cast<int64_t>(rows_.size()); ++r) {
      Row& rw = row(r);
      if (rw.done) continue;
      if (rw.context_full(block_)) {
        if (!opts_.slide) {
          finish(r, StopReason::ContextLimit);
          continue;
        }
        rw.window_start = static_cast<int64_t>(rw.tokens.size()) - 1 - keep_;
        ++rw.slides;
      }
      const Tensor logits =
          engine_.model_.forward(window_tensor(rw, rw.window_start), nullptr, true).to(Device::CPU);
      take(r, logits.data<float>());
      ++n;
    }
    if (n == 0) break;
    record_step(step, t0, n);
  }
}

GenerationResult Engine::Generation::result(const std::vector<std::vector<int32_t>>& prompts) {
  GenerationStats& st = stats();
  st.total_s = seconds(t_start_, Clock::now());
  result_.rows.resize(rows_.size());
  for (size_t b = 0; b < rows_.size(); ++b) {
    Row& rw = rows_[b];
    RowResult& out = result_.rows[b];
    out.prompt = prompts[b / static_cast<size_t>(opts_.n)];
    out.tokens.assign(rw.tokens.begin() + rw.prompt_len, rw.tokens.end());
    out.text = std::move(rw.text);
    out.stop_reason = rw.reason;
    out.slides = rw.slides;
    out.ttft_s = rw.ttft_s;
    st.new_tokens += rw.made;
  }
  return std::move(result_);
}

GenerationResult Engine::generate_ids(const std::vector<std::vector<int32_t>>& prompts,
                                      const GenerateOptions& opts) {
  validate(prompts, opts);
  NoGradGuard no_grad;
  Generation gen(*this, prompts, opts);
  if (opts.use_cache) {
    const int64_t block = model_.config().block_size, max_window = gen.max_window();
    // Capacity: what the longest row can feed (the last sampled token is never fed), or the
    // whole context when sliding.
    const int64_t capacity =
        opts.slide ? block : std::min(block, max_window + std::min(opts.max_new_tokens, block) - 1);
    const int64_t positions = std::max<int64_t>(capacity, max_window);
    GenerationKVCache& cache = cache_for(static_cast<int64_t>(prompts.size()) * opts.n, positions);
    // Inside the timed call: its first token waits for the packing.
    const DecodeStep::PackGuard pack = step_.pack();
    gen.stats().cache_capacity = positions;
    gen.prefill_cached(cache);
    gen.decode_cached(cache);
  } else {
    gen.prefill_recompute();
    gen.decode_recompute();
  }
  return gen.result(prompts);
}

}  // namespace kvlab
