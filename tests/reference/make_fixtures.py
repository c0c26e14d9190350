#!/usr/bin/python3
"""Generate the kvlab GPT reference fixtures (gpt_*.h5: GPT-2's block, the llama one, MLA).

Run from anywhere with Debian's torch:  /usr/bin/python3 tests/reference/make_fixtures.py
See README.md in this folder for the file layout.

The model is bench/torch_gpt.py's, the PyTorch restatement of the kvlab GPT that the
benchmarks' baselines use too.  Everything is float32 except the float64 self-check.
"""
import argparse
import math
import os
import sys

import h5py
import numpy as np
import torch
import torch.nn.functional as F


# The model is the repository's one PyTorch GPT (bench/torch_gpt.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from torch_gpt import ARCHS, GPT  # noqa: E402


def make_adamw(model, lr, betas, eps, weight_decay):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps, foreach=False)


# --------------------------------------------------------------------------- fixture
CFG = dict(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16, mlp_hidden=64, tied=1)
OPT = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
B, T, N_STEPS = 2, 8, 5
# With std 0.02 everywhere the attention scores are ~1e-4 and softmax is essentially
# uniform, so q/k gradients are ~1e-6 and the softmax backward is barely tested.  The
# fixture therefore draws q_proj/k_proj weights (MLA: q_proj/kv_down) with a larger std (set
# to 0.02 to get the plain benchmark init).  Only the fixture init is affected; weights are
# stored anyway.
QK_STD = 0.5
# (file, n_kv_head, seed, block): GPT-2's block, the llama preset (RoPE at theta ROPE_THETA,
# RMSNorm, SwiGLU, no biases), and the llama preset with multi-head latent attention (MLA).
VARIANTS = [("gpt_mha.h5", 4, 1234, "gpt2"), ("gpt_gqa.h5", 2, 1235, "gpt2"),
            ("gpt_mqa.h5", 1, 1236, "gpt2"), ("gpt_llama_mha.h5", 4, 1237, "llama"),
            ("gpt_llama_gqa.h5", 2, 1238, "llama"), ("gpt_llama_mqa.h5", 1, 1239, "llama"),
            ("gpt_mla.h5", 4, 1240, "mla"), ("gpt_mla_q.h5", 4, 1241, "mla_q")]
# The MLA variants' latent rank and rotary width (head size 4); mla_q also compresses queries.
MLA = dict(attn="mla", kv_lora_rank=8, rope_head_dim=4)
MLA_Q = dict(MLA, q_lora_rank=6)
# Small, so that the 8 positions of the fixture turn the pairs by clearly different angles.
ROPE_THETA = 100.0


def new_model(n_kv_head, arch):
    extra = {"mla": MLA, "mla_q": MLA_Q}.get(arch, {})
    return GPT(CFG["vocab_size"], CFG["block_size"], CFG["n_layer"], CFG["n_head"], n_kv_head,
               CFG["n_embd"], CFG["mlp_hidden"], tied=bool(CFG["tied"]),
               arch="gpt2" if arch == "gpt2" else "llama", rope_theta=ROPE_THETA, **extra)


def build_initial(n_kv_head, seed, arch):
    torch.manual_seed(seed)
    m = new_model(n_kv_head, arch)
    with torch.no_grad():  # randomize biases and LayerNorm params so their grads matter
        for n, p in m.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight", "kv_down.weight")):
                p.normal_(0.0, QK_STD)
            elif n.endswith(("c_fc.weight", "c_up.weight")) and arch != "gpt2":
                # SwiGLU multiplies two projections: at std 0.02 its gradients are so small
                # that AdamW's steps follow their f32 rounding (f32 and f64 finals differ).
                p.normal_(0.0, QK_STD)
            elif p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    x = torch.randint(0, CFG["vocab_size"], (B, T))
    y = torch.randint(0, CFG["vocab_size"], (B, T))
    return m, x, y


def run_reference(model, x, y):
    """Forward/backward on initial weights, then N_STEPS AdamW steps. Returns dict of numpy."""
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    out = {"initial": {n: p.detach().clone().numpy() for n, p in params.items()}}
    opt = make_adamw(model, OPT["lr"], (OPT["beta1"], OPT["beta2"]), OPT["eps"],
                     OPT["weight_decay"])
    losses, norms = [], []
    for step in range(N_STEPS):
        opt.zero_grad(set_to_none=True)
        logits = model.logits(x)
        loss = F.cross_entropy(logits.reshape(B * T, -1), y.reshape(B * T))
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().clone().numpy()
            out["grads"] = {n: params[n].grad.detach().clone().numpy() for n in names}
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                          OPT["grad_clip"])))
        opt.step()
    out["loss"] = losses[0]
    out["steps_loss"] = np.array(losses)
    out["steps_grad_norm"] = np.array(norms)
    out["final"] = {n: p.detach().clone().numpy() for n, p in params.items()}
    out["names"] = names
    return out


