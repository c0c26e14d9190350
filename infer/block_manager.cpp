#include "infer/block_manager.h"

#include <algorithm>
#include <unordered_map>

#include "platform/error.h"

namespace kvlab {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

BlockManager::BlockManager(int64_t n_blocks, int64_t block_size, uint64_t model_key,
                           bool prefix_caching)
    : block_size_(block_size), model_key_(model_key), prefix_caching_(prefix_caching) {
  KVLAB_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "paged KV cache: the KV block size must be a power of two, not ", block_size);
  KVLAB_CHECK(n_blocks > 0 && n_blocks <= INT32_MAX,
              "paged KV cache: the pool must have 1 to 2^31 - 1 blocks, not ", n_blocks);
  blocks_.resize(static_cast<size_t>(n_blocks));
  free_.reserve(blocks_.size());
  // Handed out from the back: block 0 first.
  for (int64_t b = n_blocks; b-- > 0;) free_.push_back(static_cast<BlockId>(b));
}

BlockManager::Sequence& BlockManager::seq(SeqId id) {
  const auto it = seqs_.find(id);
  KVLAB_CHECK(it != seqs_.end(), "paged KV cache: no sequence ", id);
  return it->second;
}

const BlockManager::Sequence& BlockManager::seq(SeqId id) const {
  const auto it = seqs_.find(id);
  KVLAB_CHECK(it != seqs_.end(), "paged KV cache: no sequence ", id);
  return it->second;
}

void BlockManager::add(SeqId id) {
  KVLAB_CHECK(!contains(id), "paged KV cache: sequence ", id, " exists already");
  Sequence s;
  s.last_key = model_key_;
  seqs_.emplace(id, std::move(s));
}

void BlockManager::fork(SeqId parent, SeqId child) {
  KVLAB_CHECK(!contains(child), "paged KV cache: sequence ", child, " exists already");
  Sequence c = seq(parent);
  // Blocks reserved past the parent's length are its own: the child has not written there.
  c.table.resize(static_cast<size_t>((c.length + block_size_ - 1) / block_size_));
  for (const BlockId b : c.table) ++blocks_[static_cast<size_t>(b)].ref;
  seqs_.emplace(child, std::move(c));
}

void BlockManager::free(SeqId id) {
  for (const BlockId b : seq(id).table) release(b);
  seqs_.erase(id);
}

void BlockManager::release(BlockId b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  KVLAB_ASSERT(blk.ref > 0, "block ", b, " released with no holder");
  if (--blk.ref > 0) return;
  --in_use_;
  positions_ -= blk.filled;
  if (blk.key) {
    blk.lru = lru_.insert(lru_.end(), b);
  } else {
    blk.filled = 0;
    blk.free = true;
    free_.push_back(b);
  }
}

BlockId BlockManager::allocate() {
  BlockId b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    KVLAB_ASSERT(!lru_.empty(), "no block to allocate");
    b = lru_.front();
    lru_.pop_front();
    Block& old = blocks_[static_cast<size_t>(b)];
    keyed_.erase(*old.key);
    old.key.reset();
    old.tokens.clear();
    ++evicted_;
  }
  Block& blk = blocks_[static_cast<size_t>(b)];
  blk.ref = 1;
  blk.filled = 0;
  blk.free = false;
  ++in_use_;
  return b;
}

uint64_t BlockManager::chain(uint64_t parent, std::span<const int32_t> tokens) const {
  uint64_t h = mix(parent ^ 0x6b766c6162ULL);
  for (const int32_t t : tokens) h = mix(h ^ static_cast<uint32_t>(t));
  return h;
}

std::optional<BlockId> BlockManager::find(uint64_t key, uint64_t parent,
                                          std::span<const int32_t> tokens) const {
  const auto it = keyed_.find(key);
  if (it == keyed_.end()) return std::nullopt;
  const Block& blk = blocks_[static_cast<size_t>(it->second)];
  if (blk.parent_key != parent || !std::equal(tokens.begin(), tokens.end(), blk.tokens.begin(),
                                              blk.tokens.end()))
    return std::nullopt;
  return it->second;
}

int64_t BlockManager::take_prefix(SeqId id, std::span<const int32_t> prompt) {
  Sequence& s = seq(id);
  KVLAB_CHECK(s.length == 0 && s.table.empty(), "paged KV cache: sequence ", id,
              " holds positions already; a prefix is taken before anything else");
  if (!prefix_caching_ || prompt.empty()) return 0;
  const int64_t whole = static_cast<int64_t>(prompt.size() - 1) / block_size_;
  for (int64_t i = 0; i < whole; ++i) {
    const auto tokens = prompt.subspan(static_cast<size_t>(i * block_size_),
                                       static_cast<size_t>(block_size_));
    const uint64_t key = chain(s.last_key, tokens);
    const std::optional<BlockId> b = find(key, s.last_key, tokens);
    if (!b) break;
    Block& blk = blocks_[static_cast<size_t>(*b)];
    if (blk.ref == 0) {
      lru_.erase(blk.lru);
      ++in_use_;
      positions_ += blk.filled;
    }
    ++blk.ref;
    s.table.push_back(*b);
    s.length += block_size_;
    s.last_key = key;
    ++hit_blocks_;
    hit_positions_ += block_size_;
  }
  return s.length;
}

