#include <cmath>

#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"

namespace kvlab {

using namespace ops_detail;

namespace {

// Broadcast shape of a and b (NumPy rules) and each operand's strides over it (0 where it is
// broadcast).
Shape broadcast_shape(const char* op, const Tensor& a, const Tensor& b) {
  const Shape &sa = a.sizes(), &sb = b.sizes();
  const size_t nd = std::max(sa.size(), sb.size());
  Shape out(nd);
  for (size_t i = 0; i < nd; ++i) {
    const int64_t da = i < nd - sa.size() ? 1 : sa[i - (nd - sa.size())];
    const int64_t db = i < nd - sb.size() ? 1 : sb[i - (nd - sb.size())];
    KVLAB_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", a.shape_str(), " and ",
                b.shape_str(), " cannot be broadcast");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Strides broadcast_strides(const Tensor& t, const Shape& out) {
  const size_t nd = out.size(), off = nd - t.sizes().size();
  Strides s(nd, 0);
  for (size_t i = off; i < nd; ++i)
    s[i] = t.sizes()[i - off] == 1 && out[i] != 1 ? 0 : t.strides()[i - off];
  return s;
}

// Merges adjacent dims that both operands walk contiguously (the output always does), so
// (B, T, C) + (T, C) runs as a (B, T*C) + (T*C) row loop.
void coalesce(Shape& sizes, Strides& as, Strides& bs) {
  Shape s2;
  Strides a2, b2;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (!s2.empty() && a2.back() == as[d] * sizes[d] && b2.back() == bs[d] * sizes[d]) {
      s2.back() *= sizes[d];
      a2.back() = as[d];
      b2.back() = bs[d];
    } else {
      s2.push_back(sizes[d]);
      a2.push_back(as[d]);
      b2.push_back(bs[d]);
    }
  }
  sizes = std::move(s2);
  as = std::move(a2);
  bs = std::move(b2);
}

Tensor binary_raw(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  check_defined(name, a);
  check_defined(name, b);
  check_same_dtype(name, a, b);
  check_same_device(name, a, b);
  const Shape out_shape = broadcast_shape(name, a, b);
  Tensor out = Tensor::empty(out_shape, a.dtype(), a.device());
  Shape sizes = out_shape;
  Strides as = broadcast_strides(a, out_shape), bs = broadcast_strides(b, out_shape);
  coalesce(sizes, as, bs);
  dispatch_float(a.dtype(), name, [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(a.device(),
                 binary_forward<T>(op, out.data<T>(), sizes, a.data<T>(), as, b.data<T>(), bs));
  });
  return out;
}

struct BinaryNode : Node {
  BinaryOp op;
  Shape a_shape, b_shape;
  Tensor a, b;  // saved for Mul only
  const char* name() const override {
    return op == BinaryOp::Add ? "add" : op == BinaryOp::Sub ? "sub" : "mul";
  }
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor ga, gb;
    if (inputs[0].defined()) {
      ga = op == BinaryOp::Mul ? binary_raw(BinaryOp::Mul, "mul", g, b) : g;
      ga = sum_to(ga, a_shape);
    }
    if (inputs[1].defined()) {
      gb = op == BinaryOp::Mul ? binary_raw(BinaryOp::Mul, "mul", g, a) : g;
      if (op == BinaryOp::Sub) gb = scale(gb, -1.0);
      gb = sum_to(gb, b_shape);
    }
    return {ga, gb};
  }
  void release() override {
    a = Tensor();
    b = Tensor();
  }
};

Tensor binary(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(op, name, a, b);
  if (needs_grad({&a, &b})) {
    auto node = std::make_shared<BinaryNode>();
    node->op = op;
    node->a_shape = a.sizes();
    node->b_shape = b.sizes();
    if (op == BinaryOp::Mul) {
      node->a = a.detach();
      node->b = b.detach();
    }
    record(out, node, {&a, &b});
  }
  return out;
}

struct ScaleNode : Node {
  double s;
  const char* name() const override { return "scale"; }
  std::vector<Tensor> backward(const Tensor& g) override { return {scale(g, s)}; }
  void release() override {}
};

struct GeluNode : Node {
  Tensor x;
  const char* name() const override { return "gelu"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor gc = g.contiguous();
    Tensor dx = Tensor::empty(x.sizes(), x.dtype(), x.device());
    dispatch_float(x.dtype(), "gelu", [&](auto tag) {
      using T = decltype(tag);
      KVLAB_KERNEL(x.device(),
                   gelu_backward<T>(dx.data<T>(), gc.data<T>(), x.data<T>(), x.numel()));
    });
    return {dx};
  }
  void release() override { x = Tensor(); }
};

struct SwigluNode : Node {
  Tensor gate, up;  // contiguous, of one shape
  const char* name() const override { return "swiglu"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    const Tensor gc = g.contiguous();
    Tensor dgate = Tensor::empty(gate.sizes(), gate.dtype(), gate.device());
    Tensor dup = Tensor::empty(gate.sizes(), gate.dtype(), gate.device());
    dispatch_float(gate.dtype(), "swiglu", [&](auto tag) {
      using T = decltype(tag);
      KVLAB_KERNEL(gate.device(),
                   swiglu_backward<T>(dgate.data<T>(), dup.data<T>(), gc.data<T>(),
                                      gate.data<T>(), up.data<T>(), gate.numel()));
    });
    return {dgate, dup};
  }
  void release() override { gate = up = Tensor(); }
};

// Rotates x (N, H, HS) by each row's angles; the backward rotates the gradient back.
void rope_apply(Tensor& out, const Tensor& x, const Tensor& positions, const Tensor& table,
                bool inverse) {
  const int64_t HS = x.size(-1), H = x.size(-2), N = HS * H != 0 ? x.numel() / (H * HS) : 0;
  dispatch_float(x.dtype(), "rope", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(x.device(), rope_forward<T>(out.data<T>(), x.data<T>(),
                                             positions.data<int32_t>(), table.data<T>(), N, H,
                                             HS, inverse));
  });
}

