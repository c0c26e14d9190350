#include <gtest/gtest.h>

#include <cmath>

#include "autograd/backend/allocator.h"
#include "autograd/graph.h"
#include "autograd/ops/ops.h"
#include "infer/kv_cache.h"
#include "infer_test_util.h"

namespace kvlab {
namespace {

// (B, NKV, T, HS) values that encode their own index, stored transposed like the model's
// projections: a (B, T, NKV, HS) buffer read through a (B, NKV, T, HS) view.
Tensor coded(int64_t B, int64_t NKV, int64_t T, int64_t HS, float base) {
  Tensor buf = Tensor::empty({B, T, NKV, HS});
  float* p = buf.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NKV; ++h)
        for (int64_t i = 0; i < HS; ++i)
          p[((b * T + t) * NKV + h) * HS + i] =
              base + static_cast<float>(b * 1000 + h * 100 + t * 10 + i);
  return transpose(buf, 1, 2);
}

TEST(KVCache, BytesEqualTheFormulaForEveryNkv) {
  for (int64_t nkv : {8, 4, 2, 1})
    for (int64_t B : {1, 3}) {
      const ContiguousKVCache cache(6, B, 512, nkv, 32);
      EXPECT_EQ(cache.bytes(), kv_cache_formula_bytes(6, B, 512, nkv, 32, DType::F32)) << "NKV " << nkv;
      EXPECT_EQ(cache.bytes(), 2 * 6 * B * 512 * nkv * 32 * 4);
      // Only NKV heads are stored, never repeated to NH.
      EXPECT_EQ(cache.k_buffer(0).sizes(), (Shape{B, nkv, 512, 32}));
      EXPECT_EQ(cache.v_buffer(5).sizes(), (Shape{B, nkv, 512, 32}));
    }
  // MQA takes 1/8 of MHA's memory at NH = 8.
  EXPECT_EQ(ContiguousKVCache(2, 1, 64, 8, 16).bytes(),
            8 * ContiguousKVCache(2, 1, 64, 1, 16).bytes());
  const ContiguousKVCache f64(2, 2, 10, 2, 4, DType::F64);
  EXPECT_EQ(f64.bytes(), kv_cache_formula_bytes(2, 2, 10, 2, 4, DType::F64));
}

// A bf16 cache takes half the bytes and stores f32 keys and values rounded to bf16.
TEST(KVCache, Bf16HalvesTheBytesAndRoundsOnStore) {
  for (int64_t nkv : {4, 1}) {
    const ContiguousKVCache c16(6, 2, 512, nkv, 32, DType::BF16);
    EXPECT_EQ(c16.bytes(), kv_cache_formula_bytes(6, 2, 512, nkv, 32, DType::BF16));
    EXPECT_EQ(2 * c16.bytes(), ContiguousKVCache(6, 2, 512, nkv, 32).bytes());
  }
  ContiguousKVCache cache(1, 2, 4, 2, 3, DType::BF16);
  Tensor k = coded(2, 2, 3, 3, 0.001f), v = coded(2, 2, 3, 3, 0.0037f);
  auto [kv, vv] = cache.append(0, k, v);
  for (const auto& [stored, src] : {std::pair{kv, k}, std::pair{vv, v}}) {
    EXPECT_EQ(stored.dtype(), DType::BF16);
    const auto got = stored.to(DType::F32).to_vector<float>();
    const auto want = src.to(DType::BF16).to(DType::F32).to_vector<float>();
    const auto exact = src.contiguous().to_vector<float>();
    EXPECT_EQ(got, want);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::fabs(got[i] - exact[i])));
      EXPECT_LE(std::fabs(got[i] - exact[i]), std::fabs(exact[i]) / 256) << i;  // 8-bit mantissa
    }
    EXPECT_GT(worst, 0.0);  // really rounded, not stored as f32
  }
  // f64 keys do not go into a bf16 cache.
  EXPECT_THROW(cache.append(0, k.to(DType::F64), v.to(DType::F64)), Error);
}

