#include "infer/kv_pool.h"

#include <utility>

#include "platform/error.h"

namespace kvlab {

KVPoolSize kv_pool_size(const PagedCacheOptions& options, const KVCacheLayout& layout,
                        int64_t sequences, int64_t positions) {
  const int64_t bs = options.kv_block_size;
  KVPoolSize size;
  size.block_bytes = bs * kv_bytes_per_token(layout);
  size.per_sequence = (positions + bs - 1) / bs;
  size.fixed = options.pool_blocks > 0 || options.pool_bytes > 0;
  size.blocks = options.pool_blocks > 0  ? options.pool_blocks
                : options.pool_bytes > 0 ? options.pool_bytes / size.block_bytes
                                         : sequences * size.per_sequence;
  return size;
}

void check_kv_block_size(int64_t kv_block_size, int64_t context, std::string_view who) {
  const int64_t n = kv_block_size;
  KVLAB_CHECK(n >= 1 && (n & (n - 1)) == 0, who, ": kv_block_size ", n, " is not a power of two");
  KVLAB_CHECK(n <= context, who, ": kv_block_size ", n, " is larger than the context (", context,
              ")");
}

void check_holds_one_sequence(const KVPoolSize& size, int64_t positions, int64_t kv_block_size,
                              std::string_view who) {
  KVLAB_CHECK(size.holds_one_sequence(), who, ": a paged KV cache of ", size.blocks, " blocks (",
              size.blocks * size.block_bytes, " bytes) cannot hold one sequence of ", positions,
              " positions, which takes ", size.per_sequence, " blocks of ", kv_block_size,
              " positions (", size.block_bytes, " bytes each)");
}

KVPool make_kv_pool(const KVCacheLayout& layout, const PagedCacheOptions& options, int64_t blocks,
                    uint64_t model_key, std::vector<float> fp8_scales) {
  KVPool pool;
  pool.blocks = std::make_unique<BlockManager>(blocks, options.kv_block_size, model_key,
                                               options.prefix_caching);
  pool.cache = std::make_unique<PagedKVCache>(*pool.blocks, layout.n_layer, layout.n_kv_head,
                                              layout.head_size, layout.context, layout.dtype, 0,
                                              std::move(fp8_scales), layout.values_are_keys);
  return pool;
}

}  // namespace kvlab
