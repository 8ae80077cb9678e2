#include "client/cli/cancel_on_signal.h"

#include <unistd.h>

#include <cstring>
#include <ctime>

namespace flatshard::cli {

CancelOnSignal::CancelOnSignal(std::ostream& err, std::string command) : err_(err), command_(std::move(command)) {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGINT);
  sigaddset(&signals_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals_, &previous_);
  thread_ = std::thread([this] { Run(); });
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

void CancelOnSignal::Run() {
  const timespec poll{0, 100'000'000};  // how soon the destructor's stop is seen; how often a cancel repeats
  while (!stop_.load()) {
    const int signal_number = sigtimedwait(&signals_, nullptr, &poll);
    absl::MutexLock lock(&mu_);
    if (signal_number >= 0) {
      if (signalled_.exchange(true) || cancel_ == nullptr) _exit(130);
      err_ << "\nflatshard " << command_ << ": cancelling on " << strsignal(signal_number)
           << " (the servers keep nothing of it); again to quit at once" << std::endl;
    }
    if (signalled_.load()) cancel_();  // also a call that began since
  }
}

}  // namespace flatshard::cli
