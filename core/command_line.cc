#include "core/command_line.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace flatshard {

std::vector<std::string> ParseCommandLineOrExit(int argc, char** argv, const char* program) {
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "--helpfull") {
      char* help_argv[] = {argv[0], const_cast<char*>("--help")};
      absl::ParseCommandLine(2, help_argv);  // prints the usage and exits
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
