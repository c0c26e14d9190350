#!/usr/bin/env bash
# Batch-1 decode speed: kvlab against llama.cpp's own llama-bench, both on kvlab's GGUF export of
# the same checkpoint, in one sitting on the same machine and threads.
#   (a) a llama-block model: 8 layers, n_embd 512, 8 heads, 2 KV heads, context 1024, char
#       vocabulary (~22M parameters): a checkpoint after one optimizer step (speed does not
#       depend on the weights' values), trained here unless LLAMA_CKPT names one;
#   (b) the default ablation's model (kvlab ablate's defaults: GPT-2's block, 4 layers, 8 heads,
#       n_embd 128, context 64): ABLATE_CKPT, by default /tmp/ev/default/runs/kv2_seed0/final.h5.
# kvlab: `kvlab bench generate --prompt-tokens 1` (decode tokens/s after a 1-token prefill, the
# median of 3 runs after a warm-up) at each --weight-dtype of PAIRS, OMP_NUM_THREADS=T.
# llama.cpp: `llama-bench -p 0 -n N -t T -r 3` (its text-generation test: N single-token decode
# steps from position 0, mean of 3 repetitions after a warm-up) on the export of each PAIRS
# type, with its defaults otherwise (f16 KV cache, mmap, flash attention auto).
# PAIRS: kvlab weight dtype:llama.cpp type, default "f32:f32 bf16:f16 q8_0:q8_0 q8_0+int8:q8_0
# q4_0:q4_0 q4_0+int8:q4_0" (llama.cpp has no bf16 matrix kernel of its own on every CPU: f16
# is its 2-byte type; "+int8": kvlab with --int8-products, llama.cpp's own trade).
# N is 256 for (a) and 63 for (b) (its context is 64). The sides alternate for ROUNDS rounds
# (default 3); each figure is the median of its rounds, beside the min and max, and the load
# average (uptime) before each round is recorded.
# Usage: [ROUNDS=3] [RUNS=3] [THREADS="1 2"] [PAIRS=...] [MODELS="llama22m ablate"]
#        [LLAMA_CKPT=...] [ABLATE_CKPT=...] [CORPUS=...]
#        bench/compare_llama_cpp.sh [BUILD_DIR]
#        (writes BUILD_DIR/compare_llama_cpp/summary.json; llama-bench from
#        bench/llama_cpp/build.sh, or LLAMA_BENCH)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${ROUNDS:-3}
runs=${RUNS:-3}  # kvlab --runs and llama-bench -r per round
threads=${THREADS:-"1 2"}
pairs=${PAIRS:-"f32:f32 bf16:f16 q8_0:q8_0 q8_0+int8:q8_0 q4_0:q4_0 q4_0+int8:q4_0"}
models=${MODELS:-"llama22m ablate"}
kvlab=$build/apps/kvlab
llama_bench=${LLAMA_BENCH:-bench/llama_cpp/build/bin/llama-bench}
out=$build/compare_llama_cpp
mkdir -p "$out"
[[ -x $llama_bench ]] || { echo "no llama-bench at $llama_bench: run bench/llama_cpp/build.sh" >&2; exit 1; }
[[ -x $kvlab ]] || { echo "no kvlab at $kvlab: build the kvlab target" >&2; exit 1; }

llama_ckpt=${LLAMA_CKPT:-$out/llama22m/final.h5}
if [[ ! -f $llama_ckpt ]]; then
  corpus=${CORPUS:-data/corpora/bible-kjv.txt}
  [[ -f $corpus ]] || { echo "no corpus at $corpus to train model (a) on: run scripts/setup.sh or set CORPUS" >&2; exit 1; }
  "$kvlab" train --corpus "$corpus" --arch llama --n-layer 8 --n-head 8 --n-kv-head 2 --n-embd 512 --block-size 1024 \
    --iters 1 --batch-size 1 --eval-interval 1 --eval-iters 1 --warmup 0 \
    --out "$out/llama22m" >"$out/llama22m.train.log"
  llama_ckpt=$out/llama22m/final.h5
fi
ablate_ckpt=${ABLATE_CKPT:-/tmp/ev/default/runs/kv2_seed0/final.h5}
[[ " $models " != *" ablate "* || -f $ablate_ckpt ]] || { echo "no checkpoint at $ablate_ckpt: run kvlab ablate (its defaults) or set ABLATE_CKPT" >&2; exit 1; }
declare -A ckpt=([llama22m]=$llama_ckpt [ablate]=$ablate_ckpt) new=([llama22m]=256 [ablate]=63)
for m in $models; do
  for pair in $pairs; do
    d=${pair#*:}
    "$kvlab" export --ckpt "${ckpt[$m]}" --format gguf --dtype $d \
      --out "$out/$m.$d.gguf" >/dev/null
  done
done

: >"$out/load.txt"
for r in $(seq "$rounds"); do
  echo "round $r: $(uptime)" | tee -a "$out/load.txt"
  for t in $threads; do
    for m in $models; do
      for pair in $pairs; do
        w=${pair%:*} d=${pair#*:}
        int8=()
        [[ $w == *+int8 ]] && int8=(--int8-products)
        OMP_NUM_THREADS=$t "$kvlab" bench generate --ckpt "${ckpt[$m]}" --prompt-tokens 1 \
          --new-tokens "${new[$m]}" --runs "$runs" --skip-no-cache --kv-heads 2 \
          --weight-dtype "${w%+int8}" "${int8[@]}" --json "$out/kvlab.$m.$w.t$t.$r.json" >/dev/null
        "$llama_bench" -m "$out/$m.$d.gguf" -p 0 -n "${new[$m]}" -t "$t" -r "$runs" -o json \
          >"$out/llama.$m.$d.t$t.$r.json" 2>/dev/null
      done
    done
  done
done
echo "end: $(uptime)" | tee -a "$out/load.txt"

/usr/bin/python3 - "$out" "$rounds" "$threads" "$pairs" "$models" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
threads, pairs, models = sys.argv[3].split(), [p.split(":") for p in sys.argv[4].split()], sys.argv[5].split()
def kv(m, w, t, r):
    return json.load(open(f"{out}/kvlab.{m}.{w}.t{t}.{r}.json"))["generate"]["results"][0]["cache"]["tokens_per_s"]
def ll(m, d, t, r):
    return json.load(open(f"{out}/llama.{m}.{d}.t{t}.{r}.json"))[0]["avg_ts"]
def fig(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
c = lambda f: f"{f['median']:.1f} [{f['min']:.0f}-{f['max']:.0f}]"
rows = []
print(f"batch-1 decode tok/s, medians of {rounds} alternating rounds [min-max]")
print(f"{'model':9} {'thr':>3} {'kvlab':>6} {'tok/s':>22} {'llama.cpp':>9} {'tok/s':>22} {'ratio':>6}")
for m in models:
    for t in threads:
        for w, d in pairs:
            R = range(1, rounds + 1)
            row = {"model": m, "threads": int(t), "kvlab_weights": w, "llama_type": d,
                   "kvlab": fig([kv(m, w, t, r) for r in R]), "llama": fig([ll(m, d, t, r) for r in R])}
            row["ratio"] = row["kvlab"]["median"] / row["llama"]["median"]
            rows.append(row)
            print(f"{m:9} {t:>3} {w:>6} {c(row['kvlab']):>22} {d:>9} {c(row['llama']):>22} {row['ratio']:6.2f}")
json.dump({"rows": rows, "load": open(f"{out}/load.txt").read().splitlines()},
          open(f"{out}/summary.json", "w"), indent=1)
PY
