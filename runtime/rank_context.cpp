//===- runtime/rank_context.cpp - This process's place among the ranks --===//
#include "runtime/rank_context.h"

#include <algorithm>

#include "ir/error.h"
#include "ir/fragment_rule.h"

#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <future>
#include <thread>
#include <mutex>

namespace frag::runtime {
namespace {

/// `text` fit for a one-line message: bytes outside printable ASCII as \xNN, at most 64 characters.
std::string printable(const std::string& text) {
  std::string out;
  for (unsigned char c : text.substr(0, 64)) out += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c))
                                                                        : fmt::format("\\x{:02x}", c);
  return text.size() > 64 ? out + "…" : out;
}

/// An integer environment variable in [low, high]; unset or empty: `fallback`.
int env_int(const char* name, int fallback, long low, long high) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || value < low || value > high)
    fail("environment variable {}='{}': expected an integer from {} to {}", name, printable(text), low, high);
  return static_cast<int>(value);
}

/// MASTER_ADDR: a host name or an IPv4/IPv6 address, nothing else (c10d's
/// resolver and its messages take it as it is).
std::string master_addr_from_env(const std::string& fallback) {
  const char* text = std::getenv("MASTER_ADDR");
  if (text == nullptr || *text == '\0') return fallback;
  std::string addr = text;
  const bool valid = addr.size() <= 253 && addr.find_first_not_of("abcdefghijklmnopqrstuvwxyz"
                                                                  "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%") ==
                                               std::string::npos;
  if (!valid)
    fail("environment variable MASTER_ADDR='{}': expected a host name or an IP address (letters, digits, '.', "
         "'-', ':'; at most 253 characters)",
         printable(addr));
  return addr;
}

std::string to_string(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::vector<uint8_t> to_bytes(const std::string& text) { return {text.begin(), text.end()}; }



/// The TCP store, within the timeout. TCPStore's constructor bounds a refused
/// connection but can wait forever on a peer that accepts and never answers,
/// so it runs on a thread of its own that is abandoned past the deadline
/// (blocked in a read; the process is about to fail anyway).
c10::intrusive_ptr<c10d::Store> connect_store(const RendezvousOptions& options) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options.master_port);
  store_options.isServer = options.rank == 0;
  store_options.numWorkers = options.world_size;
  store_options.waitWorkers = true;
  store_options.timeout = options.timeout;
  auto promise = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Store>>>();
  auto result = promise->get_future();
  std::thread([promise, store_options, addr = options.master_addr] {
    try {
      promise->set_value(c10::make_intrusive<c10d::TCPStore>(addr, store_options));
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  }).detach();
  const auto where = fmt::format("rendezvous at {}:{} failed for rank {} of {} within {} ms", options.master_addr,
                                 options.master_port, options.rank, options.world_size, options.timeout.count());
  // A little grace, so that the store's own (more specific) timeout error wins when it comes.
  if (result.wait_for(options.timeout + std::chrono::seconds(1)) != std::future_status::ready)
    fail("{}: {}", where,
         options.rank == 0 ? "the store did not start"
                           : "something there accepted the connection but never answered as a store would");
  try {
    return result.get();
  } catch (const std::exception& e) {
    fail("{}: {}", where, first_line(e.what()));
  }
}

}  // namespace

RendezvousOptions RendezvousOptions::from_env() {
  RendezvousOptions options;
  // World sizes beyond kMaxWorldSize would only allocate per-rank tables of absurd size.
  options.world_size = env_int("WORLD_SIZE", 1, 1, kMaxWorldSize);
  options.rank = env_int("RANK", 0, 0, kMaxWorldSize - 1);
  options.local_rank = env_int("LOCAL_RANK", options.rank, 0, kMaxWorldSize - 1);
  options.master_port = env_int("MASTER_PORT", options.master_port, 1, 65535);
  options.master_addr = master_addr_from_env(options.master_addr);
  if (options.rank >= options.world_size)
    fail("RANK={} is out of range for WORLD_SIZE={}", options.rank, options.world_size);
  return options;
}

