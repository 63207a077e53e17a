//===- runtime/safetensors.h - Read and write .safetensors files -*- C++ -*-===//
//
// safetensors is the format Python users read tensors from (the `safetensors`
// package, numpy, HF). A file is an 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets}} and the raw bytes. Outputs are
// written atomically: to a temporary file in the same folder, then renamed.
//
//===----------------------------------------------------------------------===//
#pragma once

#include <torch/types.h>

#include <map>
#include <string>

namespace frag::runtime {

/// Named tensors, sorted by name (the order they are written in).
using TensorMap = std::map<std::string, torch::Tensor>;

/// The bytes of a safetensors file holding `tensors` (moved to CPU, contiguous).
std::string safetensors_bytes(const TensorMap& tensors, const std::map<std::string, std::string>& metadata = {});

/// Writes `tensors` (moved to CPU, contiguous) to `path` atomically.
void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// Reads every tensor of `path`; a malformed file is a frag::Error naming it.
TensorMap read_safetensors(const std::string& path);

}  // namespace frag::runtime
