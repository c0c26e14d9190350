#pragma once
// Continuous batching: requests join the running batch at any step and leave it as they end
// (iteration-level scheduling, as in Orca), over the engine's model and a paged KV cache of
// the scheduler's own. Each step() runs, in this order:
//  1. decode: one batched forward (T = 1; on the CPU the fused DecodeStep) of every running
//     sequence, each sampling its next token. When the pool cannot give the sequences the
//     blocks for their next position, the most recently admitted request is preempted: its
//     blocks are freed and it returns to the front of the queue, keeping its tokens and its
//     sampler's state, so that prefilling it again (prompt and tokens made) continues with
//     the same output;
//  2. prefill: with what the step's token budget (max_batch_tokens) leaves after the decodes,
//     chunks of the waiting prompts, first come first served; a prompt longer than the budget
//     is prefilled over several steps (chunked prefill). A request is admitted while fewer
//     than max_seqs are admitted and the pool has the blocks of its chunk; it first takes the
//     whole blocks the prefix cache holds of its tokens. Its last chunk's logits give its
//     first token, and it decodes from the next step.
// That is the continuous policy. The static one runs the same loop as static batching does:
// it admits a batch only when none is running (every waiting request, up to max_seqs, that
// the pool has the blocks for), prefills its prompts whole in that step, and then decodes it
// until its last request ends; requests that arrive meanwhile wait for the next batch.
//
// A request is one sequence: n samples of a prompt are n requests, and all but the first to
// be prefilled take the prompt's whole blocks from the prefix cache. A request may also ask
// for log-probabilities (the OpenAI completions API's logprobs and echo), or for no token at
// all (max_new_tokens 0: the prompt's log-probabilities alone).
//
// The engine's weights must not change while a scheduler lives: it holds the decode step's
// packed weights (DecodeStep::pack) and keys the prefix cache by the weights it began with.
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "infer/block_manager.h"
#include "infer/engine.h"
#include "infer/paged_kv_cache.h"
#include "infer/sampler.h"

namespace kvlab {

using RequestId = int64_t;

// When requests join the running batch (above).
enum class BatchPolicy { Continuous, Static };
const char* batch_policy_name(BatchPolicy p);  // "continuous", "static"

struct SchedulerOptions {
  BatchPolicy policy = BatchPolicy::Continuous;
  int64_t max_seqs = 64;            // requests admitted at once (prefilling or decoding)
  // Positions a step computes: 1 a decode, a chunk's length. The static policy prefills a
  // batch's prompts whole, over this.
  int64_t max_batch_tokens = 512;
  // The pool (kv_block_size, pool_blocks or pool_bytes; prefix_caching). With neither size
  // given: room for max_seqs sequences of the whole context.
  PagedCacheOptions cache;
};

// What a request asks beyond its GenerateOptions.
struct RequestExtras {
  // Its sampler draws the stream hash64(seed, sample): sample i equals row i of
  // Engine::generate given this prompt alone with n > i.
  int64_t sample = 0;
  // >= 0: each token made comes with its log-probability and the top_logprobs most probable.
  int64_t top_logprobs = -1;
  // Every prompt position after the first comes with its log-probability (and top_logprobs
  // alternatives, when >= 0). The prompt is then prefilled whole: the prefix cache's blocks
  // hold keys and values, not the logits these need.
  bool prompt_logprobs = false;
};

// What a step did to one request: its new text (may be empty: a token can end inside a
// character, or begin a stop string), and whether it ended.
struct SchedulerEvent {
  RequestId request = 0;
  int32_t token = -1;  // the token made, or -1 when none was (an abort)
  std::string text;
  bool finished = false;
  StopReason reason = StopReason::MaxNewTokens;
  std::optional<TokenLogprob> logprob;  // of `token`, when the request asked (top_logprobs >= 0)
  // With prompt_logprobs: positions 1 .. prompt length - 1, in the request's first event.
  std::vector<TokenLogprob> prompt_logprobs;
};

struct SchedulerStepStats {
  int64_t decode_rows = 0;     // sequences the decode forward advanced
  int64_t prefill_tokens = 0;  // prompt positions the prefill chunks computed
  int64_t preempted = 0;       // requests preempted in this step
  int64_t admitted = 0;        // requests admitted (prefilling or decoding) after the step
  int64_t waiting = 0;         // requests queued after the step
};

class Scheduler {
 public:
  // Borrows the engine (its model, tokenizer, cache dtype and decode step) for its life.
  // Throws kvlab::Error naming a bad option or a pool too small for one sequence of the
  // whole context.
  Scheduler(Engine& engine, SchedulerOptions options);
  ~Scheduler();

  // Queues a request. Its options: max_new_tokens (0: the prefill alone, which ends it),
  // sampling, stop strings; n must be 1, slide off and the cache on. Throws kvlab::Error as
  // Engine::validate does, and for those.
  RequestId add(std::vector<int32_t> prompt, const GenerateOptions& options,
                const RequestExtras& extras = {});
  // Ends a request wherever it is, freeing its blocks; an event says so at the next step. A
  // request that already ended is ignored.
  void abort(RequestId id);
  // True when no request is queued or admitted (events of aborts may still be pending).
  bool idle() const;
  // One iteration (above). The events of every request it advanced or ended.
  std::vector<SchedulerEvent> step();

  const SchedulerStepStats& last_step() const { return last_; }
  int64_t admitted() const { return static_cast<int64_t>(admitted_.size()); }
  int64_t waiting() const { return static_cast<int64_t>(waiting_.size()); }
  BlockStats block_stats() const { return blocks_->stats(); }
  int64_t preemptions() const { return preemptions_; }

 private:
  struct Request;
  void preempt(Request& r);
  void finish(Request& r, StopReason why, std::vector<SchedulerEvent>& events);
  // Samples r's next token from logits (V) and reports it; ends r when it is done.
  void take(Request& r, const float* logits, std::vector<SchedulerEvent>& events);
  // Keeps the prompt log-probabilities that a prefill chunk's logits (chunk, V) give: those
  // of positions done + 1 .. done + chunk that lie in the prompt.
  void note_prompt(Request& r, const float* logits, int64_t done, int64_t chunk);
  void decode(std::vector<SchedulerEvent>& events);
  void prefill(int64_t budget, std::vector<SchedulerEvent>& events);
  Request* find(RequestId id);

  Engine& engine_;
  SchedulerOptions options_;
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<PagedKVCache> cache_;
  DecodeStep::PackGuard pack_;
  std::vector<std::unique_ptr<Request>> admitted_;  // in admission order
  std::deque<std::unique_ptr<Request>> waiting_;
  std::vector<SchedulerEvent> aborted_;  // reported by the next step
  RequestId next_id_ = 0;
  int64_t preemptions_ = 0;
  SchedulerStepStats last_;
};

}  // namespace kvlab
