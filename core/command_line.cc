#include "core/command_line.h"

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"

namespace flatshard {

namespace {

// "server/main.cc" rather than the build machine's absolute path.
std::string RelativeFlagFile(absl::string_view file) {
  absl::string_view root = __FILE__;  // Abseil reports flag files without the leading '/'
  absl::ConsumePrefix(&root, "/");
  absl::ConsumePrefix(&file, "/");
  if (absl::ConsumeSuffix(&root, "core/command_line.cc")) absl::ConsumePrefix(&file, root);
  return std::string(file);
}

// The usage message, then every flag the program defines (Abseil's own aside) by file.
// Abseil's --help lists only flags of a file named after the program, which ours are
// not, and exits 1.
void PrintHelp(std::ostream& out) {
  std::map<std::string, std::map<std::string, const absl::CommandLineFlag*>> by_file;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string file = RelativeFlagFile(flag->Filename());
    if (!absl::StrContains(file, "absl/")) by_file[file][std::string(name)] = flag;
  }
  out << absl::ProgramUsageMessage() << "\n";
  for (const auto& [file, flags] : by_file) {
    out << "\n  Flags from " << file << ":\n";
    for (const auto& [name, flag] : flags) {
      out << "    --" << name << " (" << flag->Help() << "); default: "
          << (flag->IsOfType<std::string>() ? "\"" + flag->DefaultValue() + "\"" : flag->DefaultValue()) << "\n";
    }
  }
}

}  // namespace

std::vector<std::string> ParseCommandLineOrExit(int argc, char** argv, const char* program) {
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull") {
      PrintHelp(std::cout);
      std::exit(0);
    }
    if (!absl::StartsWith(arg, "-") || arg == "-") {
      positional.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      for (++i; i < argc; ++i) positional.emplace_back(argv[i]);
      break;
    }
    arg.remove_prefix(absl::StartsWith(arg, "--") ? 2 : 1);
    const size_t equals = arg.find('=');
    std::string name(arg.substr(0, equals));
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    std::string value;
    if (equals != absl::string_view::npos) {
      value = std::string(arg.substr(equals + 1));
    } else if (flag != nullptr && flag->IsOfType<bool>()) {
      value = "true";
    } else if (flag == nullptr && absl::StartsWith(name, "no") &&
               (flag = absl::FindCommandLineFlag(name.substr(2))) != nullptr &&
               flag->IsOfType<bool>()) {
      value = "false";
    } else if (flag != nullptr && i + 1 < argc) {
      value = argv[++i];
    } else if (flag != nullptr) {
      std::cerr << program << ": flag --" << name << " needs a value\n";
      std::exit(2);
    }
    if (flag == nullptr) {
      std::cerr << program << ": unknown flag --" << name << " (see --help)\n";
      std::exit(2);
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      std::cerr << program << ": bad value for --" << flag->Name() << ": " << error << "\n";
      std::exit(2);
    }
  }
  return positional;
}

}  // namespace flatshard
