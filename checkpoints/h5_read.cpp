// Reading a checkpoint's HDF5 layout from its file image: every link, type, shape and storage
// checked before an array is allocated, then the arrays and attributes read.
#include <algorithm>
#include <cstring>
#include <map>
#include <variant>

#include "checkpoints/h5_layout.h"
#include "platform/error.h"

namespace kvlab::checkpoint_detail {
namespace {

// HDF5 iteration callback (links or attributes) appending each name to a vector of strings.
template <class Info>
herr_t append_name(hid_t, const char* name, const Info*, void* out) noexcept {
  try {
    static_cast<std::vector<std::string>*>(out)->emplace_back(name);
    return 0;
  } catch (...) {
    return -1;
  }
}

// "float32", "uint64", "string", ...: what a dataset holds, for error messages.
std::string dtype_name(hid_t type) {
  const H5T_class_t c = H5Tget_class(type);
  const size_t bits = 8 * H5Tget_size(type);
  if (c == H5T_FLOAT) return "float" + std::to_string(bits);
  if (c == H5T_INTEGER) {
    return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(bits);
  }
  return c == H5T_STRING ? "string" : "HDF5 type class " + std::to_string(c);
}

struct Dtype {
  H5T_class_t cls;
  size_t size;
  H5T_sign_t sign;  // H5T_SGN_ERROR for floats
  const char* name;
};
const Dtype kFloat32{H5T_FLOAT, 4, H5T_SGN_ERROR, "float32"};
const Dtype kUint8{H5T_INTEGER, 1, H5T_SGN_NONE, "uint8"};
const Dtype kUint32{H5T_INTEGER, 4, H5T_SGN_NONE, "uint32"};
const Dtype kUint64{H5T_INTEGER, 8, H5T_SGN_NONE, "uint64"};

// Whether a type of `want`'s class and size is its standard layout (IEEE binary32, or an
// unsigned integer of all its bits) in either byte order. A damaged type message can keep the
// class and size and change the precision, the bit offsets or the exponent's bias: the values
// would then convert into others, silently.
bool standard_layout(hid_t type, const Dtype& want) {
  const bool f = want.cls == H5T_FLOAT;
  const hid_t le = f                ? H5T_IEEE_F32LE
                   : want.size == 1 ? H5T_STD_U8LE
                   : want.size == 4 ? H5T_STD_U32LE
                                    : H5T_STD_U64LE;
  const hid_t be = f                ? H5T_IEEE_F32BE
                   : want.size == 1 ? H5T_STD_U8BE
                   : want.size == 4 ? H5T_STD_U32BE
                                    : H5T_STD_U64BE;
  return H5Tequal(type, le) > 0 || H5Tequal(type, be) > 0;
}

// What a group lists: each link's name, and whether it is a hard link (an object stored in
// this file) rather than a soft or external one.
struct Link {
  std::string name;
  bool hard;
};

herr_t append_link(hid_t, const char* name, const H5L_info_t* info, void* out) noexcept {
  try {
    static_cast<std::vector<Link>*>(out)->push_back({name, info->type == H5L_TYPE_HARD});
    return 0;
  } catch (...) {
    return -1;
  }
}

// Deflate never shrinks data by more than 1032:1, so a gzip dataset declaring more than that
// many times its stored bytes is damaged: refused before its values are allocated.
constexpr int64_t kDeflateMaxRatio = 1032;
// The longest fixed-length string attribute read (kvlab's are variable-length and short).
constexpr size_t kMaxStringAttr = size_t{1} << 20;

class Loader {
 public:
  // `image` holds the file's bytes; `sealed` says that its digest was kvlab's and matched.
  Loader(const fs::path& path, const FileImage& image, bool sealed)
      : path_(path), pre_("checkpoint: " + path.string() + ": "), image_(image), sealed_(sealed) {}

