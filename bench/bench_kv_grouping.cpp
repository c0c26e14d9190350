// int4 key grouping, measured on a trained checkpoint: per position (what kvlab's int4 cache
// stores: a scale and minimum per group of up to 32 channels of one position) against per
// channel over blocks of positions (KIVI: a scale and minimum per channel over 16 positions,
// the block still filling kept in f32). Values are grouped per position in all. A third case,
// per position with the same f32 residual, separates the grouping from the residual.
//
// Both are applied the same way: a window's first T - 1 tokens are prefilled into an f32 cache,
// its keys and values are then quantised and dequantised in place as the grouping says, and
// token T is decoded; its next-token distribution is compared with the untouched cache's
// (loss delta, KL, top-1). Only that last step reads quantised keys (the earlier positions'
// states were computed from exact ones), so this compares the groupings on equal terms and is
// not either one's full cost: `kvlab bench kv-quality` measures that for the cache itself.
// T is spread over [17, block_size] so that every window holds a whole block of 16 and the
// residual block takes each size.
//
//   bench_kv_grouping --ckpt FILE [--data FILE] [--windows 512] [--json out.json]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "autograd/graph.h"
#include "checkpoints/model_io.h"
#include "data/sampler.h"
#include "infer/kv_cache.h"
#include "infer/measure/kv_quality.h"
#include "platform/kv_rows.h"
#include "platform/kv_rows.h"

using namespace kvlab;
using nlohmann::json;

