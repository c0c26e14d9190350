#pragma once
// kvlab's models as GGUF files llama.cpp runs (docs/gguf.md), and back. The llama block
// (RoPE, RMSNorm, SwiGLU, no biases) is llama.cpp's `llama` architecture, GPT-2's block its
// `gpt2`; the tokenizer is a `gpt2` (byte-level BPE) vocabulary. Import takes `llama` files
// only.
#include <filesystem>
#include <string>

#include "checkpoints/gguf.h"
#include "data/tokenizer.h"
#include "nn/gpt.h"

namespace kvlab {

// What the export records of where the weights came from (kvlab.* keys).
struct GgufProvenance {
  std::string source_file, source_hash;
  int64_t iteration = -1;                                          // -1: not recorded
  double best_val_loss = std::numeric_limits<double>::infinity();  // +inf: none
};

// llama.cpp's architecture for the model ("llama" or "gpt2"); an Error naming what keeps the
// model from either otherwise.
std::string gguf_architecture(const GPTConfig& cfg);

// The model and its tokenizer as a GGUF file; `type` is the matrices' (f32, f16, bf16 or
// q8_0; a matrix whose rows are not whole q8_0 blocks stays f32, and norms are always f32).
GgufFile model_to_gguf(const GPT& model, const Tokenizer& tok, GgmlType type,
                       const GgufProvenance& provenance);

// A `llama` GGUF file as a weights-only checkpoint (config, tokenizer, f32 weights), what
// generate, serve and train --init-from read. Errors name the key or tensor refused.
Checkpoint gguf_to_checkpoint(const GgufFile& file, std::string_view what);

}  // namespace kvlab
