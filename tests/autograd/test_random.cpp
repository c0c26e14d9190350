// random.h: seeded xoshiro256** generator and the stateless hash behind dropout masks.
#include <cmath>
#include <set>

#include "tests/autograd/gradcheck.h"

namespace {

using kvlab::Generator;

TEST(AutogradRandom, SameSeedSameSequenceAndStateRoundTrips) {
  Generator a(42), b(42), c(43);
  std::vector<uint64_t> sa, sc;
  for (int i = 0; i < 8; ++i) {
    sa.push_back(a.next_u64());
    sc.push_back(c.next_u64());
    EXPECT_EQ(sa.back(), b.next_u64());
  }
  EXPECT_NE(sa, sc);
  const Generator::State st = a.state();
  const uint64_t n1 = a.next_u64(), n2 = a.next_u64();
  Generator d(0);
  d.set_state(st);
  EXPECT_EQ(d.next_u64(), n1);
  EXPECT_EQ(d.next_u64(), n2);
  a.reseed(42);
  EXPECT_EQ(a.next_u64(), sa[0]);
}

TEST(AutogradRandom, DistributionsHaveTheRightMoments) {
  Generator g(7);
  const int n = 200000;
  double su = 0, su2 = 0, sn = 0, sn2 = 0;
  std::vector<int> counts(7, 0);
  for (int i = 0; i < n; ++i) {
    const double u = g.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    su += u;
    su2 += u * u;
    const double z = g.normal();
    ASSERT_TRUE(std::isfinite(z));
    sn += z;
    sn2 += z * z;
    const uint64_t k = g.below(7);
    ASSERT_LT(k, 7u);
    ++counts[k];
  }
  EXPECT_NEAR(su / n, 0.5, 0.005);
  EXPECT_NEAR(su2 / n - 0.25, 1.0 / 12, 0.003);
  EXPECT_NEAR(sn / n, 0.0, 0.015);
  EXPECT_NEAR(sn2 / n, 1.0, 0.02);
  for (int c : counts) EXPECT_NEAR(c / static_cast<double>(n), 1.0 / 7, 0.005);
}

TEST(AutogradRandom, HashIsAPureFunctionOfSeedAndCounter) {
  EXPECT_EQ(kvlab::hash64(1, 5), kvlab::hash64(1, 5));
  std::set<uint64_t> seen;
  for (uint64_t s = 0; s < 4; ++s)
    for (uint64_t i = 0; i < 1000; ++i) seen.insert(kvlab::hash64(s, i));
  EXPECT_EQ(seen.size(), 4000u);
}

}  // namespace
