// ops/attention.cpp: fused causal attention with grouped K/V heads.
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "autograd/backend/cpu/decode_kernels.h"
#include "tests/autograd/gradcheck.h"

namespace {

using namespace kvlab;
using kvtest::all_close;
using kvtest::gradcheck;
using kvtest::param;
using kvtest::throws_with;
using kvtest::vals;

struct Cfg {
  int64_t B, NH, NKV, T, S, HS;
  std::vector<int64_t> lens = {};  // kv_lengths; empty: S for every row
  double dropout = 0.0;
  uint64_t seed = 0;
};

std::string describe(const Cfg& c) {
  std::ostringstream os;
  os << "B=" << c.B << " NH=" << c.NH << " NKV=" << c.NKV << " T=" << c.T << " S=" << c.S
     << " HS=" << c.HS;
  if (!c.lens.empty()) {
    os << " kv_lengths={";
    for (int64_t l : c.lens) os << l << ",";
    os << "}";
  }
  if (c.dropout > 0) os << " dropout=" << c.dropout << " seed=" << c.seed;
  return os.str();
}

AttentionOptions options(const Cfg& c) {
  AttentionOptions o;
  o.kv_lengths = c.lens;
  o.dropout = c.dropout;
  o.seed = c.seed;
  return o;
}

// Naive reference in double: materialise the repeated K/V heads, build the full (T, S) score
// matrix, mask it bottom-right (query t of row b sits at position S_b - T + t), softmax, and
// multiply by V. q (B, NH, T, HS); k, v (B, NKV, S, HS); returns (B, NH, T, HS) in order.
std::vector<double> naive_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const std::vector<int64_t>& lens) {
  const int64_t B = q.size(0), NH = q.size(1), T = q.size(2), HS = q.size(3);
  const int64_t NKV = k.size(1), S = k.size(2), group = NH / NKV;
  const auto qv = vals(q), kv = vals(k), vv = vals(v);
  std::vector<double> kr(static_cast<size_t>(B * NH * S * HS)), vr(kr.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < HS; ++d) {
          const size_t dst = static_cast<size_t>(((b * NH + h) * S + s) * HS + d);
          const size_t src = static_cast<size_t>(((b * NKV + h / group) * S + s) * HS + d);
          kr[dst] = kv[src];
          vr[dst] = vv[src];
        }
  std::vector<double> out(static_cast<size_t>(B * NH * T * HS), 0.0);
  std::vector<double> p(static_cast<size_t>(T * S));
  const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t Sb = lens.empty() ? S : lens[static_cast<size_t>(b)];
    for (int64_t h = 0; h < NH; ++h) {
      const double* qh = qv.data() + (b * NH + h) * T * HS;
      const double* kh = kr.data() + (b * NH + h) * S * HS;
      const double* vh = vr.data() + (b * NH + h) * S * HS;
      for (int64_t t = 0; t < T; ++t) {
        double mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          double s = -INFINITY;
          if (j < Sb && j <= Sb - T + t) {
            s = 0;
            for (int64_t d = 0; d < HS; ++d) s += qh[t * HS + d] * kh[j * HS + d];
            s *= scale;
          }
          p[static_cast<size_t>(t * S + j)] = s;
          mx = std::max(mx, s);
        }
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) {
          double& e = p[static_cast<size_t>(t * S + j)];
          e = std::isinf(e) ? 0.0 : std::exp(e - mx);
          sum += e;
        }
        for (int64_t j = 0; j < S; ++j) p[static_cast<size_t>(t * S + j)] /= sum;
      }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < HS; ++d) {
          double s = 0;
          for (int64_t j = 0; j < S; ++j) s += p[static_cast<size_t>(t * S + j)] * vh[j * HS + d];
          out[static_cast<size_t>(((b * NH + h) * T + t) * HS + d)] = s;
        }
    }
  }
  return out;
}

struct QKV {
  Tensor q, k, v;
};
QKV make_qkv(const Cfg& c, Generator& gen, DType dt, bool requires_grad) {
  QKV r{kvtest::randn({c.B, c.NH, c.T, c.HS}, gen, dt),
        kvtest::randn({c.B, c.NKV, c.S, c.HS}, gen, dt),
        kvtest::randn({c.B, c.NKV, c.S, c.HS}, gen, dt)};
  if (requires_grad) {
    r.q.set_requires_grad();
    r.k.set_requires_grad();
    r.v.set_requires_grad();
  }
  return r;
}