namespace {

constexpr int64_t kBlock = 16;  // positions a per-channel group spans (KIVI's residual length)

// x (n <= 32 values at stride st) quantised and dequantised in place as one int4 row of n
// channels: a single group, by the cache's own quantiser.
void fake_int4(float* x, int64_t n, int64_t st) {
  float column[32];
  uint8_t row[64];
  for (int64_t i = 0; i < n; ++i) column[i] = x[i * st];
  quantise_kv_row(DType::INT4, row, column, n, 0.0f);
  dequantise_kv_row(DType::INT4, column, row, n, 0.0f);
  for (int64_t i = 0; i < n; ++i) x[i * st] = column[i];
}

// How keys are grouped: per position over every position, per channel over each whole block of
// kBlock positions, or per position over the whole blocks only (the partial last block kept,
// as per channel keeps it).
enum class Keys { PerPosition, PerChannel, PerPositionResidual };

// The first `len` positions of every layer's keys and values in cache (row 0), quantised: keys
// as `keys` says, values per position.
void quantise_cache(ContiguousKVCache& cache, int64_t len, Keys keys) {
  const int64_t HS = cache.head_size(), S = cache.capacity();
  std::vector<uint8_t> row(static_cast<size_t>(kv_row_bytes(DType::INT4, HS)));
  for (int l = 0; l < cache.n_layer(); ++l)
    for (int which = 0; which < 2; ++which) {
      float* base = (which == 0 ? cache.k_buffer(l) : cache.v_buffer(l)).data<float>();
      for (int64_t h = 0; h < cache.n_kv_head(); ++h) {
        float* head = base + h * S * HS;
        if (which == 0 && keys == Keys::PerChannel) {
          for (int64_t b0 = 0; b0 + kBlock <= len; b0 += kBlock)
            for (int64_t c = 0; c < HS; ++c) fake_int4(head + b0 * HS + c, kBlock, HS);
        } else {
          const int64_t n =
              which == 0 && keys == Keys::PerPositionResidual ? len / kBlock * kBlock : len;
          for (int64_t p = 0; p < n; ++p) {
            quantise_kv_row(DType::INT4, row.data(), head + p * HS, HS, 0.0f);
            dequantise_kv_row(DType::INT4, head + p * HS, row.data(), HS, 0.0f);
          }
        }
      }
    }
}

struct Sums {
  double delta = 0, kl = 0, top1 = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("int4 keys grouped per position against per channel over blocks of 16 positions");
  std::string ckpt, data, json_path;
  int windows = 512;
  app.add_option("--ckpt", ckpt, "Trained checkpoint")->required();
  app.add_option("--data", data, "Corpus (default: the checkpoint's; its validation split is read)");
  app.add_option("--windows", windows, "Windows, each scored at its last token")->capture_default_str();
  app.add_option("--json", json_path, "Write the figures as JSON");
  CLI11_PARSE(app, argc, argv);
  try {
    LoadedModel loaded = load_model(ckpt);
    GPT& model = *loaded.model;
    const GPTConfig& cfg = model.config();
    const std::vector<int32_t> val = checkpoint_validation_ids(loaded, data, &data);
    const int64_t S = cfg.block_size, V = cfg.vocab_size;
    if (S < kBlock + 1 || windows < 1) {
      std::fprintf(stderr, "bench_kv_grouping: needs block_size > %lld and --windows >= 1\n",
                   static_cast<long long>(kBlock));
      return 2;
    }
    const std::vector<int64_t> starts =
        fixed_windows(static_cast<int64_t>(val.size()), static_cast<int>(S), windows, 99);
    const NoGradGuard no_grad;
    constexpr int kCases = 3;
    Sums sums[kCases];
    for (int w = 0; w < windows; ++w) {
      const int64_t T = kBlock + 1 + w % (S - kBlock);  // 17 .. S tokens fed
      const auto at = static_cast<size_t>(starts[static_cast<size_t>(w)]);
      const std::vector<int32_t> prompt(val.begin() + at, val.begin() + at + T - 1);
      const int32_t last = val[at + T - 1], target = val[at + T];
      auto decode = [&](int grouping) {  // -1: f32
        ContiguousKVCache cache(cfg.n_layer, 1, S, cfg.n_kv_head, cfg.head_size());
        model.forward(Tensor::from_vector(prompt, {1, T - 1}), &cache);
        if (grouping >= 0) quantise_cache(cache, T - 1, static_cast<Keys>(grouping));
        return model.forward(Tensor::from_vector(std::vector<int32_t>{last}, {1, 1}), &cache)
            .to_vector<float>();
      };
      auto log_softmax = [&](const std::vector<float>& z) {
        const float mx = *std::max_element(z.begin(), z.end());
        double s = 0;
        for (float v : z) s += std::exp(double(v) - mx);
        std::vector<double> out(z.size());
        for (size_t i = 0; i < z.size(); ++i) out[i] = z[i] - mx - std::log(s);
        return out;
      };
      const std::vector<float> ref_logits = decode(-1);
      const std::vector<double> ref = log_softmax(ref_logits);
      const auto ref_top = std::max_element(ref_logits.begin(), ref_logits.end()) - ref_logits.begin();
      for (int g = 0; g < kCases; ++g) {
        const std::vector<float> z = decode(g);
        const std::vector<double> lp = log_softmax(z);
        double kl = 0;
        for (int64_t v = 0; v < V; ++v) kl += std::exp(ref[v]) * (ref[v] - lp[v]);
        sums[g].delta += ref[target] - lp[target];
        sums[g].kl += kl;
        sums[g].top1 += (std::max_element(z.begin(), z.end()) - z.begin()) == ref_top;
      }
    }
    const char* names[kCases] = {"per position (groups of channels)",
                                 "per channel (blocks of 16), residual f32",
                                 "per position, the same residual f32"};
    std::printf("%s: %d windows of %s, int4 keys (values per position in both), against f32:\n",
                ckpt.c_str(), windows, data.c_str());
    json out{{"checkpoint", ckpt}, {"data", data}, {"windows", windows}, {"groupings", json::array()}};
    for (int g = 0; g < kCases; ++g) {
      const double n = windows;
      std::printf("  %-42s delta loss %+.5f  mean KL %.3e  top-1 %.4f\n", names[g],
                  sums[g].delta / n, sums[g].kl / n, sums[g].top1 / n);
      out["groupings"].push_back({{"keys", names[g]},
                                  {"delta_loss", sums[g].delta / n},
                                  {"kl", sums[g].kl / n},
                                  {"top1", sums[g].top1 / n}});
    }
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kv_grouping: %s\n", e.what());
    return 1;
  }
}
