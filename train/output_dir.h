#pragma once
// One writer per output folder: `kvlab train --out DIR` and `kvlab ablate --out DIR` hold their
// folder for the whole run, so a second process started on it refuses at once instead of
// interleaving its log and checkpoints with the first's.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace kvlab {

// An exclusive, non-blocking flock on <dir>/.lock, held while the object lives; the file holds
// the holder's pid so that a refused process can name it. The kernel drops the lock when the
// process ends, however it ends, so a killed run never leaves a stale one. The file itself
// stays: removing it would let one process lock the old file while another locks a new one.
class OutputDirLock {
 public:
  // Creates `dir` if needed (ensure_writable_dir). Throws kvlab::Error naming the folder and
  // the holder's pid when another process holds it; `who` ("train", "ablate") starts messages.
  OutputDirLock(const std::filesystem::path& dir, const std::string& who);
  // The lock if no other process holds it, else nullptr (a sweep's ranks claiming runs).
  static std::unique_ptr<OutputDirLock> try_acquire(const std::filesystem::path& dir,
                                                    const std::string& who);
  ~OutputDirLock();
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;

 private:
  struct Held {};  // try_acquire's: fd_ already holds the lock
  OutputDirLock(Held, int fd) : fd_(fd) {}
  // Opens dir's lock file and takes the lock without waiting: the fd, or -1 when another
  // process holds it, *holder then the pid it wrote ("" if none).
  static int open_and_lock(const std::filesystem::path& dir, const std::string& who,
                           std::string* holder);
  int fd_ = -1;
};

// Removes the checkpoint temporaries (<name>.h5.tmp-<digits>, checkpoints/checkpoint.h) that a
// process killed while saving left in `dir`, and returns their names. Call it only while
// holding dir's OutputDirLock.
std::vector<std::string> remove_checkpoint_temporaries(const std::filesystem::path& dir);

}  // namespace kvlab
