#include "checkpoints/checkpoint.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <system_error>

#include "platform/error.h"
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

// ------------------------------------------------------------------------------------------
// The digest: HDF5 leaves a file's user block (the bytes before its superblock) to the
// application. kvlab's holds a text header with the CRC-32 and the size of everything after
// it; the block is exactly the header followed by zero bytes. CRC-32 catches every error
// confined to 32 consecutive bits, so any one damaged byte, by construction.

constexpr size_t kUserBlock = 512;
constexpr char kDigestMagic[] = "kvlab-checkpoint-digest 1\n";

// CRC-32 of n bytes at p, continuing the CRC of the bytes before them (0 for none).
uint32_t crc32_of(const char* p, size_t n, uint32_t before = 0) {
  return static_cast<uint32_t>(crc32_z(before, reinterpret_cast<const Bytef*>(p), n));
}

std::string digest_block(uint32_t crc, uint64_t size) {
  char text[128];
  const int len = std::snprintf(text, sizeof text, "%scrc32 %08x\nsize %llu\n", kDigestMagic,
                                crc, static_cast<unsigned long long>(size));
  std::string block(kUserBlock, '\0');
  block.replace(0, static_cast<size_t>(len), text, static_cast<size_t>(len));
  return block;
}

// Writes the digest of image[kUserBlock, end) into its user block.
void seal(std::vector<char>& image) {
  KVLAB_ASSERT(image.size() > kUserBlock);
  const std::string block = digest_block(
      crc32_of(image.data() + kUserBlock, image.size() - kUserBlock), image.size());
  std::memcpy(image.data(), block.data(), kUserBlock);
}

// A file's bytes, read once: the digest is checked, and HDF5 parses, exactly these.
struct FileImage {
  std::unique_ptr<char[]> bytes;  // not zeroed first: every byte is read into
  size_t size = 0;
  uint32_t crc = 0;  // CRC-32 of bytes [kUserBlock, size), computed chunk by chunk as read
  const char* data() const { return bytes.get(); }
};

// The core driver's file-image callbacks, so that HDF5 parses a FileImage in place: every
// "allocation" of the image is the image itself and every copy of it onto itself is nothing.
// Sound because the file is opened read-only, so the driver never writes to or grows it, and
// the image outlives the file.
void* image_in_place(size_t size, H5FD_file_image_op_t, void* udata) {
  const auto* image = static_cast<const FileImage*>(udata);
  return size == image->size ? const_cast<char*>(image->data()) : nullptr;
}
void* copy_in_place(void* dst, const void* src, size_t, H5FD_file_image_op_t, void*) {
  return dst == src ? dst : nullptr;
}
herr_t free_in_place(void*, H5FD_file_image_op_t, void*) { return 0; }
void* share_udata(void* udata) { return udata; }  // property lists copied share the image
herr_t keep_udata(void*) { return 0; }

// Opens `image` read-only through HDF5's core (memory) driver.
hid_t open_image(const FileImage& image) {
  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5FD_file_image_callbacks_t callbacks = {image_in_place, copy_in_place, nullptr,
                                           free_in_place,  share_udata,   keep_udata,
                                           const_cast<FileImage*>(&image)};
  if (fapl < 0 || H5Pset_fapl_core(fapl, 1 << 20, /*backing_store=*/0) < 0 ||
      H5Pset_file_image_callbacks(fapl, &callbacks) < 0 ||
      H5Pset_file_image(fapl, const_cast<char*>(image.data()), image.size) < 0)
    return H5I_INVALID_HID;
  return H5Fopen("checkpoint", H5F_ACC_RDONLY, fapl);
}

// True for a file that carries kvlab's digest and matches it; false for a file without one.
// Throws for a file whose digest does not match: damaged after kvlab wrote it.
bool verify_seal(const FileImage& image, const std::string& pre) {
  const size_t magic = sizeof kDigestMagic - 1;
  if (image.size < magic || std::memcmp(image.data(), kDigestMagic, magic) != 0) return false;
  const bool ok = image.size > kUserBlock &&
                  std::memcmp(image.data(), digest_block(image.crc, image.size).data(),
                              kUserBlock) == 0;
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08x", image.crc);
  KVLAB_CHECK(ok, pre, "damaged: its bytes no longer match the digest kvlab saved with them (",
              image.size, " bytes, CRC-32 ", crc,
              " now); the file was changed or corrupted after it was written");
  return true;
}