const std::vector<Cfg> kConfigs = {
    {1, 2, 2, 3, 3, 3},          // MHA, T = S
    {2, 4, 2, 3, 5, 3},          // GQA (NKV = NH/2), T < S
    {1, 4, 1, 2, 4, 5},          // MQA (NKV = 1)
    {2, 2, 1, 1, 4, 3},          // decode: T = 1
    {2, 4, 2, 2, 5, 3, {5, 3}},  // rows with different cache lengths
    {2, 2, 2, 1, 6, 3, {1, 4}},  // T = 1, a row with a single key
    {1, 3, 1, 4, 4, 1},          // HS = 1, NH = 3
    {1, 1, 1, 17, 17, 3},        // a longer sequence
};

TEST(Attention, ForwardMatchesNaiveF64AndF32) {
  Generator gen(1);
  std::vector<Cfg> cfgs = kConfigs;
  cfgs.push_back({2, 4, 2, 17, 33, 8});  // tasks >= threads: the parallel path
  cfgs.push_back({3, 6, 3, 5, 40, 16, {40, 5, 21}});
  for (const Cfg& c : cfgs)
    for (DType dt : {DType::F64, DType::F32}) {
      SCOPED_TRACE(describe(c) + " " + dtype_name(dt));
      QKV x = make_qkv(c, gen, dt, false);
      Tensor out = causal_attention(x.q, x.k, x.v, options(c));
      EXPECT_EQ(out.sizes(), (Shape{c.B, c.NH, c.T, c.HS}));
      EXPECT_EQ(out.dtype(), dt);
      // The result is a view of a (B, T, NH, HS) buffer.
      EXPECT_TRUE(transpose(out, 1, 2).is_contiguous());
      EXPECT_TRUE(
          all_close(out, naive_attention(x.q, x.k, x.v, c.lens), dt == DType::F64 ? 1e-12 : 1e-5));
    }
}

TEST(Attention, HandComputedSingleQuery) {
  // One head, T = 1, S = 2, HS = 1: q = 1, k = (0, log 2 * sqrt(1)), v = (1, 4):
  // p = softmax(0, log 2) = (1/3, 2/3); out = 1/3 + 8/3 = 3.
  Tensor q = Tensor::from_vector(std::vector<double>{1.0}, {1, 1, 1, 1});
  Tensor k = Tensor::from_vector(std::vector<double>{0.0, std::log(2.0)}, {1, 1, 2, 1});
  Tensor v = Tensor::from_vector(std::vector<double>{1.0, 4.0}, {1, 1, 2, 1});
  EXPECT_NEAR(causal_attention(q, k, v).item(), 3.0, 1e-14);
  // T = S = 2: the first query sees key 0 only.
  Tensor q2 = Tensor::from_vector(std::vector<double>{1.0, 1.0}, {1, 1, 2, 1});
  EXPECT_EQ(vals(causal_attention(q2, k, v))[0], 1.0);
}

TEST(Attention, GradcheckConfigs) {
  Generator gen(2);
  for (const Cfg& c : kConfigs) {
    if (c.T == 17) continue;  // forward-only size
    SCOPED_TRACE(describe(c));
    QKV x = make_qkv(c, gen, DType::F64, true);
    const AttentionOptions o = options(c);
    EXPECT_TRUE(gradcheck(
        [&](const std::vector<Tensor>& in) { return causal_attention(in[0], in[1], in[2], o); },
        {x.q, x.k, x.v}));
  }
}

TEST(Attention, GradcheckWithDropout) {
  Generator gen(3);
  for (Cfg c : {Cfg{2, 4, 2, 3, 5, 3, {}, 0.3, 7}, Cfg{2, 2, 1, 2, 4, 3, {4, 2}, 0.3, 11},
                Cfg{1, 2, 2, 4, 4, 3, {}, 0.5, 3}}) {
    SCOPED_TRACE(describe(c));
    QKV x = make_qkv(c, gen, DType::F64, true);
    const AttentionOptions o = options(c);
    EXPECT_TRUE(gradcheck(
        [&](const std::vector<Tensor>& in) { return causal_attention(in[0], in[1], in[2], o); },
        {x.q, x.k, x.v}));
  }
}

TEST(Attention, F32GradientsMatchF64) {
  // f32 runs the fast exp and the GEMV branches (T = 1, HS = 1) in backward.
  Generator gen(11);
  std::vector<Cfg> cfgs = kConfigs;
  cfgs.push_back({2, 4, 2, 3, 5, 3, {}, 0.3, 5});
  cfgs.push_back({2, 1, 1, 1, 3, 1});
  for (const Cfg& c : cfgs) {
    SCOPED_TRACE(describe(c));
    QKV x = make_qkv(c, gen, DType::F64, true);
    Tensor q32 = x.q.detach().to(DType::F32).set_requires_grad();
    Tensor k32 = x.k.detach().to(DType::F32).set_requires_grad();
    Tensor v32 = x.v.detach().to(DType::F32).set_requires_grad();
    Tensor up = kvtest::randn({c.B, c.NH, c.T, c.HS}, gen);
    causal_attention(x.q, x.k, x.v, options(c)).backward(up);
    causal_attention(q32, k32, v32, options(c)).backward(up.to(DType::F32));
    EXPECT_TRUE(all_close(q32.grad(), x.q.grad(), 2e-5));
    EXPECT_TRUE(all_close(k32.grad(), x.k.grad(), 2e-5));
    EXPECT_TRUE(all_close(v32.grad(), x.v.grad(), 2e-5));
  }
}

