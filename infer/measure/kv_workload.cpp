#include "infer/measure/kv_workload.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>

#include "platform/error.h"
#include "platform/random.h"

namespace kvlab {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t prompt_length(const KVRequest& q) { return static_cast<int64_t>(q.prompt.size()); }

// round(exp(N(mu, 1))) clipped to [lo, hi]; clipped before rounding, as the tail is unbounded.
int64_t log_normal_length(Generator& gen, double mu, int64_t lo, int64_t hi) {
  const double x = std::exp(mu + gen.normal());
  return std::clamp<int64_t>(std::llround(std::min(x, static_cast<double>(hi))), lo, hi);
}

// The token sample s of request r makes at position p: distinct across samples, the same when
// a preempted request is prefilled again.
int32_t made_token(int64_t r, int64_t s, int64_t p) {
  const uint64_t h =
      hash64(static_cast<uint64_t>(r), (static_cast<uint64_t>(s) << 32) ^ static_cast<uint64_t>(p));
  return static_cast<int32_t>(h & 0x7fffffff);
}

struct Admission {
  int64_t computed = 0;       // positions the prefill computed
  int64_t prefix_hit = 0;     // positions taken from the prefix cache
  int64_t prompt_stored = 0;  // growth of positions stored once the prompt is in every sample
};

struct Usage {
  int64_t stored = 0, held = 0;
};

// A layout's KV memory, as the step loop drives it.
class Layout {
 public:
  virtual ~Layout() = default;
  // Request r's samples, each with the prompt and `made` tokens stored, or nullopt (nothing
  // changed) when the layout cannot take them now.
  virtual std::optional<Admission> admit(int64_t r, const KVRequest& q, int64_t made) = 0;
  // Stores position p of sample s; false (nothing changed) when there is no room.
  virtual bool append(int64_t r, int64_t s, int64_t p) = 0;
  virtual void release(int64_t r, const KVRequest& q) = 0;
  virtual Usage usage() const = 0;
  virtual const BlockManager* blocks() const { return nullptr; }
};

class Contiguous final : public Layout {
 public:
  Contiguous(int64_t slots, int64_t context) : slots_(slots), context_(context) {}

  std::optional<Admission> admit(int64_t r, const KVRequest& q, int64_t made) override {
    if (used_ + q.samples > slots_) return std::nullopt;
    used_ += q.samples;
    const int64_t p = prompt_length(q);
    stored_[r] = q.samples * (p + made);
    return Admission{p + q.samples * made, 0, q.samples * p};
  }
  bool append(int64_t r, int64_t, int64_t) override {
    ++stored_[r];
    return true;
  }
  void release(int64_t r, const KVRequest& q) override {
    used_ -= q.samples;
    stored_.erase(r);
  }
  Usage usage() const override {
    Usage u{0, used_ * context_};
    for (const auto& [r, n] : stored_) u.stored += n;
    return u;
  }

 private:
  int64_t slots_, context_, used_ = 0;
  std::unordered_map<int64_t, int64_t> stored_;  // positions of each running request
};

class Paged final : public Layout {
 public:
  Paged(int64_t n_blocks, int64_t block_size, bool prefix_caching, int64_t max_samples)
      : m_(n_blocks, block_size, /*model_key=*/0, prefix_caching), stride_(max_samples) {}

  // Blocks request q holds once each sample holds `length` positions: the prompt's full
  // blocks once, and past them each sample's own (the original partly filled prompt block
  // ends with the last sample to write into it).
  int64_t held_blocks(const KVRequest& q, int64_t length) const {
    const int64_t bs = m_.block_size(), p = prompt_length(q);
    if (length == p) return ceil_div(p, bs);
    return p / bs + q.samples * (ceil_div(length, bs) - p / bs);
  }
  int64_t peak_blocks(const KVRequest& q) const {
    return held_blocks(q, prompt_length(q) + q.output_tokens - 1);
  }