TEST(KVCache, AppendWritesEachRowAtItsLengthAndReturnsViews) {
  const int64_t NKV = 2, HS = 3, S = 8;
  ContiguousKVCache cache(1, 2, S, NKV, HS);
  // Row 1 alone first gets 3 positions (as a per-row prefill does).
  {
    KVCache& row1 = cache.rows(1, 1);
    auto [k, v] = row1.append(0, coded(1, NKV, 3, HS, 0), coded(1, NKV, 3, HS, 0.5f));
    EXPECT_EQ(k.sizes(), (Shape{1, NKV, 3, HS}));
    row1.advance(3);
    EXPECT_EQ(row1.lengths(), (std::vector<int64_t>{3}));
  }
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{0, 3}));
  // Then both rows append 2 positions.
  auto [k, v] = cache.append(0, coded(2, NKV, 2, HS, 7000), coded(2, NKV, 2, HS, 9000));
  EXPECT_EQ(k.sizes(), (Shape{2, NKV, 5, HS}));  // max(lengths) + T
  EXPECT_EQ(k.stride(3), 1);
  cache.advance(2);
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{2, 5}));
  const Tensor kb = cache.k_buffer(0);
  auto at = [&](const Tensor& t, int64_t b, int64_t h, int64_t s, int64_t i) {
    return t.data<float>()[((b * NKV + h) * S + s) * HS + i];
  };
  for (int64_t h = 0; h < NKV; ++h)
    for (int64_t i = 0; i < HS; ++i) {
      for (int64_t t = 0; t < 3; ++t)  // row 1's first positions
        EXPECT_EQ(at(kb, 1, h, t, i), static_cast<float>(h * 100 + t * 10 + i));
      for (int64_t t = 0; t < 2; ++t) {
        EXPECT_EQ(at(kb, 0, h, t, i), 7000.0f + static_cast<float>(h * 100 + t * 10 + i));
        EXPECT_EQ(at(kb, 1, h, 3 + t, i),
                  7000.0f + static_cast<float>(1000 + h * 100 + t * 10 + i));
        EXPECT_EQ(at(cache.v_buffer(0), 1, h, 3 + t, i),
                  9000.0f + static_cast<float>(1000 + h * 100 + t * 10 + i));
      }
    }
  // The returned view reads the same memory: row 1, head 1, position 4.
  const std::vector<float> kv = k.to_vector<float>();
  EXPECT_EQ(kv[((1 * NKV + 1) * 5 + 4) * HS + 2], 7000.0f + 1000 + 100 + 10 + 2);
}

// layer_rows() says where each row of a layer lies, storing nothing: what is written there at
// each row's length is cached, the same as append() would store, for the whole cache and for a
// range of its rows, and a row without room is an error naming its capacity.
TEST(KVCache, LayerRowsAreTheCachesMemoryAndWritesIntoThemAreCached) {
  const int64_t NKV = 2, HS = 3, S = 4;
  ContiguousKVCache cache(2, 3, S, NKV, HS), appended(2, 3, S, NKV, HS);
  for (ContiguousKVCache* c : {&cache, &appended}) c->rows(1, 1).advance(2);  // lengths 0, 2, 0
  const KVRows r = cache.layer_rows(1, 1);
  EXPECT_EQ(r.rows, 3);
  EXPECT_EQ(r.positions, 3);  // max(lengths) + T
  const std::vector<float> zeros(3 * NKV * S * HS, 0.0f);
  EXPECT_EQ(cache.k_buffer(1).to_vector<float>(), zeros);  // stored nothing
  const Tensor new_k = coded(3, NKV, 1, HS, 100), new_v = coded(3, NKV, 1, HS, 200);
  const std::vector<float> nk = new_k.contiguous().to_vector<float>();
  const std::vector<float> nv = new_v.contiguous().to_vector<float>();
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t len = cache.lengths()[static_cast<size_t>(b)];
    for (int64_t h = 0; h < NKV; ++h)
      for (int64_t i = 0; i < HS; ++i) {
        const int64_t src = (b * NKV + h) * HS + i;
        const int64_t dst = h * r.head_stride + len * r.pos_stride + i;
        static_cast<float*>(r.k[b])[dst] = nk[static_cast<size_t>(src)];
        static_cast<float*>(r.v[b])[dst] = nv[static_cast<size_t>(src)];
      }
  }
  appended.append(1, new_k, new_v);
  EXPECT_EQ(cache.k_buffer(1).to_vector<float>(), appended.k_buffer(1).to_vector<float>());
  EXPECT_EQ(cache.v_buffer(1).to_vector<float>(), appended.v_buffer(1).to_vector<float>());
  EXPECT_EQ(cache.k_buffer(0).to_vector<float>(), zeros);
  // A range of rows sees its own rows; row 1 has room for 2 more positions, not 3.
  DecodeKVCache& row1 = cache.rows(1, 1);
  const KVRows r1 = row1.layer_rows(0, 2);
  EXPECT_EQ(r1.rows, 1);
  EXPECT_EQ(r1.positions, 4);
  EXPECT_EQ(r1.k[0], cache.k_buffer(0).data<float>() + cache.k_buffer(0).stride(0));
  try {
    row1.layer_rows(0, 3);
    FAIL() << "rows past the capacity did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity of 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cache.layer_rows(2, 1), Error);  // layer 2 of 2
}

