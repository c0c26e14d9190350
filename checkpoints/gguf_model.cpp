#include "checkpoints/gguf_model.h"

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoints/model_io.h"
#include "platform/error.h"

namespace kvlab {

namespace {

constexpr double kNormEps = 1e-5;  // every kvlab LayerNorm and RMSNorm (nn/gpt.cpp)

// One parameter's place in both files. rope_heads > 0: a q or k projection of that many heads,
// whose rows are reordered between the two RoPE conventions.
struct TensorPlace {
  std::string kvlab, gguf;
  int64_t rope_heads = 0;
};

// llama.cpp's `llama` tensors for kvlab's llama block (llama-arch.cpp's names).
std::vector<TensorPlace> llama_places(const GPTConfig& cfg) {
  std::vector<TensorPlace> places = {{"wte.weight", "token_embd.weight"}};
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    const std::string k = "blocks." + std::to_string(l) + ".", g = "blk." + std::to_string(l) + ".";
    places.push_back({k + "ln_1.weight", g + "attn_norm.weight"});
    places.push_back({k + "attn.q_proj.weight", g + "attn_q.weight", cfg.n_head});
    places.push_back({k + "attn.k_proj.weight", g + "attn_k.weight", cfg.n_kv_head});
    places.push_back({k + "attn.v_proj.weight", g + "attn_v.weight"});
    places.push_back({k + "attn.c_proj.weight", g + "attn_output.weight"});
    places.push_back({k + "ln_2.weight", g + "ffn_norm.weight"});
    places.push_back({k + "mlp.c_fc.weight", g + "ffn_gate.weight"});
    places.push_back({k + "mlp.c_up.weight", g + "ffn_up.weight"});
    places.push_back({k + "mlp.c_proj.weight", g + "ffn_down.weight"});
  }
  places.push_back({"ln_f.weight", "output_norm.weight"});
  if (!cfg.tied) places.push_back({"lm_head.weight", "output.weight"});
  return places;
}

// kvlab's RoPE pairs channel i of a head with i + HS/2; llama.cpp's `llama` RoPE pairs 2i with
// 2i + 1 (its converter reorders Hugging Face's rows, which pair as kvlab's, the same way). Row
// h*HS + 2i + t of the GGUF matrix is row h*HS + t*HS/2 + i of kvlab's.
ArrayF32 reorder_rope_rows(const ArrayF32& w, int64_t heads, bool to_gguf) {
  const int64_t rows = w.shape[0], cols = w.shape[1], hs = rows / heads, half = hs / 2;
  ArrayF32 out{w.shape, std::vector<float>(w.data.size())};
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t g = h * hs + 2 * i + t, k = h * hs + t * half + i;
        const int64_t from = to_gguf ? k : g, to = to_gguf ? g : k;
        std::copy_n(w.data.begin() + from * cols, cols, out.data.begin() + to * cols);
      }
  return out;
}

// Matrices take the export's type; vectors (norms, biases) stay f32, as llama.cpp's converter
// keeps them, and so does a matrix whose rows are not whole q8_0 blocks.
GgmlType type_for(const ArrayF32& arr, GgmlType matrices) {
  if (arr.shape.size() < 2) return GgmlType::F32;
  if (matrices == GgmlType::Q8_0 && arr.shape.back() % kQ8Block != 0) return GgmlType::F32;
  return matrices;
}

GgufTensor to_tensor(const std::string& name, const ArrayF32& arr, GgmlType matrices) {
  const GgmlType type = type_for(arr, matrices);
  if (type == GgmlType::F16)
    for (float v : arr.data)
      KVLAB_CHECK(std::fabs(v) <= 65504.0f, "export: ", name, " holds ", v,
                  ", past f16's range: export it as f32, bf16 or q8_0");
  return make_gguf_tensor(name, arr, type);
}

ArrayF32 concat_rows(const std::vector<const ArrayF32*>& parts) {
  ArrayF32 out{parts[0]->shape, {}};
  out.shape[0] = 0;
  for (const ArrayF32* p : parts) {
    out.shape[0] += p->shape[0];
    out.data.insert(out.data.end(), p->data.begin(), p->data.end());
  }
  return out;
}

