#include "checkpoints/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <system_error>

#include "autograd/error.h"
#include "checkpoints/h5.h"

namespace kvlab {
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

namespace fs = std::filesystem;

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// Variable-length UTF-8: h5py reads these attributes as Python str.
H5Id string_type(H5T_cset_t cset = H5T_CSET_UTF8) {
  H5Id type(H5_CHECK(H5Tcopy(H5T_C_S1), "checkpoint: string type"), H5Tclose);
  H5_CHECK(H5Tset_size(type, H5T_VARIABLE), "checkpoint: string type");
  H5_CHECK(H5Tset_cset(type, cset), "checkpoint: string type");
  return type;
}

// ------------------------------------------------------------------------------------------
// Saving

void validate_arrays(const NamedArrays& arrays, const std::string& group, const std::string& pre) {
  std::set<std::string> seen;
  for (const auto& [name, array] : arrays) {
    const std::string path = group + "/" + name;
    KVLAB_CHECK(!name.empty() && name != "." && name.find('/') == std::string::npos, pre,
                "invalid parameter name '", name, "' (no '/', not empty)");
    KVLAB_CHECK(seen.insert(name).second, pre, "duplicate parameter ", path);
    int64_t count = 1;
    for (int64_t d : array.shape) {
      KVLAB_CHECK(d >= 0, pre, path, ": negative size in shape ", shape_str(array.shape));
      count *= d;
    }
    KVLAB_CHECK(count == static_cast<int64_t>(array.data.size()), pre, path, ": shape ",
                shape_str(array.shape), " holds ", count, " elements, data has ",
                array.data.size());
  }
}

void validate_optimizer(const NamedArrays& state, const NamedArrays& model,
                        const std::string& group, const std::string& pre) {
  KVLAB_CHECK(state.size() == model.size(), pre, group, " has ", state.size(),
              " parameters, /model has ", model.size());
  for (size_t i = 0; i < model.size(); ++i) {
    KVLAB_CHECK(state[i].first == model[i].first, pre, group, " parameter ", i, " is '",
                state[i].first, "', /model has '", model[i].first, "'");
    KVLAB_CHECK(state[i].second.shape == model[i].second.shape, pre, group, "/", state[i].first,
                ": shape ", shape_str(state[i].second.shape), ", /model has ",
                shape_str(model[i].second.shape));
  }
}

void validate_for_save(const Checkpoint& ckpt, const std::string& pre) {
  KVLAB_CHECK(!ckpt.tokenizer_kind.empty(), pre, "tokenizer kind is empty");
  validate_arrays(ckpt.model, "/model", pre);
  if (ckpt.has_optimizer) {
    validate_arrays(ckpt.optimizer_m, "/optimizer/m", pre);
    validate_arrays(ckpt.optimizer_v, "/optimizer/v", pre);
    validate_optimizer(ckpt.optimizer_m, ckpt.model, "/optimizer/m", pre);
    validate_optimizer(ckpt.optimizer_v, ckpt.model, "/optimizer/v", pre);
  }
  if (ckpt.has_train_state) {
    for (const char* key : {"iteration", "best_val_loss"}) {
      KVLAB_CHECK(!ckpt.train_extra.count(key), pre, "train_extra may not use the name '", key,
                  "'");
    }
  }
}

H5Id create_group(hid_t loc, const char* name, const std::string& pre) {
  H5Id gcpl(H5_CHECK(H5Pcreate(H5P_GROUP_CREATE), pre, "creating /", name), H5Pclose);
  // Tracked creation order lets the reader return parameters in module order.
  H5_CHECK(H5Pset_link_creation_order(gcpl, H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED), pre,
           "creating ", name);
  return H5Id(
      H5_CHECK(H5Gcreate2(loc, name, H5P_DEFAULT, gcpl, H5P_DEFAULT), pre, "creating ", name),
      H5Gclose);
}

void write_attr(hid_t loc, const std::string& name, const AttrValue& value,
                const std::string& what) {
  H5Id space(H5_CHECK(H5Screate(H5S_SCALAR), what), H5Sclose);
  H5Id str_type;
  hid_t file_type = H5T_STD_I64LE, mem_type = H5T_NATIVE_INT64;
  const void* buf = std::get_if<int64_t>(&value);
  const char* str = nullptr;
  if (const auto* d = std::get_if<double>(&value)) {
    file_type = H5T_IEEE_F64LE;
    mem_type = H5T_NATIVE_DOUBLE;
    buf = d;
  } else if (const auto* s = std::get_if<std::string>(&value)) {
    KVLAB_CHECK(s->find('\0') == std::string::npos, what, ": string contains a NUL byte");
    str_type = string_type();
    file_type = mem_type = str_type;
    str = s->c_str();
    buf = &str;
  }
  H5Id attr(
      H5_CHECK(H5Acreate2(loc, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT), what),
      H5Aclose);
  H5_CHECK(H5Awrite(attr, mem_type, buf), what);
}

void write_attrs(hid_t loc, const Attrs& attrs, const std::string& pre, const std::string& group) {
  for (const auto& [name, value] : attrs) {
    write_attr(loc, name, value, pre + "writing attribute '" + name + "' of " + group);
  }
}

void write_dataset(hid_t loc, const std::string& name, hid_t file_type, hid_t mem_type,
                   const std::vector<int64_t>& shape, const void* data, const std::string& what) {
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  H5Id space(
      H5_CHECK(dims.empty() ? H5Screate(H5S_SCALAR)
                            : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
               what),
      H5Sclose);
  H5Id dset(H5_CHECK(H5Dcreate2(loc, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT,
                                H5P_DEFAULT),
                     what),
            H5Dclose);
  if (H5_CHECK(H5Sget_simple_extent_npoints(space), what) > 0) {
    H5_CHECK(H5Dwrite(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), what);
  }
}

void write_arrays(hid_t loc, const NamedArrays& arrays, const std::string& group,
                  const std::string& pre) {
  for (const auto& [name, array] : arrays) {
    write_dataset(loc, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, array.shape, array.data.data(),
                  pre + "writing " + group + "/" + name);
  }
}

template <class T>
void write_vector(hid_t loc, const char* name, hid_t file_type, hid_t mem_type,
                  const std::vector<T>& v, const std::string& what) {
  write_dataset(loc, name, file_type, mem_type, {static_cast<int64_t>(v.size())}, v.data(), what);
}

size_t bytes_of(const NamedArrays& arrays) {
  size_t n = 0;
  for (const auto& [name, array] : arrays) n += array.data.size() * sizeof(float);
  return n;
}

// Builds the whole file in memory (HDF5's core driver) and returns its bytes. All disk I/O is
// then ours: HDF5 1.10 cannot cleanly close a file whose writes failed (a full disk left the
// process to crash at exit), while a failed write(2) is an ordinary error.
std::vector<char> build_image(const fs::path& name, const Checkpoint& ckpt,
                              const std::string& pre) {
  const size_t estimate = (size_t{1} << 20) + bytes_of(ckpt.model) + bytes_of(ckpt.optimizer_m) +
                          bytes_of(ckpt.optimizer_v) + 4 * ckpt.tokenizer_vocab.size() +
                          8 * ckpt.rng_state.size();
  H5Id fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS), pre, "creating the file"), H5Pclose);
  H5_CHECK(H5Pset_fapl_core(fapl, estimate, /*backing_store=*/0), pre, "creating the file");
  H5Id file(
      H5_CHECK(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), pre, "creating the file"),
      H5Fclose);
  write_attrs(file,
              {{"format", std::string(kCheckpointFormat)}, {"format_version", kCheckpointVersion}},
              pre, "/");
  {
    H5Id config = create_group(file, "config", pre);
    write_attrs(config, ckpt.config, pre, "/config");
  }
  {
    H5Id tok = create_group(file, "tokenizer", pre);
    write_attrs(tok, {{"kind", ckpt.tokenizer_kind}}, pre, "/tokenizer");
    write_vector(tok, "vocab", H5T_STD_U32LE, H5T_NATIVE_UINT32, ckpt.tokenizer_vocab,
                 pre + "writing /tokenizer/vocab");
  }
  {
    H5Id model = create_group(file, "model", pre);
    write_arrays(model, ckpt.model, "/model", pre);
  }
  if (ckpt.has_optimizer) {
    H5Id opt = create_group(file, "optimizer", pre);
    write_attrs(opt, {{"step", ckpt.optimizer_step}}, pre, "/optimizer");
    H5Id m = create_group(opt, "m", pre);
    write_arrays(m, ckpt.optimizer_m, "/optimizer/m", pre);
    H5Id v = create_group(opt, "v", pre);
    write_arrays(v, ckpt.optimizer_v, "/optimizer/v", pre);
  }
  if (ckpt.has_train_state) {
    H5Id train = create_group(file, "train", pre);
    Attrs attrs = ckpt.train_extra;
    attrs["iteration"] = ckpt.iteration;
    attrs["best_val_loss"] = ckpt.best_val_loss;
    write_attrs(train, attrs, pre, "/train");
    write_vector(train, "rng_state", H5T_STD_U64LE, H5T_NATIVE_UINT64, ckpt.rng_state,
                 pre + "writing /train/rng_state");
  }
  H5_CHECK(H5Fflush(file, H5F_SCOPE_GLOBAL), pre, "flushing the file");
  const ssize_t size = H5_CHECK(H5Fget_file_image(file, nullptr, 0), pre, "file image");
  std::vector<char> image(size);
  H5_CHECK(H5Fget_file_image(file, image.data(), image.size()), pre, "file image");
  H5_CHECK(H5Fclose(file.release()), pre, "closing the file");
  return image;
}

