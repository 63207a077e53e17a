//===- runtime/collective_watchdog.h - Timeouts without host syncs -*- C++ -*-===//
//
// Enforces a communicator's timeout while its collectives run asynchronously
// (NCCL on a CUDA stream). After enqueueing a collective the communicator
// hands the watchdog a marker (a CUDA event recorded behind it); a thread
// polls the oldest unfinished marker and the backend's asynchronous error.
// When the backend reports an error, or no marker finishes for `timeout`
// (counted from its enqueue or from the previous marker's finish, whichever
// is later, so a long queue of work ahead of it is no fault), the watchdog
// aborts the backend once and keeps a one-line error; every later check(),
// wait_all() and watch() throws it.
//
// Device-independent: the backend is three callbacks, so the logic is tested
// on the CPU with fake markers (tests/runtime:collective_watchdog_test).
//
//===----------------------------------------------------------------------===//
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace frag::runtime {

class CollectiveWatchdog {
 public:
  using Marker = void*;
  struct Backend {
    /// Whether the work before `marker` has finished. Called from both threads.
    std::function<bool(Marker)> finished;
    /// The backend's asynchronous error, or nullopt while it is healthy.
    std::function<std::optional<std::string>()> async_error;
    /// Aborts the backend (unblocks its pending work). Called at most once,
    /// from the watchdog thread, with the backend lock held.
    std::function<void()> abort;
    /// Runs first on the watchdog thread (e.g. cudaSetDevice). Optional.
    std::function<void()> thread_start;
  };

  /// `who` names the communicator in errors, e.g. "NCCL rank 0 of 2".
  CollectiveWatchdog(Backend backend, std::chrono::milliseconds timeout, std::string who,
                     std::chrono::microseconds poll = std::chrono::microseconds(500));
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  /// Held by the communicator while it calls the backend (enqueue); the
  /// watchdog holds it to abort, so an abort never races an enqueue. Never
  /// call watch() with it held.
  std::mutex& backend_mutex() { return backend_mutex_; }

  /// Starts watching `marker` behind collective `what` (e.g. "all_reduce").
  /// Throws the error when the watchdog has already failed. Like check() and
  /// wait_all(), it throws only once the backend's abort has returned, so a
  /// caller that sees the error never races the abort.
  void watch(Marker marker, const char* what);
  /// Throws frag::Error with the one-line error once the watchdog failed.
  void check();
  /// Waits until every watched marker finished (polling on this thread, so
  /// it returns as soon as the work is done); throws the error if the
  /// watchdog fails meanwhile or had failed.
  void wait_all();
  /// Markers that finished and may be reused; the caller takes them back.
  std::vector<Marker> take_finished();
  /// The error, if the watchdog failed.
  std::optional<std::string> error() const;
  /// Collectives watched so far.
  int64_t watched() const;

 private:
  struct Pending {
    Marker marker;
    const char* what;
    int64_t sequence;
    std::chrono::steady_clock::time_point enqueued;
  };
  void run();
  void fail_locked(std::unique_lock<std::mutex>& lock, std::string message);  // with mutex_ held
  /// Throws the error once the abort has returned; with mutex_ held.
  [[noreturn]] void throw_after_abort(std::unique_lock<std::mutex>& lock);

  Backend backend_;
  std::chrono::milliseconds timeout_;
  std::string who_;
  std::chrono::microseconds poll_;

  std::mutex backend_mutex_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::vector<Marker> finished_;
  std::chrono::steady_clock::time_point last_progress_;
  std::optional<std::string> error_;
  bool aborted_ = false;      // the abort has begun (at most one)
  bool abort_done_ = false;   // ... and returned
  std::condition_variable abort_returned_;
  bool stop_ = false;
  int64_t sequence_ = 0;
  std::thread thread_;
};

}  // namespace frag::runtime
