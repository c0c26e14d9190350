// kvlab generate: text from a checkpoint through the KV cache, streamed as it is made.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "apps/cli.h"
#include "apps/train_flags.h"
#include "checkpoints/model_io.h"
#include "data/chat_template.h"
#include "infer/engine.h"

namespace kvlab {

namespace {

struct GenerateArgs {
  std::string ckpt;
  std::string device = "cpu";
  std::string dtype = "f32";
  std::string kv_dtype = "f32";
  KVCacheFlags kv;
  std::string weight_dtype = "f32";
  bool int8_products = false;
  std::string prompt;
  std::string prompt_file;
  bool has_prompt = false, has_prompt_file = false;
  int64_t max_new = 100;
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 0;
  int64_t batch = 1;
  int64_t n = 1;
  bool no_cache = false;
  bool slide = false;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool json = false;
  bool chat = false;
  std::string system;
  std::string chat_template;  // a file; empty: the model's own
};

// A prompt has at most block_size tokens (more with --slide, which keeps the last ones): this
// bounds what is read, so that /dev/zero or a huge file is an error, not all of memory.
constexpr std::streamsize kMaxPromptFileBytes = 64 << 20;

std::string read_file(const std::string& path) {
  std::error_code ec;
  KVLAB_CHECK(!std::filesystem::is_directory(path, ec), "prompt file ", path, " is a directory");
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  KVLAB_CHECK(in.good(), "cannot read prompt file ", path,
              errno != 0 ? detail::cat(": ", std::strerror(errno)) : std::string());
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, static_cast<size_t>(in.gcount()));
    KVLAB_CHECK(static_cast<std::streamsize>(text.size()) <= kMaxPromptFileBytes, "prompt file ",
                path, " is larger than ", kMaxPromptFileBytes >> 20, " MiB");
  }
  KVLAB_CHECK(!in.bad(), "error reading prompt file ", path);
  return text;
}

std::vector<std::string> prompts_of(const GenerateArgs& a) {
  if (!a.has_prompt_file) return std::vector<std::string>(static_cast<size_t>(a.batch), a.prompt);
  std::string text = read_file(a.prompt_file);
  if (a.batch == 1) {  // the whole file is the prompt (less one trailing newline)
    if (text.ends_with("\r\n"))
      text.resize(text.size() - 2);
    else if (text.ends_with('\n'))
      text.pop_back();
    return {text};
  }
  std::vector<std::string> lines;  // --batch N: the first N non-empty lines
  std::istringstream in(text);
  for (std::string line; std::getline(in, line) && static_cast<int64_t>(lines.size()) < a.batch;) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) lines.push_back(line);
  }
  KVLAB_USAGE_CHECK(static_cast<int64_t>(lines.size()) == a.batch, "--batch ", a.batch, " needs ",
                    a.batch, " non-empty lines in ", a.prompt_file, ", found ", lines.size());
  return lines;
}

void check_args(const GenerateArgs& a) {
  KVLAB_USAGE_CHECK(a.has_prompt != a.has_prompt_file,
                    "give exactly one of --prompt and --prompt-file");
  KVLAB_USAGE_CHECK(a.max_new >= 1, "--max-new must be >= 1, got ", a.max_new);
  KVLAB_USAGE_CHECK(std::isfinite(a.temperature) && a.temperature >= 0,
                    "--temperature must be >= 0, got ", a.temperature);
  KVLAB_USAGE_CHECK(a.top_k >= 0, "--top-k must be >= 0 (0 keeps every token), got ", a.top_k);
  KVLAB_USAGE_CHECK(std::isfinite(a.top_p) && a.top_p > 0 && a.top_p <= 1,
                    "--top-p must be in (0, 1], got ", a.top_p);
  KVLAB_USAGE_CHECK(a.batch >= 1, "--batch must be >= 1, got ", a.batch);
  KVLAB_USAGE_CHECK(a.n >= 1, "--n must be >= 1 (samples per prompt), got ", a.n);
  for (const auto& s : a.stop) KVLAB_USAGE_CHECK(!s.empty(), "--stop must not be empty");
  KVLAB_USAGE_CHECK(a.chat || (a.system.empty() && a.chat_template.empty()),
                    "--system and --chat-template need --chat");
}

