// The format table's entry points and look-ups (formats.h): each format's codec is the one
// that its kernels and files use (ggml_blocks.h, scalar_codecs.h, kv_rows.h), called here row
// by row or block by block.
#include "platform/formats.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "platform/ggml_blocks.h"
#include "platform/kquant_blocks.h"
#include "platform/kv_rows.h"
#include "platform/scalar_codecs.h"

namespace kvlab {
namespace format_codec {
namespace {

// A ggml block: q8_0 and q4_0 its f16 scale, then the codes; q5_0, q5_1 and a K-quant's
// super-block written whole by their codecs.
template <Fmt F>
void quantise_block(const float* x, uint8_t* block) {
  if constexpr (F == Fmt::Q8_0)
    store_unaligned(block, quantise_q8_0(x, reinterpret_cast<int8_t*>(block + 2)));
  if constexpr (F == Fmt::Q4_0) store_unaligned(block, quantise_q4_0(x, block + 2));
  if constexpr (F == Fmt::Q4_K) quantise_q4_k(x, block);
  if constexpr (F == Fmt::Q5_K) quantise_q5_k(x, block);
  if constexpr (F == Fmt::Q6_K) quantise_q6_k(x, block);
  if constexpr (F == Fmt::Q8_K) quantise_q8_k(x, block);
  if constexpr (F == Fmt::Q5_0) quantise_q5_0(x, block);
  if constexpr (F == Fmt::Q5_1) quantise_q5_1(x, block);
}
template <Fmt F>
void dequantise_block(const uint8_t* block, float* x) {
  if constexpr (F == Fmt::Q8_0)
    dequantise_q8_0(load_unaligned<uint16_t>(block), reinterpret_cast<const int8_t*>(block + 2),
                    x);
  if constexpr (F == Fmt::Q4_0) dequantise_q4_0(load_unaligned<uint16_t>(block), block + 2, x);
  if constexpr (F == Fmt::Q4_K) dequantise_q4_k(block, x);
  if constexpr (F == Fmt::Q5_K) dequantise_q5_k(block, x);
  if constexpr (F == Fmt::Q6_K) dequantise_q6_k(block, x);
  if constexpr (F == Fmt::Q8_K) dequantise_q8_k(block, x);
  if constexpr (F == Fmt::Q5_0) dequantise_q5_0(block, x);
  if constexpr (F == Fmt::Q5_1) dequantise_q5_1(block, x);
}

}  // namespace

template <Fmt F>
void quantise(const float* x, int64_t n, void* dst) {
  auto* out = static_cast<uint8_t*>(dst);
  constexpr const Format& f = format(F);
  if constexpr (F == Fmt::F32) {
    std::memcpy(out, x, static_cast<size_t>(n) * 4);
  } else if constexpr (F == Fmt::INT8 || F == Fmt::INT4) {
    quantise_kv_row(static_cast<DType>(F), out, x, n, 1.0f);
  } else if constexpr (f.block_values > 1) {
    for (int64_t b = 0; b < n / f.block_values; ++b)
      quantise_block<F>(x + b * f.block_values, out + b * f.block_bytes);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (F == Fmt::F64) store_unaligned(out + 8 * i, static_cast<double>(x[i]));
      if constexpr (F == Fmt::I32)
        store_unaligned(out + 4 * i, static_cast<int32_t>(std::lrint(x[i])));
      if constexpr (F == Fmt::BF16) store_unaligned(out + 2 * i, f32_to_bf16(x[i]));
      if constexpr (F == Fmt::F16) store_unaligned(out + 2 * i, f32_to_f16(x[i]));
      if constexpr (F == Fmt::FP8) out[i] = fp8_encode(x[i]);
    }
  }
}

template <Fmt F>
void dequantise(const void* src, int64_t n, float* x) {
  const auto* in = static_cast<const uint8_t*>(src);
  constexpr const Format& f = format(F);
  if constexpr (F == Fmt::F32) {
    std::memcpy(x, in, static_cast<size_t>(n) * 4);
  } else if constexpr (F == Fmt::INT8 || F == Fmt::INT4) {
    dequantise_kv_row(static_cast<DType>(F), x, in, n, 1.0f);
  } else if constexpr (f.block_values > 1) {
    for (int64_t b = 0; b < n / f.block_values; ++b)
      dequantise_block<F>(in + b * f.block_bytes, x + b * f.block_values);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (F == Fmt::F64) x[i] = static_cast<float>(load_unaligned<double>(in + 8 * i));
      if constexpr (F == Fmt::I32) x[i] = static_cast<float>(load_unaligned<int32_t>(in + 4 * i));
      if constexpr (F == Fmt::BF16) x[i] = bf16_to_f32(load_unaligned<uint16_t>(in + 2 * i));
      if constexpr (F == Fmt::F16) x[i] = f16_to_f32(load_unaligned<uint16_t>(in + 2 * i));
      if constexpr (F == Fmt::FP8) x[i] = fp8_value(in[i]);
    }
  }
}

