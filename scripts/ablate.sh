#!/usr/bin/env bash
# The main job: installs what is needed, builds kvlab and runs the default n_kv_head
# ablation (MHA, GQA, MQA on the King James Bible), printing the comparison table at the end.
# Extra arguments go to `kvlab ablate` (e.g. --quick, --seeds 3, --corpus FILE).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/ablate.sh [--quick] [kvlab ablate flags...]

Installs the dependencies (scripts/setup.sh), builds kvlab in build/ (Release) and runs
`kvlab ablate --out out/ablate` (or the --out given): the same GPT trained with n_kv_head = n_head (MHA), its
divisors (GQA) and 1 (MQA), compared on validation loss, KV-cache memory and decode speed.
The table is printed at the end; report.html and results.json are written to out/ablate.

  --quick      a smoke test of the whole job (small model, 300 steps): about a minute
  -h, --help   this text

Every other argument is passed to `kvlab ablate` (e.g. --seeds 3, --kv-heads 8,2,1,
--corpus FILE, --out DIR); `build/apps/kvlab ablate --help` lists them all.
EOF
}
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      usage
      exit 0
      ;;
  esac
done

cd "$(dirname "$0")/.."
./scripts/setup.sh
# An existing build/ keeps its generator and options (naming another generator is an error
# there); a new one is configured with Ninja, without tests and benchmarks.
if [ -f build/CMakeCache.txt ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
else
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVLAB_TESTS=OFF -DKVLAB_BENCH=OFF >/dev/null
fi
cmake --build build -j "$(nproc)" --target kvlab
# out/ablate unless the arguments name another folder.
out=(--out out/ablate)
for arg in "$@"; do
  case "$arg" in
    --out | --out=*) out=() ;;
  esac
done
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} build/apps/kvlab ablate "${out[@]}" "$@"
