#pragma once
// The generation engine: prompts in, tokens out, through GPT::forward with a KV cache.
//
// Prefill: each prompt goes through the model in one forward pass (T = prompt length) that
// fills its cache row and yields the first token. Rows whose prompts have the same length and
// sit next to each other in the batch are prefilled together (one forward of (n, P) tokens);
// a row of a different length gets its own forward into its own cache row. Batching prompts
// of different lengths into one prefill would need left padding and a key mask the attention
// op does not have (its queries are bottom-right aligned per row), and would spend FLOPs on
// padding; per-row prefill costs the same FLOPs as the real tokens, only in smaller GEMMs.
//
// Decode: one batched forward per step with T = 1 over the rows still running; each row's
// position and keys continue from its own cache length (AttentionOptions::kv_lengths). On the
// CPU such a step (f32, no gradients) runs in the engine's DecodeStep, fused, rather than
// through GPT::forward op by op (infer/decode/decode_step.h); every other forward is the
// model's. A row stops on its own (max_new_tokens, a stop string, the context limit); finished
// rows leave the batch (the last running row's cache moves into the freed slot), so later steps
// do not spend time on them.
//
// Context limit: a model attends over at most block_size positions (the most its training
// saw). A row whose cache holds block_size positions has produced the token predicted from
// the last one and stops there (prompt + generated = block_size + 1 tokens), reason
// ContextLimit. With `slide` it goes on, in one of two ways:
//  - Learned positions: it resets its cache row, re-prefills its last block_size - 1 known
//    tokens there, and the pending token is fed at position block_size - 1 by the next
//    batched step, so every later token is predicted from the last block_size tokens at
//    positions 0 .. (as nanoGPT's crop does). Each token past the limit costs a prefill of
//    block_size - 1 tokens (O(block_size) projections, O(block_size^2) attention) instead of
//    one decode step: generation past the limit runs at prefill speed.
//  - RoPE, cached (where slide_drop() > 0): the row drops its oldest slide_drop() positions
//    (drop_front) and goes on from its cache, positions counting on past block_size.
//    Attention sees only the differences of rotated positions, so no key is recomputed: a
//    slide costs a few copies (none in the paged cache, which frees whole blocks). Every
//    token attends to the last block_size - slide_drop() + 1 to block_size positions (a
//    sliding window, as Mistral's); unlike a re-prefill, the keys and values kept were
//    computed while older tokens were still in view.
// Either way what lies before the window is forgotten. A prompt longer than block_size is an
// error unless `slide` is set, which keeps its last block_size - 1 tokens.
//
// use_cache = false recomputes the whole window at every step (one forward of the full
// sequence per row, no cache): the reference for the cache-on/off comparison and the tests.
// Both modes see the same windows, so with greedy sampling they produce the same text, but
// for RoPE models past the context with `slide`: recomputing has no cache to go on from, so
// it re-prefills (the learned positions' way), and the two then differ.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"
#include "infer/decode/decode_step.h"
#include "infer/kv_cache.h"
#include "infer/kv_pool.h"
#include "infer/paged_kv_cache.h"
#include "infer/sampler.h"
#include "infer/sequence.h"
#include "nn/gpt.h"

namespace kvlab {

// How errors name prompt b of B: "prompt", or "prompt 2" among several.
std::string prompt_name(int64_t b, int64_t B);
// Why the engine refuses prompt `ids` for a model of this vocabulary and context, as the end
// of a sentence that starts with the prompt's name (" is empty: ..."), or "" when it does not:
// empty, a token outside the vocabulary, or longer than block_size without sliding. Callers
// that generate only later (ablate, after training) check their prompts with it up front.
std::string prompt_problem(std::span<const int32_t> ids, int64_t vocab_size, int64_t block_size,
                           bool slide);

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  // Samples per prompt: prompt b's are rows b * n .. b * n + n - 1 of the result, each its
  // own row as if the prompt were given n times. The prompt is prefilled once and the other
  // samples are forks of that row (a paged cache shares its blocks, copy-on-write).
  int64_t n = 1;
  SamplingOptions sampling;  // row r draws from a Generator seeded hash64(seed, r)
  bool use_cache = true;
  bool slide = false;
  // A row stops once its text contains one of these; the stop string is not part of the text
  // (neither returned nor streamed: text that may begin a stop string is held back).
  std::vector<std::string> stop;
  // A row also stops at a token of the tokenizer's TokenControls::eog (its text not part of
  // the text), unless this is set (llama-server's ignore_eos; benchmarks set it).
  bool ignore_eos = false;

