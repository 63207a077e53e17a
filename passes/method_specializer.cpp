//===- passes/method_specializer.cpp - Method bodies per folded config ---===//
#include "passes/method_specializer.h"

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_set>

namespace frag::passes {
namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

/// See the header: bodies carry no debug names.
void clear_debug_names(Block* block) {
  for (Value* input : block->inputs()) input->setDebugName("");
  for (Node* node : block->nodes()) {
    for (Value* output : node->outputs()) output->setDebugName("");
    for (Block* inner : node->blocks()) clear_debug_names(inner);
  }
}

void collect_calls(Block* block, std::vector<Node*>& calls) {
  for (Node* node : block->nodes()) {
    if (node->kind() == c10::prim::CallMethod) calls.push_back(node);
    for (Block* inner : node->blocks()) collect_calls(inner, calls);
  }
}

/// Whether `read` (an attribute read from self) may decide the shape of a body it is folded into: whether it
/// reaches, through any value computed from it, a branch's condition or a loop's inputs or continuation (the
/// only places where ConstantPropagation changes a body's structure: a constant condition removes a branch,
/// and with it calls and collectives the analysis would meet). A value only computed with (a layer's slot in
/// the KV cache, a slice width) is left as a read: folding it changes no call or visit, and a per-layer value
/// gave each of 80 layers a body of its own, each constant-propagated (issue 41: 4x the rewrite's time).
/// Errs towards folding: every user's outputs count as computed from the read.
bool decides_shape(Value* read) {
  std::vector<Value*> pending{read};
  std::unordered_set<const Value*> seen{read};
  while (!pending.empty()) {
    Value* value = pending.back();
    pending.pop_back();
    for (const auto& use : value->uses()) {
      Node* user = use.user;
      if (!user->blocks().empty() || user->hasAttribute(c10::attr::Subgraph)) return true;
      c10::ArrayRef<Value*> computed = user->outputs();
      if (user->kind() == c10::prim::Return) {  // a block's result: the value of the node that owns the block
        Node* owner = user->owningBlock()->owningNode();
        if (owner == nullptr) continue;  // the body's own result
        if (owner->kind() != c10::prim::If) return true;  // a loop's continuation or carried value
        computed = owner->outputs();
      }
      for (Value* next : computed)
        if (seen.insert(next).second) pending.push_back(next);
    }
  }
  return false;
}

bool foldable(const c10::IValue& value) {
  return value.isBool() || value.isInt() || value.isDouble() || value.isString() || value.isNone();
}

/// Equal folded configs: same kinds and values (floats bit for bit).
bool same_values(const std::vector<std::optional<c10::IValue>>& a, const std::vector<std::optional<c10::IValue>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].has_value() != b[i].has_value()) return false;
    if (!a[i]) continue;
    const c10::IValue& x = *a[i];
    const c10::IValue& y = *b[i];
    if (x.tagKind() != y.tagKind()) return false;
    if (x.isDouble()) {
      // Bit patterns, not values: NaN equals itself and 0.0 differs from -0.0 (a config is data).
      const double dx = x.toDouble(), dy = y.toDouble();
      uint64_t bx = 0, by = 0;
      std::memcpy(&bx, &dx, sizeof dx);
      std::memcpy(&by, &dy, sizeof dy);
      if (bx != by) return false;
    } else if (x.isString()) {
      if (x.toStringRef() != y.toStringRef()) return false;
    } else if (x.isInt()) {
      if (x.toInt() != y.toInt()) return false;
    } else if (x.isBool()) {
      if (x.toBool() != y.toBool()) return false;
    }
  }
  return true;
}

}  // namespace

std::vector<torch::jit::GraphFunction*> method_graphs(const torch::jit::Module& root) {
  // Over the classes, not the instances: a Module per instance costs more than the whole walk.
  std::vector<torch::jit::GraphFunction*> out;
  std::unordered_set<const c10::ClassType*> seen;
  std::vector<c10::ClassTypePtr> pending{root.type()};
  while (!pending.empty()) {
    c10::ClassTypePtr type = pending.back();
    pending.pop_back();
    if (!seen.insert(type.get()).second) continue;
    for (torch::jit::Function* method : type->methods())
      if (auto* graph_function = torch::jit::tryToGraphFunction(*method)) out.push_back(graph_function);
    for (size_t i = 0; i < type->numAttributes(); ++i)
      if (auto child = type->getAttribute(i)->cast<c10::ClassType>(); child && child->is_module()) pending.push_back(child);
  }
  return out;
}

