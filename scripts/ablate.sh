#!/usr/bin/env bash
# The main job: installs what is needed, builds kvlab and runs the default n_kv_head
# ablation (MHA, GQA, MQA on the King James Bible), printing the comparison table at the end.
# Extra arguments go to `kvlab ablate` (e.g. --quick, --seeds 3, --corpus FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVLAB_TESTS=OFF -DKVLAB_BENCH=OFF >/dev/null
cmake --build build -j "$(nproc)" --target kvlab
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} build/apps/kvlab ablate --out out/ablate "$@"
