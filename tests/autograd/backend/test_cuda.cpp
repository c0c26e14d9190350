// CPU equals CUDA: every op forward and backward on fresh random inputs, with the GPU's output
// buffers poisoned (NaN) before the compared run. Label `cuda`: skipped when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "autograd/backend/cuda/runtime.h"
#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::randn;

bool have_gpu() { return cuda::device_count() > 0; }
#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA GPU is visible"

// max |got - want| <= tol * max |want| (relative to the largest reference value), NaN fails.
::testing::AssertionResult close_rel(const Tensor& got, const Tensor& want, double tol) {
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << got.shape_str() << " vs " << want.shape_str();
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  double scale = 0, worst = 0;
  for (double x : w) scale = std::max(scale, std::abs(x));
  for (size_t i = 0; i < g.size(); ++i) {
    const double e = std::abs(g[i] - w[i]);
    if (!(e <= worst)) worst = e;  // NaN sticks
  }
  if (worst <= tol * std::max(scale, 1e-30)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "max abs error " << worst << " vs max |want| " << scale << " (tol " << tol << ")";
}

using OpFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

struct Outputs {
  std::vector<Tensor> values;  // the op's outputs, then the float inputs' gradients
};

// Leaves on `device` (floats require grad), the outputs, and the gradients of
// L = sum_i sum(out_i * weight_i), all copied to the CPU.
Outputs run_on(Device device, const OpFn& fn, const std::vector<Tensor>& inputs,
               const std::vector<Tensor>& weights) {
  std::vector<Tensor> leaves;
  for (const Tensor& x : inputs) {
    Tensor l = x.to(device).clone();
    if (l.dtype() == DType::F32) l.set_requires_grad(true);
    leaves.push_back(l);
  }
  const std::vector<Tensor> outs = fn(leaves);
  Outputs r;
  Tensor loss;
  for (size_t i = 0; i < outs.size(); ++i) {
    r.values.push_back(outs[i].to(Device::CPU).clone());
    if (outs[i].requires_grad() || outs[i].grad_fn()) {
      const Tensor term = sum(mul(outs[i], weights[i].to(device)));
      loss = loss.defined() ? add(loss, term) : term;
    }
  }
  if (loss.defined()) loss.backward();
  for (const Tensor& l : leaves)
    if (l.requires_grad())
      r.values.push_back(l.grad().defined() ? l.grad().to(Device::CPU) : Tensor::zeros(l.sizes()));
  return r;
}

// Runs fn on the CPU and twice on the GPU; before the second GPU run every block in the device
// allocator's cache (which the first run filled with blocks of every size it needs) is set to
// NaN, so a kernel that leaves part of its output unwritten fails the comparison.
void expect_cuda_matches_cpu(const std::string& what, const OpFn& fn,
                             const std::vector<Tensor>& inputs, double tol = 1e-5) {
  SCOPED_TRACE(what);
  Generator gen(42);
  std::vector<Tensor> weights;
  {
    std::vector<Tensor> probe;
    for (const Tensor& x : inputs) probe.push_back(x.clone());
    for (const Tensor& o : fn(probe)) weights.push_back(randn(o.sizes(), gen, DType::F32));
  }
  const Outputs want = run_on(Device::CPU, fn, inputs, weights);
  run_on(Device::CUDA, fn, inputs, weights);
  allocator_for(Device::CUDA).fill_cached(0xFF);
  const Outputs got = run_on(Device::CUDA, fn, inputs, weights);
  ASSERT_EQ(got.values.size(), want.values.size());
  for (size_t i = 0; i < got.values.size(); ++i)
    EXPECT_TRUE(close_rel(got.values[i], want.values[i], tol)) << "result " << i;
}

Tensor rnd(const Shape& s, Generator& gen, double scale = 1.0) {
  return randn(s, gen, DType::F32, scale);
}

TEST(Cuda, ElementwiseWithBroadcast) {
  REQUIRE_GPU();
  Generator gen(1);
  expect_cuda_matches_cpu("add", [](auto& x) { return std::vector<Tensor>{add(x[0], x[1])}; },
                          {rnd({3, 17, 33}, gen), rnd({33}, gen)});
  expect_cuda_matches_cpu("sub", [](auto& x) { return std::vector<Tensor>{sub(x[0], x[1])}; },
                          {rnd({7, 1}, gen), rnd({1, 9}, gen)});
  expect_cuda_matches_cpu("mul", [](auto& x) { return std::vector<Tensor>{mul(x[0], x[1])}; },
                          {rnd({2, 5, 1, 3}, gen), rnd({4, 1}, gen)});
  expect_cuda_matches_cpu("scale", [](auto& x) { return std::vector<Tensor>{scale(x[0], -1.7)}; },
                          {rnd({1000}, gen)});
  expect_cuda_matches_cpu("gelu", [](auto& x) { return std::vector<Tensor>{gelu(x[0])}; },
                          {rnd({5, 77}, gen, 3.0)});
  expect_cuda_matches_cpu("sum and mean",
                          [](auto& x) {
                            return std::vector<Tensor>{sum(x[0]), mean(x[0])};
                          },
                          {rnd({100003}, gen)});
}

TEST(Cuda, DropoutMaskEqualsCpu) {
  REQUIRE_GPU();
  Generator gen(2);
  expect_cuda_matches_cpu(
      "dropout", [](auto& x) { return std::vector<Tensor>{dropout(x[0], 0.3, 99)}; },
      {rnd({4, 1031}, gen)}, 0.0);
}

TEST(Cuda, MatmulAndLinear) {
  REQUIRE_GPU();
  Generator gen(3);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Shape a = ta ? Shape{2, 3, 9, 17} : Shape{2, 3, 17, 9};
      const Shape b = tb ? Shape{2, 3, 5, 9} : Shape{2, 3, 9, 5};
      expect_cuda_matches_cpu(
          "batched matmul",
          [&](auto& x) { return std::vector<Tensor>{matmul(x[0], x[1], ta, tb)}; },
          {rnd(a, gen), rnd(b, gen)});
    }
  expect_cuda_matches_cpu("shared-b matmul",
                          [](auto& x) { return std::vector<Tensor>{matmul(x[0], x[1])}; },
                          {rnd({4, 7, 9}, gen), rnd({9, 5}, gen)});
  expect_cuda_matches_cpu("linear with bias",
                          [](auto& x) { return std::vector<Tensor>{linear(x[0], x[1], x[2])}; },
                          {rnd({3, 17, 33}, gen), rnd({20, 33}, gen), rnd({20}, gen)});
  expect_cuda_matches_cpu("linear 256 x 768 x 3072",
                          [](auto& x) { return std::vector<Tensor>{linear(x[0], x[1])}; },
                          {rnd({256, 768}, gen), rnd({3072, 768}, gen, 0.02)});
}

