#!/usr/bin/python3
"""PyTorch CPU eager training baseline for the kvlab GPT (same architecture, float32).

Speed run (default):   /usr/bin/python3 bench/torch_train.py --threads 2 --json out.json
Quality run:           /usr/bin/python3 bench/torch_train.py --corpus input.txt --iters 5000 \
                           --eval-full --json out.json
"""
import os

os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # must precede the torch import

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from torch_gpt import GPT, blas_kernels, char_corpus, fixed_val_loss, get_batch  # noqa: E402  (bench/torch_gpt.py)


def main():
    ap = argparse.ArgumentParser(description="PyTorch eager CPU training baseline")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-kv-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--mlp-hidden", type=int, default=0, help="0 = 4*n_embd")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup-iters", type=int, default=5,
                    help="leading iterations excluded from the timing")
    ap.add_argument("--corpus", default=None, help="text file, char-level tokenized")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--lr-warmup", type=int, default=100, help="(--eval-full) linear warmup")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--eval-full", action="store_true",
                    help="cosine schedule (warmup --lr-warmup, floor --min-lr) and final val "
                         "loss over --eval-batches fixed val batches")
    ap.add_argument("--eval-batches", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    B, T = args.batch_size, args.block_size

    vocab = args.vocab
    if args.corpus:
        chars, train_data, val_data = char_corpus(args.corpus)
        if len(chars) != vocab:
            print(f"note: corpus has {len(chars)} distinct chars; using vocab={len(chars)}")
        vocab = len(chars)
    else:
        train_data = torch.randint(0, vocab, (200_000,))
        val_data = torch.randint(0, vocab, (20_000,))

    hidden = args.mlp_hidden or 4 * args.n_embd
    model = GPT(vocab, T, args.n_layer, args.n_head, args.n_kv_head, args.n_embd, hidden)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99), eps=1e-8)

    def lr_at(it):
        if not args.eval_full:
            return args.lr
        if it < args.lr_warmup:
            return args.lr * (it + 1) / args.lr_warmup
        frac = min(1.0, (it - args.lr_warmup) / max(1, args.iters - args.lr_warmup))
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (args.lr - args.min_lr)

    gen = torch.Generator().manual_seed(args.seed)
    times, last_loss = [], float("nan")
    model.train()
    t_all = time.perf_counter()
    for it in range(args.iters):
        x, y = get_batch(train_data, B, T, gen)  # batch sampling is outside the timed region
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        last_loss = loss.item()
        dt = time.perf_counter() - t0
        if it >= args.warmup_iters:
            times.append(dt)
        if args.log_every and (it % args.log_every == 0 or it == args.iters - 1):
            print(f"iter {it:6d} loss {last_loss:.4f} lr {lr_at(it):.2e} {dt * 1e3:.1f} ms")
    wall = time.perf_counter() - t_all

    if not times:
        raise SystemExit("no timed iterations: --iters must exceed --warmup-iters")
    step_ms = 1e3 * sum(times) / len(times)
    tokens_per_s = B * T / (step_ms / 1e3)
    cfg = dict(n_layer=args.n_layer, n_head=args.n_head, n_kv_head=args.n_kv_head,
               n_embd=args.n_embd, mlp_hidden=hidden, block_size=T, batch_size=B, vocab=vocab,
               iters=args.iters, warmup_iters=args.warmup_iters, lr=args.lr,
               corpus=args.corpus, n_params=n_params)
    st = sorted(times)
    result = {"tokens_per_s": tokens_per_s, "step_ms": step_ms, "threads": args.threads,
              "step_ms_median": 1e3 * st[len(st) // 2], "step_ms_min": 1e3 * st[0],
              "torch_version": torch.__version__, "blas_kernels": blas_kernels(), "config": cfg,
              "final_train_loss": last_loss, "wall_s": wall,
              "host": platform.node(), "timed_iters": len(times)}

    if args.eval_full:
        result["val_loss"] = fixed_val_loss(model, val_data, B, T, args.eval_batches)
        result["eval_batches"] = args.eval_batches
        result["schedule"] = dict(kind="cosine", warmup=args.lr_warmup, max_lr=args.lr,
                                  min_lr=args.min_lr)

    print(f"torch {torch.__version__} threads={args.threads} params={n_params} "
          f"B={B} T={T}: {step_ms:.2f} ms/step, {tokens_per_s:.0f} tokens/s "
          f"(mean of {len(times)} iters after {args.warmup_iters} warmup; median "
          f"{1e3 * st[len(st) // 2]:.2f}, min {1e3 * st[0]:.2f} ms), "
          f"last loss {last_loss:.4f}" +
          (f", val loss {result['val_loss']:.4f}" if "val_loss" in result else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