// Creates `path` with `bytes`, fsynced.
void write_file(const fs::path& path, const std::vector<char>& bytes, const std::string& pre) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KVLAB_CHECK(fd >= 0, pre, "cannot create ", path.string(), ": ", std::strerror(errno));
  int err = 0;
  for (size_t done = 0; done < bytes.size() && err == 0;) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n >= 0) {
      done += n;
    } else if (errno != EINTR) {
      err = errno;
    }
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  KVLAB_CHECK(err == 0, pre, "writing ", path.string(), ": ", std::strerror(err));
}

// ------------------------------------------------------------------------------------------
// Loading

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
const Dtype kUint32{H5T_INTEGER, 4, H5T_SGN_NONE, "uint32"};
const Dtype kUint64{H5T_INTEGER, 8, H5T_SGN_NONE, "uint64"};

class Loader {
 public:
  explicit Loader(const fs::path& path)
      : path_(path), pre_("checkpoint: " + path.string() + ": ") {}

  Checkpoint load(bool with_training_state) {
    std::error_code ec;
    const fs::file_status st = fs::status(path_, ec);
    check(fs::exists(st), "no such file");
    check(!fs::is_directory(st), "is a directory, not a checkpoint file");
    const htri_t is_hdf5 = H5Fis_hdf5(path_.c_str());
    check(is_hdf5 >= 0, "cannot read: ", h5_error_message());
    check(is_hdf5 > 0, "not an HDF5 file");
    H5Id file(H5_CHECK(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), pre_,
                       "cannot open HDF5 file (truncated or damaged?)"),
              H5Fclose);

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
    {
      H5Id tok = open_group(file, "tokenizer", "/tokenizer");
      ckpt.tokenizer_kind = string_attr(tok, "kind", "/tokenizer");
      ckpt.tokenizer_vocab =
          read<uint32_t>(tok, "vocab", "/tokenizer/vocab", kUint32, H5T_NATIVE_UINT32, 1).second;
    }
    {
      H5Id model = open_group(file, "model", "/model");
      for (const std::string& name : link_names(model, "/model")) {
        auto [shape, data] =
            read<float>(model, name, "/model/" + name, kFloat32, H5T_NATIVE_FLOAT, -1);
        ckpt.model.emplace_back(name, ArrayF32{std::move(shape), std::move(data)});
      }
    }
    if (!with_training_state) return ckpt;

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
    return ckpt;
  }

 private:
  template <class... Args>
  void check(bool ok, const Args&... args) const {
    KVLAB_CHECK(ok, pre_, args...);
  }

  static std::string describe(const AttrValue& v) {
    if (const auto* s = std::get_if<std::string>(&v)) return "\"" + *s + "\"";
    if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
    return detail::cat(std::get<double>(v));
  }

  bool has_link(hid_t loc, const std::string& name, const std::string& path) const {
    return H5_CHECK(H5Lexists(loc, name.c_str(), H5P_DEFAULT), pre_, "looking up ", path) > 0;
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
    std::vector<std::string> names;
    H5_CHECK(H5Literate(
                 group, index, H5_ITER_INC, nullptr,
                 append_name<H5L_info_t>,
                 &names),
             pre_, "listing ", path);
    return names;
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
    H5Id space(H5_CHECK(H5Dget_space(dset), pre_, "reading ", path), H5Sclose);
    check(H5Sget_simple_extent_type(space) != H5S_NULL, path, ": empty dataspace");
    const int ndims = H5_CHECK(H5Sget_simple_extent_ndims(space), pre_, "reading ", path);
    check(rank < 0 || ndims == rank, path, ": rank ", ndims, ", expected ", rank);
    std::vector<hsize_t> dims(ndims);
    H5_CHECK(H5Sget_simple_extent_dims(space, dims.data(), nullptr), pre_, "reading ", path);
    const std::vector<int64_t> shape(dims.begin(), dims.end());
    const hssize_t points = H5_CHECK(H5Sget_simple_extent_npoints(space), pre_, "reading ", path);
    // A chunked dataset can declare far more values than the file stores (the chunks never
    // written read back as the fill value): reading it would allocate all of them.
    H5D_space_status_t stored = H5D_SPACE_STATUS_ERROR;
    H5_CHECK(H5Dget_space_status(dset, &stored), pre_, "reading ", path);
    check(points == 0 || stored == H5D_SPACE_STATUS_ALLOCATED, path, ": declares ", points,
          " values but the file does not store them all (a damaged or unfinished file)");
    std::vector<T> data(static_cast<size_t>(points));
    if (!data.empty()) {
      H5_CHECK(H5Dread(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()), pre_,
               "reading ", path);
    }
    return {shape, std::move(data)};
  }

  NamedArrays read_optimizer_state(hid_t opt, const char* name, const NamedArrays& model) const {
    const std::string group = std::string("/optimizer/") + name;
    H5Id g = open_group(opt, name, group);
    NamedArrays state;
    for (const auto& [param, array] : model) {
      const std::string path = group + "/" + param;
      auto [shape, data] = read<float>(g, param, path, kFloat32, H5T_NATIVE_FLOAT, -1);
      check(shape == array.shape, path, ": shape ", shape_str(shape), ", /model/", param, " has ",
            shape_str(array.shape));
      state.emplace_back(param, ArrayF32{std::move(shape), std::move(data)});
    }
    const std::vector<std::string> names = link_names(g, group);
    check(names.size() == model.size(), group, " has ", names.size(), " datasets, /model has ",
          model.size());
    return state;
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
    H5_CHECK(H5Aiterate2(
                 loc, H5_INDEX_NAME, H5_ITER_INC, nullptr,
                 append_name<H5A_info_t>,
                 &names),
             pre_, "listing attributes of ", group);
    Attrs attrs;
    for (const std::string& name : names) {
      attrs[name] = read_attr(loc, name, "attribute '" + name + "' of " + group);
    }
    return attrs;
  }

  fs::path path_;
  std::string pre_;  // "checkpoint: <path>: "
};

}  // namespace

