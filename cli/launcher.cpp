//===- cli/launcher.cpp - Start N local ranks as processes -------------===//
#include "cli/launcher.h"

#include "ir/error.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
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
#include <string>
#include <thread>

namespace frag::cli {
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

/// One rank's stdout or stderr, passed on a whole line at a time. Ranks share the launcher's terminal;
/// a line one rank writes in pieces (several `<<`, or more than a pipe carries at once) would otherwise
/// be cut by another rank's. The launcher is the only writer of its streams, so whole lines stay whole.
class LineRelay {
 public:
  LineRelay(int read_fd, int target_fd) : fd_(read_fd), target_(target_fd) {}
  int fd() const { return fd_; }
  bool open() const { return fd_ >= 0; }

  /// Reads what the rank wrote; passes on every complete line. At end of file, the rest as a line.
  void pump() {
    char chunk[65536];
    while (open()) {
      const ssize_t n = read(fd_, chunk, sizeof(chunk));
      if (n > 0) {
        pending_.append(chunk, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      close();  // end of file (the rank and its children are gone) or an error
      break;
    }
    const size_t end = open() ? pending_.rfind('\n') : pending_.size();
    if (end == std::string::npos || pending_.empty()) return;
    if (!open() && pending_.back() != '\n') pending_ += '\n';
    const size_t upto = open() ? end + 1 : pending_.size();
    write_all(pending_.data(), upto);
    pending_.erase(0, upto);
  }

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  void write_all(const char* data, size_t size) const {
    while (size > 0) {
      const ssize_t n = write(target_, data, size);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // the launcher's own output is gone: nothing to tell
      data += n;
      size -= static_cast<size_t>(n);
    }
  }

  int fd_;
  int target_;
  std::string pending_;
};

/// A pipe whose ends close on exec (a rank inherits only its own, as fds 1 and 2); the launcher reads
/// its end without blocking.
void make_pipe(int ends[2]) {
  if (pipe2(ends, O_CLOEXEC) != 0) fail("cannot create a pipe for a rank's output: {}", std::strerror(errno));
  fcntl(ends[0], F_SETFL, fcntl(ends[0], F_GETFL) | O_NONBLOCK);
}

/// Waits up to `wait` for output from any rank, then passes on what came.
void relay_output(std::vector<LineRelay>& relays, std::chrono::milliseconds wait) {
  std::vector<pollfd> fds;
  std::vector<LineRelay*> owners;
  for (auto& relay : relays)
    if (relay.open()) {
      fds.push_back({relay.fd(), POLLIN, 0});
      owners.push_back(&relay);
    }
  if (fds.empty()) {
    std::this_thread::sleep_for(wait);
    return;
  }
  if (poll(fds.data(), fds.size(), static_cast<int>(wait.count())) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i)
    if (fds[i].revents != 0) owners[i]->pump();
}

bool any_open(const std::vector<LineRelay>& relays) {
  return std::any_of(relays.begin(), relays.end(), [](const LineRelay& r) { return r.open(); });
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
  std::vector<LineRelay> relays;
  relays.reserve(2 * static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    int out[2], err[2];
    make_pipe(out);
    make_pipe(err);
    pid_t pid = fork();
    if (pid < 0) fail("cannot start rank {}: {}", rank, std::strerror(errno));
    if (pid == 0) {
      // A rank dies with its launcher (even of SIGKILL), never writing --out as an orphan.
      for (int signal_number : {SIGINT, SIGTERM, SIGHUP}) signal(signal_number, SIG_DFL);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != launcher) _exit(128 + SIGTERM);  // the launcher died before prctl
      // Its output goes through the launcher's relay. A write after the launcher died then fails
      // (EPIPE) instead of killing the rank before it removed its temporaries.
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      signal(SIGPIPE, SIG_IGN);
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
    ::close(out[1]);
    ::close(err[1]);
    relays.emplace_back(out[0], STDOUT_FILENO);
    relays.emplace_back(err[0], STDERR_FILENO);
  }
  int first_failure = 0;
  size_t running = children.size();
  std::set<pid_t> stopped;  // ranks paused by a signal (SIGSTOP, SIGTSTP): they cannot fail on their own
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
    relay_output(relays, std::chrono::milliseconds(0));
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
    relay_output(relays, std::chrono::milliseconds(5));
  }
  // The ranks are gone: pass on what they wrote last (bounded, in case a child of theirs holds a pipe).
  const auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (any_open(relays) && std::chrono::steady_clock::now() < drain_until)
    relay_output(relays, std::chrono::milliseconds(20));
  for (auto& relay : relays) {
    relay.pump();
    relay.close();
  }
  if (int signal_number = received_signal.load(); signal_number != 0) {
    signal(signal_number, SIG_DFL);
    raise(signal_number);
  }
  return first_failure;
}

}  // namespace frag::cli
