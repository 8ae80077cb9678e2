// TestDataServer: a data server on 127.0.0.1 for the client's tests. It accepts every
// connection and runs `serve` on it on a thread of its own; the destructor stops
// accepting and joins those threads, each of which ends once its client has closed the
// connection (`serve` returns when a read fails). Create it after what `serve` uses
// (declare it last among its owner's members). Thread-safe.
#ifndef FLATSHARD_TESTS_CLIENT_TEST_DATA_SERVER_H_
#define FLATSHARD_TESTS_CLIENT_TEST_DATA_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/data_channel.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::client_internal {

class TestDataServer {
 public:
  explicit TestDataServer(std::function<void(transport::Connection&)> serve) : serve_(std::move(serve)) {
    listener_ = *transport::ListenTcp("127.0.0.1", 0);
    accepting_ = std::thread([this] {
      while (true) {
        absl::StatusOr<std::unique_ptr<transport::Connection>> conn = listener_->Accept();
        if (!conn.ok()) return;  // shut down
        ++accepted_;
        absl::MutexLock lock(&mu_);
        serving_.emplace_back([this, c = std::shared_ptr<transport::Connection>(std::move(*conn))] { serve_(*c); });
      }
    });
  }
  ~TestDataServer() {
    listener_->Shutdown();
    accepting_.join();
    absl::MutexLock lock(&mu_);
    for (std::thread& thread : serving_) thread.join();
  }
  TestDataServer(const TestDataServer&) = delete;
  TestDataServer& operator=(const TestDataServer&) = delete;

  DataSession session() const { return {absl::StrCat("127.0.0.1:", listener_->port()), "token"}; }
  int accepted() const { return accepted_.load(); }

 private:
  const std::function<void(transport::Connection&)> serve_;
  std::unique_ptr<transport::Listener> listener_;
  std::atomic<int> accepted_ = 0;
  std::thread accepting_;
  absl::Mutex mu_;
  std::vector<std::thread> serving_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_TESTS_CLIENT_TEST_DATA_SERVER_H_