std::shared_ptr<RankContext> RankContext::single_rank() {
  std::shared_ptr<RankContext> context(new RankContext());
  auto single = make_single_rank_communicator();
  context->groups_.fill(single);  // every group spans the whole world under pure tensor parallelism
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
  context->store_ = connect_store(options);
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
  context->groups_.fill(world);
  return context;
}

std::shared_ptr<RankContext> RankContext::over_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                             const std::string& group_name,
                                                             std::chrono::milliseconds timeout) {
  auto world = make_process_group_communicator(group_name, timeout);
  std::shared_ptr<RankContext> context(new RankContext());
  context->rank_ = world->rank();
  context->world_size_ = world->size();
  context->timeout_ = timeout;
  context->backend_ = world->backend();
  context->process_group_ = group_name;
  context->store_ = c10::make_intrusive<c10d::PrefixStore>("fragments", store);
  context->groups_.fill(world);
  return context;
}

Communicator& RankContext::group(std::string_view name) const {
  const auto id = ir::group_id(name);
  if (!id) fail("unknown communicator group '{}': expected tp, ep, tp×ep or world", name);
  return group(*id);
}

std::vector<Communicator*> RankContext::communicators() const {
  // The groups may share one communicator: each once.
  std::vector<Communicator*> distinct;
  for (const auto& group : groups_)
    if (std::find(distinct.begin(), distinct.end(), group.get()) == distinct.end()) distinct.push_back(group.get());
  return distinct;
}

void RankContext::synchronize() const {
  for (Communicator* communicator : communicators()) communicator->synchronize();
}

bool RankContext::capturable() const {
  const auto all = communicators();
  return std::all_of(all.begin(), all.end(), [](const Communicator* c) { return c->capturable(); });
}

void RankContext::watch_replay() const {
  for (Communicator* communicator : communicators()) communicator->watch_replay();
}

std::vector<std::string> RankContext::exchange(const std::string& step, const std::string& value) {
  if (world_size_ == 1) return {value};
  // A sequence number keeps keys unique when a step name repeats; every rank
  // exchanges in the same order, so the numbers match.
  const std::string prefix = fmt::format("exchange/{}/{}/", exchanges_++, step);
  store_->set(prefix + std::to_string(rank_), to_bytes(value));
  std::vector<std::string> keys;
  keys.reserve(static_cast<size_t>(world_size_));
  for (int r = 0; r < world_size_; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store_->wait(keys, timeout_);
  } catch (const std::exception& e) {
    fail("rank {} of {}: other ranks did not reach step '{}' within {} ms (one may have died)",
         rank_, world_size_, step, timeout_.count());
  }
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const auto& key : keys) values.push_back(to_string(store_->get(key)));
  return values;
}

void RankContext::agree(const std::string& step, const std::string& local_error) {
  auto errors = exchange(step, local_error);
  if (world_size_ == 1) {
    if (!errors[0].empty()) throw RankAgreementError(errors[0]);
    return;
  }
  // Ranks that failed alike are named together, so a bad plan shared by 8 ranks reads as one message.
  std::vector<std::pair<std::string, std::vector<size_t>>> distinct;  // message -> ranks, in rank order
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](const auto& d) { return d.first == errors[r]; });
    if (it == distinct.end()) distinct.push_back({errors[r], {r}});
    else it->second.push_back(r);
  }
  std::string message;
  for (const auto& [text, ranks] : distinct) {
    if (!message.empty()) message += "; ";
    if (ranks.size() == errors.size()) message += fmt::format("every rank: {}", text);
    else if (ranks.size() == 1) message += fmt::format("rank {}: {}", ranks[0], text);
    else message += fmt::format("ranks {}: {}", fmt::join(ranks, ", "), text);
  }
  if (!message.empty()) throw RankAgreementError(message);
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
