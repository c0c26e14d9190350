// Tensor handle: creation, metadata, views, copies, dtype conversion, printing, devices.
#include <cmath>
#include <cstring>
#include <sstream>

#include "tests/autograd/gradcheck.h"
#ifdef KVLAB_WITH_CUDA
#include "autograd/backend/cuda/runtime.h"
#endif

namespace {

using namespace kvlab;
using kvtest::vals;

std::vector<double> iota(int64_t n, double start = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + static_cast<double>(i);
  return v;
}

TEST(Tensor, CreationZerosFullFromVector) {
  Tensor z = Tensor::zeros({2, 3});
  EXPECT_EQ(z.sizes(), (Shape{2, 3}));
  EXPECT_EQ(z.dtype(), DType::F32);
  EXPECT_EQ(z.device(), Device::CPU);
  EXPECT_EQ(z.numel(), 6);
  EXPECT_EQ(z.dim(), 2);
  EXPECT_EQ(vals(z), std::vector<double>(6, 0.0));

  Tensor f = Tensor::full({3}, 2.5, DType::F64);
  EXPECT_EQ(f.dtype(), DType::F64);
  EXPECT_EQ(vals(f), (std::vector<double>{2.5, 2.5, 2.5}));

  Tensor v = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {3, 2});
  EXPECT_EQ(v.dtype(), DType::F32);
  EXPECT_EQ(v.to_vector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(v.data<float>()[3], 4.0f);

  Tensor i = Tensor::from_vector(std::vector<int32_t>{7, -1}, {2});
  EXPECT_EQ(i.dtype(), DType::I32);
  EXPECT_EQ(i.to_vector<int32_t>(), (std::vector<int32_t>{7, -1}));

  Tensor s = Tensor::scalar(3.25, DType::F64);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_DOUBLE_EQ(s.item(), 3.25);

  EXPECT_THROW(Tensor::from_vector(std::vector<float>{1, 2, 3}, {2, 2}), Error);
  EXPECT_THROW(Tensor::empty({2, -1}), Error);
  EXPECT_THROW(v.item(), Error);                // 6 elements
  EXPECT_THROW((void)v.data<double>(), Error);  // wrong dtype
}

// A loaded parameter takes over its array's memory: adopt keeps the vector's own buffer, and
// share_data_of makes every handle of a tensor see it (as a model's registered parameter is seen).
TEST(Tensor, AdoptedDataIsSharedWithoutACopy) {
  std::vector<float> values{1, 2, 3, 4, 5, 6};
  const float* buffer = values.data();
  const Tensor a = Tensor::adopt(std::move(values), {2, 3});
  EXPECT_EQ(a.data<float>(), buffer);
  Tensor param = Tensor::zeros({2, 3});
  const Tensor other_handle = param;
  param.share_data_of(a);
  EXPECT_EQ(other_handle.data<float>(), buffer);
  EXPECT_EQ(other_handle.to_vector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_THROW(Tensor::zeros({3, 2}).share_data_of(a), Error);
  EXPECT_THROW(Tensor::adopt(std::vector<float>(5), {2, 3}), Error);
}

TEST(Tensor, ContiguousStridesAndNegativeDims) {
  Tensor t = Tensor::empty({2, 3, 4});
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(contiguous_strides({5}), (Shape{1}));
  EXPECT_EQ(contiguous_strides({}), Shape{});
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.stride(-2), 4);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_THROW(t.size(3), Error);
  EXPECT_THROW(t.size(-4), Error);
  EXPECT_EQ(shape_str({4, 8}), "(4, 8)");
  EXPECT_EQ(shape_str({}), "()");
  EXPECT_EQ(shape_numel({3, 0, 2}), 0);
}

TEST(Tensor, IsContiguousForViews) {
  Tensor x = Tensor::from_vector(iota(12), {3, 4});
  Tensor xt = transpose(x, 0, 1);
  EXPECT_FALSE(xt.is_contiguous());
  EXPECT_EQ(xt.strides(), (Shape{1, 4}));
  EXPECT_EQ(xt.storage().get(), x.storage().get());

  Tensor cols = narrow(x, 1, 1, 2);  // (3, 2) inside rows of 4
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(cols.offset(), 1);
  Tensor rows = narrow(x, 0, 1, 2);  // whole rows: still contiguous, offset 4
  EXPECT_TRUE(rows.is_contiguous());
  EXPECT_EQ(rows.offset(), 4);
  EXPECT_EQ(vals(rows), iota(8, 4));

  // Size-1 dims do not break contiguity whatever their stride.
  Tensor one = x.as_strided({1, 12}, {999, 1}, 0);
  EXPECT_TRUE(one.is_contiguous());
  // A transposed (1, N) view is still contiguous.
  Tensor row = Tensor::from_vector(iota(5), {1, 5});
  EXPECT_TRUE(transpose(row, 0, 1).is_contiguous());
}

TEST(Tensor, ContiguousCopiesCorrectly) {
  Tensor x = Tensor::from_vector(iota(2 * 3 * 4), {2, 3, 4});
  EXPECT_TRUE(x.contiguous().same(x));  // already contiguous: the same handle

  Tensor v = transpose(x, 0, 2);  // (4, 3, 2)
  Tensor c = v.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_NE(c.storage().get(), x.storage().get());
  EXPECT_EQ(c.sizes(), (Shape{4, 3, 2}));
  std::vector<double> want;
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < 2; ++i) want.push_back(static_cast<double>(i * 12 + j * 4 + k));
  EXPECT_EQ(vals(c), want);

