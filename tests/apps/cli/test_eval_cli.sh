#!/usr/bin/env bash
# End-to-end checks of `kvlab eval`: two tiny models trained on one corpus are compared (a
# model against itself differs by exactly 0, its JSON holds every figure), and bad input gives
# a one-line error and the documented exit code (2 usage, 1 runtime).
set -u
KVLAB=$1
# shellcheck source=check.sh
. "$(dirname "$0")/check.sh"

for i in $(seq 400); do echo "and the lord said unto moses, speak unto the children $((i * 7))."; done > "$work/corpus.txt"
: > "$work/empty.txt"
train() {  # NAME N_KV_HEAD TOKENIZER
  "$KVLAB" train --corpus "$work/corpus.txt" --tokenizer "$3" --n-layer 1 --n-head 4 --n-kv-head "$2" \
    --n-embd 32 --block-size 32 --batch-size 4 --iters 20 --eval-interval 20 --eval-iters 2 \
    --out "$work/$1" > /dev/null 2>&1
}
train mha 4 char && train mqa 1 char && train bytes 4 byte
a=$work/mha/final.h5 b=$work/mqa/final.h5

check "two models" 0 "paired difference of the mean per-token loss" -- \
  "$KVLAB" eval --ckpt "$a" "$b" --windows 16 --json "$work/e.json"
check "json: every pair" 0 '"distinguishable"' -- cat "$work/e.json"
check "json: recall by distance" 0 '"distance": 16' -- cat "$work/e.json"
check "a model against itself differs by exactly 0" 0 "$a - $a: +0.00000 [+0.00000, +0.00000] not distinguishable" -- \
  "$KVLAB" eval --ckpt "$a" "$a" --windows 8
check "the whole split" 0 "windows of 32 tokens" -- "$KVLAB" eval --ckpt "$a" --windows 0
check "other tokenizers are refused" 2 "is not $a's (char" -- "$KVLAB" eval --ckpt "$a" "$work/bytes/final.h5"
check "a window past the context" 2 "--window 33 is longer than the context of $a (block_size 32)" -- \
  "$KVLAB" eval --ckpt "$a" --window 33
check "an empty corpus" 1 "is empty" -- "$KVLAB" eval --ckpt "$a" --corpus "$work/empty.txt"
# A checkpoint of --task mqar is scored on its task's answers: 16 windows of 4 queries each.
"$KVLAB" train --task mqar --mqar-train-examples 200 --mqar-val-examples 50 --n-layer 1 \
  --n-head 4 --n-embd 32 --block-size 32 --batch-size 4 --iters 10 --eval-interval 10 \
  --eval-iters 2 --out "$work/mqar" > /dev/null 2>&1
check "a task's answers" 0 "(64 predictions a model" -- \
  "$KVLAB" eval --ckpt "$work/mqar/final.h5" --windows 16 --json "$work/m.json"
check "a task's validation examples" 0 "split of mqar(vocab=32,pairs=4,train=200,val=50,seed=0)" -- \
  "$KVLAB" eval --ckpt "$work/mqar/final.h5" --windows 16
check "json: the answers' accuracy (10 steps: below 1)" 0 '"accuracy": 0' -- cat "$work/m.json"
check "no checkpoint" 1 "no such file" -- "$KVLAB" eval --ckpt "$work/nosuch.h5"
check "bad --windows" 2 "--windows must be >= 0" -- "$KVLAB" eval --ckpt "$a" --windows -1

echo "eval cli: $pass passed, $fails failed"
[ "$fails" -eq 0 ]