  Checkpoint load(const LoadOptions& options) {
    check(has_hdf5_signature(), "not an HDF5 file");
    // Read-only, straight from the bytes already read: no copy, and nothing else is opened.
    H5Id file(H5_CHECK(open_image(image_), pre_, "cannot open HDF5 file (truncated or damaged?)"),
              H5Fclose);
    if (!sealed_) {
      H5Id fcpl(H5_CHECK(H5Fget_create_plist(file), pre_, "reading the file"), H5Pclose);
      hsize_t user_block = 0;
      H5_CHECK(H5Pget_userblock(fcpl, &user_block), pre_, "reading the file");
      check(user_block == 0, "its ", user_block,
            "-byte user block is not a kvlab digest: a kvlab checkpoint damaged at its start, "
            "or a file with a user block of its own (h5unjam removes one)");
    }

    const AttrValue format = required_attr(file, "format", "/");
    const auto* format_str = std::get_if<std::string>(&format);
    check(format_str && *format_str == kCheckpointFormat, "attribute 'format' of / is ",
          describe(format), ", expected \"", kCheckpointFormat, "\"");
    const int64_t version = int_attr(file, "format_version", "/");
    check(version == kCheckpointVersion, "unsupported format_version ", version,
          " (this build reads version ", kCheckpointVersion, ")");

    Checkpoint ckpt;
    {
      H5Id config = open_group(file, "config", "/config");
      ckpt.config = all_attrs(config, "/config");
    }
    ShapeList expected;
    if (options.expected_model) expected = options.expected_model(ckpt.config);
    read_tokenizer(file, ckpt);
    {
      H5Id model = open_group(file, "model", "/model");
      ckpt.model = read_arrays(model, "/model", options.expected_model ? &expected : nullptr);
    }
    if (!options.training_state) return ckpt;
    try {
      read_training_state(file, ckpt);
    } catch (const Error& e) {
      if (!options.report_training_state) throw;
      ckpt.has_optimizer = ckpt.has_train_state = false;
      ckpt.optimizer_m.clear();
      ckpt.optimizer_v.clear();
      ckpt.rng_state.clear();
      ckpt.training_state_problem = e.what();
    }
    return ckpt;
  }

 private:
  template <class... Args>
  void check(bool ok, const Args&... args) const {
    KVLAB_CHECK(ok, pre_, args...);
  }

  // HDF5's signature at offset 0, 512, 1024, ... (its superblock follows any user block).
  bool has_hdf5_signature() const {
    static constexpr char kSignature[] = "\211HDF\r\n\032\n";
    for (size_t at = 0; at + 8 <= image_.size; at = at ? 2 * at : 512) {
      if (std::memcmp(image_.data() + at, kSignature, 8) == 0) return true;
    }
    return false;
  }

