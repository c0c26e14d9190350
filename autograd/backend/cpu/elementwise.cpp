#include <cmath>

#include "autograd/backend/cpu/index.h"
#include "autograd/backend/cpu/vec_math.h"
#include "autograd/backend/kernels.h"
#include "platform/parallel.h"
#include "platform/random.h"

namespace kvlab::cpu {

namespace {

template <class T>
inline T apply(BinaryOp op, T a, T b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
  }
  return 0;
}

template <class T, BinaryOp Op>
void dense_rows(T* out, int64_t rows, int64_t inner, const T* a, int64_t a_rs, int64_t a_is,
                const T* b, int64_t b_rs, int64_t b_is) {
  parallel_range(rows, rows * inner, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* o = out + r * inner;
      const T* pa = a + r * a_rs;
      const T* pb = b + r * b_rs;
      if (a_is == 1 && b_is == 1) {
#pragma omp simd
        for (int64_t j = 0; j < inner; ++j) o[j] = apply(Op, pa[j], pb[j]);
      } else {
        for (int64_t j = 0; j < inner; ++j) o[j] = apply(Op, pa[j * a_is], pb[j * b_is]);
      }
    }
  });
}
}  // namespace

template <class T>
void binary_forward(BinaryOp op, T* out, const std::vector<int64_t>& sizes, const T* a,
                    const Strides& as, const T* b, const Strides& bs) {
  const int nd = static_cast<int>(sizes.size());
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  if (n == 0) return;
  const int64_t inner = nd ? sizes[nd - 1] : 1;
  const int64_t rows = n / inner;
  const int64_t a_is = nd ? as[nd - 1] : 0, b_is = nd ? bs[nd - 1] : 0;
  // Row offsets: rows are walked in order, so precompute only when the leading dims need it.
  if (nd <= 2) {
    const int64_t a_rs = nd == 2 ? as[0] : 0, b_rs = nd == 2 ? bs[0] : 0;
    switch (op) {
      case BinaryOp::Add: dense_rows<T, BinaryOp::Add>(out, rows, inner, a, a_rs, a_is, b, b_rs, b_is); break;
      case BinaryOp::Sub: dense_rows<T, BinaryOp::Sub>(out, rows, inner, a, a_rs, a_is, b, b_rs, b_is); break;
      case BinaryOp::Mul: dense_rows<T, BinaryOp::Mul>(out, rows, inner, a, a_rs, a_is, b, b_rs, b_is); break;
    }
    return;
  }
  parallel_range(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t ao = row_offset(r, sizes, as), bo = row_offset(r, sizes, bs);
      T* o = out + r * inner;
      for (int64_t j = 0; j < inner; ++j) o[j] = apply(op, a[ao + j * a_is], b[bo + j * b_is]);
    }
  });
}

template <class T>
void scale_forward(T* out, const T* x, T s, int64_t n) {
  parallel_range(n, n, [&](int64_t i0, int64_t i1) {
    const T f = s;  // a local (see gelu_forward)
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) out[i] = x[i] * f;
  });
}

template <class T>
void add_inplace(T* dst, const T* src, int64_t n) {
  parallel_range(n, n, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) dst[i] += src[i];
  });
}

template <class T>
void sum_to(T* out, const std::vector<int64_t>& out_sizes, const T* x,
            const std::vector<int64_t>& x_sizes) {
  const int nd = static_cast<int>(x_sizes.size());
  const int off = nd - static_cast<int>(out_sizes.size());
  // Out strides aligned to x's dims, 0 on every reduced dim.
  std::vector<int64_t> os(nd, 0);
  int64_t acc = 1, out_n = 1;
  for (int d = nd - 1; d >= 0; --d) {
    const int od = d - off;
    const int64_t osz = od >= 0 ? out_sizes[od] : 1;
    os[d] = (osz == 1 && x_sizes[d] != 1) ? 0 : acc;
    acc *= osz;
  }
  for (int64_t s : out_sizes) out_n *= s;
  int64_t n = 1;
  for (int64_t s : x_sizes) n *= s;
  for (int64_t i = 0; i < out_n; ++i) out[i] = 0;
  // Common case (bias and position-embedding gradients): only leading dims are reduced, so
  // x is (rows, inner) and out is one row.
  int k = 0;
  while (k < nd && os[k] == 0) ++k;
  int64_t inner = 1;
  for (int d = k; d < nd; ++d) inner *= x_sizes[d];
  if (inner == out_n) {
    const int64_t rows = inner ? n / inner : 0;
    // Columns are split across threads; each walks every row in order (deterministic).
    parallel_range(inner, n, [&](int64_t c0, int64_t c1) {
      for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
        for (int64_t j = c0; j < c1; ++j) out[j] += x[r * inner + j];
    });
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, o = 0;
    for (int d = nd - 1; d >= 0; --d) {
      o += (rem % x_sizes[d]) * os[d];
      rem /= x_sizes[d];
    }
    out[o] += x[i];
  }
}

