//===- tests/support/test_support.cpp - Paths, subprocesses and ranks ---===//
#include "tests/support/test_support.h"

#include "cli/launcher.h"

#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

namespace frag::testing {
namespace {

/// The folders temporary_folder made, removed with what they hold when the process that made them exits
/// (FRAG_KEEP_WORK=1 keeps them). Why: under ctest (the sanitizer stage) they are made in /tmp, where nothing
/// else removes them (about 100 a CI run); Bazel's TEST_TMPDIR is Bazel's to clean, and cleaned the same way.
/// A forked child that exits normally leaves its parent's folders alone.
class MadeFolders {
 public:
  void add(std::string folder) {
    std::lock_guard<std::mutex> lock(mu_);
    folders_.emplace_back(::getpid(), std::move(folder));
  }
  ~MadeFolders() {
    const char* keep = std::getenv("FRAG_KEEP_WORK");
    if (keep != nullptr && *keep != '\0' && std::string(keep) != "0") return;
    for (const auto& [pid, folder] : folders_)
      if (pid == ::getpid()) remove_tree(folder);
  }

 private:
  /// nftw, deepest first, links not followed: not std::filesystem::remove_all (remove_flat_folder says why).
  static void remove_tree(const std::string& folder) {
    ::nftw(folder.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
  }
  static int remove_one(const char* path, const struct stat*, int, struct FTW*) {
    ::remove(path);
    return 0;
  }
  std::mutex mu_;
  std::vector<std::pair<pid_t, std::string>> folders_;
};

MadeFolders& made_folders() {
  static MadeFolders folders;
  return folders;
}

// LibTorch's c10d FlightRecorder inserts into a std::map before taking its lock (record() in
// torch/csrc/distributed/c10d/FlightRecorderDetail.hpp, all_pg_status_): a race when one process holds
// several process groups, as the in-process thread ranks of run_ranks do (ASan caught it in
// communicator_test and ad_hoc_call_test). frag's ranks are processes with one group each. A buffer size of
// 0 turns recording off, which skips that path; set before any process group exists (a static initializer),
// unless the environment already chose a size.
[[maybe_unused]] const bool kFlightRecorderOff = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0; }();

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

std::string data_path(const std::string& relative) {
  const char* root = std::getenv("FRAG_TEST_DATA");
  return (root != nullptr && *root != '\0') ? std::string(root) + "/" + relative : relative;
}

std::string frag_binary() {
  if (const char* bin = std::getenv("FRAG_BIN"); bin != nullptr && *bin != '\0') return bin;
  return std::filesystem::absolute(data_path("cli/frag")).string();
}

std::vector<std::string> model_files(const std::string& export_name, const std::string& extension) {
  std::vector<std::string> files;
  for (int r = 0;; ++r) {
    std::string path = data_path("tests/models/" + export_name + "/rank" + std::to_string(r) + "." + extension);
    if (!std::filesystem::exists(path)) break;
    files.push_back(std::filesystem::absolute(path).string());
  }
  if (files.empty()) throw std::runtime_error("no rank files for export " + export_name);
  return files;
}

void remove_flat_folder(const std::string& folder) {
  for (const auto& entry : std::filesystem::directory_iterator(folder)) ::unlink(entry.path().c_str());
  ::rmdir(folder.c_str());
}

std::string temporary_folder() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/frag_test_XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  made_folders().add(pattern);
  return pattern;
}

CommandResult run_command(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& environment,
                          std::chrono::seconds limit) {
  CommandResult result;
  std::string log = temporary_folder() + "/output.txt";
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    setpgid(0, 0);  // its own group, so a kill reaches the ranks it starts
    for (const auto& [key, value] : environment) setenv(key.c_str(), value.c_str(), 1);
    std::vector<char*> args;
    std::vector<std::string> copy = argv;
    for (auto& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  while (true) {
    pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) {
      result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (std::chrono::steady_clock::now() - start > limit) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      result.exit_code = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  std::ifstream in(log);
  result.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return result;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

FragOutput frag(const std::vector<std::string>& args, std::chrono::seconds limit) {
  // stdout comes back through run_command's log; stderr goes to a file of its own.
  const std::string err = temporary_folder() + "/stderr.txt";
  std::string command = "exec " + shell_quote(frag_binary());
  for (const auto& a : args) command += " " + shell_quote(a);
  command += " 2>" + shell_quote(err);
  auto result = run_command({"/bin/sh", "-c", command}, {}, limit);
  return FragOutput{result.exit_code, result.output, read_text(err)};
}

std::vector<std::string> run_ranks(
    int world, std::chrono::milliseconds timeout,
    const std::function<void(int rank, const std::shared_ptr<runtime::RankContext>& context)>& body) {
  const int port = cli::find_free_port();
  std::vector<std::string> errors(world);
  // Every rank's context outlives every rank's body: rank 0's holds the TCP store's server, and a rank 0 that
  // finished (or failed) first would otherwise close it while another rank still reads the last exchange's
  // values, which then fails with "Failed to recv ... Connection was likely closed" instead of its own result
  // (seen in ad_hoc_call_test under the sanitizers on a loaded machine).
  std::vector<std::shared_ptr<runtime::RankContext>> contexts(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        runtime::RendezvousOptions options;
        options.rank = rank;
        options.world_size = world;
        options.master_port = port;
        options.timeout = timeout;
        contexts[rank] = runtime::RankContext::connect(options);
        body(rank, contexts[rank]);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  contexts.clear();
  return errors;
}

}  // namespace frag::testing