// Each prompt's ids: its text encoded, or with --chat one user turn (after --system's) rendered
// by the chat template and encoded with its special tokens.
std::vector<std::vector<int32_t>> prompt_ids(const GenerateArgs& a, const Engine& engine,
                                             const std::vector<std::string>& prompts) {
  std::optional<ChatTemplate> tmpl;
  if (a.chat) {
    const std::string source = chat_template_source(a.chat_template, engine.tokenizer());
    KVLAB_CHECK(!source.empty(), "--chat: the model has no chat template "
                                 "(tokenizer.chat_template); give --chat-template FILE");
    tmpl.emplace(source, a.chat_template.empty() ? "the model's chat template" : a.chat_template);
  }
  std::vector<std::vector<int32_t>> ids;
  for (size_t b = 0; b < prompts.size(); ++b) {
    const std::string what = a.has_prompt_file && prompts.size() > 1
                                 ? detail::cat("prompt line ", b + 1)
                                 : std::string("prompt");
    if (!tmpl) {
      ids.push_back(engine.encode(prompts[b], what));
      continue;
    }
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
    messages.push_back({{"role", "user"}, {"content", prompts[b]}});
    ids.push_back(chat_prompt(*tmpl, engine.tokenizer(), messages).ids);
  }
  return ids;
}

// The cache's figures, from its allocations: the most it held, the mean of its utilisation
// (positions stored / positions the memory held holds), prompt positions prefilled and taken
// from the prefix cache, and a paged cache's block counts when it held the most.
nlohmann::json cache_json(const GenerateArgs& a, const GenerationStats& st, Device device) {
  nlohmann::json c{{"enabled", !a.no_cache},
                   {"dtype", a.kv_dtype},
                   {"layout", a.no_cache ? "none" : kv_cache_layout(a.kv, device)},
                   {"bytes", st.cache_bytes},
                   {"positions", st.cache_capacity},
                   {"utilisation_mean", st.utilisation_mean()},
                   {"prefill_positions", st.prefill_positions},
                   {"prefix_hit_positions", st.prefix_hit_positions}};
  if (st.blocks)
    c["blocks"] = {{"kv_block_size", a.kv.block_size}, {"total", st.blocks->total},
                   {"in_use", st.blocks->in_use},      {"cached", st.blocks->cached},
                   {"free", st.blocks->free},          {"positions", st.blocks->positions}};
  return c;
}

// The generation's options from the flags (sampling, cache, slide, stops; the callbacks are
// run_generate's).
GenerateOptions options_of(const GenerateArgs& a) {
  GenerateOptions o;
  o.max_new_tokens = a.max_new;
  o.n = a.n;
  o.sampling.temperature = a.temperature;
  o.sampling.top_k = a.top_k;
  o.sampling.top_p = a.top_p;
  o.sampling.seed = a.seed;
  o.use_cache = !a.no_cache;
  o.slide = a.slide;
  o.stop = a.stop;
  o.ignore_eos = a.ignore_eos;
  return o;
}

// --json's document: every row, the timings, the cache, the sampling and the model (its
// matrices multiplied in integers or not: DecodeStep::multiplies_in_integers).
nlohmann::json result_json(const GenerateArgs& a, const GenerationResult& res, const GPT& model,
                           bool integer_products, Device device,
                           const std::vector<std::string>& prompts) {
  using nlohmann::json;
  const GenerationStats& st = res.stats;
  json rows = json::array();
  json texts = json::array();
  for (size_t b = 0; b < res.rows.size(); ++b) {
    const RowResult& r = res.rows[b];
    texts.push_back(r.text);
    rows.push_back(json{{"prompt", prompts[b / static_cast<size_t>(a.n)]},
                        {"sample", b % static_cast<size_t>(a.n)},
                        {"text", r.text},
                        {"prompt_tokens", r.prompt.size()},
                        {"new_tokens", r.tokens.size()},
                        {"stop_reason", stop_reason_name(r.stop_reason)},
                        {"slides", r.slides},
                        {"ttft_ms", r.ttft_s * 1e3}});
  }
  return json{{"texts", texts},
              {"rows", rows},
              {"timings",
               {{"ttft_ms", st.ttft_s * 1e3},
                {"prefill_ms", st.prefill_s * 1e3},
                {"total_s", st.total_s},
                {"new_tokens", st.new_tokens},
                {"tokens_per_s", st.tokens_per_s()},
                {"decode_tokens_per_s", st.decode_tokens_per_s()},
                {"tpot_mean_ms", st.tpot_mean_s() * 1e3},
                {"tpot_p50_ms", st.tpot_quantile_s(0.5) * 1e3},
                {"tpot_p99_ms", st.tpot_quantile_s(0.99) * 1e3}}},
              {"cache", cache_json(a, st, device)},
              {"sampling",
               {{"temperature", a.temperature},
                {"top_k", a.top_k},
                {"top_p", a.top_p},
                {"seed", a.seed}}},
              {"model",
               {{"n_layer", model.config().n_layer},
                {"n_head", model.config().n_head},
                {"n_kv_head", model.config().n_kv_head},
                {"n_embd", model.config().n_embd},
                {"block_size", model.config().block_size},
                {"vocab_size", model.config().vocab_size},
                {"weight_dtype", a.weight_dtype},
                {"int8_products", integer_products}}}};
}

