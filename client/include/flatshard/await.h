// Await: waits for a Gather's or Scatter's future as future.get() does, but polls it
// first, for up to `spin`, yielding the CPU between polls. A transfer that completes
// within that window is seen at once, instead of after the thread that finished it wakes
// this one up: a wake-up of a sleeping thread costs 20-50 us in a VM (an idle virtual
// CPU has to be woken by the host), a large share of a small transfer's time
// (bench/RESULTS.md: a 1 KiB gather from one server over loopback TCP on the dev VM,
// 58-61 us awaited against 90-98 us with get()). A transfer that takes longer costs at
// most `spin` of this thread's CPU time, during which any other runnable thread on its
// CPU goes first. A deferred future is not polled. Thread-safe as the future's own get()
// is.
//
//   std::vector<float> params(layout->padded_numel());
//   auto gathered = client->Gather("mlp", step, flatshard::DType::kFloat32, flatshard::AsBytes(params));
//   absl::StatusOr<int64_t> version = flatshard::Await(gathered);
#ifndef FLATSHARD_CLIENT_INCLUDE_FLATSHARD_AWAIT_H_
#define FLATSHARD_CLIENT_INCLUDE_FLATSHARD_AWAIT_H_

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "absl/time/time.h"

namespace flatshard {

// Await's polling window by default: the small transfers it is for (up to ~1 MiB over
// TCP here, a few MiB over CUDA IPC) finish within it.
inline constexpr absl::Duration kAwaitSpin = absl::Microseconds(200);

namespace await_internal {
template <typename Future>
void Poll(const Future& future, absl::Duration spin) {
  const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(spin);
  while (future.wait_for(std::chrono::seconds(0)) == std::future_status::timeout &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
  }
}
}  // namespace await_internal

template <typename T>
T Await(std::future<T>& future, absl::Duration spin = kAwaitSpin) {
  await_internal::Poll(future, spin);
  return future.get();
}
template <typename T>
T Await(std::future<T>&& future, absl::Duration spin = kAwaitSpin) {
  return Await(future, spin);
}
// Several threads may await one shared_future (std::shared_future::get's rules).
template <typename T>
const T& Await(const std::shared_future<T>& future, absl::Duration spin = kAwaitSpin) {
  await_internal::Poll(future, spin);
  return future.get();
}

// Waits as Await does, but for at most `timeout` (the spin included) and without taking
// the result: true once get() would not block (the future is ready, or deferred), false
// if it is not by then. For a caller that has something to look at between waits (a
// Python binding: its signals, so that Ctrl-C interrupts the wait).
template <typename Future>
bool AwaitFor(const Future& future, absl::Duration timeout, absl::Duration spin = kAwaitSpin) {
  spin = std::min(spin, timeout);
  await_internal::Poll(future, spin);
  return future.wait_for(absl::ToChronoNanoseconds(timeout - spin)) != std::future_status::timeout;
}

}  // namespace flatshard

#endif  // FLATSHARD_CLIENT_INCLUDE_FLATSHARD_AWAIT_H_