TEST(Attention, GradcheckThroughTransposedViews) {
  // q, k, v given as (B, T, H, HS) buffers viewed as (B, H, T, HS), as the model does.
  Generator gen(4);
  Tensor qb = param({2, 3, 4, 3}, gen), kb = param({2, 5, 2, 3}, gen),
         vb = param({2, 5, 2, 3}, gen);
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        return causal_attention(transpose(in[0], 1, 2), transpose(in[1], 1, 2),
                                transpose(in[2], 1, 2));
      },
      {qb, kb, vb}));
}

TEST(Attention, GradcheckModelLikePath) {
  // As the model uses it: projections produce (B, T, H, HS) buffers, attention reads them as
  // (B, H, T, HS) views, and its output is viewed back as (B, T, C) for the output projection.
  // The upstream gradient then reaches attention as a heads-last strided view.
  Generator gen(12);
  const int64_t B = 2, T = 3, NH = 4, NKV = 2, HS = 3, C = NH * HS;
  Tensor x = param({B, T, C}, gen, DType::F64, 0.5);
  Tensor wq = param({C, C}, gen, DType::F64, 0.3), wk = param({NKV * HS, C}, gen, DType::F64, 0.3);
  Tensor wv = param({NKV * HS, C}, gen, DType::F64, 0.3), wo = param({C, C}, gen, DType::F64, 0.3);
  EXPECT_TRUE(gradcheck(
      [&](const std::vector<Tensor>& in) {
        Tensor q = transpose(reshape(linear(in[0], in[1]), {B, T, NH, HS}), 1, 2);
        Tensor k = transpose(reshape(linear(in[0], in[2]), {B, T, NKV, HS}), 1, 2);
        Tensor v = transpose(reshape(linear(in[0], in[3]), {B, T, NKV, HS}), 1, 2);
        Tensor y = causal_attention(q, k, v);
        Tensor merged = reshape(transpose(y, 1, 2), {B, T, C});
        EXPECT_EQ(merged.storage().get(), y.storage().get());  // no copy: already heads-last
        return linear(merged, in[4]);
      },
      {x, wq, wk, wv, wo}));
}

// Expands k (B, NKV, S, HS) to (B, NH, S, HS) by copying each KV head to its group of query heads.
Tensor repeat_heads(const Tensor& k, int64_t NH) {
  const int64_t group = NH / k.size(1);
  std::vector<Tensor> heads;
  for (int64_t h = 0; h < NH; ++h) heads.push_back(narrow(k, 1, h / group, 1));
  return concat(heads, 1).detach();
}

// Sums a (B, NH, S, HS) gradient over each group of query heads -> (B, NKV, S, HS).
std::vector<double> group_sum(const Tensor& g, int64_t NKV) {
  const int64_t B = g.size(0), NH = g.size(1), S = g.size(2), HS = g.size(3), group = NH / NKV;
  const auto gv = vals(g);
  std::vector<double> out(static_cast<size_t>(B * NKV * S * HS), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < S * HS; ++i)
        out[static_cast<size_t>((b * NKV + h / group) * S * HS + i)] +=
            gv[static_cast<size_t>((b * NH + h) * S * HS + i)];
  return out;
}

TEST(Attention, GroupedEqualsMultiHeadOnRepeatedKV) {
  Generator gen(5);
  for (DType dt : {DType::F64, DType::F32})
    for (Cfg c : {Cfg{2, 4, 2, 3, 5, 3}, Cfg{2, 4, 1, 2, 6, 5}, Cfg{1, 6, 3, 4, 4, 2},
                  Cfg{2, 4, 2, 2, 5, 3, {5, 2}}, Cfg{2, 4, 1, 3, 5, 3, {}, 0.25, 9}}) {
      SCOPED_TRACE(describe(c) + " " + dtype_name(dt));
      const double tol = dt == DType::F64 ? 1e-12 : 2e-5;
      QKV g = make_qkv(c, gen, dt, true);
      Tensor qm = g.q.detach().clone().set_requires_grad();
      Tensor km = repeat_heads(g.k, c.NH).set_requires_grad();
      Tensor vm = repeat_heads(g.v, c.NH).set_requires_grad();
      Tensor upstream = kvtest::randn({c.B, c.NH, c.T, c.HS}, gen, dt);
      Tensor out_g = causal_attention(g.q, g.k, g.v, options(c));
      Tensor out_m = causal_attention(qm, km, vm, options(c));
      EXPECT_TRUE(all_close(out_g, out_m, tol));
      out_g.backward(upstream);
      out_m.backward(upstream);
      EXPECT_TRUE(all_close(g.q.grad(), qm.grad(), tol));
      EXPECT_TRUE(all_close(g.k.grad(), group_sum(km.grad(), c.NKV), tol));
      EXPECT_TRUE(all_close(g.v.grad(), group_sum(vm.grad(), c.NKV), tol));
    }
}

