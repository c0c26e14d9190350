#pragma once
// The paged KV pool of the Engine and the Scheduler: its size, as PagedCacheOptions ask for
// it, and the BlockManager and PagedKVCache it is made of, built in one place for both.
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "infer/block_manager.h"
#include "infer/kv_cache.h"
#include "infer/paged_kv_cache.h"

namespace kvlab {

// The paged KV cache (infer/paged_kv_cache.h) instead of the contiguous one: blocks of
// kv_block_size positions from a pool, taken as rows grow and handed back as they finish. CPU
// only. The pool: pool_blocks blocks, else as many as fit in pool_bytes, else (both 0) enough
// for every row of the call to reach its capacity, so that generation never runs out and
// behaves as with the contiguous cache (a pool sized so is kept while later calls fit in it).
// A pool too small for one sequence of the call is a kvlab::Error before anything runs;
// running out during a call is a kvlab::Error that names the pool, and the engine stays usable.
//
// The pool lives as long as the engine, and with prefix_caching the full blocks of ended
// sequences stay there (until their blocks are needed), so a later prompt that begins with
// the same tokens, in this call or a later one, takes them instead of computing them. Their
// key begins with a hash of the model's configuration and weights, taken at each call: a
// model whose weights changed never reads another's keys and values.
struct PagedCacheOptions {
  int64_t kv_block_size = 16;  // a power of two, at most the model's block_size
  int64_t pool_blocks = 0;
  int64_t pool_bytes = 0;
  bool prefix_caching = true;
};

// A pool's size: its blocks of kv_block_size positions, block_bytes each, and the blocks one
// sequence of the positions asked for takes.
struct KVPoolSize {
  int64_t blocks = 0;
  int64_t block_bytes = 0;
  int64_t per_sequence = 0;
  bool fixed = false;  // set by pool_blocks or pool_bytes, not by the sequences asked for
  bool holds_one_sequence() const { return blocks >= per_sequence; }
};
// The pool `options` ask for, for caches of `layout`: pool_blocks blocks, else as many as fit
// in pool_bytes, else room for `sequences` sequences of `positions` each.
KVPoolSize kv_pool_size(const PagedCacheOptions& options, const KVCacheLayout& layout,
                        int64_t sequences, int64_t positions);

// kvlab::Error, naming `who`, unless kv_block_size is a power of two of at most the context.
void check_kv_block_size(int64_t kv_block_size, int64_t context, std::string_view who);
// kvlab::Error, naming `who`, when the pool cannot hold one sequence of `positions`: its blocks
// and bytes, and what the sequence takes.
void check_holds_one_sequence(const KVPoolSize& size, int64_t positions, int64_t kv_block_size,
                              std::string_view who);

struct KVPool {
  std::unique_ptr<BlockManager> blocks;  // declared first, freed last
  std::unique_ptr<PagedKVCache> cache;
};
// A pool of `blocks` blocks of options.kv_block_size positions and a cache of `layout` over
// it whose rows may reach the whole context: the pool, not the cache, bounds what rows take.
// model_key: of the model that computes the blocks, keying them with options.prefix_caching.
KVPool make_kv_pool(const KVCacheLayout& layout, const PagedCacheOptions& options, int64_t blocks,
                    uint64_t model_key, std::vector<float> fp8_scales);

}  // namespace kvlab
