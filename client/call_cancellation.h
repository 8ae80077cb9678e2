// Cancellation: how Client::CancelCheckpointCalls reaches a save, load or export in
// progress. The call holds one (CancellationSet::Scope) and registers the gRPC context of
// each call it makes to the servers while that runs (Registration); Cancel cancels them
// (TryCancel) and every one registered later, so a call cancelled between two phases
// fails at the next. Once the call reaches its point of no return (a save's or load's
// commit, an export's publish) it Seals the Cancellation: from then on Cancel does
// nothing and the call goes to its end. Internal to the client library. Thread-safe.
//
//   CancellationSet::Scope cancellation(set);  // set.CancelAll() reaches it
//   { Registration registered(&*cancellation, &ctx); ... the call on ctx ... }
//   if (!cancellation->Seal()) return absl::CancelledError("...");
//   ... commit ...
#ifndef FLATSHARD_CLIENT_CALL_CANCELLATION_H_
#define FLATSHARD_CLIENT_CALL_CANCELLATION_H_

#include <grpcpp/client_context.h>

#include <set>

#include "absl/synchronization/mutex.h"

namespace flatshard::client_internal {

class Cancellation {
 public:
  // Cancels the contexts registered now and later, unless sealed.
  void Cancel();
  // The point of no return: false if cancelled first (the caller stops, Cancelled);
  // otherwise true, and Cancel does nothing from then on.
  [[nodiscard]] bool Seal();
  bool cancelled() const;

 private:
  friend class Registration;
  void Add(grpc::ClientContext* ctx);
  void Remove(grpc::ClientContext* ctx);

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool sealed_ ABSL_GUARDED_BY(mu_) = false;
  std::set<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
};

// Registers `ctx` with `cancellation` (may be null: then nothing) while it lives: create it
// before the call starts on `ctx`, destroy it before `ctx`.
class Registration {
 public:
  Registration(Cancellation* cancellation, grpc::ClientContext* ctx) : cancellation_(cancellation), ctx_(ctx) {
    if (cancellation_ != nullptr) cancellation_->Add(ctx_);
  }
  ~Registration() {
    if (cancellation_ != nullptr) cancellation_->Remove(ctx_);
  }
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

 private:
  Cancellation* const cancellation_;
  grpc::ClientContext* const ctx_;
};

// The Cancellations of the calls in progress on one client.
class CancellationSet {
 public:
  // One call's Cancellation, which CancelAll reaches while the Scope lives.
  class Scope {
   public:
    explicit Scope(CancellationSet& set);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Cancellation& operator*() { return cancellation_; }
    Cancellation* operator->() { return &cancellation_; }

   private:
    CancellationSet& set_;
    Cancellation cancellation_;
  };

  // Cancels every call in progress (those that begin afterwards are not affected).
  void CancelAll();

 private:
  absl::Mutex mu_;
  std::set<Cancellation*> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CALL_CANCELLATION_H_
