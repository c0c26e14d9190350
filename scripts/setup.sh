#!/usr/bin/env bash
# Installs what kvlab needs from Debian's packages (idempotent: only missing packages are
# installed) and writes the default corpus, the King James Bible, to data/corpora/.
# --tests adds what only the tests (and the PyTorch baselines in bench/) run: Python with
# h5py, NumPy, regex, Jinja2 and PyTorch (python3-torch and what it depends on are large), and Node.js
# with the openai npm client (tests/apps/openai_client) that drives `kvlab serve`, tiktoken
# (tests/data/tiktoken), the reference for the BPE tokenizer's ids and encode speed,
# Hugging Face's tokenizers (bench/hf_tokenizers), the baseline of BPE training speed, and
# node-llama-cpp (tests/infer/llama_cpp), whose prebuilt CPU binaries of llama.cpp run
# kvlab's GGUF exports, and Debian's chromium with playwright-core (tests/report/browser),
# which renders an ablation's report.html headless.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config
  libopenblas-openmp-dev libhdf5-dev libgtest-dev libgmock-dev
  libcli11-dev nlohmann-json3-dev libcpp-httplib-dev libopenmpi-dev openmpi-bin libpcre2-dev
  librsvg2-bin bible-kjv
)
with_tests=0
for arg in "$@"; do
  case "$arg" in
    --tests)
      with_tests=1
      packages+=(python3 python3-numpy python3-h5py python3-regex python3-jinja2 python3-torch chromium)
      # A Node.js already on PATH is kept: NodeSource's bundles npm and conflicts with Debian's.
      command -v node >/dev/null || packages+=(nodejs)
      command -v npm >/dev/null || packages+=(npm)
      ;;
    *)
      echo "usage: scripts/setup.sh [--tests]" >&2
      exit 2
      ;;
  esac
done
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The npm packages the tests and benchmarks drive, each pinned by its folder's
# package-lock.json: the openai client, tiktoken, tokenizers (0.23.2 carries its native
# binaries inside the package; 0.13.3's separate ones were never published for linux-x64)
# node-llama-cpp and playwright-core (which drives the chromium package: it downloads no
# browser of its own); reinstalled when the lock file is newer than the installed package.
# node-llama-cpp's prebuilt binaries come with the package: its postinstall step is told not
# to download or build llama.cpp (the tests run it with build: "never").
for pair in tests/apps/openai_client:openai tests/data/tiktoken:tiktoken \
  bench/hf_tokenizers:tokenizers tests/infer/llama_cpp:node-llama-cpp \
  tests/report/browser:playwright-core; do
  folder=${pair%%:*}
  package=${pair##*:}
  if [ "$with_tests" -eq 1 ] &&
    { [ ! -f "$folder/node_modules/$package/package.json" ] ||
      [ "$folder/package-lock.json" -nt "$folder/node_modules/$package/package.json" ]; }; then
    echo "setup: installing the $package npm package in $folder"
    NODE_LLAMA_CPP_SKIP_DOWNLOAD=true PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --prefix "$folder" --no-audit --no-fund --loglevel=error
  fi
done

# The default corpus: bible-kjv ships the text as a verse database read by the `bible`
# program; dump Genesis 1:1 to Revelation 22:21 as plain text, chapter headings kept and
# verse numbers dropped.
corpus=data/corpora/bible-kjv.txt
if [ ! -s "$corpus" ]; then
  mkdir -p data/corpora
  tmp="$corpus.tmp.$$"
  bible -l100000 "gen1:1-rev22:21" | sed -E 's/^ +[0-9]+ //' > "$tmp"
  mv "$tmp" "$corpus"
fi
echo "setup: ok ($(wc -c < "$corpus") bytes of default corpus in $corpus)"
