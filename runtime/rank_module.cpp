//===- runtime/rank_module.cpp - One rank's exported module --------------===//
#include "runtime/rank_module.h"

#include "runtime/forward_arguments.h"

#include "ir/error.h"
#include "runtime/cuda_graph.h"
#include "runtime/rank_context.h"

#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/codegen/fuser/interface.h>
#include <torch/csrc/jit/serialization/import.h>  // torch::jit::load

#include <sys/stat.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <new>
#include <sstream>

namespace frag::runtime {
namespace {

ExportInfo read_export_info(const std::string& path, const torch::jit::Module& module,
                            const std::string& json_text) {
  ExportInfo info;
  if (!json_text.empty()) {
    try {
      auto json = nlohmann::json::parse(json_text);
      info.export_id = json.value("export_id", "");
      info.tp_size = json.at("tp_size").get<int64_t>();
      info.tp_rank = json.at("tp_rank").get<int64_t>();
      info.model = json.value("model", "");
      return info;
    } catch (const std::exception& e) {
      fail("{}: extra file {} is malformed: {}", path, kExportInfoFile, e.what());
    }
  }
  if (!module.hasattr("tp_size") || !module.hasattr("tp_rank"))
    fail("{}: no {} and no tp_size/tp_rank attributes on the root module; export it with fragkit "
         "(tools/export_model.py or fragkit.export.export)",
         path, kExportInfoFile);
  info.tp_size = module.attr("tp_size").toInt();
  info.tp_rank = module.attr("tp_rank").toInt();
  return info;
}

}  // namespace

bool is_torch_export_archive(const std::string& path) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    if (!reader.hasRecord("archive_format")) return false;
    auto [data, size] = reader.getRecord("archive_format");
    return std::string(static_cast<const char*>(data.get()), size) == "pt2";
  } catch (const c10::Error&) {
    return false;
  }
}

RankModule load_rank_module(const std::string& path, const torch::Device& device) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) fail("{}: cannot open file: {}", path, std::strerror(errno));
  // Checked before opening: a FIFO or a device would block the open or the read forever.
  if (!S_ISREG(info.st_mode)) fail("{}: the model file must be a regular file, but it is not (not opened)", path);
  if (!std::ifstream(path).good()) fail("{}: cannot open file", path);
  RankModule result;
  result.path = path;
  torch::jit::ExtraFilesMap extra{{kExportInfoFile, ""}, {kRuleTableFile, ""}};
  try {
    // Without the debug records (code/*.debug_pkl: where each node came from in the original Python):
    // LibTorch 2.11 indexes their tables unchecked, and damaged ones crashed it (SIGSEGV in
    // SourceRangeDeserializer, found by tests/fuzz/archive_fuzzer). Errors raised inside TorchScript
    // code still name the line of the archive's own code/.
    result.module = torch::jit::load(path, device, extra, /*load_debug_files=*/false);
  } catch (const c10::Error& e) {
    if (is_torch_export_archive(path))
      fail("{}: a torch.export archive (.pt2), not a TorchScript file: program::ShardedModel::load (frag run) "
           "and fragments.load take both formats",
           path);
    fail("{}: not a loadable TorchScript file: {}", path, first_line(e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    // LibTorch's unpickler allocates what sizes inside the file say (a memo id, a list length) before
    // reading further: a damaged file asks for more memory than the process may have.
    fail("{}: not a loadable TorchScript file: it asks LibTorch's reader for more memory than this process "
         "can allocate (sizes inside the file are damaged)", path);
  } catch (const std::exception& e) {
    fail("{}: not a loadable TorchScript file: {}", path, first_line(e.what()));
  }
  result.module.eval();
  for (auto& [name, text] : extra)
    if (!text.empty()) result.extra_files[name] = text;
  result.info = read_export_info(path, result.module, extra[kExportInfoFile]);
  return result;
}

void check_export_across_ranks(RankContext& context, const std::string& path, const ExportInfo& info,
                               std::string error) {
  if (error.empty() && info.tp_size != context.world_size())
    error = fmt::format("{} was exported for tp_size {} but the world size is {}", path, info.tp_size,
                        context.world_size());
  else if (error.empty() && info.tp_rank != context.rank())
    error = fmt::format("{} holds tp_rank {} but was given to rank {}: pass the rank files in rank order", path,
                        info.tp_rank, context.rank());
  context.agree("load", error);
  auto ids = context.exchange("export_id", info.export_id);
  for (size_t r = 0; r < ids.size(); ++r)
    if (ids[r] != ids[0])  // every rank sees the same ids: the same error everywhere
      throw RankAgreementError(
          fmt::format("rank files come from different exports: rank 0 has export {} but rank {} has export {}",
                      ids[0].empty() ? "(none)" : ids[0], r, ids[r].empty() ? "(none)" : ids[r]));
}

RankModule load_and_check_rank_module(RankContext& context, const std::string& path,
                                      const torch::Device& device) {
  RankModule result;
  std::string error;
  try {
    result = load_rank_module(path, device);
  } catch (const Error& e) {
    error = e.what();
  }
  check_export_across_ranks(context, path, result.info, error);
  return result;
}

namespace {
/// "X" of a line "[builtins.]NameError: X" or "NameException: X" (a Python exception's last line); empty if
/// the line is not one. Plain string work: std::regex's locale machinery crashed on the GPU machine's
/// libstdc++ inside this very error path, turning a message into a segfault.
std::string raised_text(const std::string& line) {
  const auto colon = line.find(": ");
  if (colon == std::string::npos || colon + 2 >= line.size()) return "";
  std::string name = line.substr(0, colon);
  if (name.rfind("builtins.", 0) == 0) name = name.substr(9);
  for (const char c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return "";
  auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return ends_with("Error") || ends_with("Exception") ? line.substr(colon + 2) : "";
}
}  // namespace

/// The user-facing message inside an error raised through the TorchScript
/// interpreter (which wraps it in a traceback).
std::string interpreter_message(const std::string& text) {
  // A TorchScript `raise X("...")` ends the text with "builtins.XError: ..." after the tracebacks.
  std::istringstream lines(text);
  std::string line, last_raised;
  while (std::getline(lines, line)) {
    auto raised = raised_text(line);
    if (!raised.empty() && line.rfind("RuntimeError: ", 0) != 0) last_raised = std::move(raised);
  }
  if (!last_raised.empty()) return last_raised;
  const std::string marker = "RuntimeError: ";
  auto at = text.rfind(marker);
  std::string message = at == std::string::npos ? text : text.substr(at + marker.size());
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  return first_line(message);
}

namespace {
std::atomic<bool> gpu_fusion_allowed{false};
std::mutex fusion_scope_mutex;
int fusion_scopes = 0;         // live GpuFusionScopes, all threads
bool libtorch_gpu_fusion = true;  // LibTorch's setting before the outermost scope
}  // namespace

void set_gpu_fusion(bool allowed) { gpu_fusion_allowed = allowed; }
bool gpu_fusion() { return gpu_fusion_allowed; }

bool computes_in_half_precision(const torch::jit::Module& module) {
  for (const auto& p : module.parameters())
    if (p.is_floating_point()) return p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf;
  return false;
}

GpuFusionScope::GpuFusionScope(bool half_precision) : active_(half_precision && !gpu_fusion_allowed) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(fusion_scope_mutex);
  if (fusion_scopes++ == 0) libtorch_gpu_fusion = torch::jit::canFuseOnGPU();
  torch::jit::overrideCanFuseOnGPU(false);
}

GpuFusionScope::~GpuFusionScope() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(fusion_scope_mutex);
  if (--fusion_scopes == 0) torch::jit::overrideCanFuseOnGPU(libtorch_gpu_fusion);
}

