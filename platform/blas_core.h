#pragma once
// Which OpenBLAS kernels run on this CPU: see blas_core.cpp.

// The OpenBLAS kernels (OPENBLAS_CORETYPE) kvlab named at start-up because OpenBLAS had fallen
// back to kernels narrower than the CPU's vectors, or nullptr where it named none. extern "C":
// the link names it, to keep blas_core.cpp, whose start-up code nothing calls by name.
extern "C" const char* kvlab_blas_core_named();
// The kernels of the CPU's widest vectors where OpenBLAS runs narrower ones (the user's
// OPENBLAS_CORETYPE named them, and kvlab leaves a named choice alone; or the BLAS cannot pick
// again), else nullptr.
extern "C" const char* kvlab_blas_core_wider();

namespace kvlab {

// The BLAS's identity, as `--version` and every result's machine record name it: OpenBLAS's
// build configuration, and the kernels it runs on this CPU. Declared here so that nothing
// above the platform includes <cblas.h> for them.
const char* blas_config();
const char* blas_kernels();

}  // namespace kvlab