  Tensor n = narrow(narrow(x, 2, 1, 2), 1, 1, 2);  // (2, 2, 2)
  std::vector<double> want_n;
  for (int i = 0; i < 2; ++i)
    for (int j = 1; j < 3; ++j)
      for (int k = 1; k < 3; ++k) want_n.push_back(static_cast<double>(i * 12 + j * 4 + k));
  EXPECT_EQ(vals(n.contiguous()), want_n);

  // clone is a deep copy: writing the copy leaves the original alone.
  Tensor cl = x.clone();
  cl.data<double>()[0] = 100;
  EXPECT_EQ(x.data<double>()[0], 0.0);
}

TEST(Tensor, CopyFromAndFillThroughViews) {
  Tensor x = Tensor::zeros({3, 4}, DType::F64);
  Tensor col = narrow(x, 1, 2, 1);  // (3, 1)
  col.fill(7);
  Tensor t = transpose(x, 0, 1);
  narrow(t, 0, 0, 1).copy_from(Tensor::from_vector(std::vector<double>{1, 2, 3}, {1, 3}));
  EXPECT_EQ(vals(x), (std::vector<double>{1, 0, 7, 0, 2, 0, 7, 0, 3, 0, 7, 0}));
  EXPECT_THROW(x.copy_from(Tensor::zeros({4, 3}, DType::F64)), Error);
  EXPECT_THROW(x.as_strided({4, 4}, {4, 1}, 0), Error);  // past the storage
}

TEST(Tensor, ReshapeViewVersusCopy) {
  Tensor x = Tensor::from_vector(iota(24), {2, 3, 4});
  Tensor r = reshape(x, {6, -1});
  EXPECT_EQ(r.sizes(), (Shape{6, 4}));
  EXPECT_EQ(r.storage().get(), x.storage().get());  // contiguous: a view
  EXPECT_EQ(vals(r), iota(24));

  Tensor rows = narrow(x, 0, 1, 1);  // contiguous with an offset: still a view
  Tensor rr = reshape(rows, {12});
  EXPECT_EQ(rr.storage().get(), x.storage().get());
  EXPECT_EQ(vals(rr), iota(12, 12));

  Tensor t = transpose(x, 1, 2);  // (2, 4, 3), not contiguous: reshape copies
  Tensor rt = reshape(t, {2, 12});
  EXPECT_NE(rt.storage().get(), x.storage().get());
  EXPECT_EQ(vals(rt), vals(t.contiguous()));
}

TEST(Tensor, DtypeRoundTrips) {
  kvlab::Generator gen(3);
  Tensor a = kvtest::randn({5, 7}, gen, DType::F32);
  Tensor d = a.to(DType::F64);
  EXPECT_EQ(d.dtype(), DType::F64);
  EXPECT_EQ(vals(d.to(DType::F32)), vals(a));  // f32 -> f64 -> f32 is exact
  EXPECT_TRUE(a.to(DType::F32).same(a));       // same dtype: no copy

  // f64 -> f32 rounds to nearest.
  Tensor third = Tensor::full({1}, 1.0 / 3.0, DType::F64).to(DType::F32);
  EXPECT_EQ(third.to_vector<float>()[0], 1.0f / 3.0f);

  // f32 -> bf16 -> f32: rounded to nearest, so within half a bf16 ulp (8 significant bits:
  // half an ulp is 2^(e - 8) for |x| in [2^e, 2^(e+1))), hence relative error <= 2^-8.
  Tensor b = a.to(DType::BF16);
  EXPECT_EQ(b.dtype(), DType::BF16);
  EXPECT_EQ(b.storage()->nbytes(), 35u * 2u);
  const std::vector<double> back = vals(b.to(DType::F32)), orig = vals(a);
  for (size_t i = 0; i < orig.size(); ++i) {
    const double half_ulp = std::ldexp(1.0, std::ilogb(orig[i]) - 8);
    EXPECT_LE(std::abs(back[i] - orig[i]), half_ulp) << i << ": " << orig[i];
    EXPECT_LE(std::abs(back[i] - orig[i]), std::abs(orig[i]) * std::ldexp(1.0, -8)) << i;
  }
  // Values with 8 significant bits survive bf16 exactly; ties round to even.
  Tensor exact = Tensor::from_vector(std::vector<float>{1.5f, -2.0f, 0.15625f, 0.0f, 384.0f}, {5});
  EXPECT_EQ(vals(exact.to(DType::BF16).to(DType::F32)), vals(exact));
  const float tie = 1.0f + std::ldexp(1.0f, -8);  // halfway between 1 and 1 + 2^-7
  EXPECT_EQ(Tensor::full({1}, tie).to(DType::BF16).to(DType::F32).item(), 1.0);

  // Integer conversions.
  Tensor ids = Tensor::from_vector(std::vector<int32_t>{-3, 0, 41}, {3});
  EXPECT_EQ(vals(ids.to(DType::F32)), (std::vector<double>{-3, 0, 41}));
}

