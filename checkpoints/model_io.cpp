#include "checkpoints/model_io.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "checkpoints/gguf_model.h"
#include "data/corpus.h"

namespace kvlab {

namespace {
template <class T>
const T& attr(const Attrs& attrs, const std::string& key, const std::filesystem::path& file) {
  auto it = attrs.find(key);
  KVLAB_CHECK(it != attrs.end(), "checkpoint ", file.string(), ": /config has no attribute '", key,
              "'");
  const T* v = std::get_if<T>(&it->second);
  KVLAB_CHECK(v != nullptr, "checkpoint ", file.string(), ": /config attribute '", key,
              "' has the wrong type");
  return *v;
}
// A key files written before it existed lack: absent means the default (GPT-2's block).
template <class T>
T attr_or(const Attrs& attrs, const std::string& key, const T& fallback,
          const std::filesystem::path& file) {
  return attrs.count(key) != 0 ? attr<T>(attrs, key, file) : fallback;
}

// /config's rope_freqs: the factors as text, each with the 9 digits that give a float back.
std::string rope_freqs_text(const std::vector<float>& freqs) {
  std::string s;
  char buf[32];
  for (const float f : freqs) {
    std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(f));
    if (!s.empty()) s += ' ';
    s += buf;
  }
  return s;
}

std::vector<float> parse_rope_freqs(const std::string& text, const std::filesystem::path& file) {
  std::vector<float> freqs;
  std::istringstream in(text);
  for (std::string word; in >> word;) {
    char* end = nullptr;
    const float f = std::strtof(word.c_str(), &end);
    KVLAB_CHECK(end == word.c_str() + word.size(), "checkpoint ", file.string(),
                ": /config rope_freqs holds '", word, "', not a number");
    freqs.push_back(f);
  }
  return freqs;
}

}  // namespace

void put_gpt_config(Attrs& a, const GPTConfig& c) {
  a["vocab_size"] = c.vocab_size;
  a["block_size"] = c.block_size;
  a["n_layer"] = c.n_layer;
  a["n_head"] = c.n_head;
  a["n_kv_head"] = c.n_kv_head;
  a["n_embd"] = c.n_embd;
  a["mlp_hidden"] = c.hidden();
  a["dropout"] = c.dropout;
  a["tied"] = static_cast<int64_t>(c.tied ? 1 : 0);
  a["pos"] = c.pos;
  a["rope_theta"] = c.rope_theta;
  // Scaled RoPE only where a model has it (an imported one): absent, none.
  if (c.rope_scale != 1) a["rope_scale"] = c.rope_scale;
  if (!c.rope_freqs.empty()) a["rope_freqs"] = rope_freqs_text(c.rope_freqs);
  a["norm_eps"] = c.norm_eps;
  a["norm"] = c.norm;
  a["mlp"] = c.mlp;
  a["bias"] = static_cast<int64_t>(c.bias ? 1 : 0);
  if (c.qkv_bias) a["qkv_bias"] = int64_t{1};  // absent: off (every file before it)
  a["attn"] = c.attn;
  a["kv_lora_rank"] = c.kv_lora_rank;
  a["rope_head_dim"] = c.rope_head_dim;
  a["q_lora_rank"] = c.q_lora_rank;
}

void put_mqar_settings(Attrs& a, const MqarSettings& s) {
  a["task"] = std::string("mqar");
  a["mqar_vocab"] = static_cast<int64_t>(s.vocab);
  a["mqar_pairs"] = static_cast<int64_t>(s.pairs);
  a["mqar_train_examples"] = s.train_examples;
  a["mqar_val_examples"] = s.val_examples;
  a["mqar_seed"] = static_cast<int64_t>(s.seed);
}

std::optional<MqarSettings> get_mqar_settings(const Attrs& a, const std::filesystem::path& file) {
  const std::string task = attr_or<std::string>(a, "task", "text", file);
  if (task == "text") return std::nullopt;
  KVLAB_CHECK(task == "mqar", "checkpoint ", file.string(), ": /config names task '", task,
              "', which this build does not know (text, mqar)");
  MqarSettings s;
  const auto small = [&](const char* key) {
    const int64_t v = attr<int64_t>(a, key, file);
    KVLAB_CHECK(v >= 0 && v <= 1 << 20, "checkpoint ", file.string(), ": /config ", key, " = ",
                v, " is out of range");
    return static_cast<int>(v);
  };
  s.vocab = small("mqar_vocab");
  s.pairs = small("mqar_pairs");
  s.train_examples = attr<int64_t>(a, "mqar_train_examples", file);
  s.val_examples = attr<int64_t>(a, "mqar_val_examples", file);
  s.seed = static_cast<uint64_t>(attr<int64_t>(a, "mqar_seed", file));
  return s;
}

