#pragma once
// The number formats kvlab stores, one row each in one table (kFormats): a tensor's element
// types, the formats a model's matrices take, a KV cache's row formats and GGUF's tensor types
// are all subsets of it. Each subset is an enum whose members take their row's id, checked at
// compile time against the row's roles: DType and WeightDtype below, GgmlType in
// checkpoints/gguf.h (whose members take the row's GGUF type id). A format's name and bytes are
// defined here and nowhere else.
//
// Adding a format is one row here plus its codec (the branch of each entry point in
// formats.cpp, over a block codec in platform/) and, where it holds weights or KV rows, its
// kernels in the backends; tests/platform/test_formats.cpp round-trips every row of the table.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvlab {

// A row's id: its index in kFormats. The first seven keep DType's values as they were.
enum class Fmt : uint8_t {
  F32, F64, I32, BF16, FP8, INT8, INT4, F16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q8_K, Q5_0, Q5_1,
};

// What a format can hold: the bits of Format::roles.
enum FormatRole : uint8_t {
  kTensorElement = 1,  // a tensor's dtype (DType); a row format's tensor holds the rows' bytes
  kWeights = 2,        // a model's matrices (--weight-dtype, the decode step's packed forms)
  kKVEntries = 4,      // a KV cache's rows (--kv-dtype)
  kGgufTensor = 8,     // a GGUF tensor's type (kvlab import and export)
  kActivations = 16,   // what integer products round their input rows to
};

namespace format_codec {
// The entry points of format F; formats.cpp defines them for every row.
// dst (format_row_bytes(F, n) bytes) = x (n values) as F rounds them; n a multiple of the
// format's block (any n for an element type; one whole row for a row format, int4's even).
template <Fmt F>
void quantise(const float* x, int64_t n, void* dst);
// x (n values) = what src holds.
template <Fmt F>
void dequantise(const void* src, int64_t n, float* x);
// The dot product of src's n values with x, summed in f32 in order: the reference the
// backends' kernels are held to.
template <Fmt F>
float dot(const void* src, const float* x, int64_t n);
}  // namespace format_codec

// How a format lays out values:
//  - an element type (block_values 1): block_bytes a value;
//  - a block format (ggml's q8_0, q4_0, q5_0, q5_1): blocks of block_values consecutive values
//    of a row, block_bytes each, f16 scales then the codes (platform/ggml_blocks.h); the K-quants'
//    super-blocks of 256 values, their sub-blocks' scales packed inside (kquant_blocks.h);
//  - a row format (block_values 0: the KV caches' int8 and int4): one block is a whole row of
//    any length, its scales then its codes (platform/kv_rows.h); a tensor of such rows holds
//    bytes, block_bytes (1) each.
struct Format {
  Fmt id;
  const char* name;
  int64_t block_values;
  int64_t block_bytes;
  int32_t ggml_type;  // GGUF's type id, -1 where GGUF has none
  uint8_t roles;      // FormatRole bits
  void (*quantise)(const float* x, int64_t n, void* dst);
  void (*dequantise)(const void* src, int64_t n, float* x);
  float (*dot)(const void* src, const float* x, int64_t n);

  constexpr bool holds(FormatRole r) const { return (roles & r) != 0; }
  constexpr bool is_row_format() const { return block_values == 0; }
};

template <Fmt F>
constexpr Format format_row(const char* name, int64_t block_values, int64_t block_bytes,
                            int32_t ggml_type, uint8_t roles) {
  return {F, name, block_values, block_bytes, ggml_type, roles, &format_codec::quantise<F>,
          &format_codec::dequantise<F>, &format_codec::dot<F>};
}

// The table, in Fmt's order.
inline constexpr Format kFormats[] = {
    format_row<Fmt::F32>("f32", 1, 4, 0, kTensorElement | kWeights | kKVEntries | kGgufTensor),
    format_row<Fmt::F64>("f64", 1, 8, -1, kTensorElement),
    format_row<Fmt::I32>("i32", 1, 4, -1, kTensorElement),
    format_row<Fmt::BF16>("bf16", 1, 2, 30, kTensorElement | kWeights | kKVEntries | kGgufTensor),
    format_row<Fmt::FP8>("fp8", 1, 1, -1, kTensorElement | kKVEntries),
    format_row<Fmt::INT8>("int8", 0, 1, -1, kTensorElement | kKVEntries),
    format_row<Fmt::INT4>("int4", 0, 1, -1, kTensorElement | kKVEntries),
    format_row<Fmt::F16>("f16", 1, 2, 1, kGgufTensor),
    format_row<Fmt::Q8_0>("q8_0", 32, 34, 8, kWeights | kGgufTensor),
    format_row<Fmt::Q4_0>("q4_0", 32, 18, 2, kWeights | kGgufTensor),
    format_row<Fmt::Q4_K>("q4_k", 256, 144, 12, kGgufTensor),
    format_row<Fmt::Q5_K>("q5_k", 256, 176, 13, kGgufTensor),
    format_row<Fmt::Q6_K>("q6_k", 256, 210, 14, kGgufTensor),
    format_row<Fmt::Q8_K>("q8_k", 256, 292, 15, kActivations),
    // llama-quantize's types for a Q4_K or Q5_K matrix whose rows are not whole super-blocks.
    format_row<Fmt::Q5_0>("q5_0", 32, 22, 6, kGgufTensor),
    format_row<Fmt::Q5_1>("q5_1", 32, 24, 7, kGgufTensor),
};

