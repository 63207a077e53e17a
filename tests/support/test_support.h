//===- tests/support/test_support.h - Paths, subprocesses and ranks -*- C++ -*-===//
//
// Tests find built files (exports, the frag binary) relative to a data root:
// $FRAG_TEST_DATA if set (CMake sets it to the build folder), else the current
// folder (Bazel runs tests in their runfiles tree, where the same relative
// paths hold).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "runtime/communicator.h"
#include "runtime/rank_context.h"

#include <torch/cuda.h>  // torch::cuda::is_available

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

/// Skips a test that runs several CPU ranks where this build has no Gloo
/// (PyTorch's pip wheels ship no gloo headers; the GPU machine's CMake build).
/// The skip is reported by GoogleTest and counted by tools/summarize_tests.py.
#define FRAG_REQUIRE_GLOO()                                                                       \
  if (!::frag::runtime::have_gloo())                                                              \
  GTEST_SKIP() << "needs several CPU ranks over Gloo, and this build has no Gloo backend "        \
                  "(built without gloo headers, as against PyTorch's pip wheels)"

/// Whether this build runs .pt2 rank files in C++: CMake defines FRAG_WITH_NATIVERT from a probe of
/// libtorch_cpu (torch 2.13's wheels ship NativeRT's header without its code); Bazel builds against
/// torch 2.11, which has it, and leaves it undefined.
#if defined(FRAG_WITH_NATIVERT) && !FRAG_WITH_NATIVERT
#define FRAG_TEST_NATIVERT 0
#else
#define FRAG_TEST_NATIVERT 1
#endif

/// Skips a test that runs a .pt2 in C++ where this LibTorch has no NativeRT (frag_run_pt2_test checks the
/// one-line refusal there instead).
#define FRAG_REQUIRE_NATIVERT()                                                                     \
  if (!FRAG_TEST_NATIVERT)                                                                          \
  GTEST_SKIP() << "runs a .pt2 rank file in C++, and this LibTorch has no NativeRT (torch 2.13's "  \
                  "wheels leave it out; frag run refuses a .pt2 there in one line)"

/// Skips a test that needs a CUDA device.
#define FRAG_REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device; this machine has none"

namespace frag::testing {

/// `relative` under the data root.
std::string data_path(const std::string& relative);

/// The frag executable.
std::string frag_binary();

/// Rank files of a reference export, e.g. model_files("llama_tp2") -> {…/rank0.pt, …/rank1.pt};
/// `extension` "pt2" for its torch.export archives (model_files("llama_tp2_pt2", "pt2")).
std::vector<std::string> model_files(const std::string& export_name, const std::string& extension = "pt");

/// A fresh empty folder for one test's outputs, removed when the process that made it exits
/// (FRAG_KEEP_WORK=1 keeps it).
std::string temporary_folder();
/// Removes a flat folder (temporary_folder's). Not std::filesystem::remove_all: libtorch exports a copy
/// of it that the dynamic linker may pick, and that copy crashed in a test here.
void remove_flat_folder(const std::string& folder);

struct CommandResult {
  int exit_code = -1;
  std::string output;  ///< stdout and stderr, interleaved
  std::chrono::milliseconds elapsed{0};
};

/// Runs argv[0] with argv, extra environment variables set, and a hard limit
/// (the process is killed past it and exit_code is -1).
CommandResult run_command(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& environment = {},
                          std::chrono::seconds limit = std::chrono::seconds(120));

/// Writes `text` to `path`.
void write_text(const std::string& path, const std::string& text);

/// The bytes of the file at `path` ("" if it cannot be read).
std::string read_text(const std::string& path);

/// The lines of `text`, without their newlines.
std::vector<std::string> lines_of(const std::string& text);

/// What one run of the frag binary printed, stdout and stderr apart.
struct FragOutput {
  int exit_code = -1;
  std::string out;  ///< stdout only
  std::string err;  ///< stderr only
};

/// Runs `frag ARGS...` (frag_binary()) with the hard limit of run_command.
FragOutput frag(const std::vector<std::string>& args, std::chrono::seconds limit = std::chrono::seconds(120));

/// Runs body(rank, context) for every rank of a `world`-rank group, each rank
/// a thread of this process with its own RankContext, connected through a TCP
/// store on a free local port and Gloo (real sockets, as between processes),
/// `timeout` bounding the rendezvous and every collective. The context is not
/// made current on the thread: a body that runs frag:: ops outside a
/// ShardedModel sets a ScopedRankContext itself. Returns each rank's error
/// message, "" for none.
std::vector<std::string> run_ranks(
    int world, std::chrono::milliseconds timeout,
    const std::function<void(int rank, const std::shared_ptr<runtime::RankContext>& context)>& body);

}  // namespace frag::testing
