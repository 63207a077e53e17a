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

}  // namespace frag::program
