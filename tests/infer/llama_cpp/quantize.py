#!/usr/bin/env python3
"""llama-quantize's own quantiser on a GGUF file: llama_model_quantize, the function the
llama-quantize tool runs, from node-llama-cpp's prebuilt libllama (no build, no network).

usage: quantize.py BINS_DIR IN.gguf OUT.gguf FTYPE [--pure]
FTYPE is llama.h's llama_ftype (2 Q4_0, 15 Q4_K_M, 17 Q5_K_M, 18 Q6_K, ...); default
parameters otherwise (no importance matrix, the type mix llama-quantize picks for FTYPE), or
with --pure every matrix in FTYPE's own type (llama-quantize --pure).
Exit 77 when the library cannot be loaded (the caller skips).
"""
import ctypes
import glob
import os
import sys


class QuantizeParams(ctypes.Structure):
    # llama.h's llama_model_quantize_params, then room: the library fills its own default.
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int),
                ("output_tensor_type", ctypes.c_int), ("token_embedding_type", ctypes.c_int),
                ("allow_requantize", ctypes.c_bool), ("quantize_output_tensor", ctypes.c_bool),
                ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool),
                ("imatrix", ctypes.c_void_p), ("kv_overrides", ctypes.c_void_p),
                ("tt_overrides", ctypes.c_void_p), ("prune_layers", ctypes.c_void_p),
                ("max_buf_size", ctypes.c_size_t), ("reserved", ctypes.c_char * 512)]


def main():
    if len(sys.argv) not in (5, 6) or sys.argv[5:] not in ([], ["--pure"]):
        sys.exit(__doc__)
    bins, src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    pure = sys.argv[5:] == ["--pure"]
    try:
        # Its dependencies first, global, so that libllama finds them beside it.
        for pattern in ("libggml-base.so", "libggml.v*.so", "libggml.so"):
            for path in glob.glob(os.path.join(bins, pattern)):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(glob.glob(os.path.join(bins, "libllama.v*.so"))[0])
    except (OSError, IndexError) as e:
        print(f"quantize.py: cannot load libllama from {bins}: {e}", file=sys.stderr)
        sys.exit(77)
    lib.llama_model_quantize_default_params.restype = QuantizeParams
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.POINTER(QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    params = lib.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    params.pure = pure
    if lib.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        sys.exit(f"quantize.py: llama_model_quantize failed on {src}")


if __name__ == "__main__":
    main()
