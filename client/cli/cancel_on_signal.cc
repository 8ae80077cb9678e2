#include "client/cli/cancel_on_signal.h"

#include <unistd.h>

#include <cstring>
#include <initializer_list>

#include "absl/synchronization/notification.h"

namespace flatshard::cli {
namespace {

// The signals that cancel: blocked in every thread, routed to the watcher's.
constexpr std::initializer_list<int> kCancelSignals = {SIGINT, SIGTERM};

}  // namespace

CancelOnSignal::CancelOnSignal(std::ostream& err, std::string command) : err_(err), command_(std::move(command)) {
  sigemptyset(&signals_);
  for (int signal_number : kCancelSignals) sigaddset(&signals_, signal_number);
  pthread_sigmask(SIG_BLOCK, &signals_, &previous_);
  absl::Notification routed;
  thread_ = std::thread([this, &routed] {
    SignalRoute route(kCancelSignals);
    routed.Notify();
    Run(route);
  });
  routed.WaitForNotification();
}

CancelOnSignal::~CancelOnSignal() {
  stop_.store(true);
  thread_.join();
  pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
}

void CancelOnSignal::Watch(std::function<void()> cancel) {
  absl::MutexLock lock(&mu_);
  cancel_ = std::move(cancel);
}

void CancelOnSignal::Run(SignalRoute& route) {
  while (!stop_.load()) {
    // How soon the destructor's stop is seen; how often a cancel repeats.
    const int signal_number = route.Wait(absl::Milliseconds(100));
    absl::MutexLock lock(&mu_);
    if (signal_number != 0) {
      if (signalled_.exchange(true) || cancel_ == nullptr) _exit(130);
      err_ << "\nflatshard " << command_ << ": cancelling on " << strsignal(signal_number)
           << " (the servers keep nothing of it); again to quit at once" << std::endl;
    }
    if (signalled_.load()) cancel_();  // also a call that began since
  }
}

}  // namespace flatshard::cli
