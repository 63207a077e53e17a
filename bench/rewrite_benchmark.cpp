//===- bench/rewrite_benchmark.cpp - How fast is the fragment rewrite? ===//
//
// For llama exports of growing depth (40, 80 and 160 decoder layers at tp 2 by
// default) measures, in one process and side by side:
//   - load:    torch::jit::load of the rank file, without debug records (as frag loads it);
//   - rewrite: passes::rewrite_for_fragments on a fresh load (median and min);
//              also split into its two steps, classify_parallel_layers and
//              insert_fragment_ops, to show where the time goes;
//   - freeze:  LibTorch's own torch::jit::freeze_module on a fresh load of the
//              same file (a pass of comparable scope: it also inlines every
//              submodule call into the root graph);
//   - save:    Module::save of the rewritten module with its rule table;
//   - nodes:   node counts of the root forward graph before and after the
//              rewrite, and after freezing;
//   - file form: what `frag rewrite` saves (passes::rewrite_for_file: the ops
//              in each class's methods), its save beside the original's, and
//              the inlining a load of it runs (passes::inline_fragment_ops); the
//              targets (issue 13) are printed for this form, and --check exits 1
//              when a guarded one is missed (tests/bench:rewrite_benchmark_test);
// and then the growth of the rewrite time with depth (80/40, 160/80; a linear
// pass gives about 2.0). Each depth is measured in a process of its own (this
// program again, --measure-one), from a fresh heap as each `frag rewrite` runs:
// measured in one process, the deeper models ran in a heap the shallower ones
// had grown and fragmented, and every pass (LibTorch's freeze and save too)
// grew faster than its work (--one-process shows it). Then the same model as a torch.export archive (.pt2,
// 80 layers by default, or --pt2 FILE): read (zip + JSON), rewrite
// (classification + insert_fragment_ops_pt2 on the graph JSON) and save
// (the archive copied with the rewritten graph and the table, in memory) beside
// the same copy with the original graph; printed beside the TorchScript row of
// the same depth.
//
//   bazel build //bench:rewrite_benchmark
//   bazel-bin/bench/rewrite_benchmark [--reps N (>= 5)] [--warmup N] [--check] [FILE.pt ...]
//   bazel-bin/bench/rewrite_benchmark --profile-rewrite N FILE.pt   (N rewrites, nothing
//       else, for `perf record`)
//   bazel-bin/bench/rewrite_benchmark --profile-save N FILE.pt   (one rewrite, then N saves
//       of the rewritten module, for `perf record`)
//
// With no files it uses the exports //tests/models:bench_llama_l{40,80,160}_tp2
// (rank 0), found in its runfiles or under bazel-bin/.
//
//===----------------------------------------------------------------------===//
#include "ir/fragment_table.h"
#include "passes/classify_parallel_layers.h"
#include "passes/insert_fragment_ops.h"
#include "passes/rewrite_for_fragments.h"
#include "passes/insert_fragment_ops_pt2.h"
#include "runtime/pt2_archive.h"
#include "runtime/rank_module.h"
#include "bench/reference_exports.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/freeze_module.h>
#include <torch/script.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <fmt/format.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

/// CPU time of this thread in ms: what other jobs on a shared machine cannot inflate by preemption.
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct Stats {
  std::vector<double> samples;
  void add(double ms) { samples.push_back(ms); }
  double median() const {
    if (samples.empty()) return 0;
    auto s = samples;
    std::sort(s.begin(), s.end());
    const size_t n = s.size();
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  }
  double min() const { return samples.empty() ? 0 : *std::min_element(samples.begin(), samples.end()); }
};

size_t count_nodes(const torch::jit::Block* block) {
  size_t n = 0;
  for (const torch::jit::Node* node : block->nodes()) {
    ++n;
    for (const torch::jit::Block* inner : node->blocks()) n += count_nodes(inner);
  }
  return n;
}

size_t count_blocks(const torch::jit::Block* block) {
  size_t n = 1;
  for (const torch::jit::Node* node : block->nodes())
    for (const torch::jit::Block* inner : node->blocks()) n += count_blocks(inner);
  return n;
}

