//===- runtime/safetensors.cpp - Read and write .safetensors files -------===//
#include "runtime/safetensors.h"

#include "ir/error.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <fstream>
#include <vector>

namespace frag::runtime {
namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
};

constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},    {at::kBool, "BOOL"},
};

const char* dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes)
    if (d.type == type) return d.name;
  fail("safetensors cannot hold tensors of dtype {}", c10::toString(type));
}

at::ScalarType dtype_of(const std::string& path, const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  fail("{}: unsupported safetensors dtype '{}'", path, name);
}

}  // namespace

std::string safetensors_bytes(const TensorMap& tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  size_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    auto cpu = tensor.detach().to(torch::kCPU).contiguous();
    size_t bytes = cpu.numel() * cpu.element_size();
    header[name] = {{"dtype", dtype_name(cpu.scalar_type())},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(cpu);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  std::string out;
  out.reserve(8 + text.size() + offset);
  uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(static_cast<unsigned char>(length >> (8 * i))));
  out += text;
  for (const auto& t : data)
    out.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  return out;
}

void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string bytes = safetensors_bytes(tensors, metadata);
  const std::string temporary = fmt::format("{}.tmp.{}", path, getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) fail("cannot write {}: {}", temporary, std::strerror(errno));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::remove(temporary.c_str());
      fail("writing {} failed: {}", path, std::strerror(errno));
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::remove(temporary.c_str());
    fail("cannot move {} into place as {}: {}", temporary, path, std::strerror(errno));
  }
}

TensorMap read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail("cannot open {}: {}", path, std::strerror(errno));
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < 8) fail("{}: not a safetensors file (only {} bytes)", path, file_size);
  unsigned char le[8];
  in.read(reinterpret_cast<char*>(le), 8);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(le[i]) << (8 * i);
  if (length > file_size - 8) fail("{}: header length {} runs past the end of the file", path, length);
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail("{}: header is not JSON: {}", path, e.what());
  }
  if (!header.is_object()) fail("{}: header is not a JSON object", path);
  const uint64_t data_size = file_size - 8 - length;
  std::vector<char> data(data_size);
  in.read(data.data(), static_cast<std::streamsize>(data_size));
  if (!in) fail("{}: file is truncated", path);
  TensorMap tensors;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      const std::string dtype = entry.at("dtype").get<std::string>();
      auto type = dtype_of(path, dtype);
      // The shape's entries are checked as JSON first: a float or a number past int64 would be converted
      // silently (and a float out of range is undefined behaviour).
      const auto& shape_json = entry.at("shape");
      if (!shape_json.is_array())
        fail("{}: tensor '{}' has shape {}; expected a list of sizes", path, name, shape_json.dump());
      std::vector<int64_t> shape;
      for (const auto& dim : shape_json) {
        if (!dim.is_number_integer() || (dim.is_number_unsigned() && dim.get<uint64_t>() > INT64_MAX))
          fail("{}: tensor '{}' has shape {}: {} is not a size (a whole number below 2^63)", path, name,
               shape_json.dump(), dim.dump());
        shape.push_back(dim.get<int64_t>());
      }
      auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      // The size from the header is checked before anything is allocated: a hostile or corrupt shape
      // (negative, or overflowing) is an error, not an allocation. The element count must fit int64 even
      // where a dim is 0 (LibTorch refuses such a shape itself, with a message naming neither file nor tensor).
      uint64_t bytes = c10::elementSize(type);
      uint64_t elements = 1;
      for (const int64_t dim : shape) {
        if (dim < 0)
          fail("{}: tensor '{}' has a negative dimension {} in its shape [{}]", path, name, dim, fmt::join(shape, ", "));
        if (dim == 0) continue;
        if (elements > static_cast<uint64_t>(INT64_MAX) / static_cast<uint64_t>(dim))
          fail("{}: tensor '{}' has shape [{}], whose element count overflows int64", path, name,
               fmt::join(shape, ", "));
        elements *= static_cast<uint64_t>(dim);
        if (bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(dim))
          fail("{}: tensor '{}' has shape [{}] of {}, whose size in bytes overflows", path, name,
               fmt::join(shape, ", "), dtype);
        bytes *= static_cast<uint64_t>(dim);
      }
      if (std::find(shape.begin(), shape.end(), 0) != shape.end()) bytes = 0;
      if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] > data_size ||
          offsets[1] - offsets[0] != bytes)
        fail("{}: tensor '{}' has data offsets that do not fit its shape or the file", path, name);
      auto tensor = torch::empty(shape, torch::TensorOptions().dtype(type));
      if (bytes > 0) std::memcpy(tensor.data_ptr(), data.data() + offsets[0], bytes);
      tensors[name] = tensor;
    } catch (const nlohmann::json::exception& e) {
      fail("{}: tensor '{}' has a malformed entry: {}", path, name, e.what());
    }
  }
  return tensors;
}

}  // namespace frag::runtime
