#pragma once
// What the trainer tests share: a small synthetic corpus (no dependency on shared data), a
// tiny GQA config, and a run that records every step.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "train/trainer.h"

namespace kvlab::testing {

inline void write_tiny_corpus(const std::filesystem::path& dir) {
  std::ofstream f(dir / "corpus.txt");
  for (int i = 0; i < 400; ++i) f << "the quick brown fox " << (i % 7) << " jumps over the lazy dog.\n";
}

// 2 layers, 4 query heads over 2 KV heads, n_embd 32, block 16, 12 steps; `out` empty writes
// nothing.
inline TrainConfig tiny_config(const std::filesystem::path& dir, const std::string& out,
                               double dropout = 0.0) {
  TrainConfig c;
  c.corpus = (dir / "corpus.txt").string();
  c.model.n_layer = 2;
  c.model.n_head = 4;
  c.model.n_kv_head = 2;
  c.model.n_embd = 32;
  c.model.block_size = 16;
  c.model.dropout = dropout;
  c.batch_size = 4;
  c.iters = 12;
  c.warmup = 3;
  c.lr = 3e-3;
  c.eval_interval = 4;
  c.eval_iters = 3;
  c.out_dir = out.empty() ? "" : (dir / out).string();
  return c;
}

// Runs to the end, or stops after step `stop_after`; returns every record.
inline std::vector<StepRecord> run_all(Trainer& t, int64_t stop_after = -1) {
  std::vector<StepRecord> recs;
  t.run([&](const StepRecord& r) {
    recs.push_back(r);
    return stop_after < 0 || r.step < stop_after;
  });
  return recs;
}

}  // namespace kvlab::testing
