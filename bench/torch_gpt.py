"""The kvlab GPT in PyTorch: the one reference model of the repository. The parity fixtures
(tests/reference/make_fixtures.py) and the baselines (torch_train.py, torch_decode.py,
torch_gpu.py, cross_eval.py) all build it. Same parameter names, init and math as kvlab:
pre-LayerNorm blocks, biases, tanh GELU, an LM head tied to the token table unless
tied=False, query head h reads KV head h // (n_head // n_kv_head). arch="llama" (or the
pos/norm/mlp/bias arguments one by one) gives kvlab's llama block: rotary positions (halves
form: channel j pairs with j + HS/2), RMSNorm, SwiGLU (gate c_fc, up c_up, down c_proj) and no
biases. attn="mla" (with kv_lora_rank, rope_head_dim and optionally q_lora_rank; RoPE only) swaps each block's attention
for kvlab's multi-head latent attention (LatentAttention), without a cache."""
import ctypes
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class KVCache:
    """Preallocated per-layer K and V of shape (B, NKV, S_max, HS): KV heads not repeated."""

    def __init__(self, n_layer, batch, nkv, s_max, hs, device="cpu", dtype=torch.float32):
        self.k = [torch.zeros(batch, nkv, s_max, hs, device=device, dtype=dtype)
                  for _ in range(n_layer)]
        self.v = [torch.zeros(batch, nkv, s_max, hs, device=device, dtype=dtype)
                  for _ in range(n_layer)]
        self.len = 0  # number of valid positions


class WeightOnlyNorm(nn.Module):
    """RMSNorm, or with rms=False a LayerNorm without a bias (torch 1.13's always has one)."""

    def __init__(self, c, rms, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.rms, self.eps = rms, eps

    def forward(self, x):
        if self.rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return F.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)


def make_norm(c, norm, bias):
    if norm == "layernorm" and bias:
        return nn.LayerNorm(c, eps=1e-5)
    return WeightOnlyNorm(c, rms=norm == "rmsnorm")


def rope(x, start, theta):
    """x (B, T, H, HS) at positions start..start+T-1, turned by position: channel pair
    (j, j + HS/2) by p * theta^(-2j/HS). The angles' cos and sin in float64, as kvlab's table."""
    T, hs = x.shape[1], x.shape[3]
    half = hs // 2
    p = torch.arange(start, start + T, dtype=torch.float64)[:, None]
    a = p * theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / hs)
    cos, sin = a.cos().to(x.dtype)[None, :, None], a.sin().to(x.dtype)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c, nh, nkv, bias=True, rope_theta=None):
        super().__init__()
        assert c % nh == 0 and nh % nkv == 0
        self.nh, self.nkv, self.hs = nh, nkv, c // nh
        self.rope_theta = rope_theta  # None: learned positions, added by the GPT
        self.q_proj = nn.Linear(c, c, bias=bias)
        self.k_proj = nn.Linear(c, nkv * self.hs, bias=bias)
        self.v_proj = nn.Linear(c, nkv * self.hs, bias=bias)
        self.c_proj = nn.Linear(c, c, bias=bias)

    def forward(self, x, kc=None, vc=None, start=0):
        """x: (B, T, C) at positions start..start+T-1. With kc/vc (B, NKV, S_max, HS) the new
        K/V are written there and attention reads the cache; without, it reads them directly."""
        B, T, C = x.shape
        g = self.nh // self.nkv
        q = self.q_proj(x).view(B, T, self.nh, self.hs)
        k = self.k_proj(x).view(B, T, self.nkv, self.hs)
        if self.rope_theta is not None:  # keys are cached rotated
            q, k = rope(q, start, self.rope_theta), rope(k, start, self.rope_theta)
        q = q.view(B, T, self.nkv, g, self.hs).permute(0, 2, 3, 1, 4)
        k = k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hs).transpose(1, 2)
        S = start + T
        if kc is not None:
            kc[:, :, start:S] = k
            vc[:, :, start:S] = v
            k, v = kc[:, :, :S], vc[:, :, :S]
        # Fold the g query heads that share a KV head into the row dimension, so one
        # (g*T, HS) x (HS, S) matmul per KV head reads the un-repeated K/V.
        q = q.reshape(B, self.nkv, g * T, self.hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hs))
        if T > 1:  # query t (absolute start+t) sees keys 0..start+t
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).triu(start + 1)
            att = att.view(B, self.nkv, g, T, S).masked_fill(mask, float("-inf"))
            att = att.view(B, self.nkv, g * T, S)
        y = torch.softmax(att, dim=-1) @ v  # (B, NKV, g*T, HS)
        y = y.view(B, self.nkv, g, T, self.hs)  # query head h = kv * g + j
        return self.c_proj(y.permute(0, 3, 1, 2, 4).reshape(B, T, C))