// GPT-2's tensors (llama.cpp's `gpt2`: q, k and v as one attn_qkv matrix and bias).
std::vector<GgufTensor> gpt2_tensors(const GPTConfig& cfg,
                                     const std::map<std::string, ArrayF32>& a, GgmlType type) {
  std::vector<GgufTensor> out;
  auto add = [&](const std::string& kvlab, const std::string& gguf) {
    out.push_back(to_tensor(gguf, a.at(kvlab), type));
  };
  add("wte.weight", "token_embd.weight");
  add("wpe.weight", "position_embd.weight");
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    const std::string k = "blocks." + std::to_string(l) + ".", g = "blk." + std::to_string(l) + ".";
    add(k + "ln_1.weight", g + "attn_norm.weight");
    add(k + "ln_1.bias", g + "attn_norm.bias");
    for (const char* part : {"weight", "bias"}) {
      const std::string p = std::string(".") + part;
      out.push_back(to_tensor(g + "attn_qkv" + p,
                              concat_rows({&a.at(k + "attn.q_proj" + p), &a.at(k + "attn.k_proj" + p),
                                           &a.at(k + "attn.v_proj" + p)}),
                              type));
    }
    add(k + "attn.c_proj.weight", g + "attn_output.weight");
    add(k + "attn.c_proj.bias", g + "attn_output.bias");
    add(k + "ln_2.weight", g + "ffn_norm.weight");
    add(k + "ln_2.bias", g + "ffn_norm.bias");
    add(k + "mlp.c_fc.weight", g + "ffn_up.weight");
    add(k + "mlp.c_fc.bias", g + "ffn_up.bias");
    add(k + "mlp.c_proj.weight", g + "ffn_down.weight");
    add(k + "mlp.c_proj.bias", g + "ffn_down.bias");
  }
  add("ln_f.weight", "output_norm.weight");
  add("ln_f.bias", "output_norm.bias");
  if (!cfg.tied) add("lm_head.weight", "output.weight");
  return out;
}

int64_t file_type(GgmlType t) {  // llama.cpp's llama_ftype: ALL_F32, MOSTLY_F16, _Q8_0, _BF16
  switch (t) {
    case GgmlType::F32: return 0;
    case GgmlType::F16: return 1;
    case GgmlType::Q8_0: return 7;
    case GgmlType::BF16: return 32;
  }
  return 0;
}

void put_hyperparameters(GgufFile& f, const std::string& arch, const GPTConfig& cfg) {
  auto u32 = [&](const std::string& key, int64_t v) {
    f.set(arch + "." + key, GgufValue::scalar(GgufType::U32, v));
  };
  u32("context_length", cfg.block_size);
  u32("embedding_length", cfg.n_embd);
  u32("block_count", cfg.n_layer);
  u32("feed_forward_length", cfg.hidden());
  u32("attention.head_count", cfg.n_head);
  u32("attention.head_count_kv", cfg.n_kv_head);
  if (arch == "llama") {
    f.set("llama.attention.layer_norm_rms_epsilon", GgufValue::real(GgufType::F32, kNormEps));
    f.set("llama.rope.freq_base", GgufValue::real(GgufType::F32, cfg.rope_theta));
    u32("rope.dimension_count", cfg.head_size());
    u32("vocab_size", cfg.vocab_size);
  } else {
    f.set("gpt2.attention.layer_norm_epsilon", GgufValue::real(GgufType::F32, kNormEps));
  }
}

// The vocabulary as llama.cpp's `gpt2` (byte-level BPE) tokenizer: every token's bytes in
// GPT-2's byte-to-character spelling. A char or byte vocabulary is one without merges.
void put_tokenizer_keys(GgufFile& f, const Tokenizer& tok) {
  std::vector<std::string> tokens;
  std::vector<int64_t> types;
  const int n = tok.vocab_size();
  const int n_special = tok.bpe() ? tok.bpe()->n_special() : 0;
  for (int32_t id = 0; id < n; ++id) {
    tokens.push_back(gpt2_bytes_to_text(tok.decode_one(id)));
    types.push_back(id >= n - n_special ? 3 : 1);  // llama_token_type: CONTROL, NORMAL
  }
  std::vector<std::string> merges;
  std::string pre = "gpt-2";
  if (const BpeTokenizer* bpe = tok.bpe()) {
    for (const BpeMerge& m : bpe->merges()) merges.push_back(tokens[m.left] + " " + tokens[m.right]);
    // llama.cpp's pre-tokenizers: "gpt-2" is GPT-2's regex, "llama-bpe" cl100k's.
    if (bpe->pattern() != SplitPattern::Gpt2) pre = "llama-bpe";
    f.set("kvlab.bpe_pattern", GgufValue::string(pattern_name(bpe->pattern())));
  }
  f.set("tokenizer.ggml.model", GgufValue::string("gpt2"));
  f.set("tokenizer.ggml.pre", GgufValue::string(pre));
  f.set("tokenizer.ggml.tokens", GgufValue::string_array(std::move(tokens)));
  f.set("tokenizer.ggml.token_type", GgufValue::int_array(GgufType::I32, std::move(types)));
  f.set("tokenizer.ggml.merges", GgufValue::string_array(std::move(merges)));
  if (n_special > 0) {  // the first special token (<|endoftext|> by default) ends and begins
    f.set("tokenizer.ggml.bos_token_id", GgufValue::scalar(GgufType::U32, n - n_special));
    f.set("tokenizer.ggml.eos_token_id", GgufValue::scalar(GgufType::U32, n - n_special));
  }
  f.set("tokenizer.ggml.add_bos_token", GgufValue::scalar(GgufType::Bool, 0));
  f.set("kvlab.tokenizer", GgufValue::string(tok.kind_name()));
}