// The notes on stderr after a text generation: rows stopped at the context, then the timings
// and the cache.
void print_notes(const GenerateArgs& a, const GenerationResult& res, int64_t block,
                 Device device) {
  const GenerationStats& st = res.stats;
  for (size_t b = 0; b < res.rows.size(); ++b)
    if (res.rows[b].stop_reason == StopReason::ContextLimit)
      std::fprintf(stderr,
                   "kvlab: note: %sstopped at the context limit (block_size %lld) after %zu "
                   "tokens; --slide continues past it\n",
                   res.rows.size() > 1 ? detail::cat("row ", b + 1, " ").c_str() : "",
                   static_cast<long long>(block), res.rows[b].tokens.size());
  // The first token comes from the prefill; with no step after it there is no decode rate.
  char decode[160] = "no decode steps";
  if (!st.step_s.empty())
    std::snprintf(decode, sizeof decode,
                  "%.1f tok/s decode (%.1f overall), TPOT mean %.3f ms p50 %.3f p99 %.3f",
                  st.decode_tokens_per_s(), st.tokens_per_s(), st.tpot_mean_s() * 1e3,
                  st.tpot_quantile_s(0.5) * 1e3, st.tpot_quantile_s(0.99) * 1e3);
  std::string cache = "off";
  if (!a.no_cache)
    cache = detail::cat(
        kv_cache_layout(a.kv, device), " ", a.kv_dtype, ", at most ", st.cache_bytes, " bytes",
        st.blocks ? detail::cat(" (", st.blocks->in_use, " of ", st.blocks->total, " blocks)")
                  : std::string(),
        ", ", static_cast<int>(std::lround(100 * st.utilisation_mean())), "% utilised");
  std::fprintf(stderr, "kvlab: %lld tokens, TTFT %.2f ms, %s, cache %s\n",
               static_cast<long long>(st.new_tokens), st.ttft_s * 1e3, decode, cache.c_str());
}

void run_generate(const GenerateArgs& a) {
  check_args(a);
  const Device device = parse_device(a.device);
  const MatmulPrecisionGuard precision(parse_dtype(a.dtype, device));
  const DType kv_dtype = parse_storage_dtype(a.kv_dtype);
  const std::vector<std::string> prompts = prompts_of(a);
  LoadedModel loaded = load_model(a.ckpt);
  GPT& model = *loaded.model;
  model.to(device);
  model.round_matrices(parse_weight_dtype(a.weight_dtype));
  Engine engine(model, loaded.tokenizer, kv_dtype,
                parse_kv_cache(a.kv, model.config().block_size, device));
  engine.decode_step().int8_products = a.int8_products;

  GenerateOptions o = options_of(a);
  const bool stream = !a.json && prompts.size() == 1 && a.n == 1;
  if (stream) {
    o.on_text = [](int64_t, std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    };
  } else if (!a.json) {
    // Result row r is sample r % n of prompt r / n.
    o.on_finish = [&](int64_t row, std::string_view text, StopReason why) {
      const std::string which =
          a.n == 1 ? detail::cat("row ", row + 1)
                   : detail::cat("row ", row + 1, ": prompt ", row / a.n + 1, ", sample ",
                                 row % a.n + 1);
      std::printf("--- %s (%s) ---\n%s", which.c_str(), stop_reason_name(why),
                  prompts[static_cast<size_t>(row / a.n)].c_str());
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::printf("\n");
      std::fflush(stdout);
    };
  }
  // Encoded first: a bad prompt fails before output.
  const std::vector<std::vector<int32_t>> ids = prompt_ids(a, engine, prompts);
  engine.validate(ids, o);
  if (stream && !a.chat) {  // a chat prints the reply alone
    std::fwrite(prompts[0].data(), 1, prompts[0].size(), stdout);
    std::fflush(stdout);
  }
  const GenerationResult res = engine.generate_ids(ids, o);
  if (a.json) {
    // A byte tokenizer can produce invalid UTF-8: replace it rather than fail.
    const bool integer_products = engine.decode_step().multiplies_in_integers();
    std::printf("%s\n", result_json(a, res, model, integer_products, device, prompts)
                            .dump(2, ' ', false, nlohmann::json::error_handler_t::replace)
                            .c_str());
    return;
  }
  if (stream) {  // ended before the notes on stderr, which a pipe may merge with stdout
    std::printf("\n");
    std::fflush(stdout);
  }
  print_notes(a, res, model.config().block_size, device);
}

}  // namespace

