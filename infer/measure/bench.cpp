#include "infer/measure/bench.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "infer/engine.h"
#include "infer/kv_cache.h"
#include "infer/measure/kv_workload.h"
#include "platform/memory.h"
#include "platform/random.h"

namespace kvlab {

using nlohmann::json;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

json spread(const std::vector<double>& v) {
  return json{{"median", median(v)},
              {"min", *std::min_element(v.begin(), v.end())},
              {"max", *std::max_element(v.begin(), v.end())}};
}

namespace {

struct RunFigures {
  double tokens_per_s, e2e_tokens_per_s, ttft_ms, tpot_mean_ms, tpot_p50_ms, tpot_p99_ms;
  std::vector<double> step_ms;
};

RunFigures figures(const GenerationStats& s) {
  RunFigures f{s.decode_tokens_per_s(),
               s.tokens_per_s(),
               s.ttft_s * 1e3,
               s.tpot_mean_s() * 1e3,
               s.tpot_quantile_s(0.5) * 1e3,
               s.tpot_quantile_s(0.99) * 1e3,
               {}};
  f.step_ms.reserve(s.step_s.size());
  for (double t : s.step_s) f.step_ms.push_back(t * 1e3);
  return f;
}

json summarise(const std::vector<RunFigures>& runs) {
  auto med = [&](double RunFigures::*m) {
    std::vector<double> v;
    for (const auto& r : runs) v.push_back(r.*m);
    return median(v);
  };
  return json{{"tokens_per_s", med(&RunFigures::tokens_per_s)},
              {"e2e_tokens_per_s", med(&RunFigures::e2e_tokens_per_s)},
              {"ttft_ms", med(&RunFigures::ttft_ms)},
              {"tpot_mean_ms", med(&RunFigures::tpot_mean_ms)},
              {"tpot_p50_ms", med(&RunFigures::tpot_p50_ms)},
              {"tpot_p99_ms", med(&RunFigures::tpot_p99_ms)}};
}

// Median step time per step index over the runs.
std::vector<double> median_steps(const std::vector<RunFigures>& runs) {
  size_t n = SIZE_MAX;
  for (const auto& r : runs) n = std::min(n, r.step_ms.size());
  if (runs.empty()) n = 0;
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> v;
    for (const auto& r : runs) v.push_back(r.step_ms[i]);
    out[i] = median(v);
  }
  return out;
}

// Time per token at `points` positions spread over the steps: the median of the five steps
// around each point (step i feeds the token at position prompt + i), so one preempted step
// does not make a point. With fewer steps than points, each step is a point once.
json position_curve(const std::vector<double>& steps, int64_t prompt, int points) {
  json out = json::array();
  const int64_t n = static_cast<int64_t>(steps.size());
  if (n == 0 || points <= 0) return out;
  const int64_t half = 2;
  for (int64_t p = 0, last = -1; p < points; ++p) {
    const int64_t i = points == 1 ? 0 : (n - 1) * p / (points - 1);
    if (i == last) continue;
    last = i;
    const int64_t lo = std::max<int64_t>(0, i - half), hi = std::min(n - 1, i + half);
    out.push_back(
        json{{"position", prompt + i},
             {"ms", median(std::vector<double>(steps.begin() + lo, steps.begin() + hi + 1))}});
  }
  return out;
}

std::vector<int32_t> random_prompt(int64_t n, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = static_cast<int32_t>(gen.below(static_cast<uint64_t>(vocab)));
  return p;
}

// The peak rate at which this process's threads read `bytes` of f32 (a decode step's working
// set, so the probe hits the same level of the cache hierarchy as the step): the best of many
// passes, each thread summing its own slice into 64 independent lanes (one accumulator would
// make the adds, not the loads, the limit). A step cannot beat bytes over this rate.
double cpu_read_bandwidth(double bytes) {
  const int64_t lanes = 64, n = std::max<int64_t>(lanes * 1024,
                                                  static_cast<int64_t>(bytes / 4) / lanes * lanes);
  std::vector<float> buf(static_cast<size_t>(n));
  float* data = buf.data();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(i & 1023);
  const int passes =
      static_cast<int>(std::clamp(2e9 / (4.0 * static_cast<double>(n)), 20.0, 2000.0));
  double best = 1e30;
  volatile float sink = 0;  // keeps the sums, and so the reads, alive
  for (int pass = 0; pass < passes; ++pass) {
    const double t0 = omp_get_wtime();
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
      const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num(), rows = n / lanes;
      const int64_t lo = rows * id / threads * lanes, hi = rows * (id + 1) / threads * lanes;
      float acc[lanes] = {};
      for (int64_t i = lo; i < hi; i += lanes)
#pragma omp simd
        for (int64_t j = 0; j < lanes; ++j) acc[j] += data[i + j];
      for (float a : acc) total += a;
    }
    best = std::min(best, omp_get_wtime() - t0);
    sink = sink + total;
  }
  return 4.0 * static_cast<double>(n) / best / 1e9;
}