TEST(Attention, QueryBlockAtOffsetEqualsRowsOfFullSequence) {
  Generator gen(6);
  for (DType dt : {DType::F64, DType::F32}) {
    const int64_t B = 2, NH = 4, NKV = 2, S = 7, HS = 3;
    Tensor qf = kvtest::randn({B, NH, S, HS}, gen, dt);
    Tensor k = kvtest::randn({B, NKV, S, HS}, gen, dt), v = kvtest::randn({B, NKV, S, HS}, gen, dt);
    Tensor full = causal_attention(qf, k, v);
    for (int64_t T : {1, 2, 5, 7}) {
      SCOPED_TRACE(testing::Message() << "T=" << T << " " << dtype_name(dt));
      Tensor q_last = narrow(qf, 2, S - T, T);  // a strided view: offset, row stride S*HS
      const double tol = dt == DType::F64 ? 1e-13 : 1e-6;
      EXPECT_TRUE(all_close(causal_attention(q_last, k, v), narrow(full, 2, S - T, T), tol));
      EXPECT_TRUE(
          all_close(causal_attention(q_last.contiguous(), k, v), narrow(full, 2, S - T, T), tol));
    }
  }
}

TEST(Attention, TransposedQueryViewEqualsContiguous) {
  Generator gen(7);
  for (DType dt : {DType::F64, DType::F32}) {
    const int64_t B = 2, NH = 4, NKV = 2, T = 3, S = 5, HS = 3;
    Tensor qbuf = kvtest::randn({B, T, NH, HS}, gen, dt);
    Tensor kbuf = kvtest::randn({B, S, NKV, HS}, gen, dt),
           vbuf = kvtest::randn({B, S, NKV, HS}, gen, dt);
    Tensor qv = transpose(qbuf, 1, 2), kv = transpose(kbuf, 1, 2), vv = transpose(vbuf, 1, 2);
    ASSERT_FALSE(qv.is_contiguous());
    Tensor a = causal_attention(qv, kv, vv);
    Tensor b = causal_attention(qv.contiguous(), kv.contiguous(), vv.contiguous());
    EXPECT_TRUE(all_close(a, b, dt == DType::F64 ? 1e-14 : 1e-6));
    // HS not contiguous (k given as a transposed (B, NKV, HS, S) buffer): copied, same result.
    Tensor kt = transpose(kv.contiguous(), 2, 3).contiguous();  // (B, NKV, HS, S)
    Tensor kview = transpose(kt, 2, 3);
    ASSERT_NE(kview.stride(3), 1);
    EXPECT_TRUE(all_close(causal_attention(qv, kview, vv), b, dt == DType::F64 ? 1e-14 : 1e-6));
    // k and v as the first S positions of a larger (B, NKV, Smax, HS) cache buffer.
    Tensor kcache = kvtest::randn({B, NKV, 9, HS}, gen, dt),
           vcache = kvtest::randn({B, NKV, 9, HS}, gen, dt);
    narrow(kcache, 2, 0, S).copy_from(kv);
    narrow(vcache, 2, 0, S).copy_from(vv);
    EXPECT_TRUE(all_close(causal_attention(qv, narrow(kcache, 2, 0, S), narrow(vcache, 2, 0, S)), b,
                          dt == DType::F64 ? 1e-14 : 1e-6));
    // Gradients: the same whether q arrives as a view or contiguous.
    Tensor q1 = qbuf.detach().clone().set_requires_grad();
    Tensor q2 = qv.contiguous().detach().set_requires_grad();
    Tensor up = kvtest::randn({B, NH, T, HS}, gen, dt);
    causal_attention(transpose(q1, 1, 2), kv, vv).backward(up);
    causal_attention(q2, kv, vv).backward(up);
    EXPECT_TRUE(all_close(transpose(q1.grad(), 1, 2), q2.grad(), dt == DType::F64 ? 1e-14 : 1e-6));
  }
}

