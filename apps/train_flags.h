#pragma once
// The training flags shared by `kvlab train` and `kvlab ablate`.
#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <vector>

#include "infer/engine.h"
#include "train/trainer.h"

namespace kvlab {

struct TrainFlags {
  TrainConfig cfg;
  int64_t n_kv_head = 0;         // used when n_kv_head_given; otherwise n_head (MHA)
  bool n_kv_head_given = false;  // --n-kv-head appeared (on the command line or in --config)
  bool untied = false;
  // --arch's preset of the block; --pos, --norm, --mlp and --bias / --no-bias override it.
  std::string arch = "gpt2";
  std::string pos, norm, mlp;  // empty: the preset's
  int bias = -1;               // -1: the preset's; 0 --no-bias; 1 --bias
  std::string device = "cpu";
  std::string dtype = "f32";
  // The command the flags were added to: which of them were given (take_model_from).
  const CLI::App* cmd = nullptr;
};

// --device cpu|cuda and --dtype f32|bf16, shared by the commands that run a model.
void add_device_flags(CLI::App* cmd, std::string& device, std::string& dtype);
// The parsed --device; cuda without a visible GPU (or without the backend) is an error.
Device parse_device(const std::string& device);
// The parsed --dtype for `device`: bf16 (GEMMs in bf16 with f32 accumulation) needs cuda.
MatmulPrecision parse_dtype(const std::string& dtype, Device device);
// --kv-dtype f32|bf16|fp8|int8|int4 (generate, bench, serve, ablate): the KV cache's element
// type.
void add_kv_dtype_flag(CLI::App* cmd, std::string& kv_dtype);
// --chat-template FILE (generate --chat, serve), and the template it names: the file's text, or
// the model's own (its tokenizer's) where no file is given. An unreadable file is an Error.
void add_chat_template_flag(CLI::App* cmd, std::string& file);
std::string chat_template_source(const std::string& file, const Tokenizer& tokenizer);
// --weight-dtype f32|bf16|q8_0|q4_0 (generate, bench generate, serve, ablate): the products'
// matrices, rounded at load (GPT::round_matrices); parse_weight_dtype reads its value.
void add_weight_dtype_flag(CLI::App* cmd, std::string& weight_dtype);
// The same, with --int8-products (DecodeStep::int8_products) beside it.
void add_weight_dtype_flag(CLI::App* cmd, std::string& weight_dtype, bool& int8_products);
WeightDtype parse_weight_dtype(const std::string& dtype);
// A comma-separated list of weight dtypes (bench weight-quality, ablate --weight-dtypes), each
// once: a usage error names a bad or repeated one.
std::vector<WeightDtype> parse_weight_dtypes(const std::string& list);
// The DType of either flag's value.
DType parse_storage_dtype(const std::string& dtype);
// A comma-separated list of KV cache dtypes (--kv-dtypes), each known and listed once.
std::vector<DType> parse_kv_dtypes(const std::string& list);
// --cache paged|contiguous, --kv-block-size N and --kv-memory SIZE (generate, bench
// generate): the KV cache's layout and the paged cache's pool.
struct KVCacheFlags {
  std::string layout;  // empty: paged on the CPU, contiguous on CUDA
  int64_t block_size = 16;
  std::string memory;  // empty: a pool for every row's whole generation
};
void add_kv_cache_flags(CLI::App* cmd, KVCacheFlags& flags);
// The Engine's paged cache options for those flags (none for contiguous), for a model of this
// context on this device: usage errors name a block size that is not a power of two or is
// larger than the context, a size that is not one, --kv-memory with the contiguous cache, and
// --cache paged on CUDA.
std::optional<PagedCacheOptions> parse_kv_cache(const KVCacheFlags& flags, int64_t context,
                                                Device device);
// The layout those flags choose on this device: "paged" or "contiguous".
std::string kv_cache_layout(const KVCacheFlags& flags, Device device);
// "64MiB", "1.5GiB", "512KiB", "4096" (bytes; KiB, MiB and GiB are powers of 1024; kB, MB and
// GB of 1000) as bytes, > 0; a usage error names `flag` and the value otherwise.
int64_t parse_bytes(const std::string& text, const std::string& flag);

// Registers every training flag on `cmd` (defaults: nanoGPT's CPU "baby" shakespeare config),
// plus --config FILE (expanded before parsing: apps/config_file.h).
void add_train_flags(CLI::App* cmd, TrainFlags& flags, bool with_n_kv_head);
// Turns parsed flags into a TrainConfig; bad values are UsageErrors naming the flag.
TrainConfig finish_train_flags(const TrainFlags& flags);
// For a run whose model is a checkpoint's (train --init-from, and --resume of such a run):
// every model key of /config that put_gpt_config writes, dropout aside (a training setting the
// flags keep), and the tokenizer kind are set from `model` and `tokenizer_kind`, the file's.
// A flag given (on the command line or in --config) with another value than the file's is a
// UsageError naming every such key and both values ("<what>: n_kv_head 2 on the command line,
// 4 in <file>"); a model key's flag is --<key> with dashes (tied: --untied). Call before
// finish_train_flags.
void take_model_from(TrainFlags& flags, const GPTConfig& model, const std::string& tokenizer_kind,
                     const std::string& what, const std::string& file);

// The corpus used when --corpus is not given: the King James Bible that scripts/setup.sh
// writes under data/corpora/.
std::string default_corpus();

}  // namespace kvlab
