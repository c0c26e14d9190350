#include "apps/train_flags.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <utility>
#include <variant>
#include <vector>

#include "apps/cli.h"
#include "apps/config_file.h"
#include "checkpoints/model_io.h"

namespace kvlab {

std::string default_corpus() { return KVLAB_DEFAULT_CORPUS; }

namespace {

// --config, the corpus and its tokenizer.
void add_data_flags(CLI::App* cmd, TrainFlags& f) {
  TrainConfig& c = f.cfg;
  // Expanded into flags before parsing (apps/config_file.h); declared here for --help, and its
  // keys are checked against this command's flags.
  register_config_command(cmd);
  static std::string config_file;
  cmd->add_option("--config", config_file,
                  "Read flags from a file of 'key = value' lines (the same keys; command-line "
                  "flags win)");
  cmd->add_option("--corpus", c.corpus,
                  "UTF-8 text file to train on (90/10 train/val split); its tokens are cached "
                  "beside it as FILE.<hash>.<tokenizer>.kvlab-cache (bpe: "
                  "FILE.<hash>.bpe-<vocab size>-kvlab-val<fraction>.kvlab-cache; an edit "
                  "replaces it)")
      ->capture_default_str();
  cmd->add_option("--tokenizer", c.tokenizer,
                  "char (code points of the corpus), byte, or bpe (a byte-level BPE vocabulary "
                  "of --vocab-size tokens learnt from the training split, cached beside the "
                  "corpus)")
      ->check(CLI::IsMember({"char", "byte", "bpe"}))
      ->capture_default_str();
  cmd->add_option("--vocab-size", c.model.vocab_size,
                  "With --tokenizer bpe: tokens in the vocabulary and the model (256 bytes, the "
                  "merges and <|endoftext|>; at least 257)")
      ->check(integer_of<int64_t>());
}

// The model's size and its block's parts (positions, norm, MLP, attention).
void add_model_flags(CLI::App* cmd, TrainFlags& f, bool with_n_kv_head) {
  TrainConfig& c = f.cfg;
  add_number(cmd, "--n-layer", c.model.n_layer, "Transformer blocks");
  add_number(cmd, "--n-head", c.model.n_head, "Query heads");
  if (with_n_kv_head)
    cmd->add_option("--n-kv-head", f.n_kv_head,
                    "Key/value heads: n-head (MHA), a divisor (GQA) or 1 (MQA); default n-head")
        ->check(integer_of<int64_t>())
        ->each([&f](const std::string&) { f.n_kv_head_given = true; });
  add_number(cmd, "--n-embd", c.model.n_embd, "Channels (n_embd)");
  add_number(cmd, "--mlp-hidden", c.model.mlp_hidden,
             "MLP width; 0 means 4 * n-embd for GELU and, for SwiGLU's three matrices, 8/3 * "
             "n-embd rounded to a multiple of 8 (GELU's parameter count within a few)");
  cmd->add_option("--arch", f.arch,
                  "Block preset: gpt2 (learned positions, LayerNorm, GELU, biases) or llama "
                  "(rope, rmsnorm, swiglu, no biases); the four flags below override a part")
      ->check(CLI::IsMember({"gpt2", "llama"}))
      ->capture_default_str();
  cmd->add_option("--pos", f.pos,
                  "Positions: learned (a table added to the token embeddings) or rope (rotary: "
                  "each head's queries and keys turned by their position)")
      ->check(CLI::IsMember({"learned", "rope"}));
  add_number(cmd, "--rope-theta", c.model.rope_theta,
             "RoPE's base: channel pair j turns at theta^(-2j / head size) per position");
  cmd->add_option("--norm", f.norm, "Normalisation: layernorm or rmsnorm")
      ->check(CLI::IsMember({"layernorm", "rmsnorm"}));
  cmd->add_option("--mlp", f.mlp,
                  "MLP: gelu (c_proj(gelu(c_fc x))) or swiglu (c_proj(silu(c_fc x) * c_up x))")
      ->check(CLI::IsMember({"gelu", "swiglu"}));
  cmd->add_flag_function(
      "--bias,!--no-bias", [&f](int64_t n) { f.bias = n > 0 ? 1 : 0; },
      "Biases in every Linear and LayerNorm (--no-bias: none; RMSNorm never has one)");
  cmd->add_option("--attn", c.model.attn,
                  "Attention: gqa (--n-kv-head key/value heads: MHA to MQA) or mla "
                  "(DeepSeek-V2's multi-head latent attention, cached in latent form; needs "
                  "--pos rope)")
      ->check(CLI::IsMember({"gqa", "mla"}))
      ->capture_default_str();
  add_number(cmd, "--kv-lora-rank", c.model.kv_lora_rank,
             "MLA: rank of the latent each position's keys and values are rebuilt from");
  add_number(cmd, "--rope-head-dim", c.model.rope_head_dim,
             "MLA: width of the rotary key shared by every head (even)");
  add_number(cmd, "--q-lora-rank", c.model.q_lora_rank,
             "MLA: rank of the compressed query latent (RMS-normed) the queries are built "
             "from; 0: from x directly");
  add_number(cmd, "--block-size", c.model.block_size, "Context length in tokens");
  add_number(cmd, "--dropout", c.model.dropout, "Dropout on attention and residual paths");
  cmd->add_flag("--untied", f.untied, "Separate LM head instead of the token embedding");
}

// The optimiser, its schedule, evaluations and checkpoints.
void add_optimiser_flags(CLI::App* cmd, TrainConfig& c) {
  add_number(cmd, "--batch-size", c.batch_size, "Sequences per micro-batch");
  add_number(cmd, "--grad-accum", c.grad_accum, "Micro-batches per optimizer step");
  add_number(cmd, "--iters", c.iters, "Optimizer steps");
  add_number(cmd, "--lr", c.lr, "Peak learning rate");
  add_number(cmd, "--min-lr", c.min_lr, "Learning rate at the end of the cosine decay");
  add_number(cmd, "--warmup", c.warmup, "Linear warmup steps");
  add_number(cmd, "--beta1", c.beta1, "AdamW beta1");
  add_number(cmd, "--beta2", c.beta2, "AdamW beta2");
  add_number(cmd, "--weight-decay", c.weight_decay, "AdamW weight decay (2-D weights only)");
  add_number(cmd, "--grad-clip", c.grad_clip, "Global gradient-norm clip; 0 disables");
  add_number(cmd, "--eval-interval", c.eval_interval, "Steps between validation evaluations");
  add_number(cmd, "--eval-iters", c.eval_iters,
             "Validation batches per evaluation (fixed windows, the same for every run)");
  add_number(cmd, "--ckpt-interval", c.ckpt_interval,
             "Steps between checkpoints; 0 means at every evaluation");
  add_number(cmd, "--seed", c.seed, "Seed of the initial weights, batches and dropout");
}

}  // namespace

void add_train_flags(CLI::App* cmd, TrainFlags& f, bool with_n_kv_head) {
  f.cfg.corpus = default_corpus();
  f.cmd = cmd;
  add_data_flags(cmd, f);
  add_model_flags(cmd, f, with_n_kv_head);
  add_optimiser_flags(cmd, f.cfg);
  add_device_flags(cmd, f.device, f.dtype);
}

void add_device_flags(CLI::App* cmd, std::string& device, std::string& dtype) {
  cmd->add_option("--device", device,
                  "cpu, or cuda (the first visible GPU; needs a build with the CUDA backend)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--dtype", dtype,
                  "f32, or bf16 on cuda: matrix products in bf16 with f32 accumulation; "
                  "weights, optimizer state and checkpoints stay f32")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
}

Device parse_device(const std::string& device) {
  const Device d = device == "cuda" ? Device::CUDA : Device::CPU;
  check_device_available(d);
  return d;
}

MatmulPrecision parse_dtype(const std::string& dtype, Device device) {
  if (dtype != "bf16") return MatmulPrecision::F32;
  KVLAB_USAGE_CHECK(device == Device::CUDA, "--dtype bf16 needs --device cuda (the CPU computes "
                    "in f32)");
  return MatmulPrecision::BF16;
}

void add_kv_dtype_flag(CLI::App* cmd, std::string& kv_dtype) {
  cmd->add_option("--kv-dtype", kv_dtype,
                  "KV cache element type: f32; bf16 (keys and values rounded as they are cached: "
                  "half the memory and the bytes a decode step reads); or, on the CPU, quantised "
                  "as cached: fp8 (E4M3, a scale per layer and KV head), int8 (a scale per "
                  "position and KV head) or int4 (a scale and minimum per group of up to 32 "
                  "channels). `kvlab bench kv-quality` measures what each costs a model")
      ->check(CLI::IsMember(format_name_list(kKVEntries)))
      ->capture_default_str();
}

void add_kv_cache_flags(CLI::App* cmd, KVCacheFlags& flags) {
  cmd->add_option("--cache", flags.layout,
                  "KV cache layout: paged (blocks of --kv-block-size positions taken as rows "
                  "grow, shared by samples of one prompt and by prompts that begin alike, handed "
                  "back as rows finish; CPU only) or contiguous (every row's whole generation "
                  "allocated up front). Default: paged on the CPU, contiguous on CUDA")
      ->check(CLI::IsMember({"paged", "contiguous"}));
  add_number(cmd, "--kv-block-size", flags.block_size,
             "Positions per block of the paged cache: a power of two, at most the model's "
             "block_size");
  cmd->add_option("--kv-memory", flags.memory,
                  "The paged cache's pool, e.g. 64MiB (running out is an error that says so); "
                  "default: room for every row's whole generation");
}

int64_t parse_bytes(const std::string& text, const std::string& flag) {
  static const std::pair<const char*, double> kUnits[] = {
      {"KiB", 1024.0}, {"MiB", 1024.0 * 1024}, {"GiB", 1024.0 * 1024 * 1024},
      {"kB", 1e3},     {"MB", 1e6},            {"GB", 1e9},
      {"B", 1.0},      {"", 1.0}};
  size_t end = 0;
  double number = 0;
  try {
    number = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  const std::string unit = text.substr(end);
  double scale = 0;
  for (const auto& [name, s] : kUnits)
    if (unit == name) scale = s;
  const double bytes = number * scale;
  KVLAB_USAGE_CHECK(end > 0 && scale > 0 && std::isfinite(bytes) && bytes >= 1 && bytes < 9e18,
                    flag, " must be a size such as 64MiB, 1GiB or 4096 (bytes), got '", text,
                    "'");
  return static_cast<int64_t>(bytes);
}

std::string kv_cache_layout(const KVCacheFlags& flags, Device device) {
  if (!flags.layout.empty()) return flags.layout;
  return device == Device::CPU ? "paged" : "contiguous";
}

std::optional<PagedCacheOptions> parse_kv_cache(const KVCacheFlags& flags, int64_t context,
                                                Device device) {
  const int64_t n = flags.block_size;
  KVLAB_USAGE_CHECK(n >= 1 && (n & (n - 1)) == 0, "--kv-block-size must be a power of two, got ",
                    n);
  KVLAB_USAGE_CHECK(n <= context, "--kv-block-size ", n,
                    " is larger than the model's context (block_size ", context, ")");
  if (kv_cache_layout(flags, device) != "paged") {
    KVLAB_USAGE_CHECK(flags.memory.empty(),
                      "--kv-memory sizes the paged cache's pool; the contiguous cache takes "
                      "every row's whole generation (drop --kv-memory or use --cache paged)");
    return std::nullopt;
  }
  KVLAB_USAGE_CHECK(device == Device::CPU,
                    "the paged KV cache runs on the CPU only: use --cache contiguous on CUDA");
  PagedCacheOptions o{.kv_block_size = n};
  if (!flags.memory.empty()) o.pool_bytes = parse_bytes(flags.memory, "--kv-memory");
  return o;
}

void add_weight_dtype_flag(CLI::App* cmd, std::string& weight_dtype) {
  cmd->add_option("--weight-dtype", weight_dtype,
                  "The products' matrices: f32, bf16, q8_0 or q4_0, rounded once at load on "
                  "every path (q8_0/q4_0: ggml's blocks of 32; with q4_0 the LM head is q8_0, and "
                  "a matrix whose rows are not whole blocks is bf16); the fused CPU decode reads "
                  "them in 2, 1.125 or 0.625 bytes a value, and a model imported from a q8_0/q4_0 "
                  "GGUF file in its own blocks. The token table is rounded when it is the LM head "
                  "(tied); biases, norms and positions stay f32")
      ->check(CLI::IsMember(format_name_list(kWeights)))
      ->capture_default_str();
}

void add_weight_dtype_flag(CLI::App* cmd, std::string& weight_dtype, bool& int8_products) {
  add_weight_dtype_flag(cmd, weight_dtype);
  cmd->add_flag("--int8-products", int8_products,
                "Multiply q8_0 and q4_0 matrices (--weight-dtype, or a model imported from such "
                "a GGUF file) in integers in the fused CPU decode, as llama.cpp does: each "
                "product's input rounded to q8_0 blocks of 32. Faster, at a small cost in "
                "quality (kvlab bench weight-quality --int8-products); without it the products "
                "are exact over the rounded matrices");
}

WeightDtype parse_weight_dtype(const std::string& dtype) {
  const Format* f = format_named(dtype, kWeights);
  return f ? subset_member<WeightDtype>(*f) : WeightDtype::F32;  // the flag's check admits no other name
}

DType parse_storage_dtype(const std::string& dtype) {
  const Format* f = format_named(dtype, kKVEntries);
  return f ? subset_member<DType>(*f) : DType::F32;  // the flags' checks admit no other name
}

namespace {

// A comma-separated list of the names in `known` (`what` in the errors), each once, parsed by
// `parse`: a usage error names a bad or repeated one.
template <class T, class Parse>
std::vector<T> parse_dtype_list(const std::string& list, const char* flag,
                                const std::vector<std::string>& known, const char* what,
                                Parse parse) {
  std::string names;
  for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
  std::vector<T> out;
  std::stringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    KVLAB_USAGE_CHECK(std::find(known.begin(), known.end(), name) != known.end(), flag, ": '",
                      name, "' is not a ", what, " (", names, ")");
    const T d = parse(name);
    KVLAB_USAGE_CHECK(std::find(out.begin(), out.end(), d) == out.end(), flag, ": ", name,
                      " is listed twice");
    out.push_back(d);
  }
  KVLAB_USAGE_CHECK(!out.empty(), flag, ": the list is empty");
  return out;
}

}  // namespace

std::vector<DType> parse_kv_dtypes(const std::string& list) {
  return parse_dtype_list<DType>(list, "--kv-dtypes", format_name_list(kKVEntries),
                                 "KV cache dtype", parse_storage_dtype);
}

std::vector<WeightDtype> parse_weight_dtypes(const std::string& list) {
  return parse_dtype_list<WeightDtype>(list, "--weight-dtypes", format_name_list(kWeights),
                                       "weight dtype", parse_weight_dtype);
}

namespace {

// The block's parts: --arch's preset, each part overridden by its own flag where given.
void block_from_flags(const TrainFlags& f, GPTConfig& m) {
  const bool llama = f.arch == "llama";
  m.pos = !f.pos.empty() ? f.pos : llama ? "rope" : "learned";
  m.norm = !f.norm.empty() ? f.norm : llama ? "rmsnorm" : "layernorm";
  m.mlp = !f.mlp.empty() ? f.mlp : llama ? "swiglu" : "gelu";
  m.bias = f.bias >= 0 ? f.bias == 1 : !llama;
}

std::string attr_text(const AttrValue& v) {
  std::ostringstream os;
  std::visit([&](const auto& x) { os << x; }, v);
  return os.str();
}

// The flag that sets model key `key` of /config.
std::string model_key_flag(const std::string& key) {
  if (key == "tied") return "--untied";
  std::string flag = "--" + key;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

}  // namespace

void take_model_from(TrainFlags& f, const GPTConfig& theirs, const std::string& tokenizer_kind,
                     const std::string& what, const std::string& file) {
  KVLAB_CHECK(f.cmd != nullptr, "take_model_from: the flags were not added to a command");
  const auto given = [&](const std::string& flag) {
    const CLI::Option* opt = f.cmd->get_option_no_throw(flag);
    return opt != nullptr && opt->count() > 0;
  };
  // The command line's model; --mlp-hidden 0 means the default width at the n_embd the run
  // will have.
  GPTConfig mine = f.cfg.model;
  mine.n_kv_head = f.n_kv_head_given ? f.n_kv_head : mine.n_head;
  mine.tied = !f.untied;
  block_from_flags(f, mine);
  if (mine.mlp_hidden == 0 && !given("--n-embd")) {
    GPTConfig width = mine;  // the default width at the file's n_embd
    width.n_embd = theirs.n_embd;
    mine.mlp_hidden = width.hidden();
  }
  Attrs ours, file_attrs;
  put_gpt_config(ours, mine);
  put_gpt_config(file_attrs, theirs);
  std::string conflicts;
  const auto conflict = [&](const std::string& key, const std::string& cli,
                            const std::string& in_file) {
    conflicts += detail::cat(conflicts.empty() ? "" : "; ", key, " ", cli, " on the command line, ",
                             in_file, " in ", file);
  };
  // --arch gives every part of the block it presets.
  const auto block_part = [](const std::string& key) {
    return key == "pos" || key == "norm" || key == "mlp" || key == "bias";
  };
  for (const auto& [key, value] : file_attrs) {
    if (key == "dropout" ||
        !(given(model_key_flag(key)) || (block_part(key) && given("--arch"))))
      continue;
    const auto it = ours.find(key);
    if (it != ours.end() && it->second != value)
      conflict(key, attr_text(it->second), attr_text(value));
  }
  if (given("--tokenizer") && f.cfg.tokenizer != tokenizer_kind)
    conflict("tokenizer", f.cfg.tokenizer, tokenizer_kind);
  KVLAB_USAGE_CHECK(conflicts.empty(), what, ": ", conflicts,
                    " (the model's shape and tokenizer come from the checkpoint: drop those "
                    "flags)");
  const double dropout = f.cfg.model.dropout;
  f.cfg.model = theirs;
  f.cfg.model.dropout = dropout;
  f.n_kv_head = theirs.n_kv_head;
  f.n_kv_head_given = true;
  f.untied = !theirs.tied;
  f.pos = theirs.pos;
  f.norm = theirs.norm;
  f.mlp = theirs.mlp;
  f.bias = theirs.bias ? 1 : 0;
  f.cfg.tokenizer = tokenizer_kind;
}

TrainConfig finish_train_flags(const TrainFlags& f) {
  TrainConfig c = f.cfg;
  // Only the flag's absence means MHA; an explicit 0 or negative count is a mistake.
  KVLAB_USAGE_CHECK(!f.n_kv_head_given || c.model.n_head < 1 ||
                        (f.n_kv_head >= 1 && f.n_kv_head <= c.model.n_head),
                    "--n-kv-head must be in [1, n_head] = [1, ", c.model.n_head, "], got ",
                    f.n_kv_head);
  c.model.n_kv_head = f.n_kv_head_given ? f.n_kv_head : c.model.n_head;
  c.model.tied = !f.untied;
  block_from_flags(f, c.model);
  c.device = parse_device(f.device);
  c.precision = parse_dtype(f.dtype, c.device);
  KVLAB_USAGE_CHECK(std::filesystem::exists(c.corpus), "corpus ", c.corpus,
                    ": no such file (pass --corpus FILE, or run scripts/setup.sh for the "
                    "default corpus)");
  const CLI::Option* vocab = f.cmd != nullptr ? f.cmd->get_option_no_throw("--vocab-size") : nullptr;
  KVLAB_USAGE_CHECK(c.tokenizer == "bpe" || vocab == nullptr || vocab->count() == 0,
                    "--vocab-size is for --tokenizer bpe; a ", c.tokenizer,
                    " vocabulary is what the corpus holds");
  try {
    TrainConfig probe = c;
    if (c.tokenizer != "bpe") probe.model.vocab_size = 1;  // the corpus's, known later
    probe.validate();
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  return c;
}

}  // namespace kvlab
