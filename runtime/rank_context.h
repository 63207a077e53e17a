//===- runtime/rank_context.h - This process's place among the ranks -*- C++ -*-===//
//
// A RankContext is what one rank knows about the run: its rank, the world size,
// the rendezvous store and one Communicator per named group ("tp", "ep",
// "world"). Ops find it through current_rank_context(): a thread-local one
// when set (tests run several ranks as threads of one process), else the
// process-wide one, else a single-rank context (world size 1).
//
// Groups: fragments runs pure tensor parallelism, so "tp", "ep", "tp×ep" (a
// FusedMoE with expert parallelism spans the same flat group) and "world" are
// the same ranks. Data and pipeline parallelism are not supported.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/error.h"
#include "ir/group_id.h"
#include "runtime/communicator.h"
#include "runtime/current.h"

#include <array>
#include <chrono>
#include <optional>
#include <string_view>
#include <memory>
#include <string>
#include <vector>

namespace frag::runtime {

/// The largest world from_env accepts.
inline constexpr int kMaxWorldSize = 65536;

/// An error every rank raises alike, after agreeing through the store (see
/// RankContext::agree): one rank reporting it is enough (frag prints rank 0's).
class RankAgreementError : public Error {
 public:
  using Error::Error;
};

/// How to meet the other ranks. Field names follow torchrun's variables.
struct RendezvousOptions {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  /// Bound on the rendezvous and on every collective.
  std::chrono::milliseconds timeout{60000};
  /// "gloo" (CPU tensors) or "nccl" (CUDA tensors).
  std::string backend = "gloo";

  /// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a missing
  /// variable keeps its default, a malformed or out-of-range one is an error
  /// naming it (bytes that are not printable shown as \xNN).
  static RendezvousOptions from_env();
};

/// One rank's view of the run.
class RankContext {
 public:
  /// Meets the other ranks through a TCP store on master_addr:master_port
  /// (rank 0 serves it) and connects every group. Fails within the timeout,
  /// also where something accepts the connection but never answers.
  static std::shared_ptr<RankContext> connect(const RendezvousOptions& options);
  /// World size 1, no store, no peers.
  static std::shared_ptr<RankContext> single_rank();
  /// Joins what torch.distributed set up in this process: collectives on its process group
  /// `group_name` (make_process_group_communicator), the agreement steps on its `store` (under the
  /// prefix "fragments/"). Every group name maps to that one group.
  static std::shared_ptr<RankContext> over_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                         const std::string& group_name,
                                                         std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& backend() const { return backend_; }
  /// The torch.distributed process group this context runs on ("" where fragments connected its own).
  const std::string& process_group() const { return process_group_; }

  /// The communicator of a group (an array index: ids are bound when a table is loaded).
  Communicator& group(ir::GroupId id) const { return *groups_[static_cast<size_t>(id)]; }
  /// The communicator of a named group; an unknown name (or none: nullopt) is an error naming `name`.
  Communicator& group(std::string_view name) const;
  Communicator& group(std::optional<ir::GroupId> id, std::string_view name) const {
    return id ? group(*id) : group(name);
  }

  /// Waits for every collective enqueued on this rank's communicators (NCCL
  /// returns before they ran) and throws the error of one that failed or
  /// timed out. The forward calls it once at its end.
  void synchronize() const;
  /// Whether every communicator's collectives may be captured in a CUDA graph (Communicator::capturable).
  bool capturable() const;
  /// After a replayed CUDA graph: every communicator watches the stream's work (Communicator::watch_replay).
  void watch_replay() const;

  /// Every rank posts `value` under `step`; returns all ranks' values in rank
  /// order. Goes through the store, not a collective, so ranks that have
  /// failed locally can still report why.
  std::vector<std::string> exchange(const std::string& step, const std::string& value);

  /// Every rank reports its local error ("" for none); throws RankAgreementError
  /// on every rank if any rank failed, naming the ranks and their messages. Used
  /// before the first collective so that no rank enters one another skips.
  void agree(const std::string& step, const std::string& local_error);

 private:
  RankContext() = default;
  std::vector<Communicator*> communicators() const;

  int rank_ = 0;
  int world_size_ = 1;
  std::chrono::milliseconds timeout_{60000};
  std::string backend_ = "single";
  std::string process_group_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::array<std::shared_ptr<Communicator>, ir::kGroupCount> groups_;  ///< by ir::GroupId
  int64_t exchanges_ = 0;
};

/// The context ops use on this thread (see the file comment).
RankContext& current_rank_context();
/// Sets the process-wide context (nullptr: back to single rank).
void set_process_rank_context(std::shared_ptr<RankContext> context);

/// Makes `context` current on this thread while it lives.
using ScopedRankContext = Current<RankContext>::Scope;

}  // namespace frag::runtime
