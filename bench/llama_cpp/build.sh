#!/usr/bin/env bash
# Builds llama.cpp's own llama-bench, llama-server and llama-cli from the source
# that node-llama-cpp ships (the same llama.cpp the GGUF tests hold kvlab to), so
# speed comparisons run against exactly that version.
#
#   bench/llama_cpp/build.sh            # -> bench/llama_cpp/build/bin/llama-{bench,server,cli}
#   JOBS=2 TARGETS="llama-bench" bench/llama_cpp/build.sh
#
# CPU only, -march=native (GGML_NATIVE), Release, no network: no curl, no OpenSSL
# and no prebuilt web UI download. Source goes to bench/llama_cpp/src, the build
# to bench/llama_cpp/build (both ignored by git).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
pkg="$root/tests/infer/llama_cpp/node_modules/node-llama-cpp/llama"
bundle="$pkg/gitRelease.bundle"
src="$here/src"
build="$here/build"
jobs=${JOBS:-2}
targets=${TARGETS:-"llama-bench llama-server llama-cli"}

if [[ ! -f "$bundle" ]]; then
    echo "build.sh: $bundle not found; run 'npm ci' in tests/infer/llama_cpp" \
         "(or symlink its node_modules) first" >&2
    exit 1
fi
tag=$(sed -n 's/.*"tag": *"\([^"]*\)".*/\1/p' "$pkg/llama.cpp.info.json")
head=$(git bundle list-heads "$bundle" | awk '$2=="HEAD"{print $1}')

if [[ ! -d "$src/.git" ]]; then
    git clone --quiet "$bundle" "$src"
fi
if [[ "$(git -C "$src" rev-parse HEAD)" != "$head" ]]; then
    git -C "$src" fetch --quiet "$bundle" HEAD
    git -C "$src" -c advice.detachedHead=false checkout --quiet "$head"
fi
echo "llama.cpp ${tag:-?} (node-llama-cpp bundle, commit $head)"

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src" -B "$build" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
# One target after another: llama-bench (the smallest) is usable before the server is built.
for t in $targets; do
    cmake --build "$build" -j "$jobs" --target "$t"
done
ls -l "$build"/bin/llama-*
