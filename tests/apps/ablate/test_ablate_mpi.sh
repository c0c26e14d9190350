#!/usr/bin/env bash
# kvlab ablate over MPI ranks on one machine: a sweep under `mpirun -np 2` and `-np 3` gives
# every run's numbers bit-identical to the serial sweep (curves, val losses, the paired
# evaluation), each run trained once; with --ranks-per-run 2 a run equals `mpirun -np 2 kvlab
# train` of it; a rank killed mid-sweep fails the job, and the rerun
# names the rank that left its run, reuses every finished run and trains only the rest.
# Exits 77 (skipped) without mpirun.
set -u
KVLAB=$1
MPIRUN=${2:-mpirun}
command -v "$MPIRUN" >/dev/null || { echo "mpirun not found: skipped"; exit 77; }
# shellcheck source=../cli/check.sh
. "$(dirname "$0")/../cli/check.sh"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=("$MPIRUN" --oversubscribe --bind-to none)

for i in $(seq 300); do echo "the lord is my shepherd; i shall not want $((i * 37)). Selah!"; done > "$work/corpus.txt"
common=(ablate --corpus "$work/corpus.txt" --n-layer 1 --n-head 4 --n-embd 32 --block-size 32
        --batch-size 4 --eval-iters 2 --bench-runs 1 --kv-dtypes none --weight-dtypes none
        --sample-tokens 8)
sweep=("${common[@]}" --iters 20 --eval-interval 10 --seeds 1)

# The numbers of every run, and how many runs the sweep trained (python3 reads both files).
same_numbers() {
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
runs = lambda r: [(v.get("n_kv_head"), run["seed"], run["val_loss"], run["curve"])
                  for v in r["variants"] for run in v["runs"]]
assert runs(a) == runs(b), "the runs' numbers differ"
assert a["generation_quality"] == b["generation_quality"], "the paired evaluation differs"
assert a["sweep"]["steps_trained"] == b["sweep"]["steps_trained"], (a["sweep"], b["sweep"])
print("identical:", len(runs(a)), "runs;", b["sweep"])
PY
}

check "serial sweep" 0 "sweep wall time" -- "$KVLAB" "${sweep[@]}" --out "$work/serial"
for np in 2 3; do
  check "-np $np sweep" 0 "sweep wall time" -- "${mpi[@]}" -np "$np" "$KVLAB" "${sweep[@]}" --out "$work/np$np"
  check "-np $np: every run's numbers are the serial sweep's" 0 "identical: 3 runs" -- \
    same_numbers "$work/serial/results.json" "$work/np$np/results.json"
  check "-np $np: results record the ranks" 0 "'ranks': $np" -- \
    same_numbers "$work/serial/results.json" "$work/np$np/results.json"
done
check "the report names the ranks" 0 "3 MPI ranks" -- cat "$work/np3/report.md"
check "each run claimed once" 0 "3" -- bash -c "ls $work/np3/runs/*/.claim | wc -l"

# --ranks-per-run 2: each run data-parallel over both ranks, each on half the batch, the same
# numbers as `mpirun -np 2 kvlab train` of that run (the serial sweep's differ: another sampler
# stream per rank, and another order of the gradient sums).
check "-np 2 --ranks-per-run 2 sweep" 0 "sweep wall time" -- \
  "${mpi[@]}" -np 2 "$KVLAB" "${sweep[@]}" --ranks-per-run 2 --out "$work/np2x2"
check "--ranks-per-run 2: every run trained by both ranks" 0 "3 runs on 2 ranks" -- python3 -c "
import glob, json
claims = [json.load(open(f)) for f in glob.glob('$work/np2x2/runs/*/.claim')]
assert len(claims) == 3 and all(c['ranks_per_run'] == 2 for c in claims), claims
print(len(claims), 'runs on 2 ranks')"
check "--ranks-per-run 2: a run equals mpirun -np 2 kvlab train" 0 "same val losses" -- bash -c "
  ${mpi[*]} -np 2 $KVLAB train --corpus $work/corpus.txt --n-layer 1 --n-head 4 --n-kv-head 2 \
    --n-embd 32 --block-size 32 --batch-size 2 --eval-iters 2 --iters 20 --eval-interval 10 \
    --warmup 50 --out $work/dp2 > $work/dp2.log 2>&1 || { tail -5 $work/dp2.log; exit 1; }
  python3 - $work/dp2/log.jsonl $work/np2x2/runs/*kv2*/log.jsonl <<'PY'
import json, sys
val = lambda f: [json.loads(l)['val_loss'] for l in open(f) if 'val_loss' in json.loads(l)]
a, b = val(sys.argv[1]), val(sys.argv[2])
assert a and a == b, (a, b)
print('same val losses:', a)
PY"
check "--ranks-per-run 3 on 2 ranks is an error" 2 "does not divide" -- \
  "${mpi[@]}" -np 2 "$KVLAB" "${sweep[@]}" --ranks-per-run 3 --out "$work/np2x3"
check "--ranks-per-run without mpirun is an error" 2 "needs ranks" -- \
  "$KVLAB" "${sweep[@]}" --ranks-per-run 2 --out "$work/np1x2"

# A rank killed while it trains: the job fails; the rerun finishes the sweep.
long=("${common[@]}" --iters 4000 --eval-interval 400 --kv-heads 4,2 --seeds 1)
"${mpi[@]}" -np 2 "$KVLAB" "${long[@]}" --out "$work/killed" > "$work/killed.log" 2>&1 &
job=$!
victim=
for _ in $(seq 300); do  # up to 30 s for rank 1 to claim a run and save a checkpoint
  for claim in "$work"/killed/runs/*/.claim; do
    if grep -q '"rank":1' "$claim" 2>/dev/null && [ -f "$(dirname "$claim")/last.h5" ]; then
      victim=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$claim")
    fi
  done
  [ -n "$victim" ] && break
  sleep 0.1
done
[ -n "$victim" ] && kill -9 "$victim"
wait "$job"
rc=$?
check "a killed rank fails the sweep" 0 "rank 1" -- bash -c "[ $rc -ne 0 ] && [ -n '$victim' ] && cat $work/killed.log"
# (Rank 0, done with its own run, may take the dead rank's run over before mpirun kills it
# too: the rerun then names rank 0.)
check "the rerun names the rank that left the run" 0 "left unfinished by rank " -- \
  "${mpi[@]}" -np 2 "$KVLAB" "${long[@]}" --out "$work/killed"
check "the rerun trained only what was left" 0 "resumed from checkpoints" -- python3 -c "
import json; s = json.load(open('$work/killed/results.json'))['sweep']
assert s['resumed'] >= 1 and s['resumed'] + s['reused'] == 2 and s['steps_trained'] < 2 * 4000, s
print('resumed from checkpoints:', s)"

echo "ablate over mpi: $pass passed, $fails failed"
[ "$fails" -eq 0 ]
