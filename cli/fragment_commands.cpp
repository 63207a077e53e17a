//===- cli/fragment_commands.cpp - frag inspect and frag rewrite -------===//
//
// Both load every rank file given, run the pass on each (the decisions never
// depend on the rank, so the tables must agree) and then report (inspect) or
// save (rewrite). A rewrite is saved to a temporary file beside the target and
// renamed into place, so a failure never leaves a half-written file; with
// several inputs nothing is moved into place until every file was rewritten
// (cli/safe_files.h: temporaries, signals, targets that are links or devices).
//
//===----------------------------------------------------------------------===//
#include "cli/fragment_commands.h"

#include "program/inspect_report.h"

#include "ir/error.h"
#include "ir/module_path.h"
#include "passes/insert_fragment_ops.h"
#include "passes/insert_fragment_ops_pt2.h"
#include "passes/rewrite_for_fragments.h"
#include "runtime/pt2_archive.h"
#include "runtime/rank_module.h"
#include "cli/safe_files.h"

#include <fmt/format.h>
#include <fmt/ranges.h>


#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>

namespace frag::cli {
namespace {

using program::HeadLayouts;
using program::head_layouts_of;
using program::inspect_json;
using program::inspect_text;

passes::LayerAliases load_aliases(const std::string& rules_file) {
  if (rules_file.empty()) return {};
  require_regular_file(rules_file, "the rules file (--rules)");
  return passes::LayerAliases::from_file(rules_file);
}


/// Rank files given together must come from one export (when they say which).
void check_one_export(const std::vector<std::string>& files, const std::vector<std::string>& export_ids) {
  for (size_t r = 1; r < files.size(); ++r)
    if (!export_ids[0].empty() && !export_ids[r].empty() && export_ids[r] != export_ids[0])
      fail("{} and {} come from different exports ({} vs {})", files[0], files[r], export_ids[0], export_ids[r]);
}

/// Regular files (a FIFO would block forever), each given once (one file twice is not two ranks).
void check_rank_files(const std::vector<std::string>& files) {
  for (const auto& file : files) require_regular_file(file, "the model file");
  require_distinct_files(files, "the rank files");
}

/// Whether the rank files are torch.export archives (else TorchScript files); one format of each is refused,
/// naming the first file of the other.
bool are_torch_export_archives(const std::vector<std::string>& files) {
  const bool first = runtime::is_torch_export_archive(files.at(0));
  for (size_t r = 1; r < files.size(); ++r)
    if (runtime::is_torch_export_archive(files[r]) != first)
      fail("{} and {}: one is a torch.export archive and the other a TorchScript file; give the rank files of "
           "one export", files[0], files[r]);
  return first;
}

/// The rank files' tables (whole and rank-local locations found by the rewrite, run on a copy).
struct Analysis {
  std::vector<ir::FragmentTable> tables;
  HeadLayouts heads;  ///< of the first file (all agree: the configs are in the tables' rules)
};

/// The head layout of every layer side that has one, its config read by `attributes`.
HeadLayouts head_layouts(const ir::FragmentTable& table,
                         const std::function<ir::IntAttributes(const std::string&)>& attributes) {
  return head_layouts_of(table, [&](const std::string& location) { return ir::head_layout(table, location, attributes); });
}

/// The integer config values of a .pt2 archive's module (the kit records them beside the graph).
ir::IntAttributes recorded_integers(const std::vector<ir::ModuleDescription>& modules, const std::string& path) {
  ir::IntAttributes out;
  for (const auto& module : modules)
    if (module.path == path)
      for (const auto& [name, value] : module.attributes)
        if (value.isInt()) out[name] = value.toInt();
  return out;
}

Analysis analyze_files(const std::vector<std::string>& files, const passes::LayerAliases& aliases) {
  check_rank_files(files);
  Analysis analysis;
  std::vector<std::string> export_ids;
  const bool exported = are_torch_export_archives(files);
  for (const auto& file : files) {
    if (exported) {
      auto program = runtime::read_exported_program(file);
      export_ids.push_back(program.info.export_id);
      if (!program.rule_table.empty() || passes::has_fragment_ops_pt2(program.model))
        fail("{}: already rewritten by frag rewrite; inspect reads the original export", file);
      analysis.tables.push_back(passes::analyze_pt2_fragments(program.model, program.modules, aliases, file));
      if (analysis.tables.size() == 1)
        analysis.heads = head_layouts(analysis.tables[0], [&](const std::string& path) {
          return recorded_integers(program.modules, path);
        });
      continue;
    }
    auto rank = runtime::load_rank_module(file);
    export_ids.push_back(rank.info.export_id);
    if (rank.extra_files.count(runtime::kRuleTableFile) || passes::has_fragment_ops(rank.module))
      fail("{}: already rewritten by frag rewrite; inspect reads the original export", file);
    analysis.tables.push_back(passes::analyze_fragments(rank.module, aliases, file));
    if (analysis.tables.size() == 1)
      analysis.heads = head_layouts(analysis.tables[0], [&](const std::string& path) {
        return ir::int_attributes_at(rank.module, path);
      });
  }
  // Layouts first: they name what differs; then the export ids.
  passes::check_tables_agree(files, analysis.tables);
  check_one_export(files, export_ids);
  return analysis;
}

}  // namespace

int inspect_command(const InspectArguments& args) {
  auto analysis = analyze_files(args.files, load_aliases(args.rules_file));
  const auto& table = analysis.tables[0];
  if (args.json)
    std::cout << inspect_json(table, args.files, analysis.heads).dump(2) << "\n";
  else
    std::cout << inspect_text(table, args.files, args.all, analysis.heads);
  return 0;
}

int rewrite_command(const RewriteArguments& args) {
  remove_temporaries_on_signals();
  check_rank_files(args.files);
  const bool exported = are_torch_export_archives(args.files);
  const auto aliases = load_aliases(args.rules_file);
  std::vector<std::string> paths;
  std::error_code ignored;  // a path that cannot be examined is not a folder; check_output_target says why
  if (args.files.size() == 1 && !std::filesystem::is_directory(args.output, ignored)) {
    auto parent = std::filesystem::path(args.output).parent_path();
    if (!parent.empty() && !std::filesystem::is_directory(parent))
      fail("-o {}: the folder {} does not exist", args.output, parent.string());
    paths.push_back(args.output);
  } else {
    if (!std::filesystem::is_directory(args.output))
      fail("-o {}: with {} input files, -o must be an existing folder", args.output, args.files.size());
    for (const auto& file : args.files)
      paths.push_back((std::filesystem::path(args.output) / std::filesystem::path(file).filename()).string());
    std::vector<std::string> sorted = paths;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      fail("-o {}: two input files have the same name; rewrite them into separate folders", args.output);
  }
  // Before any work: a link, a device or an input as the target is refused unless forced.
  std::vector<OutputTarget> targets;
  targets.reserve(paths.size());
  for (const auto& path : paths) targets.push_back(check_output_target(path, args.files, args.force, "-o"));
  // Regular targets are written to temporaries (removed on failure and on signals) and renamed into place
  // once every file is written; devices are written in place, before any rename.
  std::vector<std::unique_ptr<TemporaryFile>> temporaries;
  std::vector<std::string> direct_bytes(targets.size());
  std::vector<ir::FragmentTable> tables;
  std::vector<std::string> export_ids;
  for (size_t i = 0; i < args.files.size(); ++i) {
    const auto& file = args.files[i];
    std::string bytes;
    if (exported) {
      auto program = runtime::read_exported_program(file);
      if (!program.rule_table.empty() || passes::has_fragment_ops_pt2(program.model))
        fail("{}: already rewritten by frag rewrite; give the original export", file);
      export_ids.push_back(program.info.export_id);
      tables.push_back(passes::rewrite_pt2_for_fragments(program.model, program.modules, aliases, file));
      bytes = runtime::rewritten_archive(file, program.model, {{runtime::kRuleTableFile, ir::to_json(tables.back()).dump(1)}});
    } else {
      auto rank = runtime::load_rank_module(file);
      if (rank.extra_files.count(runtime::kRuleTableFile) || passes::has_fragment_ops(rank.module))
        fail("{}: already rewritten by frag rewrite; give the original export", file);
      export_ids.push_back(rank.info.export_id);
      tables.push_back(passes::rewrite_for_file(rank.module, aliases, file));
      torch::jit::ExtraFilesMap extra(rank.extra_files.begin(), rank.extra_files.end());
      extra[runtime::kRuleTableFile] = ir::to_json(tables.back()).dump(1);
      // Serialized in memory, then written with every write checked: the archive writer aborts the process
      // when its file fails mid-write (a full disk).
      std::ostringstream archive;
      rank.module.save(archive, extra);
      bytes = archive.str();
    }
    const std::vector<std::string> so_far(args.files.begin(), args.files.begin() + i + 1);
    passes::check_tables_agree(so_far, tables);
    check_one_export(so_far, export_ids);
    if (targets[i].direct) {
      direct_bytes[i] = std::move(bytes);
    } else {
      temporaries.push_back(std::make_unique<TemporaryFile>(targets[i].path));
      temporaries.back()->write(bytes);
    }
  }
  for (size_t i = 0; i < targets.size(); ++i)
    if (targets[i].direct) write_file(targets[i].path, direct_bytes[i]);
  for (auto& temporary : temporaries) temporary->commit();
  for (size_t i = 0; i < targets.size(); ++i)
    std::cout << args.files[i] << " -> " << targets[i].path << "\n";
  return 0;
}

}  // namespace frag::cli