TEST(Cuda, NormSoftmaxEmbeddingLoss) {
  REQUIRE_GPU();
  Generator gen(4);
  expect_cuda_matches_cpu("layer_norm",
                          [](auto& x) { return std::vector<Tensor>{layer_norm(x[0], x[1], x[2])}; },
                          {rnd({5, 7, 33}, gen, 2.0), rnd({33}, gen), rnd({33}, gen)});
  expect_cuda_matches_cpu("layer_norm 600 x 768",
                          [](auto& x) { return std::vector<Tensor>{layer_norm(x[0], x[1], x[2])}; },
                          {rnd({600, 768}, gen), rnd({768}, gen), rnd({768}, gen)});
  expect_cuda_matches_cpu("rms_norm 600 x 768",
                          [](auto& x) { return std::vector<Tensor>{rms_norm(x[0], x[1])}; },
                          {rnd({600, 768}, gen, 2.0), rnd({768}, gen)});
  expect_cuda_matches_cpu("layer_norm without bias",
                          [](auto& x) { return std::vector<Tensor>{layer_norm(x[0], x[1], Tensor())}; },
                          {rnd({5, 7, 33}, gen, 2.0), rnd({33}, gen)});
  expect_cuda_matches_cpu("swiglu", [](auto& x) { return std::vector<Tensor>{swiglu(x[0], x[1])}; },
                          {rnd({7, 3, 88}, gen, 3.0), rnd({7, 3, 88}, gen)});
  const Tensor positions =
      Tensor::from_vector(std::vector<int32_t>{0, 5, 63, 17, 2, 40}, {2, 3});
  expect_cuda_matches_cpu(
      "rope",
      [&](auto& x) {
        const Device d = x[0].device();
        return std::vector<Tensor>{
            rope(x[0], positions.to(d), rope_table(64, 32, 10000.0, DType::F32, d))};
      },
      {rnd({2, 3, 4, 32}, gen)});
  expect_cuda_matches_cpu("softmax", [](auto& x) { return std::vector<Tensor>{softmax(x[0])}; },
                          {rnd({6, 37}, gen, 3.0)});
  const Tensor ids = kvtest::ids_tensor({1, 3, 3, 0, 10, 3, 7, 1, 1, 5, 0, 2}, {3, 4});
  expect_cuda_matches_cpu(
      "embedding with repeated ids",
      [&](auto& x) { return std::vector<Tensor>{embedding(ids.to(x[0].device()), x[0])}; },
      {rnd({11, 19}, gen)});
  std::vector<int32_t> t(23);
  for (size_t i = 0; i < t.size(); ++i) t[i] = i % 5 == 2 ? -1 : static_cast<int32_t>((i * 7) % 50);
  const Tensor targets = Tensor::from_vector(t, {23});
  expect_cuda_matches_cpu(
      "cross_entropy with ignored targets",
      [&](auto& x) {
        return std::vector<Tensor>{cross_entropy(x[0], targets.to(x[0].device()), -1)};
      },
      {rnd({23, 50}, gen, 2.0)});
  expect_cuda_matches_cpu("cross_entropy 512 x 50304",
                          [&](auto& x) {
                            std::vector<int32_t> tt(512);
                            for (size_t i = 0; i < tt.size(); ++i)
                              tt[i] = static_cast<int32_t>((i * 977) % 50304);
                            return std::vector<Tensor>{cross_entropy(
                                x[0], Tensor::from_vector(tt, {512}).to(x[0].device()))};
                          },
                          {rnd({512, 50304}, gen)});
}

