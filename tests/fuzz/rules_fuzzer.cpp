//===- tests/fuzz/rules_fuzzer.cpp - Rules files, fragment rules and tables ===//
#include "ir/fragment_rule.h"
#include "ir/fragment_table.h"
#include "ir/json_file.h"
#include "passes/classify_parallel_layers.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace frag;
  const std::string path = fuzz::write_input(data, size, "rules.json");
  // The same bytes as a `--rules` file, as one fragment rule, and as an embedded fragment table.
  fuzz::expect_clean([&] { passes::LayerAliases::from_file(path); });
  // rule_from_json promises frag::Error for any bad rule: a raw JSON exception escaping is a finding.
  fuzz::expect_clean([&] { ir::rule_from_json(ir::read_json_file(path, "rule")); });
  return fuzz::expect_clean([&] { ir::table_from_json(ir::read_json_file(path, "table"), path); });
}
