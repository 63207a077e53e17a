//===- bench/runtime_benchmark.cpp - What do the fragment ops cost at run time? ===//
//
// Two ranks run as threads of this process over real Gloo (tp = 2, one intra-op
// thread per rank), for the tiny llama export and a larger CPU llama export.
// For each model, with one batch of token ids (1×64 by default), it measures
// side by side, running every variant once per iteration in an order that
// rotates from one iteration to the next (ABC, BCA, CAB, …):
//
//  (a) the rewritten graph with nothing registered vs the original export:
//        original     run_forward on the plain rank file (load_and_check_rank_module,
//                     no rewrite);
//        rewritten    ShardedModel::load of the same file (rewritten in memory),
//                     forward with no intervention: ShardedModel runs the graph
//                     specialized to the hooked locations (none here), see
//                     passes/remove_fragment_ops.h;
//        full         the same with set_specialize(false): the full rewrite,
//                     every location's ops running idle;
//        stripped     the rewritten graph with every frag:: op removed by the
//                     same pass, run directly (what the inlining alone does);
//        passthrough  the full rewritten graph called directly with no
//                     InterventionRuntime: the ops pass their input through;
//      target: rewritten / original <= 1.02.
//  (b) a save (ShardedModel::save) at EVERY fragmented location of the table vs
//      the same rewritten model without saves, against the raw collectives the
//      saved bytes need:
//        plain      the rewritten model, nothing registered;
//        saves      a second rewritten model with a save at every fragmented
//                   location (its saves freed after each forward, inside the timing);
//        rawfwd     the rewritten graph with each triple replaced by the bare
//                   collective of its piece (frag_bench::raw_collective:
//                   all_gather or all_reduce, no assembly, no runtime) and no
//                   other frag:: op: the
//                   collectives the saved bytes need, where a hand-written
//                   model would run them, their results kept to the end of the
//                   forward and freed inside the timing, as the saves are;
//        raw        the same collectives alone, back to back, on piece-shaped
//                   tensors (recorded by a first forward with the saves);
//        raw+asm    raw plus what the runtime does around it outside the graph:
//                   ir::whole_from_pieces (a save keeps the gathered whole
//                   without a copy when nothing edits it after the save);
//      target: (saves - plain) / (rawfwd - plain) <= 1.15, medians. A
//      collective inside the forward also costs the ranks' skew and the
//      wake-ups of Gloo's threads between compute; `raw` alone does not, so
//      the saves are judged against the same collectives in the same place.
//  Then, on rank 0 alone: the idle ops in TorchScript loops (ns per
//  gather/intervene/split triple and per lone intervene), and the frag ops of a
//  whole forward alone (the model's locations and rules, begin_forward before
//  each call) with an empty runtime and with none.
//
// Every time is per forward: each rank times `--block` calls back to back after
// a barrier; the sample is the slower rank's mean; the tables show medians (and
// minima) over the iterations, the median CPU time of the rank's own thread, and
// the spread. Both ranks do identical work in the same order.
//
//   bazel build //bench:runtime_benchmark
//   bazel-bin/bench/runtime_benchmark [--iters N] [--warmup N] [--block N] [--batch B] [--tokens T]
//                                           [--micro N] [--locations] [--graphs] [EXPORT_DIR ...]
//   bazel-bin/bench/runtime_benchmark --profile VARIANT [--iters N] [EXPORT_DIR]   (one variant
//       only, original|rewritten|full|stripped|passthrough|saves|rawfwd|raw|raw+asm, for `perf record`)
//   --locations: list every fragmented location with its collective and shapes;
//   --graphs: compare the node kinds of the optimized plans of the full rewritten graph and the stripped one.
//
// With no folders it uses //tests/models:llama_tp2 ("tiny") and
// //tests/models:bench_llama_h256_tp2 ("large"), found in its runfiles or under
// bazel-bin/. An EXPORT_DIR holds rank0.pt and rank1.pt of a tp = 2 export.
//
//===----------------------------------------------------------------------===//
#include "ir/fragment_rule.h"
#include "ir/op_schemas.h"
#include "ir/fragment_table.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/intervention_runtime.h"
#include "runtime/rank_context.h"
#include "runtime/rank_module.h"
#include "program/sharded_model.h"
#include "bench/raw_collectives.h"
#include "ir/location_table.h"
#include "bench/reference_exports.h"
#include "cli/launcher.h"

#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace frag;
using Clock = std::chrono::steady_clock;
constexpr int kWorld = 2;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

/// CPU time of the calling thread, ms (blind to preemption; excludes Gloo's own threads).
double thread_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/// The q-quantile (0..1) of v, linear between order statistics.
double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double at = q * (v.size() - 1);
  const size_t lo = static_cast<size_t>(at);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - lo);
}

double median(std::vector<double> v) { return quantile(std::move(v), 0.5); }

/// One export to measure and how many iterations it gets.
struct Export {
  std::string label, folder;
  int iters = 0;
};

