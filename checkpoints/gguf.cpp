#include "checkpoints/gguf.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "platform/atomic_file.h"
#include "platform/error.h"
#include "platform/ggml_blocks.h"
#include "platform/memory.h"

namespace kvlab {

static_assert(std::endian::native == std::endian::little, "GGUF is written little-endian");

namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr uint32_t kVersion = 3;
constexpr uint32_t kMaxDims = 4;          // ggml's GGML_MAX_DIMS
constexpr size_t kMaxTensorName = 63;     // ggml's GGML_MAX_NAME less its terminator
constexpr int64_t kMaxElements = int64_t{1} << 48;

bool is_integer(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16:
    case GgufType::U32: case GgufType::I32: case GgufType::Bool: case GgufType::U64:
    case GgufType::I64:
      return true;
    default:
      return false;
  }
}
bool is_float(GgufType t) { return t == GgufType::F32 || t == GgufType::F64; }

// Bytes one scalar of the type takes in the file (a string: its length field, at least).
uint64_t scalar_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::Bool: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    default: return 8;  // u64, i64, f64, a string's length
  }
}

bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::F64); }

// A cursor over the file's bytes: every read checks that the bytes are there, and every error
// names the file, the field and the offset.
class Reader {
 public:
  Reader(std::string_view bytes, std::string_view what) : bytes_(bytes), what_(what) {}

  uint64_t remaining() const { return bytes_.size() - pos_; }
  uint64_t pos() const { return pos_; }

