#include <algorithm>
#include <cmath>

#include "autograd/ops/common.h"
#include "autograd/ops/ops.h"
#include "platform/kv_rows.h"

namespace kvlab {

using namespace ops_detail;

namespace {

HeadView head_view(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// A (B, H, L, HS) tensor stored as a contiguous (B, L, H, HS) buffer: the layout the model's
// projections produce and consume, so neither side needs a transposing copy.
Tensor empty_heads_last(int64_t B, int64_t H, int64_t L, int64_t HS, DType dtype, Device dev) {
  Tensor buf = Tensor::empty({B, L, H, HS}, dtype, dev);
  return buf.as_strided({B, H, L, HS}, {L * H * HS, HS, H * HS, 1}, 0);
}

// The kernels' view of q (B, NH, T, HS), k (B, NKV, S, HS) and the options.
AttentionShape attention_shape(const Tensor& q, const Tensor& k, const AttentionOptions& opts) {
  const int64_t HS = q.size(3);
  return {q.size(0),
          q.size(1),
          k.size(1),
          q.size(2),
          k.size(2),
          HS,
          opts.kv_lengths.empty() ? nullptr : opts.kv_lengths.data(),
          1.0 / std::sqrt(static_cast<double>(HS)),
          opts.dropout,
          opts.seed,
          opts.kv_blocks,
          k.dtype(),
          opts.kv_scales.empty() ? nullptr : opts.kv_scales.data()};
}

// What k and v are, under f32 q: like q, or KV-cache storage (bf16, or quantised rows of
// kv_row_bytes(dtype, HS) bytes), read for inference only. Checks storage's dtype, last dim,
// device and scales.
enum class KVStorage { LikeQ, BF16, Quantised };
KVStorage kv_storage(const char* op, const Tensor& q, const Tensor& k,
                     const AttentionOptions& opts) {
  if (q.dtype() != DType::F32 || (k.dtype() != DType::BF16 && !is_quantised(k.dtype()))) {
    check_same_dtype(op, q, k);
    return KVStorage::LikeQ;
  }
  if (k.dtype() == DType::BF16) return KVStorage::BF16;
  const int64_t HS = q.size(-1), NKV = k.dim() == 4 ? k.size(1) : 0;
  KVLAB_CHECK(k.size(-1) == kv_row_bytes(k.dtype(), HS), op, ": ", dtype_name(k.dtype()),
              " keys and values of head size ", HS, " are rows of ",
              kv_row_bytes(k.dtype(), HS), " bytes, got ", k.size(-1));
  KVLAB_CHECK(q.device() == Device::CPU, op, ": ", dtype_name(k.dtype()),
              " keys and values are read on the CPU only");
  KVLAB_CHECK(k.dtype() != DType::FP8 || static_cast<int64_t>(opts.kv_scales.size()) == 2 * NKV,
              op, ": fp8 keys and values need their ", 2 * NKV, " scales, got ",
              opts.kv_scales.size());
  return KVStorage::Quantised;
}

Tensor hs_contiguous(const Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

// The checks of a paged k and v (the pools) against q and opts; returns S, the longest row.
// Every table entry a row's length reaches must name a block of the pool: the kernel reads
// there unchecked.
int64_t paged_kv_length(const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionOptions& opts) {
  const char* op = "causal_attention";
  const KVBlocks& kb = *opts.kv_blocks;
  const int64_t B = q.size(0), T = q.size(2), n_blocks = k.size(0);
  KVLAB_CHECK(kb.block_len > 0 && (kb.block_len & (kb.block_len - 1)) == 0 &&
                  k.size(2) == kb.block_len,
              op, ": paged k ", k.shape_str(), " is not (n_blocks, NKV, ", kb.block_len,
              ", HS) with a power-of-two block length");
  KVLAB_CHECK(k.strides() == v.strides() && k.stride(3) == 1 && k.stride(0) == kb.block_stride,
              op, ": paged k and v must share strides, HS contiguous, block stride ",
              kb.block_stride);
  KVLAB_CHECK(static_cast<int64_t>(opts.kv_lengths.size()) == B, op,
              ": a paged k and v need kv_lengths for each of the ", B, " rows");
  int64_t S = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = opts.kv_lengths[static_cast<size_t>(b)];
    KVLAB_CHECK(len >= T && len <= kb.width * kb.block_len, op, ": kv_lengths[", b, "] = ", len,
                " outside [T, width * block_len] = [", T, ", ", kb.width * kb.block_len, "]");
    for (int64_t i = 0; i < (len + kb.block_len - 1) / kb.block_len; ++i) {
      const int32_t id = kb.table[b * kb.width + i];
      KVLAB_CHECK(id >= 0 && id < n_blocks, op, ": row ", b, "'s block ", i, " is ", id,
                  ", outside the pool of ", n_blocks);
    }
    S = std::max(S, len);
  }
  return S;
}

struct AttentionNode : Node {
  Tensor q, k, v;                   // q (B, NH, T, HS); k, v (B, NKV, S, HS)
  AttentionOptions opts;            // kv_lengths points into the node's own copy:
  std::vector<int64_t> kv_lengths;  // (B) or empty
  const char* name() const override { return "causal_attention"; }
  std::vector<Tensor> backward(const Tensor& g_in) override {
    const Tensor g = hs_contiguous(g_in);
    const int64_t B = q.size(0), NH = q.size(1), T = q.size(2), HS = q.size(3);
    const int64_t NKV = k.size(1), S = k.size(2);
    const Device dev = q.device();
    Tensor dq = empty_heads_last(B, NH, T, HS, q.dtype(), dev);
    Tensor dk = empty_heads_last(B, NKV, S, HS, q.dtype(), dev);
    Tensor dv = empty_heads_last(B, NKV, S, HS, q.dtype(), dev);
    const AttentionShape s = attention_shape(q, k, opts);
    dispatch_float(q.dtype(), "causal_attention", [&](auto tag) {
      using T_ = decltype(tag);
      KVLAB_KERNEL(
          dev, attention_backward<T_>(dq.data<T_>(), head_view(dq), dk.data<T_>(), head_view(dk),
                                      dv.data<T_>(), head_view(dv), g.data<T_>(), head_view(g),
                                      q.data<T_>(), head_view(q), k.data<T_>(), head_view(k),
                                      v.data<T_>(), head_view(v), s));
    });
    return {dq, dk, dv};
  }
  void release() override { q = k = v = Tensor(); }
};

// out = the forward kernel of q over k and v, for f32 or f64 k and v like q, or cache storage
// under f32 q (bf16, or quantised rows, on the CPU only: there is no CUDA kernel for them).
void run_forward(Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                 const AttentionShape& s, KVStorage storage) {
  const Device dev = q.device();
  if (storage == KVStorage::Quantised) {
    cpu::attention_forward<float, uint8_t>(out.data<float>(), head_view(out), q.data<float>(),
                                           head_view(q), static_cast<const uint8_t*>(k.raw_data()),
                                           head_view(k), static_cast<const uint8_t*>(v.raw_data()),
                                           head_view(v), s);
    return;
  }
  if (storage == KVStorage::BF16) {
    KVLAB_KERNEL(dev, attention_forward<float, uint16_t>(
                          out.data<float>(), head_view(out), q.data<float>(), head_view(q),
                          static_cast<const uint16_t*>(k.raw_data()), head_view(k),
                          static_cast<const uint16_t*>(v.raw_data()), head_view(v), s));
    return;
  }
  dispatch_float(q.dtype(), "causal_attention", [&](auto tag) {
    using T_ = decltype(tag);
    KVLAB_KERNEL(dev,
                 attention_forward<T_>(out.data<T_>(), head_view(out), q.data<T_>(), head_view(q),
                                       k.data<T_>(), head_view(k), v.data<T_>(), head_view(v), s));
  });
}

// causal_attention over a paged k and v: forward only.
Tensor paged_attention(const Tensor& q_in, const Tensor& k, const Tensor& v,
                       const AttentionOptions& opts) {
  const char* op = "causal_attention";
  KVLAB_CHECK(q_in.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() &&
                  (k.size(3) == q_in.size(3) || is_quantised(k.dtype())) && k.size(1) > 0 &&
                  q_in.size(1) % k.size(1) == 0,
              op, ": q ", q_in.shape_str(), ", paged k ", k.shape_str(), ", v ", v.shape_str(),
              ": expected q (B, NH, T, HS) and k, v (n_blocks, NKV, block_len, HS), NKV | NH");
  KVLAB_CHECK(!needs_grad({&q_in, &k, &v}), op,
              ": a paged KV cache is read for inference only; gradients need k and v (B, NKV, S, "
              "HS)");
  KVLAB_CHECK(opts.dropout == 0, op, ": no dropout over a paged KV cache (inference only)");
  const KVStorage storage = kv_storage(op, q_in, k, opts);
  const Tensor q = hs_contiguous(q_in);
  AttentionShape s = attention_shape(q, k, opts);
  s.S = paged_kv_length(q, k, v, opts);
  Tensor out = empty_heads_last(s.B, s.NH, s.T, s.HS, q.dtype(), q.device());
  run_forward(out, q, k, v, s, storage);
  return out;
}

}  // namespace

Tensor causal_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                        const AttentionOptions& opts) {
  const char* op = "causal_attention";
  check_defined(op, q_in);
  check_defined(op, k_in);
  check_defined(op, v_in);
  check_same_dtype(op, k_in, v_in);
  check_same_device(op, q_in, k_in);
  check_same_device(op, q_in, v_in);
  if (opts.kv_blocks != nullptr) return paged_attention(q_in, k_in, v_in, opts);
  // Built only when a check fails (decode calls this op ~100 times per token).
  const auto shapes = [&] {
    return detail::cat("q ", q_in.shape_str(), ", k ", k_in.shape_str(), ", v ", v_in.shape_str());
  };
  KVLAB_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, op, ": ", shapes(),
              ": expected q (B, NH, T, HS) and k, v (B, NKV, S, HS)");
  // K and V may be KV-cache storage under f32 queries (bf16 or quantised): inference only.
  const KVStorage storage = kv_storage(op, q_in, k_in, opts);
  const int64_t B = q_in.size(0), NH = q_in.size(1), T = q_in.size(2), HS = q_in.size(3);
  const int64_t NKV = k_in.size(1), S = k_in.size(2);
  KVLAB_CHECK(k_in.sizes() == v_in.sizes(), op, ": ", shapes(), ": k and v differ");
  KVLAB_CHECK(k_in.size(0) == B && (k_in.size(3) == HS || storage == KVStorage::Quantised), op,
              ": ", shapes(), ": B and HS must match between q and k");
  KVLAB_CHECK(NKV > 0 && NH % NKV == 0, op, ": ", shapes(), ": NH = ", NH,
              " is not divisible by NKV = ", NKV);
  KVLAB_CHECK(T <= S, op, ": ", shapes(), ": T = ", T, " queries but only S = ", S, " keys");
  if (!opts.kv_lengths.empty()) {
    KVLAB_CHECK(static_cast<int64_t>(opts.kv_lengths.size()) == B, op, ": ", opts.kv_lengths.size(),
                " kv_lengths for batch ", B);
    for (int64_t b = 0; b < B; ++b)
      KVLAB_CHECK(opts.kv_lengths[b] >= T && opts.kv_lengths[b] <= S, op, ": kv_lengths[", b,
                  "] = ", opts.kv_lengths[b], " outside [T, S] = [", T, ", ", S, "]");
  }
  KVLAB_CHECK(opts.dropout >= 0 && opts.dropout < 1, op, ": dropout ", opts.dropout,
              " outside [0, 1)");
  const Tensor q = hs_contiguous(q_in), k = hs_contiguous(k_in), v = hs_contiguous(v_in);
  const Device dev = q.device();
  Tensor out = empty_heads_last(B, NH, T, HS, q.dtype(), dev);
  const AttentionShape s = attention_shape(q, k, opts);
  if (storage != KVStorage::LikeQ)
    KVLAB_CHECK(!needs_grad({&q_in, &k_in, &v_in}), op, ": ", dtype_name(k_in.dtype()),
                " keys and values are cache storage; gradients need f32 k and v");
  run_forward(out, q, k, v, s, storage);
  if (needs_grad({&q_in, &k_in, &v_in})) {
    auto node = std::make_shared<AttentionNode>();
    node->q = q.detach();
    node->k = k.detach();
    node->v = v.detach();
    node->kv_lengths.assign(opts.kv_lengths.begin(), opts.kv_lengths.end());
    node->opts = opts;
    node->opts.kv_lengths = node->kv_lengths;
    record(out, node, {&q_in, &k_in, &v_in});
  }
  return out;
}

}  // namespace kvlab