TEST(Attention, KvLengthsRowsEqualEachRowAlone) {
  Generator gen(8);
  for (DType dt : {DType::F64, DType::F32})
    for (Cfg c : {Cfg{2, 4, 2, 2, 6, 3, {6, 3}}, Cfg{3, 2, 1, 1, 5, 4, {1, 5, 2}},
                  Cfg{2, 4, 4, 3, 7, 2, {3, 7}}}) {
      SCOPED_TRACE(describe(c) + " " + dtype_name(dt));
      const double tol = dt == DType::F64 ? 1e-13 : 1e-6;
      QKV x = make_qkv(c, gen, dt, true);
      Tensor out = causal_attention(x.q, x.k, x.v, options(c));
      Tensor up = kvtest::randn(out.sizes(), gen, dt);
      out.backward(up);
      for (int64_t b = 0; b < c.B; ++b) {
        const int64_t len = c.lens[static_cast<size_t>(b)];
        Tensor qb = narrow(x.q, 0, b, 1).detach().clone().set_requires_grad();
        Tensor kb = narrow(narrow(x.k, 0, b, 1), 2, 0, len).detach().clone().set_requires_grad();
        Tensor vb = narrow(narrow(x.v, 0, b, 1), 2, 0, len).detach().clone().set_requires_grad();
        Tensor ob = causal_attention(qb, kb, vb);
        EXPECT_TRUE(all_close(ob, narrow(out, 0, b, 1), tol)) << "row " << b;
        ob.backward(narrow(up, 0, b, 1));
        EXPECT_TRUE(all_close(qb.grad(), narrow(x.q.grad(), 0, b, 1), tol)) << "row " << b;
        EXPECT_TRUE(all_close(kb.grad(), narrow(narrow(x.k.grad(), 0, b, 1), 2, 0, len), tol));
        EXPECT_TRUE(all_close(vb.grad(), narrow(narrow(x.v.grad(), 0, b, 1), 2, 0, len), tol));
        // Keys past the row's length receive exactly zero.
        if (len < c.S) {
          Tensor tail_k = narrow(narrow(x.k.grad(), 0, b, 1), 2, len, c.S - len);
          Tensor tail_v = narrow(narrow(x.v.grad(), 0, b, 1), 2, len, c.S - len);
          EXPECT_TRUE(
              all_close(tail_k, std::vector<double>(static_cast<size_t>(tail_k.numel()), 0.0), 0));
          EXPECT_TRUE(
              all_close(tail_v, std::vector<double>(static_cast<size_t>(tail_v.numel()), 0.0), 0));
        }
      }
    }
}

// A bf16 KV cache hands the op bf16 keys and values under f32 queries: the result must be the
// f32 attention over those same values widened (exact in f32), in prefill and in decode.
TEST(Attention, Bf16KeysAndValuesEqualF32OverTheRoundedValues) {
  Generator gen(12);
  for (Cfg c : {Cfg{2, 4, 2, 3, 5, 8}, Cfg{2, 4, 1, 1, 6, 8, {6, 2}}, Cfg{1, 2, 2, 1, 7, 4},
                Cfg{3, 8, 2, 1, 9, 16, {9, 1, 5}}, Cfg{1, 4, 4, 6, 6, 8}}) {
    SCOPED_TRACE(describe(c));
    QKV x = make_qkv(c, gen, DType::F32, false);
    const Tensor k16 = x.k.to(DType::BF16), v16 = x.v.to(DType::BF16);
    const Tensor got = causal_attention(x.q, k16, v16, options(c));
    const Tensor want = causal_attention(x.q, k16.to(DType::F32), v16.to(DType::F32), options(c));
    EXPECT_TRUE(all_close(got, vals(want), 1e-6));
    // The rounding is real: the f32 inputs give a different result.
    const auto exact = vals(causal_attention(x.q, x.k, x.v, options(c)));
    double diff = 0;
    const auto g = vals(got);
    for (size_t i = 0; i < g.size(); ++i) diff = std::max(diff, std::fabs(g[i] - exact[i]));
    EXPECT_GT(diff, 1e-5);
    EXPECT_LT(diff, 5e-2);
  }
  // Gradients need f32 keys and values.
  Cfg c{1, 2, 1, 2, 3, 4};
  QKV x = make_qkv(c, gen, DType::F32, true);
  EXPECT_TRUE(throws_with(
      [&] { causal_attention(x.q, x.k.detach().to(DType::BF16), x.v.detach().to(DType::BF16)); },
      {"gradients need f32 k and v"}));
  // f64 queries do not mix with bf16 storage.
  EXPECT_THROW(causal_attention(x.q.detach().to(DType::F64), x.k.detach().to(DType::BF16),
                                x.v.detach().to(DType::BF16)),
               Error);
}

