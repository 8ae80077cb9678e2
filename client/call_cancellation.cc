#include "client/call_cancellation.h"

namespace flatshard::client_internal {

void Cancellation::Cancel() {
  absl::MutexLock lock(&mu_);
  if (sealed_ || cancelled_) return;
  cancelled_ = true;
  for (grpc::ClientContext* ctx : contexts_) ctx->TryCancel();
}

bool Cancellation::Seal() {
  absl::MutexLock lock(&mu_);
  sealed_ = !cancelled_;
  return sealed_;
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

void Cancellation::Add(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  contexts_.insert(ctx);
  if (cancelled_) ctx->TryCancel();
}

void Cancellation::Remove(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);  // a Cancel running now is done with `ctx` once this returns
  contexts_.erase(ctx);
}

CancellationSet::Scope::Scope(CancellationSet& set) : set_(set) {
  absl::MutexLock lock(&set_.mu_);
  set_.calls_.insert(&cancellation_);
}

CancellationSet::Scope::~Scope() {
  absl::MutexLock lock(&set_.mu_);
  set_.calls_.erase(&cancellation_);
}

void CancellationSet::CancelAll() {
  absl::MutexLock lock(&mu_);
  for (Cancellation* call : calls_) call->Cancel();
}

}  // namespace flatshard::client_internal
