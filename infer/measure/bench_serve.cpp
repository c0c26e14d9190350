// kvlab bench serve: a request stream served by static batching over contiguous caches and by
// continuous batching (infer/scheduler.h) over the paged cache, at the same KV memory.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "infer/kv_cache.h"
#include "infer/measure/bench.h"
#include "infer/measure/kv_workload.h"
#include "infer/scheduler.h"
#include "platform/error.h"
#include "platform/random.h"

namespace kvlab {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Nearest rank: the smallest value with at least q of the samples at or below it.
double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(q * static_cast<double>(v.size()));
  return v[static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(v.size()))) - 1];
}

json quantiles_ms(const std::vector<double>& seconds) {
  std::vector<double> ms;
  for (const double s : seconds) ms.push_back(s * 1e3);
  return json{{"p50", quantile(ms, 0.5)}, {"p90", quantile(ms, 0.9)}, {"p99", quantile(ms, 0.99)}};
}

using Timeline = ServeTimeline;

}  // namespace

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<double> poisson_arrivals(size_t n, double rate, uint64_t seed) {
  std::vector<double> arrivals(n, 0.0);
  Generator gen(seed + 17);
  double at = 0;
  for (double& a : arrivals) {
    if (rate > 0) at += -std::log(1.0 - gen.uniform()) / rate;
    a = at;
  }
  return arrivals;
}

json serve_summary(const ServeTimeline& t, const std::vector<KVRequest>& reqs, double duration,
                   int64_t peak_sequences) {
  std::vector<double> ttft, tpot;
  int64_t tokens = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    ttft.push_back(t.first[i] - t.arrival[i]);
    const int64_t o = reqs[i].output_tokens;
    tokens += o * reqs[i].samples;
    if (o > 1) tpot.push_back((t.last[i] - t.first[i]) / static_cast<double>(o - 1));
  }
  return json{{"duration_s", duration},
              {"requests_per_s", static_cast<double>(reqs.size()) / duration},
              {"output_tokens_per_s", static_cast<double>(tokens) / duration},
              {"ttft_ms", quantiles_ms(ttft)},
              {"tpot_ms", quantiles_ms(tpot)},
              {"itl_ms", quantiles_ms(t.gaps)},
              {"peak_sequences", peak_sequences}};
}

namespace {

// Waits until the next request not yet taken has arrived, if none has.
void wait_for(const Timeline& t, size_t next, Clock::time_point t0) {
  if (next < t.arrival.size() && t.arrival[next] > seconds_since(t0))
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(t.arrival[next])));
}

// Static batching: the arrived requests, up to `slots` rows of them (a row per sample), run as
// one batch until its longest output is made (every row generates that long, as a batch of
// fixed shape does); then the next batch. Each request's tokens are its first output_tokens.
json serve_static(Engine& engine, const std::vector<KVRequest>& reqs, Timeline t, int64_t slots,
                  const BenchServeOptions& o) {
  const auto t0 = Clock::now();
  int64_t peak = 0, done = 0, sequences = 0;
  for (const KVRequest& r : reqs) sequences += r.samples;
  double utilisation = 0, weight = 0;  // each batch's mean, weighted by its steps
  for (size_t next = 0; next < reqs.size();) {
    wait_for(t, next, t0);
    std::vector<size_t> batch;
    int64_t rows = 0;
    while (next < reqs.size() && rows + reqs[next].samples <= slots &&
           t.arrival[next] <= seconds_since(t0)) {
      rows += reqs[next].samples;
      batch.push_back(next++);
    }
    std::vector<std::vector<int32_t>> prompts;
    GenerateOptions g;
    g.sampling.temperature = 0;
    g.max_new_tokens = 1;
    for (const size_t i : batch) {
      for (int64_t s = 0; s < reqs[i].samples; ++s) prompts.push_back(reqs[i].prompt);
      g.max_new_tokens = std::max(g.max_new_tokens, reqs[i].output_tokens);
    }
    // Step k makes every row's token k + 2 (the prefill makes the first).
    std::vector<double> step_end;
    g.on_decode_step = [&](int64_t) { step_end.push_back(seconds_since(t0)); };
    const double start = seconds_since(t0);
    const GenerationResult res = engine.generate_ids(prompts, g);
    size_t row = 0;
    for (const size_t i : batch)
      for (int64_t s = 0; s < reqs[i].samples; ++s, ++row) {
        t.token(i, s, start + res.rows[row].ttft_s);
        for (int64_t k = 0; k + 1 < reqs[i].output_tokens; ++k)
          t.token(i, s, step_end[static_cast<size_t>(k)]);
      }
    peak = std::max(peak, rows);
    done += rows;
    if (o.on_requests) o.on_requests("static", done, sequences);
    const auto steps = static_cast<double>(std::max<size_t>(step_end.size(), 1));
    utilisation += res.stats.utilisation_mean() * steps;
    weight += steps;
  }
  json out = serve_summary(t, reqs, seconds_since(t0), peak);
  out["kv_utilisation"] = weight > 0 ? utilisation / weight : 0.0;
  return out;
}

