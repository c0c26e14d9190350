#!/usr/bin/env bash
# End-to-end checks of `kvlab tokenizer`: train -> inspect -> encode -> decode round trips
# (files, stdin, --json, a model checkpoint's tokenizer refused where it is none), and bad
# input that must give a one-line error and the documented exit code (2 usage, 1 runtime).
set -u
KVLAB=$1
# shellcheck source=check.sh
. "$(dirname "$0")/check.sh"

for i in $(seq 300); do echo "the lord is my shepherd; i shall not want $((i * 37)). Don't!"; done > "$work/corpus.txt"
printf 'h\xc3\xa9llo \xff\xfe w\xe2\x82orld\n' > "$work/odd.txt"
: > "$work/empty.txt"
echo "not an hdf5 file" > "$work/fake.h5"
tok=$work/tok.h5

check "train" 0 "wrote $tok: bpe, pattern kvlab, 300 tokens (256 bytes, 43 merges, 1 special)" -- \
  "$KVLAB" tokenizer train --corpus "$work/corpus.txt" --vocab-size 300 --out "$tok"
check "inspect" 0 "special: 299 <|endoftext|>" -- "$KVLAB" tokenizer inspect --tokenizer "$tok"
check "kvlab inspect counts a bpe vocabulary's tokens" 0 "tokenizer: bpe, 300 symbols" -- \
  "$KVLAB" inspect "$tok"
check "inspect --json" 0 '"pattern": "kvlab"' -- "$KVLAB" tokenizer inspect --tokenizer "$tok" --json
for input in corpus.txt odd.txt empty.txt; do
  "$KVLAB" tokenizer encode --tokenizer "$tok" "$work/$input" > "$work/ids.txt" &&
    "$KVLAB" tokenizer decode --tokenizer "$tok" "$work/ids.txt" > "$work/back.txt"
  check "round trip of $input" 0 "" -- cmp "$work/$input" "$work/back.txt"
done
# stdin in, a JSON array out, and back in through stdin.
"$KVLAB" tokenizer encode --tokenizer "$tok" --json < "$work/odd.txt" > "$work/ids.json"
check "encode --json is an array" 0 "[" -- head -c 1 "$work/ids.json"
"$KVLAB" tokenizer decode --tokenizer "$tok" < "$work/ids.json" > "$work/back.txt"
check "round trip through stdin and JSON" 0 "" -- cmp "$work/odd.txt" "$work/back.txt"

# The h5py example of docs/checkpoint-format.md reads the file and gives kvlab's ids.
python=""
for p in /usr/bin/python3 python3; do
  if "$p" -c 'import h5py, regex' 2>/dev/null; then python=$p; break; fi
