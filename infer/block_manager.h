#pragma once
// The bookkeeping of a paged KV cache, without its memory. The cache's positions live in a
// pool of blocks of `block_size` positions; each sequence reaches its own through a block
// table (position p is in block table[p / block_size]). The manager says which blocks each
// sequence holds, how many holders each block has, which blocks are free, and which full
// blocks are kept after their last holder ended so that a later prompt beginning with the
// same tokens takes them instead of computing them again (prefix caching). It never touches
// keys or values: where a sequence is about to write into a block it shares, it hands the
// cache the copy to make first (copy-on-write). So it is tested on its own, over thousands of
// random operations.
//
// Invariants, after every call:
//  - a block's reference count is the number of table entries, over all sequences, naming it;
//  - every block is exactly one of: free, in use (count > 0), or cached (count 0, full, and
//    reachable by its prefix key, in least-recently-released order);
//  - positions [0, length) of a sequence are in blocks that hold them (`filled`), and a full
//    block is never written again, which is what makes sharing it safe.
#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace kvlab {

using SeqId = int64_t;
using BlockId = int32_t;

// Copy-on-write: before writing into block dst, the cache copies the first `positions`
// positions of src into it (every layer, K and V).
struct BlockCopy {
  BlockId src, dst;
  int64_t positions;
};

struct BlockStats {
  int64_t total = 0;
  int64_t free = 0;
  int64_t in_use = 0;  // held by at least one sequence
  int64_t cached = 0;  // held by none, kept for prefix hits (reclaimed when the pool runs dry)
  // Positions stored in the blocks in use, a shared block counted once: utilisation is
  // positions / (in_use * block_size).
  int64_t positions = 0;
  int64_t prefix_hit_blocks = 0;       // blocks taken from the prefix cache, since the start
  int64_t prefix_hit_positions = 0;    // positions those blocks spared a prefill
  int64_t evicted = 0;                 // cached blocks reclaimed for new ones
};

class BlockManager {
 public:
  // n_blocks blocks of block_size positions (a power of two). Prefix keys start from
  // model_key, so caches of different models never share a block; prefix_caching false keeps
  // no block after its last holder ends.
  BlockManager(int64_t n_blocks, int64_t block_size, uint64_t model_key, bool prefix_caching);

  int64_t block_size() const { return block_size_; }
  int64_t total_blocks() const { return static_cast<int64_t>(blocks_.size()); }

  // A new, empty sequence. Throws kvlab::Error if `id` is in use.
  void add(SeqId id);
  // A new sequence `child` sharing every block of `parent` that holds its positions, with its
  // length and tokens: the two diverge by copy-on-write.
  void fork(SeqId parent, SeqId child);
  // Ends a sequence. Each of its blocks loses a holder; one that has none left is free again
  // or, when it is full and keyed, cached.
  void free(SeqId id);

  // Prefix caching, for a new sequence `id` that holds nothing yet: takes the cached blocks
  // whose tokens are the first whole blocks of `prompt`, at most up to the prompt's last
  // token (which is left to compute: its logits are the ones wanted). Returns the positions
  // taken (a multiple of block_size); the sequence's length is that.
  int64_t take_prefix(SeqId id, std::span<const int32_t> prompt);

  // Blocks needed for `n` more positions of `id` beyond what it holds, counting the copy of a
  // shared last block.
  int64_t blocks_needed(SeqId id, int64_t n) const;
  // The same for every sequence of `ids` (distinct) reserving n more positions one after the
  // other: a shared last block that only these sequences hold is copied for all but the last
  // of them, which then writes it in place (n forks of one prompt decoding together).
  int64_t blocks_needed(std::span<const SeqId> ids, int64_t n) const;
  // Blocks that can be had now: free ones and cached ones (which are then reclaimed).
  int64_t blocks_available() const;
  // Makes room for positions [length, length + n) of `id`: the copies the cache must make
  // first (at most one, of a shared partly filled last block), or nullopt when the pool
  // cannot supply the blocks, in which case nothing changed.
  std::optional<std::vector<BlockCopy>> reserve(SeqId id, int64_t n);
  // Positions [length, length + tokens.size()) of `id` now hold these tokens' keys and values
  // (within what reserve made room for): its length grows, and each block this fills is
  // keyed for prefix caching.
  void commit(SeqId id, std::span<const int32_t> tokens);

  // Drops the first n_blocks blocks of `id`, all full: each loses a holder, and the sequence
  // holds the positions after them from its table's start (its length shrinks and its
  // offset grows by n_blocks * block_size). Blocks it fills from then on are not keyed: their
  // keys and values were computed in a window that had left the sequence's start behind, so
  // no prompt's prefix can take them.
  void drop_front(SeqId id, int64_t n_blocks);

  bool contains(SeqId id) const { return seqs_.count(id) != 0; }
  const std::vector<BlockId>& table(SeqId id) const;
  int64_t length(SeqId id) const;
  int64_t offset(SeqId id) const;  // positions drop_front dropped
  std::vector<SeqId> sequences() const;
  int ref_count(BlockId b) const;
  bool is_free(BlockId b) const;
  bool is_cached(BlockId b) const;
  BlockStats stats() const;

 private:
  struct Block {
    int ref = 0;
    int64_t filled = 0;         // positions written (block_size when full)
    std::optional<uint64_t> key;  // set once full and entered in keyed_
    uint64_t parent_key = 0;
    std::vector<int32_t> tokens;  // a keyed block's tokens: a key match is checked exactly
    std::list<BlockId>::iterator lru;  // its place in lru_ while cached
    bool free = true;
  };
  struct Sequence {
    std::vector<BlockId> table;
    int64_t length = 0;
    uint64_t last_key = 0;         // key of the last full block (model_key before any)
    std::vector<int32_t> pending;  // tokens of the partly filled last block
    int64_t offset = 0;
    bool keyed = true;  // false once it dropped blocks: what it fills then is not keyed
  };

  Sequence& seq(SeqId id);
  const Sequence& seq(SeqId id) const;
  BlockId allocate();  // a free block, else the least recently released cached one
  void release(BlockId b);
  uint64_t chain(uint64_t parent, std::span<const int32_t> tokens) const;
  // The cached or in-use block keyed `key` whose tokens and parent are these, if any.
  std::optional<BlockId> find(uint64_t key, uint64_t parent, std::span<const int32_t> tokens) const;

  int64_t block_size_;
  uint64_t model_key_;
  bool prefix_caching_;
  std::vector<Block> blocks_;
  std::vector<BlockId> free_;
  std::list<BlockId> lru_;  // cached blocks, least recently released first
  std::unordered_map<uint64_t, BlockId> keyed_;
  std::unordered_map<SeqId, Sequence> seqs_;
  int64_t hit_blocks_ = 0, hit_positions_ = 0, evicted_ = 0;
  // Kept as blocks change hands, so that stats() is O(1) (the server and the engine read it
  // every step): blocks with a holder, and the positions written in them.
  int64_t in_use_ = 0, positions_ = 0;
};

}  // namespace kvlab