// --- import -----------------------------------------------------------------------------------

// One code point's UTF-8 bytes back to it; -1 unless the bytes are exactly one.
int64_t single_code_point(const std::string& s) {
  if (s.empty()) return -1;
  const auto b0 = static_cast<uint8_t>(s[0]);
  const size_t len = b0 < 0x80 ? 1 : (b0 >> 5) == 6 ? 2 : (b0 >> 4) == 14 ? 3 : (b0 >> 3) == 30 ? 4 : 0;
  if (len == 0 || s.size() != len) return -1;
  uint32_t cp = len == 1 ? b0 : b0 & (0x7F >> len);
  for (size_t i = 1; i < len; ++i) {
    const auto b = static_cast<uint8_t>(s[i]);
    if ((b & 0xC0) != 0x80) return -1;
    cp = (cp << 6) | (b & 0x3F);
  }
  return cp;
}

const std::vector<std::string>& string_array(const GgufFile& f, const char* key,
                                             std::string_view what) {
  const GgufValue* v = f.find(key);
  KVLAB_CHECK(v != nullptr, what, ": key ", key, " is missing");
  KVLAB_CHECK(v->is_array() && v->elem == GgufType::String, what, ": key ", key,
              " is not an array of strings");
  return v->strings;
}

Tokenizer tokenizer_of(const GgufFile& f, std::string_view what) {
  const std::string& model = f.get_string("tokenizer.ggml.model", what);
  KVLAB_CHECK(model == "gpt2", what, ": tokenizer.ggml.model is '", model,
              "'; kvlab imports only byte-level BPE vocabularies ('gpt2')");
  const std::vector<std::string>& tokens = string_array(f, "tokenizer.ggml.tokens", what);
  const GgufValue* kind_key = f.find("kvlab.tokenizer");
  const std::string kind =
      kind_key && kind_key->type == GgufType::String ? kind_key->strings[0] : "bpe";
  std::vector<std::string> bytes(tokens.size());
  for (size_t id = 0; id < tokens.size(); ++id)
    KVLAB_CHECK(gpt2_text_to_bytes(tokens[id], bytes[id]), what, ": tokenizer.ggml.tokens[", id,
                "] is not in GPT-2's byte-to-character spelling");
  if (kind == "char" || kind == "byte") {
    std::vector<uint32_t> vocab;
    for (size_t id = 0; id < bytes.size(); ++id) {
      const int64_t cp = kind == "char" ? single_code_point(bytes[id])
                         : bytes[id].size() == 1 ? static_cast<uint8_t>(bytes[id][0]) : -1;
      KVLAB_CHECK(cp >= 0, what, ": tokenizer.ggml.tokens[", id, "] is not one ",
                  kind == "char" ? "character" : "byte", " of a ", kind, " vocabulary");
      vocab.push_back(static_cast<uint32_t>(cp));
    }
    return Tokenizer::from_vocab(Tokenizer::parse_kind(kind), std::move(vocab));
  }
  KVLAB_CHECK(kind == "bpe", what, ": kvlab.tokenizer '", kind, "' is not char, byte or bpe");
  const std::string& pre = f.find("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre", what)
                                                          : std::string("gpt-2");
  SplitPattern pattern;
  if (pre == "gpt-2") {
    pattern = SplitPattern::Gpt2;
  } else if (pre == "llama-bpe") {
    const GgufValue* p = f.find("kvlab.bpe_pattern");
    pattern = p && p->type == GgufType::String && p->strings[0] == "kvlab" ? SplitPattern::Kvlab
                                                                           : SplitPattern::Cl100k;
  } else {
    throw Error(detail::cat(what, ": tokenizer.ggml.pre '", pre,
                            "' is a pre-tokenizer kvlab lacks (it has gpt-2 and llama-bpe)"));
  }
  // GPT-2's vocab.json and merges.txt, which BpeTokenizer::from_gpt2 checks and reads.
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t id = 0; id < tokens.size(); ++id) vocab[tokens[id]] = id;
  KVLAB_CHECK(vocab.size() == tokens.size(), what, ": tokenizer.ggml.tokens repeats a token");
  std::string merges_txt;
  for (const std::string& m : string_array(f, "tokenizer.ggml.merges", what)) merges_txt += m + "\n";
  return Tokenizer::bpe(BpeTokenizer::from_gpt2(vocab.dump(), merges_txt, pattern));
}

