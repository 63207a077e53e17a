//===- cli/safe_files.cpp - Files frag reads and writes, safely --------===//
#include "cli/safe_files.h"

#include "ir/error.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace frag::cli {
namespace {

/// Registered outputs. A signal handler may only read plain memory, so each lives in a fixed table of
/// atomics: the temporary's name and the target's (strdup'd), and the temporary's file identity once written.
struct Registered {
  std::atomic<char*> temporary{nullptr};
  std::atomic<char*> target{nullptr};
  std::atomic<bool> written{false};
  std::atomic<dev_t> device{0};
  std::atomic<ino_t> inode{0};
};
constexpr int kMaxTemporaries = 64;
Registered registered[kMaxTemporaries];

/// The slot now holding `temporary` → `target`, or -1 when the table is full (that output is then still
/// removed on failure, only not on a signal).
int register_temporary(const std::string& temporary, const std::string& target) {
  char* name = strdup(temporary.c_str());
  for (int i = 0; i < kMaxTemporaries; ++i) {
    char* expected = nullptr;
    if (registered[i].temporary.compare_exchange_strong(expected, name)) {
      registered[i].written.store(false);
      registered[i].target.store(strdup(target.c_str()));
      return i;
    }
  }
  std::free(name);
  return -1;
}

void release_temporary(int slot) {
  if (slot < 0) return;
  Registered& entry = registered[slot];
  std::free(entry.target.exchange(nullptr));
  std::free(entry.temporary.exchange(nullptr));
}

/// Removes every registered temporary, and every target its temporary was already renamed onto (the file
/// this process wrote, by device and inode): a command killed by a signal leaves nothing, even when its
/// commit raced the signal (delivered to another thread while the writer renames). The temporary first:
/// once it is unlinked no rename can follow; if it is gone, the rename happened and the target is ours.
void remove_registered_and_die(int signal_number) {
  for (auto& entry : registered) {
    char* temporary = entry.temporary.load();
    if (temporary == nullptr || unlink(temporary) == 0) continue;
    char* target = entry.target.load();
    struct stat info {};
    if (target != nullptr && entry.written.load() && stat(target, &info) == 0 && info.st_dev == entry.device.load() &&
        info.st_ino == entry.inode.load())
      unlink(target);
  }
  // SA_RESETHAND restored the default action and SA_NODEFER lets it through now.
  raise(signal_number);
}

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

bool same_file(const struct stat& a, const struct stat& b) { return a.st_dev == b.st_dev && a.st_ino == b.st_ino; }

/// The path a chain of symbolic links ends at (that path itself may not exist).
std::string resolve_links(const std::string& path, const std::string& option) {
  std::filesystem::path current(path);
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code error;
    if (!std::filesystem::is_symlink(std::filesystem::symlink_status(current, error))) return current.string();
    const auto target = std::filesystem::read_symlink(current, error);
    if (error) fail("{} {}: cannot read the symbolic link {}: {}", option, path, current.string(), error.message());
    current = target.is_absolute() ? target : current.parent_path() / target;
  }
  fail("{} {}: too many levels of symbolic links", option, path);
}

}  // namespace

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) fail("{}: cannot open {}: {}", path, what, std::strerror(errno));
  if (!S_ISREG(info.st_mode))
    fail("{}: {} must be a regular file, but it is {} (not opened: reading it could block forever)", path, what,
         kind_of(info.st_mode));
}

OutputTarget check_output_target(const std::string& path, const std::vector<std::string>& inputs, bool force,
                                 const std::string& option) {
  struct stat info {};
  if (lstat(path.c_str(), &info) != 0) {
    if (errno == ENOENT) return {path, false};
    fail("{} {}: cannot check the output path: {}", option, path, std::strerror(errno));
  }
  if (S_ISLNK(info.st_mode)) {
    const std::string resolved = resolve_links(path, option);
    if (!force)
      fail("{} {}: expected a file, found a symbolic link (to {}); writing would replace the link: pass --force "
           "to write the file it points to",
           option, path, resolved);
    return check_output_target(resolved, inputs, force, option);
  }
  if (S_ISDIR(info.st_mode) || S_ISSOCK(info.st_mode))
    fail("{} {}: expected a file, found {}", option, path, kind_of(info.st_mode));
  if (!S_ISREG(info.st_mode)) {
    if (!force)
      fail("{} {}: expected a file, found {}; writing would replace it with a file: pass --force to write into "
           "it",
           option, path, kind_of(info.st_mode));
    return {path, true};
  }
  for (const auto& input : inputs) {
    struct stat input_info {};
    if (stat(input.c_str(), &input_info) == 0 && same_file(info, input_info) && !force)
      fail("{} {}: expected a new file, found the input file {} itself; writing would overwrite the input: pass "
           "--force to replace it",
           option, path, input);
  }
  return {path, false};
}

