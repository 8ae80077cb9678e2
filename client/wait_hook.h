// Internal to the client: how the client's waits honour flatshard::WhileWaiting
// (flatshard/while_waiting.h). A wait on a thread with a hook waits in slices of
// kWaitSlice and calls the hook between them; without one it just waits.
#ifndef FLATSHARD_CLIENT_WAIT_HOOK_H_
#define FLATSHARD_CLIENT_WAIT_HOOK_H_

#include <chrono>
#include <functional>
#include <future>

#include "flatshard/await.h"
#include "flatshard/while_waiting.h"

namespace flatshard::client_internal {

// The hook of the innermost WhileWaiting of this thread, or nullptr.
const std::function<void()>* ThreadWaitHook();

// future.get(), calling this thread's wait hook every kWaitSlice until it is ready.
template <typename T>
T GetCallingWaitHook(std::future<T>& future) {
  if (const std::function<void()>* hook = ThreadWaitHook()) {
    while (future.wait_for(absl::ToChronoMilliseconds(kWaitSlice)) != std::future_status::ready) (*hook)();
  }
  return future.get();
}

// GetCallingWaitHook, polling the future first for up to kAwaitSpin as flatshard::Await
// does: a small request's answer is seen as it comes, not after this thread wakes.
template <typename T>
T AwaitCallingWaitHook(std::future<T>& future) {
  if (AwaitFor(future, kAwaitSpin)) return future.get();
  return GetCallingWaitHook(future);
}

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_WAIT_HOOK_H_