GPTConfig llama_config_of(const GgufFile& f, std::string_view what) {
  auto count = [&](const std::string& key) {
    const int64_t v = f.get_int("llama." + key, what);
    KVLAB_CHECK(v >= 1 && v <= (int64_t{1} << 31), what, ": llama.", key, " is ", v,
                " (1 to 2^31)");
    return v;
  };
  GPTConfig cfg;
  cfg.pos = "rope";
  cfg.norm = "rmsnorm";
  cfg.mlp = "swiglu";
  cfg.bias = false;
  cfg.block_size = count("context_length");
  cfg.n_embd = count("embedding_length");
  cfg.n_layer = count("block_count");
  // Each layer is 9 tensors of the file: a count the file cannot hold is refused before
  // anything is sized by it.
  KVLAB_CHECK(cfg.n_layer <= static_cast<int64_t>(f.tensors.size() / 9), what,
              ": llama.block_count ", cfg.n_layer, " is more layers than the file's ",
              f.tensors.size(), " tensors hold");
  cfg.mlp_hidden = count("feed_forward_length");
  cfg.n_head = count("attention.head_count");
  cfg.n_kv_head = f.find("llama.attention.head_count_kv") ? count("attention.head_count_kv")
                                                          : cfg.n_head;
  const double eps = f.get_float("llama.attention.layer_norm_rms_epsilon", what);
  KVLAB_CHECK(std::fabs(eps - kNormEps) <= 1e-3 * kNormEps, what,
              ": llama.attention.layer_norm_rms_epsilon is ", eps, "; kvlab's RMSNorm has ",
              kNormEps);
  if (f.find("llama.rope.freq_base")) cfg.rope_theta = f.get_float("llama.rope.freq_base", what);
  KVLAB_CHECK(std::isfinite(cfg.rope_theta) && cfg.rope_theta > 1.0, what,
              ": llama.rope.freq_base is ", cfg.rope_theta);
  KVLAB_CHECK(cfg.n_embd % cfg.n_head == 0, what, ": llama.embedding_length ", cfg.n_embd,
              " is not a multiple of llama.attention.head_count ", cfg.n_head);
  if (f.find("llama.rope.dimension_count"))
    KVLAB_CHECK(f.get_int("llama.rope.dimension_count", what) == cfg.head_size(), what,
                ": llama.rope.dimension_count ", f.get_int("llama.rope.dimension_count", what),
                " is not the head size ", cfg.head_size(), " (kvlab turns whole heads)");
  for (const char* key : {"llama.rope.scaling.type", "llama.expert_count"})
    KVLAB_CHECK(!f.find(key), what, ": ", key, " is set; kvlab's llama block has no such part");
  const GgufTensor* embd = f.tensor("token_embd.weight");
  KVLAB_CHECK(embd != nullptr, what, ": tensor token_embd.weight is missing");
  KVLAB_CHECK(embd->dims.size() == 2, what, ": token_embd.weight is not a matrix");
  cfg.vocab_size = embd->dims[1];
  cfg.tied = f.tensor("output.weight") == nullptr;
  return cfg;
}

}  // namespace

std::string gguf_architecture(const GPTConfig& cfg) {
  KVLAB_CHECK(!cfg.mla(), "export: attn mla (multi-head latent attention) has no llama.cpp "
              "architecture kvlab writes (deepseek2's MLA differs in its norms and rotary split)");
  if (cfg.rope() && cfg.rms() && cfg.swiglu() && !cfg.bias) return "llama";
  if (!cfg.rope() && !cfg.rms() && !cfg.swiglu() && cfg.bias) return "gpt2";
  throw Error(detail::cat(
      "export: this block (pos ", cfg.pos, ", norm ", cfg.norm, ", mlp ", cfg.mlp, ", bias ",
      cfg.bias ? "on" : "off", ") is neither llama.cpp's llama (rope, rmsnorm, swiglu, no "
      "biases) nor its gpt2 (learned, layernorm, gelu, biases)"));
}