  // Streams each row's new text as it is made (row index, UTF-8 piece; a byte tokenizer may
  // split a character across pieces).
  std::function<void(int64_t row, std::string_view piece)> on_text;
  // Called before each sample with the tokens the model was conditioned on (the current
  // window, positions 0 ..) and the next-token logits (V). For tests; slows decoding.
  std::function<void(int64_t row, std::span<const int32_t> window, std::span<const float> logits)>
      on_logits;
  // Called once per row when it stops, with its whole generated text.
  std::function<void(int64_t row, std::string_view text, StopReason why)> on_finish;
  // Called after each decode step (step = 0, 1, ...) once its tokens are sampled.
  std::function<void(int64_t step)> on_decode_step;

  // Throws kvlab::Error naming the setting (max_new_tokens or n < 1, sampling, empty stop
  // string).
  void validate() const;
};

struct RowResult {
  std::vector<int32_t> prompt;  // the prompt's token ids, all of them (the same for its samples)
  std::vector<int32_t> tokens;  // generated token ids (including any that form a stop string)
  std::string text;             // decoded generated text, cut before a stop string
  StopReason stop_reason = StopReason::MaxNewTokens;
  int64_t slides = 0;  // slides past the context limit (re-prefills, or RoPE's drops)
  double ttft_s = 0;   // start of generate() until this row's first token
};

struct GenerationStats {
  double prefill_s = 0;            // every prompt through the model (and first tokens sampled)
  double ttft_s = 0;               // start until every row has its first token
  std::vector<double> step_s;      // each decode step (T = 1, all running rows)
  std::vector<int64_t> step_rows;  // rows each decode step advanced
  double total_s = 0;
  int64_t new_tokens = 0;      // over all rows
  // The most the cache held at once, measured from its allocations (0 without cache): all of
  // a contiguous cache, a paged cache's blocks in use at its fullest.
  int64_t cache_bytes = 0;
  int64_t cache_capacity = 0;  // positions a row may reach in this call (a contiguous cache's S)
  // The cache's utilisation (positions_stored / positions_held), sampled after the prefill
  // and after every decode step, and its mean over those samples.
  std::vector<double> utilisation;
  double utilisation_mean() const;
  int64_t prefill_positions = 0;     // prompt positions the prefill computed
  int64_t prefix_hit_positions = 0;  // prompt positions taken from the prefix cache instead
  // A paged cache's allocator counts when it held the most blocks.
  std::optional<BlockStats> blocks;

  double decode_s() const;
  // Tokens made by decode steps per second of decode time (excludes prefill).
  double decode_tokens_per_s() const;
  // All new tokens over the whole call, prefill included.
  double tokens_per_s() const;
  // Time per output token after the first: statistics of step_s (seconds; 0 when no steps).
  double tpot_mean_s() const;
  double tpot_quantile_s(double q) const;
};

struct GenerationResult {
  std::vector<RowResult> rows;
  GenerationStats stats;
};

// The model's identity for prefix-cache keys: its shapes and a CRC-32 of every parameter's
// bytes (a CRC sees any change of a few bytes).
uint64_t model_cache_key(const GPT& model);

