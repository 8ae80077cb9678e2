#include "server/rpc_errors.h"

namespace flatshard::server {

void RpcErrorCounts::Add(absl::string_view method, absl::StatusCode code) {
  absl::MutexLock lock(&mu_);
  ++counts_[{std::string(method), absl::StatusCodeToString(code)}];
}

void RpcErrorCounts::ToProto(google::protobuf::RepeatedPtrField<v1::RpcErrorCount>* proto) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [key, count] : counts_) {
    v1::RpcErrorCount* entry = proto->Add();
    entry->set_method(key.first);
    entry->set_code(key.second);
    entry->set_count(count);
  }
}

}  // namespace flatshard::server
