// HealthCheck: asks a server the standard grpc.health.v1.Health/Check, as Kubernetes'
// grpc probe and grpc_health_probe do (no token), without the health protos' generated
// code (Debian's gRPC ships none): the request and answer are encoded by hand.
#ifndef FLATSHARD_TESTS_INTEGRATION_HEALTH_CHECK_H_
#define FLATSHARD_TESTS_INTEGRATION_HEALTH_CHECK_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"

namespace flatshard::testing {

// HealthCheckResponse.status values.
inline constexpr int kServing = 1;
inline constexpr int kNotServing = 2;

// grpc.health.v1.Health/Check for `service` at `address`, without a token: the status,
// and the serving status of the answer (HealthCheckResponse field 1, a small varint; -1
// when there is none).
inline std::pair<grpc::Status, int> HealthCheck(const std::string& address, const std::string& service) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  // HealthCheckRequest: field 1, the service name (empty: the server as a whole).
  std::string encoded;
  if (!service.empty()) encoded = std::string{'\x0a', static_cast<char>(service.size())} + service;
  grpc::Slice slice(encoded);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return {status, bytes.size() == 2 && bytes[0] == '\x08' ? bytes[1] : -1};
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_INTEGRATION_HEALTH_CHECK_H_
