// One timed round of kvlab's BPE, printing JSON (bench/compare_bpe.sh alternates it with the
// baselines of bench/bpe_baselines.js):
//   bench_bpe train --corpus F --vocab-size N     train_bpe on F's bytes (one thread)
//   bench_bpe encode --ranks R --text F           F encoded with tiktoken rank file R's
//                                                 vocabulary (gpt2 pattern), a fresh tokenizer
//                                                 (empty chunk cache) each round
//   bench_bpe encode --gguf V --text F            the same with a GGUF file's vocabulary
//                                                 (llama.cpp's ggml-vocab-llama-bpe.gguf)
// Only the work is timed: reading the files and building the vocabulary are not.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iterator>

#include "bench/bench_util.h"
#include "checkpoints/gguf_model.h"
#include "data/bpe.h"

namespace {

std::string read_file(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + file);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvlab;
  CLI::App app{"kvlab's BPE training or encoding speed, one round"};
  app.require_subcommand(1);
  std::string corpus, ranks, gguf, text, pattern = "kvlab";
  int vocab_size = 4096;
  CLI::App* train = app.add_subcommand("train", "Time train_bpe on a corpus");
  train->add_option("--corpus", corpus, "Text to learn from")->required();
  train->add_option("--vocab-size", vocab_size, "Tokens in all")->capture_default_str();
  train->add_option("--pattern", pattern, "Pre-split pattern")->capture_default_str();
  CLI::App* encode = app.add_subcommand("encode", "Time encoding a text");
  auto* ranks_opt = encode->add_option("--ranks", ranks, "tiktoken rank file (gpt2)");
  encode->add_option("--gguf", gguf, "GGUF file whose vocabulary to encode with")
      ->excludes(ranks_opt);
  encode->require_option(2);
  encode->add_option("--text", text, "Text to encode")->required();
  CLI11_PARSE(app, argc, argv);

  bench::Json out;
  if (train->parsed()) {
    const std::string bytes = read_file(corpus);
    const double t0 = bench::now_s();
    const BpeTokenizer tok = train_bpe(bytes, vocab_size, parse_pattern(pattern));
    const double s = bench::now_s() - t0;
    out = {{"side", "kvlab"},          {"seconds", s},
           {"bytes", bytes.size()},    {"mb_per_s", static_cast<double>(bytes.size()) / 1e6 / s},
           {"vocab_size", tok.vocab_size()}, {"merges", tok.merges().size()},
           {"threads", 1}};
  } else {
    const Tokenizer tok = gguf.empty() ? Tokenizer::bpe(BpeTokenizer::from_tiktoken(
                                             read_file(ranks), SplitPattern::Gpt2))
                                       : gguf_tokenizer(read_gguf(gguf), gguf);
    const std::string bytes = read_file(text);
    const double t0 = bench::now_s();
    const std::vector<int32_t> ids = tok.encode(bytes);
    const double s = bench::now_s() - t0;
    out = {{"side", "kvlab"},       {"seconds", s},
           {"bytes", bytes.size()}, {"mb_per_s", static_cast<double>(bytes.size()) / 1e6 / s},
           {"tokens", ids.size()},  {"threads", 1}};
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
