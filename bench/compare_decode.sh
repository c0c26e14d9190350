#!/usr/bin/env bash
# Decode speed with a KV cache (6 layers, 8 heads, n_embd 256, block 512, random weights) for
# n_kv_head 8, 4, 2, 1: kvlab against PyTorch CPU eager with an un-repeated cache, in one
# sitting on the same machine and threads. BATCH rows (default 1) decode together, each from
# its own prompt; tokens/s counts every row's tokens.
# Usage: [BATCH=8] bench/compare_decode.sh [BUILD_DIR]   (writes BUILD_DIR/compare_decode.json)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${THREADS:-2}
batch=${BATCH:-1}
model=(--n-layer 6 --n-head 8 --n-embd 256 --block-size 512 --vocab 65)
OMP_NUM_THREADS=$threads "$build/apps/kvlab" bench generate "${model[@]}" --kv-heads 8,4,2,1 \
  --new-tokens 256 --prompt-tokens 16 --batch "$batch" --runs 3 --skip-no-cache \
  --json "$build/kvlab_decode.json" >/dev/null
# The same decode op by op (the fused step's baseline).
OMP_NUM_THREADS=$threads "$build/apps/kvlab" bench generate "${model[@]}" --kv-heads 8,4,2,1 \
  --new-tokens 256 --prompt-tokens 16 --batch "$batch" --runs 3 --skip-no-cache --op-by-op \
  --json "$build/kvlab_decode_op_by_op.json" >/dev/null
/usr/bin/python3 bench/torch_decode.py "${model[@]}" --n-kv-heads 8,4,2,1 --new-tokens 256 \
  --prompt-len 16 --batch "$batch" --runs 3 --threads "$threads" --json "$build/torch_decode.json" \
  >/dev/null
/usr/bin/python3 - "$build" "$threads" "$batch" <<'PY'
import json, sys
build, threads, batch = sys.argv[1], sys.argv[2], sys.argv[3]
k = json.load(open(f"{build}/kvlab_decode.json"))
o = json.load(open(f"{build}/kvlab_decode_op_by_op.json"))
t = json.load(open(f"{build}/torch_decode.json"))
kv = {r["n_kv_head"]: r for r in k["decode_by_kv_heads"]}
op = {r["n_kv_head"]: r for r in o["decode_by_kv_heads"]}
rows = []
print(f"\ndecode with KV cache, batch {batch}, 6L/8H/256, 256 new tokens, {threads} threads "
      f"(kvlab: OpenMP + OpenBLAS-openmp; PyTorch {t['torch_version']}: "
      f"set_num_threads({threads}), OMP_WAIT_POLICY=PASSIVE)")
print("ceiling: the bytes a step reads (weights + cache) over the peak rate at which kvlab's threads\n"
      "read a buffer of that size in the same run, times the batch; 'ceiling / PyTorch' is the\n"
      "largest ratio any engine could reach here" +
      ("" if batch == "1" else " (an upper bound only: at a batch the step is bound by\n"
       "arithmetic well before memory)"))
print(f"{'n_kv_head':>9} {'kvlab tok/s':>12} {'op by op':>9} {'PyTorch tok/s':>14} {'ratio':>7}"
      f" {'ceiling tok/s':>14} {'kvlab of ceiling':>17} {'ceiling / PyTorch':>18}")
for r in t["results"]:
    n = r["n_kv_head"]
    ratio = kv[n]["tokens_per_s"] / r["tokens_per_s"]
    ceiling = kv[n]["ceiling_tokens_per_s"]
    rows.append({"n_kv_head": n, "kvlab": kv[n]["tokens_per_s"],
                 "kvlab_op_by_op": op[n]["tokens_per_s"], "torch": r["tokens_per_s"],
                 "ratio": ratio, "ceiling": ceiling, "ceiling_ratio": ceiling / r["tokens_per_s"]})
    print(f"{n:>9} {kv[n]['tokens_per_s']:>12.0f} {op[n]['tokens_per_s']:>9.0f}"
          f" {r['tokens_per_s']:>14.0f} {ratio:>6.1f}x {ceiling:>14.0f}"
          f" {kv[n]['fraction_of_ceiling']:>17.2f} {ceiling / r['tokens_per_s']:>17.1f}x")
json.dump({"rows": rows, "kvlab": k, "kvlab_op_by_op": o, "torch": t}, open(f"{build}/compare_decode.json", "w"), indent=2)
PY
