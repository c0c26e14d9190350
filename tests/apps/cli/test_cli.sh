#!/usr/bin/env bash
# End-to-end checks of the kvlab command line: a tiny train -> inspect -> generate -> resume
# round trip, and bad input that must give a one-line error and the documented exit code
# (2 for usage errors, 1 for runtime errors), never a crash.
set -u
KVLAB=$1
# shellcheck source=check.sh
. "$(dirname "$0")/check.sh"

for i in $(seq 300); do echo "the lord is my shepherd; i shall not want $((i % 7))."; done > "$work/corpus.txt"
printf '\xff\xfe bad bytes' > "$work/binary.txt"
: > "$work/empty.txt"
echo "not an hdf5 file" > "$work/fake.h5"

check "--version names the BLAS kernels" 0 "; kernels " -- "$KVLAB" --version
if grep -qw avx2 /proc/cpuinfo; then  # SSE3 kernels named on a CPU with wider vectors
  check "--version notes narrower named kernels" 0 "unset OPENBLAS_CORETYPE" -- env OPENBLAS_CORETYPE=Prescott "$KVLAB" --version
fi
# With OMP_PROC_BIND set, libgomp binds the first thread before main(), and kvlab re-executes
# itself to set GOMP_SPINCOUNT (platform/threads.cpp): the new program must still
# see every place, not the first one's CPUs alone.
if [ "$(nproc)" -ge 2 ]; then
  places=$(env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY OMP_PROC_BIND=true OMP_DISPLAY_ENV=true \
    "$KVLAB" --version 2>&1 | sed -n 's/^ *OMP_PLACES = //p')
  if [ "$(wc -l <<<"$places")" -eq 2 ] && [ "$(sort -u <<<"$places" | wc -l)" -eq 1 ]; then
    pass=$((pass + 1))
  else
    echo "FAIL OMP_PROC_BIND survives the re-exec: places before and after: $places"
    fails=$((fails + 1))
  fi
fi
tiny=(--corpus "$work/corpus.txt" --n-layer 1 --n-head 4 --n-embd 16 --block-size 16 --batch-size 4
      --iters 20 --eval-interval 10 --eval-iters 2)
check "train" 0 "finished at step 20" -- "$KVLAB" train "${tiny[@]}" --n-kv-head 2 --out "$work/run"
check "train refuses to overwrite" 2 "--resume" -- "$KVLAB" train "${tiny[@]}" --n-kv-head 2 --out "$work/run"
check "resume of a finished run" 0 "finished at step 20" -- "$KVLAB" train "${tiny[@]}" --n-kv-head 2 --out "$work/run" --resume
check "resume with another config" 1 "n_kv_head: 2 vs 1" -- "$KVLAB" train "${tiny[@]}" --n-kv-head 1 --out "$work/run" --resume
check "inspect" 0 "blocks.0.attn.k_proj.weight" -- "$KVLAB" inspect "$work/run/final.h5"
check "generate" 0 "" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the lord" --max-new 8
check "generate --json" 0 "\"ttft_ms\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json
check "generate --kv-dtype bf16" 0 "\"dtype\": \"bf16\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --kv-dtype bf16
check "generate --kv-dtype int8" 0 "\"dtype\": \"int8\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --kv-dtype int8
check "generate --kv-dtype int4, contiguous" 0 "\"dtype\": \"int4\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --kv-dtype int4 --cache contiguous
check "bench kv-quality" 0 "int4" -- "$KVLAB" bench kv-quality --ckpt "$work/run/final.h5" --windows 8 --json "$work/kvq.json"
check "bench kv-quality: an unknown dtype" 2 "--kv-dtypes: 'int3' is not a KV cache dtype" -- "$KVLAB" bench kv-quality --ckpt "$work/run/final.h5" --kv-dtypes f32,int3
check "bench kv-quality: a dtype twice" 2 "--kv-dtypes: int8 is listed twice" -- "$KVLAB" bench kv-quality --ckpt "$work/run/final.h5" --kv-dtypes int8,int8
check "bench kv-quality needs --ckpt" 2 "--ckpt is required" -- "$KVLAB" bench kv-quality
check "bench kv-quality: --windows 0" 2 "--windows must be >= 1, got 0" -- "$KVLAB" bench kv-quality --ckpt "$work/run/final.h5" --windows 0
check "bench weight-quality" 0 "q4_0" -- "$KVLAB" bench weight-quality --ckpt "$work/run/final.h5" --windows 8 --json "$work/wq.json"
check "bench weight-quality --int8-products" 0 "q4_0+int8" -- "$KVLAB" bench weight-quality --ckpt "$work/run/final.h5" --windows 8 --int8-products
check "bench weight-quality: an unknown dtype" 2 "--weight-dtypes: 'q4_1' is not a weight dtype" -- "$KVLAB" bench weight-quality --ckpt "$work/run/final.h5" --weight-dtypes q8_0,q4_1
check "unknown --kv-dtype" 2 "kv-dtype" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --kv-dtype f16
# The paged cache (the default) generates the same text as the contiguous one (blocks of 4:
# the prompt and the new tokens cross block boundaries; two rows of different lengths leave
# the batch apart).
printf 'the lord is my\nthe\n' > "$work/two_prompts.txt"
gen_text() { "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt-file "$work/two_prompts.txt" --batch 2 --max-new 12 --temperature 0 "$@" 2>/dev/null; }
contiguous_text=$(gen_text --cache contiguous)
paged_text=$(gen_text --kv-block-size 4)
if [ -n "$contiguous_text" ] && [ "$contiguous_text" = "$paged_text" ]; then
  pass=$((pass + 1))
else
  echo "FAIL generate (paged): text differs from --cache contiguous:"
  echo "$contiguous_text"
  echo "vs"
  echo "$paged_text"
  fails=$((fails + 1))
fi
check "generate --json: paged by default" 0 "\"layout\": \"paged\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json
check "generate --cache contiguous --json" 0 "\"layout\": \"contiguous\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --cache contiguous
check "unknown --cache" 2 "cache" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --cache blocks
check "--kv-block-size not a power of two" 2 "--kv-block-size must be a power of two, got 12" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --kv-block-size 12
check "--kv-block-size 0" 2 "--kv-block-size must be a power of two, got 0" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --kv-block-size 0
check "--kv-block-size past the context" 2 "--kv-block-size 32 is larger than the model's context (block_size 16)" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --kv-block-size 32
# --n: samples of one prompt share its blocks; the JSON counts them from the allocator.
check "generate --n 4" 0 "\"sample\": 3" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the lord is my" --max-new 6 --n 4 --kv-block-size 4 --json
check "generate --n 0" 2 "--n must be >= 1 (samples per prompt), got 0" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --n 0
check "generate --kv-memory" 0 "\"total\": 6" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --kv-block-size 4 --kv-memory 1.5KiB
check "--kv-memory not a size" 2 "--kv-memory must be a size such as 64MiB, 1GiB or 4096 (bytes), got '64 apples'" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --kv-memory "64 apples"
check "--kv-memory too small for a sequence" 1 "cannot hold one sequence of" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the lord is my" --max-new 8 --kv-block-size 4 --kv-memory 512
check "--kv-memory runs out" 1 "out of blocks" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the lord is my" --n 2 --max-new 4 --kv-block-size 4 --kv-memory 1KiB
check "--kv-memory with --cache contiguous" 2 "--kv-memory sizes the paged cache's pool" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --cache contiguous --kv-memory 1MiB
check "bench generate (paged)" 0 "tok/s" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-kv-head 2 --n-embd 32 --block-size 24 --new-tokens 4 --runs 1 --kv-heads 2 --skip-no-cache --kv-block-size 8
check "bench generate --cache contiguous" 0 "tok/s" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-kv-head 2 --n-embd 32 --block-size 24 --new-tokens 4 --runs 1 --kv-heads 2 --skip-no-cache --cache contiguous
check "bench kv-memory" 0 "peak seqs p/c" -- "$KVLAB" bench kv-memory --n-layer 1 --n-head 2 --n-embd 32 --block-size 128 --requests 32 --rounds 1 --kv-block-size 8 --json "$work/kvm.json"
check "bench kv-memory --kv-memory too small" 1 "holds no block of 8 positions" -- "$KVLAB" bench kv-memory --n-layer 1 --n-head 2 --n-embd 32 --block-size 128 --requests 32 --rounds 1 --kv-block-size 8 --kv-memory 100
check "bench kv-memory --cache" 2 "--cache" -- "$KVLAB" bench kv-memory --n-layer 1 --n-head 2 --n-embd 32 --block-size 128 --cache contiguous
check "bench kv-memory --samples 0" 2 "--samples must be >= 1, got 0" -- "$KVLAB" bench kv-memory --n-layer 1 --n-head 2 --n-embd 32 --block-size 128 --samples 0
check "bench serve" 0 "continuous" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --requests 16 --rates 500 --kv-block-size 8 --json "$work/serve.json"
check "bench serve --rates 0" 2 "--rates must be > 0 requests/s, got 0" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --rates 0
check "bench serve --requests 0" 2 "--requests must be >= 1, got 0" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --requests 0
check "bench serve --http" 0 "the server's side alone" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --requests 8 --kv-block-size 8 --http
check "bench serve --http-streams" 0 "4 streams at once, 16 + 12 tokens each" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --requests 8 --kv-block-size 8 --http --http-streams 4
check "bench serve --http-streams 0" 2 "--http-streams must be >= 1, got 0" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --http --http-streams 0
check "bench serve --samples past static's rows" 1 "20 samples a request need as many rows of static batching, but its KV memory holds 16" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --requests 4 --samples 20
check "bench serve --samples --system-prompt" 0 "continuous" -- "$KVLAB" bench serve --n-layer 1 --n-head 2 --n-embd 32 --block-size 64 --requests 8 --kv-block-size 8 --samples 2 --system-prompt 8
check "bench serve --shared-fraction 2" 2 "--shared-fraction must be in [0, 1], got 2" -- "$KVLAB" bench serve --shared-fraction 2
check "bench serve --samples 0" 2 "--samples must be >= 1, got 0" -- "$KVLAB" bench serve --samples 0
check "bench serve --url not http" 2 "--url must be http://HOST:PORT, got 'localhost:1'" -- "$KVLAB" bench serve --url localhost:1
check "bench serve --url with --ckpt" 2 "--http and --ckpt do not apply" -- "$KVLAB" bench serve --url http://127.0.0.1:1 --ckpt "$work/run/final.h5"
check "bench serve --url, nobody there" 1 "cannot reach http://127.0.0.1:1" -- "$KVLAB" bench serve --url http://127.0.0.1:1
check "serve --port out of range" 2 "--port must be in [0, 65535], got 70000" -- "$KVLAB" serve --ckpt "$work/run/final.h5" --port 70000
check "serve --max-batch-tokens below --max-seqs" 2 "--max-batch-tokens (4) must be at least --max-seqs (8)" -- "$KVLAB" serve --ckpt "$work/run/final.h5" --max-seqs 8 --max-batch-tokens 4
check "serve --kv-memory too small" 1 "cannot hold one sequence" -- "$KVLAB" serve --ckpt "$work/run/final.h5" --kv-memory 100 --port 0
check "serve --max-body not a size" 2 "--max-body must be a size" -- "$KVLAB" serve --ckpt "$work/run/final.h5" --max-body lots
check "serve without --ckpt" 2 "--ckpt is required" -- "$KVLAB" serve
check "serve --stream-interval negative" 2 "--stream-interval must be >= 0 ms, got -1" -- "$KVLAB" serve --ckpt "$work/run/final.h5" --stream-interval -1
check "bench generate bad --kv-block-size" 2 "--kv-block-size must be a power of two, got 6" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-embd 32 --block-size 24 --new-tokens 4 --runs 1 --kv-block-size 6
check "generate --weight-dtype bf16" 0 "\"weight_dtype\": \"bf16\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --weight-dtype bf16
check "unknown --weight-dtype" 2 "weight-dtype" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --weight-dtype f16
check "generate --weight-dtype q4_0" 0 "\"weight_dtype\": \"q4_0\"" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --weight-dtype q4_0
check "bench generate --weight-dtype q8_0" 0 "q8_0 matrices" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-kv-head 2 --n-embd 32 --block-size 24 --new-tokens 4 --runs 1 --kv-heads 2 --skip-no-cache --weight-dtype q8_0
check "generate --int8-products" 0 "\"int8_products\": true" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --weight-dtype q8_0 --int8-products
check "bench generate --int8-products" 0 "q4_0 matrices in integer products" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-kv-head 2 --n-embd 32 --block-size 24 --new-tokens 4 --runs 1 --kv-heads 2 --skip-no-cache --weight-dtype q4_0 --int8-products
check "bench generate --weight-dtype bf16" 0 "bf16 matrices" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-kv-head 2 --n-embd 32 --block-size 24 --new-tokens 4 --runs 1 --kv-heads 2 --skip-no-cache --weight-dtype bf16
# The bf16 cache holds the same positions in half the bytes, and greedy text is unchanged here.
cache_bytes() { "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the" --max-new 4 --json --temperature 0 "$@" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["cache"]["bytes"])'; }
b32=$(cache_bytes --kv-dtype f32); b16=$(cache_bytes --kv-dtype bf16)
if [ -n "$b32" ] && [ -n "$b16" ] && [ "$b32" -gt 0 ] && [ "$b32" -eq $((2 * b16)) ]; then
  pass=$((pass + 1))
else
  echo "FAIL bf16 cache bytes: f32 '$b32', bf16 '$b16' (want half)"
  fails=$((fails + 1))
fi

# kvlab convert: an MHA run's 4 KV heads merged into 2 (mean), generated from, inspected and
# uptrained with train --init-from; the GQA run's 2 merged into 1 (MQA).
fnv1a64() {  # the content hash kvlab records of a file (data/corpus.h)
  /usr/bin/python3 -c 'import sys
h = 0xcbf29ce484222325
for b in open(sys.argv[1], "rb").read(): h = ((h ^ b) * 0x100000001b3) & 0xffffffffffffffff
print("%016x" % h)' "$1"
}
json_config() {  # json_config FILE KEY: the /config attribute, as inspect --json gives it
  "$KVLAB" inspect --json "$1" | /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["config"].get(sys.argv[1], "(none)"))' "$2"
}
# train --task mqar: the task's own defaults (Zoology's two layers, byte tokens, short examples),
# its accuracy in the log; settings that cannot hold the task are usage errors naming the flag.
mqar=(--task mqar --mqar-train-examples 100 --mqar-val-examples 20 --n-embd 16 --iters 4
      --eval-interval 2 --eval-iters 1)
