#!/usr/bin/env bash
# Installs what is needed, builds kvlab with warnings as errors, runs every test, then runs
# the suite once more under AddressSanitizer + UndefinedBehaviorSanitizer, built for the AVX2
# kernels (x86-64-v3) where the first build took the host's (-march=native).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --tests

jobs=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# Two tests at a time, each with its OpenMP threads, oversubscribe the cores: a thread that
# spins at a barrier while its partner waits for a core burns the time the other test needs.
# Sleeping there instead took the Release suite from 281 s to 163 s on 2 cores (user CPU from
# 406 s to 169 s); the tests time nothing, so their results are the same.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

# Configures folder $1 with the rest as options: Ninja for a new one; an existing one keeps
# its generator (naming another is an error there), and the options below are set either way.
configure() {
  local dir=$1
  shift
  if [ -f "$dir/CMakeCache.txt" ]; then
    cmake -S . -B "$dir" "$@"
  else
    cmake -S . -B "$dir" -G Ninja "$@"
  fi
}

# Tests and benchmarks on, whatever an earlier configuration (scripts/ablate.sh's) chose.
configure build -DCMAKE_BUILD_TYPE=Release -DKVLAB_WERROR=ON -DKVLAB_TESTS=ON -DKVLAB_BENCH=ON
cmake --build build -j "$jobs"
(cd build && ctest --output-on-failure -j "$jobs" --timeout 600)

# Sanitizers: a Debug-free optimised build (RelWithDebInfo) keeps the run short. It targets
# x86-64-v3 (AVX2 + FMA), so that on an AVX-512 host the suite runs once on each set of SIMD
# kernels (docs/architecture.md, "Code paths per ISA"); a host without AVX2 builds it portable.
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  asan_march=x86-64-v3
else
  asan_march=
  echo "test.sh: this CPU lacks AVX2: the sanitizer build is portable (KVLAB_MARCH empty), not x86-64-v3"
fi
configure build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVLAB_WERROR=ON -DKVLAB_TESTS=ON \
  -DKVLAB_SANITIZE="address;undefined" -DKVLAB_BENCH=OFF -DKVLAB_CUDA=OFF \
  -DKVLAB_MARCH="$asan_march"
cmake --build build-asan -j "$jobs"
# libhdf5's own leaks on damaged input are suppressed (tests/lsan.supp says which).
lsan_supp="$PWD/tests/lsan.supp"
# The sweep's workflow variants (resume, reuse, a changed config or corpus, uptraining, MLA
# and bpe variants, MPI ranks) take minutes each under the sanitizers and run the code that
# AblateTest.QuickSweepEndToEndInvariants runs there too; so does MQAR's learning test, whose
# sampler, evaluation and log TrainerTest.AnMqarRunLogsItsAccuracy runs. The Release suite
# above runs them.
sanitizer_skip='^(AblateTest\.(UptrainConverts|MlaRanksJoin|Resume|BpeSweep|AnotherCorpus|AChangedConfig|ARunFolder).*|TrainerTest\.MqarIsLearnt.*|mpi\.ablate)$'
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS="suppressions=$lsan_supp" \
  ctest --output-on-failure -j "$jobs" --timeout 900 -E "$sanitizer_skip")

# The AVX2 kernels in a Release build: the sanitizer build above runs them at another
# optimisation level, and a difference between two paths that a bf16 cache rounds into whole
# bf16 steps may show on one set of kernels only (paged and contiguous prefill once did, on
# AVX2 alone). The full Release suite a second time does not fit CI's time: the decode, paged,
# quantised and kernel tests do (a few minutes).
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  configure build-v3 -DCMAKE_BUILD_TYPE=Release -DKVLAB_WERROR=ON -DKVLAB_TESTS=ON \
    -DKVLAB_BENCH=OFF -DKVLAB_CUDA=OFF -DKVLAB_MARCH=x86-64-v3
  cmake --build build-v3 -j "$jobs" --target test_infer test_autograd
  (cd build-v3 && ctest --output-on-failure -j "$jobs" --timeout 600 -R \
    '(PagedEqualsContiguous|CacheEqualsRecompute|PackedDecode|FusedDecode|PagedKVCache|KVQuant|PrefillSplit|AttendOneQuery|GemmFewRows|GemmPacked|Q8Activations|AllBf16)')
fi
