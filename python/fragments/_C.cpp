//===- python/fragments/_C.cpp - The Python extension: ShardedModel and plans --===//
//
// The thin layer under `import fragments`: it binds the rank context, the C++
// API (program::ShardedModel) and plan steps. Python records one plan per trace
// as typed steps (python/fragments/core/step.py: Step, runtime::PlanStep field
// for field); each is read here into runtime::StepFields and checked by the one
// plan builder, runtime::make_step (no JSON in between), and the forward runs
// in C++ with the GIL released: no Python runs per layer unless a step is a
// Python callable (`.apply`). Loading this module registers the frag:: ops (static
// initializers of the linked libraries), so rewritten files load with plain
// torch.jit.load afterwards.
//
//===----------------------------------------------------------------------===//
#include "ir/digest.h"
#include "ir/error.h"
#include "program/decoder.h"
#include "program/pt2_program.h"
#include "program/inspect_report.h"
#include "runtime/pt2_archive.h"
#include "program/sharded_model.h"
#include "runtime/plan.h"
#include "runtime/rank_context.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/distributed/c10d/Store.hpp>  // RankContext holds a Store: pybind11 instantiates its destructor
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace frag::python {
void bind_rules(py::module& m);  // _C_rules.cpp: the rule library and plans for hook-based front ends (vLLM)
void bind_row_sink(py::module& m);  // _C_rowsink.cpp: saves' rows into their files by a writer thread (vLLM)
namespace {

using program::ShardedModel;
using runtime::Plan;
using runtime::PlanStep;
using runtime::RankContext;

/// One plan step from Python's typed record (python/fragments/core/step.py: Step), field for field into
/// runtime::StepFields and the one builder, runtime::make_step: a JSON plan's checks, without JSON. A tensor
/// given in Python has no file: the value's reference is checked for its form only, its name is for messages.
PlanStep make_step(const py::handle& record, const std::string& source, size_t i) {
  runtime::StepFields f;
  f.at = record.attr("at").cast<std::string>();
  f.action = record.attr("do").cast<std::string>();
  const auto given = [&](const char* name) -> std::optional<py::object> {
    py::object value = record.attr(name);
    return value.is_none() ? std::nullopt : std::optional<py::object>(value);
  };
  if (auto as = record.attr("as_").cast<std::string>(); !as.empty()) f.as = as;
  if (f.action == "scale") f.by = record.attr("by").cast<double>();
  if (auto index = given("index")) f.index = index->cast<std::string>();
  if (auto segment = record.attr("segment").cast<std::string>(); !segment.empty()) f.segment = segment;
  if (auto heads = given("heads")) f.heads = heads->cast<std::vector<int64_t>>();
  if (auto visit = given("visit")) f.visit = visit->cast<int64_t>();
  if (auto modules = record.attr("modules").cast<std::vector<std::string>>(); !modules.empty()) f.modules = modules;
  if (auto steps = given("steps")) {
    f.steps = py::str(*steps).cast<std::string>();
    if (py::isinstance<py::int_>(*steps)) f.steps_shown = *f.steps;
  }
  if (auto rows = given("rows")) f.rows = rows->cast<std::vector<int64_t>>();
  const auto value = given("value");
  if (value) f.value = "python:value";
  PlanStep step = runtime::make_step(f, fmt::format("{}: intervention {} at {}", source, i, f.at));
  if (value) {
    step.value_tensor = value->cast<torch::Tensor>().contiguous();
    step.value = record.attr("value_name").cast<std::string>();
  }
  return step;
}

Plan make_plan(const py::list& records, const std::string& source, int64_t& read) {
  Plan plan;
  plan.source = source;
  for (const auto& record : records) plan.steps.push_back(make_step(record, source, plan.steps.size()));
  read += static_cast<int64_t>(plan.steps.size());
  return plan;
}

/// A cheap, exact fingerprint of a tensor for the cross-rank check of a Python
/// callable's result: shape, dtype and an FNV-1a digest of the bytes.
std::string fingerprint(const torch::Tensor& tensor) {
  auto bytes = tensor.detach().to(torch::kCPU).contiguous();
  const uint64_t hash = frag::ir::fnv1a_bytes(bytes.data_ptr(), bytes.nbytes());
  return fmt::format("[{}] {} {:016x}", fmt::join(tensor.sizes(), ", "), c10::toString(tensor.scalar_type()), hash);
}

/// Python's saved dict: name -> list of tensors in visit order.
py::dict saved_dict(const program::SavedTensors& saved) {
  py::dict out;
  for (const auto& [name, tensors] : saved) {
    py::list list;
    for (const auto& t : tensors) list.append(py::cast(t));
    out[py::str(name)] = list;
  }
  return out;
}

/// A .pt2 program run by torch.export in Python (python/fragments/local/pt2_torch_export.py: Pt2Runner) for the
/// C++ plan engine. Each call takes the GIL (the forward is entered with it released) and stays on the
/// calling thread, so the rank context and intervention runtime ShardedModel::forward made current there
/// are the ones the graph's ops find.
class Pt2TorchExportProgram : public program::Pt2Program {
 public:
  Pt2TorchExportProgram(const std::string& path, program::PreparedPt2& prepared, py::object runner)
      : Pt2Program(path, prepared), runner_(std::move(runner)) {}
  ~Pt2TorchExportProgram() override {
    py::gil_scoped_acquire gil;
    runner_ = py::object();
  }
  Pt2TorchExportProgram(const Pt2TorchExportProgram&) = delete;
  Pt2TorchExportProgram& operator=(const Pt2TorchExportProgram&) = delete;

  std::optional<Arity> forward_arity(const std::string& module) const override {
    auto arity = call([&] {
      py::object found = runner_.attr("arity")(module);
      return found.is_none() ? std::nullopt : std::optional<int64_t>(found.cast<int64_t>());
    });
    if (!arity) fail("unknown module '{}' (not a submodule of {})", module, path());
    if (*arity < 0) return std::nullopt;
    return Arity{static_cast<size_t>(*arity), static_cast<size_t>(*arity)};
  }
  torch::Tensor run(const std::string& module, const std::vector<torch::Tensor>& inputs) const override {
    return call([&] { return runner_.attr("run")(module, inputs).cast<torch::Tensor>(); });
  }
  torch::Device device() const override {
    return call([&] { return torch::Device(runner_.attr("device").cast<std::string>()); });
  }

 protected:
  torch::Tensor run_graph(const torch::Tensor& input_ids, const program::CachedStep* step,
                          const std::vector<ir::LocationId>* kept, Use use) override {
    return call([&] {
      py::object locations = kept ? py::cast(*kept) : py::none();
      py::object positions = step ? py::cast(step->positions) : py::none();
      py::object cache = step ? py::cast(step->kv_cache) : py::none();
      return runner_.attr("forward")(input_ids, locations, use == Use::kOnce, positions, cache)
          .cast<torch::Tensor>();
    });
  }

 private:
  /// Runs `f` with the GIL (every Python object it makes dies inside); a Python exception becomes a
  /// frag::Error with its message (the ops' own errors, a hook's included, arrive as RuntimeErrors).
  template <typename F>
  static auto call(F&& f) -> decltype(f()) {
    py::gil_scoped_acquire gil;
    try {
      return f();
    } catch (py::error_already_set& e) {
      fail("{}", std::string(py::str(e.value())));
    }
  }

  py::object runner_;
};

/// One rank of a model, as Python holds it.
struct PyModel {
  std::shared_ptr<RankContext> context;
  std::shared_ptr<ShardedModel> model;
  std::string path;
  int64_t python_calls = 0;  ///< Python callables run (benchmarks count them)
  int64_t steps_read = 0;    ///< Python steps read into plan steps (a repeated plan is not read again)
  /// model->registration_changes() right after run() last registered a plan (-1: it did not): while
  /// unchanged, that plan is what is registered.
  int64_t run_plan_at = -1;

  /// Registers a Python callable at a location: it gets the whole tensor once
  /// per visit and returns a replacement or None. Every rank runs it; the
  /// ranks then compare (through the store) whether any raised and a
  /// fingerprint of what each returned, and all refuse alike if they differ.
  void on(const std::string& location, py::function fn, std::optional<int64_t> visit, const std::string& label) {
    auto shared_fn = std::make_shared<py::function>(std::move(fn));
    auto context_ref = context;
    auto* calls = &python_calls;
    auto hook = [shared_fn, context_ref, calls, label](torch::Tensor& whole,
                                                      const runtime::VisitInfo& info) -> std::optional<torch::Tensor> {
      std::string error;
      std::optional<torch::Tensor> result;
      {
        py::gil_scoped_acquire gil;
        ++*calls;
        try {
          py::object out = (*shared_fn)(whole);
          if (!out.is_none()) {
            if (!THPVariable_Check(out.ptr()))
              error = fmt::format("{}: {} returned {}, not a tensor or None", info.location, label,
                                  std::string(py::str(out.get_type().attr("__name__"))));
            else
              result = out.cast<torch::Tensor>();
          }
        } catch (py::error_already_set& e) {
          error = fmt::format("{}: {} raised {}", info.location, label, e.what());
        }
      }
      if (error.empty() && result && (result->sizes() != whole.sizes() || result->scalar_type() != whole.scalar_type()))
        error = fmt::format("{}: {} returned a tensor of shape [{}] ({}), expected the whole's shape [{}] ({})",
                            info.location, label, fmt::join(result->sizes(), ", "),
                            c10::toString(result->scalar_type()), fmt::join(whole.sizes(), ", "),
                            c10::toString(whole.scalar_type()));
      const std::string step = fmt::format("apply:{}:{}", info.location, info.visit);
      context_ref->agree(step, error);
      const auto prints = context_ref->exchange(step + ":result", fingerprint(result ? *result : whole));
      for (size_t r = 1; r < prints.size(); ++r)
        if (prints[r] != prints[0])
          throw runtime::RankAgreementError(fmt::format(
              "{} (visit {}): {} returned different tensors on different ranks (rank 0: {}, rank {}: {}); a "
              "callable must compute the same whole tensor on every rank",
              info.location, info.visit, label, prints[0], r, prints[r]));
      return result;
    };
    model->on(location, hook, visit, label, /*edits=*/true);
  }

  /// The plan of `records` and the callables ((location, fn, visit or None, label)), registered afresh.
  void apply_with_callables(const py::list& records, const std::vector<py::tuple>& callables,
                            const std::string& source) {
    model->clear();
    model->apply(make_plan(records, source, steps_read));
    for (const auto& c : callables)
      on(c[0].cast<std::string>(), c[1].cast<py::function>(),
         c[2].is_none() ? std::nullopt : std::optional<int64_t>(c[2].cast<int64_t>()), c[3].cast<std::string>());
  }

  /// Registers `records` (and `callables`) as run() does, for the forwards that follow (generation driven
  /// from Python through Decoder); finish() drops callables and saved tensors after.
  void prepare(const py::list& records, const std::vector<py::tuple>& callables) {
    model->clear_saved();
    try {
      if (callables.empty())
        model->set_plan(make_plan(records, "model.generate", steps_read));
      else
        apply_with_callables(records, callables, "model.generate");
    } catch (...) {
      model->clear();
      throw;
    }
  }
  /// (saved, unreached visits) since prepare(); drops the callables (a plan without any stays registered).
  py::tuple finish(bool had_callables) {
    auto unreached = model->unreached_visits();
    py::dict saved = saved_dict(model->saved());
    if (had_callables) model->clear();
    model->clear_saved();
    return py::make_tuple(saved, unreached);
  }

  /// Runs one forward with `records` registered (and nothing else); returns
  /// (logits, saved, unreached visits). A plan without callables stays registered
  /// after its forward (ShardedModel::set_plan): a trace that repeats it, as a
  /// decode loop does, registers nothing and exchanges nothing before its forward.
  /// `same_plan`: the caller's records are the previous run's steps (no tensor values), so while nothing
  /// else registered since (generation's prepare, callables) they are not parsed and compared again.
  py::tuple run(const py::list& records, const std::vector<py::tuple>& callables, const torch::Tensor& ids,
                int64_t generate, bool same_plan) {
    model->clear_saved();
    const bool current = same_plan && run_plan_at == model->registration_changes();
    run_plan_at = -1;
    try {
      if (callables.empty()) {
        if (!current) model->set_plan(make_plan(records, "model.trace", steps_read));
        run_plan_at = model->registration_changes();
      } else {  // Python functions: registered for this forward only, so the model holds none after it
        apply_with_callables(records, callables, "model.trace");
      }
      torch::Tensor out;
      {
        py::gil_scoped_release release;
        out = generate > 0 ? model->generate(ids, generate) : model->forward(ids);
      }
      auto unreached = model->unreached_visits();
      py::dict saved = saved_dict(model->saved());
      if (!callables.empty()) model->clear();
      model->clear_saved();
      return py::make_tuple(out, saved, unreached);
    } catch (...) {
      model->clear();
      model->clear_saved();
      throw;
    }
  }
};

std::shared_ptr<RankContext> connect_from_env(double timeout_s, const std::string& backend) {
  auto options = runtime::RendezvousOptions::from_env();
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.backend = backend;
  py::gil_scoped_release release;
  return RankContext::connect(options);
}

/// program::Decoder for Python: holds the model it drives.
struct PyDecoder {
  std::shared_ptr<ShardedModel> model;
  std::unique_ptr<program::Decoder> decoder;
};

/// fragments.FragError (frag::Error) and its RankAgreementError.
void bind_errors(py::module& m) {
  static py::exception<frag::Error> error(m, "FragError", PyExc_RuntimeError);
  static py::exception<frag::runtime::RankAgreementError> agreement(m, "RankAgreementError", error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const frag::runtime::RankAgreementError& e) {
      PyErr_SetString(agreement.ptr(), e.what());
    } catch (const frag::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
}

void bind_rank_context(py::module& m) {
  py::class_<RankContext, std::shared_ptr<RankContext>>(m, "RankContext")
      .def_property_readonly("rank", &RankContext::rank)
      .def_property_readonly("world_size", &RankContext::world_size)
      .def_property_readonly("backend", &RankContext::backend)
      .def_property_readonly("process_group", &RankContext::process_group);
  m.def("connect_from_env", &connect_from_env, py::arg("timeout_s"), py::arg("backend"),
        "Meets the other ranks with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's variables).");
  m.def("single_rank", &RankContext::single_rank);
  m.def(
      "join_process_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, const std::string& group_name, double timeout_s) {
        py::gil_scoped_release release;
        return RankContext::over_process_group(
            store, group_name, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
      },
      py::arg("store"), py::arg("group_name"), py::arg("timeout_s"),
      "A rank context over torch.distributed's process group `group_name` and its store (this process "
      "called init_process_group): fragments' collectives run on that group.");
  m.def("is_torch_export_archive", &frag::runtime::is_torch_export_archive, py::arg("path"),
        "True when `path` is a torch.export archive (.pt2).");
  m.def("set_process_rank_context", &frag::runtime::set_process_rank_context, py::arg("context"),
        "Makes `context` the one the frag:: collectives of any program in this process run on (a plain "
        "torch.jit.load or torch.export.load of a rank file included).");
}

/// The plan format (runtime/plan.schema.json) as the C++ parser reads it: tests compare it with the schema.
void bind_plan_format(py::module& m) {
  m.attr("PLAN_FORMAT") = frag::runtime::kPlanFormat;
  m.def("plan_step_fields", &frag::runtime::plan_step_fields, "A plan step's fields, in the README's order.");
  m.def("plan_actions", &frag::runtime::action_names, "The words of \"do\", in runtime::Action's order.");
  m.def(
      "check_plan",
      [](const std::string& text, const std::string& source) {
        return frag::runtime::Plan::parse(nlohmann::json::parse(text), source).steps.size();
      },
      py::arg("text"), py::arg("source"),
      "Parses a plan's JSON text as frag run does, without reading its values; returns its number of steps or "
      "raises FragError.");
}

using PyModelClass = py::class_<PyModel>;

/// Loading one rank: a TorchScript rank file, or a .pt2 program run by torch.export in Python.
PyModelClass bind_model_loading(py::module& m) {
  PyModelClass cls(m, "ShardedModel");
  cls.def(py::init([](std::shared_ptr<RankContext> context, const std::string& path, const std::string& device) {
             std::shared_ptr<ShardedModel> model;
             {
               py::gil_scoped_release release;  // collectives: other ranks' threads may need the GIL
               model = std::make_shared<ShardedModel>(ShardedModel::load(context, path, torch::Device(device)));
             }
             return PyModel{context, model, path};
           }),
           py::arg("context"), py::arg("path"), py::arg("device") = "cpu")
      .def_static(
          "pt2",
          [](std::shared_ptr<RankContext> context, const std::string& path, const std::string& device,
             const py::function& make_runner) {
            // C++ prepares (checks across ranks, rewrites in memory, indexes the table); Python loads and runs.
            frag::program::PreparedPt2 prepared;
            std::string rewritten;  // the archive torch.export loads, where C++ rewrote a plain export
            {
              py::gil_scoped_release release;
              prepared = frag::program::prepare_pt2_rank(*context, path);
              if (prepared.rewritten_here) rewritten = frag::runtime::rewritten_archive(path, prepared.model, {});
            }
            py::list names;
            for (size_t id = 0; id < prepared.locations->size(); ++id)
              names.append(prepared.locations->at(static_cast<int64_t>(id)).name);
            py::object runner = make_runner(path, py::bytes(rewritten), names, device);
            auto program = std::make_shared<Pt2TorchExportProgram>(path, prepared, std::move(runner));
            auto model = std::make_shared<ShardedModel>(ShardedModel::over(context, std::move(program)));
            return PyModel{context, model, path};
          },
          py::arg("context"), py::arg("path"), py::arg("device"), py::arg("make_runner"),
          "One rank of a .pt2 program: C++ prepares it and runs its plans, make_runner(path, rewritten bytes, "
          "location names in id order, device) returns what runs it (fragments.local.pt2_torch_export.Pt2Runner).");
  return cls;
}

void bind_model_properties(PyModelClass& model) {
  model
      .def_property_readonly("rank", [](const PyModel& m) { return m.context->rank(); })
      .def_property_readonly("world_size", [](const PyModel& m) { return m.context->world_size(); })
      .def_property_readonly("python_calls", [](const PyModel& m) { return m.python_calls; })
      .def_property_readonly("steps_read", [](const PyModel& m) { return m.steps_read; })
      .def_property(
          "cuda_graphs", [](const PyModel& m) { return m.model->cuda_graphs(); },
          [](PyModel& m, bool on) { m.model->set_cuda_graphs(on); })
      .def("graph_stats",
           [](const PyModel& m) {
             const auto& stats = m.model->graph_stats();
             py::dict out;
             out["captures"] = stats.captures;
             out["replays"] = stats.replays;
             out["refusals"] = stats.refusals;
             return out;
           })
      .def_property_readonly("dtype",
                             [](PyModel& m) -> py::object {
                               return py::reinterpret_borrow<py::object>(
                                   reinterpret_cast<PyObject*>(torch::getTHPDtype(m.model->program().dtype())));
                             });
}

/// What a model holds: its locations, modules, head layouts and report (no forward runs).
void bind_model_tables(PyModelClass& model) {
  model
      .def("inspect_json",
           [](const PyModel& m) {
             const auto heads = frag::program::head_layouts_of(
                 m.model->table(), [&](const std::string& location) { return m.model->head_layout(location); });
             return frag::program::inspect_json(m.model->table(), {m.path}, heads).dump();
           })
      .def("locations",
           [](const PyModel& m) {
             // (name, kind, whole width or None) for every location, in id order.
             py::list out;
             const auto& table = m.model->locations();
             for (size_t id = 0; id < table.size(); ++id) {
               const auto& entry = table.at(static_cast<int64_t>(id));
               const char* kind = entry.kind == frag::ir::LocationKind::kFragmented ? "fragmented"
                                  : entry.kind == frag::ir::LocationKind::kWhole    ? "whole"
                                                                                    : "rank_local";
               py::object width = py::none();
               if (entry.side && entry.side->whole_width) width = py::int_(*entry.side->whole_width);
               out.append(py::make_tuple(entry.name, kind, width));
             }
             return out;
           })
      .def("modules",
           [](PyModel& m) {
             // (path, class name) of every submodule, the root as "".
             py::list out;
             for (const auto& [path, type] : m.model->program().named_modules()) out.append(py::make_tuple(path, type));
             return out;
           })
      .def("head_layout",
           [](const PyModel& m, const std::string& location) {
             // name -> (start, stop, head_dim) of the heads on the location's last dim, in whole coordinates
             // and last-dim order: ShardedModel::head_layout (ir::head_layout), the regions JSON plans'
             // "segment"/"heads" and frag inspect use. Empty where the location has no heads.
             py::dict out;
             for (const auto& region : m.model->head_layout(location))
               out[py::str(region.name)] = py::make_tuple(region.start, region.stop, region.head_dim);
             return out;
           })
      .def("callable",
           [](const PyModel& m, const std::string& path) -> std::string {
             try {
               m.model->caller().check_callable(path);
               return "";
             } catch (const frag::Error& e) {
               return e.what();
             }
           });
}

void bind_model_runs(PyModelClass& model) {
  model
      .def("run", &PyModel::run, py::arg("records"), py::arg("callables"), py::arg("ids"), py::arg("generate") = 0,
           py::arg("same_plan") = false)
      .def("prepare", &PyModel::prepare, py::arg("records"), py::arg("callables"))
      .def("finish", &PyModel::finish, py::arg("had_callables"))
      .def_property_readonly("has_kv_cache", [](const PyModel& m) { return m.model->program().has_kv_cache(); })
      .def(
          "call",
          [](PyModel& m, const std::vector<std::string>& paths, const torch::Tensor& whole) {
            py::gil_scoped_release release;
            return m.model->call(paths, whole);
          },
          py::arg("paths"), py::arg("whole"))
      .def(
          "call_module",
          [](PyModel& m, const std::string& path, const std::vector<torch::Tensor>& wholes) {
            py::gil_scoped_release release;
            return m.model->call_module(path, wholes);
          },
          py::arg("path"), py::arg("wholes"));
}

void bind_decoder(py::module& m) {
  // Cached generation (program/decoder.h); every call releases the GIL (collectives, Python callables).
  py::class_<PyDecoder>(m, "Decoder")
      .def(py::init([](PyModel& m, int64_t max_batch, int64_t max_len) {
             py::gil_scoped_release release;
             return PyDecoder{m.model, std::make_unique<frag::program::Decoder>(*m.model, max_batch, max_len)};
           }),
           py::arg("model"), py::arg("max_batch"), py::arg("max_len"))
      .def("describe", [](const PyDecoder& d) { return d.decoder->describe(); })
      .def_property_readonly("cache_bytes", [](const PyDecoder& d) { return d.decoder->cache_bytes(); })
      .def_property_readonly("rows", [](const PyDecoder& d) { return d.decoder->rows(); })
      .def_property_readonly("lengths", [](const PyDecoder& d) { return d.decoder->lengths(); })
      .def_property_readonly("step", [](const PyDecoder& d) { return d.decoder->step(); })
      .def(
          "prefill",
          [](PyDecoder& d, const std::vector<std::vector<int64_t>>& prompts) {
            py::gil_scoped_release release;
            return d.decoder->prefill(prompts);
          },
          py::arg("prompts"))
      .def(
          "decode",
          [](PyDecoder& d, const torch::Tensor& tokens) {
            py::gil_scoped_release release;
            return d.decoder->decode(tokens);
          },
          py::arg("tokens"))
      .def("drop", [](PyDecoder& d, int64_t row) { d.decoder->drop(row); }, py::arg("row"))
      .def("set_batch_buckets", [](PyDecoder& d, const std::vector<int64_t>& b) { d.decoder->set_batch_buckets(b); },
           py::arg("buckets"))
      .def_property_readonly("batch_buckets", [](const PyDecoder& d) { return d.decoder->batch_buckets(); })
      .def("bucket_for", [](const PyDecoder& d, int64_t rows) { return d.decoder->bucket_for(rows); },
           py::arg("rows"));
}

}  // namespace
}  // namespace frag::python

PYBIND11_MODULE(_C, m) {
  using namespace frag::python;
  m.doc() = "fragments' C++ runtime (program::ShardedModel) for the Python front end";
  bind_rules(m);
  bind_row_sink(m);
  bind_errors(m);
  bind_rank_context(m);
  bind_plan_format(m);
  auto model = bind_model_loading(m);
  bind_model_properties(model);
  bind_model_tables(model);
  bind_model_runs(model);
  bind_decoder(m);
}