std::shared_ptr<Graph> MethodSpecializer::method_body(torch::jit::GraphFunction& callee,
                                                      const c10::ivalue::Object& instance) {
  Specializations& known = methods_[&callee];
  if (!known.scanned) {
    known.scanned = true;
    for (const auto& use : callee.graph()->inputs().at(0)->uses()) {
      if (use.user->kind() != c10::prim::GetAttr) continue;
      const std::string& name = use.user->s(c10::attr::name);
      if (name == kModulePathAttribute || !decides_shape(use.user->output())) continue;
      if (instance.type()->hasAttribute(name))
        known.reads.push_back({name, instance.type()->getAttributeSlot(name), {}});
      else if (instance.type()->hasConstant(name))
        known.reads.push_back({name, std::nullopt, instance.type()->getConstant(name)});
    }
  }
  // The folded values of this instance (nullopt: that attribute is not folded).
  std::vector<std::optional<c10::IValue>> values;
  values.reserve(known.reads.size());
  for (const auto& read : known.reads) {
    c10::IValue value = read.slot ? instance.getSlot(*read.slot) : read.constant;
    values.push_back(foldable(value) ? std::make_optional(std::move(value)) : std::nullopt);
  }
  for (const auto& [folded, body] : known.bodies)
    if (same_values(folded, values)) return body;
  auto body = callee.graph()->copy();
  // The copy's calls, in the same order as the method's own (a copy keeps the structure), indexed as
  // their originals' sites once folding has removed what it removes.
  std::unordered_map<const Node*, size_t> copied_sites;
  {
    std::vector<Node*> copied;
    collect_calls(body->block(), copied);
    TORCH_INTERNAL_ASSERT(copied.size() == sites_of(callee).calls.size(), "MethodSpecializer: a copy changed its calls");
    for (size_t i = 0; i < copied.size(); ++i) copied_sites.emplace(copied[i], i);
  }
  Value* self = body->inputs().at(0);
  std::vector<Node*> reads;
  for (const auto& use : self->uses())
    if (use.user->kind() == c10::prim::GetAttr) reads.push_back(use.user);
  bool folded_any = false;
  for (Node* read : reads) {
    const std::string name = read->s(c10::attr::name);
    auto found = std::find_if(known.reads.begin(), known.reads.end(), [&](const auto& r) { return r.name == name; });
    if (found == known.reads.end()) continue;
    const auto& value = values[found - known.reads.begin()];
    if (!value) continue;
    torch::jit::WithInsertPoint guard(read);
    read->output()->replaceAllUsesWith(body->insertConstant(*value));
    read->destroy();
    folded_any = true;
  }
  // Nothing folded, nothing to propagate (the compiler already propagated the method's own constants).
  // Skipped because ConstantPropagation's alias analysis walks the module types of a body that holds
  // every layer (the model's forward): a fifth of the rewrite's time.
  if (folded_any) {
    torch::jit::ConstantPropagation(body);
    torch::jit::EliminateDeadCode(body);
  }
  clear_debug_names(body->block());
  {
    std::vector<Node*> kept;
    collect_calls(body->block(), kept);
    Sites& sites = sites_of(callee);
    for (Node* call : kept) sites.index[call] = copied_sites.at(call);
  }
  known.bodies.emplace_back(std::move(values), body);
  return body;
}

MethodSpecializer::Sites& MethodSpecializer::sites_of(torch::jit::GraphFunction& method) {
  auto [sites, fresh] = sites_.try_emplace(&method);
  if (fresh) {
    collect_calls(method.graph()->block(), sites->second.calls);
    for (size_t i = 0; i < sites->second.calls.size(); ++i) sites->second.index.emplace(sites->second.calls[i], i);
  }
  return sites->second;
}

const std::vector<Node*>& MethodSpecializer::call_sites(torch::jit::GraphFunction& method) {
  return sites_of(method).calls;
}

std::optional<size_t> MethodSpecializer::call_site(torch::jit::GraphFunction& method, const Node* call) {
  const Sites& sites = sites_of(method);
  auto found = sites.index.find(call);
  return found == sites.index.end() ? std::nullopt : std::make_optional(found->second);
}

std::shared_ptr<Graph> MethodSpecializer::function_body(torch::jit::GraphFunction& function) {
  auto& body = functions_[&function];
  if (!body) {
    body = function.graph()->copy();
    clear_debug_names(body->block());
  }
  return body;
}

}  // namespace frag::passes