// layer_rows() names, row by row and without making anything, the memory and layout of the
// views append() returns for as many positions: for the whole cache and a range of its rows,
// f32 and bf16, with the same errors.
TEST(KVCache, LayerRowsDescribeTheViewsOfAppend) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    ContiguousKVCache cache(2, 3, 5, 2, 4, dtype);
    cache.rows(1, 2).advance(3);  // lengths 0, 3, 3
    for (int64_t first : {0, 1}) {
      DecodeKVCache& c = first == 0 ? static_cast<DecodeKVCache&>(cache) : cache.rows(1, 2);
      const int64_t n = c.batch();
      Allocator& alloc = allocator_for(Device::CPU);
      const uint64_t requests = alloc.stats().requests;
      const KVRows r = c.layer_rows(1, 2);
      EXPECT_EQ(alloc.stats().requests, requests);    // nothing made
      const Tensor kv = Tensor::zeros({n, 2, 2, 4});  // two positions a row (append stores them)
      const auto [k, v] = c.append(1, kv, kv);
      EXPECT_EQ(r.rows, n);
      EXPECT_EQ(r.n_kv_head, k.size(1));
      EXPECT_EQ(r.positions, k.size(2));
      EXPECT_EQ(r.head_size, k.size(3));
      EXPECT_EQ(r.head_stride, k.stride(1));
      EXPECT_EQ(r.pos_stride, k.stride(2));
      EXPECT_EQ(k.stride(3), 1);
      EXPECT_EQ(r.dtype, dtype);
      EXPECT_EQ(r.device, Device::CPU);
      const size_t row = static_cast<size_t>(k.stride(0)) * dtype_size(dtype);
      for (int64_t b = 0; b < n; ++b) {
        EXPECT_EQ(r.k[b], static_cast<char*>(k.raw_data()) + static_cast<size_t>(b) * row);
        EXPECT_EQ(r.v[b], static_cast<char*>(v.raw_data()) + static_cast<size_t>(b) * row);
      }
      EXPECT_THROW(c.layer_rows(1, 3), Error);  // rows of length 3 hold 5
      EXPECT_THROW(c.layer_rows(2, 1), Error);  // layer 2 of 2
    }
  }
}

TEST(KVCache, AcceptsAnyStrides) {
  // The same values once with HS contiguous and once with HS strided (the slow path).
  const int64_t B = 2, NKV = 2, T = 3, HS = 4;
  const Tensor dense = coded(B, NKV, T, HS, 1).contiguous();  // (B, NKV, T, HS)
  Tensor hs_major = Tensor::empty({HS, B, NKV, T});           // HS outermost: stride(3) != 1 below
  const std::vector<float> d = dense.to_vector<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NKV; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < HS; ++i)
          hs_major.data<float>()[((i * B + b) * NKV + h) * T + t] =
              d[static_cast<size_t>(((b * NKV + h) * T + t) * HS + i)];
  const Tensor strided = hs_major.as_strided({B, NKV, T, HS}, {NKV * T, T, 1, B * NKV * T}, 0);
  ASSERT_NE(strided.stride(3), 1);
  ContiguousKVCache a(1, B, 5, NKV, HS), b(1, B, 5, NKV, HS);
  a.rows(1, 1).advance(1);  // rows at different lengths
  b.rows(1, 1).advance(1);
  auto [ka, va] = a.append(0, dense, dense);
  auto [kb, vb] = b.append(0, strided, strided);
  EXPECT_EQ(ka.to_vector<float>(), kb.to_vector<float>());
  EXPECT_EQ(a.v_buffer(0).to_vector<float>(), b.v_buffer(0).to_vector<float>());
}

