#!/usr/bin/env python3
"""llama.cpp's own code as the peer for kvlab's block formats:

  ggml_reference.py dequantize GGUF_PY_DIR TYPE BLOCKS_FILE VALUES_FILE
      gguf-py's numpy reference (quants.py) dequantises a file of blocks, writing f32 values;
  ggml_reference.py quantize LIBGGML_BASE TYPE ROW_LENGTH VALUES_FILE BLOCKS_FILE
      ggml's ggml_quantize_chunk (the function llama-quantize calls, without an importance
      matrix: the reference quantisers), from node-llama-cpp's prebuilt libggml-base.so,
      quantises rows of f32 values.

TYPE is a ggml type name as gguf-py spells it (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, ...). Exit 77
when the peer cannot be loaded (the caller skips).
"""
import ctypes
import sys

try:
    import numpy as np
except ImportError as e:
    print(f"ggml_reference: numpy is missing: {e}", file=sys.stderr)
    sys.exit(77)

# ggml.h's enum ggml_type, for the types compared here.
GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12,
              "Q5_K": 13, "Q6_K": 14, "Q8_K": 15}


def dequantize(gguf_py, type_name, blocks_file, values_file):
    try:
        sys.path.insert(0, gguf_py)
        from gguf import quants
        from gguf.constants import GGMLQuantizationType, GGML_QUANT_SIZES
    except Exception as e:  # noqa: BLE001 (any failure to import is "no peer")
        print(f"ggml_reference: gguf-py not importable from {gguf_py}: {e}", file=sys.stderr)
        sys.exit(77)
    qtype = GGMLQuantizationType[type_name]
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    data = np.fromfile(blocks_file, dtype=np.uint8)
    if data.size % block_bytes != 0:
        sys.exit(f"ggml_reference: {data.size} bytes are not whole {block_bytes}-byte blocks")
    values = quants.dequantize(data.reshape(-1, block_bytes), qtype).astype(np.float32)
    values.reshape(-1).tofile(values_file)


def quantize(lib_path, type_name, row_length, values_file, blocks_file):
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as e:
        print(f"ggml_reference: cannot load {lib_path}: {e}", file=sys.stderr)
        sys.exit(77)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    t = GGML_TYPES[type_name]
    n = int(row_length)
    x = np.ascontiguousarray(np.fromfile(values_file, dtype=np.float32))
    rows = x.size // n
    out = np.zeros(rows * lib.ggml_row_size(t, n), dtype=np.uint8)
    written = lib.ggml_quantize_chunk(t, x.ctypes.data, out.ctypes.data, 0, rows, n, None)
    if written != out.size:
        sys.exit(f"ggml_reference: ggml_quantize_chunk wrote {written} bytes, not {out.size}")
    out.tofile(blocks_file)


if __name__ == "__main__":
    arity = {"dequantize": 6, "quantize": 7}
    if len(sys.argv) < 2 or arity.get(sys.argv[1]) != len(sys.argv):
        sys.exit(__doc__)
    (dequantize if sys.argv[1] == "dequantize" else quantize)(*sys.argv[2:])
