#pragma once
// Seeded random numbers whose full state is four words, so checkpoints can save and restore it
// exactly (xoshiro256**, seeded through splitmix64).
#include <array>
#include <cmath>
#include <cstdint>

// The stateless hash is shared with CUDA kernels, so dropout masks agree across devices.
#ifdef __CUDACC__
#define KVLAB_HOST_DEVICE __host__ __device__
#else
#define KVLAB_HOST_DEVICE
#endif

namespace kvlab {

KVLAB_HOST_DEVICE inline uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Stateless hash of (seed, counter) to 64 bits: dropout masks are a function of their element
// index, so backward recomputes them instead of storing them.
KVLAB_HOST_DEVICE inline uint64_t hash64(uint64_t seed, uint64_t counter) {
  uint64_t x = seed ^ (counter * 0xD1B54A32D192ED03ull);
  return splitmix64(x);
}

class Generator {
 public:
  using State = std::array<uint64_t, 4>;
  explicit Generator(uint64_t seed = 0) { reseed(seed); }
  void reseed(uint64_t seed) {
    uint64_t x = seed;
    for (auto& w : s_) w = splitmix64(x);
  }
  uint64_t next_u64() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n > 0 (Lemire's multiply-shift; bias below 2^-64 * n).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }
  // Standard normal (Box-Muller; uses two draws, keeps no spare so the state stays four words).
  double normal() {
    double u1 = uniform();
    const double u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  const State& state() const { return s_; }
  void set_state(const State& s) { s_ = s; }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  State s_{};
};

}  // namespace kvlab
