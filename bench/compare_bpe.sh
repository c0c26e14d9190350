#!/usr/bin/env bash
# BPE speed against the npm baselines, in one sitting on the same machine, the two sides
# alternating for ROUNDS rounds (default 5); medians and ranges of MB/s:
#   training: kvlab's train_bpe (one thread) against Hugging Face tokenizers 0.23.2 (Rust,
#     bench/hf_tokenizers) with HF_THREADS rayon threads (default 1), both byte-level over
#     GPT-2's pre-split regex on CORPUS, both merging until no pair is left: the node binding
#     trains only with its default trainer (vocab 30000, which the binding cannot change, and
#     which a 4 MB corpus runs out of pairs before), so kvlab is asked for the largest vocab
#     the corpus supports. KVLAB_VOCAB (default 4096) adds kvlab's rounds at that size.
#   encoding: CORPUS under the GPT-2 vocabulary, kvlab's encode (one thread, a fresh chunk cache
#     each round) against tiktoken 1.0.22 (WASM, one thread; tests/data/tiktoken): MB/s per core;
#     and under Llama 3's byte-level BPE and Llama 2's SentencePiece vocabularies (llama.cpp's
#     models/ggml-vocab-llama-bpe.gguf and -llama-spm.gguf, in the source the GGUF tests clone
#     into BUILD_DIR/llama_cpp_src) against llama.cpp's own tokenizer (node-llama-cpp's prebuilt
#     library, one thread), where those files are there.
#     DeepSeek LLM's (several pre-split regexes in turn) is measured the same way.
# FAMILIES_ONLY=1 runs the family vocabularies' encoding rounds alone.
# Needs scripts/setup.sh --tests (the npm packages). Usage:
#   bench/compare_bpe.sh BUILD_DIR CORPUS   (writes BUILD_DIR/compare_bpe.json)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
corpus=${2:-data/corpora/bible-kjv.txt}
rounds=${ROUNDS:-5}
hf_threads=${HF_THREADS:-1}
kvlab_vocab=${KVLAB_VOCAB:-4096}
out=$build/compare_bpe
family_vocabs="llama3:$build/llama_cpp_src/models/ggml-vocab-llama-bpe.gguf
llama2:$build/llama_cpp_src/models/ggml-vocab-llama-spm.gguf
deepseek:$build/llama_cpp_src/models/ggml-vocab-deepseek-llm.gguf"
families_only=${FAMILIES_ONLY:-0}
mkdir -p "$out"
rm -f "$out"/*.jsonl
if [ "$families_only" != 1 ]; then
  node tests/data/tiktoken/reference.js ranks gpt2 "$out/gpt2.tiktoken"
  # Every merge the corpus supports: train_bpe's error for too large a vocab names the size.
  train_vocab=$({ "$build/apps/kvlab" tokenizer train --corpus "$corpus" --pattern gpt2 \
    --vocab-size 10000000 --out "$out/unused.h5" 2>&1 || true; } |
    sed -n 's/.*vocab size of at most \([0-9]*\).*/\1/p')
