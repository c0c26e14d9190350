#!/usr/bin/env bash
# The GPU check: builds kvlab with the CUDA backend, runs the tests labelled `cuda`, then the
# GPU benchmarks (kvlab's bench_cuda and PyTorch on the same GPU, bench/torch_gpu.py), and
# prints one short table. Sized to finish in under 8 minutes on one H100/H200.
#
# With this project's Debian packages installed (scripts/setup.sh) it configures and builds
# here. A GPU machine without them (CUDA, CMake and PyTorch only) runs the programs that
# scripts/gpu-bundle.sh built on a Debian machine into build-gpu/ instead.
# Results: $OUT (or out/gpu-check) holds the logs and JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${OUT:-out/gpu-check}" && cd "${OUT:-out/gpu-check}" && pwd)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ||
  { echo "gpu-check: no GPU visible (nvidia-smi failed)"; exit 1; }

if [[ -x build-gpu/bench/bench_cuda && -f build-gpu/lib.tar.xz ]]; then
  echo "== using the programs in build-gpu/ (scripts/gpu-bundle.sh)"
  if [[ "$(cat build-gpu/source-hash 2>/dev/null)" != "$(./scripts/source-hash.sh)" ]]; then
    echo "gpu-check: build-gpu/ was built from other sources; rerun scripts/gpu-bundle.sh"
    exit 1
  fi
  mkdir -p /tmp/kvlab-gpu && tar -C /tmp/kvlab-gpu -xJf build-gpu/lib.tar.xz
  # CUDA's own libraries (cudart, cuBLAS, NCCL) come from the machine: the toolkit, then the
  # NVIDIA Python wheels PyTorch brings (NCCL may exist only there).
  wheels=$(python3 -c "import glob, os, site
print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages()
      for p in glob.glob(os.path.join(d, 'nvidia', '**', 'lib*.so*'), recursive=True)})))" \
    2>/dev/null || true)
  export LD_LIBRARY_PATH="/tmp/kvlab-gpu/lib:/usr/local/cuda/lib64:${wheels}:${LD_LIBRARY_PATH:-}"
else
  echo "== configuring and building with CUDA"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVLAB_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real >"$out/configure.log" 2>&1 &&
    cmake --build build-gpu -j "$(nproc)" --target test_cuda test_infer_cuda test_nccl bench_cuda \
      >"$out/build.log" 2>&1 || { tail -30 "$out/build.log" "$out/configure.log"; exit 1; }
fi

tests_rc=0
for t in build-gpu/tests/autograd/test_cuda build-gpu/tests/infer/test_infer_cuda \
  build-gpu/tests/train/test_nccl; do
  echo "== $t"
  timeout 90 "$t" --gtest_brief=1 2>&1 | tee -a "$out/tests.log" || tests_rc=1
done
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$out/tests.log" | sort | uniq -c
# With a GPU present nothing may skip: a skipped GPU test would be a check that did not run.
grep -qE "^\[  SKIPPED \] [1-9]" "$out/tests.log" && tests_rc=1

echo "== kvlab GPU benchmarks"
timeout 180 build-gpu/bench/bench_cuda --json "$out/kvlab.json" 2>&1 | tee "$out/bench_cuda.log"
echo "== PyTorch on the same GPU"
(cd bench && timeout 150 python3 torch_gpu.py --json "$out/torch.json") 2>&1 |
  tee "$out/torch.log"

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else {}
k, t = load("kvlab.json"), load("torch.json")
print("\n== summary (kvlab and PyTorch on the same GPU)")
if k:
    print(f"device: bf16 GEMM {k['bf16_gemm_tflops']:.0f} TFLOP/s, f32 GEMM "
          f"{k['f32_gemm_tflops']:.1f} TFLOP/s, copy {k['copy_gbps']:.0f} GB/s")
torch_train = {}
for r in t.get("train", []):
    torch_train.setdefault(r["config"], {})[r["mode"]] = r["tokens_per_s"]
print(f"{'train config':22} {'dtype':5} {'kvlab tok/s':>12} {'MFU bf16':>9} {'torch tok/s':>12} "
      f"{'kv/torch':>9}")
for r in k.get("train", []):
    tt = torch_train.get(r["config"], {})
    # the same arithmetic: f32 against f32 eager, bf16 against the best bf16 PyTorch mode
    ref = tt.get("f32") if r["dtype"] == "f32" else max(
        [v for m, v in tt.items() if m != "f32"], default=None)
    ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "-"
    print(f"{r['config']:22} {r['dtype']:5} {r['tokens_per_s']:12.0f} {r['mfu_bf16']:9.3f} "
          f"{ref or 0:12.0f} {ratio:>9}")
torch_dec = {(r["n_kv_head"], r["batch"]): r["tokens_per_s"] for r in t.get("decode", [])}
print(f"{'decode NKV/batch/cache':22} {'kvlab tok/s':>12} {'step/ceiling':>13} {'torch tok/s':>12}")
for r in k.get("decode", []):
    cache = r.get("cache_dtype", "f32")  # PyTorch's baseline keeps an f32 cache
    td = torch_dec.get((r["n_kv_head"], r["batch"]), 0) if cache == "f32" else 0
    label = f"{r['n_kv_head']} / {r['batch']} / {cache}"
    print(f"{label:22} {r['tokens_per_s']:12.0f} {r['step_ms'] / r['ceiling_step_ms']:13.2f} "
          f"{td:12.0f}")
PY
exit $tests_rc
