//===- tests/runtime/collective_watchdog_test.cpp - Timeouts, no host sync ===//
//
// The watchdog's logic with fake markers (atomic flags standing in for CUDA
// events) and a fake backend: runs here without a GPU. The NCCL communicator
// uses the same class with CUDA events (tests/program:cuda_test on a GPU).
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/collective_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>

namespace frag::runtime {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

/// Markers are flags; the backend's abort "unblocks the work" by finishing them all.
struct FakeBackend {
  std::vector<std::unique_ptr<std::atomic<bool>>> markers;
  std::mutex mutex;
  std::atomic<int> aborts{0};
  std::atomic<bool> broken{false};

  CollectiveWatchdog::Marker make() {
    std::lock_guard<std::mutex> lock(mutex);
    markers.push_back(std::make_unique<std::atomic<bool>>(false));
    return markers.back().get();
  }
  static void finish(CollectiveWatchdog::Marker marker) { static_cast<std::atomic<bool>*>(marker)->store(true); }

  CollectiveWatchdog::Backend backend() {
    CollectiveWatchdog::Backend b;
    b.finished = [](CollectiveWatchdog::Marker m) { return static_cast<std::atomic<bool>*>(m)->load(); };
    b.async_error = [this]() -> std::optional<std::string> {
      if (broken) return std::string("remote process exited or there was a network error");
      return std::nullopt;
    };
    b.abort = [this] {
      ++aborts;
      std::lock_guard<std::mutex> lock(mutex);
      for (auto& m : markers) m->store(true);
    };
    return b;
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CollectiveWatchdog, FinishedWorkWaitsAndRecyclesMarkersWithoutAbort) {
  FakeBackend fake;
  CollectiveWatchdog watchdog(fake.backend(), 2000ms, "NCCL rank 0 of 2");
  auto a = fake.make(), b = fake.make();
  watchdog.watch(a, "all_reduce");
  watchdog.watch(b, "all_gather");
  std::thread gpu([&] {
    std::this_thread::sleep_for(20ms);
    FakeBackend::finish(a);
    FakeBackend::finish(b);
  });
  watchdog.wait_all();  // returns once the last marker finished
  gpu.join();
  EXPECT_EQ(fake.aborts, 0);
  EXPECT_FALSE(watchdog.error());
  EXPECT_EQ(watchdog.watched(), 2);
  // The thread retires finished markers for reuse (polls every 0.5 ms).
  std::vector<CollectiveWatchdog::Marker> back;
  for (auto deadline = Clock::now() + 2s; back.size() < 2 && Clock::now() < deadline;) {
    auto more = watchdog.take_finished();
    back.insert(back.end(), more.begin(), more.end());
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0], a);
  EXPECT_EQ(back[1], b);
}

TEST(CollectiveWatchdog, StalledCollectiveAbortsWithinTheTimeoutAndFailsWithOneLine) {
  FakeBackend fake;
  const auto timeout = 200ms;
  CollectiveWatchdog watchdog(fake.backend(), timeout, "NCCL rank 1 of 2");
  watchdog.watch(fake.make(), "all_reduce");
  watchdog.watch(fake.make(), "all_gather");  // never finishes: a peer stalled
  const auto start = Clock::now();
  const std::string message = error_of([&] { watchdog.wait_all(); });
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, timeout);
  EXPECT_LT(waited, timeout + 2s) << "the forward must fail soon after the timeout";
  EXPECT_EQ(fake.aborts, 1);
  EXPECT_NE(message.find("NCCL rank 1 of 2"), std::string::npos) << message;
  EXPECT_NE(message.find("all_reduce #1"), std::string::npos) << message;  // the oldest unfinished one
  EXPECT_NE(message.find("200 ms"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  // Every later use fails with the same error; the backend is aborted once.
  EXPECT_EQ(error_of([&] { watchdog.check(); }), message);
  EXPECT_EQ(error_of([&] { watchdog.watch(fake.make(), "all_reduce"); }), message);
  EXPECT_EQ(error_of([&] { watchdog.wait_all(); }), message);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(fake.aborts, 1);
}

TEST(CollectiveWatchdog, BackendErrorAbortsAtOnce) {
  FakeBackend fake;
  CollectiveWatchdog watchdog(fake.backend(), 60s, "NCCL rank 0 of 4");
  watchdog.watch(fake.make(), "all_gather");
  fake.broken = true;
  const auto start = Clock::now();
  const std::string message = error_of([&] { watchdog.wait_all(); });
  EXPECT_LT(Clock::now() - start, 5s) << "an error reported by the backend must not wait for the timeout";
  EXPECT_EQ(fake.aborts, 1);
  EXPECT_NE(message.find("all_gather failed: remote process exited"), std::string::npos) << message;
}

TEST(CollectiveWatchdog, QueuedWorkIsNoStallWhileItProgresses) {
  // Ten collectives of 80 ms each behind one another: 800 ms in all, beyond a
  // 300 ms timeout, yet each finishes within 300 ms of the one before.
  FakeBackend fake;
  CollectiveWatchdog watchdog(fake.backend(), 300ms, "NCCL rank 0 of 2");
  std::vector<CollectiveWatchdog::Marker> queue;
  for (int i = 0; i < 10; ++i) {
    queue.push_back(fake.make());
    watchdog.watch(queue.back(), "all_reduce");
  }
  std::thread gpu([&] {
    for (auto m : queue) {
      std::this_thread::sleep_for(80ms);
      FakeBackend::finish(m);
    }
  });
  EXPECT_EQ(error_of([&] { watchdog.wait_all(); }), "");
  gpu.join();
  EXPECT_EQ(fake.aborts, 0);
}

TEST(CollectiveWatchdog, IdleTimeBetweenForwardsIsNoStall) {
  FakeBackend fake;
  CollectiveWatchdog watchdog(fake.backend(), 100ms, "NCCL rank 0 of 2");
  auto a = fake.make();
  watchdog.watch(a, "all_reduce");
  FakeBackend::finish(a);
  watchdog.wait_all();
  std::this_thread::sleep_for(300ms);  // the host does something else
  auto b = fake.make();
  watchdog.watch(b, "all_reduce");
  FakeBackend::finish(b);
  EXPECT_EQ(error_of([&] { watchdog.wait_all(); }), "");
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(fake.aborts, 0);
}

}  // namespace
}  // namespace frag::runtime
