"""PyTorch on the same GPU as kvlab's bench_cuda, same model (bench/torch_gpt.py), same
configs: training tokens/s in f32 eager, bf16 autocast eager and bf16 torch.compile (where it
compiles), and cached greedy decode tokens/s at batch 1 and 64. Run by scripts/gpu-check.sh;
prints a table and writes JSON."""
import argparse
import json
import time

import torch

from torch_gpt import GPT

# torch.compile takes a minute per model: it runs for the first GPT-2-small config and the
# shakespeare one only, so the whole script stays within the GPU check's budget.
COMPILED = {"gpt2-small NKV 12", "shakespeare 6/6/384"}
CONFIGS = [  # name, n_layer, n_head, n_kv_head, n_embd, block, vocab, batch
    ("gpt2-small NKV 12", 12, 12, 12, 768, 1024, 50304, 8),
    ("gpt2-small NKV 4", 12, 12, 4, 768, 1024, 50304, 8),
    ("gpt2-small NKV 1", 12, 12, 1, 768, 1024, 50304, 8),
    ("shakespeare 6/6/384", 6, 6, 6, 384, 256, 65, 64),
]


def step_time(model, opt, vocab, B, T, mode, warmup, steps):
    fwd = torch.compile(model) if mode == "bf16 compile" else model
    times = []
    for i in range(warmup + steps):
        x = torch.randint(0, vocab, (B, T), device="cuda")
        y = torch.randint(0, vocab, (B, T), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode != "f32"):
            loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


@torch.no_grad()
def decode_tokens_per_s(model, batch, new_tokens=128, prompt=16):
    vocab = model.wte.weight.shape[0]
    idx = torch.randint(0, vocab, (batch, prompt), device="cuda")
    for measured in (False, True):
        cache = model.new_cache(batch)
        tok = model.logits(idx, cache, last_only=True).argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            tok = model.logits(tok, cache, last_only=True).argmax(-1)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return batch * (new_tokens - 1) / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # plain FP32, as kvlab's f32 path
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "train": [],
           "decode": []}
    print(f"PyTorch {torch.__version__} on {out['device']}")
    print(f"{'config':22} {'mode':14} {'tokens/s':>10} {'step ms':>9}")
    def save():  # after every row: a timeout keeps what was measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

    for name, L, nh, nkv, c, T, V, B in CONFIGS:
        modes = ("f32", "bf16 eager") + (("bf16 compile",) if name in COMPILED else ())
        for mode in modes:
            model = GPT(V, T, L, nh, nkv, c, 4 * c).cuda()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)
            try:
                s = step_time(model, opt, V, B, T, mode, args.warmup, args.steps)
            except Exception as e:  # torch.compile may be unavailable on the machine
                print(f"{name:22} {mode:14} {'failed':>10}  ({type(e).__name__})")
                continue
            out["train"].append({"config": name, "mode": mode, "tokens_per_s": B * T / s,
                                 "step_ms": s * 1e3})
            print(f"{name:22} {mode:14} {B * T / s:10.0f} {s * 1e3:9.1f}", flush=True)
            save()
            del model, opt
            torch.cuda.empty_cache()
    for nkv in (12, 4, 1):
        model = GPT(50304, 1024, 12, 12, nkv, 768, 3072).cuda().eval()
        for batch in (1, 64):
            tps = decode_tokens_per_s(model, batch)
            out["decode"].append({"n_kv_head": nkv, "batch": batch, "tokens_per_s": tps})
            print(f"decode NKV {nkv:2d} batch {batch:2d}: {tps:10.0f} tokens/s (f32 eager)",
                  flush=True)
            save()


if __name__ == "__main__":
    main()