  std::optional<Admission> admit(int64_t r, const KVRequest& q, int64_t made) override {
    const int64_t p = prompt_length(q);
    const int64_t stored_before = m_.stats().positions;
    const SeqId first = id(r, 0);
    m_.add(first);
    const int64_t hit = m_.take_prefix(first, q.prompt);
    // The prefix's blocks are held already: the rest are new.
    const int64_t need =
        std::min(held_blocks(q, p + made) + q.samples, peak_blocks(q)) - hit / m_.block_size();
    if (need > m_.blocks_available()) {
      m_.free(first);
      return std::nullopt;
    }
    store(first, std::span(q.prompt).subspan(static_cast<size_t>(hit)));
    for (int64_t s = 1; s < q.samples; ++s) m_.fork(first, id(r, s));
    const Admission a{p - hit + q.samples * made, hit, m_.stats().positions - stored_before};
    for (int64_t s = 0; s < q.samples; ++s) {
      std::vector<int32_t> tokens(static_cast<size_t>(made));
      for (int64_t i = 0; i < made; ++i) tokens[static_cast<size_t>(i)] = made_token(r, s, p + i);
      store(id(r, s), tokens);
    }
    return a;
  }
  bool append(int64_t r, int64_t s, int64_t p) override {
    const SeqId seq = id(r, s);
    if (!m_.reserve(seq, 1)) return false;
    const int32_t t = made_token(r, s, p);
    m_.commit(seq, std::span(&t, 1));
    return true;
  }
  void release(int64_t r, const KVRequest& q) override {
    for (int64_t s = 0; s < q.samples; ++s) m_.free(id(r, s));
  }
  Usage usage() const override {
    const BlockStats st = m_.stats();
    return {st.positions, st.in_use * m_.block_size()};
  }
  const BlockManager* blocks() const override { return &m_; }

 private:
  SeqId id(int64_t r, int64_t s) const { return r * stride_ + s; }
  // Within what admission counted: the pool has the blocks.
  void store(SeqId seq, std::span<const int32_t> tokens) {
    const bool room = m_.reserve(seq, static_cast<int64_t>(tokens.size())).has_value();
    KVLAB_ASSERT(room, "admission counted too few blocks for sequence ", seq);
    m_.commit(seq, tokens);
  }

  BlockManager m_;
  int64_t stride_;
};

}  // namespace

void KVWorkloadOptions::validate() const {
  KVLAB_CHECK(requests >= 1, "kv workload: requests must be at least 1, not ", requests);
  KVLAB_CHECK(context >= 2, "kv workload: the context must be at least 2 positions, not ", context);
  KVLAB_CHECK(samples >= 1, "kv workload: samples must be at least 1, not ", samples);
  KVLAB_CHECK(system_prompt >= 0 && system_prompt <= context - 2,
              "kv workload: the system prompt must be 0 to context - 2 = ", context - 2,
              " tokens (room for a user token and an output token), not ", system_prompt);
  KVLAB_CHECK(shared_fraction >= 0 && shared_fraction <= 1,
              "kv workload: the shared-prefix fraction must be in [0, 1], not ", shared_fraction);
  KVLAB_CHECK(vocab_size >= 1 && vocab_size <= INT32_MAX,
              "kv workload: the vocabulary must have 1 to 2^31 - 1 tokens, not ", vocab_size);
}

