// Autograd bookkeeping: accumulation, broadcast reduction, explicit gradients, no-grad scopes,
// graph release, detach. Also checks that the gradient checker itself can fail.
#include <memory>

#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::param;
using kvtest::vals;

TEST(AutogradGraph, TensorUsedTwiceAccumulates) {
  Generator gen(1);
  Tensor x = param({3, 5}, gen);
  Tensor y = add(mul(x, x), x);  // dy/dx = 2x + 1
  sum(y).backward();
  std::vector<double> want = vals(x);
  for (double& v : want) v = 2 * v + 1;
  EXPECT_TRUE(all_close(x.grad(), want, 1e-14));
}

TEST(AutogradGraph, IntermediateUsedTwiceAccumulates) {
  Generator gen(2);
  Tensor x = param({4}, gen);
  Tensor h = scale(x, 3.0);
  Tensor y = add(mul(h, h), h);  // d/dx = (2h + 1) * 3
  sum(y).backward();
  std::vector<double> want = vals(x);
  for (double& v : want) v = (2 * 3 * v + 1) * 3;
  EXPECT_TRUE(all_close(x.grad(), want, 1e-13));
}

TEST(AutogradGraph, BroadcastGradientsSumToInputShape) {
  Generator gen(3);
  Tensor a = param({3, 17}, gen), b = param({17}, gen), c = param({1}, gen);
  Tensor y = mul(add(a, b), c);  // (3, 17)
  sum(y).backward();
  ASSERT_EQ(a.grad().sizes(), a.sizes());
  ASSERT_EQ(b.grad().sizes(), b.sizes());
  ASSERT_EQ(c.grad().sizes(), c.sizes());
  const double cv = c.item();
  EXPECT_TRUE(all_close(a.grad(), std::vector<double>(51, cv), 1e-14));
  EXPECT_TRUE(all_close(b.grad(), std::vector<double>(17, 3 * cv), 1e-14));
  double s = 0;
  const auto av = vals(a), bv = vals(b);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 17; ++j) s += av[i * 17 + j] + bv[j];
  EXPECT_TRUE(all_close(c.grad(), {s}, 1e-12));

  // (2, 3, 1) * (1, 17): each input's gradient sums over the other's broadcast dims.
  Tensor p = param({2, 3, 1}, gen), q = param({1, 17}, gen);
  sum(mul(p, q)).backward();
  ASSERT_EQ(p.grad().sizes(), (Shape{2, 3, 1}));
  ASSERT_EQ(q.grad().sizes(), (Shape{1, 17}));
  double qs = 0, ps = 0;
  for (double v : vals(q)) qs += v;
  for (double v : vals(p)) ps += v;
  EXPECT_TRUE(all_close(p.grad(), std::vector<double>(6, qs), 1e-12));
  EXPECT_TRUE(all_close(q.grad(), std::vector<double>(17, ps), 1e-12));
}

TEST(AutogradGraph, ExplicitGradientForNonScalarOutput) {
  Generator gen(4);
  Tensor x = param({2, 3}, gen);
  Tensor y = scale(x, -2.5);
  Tensor g = kvtest::randn({2, 3}, gen);
  y.backward(g);
  std::vector<double> want = vals(g);
  for (double& v : want) v *= -2.5;
  EXPECT_TRUE(all_close(x.grad(), want, 1e-15));

  // Without a gradient a non-scalar output is an error; a wrong-shaped one too.
  Tensor y2 = scale(x, 2.0);
  EXPECT_TRUE(kvtest::throws_with([&] { y2.backward(); }, {"backward", "(2, 3)"}));
  EXPECT_TRUE(kvtest::throws_with(
      [&] {
        y2.backward(Tensor::zeros({3, 2}, DType::F64));
      },
      {"backward", "(3, 2)", "(2, 3)"}));
}

TEST(AutogradGraph, BackwardOnLeafSetsItsGradient) {
  Generator gen(5);
  Tensor x = param({3}, gen);
  Tensor g = kvtest::randn({3}, gen);
  x.backward(g);
  EXPECT_TRUE(all_close(x.grad(), vals(g), 0));
  x.backward(g);
  std::vector<double> twice = vals(g);
  for (double& v : twice) v *= 2;
  EXPECT_TRUE(all_close(x.grad(), twice, 1e-15));
}

