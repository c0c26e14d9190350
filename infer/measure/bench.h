#pragma once
// Generation benchmarks behind `kvlab bench generate`: decode speed with and without the KV
// cache, time per token against position, and the cache's memory against the formula.
// Timing lives here and in bench/, never in unit tests.
#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "infer/engine.h"
#include "infer/measure/kv_workload.h"
#include "infer/scheduler.h"
#include "nn/gpt.h"

namespace kvlab {

struct BenchGenerateOptions {
  int64_t prompt_tokens = 16;
  // Rows decoded together, each from its own random prompt of prompt_tokens; tokens/s counts
  // every row's tokens.
  int64_t batch = 1;
  // Each capped at block_size - prompt_tokens (duplicates after capping are dropped).
  std::vector<int64_t> new_tokens = {64, 256, 512};
  int runs = 3;                 // measured runs per setting (median reported); one warm-up before
  bool no_cache = true;         // also measure recomputation without the cache
  int position_points = 8;      // sample points of time per token against position
  uint64_t seed = 0;            // prompt tokens are drawn from it; decoding is greedy
  Device device = Device::CPU;  // where the models of bench_decode_by_kv_heads run
  DType cache_dtype = DType::F32;          // of the KV cache: f32 or bf16
  std::optional<PagedCacheOptions> paged;  // the engines' paged cache; none: contiguous
  // Of the products' matrices: bf16, q8_0 or q4_0 rounds those of every model measured, the
  // one passed to bench_generate included (GPT::round_matrices).
  WeightDtype weight_dtype = WeightDtype::F32;
  bool fused_decode = true;  // DecodeStep::enabled of the engines measured (false: op by op)
  bool int8_products = false;  // DecodeStep::int8_products of the engines measured
  std::function<void(const std::string&)> progress;  // one line per measured setting
  // While a setting ("new tokens 256, cache off", "n_kv_head 2") is measured: every row's
  // tokens made so far, its warm-up included, and the setting's total; first with done = 0.
  std::function<void(const std::string& setting, int64_t done, int64_t total)> on_tokens;
};

// Greedy generation of options.batch rows from random prompts. JSON:
//   model {n_layer, n_head, n_kv_head, n_embd, block_size, vocab_size, parameters,
//          weight_bytes (f32 storage), decode_weight_bytes (DecodeStep::weight_bytes)},
//   threads, prompt_tokens, batch, cache_dtype, weight_dtype, runs,
//   results [{new_tokens, cache {...}, no_cache {...}, speedup}] where each side holds
//     tokens_per_s (decode: tokens after the first per second of decode time),
//     e2e_tokens_per_s, ttft_ms, tpot_mean_ms, tpot_p50_ms, tpot_p99_ms, and for the cache
//     cache_bytes (measured), cache_bytes_formula, cache_positions, bytes_read_per_step
//     (weights + every row's cached K/V at the mean position; a step makes one token per
//     row) and read_GB_per_s (that times steps/s); on the CPU also read_bandwidth_GB_per_s
//     (the peak rate at which the threads read a buffer of bytes_read_per_step, measured in
//     the same run), ceiling_tokens_per_s (batch over the time to read bytes_read_per_step at
//     that rate: the memory ceiling; a large batch can be bound by arithmetic first) and
//     fraction_of_ceiling (tokens_per_s over the ceiling);
//   time_vs_position {cache [{position, ms}], no_cache [...]} from the longest setting.
// Each figure is the median over the runs.
nlohmann::json bench_generate(GPT& model, const Tokenizer& tokenizer,
                              const BenchGenerateOptions& options);

// Cache memory for each n_kv_head at batch `batch` and S = block_size: a ContiguousKVCache of
// `dtype` is built for each and its allocations summed, next to 2 L B S NKV HS bytes and the
// ratio to MHA (n_kv_head = n_head) at the same dtype. JSON array of {n_kv_head, dtype,
// measured_bytes, formula_bytes, ratio_to_mha, expected_ratio}.
nlohmann::json kv_cache_report(const GPTConfig& config, const std::vector<int64_t>& kv_heads,
                               int64_t batch = 1, DType dtype = DType::F32);

// Decode speed with the cache at options.batch rows for each n_kv_head (random weights from
// `seed`, the rest of `config` unchanged): JSON array of {n_kv_head, tokens_per_s, tpot_mean_ms,
// tpot_p50_ms, tpot_p99_ms, ttft_ms, cache_bytes, bytes_read_per_step, read_GB_per_s} and on
// the CPU the measured ceiling as in bench_generate.
nlohmann::json bench_decode_by_kv_heads(const GPTConfig& config,
                                        const std::vector<int64_t>& kv_heads, int64_t new_tokens,
                                        const BenchGenerateOptions& options);

// `kvlab bench kv-memory`: what the paged cache does with a fixed KV memory, against
// contiguous max-length allocation.
struct BenchKVMemoryOptions {
  // n_kv_head settings of the memory part (the workload needs only the shapes).
  std::vector<int64_t> kv_heads;
  int64_t budget_bytes = 0;  // the KV memory; 0: that of 16 full-context multi-head sequences
  int64_t kv_block_size = 16;
  int64_t requests = 256;
  int64_t samples = 4;        // the parallel-sampling case
  int64_t system_prompt = 0;  // the shared-system-prompt case; 0: a quarter of the context
  uint64_t seed = 0;
  DType cache_dtype = DType::F32;
  // The timed part, on the model given: rounds alternate paged and contiguous (or prefix
  // caching on and off), medians and spreads reported.
  int rounds = 5;
  std::vector<int64_t> decode_batches = {1, 8};
  int64_t decode_prompt = 64, decode_new_tokens = 128;
  std::function<void(const std::string&)> progress;  // a line per measured part
};

// JSON:
//   model {...}, threads, kv_block_size, cache_dtype, budget_bytes,
//   workload {requests, context, distribution, samples, system_prompt},
//   memory [{n_kv_head, bytes_per_position, blocks, slots, plain {paged, contiguous},
//            samples {paged, contiguous}, system_prompt {paged, paged_no_prefix_caching,
//            contiguous}}] where each side holds the simulation's figures
//            (infer/measure/kv_workload.h),
//   decode [{batch, paged_tokens_per_s, contiguous_tokens_per_s, ratio: {median, min, max}}]
//            where ratio is each round's paged / contiguous (on a shared host the rounds'
//            ratios vary less than either side's rate),
//   prefix_caching {system_prompt, user_tokens, ttft_ms {on, off: {median, min, max}},
//                   prefill_positions {on, off}},
//   samples {prompt_tokens, samples, forked_bytes, independent_bytes, contiguous_bytes,
//            prompt_blocks_shared} from the engine's allocator.
nlohmann::json bench_kv_memory(GPT& model, const Tokenizer& tokenizer,
                               const BenchKVMemoryOptions& options);

// The median of v (0 when empty; the mean of the middle two for an even count).
double median(std::vector<double> v);
// {median, min, max} of v (not empty): a benchmark's rounds.
nlohmann::json spread(const std::vector<double>& v);

// Seconds of the steady clock since t0 (the benchmarks' timer).
double seconds_since(std::chrono::steady_clock::time_point t0);

// Arrival times of n requests at `rate` requests/s (exponential gaps drawn from the seed);
// rate 0: all at 0.
std::vector<double> poisson_arrivals(size_t n, double rate, uint64_t seed);

// When each request arrived, made its first token and its last (over its samples), in
// seconds from the start; and every gap between two consecutive tokens of one sample (as its
// client saw them).
struct ServeTimeline {
  std::vector<double> arrival, first, last;
  std::vector<double> gaps;
  ServeTimeline(const std::vector<double>& arrivals, int64_t samples)
      : arrival(arrivals),
        first(arrivals.size(), -1),
        last(arrivals.size(), -1),
        samples_(samples),
        sample_last_(arrivals.size() * static_cast<size_t>(samples), -1) {}
  // Sample s of request i made a token (or a chunk of them) at `now`.
  void token(size_t i, int64_t s, double now) {
    if (first[i] < 0) first[i] = now;
    double& prev = sample_last_[i * static_cast<size_t>(samples_) + static_cast<size_t>(s)];
    if (prev >= 0) gaps.push_back(now - prev);
    prev = now;
    last[i] = std::max(last[i], now);
  }