GPTConfig get_gpt_config(const Attrs& a, const std::filesystem::path& file) {
  GPTConfig c;
  c.vocab_size = attr<int64_t>(a, "vocab_size", file);
  c.block_size = attr<int64_t>(a, "block_size", file);
  c.n_layer = attr<int64_t>(a, "n_layer", file);
  c.n_head = attr<int64_t>(a, "n_head", file);
  c.n_kv_head = attr<int64_t>(a, "n_kv_head", file);
  c.n_embd = attr<int64_t>(a, "n_embd", file);
  c.mlp_hidden = attr<int64_t>(a, "mlp_hidden", file);
  c.dropout = attr<double>(a, "dropout", file);
  c.tied = attr<int64_t>(a, "tied", file) != 0;
  c.pos = attr_or<std::string>(a, "pos", c.pos, file);
  c.rope_theta = attr_or<double>(a, "rope_theta", c.rope_theta, file);
  c.rope_scale = attr_or<double>(a, "rope_scale", 1.0, file);
  c.rope_freqs = parse_rope_freqs(attr_or<std::string>(a, "rope_freqs", "", file), file);
  c.norm_eps = attr_or<double>(a, "norm_eps", c.norm_eps, file);  // 1e-5 before it was kept
  c.norm = attr_or<std::string>(a, "norm", c.norm, file);
  c.mlp = attr_or<std::string>(a, "mlp", c.mlp, file);
  c.bias = attr_or<int64_t>(a, "bias", 1, file) != 0;
  c.qkv_bias = attr_or<int64_t>(a, "qkv_bias", 0, file) != 0;
  c.attn = attr_or<std::string>(a, "attn", c.attn, file);
  c.kv_lora_rank = attr_or<int64_t>(a, "kv_lora_rank", 0, file);
  c.rope_head_dim = attr_or<int64_t>(a, "rope_head_dim", 0, file);
  c.q_lora_rank = attr_or<int64_t>(a, "q_lora_rank", 0, file);
  try {
    c.validate();
  } catch (const Error& e) {
    KVLAB_CHECK(false, "checkpoint ", file.string(), ": invalid /config: ", e.what());
  }
  return c;
}

LoadOptions gpt_load_options(const std::filesystem::path& file, bool with_training_state) {
  LoadOptions options;
  options.training_state = with_training_state;
  options.expected_model = [file](const Attrs& config) {
    return parameter_shapes(get_gpt_config(config, file));
  };
  return options;
}

std::vector<std::string> training_state_problems(const Checkpoint& c) {
  std::vector<std::string> problems;
  if (c.has_optimizer) {
    if (c.optimizer_step < 0)
      problems.push_back(detail::cat("attribute 'step' of /optimizer is ", c.optimizer_step));
    for (const auto* group : {&c.optimizer_m, &c.optimizer_v}) {
      for (const auto& [name, arr] : *group) {
        const int64_t bad = count_non_finite(arr);
        if (bad > 0)
          problems.push_back(detail::cat("/optimizer/", group == &c.optimizer_m ? "m/" : "v/",
                                         name, " holds non-finite values (", bad, " of ",
                                         arr.data.size(), " are NaN or inf)"));
      }
    }
  }
  if (!c.has_train_state) return problems;
  int64_t world = 1;  // checkpoints without the key come from single-process runs
  if (auto it = c.train_extra.find("world_size"); it != c.train_extra.end()) {
    const int64_t* w = std::get_if<int64_t>(&it->second);
    if (w == nullptr || *w < 1) {
      problems.push_back("attribute 'world_size' of /train is not a positive integer");
      return problems;
    }
    world = *w;
  }
  if (static_cast<int64_t>(c.rng_state.size()) != 8 * world) {
    problems.push_back(detail::cat("/train/rng_state holds ", c.rng_state.size(), " words, ",
                                   8 * world, " expected for ", world, " rank(s)"));
    return problems;
  }
  // Rank r's words: [8 r, 8 r + 4) its batch sampler's generator, [8 r + 4, 8 r + 8) dropout's.
  for (size_t g = 0; g < c.rng_state.size(); g += 4) {
    if (std::all_of(c.rng_state.begin() + g, c.rng_state.begin() + g + 4,
                    [](uint64_t w) { return w == 0; }))
      problems.push_back(detail::cat("/train/rng_state words ", g, "-", g + 3, " (rank ", g / 8,
                                     g % 8 ? "'s dropout" : "'s batch sampler",
                                     " generator) are all zero, a state xoshiro256** never "
                                     "leaves"));
  }
  return problems;
}