struct Options {
  int iters = 0;  ///< 0: each model's default (Export::iters)
  int block = 3;  ///< calls per timed sample (their mean is the sample)
  int warmup = 5;
  int batch = 1;
  int tokens = 64;
  int micro = 20000;
  bool locations = false;
  bool graphs = false;  ///< print how the optimized plans of rewritten and stripped differ
  std::string profile;  ///< run only this variant, for `perf record`
  std::vector<Export> exports;
};

/// One fragmented location as the saves see it.
struct Piece {
  std::string location;
  ir::FragmentRule rule;
  std::vector<int64_t> whole_shape;
  std::vector<int64_t> piece_shape;
  int64_t visits = 0;  ///< per forward
};

/// What one model's run found; ranks write their own samples, rank 0 the facts.
struct ModelResult {
  std::string label, folder;
  std::map<std::string, std::vector<double>> samples[kWorld];  ///< series -> ms per iteration
  std::vector<Piece> pieces;
  int64_t layers = 0, parallel_layers = 0;
  int64_t gathers = 0, intervenes_fragmented = 0, intervenes_whole = 0, splits = 0;
  int64_t collectives_original = 0, collectives_rewritten = 0, collectives_saves = 0;
  int64_t collectives_at_saved = 0;  ///< InterventionRuntime::collectives_at summed, one forward
  bool logits_equal_rewritten = false, logits_equal_inlined = false, logits_equal_saves = false;
  bool logits_equal_full = false;
  bool logits_equal_raw_in_forward = false;
  int64_t collectives_raw_in_forward = 0;
  std::vector<int64_t> logits_shape;
  // micro-benchmark (rank 0), ns per op or triple
  double ns_detach = 0, ns_triple = 0, ns_whole = 0;
  std::string micro_location, micro_error, graph_notes;
  double us_ops_forward_runtime = 0, us_ops_forward_none = 0;
  int64_t ops_forward_triples = 0, ops_forward_lone = 0;
  std::string error[kWorld];

  /// Per iteration, the slower rank.
  std::vector<double> series(const std::string& name) const {
    std::vector<double> out;
    const auto& s0 = samples[0].at(name);
    for (size_t i = 0; i < s0.size(); ++i) {
      double worst = 0;
      for (int r = 0; r < kWorld; ++r) worst = std::max(worst, samples[r].at(name).at(i));
      out.push_back(worst);
    }
    return out;
  }
  double med(const std::string& name) const { return median(series(name)); }
  /// Interquartile range relative to the median, %: how noisy a series is.
  double iqr(const std::string& name) const {
    auto s = series(name);
    return (quantile(s, 0.75) - quantile(s, 0.25)) / quantile(s, 0.5) * 100;
  }
  double min(const std::string& name) const {
    auto s = series(name);
    return s.empty() ? 0 : *std::min_element(s.begin(), s.end());
  }
  /// Median over iterations of a[i] / b[i] (pairs measured back to back).
  double paired_ratio(const std::string& a, const std::string& b) const {
    auto x = series(a), y = series(b);
    std::vector<double> r;
    for (size_t i = 0; i < x.size(); ++i) r.push_back(x[i] / y[i]);
    return median(r);
  }
  /// Median over iterations of a[i] - b[i].
  double paired_diff(const std::string& a, const std::string& b) const {
    auto x = series(a), y = series(b);
    std::vector<double> d;
    for (size_t i = 0; i < x.size(); ++i) d.push_back(x[i] - y[i]);
    return median(d);
  }
};

// ----------------------------------------------------------------------------------------------
// graph helpers

std::shared_ptr<torch::jit::Graph> forward_graph(torch::jit::Module& module) {
  return torch::jit::toGraphFunction(module.get_method("forward").function()).graph();
}

void count_ops(torch::jit::Block* block, ModelResult& result) {
  for (torch::jit::Node* node : block->nodes()) {
    for (torch::jit::Block* inner : node->blocks()) count_ops(inner, result);
    const c10::Symbol kind = node->kind();
    if (kind == ir::kGatherKind) ++result.gathers;
    else if (kind == ir::kSplitKind) ++result.splits;
    else if (kind == ir::kInterveneKind) {
      if (torch::jit::toIValue(node->input(2))->toBool()) ++result.intervenes_fragmented;
      else ++result.intervenes_whole;
    }
  }
}

int64_t count_decoder_layers(const torch::jit::Module& module) {
  int64_t n = 0;
  const std::string prefix = "model.layers.";
  for (const auto& named : module.named_modules())
    if (named.name.rfind(prefix, 0) == 0 && named.name.find('.', prefix.size()) == std::string::npos) ++n;
  return n;
}

// ----------------------------------------------------------------------------------------------
// the idle ops alone

/// Resolves `frag.<op>` to the frag:: builtins (torch::jit::compile knows only `torch`).
struct FragResolver : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& m,
                                                         const torch::jit::SourceRange& loc) override {
    if (name == "frag") return std::make_shared<torch::jit::BuiltinModule>("frag");
    return torch::jit::nativeResolver()->resolveValue(name, m, loc);
  }
};

