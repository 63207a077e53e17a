//===- cli/launcher.h - Start N local ranks as processes -------*- C++ -*-===//
//
// `frag run --world N` starts N copies of itself with torchrun's variables
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT) and waits
// for them. If a rank fails, the others get a bounded time to fail too (they
// will, through the collective timeout) and are then killed. The ranks' stdout and
// stderr come through the launcher a whole line at a time, so that lines of
// different ranks never cut into each other.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace frag::cli {

/// Runs `arguments` (argv without argv[0]) as `world` ranks of this executable.
/// Returns 0 when every rank exits 0, else the first failing rank's status (≥1).
int launch_local_ranks(int world, const std::vector<std::string>& arguments,
                       std::chrono::milliseconds timeout);

/// A TCP port on 127.0.0.1 that was free a moment ago.
int find_free_port();

}  // namespace frag::cli
