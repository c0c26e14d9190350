#pragma once
// HDF5 checkpoints of plain arrays and attributes; docs/checkpoint-format.md has the layout.
// Independent of the tensor engine: callers convert their parameters to and from ArrayF32.
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace kvlab {

inline constexpr char kCheckpointFormat[] = "kvlab-checkpoint";
inline constexpr int64_t kCheckpointVersion = 1;

struct ArrayF32 {
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major, product(shape) elements
};

using AttrValue = std::variant<int64_t, double, std::string>;
using Attrs = std::map<std::string, AttrValue>;  // sorted: written in a stable order
using NamedArrays = std::vector<std::pair<std::string, ArrayF32>>;

struct Checkpoint {
  Attrs config;                           // every model and training hyper-parameter
  std::string tokenizer_kind;             // "char" | "byte"
  std::vector<uint32_t> tokenizer_vocab;  // code points
  NamedArrays model;                      // state_dict names ("blocks.0.attn.q_proj.weight")
                                          // in module order; Linear weights (out, in)
  bool has_optimizer = false;
  int64_t optimizer_step = 0;
  NamedArrays optimizer_m, optimizer_v;  // same names, order and shapes as model
  bool has_train_state = false;
  int64_t iteration = 0;
  double best_val_loss = std::numeric_limits<double>::infinity();  // +inf when none yet
  std::vector<uint64_t> rng_state;  // opaque words (sampler + dropout generators)
  Attrs train_extra;                // anything else, e.g. world size, elapsed seconds
};

// Writes a temporary file next to `file`, flushes and fsyncs it, then renames it over `file`:
// an existing checkpoint is replaced whole or left untouched. Creates the folder if needed.
// Throws kvlab::Error (naming the path) on inconsistent input or any I/O failure.
void save_checkpoint(const std::filesystem::path& file, const Checkpoint& ckpt);

// Reads and validates a checkpoint; model parameters come back in the order they were written.
// with_training_state = false skips /optimizer and /train (has_optimizer, has_train_state are
// then false). Throws kvlab::Error naming the file and the offending dataset or attribute.
Checkpoint load_checkpoint(const std::filesystem::path& file, bool with_training_state = true);

// Checks that the model holds exactly the expected parameters: each name present with exactly
// that shape, and nothing else. `file` is only used in the error message.
void check_model_shapes(const Checkpoint& ckpt,
                        const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected,
                        const std::filesystem::path& file);

}  // namespace kvlab
