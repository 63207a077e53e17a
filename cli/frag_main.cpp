//===- cli/frag_main.cpp - The frag command line ------------------------===//
//
// frag run:     run an exported (or rewritten) sharded model on N ranks.
// frag inspect: list which locations are fragmented, and how.
// frag rewrite: insert gather/intervene/split ops and save the rewritten files.
// Errors print one line, "frag: error: …", and exit 1.
//
//===----------------------------------------------------------------------===//
#include "ir/error.h"
#include "runtime/rank_context.h"
#include "runtime/rank_module.h"
#include "program/decoder.h"
#include "program/sharded_model.h"
#include "runtime/safetensors.h"
#include "cli/fragment_commands.h"
#include "cli/launcher.h"
#include "cli/safe_files.h"
#include "cli/text_tokenizer.h"
#include "cli/token_ids.h"

#include <CLI/CLI.hpp>
#include <c10/util/Logging.h>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <algorithm>
#include <chrono>
#include <optional>

namespace {

using frag::fail;
using frag::cli::require_regular_file;

struct RunArguments {
  std::vector<std::string> files;
  std::string input;
  std::vector<std::string> prompts;
  std::string tokenizer;
  std::string out;
  int world = 0;
  double timeout_s = 60;
  std::string device = "cpu";
  std::string plan;
  std::string rules_file;
  int generate = 0;
  int64_t cache_len = 0;
  int repeat = 0;
  bool force = false;
};

/// The file this rank runs: one per rank, or one pattern with "{rank}".
std::string file_for_rank(const RunArguments& args, int rank, int world) {
  if (args.files.size() == 1) {
    std::string file = args.files[0];
    auto at = file.find("{rank}");
    if (at != std::string::npos) return file.replace(at, 6, std::to_string(rank));
    if (world == 1) return file;
  }
  if (static_cast<int>(args.files.size()) == world) return args.files[rank];
  fail("got {} rank file(s) for a world of {} rank{}: give one file per rank in rank order, "
       "or one path containing {{rank}}",
       args.files.size(), world, world == 1 ? "" : "s");
}

/// A check that an option's value is not "": an empty path would be taken for "no file" (--rules, --out) or
/// name nothing (": cannot open the model file").
CLI::Validator non_empty(const std::string& expected) {
  return CLI::Validator(
      [expected](std::string& value) { return value.empty() ? "is empty: expected " + expected : std::string(); },
      "", "NONEMPTY");
}

/// Where the ids came from, for messages.
std::string ids_source(const RunArguments& args) {
  return args.prompts.empty() ? "--input " + args.input : "--prompt";
}

/// The files this rank reads, checked before anything opens them (a FIFO would block forever).
void check_input_files(const RunArguments& args, const std::string& file) {
  require_regular_file(file, "the model file");
  if (!args.plan.empty()) require_regular_file(args.plan, "the plan (--plan)");
  if (!args.rules_file.empty()) require_regular_file(args.rules_file, "the rules file (--rules)");
}

/// The files --out must not replace: the inputs.
std::vector<std::string> run_inputs(const RunArguments& args, int world) {
  std::vector<std::string> inputs;
  inputs.reserve(static_cast<size_t>(world) + 3);
  for (int rank = 0; rank < world; ++rank) inputs.push_back(file_for_rank(args, rank, world));
  for (const auto& extra : {args.input, args.plan, args.rules_file})
    if (!extra.empty()) inputs.push_back(extra);
  return inputs;
}

/// The vocabulary size from the model's VocabParallelEmbedding ("" and 0 when it has none).
std::pair<std::string, int64_t> vocabulary_of(frag::program::ShardedModel& model) {
  for (const auto& layer : model.table().layers) {
    if (layer.kind != "VocabParallelEmbedding") continue;
    const auto config = model.program().int_attributes(layer.path);
    if (auto vocab = config.find("org_vocab_size"); vocab != config.end()) return {layer.path, vocab->second};
  }
  return {"", 0};
}

/// --repeat N (benchmarks): N forwards, each as a trace in the Python API runs one: set the plan (registered
/// and agreed on once: ShardedModel::set_plan keeps a repeated plan), forward. Rank 0 prints the median per
/// forward; the run then goes on as usual.
void time_forwards(frag::program::ShardedModel& model, const RunArguments& args,
                   const std::optional<frag::runtime::Plan>& plan, const torch::Tensor& ids) {
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(args.repeat));
  for (int i = 0; i < args.repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    model.set_plan(plan ? *plan : frag::runtime::Plan{});
    model.forward(ids);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    model.clear_saved();
  }
  std::sort(ms.begin(), ms.end());
  if (model.context().rank() == 0)
    std::cerr << fmt::format("frag run: --repeat {}: median {:.3f} ms per forward (set the plan, forward); "
                             "min {:.3f}, max {:.3f}\n",
                             args.repeat, ms[ms.size() / 2], ms.front(), ms.back());
  model.clear();
  if (plan) model.apply(*plan);
}