template <class T>
void sum_all(T* out, const T* x, int64_t n, T divisor) {
  const double s = ordered_chunk_sum(n, [&](int64_t i0, int64_t i1) {
    double acc = 0;
    for (int64_t i = i0; i < i1; ++i) acc += x[i];
    return acc;
  });
  *out = static_cast<T>(s) / divisor;
}

// GELU (tanh form): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
namespace {
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluA = 0.044715;
}  // namespace

// The constants are locals of the loop's own function: captured by reference, GCC reloads
// and broadcasts them in every vector iteration (a float store might alias them).
template <class T>
void gelu_forward(T* out, const T* x, int64_t n) {
  parallel_range(n, n, [&](int64_t i0, int64_t i1) {
    const T c = static_cast<T>(kGeluC), a = static_cast<T>(kGeluA);
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const T xi = x[i];
      const T u = c * (xi + a * xi * xi * xi);
      out[i] = T(0.5) * xi * (T(1) + tanh_t(u));
    }
  });
}

template <class T>
void gelu_backward(T* dx, const T* dout, const T* x, int64_t n) {
  parallel_range(n, n, [&](int64_t i0, int64_t i1) {
    const T c = static_cast<T>(kGeluC), a = static_cast<T>(kGeluA);
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const T xi = x[i];
      const T u = c * (xi + a * xi * xi * xi);
      const T th = tanh_t(u);
      const T du = c * (T(1) + T(3) * a * xi * xi);
      dx[i] = dout[i] * (T(0.5) * (T(1) + th) + T(0.5) * xi * (T(1) - th * th) * du);
    }
  });
}

namespace {
inline bool dropped(uint64_t seed, int64_t i, uint64_t threshold) {
  return hash64(seed, static_cast<uint64_t>(i)) < threshold;
}
inline uint64_t drop_threshold(double p) {
  return p >= 1.0 ? ~0ull : static_cast<uint64_t>(p * 18446744073709551616.0);
}
}  // namespace

template <class T>
void dropout_forward(T* out, const T* x, int64_t n, double p, uint64_t seed) {
  const uint64_t th = drop_threshold(p);
  const T keep = static_cast<T>(1.0 / (1.0 - p));
  parallel_range(n, n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = dropped(seed, i, th) ? T(0) : x[i] * keep;
  });
}

template <class T>
void dropout_backward(T* dx, const T* dout, int64_t n, double p, uint64_t seed) {
  dropout_forward(dx, dout, n, p, seed);  // the same mask and scale
}

template <class T>
void swiglu_forward(T* out, const T* gate, const T* up, int64_t n) {
  parallel_range(n, n * 4, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) out[i] = gate[i] * sigmoid_t(gate[i]) * up[i];
  });
}

template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
  parallel_range(n, n * 4, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const T a = gate[i], sg = sigmoid_t(a);
      dup[i] = dout[i] * a * sg;
      dgate[i] = dout[i] * up[i] * sg * (T(1) + a * (T(1) - sg));
    }
  });
}

template <class T>
void rope_forward(T* out, const T* x, const int32_t* pos, const T* table, int64_t N, int64_t H,
                  int64_t HS, bool inverse) {
  parallel_range(N, N * H * HS, [&](int64_t i0, int64_t i1) {
    const int64_t half = HS / 2, Hl = H, HSl = HS;
    const T sign = inverse ? T(-1) : T(1);
    for (int64_t i = i0; i < i1; ++i) {
      const T* c = table + static_cast<int64_t>(pos[i]) * HSl;
      const T* sn = c + half;
      for (int64_t h = 0; h < Hl; ++h) {
        const T* xi = x + (i * Hl + h) * HSl;
        T* oi = out + (i * Hl + h) * HSl;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const T x1 = xi[j], x2 = xi[j + half], s = sign * sn[j];
          oi[j] = x1 * c[j] - x2 * s;
          oi[j + half] = x2 * c[j] + x1 * s;
        }
      }
    }
  });
}

KVLAB_ELEMENTWISE_KERNELS(KVLAB_INSTANTIATE, float)
KVLAB_ELEMENTWISE_KERNELS(KVLAB_INSTANTIATE, double)

}  // namespace kvlab::cpu
