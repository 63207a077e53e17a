//===- program/width_probe.cpp - Widths of whole locations, learned by running ===//
#include "program/width_probe.h"

#include "runtime/intervention_runtime.h"

#include <algorithm>

namespace frag::program {

std::map<ir::LocationId, int64_t> probe_widths(RankProgram& program,
                                               const std::shared_ptr<runtime::RankContext>& context,
                                               const std::vector<ir::LocationId>& locations,
                                               const torch::Tensor& input_ids) {
  std::vector<ir::LocationId> kept(locations);
  std::sort(kept.begin(), kept.end());
  kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
  std::map<ir::LocationId, int64_t> widths;
  auto probe = std::make_shared<runtime::InterventionRuntime>(program.locations());
  for (auto id : kept)
    probe->add(
        id,
        [&widths](torch::Tensor& whole, const runtime::VisitInfo& info) -> std::optional<torch::Tensor> {
          if (whole.dim() > 0) widths.emplace(info.id, whole.size(-1));
          return std::nullopt;
        },
        std::nullopt, /*edits=*/false);
  runtime::ScopedRankContext rank_scope(context);
  runtime::ScopedInterventionRuntime runtime_scope(probe);
  probe->begin_forward();
  auto first_token = input_ids.dim() == 2 ? input_ids.narrow(0, 0, 1).narrow(1, 0, 1) : input_ids;
  program.forward(first_token, &kept, RankProgram::Use::kOnce);
  return widths;
}

std::optional<int64_t> WholeWidths::at(const ir::LocationTable& locations, ir::LocationId location) const {
  const auto& side = locations.at(location).side;
  if (side && side->whole_width) return *side->whole_width;
  if (auto it = probed_.find(location); it != probed_.end()) return it->second;
  return std::nullopt;
}

void WholeWidths::defer(ir::LocationId location, std::function<void(int64_t)> check) {
  checks_.emplace_back(location, std::move(check));
}

void WholeWidths::check_pending(RankProgram& program, const std::shared_ptr<runtime::RankContext>& context,
                                const torch::Tensor& input_ids) {
  std::vector<ir::LocationId> probed;
  for (const auto& check : checks_) probed.push_back(check.first);
  for (const auto& [id, width] : probe_widths(program, context, probed, input_ids)) probed_.emplace(id, width);
  for (const auto& [location, check] : checks_)
    if (auto width = at(*program.locations(), location)) check(*width);
  checks_.clear();
}

}  // namespace frag::program