  [[noreturn]] void fail(std::string_view field, const std::string& problem) const {
    throw Error("gguf " + std::string(what_) + ": " + std::string(field) + " (at byte " +
                std::to_string(pos_) + "): " + problem);
  }
  void need(uint64_t n, std::string_view field) const {
    if (n > remaining())
      fail(field, "needs " + std::to_string(n) + " bytes, the file has " +
                      std::to_string(remaining()) + " left (truncated?)");
  }
  template <typename T>
  T read(std::string_view field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view take(uint64_t n, std::string_view field) {
    need(n, field);
    std::string_view v = bytes_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  std::string string(std::string_view field) {
    const uint64_t n = read<uint64_t>(field);
    return std::string(take(n, field));
  }
  // A count of items that each take at least `min_bytes`: refused before anything is
  // allocated for it when the rest of the file cannot hold that many.
  uint64_t count(std::string_view field, uint64_t min_bytes) {
    const uint64_t n = read<uint64_t>(field);
    if (min_bytes > 0 && n > remaining() / min_bytes)
      fail(field, std::to_string(n) + " items of at least " + std::to_string(min_bytes) +
                      " bytes cannot fit in the " + std::to_string(remaining()) +
                      " bytes left");
    return n;
  }

 private:
  std::string_view bytes_;
  std::string_view what_;
  uint64_t pos_ = 0;
};

void read_scalar_into(Reader& r, GgufType t, GgufValue& v, const std::string& field) {
  auto as_int = [&](auto raw) { v.ints.push_back(static_cast<int64_t>(raw)); };
  switch (t) {
    case GgufType::U8: as_int(r.read<uint8_t>(field)); break;
    case GgufType::I8: as_int(r.read<int8_t>(field)); break;
    case GgufType::U16: as_int(r.read<uint16_t>(field)); break;
    case GgufType::I16: as_int(r.read<int16_t>(field)); break;
    case GgufType::U32: as_int(r.read<uint32_t>(field)); break;
    case GgufType::I32: as_int(r.read<int32_t>(field)); break;
    case GgufType::I64: as_int(r.read<int64_t>(field)); break;
    case GgufType::U64: {
      const uint64_t u = r.read<uint64_t>(field);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        r.fail(field, "u64 value " + std::to_string(u) + " is past the range kvlab reads");
      as_int(u);
      break;
    }
    case GgufType::Bool: {
      const uint8_t b = r.read<uint8_t>(field);
      if (b > 1) r.fail(field, "bool value " + std::to_string(b) + " is neither 0 nor 1");
      as_int(b);
      break;
    }
    case GgufType::F32: v.floats.push_back(r.read<float>(field)); break;
    case GgufType::F64: v.floats.push_back(r.read<double>(field)); break;
    case GgufType::String: v.strings.push_back(r.string(field)); break;
    case GgufType::Array: r.fail(field, "arrays of arrays are not supported");
  }
}

GgufValue read_value(Reader& r, const std::string& key) {
  const std::string field = "value of '" + key + "'";
  const uint32_t t = r.read<uint32_t>(field + "'s type");
  if (!known_value_type(t)) r.fail(field, "unknown value type " + std::to_string(t));
  GgufValue v;
  v.type = v.elem = static_cast<GgufType>(t);
  if (v.type != GgufType::Array) {
    read_scalar_into(r, v.elem, v, field);
    return v;
  }
  const uint32_t e = r.read<uint32_t>(field + "'s element type");
  if (!known_value_type(e)) r.fail(field, "unknown array element type " + std::to_string(e));
  v.elem = static_cast<GgufType>(e);
  if (v.elem == GgufType::Array) r.fail(field, "arrays of arrays are not supported");
  const uint64_t n = r.count(field + "'s length", scalar_bytes(v.elem));
  for (uint64_t i = 0; i < n; ++i) read_scalar_into(r, v.elem, v, field);
  return v;
}

uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what) {
  KVLAB_CHECK(b == 0 || a <= std::numeric_limits<uint64_t>::max() / b, what, " overflows");
  return a * b;
}

uint64_t padded(uint64_t n, uint64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void put_string(std::string& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  out.append(s);
}

void put_scalar(std::string& out, GgufType t, const GgufValue& v, size_t i) {
  switch (t) {
    case GgufType::U8: case GgufType::Bool: put<uint8_t>(out, static_cast<uint8_t>(v.ints[i])); break;
    case GgufType::I8: put<int8_t>(out, static_cast<int8_t>(v.ints[i])); break;
    case GgufType::U16: put<uint16_t>(out, static_cast<uint16_t>(v.ints[i])); break;
    case GgufType::I16: put<int16_t>(out, static_cast<int16_t>(v.ints[i])); break;
    case GgufType::U32: put<uint32_t>(out, static_cast<uint32_t>(v.ints[i])); break;
    case GgufType::I32: put<int32_t>(out, static_cast<int32_t>(v.ints[i])); break;
    case GgufType::U64: put<uint64_t>(out, static_cast<uint64_t>(v.ints[i])); break;
    case GgufType::I64: put<int64_t>(out, v.ints[i]); break;
    case GgufType::F32: put<float>(out, static_cast<float>(v.floats[i])); break;
    case GgufType::F64: put<double>(out, v.floats[i]); break;
    case GgufType::String: put_string(out, v.strings[i]); break;
    case GgufType::Array: KVLAB_ASSERT(false, "gguf: nested array");
  }
}

}  // namespace

// --- values -----------------------------------------------------------------------------------

GgufValue GgufValue::scalar(GgufType t, int64_t v) {
  KVLAB_ASSERT(is_integer(t), "gguf: not an integer type");
  GgufValue out;
  out.type = out.elem = t;
  out.ints = {v};
  return out;
}
GgufValue GgufValue::real(GgufType t, double v) {
  KVLAB_ASSERT(is_float(t), "gguf: not a float type");
  GgufValue out;
  out.type = out.elem = t;
  out.floats = {v};
  return out;
}
GgufValue GgufValue::string(std::string v) {
  GgufValue out;
  out.type = out.elem = GgufType::String;
  out.strings = {std::move(v)};
  return out;
}
namespace {
GgufValue empty_array(GgufType elem) {
  GgufValue out;
  out.type = GgufType::Array;
  out.elem = elem;
  return out;
}
}  // namespace
GgufValue GgufValue::int_array(GgufType elem, std::vector<int64_t> v) {
  KVLAB_ASSERT(is_integer(elem), "gguf: not an integer type");
  GgufValue out = empty_array(elem);
  out.ints = std::move(v);
  return out;
}
GgufValue GgufValue::real_array(GgufType elem, std::vector<double> v) {
  KVLAB_ASSERT(is_float(elem), "gguf: not a float type");
  GgufValue out = empty_array(elem);
  out.floats = std::move(v);
  return out;
}
GgufValue GgufValue::string_array(std::vector<std::string> v) {
  GgufValue out = empty_array(GgufType::String);
  out.strings = std::move(v);
  return out;
}
size_t GgufValue::size() const {
  return elem == GgufType::String ? strings.size() : is_float(elem) ? floats.size() : ints.size();
}

const GgufValue* GgufFile::find(std::string_view key) const {
  for (const auto& [k, v] : metadata)
    if (k == key) return &v;
  return nullptr;
}
const GgufTensor* GgufFile::tensor(std::string_view name) const {
  for (const GgufTensor& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}
int64_t GgufFile::get_int(std::string_view key, std::string_view what) const {
  const GgufValue* v = find(key);
  KVLAB_CHECK(v != nullptr, what, ": key ", key, " is missing");
  KVLAB_CHECK(!v->is_array() && is_integer(v->type), what, ": key ", key, " is not an integer");
  return v->ints[0];
}
double GgufFile::get_float(std::string_view key, std::string_view what) const {
  const GgufValue* v = find(key);
  KVLAB_CHECK(v != nullptr, what, ": key ", key, " is missing");
  KVLAB_CHECK(!v->is_array() && is_float(v->type), what, ": key ", key, " is not a float");
  return v->floats[0];
}
const std::string& GgufFile::get_string(std::string_view key, std::string_view what) const {
  const GgufValue* v = find(key);
  KVLAB_CHECK(v != nullptr, what, ": key ", key, " is missing");
  KVLAB_CHECK(v->type == GgufType::String, what, ": key ", key, " is not a string");
  return v->strings[0];
}
void GgufFile::set(std::string key, GgufValue value) {
  for (auto& [k, v] : metadata)
    if (k == key) {
      v = std::move(value);
      return;
    }
  metadata.emplace_back(std::move(key), std::move(value));
}

// --- tensors ----------------------------------------------------------------------------------

const Format& format_of(GgmlType t) {
  const Format* f = format_of_ggml_type(static_cast<uint32_t>(t));
  KVLAB_CHECK(f && f->holds(kGgufTensor), "gguf: tensor type ", static_cast<uint32_t>(t),
              " is not supported (", format_names(kGgufTensor), " are)");
  return *f;
}

std::string ggml_type_name(GgmlType t) { return format_of(t).name; }

uint64_t gguf_tensor_bytes(GgmlType t, const std::vector<int64_t>& dims) {
  KVLAB_CHECK(!dims.empty() && dims.size() <= kMaxDims, "gguf: a tensor has ", dims.size(),
              " dimensions (1 to ", kMaxDims, ")");
  uint64_t n = 1;
  for (int64_t d : dims) {
    KVLAB_CHECK(d >= 1 && d <= kMaxElements, "gguf: dimension ", d, " is out of range");
    n = checked_mul(n, static_cast<uint64_t>(d), "gguf: element count");
    KVLAB_CHECK(n <= static_cast<uint64_t>(kMaxElements), "gguf: ", n, " elements is too many");
  }
  const Format& f = format_of(t);
  KVLAB_CHECK(dims[0] % f.block_values == 0, "gguf: a ", f.name, " row of ", dims[0],
              " values is not whole blocks of ", f.block_values);
  return static_cast<uint64_t>(format_row_bytes(f, static_cast<int64_t>(n)));
}

GgufTensor make_gguf_tensor(std::string name, const ArrayF32& arr, GgmlType type) {
  KVLAB_CHECK(!arr.shape.empty() && arr.shape.size() <= kMaxDims, "gguf: tensor ", name, " has ",
              arr.shape.size(), " dimensions (1 to ", kMaxDims, " are written)");
  GgufTensor t;
  t.name = std::move(name);
  t.type = type;
  t.dims.assign(arr.shape.rbegin(), arr.shape.rend());
  t.data.resize(gguf_tensor_bytes(type, t.dims));
  format_of(type).quantise(arr.data.data(), static_cast<int64_t>(arr.data.size()), t.data.data());
  return t;
}

ArrayF32 gguf_tensor_values(const GgufTensor& t) {
  const uint64_t bytes = gguf_tensor_bytes(t.type, t.dims);
  KVLAB_CHECK(t.data.size() == bytes, "gguf: tensor ", t.name, " holds ", t.data.size(),
              " bytes, its shape and type need ", bytes);
  ArrayF32 arr;
  arr.shape.assign(t.dims.rbegin(), t.dims.rend());
  int64_t n = 1;
  for (int64_t d : t.dims) n *= d;
  arr.data.resize(static_cast<size_t>(n));
  format_of(t.type).dequantise(t.data.data(), n, arr.data.data());
  return arr;
}

// --- the file ---------------------------------------------------------------------------------

std::string serialize_gguf(const GgufFile& file) {
  const uint64_t align = file.alignment;
  KVLAB_CHECK(align > 0 && std::has_single_bit(align), "gguf: alignment ", align,
              " is not a power of two");
  std::string out(kMagic, 4);
  put<uint32_t>(out, kVersion);
  put<uint64_t>(out, file.tensors.size());
  put<uint64_t>(out, file.metadata.size());
  for (const auto& [key, v] : file.metadata) {
    put_string(out, key);
    put<uint32_t>(out, static_cast<uint32_t>(v.type));
    if (v.is_array()) {
      put<uint32_t>(out, static_cast<uint32_t>(v.elem));
      put<uint64_t>(out, v.size());
    }
    for (size_t i = 0; i < v.size(); ++i) put_scalar(out, v.elem, v, i);
  }
  uint64_t offset = 0;
  for (const GgufTensor& t : file.tensors) {
    KVLAB_CHECK(t.data.size() == gguf_tensor_bytes(t.type, t.dims), "gguf: tensor ", t.name,
                " holds the wrong number of bytes for its shape");
    put_string(out, t.name);
    put<uint32_t>(out, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) put<uint64_t>(out, static_cast<uint64_t>(d));
    put<uint32_t>(out, static_cast<uint32_t>(t.type));
    put<uint64_t>(out, offset);
    offset += padded(t.data.size(), align);
  }
  out.resize(padded(out.size(), align), '\0');
  for (const GgufTensor& t : file.tensors) {
    out.append(t.data);
    out.resize(padded(out.size(), align), '\0');
  }
  return out;
}

namespace {

struct TensorInfo {
  GgufTensor tensor;  // without its data yet
  uint64_t offset, bytes;
};

void read_metadata(Reader& r, uint64_t n_kv, GgufFile& file) {
  std::set<std::string, std::less<>> keys;
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string field = "metadata key " + std::to_string(i);
    std::string key = r.string(field);
    if (key.empty()) r.fail(field, "is empty");
    if (!keys.insert(key).second) r.fail(field, "'" + key + "' appears twice");
    GgufValue v = read_value(r, key);
    if (key == "general.alignment") {
      if (v.type != GgufType::U32) r.fail("general.alignment", "is not a u32");
      const uint64_t a = static_cast<uint64_t>(v.ints[0]);
      if (a == 0 || !std::has_single_bit(a) || a > (uint64_t{1} << 20))
        r.fail("general.alignment", std::to_string(a) + " is not a power of two up to 2^20");
      file.alignment = static_cast<uint32_t>(a);
    }
    file.metadata.emplace_back(std::move(key), std::move(v));
  }
}

std::vector<TensorInfo> read_tensor_infos(Reader& r, uint64_t n_tensors) {
  std::vector<TensorInfo> infos;
  std::set<std::string, std::less<>> names;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const std::string field = "tensor info " + std::to_string(i);
    TensorInfo info{};
    GgufTensor& t = info.tensor;
    t.name = r.string(field + "'s name");
    if (t.name.empty() || t.name.size() > kMaxTensorName)
      r.fail(field, "name of " + std::to_string(t.name.size()) + " bytes (1 to " +
                        std::to_string(kMaxTensorName) + ")");
    if (!names.insert(t.name).second) r.fail(field, "tensor '" + t.name + "' appears twice");
    const std::string tfield = "tensor '" + t.name + "'";
    const uint32_t n_dims = r.read<uint32_t>(tfield + "'s dimension count");
    if (n_dims < 1 || n_dims > kMaxDims)
      r.fail(tfield, std::to_string(n_dims) + " dimensions (1 to 4)");
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim = r.read<uint64_t>(tfield + "'s dimensions");
      if (dim < 1 || dim > static_cast<uint64_t>(kMaxElements))
        r.fail(tfield, "dimension " + std::to_string(dim) + " is out of range");
      t.dims.push_back(static_cast<int64_t>(dim));
    }
    const uint32_t type = r.read<uint32_t>(tfield + "'s type");
    const Format* format = format_of_ggml_type(type);
    if (!format || !format->holds(kGgufTensor))
      r.fail(tfield, "ggml type " + std::to_string(type) + " is not supported (" +
                         format_names(kGgufTensor) + " are)");
    t.type = static_cast<GgmlType>(type);
    try {
      info.bytes = gguf_tensor_bytes(t.type, t.dims);
    } catch (const Error& e) {
      r.fail(tfield, e.what());
    }
    info.offset = r.read<uint64_t>(tfield + "'s offset");
    infos.push_back(std::move(info));
  }
  return infos;
}

}  // namespace

