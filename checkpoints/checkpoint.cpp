#include "checkpoints/checkpoint.h"

#include <system_error>

#include "checkpoints/h5.h"
#include "checkpoints/h5_layout.h"
#include "checkpoints/sealed_image.h"
#include "platform/atomic_file.h"
#include "platform/error.h"

namespace kvlab {

using namespace checkpoint_detail;

bool is_checkpoint_temporary(const std::string& filename) {
  const std::string marker = ".h5" + std::string(kAtomicTemporarySuffix);
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

  const std::vector<char> image = build_image(file, ckpt, pre);
  write_file_atomic(file, std::string_view(image.data(), image.size()), pre);
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