// Bytes a decode step of `batch` rows reads: the weights (DecodeStep::weight_bytes) once for
// all the rows, plus each row's cached K and V of every layer at position `pos` (quantised
// rows with their scales).
double step_read_bytes(const Engine& engine, double pos, int64_t batch) {
  const GPTConfig& c = engine.model().config();
  return static_cast<double>(engine.decode_step().weight_bytes()) +
         static_cast<double>(batch * kv_bytes_per_token(c, engine.cache_dtype())) * pos;
}

// A decode side's memory traffic: bytes_read_per_step and read_GB_per_s, and on the CPU the
// ceiling measured here over a buffer of the step's size (at least 256 KB; each timed pass
// includes entering the parallel region, <1% of a pass at a real model's size; on a GPU,
// bench_cuda measures its own): read_bandwidth_GB_per_s, ceiling_tokens_per_s and
// fraction_of_ceiling.
void add_bandwidth(json& side, const Engine& engine, double mean_pos, int64_t batch) {
  const double bytes = step_read_bytes(engine, mean_pos, batch);
  const double tps = side["tokens_per_s"].get<double>(), steps = tps / static_cast<double>(batch);
  side["bytes_read_per_step"] = bytes;
  side["read_GB_per_s"] = bytes * steps / 1e9;
  if (engine.model().wte.weight.device() != Device::CPU) return;
  const double gbps = cpu_read_bandwidth(bytes);
  side["read_bandwidth_GB_per_s"] = gbps;
  side["ceiling_tokens_per_s"] = static_cast<double>(batch) * gbps * 1e9 / bytes;
  side["fraction_of_ceiling"] = steps * bytes / (gbps * 1e9);
}

// o.batch random prompts of o.prompt_tokens each; the first is the one a batch of 1 uses.
// A batch whose KV cache (at most n_head heads, up to block_size positions) could not fit in
// memory is refused first: building its prompts alone would take hours.
std::vector<std::vector<int32_t>> random_prompts(const BenchGenerateOptions& o,
                                                 const GPTConfig& c) {
  KVLAB_CHECK(o.batch >= 1, "bench: batch must be >= 1, got ", o.batch);
  const double row_bytes =
      static_cast<double>(kv_bytes_per_token(c.n_layer, c.n_head, c.head_size(), o.cache_dtype)) *
      static_cast<double>(c.block_size);
  const double memory = host_memory_bytes();
  KVLAB_CHECK(memory <= 0 || static_cast<double>(o.batch) * row_bytes <= memory,
              "bench: a batch of ", o.batch, " rows would need up to ",
              static_cast<double>(o.batch) * row_bytes / 1e9,
              " GB of KV cache, more than this machine's ", memory / 1e9, " GB of memory");
  const int64_t vocab = c.vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < o.batch; ++b)
    prompts.push_back(random_prompt(o.prompt_tokens, vocab, o.seed + static_cast<uint64_t>(b)));
  return prompts;
}

json model_json(const Engine& engine) {
  const GPTConfig& c = engine.model().config();
  const int64_t params = engine.model().num_parameters();
  return json{{"n_layer", c.n_layer},
              {"n_head", c.n_head},
              {"n_kv_head", c.n_kv_head},
              {"n_embd", c.n_embd},
              {"block_size", c.block_size},
              {"vocab_size", c.vocab_size},
              {"parameters", params},
              {"weight_bytes", params * 4},
              {"decode_weight_bytes", engine.decode_step().weight_bytes()}};
}