TEST(Tensor, PrintingNamesShapeAndDtype) {
  Tensor t = Tensor::from_vector(std::vector<double>{1.5, 2, 3, 4, 5, 6}, {2, 3});
  std::ostringstream os;
  os << t;
  const std::string s = os.str();
  EXPECT_NE(s.find("(2, 3)"), std::string::npos) << s;
  EXPECT_NE(s.find("f64"), std::string::npos) << s;
  EXPECT_NE(s.find("1.5"), std::string::npos) << s;
  const std::string i = Tensor::zeros({4}, DType::I32).str();
  EXPECT_NE(i.find("(4)"), std::string::npos) << i;
  EXPECT_NE(i.find("i32"), std::string::npos) << i;
  EXPECT_NE(Tensor::zeros({2}, DType::BF16).str().find("bf16"), std::string::npos);
  EXPECT_NE(Tensor().str().find("undefined"), std::string::npos);
  // Long tensors are elided.
  EXPECT_NE(Tensor::zeros({100}).str(4).find("..."), std::string::npos);
}

TEST(Tensor, CudaWithoutAVisibleGpuIsAClearError) {
#ifdef KVLAB_WITH_CUDA
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is visible";
  EXPECT_TRUE(kvtest::throws_with([] { Tensor::empty({2, 3}, DType::F32, Device::CUDA); },
                                  {"no CUDA GPU is visible"}));
  Tensor x = Tensor::zeros({2});
  EXPECT_TRUE(kvtest::throws_with([&] { x.to(Device::CUDA); }, {"no CUDA GPU is visible"}));
#else
  GTEST_SKIP() << "this build has no CUDA backend";
#endif
}

TEST(Tensor, CudaDeviceThrowsWithoutCudaBuild) {
  if (cuda_built()) GTEST_SKIP() << "this build carries the CUDA backend";
  EXPECT_TRUE(kvtest::throws_with(
      [] {
        Tensor::empty({2, 3}, DType::F32, Device::CUDA);
      },
      {"built without CUDA support"}));
  EXPECT_TRUE(kvtest::throws_with([] { Tensor::zeros({2}, DType::F64, Device::CUDA); },
                                  {"built without CUDA support"}));
  Tensor x = Tensor::zeros({2});
  EXPECT_TRUE(kvtest::throws_with([&] { x.to(Device::CUDA); }, {"built without CUDA support"}));
  EXPECT_TRUE(kvtest::throws_with([] { check_device_available(Device::CUDA); },
                                  {"built without CUDA support"}));
  EXPECT_NO_THROW(check_device_available(Device::CPU));
  EXPECT_STREQ(device_name(Device::CUDA), "cuda");
}

TEST(Tensor, DtypeNamesAndSizes) {
  EXPECT_STREQ(dtype_name(DType::F32), "f32");
  EXPECT_STREQ(dtype_name(DType::F64), "f64");
  EXPECT_STREQ(dtype_name(DType::I32), "i32");
  EXPECT_STREQ(dtype_name(DType::BF16), "bf16");
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(Tensor::empty({3, 5}, DType::F64).storage()->nbytes(), 120u);
}

TEST(Tensor, DetachSharesStorageWithoutHistory) {
  kvlab::Generator gen(1);
  Tensor x = kvtest::param({3}, gen);
  Tensor y = scale(x, 2.0);
  Tensor d = y.detach();
  EXPECT_EQ(d.storage().get(), y.storage().get());
  EXPECT_FALSE(d.requires_grad());
  EXPECT_FALSE(d.grad_fn());
  EXPECT_TRUE(y.grad_fn());
}

}  // namespace