/// ns per iteration of TorchScript loops (loop overhead included) of idle frag ops and of aten::detach.
void micro_benchmark(const ir::FragmentTable& table, const std::string& location, int n, ModelResult& result) {
  // The ops as a loaded program runs them: bound to location ids.
  auto locations = std::make_shared<const ir::LocationTable>(table);
  const int64_t loc = locations->id_of(location, "micro benchmark");
  const int64_t whole = locations->id_of(table.whole.at(0), "micro benchmark");
  const std::string source = fmt::format(R"JIT(
def detach_loop(x: Tensor, n: int) -> Tensor:
    for _ in range(n):
        x = torch.detach(x)
    return x

def triple_loop(x: Tensor, n: int) -> Tensor:
    for _ in range(n):
        w = frag.gather(x, {0})
        w = frag.intervene(w, {0}, True)
        x = frag.split(w, x, {0})
    return x

def whole_loop(x: Tensor, n: int) -> Tensor:
    for _ in range(n):
        x = frag.intervene(x, {1}, False)
    return x
)JIT",
                                         loc, whole);
  auto unit = std::make_shared<torch::jit::CompilationUnit>();
  unit->define(c10::nullopt, source, std::make_shared<FragResolver>(), nullptr);
  auto runtime = std::make_shared<runtime::InterventionRuntime>(locations);
  runtime::ScopedInterventionRuntime scope(runtime);
  torch::NoGradGuard no_grad;
  auto x = torch::randn({1, 8});
  auto time_ns = [&](const char* name) {
    auto& fn = unit->get_function(name);
    for (int w = 0; w < 3; ++w) {
      runtime->begin_forward();
      fn({x, int64_t(n / 10 + 1)});
    }
    std::vector<double> reps;
    for (int r = 0; r < 5; ++r) {
      runtime->begin_forward();
      auto start = Clock::now();
      fn({x, int64_t(n)});
      reps.push_back(ms_since(start) * 1e6 / n);
    }
    return median(reps);
  };
  result.ns_detach = time_ns("detach_loop");
  result.ns_triple = time_ns("triple_loop");
  result.ns_whole = time_ns("whole_loop");
  result.micro_location = location;
}

/// The frag ops of one whole forward and nothing else: a TorchScript function
/// with a gather/intervene/split triple at every fragmented location and a lone
/// intervene at every whole location (their real names and rules), called
/// `reps` times with begin_forward before each call as ShardedModel::forward
/// does. Sets us per call with an empty runtime and with none (pass-through).
void ops_forward_benchmark(const ir::FragmentTable& table, int reps, ModelResult& result) {
  auto locations = std::make_shared<const ir::LocationTable>(table);
  std::string body;
  int64_t triples = 0, lone = 0;
  for (ir::LocationId id = 0; id < static_cast<ir::LocationId>(locations->size()); ++id) {
    switch (locations->at(id).kind) {
      case ir::LocationKind::kFragmented:
        body += fmt::format("    w = frag.gather(x, {0})\n    w = frag.intervene(w, {0}, True)\n"
                            "    x = frag.split(w, x, {0})\n",
                            id);
        ++triples;
        break;
      case ir::LocationKind::kWhole:
        body += fmt::format("    x = frag.intervene(x, {}, False)\n", id);
        ++lone;
        break;
      default:
        break;
    }
  }
  const std::string source = "def ops_forward(x: Tensor) -> Tensor:\n" + body + "    return x\n";
  auto unit = std::make_shared<torch::jit::CompilationUnit>();
  unit->define(c10::nullopt, source, std::make_shared<FragResolver>(), nullptr);
  auto& fn = unit->get_function("ops_forward");
  torch::NoGradGuard no_grad;
  auto x = torch::randn({1, 8});
  auto time_us = [&](runtime::InterventionRuntime* runtime) {
    for (int w = 0; w < 20; ++w) {
      if (runtime) runtime->begin_forward();
      fn({x});
    }
    std::vector<double> samples;
    for (int r = 0; r < 5; ++r) {
      auto start = Clock::now();
      for (int i = 0; i < reps; ++i) {
        if (runtime) runtime->begin_forward();
        fn({x});
      }
      samples.push_back(ms_since(start) * 1e3 / reps);
    }
    return median(samples);
  };
  {
    auto runtime = std::make_shared<runtime::InterventionRuntime>(locations);
    runtime::ScopedInterventionRuntime scope(runtime);
    result.us_ops_forward_runtime = time_us(runtime.get());
  }
  result.us_ops_forward_none = time_us(nullptr);  // no runtime on this thread or the process
  result.ops_forward_triples = triples;
  result.ops_forward_lone = lone;
}

// ----------------------------------------------------------------------------------------------
// one rank