check "train --task mqar" 0 "acc " -- "$KVLAB" train "${mqar[@]}" --out "$work/mqar"
check "train --task mqar: two layers" 0 "2" -- json_config "$work/mqar/final.h5" n_layer
check "train --task mqar: its settings in /config" 0 "4" -- json_config "$work/mqar/final.h5" mqar_pairs
check "train --task mqar logs its accuracy" 0 '"val_accuracy"' -- cat "$work/mqar/log.jsonl"
check "train --task mqar with a text tokenizer" 2 "--task mqar carries its tokens byte-level" -- \
  "$KVLAB" train "${mqar[@]}" --tokenizer char --out "$work/mqar_char"
check "train --task mqar, too many pairs" 2 "cannot hold 8 pairs" -- \
  "$KVLAB" train "${mqar[@]}" --mqar-pairs 8 --block-size 16 --out "$work/mqar_pairs"
check "train an MHA model" 0 "finished at step 20" -- "$KVLAB" train "${tiny[@]}" --out "$work/mha"
check "convert mean" 0 "(n_kv_head 2, " -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 2 --method mean --out "$work/gqa.h5"
check "generate from a converted checkpoint" 0 "tok/s" -- "$KVLAB" generate --ckpt "$work/gqa.h5" --prompt "the lord" --max-new 8
check "inspect shows convert_method" 0 "convert_method           mean" -- "$KVLAB" inspect "$work/gqa.h5"
check "inspect shows converted_from_n_kv_head" 0 "converted_from_n_kv_head 4" -- "$KVLAB" inspect "$work/gqa.h5"
check "inspect shows the new n_kv_head" 0 "n_kv_head                2" -- "$KVLAB" inspect "$work/gqa.h5"
check "converted_from is the source's content hash" 0 "$(fnv1a64 "$work/mha/final.h5")" -- json_config "$work/gqa.h5" converted_from
check "a converted checkpoint holds weights only" 1 "" -- bash -c '"$0" inspect "$1" | grep -E "^(training state|optimizer):"' "$KVLAB" "$work/gqa.h5"
check "convert GQA -> MQA (first)" 0 "(n_kv_head 1, " -- "$KVLAB" convert --ckpt "$work/run/final.h5" --n-kv-head 1 --method first --out "$work/mqa.h5"
check "convert random" 0 "convert_seed             3" -- bash -c '"$0" convert --ckpt "$1" --n-kv-head 1 --method random --seed 3 --out "$2" && "$0" inspect "$2"' "$KVLAB" "$work/mha/final.h5" "$work/rnd.h5"
# n_kv_head unchanged copies the model: greedy text as the source's.
check "convert to the same n_kv_head" 0 "" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 4 --method mean --out "$work/same.h5"
greedy() { "$KVLAB" generate --ckpt "$1" --prompt "the lord" --max-new 12 --temperature 0 2>/dev/null; }
if [ -n "$(greedy "$work/mha/final.h5")" ] && [ "$(greedy "$work/mha/final.h5")" = "$(greedy "$work/same.h5")" ]; then
  pass=$((pass + 1))
