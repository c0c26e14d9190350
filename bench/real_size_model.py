#!/usr/bin/env python3
"""A random-weight model of a real model's shape, written by llama.cpp's own GGUF writer
(gguf-py), for timing and memory at real size (random weights give no quality answer).

usage: real_size_model.py GGUF_PY_DIR VOCAB.gguf OUT.gguf [SHAPE [DTYPE]]
SHAPE: 1b (Llama-3.2-1B's body: 16 layers, n_embd 2048, 32 heads, 8 KV heads, FFN 8192, the
default), 3b (28 layers, 3072, 24 heads, 8 KV heads, FFN 8192) or 8b (Llama-3.1-8B's: 32 layers,
4096, 32 heads, 8 KV heads, FFN 14336). DTYPE: f16 (the default) or f32 for the matrices; norms
are f32. The vocabulary's tokenizer.* keys are copied from VOCAB.gguf (one of llama.cpp's
models/ggml-vocab-*.gguf), its size sets the embedding's and head's rows. Quantise the file with
llama-quantize (tests/infer/llama_cpp/quantize.py) for the other types.
Weights N(0, 0.02), norms 1; context 2048; RoPE base 500000; untied head.
"""
import sys

import numpy as np

SHAPES = {
    "1b": (16, 2048, 32, 8, 8192),
    "3b": (28, 3072, 24, 8, 8192),
    "8b": (32, 4096, 32, 8, 14336),
}


def main():
    if len(sys.argv) not in (4, 5, 6):
        sys.exit(__doc__)
    gguf_py, vocab_path, out_path = sys.argv[1:4]
    shape = sys.argv[4] if len(sys.argv) > 4 else "1b"
    dtype = sys.argv[5] if len(sys.argv) > 5 else "f16"
    if shape not in SHAPES or dtype not in ("f16", "f32"):
        sys.exit(f"real_size_model.py: SHAPE {shape} or DTYPE {dtype} is not one of the above")
    sys.path.insert(0, gguf_py)
    import gguf

    layers, embd, heads, kv_heads, ffn = SHAPES[shape]
    head = embd // heads
    vocab = gguf.GGUFReader(vocab_path)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)

    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name(f"kvlab random {shape}")
    w.add_context_length(2048)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1 if dtype == "f16" else 0)
    for name, field in vocab.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)

    rng = np.random.default_rng(1)
    np_type = np.float16 if dtype == "f16" else np.float32

    def matrix(rows, cols):  # numpy (rows, cols) is ggml's {cols, rows}: a row per output
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np_type)

    ones = np.ones(embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", matrix(n_vocab, embd))
    for layer in range(layers):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", matrix(heads * head, embd))
        w.add_tensor(p + "attn_k.weight", matrix(kv_heads * head, embd))
        w.add_tensor(p + "attn_v.weight", matrix(kv_heads * head, embd))
        w.add_tensor(p + "attn_output.weight", matrix(embd, heads * head))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", matrix(ffn, embd))
        w.add_tensor(p + "ffn_up.weight", matrix(ffn, embd))
        w.add_tensor(p + "ffn_down.weight", matrix(embd, ffn))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", matrix(n_vocab, embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
