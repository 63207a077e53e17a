//===- cli/text_tokenizer.cpp - Text <-> token ids for frag run --------===//
#include "cli/text_tokenizer.h"

#include "ir/error.h"

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace frag::cli {
namespace {

// Reads one JSON request on stdin, writes one JSON answer on stdout; a failure
// exits non-zero with one line on stderr.
constexpr const char* kBridge = R"PY(
import json, sys
try:
    from tokenizers import Tokenizer
except ImportError:
    sys.exit("the Python package 'tokenizers' is not installed for %s (tools/install_deps.sh installs it)"
             % sys.executable)
request = json.load(sys.stdin)
try:
    tokenizer = Tokenizer.from_file(request["file"])
except Exception as e:
    sys.exit("%s: not a tokenizer file: %s" % (request["file"], str(e).splitlines()[0]))
if request["op"] == "encode":
    answer = [tokenizer.encode(text).ids for text in request["texts"]]
else:
    answer = [tokenizer.decode(ids, skip_special_tokens=False) for ids in request["ids"]]
json.dump(answer, sys.stdout)
)PY";

bool is_executable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the child stopped reading: its exit status tells why
    done += static_cast<size_t>(n);
  }
}

std::string read_all(int fd) {
  std::string out;
  char buffer[65536];
  for (;;) {
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

/// Runs the bridge script on `request`; returns its parsed answer.
nlohmann::json run_bridge(const nlohmann::json& request) {
  const std::string python = project_python();
  int in[2], out[2], err[2];
  if (pipe(in) != 0 || pipe(out) != 0 || pipe(err) != 0) fail("tokenizer: cannot make pipes: {}", std::strerror(errno));
  pid_t pid = fork();
  if (pid < 0) fail("tokenizer: cannot start {}: {}", python, std::strerror(errno));
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1]}) close(fd);
    execlp(python.c_str(), python.c_str(), "-c", kBridge, static_cast<char*>(nullptr));
    std::fprintf(stderr, "cannot run %s: %s\n", python.c_str(), std::strerror(errno));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  close(err[1]);
  // The bridge reads all of stdin before it writes: write, close, then read.
  write_all(in[1], request.dump());
  close(in[1]);
  std::string answer = read_all(out[0]);
  std::string error = read_all(err[0]);
  close(out[0]);
  close(err[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    while (!error.empty() && (error.back() == '\n' || error.back() == '\r')) error.pop_back();
    auto last = error.rfind('\n');
    fail("tokenizer ({} with Hugging Face tokenizers): {}", python,
         error.empty() ? "exited with an error" : error.substr(last == std::string::npos ? 0 : last + 1));
  }
  try {
    return nlohmann::json::parse(answer);
  } catch (const nlohmann::json::exception&) {
    fail("tokenizer ({}): its answer is not JSON", python);
  }
}

}  // namespace

std::string project_python() {
  if (const char* python = std::getenv("FRAG_PYTHON"); python != nullptr && *python) return python;
  if (const char* venv = std::getenv("FRAG_VENV"); venv != nullptr && *venv) return std::string(venv) + "/bin/python";
  if (const char* home = std::getenv("HOME"); home != nullptr) {
    std::string venv_python = std::string(home) + "/.cache/fragments/venv/bin/python";
    if (is_executable(venv_python)) return venv_python;
  }
  return "python3";
}

TextTokenizer::TextTokenizer(std::string folder) : folder_(std::move(folder)) {
  const std::string file = folder_ + "/tokenizer.json";
  struct stat info {};
  if (stat(file.c_str(), &info) != 0 || !S_ISREG(info.st_mode))
    fail("{}: no tokenizer.json (a checkpoint imported with `python3 -m fragkit.checkpoint` has one in "
         "<out>/tokenizer; give another folder with --tokenizer)",
         folder_);
}

std::string TextTokenizer::folder_beside(const std::string& rank_file) {
  auto parent = std::filesystem::path(rank_file).parent_path();
  return (parent.empty() ? std::filesystem::path(".") : parent).append("tokenizer").string();
}

std::vector<std::vector<int64_t>> TextTokenizer::encode_rows(const std::vector<std::string>& prompts) const {
  auto answer = run_bridge({{"op", "encode"}, {"file", folder_ + "/tokenizer.json"}, {"texts", prompts}});
  auto rows = answer.get<std::vector<std::vector<int64_t>>>();
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i].empty()) fail("prompt {} gives no tokens", i + 1);
  return rows;
}

torch::Tensor TextTokenizer::encode(const std::vector<std::string>& prompts) const {
  auto rows = encode_rows(prompts);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].size() != rows[0].size()) {
      std::string lengths;
      for (size_t j = 0; j < rows.size(); ++j)
        lengths += fmt::format("{}prompt {}: {} tokens", j ? ", " : "", j + 1, rows[j].size());
      fail("the prompts tokenize to different lengths ({}); a forward's batch must be of equal lengths: "
           "--generate batches them from a KV cache, or run them one at a time",
           lengths);
    }
  }
  auto ids = torch::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())}, torch::kLong);
  auto view = ids.accessor<int64_t, 2>();
  for (size_t b = 0; b < rows.size(); ++b)
    for (size_t t = 0; t < rows[b].size(); ++t) view[b][t] = rows[b][t];
  return ids;
}

std::vector<std::string> TextTokenizer::decode(const torch::Tensor& ids) const {
  auto cpu = ids.to(torch::kCPU, torch::kLong).contiguous();
  std::vector<std::vector<int64_t>> rows;
  for (int64_t b = 0; b < cpu.size(0); ++b) {
    auto row = cpu[b];
    rows.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
  }
  return run_bridge({{"op", "decode"}, {"file", folder_ + "/tokenizer.json"}, {"ids", rows}})
      .get<std::vector<std::string>>();
}

}  // namespace frag::cli
