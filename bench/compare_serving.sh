#!/usr/bin/env bash
# Serving throughput: `kvlab serve` (continuous batching over its paged KV cache) against
# llama.cpp's `llama-server --parallel P` (continuous batching over P slots, a context each)
# on the same weights, replayed by the same client in one sitting on the same threads.
#   llama22m: a llama-block model, 8 layers, n_embd 512, 8 heads, 2 KV heads, context 1024, char
#     vocabulary (~22M parameters; speed does not depend on the weights' values): LLAMA_CKPT;
#   ablate: the default ablation's model (GPT-2's block, 4 layers, n_embd 128, context 64):
#     ABLATE_CKPT, by default /tmp/ev/default/runs/kv2_seed0/final.h5.
# Each server serves its side of a PAIRS entry (kvlab --weight-dtype : the type of kvlab's GGUF
# export llama-server loads; default "f32:f32 bf16:f16 q8_0:q8_0"), on T threads
# (OMP_NUM_THREADS=T; llama-server -t T -tb T), P sequences at once (kvlab --max-seqs P with
# its default KV pool, room for P whole contexts, and --max-connections 1024 so that every
# request's connection waits for a sequence, as llama-server's do, instead of a 503 beyond
# its default 128; llama-server -c P*context), KV cache KV_DTYPE for kvlab (default bf16)
# and f16 (its default) for llama-server; llama-server's other settings are its defaults
# (flash attention auto, prompt cache on).
# The client is `kvlab bench serve --url` (apps/bench/http_bench.h) for both: REQUESTS requests
# (default P) of the kv workload (make_kv_workload, seed 0: prompt and output lengths drawn
# log-normal around context/8 and context/6, random token ids) all arriving at once, one
# streamed connection each, greedy, max_tokens each request's output length with ignore_eos,
# every request's usage checked against it. A server is started per run and measured after 4
# warm-up requests of another seed. The sides alternate for ROUNDS rounds (default 3); each
# figure is the median of its rounds beside the min and max, with the load average (uptime)
# before each round. The client runs on the same machine as the servers.
# Usage: [ROUNDS=3] [REQUESTS=P] [THREADS=2] [PARALLEL=16] [KV_DTYPE=bf16] [PAIRS=...]
#        [MODELS="llama22m ablate"] [LLAMA_CKPT=...] [ABLATE_CKPT=...] [PORT=18431]
#        bench/compare_serving.sh [BUILD_DIR]
#        (writes BUILD_DIR/compare_serving/summary.json; llama-server from
#        bench/llama_cpp/build.sh, or LLAMA_SERVER)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${ROUNDS:-3}
threads=${THREADS:-2}
parallel=${PARALLEL:-16}
# As many requests as sequences by default: with more connections than its HTTP threads
# (P + 2), llama-server ran several times slower and started queued requests seconds apart
# (docs/bench-log/serving.md), which would measure that rather than the batching.
requests=${REQUESTS:-$parallel}
kv_dtype=${KV_DTYPE:-bf16}
pairs=${PAIRS:-"f32:f32 bf16:f16 q8_0:q8_0"}
models=${MODELS:-"llama22m ablate"}
port=${PORT:-18431}
kvlab=$build/apps/kvlab
llama_server=${LLAMA_SERVER:-bench/llama_cpp/build/bin/llama-server}
out=$build/compare_serving
mkdir -p "$out"
[[ -x $llama_server ]] || { echo "no llama-server at $llama_server: run bench/llama_cpp/build.sh" >&2; exit 1; }
[[ -x $kvlab ]] || { echo "no kvlab at $kvlab: build the kvlab target" >&2; exit 1; }
llama_ckpt=${LLAMA_CKPT:-}
ablate_ckpt=${ABLATE_CKPT:-/tmp/ev/default/runs/kv2_seed0/final.h5}
declare -A ckpt=([llama22m]=$llama_ckpt [ablate]=$ablate_ckpt) context=([llama22m]=1024 [ablate]=64)
for m in $models; do
  [[ -f ${ckpt[$m]:-} ]] || { echo "no checkpoint for $m: set LLAMA_CKPT (bench/compare_llama_cpp.sh trains one) or ABLATE_CKPT" >&2; exit 1; }
  for pair in $pairs; do
    d=${pair#*:}
    [[ -f $out/$m.$d.gguf ]] || "$kvlab" export --ckpt "${ckpt[$m]}" --format gguf --dtype $d \
      --out "$out/$m.$d.gguf" >/dev/null
  done
done

# A port per server: one just stopped may hold its port in TIME_WAIT, and llama-server does
# not bind such a port.
url=
next_port() { url=http://127.0.0.1:$port; port=$((port + 1)); }
server=
stop_server() { [[ -z $server ]] || { kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; server=; }; }
trap stop_server EXIT
# Waits for the server started as $server to answer /health (llama-server: 503 while loading).
wait_ready() {
  for _ in $(seq 600); do
    kill -0 "$server" 2>/dev/null || { echo "the server exited: see $1" >&2; exit 1; }
    curl -sf "$url/health" >/dev/null && return 0
    sleep 0.1
  done
  echo "the server did not get ready in 60 s: see $1" >&2
  exit 1
}
# Replays $2 requests against the server at $url into $1 (JSON), after a warm-up.
replay() {
  OMP_NUM_THREADS=1 "$kvlab" bench serve --url "$url" --requests 4 --seed 1 >/dev/null
  OMP_NUM_THREADS=1 "$kvlab" bench serve --url "$url" --requests "$2" --seed 0 \
    --json "$1" >/dev/null
}

: >"$out/load.txt"
for r in $(seq "$rounds"); do
  echo "round $r: $(uptime)" | tee -a "$out/load.txt"
  for m in $models; do
    for pair in $pairs; do
      w=${pair%:*} d=${pair#*:}
      log=$out/kvlab.$m.$w.$r.log
      next_port
      OMP_NUM_THREADS=$threads "$kvlab" serve --ckpt "${ckpt[$m]}" --model-name "$m" \
        --port "${url##*:}" --weight-dtype $w --kv-dtype "$kv_dtype" --max-seqs "$parallel" \
        --max-connections 1024 >"$log" 2>&1 &
      server=$!
      wait_ready "$log"
      replay "$out/kvlab.$m.$w.$r.json" "$requests"
      stop_server
      log=$out/llama.$m.$d.$r.log
      next_port
      "$llama_server" -m "$out/$m.$d.gguf" -a "$m" --port "${url##*:}" -t "$threads" -tb "$threads" \
        --parallel "$parallel" -c $((parallel * ${context[$m]})) >"$log" 2>&1 &
      server=$!
      wait_ready "$log"
      replay "$out/llama.$m.$d.$r.json" "$requests"
      stop_server
    done
  done
done
echo "end: $(uptime)" | tee -a "$out/load.txt"

/usr/bin/python3 - "$out" "$rounds" "$pairs" "$models" "$threads" "$parallel" "$kv_dtype" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
pairs, models = [p.split(":") for p in sys.argv[3].split()], sys.argv[4].split()
threads, parallel, kv_dtype = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
def run(side, m, t, r):
    j = json.load(open(f"{out}/{side}.{m}.{t}.{r}.json"))
    return j["context"], j["runs"][0]["continuous_http"]
def fig(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
keys = {"req/s": lambda x: x["requests_per_s"], "tok/s": lambda x: x["output_tokens_per_s"],
        "TTFT p50": lambda x: x["ttft_ms"]["p50"], "TTFT p99": lambda x: x["ttft_ms"]["p99"],
        "TPOT p50": lambda x: x["tpot_ms"]["p50"]}
c = lambda f: f"{f['median']:.1f} [{f['min']:.1f}-{f['max']:.1f}]"
rows = []
print(f"{parallel} sequences at once, {threads} threads each; medians of {rounds} alternating rounds [min-max]; "
      f"KV: kvlab {kv_dtype}, llama.cpp f16; TTFT/TPOT in ms")
for m in models:
    for w, d in pairs:
        row = {"model": m, "kvlab_weights": w, "llama_type": d, "threads": threads,
               "parallel": parallel, "kvlab_kv": kv_dtype, "llama_kv": "f16"}
        contexts = set()
        for side, t in (("kvlab", w), ("llama", d)):
            runs = [run(side, m, t, r) for r in range(1, rounds + 1)]
            contexts |= {ctx for ctx, _ in runs}
            row[side] = {k: fig([f(x) for _, x in runs]) for k, f in keys.items()}
        # The workload's lengths follow the context each server gives: the same on both sides.
        assert len(contexts) == 1, f"{m}: the servers give different contexts {contexts}"
        row["context"] = contexts.pop()
        row["tok/s ratio"] = row["kvlab"]["tok/s"]["median"] / row["llama"]["tok/s"]["median"]
        rows.append(row)
        print(f"\n{m} (context {row['context']}), kvlab {w} vs llama.cpp {d}: "
              f"tok/s ratio {row['tok/s ratio']:.2f}")
        for k in keys:
            print(f"  {k:9} kvlab {c(row['kvlab'][k]):>26}   llama.cpp {c(row['llama'][k]):>26}")
json.dump({"rows": rows, "load": open(f"{out}/load.txt").read().splitlines()},
          open(f"{out}/summary.json", "w"), indent=1)
PY