size_t forward_blocks(const torch::jit::Module& module) {
  auto& function = torch::jit::toGraphFunction(module.get_method("forward").function());
  return count_blocks(function.graph()->block());
}

size_t forward_nodes(const torch::jit::Module& module) {
  auto& function = torch::jit::toGraphFunction(module.get_method("forward").function());
  return count_nodes(function.graph()->block());
}

/// As frag loads a rank file (runtime/rank_module.cpp): without its debug records.
torch::jit::Module load(const std::string& path) {
  torch::jit::ExtraFilesMap extra;
  auto module = torch::jit::load(path, torch::kCPU, extra, /*load_debug_files=*/false);
  module.eval();
  return module;
}

struct Result {
  std::string file;
  int64_t layers = 0;  ///< decoder layers (model.layers.N)
  size_t parallel_layers = 0, fragmented = 0;
  Stats load, rewrite, rewrite_cpu, classify, insert, freeze, save, save_original;
  /// frag rewrite's file form (per class): the rewrite, its save, and the inlining a load does.
  Stats file_rewrite, file_rewrite_cpu, file_save, file_save_original, file_inline;
  bool file_per_class = false;
  size_t nodes_before = 0, nodes_rewritten = 0, nodes_frozen = 0, blocks_rewritten = 0;
  uintmax_t bytes = 0;
};

int64_t count_decoder_layers(const torch::jit::Module& module) {
  int64_t n = 0;
  for (const auto& named : module.named_modules()) {
    const std::string prefix = "model.layers.";
    if (named.name.rfind(prefix, 0) == 0 && named.name.find('.', prefix.size()) == std::string::npos) ++n;
  }
  return n;
}

/// Saves `rewritten` (with its table) and a fresh load of the original `path` to `out`, interleaved so both
/// see the same machine load, `rounds` times each.
void time_saves(const torch::jit::Module& rewritten, const frag::ir::FragmentTable& table, const std::string& path,
                const std::string& out, int rounds, Stats& saved, Stats& original_saved) {
  torch::jit::ExtraFilesMap extra{{frag::runtime::kRuleTableFile, frag::ir::to_json(table).dump(1)}};
  auto original = load(path);
  for (int i = 0; i < rounds; ++i) {
    auto start = Clock::now();
    rewritten.save(out, extra);
    saved.add(ms_since(start));
    start = Clock::now();
    original.save(out);
    original_saved.add(ms_since(start));
  }
}

Result measure(const std::string& path, int reps, int warmup, const std::string& scratch) {
  Result r;
  r.file = path;
  r.bytes = std::filesystem::file_size(path);
  const frag::passes::LayerAliases aliases;

  {
    auto module = load(path);
    r.layers = count_decoder_layers(module);
    r.nodes_before = forward_nodes(module);
  }
  std::optional<torch::jit::Module> rewritten, file_form;
  frag::ir::FragmentTable file_table;
  // The file form first, as `frag rewrite` runs it: a load, then the rewrite, in a process that has done
  // nothing else yet (after it, LibTorch's freeze of 160 layers churns gigabytes of heap, which shows in
  // the wall clock of whatever runs next there). One unmeasured round warms the first-use registrations.
  for (int i = -1; i < reps; ++i) {
    auto per_class = load(path);
    auto start = Clock::now();
    const double file_cpu = thread_cpu_ms();
    file_table = frag::passes::rewrite_for_file(per_class, aliases, path);
    if (i < 0) continue;
    r.file_rewrite.add(ms_since(start));
    r.file_rewrite_cpu.add(thread_cpu_ms() - file_cpu);
    r.file_per_class = frag::passes::is_rewritten_per_class(per_class);
    file_form = per_class;
  }
  const std::string out = scratch + "/rewritten.pt";
  // Its save and the original's, also before the freezes.
  time_saves(*file_form, file_table, path, out, std::max(3, reps / 2), r.file_save, r.file_save_original);
  for (int i = 0; i < warmup; ++i) {  // caches, allocator, first-use registrations
    auto a = load(path);
    frag::passes::rewrite_for_fragments(a, aliases, path);
    auto b = load(path);
    torch::jit::freeze_module(b);
  }
  frag::ir::FragmentTable table;
  for (int i = 0; i < reps; ++i) {
    auto start = Clock::now();
    auto module = load(path);
    r.load.add(ms_since(start));

    // The headline number: the whole pipeline on a fresh load.
    start = Clock::now();
    const double cpu = thread_cpu_ms();
    table = frag::passes::rewrite_for_fragments(module, aliases, path);
    r.rewrite.add(ms_since(start));
    r.rewrite_cpu.add(thread_cpu_ms() - cpu);
    r.nodes_rewritten = forward_nodes(module);
    r.blocks_rewritten = forward_blocks(module);
    rewritten = module;

    // LibTorch's own freeze on another fresh load of the same file, same round.
    auto other = load(path);
    start = Clock::now();
    auto frozen = torch::jit::freeze_module(other);
    r.freeze.add(ms_since(start));
    r.nodes_frozen = forward_nodes(frozen);

    // The two steps of the rewrite apart.
    auto split = load(path);
    start = Clock::now();
    auto split_table = frag::passes::classify_parallel_layers(split, aliases, path);
    r.classify.add(ms_since(start));
    start = Clock::now();
    frag::passes::insert_fragment_ops(split, split_table, path);
    r.insert.add(ms_since(start));

  }
  r.parallel_layers = table.layers.size();
  for (const auto& layer : table.layers) r.fragmented += (layer.input ? 1 : 0) + (layer.output ? 1 : 0);

  time_saves(*rewritten, table, path, out, std::max(3, reps / 2), r.save, r.save_original);
  for (int i = 0; i < reps; ++i) {  // what a load of the saved file form adds: inlining it
    auto loaded = load(out);
    auto start = Clock::now();
    frag::passes::inline_fragment_ops(loaded, out);
    r.file_inline.add(ms_since(start));
  }
  std::filesystem::remove(out);
  return r;
}

