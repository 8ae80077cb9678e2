// RpcErrorCounts: the control-plane calls answered with an error since the server started,
// by method and code, for GetStatus (v1::ServerStatus.rpc_errors) and the
// flatshard_rpc_errors_total metric: what an operator alerts on (UNAUTHENTICATED: a wrong
// token somewhere) while the log keeps only a burst of each kind (server/log_throttle.h).
// Methods and codes are few: one entry per pair seen is kept for the life of the server.
// Thread-safe.
//
//   errors.Add("flatshard.v1.Flatshard/GetStatus", absl::StatusCode::kUnauthenticated);
#ifndef FLATSHARD_SERVER_RPC_ERRORS_H_
#define FLATSHARD_SERVER_RPC_ERRORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "proto/flatshard.pb.h"

namespace flatshard::server {

class RpcErrorCounts {
 public:
  void Add(absl::string_view method, absl::StatusCode code);
  // One entry per method and code counted, sorted by method, then code.
  void ToProto(google::protobuf::RepeatedPtrField<v1::RpcErrorCount>* proto) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, int64_t> counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_RPC_ERRORS_H_