torch::Tensor run_forward(RankModule& rank_module, const torch::Tensor& input_ids, torch::jit::Function* forward) {
  return run_forward_with(rank_module, input_ids, {}, forward);
}

torch::Tensor run_forward_with(RankModule& rank_module, const torch::Tensor& input_ids,
                               const std::vector<c10::IValue>& extra, torch::jit::Function* forward) {
  torch::NoGradGuard no_grad;
  GpuFusionScope fusion(computes_in_half_precision(rank_module.module));
  // A specialized copy of forward has no defaults of its own: fill them from the module's forward (a
  // forward that takes a KV cache as well as the ids, called with the ids only).
  std::vector<c10::IValue> args{rank_module.module._ivalue(), input_ids};
  args.insert(args.end(), extra.begin(), extra.end());
  const auto& schema = rank_module.module.get_method("forward").function().getSchema();
  for (size_t i = args.size(); i < schema.arguments().size() && schema.arguments()[i].default_value(); ++i)
    args.push_back(*schema.arguments()[i].default_value());
  c10::IValue output;
  try {
    if (forward == nullptr) {
      output = rank_module.module.forward(std::vector<c10::IValue>(args.begin() + 1, args.end()));
    } else {
      output = (*forward)(std::move(args));
    }
    // Collectives run asynchronously (NCCL): one wait per forward, where a
    // failed or timed-out one surfaces, instead of one per collective. A
    // forward being captured has run nothing yet: its replay waits.
    if (!CudaGraph::capturing()) current_rank_context().synchronize();
  } catch (const c10::Error& e) {
    fail("{}: forward failed: {}", rank_module.path, interpreter_message(e.what_without_backtrace()));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("{}: forward failed: {}", rank_module.path, interpreter_message(e.what()));
  }
  if (output.isTensor()) return output.toTensor();
  if (output.isTuple() && !output.toTuple()->elements().empty() &&
      output.toTuple()->elements()[0].isTensor())
    return output.toTuple()->elements()[0].toTensor();
  fail("{}: forward returned {}, expected a logits tensor", rank_module.path, output.tagKind());
}

}  // namespace frag::runtime
