#!/usr/bin/env bash
# Decode speed with a KV cache (6 layers, 8 heads, n_embd 256, block 512, random weights) for
# n_kv_head 8, 4, 2, 1: kvlab against PyTorch CPU eager with an un-repeated cache, in one
# sitting on the same machine and threads. BATCH rows (default 1) decode together, each from
# its own prompt; tokens/s counts every row's tokens. kvlab runs with f32 matrices, with bf16
# ones (--weight-dtype bf16) and op by op; PyTorch in f32 and in bf16 (whole model: its linear
# has no bf16-weight, f32-activation form). Ratios are against PyTorch f32, its faster side here.
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
OMP_NUM_THREADS=$threads "$build/apps/kvlab" bench generate "${model[@]}" --kv-heads 8,4,2,1 \
  --new-tokens 256 --prompt-tokens 16 --batch "$batch" --runs 3 --skip-no-cache \
  --weight-dtype bf16 --json "$build/kvlab_decode_bf16.json" >/dev/null
# The same decode op by op (the fused step's baseline).
OMP_NUM_THREADS=$threads "$build/apps/kvlab" bench generate "${model[@]}" --kv-heads 8,4,2,1 \
  --new-tokens 256 --prompt-tokens 16 --batch "$batch" --runs 3 --skip-no-cache --op-by-op \
  --json "$build/kvlab_decode_op_by_op.json" >/dev/null
/usr/bin/python3 bench/torch_decode.py "${model[@]}" --n-kv-heads 8,4,2,1 --new-tokens 256 \
  --prompt-len 16 --batch "$batch" --runs 3 --threads "$threads" --json "$build/torch_decode.json" \
  >/dev/null
/usr/bin/python3 bench/torch_decode.py "${model[@]}" --n-kv-heads 8,4,2,1 --new-tokens 256 \
  --prompt-len 16 --batch "$batch" --runs 3 --threads "$threads" --dtype bf16 \
  --json "$build/torch_decode_bf16.json" >/dev/null
/usr/bin/python3 - "$build" "$threads" "$batch" <<'PY'
import json, sys
build, threads, batch = sys.argv[1], sys.argv[2], sys.argv[3]
k = json.load(open(f"{build}/kvlab_decode.json"))
h = json.load(open(f"{build}/kvlab_decode_bf16.json"))
o = json.load(open(f"{build}/kvlab_decode_op_by_op.json"))
t = json.load(open(f"{build}/torch_decode.json"))
tb = json.load(open(f"{build}/torch_decode_bf16.json"))
kv = {r["n_kv_head"]: r for r in k["decode_by_kv_heads"]}
half = {r["n_kv_head"]: r for r in h["decode_by_kv_heads"]}
op = {r["n_kv_head"]: r for r in o["decode_by_kv_heads"]}
tbf = {r["n_kv_head"]: r for r in tb["results"]}
rows = []
print(f"\ndecode with KV cache, batch {batch}, 6L/8H/256, 256 new tokens, {threads} threads "
      f"(kvlab: OpenMP + OpenBLAS-openmp; PyTorch {t['torch_version']}: "
      f"set_num_threads({threads}), OMP_WAIT_POLICY=PASSIVE)")
print("ceiling: the bytes a step reads (f32 weights + cache) over the peak rate at which kvlab's\n"
      "threads read a buffer of that size in the same run, times the batch; 'ceiling / PyTorch' is\n"
      "the largest ratio any engine could reach here with f32 weights; 'bf16 mat.': kvlab with its\n"
      "matrices rounded to bf16 (--weight-dtype bf16), its ratio against PyTorch f32" +
      ("" if batch == "1" else " (an upper bound only: at a batch the step is bound by\n"
       "arithmetic well before memory)"))
print(f"{'n_kv_head':>9} {'kvlab tok/s':>12} {'op by op':>9} {'PyTorch tok/s':>14} {'ratio':>7}"
      f" {'ceiling tok/s':>14} {'kvlab of ceiling':>17} {'ceiling / PyTorch':>18}"
      f" {'bf16 mat. tok/s':>16} {'ratio':>7} {'of its ceiling':>15} {'PyTorch bf16':>13}")
for r in t["results"]:
    n = r["n_kv_head"]
    ratio = kv[n]["tokens_per_s"] / r["tokens_per_s"]
    ceiling = kv[n]["ceiling_tokens_per_s"]
    ratio_bf16 = half[n]["tokens_per_s"] / r["tokens_per_s"]
    rows.append({"n_kv_head": n, "kvlab": kv[n]["tokens_per_s"],
                 "kvlab_op_by_op": op[n]["tokens_per_s"], "torch": r["tokens_per_s"],
                 "ratio": ratio, "ceiling": ceiling, "ceiling_ratio": ceiling / r["tokens_per_s"],
                 "kvlab_bf16_matrices": half[n]["tokens_per_s"], "ratio_bf16_matrices": ratio_bf16,
                 "torch_bf16": tbf[n]["tokens_per_s"]})
    print(f"{n:>9} {kv[n]['tokens_per_s']:>12.0f} {op[n]['tokens_per_s']:>9.0f}"
          f" {r['tokens_per_s']:>14.0f} {ratio:>6.1f}x {ceiling:>14.0f}"
          f" {kv[n]['fraction_of_ceiling']:>17.2f} {ceiling / r['tokens_per_s']:>17.1f}x"
          f" {half[n]['tokens_per_s']:>16.0f} {ratio_bf16:>6.1f}x"
          f" {half[n]['fraction_of_ceiling']:>15.2f} {tbf[n]['tokens_per_s']:>13.0f}")
json.dump({"rows": rows, "kvlab": k, "kvlab_bf16_matrices": h, "kvlab_op_by_op": o, "torch": t,
           "torch_bf16": tb}, open(f"{build}/compare_decode.json", "w"), indent=2)
PY
