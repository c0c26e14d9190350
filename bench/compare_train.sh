#!/usr/bin/env bash
# Training speed at nanoGPT's baby config, kvlab against PyTorch CPU eager (Debian's
# python3-torch), in one sitting on the same machine and threads. The two alternate for
# ROUNDS rounds (default 3) and the ratio is that of their medians: the machine's speed drifts
# by 10% and more from minute to minute, and alternating keeps both sides in the same minutes.
# Usage: bench/compare_train.sh BUILD_DIR CORPUS   (writes BUILD_DIR/compare_train.json;
# nanoGPT's published figures use tinyshakespeare.txt, which kvlab does not ship)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
corpus=${2:?usage: bench/compare_train.sh BUILD_DIR CORPUS}
threads=${THREADS:-2}
rounds=${ROUNDS:-3}
# Both sides on the same OpenBLAS kernels (PyTorch's BLAS is the same OpenBLAS): those kvlab
# runs here, named where OpenBLAS would fall back to narrower ones (platform/blas_core.cpp).
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-$("$build/apps/kvlab" --version | sed -n 's/^BLAS: .*; kernels //p')}
for r in $(seq "$rounds"); do
  OMP_NUM_THREADS=$threads "$build/bench/bench_train" --corpus "$corpus" --iters 60 \
    --json "$build/bench_train.$r.json" >/dev/null
  # PyTorch's OpenMP threads otherwise spin against OpenBLAS's (2.5x slower steps): PASSIVE is
  # set inside torch_train.py before torch is imported.
  /usr/bin/python3 bench/torch_train.py --threads "$threads" --corpus "$corpus" --iters 60 \
    --warmup-iters 5 --json "$build/torch_train.$r.json" >/dev/null
done
/usr/bin/python3 - "$build" "$threads" "$rounds" <<'PY'
import json, os, statistics, sys
build, threads, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
ks = [json.load(open(f"{build}/bench_train.{r}.json")) for r in range(1, rounds + 1)]
ts = [json.load(open(f"{build}/torch_train.{r}.json")) for r in range(1, rounds + 1)]
k_rate = statistics.median(k["tokens_per_s"] for k in ks)
t_rate = statistics.median(t["tokens_per_s"] for t in ts)
ratio = k_rate / t_rate
runs = lambda rs: ", ".join(f"{x['tokens_per_s']:.0f}" for x in rs)
k = min(ks, key=lambda k: abs(k["tokens_per_s"] - k_rate))  # the median run's other figures
print(f"\ntraining, baby config, {threads} threads (kvlab: OpenMP + OpenBLAS-openmp, one pool; "
      f"PyTorch {ts[0]['torch_version']}: torch.set_num_threads({threads}), "
      f"OMP_WAIT_POLICY=PASSIVE; OpenBLAS kernels: kvlab {os.environ['OPENBLAS_CORETYPE']}, "
      f"PyTorch {ts[0]['blas_kernels']}); median of {rounds} alternating rounds")
print(f"  kvlab    {k_rate:9.0f} tokens/s  ({k['step_ms']:.1f} ms/step, "
      f"{k['fraction_of_sgemm']:.0%} of sgemm at the same shapes, peak RSS {k['peak_rss_mib']:.0f} MiB)"
      f"  rounds: {runs(ks)}")
print(f"  PyTorch  {t_rate:9.0f} tokens/s  rounds: {runs(ts)}")
print(f"  ratio    {ratio:9.2f}x")
json.dump({"kvlab_runs": ks, "torch_runs": ts, "kvlab_tokens_per_s": k_rate,
           "torch_tokens_per_s": t_rate, "ratio": ratio},
          open(f"{build}/compare_train.json", "w"), indent=2)
PY