  // /vocab for char and byte (and bpe files written before the separate datasets); bpe's
  // datasets with every length and offset checked, so that a damaged file cannot make a token
  // reach outside the bytes.
  void read_tokenizer(hid_t file, Checkpoint& ckpt) const {
    H5Id tok = open_group(file, "tokenizer", "/tokenizer");
    ckpt.tokenizer_kind = string_attr(tok, "kind", "/tokenizer");
    if (has_link(tok, "chat_template", "/tokenizer/chat_template")) {
      const std::vector<uint8_t> text = read<uint8_t>(tok, "chat_template", "/tokenizer/chat_template",
                                                      kUint8, H5T_NATIVE_UINT8, 1)
                                            .second;
      ckpt.tokenizer_chat_template.assign(text.begin(), text.end());
    }
    if (has_link(tok, "eog_ids", "/tokenizer/eog_ids")) {  // what the ids mean: data/'s to check
      ckpt.tokenizer_bos = int_attr(tok, "bos", "/tokenizer");
      ckpt.tokenizer_eos = int_attr(tok, "eos", "/tokenizer");
      ckpt.tokenizer_add_bos = int_attr(tok, "add_bos", "/tokenizer");
      if (H5_CHECK(H5Aexists(tok, "add_eos"), pre_, "reading /tokenizer") > 0)
        ckpt.tokenizer_add_eos = int_attr(tok, "add_eos", "/tokenizer");
      if (has_link(tok, "user_defined_ids", "/tokenizer/user_defined_ids"))
        ckpt.tokenizer_user_defined =
            read<uint32_t>(tok, "user_defined_ids", "/tokenizer/user_defined_ids", kUint32,
                           H5T_NATIVE_UINT32, 1)
                .second;
      ckpt.tokenizer_eog = read<uint32_t>(tok, "eog_ids", "/tokenizer/eog_ids", kUint32,
                                          H5T_NATIVE_UINT32, 1)
                               .second;
    }
    if (ckpt.tokenizer_kind == "spm") {
      SpmArrays& spm = ckpt.tokenizer_spm;
      spm.add_space_prefix = int_attr(tok, "add_space_prefix", "/tokenizer");
      read_token_texts(tok, spm.token_bytes, spm.token_offsets);
      spm.scores =
          read<float>(tok, "scores", "/tokenizer/scores", kFloat32, H5T_NATIVE_FLOAT, 1).second;
      spm.token_types = read<uint8_t>(tok, "token_types", "/tokenizer/token_types", kUint8,
                                      H5T_NATIVE_UINT8, 1)
                            .second;
      const size_t n_tokens = spm.token_offsets.size() - 1;
      check(spm.scores.size() == n_tokens && spm.token_types.size() == n_tokens,
            "/tokenizer: ", n_tokens, " pieces but ", spm.scores.size(), " scores and ",
            spm.token_types.size(), " types");
      return;
    }
    if (ckpt.tokenizer_kind != "bpe" || !has_link(tok, "merges", "/tokenizer/merges")) {
      ckpt.tokenizer_vocab =
          read<uint32_t>(tok, "vocab", "/tokenizer/vocab", kUint32, H5T_NATIVE_UINT32, 1).second;
      return;
    }
    BpeArrays& bpe = ckpt.tokenizer_bpe;
    bpe.pattern = string_attr(tok, "pattern", "/tokenizer");
    auto [merge_shape, merges] =
        read<uint32_t>(tok, "merges", "/tokenizer/merges", kUint32, H5T_NATIVE_UINT32, 2);
    check(merge_shape[1] == 2, "/tokenizer/merges: shape ", shape_str(merge_shape),
          ", expected (M, 2): a left and a right id per merge");
    bpe.merges = std::move(merges);
    read_token_texts(tok, bpe.token_bytes, bpe.token_offsets);
    bpe.special_ids = read<uint32_t>(tok, "special_ids", "/tokenizer/special_ids", kUint32,
                                     H5T_NATIVE_UINT32, 1)
                          .second;
    const size_t n_tokens = bpe.token_offsets.size() - 1;
    for (const uint32_t id : bpe.merges)
      check(id < n_tokens, "/tokenizer/merges: id ", id, " is outside the ", n_tokens, " tokens");
    for (size_t i = 0; i < bpe.special_ids.size(); ++i)
      check(bpe.special_ids[i] < n_tokens && (i == 0 || bpe.special_ids[i - 1] < bpe.special_ids[i]),
            "/tokenizer/special_ids: entry ", i, " (", bpe.special_ids[i],
            ") is not an id below ", n_tokens, " above the one before it");
  }

  // token_bytes and token_offsets (bpe's and spm's), the offsets checked so that no token
  // reaches outside the bytes.
  void read_token_texts(hid_t tok, std::vector<uint8_t>& bytes,
                        std::vector<uint64_t>& off) const {
    bytes = read<uint8_t>(tok, "token_bytes", "/tokenizer/token_bytes", kUint8, H5T_NATIVE_UINT8,
                          1)
                .second;
    off = read<uint64_t>(tok, "token_offsets", "/tokenizer/token_offsets", kUint64,
                         H5T_NATIVE_UINT64, 1)
              .second;
    check(!off.empty() && off.front() == 0, "/tokenizer/token_offsets: must start at 0 (",
          off.empty() ? "it is empty" : detail::cat("it starts at ", off.front()), ")");
    for (size_t i = 1; i < off.size(); ++i)
      check(off[i - 1] <= off[i], "/tokenizer/token_offsets: offset ", i, " (", off[i],
            ") is below offset ", i - 1, " (", off[i - 1], ")");
    check(off.back() == bytes.size(), "/tokenizer/token_offsets: the last offset is ", off.back(),
          " but /tokenizer/token_bytes holds ", bytes.size(), " bytes");
  }

  void read_training_state(hid_t file, Checkpoint& ckpt) const {
    if (has_link(file, "optimizer", "/optimizer")) {
      H5Id opt = open_group(file, "optimizer", "/optimizer");
      ckpt.has_optimizer = true;
      ckpt.optimizer_step = int_attr(opt, "step", "/optimizer");
      ckpt.optimizer_m = read_optimizer_state(opt, "m", ckpt.model);
      ckpt.optimizer_v = read_optimizer_state(opt, "v", ckpt.model);
    }
    if (has_link(file, "train", "/train")) {
      H5Id train = open_group(file, "train", "/train");
      ckpt.has_train_state = true;
      ckpt.train_extra = all_attrs(train, "/train");
      ckpt.iteration = int_attr(train, "iteration", "/train");
      const AttrValue best = required_attr(train, "best_val_loss", "/train");
      check(std::holds_alternative<double>(best), "attribute 'best_val_loss' of /train is ",
            describe(best), ", expected a double");
      ckpt.best_val_loss = std::get<double>(best);
      ckpt.train_extra.erase("iteration");
      ckpt.train_extra.erase("best_val_loss");
      ckpt.rng_state =
          read<uint64_t>(train, "rng_state", "/train/rng_state", kUint64, H5T_NATIVE_UINT64, 1)
              .second;
    }
  }

