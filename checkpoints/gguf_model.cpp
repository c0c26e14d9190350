#include "checkpoints/gguf_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <nlohmann/json.hpp>

#include "checkpoints/gguf_mix.h"
#include "checkpoints/model_io.h"
#include "platform/error.h"

namespace kvlab {

namespace {

// llama.h's llama_token_type values a byte-level BPE vocabulary holds.
enum TokenType : int64_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };

// One parameter's place in both files. rope_width > 0: a projection of `heads` equal blocks of
// rows whose last rope_width rows RoPE turns, reordered between the two RoPE conventions.
// part Keys or Values: deepseek2's attn_k_b or attn_v_b, one half of MLA's kv_up per head.
struct TensorPlace {
  enum class Part { All, Keys, Values };
  std::string kvlab, gguf;
  int64_t heads = 0, rope_width = 0;
  Part part = Part::All;
};

// llama.cpp's tensors for kvlab's llama block (llama-arch.cpp's names): `llama`, with q, k and
// v biases `qwen2` (whose RoPE, LLAMA_ROPE_TYPE_NEOX, pairs channels as kvlab's does: no rows
// are reordered), or with MLA `deepseek2` (a dense FFN in every layer).
std::vector<TensorPlace> tensor_places(const GPTConfig& cfg, MlaUpForm up) {
  using Part = TensorPlace::Part;
  std::vector<TensorPlace> places = {{"wte.weight", "token_embd.weight"}};
  const int64_t NH = cfg.n_head, D = cfg.rope_head_dim, HS = cfg.head_size();
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    const std::string k = "blocks." + std::to_string(l) + ".", g = "blk." + std::to_string(l) + ".";
    places.push_back({k + "ln_1.weight", g + "attn_norm.weight"});
    if (cfg.mla()) {
      if (cfg.q_lora_rank > 0) {
        places.push_back({k + "attn.q_down.weight", g + "attn_q_a.weight"});
        places.push_back({k + "attn.q_norm.weight", g + "attn_q_a_norm.weight"});
        places.push_back({k + "attn.q_proj.weight", g + "attn_q_b.weight", NH, D});
      } else {
        places.push_back({k + "attn.q_proj.weight", g + "attn_q.weight", NH, D});
      }
      places.push_back({k + "attn.kv_down.weight", g + "attn_kv_a_mqa.weight", 1, D});
      places.push_back({k + "attn.kv_norm.weight", g + "attn_kv_a_norm.weight"});
      if (up == MlaUpForm::Split) {
        places.push_back({k + "attn.kv_up.weight", g + "attn_k_b.weight", NH, 0, Part::Keys});
        places.push_back({k + "attn.kv_up.weight", g + "attn_v_b.weight", NH, 0, Part::Values});
      } else {
        places.push_back({k + "attn.kv_up.weight", g + "attn_kv_b.weight"});
      }
    } else {
      const int64_t turned = cfg.qkv_bias ? 0 : HS;
      places.push_back({k + "attn.q_proj.weight", g + "attn_q.weight", NH, turned});
      places.push_back({k + "attn.k_proj.weight", g + "attn_k.weight", cfg.n_kv_head, turned});
      places.push_back({k + "attn.v_proj.weight", g + "attn_v.weight"});
      if (cfg.qkv_bias)
        for (const char* p : {"q", "k", "v"})
          places.push_back({k + "attn." + p + "_proj.bias", g + "attn_" + p + ".bias"});
    }
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

// MLA's kv_up (NH * 2 HS, R: per head its HS key rows, then its HS value rows) is two tensors
// in deepseek2's split form: attn_k_b (NH, R, HS), each head's key rows transposed (llama.cpp
// folds them into the query), and attn_v_b (NH, HS, R), each head's value rows. `to_half`
// copies the half out of `up`, otherwise back into it.
void copy_kv_up_half(ArrayF32& up, ArrayF32& half, int64_t heads, TensorPlace::Part part,
                     bool to_half) {
  const int64_t R = up.shape[1], hs = up.shape[0] / heads / 2;
  const bool keys = part == TensorPlace::Part::Keys;
  if (to_half) {
    half.shape = keys ? std::vector<int64_t>{heads, R, hs} : std::vector<int64_t>{heads, hs, R};
    half.data.assign(up.data.size() / 2, 0.0f);
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < hs; ++d)
      for (int64_t c = 0; c < R; ++c) {
        float& u = up.data[((2 * h + (keys ? 0 : 1)) * hs + d) * R + c];
        float& v = half.data[keys ? (h * R + c) * hs + d : (h * hs + d) * R + c];
        if (to_half)
          v = u;
        else
          u = v;
      }
}

// The place's tensor dims in the GGUF file, for a kvlab parameter of that shape.
std::vector<int64_t> gguf_dims(const TensorPlace& p, const std::vector<int64_t>& shape) {
  if (p.part == TensorPlace::Part::All) return {shape.rbegin(), shape.rend()};
  const int64_t R = shape[1], hs = shape[0] / p.heads / 2;
  if (p.part == TensorPlace::Part::Keys) return {hs, R, p.heads};
  return {R, hs, p.heads};
}

// The file's tensors, f32, in the types the mix gives them (gguf_mix.h).
std::vector<GgufTensor> encode_tensors(NamedArrays named, const GgufMix& mix, const GPTConfig& cfg,
                                       const std::string& arch, bool pure) {
  std::vector<TensorShape> shapes;
  for (const auto& [name, arr] : named)
    shapes.push_back({name, {arr.shape.rbegin(), arr.shape.rend()}});
  const std::vector<GgmlType> types =
      mix_types(mix, {arch, cfg.n_layer, cfg.n_head, cfg.n_kv_head}, shapes, pure);
  std::vector<GgufTensor> out;
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& [name, arr] = named[i];
    if (types[i] == GgmlType::F16)
      for (float v : arr.data)
        KVLAB_CHECK(std::fabs(v) <= 65504.0f, "export: ", name, " holds ", v,
                    ", past f16's range: export it as f32, bf16 or q8_0");
    out.push_back(make_gguf_tensor(name, arr, types[i]));
    named[i].second = {};  // one f32 copy at a time besides the file's bytes
  }
  return out;
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

// GPT-2's tensors (llama.cpp's `gpt2`: q, k and v as one attn_qkv matrix and bias), the
// arrays moved out of `a`.
NamedArrays gpt2_tensors(const GPTConfig& cfg, std::map<std::string, ArrayF32>& a) {
  NamedArrays out;
  auto add = [&](const std::string& kvlab, const std::string& gguf) {
    out.emplace_back(gguf, std::move(a.at(kvlab)));
  };
  add("wte.weight", "token_embd.weight");
  add("wpe.weight", "position_embd.weight");
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    const std::string k = "blocks." + std::to_string(l) + ".", g = "blk." + std::to_string(l) + ".";
    add(k + "ln_1.weight", g + "attn_norm.weight");
    add(k + "ln_1.bias", g + "attn_norm.bias");
    for (const char* part : {"weight", "bias"}) {
      const std::string p = std::string(".") + part;
      out.emplace_back(g + "attn_qkv" + p,
                       concat_rows({&a.at(k + "attn.q_proj" + p), &a.at(k + "attn.k_proj" + p),
                                    &a.at(k + "attn.v_proj" + p)}));
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

void put_hyperparameters(GgufFile& f, const std::string& arch, const GPTConfig& cfg,
                         MlaUpForm up) {
  auto u32 = [&](const std::string& key, int64_t v) {
    f.set(arch + "." + key, GgufValue::scalar(GgufType::U32, v));
  };
  u32("context_length", cfg.block_size);
  u32("embedding_length", cfg.n_embd);
  u32("block_count", cfg.n_layer);
  u32("feed_forward_length", cfg.hidden());
  u32("attention.head_count", cfg.n_head);
  u32("attention.head_count_kv", cfg.n_kv_head);
  if (arch == "gpt2") {
    f.set("gpt2.attention.layer_norm_epsilon", GgufValue::real(GgufType::F32, cfg.norm_eps));
    return;
  }
  f.set(arch + ".attention.layer_norm_rms_epsilon", GgufValue::real(GgufType::F32, cfg.norm_eps));
  f.set(arch + ".rope.freq_base", GgufValue::real(GgufType::F32, cfg.rope_theta));
  if (cfg.rope_scale != 1) {
    f.set(arch + ".rope.scaling.type", GgufValue::string("linear"));
    f.set(arch + ".rope.scaling.factor", GgufValue::real(GgufType::F32, 1.0 / cfg.rope_scale));
  }
  u32("rope.dimension_count", cfg.rope_dim());
  u32("vocab_size", cfg.vocab_size);
  if (arch != "deepseek2") return;
  // As llama.cpp's converter writes DeepSeek-V2 (conversion/deepseek.py). The split form is
  // MQA over the latent: one cached "head" of R + D keys and R values, the per-head sizes after
  // decompression in key_length_mla and value_length_mla. The whole form is plain MHA.
  const int64_t R = cfg.kv_lora_rank, D = cfg.rope_head_dim, HS = cfg.head_size();
  const bool split = up == MlaUpForm::Split;
  u32("attention.head_count_kv", split ? 1 : cfg.n_head);
  u32("attention.key_length", split ? R + D : HS + D);
  u32("attention.value_length", split ? R : HS);
  if (split) {
    u32("attention.key_length_mla", HS + D);
    u32("attention.value_length_mla", HS);
  }
  u32("attention.kv_lora_rank", R);
  u32("attention.q_lora_rank", cfg.q_lora_rank);  // read unless the layer count is a "lite" one
  // No experts: every layer's FFN is the dense one. llama.cpp requires the two expert keys.
  u32("leading_dense_block_count", cfg.n_layer);
  u32("expert_feed_forward_length", cfg.hidden());
  u32("expert_shared_count", 0);
}

// The vocabulary as llama.cpp's `gpt2` (byte-level BPE) tokenizer: every token's bytes in
// GPT-2's byte-to-character spelling. A char or byte vocabulary is one without merges.
// llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) for kvlab's split patterns: the
// cl100k regex is llama-bpe's, whose llama3 rule kvlab's cl100k and kvlab patterns leave out
// (kvlab.bpe_pattern then says which).
constexpr std::pair<SplitPattern, const char*> kPreTokenizers[] = {
    {SplitPattern::Gpt2, "gpt-2"},       {SplitPattern::Llama3, "llama-bpe"},
    {SplitPattern::Qwen2, "qwen2"},      {SplitPattern::Cl100k, "llama-bpe"},
    {SplitPattern::Kvlab, "llama-bpe"},  {SplitPattern::DeepseekLlm, "deepseek-llm"},
    {SplitPattern::DeepseekCoder, "deepseek-coder"},
};

// The pattern of a file's pre-tokenizer, or of its kvlab.bpe_pattern where an export wrote one
// (which must agree with the pre-tokenizer).
SplitPattern split_pattern_of(const std::string& pre, const GgufValue* kvlab_pattern,
                              std::string_view what) {
  if (kvlab_pattern && kvlab_pattern->type == GgufType::String) {
    const SplitPattern p = parse_pattern(kvlab_pattern->strings[0]);
    for (const auto& [pattern, name] : kPreTokenizers)
      if (pattern == p && pre == name) return p;
    throw Error(detail::cat(what, ": kvlab.bpe_pattern '", kvlab_pattern->strings[0],
                            "' is not what tokenizer.ggml.pre '", pre, "' splits by"));
  }
  for (const auto& [pattern, name] : kPreTokenizers)
    if (pre == name) return pattern;
  throw Error(detail::cat(what, ": tokenizer.ggml.pre '", pre,
                          "' is a pre-tokenizer kvlab lacks (it has gpt-2, llama-bpe, qwen2, "
                          "deepseek-llm and deepseek-coder)"));
}

// A SentencePiece vocabulary as llama.cpp's `llama` tokenizer model: its pieces, scores and
// types as they are.
void put_spm_keys(GgufFile& f, const SpmTokenizer& spm) {
  f.set("tokenizer.ggml.model", GgufValue::string("llama"));
  f.set("tokenizer.ggml.pre", GgufValue::string("default"));
  f.set("tokenizer.ggml.tokens", GgufValue::string_array(spm.pieces()));
  f.set("tokenizer.ggml.scores", GgufValue::real_array(GgufType::F32, {spm.scores().begin(),
                                                                       spm.scores().end()}));
  f.set("tokenizer.ggml.token_type",
        GgufValue::int_array(GgufType::I32, {spm.types().begin(), spm.types().end()}));
  f.set("tokenizer.ggml.add_space_prefix",
        GgufValue::scalar(GgufType::Bool, spm.add_space_prefix() ? 1 : 0));
}

// The tokenizer's own bos and eos (an imported family's), else `fallback` where it is an id;
// add_bos and add_eos.
void put_control_keys(GgufFile& f, const TokenControls& c, int32_t fallback) {
  for (const auto& [key, id] : {std::pair{"tokenizer.ggml.bos_token_id", c.bos},
                                std::pair{"tokenizer.ggml.eos_token_id", c.eos}})
    if (const int32_t chosen = id >= 0 ? id : fallback; chosen >= 0)
      f.set(key, GgufValue::scalar(GgufType::U32, chosen));
  f.set("tokenizer.ggml.add_bos_token", GgufValue::scalar(GgufType::Bool, c.add_bos ? 1 : 0));
  f.set("tokenizer.ggml.add_eos_token", GgufValue::scalar(GgufType::Bool, c.add_eos ? 1 : 0));
  if (!c.chat_template.empty()) f.set("tokenizer.chat_template", GgufValue::string(c.chat_template));
}

void put_tokenizer_keys(GgufFile& f, const Tokenizer& tok) {
  if (const SpmTokenizer* spm = tok.spm()) {
    put_spm_keys(f, *spm);
    put_control_keys(f, tok.controls(), -1);
    return;
  }
  const std::vector<int32_t>& user = tok.controls().user_defined;
  std::vector<std::string> tokens;
  std::vector<int64_t> types;
  const int n = tok.vocab_size();
  const int n_special = tok.bpe() ? tok.bpe()->n_special() : 0;
  for (int32_t id = 0; id < n; ++id) {
    if (id < n - n_special) {
      tokens.push_back(gpt2_bytes_to_text(tok.decode_one(id)));
      types.push_back(kNormal);
      continue;
    }
    // A special token's own text, as llama.cpp reads control and user-defined tokens; an unused
    // id empty.
    const std::string& bytes = tok.bpe()->tokens()[static_cast<size_t>(id)];
    tokens.push_back(bytes);
    types.push_back(bytes.empty()                                    ? kUnused
                    : std::binary_search(user.begin(), user.end(), id) ? kUserDefined
                                                                       : kControl);
  }
  std::vector<std::string> merges;
  std::string pre = "gpt-2";
  if (const BpeTokenizer* bpe = tok.bpe()) {
    for (const BpeMerge& m : bpe->merges())
      merges.push_back(tokens[m.left] + " " + tokens[m.right]);
    for (const auto& [pattern, name] : kPreTokenizers)
      if (pattern == bpe->pattern()) {
        pre = name;
        break;
      }
    f.set("kvlab.bpe_pattern", GgufValue::string(pattern_name(bpe->pattern())));
  }
  f.set("tokenizer.ggml.model", GgufValue::string("gpt2"));
  f.set("tokenizer.ggml.pre", GgufValue::string(pre));
  f.set("tokenizer.ggml.tokens", GgufValue::string_array(std::move(tokens)));
  f.set("tokenizer.ggml.token_type", GgufValue::int_array(GgufType::I32, std::move(types)));
  f.set("tokenizer.ggml.merges", GgufValue::string_array(std::move(merges)));
  // Without bos and eos of its own, the first special token (<|endoftext|> by default) ends
  // and begins.
  put_control_keys(f, tok.controls(), n_special > 0 ? n - n_special : -1);
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


// The config a `llama`, `qwen2` or `deepseek2` file's keys give, and (deepseek2) the form of its
// up-projection.
GPTConfig config_of(const GgufFile& f, const std::string& arch, MlaUpForm& up,
                    std::string_view what) {
  const std::string a = arch + ".";
  auto count = [&](const std::string& key) {
    const int64_t v = f.get_int(a + key, what);
    KVLAB_CHECK(v >= 1 && v <= (int64_t{1} << 31), what, ": ", a, key, " is ", v, " (1 to 2^31)");
    return v;
  };
  auto count_or = [&](const std::string& key, int64_t absent) {
    return f.find(a + key) ? count(key) : absent;
  };
  // A key that must hold `want` for kvlab's block, refused naming it otherwise.
  auto expect = [&](const std::string& key, int64_t got, int64_t want, const char* why) {
    KVLAB_CHECK(got == want, what, ": ", a, key, " is ", got, ", not ", want, ": ", why);
  };
  GPTConfig cfg;
  cfg.pos = "rope";
  cfg.norm = "rmsnorm";
  cfg.mlp = "swiglu";
  cfg.bias = false;
  cfg.block_size = count("context_length");
  cfg.n_embd = count("embedding_length");
  cfg.n_layer = count("block_count");
  // Each layer is at least 9 tensors of the file: a count the file cannot hold is refused
  // before anything is sized by it.
  KVLAB_CHECK(cfg.n_layer <= static_cast<int64_t>(f.tensors.size() / 9), what, ": ", a,
              "block_count ", cfg.n_layer, " is more layers than the file's ", f.tensors.size(),
              " tensors hold");
  cfg.mlp_hidden = count("feed_forward_length");
  cfg.n_head = count("attention.head_count");
  cfg.n_kv_head = count_or("attention.head_count_kv", cfg.n_head);
  cfg.norm_eps = f.get_float(a + "attention.layer_norm_rms_epsilon", what);
  KVLAB_CHECK(cfg.norm_eps > 0 && cfg.norm_eps < 1, what, ": ", a,
              "attention.layer_norm_rms_epsilon is ", cfg.norm_eps, " (above 0, below 1)");
  if (f.find(a + "rope.freq_base")) cfg.rope_theta = f.get_float(a + "rope.freq_base", what);
  KVLAB_CHECK(std::isfinite(cfg.rope_theta) && cfg.rope_theta > 1.0, what, ": ", a,
              "rope.freq_base is ", cfg.rope_theta);
  KVLAB_CHECK(cfg.n_embd % cfg.n_head == 0, what, ": ", a, "embedding_length ", cfg.n_embd,
              " is not a multiple of ", a, "attention.head_count ", cfg.n_head);
  const int64_t HS = cfg.head_size();
  // Scaled RoPE as llama.cpp reads it (llama-model.cpp): positions times 1 / rope.scaling.factor
  // (or the older rope.scale_linear) where one is set and not 0, under the type none or linear;
  // YaRN and the others are refused.
  if (const GgufValue* v = f.find(a + "rope.scaling.type"))
    KVLAB_CHECK(v->type == GgufType::String &&
                    (v->strings[0] == "none" || v->strings[0] == "linear"),
                what, ": ", a, "rope.scaling.type is '",
                v->type == GgufType::String ? v->strings[0] : std::string("?"),
                "'; kvlab's RoPE scales linearly or not at all");
  for (const char* key : {"rope.scaling.factor", "rope.scale_linear"}) {
    if (!f.find(a + key)) continue;
    const double factor = f.get_float(a + key, what);
    KVLAB_CHECK(std::isfinite(factor) && factor >= 0, what, ": ", a, key, " is ", factor);
    if (factor != 0) cfg.rope_scale = 1.0 / factor;
    break;
  }
  // What kvlab's block has no part for: YaRN's settings, experts, extra prediction layers,
  // attention temperature.
  for (const char* key : {"rope.scaling.yarn_log_multiplier",
                          "rope.scaling.attn_factor", "expert_count", "expert_used_count",
                          "expert_shared_count", "nextn_predict_layers",
                          "attention.temperature_scale"}) {
    const GgufValue* v = f.find(a + key);
    const bool neutral = !v || (v->size() == 1 && (v->ints.empty() || v->ints[0] == 0) &&
                                (v->floats.empty() || v->floats[0] == 0 ||
                                 (std::string(key).ends_with("factor") && v->floats[0] == 1)));
    KVLAB_CHECK(neutral, what, ": ", a, key, " is set; kvlab's block has no such part");
  }
  cfg.qkv_bias = arch == "qwen2";
  if (arch == "llama" || arch == "qwen2") {
    expect("rope.dimension_count", count_or("rope.dimension_count", HS), HS,
           "kvlab turns whole heads");
  } else {
    cfg.attn = "mla";
    cfg.n_kv_head = cfg.n_head;
    cfg.kv_lora_rank = count("attention.kv_lora_rank");
    cfg.rope_head_dim = count("rope.dimension_count");
    if (f.find(a + "attention.q_lora_rank"))
      cfg.q_lora_rank = f.get_int(a + "attention.q_lora_rank", what);
    const int64_t R = cfg.kv_lora_rank, D = cfg.rope_head_dim;
    expect("leading_dense_block_count", count_or("leading_dense_block_count", 0), cfg.n_layer,
           "kvlab's layers are all dense (no experts)");
    // The split form (key_length_mla, value_length_mla set; llama.cpp's is_mla) caches the
    // latent; the whole form is MHA. Either way a head's key is HS + D, its value HS.
    up = f.find(a + "attention.key_length_mla") ? MlaUpForm::Split : MlaUpForm::Whole;
    const bool split = up == MlaUpForm::Split;
    const char* kvlab_heads =
        split ? "kvlab's MLA caches kv_lora_rank + rope.dimension_count a position, and its "
                "heads are embedding_length / head_count wide"
              : "kvlab's MLA heads are embedding_length / head_count wide";
    expect("attention.head_count_kv", count_or("attention.head_count_kv", cfg.n_head),
           split ? 1 : cfg.n_head,
           split ? "the split form (key_length_mla set) is one latent head"
                 : "the whole form is one key and value per head");
    expect("attention.key_length", count("attention.key_length"), split ? R + D : HS + D,
           kvlab_heads);
    expect("attention.value_length", count("attention.value_length"), split ? R : HS,
           kvlab_heads);
    if (split) {
      expect("attention.key_length_mla", count("attention.key_length_mla"), HS + D, kvlab_heads);
      expect("attention.value_length_mla", count("attention.value_length_mla"), HS, kvlab_heads);
    }
  }
  const GgufTensor* embd = f.tensor("token_embd.weight");
  KVLAB_CHECK(embd != nullptr, what, ": tensor token_embd.weight is missing");
  KVLAB_CHECK(embd->dims.size() == 2, what, ": token_embd.weight is not a matrix");
  cfg.vocab_size = embd->dims[1];
  cfg.tied = f.tensor("output.weight") == nullptr;
  // Llama 3.1's RoPE: each frequency divided by its factor (llama.cpp's rope_freqs tensor).
  if (const GgufTensor* freqs = f.tensor("rope_freqs.weight"); freqs && !cfg.mla()) {
    KVLAB_CHECK(freqs->dims == std::vector<int64_t>{cfg.rope_dim() / 2}, what,
                ": rope_freqs.weight is not one factor for each of the ", cfg.rope_dim() / 2,
                " frequencies");
    cfg.rope_freqs = gguf_tensor_values(*freqs).data;
  }
  return cfg;
}

}  // namespace

// kvlab's RoPE pairs channel i of the rotated part with i + W/2; llama.cpp's `llama` and
// `deepseek2` RoPE (LLAMA_ROPE_TYPE_NORM) pair 2i with 2i + 1 (its converter reorders Hugging
// Face's llama rows, which pair as kvlab's, the same way). With S rows a block, row
// b*S + (S-W) + 2i + t of the GGUF matrix is row b*S + (S-W) + t*W/2 + i of kvlab's.
ArrayF32 reorder_rope_rows(const ArrayF32& w, int64_t blocks, int64_t rope_width, bool to_gguf) {
  const int64_t cols = w.shape[1], stride = w.shape[0] / blocks;
  const int64_t half = rope_width / 2, first = stride - rope_width;
  ArrayF32 out = w;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t g = b * stride + first + 2 * i + t, k = b * stride + first + t * half + i;
        const int64_t from = to_gguf ? k : g, to = to_gguf ? g : k;
        std::copy_n(w.data.begin() + from * cols, cols, out.data.begin() + to * cols);
      }
  return out;
}

std::string gguf_architecture(const GPTConfig& cfg) {
  // (Qwen2's block is the llama block with q, k and v biases.)
  const bool llama_block = cfg.rope() && cfg.rms() && cfg.swiglu() && !cfg.bias;
  if (cfg.mla()) {
    KVLAB_CHECK(llama_block, "export: MLA is llama.cpp's deepseek2 only in the llama block "
                "(rmsnorm, swiglu, no biases); this model has norm ", cfg.norm, ", mlp ", cfg.mlp,
                ", bias ", cfg.bias ? "on" : "off");
    // llama.cpp takes these layer counts for DeepSeek-V2-Lite and its kin, whose queries are
    // not compressed, and reads no q_lora_rank for them (src/models/deepseek2.cpp).
    const bool lite = cfg.n_layer == 26 || cfg.n_layer == 27 ||
                      (cfg.n_layer == 48 && cfg.vocab_size == 128256);
    KVLAB_CHECK(!(lite && cfg.q_lora_rank > 0), "export: llama.cpp's deepseek2 reads no "
                "q_lora_rank for ", cfg.n_layer, " layers", cfg.n_layer == 48 ? " and a "
                "vocabulary of 128256" : "", ", so it cannot hold this model's query compression "
                "(q_lora_rank ", cfg.q_lora_rank, "): it would look for attn_q, which is missing");
    return "deepseek2";
  }
  if (llama_block) return cfg.qkv_bias ? "qwen2" : "llama";
  if (!cfg.rope() && !cfg.rms() && !cfg.swiglu() && cfg.bias) return "gpt2";
  throw Error(detail::cat(
      "export: this block (pos ", cfg.pos, ", norm ", cfg.norm, ", mlp ", cfg.mlp, ", bias ",
      cfg.bias ? "on" : "off", ") is neither llama.cpp's llama (rope, rmsnorm, swiglu, no "
      "biases) nor its gpt2 (learned, layernorm, gelu, biases)"));
}

GgufFile model_to_gguf(const GPT& model, const Tokenizer& tok, const GgufMix& mix,
                       const GgufProvenance& provenance, MlaUpForm mla_up, bool pure) {
  const GPTConfig& cfg = model.config();
  const std::string arch = gguf_architecture(cfg);
  KVLAB_CHECK(tok.vocab_size() == cfg.vocab_size, "export: the tokenizer has ", tok.vocab_size(),
              " tokens, the model ", cfg.vocab_size);
  GgufFile f;
  // Metadata: the architecture, its hyper-parameters, the tokenizer, where it came from.
  f.set("general.architecture", GgufValue::string(arch));
  f.set("general.name", GgufValue::string(
                            "kvlab " + std::filesystem::path(provenance.source_file).stem().string()));
  f.set("general.file_type", GgufValue::scalar(GgufType::U32, mix.file_type));
  put_hyperparameters(f, arch, cfg, mla_up);
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
  NamedArrays named;
  if (arch == "gpt2") {
    named = gpt2_tensors(cfg, arrays);
  } else {
    for (const TensorPlace& p : tensor_places(cfg, mla_up)) {
      ArrayF32& a = arrays.at(p.kvlab);
      if (p.part != TensorPlace::Part::All) {
        ArrayF32 half;
        copy_kv_up_half(a, half, p.heads, p.part, /*to_half=*/true);
        named.emplace_back(p.gguf, std::move(half));
      } else {
        named.emplace_back(p.gguf, p.rope_width ? reorder_rope_rows(a, p.heads, p.rope_width, true)
                                                : std::move(a));
      }
    }
  }
  arrays.clear();
  if (!cfg.rope_freqs.empty())  // first, where llama.cpp's converter writes it
    named.insert(named.begin(), {"rope_freqs.weight",
                                 ArrayF32{{static_cast<int64_t>(cfg.rope_freqs.size())},
                                          cfg.rope_freqs}});
  f.tensors = encode_tensors(std::move(named), mix, cfg, arch, pure);
  return f;
}

namespace {

// A kvlab export's char or byte vocabulary: one character or byte a token, spelled as GPT-2's.
Tokenizer char_or_byte_vocabulary(const std::vector<std::string>& tokens, const std::string& kind,
                                  std::string_view what) {
  std::vector<uint32_t> vocab;
  for (size_t id = 0; id < tokens.size(); ++id) {
    std::string bytes;
    KVLAB_CHECK(gpt2_text_to_bytes(tokens[id], bytes), what, ": tokenizer.ggml.tokens[", id,
                "] is not in GPT-2's byte-to-character spelling");
    const int64_t cp = kind == "char" ? single_code_point(bytes)
                       : bytes.size() == 1 ? static_cast<uint8_t>(bytes[0]) : -1;
    KVLAB_CHECK(cp >= 0, what, ": tokenizer.ggml.tokens[", id, "] is not one ",
                kind == "char" ? "character" : "byte", " of a ", kind, " vocabulary");
    vocab.push_back(static_cast<uint32_t>(cp));
  }
  return Tokenizer::from_vocab(Tokenizer::parse_kind(kind), std::move(vocab));
}

// Which ids are special (never made from text): those tokenizer.ggml.token_type says are
// control, user-defined or unused, or where a file has no types, the tokens after the last
// that a merge makes (GPT-2's <|endoftext|>).
std::vector<bool> special_tokens(const GgufFile& f, const std::vector<std::string>& tokens,
                                 std::string_view what) {
  std::vector<bool> special(tokens.size());
  if (const GgufValue* types = f.find("tokenizer.ggml.token_type")) {
    KVLAB_CHECK(types->is_array() && types->ints.size() == tokens.size(), what,
                ": tokenizer.ggml.token_type is not one integer a token");
    for (size_t id = 0; id < tokens.size(); ++id) {
      const int64_t t = types->ints[id];
      KVLAB_CHECK(t == kNormal || t == kControl || t == kUserDefined || t == kUnused, what,
                  ": tokenizer.ggml.token_type[", id, "] is ", t,
                  " (a byte-level BPE vocabulary's are 1, 3, 4 and 5)");
      special[id] = t != kNormal;
    }
    return special;
  }
  std::unordered_set<std::string> made;
  for (const std::string& m : string_array(f, "tokenizer.ggml.merges", what)) {
    std::string joined = m;
    std::erase(joined, ' ');
    made.insert(joined);
  }
  for (size_t id = tokens.size(); id-- > 0 && tokens[id].size() > 1 && !made.count(tokens[id]);)
    special[id] = true;
  return special;
}

// A byte-level BPE vocabulary: an ordinary token's text is GPT-2's byte-to-character
// spelling of its bytes, a special token's its own text (as llama.cpp reads them); the merges
// are "left right" in the ordinary tokens' spelling.
Tokenizer bpe_vocabulary(const GgufFile& f, const std::vector<std::string>& tokens,
                         SplitPattern pattern, std::string_view what) {
  const std::vector<bool> special = special_tokens(f, tokens, what);
  const auto first_special = std::find(special.begin(), special.end(), true) - special.begin();
  const auto ordinary_after = std::find(special.begin() + first_special, special.end(), false);
  KVLAB_CHECK(ordinary_after == special.end(), what, ": token ", first_special,
              " is special but ordinary token ", ordinary_after - special.begin(),
              " follows it; kvlab holds the special tokens after the ordinary ones");
  std::vector<std::string> bytes(tokens.size());
  std::vector<int32_t> special_ids;
  std::unordered_map<std::string_view, int32_t> id_of;  // spelled text -> ordinary id
  for (size_t id = 0; id < tokens.size(); ++id) {
    const auto i = static_cast<int32_t>(id);
    if (special[id]) {  // an unused id without text stays empty
      bytes[id] = tokens[id];
      if (!bytes[id].empty()) special_ids.push_back(i);
      continue;
    }
    KVLAB_CHECK(gpt2_text_to_bytes(tokens[id], bytes[id]), what, ": tokenizer.ggml.tokens[", id,
                "] is not in GPT-2's byte-to-character spelling");
    KVLAB_CHECK(id_of.emplace(tokens[id], i).second, what, ": tokenizer.ggml.tokens[", id,
                "] repeats an earlier token");
  }
  const std::vector<std::string>& merges = string_array(f, "tokenizer.ggml.merges", what);
  std::vector<std::pair<int32_t, int32_t>> pairs;
  pairs.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string_view m = merges[i];
    const size_t space = m.find(' ');
    const auto left = id_of.find(m.substr(0, space == std::string_view::npos ? 0 : space));
    const auto right = id_of.find(m.substr(space == std::string_view::npos ? 0 : space + 1));
    KVLAB_CHECK(space != std::string_view::npos && left != id_of.end() && right != id_of.end(),
                what, ": tokenizer.ggml.merges[", i, "] ('", m,
                "') is not two ordinary tokens separated by a space");
    pairs.emplace_back(left->second, right->second);
  }
  return Tokenizer::bpe(BpeTokenizer::from_pairs(pattern, std::move(bytes), pairs, special_ids));
}

// The texts of the tokens llama.cpp's vocabulary loader (src/llama-vocab.cpp) ends a
// generation at, whatever their ids, and those it takes for the fill-in-the-middle pad, repo
// and file-separator tokens where no key names them (which end one too).
constexpr const char* kEogTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["};
const std::pair<const char*, std::vector<std::string>> kFimEnds[] = {
    {"tokenizer.ggml.fim_pad_token_id",
     {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}},
    {"tokenizer.ggml.fim_rep_token_id",
     {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}},
    {"tokenizer.ggml.fim_sep_token_id", {"<|file_sep|>"}},
};

// The fill-in-the-middle prefix, suffix and middle tokens' texts, which llama.cpp looks for too.
constexpr const char* kFimStarts[] = {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
    "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>",
    "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
    "<|middle|>"};

// Whether llama.cpp's loader makes a token of this text a control token whatever its type
// says (it warns of "control-looking" tokens), so that it is not read from text as a
// user-defined one: the end, end-of-turn and fill-in-the-middle texts above.
bool looks_like_control(std::string_view text) {
  for (const char* t : kEogTexts)
    if (text == t) return true;
  for (const char* t : kFimStarts)
    if (text == t) return true;
  for (const auto& [key, texts] : kFimEnds)
    for (const std::string& t : texts)
      if (text == t) return true;
  return false;
}

// A SentencePiece vocabulary (llama.cpp's `llama` tokenizer model): the pieces as they are,
// tokenizer.ggml.scores (0 where absent, as llama.cpp reads them) and token_type (normal where
// absent; a user-defined piece that looks like control, control), a space put before a text
// unless tokenizer.ggml.add_space_prefix says not.
Tokenizer spm_vocabulary(const GgufFile& f, const std::vector<std::string>& tokens,
                         std::string_view what) {
  const size_t V = tokens.size();
  std::vector<float> scores(V, 0.0f);
  if (const GgufValue* v = f.find("tokenizer.ggml.scores")) {  // f32 or i32, as llama.cpp reads
    const bool f32 = v->elem == GgufType::F32, i32 = v->elem == GgufType::I32;
    KVLAB_CHECK(v->is_array() && (f32 || i32) && (f32 ? v->floats.size() : v->ints.size()) == V,
                what, ": tokenizer.ggml.scores is not one f32 or i32 a token");
    for (size_t id = 0; id < V; ++id)
      scores[id] = f32 ? static_cast<float>(v->floats[id]) : static_cast<float>(v->ints[id]);
  }
  std::vector<uint8_t> types(V, static_cast<uint8_t>(PieceType::Normal));
  if (const GgufValue* v = f.find("tokenizer.ggml.token_type")) {
    KVLAB_CHECK(v->is_array() && v->ints.size() == V, what,
                ": tokenizer.ggml.token_type is not one integer a token");
    for (size_t id = 0; id < V; ++id) {
      KVLAB_CHECK(v->ints[id] >= 1 && v->ints[id] <= 6, what, ": tokenizer.ggml.token_type[", id,
                  "] is ", v->ints[id], " (llama.cpp's types are 1 to 6)");
      types[id] = static_cast<uint8_t>(v->ints[id]);
      if (static_cast<PieceType>(types[id]) == PieceType::UserDefined &&
          looks_like_control(tokens[id]))
        types[id] = static_cast<uint8_t>(PieceType::Control);
    }
  }
  bool add_space_prefix = true;
  if (const GgufValue* v = f.find("tokenizer.ggml.add_space_prefix")) {
    KVLAB_CHECK(v->type == GgufType::Bool && v->ints.size() == 1, what,
                ": tokenizer.ggml.add_space_prefix is not a bool");
    add_space_prefix = v->ints[0] != 0;
  }
  try {
    return Tokenizer::spm(SpmTokenizer::from_parts(tokens, std::move(scores), std::move(types),
                                                   add_space_prefix));
  } catch (const Error& e) {
    throw Error(detail::cat(what, ": ", e.what()));
  }
}

// What llama.cpp makes of a file's special-token keys: an id outside the vocabulary is ignored;
// bos and eos default to 11 for a byte-level BPE file, 1 and 2 for a SentencePiece one
// (llama.cpp's defaults for these tokenizer models); add_bos defaults to true for SentencePiece
// and for Llama 3's pre-tokenizer; and a generation ends at eos,
// eot, eom, the fill-in-the-middle tokens above, and every token whose text kEogTexts lists.
// (llama.cpp's rules for gpt-oss's and Gemma 4's vocabularies, which drop one such token, are
// not here: kvlab reads neither.)
TokenControls gguf_token_controls(const GgufFile& f, const std::vector<std::string>& tokens,
                                  const std::string& model, const std::string& pre,
                                  std::string_view what) {
  const auto V = static_cast<int64_t>(tokens.size());
  auto id_of = [&](const char* key, int64_t fallback) -> int32_t {
    int64_t id = fallback < V ? fallback : -1;
    if (const GgufValue* v = f.find(key)) {
      KVLAB_CHECK(!v->is_array() && v->ints.size() == 1, what, ": ", key, " is not an integer");
      if (v->ints[0] >= 0 && v->ints[0] < V) id = v->ints[0];
    }
    return static_cast<int32_t>(id);
  };
  auto by_text = [&](const std::vector<std::string>& texts) -> int32_t {
    for (int64_t id = 0; id < V; ++id)
      for (const std::string& t : texts)
        if (tokens[static_cast<size_t>(id)] == t) return static_cast<int32_t>(id);
    return -1;
  };
  TokenControls c;
  const bool spm = model == "llama";
  c.bos = id_of("tokenizer.ggml.bos_token_id", spm ? 1 : 11);
  c.eos = id_of("tokenizer.ggml.eos_token_id", spm ? 2 : 11);
  c.add_bos = spm || pre == "llama-bpe";
  for (const auto& [key, flag] : {std::pair{"tokenizer.ggml.add_bos_token", &c.add_bos},
                                  std::pair{"tokenizer.ggml.add_eos_token", &c.add_eos}})
    if (const GgufValue* v = f.find(key)) {
      KVLAB_CHECK(v->type == GgufType::Bool && v->ints.size() == 1, what, ": ", key,
                  " is not a bool");
      *flag = v->ints[0] != 0;
    }
  std::set<int32_t> eog;
  for (int64_t id = 0; id < V; ++id)
    for (const char* t : kEogTexts)
      if (tokens[static_cast<size_t>(id)] == t) eog.insert(static_cast<int32_t>(id));
  for (const auto& [key, texts] : kFimEnds) {
    const int32_t id = id_of(key, -1);
    eog.insert(id >= 0 ? id : by_text(texts));
  }
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
    eog.insert(id_of(key, -1));
  eog.insert(c.eos);
  eog.erase(-1);
  c.eog.assign(eog.begin(), eog.end());
  if (f.find("tokenizer.chat_template") != nullptr)
    c.chat_template = f.get_string("tokenizer.chat_template", what);
  // A byte-level BPE vocabulary's user-defined tokens (an spm one keeps its own).
  if (const GgufValue* types = f.find("tokenizer.ggml.token_type"); types && !spm)
    for (int64_t id = 0; id < V && id < static_cast<int64_t>(types->ints.size()); ++id)
      if (types->ints[static_cast<size_t>(id)] == kUserDefined &&
          !looks_like_control(tokens[static_cast<size_t>(id)]))
        c.user_defined.push_back(static_cast<int32_t>(id));
  return c;
}

}  // namespace

Tokenizer gguf_tokenizer(const GgufFile& f, std::string_view what) {
  const std::string& model = f.get_string("tokenizer.ggml.model", what);
  KVLAB_CHECK(model == "gpt2" || model == "llama", what, ": tokenizer.ggml.model is '", model,
              "'; kvlab imports byte-level BPE ('gpt2') and SentencePiece ('llama') "
              "vocabularies");
  const std::vector<std::string>& tokens = string_array(f, "tokenizer.ggml.tokens", what);
  std::string pre = "default";
  std::optional<Tokenizer> vocab;
  if (model == "llama") {
    vocab = spm_vocabulary(f, tokens, what);
  } else {
    const GgufValue* kind_key = f.find("kvlab.tokenizer");
    const std::string kind =
        kind_key && kind_key->type == GgufType::String ? kind_key->strings[0] : "bpe";
    if (kind == "char" || kind == "byte") return char_or_byte_vocabulary(tokens, kind, what);
    KVLAB_CHECK(kind == "bpe", what, ": kvlab.tokenizer '", kind, "' is not char, byte or bpe");
    pre = f.find("tokenizer.ggml.pre") ? f.get_string("tokenizer.ggml.pre", what) : "gpt-2";
    vocab = bpe_vocabulary(f, tokens, split_pattern_of(pre, f.find("kvlab.bpe_pattern"), what),
                           what);
  }
  Tokenizer tok = std::move(*vocab);
  try {
    tok.set_controls(gguf_token_controls(f, tokens, model, pre, what));
  } catch (const Error& e) {
    throw Error(detail::cat(what, ": ", e.what()));
  }
  return tok;
}

Checkpoint gguf_to_checkpoint(const GgufFile& f, std::string_view what) {
  // The architecture and its hyper-parameters.
  const std::string& arch = f.get_string("general.architecture", what);
  KVLAB_CHECK(arch == "llama" || arch == "qwen2" || arch == "deepseek2", what,
              ": general.architecture is '", arch,
              "'; kvlab imports the llama, qwen2 and deepseek2 architectures only");
  MlaUpForm up = MlaUpForm::Split;
  const GPTConfig cfg = config_of(f, arch, up, what);
  cfg.validate();
  const Tokenizer tok = gguf_tokenizer(f, what);
  KVLAB_CHECK(tok.vocab_size() == cfg.vocab_size, what, ": tokenizer.ggml.tokens has ",
              tok.vocab_size(), " tokens, token_embd.weight ", cfg.vocab_size, " rows");

  // Every tensor where kvlab's llama block expects it, and nothing else.
  const std::vector<TensorPlace> places = tensor_places(cfg, up);
  std::map<std::string, const TensorPlace*> by_gguf;
  for (const TensorPlace& p : places) by_gguf[p.gguf] = &p;
  for (const GgufTensor& t : f.tensors)
    KVLAB_CHECK(by_gguf.count(t.name) || (t.name == "rope_freqs.weight" && !cfg.rope_freqs.empty()),
                what, ": tensor ", t.name, " has no place in kvlab's ",
                cfg.mla() ? "MLA" : "llama", " block");
  std::map<std::string, std::vector<int64_t>> shapes;
  for (auto& [name, shape] : parameter_shapes(cfg)) shapes[name] = shape;
  std::map<std::string, ArrayF32> arrays;
  for (const TensorPlace& p : places) {
    const GgufTensor* t = f.tensor(p.gguf);
    KVLAB_CHECK(t != nullptr, what, ": tensor ", p.gguf, " is missing");
    const std::vector<int64_t>& shape = shapes.at(p.kvlab);
    KVLAB_CHECK(t->dims == gguf_dims(p, shape), what, ": tensor ", p.gguf,
                " has the wrong shape for this config");
    ArrayF32 a = gguf_tensor_values(*t);
    KVLAB_CHECK(count_non_finite(a) == 0, what, ": tensor ", p.gguf, " holds NaN or inf");
    if (p.part != TensorPlace::Part::All) {  // both halves land in one kv_up
      ArrayF32& whole = arrays[p.kvlab];
      if (whole.data.empty()) whole = {shape, std::vector<float>(a.data.size() * 2)};
      copy_kv_up_half(whole, a, p.heads, p.part, /*to_half=*/false);
    } else {
      arrays[p.kvlab] = p.rope_width ? reorder_rope_rows(a, p.heads, p.rope_width, false)
                                     : std::move(a);
    }
  }
  Checkpoint c;
  for (auto& [name, shape] : parameter_shapes(cfg))
    c.model.emplace_back(name, std::move(arrays.at(name)));
  put_gpt_config(c.config, cfg);
  put_tokenizer(c, tok);
  return c;
}

}  // namespace kvlab
