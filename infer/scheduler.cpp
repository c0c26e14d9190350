#include "infer/scheduler.h"

#include <algorithm>
#include <limits>
#include <span>

#include "autograd/graph.h"
#include "platform/kv_rows.h"

namespace kvlab {

const char* batch_policy_name(BatchPolicy p) {
  return p == BatchPolicy::Static ? "static" : "continuous";
}

// A request and its one sequence. tokens(): the prompt, then every token made. While it
// decodes, the cache holds positions [0, tokens().size() - 1): the last token made is fed by
// the next decode. A prefill computes up to `target()` positions.
struct Scheduler::Request {
  RequestId id;
  GenerateOptions options;
  RequestExtras extras;
  Sequence sequence;
  SeqId seq = -1;                             // its sequence's blocks while admitted, else -1
  bool decoding = false;                      // admitted and prefilled
  std::vector<TokenLogprob> prompt_logprobs;  // gathered over the prefill's chunks

  Request(RequestId i, std::span<const int32_t> prompt, const GenerateOptions& o,
          const RequestExtras& x, std::span<const int32_t> eog)
      : id(i),
        options(o),
        extras(x),
        sequence(prompt, o.sampling, static_cast<uint64_t>(x.sample), options.stop,
                 o.max_new_tokens, eog) {}
  const std::vector<int32_t>& tokens() const { return sequence.tokens; }
  // Its first prefill computes every prompt position's logits.
  bool wants_prompt_logits() const { return extras.prompt_logprobs && sequence.made == 0; }
  // Positions the prefill computes: the whole prompt, or after a preemption everything but
  // the last token made.
  int64_t target() const {
    return static_cast<int64_t>(tokens().size()) - (sequence.made > 0 ? 1 : 0);
  }
};

Scheduler::Scheduler(Engine& engine, SchedulerOptions options)
    : engine_(engine), options_(options), pack_(engine.decode_step().pack()) {
  const GPTConfig& c = engine.model().config();
  const PagedCacheOptions& p = options.cache;
  KVLAB_CHECK(options.max_seqs >= 1, "scheduler: max_seqs must be >= 1, got ", options.max_seqs);
  KVLAB_CHECK(options.max_batch_tokens >= options.max_seqs,
              "scheduler: max_batch_tokens (", options.max_batch_tokens,
              ") must be at least max_seqs (", options.max_seqs,
              "): every admitted sequence decodes one token a step");
  KVLAB_CHECK(engine.model().device() == Device::CPU,
              "scheduler: the paged KV cache runs on the CPU only");
  check_kv_block_size(p.kv_block_size, c.block_size, "scheduler");
  const KVCacheLayout layout = kv_cache_layout(c, engine.cache_dtype());
  const KVPoolSize size = kv_pool_size(p, layout, options.max_seqs, c.block_size);
  check_holds_one_sequence(size, c.block_size, p.kv_block_size, "scheduler");
  KVPool pool =
      make_kv_pool(layout, p, size.blocks, p.prefix_caching ? model_cache_key(engine.model()) : 0,
                   engine.cache_scales());
  blocks_ = std::move(pool.blocks);
  cache_ = std::move(pool.cache);
}

Scheduler::~Scheduler() = default;

RequestId Scheduler::add(std::vector<int32_t> prompt, const GenerateOptions& options,
                         const RequestExtras& extras) {
  KVLAB_CHECK(options.max_new_tokens >= 0, "max_new_tokens must be >= 0, got ",
              options.max_new_tokens);
  GenerateOptions checked = options;  // the engine's checks, which want a token made
  checked.max_new_tokens = std::max<int64_t>(options.max_new_tokens, 1);
  engine_.validate({prompt}, checked);
  KVLAB_CHECK(options.n == 1 && !options.slide && options.use_cache,
              "scheduler: a request is one sequence with the cache and without sliding (n ",
              options.n, ", slide ", options.slide, ", cache ", options.use_cache, ")");
  KVLAB_CHECK(extras.sample >= 0, "scheduler: sample must be >= 0, got ", extras.sample);
  const RequestId id = next_id_++;
  waiting_.push_back(
      std::make_unique<Request>(id, prompt, options, extras, engine_.end_tokens(options)));
  return id;
}

bool Scheduler::idle() const { return admitted_.empty() && waiting_.empty(); }

Scheduler::Request* Scheduler::find(RequestId id) {
  for (auto& r : admitted_)
    if (r->id == id) return r.get();
  for (auto& r : waiting_)
    if (r->id == id) return r.get();
  return nullptr;
}

void Scheduler::abort(RequestId id) {
  Request* r = find(id);
  if (r == nullptr) return;
  if (r->seq >= 0) blocks_->free(r->seq);
  SchedulerEvent e;
  e.request = id;
  e.finished = true;
  aborted_.push_back(std::move(e));
  std::erase_if(admitted_, [&](const auto& q) { return q->id == id; });
  std::erase_if(waiting_, [&](const auto& q) { return q->id == id; });
}

void Scheduler::preempt(Request& r) {
  blocks_->free(r.seq);
  r.prompt_logprobs.clear();  // a prefill cut short computes them again
  r.seq = -1;
  r.decoding = false;
  ++preemptions_;
  ++last_.preempted;
}

void Scheduler::finish(Request& r, StopReason why, std::vector<SchedulerEvent>& events) {
  SchedulerEvent e;
  e.request = r.id;
  e.text = r.sequence.flush();
  e.finished = true;
  e.reason = why;
  if (!events.empty() && events.back().request == r.id && !events.back().finished) {
    events.back().text += e.text;
    events.back().finished = true;
    events.back().reason = why;
  } else {
    events.push_back(std::move(e));
  }
  blocks_->free(r.seq);
  r.seq = -1;
}

void Scheduler::note_prompt(Request& r, const float* logits, int64_t done, int64_t chunk) {
  const int64_t V = engine_.model().config().vocab_size;
  for (int64_t i = 0; i < chunk && done + i + 1 < r.sequence.prompt_len; ++i)
    r.prompt_logprobs.push_back(
        token_logprob(std::span<const float>(logits + i * V, static_cast<size_t>(V)),
                      r.tokens()[static_cast<size_t>(done + i + 1)], r.extras.top_logprobs));
}

void Scheduler::take(Request& r, const float* logits, std::vector<SchedulerEvent>& events) {
  const GPTConfig& c = engine_.model().config();
  SchedulerEvent e;
  e.request = r.id;
  e.prompt_logprobs = std::move(r.prompt_logprobs);
  r.prompt_logprobs.clear();
  if (r.options.max_new_tokens == 0) {  // the prefill was all it asked for
    events.push_back(std::move(e));
    finish(r, StopReason::MaxNewTokens, events);
    return;
  }
  const std::span<const float> row(logits, static_cast<size_t>(c.vocab_size));
  const int32_t tok = r.sequence.sample(row);
  e.token = tok;
  e.text = r.sequence.release_last(engine_.tokenizer());
  if (r.extras.top_logprobs >= 0) e.logprob = token_logprob(row, tok, r.extras.top_logprobs);
  events.push_back(std::move(e));
  if (const std::optional<StopReason> why = r.sequence.stop_reason(c.block_size))
    finish(r, *why, events);
}

void Scheduler::decode(std::vector<SchedulerEvent>& events) {
  std::vector<Request*> rows;
  std::vector<int32_t> ids;
  for (;;) {
    rows.clear();
    for (auto& r : admitted_)
      if (r->decoding) rows.push_back(r.get());
    if (rows.empty()) return;
    std::vector<SeqId> seqs;
    ids.clear();
    for (Request* r : rows) {
      seqs.push_back(r->seq);
      ids.push_back(r->tokens().back());
    }
    cache_->set_rows(seqs);
    if (cache_->reserve(ids)) break;
    // The most recently admitted request gives its blocks back (it may be prefilling). One
    // sequence alone always fits: the pool holds the whole context.
    KVLAB_ASSERT(admitted_.size() > 1, "scheduler: a sequence alone found no block");
    auto& youngest = admitted_.back();
    preempt(*youngest);
    waiting_.push_front(std::move(youngest));
    admitted_.pop_back();
  }
  Tensor tokens = Tensor::empty({static_cast<int64_t>(rows.size()), 1}, DType::I32);
  std::copy(ids.begin(), ids.end(), tokens.data<int32_t>());
  const Tensor logits = engine_.forward_cached(tokens, *cache_).to(Device::CPU);
  const int64_t V = engine_.model().config().vocab_size;
  for (size_t i = 0; i < rows.size(); ++i) take(*rows[i], logits.data<float>() + i * V, events);
  last_.decode_rows = static_cast<int64_t>(rows.size());
}

void Scheduler::prefill(int64_t budget, std::vector<SchedulerEvent>& events) {
  // Admitted requests still prefilling first (in admission order), then the queue's head.
  while (budget > 0) {
    Request* r = nullptr;
    bool fresh = false;
    for (auto& q : admitted_)
      if (!q->decoding) {
        r = q.get();
        break;
      }
    if (r == nullptr) {
      if (waiting_.empty() || static_cast<int64_t>(admitted_.size()) >= options_.max_seqs) return;
      r = waiting_.front().get();
      fresh = true;
      r->seq = r->id;
      blocks_->add(r->seq);
      if (!r->wants_prompt_logits()) blocks_->take_prefix(r->seq, r->tokens());
    }
    const int64_t done = blocks_->length(r->seq);
    if (done == r->target()) {
      // A preempted request whose every computed position the prefix cache still held: it
      // decodes from the next step (a prompt's last position is never taken from the cache).
      if (fresh) {
        admitted_.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
      r->decoding = true;
      continue;
    }
    const int64_t chunk = std::min(budget, r->target() - done);
    const std::span<const int32_t> part(r->tokens().data() + done, static_cast<size_t>(chunk));
    cache_->set_rows({r->seq});
    if (!cache_->reserve(part)) {
      if (fresh) {  // not admitted after all: it waits for blocks at the queue's head
        blocks_->free(r->seq);
        r->seq = -1;
        return;
      }
      // Admitted requests that all wait for blocks would wait for ever: the youngest gives
      // its blocks back (it may be r itself, which then waits at the queue's head).
      preempt(*admitted_.back());
      waiting_.push_front(std::move(admitted_.back()));
      admitted_.pop_back();
      continue;
    }
    if (fresh) {
      admitted_.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
    }
    Tensor tokens = Tensor::empty({1, chunk}, DType::I32);
    std::copy(part.begin(), part.end(), tokens.data<int32_t>());
    const bool all = r->wants_prompt_logits();
    const Tensor logits = engine_.forward_cached(tokens, *cache_, all).to(Device::CPU);
    if (all) note_prompt(*r, logits.data<float>(), done, chunk);
    budget -= chunk;
    last_.prefill_tokens += chunk;
    if (done + chunk < r->target()) continue;  // more chunks in later steps
    r->decoding = true;
    const int64_t V = engine_.model().config().vocab_size;
    if (r->sequence.made == 0) take(*r, logits.data<float>() + (all ? (chunk - 1) * V : 0), events);
  }
}

std::vector<SchedulerEvent> Scheduler::step() {
  last_ = {};
  std::vector<SchedulerEvent> events = std::move(aborted_);
  aborted_.clear();
  NoGradGuard no_grad;
  // Requests that ended leave before the prefill, which may preempt the youngest admitted.
  auto drop_ended = [&] { std::erase_if(admitted_, [](const auto& r) { return r->seq < 0; }); };
  decode(events);
  drop_ended();
  if (options_.policy == BatchPolicy::Continuous)
    prefill(options_.max_batch_tokens - last_.decode_rows, events);
  else if (admitted_.empty())  // static: the batch has ended, the next one prefills whole
    prefill(std::numeric_limits<int64_t>::max(), events);
  drop_ended();
  last_.admitted = static_cast<int64_t>(admitted_.size());
  last_.waiting = static_cast<int64_t>(waiting_.size());
  return events;
}

}  // namespace kvlab