/// The Stats of a Result, by name: a Result crosses from the measuring child process as JSON.
const std::vector<std::pair<const char*, Stats Result::*>>& stat_fields() {
  static const std::vector<std::pair<const char*, Stats Result::*>> fields{
      {"load", &Result::load},
      {"rewrite", &Result::rewrite},
      {"rewrite_cpu", &Result::rewrite_cpu},
      {"classify", &Result::classify},
      {"insert", &Result::insert},
      {"freeze", &Result::freeze},
      {"save", &Result::save},
      {"save_original", &Result::save_original},
      {"file_rewrite", &Result::file_rewrite},
      {"file_rewrite_cpu", &Result::file_rewrite_cpu},
      {"file_save", &Result::file_save},
      {"file_save_original", &Result::file_save_original},
      {"file_inline", &Result::file_inline}};
  return fields;
}

nlohmann::json encode(const Result& r) {
  nlohmann::json j = {{"file", r.file}, {"layers", r.layers}, {"parallel_layers", r.parallel_layers},
                      {"fragmented", r.fragmented}, {"nodes_before", r.nodes_before},
                      {"nodes_rewritten", r.nodes_rewritten}, {"nodes_frozen", r.nodes_frozen},
                      {"blocks_rewritten", r.blocks_rewritten}, {"bytes", r.bytes},
                      {"file_per_class", r.file_per_class}};
  for (const auto& [name, field] : stat_fields()) j["stats"][name] = (r.*field).samples;
  return j;
}

Result decode(const nlohmann::json& j) {
  Result r;
  r.file = j.at("file");
  r.layers = j.at("layers");
  r.parallel_layers = j.at("parallel_layers");
  r.fragmented = j.at("fragmented");
  r.nodes_before = j.at("nodes_before");
  r.nodes_rewritten = j.at("nodes_rewritten");
  r.nodes_frozen = j.at("nodes_frozen");
  r.blocks_rewritten = j.at("blocks_rewritten");
  r.bytes = j.at("bytes");
  r.file_per_class = j.at("file_per_class");
  for (const auto& [name, field] : stat_fields()) (r.*field).samples = j.at("stats").at(name).get<std::vector<double>>();
  return r;
}

