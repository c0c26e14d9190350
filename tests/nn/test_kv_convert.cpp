#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "autograd/graph.h"
#include "nn/kv_convert.h"

namespace kvlab {
namespace {

GPTConfig config(int64_t n_head, int64_t n_kv_head, bool tied = true) {
  GPTConfig c;
  c.vocab_size = 11;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = n_head;
  c.n_kv_head = n_kv_head;
  c.n_embd = 8 * n_head;  // head_size 8
  c.tied = tied;
  return c;
}

std::map<std::string, Tensor> by_name(const GPT& m) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : m.named_parameters()) out.emplace(name, t);
  return out;
}

bool is_kv(const std::string& name) {
  return name.find(".attn.k_proj.") != std::string::npos ||
         name.find(".attn.v_proj.") != std::string::npos;
}

// GPT initialises biases to zero: give every parameter random values, so a bias taken from
// the wrong head (or not converted at all) shows.
void randomise(GPT& m, uint64_t seed) {
  Generator gen(seed);
  for (auto& [name, t] : m.named_parameters()) {
    Tensor p = t;
    normal_(p, gen, 0.3);
  }
}

// Within each group of `group` consecutive KV heads, every head's k/v rows (weight and bias)
// become the group's first head's.
void equalise_groups(GPT& m, int64_t group) {
  const int64_t n_kv = m.config().n_kv_head;
  for (auto& [name, t] : m.named_parameters()) {
    if (!is_kv(name)) continue;
    float* p = t.data<float>();
    const int64_t head = t.numel() / n_kv;
    for (int64_t h = 0; h < n_kv; ++h) std::copy_n(p + (h - h % group) * head, head, p + h * head);
  }
}

std::vector<float> logits(GPT& m) {
  NoGradGuard no_grad;
  const Tensor tokens = Tensor::from_vector<int32_t>({1, 5, 2, 9, 3, 0, 7, 4, 10, 6, 2, 8}, {2, 6});
  return m.forward(tokens).to_vector<float>();
}

// max |a - b| over max |a|.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(a[i])));
  }
  return diff / scale;
}

TEST(KVConvert, SameHeadCountIsAnExactCopy) {
  for (const int64_t nkv : {4, 2, 1}) {
    GPT src(config(4, nkv), 3);
    randomise(src, 4);
    const std::vector<float> want = logits(src);
    for (const KVHeadInit init : {KVHeadInit::Mean, KVHeadInit::First}) {
      const auto dst = convert_kv_heads(src, nkv, init);
      EXPECT_EQ(dst->config().n_kv_head, nkv);
      EXPECT_EQ(logits(*dst), want) << kv_head_init_name(init) << ", n_kv_head " << nkv;
      const auto s = by_name(src);
      for (const auto& [name, t] : dst->named_parameters())
        EXPECT_EQ(t.to_vector<float>(), s.at(name).to_vector<float>()) << name;
    }
  }
}

// Where the heads of each group already agree, merging them loses nothing: the converted
// model computes the source's logits (MHA -> GQA, GQA -> MQA, MHA -> MQA).
TEST(KVConvert, GroupsOfEqualHeadsConvertExactly) {
  struct Case {
    int64_t n_head, from, to;
  };
  for (const Case c : {Case{4, 4, 2}, Case{4, 2, 1}, Case{4, 4, 1}, Case{6, 6, 3}}) {
    GPT src(config(c.n_head, c.from), 7);
    randomise(src, 8);
    equalise_groups(src, c.from / c.to);
    const std::vector<float> want = logits(src);
    for (const KVHeadInit init : {KVHeadInit::Mean, KVHeadInit::First}) {
      const auto dst = convert_kv_heads(src, c.to, init);
      EXPECT_LE(relative_difference(want, logits(*dst)), 1e-6)
          << kv_head_init_name(init) << ": n_kv_head " << c.from << " -> " << c.to;
    }
  }
}

// The same models without equal heads: the logits move, so the test above can fail.
TEST(KVConvert, GroupsOfDifferentHeadsChangeTheLogits) {
  GPT src(config(4, 4), 7);
  randomise(src, 8);
  const std::vector<float> want = logits(src);
  for (const KVHeadInit init : {KVHeadInit::Mean, KVHeadInit::First}) {
    const auto dst = convert_kv_heads(src, 2, init);
    EXPECT_GT(relative_difference(want, logits(*dst)), 1e-3) << kv_head_init_name(init);
  }
}

