#pragma once
// Between the engine's objects (GPT, Tokenizer, AdamW) and a Checkpoint of plain arrays.
#include <filesystem>
#include <memory>
#include <optional>

#include "checkpoints/checkpoint.h"
#include "data/mqar.h"
#include "data/tokenizer.h"
#include "nn/adamw.h"
#include "nn/gpt.h"

namespace kvlab {

// Model keys of /config (the rest of /config is the caller's training settings).
void put_gpt_config(Attrs& attrs, const GPTConfig& cfg);
// Reads the model keys back; a missing or mistyped key is an error naming the file and key.
GPTConfig get_gpt_config(const Attrs& attrs, const std::filesystem::path& file);
// A task run's keys of /config (task and mqar_*; a text run writes none), and the task they
// describe back: nullopt for a text run; a mistyped or invalid key is an error naming the file.
void put_mqar_settings(Attrs& attrs, const MqarSettings& s);
std::optional<MqarSettings> get_mqar_settings(const Attrs& attrs,
                                              const std::filesystem::path& file);
// LoadOptions for a GPT's checkpoint: /model must hold the parameters of the GPT its /config
// describes (get_gpt_config's checks first), compared before any weight is read.
LoadOptions gpt_load_options(const std::filesystem::path& file, bool with_training_state);
// A model file as a Checkpoint, whichever it is: an HDF5 checkpoint as load_checkpoint reads it
// with these options, or a GGUF file (is_gguf_file) as gguf_to_checkpoint converts it, weights
// only (no training state; its matrices widened to f32 as `kvlab import` widens them). Every
// command that takes a checkpoint reads it through this, so each also takes a .gguf file.
Checkpoint load_model_file(const std::filesystem::path& file, const LoadOptions& options);
// What makes a checkpoint's training state unusable for --resume, one line each, naming the
// dataset or attribute (none when nothing): moments holding NaN or inf, a negative step, a
// world_size that is not a positive integer, a /train/rng_state that is not
// 8 words a rank, and a generator state of all zeros, which xoshiro256** never leaves.
std::vector<std::string> training_state_problems(const Checkpoint& ckpt);

NamedArrays to_arrays(const NamedTensors& tensors);
// How many of the array's values are NaN or inf: the loads below refuse any; inspect lists them.
int64_t count_non_finite(const ArrayF32& arr);
// Checks that the arrays of checkpoint group `group` fit the tensors: the same names in the
// same order, the same shapes, and every value finite (an error names the file and the
// dataset otherwise). Every load of parameters or optimizer state goes through it: copy_into
// below, and the sharded optimizer's load_moments, which copies only its shard.
void check_arrays_fit(const NamedTensors& dst, const NamedArrays& src, const std::string& group,
                      const std::filesystem::path& file);
// check_arrays_fit, then copies each array into its tensor (load_model, Trainer::resume).
void copy_into(const NamedTensors& dst, const NamedArrays& src, const std::string& group,
               const std::filesystem::path& file);
// check_arrays_fit, then each tensor takes over its array's memory (Tensor::adopt, no copy; the
// arrays are left empty): a real-size model's weights are held once, not twice, while loading.
void move_into(const NamedTensors& dst, NamedArrays& src, const std::string& group,
               const std::filesystem::path& file);

void put_tokenizer(Checkpoint& ckpt, const Tokenizer& tok);
Tokenizer get_tokenizer(const Checkpoint& ckpt, const std::filesystem::path& file);
// A tokenizer file (tok.h5): a checkpoint holding only /tokenizer (and an empty /config and
// /model), sealed and checked like any other.
void save_tokenizer(const std::filesystem::path& file, const Tokenizer& tok);
// The tokenizer of a tokenizer file, of a model checkpoint or of a GGUF file.
Tokenizer load_tokenizer(const std::filesystem::path& file);

void put_optimizer(Checkpoint& ckpt, const AdamW& opt);
void get_optimizer(AdamW& opt, const Checkpoint& ckpt, const std::filesystem::path& file);

struct LoadedModel {
  std::unique_ptr<GPT> model;
  Tokenizer tokenizer;
  Checkpoint checkpoint;  // config and (when asked) training state; model arrays released
  std::filesystem::path path = {};  // the file it was loaded from (messages)
};
// Loads config, tokenizer and weights into a new GPT (in eval mode), from a checkpoint or a GGUF
// file (load_model_file).
LoadedModel load_model(const std::filesystem::path& file, bool with_training_state = false);

// fnv1a64 of the file's bytes as 16 hex digits (data/corpus.h's hash, which corpus_hash also
// records): what a checkpoint derived from another (convert, train --init-from) records of
// its source. An unreadable file is an Error naming it.
std::string file_content_hash(const std::filesystem::path& file);

}  // namespace kvlab
