//===- program/rank_agreement.h - Ranks agree on their interventions -*- C++ -*-===//
//
// Every rank must register the same hooks at the same locations in the same
// order and load files of one export: otherwise one rank would enter a
// collective another skips. Before the first forward after a change, the ranks
// exchange a digest of what is registered and of the rule table, and all refuse
// if any differs. The plan's digest is made once per change, and also keys the
// model's CUDA graphs (program/captured_forwards.h).
//
//===----------------------------------------------------------------------===//
#pragma once

#include "ir/fragment_table.h"
#include "runtime/rank_context.h"

#include <cstdint>
#include <string>

namespace frag::program {

class RankAgreement {
 public:
  /// A hook was registered: `descriptor` says what and where ("save:x@loc#*"), values by their bytes.
  /// Registration order is part of the plan (hooks at one location run in that order).
  void add(const std::string& descriptor);
  /// Nothing registered.
  void clear();
  /// Whether the ranks agreed on what is registered now.
  bool agreed() const { return agreed_; }
  /// FNV-1a of the descriptors, one a line: the plan as ranks compare it. Made once per change.
  uint64_t plan_digest();
  /// Exchanges this rank's digest of the plan and `table` with every rank; a frag::Error on every rank
  /// when any differs (nothing was run), or when the exchange itself fails.
  void agree(runtime::RankContext& context, const ir::FragmentTable& table);

 private:
  std::string plan_text_;  ///< the descriptors, "\n" between them
  uint64_t plan_digest_ = 0;
  bool digest_made_ = false;
  bool agreed_ = false;
  std::string table_digest_;  ///< of the rule table (fixed at load), made at the first agreement
  int64_t exchanges_ = 0;
};

}  // namespace frag::program
