//===- tests/support/test_support_test.cpp - The tests' own support ---===//
//
// temporary_folder: a folder goes, with what it holds, when the process that made it exits; a forked child's
// normal exit leaves its parent's folders; FRAG_KEEP_WORK=1 keeps them. Each case in a forked child that exits
// normally (exit, so that its static destructors run), reporting through a pipe.
//
//===----------------------------------------------------------------------===//
#include "tests/support/test_support.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace frag::testing {
namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

/// A child that makes a folder with a file in a subfolder, forks a grandchild that exits normally, says whether
/// the folder outlived the grandchild, then exits normally itself (`keep`: with FRAG_KEEP_WORK=1). Returns
/// (the folder, the child's answer).
std::pair<std::string, std::string> folder_of_a_child(bool keep) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    if (keep) ::setenv("FRAG_KEEP_WORK", "1", 1);
    std::string folder = temporary_folder();
    ::mkdir((folder + "/inner").c_str(), 0755);
    write_text(folder + "/inner/rows.bin", "rows");
    pid_t grandchild = ::fork();
    if (grandchild == 0) std::exit(0);
    int status = 0;
    ::waitpid(grandchild, &status, 0);
    std::string answer = folder + "\n" + (exists(folder + "/inner/rows.bin") ? "kept" : "gone") + "\n";
    (void)!::write(fds[1], answer.data(), answer.size());
    ::close(fds[1]);
    std::exit(0);
  }
  ::close(fds[1]);
  std::string text;
  char buffer[512];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's status " << status;
  auto lines = lines_of(text);
  if (lines.size() != 2) return {"", text};
  return {lines[0], lines[1]};
}

TEST(TemporaryFolder, GoesWithTheProcessThatMadeIt) {
  auto [folder, after_grandchild] = folder_of_a_child(/*keep=*/false);
  ASSERT_FALSE(folder.empty()) << after_grandchild;
  EXPECT_EQ(after_grandchild, "kept") << "a forked grandchild's exit removed its parent's folder";
  EXPECT_FALSE(exists(folder)) << folder << " outlived the process that made it";
}

TEST(TemporaryFolder, FragKeepWorkKeepsIt) {
  auto [folder, after_grandchild] = folder_of_a_child(/*keep=*/true);
  ASSERT_FALSE(folder.empty()) << after_grandchild;
  EXPECT_TRUE(exists(folder + "/inner/rows.bin"));
  ::unlink((folder + "/inner/rows.bin").c_str());
  ::rmdir((folder + "/inner").c_str());
  ::rmdir(folder.c_str());
}

}  // namespace
}  // namespace frag::testing
