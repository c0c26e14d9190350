// The flags for where and in what types a model runs, which train, generate, bench, serve and
// ablate share: the device and the products' precision, the KV cache's dtype and layout, the
// matrices' dtype, and lists of dtypes (train_flags.h declares them).
#include "apps/train_flags.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#include "apps/cli.h"

namespace kvlab {

void add_device_flags(CLI::App* cmd, std::string& device, std::string& dtype) {
  cmd->add_option("--device", device,
                  "cpu, or cuda (the first visible GPU; needs a build with the CUDA backend)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--dtype", dtype,
                  "f32, or bf16 on cuda: matrix products in bf16 with f32 accumulation; "
                  "weights, optimizer state and checkpoints stay f32")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
}

Device parse_device(const std::string& device) {
  const Device d = device == "cuda" ? Device::CUDA : Device::CPU;
  check_device_available(d);
  return d;
}

MatmulPrecision parse_dtype(const std::string& dtype, Device device) {
  if (dtype != "bf16") return MatmulPrecision::F32;
  KVLAB_USAGE_CHECK(device == Device::CUDA, "--dtype bf16 needs --device cuda (the CPU computes "
                    "in f32)");
  return MatmulPrecision::BF16;
}

void add_chat_template_flag(CLI::App* cmd, std::string& file) {
  cmd->add_option("--chat-template", file,
                  "A Jinja chat template file for chat requests, instead of the model's own "
                  "(tokenizer.chat_template of the GGUF it was imported from)")
      ->check(CLI::ExistingFile);
}

std::string chat_template_source(const std::string& file, const Tokenizer& tokenizer) {
  if (file.empty()) return tokenizer.controls().chat_template;
  std::ifstream in(file, std::ios::binary);
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  KVLAB_CHECK(in.good() || in.eof(), "cannot read the chat template ", file);
  KVLAB_CHECK(text.size() <= (1u << 20), "the chat template ", file, " is larger than 1 MiB");
  return text;
}

void add_kv_dtype_flag(CLI::App* cmd, std::string& kv_dtype) {
  cmd->add_option("--kv-dtype", kv_dtype,
                  "KV cache element type: f32; bf16 (keys and values rounded as they are cached: "
                  "half the memory and the bytes a decode step reads); or, on the CPU, quantised "
                  "as cached: fp8 (E4M3, a scale per layer and KV head), int8 (a scale per "
                  "position and KV head) or int4 (a scale and minimum per group of up to 32 "
                  "channels). `kvlab bench kv-quality` measures what each costs a model")
      ->check(CLI::IsMember(format_name_list(kKVEntries)))
      ->capture_default_str();
}

void add_kv_cache_flags(CLI::App* cmd, KVCacheFlags& flags) {
  cmd->add_option("--cache", flags.layout,
                  "KV cache layout: paged (blocks of --kv-block-size positions taken as rows "
                  "grow, shared by samples of one prompt and by prompts that begin alike, handed "
                  "back as rows finish; CPU only) or contiguous (every row's whole generation "
                  "allocated up front). Default: paged on the CPU, contiguous on CUDA")
      ->check(CLI::IsMember({"paged", "contiguous"}));
  add_number(cmd, "--kv-block-size", flags.block_size,
             "Positions per block of the paged cache: a power of two, at most the model's "
             "block_size");
  cmd->add_option("--kv-memory", flags.memory,
                  "The paged cache's pool, e.g. 64MiB (running out is an error that says so); "
                  "default: room for every row's whole generation");
}

int64_t parse_bytes(const std::string& text, const std::string& flag) {
  static const std::pair<const char*, double> kUnits[] = {
      {"KiB", 1024.0}, {"MiB", 1024.0 * 1024}, {"GiB", 1024.0 * 1024 * 1024},
      {"kB", 1e3},     {"MB", 1e6},            {"GB", 1e9},
      {"B", 1.0},      {"", 1.0}};
  size_t end = 0;
  double number = 0;
  try {
    number = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  const std::string unit = text.substr(end);
  double scale = 0;
  for (const auto& [name, s] : kUnits)
    if (unit == name) scale = s;
  const double bytes = number * scale;
  KVLAB_USAGE_CHECK(end > 0 && scale > 0 && std::isfinite(bytes) && bytes >= 1 && bytes < 9e18,
                    flag, " must be a size such as 64MiB, 1GiB or 4096 (bytes), got '", text,
                    "'");
  return static_cast<int64_t>(bytes);
}

std::string kv_cache_layout(const KVCacheFlags& flags, Device device) {
  if (!flags.layout.empty()) return flags.layout;
  return device == Device::CPU ? "paged" : "contiguous";
}

std::optional<PagedCacheOptions> parse_kv_cache(const KVCacheFlags& flags, int64_t context,
                                                Device device) {
  const int64_t n = flags.block_size;
  KVLAB_USAGE_CHECK(n >= 1 && (n & (n - 1)) == 0, "--kv-block-size must be a power of two, got ",
                    n);
  KVLAB_USAGE_CHECK(n <= context, "--kv-block-size ", n,
                    " is larger than the model's context (block_size ", context, ")");
  if (kv_cache_layout(flags, device) != "paged") {
    KVLAB_USAGE_CHECK(flags.memory.empty(),
                      "--kv-memory sizes the paged cache's pool; the contiguous cache takes "
                      "every row's whole generation (drop --kv-memory or use --cache paged)");
    return std::nullopt;
  }
  KVLAB_USAGE_CHECK(device == Device::CPU,
                    "the paged KV cache runs on the CPU only: use --cache contiguous on CUDA");
  PagedCacheOptions o{.kv_block_size = n};
  if (!flags.memory.empty()) o.pool_bytes = parse_bytes(flags.memory, "--kv-memory");
  return o;
}

void add_weight_dtype_flag(CLI::App* cmd, std::string& weight_dtype) {
  cmd->add_option("--weight-dtype", weight_dtype,
                  "The products' matrices: f32, bf16, q8_0 or q4_0, rounded once at load on "
                  "every path (q8_0/q4_0: ggml's blocks of 32; with q4_0 the LM head is q8_0, and "
                  "a matrix whose rows are not whole blocks is bf16); the fused CPU decode reads "
                  "them in 2, 1.125 or 0.625 bytes a value, and a model imported from a q8_0/q4_0 "
                  "GGUF file in its own blocks. The token table is rounded when it is the LM head "
                  "(tied); biases, norms and positions stay f32")
      ->check(CLI::IsMember(format_name_list(kWeights)))
      ->capture_default_str();
}

void add_weight_dtype_flag(CLI::App* cmd, std::string& weight_dtype, bool& int8_products) {
  add_weight_dtype_flag(cmd, weight_dtype);
  cmd->add_flag("--int8-products", int8_products,
                "Multiply q8_0 and q4_0 matrices (--weight-dtype, or a model imported from such "
                "a GGUF file) in integers in the fused CPU decode, as llama.cpp does: each "
                "product's input rounded to q8_0 blocks of 32. Faster, at a small cost in "
                "quality (kvlab bench weight-quality --int8-products); without it the products "
                "are exact over the rounded matrices");
}

WeightDtype parse_weight_dtype(const std::string& dtype) {
  const Format* f = format_named(dtype, kWeights);
  return f ? subset_member<WeightDtype>(*f) : WeightDtype::F32;  // the flag's check admits no other name
}

DType parse_storage_dtype(const std::string& dtype) {
  const Format* f = format_named(dtype, kKVEntries);
  return f ? subset_member<DType>(*f) : DType::F32;  // the flags' checks admit no other name
}

namespace {

// A comma-separated list of the names in `known` (`what` in the errors), each once, parsed by
// `parse`: a usage error names a bad or repeated one.
template <class T, class Parse>
std::vector<T> parse_dtype_list(const std::string& list, const char* flag,
                                const std::vector<std::string>& known, const char* what,
                                Parse parse) {
  std::string names;
  for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
  std::vector<T> out;
  std::stringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    KVLAB_USAGE_CHECK(std::find(known.begin(), known.end(), name) != known.end(), flag, ": '",
                      name, "' is not a ", what, " (", names, ")");
    const T d = parse(name);
    KVLAB_USAGE_CHECK(std::find(out.begin(), out.end(), d) == out.end(), flag, ": ", name,
                      " is listed twice");
    out.push_back(d);
  }
  KVLAB_USAGE_CHECK(!out.empty(), flag, ": the list is empty");
  return out;
}

}  // namespace

std::vector<DType> parse_kv_dtypes(const std::string& list) {
  return parse_dtype_list<DType>(list, "--kv-dtypes", format_name_list(kKVEntries),
                                 "KV cache dtype", parse_storage_dtype);
}

std::vector<WeightDtype> parse_weight_dtypes(const std::string& list) {
  return parse_dtype_list<WeightDtype>(list, "--weight-dtypes", format_name_list(kWeights),
                                       "weight dtype", parse_weight_dtype);
}

}  // namespace kvlab
