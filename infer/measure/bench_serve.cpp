// kvlab bench serve: a request stream served by the scheduler (infer/scheduler.h) under its
// static policy, as static batching over contiguous caches, and under its continuous one over
// the paged cache, at the same KV memory.
#include <omp.h>

#include <algorithm>
#include <bit>
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

// One side of the comparison: the scheduler's loop under so.policy, fed the requests as they
// arrive.
//  - Continuous: each request is added when it arrives and makes its own output_tokens.
//  - Static, as a batch of fixed shape over contiguous caches: when no batch runs, the arrived
//    requests, up to `slots` rows (a row per sample), form the next one; every row generates
//    until the batch's longest output is made, and a request's tokens are its first
//    output_tokens. Its KV utilisation is what contiguous rows of the batch's capacity (the
//    longest prompt and output) would hold; the paged pool it runs on holds no more rows.
json serve_policy(Engine& engine, const std::vector<KVRequest>& reqs, Timeline t,
                  const SchedulerOptions& so, int64_t slots, const BenchServeOptions& o) {
  const bool fixed = so.policy == BatchPolicy::Static;
  const char* side = batch_policy_name(so.policy);
  const int64_t block = engine.model().config().block_size;
  Scheduler s(engine, so);
  const auto t0 = Clock::now();
  struct Of {
    size_t request;
    int64_t sample, made = 0;
  };
  std::vector<Of> of;  // of each RequestId
  int64_t peak = 0, steps = 0, finished = 0, sequences = 0, capacity = 0;
  for (const KVRequest& r : reqs) sequences += r.samples;
  double utilisation = 0;  // positions stored / held, summed over steps
  size_t next = 0;
  auto add = [&](size_t i, int64_t max_new) {
    GenerateOptions g;
    g.sampling.temperature = 0;
    g.ignore_eos = true;  // each request makes its output length
    g.max_new_tokens = max_new;
    for (int64_t k = 0; k < reqs[i].samples; ++k) {
      const RequestId id = s.add(reqs[i].prompt, g, {.sample = k});
      if (static_cast<size_t>(id) >= of.size()) of.resize(static_cast<size_t>(id) + 1);
      of[static_cast<size_t>(id)] = {i, k};
    }
  };
  while (next < reqs.size() || !s.idle()) {
    if (s.idle()) wait_for(t, next, t0);
    if (!fixed) {
      for (; next < reqs.size() && t.arrival[next] <= seconds_since(t0); ++next)
        add(next, reqs[next].output_tokens);
    } else if (s.idle()) {
      const size_t first = next;
      int64_t rows = 0, longest = 1, prompt = 1;
      for (; next < reqs.size() && rows + reqs[next].samples <= slots &&
             t.arrival[next] <= seconds_since(t0);
           ++next) {
        rows += reqs[next].samples;
        longest = std::max(longest, reqs[next].output_tokens);
        prompt = std::max(prompt, static_cast<int64_t>(reqs[next].prompt.size()));
      }
      for (size_t i = first; i < next; ++i) add(i, longest);
      capacity = rows * std::min(block, prompt + longest - 1);
    }
    const std::vector<SchedulerEvent> events = s.step();
    const double now = seconds_since(t0);
    for (const SchedulerEvent& e : events) {
      Of& x = of[static_cast<size_t>(e.request)];
      if (e.token >= 0 && x.made++ < reqs[x.request].output_tokens) t.token(x.request, x.sample, now);
      finished += e.finished;
    }
    if (o.on_requests) o.on_requests(side, finished, sequences);
    peak = std::max(peak, s.last_step().admitted);
    const BlockStats b = s.block_stats();
    if (b.in_use > 0) {
      const int64_t held = fixed ? capacity : b.in_use * so.cache.kv_block_size;
      utilisation += static_cast<double>(b.positions) / static_cast<double>(held);
      ++steps;
    }
  }
  json out = serve_summary(t, reqs, seconds_since(t0), peak);
  if (!fixed) out["preemptions"] = s.preemptions();
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
  // Both policies run the scheduler, over a paged pool of its own each.
  Engine engine(model, tokenizer, o.cache_dtype, std::nullopt);
  engine.decode_step().int8_products = o.int8_products;
  SchedulerOptions so;
  so.max_batch_tokens = o.max_batch_tokens;
  so.max_seqs = std::min<int64_t>(o.requests, o.max_batch_tokens);
  so.cache.kv_block_size = o.kv_block_size;
  so.cache.pool_bytes = budget;
  // Static batching over contiguous caches: at most as many rows as full-context rows of the
  // same memory, each a row of one block (of the context where it is a power of two: then in
  // exactly that memory), read as a contiguous row is, and no prefix cache (a row has none).
  SchedulerOptions static_batching = so;
  static_batching.policy = BatchPolicy::Static;
  static_batching.max_seqs = slots;
  static_batching.max_batch_tokens = std::max(so.max_batch_tokens, slots);
  // The pool's size left unset: room for max_seqs sequences of the whole context.
  static_batching.cache = {
      .kv_block_size = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(c.block_size))),
      .prefix_caching = false};

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
    run["continuous_paged"] = serve_policy(engine, reqs, t, so, slots, o);
    if (o.with_static) {
      run["static_contiguous"] = serve_policy(engine, reqs, t, static_batching, slots, o);
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
