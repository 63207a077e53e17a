//===- tools/launcher.cpp - Start N local ranks as processes -------------===//
#include "tools/launcher.h"

#include "ir/error.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <thread>

namespace frag::tools {
namespace {

/// The running ranks, for the signal handler (plain memory only).
constexpr int kMaxRanks = 1024;
std::atomic<pid_t> rank_pids[kMaxRanks];
std::atomic<int> received_signal{0};

/// A signal to the launcher goes to every rank, so that each removes its
/// temporaries and dies; the launcher dies of it once they are gone.
void forward_to_ranks(int signal_number) {
  received_signal.store(signal_number);
  for (auto& pid : rank_pids)
    if (pid_t p = pid.load(); p > 0) kill(p, signal_number);
}

void forward_signals_to_ranks() {
  struct sigaction action {};
  action.sa_handler = forward_to_ranks;
  sigemptyset(&action.sa_mask);
  for (int signal_number : {SIGINT, SIGTERM, SIGHUP}) sigaction(signal_number, &action, nullptr);
}

}  // namespace

int find_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) fail("cannot open a socket to find a free port: {}", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    close(fd);
    fail("cannot find a free port on 127.0.0.1: {}", std::strerror(errno));
  }
  close(fd);
  return ntohs(address.sin_port);
}

int launch_local_ranks(int world, const std::vector<std::string>& arguments,
                       std::chrono::milliseconds timeout) {
  if (world > kMaxRanks) fail("--world {}: at most {} local ranks", world, kMaxRanks);
  const int port = find_free_port();
  const pid_t launcher = getpid();
  forward_signals_to_ranks();
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid < 0) fail("cannot start rank {}: {}", rank, std::strerror(errno));
    if (pid == 0) {
      // A rank dies with its launcher (even of SIGKILL), never writing --out as an orphan.
      for (int signal_number : {SIGINT, SIGTERM, SIGHUP}) signal(signal_number, SIG_DFL);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != launcher) _exit(128 + SIGTERM);  // the launcher died before prctl
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> argv;
      std::string self = "/proc/self/exe";
      argv.push_back(self.data());
      std::vector<std::string> copy = arguments;
      for (auto& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(self.c_str(), argv.data());
      std::fprintf(stderr, "frag: cannot start rank %d: %s\n", rank, std::strerror(errno));
      _exit(127);
    }
    children.push_back(pid);
    rank_pids[rank].store(pid);
  }
  int first_failure = 0;
  size_t running = children.size();
  std::set<pid_t> stopped;  // ranks paused by a signal (SIGSTOP, SIGTSTP): they cannot fail on their own
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
    if (pid > 0 && WIFSTOPPED(status)) {
      stopped.insert(pid);
    } else if (pid > 0 && WIFCONTINUED(status)) {
      stopped.erase(pid);
    } else if (pid > 0) {
      stopped.erase(pid);
      for (auto& slot : rank_pids)
        if (slot.load() == pid) slot.store(0);
      --running;
      int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && first_failure == 0) {
        first_failure = code;
        // The others will fail through their collective timeout; give them that long.
        deadline = std::chrono::steady_clock::now() + timeout + std::chrono::seconds(10);
      }
    }
    if (pid > 0) {
      // A rank failed and every rank still there is paused: none of them can end by itself, and
      // waiting out the deadline would only delay the error the user already has. SIGTERM, then
      // SIGCONT: the rank removes its temporaries and dies (the deadline's SIGKILL stays the fallback).
      // Not when the launcher itself got a signal: that one is already forwarded and waits for them.
      if (first_failure != 0 && received_signal.load() == 0 && running > 0 && stopped.size() == running) {
        for (pid_t child : stopped) {
          const int rank = static_cast<int>(std::find(children.begin(), children.end(), child) - children.begin());
          std::fprintf(stderr, "frag: rank %d is paused (stopped by a signal) after another rank failed; ending it\n",
                       rank);
          kill(child, SIGTERM);
          kill(child, SIGCONT);
        }
        stopped.clear();  // said once; their deaths arrive as exits
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (pid_t child : children) kill(child, SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (int signal_number = received_signal.load(); signal_number != 0) {
    signal(signal_number, SIG_DFL);
    raise(signal_number);
  }
  return first_failure;
}

}  // namespace frag::tools