GgufFile model_to_gguf(const GPT& model, const Tokenizer& tok, GgmlType type,
                       const GgufProvenance& provenance) {
  const GPTConfig& cfg = model.config();
  const std::string arch = gguf_architecture(cfg);
  KVLAB_CHECK(tok.vocab_size() == cfg.vocab_size, "export: the tokenizer has ", tok.vocab_size(),
              " tokens, the model ", cfg.vocab_size);
  GgufFile f;
  // Metadata: the architecture, its hyper-parameters, the tokenizer, where it came from.
  f.set("general.architecture", GgufValue::string(arch));
  f.set("general.name", GgufValue::string(
                            "kvlab " + std::filesystem::path(provenance.source_file).stem().string()));
  f.set("general.file_type", GgufValue::scalar(GgufType::U32, file_type(type)));
  put_hyperparameters(f, arch, cfg);
  put_tokenizer_keys(f, tok);
  if (!provenance.source_hash.empty())
    f.set("kvlab.source_hash", GgufValue::string(provenance.source_hash));
  if (provenance.iteration >= 0)
    f.set("kvlab.iteration", GgufValue::scalar(GgufType::I64, provenance.iteration));
  if (std::isfinite(provenance.best_val_loss))
    f.set("kvlab.best_val_loss", GgufValue::real(GgufType::F64, provenance.best_val_loss));

  // The tensors.
  std::map<std::string, ArrayF32> arrays;
  for (auto& [name, arr] : to_arrays(model.named_parameters())) arrays.emplace(name, std::move(arr));
  if (arch == "gpt2") {
    f.tensors = gpt2_tensors(cfg, arrays, type);
  } else {
    for (const TensorPlace& p : llama_places(cfg)) {
      const ArrayF32& a = arrays.at(p.kvlab);
      f.tensors.push_back(
          to_tensor(p.gguf, p.rope_heads ? reorder_rope_rows(a, p.rope_heads, true) : a, type));
    }
  }
  return f;
}

Checkpoint gguf_to_checkpoint(const GgufFile& f, std::string_view what) {
  // The architecture and its hyper-parameters.
  const std::string& arch = f.get_string("general.architecture", what);
  KVLAB_CHECK(arch == "llama", what, ": general.architecture is '", arch,
              "'; kvlab imports the llama architecture only");
  const GPTConfig cfg = llama_config_of(f, what);
  cfg.validate();
  const Tokenizer tok = tokenizer_of(f, what);
  KVLAB_CHECK(tok.vocab_size() == cfg.vocab_size, what, ": tokenizer.ggml.tokens has ",
              tok.vocab_size(), " tokens, token_embd.weight ", cfg.vocab_size, " rows");

  // Every tensor where kvlab's llama block expects it, and nothing else.
  const std::vector<TensorPlace> places = llama_places(cfg);
  std::map<std::string, const TensorPlace*> by_gguf;
  for (const TensorPlace& p : places) by_gguf[p.gguf] = &p;
  for (const GgufTensor& t : f.tensors)
    KVLAB_CHECK(by_gguf.count(t.name), what, ": tensor ", t.name,
                " has no place in kvlab's llama block");
  std::map<std::string, std::vector<int64_t>> shapes;
  for (auto& [name, shape] : parameter_shapes(cfg)) shapes[name] = shape;
  Checkpoint c;
  for (const TensorPlace& p : places) {
    const GgufTensor* t = f.tensor(p.gguf);
    KVLAB_CHECK(t != nullptr, what, ": tensor ", p.gguf, " is missing");
    const std::vector<int64_t>& shape = shapes.at(p.kvlab);
    const std::vector<int64_t> dims(shape.rbegin(), shape.rend());
    KVLAB_CHECK(t->dims == dims, what, ": tensor ", p.gguf, " has the wrong shape for this config");
    ArrayF32 a = gguf_tensor_values(*t);
    KVLAB_CHECK(count_non_finite(a) == 0, what, ": tensor ", p.gguf, " holds NaN or inf");
    c.model.emplace_back(p.kvlab, p.rope_heads ? reorder_rope_rows(a, p.rope_heads, false)
                                               : std::move(a));
  }
  put_gpt_config(c.config, cfg);
  put_tokenizer(c, tok);
  return c;
}

}  // namespace kvlab