int64_t BlockManager::blocks_needed(SeqId id, int64_t n) const {
  KVLAB_CHECK(n >= 0, "paged KV cache: cannot make room for ", n, " positions");
  const Sequence& s = seq(id);
  const int64_t held = static_cast<int64_t>(s.table.size());
  int64_t need = std::max<int64_t>(0, (s.length + n + block_size_ - 1) / block_size_ - held);
  const int64_t at = s.length / block_size_;
  if (n > 0 && s.length % block_size_ != 0 &&
      blocks_[static_cast<size_t>(s.table[static_cast<size_t>(at)])].ref > 1)
    ++need;  // the shared last block is copied before it is written
  return need;
}

int64_t BlockManager::blocks_needed(std::span<const SeqId> ids, int64_t n) const {
  int64_t need = 0;
  std::unordered_map<BlockId, int> shared;  // shared last blocks: holders among ids
  for (const SeqId id : ids) {
    need += blocks_needed(id, n);
    const Sequence& s = seq(id);
    if (n > 0 && s.length % block_size_ != 0) {
      const BlockId b = s.table[static_cast<size_t>(s.length / block_size_)];
      if (blocks_[static_cast<size_t>(b)].ref > 1) ++shared[b];
    }
  }
  for (const auto& [b, holders] : shared)
    if (holders == blocks_[static_cast<size_t>(b)].ref) --need;
  return need;
}

int64_t BlockManager::blocks_available() const {
  return static_cast<int64_t>(free_.size() + lru_.size());
}

std::optional<std::vector<BlockCopy>> BlockManager::reserve(SeqId id, int64_t n) {
  if (blocks_needed(id, n) > blocks_available()) return std::nullopt;
  Sequence& s = seq(id);
  std::vector<BlockCopy> copies;
  const int64_t within = s.length % block_size_;
  if (n > 0 && within != 0) {
    BlockId& last = s.table[static_cast<size_t>(s.length / block_size_)];
    if (blocks_[static_cast<size_t>(last)].ref > 1) {
      const BlockId copy = allocate();
      blocks_[static_cast<size_t>(copy)].filled = within;
      positions_ += within;
      copies.push_back({last, copy, within});
      release(last);
      last = copy;
    }
  }
  while (static_cast<int64_t>(s.table.size()) * block_size_ < s.length + n)
    s.table.push_back(allocate());
  return copies;
}

void BlockManager::commit(SeqId id, std::span<const int32_t> tokens) {
  Sequence& s = seq(id);
  const int64_t n = static_cast<int64_t>(tokens.size());
  KVLAB_CHECK(s.length + n <= static_cast<int64_t>(s.table.size()) * block_size_,
              "paged KV cache: sequence ", id, " commits ", n, " positions at ", s.length,
              " but holds room for ", static_cast<int64_t>(s.table.size()) * block_size_);
  for (const int32_t t : tokens) {
    const BlockId b = s.table[static_cast<size_t>(s.length / block_size_)];
    Block& blk = blocks_[static_cast<size_t>(b)];
    KVLAB_ASSERT(blk.ref == 1, "block ", b, " written while shared");
    positions_ += s.length % block_size_ + 1 - blk.filled;
    blk.filled = s.length % block_size_ + 1;
    ++s.length;
    s.pending.push_back(t);
    if (static_cast<int64_t>(s.pending.size()) < block_size_) continue;
    const uint64_t key = chain(s.last_key, s.pending);
    if (prefix_caching_ && s.keyed && !blk.key && keyed_.count(key) == 0) {
      blk.key = key;
      blk.parent_key = s.last_key;
      blk.tokens = s.pending;
      keyed_.emplace(key, b);
    }
    s.last_key = key;
    s.pending.clear();
  }
}

const std::vector<BlockId>& BlockManager::table(SeqId id) const { return seq(id).table; }

int64_t BlockManager::length(SeqId id) const { return seq(id).length; }

int64_t BlockManager::offset(SeqId id) const { return seq(id).offset; }

void BlockManager::drop_front(SeqId id, int64_t n_blocks) {
  Sequence& s = seq(id);
  const int64_t n = n_blocks * block_size_;
  KVLAB_CHECK(n_blocks >= 1 && n <= s.length, "paged KV cache: sequence ", id, " holds ",
              s.length, " positions, cannot drop ", n_blocks, " blocks of ", block_size_);
  for (int64_t i = 0; i < n_blocks; ++i) release(s.table[static_cast<size_t>(i)]);
  s.table.erase(s.table.begin(), s.table.begin() + n_blocks);
  s.length -= n;
  s.offset += n;
  s.keyed = false;
}

std::vector<SeqId> BlockManager::sequences() const {
  std::vector<SeqId> ids;
  ids.reserve(seqs_.size());
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

int BlockManager::ref_count(BlockId b) const { return blocks_.at(static_cast<size_t>(b)).ref; }

bool BlockManager::is_free(BlockId b) const { return blocks_.at(static_cast<size_t>(b)).free; }

bool BlockManager::is_cached(BlockId b) const {
  const Block& blk = blocks_.at(static_cast<size_t>(b));
  return !blk.free && blk.ref == 0;
}

BlockStats BlockManager::stats() const {
  BlockStats st;
  st.total = total_blocks();
  st.free = static_cast<int64_t>(free_.size());
  st.cached = static_cast<int64_t>(lru_.size());
  st.in_use = in_use_;
  st.positions = positions_;
  st.prefix_hit_blocks = hit_blocks_;
  st.prefix_hit_positions = hit_positions_;
  st.evicted = evicted_;
  return st;
}

}  // namespace kvlab
