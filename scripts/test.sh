#!/usr/bin/env bash
# Installs what is needed, builds kvlab with warnings as errors, runs every test, then runs
# the suite once more under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

jobs=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVLAB_WERROR=ON
cmake --build build -j "$jobs"
(cd build && ctest --output-on-failure -j "$jobs" --timeout 600)

# Sanitizers: a Debug-free optimised build (RelWithDebInfo) keeps the run short.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVLAB_WERROR=ON \
  -DKVLAB_SANITIZE="address;undefined" -DKVLAB_BENCH=OFF -DKVLAB_CUDA=OFF
cmake --build build-asan -j "$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j "$jobs" --timeout 900)
