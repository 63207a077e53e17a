//===- runtime/communicator.cpp - Collectives over one group -------------===//
//
// The shared part of every backend (counting) and the single-rank backend.
//
//===----------------------------------------------------------------------===//
#include "runtime/communicator.h"

namespace frag::runtime {

torch::Tensor Communicator::all_reduce(const torch::Tensor& x) {
  ++collective_count_;
  return do_all_reduce(x);
}

std::vector<torch::Tensor> Communicator::all_gather(const torch::Tensor& x) {
  ++collective_count_;
  return do_all_gather(x);
}

torch::Tensor Communicator::all_gather_stacked(const torch::Tensor& x) {
  ++collective_count_;
  return do_all_gather_stacked(x);
}

namespace {

/// World size 1: the sum of one tensor is itself; the gather of one is a list of it.
class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  bool capturable() const override { return true; }

 protected:
  torch::Tensor do_all_reduce(const torch::Tensor& x) override { return x.clone(); }
  std::vector<torch::Tensor> do_all_gather(const torch::Tensor& x) override { return {x.clone()}; }
  torch::Tensor do_all_gather_stacked(const torch::Tensor& x) override { return x.unsqueeze(0).clone(); }
};

}  // namespace

std::shared_ptr<Communicator> make_single_rank_communicator() {
  return std::make_shared<SingleRankCommunicator>();
}

}  // namespace frag::runtime
