//===- tests/cli/launcher_test.cpp - Ranks' output under the launcher ---===//
//
// launch_local_ranks starts copies of this test binary as ranks (the child test below, selected by
// --gtest_filter and enabled by FRAG_LAUNCHER_TEST_CHILD). Each rank writes long lines in small
// pieces, with pauses, to stdout and stderr at once; what the launcher passes on must be whole lines
// only, every line of every rank present once.
//
//===----------------------------------------------------------------------===//
#include "cli/launcher.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

namespace frag {
namespace {

constexpr int kLines = 40;
constexpr int kLineLength = 9000;  // over a pipe's atomic write (4096): one write could not keep it whole

TEST(LauncherChild, WritesLongLinesInPieces) {
  const char* enabled = std::getenv("FRAG_LAUNCHER_TEST_CHILD");
  if (enabled == nullptr) GTEST_SKIP() << "runs as a rank of LauncherTest only";
  const std::string rank = std::getenv("RANK");
  for (int line = 0; line < kLines; ++line)
    for (int fd : {STDOUT_FILENO, STDERR_FILENO}) {
      const std::string text = "piece-line rank " + rank + " fd " + std::to_string(fd) + " line " +
                               std::to_string(line) + " " + std::string(kLineLength, static_cast<char>('a' + rank[0] - '0')) + "\n";
      // Pieces of 1000 bytes with a pause between: another rank's pieces land in between unless the
      // launcher assembles lines.
      for (size_t at = 0; at < text.size(); at += 1000) {
        const std::string piece = text.substr(at, 1000);
        ASSERT_EQ(write(fd, piece.data(), piece.size()), static_cast<ssize_t>(piece.size()));
        if (line % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
}

/// Runs fn with this process's stdout and stderr going into one file; returns the file's text.
template <typename Fn>
std::string capture_output(Fn fn) {
  const std::string path = testing::TempDir() + "/launcher_output." + std::to_string(getpid());
  std::fflush(stdout);
  std::fflush(stderr);
  const int saved_out = dup(STDOUT_FILENO), saved_err = dup(STDERR_FILENO);
  FILE* file = std::fopen(path.c_str(), "w");
  dup2(fileno(file), STDOUT_FILENO);
  dup2(fileno(file), STDERR_FILENO);
  fn();
  std::fflush(stdout);
  dup2(saved_out, STDOUT_FILENO);
  dup2(saved_err, STDERR_FILENO);
  close(saved_out);
  close(saved_err);
  std::fclose(file);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(path.c_str());
  return text.str();
}

TEST(Launcher, RanksLinesComeWholeAndAllOfThem) {
  setenv("FRAG_LAUNCHER_TEST_CHILD", "1", 1);
  int status = -1;
  const std::string output = capture_output([&] {
    status = cli::launch_local_ranks(3, {"--gtest_filter=LauncherChild.WritesLongLinesInPieces"},
                                       std::chrono::seconds(30));
  });
  unsetenv("FRAG_LAUNCHER_TEST_CHILD");
  ASSERT_EQ(status, 0) << output.substr(0, 2000);

  const std::regex whole("piece-line rank ([0-2]) fd ([12]) line ([0-9]+) ([a-c]+)");
  std::map<std::string, int> seen;
  std::istringstream lines(output);
  std::string line;
  int pieces = 0;
  while (std::getline(lines, line)) {
    if (line.find("piece-line") == std::string::npos) continue;  // GoogleTest's own lines
    ++pieces;
    std::smatch match;
    ASSERT_TRUE(std::regex_match(line, match, whole)) << "a line was cut by another: " << line.substr(0, 200);
    ASSERT_EQ(match[4].length(), kLineLength) << line.substr(0, 200);
    ASSERT_EQ(match[4].str()[0], 'a' + std::stoi(match[1].str())) << "another rank's bytes in rank " << match[1];
    ++seen[match[1].str() + "/" + match[2].str() + "/" + match[3].str()];
  }
  EXPECT_EQ(pieces, 3 * 2 * kLines);
  EXPECT_EQ(seen.size(), static_cast<size_t>(3 * 2 * kLines));
  for (const auto& [key, count] : seen) EXPECT_EQ(count, 1) << key;
}

}  // namespace
}  // namespace frag
