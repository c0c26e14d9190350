#!/usr/bin/env python3
"""A small random-weight model with a real family's vocabulary, written by llama.cpp's own
GGUF writer (gguf-py), not kvlab's: the vocabulary's tokenizer.* keys copied as they are from
one of llama.cpp's models/ggml-vocab-*.gguf files, and a `llama` block of random weights.

usage: family_model.py GGUF_PY_DIR VOCAB.gguf OUT.gguf SEED EPS [ARCH [ROPE]]
ARCH: llama (the default), or qwen2: the same block with biases on q, k and v, N(0, 0.2).
ROPE: plain (the default); linear4: rope.scaling.type linear, factor 4; llama3: the
rope_freqs tensor Llama 3.1's converter writes (factor 8, low 1, high 4, original context 8192).
The block: 2 layers, 64 channels, 4 query heads and 2 KV heads of 16, an FFN of 128, a context
of 128, RMSNorm epsilon EPS, RoPE base 500000, untied head; weights N(0, 0.4) for the
matrices (so that the next token depends on the text), 1 + N(0, 0.1) for the norms.
Exit 77 when gguf-py or numpy cannot be imported (the caller skips).
"""
import sys

try:
    import numpy as np
except ImportError as e:
    print(f"family_model.py: numpy is missing: {e}", file=sys.stderr)
    sys.exit(77)


def main():
    if len(sys.argv) not in (6, 7, 8):
        sys.exit(__doc__)
    gguf_py, vocab_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    seed, eps = int(sys.argv[4]), float(sys.argv[5])
    arch = sys.argv[6] if len(sys.argv) >= 7 else "llama"
    rope = sys.argv[7] if len(sys.argv) == 8 else "plain"
    if arch not in ("llama", "qwen2") or rope not in ("plain", "linear4", "llama3"):
        sys.exit(f"family_model.py: ARCH {arch} or ROPE {rope} is not one of the above")
    try:
        sys.path.insert(0, gguf_py)
        import gguf
    except Exception as e:  # noqa: BLE001 (any failure to import is "no peer")
        print(f"family_model.py: gguf-py not importable from {gguf_py}: {e}", file=sys.stderr)
        sys.exit(77)
    vocab = gguf.GGUFReader(vocab_path)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    layers, embd, heads, kv_heads, ffn, ctx = 2, 64, 4, 2, 128, 128
    head = embd // heads

    w = gguf.GGUFWriter(out_path, arch)
    w.add_name("kvlab family test model")
    w.add_context_length(ctx)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(eps)
    if rope == "linear4":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
    w.add_file_type(0)
    # The vocabulary's keys as the family's file holds them.
    for name, field in vocab.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)

    rng = np.random.default_rng(seed)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.4).astype(np.float32)

    def norm(n):
        return (1 + rng.standard_normal(n) * 0.1).astype(np.float32)

    # numpy shape (rows, cols) is ggml's {cols, rows}: a row per output.
    if rope == "llama3":
        # As convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors computes them.
        factor, low, high, old_ctx = 8.0, 1.0, 4.0, 8192
        freqs = 1.0 / (500000.0 ** (np.arange(0, head, 2, dtype=np.float32) / head))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        factors = []
        for f in freqs:
            wavelen = 2 * np.pi / f
            if wavelen < high_wavelen:
                factors.append(1)
            elif wavelen > low_wavelen:
                factors.append(factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    w.add_tensor("token_embd.weight", matrix(n_vocab, embd))
    for l in range(layers):
        p = f"blk.{l}."
        w.add_tensor(p + "attn_norm.weight", norm(embd))
        w.add_tensor(p + "attn_q.weight", matrix(heads * head, embd))
        w.add_tensor(p + "attn_k.weight", matrix(kv_heads * head, embd))
        w.add_tensor(p + "attn_v.weight", matrix(kv_heads * head, embd))
        if arch == "qwen2":
            for name, n in (("attn_q", heads * head), ("attn_k", kv_heads * head),
                            ("attn_v", kv_heads * head)):
                w.add_tensor(p + name + ".bias", (rng.standard_normal(n) * 0.2).astype(np.float32))
        w.add_tensor(p + "attn_output.weight", matrix(embd, heads * head))
        w.add_tensor(p + "ffn_norm.weight", norm(embd))
        w.add_tensor(p + "ffn_gate.weight", matrix(ffn, embd))
        w.add_tensor(p + "ffn_up.weight", matrix(ffn, embd))
        w.add_tensor(p + "ffn_down.weight", matrix(embd, ffn))
    w.add_tensor("output_norm.weight", norm(embd))
    w.add_tensor("output.weight", matrix(n_vocab, embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