TEST(KVCache, MoveRowTruncateResetAndCapacity) {
  ContiguousKVCache cache(2, 3, 4, 1, 2);
  for (int layer = 0; layer < 2; ++layer)
    cache.append(layer, coded(3, 1, 2, 2, static_cast<float>(layer)),
                 coded(3, 1, 2, 2, static_cast<float>(layer)));
  cache.advance(2);
  cache.move_row(2, 0);
  cache.truncate_batch(2);
  EXPECT_EQ(cache.batch(), 2);
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{2, 2}));
  // Row 0 now holds what row 2 had, in every layer.
  EXPECT_EQ(cache.k_buffer(1).data<float>()[1], 1.0f + 2000 + 1);
  EXPECT_THROW(cache.move_row(2, 0), Error);  // row 2 is no longer active
  // Capacity 4: two more positions fit, a third does not.
  cache.append(0, coded(2, 1, 2, 2, 0), coded(2, 1, 2, 2, 0));
  cache.advance(2);
  try {
    cache.append(0, coded(2, 1, 1, 2, 0), coded(2, 1, 1, 2, 0));
    FAIL() << "append past the capacity did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity of 4"), std::string::npos) << e.what();
  }
  cache.reset_row(1);
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{4, 0}));
  cache.reset();
  EXPECT_EQ(cache.batch(), 3);
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_THROW(ContiguousKVCache(1, 1, 0, 1, 1), Error);
  EXPECT_THROW(cache.append(0, coded(3, 2, 1, 2, 0), coded(3, 2, 1, 2, 0)), Error);  // NKV 2
}

// Prefill of a whole prompt in one forward equals feeding it one token at a time: the same
// cache contents and the same logits at every position.
// (n_kv_head, cache dtype): a bf16 cache rounds keys and values as they are stored, and both
// ways read them back from the cache, so they agree as closely as in f32, except that the two
// ways' f32 keys and values (a many-row GEMM against one-row products, summed in other
// orders) can fall on either side of a bf16 rounding boundary: an element may then differ by
// one bf16 step, and the logits then by what such a step makes (7e-5 seen where one did,
// 2-3e-6 elsewhere, as in f32).
class PrefillSplit : public ::testing::TestWithParam<std::tuple<int64_t, DType>> {};

TEST_P(PrefillSplit, OnePassEqualsTokenByToken) {
  const auto [nkv, dtype] = GetParam();
  auto model = test::tiny_model(nkv);
  const GPTConfig& c = model->config();
  NoGradGuard no_grad;
  const int64_t B = 2, T = 9;
  std::vector<int32_t> ids(static_cast<size_t>(B * T));
  Generator gen(3);
  for (auto& t : ids) t = static_cast<int32_t>(gen.below(static_cast<uint64_t>(c.vocab_size)));
  const Tensor tokens = Tensor::from_vector(ids, {B, T});

  ContiguousKVCache one(c.n_layer, B, c.block_size, nkv, c.head_size(), dtype);
  const std::vector<float> full = model->forward(tokens, &one).to_vector<float>();  // (B, T, V)
  ContiguousKVCache step(c.n_layer, B, c.block_size, nkv, c.head_size(), dtype);
  const int64_t V = c.vocab_size;
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    const Tensor col = narrow(tokens, 1, t, 1).contiguous();
    const std::vector<float> l = model->forward(col, &step).to_vector<float>();  // (B, 1, V)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < V; ++i)
        worst = std::max(
            worst, static_cast<double>(std::fabs(l[static_cast<size_t>(b * V + i)] -
                                                 full[static_cast<size_t>((b * T + t) * V + i)])));
  }
  EXPECT_LE(worst, dtype == DType::BF16 ? 5e-4 : 1e-5);
  EXPECT_EQ(one.lengths(), step.lengths());
  for (int layer = 0; layer < c.n_layer; ++layer)
    for (const bool is_k : {true, false}) {
      const auto a = test::cached(one, layer, is_k);
      const auto b = test::cached(step, layer, is_k);
      ASSERT_EQ(a.size(), b.size());
      double d = 0;  // beyond the allowed difference
      for (size_t i = 0; i < a.size(); ++i) {
        const double m = std::max(std::fabs(a[i]), std::fabs(b[i]));  // ilogb(0) is INT_MIN
        const double step_bf16 = m > 0 ? std::ldexp(1.0, std::ilogb(m) - 7) : 0.0;
        const double allowed = dtype == DType::BF16 ? std::max(1e-5, step_bf16) : 1e-5;
        d = std::max(d, std::fabs(a[i] - b[i]) - allowed);
      }
      EXPECT_LE(d, 0.0) << "layer " << layer << (is_k ? " K" : " V");
    }
  // The cache is not trivially empty: its keys are the model's, not zeros.
  double norm = 0;
  for (float x : test::cached(one, 0, true)) norm += std::fabs(x);
  EXPECT_GT(norm, 1.0);
}

INSTANTIATE_TEST_SUITE_P(NkvDtype, PrefillSplit,
                         ::testing::Combine(::testing::Values(4, 2, 1),
                                            ::testing::Values(DType::F32, DType::BF16)),
                         [](const auto& info) {
                           return "nkv" + std::to_string(std::get<0>(info.param)) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace kvlab
