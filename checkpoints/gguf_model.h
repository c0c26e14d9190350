#pragma once
// kvlab's models as GGUF files llama.cpp runs (docs/gguf.md), and back. The llama block
// (RoPE, RMSNorm, SwiGLU, no biases) is llama.cpp's `llama` architecture, GPT-2's block its
// `gpt2`, and the llama block with multi-head latent attention its `deepseek2` (dense, no
// experts); the tokenizer is a `gpt2` (byte-level BPE) vocabulary. Import takes `llama` and
// `deepseek2` files.
#include <filesystem>
#include <string>

#include "checkpoints/gguf.h"
#include "checkpoints/gguf_mix.h"
#include "data/tokenizer.h"
#include "nn/gpt.h"

namespace kvlab {

// What the export records of where the weights came from (kvlab.* keys).
struct GgufProvenance {
  std::string source_file, source_hash;
  int64_t iteration = -1;                                          // -1: not recorded
  double best_val_loss = std::numeric_limits<double>::infinity();  // +inf: none
};

// How a deepseek2 file holds MLA's up-projection kv_up: split per head into attn_k_b and
// attn_v_b, as llama.cpp's converter writes it today (llama.cpp then caches the latent), or
// whole as attn_kv_b, the older form (llama.cpp then caches every head's key and value).
enum class MlaUpForm { Split, Whole };

// llama.cpp's architecture for the model ("llama", "gpt2" or "deepseek2"); an Error naming
// what keeps the model from each otherwise.
std::string gguf_architecture(const GPTConfig& cfg);

// The model and its tokenizer as a GGUF file of llama-quantize's file type `mix`: each tensor
// in the type llama.cpp's rules give it (gguf_mix.h), or with `pure` every matrix in the mix's
// type where its rows allow.
GgufFile model_to_gguf(const GPT& model, const Tokenizer& tok, const GgufMix& mix,
                       const GgufProvenance& provenance, MlaUpForm mla_up = MlaUpForm::Split,
                       bool pure = false);

// A (rows, cols) projection of `blocks` equal blocks of rows whose last `rope_width` rows RoPE
// turns, those rows reordered from kvlab's pairing (i with i + W/2) to llama.cpp's (2i with
// 2i + 1), or back (to_gguf false).
ArrayF32 reorder_rope_rows(const ArrayF32& w, int64_t blocks, int64_t rope_width, bool to_gguf);

// A GGUF file's vocabulary (tokenizer.ggml.*; vocabulary-only files too): a byte-level BPE
// (tokenizer.ggml.model gpt2) split by the pre-tokenizer it names (gpt-2, llama-bpe or qwen2),
// or the char or byte vocabulary a kvlab export wrote. Errors name the key refused.
Tokenizer gguf_tokenizer(const GgufFile& file, std::string_view what);

// A `llama`, `qwen2` or `deepseek2` GGUF file as a weights-only checkpoint (config, tokenizer, f32
// weights), what generate, serve and train --init-from read. Errors name the key or tensor refused.
Checkpoint gguf_to_checkpoint(const GgufFile& file, std::string_view what);

}  // namespace kvlab