std::vector<KVRequest> make_kv_workload(const KVWorkloadOptions& options) {
  options.validate();
  Generator gen(options.seed);
  const auto vocab = static_cast<uint64_t>(options.vocab_size);
  std::vector<int32_t> system(static_cast<size_t>(options.system_prompt));
  for (int32_t& t : system) t = static_cast<int32_t>(gen.below(vocab));
  const double c = static_cast<double>(options.context);
  const int64_t room = options.context - options.system_prompt;
  std::vector<KVRequest> requests(static_cast<size_t>(options.requests));
  for (KVRequest& q : requests) {
    const int64_t u = log_normal_length(gen, std::log(c / 8), 1, room - 1);
    q.output_tokens = log_normal_length(gen, std::log(c / 6), 1, room - u);
    q.samples = options.samples;
    // Drawn only for a fraction below 1, so that other workloads keep their lengths.
    const bool shared = options.shared_fraction >= 1 || gen.uniform() < options.shared_fraction;
    q.prompt = shared ? system : std::vector<int32_t>();
    for (int64_t i = 0; i < u; ++i) q.prompt.push_back(static_cast<int32_t>(gen.below(vocab)));
  }
  return requests;
}

int64_t KVSimOptions::blocks() const { return budget_bytes / (bytes_per_position * kv_block_size); }

int64_t KVSimOptions::slots() const { return budget_bytes / (bytes_per_position * context); }

void KVSimOptions::validate() const {
  KVLAB_CHECK(budget_bytes > 0, "kv simulation: the KV budget must be positive, not ", budget_bytes,
              " bytes");
  KVLAB_CHECK(bytes_per_position > 0, "kv simulation: bytes per position must be positive, not ",
              bytes_per_position);
  KVLAB_CHECK(context >= 2, "kv simulation: the context must be at least 2 positions, not ",
              context);
  KVLAB_CHECK(kv_block_size > 0 && (kv_block_size & (kv_block_size - 1)) == 0,
              "kv simulation: the KV block size must be a power of two, not ", kv_block_size);
}

