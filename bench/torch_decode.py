#!/usr/bin/python3
"""PyTorch eager CPU decode-with-KV-cache baseline for the kvlab GPT (float32, or with
--dtype bf16 the whole model and cache in bfloat16: PyTorch's linear takes one dtype for
weights and activations, so it has no f32-activation, bf16-weight form).

For each n_kv_head in --n-kv-heads: random weights, --batch random prompts of --prompt-len
tokens are prefilled together, then --new-tokens tokens per row are generated greedily one
step at a time (tokens/s counts every row's tokens).  Each layer owns
a preallocated cache of shape (B, n_kv_head, block_size, head_size) for K and for V (the
KV heads are NOT repeated in the cache; the grouped query heads are matched to their KV
head at compute time by folding them into the matmul rows).  One warm-up run is discarded and the
median of --runs runs is reported; decode time excludes the prefill.

    /usr/bin/python3 bench/torch_decode.py --threads 2 --json decode.json
"""
import os

os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # must precede the torch import

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_gpt import GPT, blas_kernels  # noqa: E402  (bench/torch_gpt.py)


@torch.no_grad()
def generate(model, prompt, n_new):
    """Returns (tokens, prefill_s, decode_s, last_logits)."""
    cache = model.new_cache(prompt.shape[0])
    t0 = time.perf_counter()
    logits = model.logits(prompt, cache, last_only=True)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    t1 = time.perf_counter()
    out = [nxt]
    for _ in range(n_new - 1):  # the first new token came from the prefill
        logits = model.logits(nxt, cache, last_only=True)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
    t2 = time.perf_counter()
    return torch.cat([prompt] + out, dim=1), t1 - t0, t2 - t1, logits[:, -1]


@torch.no_grad()
def reference_logits(model, tokens):
    """Plain cache-free causal forward (GQA via repeat_interleave): last-position logits."""
    B, T = tokens.shape
    x = model.wte(tokens) + model.wpe.weight[:T]
    for blk in model.blocks:
        a = blk.attn
        h = blk.ln_1(x)
        q = a.q_proj(h).view(B, T, a.nh, a.hs).transpose(1, 2)
        k = a.k_proj(h).view(B, T, a.nkv, a.hs).transpose(1, 2)
        v = a.v_proj(h).view(B, T, a.nkv, a.hs).transpose(1, 2)
        k = k.repeat_interleave(a.nh // a.nkv, dim=1)  # query head h -> KV head h // g
        v = v.repeat_interleave(a.nh // a.nkv, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(a.hs)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = (torch.softmax(att, -1) @ v).transpose(1, 2).reshape(B, T, -1)
        x = x + a.c_proj(y)
        x = x + blk.mlp.c_proj(F.gelu(blk.mlp.c_fc(blk.ln_2(x)), approximate="tanh"))
    return (model.ln_f(x) @ model.wte.weight.t())[:, -1]


def check_against_full(model, tokens, last_logits, tol):
    """The cached decode must equal a plain full-sequence causal forward."""
    ref = reference_logits(model, tokens[:, :-1]).float()
    err = (ref - last_logits.float()).abs().max().item() / ref.abs().max().item()
    assert err < tol, f"KV-cache decode disagrees with full forward: rel err {err:.2e}"
    return err


def main():
    ap = argparse.ArgumentParser(description="PyTorch eager CPU KV-cache decode baseline")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-kv-heads", default="8,4,2,1", help="comma-separated list")
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--mlp-hidden", type=int, default=0, help="0 = 4*n_embd")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--no-check", action="store_true", help="skip the full-forward check")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="of the weights, activations and cache")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    assert args.prompt_len + args.new_tokens <= args.block_size, "exceeds block_size"
    hidden = args.mlp_hidden or 4 * args.n_embd
    results = []
    for nkv in [int(s) for s in args.n_kv_heads.split(",") if s]:
        torch.manual_seed(args.seed)
        model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, nkv, args.n_embd,
                    hidden).eval()
        if args.dtype == "bf16":
            model = model.to(torch.bfloat16)
        prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_len))
        tokens, _, _, last = generate(model, prompt, args.new_tokens)  # warm-up, discarded
        tol = 1e-4 if args.dtype == "f32" else 3e-2  # bf16: 8 bits of mantissa, other orders
        err = None if args.no_check else check_against_full(model, tokens, last, tol)
        pre, dec = [], []
        for _ in range(args.runs):
            toks, p, d, _ = generate(model, prompt, args.new_tokens)
            assert torch.equal(toks, tokens)
            pre.append(p)
            dec.append(d)
        d_med = statistics.median(dec)
        n_dec = args.new_tokens - 1  # timed single-token steps
        r = {"n_kv_head": nkv, "tokens_per_s": args.batch * n_dec / d_med,
             "tpot_ms": 1e3 * d_med / n_dec, "prefill_ms": 1e3 * statistics.median(pre),
             "kv_cache_bytes": 2 * args.n_layer * args.batch * nkv * args.block_size *
             (args.n_embd // args.n_head) * (4 if args.dtype == "f32" else 2),
             "decode_s_runs": dec}
        if err is not None:
            r["check_rel_err"] = err
        results.append(r)
        print(f"n_kv_head={nkv}: {r['tokens_per_s']:.1f} tokens/s, tpot {r['tpot_ms']:.3f} ms, "
              f"prefill({args.prompt_len}) {r['prefill_ms']:.2f} ms"
              + (f", check rel err {err:.1e}" if err is not None else ""))

    out = {"results": results, "threads": args.threads, "torch_version": torch.__version__,
           "blas_kernels": blas_kernels(), "dtype": args.dtype,
           "config": dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                          mlp_hidden=hidden, block_size=args.block_size, vocab=args.vocab,
                          batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                          runs=args.runs, seed=args.seed)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