NamedArrays to_arrays(const NamedTensors& tensors) {
  NamedArrays out;
  out.reserve(tensors.size());
  for (const auto& [name, t] : tensors)
    out.emplace_back(name, ArrayF32{t.sizes(), t.to_vector<float>()});
  return out;
}

int64_t count_non_finite(const ArrayF32& arr) {
  return std::count_if(arr.data.begin(), arr.data.end(), [](float v) { return !std::isfinite(v); });
}

void check_arrays_fit(const NamedTensors& dst, const NamedArrays& src, const std::string& group,
                      const std::filesystem::path& file) {
  if (dst.size() != src.size()) {  // name what is missing and what is extra
    std::set<std::string> expected, found;
    for (const auto& entry : dst) expected.insert(entry.first);
    for (const auto& entry : src) found.insert(entry.first);
    std::string missing, extra;
    for (const std::string& n : expected)
      if (!found.count(n)) missing += (missing.empty() ? "" : ", ") + n;
    for (const std::string& n : found)
      if (!expected.count(n)) extra += (extra.empty() ? "" : ", ") + n;
    KVLAB_CHECK(false, "checkpoint ", file.string(), ": /", group, " holds ", src.size(),
                " tensors, the model has ", dst.size(),
                missing.empty() ? "" : detail::cat("; missing: ", missing),
                extra.empty() ? "" : detail::cat("; not in the model: ", extra));
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    const auto& [name, t] = dst[i];
    const auto& [sname, arr] = src[i];
    KVLAB_CHECK(name == sname, "checkpoint ", file.string(), ": /", group, "/", sname,
                " found where the model expects ", name);
    KVLAB_CHECK(arr.shape == t.sizes(), "checkpoint ", file.string(), ": /", group, "/", name,
                " has shape ", shape_str(arr.shape), ", the model expects ", t.shape_str());
    KVLAB_CHECK(t.is_contiguous() && t.dtype() == DType::F32, "check_arrays_fit: ", name);
    // One pass over the values: a run that diverged must not come back as weights that
    // compute NaN (greedy decoding of NaN logits prints token 0 forever).
    const int64_t non_finite = count_non_finite(arr);
    KVLAB_CHECK(non_finite == 0, "checkpoint ", file.string(), ": tensor ",
                group == "model" ? name : group + "/" + name, " holds non-finite values (",
                non_finite, " of ", arr.data.size(), " are NaN or inf)");
  }
}

void copy_into(const NamedTensors& dst, const NamedArrays& src, const std::string& group,
               const std::filesystem::path& file) {
  check_arrays_fit(dst, src, group, file);
  for (size_t i = 0; i < dst.size(); ++i) {
    Tensor target = dst[i].second;  // the handle is shared: the data lands in the model's tensor
    target.copy_from(Tensor::from_vector(src[i].second.data, src[i].second.shape));
  }
}

void move_into(const NamedTensors& dst, NamedArrays& src, const std::string& group,
               const std::filesystem::path& file) {
  check_arrays_fit(dst, src, group, file);
  for (size_t i = 0; i < dst.size(); ++i) {
    ArrayF32& a = src[i].second;
    Tensor target = dst[i].second;  // the handle is shared: the data lands in the model's tensor
    target.share_data_of(Tensor::adopt(std::move(a.data), a.shape));
    a = {};
  }
}

