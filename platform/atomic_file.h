#pragma once
// The one way kvlab writes a file that must never be seen half-written (checkpoints, the corpus's
// token cache, results and reports): the bytes go to a temporary file beside the target, which
// is flushed to disk and renamed over it; then the folder is synced so the rename lasts too.
// A reader sees the old file or the new one, never a mix, even across a crash.
#include <filesystem>
#include <string_view>

namespace kvlab {

// The temporary is `path` + kAtomicTemporarySuffix + decimal digits (the writer's process id,
// then random digits, so ranks on several hosts writing one shared folder never collide).
inline constexpr std::string_view kAtomicTemporarySuffix = ".tmp-";

// Writes `bytes` to `path` atomically, in a folder that exists. Throws kvlab::Error whose
// message starts with `context` (e.g. "checkpoint: FILE: ") and names the failing step; the
// temporary is removed on failure and `path` is left as it was.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes,
                       std::string_view context = "");

}  // namespace kvlab
