//===- runtime/c10d_work.h - Waiting for a c10d collective, bounded -*- C++ -*-===//
//
// The Gloo communicator and the one over torch.distributed's process group both
// hand collectives to c10d and wait for its Work: one wait, one message.
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/error.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>

namespace frag::runtime {

/// Waits at most `timeout` for `work`; its failure or the timeout: frag::Error "`what()` failed on rank
/// `rank` of `size` (a peer that dies or stays away fails it after the timeout): cause". `what` is called
/// only then: nothing is formatted per collective.
template <class Describe>
void wait_for_work(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout,
                   const Describe& what, int rank, int size) {
  try {
    work->wait(timeout);
  } catch (const std::exception& e) {
    fail("{} failed on rank {} of {} (a peer that dies or stays away fails it after the {} ms timeout): {}", what(),
         rank, size, timeout.count(), first_line(e.what()));
  }
}

}  // namespace frag::runtime