fi
for r in $(seq "$rounds"); do
  echo "round $r of $rounds" >&2
  if [ "$families_only" != 1 ]; then
  "$build/bench/bench_bpe" train --corpus "$corpus" --pattern gpt2 --vocab-size "$train_vocab" >> "$out/kvlab_train.jsonl"
  RAYON_NUM_THREADS=$hf_threads node bench/bpe_baselines.js train "$corpus" 2>/dev/null >> "$out/hf_train.jsonl"
  "$build/bench/bench_bpe" train --corpus "$corpus" --pattern gpt2 --vocab-size "$kvlab_vocab" >> "$out/kvlab_train_small.jsonl"
  "$build/bench/bench_bpe" encode --ranks "$out/gpt2.tiktoken" --text "$corpus" >> "$out/kvlab_encode.jsonl"
  node bench/bpe_baselines.js encode gpt2 "$corpus" >> "$out/tiktoken_encode.jsonl"
  fi
  for entry in $family_vocabs; do
    name=${entry%%:*} vocab=${entry#*:}
    [ -f "$vocab" ] || continue
    "$build/bench/bench_bpe" encode --gguf "$vocab" --text "$corpus" >> "$out/kvlab_$name.jsonl"
    node bench/bpe_baselines.js llama-cpp "$vocab" "$corpus" 2>/dev/null >> "$out/llama_cpp_$name.jsonl"
  done
done
/usr/bin/python3 - "$out" "$build/compare_bpe.json" "$hf_threads" "$(nproc)" "$(cat /proc/loadavg)" <<'PY'
import json, os, statistics, sys
out, dest, hf_threads, cores, load = sys.argv[1:6]
def runs(name):
    return [json.loads(l) for l in open(f"{out}/{name}.jsonl") if l.strip()]
def summary(rs):
    xs = sorted(r["mb_per_s"] for r in rs)
    return {"median_mb_per_s": statistics.median(xs), "min": xs[0], "max": xs[-1], "runs": rs}
base = os.path.exists(f"{out}/kvlab_train.jsonl")  # not with FAMILIES_ONLY=1
res = {}
if base:
    res = {name: summary(runs(name)) for name in
           ["kvlab_train", "hf_train", "kvlab_train_small", "kvlab_encode", "tiktoken_encode"]}
    res["train_ratio"] = res["kvlab_train"]["median_mb_per_s"] / res["hf_train"]["median_mb_per_s"]
    res["encode_ratio"] = (res["kvlab_encode"]["median_mb_per_s"] /
                           res["tiktoken_encode"]["median_mb_per_s"])
res["threads"] = {"kvlab": 1, "hf_tokenizers": int(hf_threads), "tiktoken": 1, "llama.cpp": 1,
                  "cores": int(cores)}
families = {"llama3": "Llama 3 vocabulary (byte-level BPE, 128,256 tokens)",
            "llama2": "Llama 2 vocabulary (SentencePiece, 32,000 tokens)",
            "deepseek": "DeepSeek LLM vocabulary (byte-level BPE, six regexes in turn, 102,400 tokens)"}
for fam in families:
    if os.path.exists(f"{out}/kvlab_{fam}.jsonl"):
        for name in [f"kvlab_{fam}", f"llama_cpp_{fam}"]:
            res[name] = summary(runs(name))
        res[f"{fam}_ratio"] = (res[f"kvlab_{fam}"]["median_mb_per_s"] /
                               res[f"llama_cpp_{fam}"]["median_mb_per_s"])
res["loadavg_after"] = load
json.dump(res, open(dest, "w"), indent=2)
f = lambda s: f"{s['median_mb_per_s']:.3f} MB/s ({s['min']:.3f}-{s['max']:.3f})"
if base:
    k, h = res["kvlab_train"]["runs"][0], res["hf_train"]["runs"][0]
    print(f"training, {k['bytes']} bytes, median of {len(res['kvlab_train']['runs'])} alternating rounds")
    print(f"  kvlab  vocab {k['vocab_size']} ({k['merges']} merges), 1 thread: {f(res['kvlab_train'])}")
    print(f"  HF     vocab {h['vocab_size']} (its alphabet + merges), {hf_threads} thread(s): {f(res['hf_train'])}")
    print(f"  ratio  {res['train_ratio']:.2f}x")
    s = res["kvlab_train_small"]["runs"][0]
    print(f"  kvlab  vocab {s['vocab_size']}, 1 thread: {f(res['kvlab_train_small'])}")
    print(f"encoding, GPT-2 vocabulary, 1 thread each")
    print(f"  kvlab    {f(res['kvlab_encode'])}  ({res['kvlab_encode']['runs'][0]['tokens']} tokens)")
    print(f"  tiktoken {f(res['tiktoken_encode'])}  ({res['tiktoken_encode']['runs'][0]['tokens']} tokens)")
    print(f"  ratio    {res['encode_ratio']:.2f}x")
for fam, title in families.items():
    if f"{fam}_ratio" in res:
        print(f"encoding, {title}, 1 thread each")
        print(f"  kvlab     {f(res[f'kvlab_{fam}'])}  ({res[f'kvlab_{fam}']['runs'][0]['tokens']} tokens)")
        print(f"  llama.cpp {f(res[f'llama_cpp_{fam}'])}  ({res[f'llama_cpp_{fam}']['runs'][0]['tokens']} tokens)")
        print(f"  ratio     {res[f'{fam}_ratio']:.2f}x")
print(f"load average after: {load}")
PY
