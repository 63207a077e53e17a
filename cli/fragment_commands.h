//===- cli/fragment_commands.h - frag inspect and frag rewrite -*- C++ -*-===//
#pragma once

#include <string>
#include <vector>

namespace frag::cli {

struct InspectArguments {
  std::vector<std::string> files;
  std::string rules_file;  ///< user layer aliases ("" for none)
  bool json = false;
  bool all = false;  ///< also list whole locations in text
};

struct RewriteArguments {
  std::vector<std::string> files;
  std::string output;  ///< a file for one input, a folder for several
  std::string rules_file;
  bool force = false;  ///< write through a symbolic link, into a device, or over an input
};

/// `frag inspect`: prints the report; returns the exit code.
int inspect_command(const InspectArguments& args);
/// `frag rewrite`: writes each rewritten file atomically; returns the exit code.
int rewrite_command(const RewriteArguments& args);

}  // namespace frag::cli