TEST(Cuda, CopiesAndConversions) {
  REQUIRE_GPU();
  Generator gen(5);
  expect_cuda_matches_cpu(
      "transpose, narrow, concat",
      [](auto& x) {
        const Tensor t = transpose(x[0], 0, 2).contiguous();
        return std::vector<Tensor>{t, concat({narrow(x[0], 1, 1, 3), x[1]}, 1)};
      },
      {rnd({4, 5, 6}, gen), rnd({4, 2, 6}, gen)}, 0.0);
  const Tensor x = rnd({3, 257}, gen, 100.0);
  // bf16 rounding (nearest even) gives the same bits on both devices.
  EXPECT_TRUE(close_rel(x.to(Device::CUDA).to(DType::BF16).to(DType::F32).to(Device::CPU),
                        x.to(DType::BF16).to(DType::F32), 0.0));
  const Tensor strided = transpose(x, 0, 1);
  EXPECT_TRUE(close_rel(strided.to(Device::CUDA).to(DType::F64).to(Device::CPU),
                        strided.to(DType::F64), 0.0));
  Tensor z = Tensor::zeros({5, 5}, DType::F32, Device::CUDA);
  narrow(z, 0, 1, 2).fill(3.5);
  EXPECT_DOUBLE_EQ(z.to(Device::CPU).to_vector<float>()[5], 3.5);
  EXPECT_DOUBLE_EQ(z.to(Device::CPU).to_vector<float>()[0], 0.0);
}

struct AttnCase {
  int64_t B, NH, NKV, T, S, HS;
  std::vector<int64_t> lengths;
  double dropout;
};

