//===- cli/safe_files.h - Files frag reads and writes, safely --*- C++ -*-===//
//
// What frag reads must be a regular file: a FIFO or a device would block
// forever on open or read. What frag writes goes to a temporary beside the
// target (X.tmp.<pid>) and is renamed into place; the temporary is removed on
// failure, on SIGINT/SIGTERM/SIGHUP (with the outputs already renamed into
// place: a killed command leaves nothing), and by a later run once its process
// is gone (after a SIGKILL). A target that is a symbolic link, a device node or
// one of the inputs is refused unless forced.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace frag::cli {

/// Fails unless `path` names a regular file (symbolic links followed), without
/// opening it. `what` says what the file is for ("the model file", "the plan").
void require_regular_file(const std::string& path, const std::string& what);

/// Where and how an output is written.
struct OutputTarget {
  std::string path;     ///< the file written (a symbolic link resolved, with force)
  bool direct = false;  ///< a device node (with force): written in place, no temporary or rename
};

/// Checks an output path before any work: refuses a symbolic link, a device
/// node, a FIFO or socket, a folder, or a file that is one of `inputs`, unless
/// `force` (then a link is followed, a device written in place, an input
/// replaced; a folder is always refused). `option` names the flag ("-o", "--out").
OutputTarget check_output_target(const std::string& path, const std::vector<std::string>& inputs, bool force,
                                 const std::string& option);

/// Fails if two of `files` are the same file (by device and inode, so through
/// links and different spellings too). `what` names them ("rank files").
void require_distinct_files(const std::vector<std::string>& files, const std::string& what);

/// Installs handlers for SIGINT, SIGTERM and SIGHUP that remove the registered
/// temporaries, and the outputs already committed from them (a killed command
/// leaves nothing), and then die of the signal as before. Idempotent.
void remove_temporaries_on_signals();

/// Removes `target`.tmp.<pid> files beside `target` whose process is gone.
void remove_stale_temporaries(const std::string& target);

/// The temporary frag writes `target` through: `target`.tmp.<this pid>.
std::string temporary_name(const std::string& target);

/// A temporary beside a target, registered for removal on signals until it is
/// destroyed uncommitted (removed); once committed (renamed into place), the
/// target stays registered until the process ends.
class TemporaryFile {
 public:
  /// Removes stale temporaries of `target` first.
  explicit TemporaryFile(const std::string& target);
  ~TemporaryFile();
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;

  const std::string& path() const { return path_; }
  /// Writes `bytes` to the temporary (every write checked, then fsync).
  void write(const std::string& bytes);
  /// Renames the temporary onto the target.
  void commit();

 private:
  std::string target_;
  std::string path_;
  int slot_ = -1;  ///< in the table the signal handler reads (-1: not registered)
  bool committed_ = false;
};

/// Writes `bytes` to `path` (created or truncated), checking every write: a
/// full disk or device (ENOSPC) is a frag::Error naming the file.
void write_file(const std::string& path, const std::string& bytes);

/// Writes `bytes` to `target`: atomically through a TemporaryFile, or in place
/// when `target.direct`.
void write_output(const OutputTarget& target, const std::string& bytes);

}  // namespace frag::cli
