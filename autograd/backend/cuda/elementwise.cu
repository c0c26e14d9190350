// Elementwise kernels and reductions on the device. Reductions run in a fixed order (fixed
// grids, per-block partials summed in index order), so results do not vary between runs.
#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/kernels.h"
#include "platform/random.h"

namespace kvlab::cuda {

namespace {

#define KVLAB_GRID_LOOP(i, n)                                               \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

template <class T>
__device__ inline T apply(BinaryOp op, T a, T b) {
  return op == BinaryOp::Add ? a + b : op == BinaryOp::Sub ? a - b : a * b;
}

template <class T>
__global__ void binary_kernel(BinaryOp op, T* out, const T* a, const T* b, Indexer ix, int64_t n) {
  KVLAB_GRID_LOOP(i, n) {
    int64_t ao, bo;
    ix.offsets(i, ao, bo);
    out[i] = apply(op, a[ao], b[bo]);
  }
}

template <class T>
__global__ void binary_dense_kernel(BinaryOp op, T* out, const T* a, const T* b, int64_t n) {
  KVLAB_GRID_LOOP(i, n) out[i] = apply(op, a[i], b[i]);
}

template <class T>
__global__ void scale_kernel(T* out, const T* x, T s, int64_t n) {
  KVLAB_GRID_LOOP(i, n) out[i] = x[i] * s;
}

template <class T>
__global__ void add_inplace_kernel(T* dst, const T* src, int64_t n) {
  KVLAB_GRID_LOOP(i, n) dst[i] += src[i];
}

__device__ inline float tanh_of(float x) { return tanhf(x); }
__device__ inline double tanh_of(double x) { return tanh(x); }

// GELU (tanh form), the CPU formula term by term.
template <class T>
__global__ void gelu_forward_kernel(T* out, const T* x, int64_t n) {
  const T c = T(0.7978845608028654), a = T(0.044715);
  KVLAB_GRID_LOOP(i, n) {
    const T xi = x[i];
    const T u = c * (xi + a * xi * xi * xi);
    out[i] = T(0.5) * xi * (T(1) + tanh_of(u));
  }
}

template <class T>
__global__ void gelu_backward_kernel(T* dx, const T* dout, const T* x, int64_t n) {
  const T c = T(0.7978845608028654), a = T(0.044715);
  KVLAB_GRID_LOOP(i, n) {
    const T xi = x[i];
    const T u = c * (xi + a * xi * xi * xi);
    const T th = tanh_of(u);
    const T du = c * (T(1) + T(3) * a * xi * xi);
    dx[i] = dout[i] * (T(0.5) * (T(1) + th) + T(0.5) * xi * (T(1) - th * th) * du);
  }
}

template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* gate, const T* up, int64_t n) {
  KVLAB_GRID_LOOP(i, n) {
    const T a = gate[i];
    out[i] = a * (T(0.5) + T(0.5) * tanh_of(T(0.5) * a)) * up[i];
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dout, const T* gate,
                                       const T* up, int64_t n) {
  KVLAB_GRID_LOOP(i, n) {
    const T a = gate[i], sg = T(0.5) + T(0.5) * tanh_of(T(0.5) * a);
    dup[i] = dout[i] * a * sg;
    dgate[i] = dout[i] * up[i] * sg * (T(1) + a * (T(1) - sg));
  }
}

// One thread per rotated pair: element i of the (N, H, HS / 2) pairs.
template <class T>
__global__ void rope_kernel(T* out, const T* x, const int32_t* pos, const T* table, int64_t N,
                            int64_t H, int64_t HS, T sign) {
  const int64_t half = HS / 2;
  KVLAB_GRID_LOOP(i, N * H * half) {
    const int64_t j = i % half, head = i / half, row = head / H;
    const T* c = table + static_cast<int64_t>(pos[row]) * HS;
    const T cs = c[j], s = sign * c[half + j];
    const T x1 = x[head * HS + j], x2 = x[head * HS + half + j];
    out[head * HS + j] = x1 * cs - x2 * s;
    out[head * HS + half + j] = x2 * cs + x1 * s;
  }
}

// The CPU's mask: element i is dropped when hash64(seed, i) < threshold.
template <class T>
__global__ void dropout_kernel(T* out, const T* x, int64_t n, uint64_t threshold, T keep,
                               uint64_t seed) {
  KVLAB_GRID_LOOP(i, n) {
    out[i] = hash64(seed, static_cast<uint64_t>(i)) < threshold ? T(0) : x[i] * keep;
  }
}

constexpr int kReduceBlocks = 256;  // fixed, so the summation order never changes

// partial[blockIdx.x] = sum of x over a fixed block-strided slice, in double.
template <class T>
__global__ void partial_sums_kernel(double* partial, const T* x, int64_t n) {
  __shared__ double shared[32];
  double s = 0;
  KVLAB_GRID_LOOP(i, n) s += static_cast<double>(x[i]);
  s = block_sum(s, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

template <class T>
__global__ void finish_sum_kernel(T* out, const double* partial, int parts, T divisor) {
  __shared__ double shared[32];
  double s = 0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
  s = block_sum(s, shared);
  if (threadIdx.x == 0) *out = static_cast<T>(s) / divisor;
}

// sum_to: x's dims split into kept dims (they index out) and reduced dims. Block (ox, chunk)
// sums a fixed slice of the reduced index space for each output it covers; a second pass adds
// the chunks in order.
struct SumToPlan {
  Indexer kept;     // sizes: the kept dims; strides[0]: x strides; strides[1]: unused
  Indexer reduced;  // sizes: the reduced dims; strides[0]: x strides
  int64_t out_n, red_n;
};

template <class T>
__global__ void sum_to_partial_kernel(T* partial, const T* x, SumToPlan p, int64_t chunk) {
  const int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (o >= p.out_n) return;
  int64_t xo, unused;
  p.kept.offsets(o, xo, unused);
  const int64_t r0 = blockIdx.y * chunk;
  const int64_t r1 = r0 + chunk < p.red_n ? r0 + chunk : p.red_n;
  T s = 0;
  for (int64_t r = r0; r < r1; ++r) {
    int64_t ro;
    p.reduced.offsets(r, ro, unused);
    s += x[xo + ro];
  }
  partial[blockIdx.y * p.out_n + o] = s;
}

template <class T>
__global__ void sum_chunks_kernel(T* out, const T* partial, int64_t out_n, int chunks) {
  KVLAB_GRID_LOOP(o, out_n) {
    T s = 0;
    for (int c = 0; c < chunks; ++c) s += partial[c * out_n + o];
    out[o] = s;
  }
}

}  // namespace

template <class T>
void binary_forward(BinaryOp op, T* out, const std::vector<int64_t>& sizes, const T* a,
                    const Strides& as, const T* b, const Strides& bs) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  if (n == 0) return;
  if (sizes.size() == 1 && as[0] == 1 && bs[0] == 1) {
    binary_dense_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(op, out, a, b, n);
  } else {
    binary_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(
        op, out, a, b, make_indexer("binary op", sizes, as, bs), n);
  }
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void scale_forward(T* out, const T* x, T s, int64_t n) {
  if (n == 0) return;
  scale_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(out, x, s, n);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void add_inplace(T* dst, const T* src, int64_t n) {
  if (n == 0) return;
  add_inplace_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(dst, src, n);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void gelu_forward(T* out, const T* x, int64_t n) {
  if (n == 0) return;
  gelu_forward_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(out, x, n);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void gelu_backward(T* dx, const T* dout, const T* x, int64_t n) {
  if (n == 0) return;
  gelu_backward_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(dx, dout, x, n);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed) {
  if (n == 0) return;
  const uint64_t threshold = p >= 1.0 ? ~0ull : static_cast<uint64_t>(p * 18446744073709551616.0);
  const T keep = static_cast<T>(1.0 / (1.0 - p));
  dropout_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(out, x, n, threshold, keep, seed);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed) {
  dropout_forward(dx, dout, n, p, seed);  // the same mask and scale
}

template <class T>
void sum_all(T* out, const T* x, int64_t n, T divisor) {
  double* partial = nullptr;  // (kReduceBlocks)
  CUDA_CHECK(cudaMallocAsync(&partial, kReduceBlocks * sizeof(double), stream()));
  partial_sums_kernel<<<kReduceBlocks, kThreads, 0, stream()>>>(partial, x, n);
  KVLAB_LAUNCH_CHECK();
  finish_sum_kernel<<<1, kThreads, 0, stream()>>>(out, partial, kReduceBlocks, divisor);
  KVLAB_LAUNCH_CHECK();
  CUDA_CHECK(cudaFreeAsync(partial, stream()));
}

template <class T>
void sum_to(T* out, const std::vector<int64_t>& out_sizes, const T* x,
            const std::vector<int64_t>& x_sizes) {
  const int nd = static_cast<int>(x_sizes.size());
  const int off = nd - static_cast<int>(out_sizes.size());
  std::vector<int64_t> kept_sizes, kept_strides, red_sizes, red_strides;
  int64_t stride = 1;
  std::vector<int64_t> x_strides(nd);
  for (int d = nd - 1; d >= 0; --d) {
    x_strides[d] = stride;
    stride *= x_sizes[d];
  }
  int64_t out_n = 1, red_n = 1;
  for (int d = 0; d < nd; ++d) {
    const int od = d - off;
    const int64_t osz = od >= 0 ? out_sizes[od] : 1;
    if (osz == 1 && x_sizes[d] != 1) {
      red_sizes.push_back(x_sizes[d]);
      red_strides.push_back(x_strides[d]);
      red_n *= x_sizes[d];
    } else {
      kept_sizes.push_back(x_sizes[d]);
      kept_strides.push_back(x_strides[d]);
      out_n *= x_sizes[d];
    }
  }
  if (out_n == 0) return;
  SumToPlan plan{make_indexer("sum_to", kept_sizes, kept_strides, kept_strides),
                 make_indexer("sum_to", red_sizes, red_strides, red_strides), out_n, red_n};
  // Enough chunks of the reduced space to fill the GPU when out_n is small (bias gradients:
  // out_n = C, red_n = B * T).
  const int64_t out_blocks = (out_n + kThreads - 1) / kThreads;
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(red_n / 64, 1024 / out_blocks));
  chunks = std::min<int64_t>(chunks, 65535);
  const int64_t chunk = red_n == 0 ? 1 : (red_n + chunks - 1) / chunks;
  chunks = red_n == 0 ? 1 : (red_n + chunk - 1) / chunk;
  T* partial = nullptr;  // (chunks, out_n)
  CUDA_CHECK(cudaMallocAsync(&partial, sizeof(T) * chunks * out_n, stream()));
  sum_to_partial_kernel<<<dim3(static_cast<unsigned>(out_blocks), static_cast<unsigned>(chunks)),
                          kThreads, 0, stream()>>>(partial, x, plan, chunk);
  KVLAB_LAUNCH_CHECK();
  sum_chunks_kernel<<<blocks_for(out_n), kThreads, 0, stream()>>>(out, partial, out_n,
                                                                  static_cast<int>(chunks));
  KVLAB_LAUNCH_CHECK();
  CUDA_CHECK(cudaFreeAsync(partial, stream()));
}

template <class T>
void swiglu_forward(T* out, const T* gate, const T* up, int64_t n) {
  if (n == 0) return;
  swiglu_forward_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(out, gate, up, n);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
  if (n == 0) return;
  swiglu_backward_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(dgate, dup, dout, gate, up, n);
  KVLAB_LAUNCH_CHECK();
}

template <class T>
void rope_forward(T* out, const T* x, const int32_t* pos, const T* table, int64_t N, int64_t H,
                  int64_t HS, bool inverse) {
  const int64_t pairs = N * H * (HS / 2);
  if (pairs == 0) return;
  rope_kernel<<<blocks_for(pairs), kThreads, 0, stream()>>>(out, x, pos, table, N, H, HS,
                                                             inverse ? T(-1) : T(1));
  KVLAB_LAUNCH_CHECK();
}

KVLAB_ELEMENTWISE_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_ELEMENTWISE_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cuda