TEST(Cuda, CausalAttentionForwardBackward) {
  REQUIRE_GPU();
  Generator gen(6);
  std::vector<int64_t> many(70);
  for (size_t b = 0; b < many.size(); ++b) many[b] = 3 + static_cast<int64_t>(b % 3);
  std::vector<int64_t> decode_lengths(70);
  for (size_t b = 0; b < decode_lengths.size(); ++b)
    decode_lengths[b] = 1 + static_cast<int64_t>(b * 149 / 69);
  const std::vector<AttnCase> cases = {
      {2, 4, 4, 17, 17, 32, {}, 0.0},       // MHA
      {2, 6, 2, 9, 21, 64, {21, 15}, 0.0},  // GQA, T < S, per-row lengths
      {1, 8, 1, 1, 40, 64, {}, 0.0},        // MQA decode step
      {3, 4, 2, 33, 33, 80, {}, 0.0},       // head size not a power of two
      {2, 4, 2, 40, 40, 128, {}, 0.2},      // dropout
      {70, 2, 1, 3, 5, 16, many, 0.0},      // lengths for more rows than travel inline
      {1, 2, 2, 130, 130, 256, {}, 0.0},    // largest head size, several tiles
      // Decode (T = 1) through the split-key kernel: several splits, rows of different
      // lengths (one of 5 keys), more than 16 heads per KV head, lengths in a device buffer.
      {3, 8, 2, 1, 700, 64, {700, 5, 333}, 0.0},
      {1, 32, 1, 1, 300, 256, {}, 0.0},
      {70, 4, 4, 1, 150, 16, decode_lengths, 0.0},
  };
  for (const AttnCase& c : cases) {
    AttentionOptions o;
    o.dropout = c.dropout;
    o.seed = 7;
    o.kv_lengths = c.lengths;
    expect_cuda_matches_cpu(
        "attention B" + std::to_string(c.B) + " NH" + std::to_string(c.NH) + " NKV" +
            std::to_string(c.NKV) + " T" + std::to_string(c.T) + " S" + std::to_string(c.S) +
            " HS" + std::to_string(c.HS),
        [&](auto& x) { return std::vector<Tensor>{causal_attention(x[0], x[1], x[2], o)}; },
        {rnd({c.B, c.NH, c.T, c.HS}, gen), rnd({c.B, c.NKV, c.S, c.HS}, gen),
         rnd({c.B, c.NKV, c.S, c.HS}, gen)});
  }
}

// K and V in bf16 (a bf16 KV cache) under f32 queries: the GPU kernels, which widen them as
// they stage tiles, equal the CPU's, in prefill (flash kernel) and decode (split-key kernel,
// several splits and per-row lengths at S = 300 and 1000).
TEST(Cuda, AttentionOverBf16KeysAndValues) {
  REQUIRE_GPU();
  Generator gen(19);
  NoGradGuard no_grad;
  struct C {
    int64_t B, NH, NKV, T, S, HS;
    std::vector<int64_t> lens;
  };
  for (const C& c : {C{2, 4, 2, 5, 9, 32, {}}, C{2, 4, 4, 7, 40, 64, {40, 12}},
                     C{3, 8, 2, 1, 300, 64, {300, 17, 129}}, C{1, 4, 1, 1, 1000, 128, {}}}) {
    SCOPED_TRACE(::testing::Message() << "B " << c.B << " NH " << c.NH << " NKV " << c.NKV
                                      << " T " << c.T << " S " << c.S);
    const Tensor q = rnd({c.B, c.NH, c.T, c.HS}, gen);
    const Tensor k = rnd({c.B, c.NKV, c.S, c.HS}, gen).to(DType::BF16);
    const Tensor v = rnd({c.B, c.NKV, c.S, c.HS}, gen).to(DType::BF16);
    AttentionOptions o;
    o.kv_lengths = c.lens;
    const Tensor want = causal_attention(q, k, v, o);
    allocator_for(Device::CUDA).fill_cached(0xFF);
    const Tensor got =
        causal_attention(q.to(Device::CUDA), k.to(Device::CUDA), v.to(Device::CUDA), o);
    EXPECT_TRUE(close_rel(got.to(Device::CPU), want, 1e-5));
  }
}

TEST(Cuda, Bf16ProductsStayWithinBf16RoundingOfF32) {
  REQUIRE_GPU();
  Generator gen(9);
  const MatmulPrecisionGuard bf16(MatmulPrecision::BF16);  // the CPU side still computes f32
  expect_cuda_matches_cpu(
      "linear with bias, bf16 products",
      [](auto& x) { return std::vector<Tensor>{linear(x[0], x[1], x[2])}; },
      {rnd({3, 17, 96}, gen), rnd({40, 96}, gen), rnd({40}, gen)}, 1e-2);
  expect_cuda_matches_cpu(
      "batched matmul, bf16 products",
      [](auto& x) { return std::vector<Tensor>{matmul(x[0], x[1], false, true)}; },
      {rnd({2, 3, 17, 64}, gen), rnd({2, 3, 9, 64}, gen)}, 1e-2);
}

TEST(Cuda, MixedDevicesAreAClearError) {
  REQUIRE_GPU();
  const Tensor a = Tensor::zeros({2, 3}), b = Tensor::zeros({2, 3}, DType::F32, Device::CUDA);
  EXPECT_TRUE(kvtest::throws_with([&] { add(a, b); }, {"add", "different devices"}));
  EXPECT_TRUE(
      kvtest::throws_with([&] { matmul(a, transpose(b)); }, {"matmul", "different devices"}));
}

}  // namespace