  static std::string describe(const AttrValue& v) {
    if (const auto* s = std::get_if<std::string>(&v)) return "\"" + *s + "\"";
    if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
    return detail::cat(std::get<double>(v));
  }

  // Whether `name` is a link of `loc`; a link that is not a hard one (soft, or to another
  // file) is refused: a checkpoint's objects are stored in the checkpoint.
  bool has_link(hid_t loc, const std::string& name, const std::string& path) const {
    if (H5_CHECK(H5Lexists(loc, name.c_str(), H5P_DEFAULT), pre_, "looking up ", path) <= 0)
      return false;
    H5L_info_t info;
    H5_CHECK(H5Lget_info(loc, name.c_str(), &info, H5P_DEFAULT), pre_, "looking up ", path);
    check(info.type == H5L_TYPE_HARD, path, " is a ",
          info.type == H5L_TYPE_EXTERNAL ? "link to another file" : "soft link",
          "; kvlab reads only objects stored in the checkpoint itself");
    return true;
  }

  // Opens an object that must exist and be of `type` (H5I_GROUP or H5I_DATASET).
  H5Id open_object(hid_t loc, const std::string& name, const std::string& path,
                   H5I_type_t type) const {
    const char* kind = type == H5I_GROUP ? "group" : "dataset";
    check(has_link(loc, name, path), "missing ", kind, " ", path);
    H5Id obj(H5_CHECK(H5Oopen(loc, name.c_str(), H5P_DEFAULT), pre_, "opening ", path), H5Oclose);
    check(H5Iget_type(obj) == type, path, " is not a ", kind);
    return obj;
  }

  H5Id open_group(hid_t loc, const std::string& name, const std::string& path) const {
    return open_object(loc, name, path, H5I_GROUP);
  }

  // Link names in creation order when the group tracks it (kvlab files do), else by name.
  std::vector<std::string> link_names(hid_t group, const std::string& path) const {
    H5Id gcpl(H5_CHECK(H5Gget_create_plist(group), pre_, "reading ", path), H5Pclose);
    unsigned flags = 0;
    H5_CHECK(H5Pget_link_creation_order(gcpl, &flags), pre_, "reading ", path);
    const H5_index_t index = (flags & H5P_CRT_ORDER_TRACKED) ? H5_INDEX_CRT_ORDER : H5_INDEX_NAME;
    std::vector<Link> links;
    H5_CHECK(H5Literate(group, index, H5_ITER_INC, nullptr, append_link, &links), pre_, "listing ",
             path);
    std::vector<std::string> names;
    for (const Link& link : links) {
      check(link.hard, path, "/", link.name,
            " is a soft or external link; kvlab reads only objects stored in the checkpoint "
            "itself");
      names.push_back(link.name);
    }
    return names;
  }

  // The shape a dataset declares, read from its header alone.
  std::vector<int64_t> shape_of(hid_t loc, const std::string& name, const std::string& path) const {
    H5Id dset = open_object(loc, name, path, H5I_DATASET);
    H5Id space(H5_CHECK(H5Dget_space(dset), pre_, "reading ", path), H5Sclose);
    const int ndims = H5_CHECK(H5Sget_simple_extent_ndims(space), pre_, "reading ", path);
    std::vector<hsize_t> dims(ndims);
    H5_CHECK(H5Sget_simple_extent_dims(space, dims.data(), nullptr), pre_, "reading ", path);
    return {dims.begin(), dims.end()};
  }

