// The decode step's packed weights: what DecodeStep::pack packs, where each part lies, and
// the references (DecodeRefs) the step reads them through (packed_weights.h says why).
#include "infer/decode/packed_weights.h"

#include <omp.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "autograd/backend/cpu/decode_kernels.h"
#include "infer/decode/decode_step.h"
#include "infer/decode/thread_rows.h"
#include "platform/ggml_blocks.h"
#include "platform/scalar_codecs.h"

namespace kvlab {

namespace decode {

std::array<const Linear*, 7> block_linears(const Block& b) {
  if (b.mla)
    return {&b.mla->q_proj, &b.mla->kv_down, &b.mla->kv_up,   &b.mla->c_proj,
            &b.mlp.c_fc,    &b.mlp.c_proj,   b.mlp.c_up.get()};
  return {&b.attn->q_proj, &b.attn->k_proj, &b.attn->v_proj, &b.attn->c_proj,
          &b.mlp.c_fc,     &b.mlp.c_proj,   b.mlp.c_up.get()};
}

size_t matrices_per_block(const GPTConfig& cfg) { return cfg.swiglu() ? 7 : 6; }

std::vector<const Tensor*> decode_matrices(const GPT& m) {
  std::vector<const Tensor*> out;
  for (const auto& blk : m.blocks)
    for (const Linear* l : block_linears(*blk))
      if (l != nullptr) out.push_back(&l->weight);
  out.push_back(&m.lm_head_weight());
  return out;
}

BlockRef::BlockRef(const Block& b, const PackRef* parts, int threads)
    : BlockRef(b, block_linears(b), parts, threads) {
  if (!b.mla) return;
  kv_norm.emplace(b.mla->kv_norm);
  if (b.mla->q_down) {
    q_down.emplace(*b.mla->q_down, nullptr);
    q_norm.emplace(*b.mla->q_norm);
  }
}

BlockRef::BlockRef(const Block& b, const std::array<const Linear*, 7>& l, const PackRef* p, int n)
    : ln_1(b.ln_1),
      ln_2(b.ln_2),
      q(*l[0], p),
      k(*l[1], p ? p + n : nullptr),
      v(*l[2], p ? p + 2 * n : nullptr),
      proj(*l[3], p ? p + 3 * n : nullptr),
      fc(*l[4], p ? p + 4 * n : nullptr),
      fc_proj(*l[5], p ? p + 5 * n : nullptr) {
  if (l[6] != nullptr) up.emplace(*l[6], p ? p + 6 * n : nullptr);
}

DecodeRefs::DecodeRefs(const GPT& m, std::vector<PackRef> packed, int packed_threads)
    : parts(std::move(packed)),
      threads(packed_threads),
      final_norm(m.ln_f),
      head(m.lm_head_weight(), nullptr, part(m.blocks.size() * matrices_per_block(m.config()))) {
  const size_t per_block = matrices_per_block(m.config());
  KVLAB_ASSERT(parts.size() == (m.blocks.size() * per_block + 1) * static_cast<size_t>(threads),
               "decode step: ", parts.size(), " packed parts for ", m.blocks.size(), " blocks and ",
               threads, " threads");
  layers.reserve(m.blocks.size());
  for (size_t l = 0; l < m.blocks.size(); ++l)
    layers.emplace_back(*m.blocks[l], part(l * per_block), threads);
}

}  // namespace decode

using decode::decode_matrices;
using decode::DecodeRefs;
using decode::matrices_per_block;
using decode::PackRef;
using decode::StepRows;
using decode::whole_lines;

bool DecodeStep::packing_applies() const {
  return runs_on_model() && cpu::packed_weight_bytes(WeightDtype::F32, 1, 1) > 0;
}

namespace decode {

WeightDtype exact_form(const Tensor& w) {
  const float* x = w.data<float>();
  const int64_t n = w.numel(), k = w.size(1);
  if (cpu::packed_weight_bytes(WeightDtype::Q4_0, 1, k) > 0) {
    if (exact_q4_0(x, n)) return WeightDtype::Q4_0;
    if (exact_q8_0(x, n)) return WeightDtype::Q8_0;
  }
  return all_bf16(x, n) ? WeightDtype::BF16 : WeightDtype::F32;
}

// Bytes of n values in a form, without its padding: the format's bytes, its blocks' f16
// scales widened to the f32 ones the packed units hold.
int64_t value_bytes(WeightDtype form, int64_t n) {
  const Format& f = format_of(form);
  return format_row_bytes(f, n) + (f.block_values > 1 ? n / f.block_values * 2 : 0);
}

}  // namespace decode

using decode::exact_form;
using decode::value_bytes;

DecodeStep::PackGuard DecodeStep::pack() {
  if (!packing_applies()) return {};
  const std::vector<const Tensor*> weights = decode_matrices(model_);
  const auto count = static_cast<int64_t>(weights.size());
  std::vector<WeightDtype> form(weights.size());  // each matrix's (exact_form)
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) form[static_cast<size_t>(i)] = exact_form(*weights[static_cast<size_t>(i)]);
  // The buffer (reused while its size fits) and the weights' pointers are taken before the
  // parallel region: nothing inside it may throw. All the parts lie in one block, so that the
  // step's streams of weights take huge pages (cpu_raw_alloc): thread t's parts of every
  // matrix in the order the step reads them, then thread t + 1's.
  const int threads = omp_get_max_threads();
  const size_t parts = weights.size() * static_cast<size_t>(threads);
  std::vector<int64_t> offset(parts);  // of matrix i's part t at i * threads + t, in words
  std::vector<std::pair<int64_t, int64_t>> rows(parts);
  int64_t words = 0;
  for (int t = 0; t < threads; ++t) {
    const StepRows step(model_.config(), t, threads);
    for (size_t i = 0; i < weights.size(); ++i) {
      const size_t at = i * static_cast<size_t>(threads) + static_cast<size_t>(t);
      rows[at] = step.of_matrix(i, weights.size(), matrices_per_block(model_.config()));
      const int64_t n = rows[at].second - rows[at].first, k = weights[i]->size(1);
      if (n <= 0) continue;
      offset[at] = words;
      words += whole_lines((cpu::packed_weight_bytes(form[i], n, k) + 3) / 4);
    }
  }
  if (!pack_.defined() || pack_.numel() != words) pack_ = Tensor::empty({words});
  float* buffer = pack_.data<float>();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t j = 0; j < static_cast<int64_t>(parts); ++j) {
    const size_t at = static_cast<size_t>(j), i = at / static_cast<size_t>(threads);
    const auto [lo, hi] = rows[at];
    if (lo >= hi) continue;
    const Tensor& w = *weights[i];
    const float* src = w.data<float>() + lo * w.size(1);
    cpu::pack_weight(form[i], buffer + offset[at], src, hi - lo, w.size(1));
  }
  std::vector<PackRef> pack(parts);
  for (size_t at = 0; at < parts; ++at) {
    const WeightDtype f = form[at / static_cast<size_t>(threads)];
    const bool blocks = f == WeightDtype::Q8_0 || f == WeightDtype::Q4_0;
    if (rows[at].first < rows[at].second)
      pack[at] = {buffer + offset[at], f, blocks && int8_products};
  }
  refs_ = std::make_shared<const DecodeRefs>(model_, std::move(pack), threads);
  ++pack_users_;
  return PackGuard(this);
}