namespace {
// Tokens as /tokenizer/token_bytes and token_offsets hold them, and back (the checkpoint reader
// has checked the offsets).
void pack_texts(const std::vector<std::string>& texts, std::vector<uint8_t>& bytes,
                std::vector<uint64_t>& offsets) {
  offsets.assign(1, 0);
  for (const std::string& t : texts) {
    bytes.insert(bytes.end(), t.begin(), t.end());
    offsets.push_back(bytes.size());
  }
}

std::vector<std::string> unpack_texts(const std::vector<uint8_t>& bytes,
                                      const std::vector<uint64_t>& offsets) {
  std::vector<std::string> texts;
  texts.reserve(offsets.size() - 1);
  const auto* b = reinterpret_cast<const char*>(bytes.data());
  for (size_t i = 0; i + 1 < offsets.size(); ++i)
    texts.emplace_back(b + offsets[i], offsets[i + 1] - offsets[i]);
  return texts;
}

BpeArrays to_bpe_arrays(const BpeTokenizer& bpe) {
  BpeArrays a;
  a.pattern = pattern_name(bpe.pattern());
  for (const BpeMerge& m : bpe.merges()) {
    a.merges.push_back(static_cast<uint32_t>(m.left));
    a.merges.push_back(static_cast<uint32_t>(m.right));
  }
  pack_texts(bpe.tokens(), a.token_bytes, a.token_offsets);
  for (const int32_t id : bpe.special_ids()) a.special_ids.push_back(static_cast<uint32_t>(id));
  return a;
}

// The checkpoint reader has checked that every id is below the token count.
BpeTokenizer from_bpe_arrays(const BpeArrays& a) {
  std::vector<std::string> tokens = unpack_texts(a.token_bytes, a.token_offsets);
  std::vector<std::pair<int32_t, int32_t>> pairs;
  pairs.reserve(a.merges.size() / 2);
  for (size_t i = 0; i + 1 < a.merges.size(); i += 2)
    pairs.emplace_back(static_cast<int32_t>(a.merges[i]), static_cast<int32_t>(a.merges[i + 1]));
  const std::vector<int32_t> specials(a.special_ids.begin(), a.special_ids.end());
  return BpeTokenizer::from_pairs(parse_pattern(a.pattern), std::move(tokens), pairs, specials);
}

SpmArrays to_spm_arrays(const SpmTokenizer& spm) {
  SpmArrays a;
  pack_texts(spm.pieces(), a.token_bytes, a.token_offsets);
  a.scores = spm.scores();
  a.token_types = spm.types();
  a.add_space_prefix = spm.add_space_prefix();
  return a;
}

SpmTokenizer from_spm_arrays(const SpmArrays& a) {
  KVLAB_CHECK(a.add_space_prefix == 0 || a.add_space_prefix == 1, "add_space_prefix is ",
              a.add_space_prefix, ", not 0 or 1");
  return SpmTokenizer::from_parts(unpack_texts(a.token_bytes, a.token_offsets), a.scores,
                                  a.token_types, a.add_space_prefix == 1);
}
}  // namespace

void put_tokenizer(Checkpoint& ckpt, const Tokenizer& tok) {
  ckpt.tokenizer_kind = tok.kind_name();
  ckpt.tokenizer_vocab.clear();
  if (tok.bpe() != nullptr) {
    ckpt.tokenizer_bpe = to_bpe_arrays(*tok.bpe());
  } else if (tok.spm() != nullptr) {
    ckpt.tokenizer_spm = to_spm_arrays(*tok.spm());
  } else {
    ckpt.tokenizer_vocab = tok.vocab();
  }
  const TokenControls& c = tok.controls();
  ckpt.tokenizer_bos = c.bos;
  ckpt.tokenizer_eos = c.eos;
  ckpt.tokenizer_add_bos = c.add_bos;
  ckpt.tokenizer_add_eos = c.add_eos;
  ckpt.tokenizer_eog.assign(c.eog.begin(), c.eog.end());
  ckpt.tokenizer_user_defined.assign(c.user_defined.begin(), c.user_defined.end());
  ckpt.tokenizer_chat_template = c.chat_template;
}