done
if [ -n "$python" ]; then
  awk '/^```python$/ {on = 1; block = ""; next}
       /^```$/ {if (on && block ~ /def load_bpe/) printf "%s", block; on = 0; next}
       on {block = block $0 "\n"}' "$(dirname "$0")/../../../docs/checkpoint-format.md" > "$work/example.py"
  cat >> "$work/example.py" <<'PY'
import json, sys
print(json.dumps(encode(open(sys.argv[1], encoding="utf-8").read(), bpe), separators=(",", ":")))
PY
  "$KVLAB" tokenizer encode --tokenizer "$tok" --json "$work/corpus.txt" > "$work/kvlab_ids.json"
  check "the documented h5py example gives kvlab's ids" 0 "$(cat "$work/kvlab_ids.json")" -- \
    bash -c "cd '$work' && '$python' example.py corpus.txt"
else
  echo "skip: the h5py example of docs/checkpoint-format.md (no python3 with h5py and regex)"
fi

# kvlab train learns the vocabulary from the corpus's training split; the model's vocabulary
# is --vocab-size, and inspect turns its val loss into bits per byte.
bpe_run=(--corpus "$work/corpus.txt" --tokenizer bpe --vocab-size 290 --n-layer 1 --n-head 2
         --n-embd 16 --block-size 16 --batch-size 4 --iters 6 --eval-interval 3 --eval-iters 2)
check "train --tokenizer bpe" 0 "bits per byte" -- "$KVLAB" train "${bpe_run[@]}" --out "$work/run"
check "its checkpoint holds the vocabulary" 0 "tokenizer: bpe, 290 symbols" -- "$KVLAB" inspect "$work/run/final.h5"
check "inspect gives bits per byte" 0 "bits per byte" -- "$KVLAB" inspect "$work/run/final.h5"
check "the log gives bits per byte" 0 '"val_bpb":' -- cat "$work/run/log.jsonl"
check "the vocabulary is cached beside the corpus" 0 "bpe-290-kvlab-val0.1.kvlab-cache" -- ls "$work"
check "generate decodes bpe" 0 "" -- "$KVLAB" generate --ckpt "$work/run/final.h5" --prompt "the lord" --max-new 8
check "import --gguf: an export's vocabulary" 0 "pattern kvlab, 290 tokens" -- bash -c \
  '"$0" export --ckpt "$1" --out "$2" >/dev/null && "$0" tokenizer import --gguf "$2" --out "$3"' \
  "$KVLAB" "$work/run/final.h5" "$work/run.gguf" "$work/run_tok.h5"
check "import --gguf: the same ids as the run's tokenizer" 0 "same" -- bash -c \
  '[ "$("$0" tokenizer encode --tokenizer "$1" "$3")" = "$("$0" tokenizer encode --tokenizer "$2" "$3")" ] && echo same' \
  "$KVLAB" "$work/run/final.h5" "$work/run_tok.h5" "$work/corpus.txt"
check "--vocab-size without bpe" 2 "--vocab-size is for --tokenizer bpe" -- \
  "$KVLAB" train --corpus "$work/corpus.txt" --vocab-size 300 --iters 1 --out "$work/run2"
check "bpe without --vocab-size" 2 "--tokenizer bpe needs --vocab-size N of at least 257" -- \
  "$KVLAB" train --corpus "$work/corpus.txt" --tokenizer bpe --iters 1 --out "$work/run2"

check "vocab size too small" 2 "--vocab-size 100 is below the 256 bytes plus <|endoftext|>" -- \
  "$KVLAB" tokenizer train --corpus "$work/corpus.txt" --vocab-size 100 --out "$work/x.h5"
check "empty corpus" 1 "the corpus is empty" -- \
  "$KVLAB" tokenizer train --corpus "$work/empty.txt" --vocab-size 300 --out "$work/x.h5"
check "corpus too small for the vocab" 1 "supports a vocab size of at most" -- \
  "$KVLAB" tokenizer train --corpus "$work/odd.txt" --vocab-size 5000 --out "$work/x.h5"
check "missing corpus" 1 "cannot read $work/nosuch.txt" -- \
  "$KVLAB" tokenizer train --corpus "$work/nosuch.txt" --vocab-size 300 --out "$work/x.h5"
check "unknown pattern" 2 "--pattern" -- \
  "$KVLAB" tokenizer train --corpus "$work/corpus.txt" --vocab-size 300 --pattern o200k --out "$work/x.h5"
check "not a tokenizer file" 1 "$work/fake.h5" -- "$KVLAB" tokenizer encode --tokenizer "$work/fake.h5" "$work/odd.txt"
check "bad id" 1 "decode: 'x1' is not a token id" -- \
  bash -c "echo '1 x1' | '$KVLAB' tokenizer decode --tokenizer '$tok'"
check "id out of range" 1 "token id 300 is out of range [0, 300)" -- \
  bash -c "echo '300' | '$KVLAB' tokenizer decode --tokenizer '$tok'"
check "import needs a source" 2 "takes one of --tiktoken FILE, --vocab FILE --merges FILE or --gguf FILE" -- \
  "$KVLAB" tokenizer import --out "$work/x.h5"
check "import takes one source" 2 "takes one of" -- \
  "$KVLAB" tokenizer import --gguf "$work/x.gguf" --tiktoken "$work/corpus.txt" --out "$work/x.h5"
check "import --gguf: the file names its pattern" 2 "leave --pattern out" -- \
  "$KVLAB" tokenizer import --gguf "$work/x.gguf" --pattern gpt2 --out "$work/x.h5"
check "import --gguf: not a GGUF file" 1 "not a GGUF file" -- \
  "$KVLAB" tokenizer import --gguf "$work/corpus.txt" --out "$work/x.h5"
check "import --tiktoken needs --pattern" 2 "needs --pattern" -- \
  "$KVLAB" tokenizer import --tiktoken "$work/corpus.txt" --out "$work/x.h5"
check "import a file that is no rank file" 1 "tiktoken rank file, line 1" -- \
  "$KVLAB" tokenizer import --tiktoken "$work/corpus.txt" --pattern gpt2 --out "$work/x.h5"
check "no subcommand" 2 "'kvlab tokenizer' needs a command (commands: train, import" -- "$KVLAB" tokenizer

echo "tokenizer cli: $pass passed, $fails failed"
[ "$fails" -eq 0 ]