GgufFile parse_gguf(std::string_view bytes, std::string_view what) {
  Reader r(bytes, what);
  GgufFile file;
  // The header.
  const std::string_view magic = r.take(4, "magic");
  if (magic != std::string_view(kMagic, 4)) r.fail("magic", "not a GGUF file");
  const uint32_t version = r.read<uint32_t>("version");
  if (version != kVersion)
    r.fail("version", std::to_string(version) + " is not supported (version 3 is)");
  // Each tensor info takes at least 32 bytes (name length, one dimension, type, offset), each
  // key/value at least 13 (key length, type, one byte of value).
  const uint64_t n_tensors = r.read<uint64_t>("tensor count");
  const uint64_t n_kv = r.count("metadata count", 13);
  if (n_tensors > r.remaining() / 32)
    r.fail("tensor count", std::to_string(n_tensors) + " tensors cannot fit in the file");

  read_metadata(r, n_kv, file);
  std::vector<TensorInfo> infos = read_tensor_infos(r, n_tensors);

  // The data section: aligned after the infos; every tensor inside it, at an aligned offset.
  const uint64_t data_start = padded(r.pos(), file.alignment);
  if (data_start > bytes.size() && !infos.empty())
    r.fail("data section", "starts at byte " + std::to_string(data_start) + ", past the end");
  const uint64_t data_size = bytes.size() > data_start ? bytes.size() - data_start : 0;
  for (TensorInfo& info : infos) {
    const std::string field = "tensor '" + info.tensor.name + "'";
    if (info.offset % file.alignment != 0)
      r.fail(field, "offset " + std::to_string(info.offset) + " is not a multiple of the alignment " +
                        std::to_string(file.alignment));
    if (info.offset > data_size || info.bytes > data_size - info.offset)
      r.fail(field, std::to_string(info.bytes) + " bytes at offset " + std::to_string(info.offset) +
                        " lie past the data section's " + std::to_string(data_size) + " bytes");
    info.tensor.data.assign(bytes.substr(data_start + info.offset, info.bytes));
    file.tensors.push_back(std::move(info.tensor));
  }
  return file;
}

bool is_gguf_file(const std::filesystem::path& path) {
  std::error_code ec;  // a FIFO or device is not opened: its reader would wait for a writer
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string_view(magic, 4) == std::string_view(kMagic, 4);
}

GgufFile read_gguf(const std::filesystem::path& path) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  KVLAB_CHECK(!ec, "gguf ", path.string(), ": cannot read it: ", ec.message());
  KVLAB_CHECK(static_cast<double>(size) < host_memory_bytes() / 2, "gguf ", path.string(), ": ",
              size, " bytes is more than half this machine's memory");
  std::ifstream in(path, std::ios::binary);
  KVLAB_CHECK(in.good(), "gguf ", path.string(), ": cannot open it");
  std::string bytes(static_cast<size_t>(size), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  KVLAB_CHECK(static_cast<uintmax_t>(in.gcount()) == size, "gguf ", path.string(),
              ": reading it failed");
  return parse_gguf(bytes, path.string());
}

void write_gguf(const std::filesystem::path& path, const GgufFile& file) {
  write_file_atomic(path, serialize_gguf(file), "gguf " + path.string() + ": ");
}

}  // namespace kvlab