template <Fmt F>
float dot(const void* src, const float* x, int64_t n) {
  std::vector<float> values(static_cast<size_t>(n));
  dequantise<F>(src, n, values.data());
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += values[static_cast<size_t>(i)] * x[i];
  return sum;
}

// Every row's entry points, instantiated here once: the table in formats.h names them.
#define KVLAB_FORMAT_ENTRIES(F)                                       \
  template void quantise<F>(const float*, int64_t, void*);            \
  template void dequantise<F>(const void*, int64_t, float*);          \
  template float dot<F>(const void*, const float*, int64_t);
KVLAB_FORMAT_ENTRIES(Fmt::F32)
KVLAB_FORMAT_ENTRIES(Fmt::F64)
KVLAB_FORMAT_ENTRIES(Fmt::I32)
KVLAB_FORMAT_ENTRIES(Fmt::BF16)
KVLAB_FORMAT_ENTRIES(Fmt::FP8)
KVLAB_FORMAT_ENTRIES(Fmt::INT8)
KVLAB_FORMAT_ENTRIES(Fmt::INT4)
KVLAB_FORMAT_ENTRIES(Fmt::F16)
KVLAB_FORMAT_ENTRIES(Fmt::Q8_0)
KVLAB_FORMAT_ENTRIES(Fmt::Q4_0)
KVLAB_FORMAT_ENTRIES(Fmt::Q4_K)
KVLAB_FORMAT_ENTRIES(Fmt::Q5_K)
KVLAB_FORMAT_ENTRIES(Fmt::Q6_K)
KVLAB_FORMAT_ENTRIES(Fmt::Q8_K)
KVLAB_FORMAT_ENTRIES(Fmt::Q5_0)
KVLAB_FORMAT_ENTRIES(Fmt::Q5_1)
#undef KVLAB_FORMAT_ENTRIES
static_assert(std::size(kFormats) == 16, "a new row needs its entry points instantiated above");

}  // namespace format_codec

std::span<const Format> formats() { return kFormats; }

std::vector<std::string> format_name_list(FormatRole r) {
  std::vector<std::string> names;
  for (const Format& f : kFormats)
    if (f.holds(r)) names.emplace_back(f.name);
  return names;
}

std::string format_names(FormatRole r, std::string_view last_separator) {
  const std::vector<std::string> names = format_name_list(r);
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? std::string(last_separator) : std::string(", ");
    out += names[i];
  }
  return out;
}

const Format* format_named(std::string_view name, FormatRole r) {
  for (const Format& f : kFormats)
    if (f.holds(r) && name == f.name) return &f;
  return nullptr;
}

const Format* format_of_ggml_type(uint32_t ggml_type) {
  for (const Format& f : kFormats)
    if (f.ggml_type >= 0 && static_cast<uint32_t>(f.ggml_type) == ggml_type) return &f;
  return nullptr;
}

}  // namespace kvlab