// A setting's runs, and the last run's stats (its cache's bytes and positions).
struct Measured {
  std::vector<RunFigures> runs;
  GenerationStats last;
};

// One measured setting: a warm-up of `warm` new tokens (discarded: allocator, caches, thread
// pool), then o.runs runs of g. o.on_tokens hears of every row's tokens as they are made, the
// warm-up's included, against the setting's total.
Measured measure(Engine& engine, const std::vector<std::vector<int32_t>>& prompt,
                 const GenerateOptions& g, int64_t warm, const BenchGenerateOptions& o,
                 const std::string& setting) {
  const int64_t rows = static_cast<int64_t>(prompt.size());
  const int64_t total = rows * (warm + o.runs * g.max_new_tokens);
  int64_t before = 0;  // tokens of the generations already done
  auto run = [&](GenerateOptions opts) {
    if (o.on_tokens)  // the first token comes from the prefill, one more per decode step
      opts.on_decode_step = [&](int64_t step) {
        o.on_tokens(setting, before + rows * (step + 2), total);
      };
    const GenerationResult res = engine.generate_ids(prompt, opts);
    before += rows * opts.max_new_tokens;
    return res.stats;
  };
  if (o.on_tokens) o.on_tokens(setting, 0, total);
  GenerateOptions w = g;
  w.max_new_tokens = warm;
  run(w);
  Measured m;
  for (int r = 0; r < o.runs; ++r) {
    m.last = run(g);
    m.runs.push_back(figures(m.last));
  }
  return m;
}

}  // namespace

Tokenizer synthetic_tokenizer(int64_t vocab_size) {
  KVLAB_CHECK(vocab_size >= 1, "synthetic tokenizer: vocab_size must be >= 1, got ", vocab_size);
  std::vector<uint32_t> cps;
  cps.reserve(static_cast<size_t>(vocab_size));
  for (uint32_t cp = 32; static_cast<int64_t>(cps.size()) < vocab_size; ++cp) {
    if (cp >= 127 && cp < 161) continue;        // DEL and C1 controls
    if (cp >= 0xD800 && cp < 0xE000) continue;  // surrogates
    cps.push_back(cp);
  }
  return Tokenizer::from_vocab(TokenizerKind::Char, std::move(cps));
}