  // The float32 datasets of a group of parameters. With `expected`, every name and shape is
  // compared first, and the arrays are read in its order.
  NamedArrays read_arrays(hid_t group, const std::string& path, const ShapeList* expected) const {
    const std::vector<std::string> names = link_names(group, path);
    NamedArrays arrays;
    if (expected) {
      ShapeList found;
      for (const std::string& name : names)
        found.emplace_back(name, shape_of(group, name, path + "/" + name));
      compare_shapes(found, *expected, path);
      for (const auto& [name, shape] : *expected) {
        auto [s, data] =
            read<float>(group, name, path + "/" + name, kFloat32, H5T_NATIVE_FLOAT, -1);
        arrays.emplace_back(name, ArrayF32{std::move(s), std::move(data)});
      }
      return arrays;
    }
    for (const std::string& name : names) {
      auto [shape, data] =
          read<float>(group, name, path + "/" + name, kFloat32, H5T_NATIVE_FLOAT, -1);
      arrays.emplace_back(name, ArrayF32{std::move(shape), std::move(data)});
    }
    return arrays;
  }

 public:
  // Each expected name present with exactly its shape, and nothing else.
  static void compare_shapes(const ShapeList& found, const ShapeList& expected,
                             const std::string& group, const std::string& pre) {
    std::map<std::string, const std::vector<int64_t>*> by_name;
    for (const auto& [name, shape] : found) by_name[name] = &shape;
    for (const auto& [name, shape] : expected) {
      const auto it = by_name.find(name);
      KVLAB_CHECK(it != by_name.end(), pre, "missing dataset ", group, "/", name,
                  " (expected shape ", shape_str(shape), ")");
      KVLAB_CHECK(*it->second == shape, pre, group, "/", name, ": shape ", shape_str(*it->second),
                  " in the file, the model expects ", shape_str(shape));
      by_name.erase(it);
    }
    KVLAB_CHECK(by_name.empty(), pre, "unexpected dataset ", group, "/", by_name.begin()->first,
                " (not a parameter of this model; ", by_name.size(), " unexpected in all)");
  }

 private:
  void compare_shapes(const ShapeList& found, const ShapeList& expected,
                      const std::string& group) const {
    compare_shapes(found, expected, group, pre_);
  }

  // Checks that a dataset's values are stored in this file, as many as it declares (`bytes`),
  // before anything is allocated for them: contiguous or compact, or chunked with every chunk
  // written and only the filters h5py users apply (gzip, shuffle, fletcher32).
  void check_storage(hid_t dset, const std::string& path, int64_t points, size_t elem) const {
    H5Id dcpl(H5_CHECK(H5Dget_create_plist(dset), pre_, "reading ", path), H5Pclose);
    const H5D_layout_t layout = H5Pget_layout(dcpl);
    check(layout != H5D_VIRTUAL, path,
          ": a virtual dataset (its values live in other files); kvlab reads only values stored "
          "in the checkpoint itself");
    check(H5_CHECK(H5Pget_external_count(dcpl), pre_, "reading ", path) == 0, path,
          ": its values are stored in external files; kvlab reads only values stored in the "
          "checkpoint itself");
    check(layout == H5D_CONTIGUOUS || layout == H5D_COMPACT || layout == H5D_CHUNKED, path,
          ": unknown storage layout ", static_cast<int>(layout));
    if (points == 0) return;
    const auto image = static_cast<int64_t>(image_.size);
    const std::string not_all = detail::cat(path, ": declares ", points,
                                            " values but the file does not store them all (a "
                                            "damaged or unfinished file)");
    check(points <= image * kDeflateMaxRatio / static_cast<int64_t>(elem), not_all);
    const int64_t bytes = points * static_cast<int64_t>(elem);
    const auto stored = static_cast<int64_t>(H5Dget_storage_size(dset));
    check(stored <= image, path, ": claims ", stored, " stored bytes in a file of ", image);
    if (layout != H5D_CHUNKED) {
      check(stored == bytes, not_all);
      return;
    }
    bool deflate = false;
    const int nfilters = H5_CHECK(H5Pget_nfilters(dcpl), pre_, "reading ", path);
    for (int i = 0; i < nfilters; ++i) {
      unsigned flags = 0, config = 0;
      size_t nvalues = 0;
      char name[64] = {};
      const H5Z_filter_t id = H5Pget_filter2(dcpl, static_cast<unsigned>(i), &flags, &nvalues,
                                             nullptr, sizeof name, name, &config);
      check(id == H5Z_FILTER_DEFLATE || id == H5Z_FILTER_SHUFFLE || id == H5Z_FILTER_FLETCHER32,
            path, ": stored through HDF5 filter ", id, " (", name,
            "); kvlab reads gzip, shuffle and fletcher32 datasets");
      deflate = deflate || id == H5Z_FILTER_DEFLATE;
    }
    const int rank = H5Pget_chunk(dcpl, 0, nullptr);
    std::vector<hsize_t> chunk(rank > 0 ? rank : 0);
    check(rank > 0 && H5Pget_chunk(dcpl, rank, chunk.data()) == rank, path,
          ": unreadable chunk shape");
    H5Id space(H5_CHECK(H5Dget_space(dset), pre_, "reading ", path), H5Sclose);
    std::vector<hsize_t> dims(rank);
    check(H5Sget_simple_extent_dims(space, dims.data(), nullptr) == rank, path,
          ": chunk rank differs from the dataset's");
    hsize_t want = 1;
    for (int d = 0; d < rank; ++d) {
      check(chunk[d] > 0, path, ": chunk of size 0");
      want *= (dims[d] + chunk[d] - 1) / chunk[d];
    }
    hsize_t have = 0;
    H5_CHECK(H5Dget_num_chunks(dset, space, &have), pre_, "reading ", path);
    check(have == want, not_all);
    check(bytes <= (deflate ? kDeflateMaxRatio : 1) * stored, not_all);
  }

