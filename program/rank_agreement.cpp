//===- program/rank_agreement.cpp - Ranks agree on their interventions ===//
#include "program/rank_agreement.h"

#include "ir/digest.h"
#include "ir/error.h"

#include <fmt/format.h>

namespace frag::program {

void RankAgreement::add(const std::string& descriptor) {
  if (!plan_text_.empty()) plan_text_ += '\n';  // descriptors are never empty
  plan_text_ += descriptor;
  digest_made_ = false;
  agreed_ = false;
}

void RankAgreement::clear() {
  plan_text_.clear();
  digest_made_ = false;
  agreed_ = false;
}

uint64_t RankAgreement::plan_digest() {
  if (!digest_made_) {
    plan_digest_ = ir::fnv1a(plan_text_);
    digest_made_ = true;
  }
  return plan_digest_;
}

void RankAgreement::agree(runtime::RankContext& context, const ir::FragmentTable& table) {
  if (table_digest_.empty()) table_digest_ = fmt::format("{:016x}", ir::fnv1a(ir::to_json(table).dump()));
  // The plan's text, a line, the table's digest: FNV-1a folds them in that order.
  const std::string mine = fmt::format("{:016x}", ir::fnv1a(table_digest_, ir::fnv1a("\n", plan_digest())));
  std::vector<std::string> all;
  try {
    all = context.exchange(fmt::format("interventions/{}", exchanges_++), mine);
  } catch (const Error& e) {
    fail("{} (ranks compare plans before the first forward after a change of plan; a rank whose plan did not "
         "change since its last forward does not: every rank must change its plan alike)",
         e.what());
  }
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != all[0])
      fail("ranks hold different interventions or rule tables (digest {} on rank 0, {} on rank {}): every "
           "rank must load the same plan and files of one export; nothing was run",
           all[0], all[r], r);
  agreed_ = true;
}

}  // namespace frag::program