json bench_generate(GPT& model, const Tokenizer& tokenizer, const BenchGenerateOptions& o) {
  const GPTConfig& c = model.config();
  KVLAB_CHECK(o.runs >= 1, "bench: runs must be >= 1, got ", o.runs);
  KVLAB_CHECK(o.prompt_tokens >= 1 && o.prompt_tokens < c.block_size, "bench: a prompt of ",
              o.prompt_tokens, " tokens leaves no room in block_size ", c.block_size);
  std::vector<int64_t> lengths;
  const int64_t cap = c.block_size - o.prompt_tokens;
  for (int64_t n : o.new_tokens) {
    KVLAB_CHECK(n >= 1, "bench: new token counts must be >= 1, got ", n);
    const int64_t m = std::min(n, cap);
    if (std::find(lengths.begin(), lengths.end(), m) == lengths.end()) lengths.push_back(m);
  }
  model.round_matrices(o.weight_dtype);
  Engine engine(model, tokenizer, o.cache_dtype, o.paged);
  engine.decode_step().enabled = o.fused_decode;
  engine.decode_step().int8_products = o.int8_products;
  const std::vector<std::vector<int32_t>> prompt = random_prompts(o, c);

  json out{{"model", model_json(engine)},
           {"threads", omp_get_max_threads()},
           {"prompt_tokens", o.prompt_tokens},
           {"batch", o.batch},
           {"cache_dtype", dtype_name(o.cache_dtype)},
           {"weight_dtype", weight_dtype_name(o.weight_dtype)},
           {"fused_decode", o.fused_decode && model.device() == Device::CPU},
           {"int8_products", engine.decode_step().multiplies_in_integers()},
           {"runs", o.runs},
           {"sampling", "greedy"},
           {"results", json::array()}};
  std::vector<double> curve_cache, curve_nocache;
  for (int64_t n : lengths) {
    json entry{{"new_tokens", n}};
    for (bool use_cache : {true, false}) {
      if (!use_cache && !o.no_cache) continue;
      GenerateOptions g;
      g.max_new_tokens = n;
      g.sampling.temperature = 0;
      g.ignore_eos = true;  // every row makes its n tokens
      g.use_cache = use_cache;
      const std::string setting =
          detail::cat("new tokens ", n, use_cache ? ", cache on" : ", cache off");
      const Measured m = measure(engine, prompt, g, std::min<int64_t>(n, 32), o, setting);
      const int64_t positions = m.last.cache_capacity;
      json side = summarise(m.runs);
      if (use_cache) {
        side["cache_bytes"] = m.last.cache_bytes;
        side["cache_positions"] = positions;
        // A paged cache holds whole blocks: each row's positions rounded up to them.
        const int64_t bs = o.paged ? o.paged->kv_block_size : 1;
        side["cache_layout"] = o.paged ? "paged" : "contiguous";
        side["cache_bytes_formula"] =
            kv_cache_formula_bytes(c, o.batch, (positions + bs - 1) / bs * bs, o.cache_dtype);
        add_bandwidth(side, engine,
                      static_cast<double>(o.prompt_tokens) + static_cast<double>(n) / 2, o.batch);
        curve_cache = median_steps(m.runs);
      } else {
        curve_nocache = median_steps(m.runs);
      }
      entry[use_cache ? "cache" : "no_cache"] = side;
      if (o.progress)
        o.progress(detail::cat(setting, ": ",
                               static_cast<int64_t>(side["tokens_per_s"].get<double>()), " tok/s"));
    }
    if (entry.contains("no_cache")) {
      const double off = entry["no_cache"]["tokens_per_s"].get<double>();
      entry["speedup"] = off > 0 ? entry["cache"]["tokens_per_s"].get<double>() / off : 0.0;
    }
    out["results"].push_back(entry);
  }
  out["time_vs_position"] =
      json{{"new_tokens", lengths.back()},
           {"cache", position_curve(curve_cache, o.prompt_tokens, o.position_points)},
           {"no_cache", position_curve(curve_nocache, o.prompt_tokens, o.position_points)}};
  return out;
}

json kv_cache_report(const GPTConfig& config, const std::vector<int64_t>& kv_heads, int64_t batch,
                     DType dtype) {
  json out = json::array();
  const int64_t L = config.n_layer, S = config.block_size, HS = config.head_size();
  const int64_t mha = kv_cache_formula_bytes(L, batch, S, config.n_head, HS, dtype);
  for (int64_t nkv : kv_heads) {
    GPTConfig c = config;
    c.n_kv_head = nkv;
    c.validate();
    // fp8's scales are the cache's to check, not to measure: ones of the right count.
    const ContiguousKVCache cache(L, batch, S, nkv, HS, dtype, Device::CPU,
                                  std::vector<float>(dtype == DType::FP8 ? 2 * L * nkv : 0, 1.0f));
    const int64_t measured = cache.bytes();
    out.push_back(
        json{{"n_kv_head", nkv},
             {"dtype", dtype_name(dtype)},
             {"batch", batch},
             {"positions", S},
             {"measured_bytes", measured},
             {"formula_bytes", kv_cache_formula_bytes(L, batch, S, nkv, HS, dtype)},
             {"ratio_to_mha", static_cast<double>(measured) / static_cast<double>(mha)},
             {"expected_ratio", static_cast<double>(nkv) / static_cast<double>(config.n_head)}});
  }
  return out;
}