Tokenizer get_tokenizer(const Checkpoint& ckpt, const std::filesystem::path& file) {
  try {
    const TokenizerKind kind = Tokenizer::parse_kind(ckpt.tokenizer_kind);
    Tokenizer tok = kind == TokenizerKind::Spm ? Tokenizer::spm(from_spm_arrays(ckpt.tokenizer_spm))
                    : kind == TokenizerKind::Bpe && !ckpt.tokenizer_bpe.token_offsets.empty()
                        ? Tokenizer::bpe(from_bpe_arrays(ckpt.tokenizer_bpe))
                        : Tokenizer::from_vocab(kind, ckpt.tokenizer_vocab);
    for (const int64_t id : {ckpt.tokenizer_bos, ckpt.tokenizer_eos})
      KVLAB_CHECK(id >= -1 && id <= INT32_MAX, "bos or eos ", id, " is not an id (or -1)");
    for (const int64_t flag : {ckpt.tokenizer_add_bos, ckpt.tokenizer_add_eos})
      KVLAB_CHECK(flag == 0 || flag == 1, "add_bos or add_eos is ", flag, ", not 0 or 1");
    TokenControls c{.bos = static_cast<int32_t>(ckpt.tokenizer_bos),
                    .eos = static_cast<int32_t>(ckpt.tokenizer_eos),
                    .add_bos = ckpt.tokenizer_add_bos == 1,
                    .add_eos = ckpt.tokenizer_add_eos == 1,
                    .user_defined = {},
                    .eog = {},
                    .chat_template = ckpt.tokenizer_chat_template};
    for (const uint32_t id : ckpt.tokenizer_eog)
      c.eog.push_back(static_cast<int32_t>(std::min<uint32_t>(id, INT32_MAX)));
    for (const uint32_t id : ckpt.tokenizer_user_defined)
      c.user_defined.push_back(static_cast<int32_t>(std::min<uint32_t>(id, INT32_MAX)));
    tok.set_controls(std::move(c));
    return tok;
  } catch (const Error& e) {
    KVLAB_CHECK(false, "checkpoint ", file.string(), ": /tokenizer: ", e.what());
  }
  return Tokenizer::byte_level();  // unreachable
}

void save_tokenizer(const std::filesystem::path& file, const Tokenizer& tok) {
  Checkpoint ckpt;
  put_tokenizer(ckpt, tok);
  save_checkpoint(file, ckpt);
}

Checkpoint load_model_file(const std::filesystem::path& file, const LoadOptions& options) {
  if (is_gguf_file(file)) return gguf_to_checkpoint(read_gguf(file), file.string());
  return load_checkpoint(file, options);
}

Tokenizer load_tokenizer(const std::filesystem::path& file) {
  if (is_gguf_file(file)) return gguf_tokenizer(read_gguf(file), file.string());
  return get_tokenizer(load_checkpoint(file, false), file);
}

void put_optimizer(Checkpoint& ckpt, const AdamW& opt) {
  ckpt.has_optimizer = true;
  ckpt.optimizer_step = opt.step_count();
  ckpt.optimizer_m = to_arrays(opt.exp_avg());
  ckpt.optimizer_v = to_arrays(opt.exp_avg_sq());
}

void get_optimizer(AdamW& opt, const Checkpoint& ckpt, const std::filesystem::path& file) {
  KVLAB_CHECK(ckpt.has_optimizer, "checkpoint ", file.string(),
              ": no /optimizer group, cannot resume training from it");
  copy_into(opt.exp_avg(), ckpt.optimizer_m, "optimizer/m", file);
  copy_into(opt.exp_avg_sq(), ckpt.optimizer_v, "optimizer/v", file);
  opt.set_step_count(ckpt.optimizer_step);
}

LoadedModel load_model(const std::filesystem::path& file, bool with_training_state) {
  Checkpoint ckpt = load_model_file(file, gpt_load_options(file, with_training_state));
  const GPTConfig cfg = get_gpt_config(ckpt.config, file);
  Tokenizer tok = get_tokenizer(ckpt, file);
  KVLAB_CHECK(tok.vocab_size() == cfg.vocab_size, "checkpoint ", file.string(), ": tokenizer has ",
              tok.vocab_size(), " symbols, /config vocab_size is ", cfg.vocab_size);
  auto model = std::make_unique<GPT>(cfg, GPT::WeightsToLoad{});
  move_into(model->named_parameters(), ckpt.model, "model", file);
  model->set_training(false);
  ckpt.model.clear();
  return {std::move(model), std::move(tok), std::move(ckpt), file};
}

std::string file_content_hash(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  KVLAB_CHECK(in.good(), "cannot read ", file.string(), " to hash it");
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  KVLAB_CHECK(!in.bad(), "reading ", file.string(), " to hash it failed");
  return hash_hex(fnv1a64(bytes));
}

}  // namespace kvlab