def rel_err(a, b, floor=1e-8):
    """max|a-b| / max|b|, with an absolute floor on the denominator's scale so that
    mathematically-zero tensors (k_proj.bias grads: softmax is shift invariant) pass."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor / 1e-4))


def self_check(ref32, model32_init_state, n_kv_head, arch, x, y, fname):
    """Recompute in float64 from the same initial weights; assert agreement."""
    m64 = new_model(n_kv_head, arch).double()
    with torch.no_grad():
        for n, p in m64.named_parameters():
            p.copy_(torch.from_numpy(model32_init_state[n]).double())
    ref64 = run_reference(m64, x, y)
    ref32["grads64"], ref32["logits64"] = ref64["grads"], ref64["logits"]
    worst = rel_err(ref32["logits"], ref64["logits"])
    assert worst < 1e-4, f"{fname}: logits f32 vs f64 rel err {worst:.3e}"
    gworst = 0.0
    for n in ref32["names"]:
        e = rel_err(ref32["grads"][n], ref64["grads"][n])
        assert e < 1e-4, f"{fname}: grad {n} f32 vs f64 rel err {e:.3e}"
        gworst = max(gworst, e)
    lworst = rel_err(ref32["steps_loss"], ref64["steps_loss"])
    assert lworst < 1e-5, f"{fname}: steps/loss f32 vs f64 rel err {lworst:.3e}"
    fworst, kb = 0.0, 0.0
    for n in ref32["names"]:
        if n.endswith("k_proj.bias"):
            # Analytically zero gradient (softmax shift invariance): the f32 grad is rounding
            # noise ~1e-9, which Adam (eps 1e-8) turns into updates up to ~lr*0.1 per step.
            # So its final value is only defined to ~N_STEPS*lr*0.1; bound the drift.
            assert np.abs(ref32["grads"][n]).max() < 1e-6, f"{fname}: {n} grad not ~0"
            kb = max(kb, float(np.abs(ref32["final"][n] - ref64["final"][n]).max()))
            assert kb < N_STEPS * OPT["lr"] * 0.1, f"{fname}: {n} final drift {kb}"
            continue
        e = rel_err(ref32["final"][n], ref64["final"][n])
        assert e < 1e-4, f"{fname}: final {n} f32 vs f64 rel err {e:.3e}"
        fworst = max(fworst, e)
    return worst, gworst, lworst, fworst, kb


def _group(parent, name):
    """Group that keeps creation (= state_dict) order and stores no timestamps, so that
    regenerating the fixtures gives byte-identical files."""
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_link_creation_order(h5py.h5p.CRT_ORDER_TRACKED | h5py.h5p.CRT_ORDER_INDEXED)
    gcpl.set_obj_track_times(False)
    return h5py.Group(h5py.h5g.create(parent.id, name.encode(), gcpl=gcpl))


def write_h5(path, n_kv_head, arch, x, y, ref):
    def put(g, name, arr, dtype):
        g.create_dataset(name, data=np.asarray(arr).astype(dtype), track_times=False)

    with h5py.File(path, "w") as f:
        for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_hidden",
                  "tied"):
            f.attrs[k] = np.int64(CFG[k])
        f.attrs["n_kv_head"] = np.int64(n_kv_head)
        if arch != "gpt2":  # the block's parts (absent: GPT-2's)
            for k, v in ARCHS["llama"].items():
                f.attrs[k] = np.int64(v) if isinstance(v, bool) else np.bytes_(v)
            f.attrs["rope_theta"] = np.float64(ROPE_THETA)
        if arch.startswith("mla"):  # the attention (absent: grouped-query)
            for k, v in (MLA_Q if arch == "mla_q" else MLA).items():
                f.attrs[k] = np.int64(v) if isinstance(v, int) else np.bytes_(v)
        for k, v in OPT.items():
            f.attrs[k] = np.float64(v)
        f.attrs["batch_size"] = np.int64(B)
        f.attrs["seq_len"] = np.int64(T)
        f.attrs["n_steps"] = np.int64(N_STEPS)
        f.attrs["param_names"] = np.bytes_(",".join(ref["names"]))  # state_dict order
        g_model, g_grads, g_final = _group(f, "model"), _group(f, "grads"), _group(f, "final")
        for n in ref["names"]:
            put(g_model, n, ref["initial"][n], np.float32)
            put(g_grads, n, ref["grads"][n], np.float32)
            put(g_final, n, ref["final"][n], np.float32)
        if "grads64" in ref:  # the float64 truth: f32 implementations are judged against it
            g_grads64 = _group(f, "grads64")
            for n in ref["names"]:
                put(g_grads64, n, ref["grads64"][n], np.float64)
            put(f, "logits64", ref["logits64"], np.float64)
        g_batch, g_steps = _group(f, "batch"), _group(f, "steps")
        put(g_batch, "x", x.numpy(), np.int32)
        put(g_batch, "y", y.numpy(), np.int32)
        put(f, "logits", ref["logits"], np.float32)
        put(f, "loss", [ref["loss"]], np.float32)  # shape (1,)
        put(g_steps, "loss", ref["steps_loss"], np.float32)
        put(g_steps, "grad_norm", ref["steps_grad_norm"], np.float32)  # pre-clip total norm


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--no-check", action="store_true", help="skip the float64 self-check")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # bitwise-stable reductions across machines/thread counts

    total = 0
    for fname, nkv, seed, arch in VARIANTS:
        model, x, y = build_initial(nkv, seed, arch)
        ref = run_reference(model, x, y)
        path = os.path.join(args.out_dir, fname)
        check = None if args.no_check else self_check(ref, ref["initial"], nkv, arch, x, y,
                                                      fname)
        write_h5(path, nkv, arch, x, y, ref)
        size = os.path.getsize(path)
        total += size
        nparams = sum(v.size for v in ref["initial"].values())
        print(f"{fname}: n_kv_head={nkv} seed={seed} params={nparams} ({len(ref['names'])} "
              f"tensors) size={size} B")
        print("  loss_0=%.6f  steps/loss=%s" % (ref["loss"],
              " ".join("%.6f" % v for v in ref["steps_loss"])))
        print("  pre-clip grad norms=%s" % " ".join("%.4f" % v for v in ref["steps_grad_norm"]))
        if check is not None:
            e = check
            print("  f64 check (max rel err): logits %.1e grads %.1e steps/loss %.1e final %.1e; "
                  "final k_proj.bias abs drift %.1e (zero-grad param, see README)" % e)
    print(f"total fixture size: {total} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
