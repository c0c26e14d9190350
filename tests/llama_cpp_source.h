#pragma once
// llama.cpp's source, the peer's own code and data for the tests (gguf-py, models/ggml-vocab-*
// with their test vectors): the git bundle that npm's node-llama-cpp ships
// (scripts/setup.sh --tests installs it), cloned once into the build folder.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvlab::test {

// The source folder, or "" with why when the bundle or git is missing (the test then skips).
inline std::filesystem::path llama_cpp_source(std::string& why) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(KVLAB_BINARY_DIR) / "llama_cpp_src";
  if (fs::exists(src / "gguf-py" / "gguf" / "quants.py")) return src;
  const fs::path bundle =
      fs::path(KVLAB_SOURCE_DIR) /
      "tests/infer/llama_cpp/node_modules/node-llama-cpp/llama/gitRelease.bundle";
  if (!fs::exists(bundle)) {
    why = "node-llama-cpp's llama.cpp source bundle is not installed (scripts/setup.sh --tests)";
    return {};
  }
  // Cloned beside and renamed into place: a test run elsewhere never sees half a clone.
  const fs::path tmp = src.string() + ".tmp" + std::to_string(::getpid());
  const std::string cmd = "git clone --quiet '" + bundle.string() + "' '" + tmp.string() +
                          "' >/dev/null 2>&1 && mv -T '" + tmp.string() + "' '" + src.string() +
                          "' 2>/dev/null; rm -rf '" + tmp.string() + "'";
  if (std::system(cmd.c_str()) != 0 && !fs::exists(src / "gguf-py")) {
    why = "git could not clone " + bundle.string();
    return {};
  }
  return src;
}

}  // namespace kvlab::test
