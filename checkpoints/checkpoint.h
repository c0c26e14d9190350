#pragma once
// HDF5 checkpoints of plain arrays and attributes; docs/checkpoint-format.md has the layout.
// Independent of the tensor engine: callers convert their parameters to and from ArrayF32.
#include <cstdint>
#include <filesystem>
#include <functional>
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
using ShapeList = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// A byte-level BPE vocabulary as /tokenizer of kind "bpe" stores it (docs/checkpoint-format.md).
// The reader checks every length and offset; what the ids mean is data/bpe.h's to check.
struct BpeArrays {
  std::string pattern;                 // the pre-split regex's name: gpt2, cl100k or kvlab
  std::vector<uint32_t> merges;        // (M, 2) in rank order: left id, right id
  std::vector<uint8_t> token_bytes;    // every id's bytes, one after another
  std::vector<uint64_t> token_offsets;  // (V + 1,): id i is token_bytes[off[i], off[i + 1])
  std::vector<uint32_t> special_ids;   // (S,) ascending; an id with no bytes is unused
};

// A SentencePiece vocabulary as /tokenizer of kind "spm" stores it: its pieces as bpe's
// token_bytes and token_offsets, a score and a type (llama.cpp's, data/spm.h) a piece, and the
// add_space_prefix attribute. The reader checks the lengths and offsets.
struct SpmArrays {
  std::vector<uint8_t> token_bytes;
  std::vector<uint64_t> token_offsets;  // (V + 1,)
  std::vector<float> scores;            // (V,)
  std::vector<uint8_t> token_types;     // (V,)
  int64_t add_space_prefix = 1;
};

struct Checkpoint {
  Attrs config;                           // every model and training hyper-parameter
  std::string tokenizer_kind;             // "char" | "byte" | "bpe" | "spm"
  std::vector<uint32_t> tokenizer_vocab;  // char and byte: code points (bpe: empty, or the
                                          // packed words of files written before BpeArrays)
  BpeArrays tokenizer_bpe;                // kind bpe
  SpmArrays tokenizer_spm;                // kind spm
  // /tokenizer's bos, eos and add_bos attributes and eog_ids (data/tokenizer.h's
  // TokenControls), written where any is set; files without them have none.
  int64_t tokenizer_bos = -1;
  int64_t tokenizer_eos = -1;
  int64_t tokenizer_add_bos = 0;
  int64_t tokenizer_add_eos = 0;  // attribute add_eos, written where set (absent: 0)
  std::vector<uint32_t> tokenizer_eog;
  std::vector<uint32_t> tokenizer_user_defined;  // dataset user_defined_ids, where any
  std::string tokenizer_chat_template;  // dataset chat_template (its UTF-8 bytes), where any
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
  // Why /optimizer or /train could not be read, when LoadOptions::report_training_state
  // asked for the rest of the file rather than an error ("" otherwise).
  std::string training_state_problem;
};

struct LoadOptions {
  bool training_state = true;  // false skips /optimizer and /train
  // The parameters /model must hold (names and shapes, in the model's order) for the config
  // read from /config; it throws for a config that is no model. When set, every dataset of
  // /model (and of the optimizer's moments) is checked against it before any array is read,
  // so a damaged config or shape cannot make the loader allocate for a model the file does
  // not hold, and the arrays come back in this order whatever order the file lists them in.
  std::function<ShapeList(const Attrs& config)> expected_model;
  // A damaged /optimizer or /train is described in Checkpoint::training_state_problem and the
  // rest returned, instead of thrown (inspect).
  bool report_training_state = false;
};

// Writes `file` through write_file_atomic (platform/atomic_file.h): an existing checkpoint is
// replaced whole or left untouched. Creates the folder if needed.
// The file's HDF5 user block holds a digest of the rest (docs/checkpoint-format.md).
// Throws kvlab::Error (naming the path) on inconsistent input or any I/O failure.
void save_checkpoint(const std::filesystem::path& file, const Checkpoint& ckpt);
// Whether a file name is that of a temporary save_checkpoint writes, "<name>.h5.tmp-<digits>":
// one left behind where its writer was killed.
bool is_checkpoint_temporary(const std::string& filename);

// Reads and validates a checkpoint. A file whose digest is kvlab's is checked against it before
// HDF5 parses anything; any other file (written by h5py, or by kvlab before the digest) is
// parsed first in a child process, so that a file which crashes the HDF5 library ends in an
// error, not in this process's death. Then every link, layout and size is checked before an
// array is allocated. Model parameters come back in the order LoadOptions::expected_model
// gives, else in the file's. Throws kvlab::Error naming the file and the offending dataset or
// attribute.
Checkpoint load_checkpoint(const std::filesystem::path& file, const LoadOptions& options = {});
inline Checkpoint load_checkpoint(const std::filesystem::path& file, bool with_training_state) {
  LoadOptions options;
  options.training_state = with_training_state;
  return load_checkpoint(file, options);
}

// Checks that the model holds exactly the expected parameters: each name present with exactly
// that shape, and nothing else. `file` is only used in the error message.
void check_model_shapes(const Checkpoint& ckpt, const ShapeList& expected,
                        const std::filesystem::path& file);

}  // namespace kvlab
