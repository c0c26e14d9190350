#!/usr/bin/env bash
# Seeded byte mutations of a real checkpoint, given to the three commands that read one
# (inspect, generate, train --resume): each must end in an answer or a one-line error, never a
# signal or a sanitizer report. A mutant of a file kvlab wrote is always refused (its digest);
# one of the same file without the digest (as h5py or an older kvlab writes it) may load.
set -u
KVLAB=$1
MUTANTS=${2:-30}  # of each kind
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
pass=0
RANDOM=20261203

for i in $(seq 300); do echo "the lord is my shepherd; i shall not want $((i % 7))."; done > "$work/corpus.txt"
tiny=(--corpus "$work/corpus.txt" --n-layer 1 --n-head 4 --n-kv-head 2 --n-embd 16 --block-size 16
      --batch-size 4 --iters 4 --eval-interval 2 --eval-iters 1)
if ! "$KVLAB" train "${tiny[@]}" --out "$work/run" > "$work/train.log" 2>&1; then
  echo "FAIL could not train the checkpoint to mutate:"; tail -5 "$work/train.log"; exit 1
fi
sealed="$work/run/last.h5"
foreign="$work/foreign.h5"
tail -c +513 "$sealed" > "$foreign"  # without the 512-byte user block that holds the digest

# mutate SRC DST: 1-4 bytes of SRC changed to other random values. (Another value, not any:
# a byte set to the value it had is no mutation, and where that byte differs from run to run,
# a time in the training state, a sealed "mutant" would load.)
# The changes made are kept in `changes_made` (offset:old->new), for a failure to name.
mutate() {
  cp "$1" "$2"
  local size changes at old new
  size=$(stat -c %s "$1")
  changes=$((1 + RANDOM % 4))
  changes_made=""
  for _ in $(seq "$changes"); do
    at=$(( (RANDOM * 32768 + RANDOM) % size ))
    old=$(od -An -tu1 -j "$at" -N1 "$2")
    new=$(( old ^ (1 + RANDOM % 255) ))
    printf "\\x$(printf %02x "$new")" | dd of="$2" bs=1 seek="$at" conv=notrunc status=none
    changes_made+=" $at:$((old))->$new"
  done
}

# run KIND N CMD...: the command's exit code must be 0, 1 or 2 (1 or 2 for a kvlab file's
# mutant), with no sanitizer report.
declare -A outcomes
run() {
  local kind=$1 n=$2 out rc
  shift 2
  out=$("$@" 2>&1 < /dev/null)
  rc=$?
  outcomes["$kind rc=$rc"]=$(( ${outcomes["$kind rc=$rc"]:-0} + 1 ))
  if [ "$rc" -gt 2 ] || grep -q "Sanitizer" <<<"$out" || { [ "$kind" = sealed ] && [ "$rc" -eq 0 ]; }; then
    echo "FAIL $kind mutant $n (bytes changed:$changes_made of $(stat -c %s "$src")): rc=$rc: $*"
    echo "$out" | tail -12
    fails=$((fails + 1))
  else
    pass=$((pass + 1))
  fi
}

for kind in sealed foreign; do
  src=$sealed
  [ "$kind" = foreign ] && src=$foreign
  for n in $(seq "$MUTANTS"); do
    rm -rf "$work/resume"
    mkdir -p "$work/resume"
    mutate "$src" "$work/resume/last.h5"
    cp "$work/run/log.jsonl" "$work/resume/"
    run "$kind" "$n" "$KVLAB" inspect "$work/resume/last.h5"
    run "$kind" "$n" "$KVLAB" generate --ckpt "$work/resume/last.h5" --prompt "the" --max-new 4
    run "$kind" "$n" "$KVLAB" train "${tiny[@]}" --out "$work/resume" --resume
  done
done

for key in $(printf '%s\n' "${!outcomes[@]}" | sort | tr ' ' '_'); do
  echo "outcomes: ${key/_/ }: ${outcomes[${key/_/ }]}"
done
echo "$pass passed, $fails failed"
[ "$fails" -eq 0 ]
