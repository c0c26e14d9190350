#include "train/output_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "checkpoints/checkpoint.h"
#include "platform/error.h"
#include "train/trainer.h"

namespace kvlab {

namespace fs = std::filesystem;

namespace {

// The pid the holder wrote into the lock file, or "" when there is none (yet).
std::string holder_pid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string pid(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
  return pid;
}

// Writes the holder's pid into the lock file. It only serves a refusal's message: the lock
// holds even if writing it fails.
void write_holder_pid(int fd) {
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) == 0) {
    [[maybe_unused]] const ssize_t n = ::pwrite(fd, pid.data(), pid.size(), 0);
  }
}

}  // namespace

int OutputDirLock::open_and_lock(const fs::path& dir, const std::string& who,
                                 std::string* holder) {
  KVLAB_CHECK(!dir.empty(), who, ": no output folder");
  ensure_writable_dir(dir, who);
  const fs::path file = dir / ".lock";
  // CLOEXEC: a child (rsvg-convert for the report's PNGs) must not keep the lock alive.
  const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  KVLAB_CHECK(fd >= 0, who, ": cannot open the lock file ", file.string(), ": ",
              std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
    write_holder_pid(fd);
    return fd;
  }
  const int err = errno;
  if (err == EWOULDBLOCK) {
    // The holder writes its pid right after taking the lock; two processes started together
    // can look in between.
    for (int i = 0; i < 20 && (*holder = holder_pid(fd)).empty(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::close(fd);
  KVLAB_CHECK(err == EWOULDBLOCK, who, ": cannot lock ", file.string(), ": ", std::strerror(err));
  return -1;
}

OutputDirLock::OutputDirLock(const fs::path& dir, const std::string& who) {
  std::string holder;
  fd_ = open_and_lock(dir, who, &holder);
  KVLAB_CHECK(fd_ >= 0, who, ": output folder ", dir.string(),
              " is in use by another kvlab process (pid ", holder.empty() ? "unknown" : holder,
              "); wait for it to end, or choose another --out");
}

std::unique_ptr<OutputDirLock> OutputDirLock::try_acquire(const fs::path& dir,
                                                          const std::string& who) {
  std::string holder;
  const int fd = open_and_lock(dir, who, &holder);
  return fd >= 0 ? std::unique_ptr<OutputDirLock>(new OutputDirLock(Held{}, fd)) : nullptr;
}

OutputDirLock::~OutputDirLock() { ::close(fd_); }

std::vector<std::string> remove_checkpoint_temporaries(const fs::path& dir) {
  // Every temporary goes, whatever its writer's pid: the caller holds the folder's lock, and
  // every kvlab process that writes checkpoints there holds it while it does, so none of them
  // is being written. (A pid-alive check would also be wrong for a reused pid, or for a writer
  // on another machine of a shared file system.)
  std::vector<std::string> removed;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!is_checkpoint_temporary(name)) continue;
    std::error_code type_ec, remove_ec;
    if (it->is_regular_file(type_ec) && fs::remove(it->path(), remove_ec)) removed.push_back(name);
  }
  return removed;
}

}  // namespace kvlab
