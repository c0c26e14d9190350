#pragma once
// What the GGUF model tests share: kvlab's greedy decoding with its logits, a checkpoint's
// weights as a model, and llama.cpp itself as the peer (node-llama-cpp's prebuilt CPU
// binaries in tests/infer/llama_cpp, driven by greedy.mjs: no build, no network, no GPU).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "checkpoints/model_io.h"
#include "infer/engine.h"

namespace kvlab::test {

// Greedy tokens after `prompt`, and (if asked) the logits each was chosen from.
inline std::vector<int32_t> greedy(GPT& model, const Tokenizer& tok,
                                   const std::vector<int32_t>& prompt, int64_t n,
                                   std::vector<std::vector<float>>* logits = nullptr) {
  Engine engine(model, tok);
  GenerateOptions o;
  o.max_new_tokens = n;
  o.sampling.temperature = 0;
  o.ignore_eos = true;  // as llama.cpp's side, which yields end-of-generation tokens too
  if (logits)
    o.on_logits = [&](int64_t, std::span<const int32_t>, std::span<const float> l) {
      logits->emplace_back(l.begin(), l.end());
    };
  return engine.generate_ids({prompt}, o).rows[0].tokens;
}

// A checkpoint's weights in a fresh GPT, as load_model makes it.
inline std::unique_ptr<GPT> model_of(const Checkpoint& c) {
  auto m = std::make_unique<GPT>(get_gpt_config(c.config, "import"), 0);
  copy_into(m->named_parameters(), c.model, "model", "import");
  m->set_training(false);
  return m;
}

// The same names, shapes and f32 bits, in the same order.
inline void expect_bit_identical(const NamedArrays& back, const NamedArrays& before) {
  ASSERT_EQ(back.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(back[i].first, before[i].first);
    EXPECT_EQ(back[i].second.shape, before[i].second.shape);
    EXPECT_EQ(0, std::memcmp(back[i].second.data.data(), before[i].second.data.data(),
                             before[i].second.data.size() * sizeof(float)))
        << before[i].first;
  }
}

// Log-softmax of one row of logits.
inline std::vector<double> log_softmax(const std::vector<float>& l) {
  double m = -INFINITY, s = 0;
  for (float v : l) m = std::max(m, static_cast<double>(v));
  for (float v : l) s += std::exp(v - m);
  std::vector<double> out;
  for (float v : l) out.push_back(v - m - std::log(s));
  return out;
}

// The peer: node and node-llama-cpp in tests/infer/llama_cpp (scripts/setup.sh --tests).
inline const std::filesystem::path kLlamaCppPeer =
    std::filesystem::path(KVLAB_SOURCE_DIR) / "tests/infer/llama_cpp";

// False, with why, when node or node-llama-cpp is missing (the test then skips).
inline bool have_llama_cpp(std::string& why) {
  if (std::system("command -v node >/dev/null 2>&1") != 0) {
    why = "node is not installed (scripts/setup.sh --tests installs it)";
    return false;
  }
  if (!std::filesystem::exists(kLlamaCppPeer / "node_modules/node-llama-cpp/package.json")) {
    why = "node-llama-cpp is not installed in " + kLlamaCppPeer.string() +
          " (scripts/setup.sh --tests installs it)";
    return false;
  }
  return true;
}

// llama.cpp's greedy continuations of `jobs` (greedy.mjs's JOBS.json), with files in `dir`:
// its OUT.json, or an empty value and the log in `failure`.
// Runs a peer's script (a shell command line, its output to `log`): true when it exits 0;
// false with why when it exits 77, its peer missing (the test skips); a failure otherwise.
inline bool run_peer_script(const std::string& cmd, const std::filesystem::path& log,
                            const std::string& what, std::string& why) {
  const std::string line = cmd + " > '" + log.string() + "' 2>&1";
  const int status = std::system(line.c_str());
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 0) return true;
  why = what + " could not run (" + line + ": exit " + std::to_string(rc) + ")";
  if (rc != 77) ADD_FAILURE() << why;
  return false;
}

inline nlohmann::json llama_cpp_greedy(const nlohmann::json& jobs,
                                       const std::filesystem::path& dir, std::string& failure) {
  std::ofstream(dir / "jobs.json") << jobs.dump();
  const std::string cmd = "cd '" + kLlamaCppPeer.string() + "' && node greedy.mjs '" +
                          (dir / "jobs.json").string() + "' '" + (dir / "out.json").string() +
                          "' > '" + (dir / "node.log").string() + "' 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    std::ifstream log(dir / "node.log");
    failure = "llama.cpp (node greedy.mjs) failed:\n" +
              std::string(std::istreambuf_iterator<char>(log), {});
    return {};
  }
  return nlohmann::json::parse(std::ifstream(dir / "out.json"));
}

// How far llama.cpp's continuation (one OUT.json row) follows kvlab's: the greedy tokens alike
// from the start, and the largest |difference| of the log-probabilities (those above 1e-4 in
// kvlab's) at each step both decoded alike, and the step after.
struct Agreement {
  size_t same = 0;
  double worst = 0;
};

inline Agreement agreement(const nlohmann::json& theirs, const std::vector<int32_t>& tokens,
                           const std::vector<std::vector<float>>& logits) {
  const auto got = theirs["tokens"].get<std::vector<int32_t>>();
  Agreement a;
  while (a.same < got.size() && a.same < tokens.size() && got[a.same] == tokens[a.same]) ++a.same;
  const size_t last = std::min({a.same, got.size() - 1, logits.size() - 1});
  for (size_t s = 0; s <= last; ++s) {
    const std::vector<double> ours = log_softmax(logits[s]);
    const nlohmann::json& row = theirs["logprobs"][s];
    for (size_t id = 0; id < ours.size(); ++id) {
      if (id >= row.size() || row[id].is_null() || ours[id] < std::log(1e-4)) continue;
      a.worst = std::max(a.worst, std::fabs(row[id].get<double>() - ours[id]));
    }
  }
  return a;
}

}  // namespace kvlab::test
