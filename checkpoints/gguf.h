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
#include "platform/ggml_blocks.h"  // the blocks' definitions, f32_to_f16 and f16_to_f32

namespace kvlab {

// Metadata value types, numbered as the format numbers them.
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7, String = 8,
  Array = 9, U64 = 10, I64 = 11, F64 = 12,
};

// Tensor element types kvlab reads and writes, numbered as ggml numbers them.
enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, BF16 = 30 };
inline constexpr int64_t kQ8Block = kGgmlBlock;  // values a q8_0 block holds
inline constexpr int64_t kQ8BlockBytes = 34;   // its f16 scale and 32 int8 codes
inline constexpr int64_t kQ4BlockBytes = 18;   // its f16 scale and 16 bytes of 4-bit codes
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
// q8_0 and q4_0: a row is whole blocks of kGgmlBlock values, each block one scale and codes.
bool is_block_type(GgmlType t);
// Bytes of a tensor of that type and shape; an Error when a q8_0 or q4_0 row is not whole
// blocks.
uint64_t gguf_tensor_bytes(GgmlType t, const std::vector<int64_t>& dims);

// The file's bytes; what a GGUF reader reads.
std::string serialize_gguf(const GgufFile& file);
// Parses bytes of a GGUF file; `what` (the file's name) begins every error.
GgufFile parse_gguf(std::string_view bytes, std::string_view what);
// Reads and parses a file (refusing one larger than the machine's memory).
GgufFile read_gguf(const std::filesystem::path& path);
// serialize_gguf through write_file_atomic.
void write_gguf(const std::filesystem::path& path, const GgufFile& file);

// A row-major array as a tensor of `type`, its shape reversed: (rows, cols) has dims
// {cols, rows}, a vector {n}, a stack of matrices (n, rows, cols) {cols, rows, n}; q8_0 and
// q4_0 by ggml's reference quantisers (platform/ggml_blocks.h).
GgufTensor make_gguf_tensor(std::string name, const ArrayF32& arr, GgmlType type);
// The tensor's values as f32 in kvlab's order (shape: dims reversed), each type decoded
// exactly as ggml dequantises it.
ArrayF32 gguf_tensor_values(const GgufTensor& t);

}  // namespace kvlab
