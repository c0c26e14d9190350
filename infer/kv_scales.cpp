#include "infer/kv_scales.h"

#include <algorithm>
#include <cmath>

namespace kvlab {

namespace {

// Bounds on rows [first, first + n) of x W^T + b for x = ln_1's output, gamma * xhat + beta with
// |xhat| <= sqrt(C) (RMSNorm: no beta): |y_j| <= sqrt(C) * ||W[j] * gamma|| + |W[j] . beta +
// b[j]| (Cauchy-Schwarz).
std::vector<double> ln_linear_bounds(const LayerNorm& ln, const Linear& proj, int64_t first,
                                     int64_t n) {
  const Tensor gamma = ln.weight.to(Device::CPU).contiguous();
  const Tensor beta = ln.bias.defined() ? ln.bias.to(Device::CPU).contiguous() : Tensor();
  const Tensor w = proj.weight.to(Device::CPU).contiguous();  // (out, C)
  const Tensor b = proj.bias.defined() ? proj.bias.to(Device::CPU).contiguous() : Tensor();
  const int64_t C = w.size(1);
  std::vector<double> bounds(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const float* wj = w.data<float>() + (first + j) * C;
    double gain2 = 0, shift = b.defined() ? b.data<float>()[first + j] : 0.0;
    for (int64_t i = 0; i < C; ++i) {
      const double g = double(wj[i]) * gamma.data<float>()[i];
      gain2 += g * g;
      if (beta.defined()) shift += double(wj[i]) * beta.data<float>()[i];
    }
    bounds[static_cast<size_t>(j)] = std::sqrt(double(C) * gain2) + std::fabs(shift);
  }
  return bounds;
}

// The largest of n channel bounds; rotated, RoPE turns each pair (j, j + n/2), so either
// channel reaches the pair's norm.
double head_bound(const std::vector<double>& b, bool rotated) {
  const size_t n = b.size();
  double bound = 0;
  for (size_t j = 0; j < n; ++j) {
    const double pair = rotated ? b[(j + n / 2) % n] : 0.0;
    bound = std::max(bound, std::sqrt(b[j] * b[j] + pair * pair));
  }
  return bound;
}

// A head whose outputs are all zero: any positive scale stores them exactly.
float scale_for(double bound) { return bound > 0 ? static_cast<float>(bound / 448.0) : 1.0f; }

}  // namespace

std::vector<float> fp8_kv_scales(const GPT& model) {
  const GPTConfig& c = model.config();
  const int64_t HS = c.head_size(), NKV = c.n_kv_head;
  std::vector<float> scales;
  for (const auto& blk : model.blocks) {
    if (const LatentAttention* m = blk->mla.get()) {
      // A latent row is its key and its value, so both scales are the row's. kv_norm's output
      // is at most sqrt(R) times its largest gain (RMSNorm: |x_i| <= sqrt(R) * rms(x)); the
      // rotary key is kv_down's last D rows, turned.
      const Tensor g = m->kv_norm.weight.to(Device::CPU).contiguous();
      double latent = 0;
      for (int64_t i = 0; i < m->rank; ++i)
        latent = std::max(latent, std::fabs(double(g.data<float>()[i])));
      latent *= std::sqrt(double(m->rank));
      const double rot =
          head_bound(ln_linear_bounds(blk->ln_1, m->kv_down, m->rank, m->rope_dim), true);
      scales.insert(scales.end(), 2, scale_for(std::max(latent, rot)));
      continue;
    }
    for (const Linear* proj : {&blk->attn->k_proj, &blk->attn->v_proj})
      for (int64_t h = 0; h < NKV; ++h)
        scales.push_back(scale_for(head_bound(ln_linear_bounds(blk->ln_1, *proj, h * HS, HS),
                                              c.rope() && proj == &blk->attn->k_proj)));
  }
  return scales;
}

std::vector<float> kv_cache_scales(const GPT& model, DType dtype) {
  return dtype == DType::FP8 ? fp8_kv_scales(model) : std::vector<float>{};
}

}  // namespace kvlab
