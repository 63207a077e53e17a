//===- program/pt2_nativert_program.cpp - A .pt2 rank file run by NativeRT in C++ ===//
#include "program/pt2_nativert_program.h"

#include "ir/error.h"
#include "passes/bind_group_ids.h"
#include "passes/bind_location_ids.h"
#include "program/pt2_program.h"
#include "runtime/pt2_archive.h"
#include "runtime/rank_module.h"

#include <torch/version.h>

// FRAG_WITH_NATIVERT (CMake probes libtorch_cpu; Bazel builds against torch 2.11, which has it): PyTorch 2.13's
// wheels ship NativeRT's header without its code, so there a .pt2 is refused here in one line.
#ifndef FRAG_WITH_NATIVERT
#define FRAG_WITH_NATIVERT 1
#endif
#if FRAG_WITH_NATIVERT
#include <torch/nativert/ModelRunnerHandle.h>
#else
namespace torch::nativert {
class ModelRunnerHandle {};  // this LibTorch has none; never made (load refuses first)
}  // namespace torch::nativert
#endif

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <mutex>

namespace frag::program {
namespace {

/// Writes `bytes` to a fresh private temporary file and returns its path.
std::string temporary_archive(const std::string& bytes, const std::string& source) {
  std::string name = (std::filesystem::temp_directory_path() / "frag-bound-XXXXXX.pt2").string();
  const int fd = mkstemps(name.data(), 4);
  if (fd < 0) fail("{}: cannot create a temporary file for the bound archive in {}", source, name);
  const char* data = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t written = ::write(fd, data, left);
    if (written <= 0) {
      ::close(fd);
      std::remove(name.c_str());
      fail("{}: cannot write the bound archive to {} (disk full?)", source, name);
    }
    data += written;
    left -= static_cast<size_t>(written);
  }
  ::close(fd);
  return name;
}

/// Sends this process's stdout to /dev/null while it lives: PyTorch 2.11's NativeRT prints the graph
/// signature to stdout when it loads a package, and frag's stdout is the user's (a generated text, say).
/// One at a time: ranks on threads (the C++ API) loading at once would save each other's /dev/null.
class SilencedStdout {
 public:
  SilencedStdout() : one_at_a_time_(mutex()) {
    std::fflush(stdout);
    saved_ = ::dup(STDOUT_FILENO);
    const int null = ::open("/dev/null", O_WRONLY);
    if (saved_ >= 0 && null >= 0) ::dup2(null, STDOUT_FILENO);
    if (null >= 0) ::close(null);
  }
  ~SilencedStdout() {
    std::fflush(stdout);
    if (saved_ >= 0) {
      ::dup2(saved_, STDOUT_FILENO);
      ::close(saved_);
    }
  }
  SilencedStdout(const SilencedStdout&) = delete;
  SilencedStdout& operator=(const SilencedStdout&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::lock_guard<std::mutex> one_at_a_time_;
  int saved_ = -1;
};

}  // namespace

std::shared_ptr<Pt2NativeRtProgram> Pt2NativeRtProgram::load(runtime::RankContext& context, const std::string& path,
                                                       const torch::Device& device, const std::string& rules_file) {
  PreparedPt2 prepared = prepare_pt2_rank(context, path, rules_file);
  std::shared_ptr<Pt2NativeRtProgram> program(new Pt2NativeRtProgram(path, prepared));
  std::string error;
  try {
    if (!device.is_cpu())
      fail("{}: a .pt2 rank file runs on the CPU in frag run and the C++ API (asked for {}); on GPUs load it "
           "with fragments.load in Python",
           path, device.str());
#if !FRAG_WITH_NATIVERT
    fail("{}: this build's LibTorch (torch {}.{}) has no NativeRT, PyTorch's C++ runtime for exported programs "
         "(its wheels leave torch::nativert out from 2.13 on): frag run and the C++ API cannot run a .pt2 here; "
         "load it with fragments.load in Python, or build against torch 2.11",
         path, TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
#endif
    passes::bind_location_ids_pt2(prepared.model, *prepared.locations, path);
    passes::bind_group_ids_pt2(prepared.model, path);
    // NativeRT reads a package from a file: the bound archive goes to a private temporary file, which is
    // removed as soon as it is read (NativeRT keeps the weights in memory).
    const std::string bound =
        temporary_archive(runtime::rewritten_archive(path, prepared.model, {}), path);
    try {
#if FRAG_WITH_NATIVERT
      SilencedStdout silenced;
      program->runner_ = std::make_unique<torch::nativert::ModelRunnerHandle>(bound, "model");
#endif
    } catch (const std::exception& e) {
      std::remove(bound.c_str());
      fail("{}: PyTorch's runtime for exported programs (NativeRT) cannot load it: {}", path,
           runtime::interpreter_message(e.what()));
    }
    std::remove(bound.c_str());
  } catch (const Error& e) {
    error = e.what();
  }
  context.agree("nativert", error);
  return program;
}

Pt2NativeRtProgram::Pt2NativeRtProgram(const std::string& path, PreparedPt2& prepared)
    : Pt2Program(path, prepared) {}

Pt2NativeRtProgram::~Pt2NativeRtProgram() = default;

std::optional<runtime::ModuleTree::Arity> Pt2NativeRtProgram::forward_arity(const std::string& module) const {
  fail("{}: calling {} on its own (a logit lens, a \"call\" step) needs the Python front end for a .pt2 rank file "
       "(fragments.load): frag run and the C++ API run the archive's whole graph (NativeRT)",
       path(), module);
}

torch::Tensor Pt2NativeRtProgram::run(const std::string& module, const std::vector<torch::Tensor>&) const {
  forward_arity(module);
  return {};
}

torch::Tensor Pt2NativeRtProgram::run_graph(const torch::Tensor& input_ids, const CachedStep* step,
                                         const std::vector<ir::LocationId>*, Use) {
  // Every location's ops stay in the graph (NativeRT runs it whole); where nothing waits they are a lookup.
  torch::NoGradGuard no_grad;
  std::vector<c10::IValue> inputs{input_ids};
  if (step != nullptr) inputs.insert(inputs.end(), {step->positions, step->kv_cache, int64_t{0}});
#if FRAG_WITH_NATIVERT
  c10::IValue out = runner_->run(inputs, {});
#else
  c10::IValue out;  // unreachable: load refused
  fail("{}: no NativeRT in this LibTorch", path());
#endif
  if (out.isTensor()) return out.toTensor();
  if (out.isTuple() && !out.toTupleRef().elements().empty()) return out.toTupleRef().elements()[0].toTensor();
  if (out.isList() && out.toListRef().size() > 0) return out.toListRef()[0].toTensor();
  fail("{}: its forward returned {}, not logits", path(), out.tagKind());
}

}  // namespace frag::program
