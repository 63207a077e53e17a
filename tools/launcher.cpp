//===- tools/launcher.cpp - Start N local ranks as processes -------------===//
#include "tools/launcher.h"

#include "ir/error.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace frag::tools {

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
  const int port = find_free_port();
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid < 0) fail("cannot start rank {}: {}", rank, std::strerror(errno));
    if (pid == 0) {
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
  }
  int first_failure = 0;
  size_t running = children.size();
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      --running;
      int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && first_failure == 0) {
        first_failure = code;
        // The others will fail through their collective timeout; give them that long.
        deadline = std::chrono::steady_clock::now() + timeout + std::chrono::seconds(10);
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
  return first_failure;
}

}  // namespace frag::tools