KVSimResult simulate_kv_cache(std::span<const KVRequest> requests, KVLayout layout,
                              const KVSimOptions& options,
                              const std::function<void(const KVStep&)>& on_step) {
  options.validate();
  KVLAB_CHECK(!requests.empty(), "kv simulation: no requests to serve");
  const bool paged = layout == KVLayout::Paged;
  int64_t max_samples = 1;
  for (size_t r = 0; r < requests.size(); ++r) {
    const KVRequest& q = requests[r];
    KVLAB_CHECK(!q.prompt.empty() && q.output_tokens >= 1 && q.samples >= 1 &&
                    prompt_length(q) + q.output_tokens <= options.context,
                "kv simulation: request ", r, " has a prompt of ", q.prompt.size(), ", ",
                q.output_tokens, " output tokens and ", q.samples,
                " samples; it needs a prompt, an output and a sample, prompt + output within "
                "the context of ",
                options.context);
    max_samples = std::max(max_samples, q.samples);
  }
  const int64_t units = paged ? options.blocks() : options.slots();
  KVLAB_CHECK(units >= 1, "kv simulation: a KV budget of ", options.budget_bytes, " bytes at ",
              options.bytes_per_position, " bytes per position holds no ",
              paged ? "block of " : "slot of ", paged ? options.kv_block_size : options.context,
              " positions");
  std::unique_ptr<Layout> mem;
  if (paged) {
    auto p =
        std::make_unique<Paged>(units, options.kv_block_size, options.prefix_caching, max_samples);
    for (size_t r = 0; r < requests.size(); ++r)
      KVLAB_CHECK(p->peak_blocks(requests[r]) <= units, "kv simulation: request ", r, " (prompt ",
                  requests[r].prompt.size(), ", output ", requests[r].output_tokens, ", ",
                  requests[r].samples, " samples) needs ", p->peak_blocks(requests[r]),
                  " blocks of ", options.kv_block_size, " positions at its longest; the pool has ",
                  units);
    mem = std::move(p);
  } else {
    KVLAB_CHECK(max_samples <= units, "kv simulation: a request has ", max_samples,
                " samples but the budget holds ", units, " contiguous slots of ", options.context,
                " positions");
    mem = std::make_unique<Contiguous>(units, options.context);
  }

  const auto n = static_cast<int64_t>(requests.size());
  std::deque<int64_t> queue;
  for (int64_t r = 0; r < n; ++r) queue.push_back(r);
  std::vector<int64_t> running;  // in admission order
  // Tokens each sample of a request has made, and the step it was last admitted.
  std::vector<int64_t> made(static_cast<size_t>(n), 0), admitted(static_cast<size_t>(n), -1);
  auto req = [&](int64_t r) -> const KVRequest& { return requests[static_cast<size_t>(r)]; };

  KVSimResult res;
  res.utilisation_min = 1;
  double utilisation_sum = 0, resident_sum = 0;
  int64_t step = 0;
  for (; !queue.empty() || !running.empty(); ++step) {
    while (!queue.empty()) {
      const int64_t r = queue.front();
      auto& k = made[static_cast<size_t>(r)];
      const std::optional<Admission> a = mem->admit(r, req(r), k);
      if (!a) break;
      queue.pop_front();
      running.push_back(r);
      admitted[static_cast<size_t>(r)] = step;
      ++k;  // the prefill's token
      res.prefill_positions += a->computed;
      res.prefix_hit_positions += a->prefix_hit;
      res.prompt_positions += prompt_length(req(r));
      res.prompt_positions_stored += a->prompt_stored;
    }
    for (size_t i = 0; i < running.size(); ++i) {
      const int64_t r = running[i];
      if (admitted[static_cast<size_t>(r)] == step) continue;
      auto& k = made[static_cast<size_t>(r)];
      bool preempted = false;
      for (int64_t s = 0; s < req(r).samples && !preempted; ++s) {
        while (!mem->append(r, s, prompt_length(req(r)) + k - 1)) {
          // Running requests behind r are younger; r itself only when it is the youngest.
          const int64_t victim = running.back();
          KVLAB_ASSERT(running.size() > 1, "request ", r, " cannot grow even alone");
          running.pop_back();
          mem->release(victim, req(victim));
          // One admitted this step may have made all its tokens: it ends now, not later.
          if (made[static_cast<size_t>(victim)] >= req(victim).output_tokens) continue;
          queue.push_front(victim);
          ++res.preemptions;
          if (victim == r) {
            preempted = true;
            break;
          }
        }
      }
      if (!preempted) ++k;
    }

    KVLAB_ASSERT(!running.empty(), "step ", step, " admitted nothing into an empty layout");
    KVStep st;
    st.step = step;
    for (const int64_t r : running) st.resident += req(r).samples;
    const Usage u = mem->usage();
    st.positions_stored = u.stored;
    st.positions_held = u.held;
    st.blocks = mem->blocks();
    const double utilisation = static_cast<double>(u.stored) / static_cast<double>(u.held);
    utilisation_sum += utilisation;
    res.utilisation_min = std::min(res.utilisation_min, utilisation);
    resident_sum += static_cast<double>(st.resident);
    res.peak_resident = std::max(res.peak_resident, st.resident);
    res.peak_positions_held = std::max(res.peak_positions_held, u.held);
    if (on_step) on_step(st);

    std::erase_if(running, [&](int64_t r) {
      if (made[static_cast<size_t>(r)] < req(r).output_tokens) return false;
      mem->release(r, req(r));
      return true;
    });
  }
  res.steps = step;
  res.utilisation_mean = utilisation_sum / static_cast<double>(step);
  res.mean_resident = resident_sum / static_cast<double>(step);
  res.peak_bytes = res.peak_positions_held * options.bytes_per_position;
  if (mem->blocks()) res.blocks_at_end = mem->blocks()->stats();
  return res;
}

KVLayoutComparison compare_kv_layouts(std::span<const KVRequest> requests,
                                      const KVSimOptions& options) {
  KVLayoutComparison c;
  c.paged = simulate_kv_cache(requests, KVLayout::Paged, options);
  c.contiguous = simulate_kv_cache(requests, KVLayout::Contiguous, options);
  c.blocks = options.blocks();
  c.slots = options.slots();
  return c;
}

}  // namespace kvlab
