#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, for a GPU machine that has CUDA but not this
# project's Debian packages (OpenBLAS, HDF5, GoogleTest, ...): a Release build with the CUDA
# backend in build-gpu/, plus the shared libraries its programs need (other than the C/C++
# runtime and CUDA's own: cudart, cuBLAS, NCCL) in build-gpu/lib. Run it on a Debian machine with nvcc; then send
# the working tree with the six build-gpu/ paths printed at the end (the device tool's
# `carry`) to the GPU machine and run scripts/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVLAB_CUDA=ON -DKVLAB_MPI=OFF \
  -DKVLAB_MARCH=x86-64-v3 -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--as-needed"  # only the libraries a program uses travel
cmake --build build-gpu -j "$(nproc)" --target test_cuda test_infer_cuda test_nccl bench_cuda
rm -rf build-gpu/lib && mkdir -p build-gpu/lib
for exe in build-gpu/tests/autograd/test_cuda build-gpu/tests/infer/test_infer_cuda \
  build-gpu/tests/train/test_nccl build-gpu/bench/bench_cuda; do
  ldd "$exe" | awk '/=> \// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libresolv|libcuda|libcudart|libcublas|libcublasLt|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" build-gpu/lib/; done
# The sources the programs were built from, so gpu-check.sh can refuse a stale bundle.
./scripts/source-hash.sh > build-gpu/source-hash
# Compressed: OpenBLAS alone is 36 MB, and what travels is limited.
tar -C build-gpu -cJf build-gpu/lib.tar.xz lib && rm -rf build-gpu/lib
ls -la build-gpu/source-hash build-gpu/lib.tar.xz build-gpu/tests/autograd/test_cuda build-gpu/tests/infer/test_infer_cuda \
  build-gpu/tests/train/test_nccl build-gpu/bench/bench_cuda