TEST(KVConvert, MeanAndFirstTakeTheGroupsRows) {
  GPT src(config(4, 4), 11);
  randomise(src, 12);
  const auto mean = convert_kv_heads(src, 2, KVHeadInit::Mean);
  const auto first = convert_kv_heads(src, 2, KVHeadInit::First);
  const auto s = by_name(src), m = by_name(*mean), f = by_name(*first);
  int checked = 0;
  for (const auto& [name, t] : s) {
    const std::vector<float> sv = t.to_vector<float>();
    const std::vector<float> mv = m.at(name).to_vector<float>();
    const std::vector<float> fv = f.at(name).to_vector<float>();
    if (!is_kv(name)) {
      EXPECT_EQ(mv, sv) << name;
      EXPECT_EQ(fv, sv) << name;
      continue;
    }
    ++checked;
    const size_t head = sv.size() / 4;  // new head j: source heads 2 j and 2 j + 1
    ASSERT_EQ(mv.size(), 2 * head) << name;
    for (size_t j = 0; j < 2; ++j)
      for (size_t i = 0; i < head; ++i) {
        const float a = sv[(2 * j) * head + i], b = sv[(2 * j + 1) * head + i];
        EXPECT_NEAR(mv[j * head + i], (static_cast<double>(a) + b) / 2, 1e-7) << name << " " << i;
        EXPECT_EQ(fv[j * head + i], a) << name << " " << i;
      }
  }
  EXPECT_EQ(checked, 2 * 4);  // k and v, weight and bias, in 2 layers
}

TEST(KVConvert, RandomIsFreshAndSeeded) {
  GPT src(config(4, 4), 13);
  randomise(src, 14);
  const auto mean = by_name(*convert_kv_heads(src, 2, KVHeadInit::Mean));
  const auto first = by_name(*convert_kv_heads(src, 2, KVHeadInit::First));
  const auto a = by_name(*convert_kv_heads(src, 2, KVHeadInit::Random, 5));
  const auto b = by_name(*convert_kv_heads(src, 2, KVHeadInit::Random, 5));
  const auto c = by_name(*convert_kv_heads(src, 2, KVHeadInit::Random, 6));
  const auto s = by_name(src);
  for (const auto& [name, t] : a) {
    const std::vector<float> v = t.to_vector<float>();
    EXPECT_EQ(v, b.at(name).to_vector<float>()) << name;  // the same seed, the same draws
    if (!is_kv(name)) {
      EXPECT_EQ(v, s.at(name).to_vector<float>()) << name;
      continue;
    }
    if (name.ends_with(".bias")) {
      EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 0; })) << name;
      continue;
    }
    EXPECT_NE(v, c.at(name).to_vector<float>()) << name;
    EXPECT_NE(v, mean.at(name).to_vector<float>()) << name;
    EXPECT_NE(v, first.at(name).to_vector<float>()) << name;
    double sq = 0;
    for (const float x : v) sq += static_cast<double>(x) * x;
    EXPECT_NEAR(std::sqrt(sq / static_cast<double>(v.size())), 0.02, 0.004) << name;
  }
}

TEST(KVConvert, ShapesAreTheNewConfigs) {
  struct Case {
    int64_t n_head, from, to;
    bool tied;
  };
  for (const Case c :
       {Case{4, 4, 2, true}, Case{4, 4, 1, false}, Case{8, 4, 2, true}, Case{6, 3, 1, false}}) {
    GPT src(config(c.n_head, c.from, c.tied), 1);
    const auto dst = convert_kv_heads(src, c.to, KVHeadInit::Mean);
    GPTConfig want = src.config();
    want.n_kv_head = c.to;
    EXPECT_EQ(dst->config().n_kv_head, c.to);
    EXPECT_EQ(dst->config().tied, c.tied);
    std::vector<std::pair<std::string, std::vector<int64_t>>> got;
    for (const auto& [name, t] : dst->named_parameters()) got.emplace_back(name, t.sizes());
    EXPECT_EQ(got, parameter_shapes(want)) << c.from << " -> " << c.to;
  }
}

template <class F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    FAIL() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(KVConvert, BadTargetsAreNamed) {
  GPT src(config(4, 4), 1);
  expect_error([&] { convert_kv_heads(src, 0, KVHeadInit::Mean); },
               "n_kv_head must be >= 1, got 0");
  expect_error([&] { convert_kv_heads(src, 8, KVHeadInit::Mean); },
               "n_kv_head 8 is more than the source's 4");
  expect_error([&] { convert_kv_heads(src, 3, KVHeadInit::Mean); },
               "n_kv_head 3 does not divide the source's n_kv_head 4");
  expect_error([] { parse_kv_head_init("median"); }, "unknown method 'median'");
  EXPECT_EQ(parse_kv_head_init("first"), KVHeadInit::First);
}

}  // namespace
}  // namespace kvlab
