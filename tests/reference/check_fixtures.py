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


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def forward(f):
    a = f.attrs
    L, NH, NKV, C = (int(a[k]) for k in ("n_layer", "n_head", "n_kv_head", "n_embd"))
    HS, G = C // NH, NH // NKV
    W = {k: v[()].astype(np.float64) for k, v in f["model"].items()}
    idx = f["batch/x"][()]
    B, T = idx.shape
    x = W["wte.weight"][idx] + W["wpe.weight"][:T][None]
    lin = lambda h, name: h @ W[name + ".weight"].T + W[name + ".bias"]
    for i in range(L):
        p = f"blocks.{i}."
        h = layer_norm(x, W[p + "ln_1.weight"], W[p + "ln_1.bias"])
        q = lin(h, p + "attn.q_proj").reshape(B, T, NH, HS)
        k = lin(h, p + "attn.k_proj").reshape(B, T, NKV, HS)
        v = lin(h, p + "attn.v_proj").reshape(B, T, NKV, HS)
        y = np.zeros((B, T, NH, HS))
        for hd in range(NH):
            kv = hd // G
            s = np.einsum("btd,bsd->bts", q[:, :, hd], k[:, :, kv]) / math.sqrt(HS)
            s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            y[:, :, hd] = np.einsum("bts,bsd->btd", s, v[:, :, kv])
        x = x + lin(y.reshape(B, T, C), p + "attn.c_proj")
        h = layer_norm(x, W[p + "ln_2.weight"], W[p + "ln_2.bias"])
        x = x + lin(gelu_tanh(lin(h, p + "mlp.c_fc")), p + "mlp.c_proj")
    x = layer_norm(x, W["ln_f.weight"], W["ln_f.bias"])
    head = W["wte.weight"] if int(a["tied"]) else W["lm_head.weight"]
    logits = x @ head.T
    tgt = f["batch/y"][()]
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
    return logits, float((lse - picked).mean())


def main():
    ok = True
    for fname in ("gpt_mha.h5", "gpt_gqa.h5", "gpt_mqa.h5"):
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