else
  echo "FAIL convert to the same n_kv_head: greedy text differs from the source's"
  fails=$((fails + 1))
fi
check "convert: K not dividing" 2 "--n-kv-head 3 does not divide the n_kv_head of $work/mha/final.h5, 4" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 3 --method mean --out "$work/x.h5"
check "convert: K past the source's" 2 "--n-kv-head 8 is more than the n_kv_head of $work/mha/final.h5, 4" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 8 --method mean --out "$work/x.h5"
check "convert: GQA to more heads" 2 "--n-kv-head 4 is more than the n_kv_head of $work/gqa.h5, 2" -- "$KVLAB" convert --ckpt "$work/gqa.h5" --n-kv-head 4 --method mean --out "$work/x.h5"
check "convert: K 0" 2 "--n-kv-head must be >= 1, got 0" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 0 --method mean --out "$work/x.h5"
check "convert: missing checkpoint" 1 "$work/none.h5: no such file" -- "$KVLAB" convert --ckpt "$work/none.h5" --n-kv-head 1 --method mean --out "$work/x.h5"
check "convert: a text file" 1 "$work/corpus.txt: not an HDF5 file" -- "$KVLAB" convert --ckpt "$work/corpus.txt" --n-kv-head 1 --method mean --out "$work/x.h5"
check "convert: not a checkpoint" 1 "fake.h5" -- "$KVLAB" convert --ckpt "$work/fake.h5" --n-kv-head 1 --method mean --out "$work/x.h5"
check "convert: unknown method" 2 "--method: median not in {mean,first,random}" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 2 --method median --out "$work/x.h5"
check "convert: no method" 2 "--method is required" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 2 --out "$work/x.h5"
check "convert: OUT is IN" 2 "is the checkpoint --ckpt reads" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 2 --method mean --out "$work/mha/../mha/final.h5"
check "convert: --seed without random" 2 "--seed draws the new heads of --method random; --method first draws nothing" -- "$KVLAB" convert --ckpt "$work/mha/final.h5" --n-kv-head 2 --method first --seed 1 --out "$work/x.h5"
check "convert wrote nothing for bad input" 2 "No such file" -- ls "$work/x.h5"
check "convert --help" 0 "--n-kv-head" -- "$KVLAB" convert --help
# train --init-from: step 0 evaluates the file's weights, whatever --seed; the model's shape is
# the file's, with no shape flag given (the defaults would be another model).
short=(--corpus "$work/corpus.txt" --batch-size 4 --iters 4 --eval-interval 2 --eval-iters 2)
# export / import: a llama-block run as a GGUF file and back gives the same greedy text, and
# the imported checkpoint is one that generate, convert and train --init-from take.
check "train a llama-block model" 0 "finished at step 20" -- "$KVLAB" train "${tiny[@]}" --arch llama --n-kv-head 2 --out "$work/llama_kv2"
check "export gguf" 0 "llama architecture" -- "$KVLAB" export --ckpt "$work/llama_kv2/final.h5" --format gguf --out "$work/llama.gguf"
check "import gguf" 0 "imported $work/llama.gguf" -- "$KVLAB" import --gguf "$work/llama.gguf" --out "$work/imported.h5"
if [ -n "$(greedy "$work/llama_kv2/final.h5")" ] && [ "$(greedy "$work/llama_kv2/final.h5")" = "$(greedy "$work/imported.h5")" ]; then
  pass=$((pass + 1))
else
  echo "FAIL import(export(ckpt)): greedy text differs from the source's"
  fails=$((fails + 1))
fi
check "imported_from is the GGUF's content hash" 0 "$(fnv1a64 "$work/llama.gguf")" -- json_config "$work/imported.h5" imported_from
check "export --dtype q8_0, imported back" 0 "imported" -- bash -c '"$0" export --ckpt "$1" --out "$2" --dtype q8_0 && "$0" import --gguf "$2" --out "$3"' "$KVLAB" "$work/llama_kv2/final.h5" "$work/q8.gguf" "$work/q8.h5"
check "export --dtype q4_0, imported back" 0 "imported" -- bash -c '"$0" export --ckpt "$1" --out "$2" --dtype q4_0 && "$0" import --gguf "$2" --out "$3"' "$KVLAB" "$work/llama_kv2/final.h5" "$work/q4.gguf" "$work/q4.h5"
check "export --dtype q4_k_m, imported back" 0 "imported" -- bash -c '"$0" export --ckpt "$1" --out "$2" --dtype q4_k_m && "$0" import --gguf "$2" --out "$3"' "$KVLAB" "$work/llama_kv2/final.h5" "$work/q4km.gguf" "$work/q4km.h5"
check "convert an imported checkpoint" 0 "(n_kv_head 1, " -- "$KVLAB" convert --ckpt "$work/imported.h5" --n-kv-head 1 --method mean --out "$work/imported_mqa.h5"
check "train --init-from an imported checkpoint" 0 "finished at step 4" -- "$KVLAB" train "${short[@]}" --init-from "$work/imported.h5" --out "$work/upgguf"
# A GGUF file is taken wherever a checkpoint is (checkpoints/model_io.h's load_model_file): the
# same greedy text as its import, in its own mix too; inspected, converted, trained from, scored,
# exported again; a truncated one refused by name.
same_greedy() {
  if [ -n "$(greedy "$2")" ] && [ "$(greedy "$2")" = "$(greedy "$3")" ]; then
    pass=$((pass + 1))
  else
    echo "FAIL $1: greedy text differs"
    fails=$((fails + 1))
  fi
}
same_greedy "generate --ckpt FILE.gguf, as its import" "$work/llama.gguf" "$work/imported.h5"
same_greedy "generate --ckpt a q4_k_m GGUF, as its import" "$work/q4km.gguf" "$work/q4km.h5"
check "inspect a GGUF file" 0 "n_kv_head      2" -- "$KVLAB" inspect "$work/llama.gguf"
check "convert a GGUF file" 0 "(n_kv_head 1, " -- "$KVLAB" convert --ckpt "$work/llama.gguf" --n-kv-head 1 --method mean --out "$work/gguf_mqa.h5"
check "train --init-from a GGUF file" 0 "finished at step 4" -- "$KVLAB" train "${short[@]}" --init-from "$work/llama.gguf" --out "$work/upgguf2"
check "eval a GGUF file against its import" 0 "imported.h5" -- "$KVLAB" eval --ckpt "$work/llama.gguf" --ckpt "$work/imported.h5" --corpus "$work/corpus.txt" --windows 4
check "eval a GGUF file: no corpus recorded" 1 "give the text to score (--corpus)" -- "$KVLAB" eval --ckpt "$work/llama.gguf" --ckpt "$work/imported.h5"
check "export a GGUF file in another mix" 0 "as q8_0" -- "$KVLAB" export --ckpt "$work/llama.gguf" --out "$work/again-q8.gguf" --dtype q8_0
encode() { "$KVLAB" tokenizer encode --tokenizer "$1" "$work/corpus.txt" 2>&1; }
if [ -n "$(encode "$work/imported.h5")" ] && [ "$(encode "$work/imported.h5")" = "$(encode "$work/llama.gguf")" ]; then
  pass=$((pass + 1))
else
  echo "FAIL tokenizer encode with a GGUF file: ids differ from its import's"
  fails=$((fails + 1))
