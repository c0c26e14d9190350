// kvlab tokenizer: train a byte-level BPE vocabulary on a corpus, import GPT-2's or tiktoken's,
// and encode, decode or inspect with the tokenizer of a tokenizer file or of a checkpoint.
#include <cctype>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "apps/cli.h"
#include "apps/train_progress.h"
#include "checkpoints/gguf_model.h"
#include "checkpoints/model_io.h"

namespace kvlab {

namespace {

struct TokenizerArgs {
  std::string train_pattern = "kvlab";
  std::string corpus, out, pattern, tiktoken, vocab, merges, gguf, tokenizer, input;
  int vocab_size = 0;
  bool json = false;
};

std::string read_all(const std::string& file) {
  if (file.empty() || file == "-") {
    std::string text{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
    KVLAB_CHECK(!std::cin.bad(), "reading the standard input failed");
    return text;
  }
  std::ifstream in(file, std::ios::binary);
  KVLAB_CHECK(in.good(), "cannot read ", file);
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  KVLAB_CHECK(!in.bad(), "reading ", file, " failed");
  return text;
}

void print_summary(const std::string& verb, const Tokenizer& tok, const std::string& out) {
  const BpeTokenizer& bpe = *tok.bpe();
  const size_t n_special = bpe.special_ids().size();
  const size_t unused = static_cast<size_t>(bpe.n_special()) - n_special;
  std::printf("%s %s: bpe, pattern %s, %d tokens (256 bytes, %zu merges, %zu special%s)\n",
              verb.c_str(), out.c_str(), pattern_name(bpe.pattern()).c_str(), bpe.vocab_size(),
              bpe.merges().size(), n_special,
              unused ? detail::cat(", ", unused, " unused ids").c_str() : "");
}

void run_train(const TokenizerArgs& a) {
  KVLAB_USAGE_CHECK(a.vocab_size >= 257, "--vocab-size ", a.vocab_size,
                    " is below the 256 bytes plus <|endoftext|>; it must be at least 257");
  const SplitPattern pattern = parse_pattern(a.train_pattern);
  const std::string corpus = read_all(a.corpus);
  const Tokenizer tok =
      Tokenizer::bpe(train_bpe(corpus, a.vocab_size, pattern, bpe_progress_bar("bpe")));
  save_tokenizer(a.out, tok);
  print_summary("wrote", tok, a.out);
}

// The tokenizer of one of import's three sources.
Tokenizer imported_tokenizer(const TokenizerArgs& a) {
  const bool gpt2_files = !a.vocab.empty() || !a.merges.empty();
  KVLAB_USAGE_CHECK(!a.tiktoken.empty() + gpt2_files + !a.gguf.empty() == 1,
                    "tokenizer import takes one of --tiktoken FILE, --vocab FILE --merges FILE "
                    "or --gguf FILE");
  if (!a.gguf.empty()) {
    KVLAB_USAGE_CHECK(a.pattern.empty(), "tokenizer import --gguf: the file names its "
                      "pre-tokenizer (tokenizer.ggml.pre); leave --pattern out");
    return gguf_tokenizer(read_gguf(a.gguf), a.gguf);
  }
  KVLAB_USAGE_CHECK(!gpt2_files || (!a.vocab.empty() && !a.merges.empty()),
                    "tokenizer import: --vocab and --merges go together");
  KVLAB_USAGE_CHECK(gpt2_files || !a.pattern.empty(), "tokenizer import --tiktoken needs --pattern (",
                    pattern_names(), "): a rank file does not name its pre-split regex");
  const SplitPattern pattern = parse_pattern(a.pattern.empty() ? "gpt2" : a.pattern);
  return Tokenizer::bpe(gpt2_files
                            ? BpeTokenizer::from_gpt2(read_all(a.vocab), read_all(a.merges), pattern)
                            : BpeTokenizer::from_tiktoken(read_all(a.tiktoken), pattern));
}

void run_import(const TokenizerArgs& a) {
  const Tokenizer tok = imported_tokenizer(a);
  save_tokenizer(a.out, tok);
  if (tok.bpe())
    print_summary("wrote", tok, a.out);
  else
    std::printf("wrote %s: %s, %d tokens\n", a.out.c_str(), tok.kind_name().c_str(),
                tok.vocab_size());
}

void run_encode(const TokenizerArgs& a) {
  const Tokenizer tok = load_tokenizer(a.tokenizer);
  const std::vector<int32_t> ids = tok.encode(read_all(a.input), "input");
  if (a.json) {
    std::printf("%s\n", nlohmann::json(ids).dump().c_str());
    return;
  }
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
  std::printf("%s\n", line.c_str());
}

// Ids separated by whitespace or commas, brackets allowed (a JSON array reads as well).
std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::string word;
  const auto flush = [&] {
    if (word.empty()) return;
    int32_t id = 0;
    const auto [stop, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
    KVLAB_CHECK(ec == std::errc() && stop == word.data() + word.size(), "decode: '", word,
                "' is not a token id");
    ids.push_back(id);
    word.clear();
  };
  for (const char c : text) {
    if (std::isspace(static_cast<unsigned char>(c)) || c == ',' || c == '[' || c == ']')
      flush();
    else
      word += c;
  }
  flush();
  return ids;
}

void run_decode(const TokenizerArgs& a) {
  const Tokenizer tok = load_tokenizer(a.tokenizer);
  const std::string text = tok.decode(parse_ids(read_all(a.input)));
  std::fwrite(text.data(), 1, text.size(), stdout);
}

// The ids never made from ordinary text, with their text: bpe's special tokens; spm's unknown,
// control and user-defined pieces.
std::vector<std::pair<int32_t, std::string>> special_tokens(const Tokenizer& tok) {
  std::vector<std::pair<int32_t, std::string>> out;
  if (const BpeTokenizer* bpe = tok.bpe())
    for (const int32_t id : bpe->special_ids()) out.emplace_back(id, bpe->token(id));
  if (const SpmTokenizer* spm = tok.spm())
    for (int32_t id = 0; id < spm->vocab_size(); ++id)
      if (const auto t = static_cast<PieceType>(spm->types()[static_cast<size_t>(id)]);
          t == PieceType::Unknown || t == PieceType::Control || t == PieceType::UserDefined)
        out.emplace_back(id, spm->pieces()[static_cast<size_t>(id)]);
  return out;
}

void run_inspect(const TokenizerArgs& a) {
  const Tokenizer tok = load_tokenizer(a.tokenizer);
  const BpeTokenizer* bpe = tok.bpe();
  const SpmTokenizer* spm = tok.spm();
  if (a.json) {
    nlohmann::json j = {{"kind", tok.kind_name()}, {"vocab_size", tok.vocab_size()}};
    if (bpe != nullptr) {
      j["pattern"] = pattern_name(bpe->pattern());
      j["merges"] = bpe->merges().size();
    }
    if (spm != nullptr) j["add_space_prefix"] = spm->add_space_prefix();
    for (const auto& [id, text] : special_tokens(tok)) j["special"][text] = id;
    std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return;
  }
  std::printf("tokenizer %s: %s, %d tokens\n", a.tokenizer.c_str(), tok.kind_name().c_str(),
              tok.vocab_size());
  if (bpe != nullptr)
    std::printf("pattern: %s\nmerges: %zu\n", pattern_name(bpe->pattern()).c_str(),
                bpe->merges().size());
  if (spm != nullptr) std::printf("add_space_prefix: %d\n", spm->add_space_prefix());
  for (const auto& [id, text] : special_tokens(tok))
    std::printf("special: %d %s\n", id, text.c_str());
}

}  // namespace

void add_tokenizer_command(CLI::App& root) {
  auto a = std::make_shared<TokenizerArgs>();
  CLI::App* cmd = root.add_subcommand(
      "tokenizer",
      "Train, import, and use byte-level BPE tokenizers; import SentencePiece ones (tok.h5 files)");
  cmd->require_subcommand(1);
  // Training takes kvlab's own patterns; an imported vocabulary any of them.
  const auto train_patterns = CLI::IsMember({"gpt2", "cl100k", "kvlab"});

  CLI::App* train = cmd->add_subcommand("train", "Learn a BPE vocabulary from a corpus");
  train->add_option("--corpus", a->corpus, "Text file to learn from")->required();
  train
      ->add_option("--vocab-size", a->vocab_size,
                   "Tokens in all: 256 bytes, the merges, and <|endoftext|>")
      ->required()
      ->check(integer_of<int>());
  train->add_option("--out", a->out, "Tokenizer file to write (.h5)")->required();
  train
      ->add_option("--pattern", a->train_pattern,
                   "Pre-split regex: kvlab (the cl100k regex), cl100k or gpt2")
      ->check(train_patterns)
      ->capture_default_str();
  train->callback([a] { run_train(*a); });

  CLI::App* import = cmd->add_subcommand(
      "import",
      "Write a tokenizer file from a tiktoken rank file, GPT-2's vocab.json + merges.txt, or a "
      "GGUF file's vocabulary (a model, or llama.cpp's vocabulary-only files)");
  import->add_option("--tiktoken", a->tiktoken, "tiktoken rank file (<base64 token> <rank> lines)");
  import->add_option("--vocab", a->vocab, "GPT-2 vocab.json");
  import->add_option("--merges", a->merges, "GPT-2 merges.txt");
  import->add_option("--gguf", a->gguf,
                     "GGUF file whose tokenizer.ggml.* vocabulary to read (byte-level BPE with "
                     "pre-tokenizer gpt-2, llama-bpe, qwen2, deepseek-llm or deepseek-coder; "
                     "or SentencePiece)");
  import->add_option("--pattern", a->pattern, "Pre-split regex: " + pattern_names())
      ->check(CLI::IsMember(pattern_name_list()));
  import->add_option("--out", a->out, "Tokenizer file to write (.h5)")->required();
  import->callback([a] { run_import(*a);
});

const auto add_use = [&](const char* name, const char* help, const char* input_help,
                         void (*run)(const TokenizerArgs&)) {
  CLI::App* sub = cmd->add_subcommand(name, help);
  sub->add_option("--tokenizer", a->tokenizer,
                  "Tokenizer file, model checkpoint (.h5) or GGUF model file")
      ->required();
  if (input_help != nullptr) sub->add_option("file", a->input, input_help);
  sub->add_flag("--json", a->json, "Print JSON");
  sub->callback([a, run] { run(*a); });
};
add_use("encode", "Print the token ids of a file's bytes (stdin without FILE)",
        "File to encode (default: stdin)", run_encode);
add_use("decode",
        "Write the bytes of token ids (whitespace- or comma-separated, stdin without FILE)",
        "File of ids (default: stdin)", run_decode);
add_use("inspect", "Print a tokenizer's kind, pattern, size and special tokens", nullptr,
        run_inspect);
}  // namespace kvlab

}  // namespace kvlab
