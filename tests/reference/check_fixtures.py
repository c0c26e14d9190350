#!/usr/bin/python3
"""Independent NumPy (float64) re-implementation of the kvlab GPT forward pass that reads
only the HDF5 fixtures and checks /logits and /loss.  It does not import torch, so it
cross-checks the PyTorch model (bench/torch_gpt.py) against the written spec.

    /usr/bin/python3 tests/reference/check_fixtures.py
"""
import math
import os
import sys

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rms_norm(x, w, eps=1e-5):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w


def rope(x, theta):
    """x (B, T, H, HS) at positions 0..T-1: pair (j, j + HS/2) turned by p theta^(-2j/HS)."""
    T, hs = x.shape[1], x.shape[3]
    a = np.arange(T)[:, None] * theta ** (-2.0 * np.arange(hs // 2) / hs)
    c, s = np.cos(a)[None, :, None], np.sin(a)[None, :, None]
    x1, x2 = x[..., :hs // 2], x[..., hs // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def forward(f):
    a = f.attrs
    L, NH, NKV, C = (int(a[k]) for k in ("n_layer", "n_head", "n_kv_head", "n_embd"))
    HS, G = C // NH, NH // NKV
    W = {k: v[()].astype(np.float64) for k, v in f["model"].items()}
    idx = f["batch/x"][()]
    B, T = idx.shape
    attr = lambda k, d: a[k].decode() if k in a else d  # the block's parts; absent: GPT-2's
    llama_rope, rms, swiglu = attr("pos", "") == "rope", attr("norm", "") == "rmsnorm", \
        attr("mlp", "") == "swiglu"
    mla = attr("attn", "gqa") == "mla"
    R, RD = (int(a["kv_lora_rank"]), int(a["rope_head_dim"])) if mla else (0, 0)
    x = W["wte.weight"][idx]
    if not llama_rope:
        x = x + W["wpe.weight"][:T][None]
    lin = lambda h, name: h @ W[name + ".weight"].T + W.get(name + ".bias", 0.0)
    norm = lambda h, name: (rms_norm(h, W[name + ".weight"]) if rms else
                            layer_norm(h, W[name + ".weight"], W.get(name + ".bias", 0.0)))
    for i in range(L):
        p = f"blocks.{i}."
        h = norm(x, p + "ln_1")
        if mla:  # per head: [HS nope, RD rotated] queries and keys, HS values
            theta = float(a["rope_theta"])
            qx = (rms_norm(lin(h, p + "attn.q_down"), W[p + "attn.q_norm.weight"])
                  if p + "attn.q_down.weight" in W else h)
            qm = lin(qx, p + "attn.q_proj").reshape(B, T, NH, HS + RD)
            q = np.concatenate([qm[..., :HS], rope(qm[..., HS:], theta)], -1)
            kv = lin(h, p + "attn.kv_down")
            lat = rms_norm(kv[..., :R], W[p + "attn.kv_norm.weight"])
            k_rot = rope(kv[..., R:].reshape(B, T, 1, RD), theta)
            up = lin(lat, p + "attn.kv_up").reshape(B, T, NH, 2 * HS)
            k = np.concatenate([up[..., :HS], np.repeat(k_rot, NH, 2)], -1)
            v = up[..., HS:]
            scale = math.sqrt(HS + RD)
        else:
            q = lin(h, p + "attn.q_proj").reshape(B, T, NH, HS)
            k = lin(h, p + "attn.k_proj").reshape(B, T, NKV, HS)
            if llama_rope:
                q, k = rope(q, float(a["rope_theta"])), rope(k, float(a["rope_theta"]))
            v = lin(h, p + "attn.v_proj").reshape(B, T, NKV, HS)
            scale = math.sqrt(HS)
        y = np.zeros((B, T, NH, HS))
        for hd in range(NH):
            kv = hd if mla else hd // G
            s = np.einsum("btd,bsd->bts", q[:, :, hd], k[:, :, kv]) / scale
            s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            y[:, :, hd] = np.einsum("bts,bsd->btd", s, v[:, :, kv])
        x = x + lin(y.reshape(B, T, C), p + "attn.c_proj")
        h = norm(x, p + "ln_2")
        if swiglu:
            g = lin(h, p + "mlp.c_fc")
            h = g / (1 + np.exp(-g)) * lin(h, p + "mlp.c_up")
        else:
            h = gelu_tanh(lin(h, p + "mlp.c_fc"))
        x = x + lin(h, p + "mlp.c_proj")
    x = norm(x, "ln_f")
    head = W["wte.weight"] if int(a["tied"]) else W["lm_head.weight"]
    logits = x @ head.T
    tgt = f["batch/y"][()]
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
    return logits, float((lse - picked).mean())


def main():
    ok = True
    for fname in ("gpt_mha.h5", "gpt_gqa.h5", "gpt_mqa.h5", "gpt_llama_mha.h5",
                  "gpt_llama_gqa.h5", "gpt_llama_mqa.h5", "gpt_mla.h5", "gpt_mla_q.h5"):
        with h5py.File(os.path.join(HERE, fname), "r") as f:
            logits, loss = forward(f)
            ref_logits, ref_loss = f["logits"][()], float(f["loss"][0])
            e = np.abs(logits - ref_logits).max() / np.abs(logits).max()
            el = abs(loss - ref_loss) / abs(loss)
            good = e < 1e-5 and el < 1e-5 and abs(float(f["steps/loss"][0]) - ref_loss) == 0
            ok &= good
            print(f"{fname}: logits rel err {e:.2e}, loss {loss:.6f} vs {ref_loss:.6f} "
                  f"(rel {el:.1e}) {'OK' if good else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
