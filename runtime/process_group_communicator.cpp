//===- runtime/process_group_communicator.cpp - Collectives on torch.distributed's groups ===//
//
// In a process where torch.distributed is set up (init_process_group, under
// torchrun), fragments reuses its process group instead of making its own
// communicators: the c10d::ProcessGroup that Python registered is found by
// name (c10d::resolve_process_group) and its backend — Gloo for CPU tensors,
// NCCL for CUDA ones — runs the collectives.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/c10d_work.h"
#include "runtime/communicator.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace frag::runtime {
namespace {

class ProcessGroupCommunicator final : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string name,
                           std::chrono::milliseconds timeout)
      : group_(std::move(group)), name_(std::move(name)), timeout_(timeout) {}

  int rank() const override { return group_->getRank(); }
  int size() const override { return group_->getSize(); }
  std::string backend() const override { return group_->getBackendName(); }

 protected:
  torch::Tensor do_all_reduce(const torch::Tensor& x) override {
    std::vector<at::Tensor> tensors{x.contiguous().clone()};
    wait(group_->allreduce(tensors), "all_reduce");
    return tensors[0];
  }
  std::vector<torch::Tensor> do_all_gather(const torch::Tensor& x) override {
    std::vector<at::Tensor> input{x.contiguous()};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < size(); ++r) output[0].push_back(torch::empty_like(input[0]));
    wait(group_->allgather(output, input), "all_gather");
    return output[0];
  }

 private:
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
    wait_for_work(
        work, timeout_, [&] { return fmt::format("{} on torch.distributed's group '{}'", what, name_); }, rank(), size());
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string name_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::shared_ptr<Communicator> make_process_group_communicator(const std::string& group_name,
                                                              std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(group_name);
  } catch (const std::exception& e) {
    fail("no torch.distributed process group named '{}' in this process: {}", group_name, first_line(e.what()));
  }
  return std::make_shared<ProcessGroupCommunicator>(std::move(group), group_name, timeout);
}

}  // namespace frag::runtime