json bench_decode_by_kv_heads(const GPTConfig& config, const std::vector<int64_t>& kv_heads,
                              int64_t new_tokens, const BenchGenerateOptions& o) {
  json out = json::array();
  const Tokenizer tok = synthetic_tokenizer(config.vocab_size);
  const int64_t n = std::min(new_tokens, config.block_size - o.prompt_tokens);
  KVLAB_CHECK(n >= 1, "bench: a prompt of ", o.prompt_tokens,
              " tokens leaves no room in block_size ", config.block_size);
  const std::vector<std::vector<int32_t>> prompt = random_prompts(o, config);
  for (int64_t nkv : kv_heads) {
    GPTConfig c = config;
    c.n_kv_head = nkv;
    GPT model(c, o.seed + 1);
    model.set_training(false);
    model.to(o.device);
    model.round_matrices(o.weight_dtype);
    Engine engine(model, tok, o.cache_dtype, o.paged);
    engine.decode_step().enabled = o.fused_decode;
    engine.decode_step().int8_products = o.int8_products;
    GenerateOptions g;
    g.max_new_tokens = n;
    g.sampling.temperature = 0;
    g.ignore_eos = true;
    const std::string setting = detail::cat("n_kv_head ", nkv);
    const Measured m = measure(engine, prompt, g, n, o, setting);
    json e = summarise(m.runs);
    e["n_kv_head"] = nkv;
    e["new_tokens"] = n;
    e["cache_bytes"] = m.last.cache_bytes;
    e["weights"] = "random";
    e["weight_dtype"] = weight_dtype_name(o.weight_dtype);
    e["batch"] = o.batch;
    add_bandwidth(e, engine, static_cast<double>(o.prompt_tokens) + static_cast<double>(n) / 2,
                  o.batch);
    out.push_back(e);
    if (o.progress)
      o.progress(detail::cat(setting, ": ", static_cast<int64_t>(e["tokens_per_s"].get<double>()),
                             " tok/s"));
  }
  return out;
}

// ---- kv-memory ---------------------------------------------------------------------------

namespace {

json sim_json(const KVSimResult& r) {
  return json{
      {"steps", r.steps},
      {"utilisation_mean", r.utilisation_mean},
      {"utilisation_min", r.utilisation_min},
      {"peak_sequences", r.peak_resident},
      {"mean_sequences", r.mean_resident},
      {"peak_bytes", r.peak_bytes},
      {"preemptions", r.preemptions},
      {"prefill_positions", r.prefill_positions},
      {"prefix_hit_positions", r.prefix_hit_positions},
      {"prompt_copies", r.prompt_positions > 0 ? static_cast<double>(r.prompt_positions_stored) /
                                                     static_cast<double>(r.prompt_positions)
                                               : 0.0}};
}

// The memory part for one n_kv_head: the three workloads through both layouts.
json kv_memory_for(const GPTConfig& c, int64_t nkv, const BenchKVMemoryOptions& o, int64_t budget,
                   int64_t system_prompt) {
  KVSimOptions so;
  so.budget_bytes = budget;
  so.bytes_per_position = kv_bytes_per_token(c.n_layer, nkv, c.head_size(), o.cache_dtype);
  so.context = c.block_size;
  so.kv_block_size = o.kv_block_size;
  const KVWorkloadOptions base{
      .requests = o.requests, .context = c.block_size, .vocab_size = c.vocab_size, .seed = o.seed};
  auto both = [&](const KVWorkloadOptions& w) {
    const std::vector<KVRequest> reqs = make_kv_workload(w);
    const KVLayoutComparison cmp = compare_kv_layouts(reqs, so);
    return std::pair{json{{"paged", sim_json(cmp.paged)}, {"contiguous", sim_json(cmp.contiguous)}},
                     reqs};
  };
  KVWorkloadOptions sampled = base, shared = base;
  sampled.samples = o.samples;
  shared.system_prompt = system_prompt;
  json out{{"n_kv_head", nkv},          {"bytes_per_position", so.bytes_per_position},
           {"blocks", so.blocks()},     {"slots", so.slots()},
           {"plain", both(base).first}, {"samples", both(sampled).first}};
  auto [sys, reqs] = both(shared);
  KVSimOptions off = so;
  off.prefix_caching = false;
  sys["paged_no_prefix_caching"] = sim_json(simulate_kv_cache(reqs, KVLayout::Paged, off));
  out["system_prompt"] = sys;
  return out;
}

// Decode speed, paged against contiguous, at each of o.decode_batches: in alternating rounds
// after a warm-up of each (bench_kv_memory's "decode").
template <class Say>
json paged_decode_speed(Engine& on_pages, Engine& contiguous, const GenerateOptions& greedy,
                        int64_t vocab, const BenchKVMemoryOptions& o, const Say& say) {
  json out = json::array();
  for (const int64_t batch : o.decode_batches) {
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t b = 0; b < batch; ++b)
      prompts.push_back(random_prompt(o.decode_prompt, vocab, o.seed + 100 + b));
    on_pages.generate_ids(prompts, greedy);
    contiguous.generate_ids(prompts, greedy);
    // Each round runs both, the one going first alternating: neither side always follows
    // the other.
    std::vector<double> p, q, ratio;
    auto rate = [&](Engine& e) {
      return e.generate_ids(prompts, greedy).stats.decode_tokens_per_s();
    };
    for (int r = 0; r < o.rounds; ++r) {
      if (r % 2 == 0) {
        p.push_back(rate(on_pages));
        q.push_back(rate(contiguous));
      } else {
        q.push_back(rate(contiguous));
        p.push_back(rate(on_pages));
      }
      ratio.push_back(p.back() / q.back());
    }
    out.push_back(json{{"batch", batch},
                       {"paged_tokens_per_s", spread(p)},
                       {"contiguous_tokens_per_s", spread(q)},
                       {"ratio", spread(ratio)}});
    say(detail::cat("decode at batch ", batch, ": paged / contiguous ", median(ratio)));
  }
  return out;
}

}  // namespace