fi
head -c 4000 "$work/llama.gguf" >"$work/truncated.gguf"
check "generate: a truncated GGUF file" 1 "$work/truncated.gguf" -- "$KVLAB" generate --ckpt "$work/truncated.gguf" --prompt "the" --max-new 2
check "export GPT-2's block as gpt2" 0 "gpt2 architecture" -- "$KVLAB" export --ckpt "$work/mha/final.h5" --out "$work/gpt2.gguf" --dtype f16
check "import refuses gpt2" 1 "general.architecture is 'gpt2'" -- "$KVLAB" import --gguf "$work/gpt2.gguf" --out "$work/x.h5"
check "import: not a GGUF file" 1 "not a GGUF file" -- "$KVLAB" import --gguf "$work/corpus.txt" --out "$work/x.h5"
check "import: missing file" 1 "$work/none.gguf" -- "$KVLAB" import --gguf "$work/none.gguf" --out "$work/x.h5"
check "import: OUT is IN" 2 "is the file --gguf reads" -- "$KVLAB" import --gguf "$work/llama.gguf" --out "$work/llama.gguf"
check "export: unknown dtype" 2 "--dtype: q4_1 not in" -- "$KVLAB" export --ckpt "$work/llama_kv2/final.h5" --out "$work/x.gguf" --dtype q4_1
check "export: unknown format" 2 "--format: onnx not in" -- "$KVLAB" export --ckpt "$work/llama_kv2/final.h5" --out "$work/x.gguf" --format onnx
check "export: OUT is IN" 2 "is the checkpoint --ckpt reads" -- "$KVLAB" export --ckpt "$work/llama_kv2/final.h5" --out "$work/llama_kv2/final.h5"
check "export wrote nothing for bad input" 2 "No such file" -- ls "$work/x.gguf"
check "export --help" 0 "--dtype" -- "$KVLAB" export --help
check "export --help: llama-quantize's mixes" 0 "q4_k_m, q5_k_m or q6_k" -- "$KVLAB" export --help
check "export --help: --pure" 0 "llama-quantize --pure" -- "$KVLAB" export --help
check "import --help" 0 "--gguf" -- "$KVLAB" import --help
check "train --init-from" 0 "finished at step 4" -- "$KVLAB" train "${short[@]}" --init-from "$work/gqa.h5" --out "$work/up"
check "train --init-from writes final.h5" 0 "" -- ls "$work/up/final.h5"
check "train --init-from: n_kv_head from the file" 0 "2" -- json_config "$work/up/final.h5" n_kv_head
check "train --init-from records the file" 0 "$work/gqa.h5" -- json_config "$work/up/final.h5" init_from
check "train --init-from records its hash" 0 "$(fnv1a64 "$work/gqa.h5")" -- json_config "$work/up/final.h5" init_from_hash
"$KVLAB" train "${short[@]}" --init-from "$work/gqa.h5" --seed 9 --out "$work/up9" >/dev/null 2>&1
val0() { /usr/bin/python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["val_loss"])' "$1"; }
# The same weights (n_kv_head unchanged) evaluate at step 0 as the source run did at its end.
"$KVLAB" train "${short[@]}" --init-from "$work/same.h5" --out "$work/upsame" >/dev/null 2>&1
src_end=$(/usr/bin/python3 -c 'import json, sys; print([json.loads(l) for l in open(sys.argv[1])][-1]["val_loss"])' "$work/mha/log.jsonl")
if [ -n "$(val0 "$work/up/log.jsonl")" ] && [ "$(val0 "$work/up/log.jsonl")" = "$(val0 "$work/up9/log.jsonl")" ] &&
   [ -n "$src_end" ] && [ "$(val0 "$work/upsame/log.jsonl")" = "$src_end" ]; then
  pass=$((pass + 1))
else
  echo "FAIL train --init-from step 0: val loss $(val0 "$work/up/log.jsonl") (seed 9: $(val0 "$work/up9/log.jsonl")); same weights $(val0 "$work/upsame/log.jsonl") vs the source's $src_end"
  fails=$((fails + 1))
fi
check "resume of an --init-from run" 0 "finished at step 4" -- "$KVLAB" train "${short[@]}" --resume --out "$work/up"
check "--init-from with the file's shape given" 0 "finished at step 4" -- "$KVLAB" train "${short[@]}" --n-layer 1 --n-head 4 --n-kv-head 2 --n-embd 16 --block-size 16 --mlp-hidden 0 --dropout 0.1 --init-from "$work/gqa.h5" --out "$work/up3"
check "--init-from with --resume" 2 "--init-from starts a new run from a checkpoint's weights and --resume continues the run in --out: give one of them" -- "$KVLAB" train "${short[@]}" --init-from "$work/gqa.h5" --resume --out "$work/up2"
check "--init-from with another --n-kv-head" 2 "--init-from: n_kv_head 4 on the command line, 2 in $work/gqa.h5" -- "$KVLAB" train "${short[@]}" --n-kv-head 4 --init-from "$work/gqa.h5" --out "$work/up2"
check "--init-from names every contradicting key" 2 "n_embd 32 on the command line, 16 in $work/gqa.h5; n_kv_head 1 on the command line, 2 in $work/gqa.h5" -- "$KVLAB" train "${short[@]}" --n-embd 32 --n-kv-head 1 --init-from "$work/gqa.h5" --out "$work/up2"
check "--init-from with another --tokenizer" 2 "tokenizer byte on the command line, char in $work/gqa.h5" -- "$KVLAB" train "${short[@]}" --tokenizer byte --init-from "$work/gqa.h5" --out "$work/up2"
{ cat "$work/corpus.txt"; echo "Zed."; } > "$work/corpus-z.txt"
check "--init-from on a corpus of another vocabulary" 1 "has another tokenizer (char, " -- "$KVLAB" train "${short[@]:2}" --corpus "$work/corpus-z.txt" --init-from "$work/gqa.h5" --out "$work/up2"
check "--init-from a missing file" 1 "$work/none.h5: no such file" -- "$KVLAB" train "${short[@]}" --init-from "$work/none.h5" --out "$work/up2"
check "--init-from a text file" 1 "$work/corpus.txt: not an HDF5 file" -- "$KVLAB" train "${short[@]}" --init-from "$work/corpus.txt" --out "$work/up2"
check "train --help names --init-from" 0 "--init-from" -- "$KVLAB" train --help
# The llama block: recorded in /config, kept through convert and --init-from, and a preset that
# contradicts the file is refused part by part.
check "train --arch llama" 0 "finished at step 20" -- "$KVLAB" train "${tiny[@]}" --arch llama --out "$work/llama"
check "inspect shows the block" 0 "pos            rope" -- "$KVLAB" inspect "$work/llama/final.h5"
check "the llama preset has no biases" 1 "" -- bash -c '"$0" inspect "$1" | grep -E "\.bias "' "$KVLAB" "$work/llama/final.h5"
check "generate from a llama checkpoint" 0 "tok/s" -- "$KVLAB" generate --ckpt "$work/llama/final.h5" --prompt "the lord" --max-new 8
# --slide: a RoPE model drops its oldest blocks and goes on (a slide per 4 tokens past the
# context of 16 here); blocks over half the context re-prefill instead, one slide per token.
check "generate --slide, llama" 0 '"slides": 7' -- "$KVLAB" generate --ckpt "$work/llama/final.h5" --prompt "the lord" --max-new 36 --slide --kv-block-size 4 --temperature 0 --json
check "generate --slide, llama, big blocks" 0 '"slides": 27' -- "$KVLAB" generate --ckpt "$work/llama/final.h5" --prompt "the lord" --max-new 36 --slide --temperature 0 --json
check "convert a llama checkpoint" 0 "(n_kv_head 2, " -- "$KVLAB" convert --ckpt "$work/llama/final.h5" --n-kv-head 2 --method mean --out "$work/llama2.h5"
check "--init-from keeps the llama block" 0 "swiglu" -- bash -c '"$0" train "${@:2}" --init-from "$1" --out "$1.up" >/dev/null && "$0" inspect "$1.up/final.h5"' "$KVLAB" "$work/llama2.h5" "${short[@]}"
check "--init-from with another --arch" 2 "mlp gelu on the command line, swiglu in $work/llama2.h5" -- "$KVLAB" train "${short[@]}" --arch gpt2 --init-from "$work/llama2.h5" --out "$work/up2"
check "--arch llama with --mlp gelu" 0 "mlp            gelu" -- bash -c '"$0" train "${@:2}" --arch llama --mlp gelu --out "$1" >/dev/null && "$0" inspect "$1/final.h5"' "$KVLAB" "$work/llama-gelu" "${short[@]}"
# MLA: trained, recorded, generated from without a cache; what needs its latent cache says so.
mla=(--arch llama --attn mla --kv-lora-rank 8 --rope-head-dim 4)
check "train --attn mla" 0 "finished at step 20" -- "$KVLAB" train "${tiny[@]}" "${mla[@]}" --out "$work/mla"
check "inspect shows MLA" 0 "kv_lora_rank   8" -- "$KVLAB" inspect "$work/mla/final.h5"
check "train MLA with compressed queries" 0 "finished at step 20" -- "$KVLAB" train "${tiny[@]}" "${mla[@]}" --q-lora-rank 6 --out "$work/mla-q"
check "inspect shows the query rank" 0 "q_lora_rank    6" -- "$KVLAB" inspect "$work/mla-q/final.h5"
check "generate from MLA with compressed queries" 0 "cache paged f32" -- "$KVLAB" generate --ckpt "$work/mla-q/final.h5" --prompt "the lord" --max-new 8
check "--q-lora-rank without MLA" 2 "q_lora_rank are MLA's (attn mla)" -- "$KVLAB" train "${short[@]}" --q-lora-rank 6 --out "$work/mla-x"
check "generate from MLA without a cache" 0 "cache off" -- "$KVLAB" generate --ckpt "$work/mla/final.h5" --prompt "the lord" --max-new 8 --no-cache
check "generate from MLA with the cache" 0 "cache paged f32" -- "$KVLAB" generate --ckpt "$work/mla/final.h5" --prompt "the lord" --max-new 8
check "generate from MLA, contiguous int8 cache" 0 "cache contiguous int8" -- "$KVLAB" generate --ckpt "$work/mla/final.h5" --prompt "the lord" --max-new 8 --cache contiguous --kv-dtype int8
# MLA as llama.cpp's deepseek2 and back (docs/gguf.md): the same greedy text, both up-projection forms.
check "export MLA as deepseek2" 0 "deepseek2 architecture" -- "$KVLAB" export --ckpt "$work/mla-q/final.h5" --out "$work/mla-q.gguf"
check "import deepseek2" 0 "imported $work/mla-q.gguf" -- "$KVLAB" import --gguf "$work/mla-q.gguf" --out "$work/mla-q-imported.h5"
check "export MLA, whole up-projection, imported back" 0 "imported" -- bash -c '"$0" export --ckpt "$1" --out "$2" --mla-up whole && "$0" import --gguf "$2" --out "$3"' "$KVLAB" "$work/mla/final.h5" "$work/mla-whole.gguf" "$work/mla-whole.h5"
if [ -n "$(greedy "$work/mla-q/final.h5")" ] && [ "$(greedy "$work/mla-q/final.h5")" = "$(greedy "$work/mla-q-imported.h5")" ] &&
   [ "$(greedy "$work/mla/final.h5")" = "$(greedy "$work/mla-whole.h5")" ]; then
  pass=$((pass + 1))
