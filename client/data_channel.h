// DataChannel: a worker's data connections to one server. Holds up to `connections`
// TCP connections, each driven by its own thread that takes tasks from a shared queue,
// so at most that many transfers to the server run at once. A connection that fails is
// dropped and a fresh one (with a fresh hello) is opened for the next task. Thread-safe.
//
//   DataChannel channel("127.0.0.1:7071", token, 2, absl::Seconds(30));
//   channel.Submit([](absl::StatusOr<transport::Connection*> conn) { ... });
#ifndef FLATSHARD_CLIENT_DATA_CHANNEL_H_
#define FLATSHARD_CLIENT_DATA_CHANNEL_H_

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace flatshard::client_internal {

// Runs with a ready, authenticated connection, or with the error that prevented one.
// Returns false if it left the connection unusable (it is then closed).
using DataTask = std::function<bool(absl::StatusOr<transport::Connection*>)>;

class DataChannel {
 public:
  DataChannel(std::string data_address, std::string session_token, int connections,
              absl::Duration timeout);
  ~DataChannel();  // finishes queued tasks, then joins the threads

  void Submit(DataTask task);

 private:
  void Run();
  absl::StatusOr<std::unique_ptr<transport::Connection>> Open();

  const std::string data_address_;
  const std::string session_token_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::deque<DataTask> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_DATA_CHANNEL_H_
