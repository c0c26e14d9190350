#include "apps/train_flags.h"

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
  cmd->add_option("--task", c.task,
                  "text (the corpus) or mqar: multi-query associative recall (Zoology), "
                  "generated examples of --block-size + 1 tokens, each --mqar-pairs key-value "
                  "pairs then every key queried once; loss and accuracy on the answers only. "
                  "Its defaults: --tokenizer byte, --arch llama, --dropout 0, --n-layer 2, "
                  "--block-size 32, --batch-size 64")
      ->check(CLI::IsMember({"text", "mqar"}))
      ->capture_default_str();
  add_number(cmd, "--mqar-vocab", c.mqar.vocab,
             "MQAR: tokens of the task (keys in the lower half, values in the upper; <= 256)");
  add_number(cmd, "--mqar-pairs", c.mqar.pairs,
             "MQAR: key-value pairs per example (needs --block-size >= 4 x pairs)");
  add_number(cmd, "--mqar-train-examples", c.mqar.train_examples,
             "MQAR: training examples (drawn with replacement)");
  add_number(cmd, "--mqar-val-examples", c.mqar.val_examples,
             "MQAR: validation examples (other than the training ones)");
  add_number(cmd, "--mqar-seed", c.mqar.seed,
             "MQAR: seed of the examples (not of the run: every run sees the same data)");
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

namespace {
bool flag_given(const TrainFlags& f, const char* flag) {
  const CLI::Option* opt = f.cmd != nullptr ? f.cmd->get_option_no_throw(flag) : nullptr;
  return opt != nullptr && opt->count() > 0;
}
}  // namespace

TrainConfig finish_train_flags(const TrainFlags& flags) {
  TrainFlags f = flags;
  // MQAR's defaults where a flag is not given: its tokens byte-level, and Zoology's two layers
  // with rotary positions, no dropout, short examples and batches of 64, which learn the
  // default task within 600 steps (deeper models and batches of 12 take longer than that).
  if (f.cfg.task == "mqar") {
    if (!flag_given(f, "--tokenizer")) f.cfg.tokenizer = "byte";
    if (!flag_given(f, "--arch")) f.arch = "llama";
    if (!flag_given(f, "--dropout")) f.cfg.model.dropout = 0;
    if (!flag_given(f, "--n-layer")) f.cfg.model.n_layer = 2;
    if (!flag_given(f, "--block-size")) f.cfg.model.block_size = 32;
    if (!flag_given(f, "--batch-size")) f.cfg.batch_size = 64;
  }
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
  KVLAB_USAGE_CHECK(c.task != "text" || std::filesystem::exists(c.corpus), "corpus ", c.corpus,
                    ": no such file (pass --corpus FILE, or run scripts/setup.sh for the "
                    "default corpus)");
  KVLAB_USAGE_CHECK(c.tokenizer == "bpe" || !flag_given(f, "--vocab-size"),
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