int run_rank(const RunArguments& args) {
  frag::cli::remove_temporaries_on_signals();
  auto options = frag::runtime::RendezvousOptions::from_env();
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
  options.backend = args.device == "cuda" ? "nccl" : "gloo";
  torch::Device device = args.device == "cuda" ? torch::Device(torch::kCUDA, options.local_rank)
                                               : torch::Device(torch::kCPU);
  const std::string file = file_for_rank(args, options.rank, options.world_size);
  check_input_files(args, file);
  std::optional<frag::cli::TextTokenizer> tokenizer;
  if (!args.prompts.empty())
    tokenizer.emplace(args.tokenizer.empty() ? frag::cli::TextTokenizer::folder_beside(file) : args.tokenizer);
  // Prompts of different lengths: --generate batches them from a KV cache (right-padded here for the checks).
  std::vector<std::vector<int64_t>> rows;
  torch::Tensor ids;
  if (tokenizer && args.generate > 0) {
    rows = tokenizer->encode_rows(args.prompts);
    size_t longest = 0;
    for (const auto& row : rows) longest = std::max(longest, row.size());
    ids = torch::zeros({static_cast<int64_t>(rows.size()), static_cast<int64_t>(longest)}, torch::kLong);
    for (size_t b = 0; b < rows.size(); ++b)
      ids[static_cast<int64_t>(b)].narrow(0, 0, static_cast<int64_t>(rows[b].size()))
          .copy_(torch::tensor(rows[b], torch::kLong));
    ids = ids.to(device);
  } else {
    ids = (tokenizer ? tokenizer->encode(args.prompts) : frag::cli::read_token_ids(args.input)).to(device);
    for (int64_t b = 0; b < ids.size(0); ++b) {
      auto row = ids[b].to(torch::kCPU).contiguous();
      rows.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
    }
  }
  // Only rank 0 writes; its verdict on --out is shared below so that every rank stops alike.
  std::string output_error;
  frag::cli::OutputTarget output;
  if (options.rank == 0 && !args.out.empty()) {
    try {
      output = frag::cli::check_output_target(args.out, run_inputs(args, options.world_size), args.force, "--out");
    } catch (const frag::Error& e) {
      output_error = e.what();
    }
  }
  auto context = frag::runtime::RankContext::connect(options);
  frag::runtime::set_process_rank_context(context);
  context->agree("output", output_error);
  // Different ids on different ranks would give wrong logits silently, or a
  // collective of mismatched sizes: compare them before any collective.
  if (auto error = frag::cli::compare_fingerprints(
          context->exchange("input ids", frag::cli::ids_fingerprint(ids, ids_source(args))));
      !error.empty())
    throw frag::runtime::RankAgreementError(error);
  auto model = frag::program::ShardedModel::load(context, file, device, args.rules_file);
  // An id past the vocabulary reads a padding row, or another rank's shard's, without an error at tp > 1.
  // Every rank has the same ids (compared above) and export: each finds the same error, rank 0 reports it.
  if (const auto [embedding, vocab] = vocabulary_of(model); vocab > 0)
    if (auto error = frag::cli::check_ids_in_vocab(ids, vocab, ids_source(args), embedding); !error.empty())
      throw frag::runtime::RankAgreementError(error);
  std::string plan_error;
  std::optional<frag::runtime::Plan> plan;  // read once; --repeat applies it again per forward
  try {
    if (!args.plan.empty()) {
      plan = frag::runtime::Plan::from_file(args.plan);
      model.apply(*plan);
    }
  } catch (const frag::Error& e) {
    plan_error = e.what();
  }
  context->agree("plan", plan_error);  // a bad plan stops every rank before any forward

  if (args.repeat > 0) time_forwards(model, args, plan, ids);

  frag::runtime::TensorMap outputs;
  if (args.generate > 0) {
    torch::Tensor new_tokens;
    if (model.program().has_kv_cache()) {
      // One cache for the batch (program/decoder.h); its size is checked and allocated before any forward.
      std::vector<int64_t> lengths;
      for (const auto& row : rows) lengths.push_back(static_cast<int64_t>(row.size()));
      const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
      const int64_t length = args.cache_len > 0 ? args.cache_len : longest + args.generate;
      frag::program::Decoder decoder(model, static_cast<int64_t>(rows.size()), length);
      if (context->rank() == 0) std::cerr << "frag run: " << decoder.describe() << "\n";
      new_tokens = decoder.generate(rows, args.generate);
      outputs["prompt_lengths"] = torch::tensor(lengths, torch::kLong);
      outputs["tokens"] = torch::cat({ids.cpu(), new_tokens}, 1);
    } else {
      for (const auto& row : rows)
        if (row.size() != rows[0].size())
          fail("{}: prompts of different lengths need a rank file whose forward takes a KV cache (export it "
               "again with the kit)", file);
      outputs["tokens"] = model.generate(ids, args.generate).cpu();
      new_tokens = outputs["tokens"].narrow(1, ids.size(1), args.generate);
    }
    outputs["new_tokens"] = new_tokens;
    if (tokenizer && context->rank() == 0) {
      auto texts = tokenizer->decode(new_tokens);
      for (size_t i = 0; i < texts.size(); ++i)
        std::cout << (texts.size() > 1 ? fmt::format("[{}] ", i + 1) : "") << args.prompts[i] << texts[i] << "\n";
      std::cout << std::flush;
    }
  } else {
    outputs["logits"] = model.forward(ids);
  }
  // A step for a visit that never came did nothing: say so (once; every rank saw the same forward).
  if (context->rank() == 0)
    for (const auto& line : model.unreached_visits())
      std::cerr << fmt::format("frag run: warning: {}: {}\n", args.plan.empty() ? "plan" : args.plan, line);
  if (context->rank() == 0 && !args.out.empty()) {
    for (const auto& [name, tensors] : model.saved()) {
      if (tensors.size() == 1) {
        outputs[name] = tensors[0];
      } else {
        for (size_t i = 0; i < tensors.size(); ++i) outputs[fmt::format("{}.{}", name, i)] = tensors[i];
      }
    }
    frag::cli::write_output(output, frag::runtime::safetensors_bytes(outputs));
  }
  return 0;
}