  template <class T>
  std::pair<std::vector<int64_t>, std::vector<T>> read(hid_t loc, const std::string& name,
                                                       const std::string& path, const Dtype& want,
                                                       hid_t mem_type, int rank) const {
    H5Id dset = open_object(loc, name, path, H5I_DATASET);
    H5Id type(H5_CHECK(H5Dget_type(dset), pre_, "reading ", path), H5Tclose);
    const bool type_ok = H5Tget_class(type) == want.cls && H5Tget_size(type) == want.size &&
                         (want.cls != H5T_INTEGER || H5Tget_sign(type) == want.sign);
    check(type_ok, path, ": dtype ", dtype_name(type), ", expected ", want.name);
    check(standard_layout(type, want), path, ": a ", want.name,
          " whose bit layout is not the standard one (a damaged type)");
    H5Id space(H5_CHECK(H5Dget_space(dset), pre_, "reading ", path), H5Sclose);
    check(H5Sget_simple_extent_type(space) != H5S_NULL, path, ": empty dataspace");
    const int ndims = H5_CHECK(H5Sget_simple_extent_ndims(space), pre_, "reading ", path);
    check(rank < 0 || ndims == rank, path, ": rank ", ndims, ", expected ", rank);
    std::vector<hsize_t> dims(ndims);
    H5_CHECK(H5Sget_simple_extent_dims(space, dims.data(), nullptr), pre_, "reading ", path);
    const std::vector<int64_t> shape(dims.begin(), dims.end());
    const hssize_t points = H5_CHECK(H5Sget_simple_extent_npoints(space), pre_, "reading ", path);
    check_storage(dset, path, points, want.size);
    std::vector<T> data(static_cast<size_t>(points));
    if (!data.empty()) {
      H5_CHECK(H5Dread(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()), pre_,
               "reading ", path);
    }
    return {shape, std::move(data)};
  }

  // A moment for every parameter of /model, by name, with its shape: compared before any is
  // read.
  NamedArrays read_optimizer_state(hid_t opt, const char* name, const NamedArrays& model) const {
    const std::string group = std::string("/optimizer/") + name;
    H5Id g = open_group(opt, name, group);
    ShapeList params;
    for (const auto& [param, array] : model) params.emplace_back(param, array.shape);
    const std::vector<std::string> names = link_names(g, group);
    ShapeList found;
    for (const std::string& n : names) found.emplace_back(n, shape_of(g, n, group + "/" + n));
    for (const auto& [param, shape] : params) {
      const auto it =
          std::find_if(found.begin(), found.end(), [&](const auto& f) { return f.first == param; });
      check(it != found.end(), "missing dataset ", group, "/", param);
      check(it->second == shape, group, "/", param, ": shape ", shape_str(it->second), ", /model/",
            param, " has ", shape_str(shape));
    }
    check(names.size() == model.size(), group, " has ", names.size(), " datasets, /model has ",
          model.size());
    return read_arrays(g, group, &params);
  }

