#pragma once
// Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"): a synthetic task that
// only a model able to look things up in its context can solve, the in-context recall that
// fewer KV heads are feared to cost. Each example is `pairs` key-value pairs, then a region of
// filler in which every key appears once more, in a random order at random even offsets; the
// model must predict the key's value right after it. Only those answers are scored.
//
// Tokens: 0 is the filler, keys are [1, vocab / 2) (distinct within an example), values are
// [vocab / 2, vocab) (drawn with replacement). As in Zoology, the answer's own position holds
// filler in the input: the value is only ever seen beside its key at the start.
#include <cstdint>
#include <string>
#include <vector>

#include "data/corpus.h"

namespace kvlab {

struct MqarSettings {
  // The defaults are learnt to near-perfect accuracy within the ablation's 600 steps by the
  // model --task mqar defaults to (apps/train_flags.cpp); more pairs or keys make it harder.
  int vocab = 32;  // the task's tokens; at most 256 (the byte-level vocabulary carries them)
  int pairs = 4;   // key-value pairs per example, each queried once
  int64_t train_examples = 20000, val_examples = 2000;
  uint64_t seed = 0;  // the data's: every run and variant of a sweep sees the same examples
  // Throws naming the setting: vocab in [4, 256], pairs in [1, vocab / 2 - 1] (distinct keys),
  // examples >= 1, and an example of `length` tokens holds the pairs and their queries
  // (length >= 4 * pairs + 1).
  void validate(int64_t length) const;
  // "mqar(vocab=64,pairs=8,train=20000,val=2000,seed=0)": the corpus's name in messages.
  std::string describe() const;
};

// Examples laid end to end: ids, and per token the id it must be predicted as (its answer)
// or -1 where the loss does not score it.
struct MqarStream {
  std::vector<int32_t> ids, targets;
};

// `examples` examples of `length` tokens each, a pure function of the arguments.
MqarStream make_mqar(const MqarSettings& s, int64_t length, int64_t examples, uint64_t seed);

// Throws naming the first example and position that breaks the layout above: a token out of
// its range, a repeated key, a query of no key or twice, an answer that is not its key's value,
// a scored position that is not an answer, or an example without every key queried.
void check_mqar(const MqarSettings& s, int64_t length, const MqarStream& stream);

// The task as a Corpus: byte-level tokenizer, examples of block_size + 1 tokens (one window
// each: Corpus::example_tokens), the training and validation splits from two streams of
// s.seed, targets scoring the answers only; content_hash is of the settings.
Corpus mqar_corpus(const MqarSettings& s, int64_t block_size);

}  // namespace kvlab
