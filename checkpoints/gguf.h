#pragma once
// GGUF version 3, the file format of llama.cpp (docs/gguf.md): a header, key/value metadata,
// tensor descriptions and the tensors' bytes, each at an aligned offset of the data section.
// This file knows the format only (no model): parse_gguf is the first thing a foreign file
// meets, so it checks every count, length, offset and shape against the bytes that remain
// before it allocates or reads, and names the field it refuses.
// gguf_model.h maps kvlab's models onto it.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "platform/formats.h"

namespace kvlab {

// Metadata value types, numbered as the format numbers them.
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7, String = 8,
  Array = 9, U64 = 10, I64 = 11, F64 = 12,
};

// Tensor element types kvlab reads and writes: the format table's rows with the kGgufTensor
// role (platform/formats.h), each numbered as ggml numbers it (the row's ggml_type).
constexpr uint32_t ggml_id(Fmt f) { return static_cast<uint32_t>(format(f).ggml_type); }
enum class GgmlType : uint32_t {
  F32 = ggml_id(Fmt::F32),
  F16 = ggml_id(Fmt::F16),
  Q4_0 = ggml_id(Fmt::Q4_0),
  Q8_0 = ggml_id(Fmt::Q8_0),
  BF16 = ggml_id(Fmt::BF16),
  Q5_0 = ggml_id(Fmt::Q5_0),
  Q5_1 = ggml_id(Fmt::Q5_1),
  Q4_K = ggml_id(Fmt::Q4_K),
  Q5_K = ggml_id(Fmt::Q5_K),
  Q6_K = ggml_id(Fmt::Q6_K),
};
// The row of a type (every GgmlType has one: parse_gguf admits no other id).
const Format& format_of(GgmlType t);
inline constexpr uint32_t kGgufDefaultAlignment = 32;

// One metadata value: a scalar (one element) or an array of scalars (no nested arrays). Integer
// and bool values live in `ints`, f32/f64 in `floats`, strings in `strings`; `type` is the
// value's type as written, `elem` the type of the scalar or of the array's elements.
struct GgufValue {
  GgufType type = GgufType::U32;
  GgufType elem = GgufType::U32;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;

  static GgufValue scalar(GgufType t, int64_t v);
  static GgufValue real(GgufType t, double v);
  static GgufValue string(std::string v);
  static GgufValue int_array(GgufType elem, std::vector<int64_t> v);
  static GgufValue real_array(GgufType elem, std::vector<double> v);
  static GgufValue string_array(std::vector<std::string> v);
  bool is_array() const { return type == GgufType::Array; }
  size_t size() const;  // elements: 1 for a scalar
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> dims;  // ggml order: dims[0] varies fastest (a row's length)
  GgmlType type = GgmlType::F32;
  std::string data;           // the tensor's bytes, gguf_tensor_bytes(type, dims) of them
};

struct GgufFile {
  std::vector<std::pair<std::string, GgufValue>> metadata;  // in file order, keys unique
  std::vector<GgufTensor> tensors;                          // in file order, names unique
  uint32_t alignment = kGgufDefaultAlignment;

  const GgufValue* find(std::string_view key) const;
  const GgufTensor* tensor(std::string_view name) const;
  // The value of a key that must be there: an Error naming `what` and the key otherwise, or
  // when it is not of the kind asked for (any integer type; f32/f64; a string).
  int64_t get_int(std::string_view key, std::string_view what) const;
  double get_float(std::string_view key, std::string_view what) const;
  const std::string& get_string(std::string_view key, std::string_view what) const;
  void set(std::string key, GgufValue value);  // appends, or replaces the key's value
};

std::string ggml_type_name(GgmlType t);
// Bytes of a tensor of that type and shape; an Error when a q8_0 or q4_0 row is not whole
// blocks.
uint64_t gguf_tensor_bytes(GgmlType t, const std::vector<int64_t>& dims);

// The file's bytes; what a GGUF reader reads.
std::string serialize_gguf(const GgufFile& file);
// Parses bytes of a GGUF file; `what` (the file's name) begins every error.
GgufFile parse_gguf(std::string_view bytes, std::string_view what);
// Reads and parses a file (refusing one larger than the machine's memory).
GgufFile read_gguf(const std::filesystem::path& path);
// True when the file begins with GGUF's magic: what tells a GGUF model from an HDF5 checkpoint
// wherever a command takes either. False for what is not a regular file or cannot be read (its
// reader says why).
bool is_gguf_file(const std::filesystem::path& path);
// serialize_gguf through write_file_atomic.
void write_gguf(const std::filesystem::path& path, const GgufFile& file);

// A row-major array as a tensor of `type`, its shape reversed: (rows, cols) has dims
// {cols, rows}, a vector {n}, a stack of matrices (n, rows, cols) {cols, rows, n}, by the
// format's codec (platform/formats.h: q8_0 and q4_0 by ggml's reference quantisers).
GgufTensor make_gguf_tensor(std::string name, const ArrayF32& arr, GgmlType type);
// The tensor's values as f32 in kvlab's order (shape: dims reversed), each type decoded
// exactly as ggml dequantises it.
ArrayF32 gguf_tensor_values(const GgufTensor& t);

}  // namespace kvlab