void add_generate_command(CLI::App& root) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = root.add_subcommand(
      "generate", "Generate text from a checkpoint through the KV cache, streamed as it is made");
  cmd->add_option("--ckpt", args->ckpt,
                  "Checkpoint (.h5) written by kvlab train, or a GGUF model file")
      ->required();
  add_device_flags(cmd, args->device, args->dtype);
  add_kv_dtype_flag(cmd, args->kv_dtype);
  add_kv_cache_flags(cmd, args->kv);
  add_weight_dtype_flag(cmd, args->weight_dtype, args->int8_products);
  CLI::Option* prompt = cmd->add_option("--prompt", args->prompt, "Prompt text");
  CLI::Option* prompt_file =
      cmd->add_option("--prompt-file", args->prompt_file,
                      "Read the prompt from a file (one trailing newline dropped); with --batch N, "
                      "its first N non-empty lines are the prompts");
  add_number(cmd, "--max-new", args->max_new, "New tokens per prompt");
  cmd->add_option("--temperature", args->temperature, "Sampling temperature; 0 is greedy")
      ->capture_default_str();
  add_number(cmd, "--top-k", args->top_k, "Keep the k most probable tokens; 0 keeps all");
  cmd->add_option("--top-p", args->top_p,
                  "Nucleus sampling: keep the smallest set with probability >= p, in (0, 1]")
      ->capture_default_str();
  add_number(cmd, "--seed", args->seed, "Sampling seed: the same seed gives the same text");
  add_number(cmd, "--batch", args->batch,
             "Rows generated together: the prompt repeated N times, or N lines of "
             "--prompt-file");
  add_number(cmd, "--n", args->n,
             "Samples per prompt: the prompt is prefilled once and the samples share its "
             "keys and values (with the paged cache, until they write)");
  cmd->add_flag("--no-cache", args->no_cache,
                "Recompute the whole sequence at every step (no KV cache), for comparison");
  cmd->add_flag("--slide", args->slide,
                "Go on past the context limit. Learned positions: re-prefill the last "
                "block_size-1 tokens at positions 0.. (each further token costs a prefill). "
                "RoPE: drop the cache's oldest --kv-block-size positions (with --cache "
                "contiguous 16, at most half the context) and go on from it, positions counting "
                "on: a sliding window, nothing recomputed (with --no-cache, or blocks over half "
                "the context, it re-prefills)");
  cmd->add_option("--stop", args->stop,
                  "Stop a row once its text contains this string "
                  "(repeatable; not printed)");
  cmd->add_flag("--ignore-eos", args->ignore_eos,
                "Go on past the tokenizer's end-of-generation tokens (an imported family's EOS, "
                "EOT and the like), which otherwise end a sample and are not printed");
  cmd->add_flag("--json", args->json, "Print the text(s) and timings as JSON instead of streaming");
  cmd->add_flag("--chat", args->chat,
                "The prompt is a user's turn: rendered by the model's chat template (or "
                "--chat-template) as a conversation, special tokens and all; the reply alone is "
                "printed");
  cmd->add_option("--system", args->system, "With --chat: a system message before the prompt");
  add_chat_template_flag(cmd, args->chat_template);
  cmd->callback([args, prompt, prompt_file] {
    args->has_prompt = prompt->count() > 0;
    args->has_prompt_file = prompt_file->count() > 0;
    run_generate(*args);
  });
}

}  // namespace kvlab