int run_command(const RunArguments& args) {
  if (args.device != "cpu" && args.device != "cuda")
    fail("--device must be cpu or cuda, got '{}'", args.device);
  if (args.repeat > 0 && args.generate > 0) fail("--repeat times forwards; it does not go with --generate");
  if (args.world > 0 && std::getenv("FRAG_LAUNCHED") == nullptr) {
    // Local launch: this process only starts and watches the ranks. What every rank would check alike is
    // checked here once first (files, ids, prompts, --out), so that a problem is reported once.
    for (int rank = 0; rank < args.world; ++rank) check_input_files(args, file_for_rank(args, rank, args.world));
    if (!args.input.empty()) frag::cli::read_token_ids(args.input);
    if (!args.out.empty()) frag::cli::check_output_target(args.out, run_inputs(args, args.world), args.force, "--out");
    if (!args.prompts.empty()) {
      frag::cli::TextTokenizer tokenizer(
          args.tokenizer.empty() ? frag::cli::TextTokenizer::folder_beside(file_for_rank(args, 0, args.world))
                                 : args.tokenizer);
      if (args.generate > 0) tokenizer.encode_rows(args.prompts);  // any lengths: generation pads them
      else tokenizer.encode(args.prompts);
    }
    std::vector<std::string> child{"run"};
    for (const auto& f : args.files) child.push_back(f);
    if (!args.input.empty()) child.insert(child.end(), {"--input", args.input});
    for (const auto& prompt : args.prompts) child.insert(child.end(), {"--prompt", prompt});
    if (!args.tokenizer.empty()) child.insert(child.end(), {"--tokenizer", args.tokenizer});
    child.insert(child.end(), {"--timeout", fmt::format("{}", args.timeout_s), "--device", args.device});
    if (!args.out.empty()) child.insert(child.end(), {"--out", args.out});
    if (!args.plan.empty()) child.insert(child.end(), {"--plan", args.plan});
    if (!args.rules_file.empty()) child.insert(child.end(), {"--rules", args.rules_file});
    if (args.generate > 0) child.insert(child.end(), {"--generate", std::to_string(args.generate)});
    if (args.cache_len > 0) child.insert(child.end(), {"--cache-len", std::to_string(args.cache_len)});
    if (args.repeat > 0) child.insert(child.end(), {"--repeat", std::to_string(args.repeat)});
    if (args.force) child.push_back("--force");
    setenv("FRAG_LAUNCHED", "1", 1);
    return frag::cli::launch_local_ranks(
        args.world, child, std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000)));
  }
  return run_rank(args);
}

