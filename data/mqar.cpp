#include "data/mqar.h"

#include <algorithm>
#include <numeric>

#include "platform/error.h"
#include "platform/random.h"

namespace kvlab {

void MqarSettings::validate(int64_t length) const {
  KVLAB_CHECK(vocab >= 4 && vocab <= 256, "mqar: --mqar-vocab must be in [4, 256], got ", vocab);
  KVLAB_CHECK(pairs >= 1 && pairs <= vocab / 2 - 1, "mqar: --mqar-pairs must be in [1, ",
              vocab / 2 - 1, "] (distinct keys of a vocabulary of ", vocab, "), got ", pairs);
  KVLAB_CHECK(train_examples >= 1 && val_examples >= 1,
              "mqar: --mqar-examples must be at least 1, got ", train_examples, " and ",
              val_examples, " (train, val)");
  KVLAB_CHECK(length >= 4 * static_cast<int64_t>(pairs) + 1, "mqar: an example of ", length,
              " tokens (block_size + 1) cannot hold ", pairs, " pairs and their queries (needs ",
              4 * static_cast<int64_t>(pairs) + 1, ": raise --block-size or lower --mqar-pairs)");
}

std::string MqarSettings::describe() const {
  return detail::cat("mqar(vocab=", vocab, ",pairs=", pairs, ",train=", train_examples,
                     ",val=", val_examples, ",seed=", seed, ")");
}

MqarStream make_mqar(const MqarSettings& s, int64_t length, int64_t examples, uint64_t seed) {
  s.validate(length);
  const auto N = static_cast<size_t>(s.pairs), L = static_cast<size_t>(length);
  const int keys = s.vocab / 2 - 1, values = s.vocab - s.vocab / 2;
  // Query slots: even offsets 2g into the region after the pairs whose answer (2g + 1) fits.
  const size_t slots = (L - 2 * N) / 2;
  MqarStream out;
  out.ids.assign(static_cast<size_t>(examples) * L, 0);
  out.targets.assign(out.ids.size(), -1);
  Generator gen(seed);
  std::vector<int32_t> key_pool(static_cast<size_t>(keys));
  std::vector<size_t> slot_pool(slots);
  for (size_t e = 0; e < static_cast<size_t>(examples); ++e) {
    int32_t* ids = out.ids.data() + e * L;
    int32_t* targets = out.targets.data() + e * L;
    // The pairs: the first N of a shuffled key pool, each with a random value.
    std::iota(key_pool.begin(), key_pool.end(), 1);
    std::vector<int32_t> value_of(static_cast<size_t>(s.vocab / 2), 0);
    for (size_t i = 0; i < N; ++i) {
      std::swap(key_pool[i], key_pool[i + gen.below(key_pool.size() - i)]);
      const int32_t value = s.vocab / 2 + static_cast<int32_t>(gen.below(values));
      ids[2 * i] = key_pool[i];
      ids[2 * i + 1] = value;
      value_of[static_cast<size_t>(key_pool[i])] = value;
    }
    // The queries: each key once, in the order of the pairs, at N distinct slots chosen at
    // random (a partial shuffle), so a key's distance to its pair varies.
    std::iota(slot_pool.begin(), slot_pool.end(), size_t{0});
    for (size_t i = 0; i < N; ++i) std::swap(slot_pool[i], slot_pool[i + gen.below(slots - i)]);
    std::vector<size_t> order(N);
    std::iota(order.begin(), order.end(), size_t{0});
    for (size_t i = 0; i + 1 < N; ++i) std::swap(order[i], order[i + gen.below(N - i)]);
    for (size_t i = 0; i < N; ++i) {
      const size_t at = 2 * N + 2 * slot_pool[i];
      const int32_t key = key_pool[order[i]];
      ids[at] = key;
      targets[at + 1] = value_of[static_cast<size_t>(key)];
    }
  }
  return out;
}

void check_mqar(const MqarSettings& s, int64_t length, const MqarStream& stream) {
  s.validate(length);
  const auto N = static_cast<size_t>(s.pairs), L = static_cast<size_t>(length);
  const int32_t half = s.vocab / 2;
  KVLAB_CHECK(stream.ids.size() == stream.targets.size() && stream.ids.size() % L == 0,
              "mqar: ", stream.ids.size(), " ids and ", stream.targets.size(),
              " targets are not whole examples of ", L, " tokens");
  for (size_t e = 0; e * L < stream.ids.size(); ++e) {
    const int32_t* ids = stream.ids.data() + e * L;
    const int32_t* targets = stream.targets.data() + e * L;
    const auto bad = [&](size_t pos, const std::string& what) {
      throw Error(detail::cat("mqar: example ", e, " position ", pos, ": ", what));
    };
    std::vector<int32_t> value_of(static_cast<size_t>(half), -1);
    for (size_t i = 0; i < N; ++i) {
      const int32_t key = ids[2 * i], value = ids[2 * i + 1];
      if (key < 1 || key >= half)
        bad(2 * i, detail::cat("key ", key, " is not in [1, ", half, ")"));
      if (value < half || value >= s.vocab)
        bad(2 * i + 1, detail::cat("value ", value, " is not in [", half, ", ", s.vocab, ")"));
      if (value_of[static_cast<size_t>(key)] >= 0) bad(2 * i, detail::cat("key ", key, " repeats"));
      value_of[static_cast<size_t>(key)] = value;
      if (targets[2 * i] != -1 || targets[2 * i + 1] != -1) bad(2 * i, "a pair is scored");
    }
    std::vector<bool> queried(static_cast<size_t>(half), false);
    size_t answers = 0;
    for (size_t pos = 2 * N; pos < L; ++pos) {
      const int32_t id = ids[pos];
      if (id == 0) {
        const bool answer = pos > 2 * N && ids[pos - 1] != 0;
        if (!answer && targets[pos] != -1) bad(pos, "a filler that answers no query is scored");
        continue;
      }
      if (id >= half || value_of[static_cast<size_t>(id)] < 0)
        bad(pos, detail::cat("query ", id, " is no key of the example"));
      if (queried[static_cast<size_t>(id)]) bad(pos, detail::cat("key ", id, " is queried twice"));
      if ((pos - 2 * N) % 2 != 0) bad(pos, "a query at an odd offset");
      if (targets[pos] != -1) bad(pos, "a query is scored");
      if (pos + 1 >= L || ids[pos + 1] != 0 ||
          targets[pos + 1] != value_of[static_cast<size_t>(id)])
        bad(pos + 1, detail::cat("the answer to key ", id, " is not its value ",
                                 value_of[static_cast<size_t>(id)]));
      queried[static_cast<size_t>(id)] = true;
      ++answers;
    }
    if (answers != N) bad(L - 1, detail::cat(answers, " of ", N, " keys are queried"));
  }
}

Corpus mqar_corpus(const MqarSettings& s, int64_t block_size) {
  const int64_t length = block_size + 1;
  s.validate(length);
  // Two streams of one seed: the validation examples are not the training ones.
  MqarStream train = make_mqar(s, length, s.train_examples, s.seed * 2);
  MqarStream val = make_mqar(s, length, s.val_examples, s.seed * 2 + 1);
  Corpus c{Tokenizer::byte_level(), std::move(train.ids), std::move(val.ids),
           s.describe() + detail::cat(",length=", length), 0};
  c.content_hash = fnv1a64(c.path);
  c.val_bytes = static_cast<int64_t>(c.val.size());
  c.train_targets = std::move(train.targets);
  c.val_targets = std::move(val.targets);
  c.example_tokens = length;
  return c;
}

}  // namespace kvlab
