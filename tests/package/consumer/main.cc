// Links the installed client, computes a layout and tries a server that is not there:
// prints the layout's padded size and the connection error's code, exits 0 if both are
// as expected.
#include <iostream>

#include "flatshard/client.h"

int main(int argc, char** argv) {
  auto layout = flatshard::FlatLayout::Create({{"w", {10}, flatshard::DType::kFloat32}}, 0, 3);
  if (!layout.ok() || layout->padded_numel() != 12) return 1;
  flatshard::ClientOptions options;
  options.servers = {argc > 1 ? argv[1] : "127.0.0.1:1"};
  options.timeout = absl::Seconds(2);
  auto client = flatshard::Client::Connect(options);
  std::cout << "padded_numel " << layout->padded_numel() << ", connect: "
            << client.status().code() << "\n";
  return absl::IsUnavailable(client.status()) ? 0 : 2;
}