// Anything but a regular file (a FIFO, a device) is refused before it is read from.
FileImage read_image(const fs::path& path, const std::string& pre) {
  struct stat st {};
  KVLAB_CHECK(::stat(path.c_str(), &st) == 0, pre,
              errno == ENOENT ? "no such file" : detail::cat("cannot read: ", std::strerror(errno)));
  KVLAB_CHECK(!S_ISDIR(st.st_mode), pre, "is a directory, not a checkpoint file");
  KVLAB_CHECK(S_ISREG(st.st_mode), pre, "not a regular file (a FIFO, socket or device?)");
  // O_NONBLOCK: should the path become a FIFO after the stat, the open does not wait for it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  KVLAB_CHECK(fd >= 0, pre, "cannot open: ", std::strerror(errno));
  FileImage image;
  int err = 0;
  if (::fstat(fd, &st) != 0) {
    err = errno;
  } else if (!S_ISREG(st.st_mode)) {
    err = EINVAL;
  } else {
    const auto size = static_cast<size_t>(st.st_size);
    image.bytes.reset(new char[size]);
    constexpr size_t kChunk = size_t{1} << 20;  // summed while still in cache
    while (image.size < size && err == 0) {
      const ssize_t n =
          ::read(fd, image.bytes.get() + image.size, std::min(kChunk, size - image.size));
      if (n > 0) {
        const size_t from = std::max(image.size, kUserBlock);
        image.size += static_cast<size_t>(n);
        if (image.size > from)
          image.crc = crc32_of(image.data() + from, image.size - from, image.crc);
      } else if (n == 0) {
        break;  // shrank while read: what is there is parsed (and will not verify)
      } else if (errno != EINTR) {
        err = errno;
      }
    }
  }
  ::close(fd);
  KVLAB_CHECK(err == 0, pre, "cannot read: ", std::strerror(err));
  return image;
}

// Runs `parse` in a forked child and returns normally when it returned normally. A kvlab::Error
// it threw is rethrown here with its message; a child that died (HDF5 does not promise to
// survive a corrupt file, and loops forever on some) becomes an error that says so. The child
// only parses: it writes nothing but its message and leaves by _exit. `cpu_seconds` bounds its
// CPU time, and `memory_bytes` how far its address space may grow: damaged metadata can make
// HDF5 allocate far past what the file holds (gigabytes for a 45 KB file), which then fails
// inside the child instead of taking the machine's memory.
void parse_in_child(const std::function<void()>& parse, rlim_t cpu_seconds, rlim_t memory_bytes,
                    const std::string& pre) {
  int fds[2];
  KVLAB_CHECK(::pipe2(fds, O_CLOEXEC) == 0, pre, "cannot create a pipe: ", std::strerror(errno));
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    // What a crashing library prints on its way down (glibc's "double free or corruption", a
    // sanitizer's report) is not for the user: the parent says what happened.
    const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null >= 0) ::dup2(null, STDERR_FILENO);
    const rlimit cpu{cpu_seconds, cpu_seconds + 5};  // SIGXCPU, then SIGKILL
    ::setrlimit(RLIMIT_CPU, &cpu);
    // From the address space mapped now (a sanitizer's shadow included), not from zero.
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    if (pages > 0) {
      const rlim_t limit = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) +
                           memory_bytes;
      const rlimit as{limit, limit};
      ::setrlimit(RLIMIT_AS, &as);
    }
    int code = 0;
    std::string msg;
    try {
      parse();
    } catch (const std::exception& e) {
      msg = e.what();
      code = 1;
    } catch (...) {
      code = 1;
    }
    for (size_t done = 0; done < msg.size();) {
      const ssize_t n = ::write(fds[1], msg.data() + done, msg.size() - done);
      if (n <= 0 && errno != EINTR) break;
      if (n > 0) done += static_cast<size_t>(n);
    }
    ::_exit(code);
  }
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    KVLAB_CHECK(false, pre, "cannot start the process that checks the file: ",
                std::strerror(errno));
  }
  std::string msg;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      msg.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  const bool looped = WIFSIGNALED(status) &&
                     (WTERMSIG(status) == SIGXCPU || WTERMSIG(status) == SIGKILL);
  KVLAB_CHECK(!looped, pre, "the HDF5 library did not finish reading it in ", cpu_seconds,
              " s of CPU time (it loops on some damaged files): the file is damaged, or is not "
              "a checkpoint HDF5 can read");
  KVLAB_CHECK(!WIFSIGNALED(status), pre, "the HDF5 library crashed reading it (",
              strsignal(WTERMSIG(status)),
              "): the file is damaged, or is not a checkpoint HDF5 can read");
  // A sanitizer ends a crashing child by exit(1) rather than by the signal.
  KVLAB_CHECK(!msg.empty(), pre, "the HDF5 library failed reading it (the checking process "
              "exited with status ", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
              "): the file is damaged, or is not a checkpoint HDF5 can read");
  throw Error(msg);
}

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
  H5Id fcpl(H5_CHECK(H5Pcreate(H5P_FILE_CREATE), pre, "creating the file"), H5Pclose);
  H5_CHECK(H5Pset_userblock(fcpl, kUserBlock), pre, "creating the file");  // for the digest
  H5Id file(
      H5_CHECK(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, fcpl, fapl), pre, "creating the file"),
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
  // The image starts at the superblock; the user block kept free for the digest goes before it.
  std::vector<char> image(kUserBlock + size);
  H5_CHECK(H5Fget_file_image(file, image.data() + kUserBlock, size), pre, "file image");
  H5_CHECK(H5Fclose(file.release()), pre, "closing the file");
  seal(image);
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

