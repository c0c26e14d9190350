// AdamW over all parameters in one launch, and the sum of squares behind the global gradient
// norm in one launch pair and one host sync (f32 parameters only). A table on the device says
// which tensor and which chunk of it each block handles.
#include <cmath>
#include <cstring>
#include <vector>

#include "autograd/backend/cuda/common.cuh"
#include "autograd/backend/cuda/runtime.h"
#include "autograd/backend/kernels.h"

namespace kvlab::cuda {
namespace {

constexpr int64_t kChunk = 16384;         // elements per block
constexpr unsigned kFinalThreads = 1024;  // the block that adds the partials

struct AdamWDesc {  // one tensor, its scalar factors computed on the host as the CPU does
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float beta1, beta2, eps, grad_scale, decay, step_size, bc2_sqrt;
};

struct Chunk {  // block b handles elements [start, start + kChunk) of tensor `tensor`
  int32_t tensor;
  int64_t start;
};

// Copies the descriptors and the chunk table into one stream-ordered device buffer; returns it
// (freed by the caller with cudaFreeAsync) and the number of chunks.
template <class Desc>
void* upload(const std::vector<Desc>& descs, const std::vector<Chunk>& chunks) {
  const size_t d_bytes = descs.size() * sizeof(Desc);
  const size_t c_off = (d_bytes + 15) / 16 * 16;
  std::vector<unsigned char> host(c_off + chunks.size() * sizeof(Chunk));
  std::memcpy(host.data(), descs.data(), d_bytes);
  std::memcpy(host.data() + c_off, chunks.data(), chunks.size() * sizeof(Chunk));
  void* dev = nullptr;
  CUDA_CHECK(cudaMallocAsync(&dev, host.size(), stream()));
  // From pageable memory the copy returns once `host` is staged, so it may go out of scope.
  CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), host.size(), cudaMemcpyHostToDevice, stream()));
  return dev;
}

template <class Desc>
const Chunk* chunk_table(const void* dev, size_t n_descs) {
  const size_t c_off = (n_descs * sizeof(Desc) + 15) / 16 * 16;
  return reinterpret_cast<const Chunk*>(static_cast<const unsigned char*>(dev) + c_off);
}

unsigned grid_of(size_t chunks) {
  KVLAB_CHECK(chunks <= 0x7fffffffu, "optimizer: ", chunks, " chunks exceed the grid");
  return static_cast<unsigned>(chunks);
}

template <class T>
std::vector<Chunk> chunks_of(const std::vector<T>& descs) {
  std::vector<Chunk> out;
  for (size_t t = 0; t < descs.size(); ++t)
    for (int64_t s = 0; s < descs[t].n; s += kChunk) out.push_back({static_cast<int32_t>(t), s});
  return out;
}

// The CPU's order of operations (PyTorch's). The square root and the divisions are the IEEE
// round-to-nearest ones whatever the -prec-sqrt/-prec-div/fast-math flags of the build.
__global__ void adamw_kernel(const AdamWDesc* descs, const Chunk* chunks) {
  const Chunk c = chunks[blockIdx.x];
  const AdamWDesc d = descs[c.tensor];
  const int64_t end = c.start + kChunk < d.n ? c.start + kChunk : d.n;
  for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
    const float gi = d.g[i] * d.grad_scale;
    const float mi = d.beta1 * d.m[i] + (1.0f - d.beta1) * gi;
    const float vi = d.beta2 * d.v[i] + (1.0f - d.beta2) * gi * gi;
    d.m[i] = mi;
    d.v[i] = vi;
    const float denom = __fdiv_rn(__fsqrt_rn(vi), d.bc2_sqrt) + d.eps;
    d.p[i] = d.p[i] * d.decay - __fdiv_rn(d.step_size * mi, denom);
  }
}

// partial[b] = sum of squares of chunk b, in double.
__global__ void sum_squares_partial_kernel(double* partial, const FloatSpan* xs,
                                           const Chunk* chunks) {
  __shared__ double shared[32];
  const Chunk c = chunks[blockIdx.x];
  const FloatSpan x = xs[c.tensor];
  const int64_t end = c.start + kChunk < x.n ? c.start + kChunk : x.n;
  double s = 0;
  for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
    const double xi = x.data[i];
    s += xi * xi;
  }
  s = block_sum(s, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// One block: *out = the partials (count) summed in a fixed order.
__global__ void sum_partials_kernel(double* out, const double* partial, int64_t count) {
  __shared__ double shared[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_sum(s, shared);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

void adamw_update_many(std::span<const AdamWTensor> tensors) {
  std::vector<AdamWDesc> descs;
  for (const AdamWTensor& t : tensors) {
    if (t.n == 0) continue;
    const AdamWStep& s = t.step;
    // The scalar factors exactly as the CPU computes them.
    descs.push_back({t.param, t.grad, t.m, t.v, t.n, s.beta1, s.beta2, s.eps, s.grad_scale,
                     1.0f - s.lr * s.weight_decay, s.lr / s.bias_correction1,
                     std::sqrt(s.bias_correction2)});
  }
  const std::vector<Chunk> chunks = chunks_of(descs);
  if (chunks.empty()) return;
  void* dev = upload(descs, chunks);
  adamw_kernel<<<grid_of(chunks.size()), kThreads, 0, stream()>>>(
      static_cast<const AdamWDesc*>(dev), chunk_table<AdamWDesc>(dev, descs.size()));
  KVLAB_LAUNCH_CHECK();
  CUDA_CHECK(cudaFreeAsync(dev, stream()));
}

double sum_squares_many(std::span<const FloatSpan> xs_in) {
  std::vector<FloatSpan> xs;
  for (const FloatSpan& x : xs_in)
    if (x.n > 0) xs.push_back(x);
  const std::vector<Chunk> chunks = chunks_of(xs);
  if (chunks.empty()) return 0.0;
  void* dev = upload(xs, chunks);
  double* partial = nullptr;  // (chunks), then the result (1)
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial),
                             (chunks.size() + 1) * sizeof(double), stream()));
  sum_squares_partial_kernel<<<grid_of(chunks.size()), kThreads, 0, stream()>>>(
      partial, static_cast<const FloatSpan*>(dev), chunk_table<FloatSpan>(dev, xs.size()));
  KVLAB_LAUNCH_CHECK();
  const int64_t count = static_cast<int64_t>(chunks.size());
  sum_partials_kernel<<<1, kFinalThreads, 0, stream()>>>(partial + count, partial, count);
  KVLAB_LAUNCH_CHECK();
  double result = 0;
  memcpy_to_host(&result, partial + count, sizeof(double));  // waits for the sum
  CUDA_CHECK(cudaFreeAsync(partial, stream()));
  CUDA_CHECK(cudaFreeAsync(dev, stream()));
  return result;
}

}  // namespace kvlab::cuda
