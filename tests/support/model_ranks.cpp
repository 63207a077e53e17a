//===- tests/support/model_ranks.cpp - A sharded model on threads --------===//
#include "tests/support/model_ranks.h"

#include "tests/support/test_support.h"

namespace frag::testing {

std::vector<std::string> on_ranks(const std::string& export_name,
                                  const std::function<void(int rank, program::ShardedModel& model)>& body,
                                  std::chrono::milliseconds timeout, const std::string& extension) {
  const auto files = model_files(export_name, extension);
  return run_ranks(static_cast<int>(files.size()), timeout,
                   [&](int rank, const std::shared_ptr<runtime::RankContext>& context) {
                     auto model = program::ShardedModel::load(context, files[rank]);
                     body(rank, model);
                   });
}

}  // namespace frag::testing