void run_rank(int rank, int port, const Options& options, ModelResult& result) {
  torch::set_num_threads(1);
  runtime::RendezvousOptions rendezvous;
  rendezvous.rank = rank;
  rendezvous.world_size = kWorld;
  rendezvous.master_port = port;
  rendezvous.timeout = std::chrono::milliseconds(180000);
  auto context = runtime::RankContext::connect(rendezvous);
  runtime::ScopedRankContext rank_scope(context);  // the original export's own collectives
  runtime::Communicator& tp = context->group("tp");
  auto barrier = [&] { tp.all_reduce(torch::zeros({1})); };
  const std::string path = fmt::format("{}/rank{}.pt", result.folder, rank);

  // The three graphs of (a) and the saving model of (b), each a load of the same file.
  auto original = runtime::load_and_check_rank_module(*context, path);
  auto rewritten = program::ShardedModel::load(context, path);
  auto inlined = runtime::load_and_check_rank_module(*context, path);
  passes::rewrite_for_fragments(inlined.module, passes::LayerAliases{}, path);
  auto inlined_graph = forward_graph(inlined.module);
  passes::remove_fragment_ops_except(*inlined_graph, {});
  auto saving = program::ShardedModel::load(context, path);
  auto raw_in_forward = runtime::load_and_check_rank_module(*context, path);
  passes::rewrite_for_fragments(raw_in_forward.module, passes::LayerAliases{}, path);
  bench::replace_fragment_ops_with_raw_collectives(*forward_graph(raw_in_forward.module));
  auto full = program::ShardedModel::load(context, path);
  full.set_specialize(false);

  const auto& table = rewritten.table();
  const std::vector<std::string> locations = table.fragmented_locations();
  for (const auto& location : locations) saving.save(location, location);

  int64_t vocab = 1000;
  for (const auto& location : locations)
    if (const auto* rule = table.rule_at(location); rule && rule->kind == ir::LayoutKind::kVocabShard)
      vocab = std::min<int64_t>(vocab, rule->org_vocab);
  const auto ids = torch::arange(int64_t(options.batch) * options.tokens, torch::kLong)
                       .mul(37)
                       .add(11)
                       .remainder(vocab)
                       .reshape({options.batch, options.tokens});

  // A first forward of each: collective counts, logits equality, the saved shapes.
  barrier();
  int64_t before = tp.collective_count();
  auto logits_original = runtime::run_forward(original, ids);
  int64_t after = tp.collective_count();
  const int64_t collectives_original = after - before;
  before = after;
  auto logits_rewritten = rewritten.forward(ids);
  after = tp.collective_count();
  const int64_t collectives_rewritten = after - before;
  auto logits_inlined = runtime::run_forward(inlined, ids);
  auto logits_full = full.forward(ids);
  barrier();
  before = tp.collective_count();
  auto logits_raw_in_forward = runtime::run_forward(raw_in_forward, ids);
  bench::raw_kept().clear();
  const int64_t collectives_raw_in_forward = tp.collective_count() - before;
  barrier();
  int64_t at_before = 0;
  for (const auto& location : locations) at_before += saving.interventions().collectives_at(location);
  before = tp.collective_count();
  auto logits_saves = saving.forward(ids);
  after = tp.collective_count();
  int64_t at_after = 0;
  for (const auto& location : locations) at_after += saving.interventions().collectives_at(location);

  std::vector<Piece> pieces;
  for (const auto& location : locations) {
    const auto& saved = saving.saved().at(location);
    Piece piece;
    piece.location = location;
    piece.rule = *table.rule_at(location);
    piece.whole_shape = saved.at(0).sizes().vec();
    piece.piece_shape = ir::piece_shape(piece.rule, piece.whole_shape);
    piece.visits = static_cast<int64_t>(saved.size());
    pieces.push_back(piece);
  }
  saving.clear_saved();

  if (rank == 0) {
    result.pieces = pieces;
    result.layers = count_decoder_layers(original.module);
    result.parallel_layers = static_cast<int64_t>(table.layers.size());
    count_ops(forward_graph(rewritten.module())->block(), result);
    result.collectives_original = collectives_original;
    result.collectives_rewritten = collectives_rewritten;
    result.collectives_saves = after - before;
    result.collectives_at_saved = at_after - at_before;
    result.logits_equal_rewritten = torch::equal(logits_original, logits_rewritten);
    result.logits_equal_inlined = torch::equal(logits_original, logits_inlined);
    result.logits_equal_full = torch::equal(logits_original, logits_full);
    result.logits_equal_saves = torch::equal(logits_original, logits_saves);
    result.logits_equal_raw_in_forward = torch::equal(logits_original, logits_raw_in_forward);
    result.collectives_raw_in_forward = collectives_raw_in_forward;
    result.logits_shape = logits_original.sizes().vec();
  }

  // The raw collectives of (b): one piece-shaped tensor per visit of a location.
  torch::manual_seed(rank + 1);
  std::vector<std::pair<const Piece*, torch::Tensor>> raw_inputs;
  for (const auto& piece : pieces)
    for (int64_t v = 0; v < piece.visits; ++v)
      raw_inputs.emplace_back(&piece, torch::randn(piece.piece_shape, logits_original.options()));
  auto run_raw = [&](bool assemble) {
    for (auto& [piece, x] : raw_inputs) {
      torch::Tensor whole;
      switch (ir::collective_for(piece->rule)) {
        case ir::CollectiveKind::kAllReduce:
          whole = tp.all_reduce(x);
          break;
        case ir::CollectiveKind::kAllGather: {
          auto gathered = tp.all_gather(x);
          if (assemble) whole = ir::whole_from_pieces(piece->rule, gathered);
          break;
        }
        case ir::CollectiveKind::kNone:
          whole = x;
          break;
      }
    }
  };

  auto run_raw_in_forward = [&] {
    runtime::run_forward(raw_in_forward, ids);
    bench::raw_kept().clear();  // frees what the collectives received (inside the timing, as the saves)
  };

  // The rewritten graph called directly, with no InterventionRuntime on this
  // thread: the ops pass their input through (fragment_ops.cpp).
  auto run_passthrough = [&] {
    torch::NoGradGuard no_grad;
    rewritten.module().forward({ids});
  };
  run_passthrough();

  if (!options.profile.empty()) {  // one variant only, no barriers in between
    barrier();
    for (int i = 0; i < options.warmup + options.iters; ++i) {
      if (options.profile == "original") runtime::run_forward(original, ids);
      else if (options.profile == "rewritten") rewritten.forward(ids);
      else if (options.profile == "full") full.forward(ids);
      else if (options.profile == "stripped") runtime::run_forward(inlined, ids);
      else if (options.profile == "passthrough") run_passthrough();
      else if (options.profile == "saves") {
        saving.forward(ids);
        saving.clear_saved();
      }
      else if (options.profile == "rawfwd") run_raw_in_forward();
      else if (options.profile == "raw") run_raw(false);
      else if (options.profile == "raw+asm") run_raw(true);
      else throw std::runtime_error("--profile takes original, rewritten, full, stripped, passthrough, saves, rawfwd, raw or raw+asm");
    }
    barrier();
    return;
  }

  auto& samples = result.samples[rank];
  auto timed = [&](const std::string& series, bool record, const std::function<void()>& body) {
    barrier();
    const double cpu_start = thread_cpu_ms();
    auto start = Clock::now();
    for (int b = 0; b < options.block; ++b) body();
    const double ms = ms_since(start) / options.block;
    const double cpu = (thread_cpu_ms() - cpu_start) / options.block;
    if (record) {
      samples[series].push_back(ms);
      samples[series + ".cpu"].push_back(cpu);
    }
  };

  // Runs the variants once each per iteration, the order rotating from one
  // iteration to the next (ABC, BCA, CAB, …) so that no variant always runs
  // first or right after a given other one.
  using Variant = std::pair<std::string, std::function<void()>>;
  auto interleave = [&](const std::vector<Variant>& variants) {
    const int n = static_cast<int>(variants.size());
    for (int i = 0; i < options.warmup + options.iters; ++i)
      for (int k = 0; k < n; ++k) {
        const auto& [series, body] = variants[(i + k) % n];
        timed(series, i >= options.warmup, body);
      }
  };
  // (a) original / rewritten / full / stripped / pass-through.
  interleave({{"original", [&] { runtime::run_forward(original, ids); }},
              {"rewritten", [&] { rewritten.forward(ids); }},
              {"full", [&] { full.forward(ids); }},
              {"inlined", [&] { runtime::run_forward(inlined, ids); }},
              {"passthrough", [&] { run_passthrough(); }}});
  // (b) plain / saves / raw / raw+asm.
  interleave({{"plain", [&] { rewritten.forward(ids); }},
              {"saves",
               [&] {
                 saving.forward(ids);
                 saving.clear_saved();  // frees last forward's saves (inside the timing: the saves' cost)
               }},
              {"rawfwd", [&] { run_raw_in_forward(); }},
              {"raw", [&] { run_raw(false); }},
              {"raw+asm", [&] { run_raw(true); }}});

  if (rank == 0 && options.graphs) {
    auto plan_kinds = [](torch::jit::Module& module) {
      std::map<std::string, int> kinds;
      auto state = torch::jit::toGraphFunction(module.get_method("forward").function()).getDebugState();
      std::function<void(torch::jit::Block*)> walk = [&](torch::jit::Block* block) {
        for (auto* node : block->nodes()) {
          ++kinds[node->kind().toQualString()];
          for (auto* inner : node->blocks()) walk(inner);
        }
      };
      for (auto& [spec, plan] : state.execution_plans) walk(plan.graph->block());
      return kinds;
    };
    auto a = plan_kinds(full.module()), b = plan_kinds(inlined.module);
    std::set<std::string> all;
    for (auto& [k, n] : a) all.insert(k);
    for (auto& [k, n] : b) all.insert(k);
    int total_a = 0, total_b = 0;
    for (auto& [k, n] : a) total_a += n;
    for (auto& [k, n] : b) total_b += n;
    result.graph_notes = fmt::format("optimized plans: full graph {} nodes, stripped {} nodes; kinds that differ:", total_a,
                                     total_b);
    for (const auto& k : all)
      if (a[k] != b[k]) result.graph_notes += fmt::format("\n    {:<28} full graph {:>5}  stripped {:>5}", k, a[k], b[k]);
  }

  // The idle ops alone, on rank 0 while rank 1 waits.
  barrier();
  if (rank == 0 && options.micro > 0) {
    const Piece* longest = &pieces.front();
    for (const auto& piece : pieces)
      if (ir::to_json(piece.rule).dump().size() > ir::to_json(longest->rule).dump().size()) longest = &piece;
    try {
      micro_benchmark(table, longest->location, options.micro, result);
      ops_forward_benchmark(table, std::max(1, options.micro / 50), result);
    } catch (const std::exception& e) {
      result.micro_error = e.what();
    }
  }
  barrier();
}

