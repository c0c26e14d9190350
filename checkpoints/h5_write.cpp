// Writing a checkpoint's HDF5 layout: the input checked, then groups, attributes and datasets
// built in memory and returned as one sealed file image.
#include <set>
#include <variant>

#include "checkpoints/h5_layout.h"
#include "platform/error.h"

namespace kvlab::checkpoint_detail {
namespace {

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

// bos, eos, add_bos, add_eos, eog_ids and user_defined_ids where the tokenizer has any (most have none: then nothing).
void write_token_controls(hid_t tok, const Checkpoint& ckpt, const std::string& pre) {
  if (ckpt.tokenizer_bos < 0 && ckpt.tokenizer_eos < 0 && ckpt.tokenizer_add_bos == 0 &&
      ckpt.tokenizer_add_eos == 0 && ckpt.tokenizer_eog.empty() &&
      ckpt.tokenizer_user_defined.empty())
    return;
  if (!ckpt.tokenizer_user_defined.empty())
    write_vector(tok, "user_defined_ids", H5T_STD_U32LE, H5T_NATIVE_UINT32,
                 ckpt.tokenizer_user_defined, pre + "writing /tokenizer/user_defined_ids");
  if (ckpt.tokenizer_add_eos != 0)  // only where set: files before it have no such attribute
    write_attrs(tok, {{"add_eos", ckpt.tokenizer_add_eos}}, pre, "/tokenizer");
  write_attrs(tok,
              {{"bos", ckpt.tokenizer_bos},
               {"eos", ckpt.tokenizer_eos},
               {"add_bos", ckpt.tokenizer_add_bos}},
              pre, "/tokenizer");
  write_vector(tok, "eog_ids", H5T_STD_U32LE, H5T_NATIVE_UINT32, ckpt.tokenizer_eog,
               pre + "writing /tokenizer/eog_ids");
}

void write_token_texts(hid_t tok, const std::vector<uint8_t>& bytes,
                       const std::vector<uint64_t>& offsets, const std::string& pre) {
  write_vector(tok, "token_bytes", H5T_STD_U8LE, H5T_NATIVE_UINT8, bytes,
               pre + "writing /tokenizer/token_bytes");
  write_vector(tok, "token_offsets", H5T_STD_U64LE, H5T_NATIVE_UINT64, offsets,
               pre + "writing /tokenizer/token_offsets");
}

// Kind bpe: the pattern as an attribute and BpeArrays' four datasets; spm: SpmArrays' four and
// its attribute; the others: /vocab.
void write_tokenizer(hid_t file, const Checkpoint& ckpt, const std::string& pre) {
  H5Id tok = create_group(file, "tokenizer", pre);
  write_token_controls(tok, ckpt, pre);
  if (!ckpt.tokenizer_chat_template.empty())  // a dataset: a template may pass HDF5's 64 KiB for
                                              // an attribute
    write_vector(tok, "chat_template", H5T_STD_U8LE, H5T_NATIVE_UINT8,
                 std::vector<uint8_t>(ckpt.tokenizer_chat_template.begin(),
                                      ckpt.tokenizer_chat_template.end()),
                 pre + "writing /tokenizer/chat_template");
  if (ckpt.tokenizer_kind == "spm") {
    const SpmArrays& spm = ckpt.tokenizer_spm;
    write_attrs(tok, {{"kind", ckpt.tokenizer_kind}, {"add_space_prefix", spm.add_space_prefix}},
                pre, "/tokenizer");
    write_token_texts(tok, spm.token_bytes, spm.token_offsets, pre);
    write_vector(tok, "scores", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, spm.scores,
                 pre + "writing /tokenizer/scores");
    write_vector(tok, "token_types", H5T_STD_U8LE, H5T_NATIVE_UINT8, spm.token_types,
                 pre + "writing /tokenizer/token_types");
    return;
  }
  if (ckpt.tokenizer_kind != "bpe") {
    write_attrs(tok, {{"kind", ckpt.tokenizer_kind}}, pre, "/tokenizer");
    write_vector(tok, "vocab", H5T_STD_U32LE, H5T_NATIVE_UINT32, ckpt.tokenizer_vocab,
                 pre + "writing /tokenizer/vocab");
    return;
  }
  const BpeArrays& bpe = ckpt.tokenizer_bpe;
  write_attrs(tok, {{"kind", ckpt.tokenizer_kind}, {"pattern", bpe.pattern}}, pre, "/tokenizer");
  write_dataset(tok, "merges", H5T_STD_U32LE, H5T_NATIVE_UINT32,
                {static_cast<int64_t>(bpe.merges.size() / 2), 2}, bpe.merges.data(),
                pre + "writing /tokenizer/merges");
  write_token_texts(tok, bpe.token_bytes, bpe.token_offsets, pre);
  write_vector(tok, "special_ids", H5T_STD_U32LE, H5T_NATIVE_UINT32, bpe.special_ids,
               pre + "writing /tokenizer/special_ids");
}

size_t bytes_of(const NamedArrays& arrays) {
  size_t n = 0;
  for (const auto& [name, array] : arrays) n += array.data.size() * sizeof(float);
  return n;
}

}  // namespace

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// Variable-length UTF-8: h5py reads these attributes as Python str.
H5Id string_type(H5T_cset_t cset) {
  H5Id type(H5_CHECK(H5Tcopy(H5T_C_S1), "checkpoint: string type"), H5Tclose);
  H5_CHECK(H5Tset_size(type, H5T_VARIABLE), "checkpoint: string type");
  H5_CHECK(H5Tset_cset(type, cset), "checkpoint: string type");
  return type;
}

void validate_for_save(const Checkpoint& ckpt, const std::string& pre) {
  KVLAB_CHECK(!ckpt.tokenizer_kind.empty(), pre, "tokenizer kind is empty");
  if (ckpt.tokenizer_kind == "bpe") {
    const BpeArrays& bpe = ckpt.tokenizer_bpe;
    KVLAB_CHECK(bpe.merges.size() % 2 == 0, pre, "bpe merges hold ", bpe.merges.size(),
                " ids, not pairs");
    KVLAB_CHECK(!bpe.token_offsets.empty() && bpe.token_offsets.back() == bpe.token_bytes.size(),
                pre, "bpe token offsets do not end at the ", bpe.token_bytes.size(), " token bytes");
  }
  if (ckpt.tokenizer_kind == "spm") {
    const SpmArrays& spm = ckpt.tokenizer_spm;
    KVLAB_CHECK(!spm.token_offsets.empty() && spm.token_offsets.back() == spm.token_bytes.size() &&
                    spm.scores.size() + 1 == spm.token_offsets.size() &&
                    spm.token_types.size() == spm.scores.size(),
                pre, "spm pieces, scores and types do not agree in length");
  }
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

// Builds the whole file in memory (HDF5's core driver) and returns its bytes. All disk I/O is
// then ours: HDF5 1.10 cannot cleanly close a file whose writes failed (a full disk left the
// process to crash at exit), while a failed write(2) is an ordinary error.
std::vector<char> build_image(const fs::path& name, const Checkpoint& ckpt,
                              const std::string& pre) {
  const size_t estimate = (size_t{1} << 20) + bytes_of(ckpt.model) + bytes_of(ckpt.optimizer_m) +
                          bytes_of(ckpt.optimizer_v) + 4 * ckpt.tokenizer_vocab.size() +
                          4 * ckpt.tokenizer_bpe.merges.size() +
                          9 * ckpt.tokenizer_bpe.token_bytes.size() +
                          9 * ckpt.tokenizer_spm.token_bytes.size() +
                          8 * ckpt.rng_state.size();
  H5Id fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS), pre, "creating the file"), H5Pclose);
  H5_CHECK(H5Pset_fapl_core(fapl, estimate, /*backing_store=*/0), pre, "creating the file");
  H5Id fcpl(H5_CHECK(H5Pcreate(H5P_FILE_CREATE), pre, "creating the file"), H5Pclose);
  H5_CHECK(H5Pset_userblock(fcpl, kUserBlock), pre, "creating the file");  // for the digest
  H5Id file(H5_CHECK(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, fcpl, fapl), pre, "creating the file"),
            H5Fclose);
  write_attrs(file,
              {{"format", std::string(kCheckpointFormat)}, {"format_version", kCheckpointVersion}},
              pre, "/");
  {
    H5Id config = create_group(file, "config", pre);
    write_attrs(config, ckpt.config, pre, "/config");
  }
  write_tokenizer(file, ckpt, pre);
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
  // The image starts at the superblock; the user block kept free for the digest goes before it.
  std::vector<char> image(kUserBlock + size);
  H5_CHECK(H5Fget_file_image(file, image.data() + kUserBlock, size), pre, "file image");
  H5_CHECK(H5Fclose(file.release()), pre, "closing the file");
  seal(image);
  return image;
}

}  // namespace kvlab::checkpoint_detail
