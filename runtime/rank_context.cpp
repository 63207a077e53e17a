//===- runtime/rank_context.cpp - This process's place among the ranks --===//
#include "runtime/rank_context.h"

#include "ir/error.h"
#include "ir/fragment_rule.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <cstdlib>
#include <mutex>

namespace frag::runtime {
namespace {

int env_int(const char* name, int fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < 0) fail("environment variable {}='{}' is not a non-negative integer", name, text);
  return static_cast<int>(value);
}

std::string to_string(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::vector<uint8_t> to_bytes(const std::string& text) { return {text.begin(), text.end()}; }

/// Every group spans the whole world under pure tensor parallelism.
constexpr const char* kGroupNames[] = {ir::kTpGroup, ir::kEpGroup, ir::kTpEpGroup, "world"};


}  // namespace

RendezvousOptions RendezvousOptions::from_env() {
  RendezvousOptions options;
  options.rank = env_int("RANK", 0);
  options.world_size = env_int("WORLD_SIZE", 1);
  options.local_rank = env_int("LOCAL_RANK", options.rank);
  options.master_port = env_int("MASTER_PORT", options.master_port);
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0')
    options.master_addr = addr;
  if (options.world_size < 1) fail("WORLD_SIZE must be at least 1");
  if (options.rank >= options.world_size)
    fail("RANK={} is out of range for WORLD_SIZE={}", options.rank, options.world_size);
  return options;
}

std::shared_ptr<RankContext> RankContext::single_rank() {
  std::shared_ptr<RankContext> context(new RankContext());
  auto single = make_single_rank_communicator();
  for (const char* name : kGroupNames) context->groups_[name] = single;
  return context;
}

std::shared_ptr<RankContext> RankContext::connect(const RendezvousOptions& options) {
  if (options.world_size == 1) {
    auto context = single_rank();
    context->timeout_ = options.timeout;
    return context;
  }
  if (options.master_port <= 0 || options.master_port > 65535)
    fail("MASTER_PORT={} is not a TCP port", options.master_port);
  std::shared_ptr<RankContext> context(new RankContext());
  context->rank_ = options.rank;
  context->world_size_ = options.world_size;
  context->timeout_ = options.timeout;
  context->backend_ = options.backend;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(options.master_port);
    store_options.isServer = options.rank == 0;
    store_options.numWorkers = options.world_size;
    store_options.waitWorkers = true;
    store_options.timeout = options.timeout;
    context->store_ = c10::make_intrusive<c10d::TCPStore>(options.master_addr, store_options);
  } catch (const std::exception& e) {
    fail("rendezvous at {}:{} failed for rank {} of {} within {} ms: {}", options.master_addr,
         options.master_port, options.rank, options.world_size, options.timeout.count(),
         first_line(e.what()));
  }
  std::shared_ptr<Communicator> world;
  if (options.backend == "gloo") {
    // Ranks on one host talk over loopback; across hosts over the address that
    // reaches MASTER_ADDR's network (GLOO_SOCKET_IFNAME picks an interface).
    std::string host = options.master_addr == "127.0.0.1" || options.master_addr == "localhost"
                           ? "127.0.0.1"
                           : "";
    if (host.empty()) {
      const char* name = std::getenv("FRAG_GLOO_HOSTNAME");
      host = name != nullptr ? name : "";
    }
    if (host.empty()) {
      char buffer[256] = {};
      gethostname(buffer, sizeof(buffer) - 1);
      host = buffer;
    }
    world = make_gloo_communicator(context->store_, "world", options.rank, options.world_size,
                                   options.timeout, host);
  } else if (options.backend == "nccl") {
    world = make_nccl_communicator(context->store_, "world", options.rank, options.world_size,
                                   options.timeout, options.local_rank);
  } else {
    fail("unknown backend '{}': expected gloo or nccl", options.backend);
  }
  for (const char* name : kGroupNames) context->groups_[name] = world;
  return context;
}

Communicator& RankContext::group(const std::string& name) const {
  auto it = groups_.find(name);
  if (it == groups_.end()) fail("unknown communicator group '{}': expected tp, ep, tp×ep or world", name);
  return *it->second;
}

std::vector<std::string> RankContext::exchange(const std::string& step, const std::string& value) {
  if (world_size_ == 1) return {value};
  // A sequence number keeps keys unique when a step name repeats; every rank
  // exchanges in the same order, so the numbers match.
  const std::string prefix = fmt::format("exchange/{}/{}/", exchanges_++, step);
  store_->set(prefix + std::to_string(rank_), to_bytes(value));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size_; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store_->wait(keys, timeout_);
  } catch (const std::exception& e) {
    fail("rank {} of {}: other ranks did not reach step '{}' within {} ms (one may have died)",
         rank_, world_size_, step, timeout_.count());
  }
  std::vector<std::string> values;
  for (const auto& key : keys) values.push_back(to_string(store_->get(key)));
  return values;
}

void RankContext::agree(const std::string& step, const std::string& local_error) {
  auto errors = exchange(step, local_error);
  std::string message;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    if (!message.empty()) message += "; ";
    message += fmt::format("rank {}: {}", r, errors[r]);
  }
  if (!message.empty()) throw Error(message);
}

RankContext& current_rank_context() {
  if (RankContext* context = Current<RankContext>::get()) return *context;
  // None set: world size 1, kept as the process's from then on.
  static std::mutex making;
  std::lock_guard<std::mutex> lock(making);
  if (Current<RankContext>::get() == nullptr) Current<RankContext>::set_process(RankContext::single_rank());
  return *Current<RankContext>::get();
}

void set_process_rank_context(std::shared_ptr<RankContext> context) {
  Current<RankContext>::set_process(std::move(context));
}

}  // namespace frag::runtime