 private:
  int64_t samples_;
  std::vector<double> sample_last_;
};
// A served run's figures (below): duration_s, requests_per_s, output_tokens_per_s, ttft_ms,
// tpot_ms and itl_ms (inter-token latency) {p50, p90, p99}, peak_sequences.
nlohmann::json serve_summary(const ServeTimeline& t, const std::vector<KVRequest>& reqs,
                             double duration, int64_t peak_sequences);
// A side served elsewhere (over HTTP: apps/bench/http_bench.h) with the continuous side's
// scheduler settings: the requests at the timeline's arrivals; returns serve_summary's figures.
using ServeSide = std::function<nlohmann::json(const std::vector<KVRequest>&, ServeTimeline,
                                               const SchedulerOptions&)>;

// `kvlab bench serve`: the serving workload (infer/measure/kv_workload.h, `samples` a request,
// greedy) as a request stream, served by the scheduler (infer/scheduler.h) under each policy
// at the same KV memory: static batching as over contiguous caches (the arrived requests, up
// to as many as the KV memory holds at full context, run as one batch until its longest
// output is made) and continuous batching over the paged cache.
struct BenchServeOptions {
  int64_t requests = 256;
  // Poisson arrival rates (requests/s), one run each; empty: every request at once.
  std::vector<double> rates;
  int64_t budget_bytes = 0;  // 0: 16 full-context sequences of the model
  int64_t kv_block_size = 16;
  int64_t max_batch_tokens = 512;
  int64_t system_prompt = 0;     // tokens the shared prompts start with (a shared prefix)
  double shared_fraction = 1.0;  // of requests whose prompts start with it
  int64_t samples = 1;           // sequences per request (n), which share its prompt
  uint64_t seed = 0;
  DType cache_dtype = DType::F32;
  bool int8_products = false;  // DecodeStep::int8_products of the engine served
  std::function<void(const std::string&)> progress;  // a line per served run
  // Sequences (samples) finished of the run's total, as they finish, per side ("static",
  // "continuous").
  std::function<void(const std::string& side, int64_t done, int64_t total)> on_requests;
  // A third side, "continuous_http": the same requests through kvlab serve over HTTP.
  ServeSide over_http;
  bool with_static = true;  // false: the continuous side alone (a rate sweep's cheaper runs)
};

// JSON: model, threads, budget_bytes, static_slots, kv_block_size, max_batch_tokens, max_seqs,
// requests, runs [{rate, continuous_paged, static_contiguous and throughput_ratio (continuous /
// static requests/s) with with_static, and continuous_http with over_http}] where each side
// holds duration_s, requests_per_s, output_tokens_per_s, ttft_ms and tpot_ms {p50, p90, p99},
// peak_sequences, and preemptions (continuous).
nlohmann::json bench_serve(GPT& model, const Tokenizer& tokenizer,
                           const BenchServeOptions& options);

// A char tokenizer of `vocab_size` printable symbols, for random-weight models.
Tokenizer synthetic_tokenizer(int64_t vocab_size);

}  // namespace kvlab