constexpr const Format& format(Fmt f) { return kFormats[static_cast<uint8_t>(f)]; }
constexpr bool table_in_order() {
  for (uint8_t i = 0; i < std::size(kFormats); ++i)
    if (static_cast<uint8_t>(kFormats[i].id) != i) return false;
  return true;
}
static_assert(table_in_order(), "kFormats is indexed by Fmt");

// int4's channels a group: 32 where the row's length is a multiple of it, else the whole row.
constexpr int64_t kv_int4_group(int64_t n) { return n % 32 == 0 ? 32 : n; }

// Bytes of n values (a row) in format f: whole blocks for a block format (n a multiple of
// block_values), scales and codes for a row format.
constexpr int64_t format_row_bytes(const Format& f, int64_t n) {
  switch (f.id) {
    case Fmt::INT8: return 4 + n;                                     // f32 scale, int8 codes
    case Fmt::INT4: return 4 * (n / kv_int4_group(n)) + n / 2;  // bf16 scale + min a group
    default: return n / f.block_values * f.block_bytes;
  }
}

// The table, and the names of the formats with role r in its order ("f32, bf16 and q8_0").
std::span<const Format> formats();
std::string format_names(FormatRole r, std::string_view last_separator = " and ");
std::vector<std::string> format_name_list(FormatRole r);
// The row named `name` with role r, or null.
const Format* format_named(std::string_view name, FormatRole r);
// The row of GGUF type id `ggml_type`, or null.
const Format* format_of_ggml_type(uint32_t ggml_type);

// A subset of the table as an enum: member M of subset S is the row Fmt::M, which must hold
// role r.
template <class Subset>
constexpr const Format& format_of(Subset s) {
  return format(static_cast<Fmt>(static_cast<uint8_t>(s)));
}
constexpr uint8_t format_id(Fmt f) { return static_cast<uint8_t>(f); }
// The member of subset S that is row f (which must be one of S's).
template <class Subset>
constexpr Subset subset_member(const Format& f) {
  return static_cast<Subset>(format_id(f.id));
}

// A tensor's element type.
enum class DType : uint8_t {
  F32 = format_id(Fmt::F32),
  F64 = format_id(Fmt::F64),
  I32 = format_id(Fmt::I32),
  BF16 = format_id(Fmt::BF16),
  FP8 = format_id(Fmt::FP8),
  INT8 = format_id(Fmt::INT8),
  INT4 = format_id(Fmt::INT4),
};
static_assert(format_of(DType::F32).holds(kTensorElement) &&
              format_of(DType::F64).holds(kTensorElement) &&
              format_of(DType::I32).holds(kTensorElement) &&
              format_of(DType::BF16).holds(kTensorElement) &&
              format_of(DType::FP8).holds(kTensorElement) &&
              format_of(DType::INT8).holds(kTensorElement) &&
              format_of(DType::INT4).holds(kTensorElement));

// Bytes of one element of a tensor of type t (of a row format's tensor: one byte of its rows).
constexpr size_t dtype_size(DType t) { return static_cast<size_t>(format_of(t).block_bytes); }
inline const char* dtype_name(DType t) { return format_of(t).name; }

// The formats of a model's matrices: what --weight-dtype rounds them to, and the forms the
// fused decode step packs them in (autograd/backend/cpu/decode_kernels.h).
enum class WeightDtype : uint8_t {
  F32 = format_id(Fmt::F32),
  BF16 = format_id(Fmt::BF16),
  Q8_0 = format_id(Fmt::Q8_0),
  Q4_0 = format_id(Fmt::Q4_0),
};
static_assert(format_of(WeightDtype::F32).holds(kWeights) &&
              format_of(WeightDtype::BF16).holds(kWeights) &&
              format_of(WeightDtype::Q8_0).holds(kWeights) &&
              format_of(WeightDtype::Q4_0).holds(kWeights));
inline const char* weight_dtype_name(WeightDtype d) { return format_of(d).name; }

}  // namespace kvlab