void save_checkpoint(const fs::path& file, const Checkpoint& ckpt) {
  h5_silence_errors();
  const std::string pre = "checkpoint: " + file.string() + ": ";
  validate_for_save(ckpt, pre);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  KVLAB_CHECK(!ec, pre, "cannot create folder ", dir.string(), ": ", ec.message());

  fs::path tmp = file;
  tmp += ".tmp-" + std::to_string(::getpid());
  try {
    write_file(tmp, build_image(tmp, ckpt, pre), pre);
    fs::rename(tmp, file, ec);
    KVLAB_CHECK(!ec, pre, "cannot rename ", tmp.string(), " to it: ", ec.message());
  } catch (...) {
    fs::remove(tmp, ec);
    throw;
  }
  // Make the rename itself durable; some file systems refuse fsync on a folder, and the new
  // checkpoint is complete either way, so this one is best effort.
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

Checkpoint load_checkpoint(const fs::path& file, bool with_training_state) {
  h5_silence_errors();
  return Loader(file).load(with_training_state);
}

void check_model_shapes(const Checkpoint& ckpt,
                        const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected,
                        const fs::path& file) {
  const std::string pre = "checkpoint: " + file.string() + ": ";
  std::map<std::string, const ArrayF32*> by_name;
  for (const auto& [name, array] : ckpt.model) by_name[name] = &array;
  for (const auto& [name, shape] : expected) {
    const auto it = by_name.find(name);
    KVLAB_CHECK(it != by_name.end(), pre, "missing dataset /model/", name, " (expected shape ",
                shape_str(shape), ")");
    KVLAB_CHECK(it->second->shape == shape, pre, "/model/", name, ": shape ",
                shape_str(it->second->shape), " in the file, the model expects ", shape_str(shape));
    by_name.erase(it);
  }
  KVLAB_CHECK(by_name.empty(), pre, "unexpected dataset /model/", by_name.begin()->first,
              " (not a parameter of this model; ", by_name.size(), " unexpected in all)");
}

}  // namespace kvlab