class LatentAttention(nn.Module):
    """DeepSeek-V2's multi-head latent attention, as kvlab's: each head's query is HS values and
    RD rotated ones, from x or (q_rank > 0) from q_norm(q_down(x)); kv_down gives a latent of
    `rank` (RMSNorm'd)
    and one rotary key of RD shared by every head; kv_up rebuilds each head's key (then the
    shared rotary key appended) and value from the latent; scores scaled by 1/sqrt(HS + RD)."""

    def __init__(self, c, nh, rank, rope_dim, bias, rope_theta, q_rank=0):
        super().__init__()
        self.nh, self.hs, self.rank, self.rd, self.theta = nh, c // nh, rank, rope_dim, rope_theta
        if q_rank:
            self.q_down = nn.Linear(c, q_rank, bias=bias)
            self.q_norm = WeightOnlyNorm(q_rank, rms=True)
        self.q_proj = nn.Linear(q_rank or c, nh * (self.hs + rope_dim), bias=bias)
        self.kv_down = nn.Linear(c, rank + rope_dim, bias=bias)
        self.kv_norm = WeightOnlyNorm(rank, rms=True)
        self.kv_up = nn.Linear(rank, nh * 2 * self.hs, bias=bias)
        self.c_proj = nn.Linear(c, c, bias=bias)

    def forward(self, x, kc=None, vc=None, start=0):
        assert kc is None, "MLA runs without a cache"
        B, T, C = x.shape
        nh, hs, rd = self.nh, self.hs, self.rd
        qx = self.q_norm(self.q_down(x)) if hasattr(self, "q_down") else x
        q = self.q_proj(qx).view(B, T, nh, hs + rd)
        q = torch.cat([q[..., :hs], rope(q[..., hs:], start, self.theta)], -1)
        kv = self.kv_down(x)
        latent = self.kv_norm(kv[..., :self.rank])
        k_rot = rope(kv[..., self.rank:].reshape(B, T, 1, rd), start, self.theta)
        up = self.kv_up(latent).view(B, T, nh, 2 * hs)
        k = torch.cat([up[..., :hs], k_rot.expand(B, T, nh, rd)], -1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), up[..., hs:].transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs + rd))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        y = torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1) @ v  # (B, NH, T, HS)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, c, nh, nkv, hidden, norm="layernorm", mlp="gelu", bias=True,
                 rope_theta=None, mla=None):
        super().__init__()
        self.ln_1 = make_norm(c, norm, bias)
        self.attn = (Attention(c, nh, nkv, bias, rope_theta) if mla is None else
                     LatentAttention(c, nh, *mla[:2], bias, rope_theta, *mla[2:]))
        self.ln_2 = make_norm(c, norm, bias)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(c, hidden, bias=bias)
        if mlp == "swiglu":
            self.mlp.c_up = nn.Linear(c, hidden, bias=bias)
        self.mlp.c_proj = nn.Linear(hidden, c, bias=bias)
        self.swiglu = mlp == "swiglu"

    def forward(self, x, kc=None, vc=None, start=0):
        x = x + self.attn(self.ln_1(x), kc, vc, start)
        h = self.ln_2(x)
        if self.swiglu:
            h = F.silu(self.mlp.c_fc(h)) * self.mlp.c_up(h)
        else:
            h = F.gelu(self.mlp.c_fc(h), approximate="tanh")
        return x + self.mlp.c_proj(h)