void require_distinct_files(const std::vector<std::string>& files, const std::string& what) {
  std::vector<struct stat> infos(files.size());
  for (size_t i = 0; i < files.size(); ++i) {
    if (stat(files[i].c_str(), &infos[i]) != 0) continue;  // reported where the file is opened
    for (size_t j = 0; j < i; ++j)
      if (same_file(infos[i], infos[j]))
        fail("{} {} and {} (positions {} and {}) are the same file; give each rank its own file", what, files[j],
             files[i], j + 1, i + 1);
  }
}

void remove_temporaries_on_signals() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  struct sigaction action {};
  action.sa_handler = remove_registered_and_die;
  action.sa_flags = SA_RESETHAND | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  for (int signal_number : {SIGINT, SIGTERM, SIGHUP}) sigaction(signal_number, &action, nullptr);
}

std::string temporary_name(const std::string& target) { return target + ".tmp." + std::to_string(getpid()); }

void remove_stale_temporaries(const std::string& target) {
  const std::filesystem::path path(target);
  const auto folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  const std::string prefix = path.filename().string() + ".tmp.";
  std::error_code error;
  for (std::filesystem::directory_iterator it(folder, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    // Only files whose writer is gone: a live pid may be another frag writing the same target.
    if (pid == getpid() || kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (std::filesystem::is_regular_file(it->symlink_status())) unlink(it->path().c_str());
  }
}

TemporaryFile::TemporaryFile(const std::string& target) : target_(target), path_(temporary_name(target)) {
  remove_stale_temporaries(target);
  slot_ = register_temporary(path_, target_);
}

TemporaryFile::~TemporaryFile() {
  // A committed output stays registered until the process ends: a signal before then removes it too.
  if (committed_) return;
  unlink(path_.c_str());
  release_temporary(slot_);
}

void TemporaryFile::write(const std::string& bytes) {
  write_file(path_, bytes);
  struct stat info {};
  if (slot_ >= 0 && stat(path_.c_str(), &info) == 0) {
    registered[slot_].device.store(info.st_dev);
    registered[slot_].inode.store(info.st_ino);
    registered[slot_].written.store(true);
  }
  // Fault injection for tests that signal a writer mid-write (tests/cli/frag_faults_test.cpp): the
  // process stops with its temporary written and not yet renamed.
  if (std::getenv("FRAG_FAULT_STOP_AFTER_WRITE") != nullptr) raise(SIGSTOP);
}

void TemporaryFile::commit() {
  if (std::rename(path_.c_str(), target_.c_str()) != 0)
    fail("{}: cannot move the temporary {} into place: {}", target_, path_, std::strerror(errno));
  committed_ = true;
}

void write_file(const std::string& path, const std::string& bytes) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: cannot open for writing: {}", path, std::strerror(errno));
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      close(fd);
      fail("{}: writing failed after {} of {} bytes: {}", path, written, bytes.size(), std::strerror(error));
    }
    written += static_cast<size_t>(n);
  }
  struct stat info {};
  // A full disk may only show at fsync or close (delayed allocation, NFS); devices need neither.
  if (fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && fsync(fd) != 0) {
    const int error = errno;
    close(fd);
    fail("{}: writing failed at fsync: {}", path, std::strerror(error));
  }
  if (close(fd) != 0) fail("{}: writing failed at close: {}", path, std::strerror(errno));
}

void write_output(const OutputTarget& target, const std::string& bytes) {
  if (target.direct) {
    write_file(target.path, bytes);
    return;
  }
  TemporaryFile temporary(target.path);
  temporary.write(bytes);
  temporary.commit();
}

}  // namespace frag::cli
