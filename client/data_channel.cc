#include "client/data_channel.h"

#include "core/status_macros.h"
#include "transport/data_protocol.h"

namespace flatshard::client_internal {

DataChannel::DataChannel(DataSession session, SessionOpener renew, int connections,
                         absl::Duration timeout)
    : renew_(std::move(renew)), timeout_(timeout), session_(std::move(session)) {
  for (int i = 0; i < std::max(1, connections); ++i) threads_.emplace_back([this] { Run(); });
}

DataChannel::~DataChannel() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void DataChannel::Submit(DataTask task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

absl::StatusOr<std::unique_ptr<transport::Connection>> DataChannel::Open() {
  DataSession session;
  {
    absl::MutexLock lock(&session_mu_);
    session = session_;
  }
  absl::StatusOr<std::unique_ptr<transport::Connection>> conn = Hello(session);
  // Refused (the server does not know the session) or unreachable (it may have come back
  // on another data port): the server restarted, or is down. Unless another connection
  // has renewed the session meanwhile, ask the control plane for a new one; while the
  // server is down that fails too, with its own error.
  const bool stale = absl::IsUnauthenticated(conn.status()) || absl::IsUnavailable(conn.status());
  if (conn.ok() || !stale || renew_ == nullptr) return conn;
  DataSession renewed;
  {
    absl::MutexLock lock(&session_mu_);
    if (session_.token != session.token) renewed = session_;
  }
  if (renewed.token.empty()) {
    FLATSHARD_ASSIGN_OR_RETURN(renewed, renew_());
    absl::MutexLock lock(&session_mu_);
    session_ = renewed;
  }
  return Hello(renewed);
}

absl::StatusOr<std::unique_ptr<transport::Connection>> DataChannel::Hello(
    const DataSession& session) const {
  return transport::OpenDataConnection(session.data_address, session.token, timeout_);
}

void DataChannel::Run() {
  std::unique_ptr<transport::Connection> conn;
  while (true) {
    DataTask task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](DataChannel* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return self->stopping_ || !self->tasks_.empty();
          },
          this));
      if (tasks_.empty()) return;  // stopping, and everything submitted has run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    // An idle connection the server has closed (it restarted, or the connection sat idle
    // past its limit) would fail the task: open a fresh one instead.
    if (conn != nullptr && conn->PeerClosed()) conn.reset();
    if (conn == nullptr) {
      absl::StatusOr<std::unique_ptr<transport::Connection>> opened = Open();
      if (!opened.ok()) {
        task(opened.status());
        continue;
      }
      conn = std::move(*opened);
    }
    if (!task(conn.get())) conn.reset();
  }
}

}  // namespace flatshard::client_internal