ModelResult run_model(const std::string& label, const std::string& folder, const Options& options) {
  ModelResult result;
  result.label = label;
  result.folder = folder;
  const int port = cli::find_free_port();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank)
    threads.emplace_back([&, rank] {
      try {
        run_rank(rank, port, options, result);
      } catch (const std::exception& e) {
        result.error[rank] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return result;
}

// ----------------------------------------------------------------------------------------------
// output

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

const char* verdict(double value, double target) { return value <= target ? "meets" : "MISSES"; }

void print_result(const ModelResult& r, const Options& options) {
  int64_t piece_bytes = 0, raw_collectives = 0;
  for (const auto& p : r.pieces) {
    int64_t n = 4;  // fp32 exports
    for (auto d : p.piece_shape) n *= d;
    piece_bytes += n * p.visits;
    if (ir::collective_for(p.rule) != ir::CollectiveKind::kNone) raw_collectives += p.visits;
  }
  const double original = r.med("original"), rewritten = r.med("rewritten"), inlined = r.med("inlined");
  const double plain = r.med("plain"), saves = r.med("saves"), raw = r.med("raw"), rawfwd = r.med("rawfwd");
  const double extra = saves - plain, extra_raw = rawfwd - plain;
  const double ratio_a = rewritten / original, ratio_b = extra / extra_raw;

  fmt::print("\n== {}: {} ==\n", r.label, r.folder);
  fmt::print("{} decoder layers, {} parallel layers, {} fragmented locations; ids [{}, {}], logits {}\n", r.layers,
             r.parallel_layers, r.pieces.size(), options.batch, options.tokens, shape_text(r.logits_shape));
  fmt::print("rewritten graph: {} frag::gather, {} frag::intervene after a gather, {} lone frag::intervene "
             "(whole locations), {} frag::split\n",
             r.gathers, r.intervenes_fragmented, r.intervenes_whole, r.splits);
  fmt::print("collectives per forward: original {}, rewritten {}, with saves {} (+{}; runtime counted {})\n",
             r.collectives_original, r.collectives_rewritten, r.collectives_saves,
             r.collectives_saves - r.collectives_rewritten, r.collectives_at_saved);
  fmt::print("collectives per forward with the raw collectives in the forward: {}\n", r.collectives_raw_in_forward);
  fmt::print("logits bit-identical to the original: rewritten {}, full graph {}, inlined {}, with saves {}, raw "
             "collectives in the "
             "forward {}\n",
             r.logits_equal_rewritten ? "yes" : "NO", r.logits_equal_full ? "yes" : "NO",
             r.logits_equal_inlined ? "yes" : "NO",
             r.logits_equal_saves ? "yes" : "NO", r.logits_equal_raw_in_forward ? "yes" : "NO");
  fmt::print("times: ms per forward, the slower rank of each iteration (the mean of {} calls back to back), over {}\n"
             "iterations after {} warm-up;\n"
             "cpu: median CPU time of the rank's own thread (blind to preemption by other processes; Gloo's\n"
             "threads not included); IQR/median: spread of the wall times, p75 - p25 over the median\n",
             options.block, options.iters, options.warmup);
  auto row = [&](const std::string& text, const std::string& series) {
    fmt::print("  {:<46} {:>9.3f} {:>9.3f} {:>9.3f} {:>8.0f} %\n", text, r.med(series), r.min(series),
               r.med(series + ".cpu"), r.iqr(series));
  };
  auto ratio_row = [&](const std::string& text, const std::string& a, const std::string& b, const std::string& note) {
    fmt::print("  {:<46} {:>9.3f} {:>9.3f} {:>9.3f}   {}\n", text, r.med(a) / r.med(b), r.min(a) / r.min(b),
               r.med(a + ".cpu") / r.med(b + ".cpu"), note);
  };
  fmt::print("\n(a) rewritten, nothing registered, vs the original export\n");
  fmt::print("  {:<46} {:>9} {:>9} {:>9} {:>10}\n", "", "median", "min", "cpu", "IQR/median");
  row("original export (no rewrite)", "original");
  row("rewritten in memory (ShardedModel, no plan)", "rewritten");
  row("rewritten, full graph (specialize off)", "full");
  row("rewritten, frag ops stripped again", "inlined");
  row("full graph, no runtime (ops pass through)", "passthrough");
  ratio_row("ratio rewritten / original", "rewritten", "original",
            fmt::format("paired median {:.3f}; target <= 1.02: {} ({:+.1f} %)",
                        r.paired_ratio("rewritten", "original"), verdict(ratio_a, 1.02), (ratio_a - 1.02) * 100));
  ratio_row("ratio full graph / original", "full", "original",
            fmt::format("paired median {:.3f}; every location's ops idle", r.paired_ratio("full", "original")));
  ratio_row("ratio stripped / original", "inlined", "original", "the inlining alone");
  ratio_row("ratio rewritten / stripped", "rewritten", "inlined", "ShardedModel::forward around the same graph");
  ratio_row("ratio full graph / stripped", "full", "inlined",
            fmt::format("the idle ops with their runtime ({:+.1f} us per forward)", (r.med("full") - inlined) * 1e3));
  ratio_row("ratio no-runtime / stripped", "passthrough", "inlined", "the ops in the graph, passing through");
  ratio_row("ratio full graph / no-runtime", "full", "passthrough", "ShardedModel::forward + runtime bookkeeping");
  fmt::print("\n(b) a save at each of the {} fragmented locations ({} collectives, {:.1f} KiB of pieces per forward)\n",
             r.pieces.size(), raw_collectives, piece_bytes / 1024.0);
  fmt::print("  {:<46} {:>9} {:>9} {:>9} {:>10}\n", "", "median", "min", "cpu", "IQR/median");
  row("rewritten, no saves", "plain");
  row("rewritten, a save at every fragmented loc.", "saves");
  row("raw collectives placed in the forward", "rawfwd");
  row("raw collectives alone, back to back", "raw");
  row("raw alone + whole_from_pieces", "raw+asm");
  fmt::print("  {:<46} {:>9.3f} {:>9.3f}             paired median {:.3f}\n", "extra of the saves (saves - no saves)",
             extra, r.min("saves") - r.min("plain"), r.paired_diff("saves", "plain"));
  fmt::print("  {:<46} {:>9.3f} {:>9.3f}             paired median {:.3f}\n",
             "extra of the raw collectives (in fwd - no saves)", extra_raw, r.min("rawfwd") - r.min("plain"),
             r.paired_diff("rawfwd", "plain"));
  fmt::print("  {:<46} {:>9.3f} {:>9.3f}             paired {:.3f}; target <= 1.15: {} ({:+.1f} %)\n",
             "ratio extra saves / extra raw collectives", ratio_b,
             (r.min("saves") - r.min("plain")) / (r.min("rawfwd") - r.min("plain")),
             r.paired_diff("saves", "plain") / r.paired_diff("rawfwd", "plain"), verdict(ratio_b, 1.15),
             (ratio_b - 1.15) * 100);
  ratio_row("ratio saves / raw collectives in the forward", "saves", "rawfwd",
            fmt::format("paired median {:.3f}", r.paired_ratio("saves", "rawfwd")));
  fmt::print("  {:<46} {:>9.3f} {:>9.3f}             the collectives alone, no forward around them\n",
             "ratio extra saves / raw alone", extra / raw, (r.min("saves") - r.min("plain")) / r.min("raw"));
  ratio_row("ratio (raw alone + assembly) / raw", "raw+asm", "raw", "");
  ratio_row("ratio saves / no saves", "saves", "plain", "the whole cost of the saves");
  if (r.ns_triple > 0) {
    const double triple = r.ns_triple, whole = r.ns_whole, detach = r.ns_detach;
    const double predicted_us = (r.gathers * triple + r.intervenes_whole * whole) / 1e3;  // one gather per triple
    fmt::print("\nidle ops alone (TorchScript loops on rank 0 with an empty InterventionRuntime; per iteration, loop "
               "included)\n");
    fmt::print("  {:<46} {:>9.0f} ns   (at {})\n", "gather+intervene+split triple", triple, r.micro_location);
    fmt::print("  {:<46} {:>9.0f} ns\n", "lone intervene (whole location)", whole);
    fmt::print("  {:<46} {:>9.0f} ns\n", "aten::detach, for scale", detach);
    fmt::print("  {:<46} {:>9.1f} us   ({} triples x {:.0f} ns + {} lone x {:.0f} ns = {:.2f} % of the original)\n",
               "predicted idle cost per forward", predicted_us, r.gathers, triple, r.intervenes_whole, whole,
               predicted_us / 1e3 / original * 100);
    fmt::print("  {:<46} {:>9.1f} us   ({} triples + {} lone intervenes, begin_forward each time; {:.2f} % of\n"
               "  {:<46} {:>9}      the original's median, {:.2f} % of its cpu)\n",
               "the frag ops of one forward, empty runtime", r.us_ops_forward_runtime, r.ops_forward_triples,
               r.ops_forward_lone, r.us_ops_forward_runtime / 1e3 / original * 100, "", "",
               r.us_ops_forward_runtime / 1e3 / r.med("original.cpu") * 100);
    fmt::print("  {:<46} {:>9.1f} us\n", "the same with no runtime (ops pass through)", r.us_ops_forward_none);
  }
  if (!r.graph_notes.empty()) fmt::print("\n{}\n", r.graph_notes);
  if (!r.micro_error.empty()) fmt::print("\nidle ops micro-benchmark failed: {}\n", r.micro_error);
  if (options.locations) {
    fmt::print("\n  {:<46} {:<11} {:<16} {:<16} {}\n", "location", "collective", "whole", "piece", "visits");
    for (const auto& p : r.pieces)
      fmt::print("  {:<46} {:<11} {:<16} {:<16} {}\n", p.location, ir::collective_name(ir::collective_for(p.rule)),
                 shape_text(p.whole_shape), shape_text(p.piece_shape), p.visits);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  std::vector<std::string> folders;
  CLI::App app{"runtime_benchmark: what the fragment ops cost at run time (tp 2, two threads over Gloo)"};
  app.add_option("--iters", options.iters,
                 "timed iterations per variant (default: 400 for the tiny model, 80 for the larger one, 80 for "
                 "export folders given)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", options.warmup, "untimed iterations first")->check(CLI::Range(0, 100000));
  app.add_option("--block", options.block, "calls back to back per timed sample")->check(CLI::Range(1, 1000));
  app.add_option("--batch", options.batch, "batch size of the token ids")->check(CLI::Range(1, 1024));
  app.add_option("--tokens", options.tokens, "tokens per sequence")->check(CLI::Range(1, 512));
  app.add_option("--micro", options.micro, "iterations of the idle-op micro-benchmarks (0: skip them)")
      ->check(CLI::Range(0, 100000000));
  app.add_flag("--locations", options.locations, "list every fragmented location with its collective and shapes");
  app.add_flag("--graphs", options.graphs, "compare the optimized plans of the full rewritten graph and the stripped one");
  app.add_option("--profile", options.profile,
                 "run only this variant warmup+iters times on both ranks and print no table (for perf record)")
      ->check(CLI::IsMember({"original", "rewritten", "full", "stripped", "passthrough", "saves", "rawfwd", "raw",
                             "raw+asm"}));
  app.add_option("exports", folders, "tp-2 export folders (rank0.pt, rank1.pt); default: the tiny and larger "
                                     "reference exports")
      ->check(CLI::ExistingDirectory);
  CLI11_PARSE(app, argc, argv);

  if (folders.empty()) {
    options.exports = {{"tiny (llama_tp2: hidden 64, 2 layers, vocab 1000)", bench::reference_export(argv[0], "llama_tp2", "rank0.pt", "runtime_benchmark"), 400},
                       {"large (bench_llama_h256_tp2: hidden 256, intermediate 768, 8 heads, 4 layers, vocab 2048)",
                        bench::reference_export(argv[0], "bench_llama_h256_tp2", "rank0.pt", "runtime_benchmark"), 80}};
  } else {
    for (const auto& folder : folders) options.exports.push_back({folder, folder, 80});
  }
  if (options.iters > 0)
    for (auto& e : options.exports) e.iters = options.iters;

  std::string command = fmt::format("bazel-bin/bench/runtime_benchmark{} --warmup {} --block {} --batch {} "
                                    "--tokens {} --micro {}{}{}",
                                    options.iters > 0 ? fmt::format(" --iters {}", options.iters) : "",
                                    options.warmup, options.block, options.batch, options.tokens, options.micro,
                                    options.locations ? " --locations" : "", options.graphs ? " --graphs" : "");
  for (const auto& folder : folders) command += " " + folder;
  fmt::print("runtime_benchmark: tp = 2 as two threads over Gloo, 1 intra-op thread per rank, libtorch {}\n",
             TORCH_VERSION);
  fmt::print("rerun: cd {} && bazel build //bench:runtime_benchmark && {}\n",
             std::filesystem::current_path().string(), command);
  std::fflush(stdout);

  int status = 0;
  struct Row {
    std::string label;
    double a, b;
  };
  std::vector<Row> rows;
  for (const auto& [label, folder, iters] : options.exports) {
    auto start = Clock::now();
    Options model_options = options;
    model_options.iters = iters;
    auto result = run_model(label, folder, model_options);
    bool failed = false;
    for (int r = 0; r < kWorld; ++r)
      if (!result.error[r].empty()) {
        std::cerr << "runtime_benchmark: " << folder << ": rank " << r << ": " << result.error[r] << "\n";
        failed = true;
      }
    if (failed) {
      status = 1;
      continue;
    }
    if (!options.profile.empty()) {
      fmt::print("{}: ran {} x {} on both ranks\n", label, options.warmup + iters, options.profile);
      continue;
    }
    print_result(result, model_options);
    fmt::print("  ({:.1f} s for this model)\n", ms_since(start) / 1e3);
    std::fflush(stdout);
    rows.push_back({label, result.med("rewritten") / result.med("original"),
                    (result.med("saves") - result.med("plain")) / (result.med("rawfwd") - result.med("plain"))});
  }
  if (rows.empty()) return status;
  fmt::print("\n== summary ==\n  {:<16} {:>26} {:>26}\n", "model", "rewritten/original (<=1.02)",
             "extra saves/raw (<=1.15)");
  for (const auto& row : rows)
    fmt::print("  {:<16} {:>20.3f} {:<6} {:>19.3f} {:<6}\n", row.label.substr(0, row.label.find(' ')), row.a,
               verdict(row.a, 1.02), row.b, verdict(row.b, 1.15));
  return status;
}
