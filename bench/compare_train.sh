#!/usr/bin/env bash
# Training speed at nanoGPT's baby config, kvlab against PyTorch CPU eager (Debian's
# python3-torch), in one sitting on the same machine and threads.
# Usage: bench/compare_train.sh [BUILD_DIR] [CORPUS]   (writes BUILD_DIR/compare_train.json)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
corpus=${2:-../shared/data/tinyshakespeare.txt}
threads=${THREADS:-2}
# PyTorch's OpenMP threads otherwise spin against OpenBLAS's (2.5x slower steps): PASSIVE is
# set inside torch_train.py before torch is imported.
OMP_NUM_THREADS=$threads "$build/bench/bench_train" --corpus "$corpus" --iters 60 --json "$build/bench_train.json"
/usr/bin/python3 bench/torch_train.py --threads "$threads" --corpus "$corpus" --iters 60 --warmup-iters 5 \
  --json "$build/torch_train.json" >/dev/null
/usr/bin/python3 - "$build" "$threads" <<'PY'
import json, sys
build, threads = sys.argv[1], sys.argv[2]
k = json.load(open(f"{build}/bench_train.json"))
t = json.load(open(f"{build}/torch_train.json"))
ratio = k["tokens_per_s"] / t["tokens_per_s"]
print(f"\ntraining, baby config, {threads} threads (kvlab: OpenMP + OpenBLAS-openmp, one pool; "
      f"PyTorch {t['torch_version']}: torch.set_num_threads({threads}), OMP_WAIT_POLICY=PASSIVE)")
print(f"  kvlab    {k['tokens_per_s']:9.0f} tokens/s  ({k['step_ms']:.1f} ms/step, "
      f"{k['fraction_of_sgemm']:.0%} of sgemm at the same shapes, peak RSS {k['peak_rss_mib']:.0f} MiB)")
print(f"  PyTorch  {t['tokens_per_s']:9.0f} tokens/s  ({t['step_ms']:.1f} ms/step)")
print(f"  ratio    {ratio:9.2f}x")
json.dump({"kvlab": k, "torch": t, "ratio": ratio}, open(f"{build}/compare_train.json", "w"), indent=2)
PY