TEST(AutogradGraph, NoGradGuardRecordsNothing) {
  Generator gen(6);
  Tensor x = param({4, 8}, gen), w = param({5, 8}, gen), b = param({5}, gen);
  Tensor ln_w = param({5}, gen), ln_b = param({5}, gen);
  const uint64_t before = nodes_created();
  {
    NoGradGuard guard;
    EXPECT_FALSE(grad_enabled());
    Tensor h = linear(x, w, b);
    Tensor n = layer_norm(h, ln_w, ln_b);
    Tensor g = gelu(n);
    Tensor s = softmax(mul(g, g));
    Tensor r = reshape(transpose(s, 0, 1), {-1});
    Tensor l = mean(r);
    for (const Tensor* t : {&h, &n, &g, &s, &r, &l}) EXPECT_FALSE(t->grad_fn());
    {
      NoGradGuard nested;
      EXPECT_FALSE(grad_enabled());
    }
    EXPECT_FALSE(grad_enabled());  // the inner guard restores "off", not "on"
  }
  EXPECT_EQ(nodes_created(), before);
  EXPECT_TRUE(grad_enabled());

  // Outside the guard the same ops record.
  Tensor h = linear(x, w, b);
  EXPECT_TRUE(h.grad_fn());
  EXPECT_GT(nodes_created(), before);

  // Inputs that need no grad record nothing either.
  const uint64_t before2 = nodes_created();
  Tensor c = kvtest::randn({3}, gen);
  Tensor d = gelu(add(c, c));
  EXPECT_FALSE(d.grad_fn());
  EXPECT_EQ(nodes_created(), before2);
}

TEST(AutogradGraph, BackwardTwiceWithoutKeepGraphThrows) {
  Generator gen(7);
  Tensor x = param({3}, gen);
  Tensor y = sum(mul(gelu(x), x));
  y.backward();
  EXPECT_TRUE(kvtest::throws_with([&] { y.backward(); }, {"keep_graph"}));
}

TEST(AutogradGraph, KeepGraphTwiceAccumulatesDouble) {
  Generator gen(8);
  Tensor x = param({5}, gen);
  Tensor y = sum(mul(gelu(x), x));
  y.backward(Tensor(), /*keep_graph=*/true);
  const std::vector<double> once = vals(x.grad());
  y.backward(Tensor(), /*keep_graph=*/true);
  std::vector<double> twice = once;
  for (double& v : twice) v *= 2;
  EXPECT_TRUE(all_close(x.grad(), twice, 1e-14));
  y.backward();  // a third pass releases the graph
  EXPECT_THROW(y.backward(), Error);
}

TEST(AutogradGraph, ZeroGradStartsFresh) {
  Generator gen(9);
  Tensor x = param({4}, gen);
  sum(scale(x, 3.0)).backward();
  sum(scale(x, 3.0)).backward();
  EXPECT_TRUE(all_close(x.grad(), std::vector<double>(4, 6.0), 1e-15));
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
  sum(scale(x, 3.0)).backward();
  EXPECT_TRUE(all_close(x.grad(), std::vector<double>(4, 3.0), 1e-15));
}

TEST(AutogradGraph, DetachStopsGradients) {
  Generator gen(10);
  Tensor x = param({6}, gen);
  Tensor y = mul(x, x.detach());  // gradient x, not 2x
  sum(y).backward();
  EXPECT_TRUE(all_close(x.grad(), vals(x), 1e-15));

  Tensor z = sum(gelu(x).detach());
  EXPECT_FALSE(z.grad_fn());
  EXPECT_THROW(z.backward(), Error);  // nothing requires grad
}

TEST(AutogradGraph, RequiresGradOnIntegerThrows) {
  Tensor ids = Tensor::zeros({3}, DType::I32);
  EXPECT_TRUE(kvtest::throws_with([&] { ids.set_requires_grad(true); }, {"requires_grad", "i32"}));
  EXPECT_NO_THROW(ids.set_requires_grad(false));
  EXPECT_THROW(Tensor::zeros({1}, DType::BF16).set_requires_grad(), Error);
  EXPECT_NO_THROW(Tensor::zeros({1}, DType::F32).set_requires_grad());
}

TEST(AutogradGraph, InputsWithoutRequiresGradGetNoGradient) {
  Generator gen(11);
  Tensor x = param({3}, gen);
  Tensor c = kvtest::randn({3}, gen);
  sum(mul(x, c)).backward();
  EXPECT_TRUE(all_close(x.grad(), vals(c), 0));
  EXPECT_FALSE(c.grad().defined());
}

TEST(AutogradGraph, ReleasedGraphFreesSavedActivations) {
  Generator gen(12);
  Tensor x = param({64}, gen);
  Tensor y;
  std::weak_ptr<Storage> h_storage;
  {
    Tensor h = gelu(x);  // fresh storage, saved by mul below
    h_storage = h.storage();
    y = sum(mul(h, h));
  }
  EXPECT_FALSE(h_storage.expired());  // the graph keeps it for backward
  y.backward();
  EXPECT_TRUE(h_storage.expired());  // released with the graph
}

TEST(AutogradGraph, GradientsThroughViewChains) {
  Generator gen(13);
  Tensor x = param({2, 3, 4}, gen);
  kvtest::Fn f = [](const std::vector<Tensor>& in) {
    Tensor t = transpose(in[0], 0, 2);  // (4, 3, 2)
    Tensor n = narrow(t, 1, 1, 2);      // (4, 2, 2)
    Tensor r = reshape(n, {8, 2});
    return mul(r, r);
  };
  EXPECT_TRUE(kvtest::gradcheck(f, {x}));
  // Elements not reached by the narrow get exactly zero.
  const auto g = vals(x.grad());
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) EXPECT_EQ(g[i * 12 + 0 * 4 + k], 0.0);
}

