#pragma once
// How well a paged KV cache uses a fixed KV memory budget, against contiguous max-length
// preallocation (every sequence reserving the whole context up front) at the same memory. A
// documented synthetic serving workload runs through an iteration-level scheduler over either
// layout; the paged side is the real allocator (infer/block_manager.h), so its figures are the
// cache's own bookkeeping, not a model of it. There is no model compute: the memory a layout
// holds depends only on the requests' lengths and tokens, so the figures are exact and cheap.
// This backs `kvlab bench kv-memory` and the ablation report's per-n_kv_head memory column
// (fewer KV heads: fewer bytes per position, more positions in the same budget).
//
// The workload. With c = context (the model's block_size) and s = system_prompt, request i
// has a user part of u tokens and an output of o tokens per sample:
//   u = clamp(round(exp(N(ln(c / 8), 1))), 1, c - s - 1)
//   o = clamp(round(exp(N(ln(c / 6), 1))), 1, c - s - u)
// (log-normal, median c / 8 and c / 6 before clipping, so prompt + output <= c). Its prompt
// is the s system-prompt tokens, the same in every request, then u tokens uniform in
// [0, vocab_size); it asks for `samples` parallel samples, which share the prompt. Draws come
// from one Generator seeded with `seed`: first the system prompt's tokens, then per request
// the normal of u, the normal of o and u tokens. The same options make the same workload.
//
// The simulation. Every request is queued at step 0, served first come first served. A step:
//  1. admission: the queue's head is admitted, with all its samples, while the layout can
//     take it, then the next; the first one that does not fit ends admission for the step.
//     Admitting is the prefill: it stores the prompt (and, for a request preempted earlier,
//     each sample's tokens made so far) and makes each sample's next token;
//  2. decode: every sample admitted in an earlier step stores its last token (one position)
//     and makes the next;
//  3. the layout is sampled (KVStep), then every request whose samples have made
//     output_tokens tokens ends and frees its memory.
// So a sample holds prompt + k - 1 positions once it has made k tokens, prompt + output - 1
// at the end (its last token is never stored).
//
// Contiguous: budget / (context * bytes_per_position) slots; each sample takes a slot for its
// life and holds its own copy of the prompt (computed once per request, copied). A request is
// admitted while slots for all its samples are free; nothing is ever preempted.
//
// Paged: a BlockManager of budget / (kv_block_size * bytes_per_position) blocks. Admission
// adds a sequence, takes what the prefix cache has of the prompt (take_prefix), stores the
// rest and forks the other samples from it: the prompt's blocks are held once, a shared
// partly filled last block copied at a sample's first write into it. A request is admitted
// only while the pool can supply its blocks plus one block per sample of headroom (at most
// what it will hold at its longest). When a decode write cannot get a block, the most recently
// admitted running request is preempted, as vLLM does by recomputation: all its sequences are
// freed and it goes back to the queue's front, keeping the tokens its samples made (prefilled
// again with the prompt when it is readmitted). The oldest running request is never the one
// preempted unless it runs alone, and a request alone always fits (checked up front), so the
// queue always drains. The tokens samples make are a hash of (request, sample, position).
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "infer/block_manager.h"

namespace kvlab {

struct KVWorkloadOptions {
  int64_t requests = 256;
  int64_t context = 0;        // the model's block_size: lengths are scaled to it
  int64_t samples = 1;        // parallel samples per request; they share the prompt
  int64_t system_prompt = 0;  // tokens every prompt starts with, the same in every request
  // The fraction of requests whose prompt starts with the system prompt; the others' prompts
  // are their user tokens alone.
  double shared_fraction = 1.0;
  int64_t vocab_size = 65;
  uint64_t seed = 0;
  // Throws kvlab::Error naming the bad value.
  void validate() const;
};

struct KVRequest {
  std::vector<int32_t> prompt;
  int64_t output_tokens = 1;  // per sample, the first made by the prefill
  int64_t samples = 1;
};

// The workload described above; validates the options.
std::vector<KVRequest> make_kv_workload(const KVWorkloadOptions& options);

enum class KVLayout { Paged, Contiguous };

// The KV memory both layouts get, and how each cuts it up.
struct KVSimOptions {
  int64_t budget_bytes = 0;
  // K and V of one position over every layer: 2 * n_layer * n_kv_head * head_size * bytes of
  // the cache's dtype (1 makes the budget a count of positions).
  int64_t bytes_per_position = 0;
  int64_t context = 0;         // positions a sequence may reach: a contiguous slot's size
  int64_t kv_block_size = 16;  // positions per paged block, a power of two
  bool prefix_caching = true;  // paged: full prompt blocks kept and shared by token prefix

  int64_t blocks() const;  // the paged pool the budget buys
  int64_t slots() const;   // the contiguous slots it buys
  // Throws kvlab::Error naming the bad value.
  void validate() const;
};

// What a layout holds at one step, after its decode writes, before finished requests end.
struct KVStep {
  int64_t step = 0;
  int64_t resident = 0;          // sequences holding KV memory (each sample is one)
  int64_t positions_stored = 0;  // written positions, a shared block's counted once
  int64_t positions_held = 0;    // paged: blocks in use * kv_block_size; else slots * context
  // Paged: the allocator, to inspect, where sample s of request r (its index in the requests)
  // is sequence r * S + s, S the most samples of any request. Else null.
  const BlockManager* blocks = nullptr;
};

struct KVSimResult {
  int64_t steps = 0;  // until every request ended
  // positions_stored / positions_held, over the steps.
  double utilisation_mean = 0;
  double utilisation_min = 0;
  int64_t peak_resident = 0;  // sequences holding KV memory at once
  double mean_resident = 0;
  int64_t peak_positions_held = 0;  // paged: peak blocks in use = this / kv_block_size
  int64_t peak_bytes = 0;           // peak_positions_held * bytes_per_position
  int64_t preemptions = 0;          // requests preempted (paged only)
  // Positions prefills computed, recomputation after preemption included; prefix cache hits
  // are positions admitted prompts took from the prefix cache instead.
  int64_t prefill_positions = 0;
  int64_t prefix_hit_positions = 0;
  // Every admission's prompt length, summed, and how much the positions stored grew as the
  // prompt was stored for all the request's samples: stored / prompt is the copies of a
  // prompt held, 1 for paged without prefix sharing (at most 1 with it), `samples` for
  // contiguous.
  int64_t prompt_positions = 0;
  int64_t prompt_positions_stored = 0;
  BlockStats blocks_at_end;  // paged: the pool once every request ended; else zero
};

// Serves `requests` over one layout. on_step, if set, sees every step. Throws kvlab::Error if
// the options are bad, there are no requests, or a request is malformed (an empty prompt, no
// output or samples, prompt + output beyond the context) or cannot fit alone in the layout.
KVSimResult simulate_kv_cache(std::span<const KVRequest> requests, KVLayout layout,
                              const KVSimOptions& options,
                              const std::function<void(const KVStep&)>& on_step = {});

struct KVLayoutComparison {
  int64_t blocks = 0;  // options.blocks()
  int64_t slots = 0;   // options.slots()
  KVSimResult paged, contiguous;
};

// Both layouts over the same requests and the same budget.
KVLayoutComparison compare_kv_layouts(std::span<const KVRequest> requests,
                                      const KVSimOptions& options);

}  // namespace kvlab