TEST(Attention, DropoutMasksProbabilities) {
  // With v = identity (HS = S), out row t is the dropped-out probability row itself.
  const int64_t B = 2, NH = 4, NKV = 2, S = 32, T = 32, HS = 32;
  const double p = 0.3;
  Generator gen(9);
  Tensor q = kvtest::randn({B, NH, T, HS}, gen), k = kvtest::randn({B, NKV, S, HS}, gen);
  Tensor v = Tensor::zeros({B, NKV, S, HS}, DType::F64);
  double* pv = v.data<double>();
  for (int64_t bg = 0; bg < B * NKV; ++bg)
    for (int64_t s = 0; s < S; ++s) pv[(bg * S + s) * HS + s] = 1.0;
  const auto probs = vals(causal_attention(q, k, v));
  AttentionOptions o;
  o.dropout = p;
  o.seed = 1234;
  const auto dropped = vals(causal_attention(q, k, v, o));
  int64_t visible = 0, zeroed = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0) {  // masked by causality: stays zero
      EXPECT_EQ(dropped[i], 0.0);
      continue;
    }
    ++visible;
    if (dropped[i] == 0) {
      ++zeroed;
    } else {
      ASSERT_NEAR(dropped[i], probs[i] / (1 - p), 1e-12 * std::max(1.0, probs[i])) << i;
    }
  }
  ASSERT_EQ(visible, B * NH * T * (T + 1) / 2);
  // sd of the fraction ~ sqrt(0.21 / 4224) ~ 0.007: allow 5 sigma.
  EXPECT_NEAR(static_cast<double>(zeroed) / static_cast<double>(visible), p, 0.035);
  // Heads get different masks.
  const int64_t per_head = T * HS;
  int64_t agree = 0, both_visible = 0;
  for (int64_t i = 0; i < per_head; ++i) {
    if (probs[i] == 0 || probs[per_head + i] == 0) continue;
    ++both_visible;
    agree += (dropped[i] == 0) == (dropped[per_head + i] == 0);
  }
  EXPECT_LT(agree, both_visible);
  // Same seed: the same result; another seed: a different one.
  EXPECT_EQ(vals(causal_attention(q, k, v, o)), dropped);
  o.seed = 1235;
  EXPECT_NE(vals(causal_attention(q, k, v, o)), dropped);
  // Dropout 0 is exactly the plain attention.
  o.dropout = 0;
  EXPECT_EQ(vals(causal_attention(q, k, v, o)), probs);
}

TEST(Attention, NoGraphInNoGradScope) {
  Generator gen(10);
  QKV x = make_qkv({1, 2, 1, 2, 4, 3}, gen, DType::F32, true);
  const uint64_t before = nodes_created();
  Tensor out;
  {
    NoGradGuard ng;
    out = causal_attention(x.q, x.k, x.v);
  }
  EXPECT_EQ(nodes_created(), before);
  EXPECT_FALSE(out.grad_fn());
}

TEST(Attention, BadInputsThrow) {
  auto z = [](Shape s, DType dt = DType::F32) { return Tensor::zeros(s, dt); };
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 4, 2, 8}), z({1, 3, 2, 8}), z({1, 3, 2, 8}));
      },
      {"causal_attention", "NKV", "(1, 4, 2, 8)", "(1, 3, 2, 8)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 2, 5, 8}), z({1, 2, 3, 8}), z({1, 2, 3, 8}));
      },
      {"causal_attention", "T = 5", "S = 3", "(1, 2, 5, 8)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 2, 2, 8}), z({1, 2, 3, 4}), z({1, 2, 3, 4}));
      },
      {"causal_attention", "HS"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({2, 2, 2, 8}), z({1, 2, 3, 8}), z({1, 2, 3, 8}));
      },
      {"causal_attention", "(2, 2, 2, 8)", "(1, 2, 3, 8)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 2, 2, 8}), z({1, 2, 3, 8}), z({1, 2, 4, 8}));
      },
      {"causal_attention", "(1, 2, 4, 8)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({2, 8}), z({1, 2, 3, 8}), z({1, 2, 3, 8}));
      },
      {"causal_attention", "(2, 8)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 2, 2, 8}), z({1, 2, 3, 8}, DType::F64), z({1, 2, 3, 8}));
      },
      {"causal_attention", "f64"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 2, 2, 8}), z({1, 0, 3, 8}), z({1, 0, 3, 8}));
      },
      {"causal_attention", "NKV"}));
  AttentionOptions o;
  const std::vector<int64_t> one_row = {3}, too_short = {3, 1}, too_long = {4, 3};
  o.kv_lengths = one_row;
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({2, 2, 2, 8}), z({2, 2, 3, 8}), z({2, 2, 3, 8}), o);
      },
      {"causal_attention", "kv_lengths"}));
  o.kv_lengths = too_short;  // below T = 2
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({2, 2, 2, 8}), z({2, 2, 3, 8}), z({2, 2, 3, 8}), o);
      },
      {"causal_attention", "kv_lengths[1] = 1"}));
  o.kv_lengths = too_long;  // above S = 3
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({2, 2, 2, 8}), z({2, 2, 3, 8}), z({2, 2, 3, 8}), o);
      },
      {"causal_attention", "kv_lengths[0] = 4"}));
  AttentionOptions d;
  d.dropout = 1.0;
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 2, 2, 8}), z({1, 2, 3, 8}), z({1, 2, 3, 8}), d);
      },
      {"causal_attention", "dropout"}));
  EXPECT_TRUE(throws_with(
      [&] {
        causal_attention(z({1, 2, 2, 8}, DType::I32), z({1, 2, 3, 8}, DType::I32),
                         z({1, 2, 3, 8}, DType::I32));
      },
      {"causal_attention", "i32"}));
}

}  // namespace