TEST(AutogradGraph, LeafBackwardDoesNotAliasTheGivenGradient) {
  // ENGINE BUG (autograd/graph.cpp:80, run_backward, leaf-root branch): x.backward(g) on a leaf
  // stores g.contiguous() -- g itself -- as x.grad(), so x.grad() and the caller's g share storage
  // and an in-place change to either (g.fill, an optimizer scaling grads) silently changes the
  // other. The node path already clones for this reason; the leaf path should too.
  Generator gen(17);
  Tensor x = param({4}, gen);
  Tensor g = kvtest::randn({4}, gen);
  const std::vector<double> gv = vals(g);
  x.backward(g);
  g.fill(0.0);
  EXPECT_TRUE(all_close(x.grad(), gv, 0));
  EXPECT_NE(x.grad().storage().get(), g.storage().get());
}

TEST(AutogradGraph, BackwardGradientDtypeMustMatchOutput) {
  // ENGINE BUG (autograd/graph.cpp:74, run_backward): the given gradient's shape is checked but not
  // its dtype, so an f64 gradient for an f32 output flows through and leaves an f64 .grad on an f32
  // parameter (or fails later deep inside a node with an unrelated message).
  Generator gen(18);
  Tensor x = param({3}, gen, DType::F32);
  Tensor y = scale(x, 2.0);
  EXPECT_TRUE(kvtest::throws_with([&] { y.backward(Tensor::full({3}, 1.0, DType::F64)); },
                                  {"backward", "f64", "f32"}));
  EXPECT_TRUE(!x.grad().defined() || x.grad().dtype() == DType::F32);
}

TEST(AutogradGraph, GradientDtypeFollowsTheLeaf) {
  Generator gen(19);
  Tensor x = param({2, 3}, gen, DType::F32);
  Tensor w = param({4, 3}, gen, DType::F32);
  mean(gelu(linear(x, w))).backward();
  EXPECT_EQ(x.grad().dtype(), DType::F32);
  EXPECT_EQ(w.grad().dtype(), DType::F32);
  EXPECT_EQ(x.grad().sizes(), x.sizes());
  EXPECT_TRUE(x.grad().is_contiguous());
}

TEST(AutogradErrors, CheckAndAssertThrowKvlabError) {
  const auto check = [](int v) {
    KVLAB_CHECK(v > 0, "thing: value ", v, " in ", shape_str({4, 8}));
  };
  EXPECT_NO_THROW(check(1));
  EXPECT_TRUE(kvtest::throws_with([&] { check(-3); }, {"thing: value -3 in (4, 8)"}));
  const auto assert_fn = [](int v) { KVLAB_ASSERT(v == 1, "v=", v); };
  EXPECT_TRUE(kvtest::throws_with([&] { assert_fn(2); },
                                  {"internal error at", "test_graph.cpp", "v == 1", "v=2"}));
  // kvlab::Error is a std::runtime_error.
  EXPECT_THROW(check(0), std::runtime_error);
}

// A deliberately wrong op: forward x^2, backward claims x (instead of 2x).
struct WrongSquareNode : Node {
  Tensor x;
  const char* name() const override { return "wrong_square"; }
  std::vector<Tensor> backward(const Tensor& g) override { return {mul(g, x)}; }
  void release() override { x = Tensor(); }
};

Tensor wrong_square(const Tensor& x) {
  Tensor out;
  {
    NoGradGuard ng;
    out = mul(x, x);
  }
  if (needs_grad({&x})) {
    auto node = std::make_shared<WrongSquareNode>();
    node->x = x.detach();
    record(out, node, {&x});
  }
  return out;
}

TEST(Gradcheck, DetectsAWrongGradient) {
  Generator gen(14);
  Tensor x = param({3, 3}, gen);
  const auto r =
      kvtest::gradcheck([](const std::vector<Tensor>& in) { return wrong_square(in[0]); }, {x});
  EXPECT_FALSE(r);
  EXPECT_NE(std::string(r.message()).find("differ"), std::string::npos) << r.message();
}

TEST(Gradcheck, AcceptsACorrectGradientAndSkipsIntegerInputs) {
  Generator gen(15);
  Tensor x = param({3, 3}, gen);
  Tensor ids = kvtest::ids_tensor({0, 2, 1}, {3});
  EXPECT_TRUE(kvtest::gradcheck(
      [](const std::vector<Tensor>& in) { return embedding(in[1], mul(in[0], in[0])); }, {x, ids}));
}

TEST(Gradcheck, RejectsInputsWithoutGradient) {
  Generator gen(16);
  Tensor x = param({3}, gen), y = param({3}, gen);
  // y is a differentiable input that f ignores: it receives no gradient, which the checker
  // reports rather than passing silently.
  EXPECT_FALSE(
      kvtest::gradcheck([](const std::vector<Tensor>& in) { return gelu(in[0]); }, {x, y}));
  EXPECT_FALSE(kvtest::gradcheck([](const std::vector<Tensor>& in) { return gelu(in[0]); },
                                 {kvtest::randn({3}, gen)}));
}

}  // namespace