DecodeStep::PackGuard::~PackGuard() {
  if (step_ != nullptr) --step_->pack_users_;
}

bool DecodeStep::multiplies_in_integers() const {
  if (!int8_products || !packing_applies()) return false;
  for (const Tensor* w : decode_matrices(model_)) {
    const WeightDtype f = exact_form(*w);
    if (f == WeightDtype::Q8_0 || f == WeightDtype::Q4_0) return true;
  }
  return false;
}

int64_t DecodeStep::weight_bytes() const {
  const int64_t tables = (model_.wpe ? model_.wpe->weight.numel() : 0) +
                         (model_.lm_head ? model_.wte.weight.numel() : 0);
  int64_t matrices = 0, bytes = 0;
  const bool packs = packing_applies();
  const std::vector<const Tensor*> weights = decode_matrices(model_);
  const size_t per_block = matrices_per_block(model_.config());
  const int threads = omp_get_max_threads();
  std::vector<StepRows> steps;
  for (int t = 0; t < threads; ++t) steps.emplace_back(model_.config(), t, threads);
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor* w = weights[i];
    // A matrix no thread has rows of is read as it is, never packed (pack(): MLA's kv_up).
    const bool unpacked = std::all_of(steps.begin(), steps.end(), [&](const StepRows& s) {
      const auto [lo, hi] = s.of_matrix(i, weights.size(), per_block);
      return lo >= hi;
    });
    matrices += w->numel();
    bytes += value_bytes(packs && !unpacked ? exact_form(*w) : WeightDtype::F32, w->numel());
  }
  return bytes + (model_.num_parameters() - tables - matrices) * 4;
}

}  // namespace kvlab