class Engine {
 public:
  // The engine borrows both; the model should be in eval mode (load_model returns it so).
  // cache_dtype: f32, or bf16 (keys and values rounded to bf16 as they are stored: half the
  // cache memory and the bytes each decode step reads), on either device; or on the CPU fp8,
  // int8 or int4 (quantised as stored, platform/kv_rows.h; fp8 with fp8_kv_scales). paged: the paged
  // cache with these options, the default (the model must be on the CPU); none: the
  // contiguous one, which CUDA needs.
  Engine(GPT& model, const Tokenizer& tokenizer, DType cache_dtype = DType::F32,
         std::optional<PagedCacheOptions> paged = PagedCacheOptions{});
  ~Engine();

  // Encodes a prompt (after the tokenizer's BOS where it asks for one:
  // Tokenizer::encode_prompt); errors name it ("prompt") and list characters outside the
  // vocabulary.
  std::vector<int32_t> encode(std::string_view text, std::string_view what = "prompt") const;

  // The checks generate_ids() starts with: options, and each prompt non-empty, inside the
  // vocabulary and no longer than block_size unless sliding. Throws kvlab::Error.
  void validate(const std::vector<std::vector<int32_t>>& prompts,
                const GenerateOptions& options) const;

  GenerationResult generate(const std::vector<std::string>& prompts,
                            const GenerateOptions& options);
  GenerationResult generate_ids(const std::vector<std::vector<int32_t>>& prompts,
                                const GenerateOptions& options);

  // The cache of the last cached generate (kept and reused while batch and capacity fit);
  // null before one.
  const GenerationKVCache* cache() const { return cache_.get(); }
  // The paged cache's allocator: its counts now, between or during calls (none before the
  // first call, or with the contiguous cache).
  std::optional<BlockStats> block_stats() const;
  GPT& model() { return model_; }
  const GPT& model() const { return model_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  // The tokens a sequence generated with these options ends at: the tokenizer's eog, or none
  // with ignore_eos.
  std::span<const int32_t> end_tokens(const GenerateOptions& options) const {
    if (options.ignore_eos) return {};
    return tokenizer_.controls().eog;
  }
  DType cache_dtype() const { return cache_dtype_; }
  // The scales a cache of cache_dtype() takes from the model now: fp8_kv_scales for fp8,
  // none otherwise.
  std::vector<float> cache_scales() const;
  // The fused CPU decode step; decode_step().enabled = false runs every step op by op.
  DecodeStep& decode_step() { return step_; }
  const DecodeStep& decode_step() const { return step_; }
  // Positions a full cache row of a RoPE model drops to slide on: the paged cache's
  // kv_block_size (it frees whole blocks), else 16 (at most half the context); 0 where a slide
  // re-prefills instead: learned positions, or a paged cache whose blocks are more than half
  // the context (dropping one would leave too little of it).
  int64_t slide_drop() const;
  // One cached forward of tokens (B, T) -> the last position's logits (B, 1, V), as generate
  // runs each: the cache's prepare(), then through the decode step where it applies
  // (DecodeStep::applies), else through the model. all_positions: every position's logits
  // (B, T, V), through the model.
  Tensor forward_cached(const Tensor& tokens, DecodeKVCache& cache, bool all_positions = false);

 private:
  class Generation;
  // The one place that picks the cache implementation: the decode loop only uses the
  // GenerationKVCache calls.
  GenerationKVCache& cache_for(int64_t batch, int64_t capacity);
  GenerationKVCache& paged_cache_for(int64_t batch, int64_t capacity);

  GPT& model_;
  const Tokenizer& tokenizer_;
  DType cache_dtype_;
  std::optional<PagedCacheOptions> paged_;
  DecodeStep step_;
  std::unique_ptr<BlockManager> blocks_;  // the paged cache's; declared first, freed last
  std::unique_ptr<GenerationKVCache> cache_;
  PagedKVCache* paged_cache_ = nullptr;  // cache_, when it is the paged one
  int64_t cache_batch_ = 0, cache_capacity_ = 0;
  std::vector<float> cache_scales_;  // cache_'s fp8 scales: a cache is rebuilt when they change
  uint64_t model_key_ = 0;  // of the model the paged pool's blocks were computed by
};

}  // namespace kvlab
