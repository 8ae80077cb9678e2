#include "server/calls_in_flight.h"

namespace flatshard::server {

// One per call: gRPC creates it with the call's ServerRpcInfo and deletes it with it.
class CallCounter : public grpc::experimental::Interceptor {
 public:
  explicit CallCounter(CallsInFlight& calls) : calls_(calls) { calls_.Begin(); }
  ~CallCounter() override { calls_.End(); }
  CallCounter(const CallCounter&) = delete;
  CallCounter& operator=(const CallCounter&) = delete;

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override { methods->Proceed(); }

 private:
  CallsInFlight& calls_;
};

namespace {

class CallCounterFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallCounterFactory(CallsInFlight& calls) : calls_(calls) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo*) override {
    return new CallCounter(calls_);
  }

 private:
  CallsInFlight& calls_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CallsInFlight::Interceptors() {
  return std::make_unique<CallCounterFactory>(*this);
}

bool CallsInFlight::AwaitNone(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  const auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
}

void CallsInFlight::Begin() {
  absl::MutexLock lock(&mu_);
  ++calls_;
}

void CallsInFlight::End() {
  absl::MutexLock lock(&mu_);
  --calls_;
}

}  // namespace flatshard::server