json bench_kv_memory(GPT& model, const Tokenizer& tokenizer, const BenchKVMemoryOptions& o) {
  const GPTConfig& c = model.config();
  KVLAB_CHECK(model.device() == Device::CPU, "bench kv-memory: the paged cache runs on the CPU");
  KVLAB_CHECK(o.rounds >= 1, "bench kv-memory: rounds must be >= 1, got ", o.rounds);
  KVLAB_CHECK(!o.kv_heads.empty(), "bench kv-memory: no n_kv_head settings");
  KVLAB_CHECK(o.decode_prompt >= 1 && o.decode_new_tokens >= 2 &&
                  o.decode_prompt + o.decode_new_tokens <= c.block_size,
              "bench kv-memory: a decode prompt of ", o.decode_prompt, " and ", o.decode_new_tokens,
              " new tokens (at least 2) must fit in block_size ", c.block_size);
  const int64_t budget = o.budget_bytes > 0
                             ? o.budget_bytes
                             : kv_cache_formula_bytes(c.n_layer, 16, c.block_size, c.n_head,
                                                      c.head_size(), o.cache_dtype);
  const int64_t system_prompt = o.system_prompt > 0 ? o.system_prompt : c.block_size / 4;
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };

  json out{{"model", json{{"n_layer", c.n_layer},
                          {"n_head", c.n_head},
                          {"n_kv_head", c.n_kv_head},
                          {"n_embd", c.n_embd},
                          {"block_size", c.block_size},
                          {"vocab_size", c.vocab_size},
                          {"parameters", model.num_parameters()}}},
           {"threads", omp_get_max_threads()},
           {"kv_block_size", o.kv_block_size},
           {"cache_dtype", dtype_name(o.cache_dtype)},
           {"budget_bytes", budget},
           {"workload",
            json{{"requests", o.requests},
                 {"context", c.block_size},
                 {"distribution",
                  "prompt u ~ round(exp(N(ln(c/8), 1))) and output o ~ round(exp(N(ln(c/6), 1))) "
                  "tokens, clipped to prompt + output <= c (infer/measure/kv_workload.h)"},
                 {"samples", o.samples},
                 {"system_prompt", system_prompt}}},
           {"memory", json::array()}};
  for (const int64_t nkv : o.kv_heads) {
    out["memory"].push_back(kv_memory_for(c, nkv, o, budget, system_prompt));
    say(detail::cat("n_kv_head ", nkv, ": workload simulated"));
  }

  // Decode speed, paged against contiguous, in alternating rounds after a warm-up of each.
  PagedCacheOptions paged{.kv_block_size = o.kv_block_size, .prefix_caching = false};
  Engine on_pages(model, tokenizer, o.cache_dtype, paged);
  Engine contiguous(model, tokenizer, o.cache_dtype, std::nullopt);
  GenerateOptions greedy;
  greedy.sampling.temperature = 0;
  greedy.ignore_eos = true;
  greedy.max_new_tokens = o.decode_new_tokens;
  out["decode"] = paged_decode_speed(on_pages, contiguous, greedy, c.vocab_size, o, say);

  // Time to first token of a request whose system prompt an earlier one left in the prefix
  // cache, against the same request without prefix caching. Each request has its own user
  // part, so only the system prompt's whole blocks can be taken.
  const int64_t user = std::min<int64_t>(32, c.block_size - system_prompt - 1);
  KVLAB_CHECK(user >= 1, "bench kv-memory: a system prompt of ", system_prompt,
              " tokens leaves no room for a user part in block_size ", c.block_size);
  const std::vector<int32_t> system = random_prompt(system_prompt, c.vocab_size, o.seed + 7);
  auto request = [&](int64_t i) {
    std::vector<int32_t> r = system;
    const std::vector<int32_t> u = random_prompt(user, c.vocab_size, o.seed + 1000 + i);
    r.insert(r.end(), u.begin(), u.end());
    return std::vector<std::vector<int32_t>>{r};
  };
  Engine cached(model, tokenizer, o.cache_dtype,
                PagedCacheOptions{.kv_block_size = o.kv_block_size});
  GenerateOptions first = greedy;
  first.max_new_tokens = 1;
  cached.generate_ids(request(0), first);  // leaves the system prompt's blocks cached
  on_pages.generate_ids(request(0), first);
  std::vector<double> ttft_on, ttft_off;
  int64_t prefill_on = 0, prefill_off = 0;
  for (int r = 0; r < o.rounds; ++r) {
    const bool on_first = r % 2 == 0;
    const GenerationStats b0 =
        on_first ? GenerationStats{} : on_pages.generate_ids(request(r + 1), first).stats;
    const GenerationStats a = cached.generate_ids(request(r + 1), first).stats;
    const GenerationStats b = on_first ? on_pages.generate_ids(request(r + 1), first).stats : b0;
    ttft_on.push_back(a.ttft_s * 1e3);
    ttft_off.push_back(b.ttft_s * 1e3);
    prefill_on = a.prefill_positions;
    prefill_off = b.prefill_positions;
  }
  out["prefix_caching"] =
      json{{"system_prompt", system_prompt},
           {"user_tokens", user},
           {"ttft_ms", json{{"on", spread(ttft_on)}, {"off", spread(ttft_off)}}},
           {"prefill_positions", json{{"on", prefill_on}, {"off", prefill_off}}}};
  say(detail::cat("prefix caching: TTFT ", median(ttft_on), " ms against ", median(ttft_off),
                  " ms"));

  // n samples of one prompt: forked from its prefill, against the prompt given n times.
  GenerateOptions sampled = greedy;
  sampled.sampling.temperature = 1;
  const std::vector<int32_t> prompt = random_prompt(o.decode_prompt, c.vocab_size, o.seed + 9);
  GenerateOptions forked = sampled;
  forked.n = o.samples;
  const std::vector<std::vector<int32_t>> repeated(static_cast<size_t>(o.samples), prompt);
  out["samples"] =
      json{{"prompt_tokens", o.decode_prompt},
           {"samples", o.samples},
           {"new_tokens", o.decode_new_tokens},
           {"forked_bytes", on_pages.generate_ids({prompt}, forked).stats.cache_bytes},
           {"independent_bytes", on_pages.generate_ids(repeated, sampled).stats.cache_bytes},
           {"contiguous_bytes", contiguous.generate_ids(repeated, sampled).stats.cache_bytes},
           {"prompt_blocks_shared", o.decode_prompt / o.kv_block_size},
           {"block_bytes", kv_bytes_per_token(c, o.cache_dtype) * o.kv_block_size}};
  return out;
}

}  // namespace kvlab