json serve_continuous(Engine& engine, const std::vector<KVRequest>& reqs, Timeline t,
                      const SchedulerOptions& so, const BenchServeOptions& o) {
  Scheduler s(engine, so);
  const auto t0 = Clock::now();
  std::vector<std::pair<size_t, int64_t>> of;  // request and sample of each RequestId
  int64_t peak = 0, steps = 0, finished = 0, sequences = 0;
  for (const KVRequest& r : reqs) sequences += r.samples;
  double utilisation = 0;  // positions stored / held by the blocks in use, summed over steps
  size_t next = 0;
  while (next < reqs.size() || !s.idle()) {
    if (s.idle()) wait_for(t, next, t0);
    for (; next < reqs.size() && t.arrival[next] <= seconds_since(t0); ++next) {
      GenerateOptions g;
      g.sampling.temperature = 0;
      g.max_new_tokens = reqs[next].output_tokens;
      for (int64_t k = 0; k < reqs[next].samples; ++k) {
        const RequestId id = s.add(reqs[next].prompt, g, {.sample = k});
        if (static_cast<size_t>(id) >= of.size()) of.resize(static_cast<size_t>(id) + 1);
        of[static_cast<size_t>(id)] = {next, k};
      }
    }
    const std::vector<SchedulerEvent> events = s.step();
    const double now = seconds_since(t0);
    for (const SchedulerEvent& e : events) {
      const auto [i, k] = of[static_cast<size_t>(e.request)];
      if (e.token >= 0) t.token(i, k, now);
      finished += e.finished;
    }
    if (o.on_requests) o.on_requests("continuous", finished, sequences);
    peak = std::max(peak, s.last_step().admitted);
    const BlockStats b = s.block_stats();
    if (b.in_use > 0) {
      utilisation +=
          static_cast<double>(b.positions) / static_cast<double>(b.in_use * so.cache.kv_block_size);
      ++steps;
    }
  }
  json out = serve_summary(t, reqs, seconds_since(t0), peak);
  out["preemptions"] = s.preemptions();
  out["kv_utilisation"] = steps > 0 ? utilisation / static_cast<double>(steps) : 0.0;
  return out;
}

}  // namespace

json bench_serve(GPT& model, const Tokenizer& tokenizer, const BenchServeOptions& o) {
  const GPTConfig& c = model.config();
  KVLAB_CHECK(model.device() == Device::CPU, "bench serve: the paged cache runs on the CPU");
  for (const double r : o.rates)
    KVLAB_CHECK(std::isfinite(r) && r > 0, "bench serve: request rates must be > 0, got ", r);
  const int64_t bytes_per_position = kv_bytes_per_token(c, o.cache_dtype);
  const int64_t budget =
      o.budget_bytes > 0 ? o.budget_bytes : 16 * c.block_size * bytes_per_position;
  const int64_t slots = budget / (c.block_size * bytes_per_position);
  KVLAB_CHECK(slots >= 1, "bench serve: a KV memory of ", budget,
              " bytes holds no full-context sequence (", c.block_size * bytes_per_position,
              " bytes)");
  KVLAB_CHECK(o.samples <= slots, "bench serve: ", o.samples,
              " samples a request need as many rows of static batching, but its KV memory holds ",
              slots);
  const std::vector<KVRequest> reqs = make_kv_workload({.requests = o.requests,
                                                        .context = c.block_size,
                                                        .samples = o.samples,
                                                        .system_prompt = o.system_prompt,
                                                        .shared_fraction = o.shared_fraction,
                                                        .vocab_size = c.vocab_size,
                                                        .seed = o.seed});
  // Static batching generates over the engine's contiguous cache; the scheduler keeps a
  // paged one of its own.
  Engine engine(model, tokenizer, o.cache_dtype, std::nullopt);
  engine.decode_step().int8_products = o.int8_products;
  SchedulerOptions so;
  so.max_batch_tokens = o.max_batch_tokens;
  so.max_seqs = std::min<int64_t>(o.requests, o.max_batch_tokens);
  so.cache.kv_block_size = o.kv_block_size;
  so.cache.pool_bytes = budget;

  json out{{"model", json{{"n_layer", c.n_layer},
                          {"n_head", c.n_head},
                          {"n_kv_head", c.n_kv_head},
                          {"n_embd", c.n_embd},
                          {"block_size", c.block_size},
                          {"vocab_size", c.vocab_size}}},
           {"threads", omp_get_max_threads()},
           {"budget_bytes", budget},
           {"static_slots", slots},
           {"kv_block_size", o.kv_block_size},
           {"max_batch_tokens", o.max_batch_tokens},
           {"max_seqs", so.max_seqs},
           {"requests", o.requests},
           {"runs", json::array()}};
  std::vector<double> rates = o.rates;
  if (rates.empty()) rates.push_back(0);  // every request at once
  for (const double rate : rates) {
    const Timeline t(poisson_arrivals(reqs.size(), rate, o.seed), o.samples);
    const std::string label = rate > 0 ? detail::cat(rate, " requests/s") : "all at once";
    json run{{"rate", rate > 0 ? json(rate) : json("all at once")}};
    run["continuous_paged"] = serve_continuous(engine, reqs, t, so, o);
    if (o.with_static) {
      run["static_contiguous"] = serve_static(engine, reqs, t, slots, o);
      run["throughput_ratio"] = run["continuous_paged"]["requests_per_s"].get<double>() /
                                run["static_contiguous"]["requests_per_s"].get<double>();
      if (o.progress)
        o.progress(detail::cat(label, ": continuous / static requests/s ",
                               run["throughput_ratio"].get<double>()));
    } else if (o.progress) {
      o.progress(label + ": continuous batching done");
    }
    if (o.over_http) {
      run["continuous_http"] = o.over_http(reqs, t, so);
      if (o.progress) o.progress(label + ": over HTTP done");
    }
    out["runs"].push_back(run);
  }
  return out;
}

}  // namespace kvlab
