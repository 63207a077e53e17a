//===- runtime/current.h - The object ops use on this thread -----*- C++ -*-===//
//
// Op kernels cannot take extra arguments, so they find their rank context and
// intervention runtime through "the current one": a thread-local one when a
// scope set it (ShardedModel, tests with one thread per rank), else the
// process-wide one (a plain torch.jit.load user), else none.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <memory>
#include <mutex>

namespace frag::runtime {

template <typename T>
class Current {
 public:
  /// The thread's object, else the process's, else nullptr.
  static T* get() {
    if (thread_value_) return thread_value_.get();
    std::lock_guard<std::mutex> lock(process_mutex_);
    return process_value_.get();
  }
  /// Sets the process-wide object; returns the previous one.
  static std::shared_ptr<T> set_process(std::shared_ptr<T> value) {
    std::lock_guard<std::mutex> lock(process_mutex_);
    std::swap(process_value_, value);
    return value;
  }

  /// Makes `value` current on this thread while it lives.
  class Scope {
   public:
    explicit Scope(std::shared_ptr<T> value) : previous_(std::move(thread_value_)) {
      thread_value_ = std::move(value);
    }
    ~Scope() { thread_value_ = std::move(previous_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    std::shared_ptr<T> previous_;
  };

 private:
  static inline thread_local std::shared_ptr<T> thread_value_;
  static inline std::mutex process_mutex_;
  static inline std::shared_ptr<T> process_value_;
};

}  // namespace frag::runtime
