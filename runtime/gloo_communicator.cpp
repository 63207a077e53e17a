//===- runtime/gloo_communicator.cpp - CPU collectives over Gloo ---------===//
//
// Wraps c10d's ProcessGroupGloo, which runs Gloo's ring algorithms over TCP.
// Built only where gloo headers exist (FRAG_WITH_GLOO): Debian's libgloo-dev
// here; PyTorch's pip wheels ship none, so GPU builds use NCCL instead.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/communicator.h"

#ifdef FRAG_WITH_GLOO
#include "runtime/c10d_work.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace frag::runtime {

#ifdef FRAG_WITH_GLOO
namespace {

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank,
                   int size, std::chrono::milliseconds timeout, const std::string& hostname)
      : rank_(rank), size_(size), timeout_(timeout) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    auto scoped = c10::make_intrusive<c10d::PrefixStore>(
        prefix, store);
    group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, rank, size, options);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }

 protected:
  // c10d's Gloo (LibTorch 1.13) has no bfloat16 kernels: sums go through
  // float32 (exact for the inputs, one rounding at the end, the same on every
  // rank), gathers move the 16-bit patterns as float16, which Gloo only copies
  // (bit-exact; it has no int16).
  torch::Tensor do_all_reduce(const torch::Tensor& x) override {
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    std::vector<at::Tensor> tensors{bf16 ? x.to(torch::kFloat) : x.contiguous().clone()};
    wait(group_->allreduce(tensors), "all_reduce");
    return bf16 ? tensors[0].to(torch::kBFloat16) : tensors[0];
  }

  std::vector<torch::Tensor> do_all_gather(const torch::Tensor& x) override {
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    std::vector<at::Tensor> input{bf16 ? x.contiguous().view(torch::kHalf) : x.contiguous()};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < size_; ++r) output[0].push_back(torch::empty_like(input[0]));
    wait(group_->allgather(output, input), "all_gather");
    if (bf16)
      for (auto& piece : output[0]) piece = piece.view(torch::kBFloat16);
    return output[0];
  }

  // Gloo copies its result into the output tensors: let them be one buffer's rows.
  torch::Tensor do_all_gather_stacked(const torch::Tensor& x) override {
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    std::vector<at::Tensor> input{bf16 ? x.contiguous().view(torch::kHalf) : x.contiguous()};
    std::vector<int64_t> shape{size_};
    for (auto d : input[0].sizes()) shape.push_back(d);
    auto buffer = torch::empty(shape, input[0].options());
    std::vector<std::vector<at::Tensor>> output{buffer.unbind(0)};
    wait(group_->allgather(output, input), "all_gather");
    return bf16 ? buffer.view(torch::kBFloat16) : buffer;
  }

 private:
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
    wait_for_work(work, timeout_, [&] { return fmt::format("gloo {}", what); }, rank_, size_);
  }

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

}  // namespace

bool have_gloo() { return true; }

std::shared_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& hostname) {
  try {
    return std::make_shared<GlooCommunicator>(store, prefix, rank, size, timeout, hostname);
  } catch (const frag::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("could not connect gloo group '{}' (rank {} of {}) within {} ms: {}", prefix, rank, size,
         timeout.count(), first_line(e.what()));
  }
}

#else

bool have_gloo() { return false; }

std::shared_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>&,
                                                     const std::string&, int, int,
                                                     std::chrono::milliseconds,
                                                     const std::string&) {
  fail("this build of fragments has no Gloo backend (built without gloo headers); "
       "run CPU ranks with a build made against Debian's libtorch and libgloo-dev, "
       "or put the model on CUDA to use NCCL");
}

#endif

}  // namespace frag::runtime