ARCHS = {"gpt2": dict(pos="learned", norm="layernorm", mlp="gelu", bias=True),
         "llama": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)}


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, nh, nkv, c, hidden, tied=True, arch="gpt2",
                 rope_theta=10000.0, attn="gqa", kv_lora_rank=0, rope_head_dim=0, q_lora_rank=0,
                 **parts):
        super().__init__()
        b = dict(ARCHS[arch], **parts)  # pos, norm, mlp, bias: the preset's unless given
        self.cfg = (n_layer, nkv, block_size, c // nh)
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(block_size, c) if b["pos"] == "learned" else None
        theta = rope_theta if b["pos"] == "rope" else None
        mla = (kv_lora_rank, rope_head_dim, q_lora_rank) if attn == "mla" else None
        assert mla is None or theta is not None, "MLA needs rotary positions"
        self.blocks = nn.ModuleList([Block(c, nh, nkv, hidden, b["norm"], b["mlp"], b["bias"],
                                           theta, mla) for _ in range(n_layer)])
        self.ln_f = make_norm(c, b["norm"], b["bias"])
        self.lm_head = None if tied else nn.Linear(c, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2 initialisation, as kvlab
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif ".ln_" in name or name.startswith("ln_f") or "_norm." in name:  # norms
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.zeros_(p)

    def new_cache(self, batch):
        n_layer, nkv, s_max, hs = self.cfg
        w = self.wte.weight
        return KVCache(n_layer, batch, nkv, s_max, hs, w.device, w.dtype)

    def logits(self, idx, cache=None, last_only=False):
        B, T = idx.shape
        start = cache.len if cache is not None else 0
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe.weight[start:start + T]
        for i, blk in enumerate(self.blocks):
            if cache is None:
                x = blk(x)
            else:
                x = blk(x, cache.k[i], cache.v[i], start)
        if cache is not None:
            cache.len = start + T
        if last_only:
            x = x[:, -1:]
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return self.ln_f(x) @ head.t()

    def forward(self, idx, targets):
        """Mean cross-entropy of the next-token logits (training)."""
        B, T = idx.shape
        return F.cross_entropy(self.logits(idx).view(B * T, -1), targets.view(B * T))


def char_corpus(path):
    """nanoGPT's character-level data: (sorted vocabulary, train ids, val ids), the first 90%
    of the text for training, as kvlab splits it."""
    text = open(path, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return chars, data[:n], data[n:]


def get_batch(src, batch, block, gen):
    """`batch` random windows of `block` tokens and their next-token targets."""
    ix = torch.randint(len(src) - block - 1, (batch,), generator=gen)
    x = torch.stack([src[i:i + block] for i in ix.tolist()])
    y = torch.stack([src[i + 1:i + 1 + block] for i in ix.tolist()])
    return x, y


def fixed_val_loss(model, val_data, batch, block, n_batches, seed=4242):
    """Mean loss over n_batches validation batches drawn from a generator seeded with `seed`:
    the same windows for every model evaluated with the same arguments."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    with torch.no_grad():
        for _ in range(n_batches):
            total += model(*get_batch(val_data, batch, block, gen)).item()
    return total / n_batches


def blas_kernels():
    """The kernels of the OpenBLAS torch calls (its BLAS is a wrapper over libopenblas.so.0), as
    kvlab --version names its own; None where torch's BLAS is another library."""
    try:
        corename = ctypes.CDLL("libopenblas.so.0").openblas_get_corename
    except (OSError, AttributeError):
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode()