  AttrValue read_attr(hid_t loc, const std::string& name, const std::string& what) const {
    H5Id attr(H5_CHECK(H5Aopen(loc, name.c_str(), H5P_DEFAULT), pre_, "reading ", what), H5Aclose);
    H5Id type(H5_CHECK(H5Aget_type(attr), pre_, "reading ", what), H5Tclose);
    H5Id space(H5_CHECK(H5Aget_space(attr), pre_, "reading ", what), H5Sclose);
    check(H5Sget_simple_extent_npoints(space) == 1, what, ": expected a single value");
    const H5T_class_t cls = H5Tget_class(type);
    if (cls == H5T_INTEGER) {
      int64_t v = 0;
      H5_CHECK(H5Aread(attr, H5T_NATIVE_INT64, &v), pre_, "reading ", what);
      return v;
    }
    if (cls == H5T_FLOAT) {
      double v = 0;
      H5_CHECK(H5Aread(attr, H5T_NATIVE_DOUBLE, &v), pre_, "reading ", what);
      return v;
    }
    check(cls == H5T_STRING, what, ": unsupported type ", dtype_name(type),
          " (int64, double or string)");
    if (H5_CHECK(H5Tis_variable_str(type), pre_, "reading ", what) > 0) {
      H5Id mem = string_type(H5Tget_cset(type));
      char* p = nullptr;
      H5_CHECK(H5Aread(attr, mem, &p), pre_, "reading ", what);
      std::string s = p ? p : "";
      H5free_memory(p);
      return s;
    }
    // Fixed-length: one more byte than stored, so the terminator never cuts a character.
    check(H5Tget_size(type) <= kMaxStringAttr, what, ": a string of ", H5Tget_size(type), " bytes");
    const size_t size = H5Tget_size(type) + 1;
    H5Id mem(H5_CHECK(H5Tcopy(H5T_C_S1), pre_, "reading ", what), H5Tclose);
    H5_CHECK(H5Tset_size(mem, size), pre_, "reading ", what);
    std::string s(size, '\0');
    H5_CHECK(H5Aread(attr, mem, s.data()), pre_, "reading ", what);
    s.resize(std::strlen(s.c_str()));
    return s;
  }

  AttrValue required_attr(hid_t loc, const std::string& name, const std::string& group) const {
    const std::string what = "attribute '" + name + "' of " + group;
    const htri_t exists = H5_CHECK(H5Aexists(loc, name.c_str()), pre_, "reading ", what);
    check(exists > 0, "missing ", what);
    return read_attr(loc, name, what);
  }

  int64_t int_attr(hid_t loc, const std::string& name, const std::string& group) const {
    const AttrValue v = required_attr(loc, name, group);
    check(std::holds_alternative<int64_t>(v), "attribute '", name, "' of ", group, " is ",
          describe(v), ", expected an integer");
    return std::get<int64_t>(v);
  }

  std::string string_attr(hid_t loc, const std::string& name, const std::string& group) const {
    const AttrValue v = required_attr(loc, name, group);
    check(std::holds_alternative<std::string>(v), "attribute '", name, "' of ", group, " is ",
          describe(v), ", expected a string");
    return std::get<std::string>(v);
  }

  Attrs all_attrs(hid_t loc, const std::string& group) const {
    std::vector<std::string> names;
    H5_CHECK(H5Aiterate2(loc, H5_INDEX_NAME, H5_ITER_INC, nullptr, append_name<H5A_info_t>, &names),
             pre_, "listing attributes of ", group);
    Attrs attrs;
    for (const std::string& name : names) {
      attrs[name] = read_attr(loc, name, "attribute '" + name + "' of " + group);
    }
    return attrs;
  }

  fs::path path_;
  std::string pre_;  // "checkpoint: <path>: "
  const FileImage& image_;
  bool sealed_;
};

}  // namespace

Checkpoint load_from_image(const fs::path& path, const FileImage& image, bool sealed,
                           const LoadOptions& options) {
  return Loader(path, image, sealed).load(options);
}

}  // namespace kvlab::checkpoint_detail

namespace kvlab {

using namespace checkpoint_detail;

void check_model_shapes(const Checkpoint& ckpt, const ShapeList& expected, const fs::path& file) {
  ShapeList found;
  for (const auto& [name, array] : ckpt.model) found.emplace_back(name, array.shape);
  Loader::compare_shapes(found, expected, "/model", "checkpoint: " + file.string() + ": ");
}

}  // namespace kvlab
