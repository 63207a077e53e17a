//===- runtime/collective_watchdog.cpp - Timeouts without host syncs ------===//
#include "runtime/collective_watchdog.h"

#include "ir/error.h"

#include <fmt/format.h>

namespace frag::runtime {

CollectiveWatchdog::CollectiveWatchdog(Backend backend, std::chrono::milliseconds timeout, std::string who,
                                       std::chrono::microseconds poll)
    : backend_(std::move(backend)), timeout_(timeout), who_(std::move(who)), poll_(poll) {
  last_progress_ = std::chrono::steady_clock::now();
  thread_ = std::thread([this] { run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void CollectiveWatchdog::watch(Marker marker, const char* what) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (error_) throw_after_abort(lock);
  const auto now = std::chrono::steady_clock::now();
  const bool was_idle = pending_.empty();
  if (was_idle) last_progress_ = now;  // idle time is no stall
  pending_.push_back(Pending{marker, what, ++sequence_, now});
  lock.unlock();
  // Only an idle watchdog sleeps until woken; a busy one polls anyway, and a
  // wake-up per collective would cost the enqueuing thread a context switch.
  if (was_idle) wake_.notify_one();
}

void CollectiveWatchdog::check() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (error_) throw_after_abort(lock);
}

void CollectiveWatchdog::throw_after_abort(std::unique_lock<std::mutex>& lock) {
  abort_returned_.wait(lock, [&] { return abort_done_; });
  fail("{}", *error_);
}

std::optional<std::string> CollectiveWatchdog::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

int64_t CollectiveWatchdog::watched() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sequence_;
}

std::vector<CollectiveWatchdog::Marker> CollectiveWatchdog::take_finished() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::move(finished_);
}

void CollectiveWatchdog::wait_all() {
  Marker last = nullptr;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (error_) throw_after_abort(lock);
    if (pending_.empty()) return;
    last = pending_.back().marker;
  }
  // Markers finish in order (one stream): the last one finished means all did.
  // The watchdog thread enforces the deadline; this loop only watches for its
  // verdict. Spin first (a forward's tail is microseconds), then sleep briefly.
  for (int polls = 0;; ++polls) {
    if (backend_.finished(last)) break;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (error_) throw_after_abort(lock);
    }
    if (polls < 20000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // An abort also ends the pending work: finished is no success then.
  check();
}

void CollectiveWatchdog::fail_locked(std::unique_lock<std::mutex>& lock, std::string message) {
  if (!error_) error_ = std::move(message);
  if (aborted_) return;
  aborted_ = true;
  // The communicator takes backend_mutex_ before mutex_ never the other way
  // round (it calls watch() after its enqueue): release ours first.
  lock.unlock();
  {
    std::lock_guard<std::mutex> backend_lock(backend_mutex_);
    backend_.abort();
  }
  lock.lock();
  abort_done_ = true;
  abort_returned_.notify_all();
}

void CollectiveWatchdog::run() {
  if (backend_.thread_start) backend_.thread_start();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if (pending_.empty() || aborted_) {
      wake_.wait(lock, [&] { return stop_ || (!pending_.empty() && !aborted_); });
      continue;
    }
    // Retire finished markers in order.
    const auto now = std::chrono::steady_clock::now();
    while (!pending_.empty() && backend_.finished(pending_.front().marker)) {
      finished_.push_back(pending_.front().marker);
      pending_.pop_front();
      last_progress_ = now;
    }
    std::optional<std::string> async;
    {
      // The backend's error query must not race an enqueue on another thread.
      lock.unlock();
      {
        std::lock_guard<std::mutex> backend_lock(backend_mutex_);
        async = backend_.async_error();
      }
      lock.lock();
    }
    if (async) {
      const std::string what = pending_.empty() ? "collective" : pending_.front().what;
      fail_locked(lock, fmt::format("{}: {} failed: {} (communicator aborted)", who_, what, *async));
    } else if (!pending_.empty()) {
      const Pending& oldest = pending_.front();
      const auto since = std::max(oldest.enqueued, last_progress_);
      if (now - since > timeout_)
        fail_locked(lock, fmt::format("{}: {} #{} made no progress for {} ms (a peer died, stalled or never "
                                "arrived); communicator aborted",
                                who_, oldest.what, oldest.sequence, timeout_.count()));
    }
    wake_.wait_for(lock, poll_, [&] { return stop_; });
  }
}

}  // namespace frag::runtime
