#include "platform/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <string>

#include "platform/error.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

fs::path temporary_beside(const fs::path& path) {
  std::random_device rd;
  fs::path tmp = path;
  tmp += detail::cat(kAtomicTemporarySuffix, ::getpid(), rd() % 100000000u);
  return tmp;
}

// Creates `path` with `bytes` and syncs it to disk; an errno, or 0.
int write_synced(const fs::path& path, std::string_view bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return errno;
  int err = 0;
  for (size_t done = 0; done < bytes.size() && err == 0;) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n >= 0) {
      done += static_cast<size_t>(n);
    } else if (errno != EINTR) {
      err = errno;
    }
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  return err;
}

// Best effort: some file systems refuse fsync on a folder, and the new file is complete either
// way; only the rename's durability across a crash depends on it.
void sync_folder(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_file_atomic(const fs::path& path, std::string_view bytes, std::string_view context) {
  std::error_code ec;
  const fs::path tmp = temporary_beside(path);
  if (const int err = write_synced(tmp, bytes); err != 0) {
    fs::remove(tmp, ec);
    KVLAB_CHECK(false, context, "cannot write ", tmp.string(), ": ", std::strerror(err));
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    KVLAB_CHECK(false, context, "cannot rename ", tmp.string(), " to ", path.string(), ": ",
                ec.message());
  }
  sync_folder(path.has_parent_path() ? path.parent_path() : fs::path("."));
}

}  // namespace kvlab