/// measure() in a child process of its own (this program again, with --measure-one): each depth starts from
/// a fresh heap, as each `frag rewrite` does, instead of inheriting the fragments of the depths before it.
Result measure_in_child(const std::string& self, const std::string& path, int reps, int warmup,
                        const std::string& scratch) {
  int out[2];
  if (pipe(out) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    std::vector<std::string> args{self, "--measure-one", "--reps", std::to_string(reps), "--warmup",
                                  std::to_string(warmup), "--scratch", scratch, path};
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (auto& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    execv(self.c_str(), argv.data());
    _exit(127);
  }
  close(out[1]);
  std::string text;
  char buffer[65536];
  for (ssize_t n; (n = read(out[0], buffer, sizeof buffer)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error(fmt::format("the measuring process failed (status {})", status));
  return decode(nlohmann::json::parse(text));
}

/// The .pt2 path of one archive (see the file comment).
struct ExportedResult {
  std::string file;
  int64_t layers = 0;
  size_t fragmented = 0, nodes_before = 0, nodes_rewritten = 0;
  Stats read, rewrite, classify, insert, save, save_original;
  uintmax_t bytes = 0;
};

ExportedResult measure_exported(const std::string& path, int reps, int warmup) {
  ExportedResult r;
  r.file = path;
  r.bytes = std::filesystem::file_size(path);
  const frag::passes::LayerAliases aliases;
  auto program = frag::runtime::read_exported_program(path);
  for (const auto& module : program.modules) {
    const std::string prefix = "model.layers.";
    if (module.path.rfind(prefix, 0) == 0 && module.path.find('.', prefix.size()) == std::string::npos) ++r.layers;
  }
  r.nodes_before = program.model["graph_module"]["graph"]["nodes"].size();
  for (int i = 0; i < warmup; ++i) {
    auto copy = program.model;
    frag::passes::rewrite_pt2_for_fragments(copy, program.modules, aliases, path);
  }
  nlohmann::json rewritten;
  frag::ir::FragmentTable table;
  for (int i = 0; i < reps; ++i) {
    auto start = Clock::now();
    auto fresh = frag::runtime::read_exported_program(path);
    r.read.add(ms_since(start));
    start = Clock::now();
    table = frag::passes::rewrite_pt2_for_fragments(fresh.model, fresh.modules, aliases, path);
    r.rewrite.add(ms_since(start));
    rewritten = std::move(fresh.model);
    auto split = program.model;  // copied outside the timings
    start = Clock::now();
    auto split_table = frag::passes::classify_parallel_layers(program.modules, aliases, path);
    r.classify.add(ms_since(start));
    start = Clock::now();
    frag::passes::insert_fragment_ops_pt2(split, split_table, path);
    r.insert.add(ms_since(start));
  }
  r.nodes_rewritten = rewritten["graph_module"]["graph"]["nodes"].size();
  for (const auto& layer : table.layers) r.fragmented += (layer.input ? 1 : 0) + (layer.output ? 1 : 0);
  const std::map<std::string, std::string> extra{{frag::runtime::kRuleTableFile, frag::ir::to_json(table).dump(1)}};
  for (int i = 0; i < std::max(3, reps / 2); ++i) {  // interleaved, as for TorchScript
    auto start = Clock::now();
    auto bytes = frag::runtime::rewritten_archive(path, rewritten, extra);
    r.save.add(ms_since(start));
    start = Clock::now();
    bytes = frag::runtime::rewritten_archive(path, program.model, {});
    r.save_original.add(ms_since(start));
  }
  return r;
}

/// A target of issue 13 judged on one run. The guarded ones decide --check's exit status (the slow-tier test
/// tests/bench:rewrite_benchmark_test); the others are printed for the reader (bench/README.md says why).
struct Target {
  std::string line;  ///< what, the target's verdict and the numbers
  bool met = false;  ///< the guard's verdict (for the growth, a looser bound than the target's)
  bool guarded = false;
};

/// The bound of the guarded growth (160 layers over 80, thread CPU medians): looser than the target's 2.1,
/// which single runs of this 10-20 ms pass miss (x1.60-x2.43 in wall clock on an idle machine, where the
/// work grows x1.87: bench/README.md); a pass that grows quadratically gives x4.
constexpr double kGrowthGuard = 3.0;

/// The targets on this run's depths: frag rewrite's file form at 80 and 160 layers and its saves.
std::vector<Target> judge_targets(const std::vector<Result>& results) {
  const Result* l80 = nullptr;
  const Result* l160 = nullptr;
  for (const auto& r : results) {
    if (r.layers == 80) l80 = &r;
    if (r.layers == 160) l160 = &r;
  }
  std::vector<Target> targets;
  const auto verdict = [](bool met) { return met ? "MET" : "NOT MET"; };
  // Judged on the pass's thread CPU time: other jobs on a shared machine inflate the wall clock of a 10 ms
  // pass by preempting it, not its CPU time; on an idle machine the two agree (the line prints both).
  if (l80) {
    const double cpu = l80->file_rewrite_cpu.median();
    targets.push_back({fmt::format("frag rewrite of 80 layers <= 20 ms (thread CPU, median): {} ({:.1f} ms; wall "
                                   "{:.1f} median, {:.1f} min)",
                                   verdict(cpu <= 20), cpu, l80->file_rewrite.median(), l80->file_rewrite.min()),
                       cpu <= 20, true});
  } else {
    targets.push_back({"frag rewrite of 80 layers <= 20 ms: NOT MEASURED (no 80-layer file)", false, true});
  }
  if (l80 && l160) {
    const double growth = l160->file_rewrite.median() / l80->file_rewrite.median();
    const double cpu_growth = l160->file_rewrite_cpu.median() / l80->file_rewrite_cpu.median();
    targets.push_back({fmt::format("frag rewrite of 160 layers <= 2.1 x 80 layers: {} (x{:.2f} median wall, x{:.2f} "
                                   "thread CPU; the guard: CPU <= x{:.1f})",
                                   verdict(growth <= 2.1), growth, cpu_growth, kGrowthGuard),
                       cpu_growth <= kGrowthGuard, true});
    const double save_growth = l160->file_save.median() / l80->file_save.median();
    targets.push_back({fmt::format("saving frag rewrite's file linear (160/80 <= 2.1): {} (x{:.2f}; the original's "
                                   "save x{:.2f}: LibTorch's writer)",
                                   verdict(save_growth <= 2.1), save_growth,
                                   l160->file_save_original.median() / l80->file_save_original.median()),
                       save_growth <= 2.1, false});
  }
  double worst = 0;
  for (const auto& r : results) worst = std::max(worst, r.file_save.median() / r.file_save_original.median());
  if (!results.empty())
    targets.push_back({fmt::format("saving frag rewrite's file <= 2 x saving the original at every depth: {} (worst "
                                   "x{:.2f})",
                                   verdict(worst <= 2), worst),
                       worst <= 2, true});
  return targets;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7, warmup = 1, profile_rewrite = 0, profile_save = 0;
  bool file_form = false, measure_one = false, one_process = false, save_original_only = false, check = false;
  std::string scratch_option;
  std::string save_to, pt2;
  std::vector<std::string> files;
  CLI::App app{"Rewrite time vs model depth (rewrite_for_fragments, its two steps, LibTorch's freeze_module, "
               "save), one rank file after another. With no files: rank 0 of the exports "
               "//tests/models:bench_llama_l{40,80,160}_tp2."};
  app.add_option("files", files, "Rank files (FILE.pt), in order of depth")->check(CLI::ExistingFile);
  app.add_option("--reps", reps, "Measured repetitions per file (medians and minima over them)")
      ->capture_default_str()
      ->check(CLI::Range(5, 100000));
  app.add_option("--warmup", warmup, "Unmeasured rewrites and freezes per file before the measured ones")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  app.add_option("--profile-rewrite", profile_rewrite,
                 "Only rewrite the one FILE.pt N times, nothing else, for `perf record` (0: off)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  app.add_option("--profile-save", profile_save,
                 "Only rewrite the one FILE.pt once and save it N times, for `perf record` (0: off)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  app.add_flag("--original", save_original_only,
               "With --profile-save: save the loaded module as it is (LibTorch's writer alone, to compare with)");
  app.add_flag("--file-form", file_form,
               "With --profile-rewrite / --profile-save: frag rewrite's file form (rewrite_for_file), not the inlining "
               "rewrite");
  app.add_flag("--one-process", one_process,
               "Measure every depth in this process (default: each in a process of its own, from a fresh heap)");
  app.add_flag("--check", check,
               "Exit 1 when a guarded target is missed (the slow-tier test tests/bench:rewrite_benchmark_test)");
  app.add_flag("--measure-one", measure_one, "(internal) measure the one FILE.pt and print the result as JSON")
      ->group("");
  app.add_option("--scratch", scratch_option, "(internal) the folder for --measure-one's saves")->group("");
  app.add_option("--save-to", save_to, "With --profile-save: keep the saved rewritten file at this path");
  app.add_option("--pt2", pt2,
                 "A torch.export archive (FILE.pt2) for the .pt2 rows; with no files: rank 0 of "
                 "//tests/models:bench_llama_l80_tp2_pt2; 'none' skips them")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (profile_rewrite > 0 || profile_save > 0) {  // only the pass, or only saving, for a profiler
    if (files.size() != 1) {
      std::cerr << "rewrite_benchmark: --profile-rewrite and --profile-save take one file\n";
      return 2;
    }
    const frag::passes::LayerAliases aliases;
    if (profile_save > 0) {
      auto module = load(files[0]);
      torch::jit::ExtraFilesMap extra;
      if (!save_original_only) {
        auto table = file_form ? frag::passes::rewrite_for_file(module, aliases, files[0])
                               : frag::passes::rewrite_for_fragments(module, aliases, files[0]);
        extra[frag::runtime::kRuleTableFile] = frag::ir::to_json(table).dump(1);
      }
      const std::string out = save_to.empty()
                                  ? (std::filesystem::temp_directory_path() / "rewrite_benchmark_profile.pt").string()
                                  : save_to;
      Stats stats;
      for (int i = 0; i < profile_save; ++i) {
        auto start = Clock::now();
        module.save(out, extra);
        stats.add(ms_since(start));
      }
      if (save_to.empty()) std::filesystem::remove(out);
      std::cout << fmt::format("{}: save of the rewritten module median {:.1f} ms, min {:.1f} ms over {} saves\n",
                               files[0], stats.median(), stats.min(), profile_save);
      return 0;
    }
    std::vector<torch::jit::Module> modules;
    modules.reserve(static_cast<size_t>(profile_rewrite));
    for (int i = 0; i < profile_rewrite; ++i) modules.push_back(load(files[0]));
    Stats stats, cpu;
    for (auto& module : modules) {
      auto start = Clock::now();
      const double cpu_start = thread_cpu_ms();
      if (file_form) frag::passes::rewrite_for_file(module, aliases, files[0]);
      else frag::passes::rewrite_for_fragments(module, aliases, files[0]);
      stats.add(ms_since(start));
      cpu.add(thread_cpu_ms() - cpu_start);
    }
    std::cout << fmt::format("{}: rewrite median {:.1f} ms, min {:.1f} ms, thread cpu median {:.1f} ms over {} runs\n",
                             files[0], stats.median(), stats.min(), cpu.median(), profile_rewrite);
    return 0;
  }
  if (measure_one) {  // the child of measure_in_child
    if (files.size() != 1 || scratch_option.empty()) return 2;
    torch::set_num_threads(1);
    std::cout << encode(measure(files[0], reps, warmup, scratch_option)).dump() << std::endl;
    return 0;
  }
  if (files.empty() && pt2.empty()) {
    if (auto found = frag::bench::find_reference_export(argv[0], "bench_llama_l80_tp2_pt2", "rank0.pt2"))
      pt2 = *found + "/rank0.pt2";
    else
      std::cerr << "rewrite_benchmark: no .pt2 rows: build //tests/models:bench_llama_l80_tp2_pt2 (a manual "
                   "target) or pass --pt2 FILE\n";
  }
  if (pt2 == "none") pt2.clear();
  if (files.empty())
    for (int layers : {40, 80, 160}) files.push_back(frag::bench::reference_export(argv[0], fmt::format("bench_llama_l{}_tp2", layers), "rank0.pt",
                                                                "rewrite_benchmark") +
                                      "/rank0.pt");

  std::string scratch = (std::filesystem::temp_directory_path() / "rewrite_benchmark_XXXXXX").string();
  if (mkdtemp(scratch.data()) == nullptr) {
    std::cerr << "rewrite_benchmark: mkdtemp failed\n";
    return 2;
  }
  torch::set_num_threads(1);  // a graph pass is single threaded; keep the machine's 2 cores quiet

  std::vector<Result> results;
  for (const auto& file : files) {
    std::cerr << "measuring " << file << " (" << reps << " reps) ...\n";
    try {
      results.push_back(one_process ? measure(file, reps, warmup, scratch)
                                    : measure_in_child("/proc/self/exe", file, reps, warmup, scratch));
    } catch (const std::exception& e) {
      std::cerr << "rewrite_benchmark: " << file << ": " << e.what() << "\n";
      std::filesystem::remove_all(scratch);
      return 1;
    }
  }
  std::filesystem::remove_all(scratch);
  std::optional<ExportedResult> exported;
  if (!pt2.empty()) {
    std::cerr << "measuring " << pt2 << " (" << reps << " reps) ...\n";
    try {
      exported = measure_exported(pt2, reps, warmup);
    } catch (const std::exception& e) {
      std::cerr << "rewrite_benchmark: " << pt2 << ": " << e.what() << "\n";
      return 1;
    }
  }

  std::cout << fmt::format("rewrite benchmark: {} reps per file (median / min in ms), LibTorch {}, "
                           "{} intra-op thread(s)\n\n",
                           reps, TORCH_VERSION, torch::get_num_threads());
  std::cout << fmt::format("{:>6} {:>8} {:>6} {:>6}  {:>8}  {:>17} {:>6}  {:>8} {:>8}  {:>8}  {:>7}  {:>9} {:>9} {:>6}  "
                           "{:>7} {:>9} {:>7} {:>7}\n",
                           "layers", "file MB", "par", "frag", "load", "rewrite med/min", "cpu", "classify",
                           "insert", "freeze", "rw/frz", "save orig", "save rw", "sv/so", "nodes", "rewritten",
                           "blocks", "frozen");
  for (const auto& r : results)
    std::cout << fmt::format("{:>6} {:>8.1f} {:>6} {:>6}  {:>8.1f}  {:>8.1f} /{:>7.1f} {:>6.1f}  {:>8.1f} {:>8.1f}  "
                             "{:>8.1f}  {:>7.2f}  {:>9.1f} {:>9.1f} {:>6.2f}  {:>7} {:>9} {:>7} {:>7}\n",
                             r.layers, r.bytes / 1e6, r.parallel_layers, r.fragmented, r.load.median(),
                             r.rewrite.median(), r.rewrite.min(), r.rewrite_cpu.median(), r.classify.median(), r.insert.median(),
                             r.freeze.median(), r.rewrite.median() / r.freeze.median(), r.save_original.median(),
                             r.save.median(), r.save.median() / r.save_original.median(), r.nodes_before,
                             r.nodes_rewritten, r.blocks_rewritten, r.nodes_frozen);
  std::cout << "\n(par = parallel layers, frag = fragmented locations; classify + insert = rewrite; "
               "cpu = median thread CPU time of the rewrite; rw/frz = rewrite median / freeze_module median, same run; save orig / save rw = Module::save "
               "of the original / rewritten module, interleaved; sv/so = their ratio; nodes = root forward "
               "graph before the rewrite, rewritten = after it, nested blocks included; blocks = blocks in the "
               "rewritten graph; frozen = nodes after freeze_module)\n";

  std::cout << fmt::format("\nfrag rewrite's file form (ops in each class's methods, inlined at load; targets: rewrite "
                           "at 80 layers <= 20 ms, 160 <= 2.1x 80, save <= 2x the original's):\n"
                           "{:>6}  {:>9}  {:>17} {:>6}  {:>9} {:>9} {:>6}  {:>14}\n",
                           "layers", "per class", "rewrite med/min", "cpu", "save orig", "save file", "sv/so",
                           "inline at load");
  for (const auto& r : results)
    std::cout << fmt::format("{:>6}  {:>9}  {:>8.1f} /{:>7.1f} {:>6.1f}  {:>9.1f} {:>9.1f} {:>6.2f}  {:>14.1f}\n", r.layers,
                             r.file_per_class ? "yes" : "no (inlined)", r.file_rewrite.median(), r.file_rewrite.min(),
                             r.file_rewrite_cpu.median(), r.file_save_original.median(), r.file_save.median(),
                             r.file_save.median() / r.file_save_original.median(), r.file_inline.median());
  for (size_t i = 1; i < results.size(); ++i) {
    const auto& a = results[i - 1];
    const auto& b = results[i];
    std::cout << fmt::format("  {:>4} -> {:<4} layers (x{:.2f}): file rewrite x{:.2f} (min x{:.2f}), save file x{:.2f}, "
                             "inline x{:.2f}\n",
                             a.layers, b.layers, double(b.layers) / a.layers,
                             b.file_rewrite.median() / a.file_rewrite.median(), b.file_rewrite.min() / a.file_rewrite.min(),
                             b.file_save.median() / a.file_save.median(), b.file_inline.median() / a.file_inline.median());
  }

  if (results.size() >= 2) {
    std::cout << "\ngrowth with depth (linear = layer ratio):\n";
    for (size_t i = 1; i < results.size(); ++i) {
      const auto& a = results[i - 1];
      const auto& b = results[i];
      std::cout << fmt::format("  {:>4} -> {:<4} layers (x{:.2f}): rewrite x{:.2f} (min x{:.2f}), insert x{:.2f}, "
                               "freeze x{:.2f}, save rw x{:.2f}, save orig x{:.2f}, nodes x{:.2f}\n",
                               a.layers, b.layers, double(b.layers) / a.layers,
                               b.rewrite.median() / a.rewrite.median(), b.rewrite.min() / a.rewrite.min(),
                               b.insert.median() / a.insert.median(), b.freeze.median() / a.freeze.median(),
                               b.save.median() / a.save.median(),
                               b.save_original.median() / a.save_original.median(),
                               double(b.nodes_rewritten) / a.nodes_rewritten);
    }
  }
  if (exported) {
    const auto& e = *exported;
    std::cout << fmt::format("\ntorch.export archive (.pt2), {} layers, {:.1f} MB, {} fragmented locations ({}):\n",
                             e.layers, e.bytes / 1e6, e.fragmented, e.file);
    std::cout << fmt::format("  {:<10} {:>9} {:>17} {:>9} {:>9} {:>10} {:>10} {:>6} {:>7} {:>9}\n", "format", "load",
                             "rewrite med/min", "classify", "insert", "save orig", "save rw", "sv/so", "nodes",
                             "rewritten");
    std::cout << fmt::format("  {:<10} {:>9.1f} {:>8.1f} /{:>7.1f} {:>9.1f} {:>9.1f} {:>10.1f} {:>10.1f} {:>6.2f} {:>7} {:>9}\n",
                             ".pt2", e.read.median(), e.rewrite.median(), e.rewrite.min(), e.classify.median(),
                             e.insert.median(), e.save_original.median(), e.save.median(),
                             e.save.median() / e.save_original.median(), e.nodes_before, e.nodes_rewritten);
    for (const auto& r : results)
      if (r.layers == e.layers)
        std::cout << fmt::format("  {:<10} {:>9.1f} {:>8.1f} /{:>7.1f} {:>9.1f} {:>9.1f} {:>10.1f} {:>10.1f} {:>6.2f} {:>7} {:>9}\n",
                                 "TorchScript", r.load.median(), r.rewrite.median(), r.rewrite.min(),
                                 r.classify.median(), r.insert.median(), r.save_original.median(), r.save.median(),
                                 r.save.median() / r.save_original.median(), r.nodes_before, r.nodes_rewritten);
    std::cout << "  (.pt2: load = read the archive and parse its graph; save = the archive copied in memory with "
                 "the rewritten graph and table / with the original graph; TorchScript: this run's row above)\n";
  }

  // The targets of issue 13, judged on this run; --check turns a missed guarded one into the exit status.
  std::cout << "\n";
  bool missed = false;
  for (const auto& target : judge_targets(results)) {
    std::cout << fmt::format("target: {}{}\n", target.line,
                             target.guarded ? (target.met ? " [guarded: MET]" : " [guarded: NOT MET]") : "");
    missed = missed || (target.guarded && !target.met);
  }
  if (check) std::cout << (missed ? "check: FAILED (a guarded target is not met)\n" : "check: passed\n");
  return check && missed ? 1 : 0;
}
