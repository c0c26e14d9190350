#include "checkpoints/sealed_image.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>

#include "checkpoints/h5.h"
#include "platform/error.h"

namespace kvlab::checkpoint_detail {
namespace {

constexpr char kDigestMagic[] = "kvlab-checkpoint-digest 1\n";

// CRC-32 of n bytes at p, continuing the CRC of the bytes before them (0 for none).
uint32_t crc32_of(const char* p, size_t n, uint32_t before = 0) {
  return static_cast<uint32_t>(crc32_z(before, reinterpret_cast<const Bytef*>(p), n));
}

std::string digest_block(uint32_t crc, uint64_t size) {
  char text[128];
  const int len = std::snprintf(text, sizeof text, "%scrc32 %08x\nsize %llu\n", kDigestMagic, crc,
                                static_cast<unsigned long long>(size));
  std::string block(kUserBlock, '\0');
  block.replace(0, static_cast<size_t>(len), text, static_cast<size_t>(len));
  return block;
}

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

}  // namespace

// Writes the digest of image[kUserBlock, end) into its user block.
void seal(std::vector<char>& image) {
  KVLAB_ASSERT(image.size() > kUserBlock);
  const std::string block =
      digest_block(crc32_of(image.data() + kUserBlock, image.size() - kUserBlock), image.size());
  std::memcpy(image.data(), block.data(), kUserBlock);
}

// Opens `image` read-only through HDF5's core (memory) driver.
hid_t open_image(const FileImage& image) {
  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5FD_file_image_callbacks_t callbacks = {image_in_place,
                                           copy_in_place,
                                           nullptr,
                                           free_in_place,
                                           share_udata,
                                           keep_udata,
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
  const bool ok =
      image.size > kUserBlock &&
      std::memcmp(image.data(), digest_block(image.crc, image.size).data(), kUserBlock) == 0;
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
  KVLAB_CHECK(
      ::stat(path.c_str(), &st) == 0, pre,
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
      const rlim_t limit =
          static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + memory_bytes;
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
    KVLAB_CHECK(false, pre,
                "cannot start the process that checks the file: ", std::strerror(errno));
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
  const bool looped =
      WIFSIGNALED(status) && (WTERMSIG(status) == SIGXCPU || WTERMSIG(status) == SIGKILL);
  KVLAB_CHECK(!looped, pre, "the HDF5 library did not finish reading it in ", cpu_seconds,
              " s of CPU time (it loops on some damaged files): the file is damaged, or is not "
              "a checkpoint HDF5 can read");
  KVLAB_CHECK(!WIFSIGNALED(status), pre, "the HDF5 library crashed reading it (",
              strsignal(WTERMSIG(status)),
              "): the file is damaged, or is not a checkpoint HDF5 can read");
  // A sanitizer ends a crashing child by exit(1) rather than by the signal.
  KVLAB_CHECK(!msg.empty(), pre,
              "the HDF5 library failed reading it (the checking process "
              "exited with status ",
              WIFEXITED(status) ? WEXITSTATUS(status) : -1,
              "): the file is damaged, or is not a checkpoint HDF5 can read");
  throw Error(msg);
}

}  // namespace kvlab::checkpoint_detail