// Whether a type of `want`'s class and size is its standard layout (IEEE binary32, or an
// unsigned integer of all its bits) in either byte order. A damaged type message can keep the
// class and size and change the precision, the bit offsets or the exponent's bias: the values
// would then convert into others, silently.
bool standard_layout(hid_t type, const Dtype& want) {
  const bool f = want.cls == H5T_FLOAT;
  const hid_t le = f ? H5T_IEEE_F32LE : want.size == 4 ? H5T_STD_U32LE : H5T_STD_U64LE;
  const hid_t be = f ? H5T_IEEE_F32BE : want.size == 4 ? H5T_STD_U32BE : H5T_STD_U64BE;
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
      : path_(path), pre_("checkpoint: " + path.string() + ": "), image_(image),
        sealed_(sealed) {}

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
    {
      H5Id tok = open_group(file, "tokenizer", "/tokenizer");
      ckpt.tokenizer_kind = string_attr(tok, "kind", "/tokenizer");
      ckpt.tokenizer_vocab =
          read<uint32_t>(tok, "vocab", "/tokenizer/vocab", kUint32, H5T_NATIVE_UINT32, 1).second;
    }
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
    H5_CHECK(H5Literate(group, index, H5_ITER_INC, nullptr, append_link, &links), pre_,
             "listing ", path);
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
  std::vector<int64_t> shape_of(hid_t loc, const std::string& name,
                                const std::string& path) const {
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
        auto [s, data] = read<float>(group, name, path + "/" + name, kFloat32, H5T_NATIVE_FLOAT, -1);
        arrays.emplace_back(name, ArrayF32{std::move(s), std::move(data)});
      }
      return arrays;
    }
    for (const std::string& name : names) {
      auto [shape, data] = read<float>(group, name, path + "/" + name, kFloat32, H5T_NATIVE_FLOAT, -1);
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
      KVLAB_CHECK(*it->second == shape, pre, group, "/", name, ": shape ",
                  shape_str(*it->second), " in the file, the model expects ", shape_str(shape));
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
      const H5Z_filter_t id =
          H5Pget_filter2(dcpl, static_cast<unsigned>(i), &flags, &nvalues, nullptr, sizeof name,
                         name, &config);
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
      const auto it = std::find_if(found.begin(), found.end(),
                                   [&](const auto& f) { return f.first == param; });
      check(it != found.end(), "missing dataset ", group, "/", param);
      check(it->second == shape, group, "/", param, ": shape ", shape_str(it->second),
            ", /model/", param, " has ", shape_str(shape));
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
    check(H5Tget_size(type) <= kMaxStringAttr, what, ": a string of ", H5Tget_size(type),
          " bytes");
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
    H5_CHECK(H5Aiterate2(loc, H5_INDEX_NAME, H5_ITER_INC, nullptr, append_name<H5A_info_t>,
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
  const FileImage& image_;
  bool sealed_;
};

// save_checkpoint writes <file> as <file><kTemporarySuffix><pid> first.
constexpr std::string_view kTemporarySuffix = ".tmp-";

}  // namespace

bool is_checkpoint_temporary(const std::string& filename) {
  const std::string marker = ".h5" + std::string(kTemporarySuffix);
  const size_t at = filename.find(marker);
  if (at == std::string::npos || at == 0) return false;
  const std::string pid = filename.substr(at + marker.size());
  return !pid.empty() && pid.find_first_not_of("0123456789") == std::string::npos;
}

void save_checkpoint(const fs::path& file, const Checkpoint& ckpt) {
  h5_silence_errors();
  const std::string pre = "checkpoint: " + file.string() + ": ";
  validate_for_save(ckpt, pre);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  KVLAB_CHECK(!ec, pre, "cannot create folder ", dir.string(), ": ", ec.message());

  fs::path tmp = file;
  tmp += std::string(kTemporarySuffix) + std::to_string(::getpid());
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

Checkpoint load_checkpoint(const fs::path& file, const LoadOptions& options) {
  h5_silence_errors();
  const std::string pre = "checkpoint: " + file.string() + ": ";
  const FileImage image = read_image(file, pre);
  const bool sealed = verify_seal(image, pre);
  // The child's CPU budget: parsing reads well over 50 MB a second, even under a sanitizer. Its
  // memory: the arrays it reads (at most the file's size) twice over, and 32 MiB for HDF5's own
  // (a whole checkpoint load of a small model takes about 12 MB, a sanitizer's included).
  const rlim_t budget = 5 + image.size / (50 << 20);
  const rlim_t memory = 2 * static_cast<rlim_t>(image.size) + (rlim_t{32} << 20);
  if (!sealed)
    parse_in_child([&] { Loader(file, image, false).load(options); }, budget, memory, pre);
  return Loader(file, image, sealed).load(options);
}

void check_model_shapes(const Checkpoint& ckpt, const ShapeList& expected, const fs::path& file) {
  ShapeList found;
  for (const auto& [name, array] : ckpt.model) found.emplace_back(name, array.shape);
  Loader::compare_shapes(found, expected, "/model", "checkpoint: " + file.string() + ": ");
}

}  // namespace kvlab
