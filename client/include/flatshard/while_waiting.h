// WhileWaiting: lets the thread that makes a client call act while the call waits,
// without a second thread. While one lives, every call of a flatshard::Client that takes
// a std::stop_token, and FetchClusterStatus, made on its thread calls `hook` on that
// thread about every kWaitSlice for as long as it waits for its servers, holding none of
// the client's locks; `hook` may ask the call's std::stop_source to stop. For callers
// that must notice something only their own thread sees: Python runs its signal
// handlers (Ctrl-C) on the main thread only. Objects nest (the innermost one's hook is
// called); each must be destroyed on its thread, in reverse order of construction. Not
// copyable.
//
//   std::stop_source stop;
//   flatshard::WhileWaiting watch([&] { if (InterruptPending()) stop.request_stop(); });
//   absl::Status status = client->ConfigureJob({}, stop.get_token());
#ifndef FLATSHARD_CLIENT_INCLUDE_FLATSHARD_WHILE_WAITING_H_
#define FLATSHARD_CLIENT_INCLUDE_FLATSHARD_WHILE_WAITING_H_

#include <functional>

#include "absl/time/time.h"

namespace flatshard {

inline constexpr absl::Duration kWaitSlice = absl::Milliseconds(50);

class WhileWaiting {
 public:
  explicit WhileWaiting(std::function<void()> hook);
  ~WhileWaiting();
  WhileWaiting(const WhileWaiting&) = delete;
  WhileWaiting& operator=(const WhileWaiting&) = delete;

 private:
  const std::function<void()> hook_;
  const std::function<void()>* const outer_;  // the hook before this one on its thread
};

}  // namespace flatshard

#endif  // FLATSHARD_CLIENT_INCLUDE_FLATSHARD_WHILE_WAITING_H_