else
  echo "FAIL import(export(MLA ckpt)): greedy text differs from the source's"
  fails=$((fails + 1))
fi
check "export: unknown --mla-up" 2 "--mla-up: half not in" -- "$KVLAB" export --ckpt "$work/mla/final.h5" --out "$work/x.gguf" --mla-up half
check "generate from MLA, fp8 cache" 0 "cache paged fp8" -- "$KVLAB" generate --ckpt "$work/mla/final.h5" --prompt "the lord" --max-new 8 --kv-dtype fp8
check "serve an MLA checkpoint sizes its pool by latent rows" 1 "cannot hold one sequence of 16 positions, which takes 1 blocks of 16 positions (768 bytes each)" -- "$KVLAB" serve --ckpt "$work/mla/final.h5" --kv-memory 767 --port 0
check "bench serve on MLA" 0 "continuous" -- "$KVLAB" bench serve --ckpt "$work/mla/final.h5" --requests 8 --kv-block-size 16
check "convert an MLA checkpoint" 1 "the source is an MLA model" -- "$KVLAB" convert --ckpt "$work/mla/final.h5" --n-kv-head 2 --method mean --out "$work/mla2.h5"
check "MLA with learned positions" 2 "MLA's rotary key needs pos rope" -- "$KVLAB" train "${short[@]}" --attn mla --kv-lora-rank 8 --rope-head-dim 4 --out "$work/mla-x"
check "MLA with an odd rotary width" 2 "rope_head_dim 3 must be even" -- "$KVLAB" train "${short[@]}" --arch llama --attn mla --kv-lora-rank 8 --rope-head-dim 3 --out "$work/mla-x"
check "MLA's rank past n_embd" 2 "kv_lora_rank 200 must be in [1, n_embd" -- "$KVLAB" train "${short[@]}" --arch llama --attn mla --kv-lora-rank 200 --rope-head-dim 4 --out "$work/mla-x"
check "bench generate on MLA" 0 "tok/s" -- "$KVLAB" bench generate --ckpt "$work/mla/final.h5" --prompt-tokens 4 --new-tokens 4 --runs 1 --skip-no-cache
check "bench kv-quality on MLA" 0 "int4" -- "$KVLAB" bench kv-quality --ckpt "$work/mla/final.h5" --windows 4 --kv-dtypes f32,int8,int4
check "bench kv-quality on MLA with fp8" 0 "fp8" -- "$KVLAB" bench kv-quality --ckpt "$work/mla/final.h5" --windows 4 --kv-dtypes f32,fp8
# ablate adds MLA variants by rank; the base model stays GQA's.
check "ablate --attn mla" 2 "the sweep adds MLA variants with --mla-ranks" -- "$KVLAB" ablate "${tiny[@]}" "${mla[@]}" --out "$work/ab-mla"
check "ablate --mla-ranks without RoPE" 2 "--mla-ranks: MLA needs rotary positions" -- "$KVLAB" ablate "${tiny[@]}" --mla-ranks 8 --out "$work/ab-mla"
check "ablate --mla-ranks 8,99" 2 "--mla-ranks: MLA rank 99 must be in [1, n_embd = 16]" -- "$KVLAB" ablate "${tiny[@]}" --arch llama --mla-ranks 8,99 --out "$work/ab-mla"
check "ablate --mla-ranks 8,x" 2 "--mla-ranks: " -- "$KVLAB" ablate "${tiny[@]}" --arch llama --mla-ranks 8,x --out "$work/ab-mla"
check "ablate --rope-head-dim alone" 2 "give --mla-ranks" -- "$KVLAB" ablate "${tiny[@]}" --arch llama --rope-head-dim 2 --out "$work/ab-mla"
check "ablate --q-lora-rank alone" 2 "--q-lora-rank is the MLA variants'; give --mla-ranks" -- "$KVLAB" ablate "${tiny[@]}" --arch llama --q-lora-rank 4 --out "$work/ab-mla"
check "ablate --mla-ranks odd --rope-head-dim" 1 "MLA rank 8: config: rope_head_dim 3 must be even" -- "$KVLAB" ablate "${tiny[@]}" --arch llama --mla-ranks 8 --rope-head-dim 3 --out "$work/ab-mla"
check "unknown --arch" 2 "--arch" -- "$KVLAB" train "${short[@]}" --arch mistral --out "$work/up2"
check "RoPE with an odd head size" 2 "RoPE needs an even head size" -- "$KVLAB" train "${short[@]}" --pos rope --n-head 4 --n-embd 12 --out "$work/up2"

printf '# same keys as the flags\n[train]\ncorpus = "%s"\nn_layer = 1\nn-head = 4\nn-kv-head = 1\nn-embd = 8\nblock-size = 16\nbatch-size = 4\niters = 6\neval-interval = 3\neval-iters = 2\n' "$work/corpus.txt" > "$work/run.toml"
check "train --config" 0 "finished at step 6" -- "$KVLAB" train --config "$work/run.toml" --out "$work/cfg"
check "config values reach the model" 0 "n_embd         8" -- "$KVLAB" inspect "$work/cfg/final.h5"
check "command line wins over --config" 0 "finished at step 4" -- "$KVLAB" train --config "$work/run.toml" --iters 4 --out "$work/cfg2"
check "unreadable --config" 2 "cannot read" -- "$KVLAB" train --config "$work/none.toml"

check "n_kv_head not dividing n_head" 2 "not divisible by n_kv_head" -- "$KVLAB" train "${tiny[@]}" --n-kv-head 3 --out "$work/x"
check "missing corpus" 2 "no such file" -- "$KVLAB" train --corpus "$work/nope.txt" --out "$work/x"
mkfifo "$work/corpus.fifo"  # no writer: opening it would block forever
check "FIFO corpus" 1 "is not a regular file (it is a FIFO)" -- timeout 60 "$KVLAB" train "${tiny[@]:2}" --corpus "$work/corpus.fifo" --out "$work/x1"
check "empty corpus" 1 "empty" -- "$KVLAB" train "${tiny[@]:2}" --corpus "$work/empty.txt" --out "$work/x2"
check "invalid utf-8" 1 "invalid UTF-8 at byte 0" -- "$KVLAB" train "${tiny[@]:2}" --corpus "$work/binary.txt" --out "$work/x3"
check "negative iters" 2 "iters" -- "$KVLAB" train "${tiny[@]}" --iters -1 --out "$work/x4"
check "unknown flag" 2 "--bogus" -- "$KVLAB" train --bogus
check "bf16 on the cpu" 2 "--dtype bf16 needs --device cuda" -- "$KVLAB" train "${tiny[@]}" --dtype bf16 --out "$work/x5"
if ! nvidia-smi -L >/dev/null 2>&1; then  # no GPU here: asking for one is a runtime error
  check "cuda without a gpu" 1 "CUDA" -- "$KVLAB" train "${tiny[@]}" --device cuda --out "$work/x6"
  check "generate on cuda without a gpu" 1 "CUDA" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --device cuda