// ---- paged K and V (AttentionOptions::kv_blocks) ----

// k (B, NKV, S, HS) laid out as a paged cache's pool (n_blocks, NKV, block_len, HS): row b's
// block i is table[b * width + i], the blocks handed out in a shuffled order so that no row's
// blocks are adjacent or in order. Unused blocks hold noise the attention must not read.
struct Paged {
  std::vector<int32_t> table;
  KVBlocks blocks;
  Tensor k, v;
};
Paged page(const Tensor& k, const Tensor& v, int64_t block_len, Generator& gen) {
  const int64_t B = k.size(0), NKV = k.size(1), S = k.size(2), HS = k.size(3);
  const int64_t width = (S + block_len - 1) / block_len, n_blocks = B * width + 3;
  std::vector<int32_t> order(static_cast<size_t>(n_blocks));
  for (int64_t i = 0; i < n_blocks; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::mt19937 rng(static_cast<uint32_t>(B * 131 + S));
  std::shuffle(order.begin(), order.end(), rng);
  Paged r;
  r.table.assign(order.begin(), order.begin() + B * width);
  r.blocks = {r.table.data(), width, block_len, NKV * block_len * HS};
  const DType dt = k.dtype();
  Tensor kp = kvtest::randn({n_blocks, NKV, block_len, HS}, gen, dt);
  Tensor vp = kvtest::randn({n_blocks, NKV, block_len, HS}, gen, dt);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < width; ++i) {
      const int64_t n = std::min(block_len, S - i * block_len);
      const int64_t blk = r.table[static_cast<size_t>(b * width + i)];
      for (auto [pool, src] : {std::pair{&kp, &k}, std::pair{&vp, &v}})
        narrow(narrow(*pool, 0, blk, 1), 2, 0, n)
            .copy_from(narrow(narrow(*src, 0, b, 1), 2, i * block_len, n));
    }
  r.k = kp;
  r.v = vp;
  return r;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (const double x : a) m = std::max(m, std::fabs(x));
  return m;
}

// Whether this build has the decode row kernel for HS (attend_row.cpp).
bool row_kernel(int64_t HS) {
  std::vector<float> x(static_cast<size_t>(HS), 1.0f), out(x.size()), p(1);
  return cpu::attend_one_query_kernel(out.data(), x.data(), x.data(), HS, x.data(), HS, 1, HS,
                                      1.0f, p.data());
}

// Reading K and V through block tables gives the contiguous operands' results. At T = 1 the
// decode row kernel reads the same rows in the same order, so in f32 (and from bf16, widened
// exactly) the bits are the same. Otherwise the values are summed block by block instead of
// in one product (attention.cpp's attend_blocks): within 1e-6 of the output's scale in f32.
TEST(Attention, PagedKeysAndValuesEqualContiguous) {
  Generator gen(21);
  for (const int64_t block_len : {int64_t{1}, int64_t{4}, int64_t{16}})
    for (const DType kv_dt : {DType::F32, DType::BF16, DType::F64})
      for (Cfg c : {Cfg{3, 4, 4, 1, 33, 8, {33, 1, 16}}, Cfg{3, 4, 2, 1, 17, 8, {15, 17, 16}},
                    Cfg{1, 4, 1, 1, 40, 16}, Cfg{3, 4, 1, 5, 33, 8, {33, 5, 17}},
                    Cfg{2, 4, 2, 16, 16, 8, {16, 16}}, Cfg{2, 2, 1, 1, 20, 160, {20, 9}},
                    Cfg{2, 2, 2, 3, 20, 160, {20, 9}}}) {
        SCOPED_TRACE(describe(c) + " block_len=" + std::to_string(block_len) + " kv " +
                     dtype_name(kv_dt));
        if (c.lens.empty()) c.lens.assign(static_cast<size_t>(c.B), c.S);
        const DType q_dt = kv_dt == DType::F64 ? DType::F64 : DType::F32;
        QKV x = make_qkv(c, gen, q_dt, false);
        const Tensor k = x.k.to(kv_dt), v = x.v.to(kv_dt);
        const Paged pg = page(k, v, block_len, gen);
        AttentionOptions po = options(c);
        po.kv_blocks = &pg.blocks;
        const auto want = vals(causal_attention(x.q, k, v, options(c)));
        const auto got = vals(causal_attention(x.q, pg.k, pg.v, po));
        if (c.T == 1 && q_dt == DType::F32 && row_kernel(c.HS))
          EXPECT_EQ(got, want);
        else
          EXPECT_LE(max_diff(got, want), (q_dt == DType::F64 ? 1e-13 : 1e-6) * max_abs(want));
      }
}

