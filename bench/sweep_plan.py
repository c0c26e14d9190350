#!/usr/bin/env python3
"""The sweep's schedule over N ranks, simulated from a finished ablation's measured run times.

Reads results.json (kvlab ablate): each run's training time is its tokens over its measured
tokens/s. Runs are replicated to --seeds per variant (each new seed taking its variant's mean
time) and handed out the way kvlab's ranks take them (apps/ablate/train_runs.cpp): the most
work (parameters x tokens) first, each to the rank that becomes free first. Prints, for each
rank count, the makespan of the training phase against the ideal (total / ranks) and the
longest single run, which no schedule can beat; rank 0's measuring phase follows either way.

  python3 bench/sweep_plan.py out/ablate/results.json --seeds 10 --ranks 1,4,16,64
"""
import argparse
import heapq
import json


def run_times(results, seeds):
    cfg = results["config"]
    tokens = cfg["iters"] * cfg["batch_size"] * cfg.get("grad_accum", 1) * cfg["block_size"]
    runs = []  # (work, seconds, label)
    for v in results["variants"]:
        times = [tokens / r["train_tokens_per_s"] for r in v["runs"]]
        mean = sum(times) / len(times)
        label = "kv%s" % v.get("n_kv_head", "mla%s" % v.get("kv_lora_rank"))
        for s in range(seeds):
            runs.append((v["params"] * tokens, times[s] if s < len(times) else mean, label))
    return runs


def makespan(runs, ranks):
    order = sorted(runs, key=lambda r: -r[0])  # stable: the plan's order among equals
    free = [(0.0, rank) for rank in range(ranks)]
    heapq.heapify(free)
    end = 0.0
    for _, seconds, _ in order:
        at, rank = heapq.heappop(free)
        heapq.heappush(free, (at + seconds, rank))
        end = max(end, at + seconds)
    return end


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--ranks", default="1,4,16,64")
    a = ap.parse_args()
    results = json.load(open(a.results))
    runs = run_times(results, a.seeds)
    total = sum(r[1] for r in runs)
    longest = max(r[1] for r in runs)
    print("%d runs (%d variants x %d seeds), %.0f s of training in all, the longest %.1f s"
          % (len(runs), len(results["variants"]), a.seeds, total, longest))
    print("%6s %12s %12s %10s" % ("ranks", "makespan s", "ideal s", "ideal/ms"))
    for n in (int(x) for x in a.ranks.split(",")):
        ms = makespan(runs, n)
        ideal = total / n
        print("%6d %12.1f %12.1f %10.3f" % (n, ms, ideal, ideal / ms))


if __name__ == "__main__":
    main()
