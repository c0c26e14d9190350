#!/usr/bin/env bash
# Decode speed with a KV cache (6 layers, 8 heads, n_embd 256, block 512, random weights) for
# n_kv_head 8, 4, 2, 1: kvlab against PyTorch CPU eager with an un-repeated cache, in one
# sitting on the same machine and threads. BATCH rows (default 1) decode together, each from
# its own prompt; tokens/s counts every row's tokens. kvlab runs with f32 matrices, with bf16
# ones (--weight-dtype bf16) and op by op; PyTorch in f32 and in bf16 (whole model: its linear
# has no bf16-weight, f32-activation form). Ratios are against PyTorch f32, its faster side here.
# The two sides alternate for ROUNDS rounds (default 3) and each figure is the median of its
# rounds, the ratio that of the medians: the shared host's speed drifts from minute to minute,
# and alternating keeps both sides in the same minutes (as bench/compare_train.sh does).
# Usage: [BATCH=8] [ROUNDS=3] bench/compare_decode.sh [BUILD_DIR]
#        (writes BUILD_DIR/compare_decode.json)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${THREADS:-2}
batch=${BATCH:-1}
rounds=${ROUNDS:-3}
# Both sides on the same OpenBLAS kernels (PyTorch's BLAS is the same OpenBLAS): those kvlab
# runs here, named where OpenBLAS would fall back to narrower ones (platform/blas_core.cpp).
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-$("$build/apps/kvlab" --version | sed -n 's/^BLAS: .*; kernels //p')}
model=(--n-layer 6 --n-head 8 --n-embd 256 --block-size 512 --vocab 65)
kvlab() {  # kvlab bench generate with the shared settings and "$@"
  OMP_NUM_THREADS=$threads "$build/apps/kvlab" bench generate "${model[@]}" --kv-heads 8,4,2,1 \
    --new-tokens 256 --prompt-tokens 16 --batch "$batch" --runs 3 --skip-no-cache "$@" >/dev/null
}
torch() {
  /usr/bin/python3 bench/torch_decode.py "${model[@]}" --n-kv-heads 8,4,2,1 --new-tokens 256 \
    --prompt-len 16 --batch "$batch" --runs 3 --threads "$threads" "$@" >/dev/null
}
for r in $(seq "$rounds"); do
  kvlab --json "$build/kvlab_decode.$r.json"
  kvlab --weight-dtype bf16 --json "$build/kvlab_decode_bf16.$r.json"
  kvlab --op-by-op --json "$build/kvlab_decode_op_by_op.$r.json"  # the fused step's baseline
  torch --json "$build/torch_decode.$r.json"
  torch --dtype bf16 --json "$build/torch_decode_bf16.$r.json"
done
/usr/bin/python3 - "$build" "$threads" "$batch" "$rounds" <<'PY'
import json, os, statistics, sys
build, threads, batch, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def load(name, key):  # per round: {n_kv_head: row}
    out = []
    for r in range(1, rounds + 1):
        d = json.load(open(f"{build}/{name}.{r}.json"))
        out.append((d, {row["n_kv_head"]: row for row in d[key]}))
    return out
k = load("kvlab_decode", "decode_by_kv_heads")
h = load("kvlab_decode_bf16", "decode_by_kv_heads")
o = load("kvlab_decode_op_by_op", "decode_by_kv_heads")
t = load("torch_decode", "results")
tb = load("torch_decode_bf16", "results")
def med(side, n, field="tokens_per_s"):
    return statistics.median(rows[n][field] for _, rows in side)
print(f"\ndecode with KV cache, batch {batch}, 6L/8H/256, 256 new tokens, {threads} threads "
      f"(kvlab: OpenMP + OpenBLAS-openmp; PyTorch {t[0][0]['torch_version']}: "
      f"set_num_threads({threads}), OMP_WAIT_POLICY=PASSIVE; OpenBLAS kernels: kvlab "
      f"{os.environ['OPENBLAS_CORETYPE']}, PyTorch {t[0][0]['blas_kernels']}); medians of {rounds} "
      f"alternating rounds")
print("ceiling: the bytes a step reads (f32 weights + cache) over the peak rate at which kvlab's\n"
      "threads read a buffer of that size in the same run, times the batch; 'ceiling / PyTorch' is\n"
      "the largest ratio any engine could reach here with f32 weights; 'bf16 mat.': kvlab with its\n"
      "matrices rounded to bf16 (--weight-dtype bf16), its ratio against PyTorch f32; 'rounds':\n"
      "the f32 ratio of each round on its own" +
      ("" if batch == "1" else " (an upper bound only: at a batch the step is bound by\n"
       "arithmetic well before memory)"))
print(f"{'n_kv_head':>9} {'kvlab tok/s':>12} {'op by op':>9} {'PyTorch tok/s':>14} {'ratio':>7}"
      f" {'rounds':>13} {'ceiling tok/s':>14} {'kvlab of ceiling':>17} {'ceiling / PyTorch':>18}"
      f" {'bf16 mat. tok/s':>16} {'ratio':>7} {'of its ceiling':>15} {'PyTorch bf16':>13}")
rows = []
for n in sorted(t[0][1], reverse=True):
    kv, torch_f32 = med(k, n), med(t, n)
    ceiling, bf16 = med(k, n, "ceiling_tokens_per_s"), med(h, n)
    per_round = [a[1][n]["tokens_per_s"] / b[1][n]["tokens_per_s"] for a, b in zip(k, t)]
    row = {"n_kv_head": n, "kvlab": kv, "kvlab_op_by_op": med(o, n), "torch": torch_f32,
           "ratio": kv / torch_f32, "round_ratios": per_round, "ceiling": ceiling,
           "ceiling_ratio": ceiling / torch_f32,
           "fraction_of_ceiling": med(k, n, "fraction_of_ceiling"),
           "kvlab_bf16_matrices": bf16, "ratio_bf16_matrices": bf16 / torch_f32,
           "bf16_fraction_of_ceiling": med(h, n, "fraction_of_ceiling"), "torch_bf16": med(tb, n)}
    rows.append(row)
    span = f"{min(per_round):.1f}-{max(per_round):.1f}x"
    print(f"{n:>9} {kv:>12.0f} {row['kvlab_op_by_op']:>9.0f} {torch_f32:>14.0f}"
          f" {row['ratio']:>6.1f}x {span:>13} {ceiling:>14.0f} {row['fraction_of_ceiling']:>17.2f}"
          f" {row['ceiling_ratio']:>17.1f}x {bf16:>16.0f} {row['ratio_bf16_matrices']:>6.1f}x"
          f" {row['bf16_fraction_of_ceiling']:>15.2f} {row['torch_bf16']:>13.0f}")
json.dump({"rounds": rounds, "rows": rows,
           "per_round": [{"kvlab": a[0], "kvlab_bf16_matrices": b[0], "kvlab_op_by_op": c[0],
                          "torch": d[0], "torch_bf16": e[0]}
                         for a, b, c, d, e in zip(k, h, o, t, tb)]},
          open(f"{build}/compare_decode.json", "w"), indent=2)
PY