TEST(Attention, PagedKeysAndValuesAreForwardOnly) {
  Generator gen(22);
  Cfg c{1, 2, 1, 2, 5, 4, {5}};
  QKV x = make_qkv(c, gen, DType::F32, true);
  const Paged pg = page(x.k.detach(), x.v.detach(), 4, gen);
  AttentionOptions po = options(c);
  po.kv_blocks = &pg.blocks;
  EXPECT_TRUE(throws_with([&] { causal_attention(x.q, pg.k, pg.v, po); },
                          {"paged KV cache", "inference only"}));
  const Tensor q = x.q.detach();
  po.dropout = 0.1;
  EXPECT_TRUE(throws_with([&] { causal_attention(q, pg.k, pg.v, po); }, {"no dropout"}));
  po.dropout = 0;
  std::vector<int32_t> bad = pg.table;
  bad[1] = static_cast<int32_t>(pg.k.size(0));
  KVBlocks bb = pg.blocks;
  bb.table = bad.data();
  po.kv_blocks = &bb;
  EXPECT_TRUE(throws_with([&] { causal_attention(q, pg.k, pg.v, po); }, {"outside the pool"}));
  po.kv_blocks = &pg.blocks;
  po.kv_lengths = {};
  EXPECT_TRUE(throws_with([&] { causal_attention(q, pg.k, pg.v, po); }, {"need kv_lengths"}));
}

// MLA's latent attention (cpu::attend_latent): each of G heads' softmax over every row, times
// the rows' first R values, against a naive double computation, for head counts that fill a
// tile of heads, leave one short and pass one; rows contiguous (at a stride past the row) and
// through a block table whose last block is partly filled.
TEST(Attention, LatentAttentionEqualsTheNaiveOne) {
  std::mt19937 rng(23);
  std::normal_distribution<float> normal;
  const int64_t KW = 24, R = 20, st = 28, block = 8;
  for (const int64_t n : {1, 13, 40})
    for (const int64_t G : {1, 4, 6, 9}) {
      std::vector<float> rows(static_cast<size_t>(n * st)), q(static_cast<size_t>(G * KW));
      for (float& x : rows) x = normal(rng);
      for (float& x : q) x = normal(rng);
      const float scale = 0.3f;
      std::vector<double> want(static_cast<size_t>(G * R));
      for (int64_t h = 0; h < G; ++h) {
        std::vector<double> s(static_cast<size_t>(n));
        double top = -1e300, sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t c = 0; c < KW; ++c) s[j] += double(q[h * KW + c]) * rows[j * st + c];
          s[j] *= scale;
          top = std::max(top, s[j]);
        }
        for (double& x : s) sum += (x = std::exp(x - top));
        for (int64_t c = 0; c < R; ++c)
          for (int64_t j = 0; j < n; ++j) want[h * R + c] += s[j] / sum * rows[j * st + c];
      }
      // The rows in blocks of 8 handed out last first; each block's rows at stride st.
      const int64_t blocks = (n + block - 1) / block;
      std::vector<float> pool(static_cast<size_t>(blocks * block * st), 1e30f);
      std::vector<int32_t> table(static_cast<size_t>(blocks));
      for (int64_t b = 0; b < blocks; ++b) table[b] = static_cast<int32_t>(blocks - 1 - b);
      for (int64_t j = 0; j < n; ++j)
        std::copy_n(rows.data() + j * st, st,
                    pool.data() + (table[j / block] * block + j % block) * st);
      const cpu::BlockRows<float> paged{pool.data(), table.data(), 3, block * st, st};
      std::vector<float> p(static_cast<size_t>(G * n));
      for (const bool through_blocks : {false, true}) {
        std::vector<float> y(static_cast<size_t>(G * KW), 7.0f);
        if (through_blocks)
          cpu::attend_latent(y.data(), q.data(), G, paged, n, KW, R, scale, p.data());
        else
          cpu::attend_latent(y.data(), q.data(), G, rows.data(), st, n, KW, R, scale, p.data());
        double worst = 0;
        for (int64_t h = 0; h < G; ++h)
          for (int64_t c = 0; c < R; ++c)
            worst = std::max(worst, std::fabs(y[h * KW + c] - want[h * R + c]));
        EXPECT_LE(worst, 1e-5 * std::max(1.0, max_abs(want)))
            << "n " << n << " G " << G << (through_blocks ? " paged" : "");
      }
    }
}
