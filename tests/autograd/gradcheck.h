#pragma once
// Shared helpers of the autograd tests: seeded random tensors, closeness checks against naive
// double references, and a generic f64 finite-difference gradient checker.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "autograd/tensor.h"
#include "platform/random.h"

namespace kvtest {

using kvlab::DType;
using kvlab::Generator;
using kvlab::Shape;
using kvlab::Tensor;

// ---- random tensors -------------------------------------------------------------------------

inline std::vector<double> randn_values(int64_t n, Generator& gen, double scale = 1.0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = gen.normal() * scale;
  return v;
}

// Standard normal values (times `scale`) of the given shape and dtype, contiguous.
inline Tensor randn(const Shape& shape, Generator& gen, DType dtype = DType::F64,
                    double scale = 1.0) {
  return Tensor::from_vector(randn_values(kvlab::shape_numel(shape), gen, scale), shape).to(dtype);
}

// A leaf that requires grad (f64 unless told otherwise).
inline Tensor param(const Shape& shape, Generator& gen, DType dtype = DType::F64,
                    double scale = 1.0) {
  Tensor t = randn(shape, gen, dtype, scale);
  t.set_requires_grad(true);
  return t;
}

inline Tensor ids_tensor(const std::vector<int32_t>& ids, const Shape& shape) {
  return Tensor::from_vector(ids, shape);
}

inline Tensor random_ids(const Shape& shape, int32_t V, Generator& gen) {
  std::vector<int32_t> v(static_cast<size_t>(kvlab::shape_numel(shape)));
  for (int32_t& x : v) x = static_cast<int32_t>(gen.below(static_cast<uint64_t>(V)));
  return Tensor::from_vector(v, shape);
}

inline std::vector<double> vals(const Tensor& t) { return t.to_vector<double>(); }

// ---- closeness -------------------------------------------------------------------------------

// |got - want| <= tol * max(1, |want|) elementwise (relative for large values, absolute near 0).
inline ::testing::AssertionResult all_close(const std::vector<double>& got,
                                            const std::vector<double>& want, double tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << "size mismatch: got " << got.size() << " values, want " << want.size();
  size_t bad = 0, first = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i]));
    if (!(err <= tol)) {  // also catches NaN
      if (bad++ == 0) first = i;
    }
    if (!(err <= worst)) worst = err;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " values differ (tol " << tol << "); first at index "
         << first << ": got " << got[first] << ", want " << want[first] << "; worst scaled error "
         << worst;
}

inline ::testing::AssertionResult all_close(const Tensor& got, const std::vector<double>& want,
                                            double tol) {
  return all_close(vals(got), want, tol);
}

inline ::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double tol) {
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure()
           << "shape mismatch: " << got.shape_str() << " vs " << want.shape_str();
  return all_close(vals(got), vals(want), tol);
}

// Runs `fn`, expects kvlab::Error, and checks the message contains every one of `parts`.
template <class Fn>
::testing::AssertionResult throws_with(Fn&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const kvlab::Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure()
               << "message \"" << msg << "\" does not contain \"" << p << "\"";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-kvlab exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// ---- finite-difference gradient check --------------------------------------------------------

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

struct GradcheckOptions {
  double eps = 1e-6;       // central-difference step
  double tol = 1e-6;       // |analytic - numeric| <= tol * max(1, |numeric|)
  uint64_t seed = 0x5eed;  // of the projection R
};

// L = sum(f(x) * R) for a fixed random R of f's output shape, so every direction of a
// non-scalar output is checked. Every f64 input that requires grad is compared against central
// differences of L; other inputs (i32 ids and targets, constants) are passed through untouched.
// Differentiable inputs must be contiguous leaves.
inline ::testing::AssertionResult gradcheck(const Fn& f, const std::vector<Tensor>& inputs,
                                            const GradcheckOptions& o = {}) {
  std::vector<size_t> diff;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    if (!t.defined() || t.dtype() != DType::F64 || !t.requires_grad()) continue;
    if (t.grad_fn() || !t.is_contiguous())
      return ::testing::AssertionFailure()
             << "gradcheck: input " << i << " must be a contiguous leaf";
    Tensor(t).zero_grad();
    diff.push_back(i);
  }
  if (diff.empty()) return ::testing::AssertionFailure() << "gradcheck: no f64 input requires grad";

  Tensor out = f(inputs);
  if (out.dtype() != DType::F64)
    return ::testing::AssertionFailure() << "gradcheck: f must return f64";
  Generator gen(o.seed);
  const Tensor R = randn(out.sizes(), gen);
  Tensor L = kvlab::sum(kvlab::mul(out, R));
  if (!L.grad_fn())
    return ::testing::AssertionFailure() << "gradcheck: the output carries no graph";
  L.backward();

  auto eval = [&]() {
    kvlab::NoGradGuard no_grad;
    return kvlab::sum(kvlab::mul(f(inputs), R)).item();
  };
  std::ostringstream report;
  int64_t bad = 0, checked = 0;
  double worst = 0;
  for (size_t i : diff) {
    const Tensor& x = inputs[i];
    const Tensor g = x.grad();
    if (!g.defined())
      return ::testing::AssertionFailure()
             << "gradcheck: input " << i << " " << x.shape_str() << " received no gradient";
    if (g.sizes() != x.sizes())
      return ::testing::AssertionFailure() << "gradcheck: input " << i << " " << x.shape_str()
                                           << " got a gradient of shape " << g.shape_str();
    const std::vector<double> analytic = vals(g);
    double* p = x.data<double>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      const double saved = p[j];
      p[j] = saved + o.eps;
      const double lp = eval();
      p[j] = saved - o.eps;
      const double lm = eval();
      p[j] = saved;
      const double numeric = (lp - lm) / (2 * o.eps);
      const double err =
          std::abs(analytic[static_cast<size_t>(j)] - numeric) / std::max(1.0, std::abs(numeric));
      ++checked;
      if (!(err <= worst)) worst = err;
      if (!(err <= o.tol)) {
        if (bad < 8)
          report << "\n  input " << i << " " << x.shape_str() << " element " << j << ": analytic "
                 << analytic[static_cast<size_t>(j)] << ", numeric " << numeric;
        ++bad;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "gradcheck: " << bad << " of " << checked
                                       << " gradient entries differ (worst scaled error " << worst
                                       << ", tol " << o.tol << "):" << report.str();
}

}  // namespace kvtest