struct RopeNode : Node {
  Tensor positions, table;
  const char* name() const override { return "rope"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    const Tensor gc = g.contiguous();
    Tensor dx = Tensor::empty(gc.sizes(), gc.dtype(), gc.device());
    rope_apply(dx, gc, positions, table, true);
    return {dx};
  }
  void release() override { positions = table = Tensor(); }
};

struct DropoutNode : Node {
  double p;
  uint64_t seed;
  const char* name() const override { return "dropout"; }
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor gc = g.contiguous();
    Tensor dx = Tensor::empty(gc.sizes(), gc.dtype(), gc.device());
    dispatch_float(gc.dtype(), "dropout", [&](auto tag) {
      using T = decltype(tag);
      KVLAB_KERNEL(gc.device(),
                   dropout_backward<T>(dx.data<T>(), gc.data<T>(), gc.numel(), p, seed));
    });
    return {dx};
  }
  void release() override {}
};

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Add, "add", a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Sub, "sub", a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Mul, "mul", a, b); }

Tensor scale(const Tensor& x, double s) {
  check_defined("scale", x);
  Tensor xc = x.contiguous();
  Tensor out = Tensor::empty(x.sizes(), x.dtype(), x.device());
  dispatch_float(x.dtype(), "scale", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(x.device(),
                 scale_forward<T>(out.data<T>(), xc.data<T>(), static_cast<T>(s), x.numel()));
  });
  if (needs_grad({&x})) {
    auto node = std::make_shared<ScaleNode>();
    node->s = s;
    record(out, node, {&x});
  }
  return out;
}

Tensor gelu(const Tensor& x) {
  check_defined("gelu", x);
  Tensor xc = x.contiguous();
  Tensor out = Tensor::empty(x.sizes(), x.dtype(), x.device());
  dispatch_float(x.dtype(), "gelu", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(x.device(), gelu_forward<T>(out.data<T>(), xc.data<T>(), x.numel()));
  });
  if (needs_grad({&x})) {
    auto node = std::make_shared<GeluNode>();
    node->x = xc.detach();
    record(out, node, {&x});
  }
  return out;
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  check_defined("swiglu", gate);
  check_defined("swiglu", up);
  check_same_dtype("swiglu", gate, up);
  check_same_device("swiglu", gate, up);
  KVLAB_CHECK(gate.sizes() == up.sizes(), "swiglu: gate ", gate.shape_str(), " and up ",
              up.shape_str(), " must have one shape");
  const Tensor gc = gate.contiguous(), uc = up.contiguous();
  Tensor out = Tensor::empty(gate.sizes(), gate.dtype(), gate.device());
  dispatch_float(gate.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(gate.device(), swiglu_forward<T>(out.data<T>(), gc.data<T>(), uc.data<T>(),
                                                  gate.numel()));
  });
  if (needs_grad({&gate, &up})) {
    auto node = std::make_shared<SwigluNode>();
    node->gate = gc.detach();
    node->up = uc.detach();
    record(out, node, {&gate, &up});
  }
  return out;
}

