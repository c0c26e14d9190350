#pragma once
// The sealed image of a checkpoint (internal to checkpoints/): HDF5 leaves a file's user block
// (the bytes before its superblock) to the application. kvlab's holds a text header with the
// CRC-32 and the size of everything after it; the block is exactly the header followed by zero
// bytes. CRC-32 catches every error confined to 32 consecutive bits, so any one damaged byte, by
// construction. A load reads the file into memory once, checks the digest, and has HDF5 parse
// those bytes, in a forked child first when the file carries no digest.
#include <hdf5.h>
#include <sys/resource.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kvlab::checkpoint_detail {

namespace fs = std::filesystem;

// The user block's size: the digest's text header, then zero bytes.
constexpr size_t kUserBlock = 512;

// Writes the digest of image[kUserBlock, end) into its user block.
void seal(std::vector<char>& image);

// A file's bytes, read once: the digest is checked, and HDF5 parses, exactly these.
struct FileImage {
  std::unique_ptr<char[]> bytes;  // not zeroed first: every byte is read into
  size_t size = 0;
  uint32_t crc = 0;  // CRC-32 of bytes [kUserBlock, size), computed chunk by chunk as read
  const char* data() const { return bytes.get(); }
};

// Reads the regular file at `path` into memory, summing its CRC-32 as it goes.
FileImage read_image(const fs::path& path, const std::string& pre);
// Whether `image` carries kvlab's digest; throws when it carries one that does not match.
bool verify_seal(const FileImage& image, const std::string& pre);
// Opens `image` read-only in place through HDF5's core (memory) driver.
hid_t open_image(const FileImage& image);
// Runs `parse` in a forked child, within `cpu_seconds` of CPU time and `memory_bytes` more
// address space; rethrows its error, or says that it crashed or looped.
void parse_in_child(const std::function<void()>& parse, rlim_t cpu_seconds, rlim_t memory_bytes,
                    const std::string& pre);

}  // namespace kvlab::checkpoint_detail
