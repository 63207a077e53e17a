//===- tests/support/model_ranks.h - A sharded model on threads -*- C++ -*-===//
//
// Runs every rank of a reference export as a thread of the test, each with a
// ShardedModel of its rank file over real Gloo (run_ranks of test_support.h).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "program/sharded_model.h"

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace frag::testing {

/// Runs body(rank, model) on every rank of the export `export_name` (one
/// thread per rank file, tp=1 included), each model loaded from its rank file
/// with a context connected as in run_ranks, `timeout` bounding the rendezvous
/// and every collective. Returns each rank's error message, "" for none.
/// `extension`: "pt" (TorchScript) or "pt2" (torch.export archives, run by NativeRT).
std::vector<std::string> on_ranks(const std::string& export_name,
                                  const std::function<void(int rank, program::ShardedModel& model)>& body,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(30),
                                  const std::string& extension = "pt");

}  // namespace frag::testing
