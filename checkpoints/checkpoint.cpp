#include "checkpoints/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "platform/error.h"
#include "checkpoints/h5.h"
#include "checkpoints/h5_layout.h"
#include "checkpoints/sealed_image.h"

namespace kvlab::checkpoint_detail {
namespace {

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

// save_checkpoint writes <file> as <file><kTemporarySuffix><pid> first.
constexpr std::string_view kTemporarySuffix = ".tmp-";

}  // namespace

}  // namespace kvlab::checkpoint_detail

namespace kvlab {

using namespace checkpoint_detail;

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
    parse_in_child([&] { load_from_image(file, image, false, options); }, budget, memory, pre);
  return load_from_image(file, image, sealed, options);
}

}  // namespace kvlab
