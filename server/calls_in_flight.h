// CallsInFlight: counts the control-plane calls a gRPC server is serving, through a
// server interceptor that lives as long as its call (from its arrival to its end, its
// handler returned and its status sent or the call cancelled). A shutdown waits on it to
// give the calls in progress a grace period, and none to connections that are only open.
// Thread-safe; must outlive the gRPC server whose builder it is given to.
//
//   CallsInFlight calls;
//   builder.experimental().SetInterceptorCreators(...calls.Interceptors()...);
//   calls.AwaitNone(absl::Now() + grace);  // then shut the server down at once
#ifndef FLATSHARD_SERVER_CALLS_IN_FLIGHT_H_
#define FLATSHARD_SERVER_CALLS_IN_FLIGHT_H_

#include <grpcpp/support/server_interceptor.h>

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::server {

class CallsInFlight {
 public:
  CallsInFlight() = default;
  CallsInFlight(const CallsInFlight&) = delete;
  CallsInFlight& operator=(const CallsInFlight&) = delete;

  // A factory of interceptors that count their calls here; it refers to this object.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> Interceptors();

  // Waits until no call is in flight, or until `deadline`; true when none is.
  bool AwaitNone(absl::Time deadline) const;

 private:
  friend class CallCounter;
  void Begin();
  void End();

  mutable absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_CALLS_IN_FLIGHT_H_