fi
check "missing checkpoint" 1 "no such file" -- "$KVLAB" generate --ckpt "$work/none.h5" --prompt a --max-new 2
check "not a checkpoint" 1 "fake.h5" -- "$KVLAB" inspect "$work/fake.h5"
check "prompt outside vocabulary" 1 "'Z'" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "Zebra" --max-new 2
check "max-new 0" 2 "max-new" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 0
check "negative temperature" 2 "temperature" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --temperature -1
check "top-p out of range" 2 "top-p" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 2 --top-p 1.5
check "negative unsigned seed" 2 "not a decimal integer" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --seed -1
check "max-new past int64" 2 "outside" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 99999999999999999999
check "largest max-new stops at the context" 0 "context limit" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt a --max-new 9223372036854775807
check "prompt file is a directory" 1 "is a directory" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt-file "$work"
check "standard output full" 1 "standard output" -- bash -c '"$0" generate --ckpt "$1" --prompt a --max-new 2 --json > /dev/full' "$KVLAB" "$work/run/final.h5"
check "--help into a full output" 1 "standard output" -- bash -c '"$0" --help > /dev/full' "$KVLAB"
# The JSON records the machine a figure came from: CPU, threads, the BLAS and its kernels.
check "bench --json records the machine" 0 "" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-embd 32 --block-size 24 --new-tokens 4 --runs 1 --kv-heads 2 --skip-no-cache --json "$work/bench.json"
check "bench --json names the BLAS kernels" 0 "openblas_kernels" -- grep -A5 '"machine"' "$work/bench.json"
check "bench --json unwritable" 2 "cannot be written" -- "$KVLAB" bench generate --json "$work/none/b.json"
check "bench --json empty" 2 "the path is empty" -- "$KVLAB" bench generate --json ""
check "bench --json onto its --ckpt" 2 "is the checkpoint --ckpt reads" -- "$KVLAB" bench generate --ckpt "$work/run/final.h5" --json "$work/run/final.h5"
check "bench --kv-heads repeated" 2 "n_kv_head = 2 is listed twice" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-embd 16 --block-size 24 --kv-heads 2,2
check "bench --ckpt with a shape flag" 2 "excludes" -- "$KVLAB" bench generate --ckpt "$work/run/final.h5" --n-layer 2
check "bench --batch past memory" 1 "GB of KV cache" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-embd 16 --block-size 24 --new-tokens 4 --batch 99999999999
check "train a model past memory" 2 "GB of f32 weights" -- "$KVLAB" train --corpus "$work/corpus.txt" --n-layer 99999999999 --out "$work/huge"
check "bench without a decode step" 2 "no decode step" -- "$KVLAB" bench generate --n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --prompt-tokens 7
cp "$work/corpus.txt" "$work/corpus-"$'\xe9'".txt"
"$KVLAB" train "${tiny[@]:2}" --corpus "$work/corpus-"$'\xe9'".txt" --out "$work/latin1" >/dev/null 2>&1
check "inspect --json of a non-UTF-8 corpus path" 0 "\"corpus\"" -- "$KVLAB" inspect --json "$work/latin1/final.h5"
# A kvlab file edited in place no longer matches its digest: refused as damaged.
cp "$work/run/final.h5" "$work/edited.h5"
/usr/bin/python3 -c 'import h5py, sys; f = h5py.File(sys.argv[1], "r+"); f["model/ln_f.bias"][0] = 1.5; f.close()' "$work/edited.h5"
check "a kvlab file edited in place is refused" 1 "no longer match the digest" -- "$KVLAB" generate --ckpt "$work/edited.h5" --prompt a --max-new 2
check "inspect refuses it too" 1 "no longer match the digest" -- "$KVLAB" inspect "$work/edited.h5"
# The files below are edited without the 512-byte user block that holds the digest, as a file
# h5py wrote: its structure is what kvlab checks.
# A checkpoint whose weights hold NaN: inspect says where, generate refuses it.
tail -c +513 "$work/run/final.h5" > "$work/nan.h5"
/usr/bin/python3 -c 'import h5py, sys; f = h5py.File(sys.argv[1], "r+"); d = f["model/blocks.0.attn.q_proj.weight"]; d[0, 0] = float("nan"); f.close()' "$work/nan.h5"
check "inspect names the NaN tensor" 0 "blocks.0.attn.q_proj.weight" -- bash -c '"$0" inspect "$1" | grep "NaN or inf"' "$KVLAB" "$work/nan.h5"
check "generate refuses NaN weights" 1 "non-finite" -- "$KVLAB" generate --ckpt "$work/nan.h5" --prompt a --max-new 2
# One without ln_f.bias: inspect says it would not load, generate names what is missing.
tail -c +513 "$work/run/final.h5" > "$work/lack.h5"
/usr/bin/python3 -c 'import h5py, sys; f = h5py.File(sys.argv[1], "r+"); del f["model/ln_f.bias"]; f.close()' "$work/lack.h5"
check "inspect flags a missing tensor" 0 "not a loadable model: the config describes" -- "$KVLAB" inspect "$work/lack.h5"
check "inspect says the training state is not usable" 0 "training state not usable" -- "$KVLAB" inspect "$work/lack.h5"
check "generate names the missing tensor" 1 "missing dataset /model/ln_f.bias" -- "$KVLAB" generate --ckpt "$work/lack.h5" --prompt a --max-new 2
# Training state --resume cannot use: inspect lists every problem, --resume refuses the first.
for edit in 'f["train/rng_state"][0:4] = 0' 'f["optimizer/m/wte.weight"][0, 0] = float("nan")' \
            'del f["train/rng_state"]; f["train"].create_dataset("rng_state", data=[1, 2, 3], dtype="u8")' \
            'del f["config"].attrs["n_layer"]; f["config"].attrs["n_layer"] = "1"'; do
  rm -rf "$work/state" && cp -r "$work/run" "$work/state"
  tail -c +513 "$work/run/last.h5" > "$work/state/last.h5"
  /usr/bin/python3 -c "import h5py, sys; f = h5py.File(sys.argv[1], 'r+'); $edit; f.close()" "$work/state/last.h5"
  case $edit in
    *rng_state*0:4*) want="words 0-3 (rank 0's batch sampler generator) are all zero" ;;
    *nan*) want="/optimizer/m/wte.weight holds non-finite values" ;;
    *1,\ 2,\ 3*) want="/train/rng_state holds 3 words, 8 expected" ;;
    *) want="'n_layer' has the wrong type" ;;
  esac
  if [ "$want" != "'n_layer' has the wrong type" ]; then
    check "inspect lists: $want" 0 "$want" -- "$KVLAB" inspect "$work/state/last.h5"
  fi
  check "--resume refuses: $want" 1 "$want" -- "$KVLAB" train "${tiny[@]}" --n-kv-head 2 --out "$work/state" --resume
done
check "prompt longer than context" 1 "context" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the lord is my shepherd; i shall" --max-new 2
check "ablate kv not dividing" 2 "not divisible by n_kv_head = 3" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads 4,3 --out "$work/ab"
check "ablate unwritable out" 1 "not writable" -- "$KVLAB" ablate "${tiny[@]}" --out /proc/kvlab-nope
# A diverging run stops at the step with an error, saving nothing from it.
check "diverging loss stops the run" 1 "loss is not finite at step" -- "$KVLAB" train "${tiny[@]}" --lr 1e6 --out "$work/nan"
check "nothing saved from a diverged step" 2 "No such file" -- ls "$work/nan/final.h5"
# Float flags must be finite and integer flags fit their type, checked as they are parsed.
check "--lr inf" 2 "'inf' is not a finite number" -- "$KVLAB" train "${tiny[@]}" --lr inf --out "$work/x7"
check "--weight-decay inf" 2 "'inf' is not a finite number" -- "$KVLAB" train "${tiny[@]}" --weight-decay inf --out "$work/x7"
check "--dropout nan" 2 "'nan' is not a finite number" -- "$KVLAB" ablate "${tiny[@]}" --dropout nan --out "$work/x7"
check "--seed -1" 2 "'-1' is not a decimal integer" -- "$KVLAB" train "${tiny[@]}" --seed -1 --out "$work/x7"
check "int64 flag past its range" 2 "is outside" -- "$KVLAB" train "${tiny[@]}" --warmup 99999999999999999999 --out "$work/x7"
check "int flag past its range" 2 "is outside" -- "$KVLAB" ablate "${tiny[@]}" --seeds 2147483648 --out "$work/x7"
# --resume and ablate's reuse compare the corpus by content, not by path.
sed 's/lord/dorl/' "$work/corpus.txt" > "$work/corpus2.txt"  # the same characters, another text
check "resume on another corpus" 1 "corpus: $work/corpus.txt (content" -- "$KVLAB" train "${tiny[@]:2}" --corpus "$work/corpus2.txt" --n-kv-head 2 --out "$work/run" --resume
ab=(--n-layer 1 --n-head 4 --n-embd 16 --block-size 16 --batch-size 4 --iters 4 --eval-interval 2 --eval-iters 1 --kv-heads 2 --seeds 1 --sample-tokens 4 --bench-runs 1)
check "ablate" 0 "n_kv_head" -- "$KVLAB" ablate --corpus "$work/corpus.txt" "${ab[@]}" --out "$work/abc"
check "ablate on another corpus" 1 "another --out" -- "$KVLAB" ablate --corpus "$work/corpus2.txt" "${ab[@]}" --out "$work/abc"
check "ablate --mla-ranks, fp8 caches" 0 "MLA against GQA at equal cache bytes" -- "$KVLAB" ablate --corpus "$work/corpus.txt" "${ab[@]}" --arch llama --mla-ranks 6 --kv-dtype fp8 --kv-dtypes f32,fp8,int8 --out "$work/ab-mla"
check "train --comm-timeout past 1e9" 2 "in (0, 1e9]" -- "$KVLAB" train "${tiny[@]}" --comm-timeout 1e10 --out "$work/ct"
# A folder holding only the log of a run stopped before its first checkpoint is started over,
# with or without --resume (which, with no checkpoint at all, starts from scratch); one holding
# another run's checkpoints is refused.
for mode in fresh resume; do
  flag=(); [ "$mode" = resume ] && flag=(--resume)
  mkdir -p "$work/dead-$mode" && echo '{"step": 0, "val_loss": 9.5}' > "$work/dead-$mode/log.jsonl"
  check "train ($mode) over a log without checkpoints" 0 "holds the log.jsonl of a run that saved no checkpoint; starting over" -- "$KVLAB" train "${tiny[@]}" "${flag[@]}" --out "$work/dead-$mode"
  check "the earlier log is gone ($mode)" 1 "" -- grep -q '"val_loss": 9.5' "$work/dead-$mode/log.jsonl"
  check "step 0 logged once ($mode)" 0 "1" -- grep -c '"step":0,' "$work/dead-$mode/log.jsonl"