std::string rank_prefix() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank == nullptr || world == nullptr || std::string(world) == "1") return "";
  // A malformed RANK is reported by itself; it is not repeated as a prefix.
  if (*rank == '\0' || std::string(rank).find_first_not_of("0123456789") != std::string::npos) return "";
  return fmt::format("rank {}: ", rank);
}

}  // namespace

int main(int argc, char** argv) {
  // A rank of `--world N` writes into its launcher's line relay (a pipe): line-buffered, so that what
  // rank 0 prints (generated text, say) shows as it comes rather than at exit.
  if (std::getenv("FRAG_LAUNCHED") != nullptr) std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  // LibTorch's own log lines (c10d's connection retries with a backtrace each, warnings) would come
  // before frag's one-line error and bury it. TORCH_CPP_LOG_LEVEL=WARNING (or INFO) brings them back.
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr) FLAGS_caffe2_log_level = c10::GLOG_FATAL;
  else c10::initLogging();
  CLI::App app{"fragments: read and edit a tensor-parallel model's activations as whole tensors"};
  app.require_subcommand(1);

  RunArguments run;
  auto* run_cmd = app.add_subcommand(
      "run", "Run rank files on N ranks: locally with --world N, or one rank per process under a "
             "launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun, srun, mpirun)");
  run_cmd->add_option("files", run.files, "Rank files, rank 0 first (or one path with {rank})")
      ->required()
      ->check(non_empty("a rank file"));
  auto* input_opt =
      run_cmd->add_option("--input", run.input, "Token ids: one sequence per line, ids separated by spaces")
          ->check(non_empty("a file of token ids"));
  auto* prompt_opt = run_cmd->add_option(
      "--prompt", run.prompts,
      "Text to run (repeatable: one batch; of equal token lengths for a forward, of any lengths with "
      "--generate), tokenized with the checkpoint's tokenizer; with --generate, prints each prompt and its "
      "decoded continuation")
      ->check(non_empty("the text to run"));
  input_opt->excludes(prompt_opt);
  run_cmd->add_option("--tokenizer", run.tokenizer,
                      "Tokenizer folder (tokenizer.json) for --prompt; default: 'tokenizer' beside the rank files")
      ->needs(prompt_opt)
      ->check(non_empty("a folder holding tokenizer.json"));
  run_cmd->add_option("--out", run.out,
                      "Write rank 0's logits here (safetensors, tensor 'logits'; 'tokens' with --generate) and "
                      "every saved tensor, whole; written atomically")
      ->check(non_empty("the safetensors file to write"));
  run_cmd->add_flag("--force", run.force,
                    "Let --out write through a symbolic link, into a device node, or over an input file");
  run_cmd->add_option("--world", run.world, "Start this many local ranks (processes)")
      ->check(CLI::Range(1, 1024));
  run_cmd->add_option("--timeout", run.timeout_s,
                      "Seconds any rank waits for the rendezvous or a collective before failing")
      ->check(CLI::PositiveNumber);
  run_cmd->add_option("--device", run.device, "cpu (Gloo) or cuda (NCCL, one GPU per rank)");
  run_cmd->add_option("--repeat", run.repeat,
                      "Benchmarks: first run N timed forwards (set the plan, forward each) and print "
                      "the median per forward on rank 0")
      ->check(CLI::Range(1, 100000));
  run_cmd->add_option("--plan", run.plan, "Interventions to apply (JSON; see README)")
      ->check(non_empty("a plan file (JSON)"))
      ->check(CLI::ExistingFile);
  run_cmd->add_option("--rules", run.rules_file, "JSON file declaring more classes as known layers")
      ->check(non_empty("a rules file (JSON)"));
  run_cmd->add_option("--generate", run.generate,
                      "Greedy-decode this many tokens (from a KV cache where the rank file takes one); writes "
                      "'tokens' (prompts right-padded with 0, then the new tokens), 'new_tokens', "
                      "'prompt_lengths' and per-step saves 'step{k}.name'")
      ->check(CLI::Range(1, 100000));
  run_cmd->add_option("--cache-len", run.cache_len,
                      "With --generate: the KV cache's tokens per row (default: the longest prompt plus "
                      "--generate); a prompt and its new tokens past it are refused before anything runs")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));

  frag::cli::InspectArguments inspect;
  auto* inspect_cmd = app.add_subcommand(
      "inspect", "List the fragmented locations of an export (and the rank-local values)");
  inspect_cmd->add_option("files", inspect.files, "Rank files of one export (one is enough)")->required()
      ->check(non_empty("a rank file"))
      ->check(CLI::ExistingFile);
  inspect_cmd->add_flag("--json", inspect.json, "Print a JSON document (format fragments.inspect/1)");
  inspect_cmd->add_flag("--all", inspect.all, "Also list the whole locations");
  inspect_cmd->add_option("--rules", inspect.rules_file,
                          "JSON file declaring more classes as known layers: {\"layers\": {\"Cls\": \"Kind\"}}")
      ->check(non_empty("a rules file (JSON)"));

  frag::cli::RewriteArguments rewrite;
  auto* rewrite_cmd = app.add_subcommand(
      "rewrite", "Insert gather/intervene/split ops at every location and save the rewritten files");
  rewrite_cmd->add_option("files", rewrite.files, "Rank files to rewrite")
      ->required()
      ->check(non_empty("a rank file"))
      ->check(CLI::ExistingFile);
  rewrite_cmd->add_option("-o,--output", rewrite.output, "Output file (one input) or existing folder")
      ->required()
      ->check(non_empty("the file or folder to write"));
  rewrite_cmd->add_option("--rules", rewrite.rules_file, "JSON file declaring more classes as known layers")
      ->check(non_empty("a rules file (JSON)"));
  rewrite_cmd->add_flag("--force", rewrite.force,
                        "Let -o write through a symbolic link, into a device node, or over its own input");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (run_cmd->parsed() && run.input.empty() && run.prompts.empty())
      fail("frag run needs the tokens to run: --input ids.txt or --prompt \"text\"");
    if (run_cmd->parsed()) return run_command(run);
    if (inspect_cmd->parsed()) return frag::cli::inspect_command(inspect);
    if (rewrite_cmd->parsed()) return frag::cli::rewrite_command(rewrite);
  } catch (const frag::runtime::RankAgreementError& e) {
    // Every rank raised it alike: rank 0 reports it, the others only exit.
    if (rank_prefix().empty() || std::string(std::getenv("RANK")) == "0")
      std::cerr << "frag: " << rank_prefix() << "error: " << e.what() << "\n";
    return 1;
  } catch (const frag::Error& e) {
    std::cerr << "frag: " << rank_prefix() << "error: " << e.what() << "\n";
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "frag: " << rank_prefix() << "error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "frag: " << rank_prefix() << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