Tensor rope(const Tensor& x, const Tensor& positions, const Tensor& table) {
  check_defined("rope", x);
  check_defined("rope", positions);
  check_defined("rope", table);
  check_same_dtype("rope", x, table);
  check_same_device("rope", x, table);
  check_same_device("rope", x, positions);
  KVLAB_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "rope: input ", x.shape_str(),
              " must be (..., H, HS) with HS even");
  const int64_t HS = x.size(-1), slices = x.numel() / (HS * x.size(-2));
  KVLAB_CHECK(positions.dtype() == DType::I32 && positions.numel() == slices,
              "rope: positions ", positions.shape_str(), " ", dtype_name(positions.dtype()),
              " must be i32 with one entry per (H, HS) slice of ", x.shape_str());
  KVLAB_CHECK(table.dim() == 2 && table.size(1) == HS, "rope: table ", table.shape_str(),
              " does not fit head size ", HS);
  const Tensor pc = positions.contiguous();
  if (pc.device() == Device::CPU)  // a device's positions were checked where they were made
    for (int64_t i = 0; i < slices; ++i) {
      const int32_t p = pc.data<int32_t>()[i];
      KVLAB_CHECK(p >= 0 && p < table.size(0), "rope: position ", p, " outside the table's ",
                  table.size(0));
    }
  const Tensor xc = x.contiguous();
  Tensor out = Tensor::empty(x.sizes(), x.dtype(), x.device());
  rope_apply(out, xc, pc, table.contiguous(), false);
  if (needs_grad({&x})) {
    auto node = std::make_shared<RopeNode>();
    node->positions = pc;
    node->table = table.contiguous();
    record(out, node, {&x});
  }
  return out;
}

Tensor rope_table(int64_t P, int64_t HS, double theta, DType dtype, Device device, double scale,
                  std::span<const float> factors) {
  KVLAB_CHECK(P >= 1 && HS >= 2 && HS % 2 == 0 && theta > 1, "rope_table: ", P,
              " positions, head size ", HS, ", theta ", theta,
              ": needs P >= 1, an even head size and theta > 1");
  const int64_t half = HS / 2;
  KVLAB_CHECK(scale > 0 && std::isfinite(scale) &&
                  (factors.empty() || static_cast<int64_t>(factors.size()) == half),
              "rope_table: scale ", scale, " and ", factors.size(),
              " frequency factors: needs a finite scale above 0 and none or ", half, " factors");
  std::vector<double> t(static_cast<size_t>(P * HS));
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 0; j < half; ++j) {
      const double divisor = factors.empty() ? 1.0 : factors[static_cast<size_t>(j)];
      const double frequency =
          std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(HS)) / divisor;
      const double angle = static_cast<double>(p) * scale * frequency;
      t[static_cast<size_t>(p * HS + j)] = std::cos(angle);
      t[static_cast<size_t>(p * HS + half + j)] = std::sin(angle);
    }
  return Tensor::from_vector(t, {P, HS}).to(dtype).to(device);
}

Tensor dropout(const Tensor& x, double p, uint64_t seed) {
  KVLAB_CHECK(p >= 0.0 && p < 1.0, "dropout: p = ", p, " is outside [0, 1)");
  if (p == 0.0) return x;
  check_defined("dropout", x);
  Tensor xc = x.contiguous();
  Tensor out = Tensor::empty(x.sizes(), x.dtype(), x.device());
  dispatch_float(x.dtype(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(x.device(), dropout_forward<T>(out.data<T>(), xc.data<T>(), x.numel(), p, seed));
  });
  if (needs_grad({&x})) {
    auto node = std::make_shared<DropoutNode>();
    node->p = p;
    node->seed = seed;
    record(out, node, {&x});
  }
  return out;
}

}  // namespace kvlab