done
check "train --resume with no checkpoint" 0 "holds no checkpoint; starting from scratch" -- "$KVLAB" train "${tiny[@]}" --resume --out "$work/none-yet"
mkdir -p "$work/bestonly" && cp "$work/run/final.h5" "$work/bestonly/best.h5"
check "train into an earlier run's checkpoints" 2 "holds an earlier run's best.h5 but no last.h5" -- "$KVLAB" train "${tiny[@]}" --out "$work/bestonly"
check "train --resume without last.h5" 2 "holds an earlier run's best.h5 but no last.h5" -- "$KVLAB" train "${tiny[@]}" --resume --out "$work/bestonly"
check "step 0 has no training loss" 0 '"train_loss":null' -- head -1 "$work/run/log.jsonl"
check "train --batch-size past int" 2 "batch_size 9223372036854775807 is past" -- "$KVLAB" train --corpus "$work/corpus.txt" --batch-size 9223372036854775807 --out "$work/big"
check "train --eval-iters past int" 2 "eval_iters 99999999999 x batch_size" -- "$KVLAB" train --corpus "$work/corpus.txt" --eval-iters 99999999999 --out "$work/big"
touch "$work/afile"
check "train --out a file" 1 "is a file, not a folder" -- "$KVLAB" train "${tiny[@]}" --out "$work/afile"
check "missing prompt file says why" 1 "No such file or directory" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt-file "$work/missing.txt" --max-new 2
check "train --out empty" 2 "no output folder" -- "$KVLAB" train "${tiny[@]}" --out ""
check "ablate --out empty" 2 "no output folder" -- "$KVLAB" ablate "${tiny[@]}" --out ""
check "--n-kv-head 0" 2 "--n-kv-head must be in [1, n_head]" -- "$KVLAB" train "${tiny[@]}" --n-kv-head 0 --out "$work/x8"
check "--n-kv-head -1" 2 "--n-kv-head must be in [1, n_head]" -- "$KVLAB" train "${tiny[@]}" --n-kv-head -1 --out "$work/x8"
# --config: a folder, a key without a value, an unknown key, a nested config.
mkdir -p "$work/cfgdir"
printf 'iters = 4\nlr =\n' > "$work/novalue.toml"
printf 'iters = 4\nn-head = 4\nbogus_key = 3\n' > "$work/bogus.toml"
printf 'iters = 4\nconfig = "%s"\n' "$work/run.toml" > "$work/nested.toml"
check "--config a folder" 2 "cannot read" -- "$KVLAB" train --config "$work/cfgdir"
check "--config key without value" 2 "novalue.toml:2: 'lr' has no value" -- "$KVLAB" train --config "$work/novalue.toml"
check "--config unknown key" 2 "bogus.toml:3: unknown key 'bogus-key'" -- "$KVLAB" train --config "$work/bogus.toml"
check "--config nested" 2 "nested.toml:2: 'config' cannot be nested" -- "$KVLAB" train --config "$work/nested.toml"
printf 'iters = 4\nlr = 1e-3\niters = 5\n' > "$work/twice.toml"
check "--config key set twice" 2 "twice.toml:3: 'iters' is set again (first at line 1)" -- "$KVLAB" train --config "$work/twice.toml"
check "--config given twice" 2 "--config is given twice" -- "$KVLAB" train --config "$work/run.toml" --config "$work/twice.toml" --out "$work/cfg3"
check "--config on generate" 2 "kvlab generate takes no config file" -- "$KVLAB" generate --config "$work/run.toml" --ckpt "$work/run/final.h5"
check "--config= empty" 2 "--config needs a file name" -- "$KVLAB" train --config= --out "$work/cfg3"
# A misspelt section is an error naming the known ones; another command's section is skipped.
printf 'iters = 4\n[trian]\nlr = 1e-2\n' > "$work/section.toml"
check "--config unknown section" 2 "section.toml:2: unknown section '[trian]' (sections: [ablate], [train])" -- "$KVLAB" train --config "$work/section.toml"
check "ablate --config unknown section" 2 "unknown section '[trian]'" -- "$KVLAB" ablate --config "$work/section.toml"
printf '[ablate]\nkv-heads = [4, 2]\n[train]\niters = 4\n' > "$work/both.toml"
check "--config skips another command's section" 0 "Usage: kvlab train" -- "$KVLAB" train --config "$work/both.toml" --help
# Ctrl-C saves and exits 130; a second Ctrl-C (here during the long step-0 evaluation) quits at once.
long=(--corpus "$work/corpus.txt" --n-layer 1 --n-head 4 --n-embd 16 --block-size 16 --batch-size 4 --iters 100000 --eval-interval 10)
"$KVLAB" train "${long[@]}" --eval-iters 2 --out "$work/int" > "$work/int.log" 2>&1 &
pid=$!; for _ in $(seq 300); do [ -s "$work/int/log.jsonl" ] && break; sleep 0.1; done
kill -INT "$pid"; wait "$pid"; rc=$?
if [ "$rc" -eq 130 ] && grep -q "interrupted at step" "$work/int.log" && [ -f "$work/int/last.h5" ]; then pass=$((pass + 1)); else echo "FAIL Ctrl-C: rc=$rc (want 130)"; tail -3 "$work/int.log"; fails=$((fails + 1)); fi
"$KVLAB" train "${long[@]}" --eval-iters 20000 --out "$work/int2" > "$work/int2.log" 2>&1 &
pid=$!; for _ in $(seq 300); do grep -q "from scratch" "$work/int2.log" && break; sleep 0.1; done
kill -INT "$pid"; sleep 0.2; kill -INT "$pid" 2>/dev/null; wait "$pid"; rc=$?
if [ "$rc" -eq 130 ] && ! grep -q "interrupted at step" "$work/int2.log"; then pass=$((pass + 1)); else echo "FAIL second Ctrl-C: rc=$rc (want 130, no clean stop)"; tail -3 "$work/int2.log"; fails=$((fails + 1)); fi
# Ctrl-C part-way through a step of a million micro-batches stops within one of them (30 s
# allowed), at step 0, where no evaluation after a step has given a best val loss yet.
"$KVLAB" train "${long[@]}" --eval-iters 2 --grad-accum 1000000 --out "$work/acc" > "$work/acc.log" 2>&1 &
pid=$!; for _ in $(seq 300); do [ -s "$work/acc/log.jsonl" ] && break; sleep 0.1; done
sleep 0.5; kill -INT "$pid"
for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
kill -9 "$pid" 2>/dev/null; wait "$pid"; rc=$?
if [ "$rc" -eq 130 ] && grep -q "interrupted at step 0: no best val loss yet" "$work/acc.log"; then pass=$((pass + 1)); else echo "FAIL Ctrl-C during gradient accumulation: rc=$rc (want 130 within 30 s)"; tail -3 "$work/acc.log"; fails=$((fails + 1)); fi
check "inspect a step-0 checkpoint" 0 "iteration 0, no best val loss yet" -- "$KVLAB" inspect "$work/acc/last.h5"
# SIGTERM (a scheduler's stop) saves as Ctrl-C does and exits 143.
"$KVLAB" train "${long[@]}" --eval-iters 2 --out "$work/term" > "$work/term.log" 2>&1 &
pid=$!; for _ in $(seq 300); do [ -s "$work/term/log.jsonl" ] && break; sleep 0.1; done
kill -TERM "$pid"; wait "$pid"; rc=$?
if [ "$rc" -eq 143 ] && grep -q "interrupted at step" "$work/term.log" && [ -f "$work/term/last.h5" ]; then pass=$((pass + 1)); else echo "FAIL SIGTERM: rc=$rc (want 143)"; tail -3 "$work/term.log"; fails=$((fails + 1)); fi
# One process per output folder: a second train or ablate on a folder a run holds refuses,
# naming its pid; once that run is killed (-9: it cleans nothing up) the folder is free, and
# the next run removes the checkpoint temporary a kill while saving would leave.
"$KVLAB" train "${long[@]}" --eval-iters 20000 --out "$work/held" > "$work/held.log" 2>&1 &
pid=$!; for _ in $(seq 300); do grep -q "from scratch" "$work/held.log" && break; sleep 0.1; done
check "a second train on a held folder" 1 "output folder $work/held is in use by another kvlab process (pid $pid)" -- "$KVLAB" train "${long[@]}" --eval-iters 20000 --out "$work/held"
check "ablate on a held folder" 1 "ablate: output folder $work/held is in use by another kvlab process (pid $pid)" -- "$KVLAB" ablate --corpus "$work/corpus.txt" "${ab[@]}" --out "$work/held"
kill -9 "$pid"; wait "$pid" 2>/dev/null
echo "half a checkpoint" > "$work/held/last.h5.tmp-$pid"
check "a killed run leaves no lock" 0 "removed last.h5.tmp-$pid, a checkpoint that a killed run was writing" -- "$KVLAB" train "${tiny[@]}" --out "$work/held"
check "the temporary is gone" 2 "No such file" -- ls "$work/held/last.h5.tmp-$pid"
# ablate --kv-heads: each item an integer in [1, n_head] dividing it, listed once.
for kv in 0 -2 16; do check "ablate --kv-heads $kv" 2 "--kv-heads: n_kv_head = $kv must be in [1, 4]" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads "$kv" --out "$work/ab"; done
check "ablate --kv-heads ''" 2 "the list is empty" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads "" --out "$work/ab"
check "ablate --kv-heads ," 2 "item 1 is empty" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads , --out "$work/ab"
check "ablate --kv-heads 4,4" 2 "--kv-heads: n_kv_head = 4 is listed twice" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads 4,4 --out "$work/ab"
check "ablate --kv-heads 4,,2" 2 "item 2 is empty" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads 4,,2 --out "$work/ab"
# ablate --weight-dtypes: known matrix types, each once, or none; checked before anything trains.
check "ablate --weight-dtypes bf16,q5_0" 2 "--weight-dtypes: 'q5_0' is not a weight dtype (f32, bf16, q8_0, q4_0)" -- "$KVLAB" ablate "${tiny[@]}" --weight-dtypes bf16,q5_0 --out "$work/ab-w"
check "ablate --weight-dtypes ''" 2 "--weight-dtypes: the list is empty" -- "$KVLAB" ablate "${tiny[@]}" --weight-dtypes "" --out "$work/ab-w"
check "ablate --help: --weight-dtypes none" 0 "q4_0, or none to measure none" -- "$KVLAB" ablate --help
check "ablate --weight-dtypes q8_0,q8_0" 2 "--weight-dtypes: q8_0 is listed twice" -- "$KVLAB" ablate "${tiny[@]}" --weight-dtypes q8_0,q8_0 --out "$work/ab-w"
# ablate --uptrain F: a fraction in (0, 1] of the sweep's steps, over a sweep holding MHA and a
# smaller n_kv_head; checked before anything trains.
check "ablate --help says what --uptrain does" 0 "converted to every smaller n_kv_head" -- "$KVLAB" ablate --help
for f in 0 2 -0.5; do check "ablate --uptrain $f" 2 "--uptrain $f must be a fraction of the sweep's steps in (0, 1]" -- "$KVLAB" ablate "${tiny[@]}" --uptrain "$f" --out "$work/abu"; done
check "ablate --uptrain nan" 2 "--uptrain: 'nan' is not a finite number" -- "$KVLAB" ablate "${tiny[@]}" --uptrain nan --out "$work/abu"
check "ablate --uptrain without MHA" 2 "--uptrain converts the multi-head run (n_kv_head = n_head = 4), which the sweep does not train: add 4 to --kv-heads" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads 2,1 --uptrain 0.5 --out "$work/abu"
check "ablate --uptrain with MHA alone" 2 "--uptrain needs an n_kv_head below n_head = 4" -- "$KVLAB" ablate "${tiny[@]}" --kv-heads 4 --uptrain 0.5 --out "$work/abu"
check "ablate --uptrain-methods unknown" 2 "--uptrain-methods 'mean,avg': 'avg' is not a method" -- "$KVLAB" ablate "${tiny[@]}" --uptrain 0.5 --uptrain-methods mean,avg --out "$work/abu"
check "ablate --uptrain-methods alone" 2 "give --uptrain" -- "$KVLAB" ablate "${tiny[@]}" --uptrain-methods mean --out "$work/abu"
check "ablate --uptrain refused trains nothing" 2 "No such file" -- ls "$work/abu/runs"
# ablate --prompt is checked before anything trains.
check "ablate prompt outside vocabulary" 1 "'Z'" -- "$KVLAB" ablate --corpus "$work/corpus.txt" "${ab[@]}" --prompt Zebra --out "$work/abp"
check "ablate empty prompt" 1 "prompt is empty" -- "$KVLAB" ablate --corpus "$work/corpus.txt" "${ab[@]}" --prompt "" --out "$work/abp"
check "ablate trained nothing for a bad prompt" 2 "No such file" -- ls "$work/abp/runs"
# scripts/ablate.sh: --help does nothing else; an existing build/ keeps its generator (stubs
# stand in for setup.sh, cmake and kvlab).
root=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$work/sh/scripts" "$work/sh/build/apps" "$work/sh/bin"
cp "$root/scripts/ablate.sh" "$work/sh/scripts/"
printf '#!/bin/sh\necho setup >> "%s"\n' "$work/sh/cmake.log" > "$work/sh/scripts/setup.sh"
printf 'CMAKE_GENERATOR:INTERNAL=Unix Makefiles\n' > "$work/sh/build/CMakeCache.txt"
printf '#!/bin/sh\necho "cmake $*" >> "%s"\n' "$work/sh/cmake.log" > "$work/sh/bin/cmake"
printf '#!/bin/sh\necho "kvlab $*"\n' > "$work/sh/build/apps/kvlab"
chmod +x "$work/sh/scripts/setup.sh" "$work/sh/bin/cmake" "$work/sh/build/apps/kvlab"
check "ablate.sh --help" 0 "kvlab ablate --help" -- env PATH="$work/sh/bin:$PATH" bash "$work/sh/scripts/ablate.sh" --help
check "ablate.sh --help sets up and builds nothing" 2 "No such file" -- ls "$work/sh/cmake.log"
check "ablate.sh in a configured checkout" 0 "kvlab ablate --out out/ablate --quick" -- env PATH="$work/sh/bin:$PATH" bash "$work/sh/scripts/ablate.sh" --quick
check "ablate.sh names no generator for an existing build/" 1 "" -- grep -q -- "-G" "$work/sh/cmake.log"
check "ablate.sh passes the user's --out alone" 0 "kvlab ablate --quick --out mine" -- env PATH="$work/sh/bin:$PATH" bash "$work/sh/scripts/ablate.sh" --quick --out mine
check "unknown command" 2 "unknown command 'nosuch' (commands: train, generate" -- "$KVLAB" nosuch
check "no command" 2 "'kvlab' needs a command (commands: train, generate" -- "$KVLAB"
check "unknown bench command" 2 "unknown command 'nosuch' for 'kvlab bench' (commands: generate, kv-memory, serve, kv-quality, weight-quality)" -- "$KVLAB" bench nosuch
check "bench without its command" 2 "'kvlab bench' needs a command (commands: generate, kv-memory, serve, kv-quality, weight-quality)" -- "$KVLAB" bench
check "bench --help" 0 "Usage: kvlab bench" -- "$KVLAB" bench --help
check "unexpected arguments in order" 2 "unexpected arguments: foo bar baz" -- "$KVLAB" train foo bar baz
check "help is printed" 0 "--kv-heads" -- "$KVLAB" ablate --help
# kvlab report rewrites an ablation's report from its results.json alone.
check "report of a missing file" 2 "report: cannot read $work/none.json" -- "$KVLAB" report "$work/none.json"
echo '{"variants": [' > "$work/cut.json"
check "report of a cut file" 2 "is not JSON" -- "$KVLAB" report "$work/cut.json"
echo '{"variants": []}' > "$work/empty.json"
check "report without variants" 1 "report: " -- "$KVLAB" report "$work/empty.json" --out "$work/empty-report"

echo "cli: $pass passed, $fails failed"
[ "$fails" -eq 0 ]
