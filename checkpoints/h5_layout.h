#pragma once
// The HDF5 layout of a checkpoint (internal to checkpoints/; docs/checkpoint-format.md has it):
// h5_write.cpp builds a sealed file image of groups, datasets and attributes from a Checkpoint,
// h5_read.cpp reads one back, checking every link, layout and size before an array is allocated.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "checkpoints/h5.h"
#include "checkpoints/sealed_image.h"

namespace kvlab::checkpoint_detail {

// "(4, 8)"
std::string shape_str(const std::vector<int64_t>& shape);
// A variable-length string type (UTF-8 unless told).
H5Id string_type(H5T_cset_t cset = H5T_CSET_UTF8);

// Throws for a checkpoint that cannot be written as it stands: a bad name or shape, optimizer
// moments that do not match the model, a reserved train_extra key.
void validate_for_save(const Checkpoint& ckpt, const std::string& pre);
// The whole file, sealed, as bytes; `name` only names it for HDF5.
std::vector<char> build_image(const fs::path& name, const Checkpoint& ckpt, const std::string& pre);

// Reads and checks the checkpoint `image` holds; `sealed` says that its digest was kvlab's and
// matched.
Checkpoint load_from_image(const fs::path& path, const FileImage& image, bool sealed,
                           const LoadOptions& options);

}  // namespace kvlab::checkpoint_detail
