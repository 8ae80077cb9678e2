#include "client/data_channel.h"

#include <optional>

#include "client/either_stop.h"
#include "core/status_macros.h"
#include "flatshard/await.h"
#include "transport/data_protocol.h"

namespace flatshard::client_internal {

// One connection and the thread that drives it. `conn` belongs to the thread, except
// while `lent` to a submitting thread that writes a request on it; it is lent only while
// the thread waits with nothing to do (`waiting`), and the thread touches it only outside
// that wait, so mu_ orders every hand-over.
struct DataChannel::ConnectionThread {
  // A request a submitting thread wrote on `conn`: `read` reads its answer.
  struct Handoff {
    DataTask read;
    absl::Status write_status;
  };

  std::unique_ptr<transport::Connection> conn;
  bool waiting = false;            // guarded by mu_
  bool lent = false;               // guarded by mu_
  std::optional<Handoff> handoff;  // guarded by mu_
  // `conn` while a task runs on it, for Cancel to shut down; guarded by mu_, and cleared
  // under it before the thread may close `conn`.
  transport::Connection* busy = nullptr;
  std::thread thread;
};

DataTask WriteThen(RequestWriter write, DataTask task) {
  return [write = std::move(write), task = std::move(task)](absl::StatusOr<transport::Connection*> conn) {
    if (!conn.ok()) return task(conn.status());
    if (absl::Status written = write(**conn); !written.ok()) {
      task(written);
      return false;
    }
    return task(conn);
  };
}

namespace {

absl::Status StoppedStatus() { return absl::CancelledError("the transfer was stopped"); }

// `task`, ended by a stop asked of `stop` as `cut` says (Submit).
DataTask StopWith(std::stop_token stop, StopCut cut, DataTask task) {
  if (!stop.stop_possible()) return task;
  if (cut == StopCut::kSend) {
    // Whether or not the request was written (Submit's two parts), the task goes on: its
    // write fails, or it reads the server's answer or close.
    return [stop = std::move(stop), task = std::move(task)](absl::StatusOr<transport::Connection*> conn) {
      if (!conn.ok()) return task(conn.status());
      transport::Connection* const ending = *conn;
      const std::stop_callback close_send(stop, [ending] { ending->CloseSend(); });
      return task(conn) && !stop.stop_requested();
    };
  }
  return [stop = std::move(stop), task = std::move(task)](absl::StatusOr<transport::Connection*> conn) {
    if (!conn.ok()) return task(conn.status());
    if (stop.stop_requested()) {
      task(StoppedStatus());
      return false;  // a request may have been written on it (Submit's two parts)
    }
    transport::Connection* const ending = *conn;
    const std::stop_callback shut_down(stop, [ending] { ending->Shutdown(); });
    return task(conn) && !stop.stop_requested();
  };
}

}  // namespace

DataChannel::DataChannel(DataSession session, SessionOpener renew, int connections,
                         absl::Duration timeout)
    : renew_(std::move(renew)), timeout_(timeout), session_(std::move(session)) {
  for (int i = 0; i < std::max(1, connections); ++i) threads_.push_back(std::make_unique<ConnectionThread>());
  for (const std::unique_ptr<ConnectionThread>& thread : threads_) {
    thread->thread = std::thread([this, t = thread.get()] { Run(*t); });
  }
}

DataChannel::~DataChannel() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (const std::unique_ptr<ConnectionThread>& thread : threads_) thread->thread.join();
}

void DataChannel::Cancel() {
  cancel_.request_stop();
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (const std::unique_ptr<ConnectionThread>& thread : threads_) {
    if (thread->busy != nullptr) thread->busy->Shutdown();
  }
}

absl::Status DataChannel::CancelledStatus() {
  return absl::CancelledError("the data channel was cancelled (its client is going away)");
}

void DataChannel::Submit(DataTask task, std::stop_token stop, StopCut cut) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back({StopWith(stop, cut, std::move(task)), stop});
}

void DataChannel::Submit(RequestWriter write, DataTask task, std::stop_token stop, StopCut cut) {
  ConnectionThread* idle = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (tasks_.empty() && !cancelled_) {  // else the threads are busy, or about to take what is queued
      for (const std::unique_ptr<ConnectionThread>& thread : threads_) {
        // Waiting with an open connection and nothing handed to it: a thread woken for a
        // request written on its connection still counts as waiting until it runs.
        if (thread->waiting && !thread->lent && !thread->handoff.has_value() && thread->conn != nullptr) {
          idle = thread.get();
          idle->lent = true;
          break;
        }
      }
    }
    if (idle == nullptr) {
      tasks_.push_back({StopWith(stop, cut, WriteThen(std::move(write), std::move(task))), stop});
      return;
    }
  }
  // A connection the server closed while it sat idle goes to its thread, which opens a
  // fresh one for the request.
  const bool closed = idle->conn->PeerClosed();
  absl::Status write_status = closed                  ? absl::OkStatus()
                              : stop.stop_requested() ? StoppedStatus()
                                                      : write(*idle->conn);
  absl::MutexLock lock(&mu_);
  idle->lent = false;
  if (closed) {
    tasks_.push_back({StopWith(stop, cut, WriteThen(std::move(write), std::move(task))), stop});
  } else {
    idle->handoff = ConnectionThread::Handoff{StopWith(stop, cut, std::move(task)), std::move(write_status)};
  }
}

bool DataChannel::HasWork(const ConnectionThread& thread) const {
  return thread.handoff.has_value() || (!thread.lent && (stopping_ || !tasks_.empty()));
}

absl::StatusOr<std::unique_ptr<transport::Connection>> DataChannel::Open(std::stop_token stop) {
  // Either stop ends the connect and the hello.
  const EitherStop either(stop, cancel_.get_token());
  DataSession session;
  {
    absl::MutexLock lock(&session_mu_);
    session = session_;
  }
  absl::StatusOr<std::unique_ptr<transport::Connection>> conn = Hello(session, either.token());
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
    FLATSHARD_ASSIGN_OR_RETURN(renewed, renew_(either.token()));
    absl::MutexLock lock(&session_mu_);
    session_ = renewed;
  }
  return Hello(renewed, either.token());
}

absl::StatusOr<std::unique_ptr<transport::Connection>> DataChannel::Hello(const DataSession& session,
                                                                          std::stop_token stop) const {
  return transport::OpenDataConnection(session.data_address, session.token, timeout_, std::move(stop), session.secure);
}

void DataChannel::Run(ConnectionThread& self) {
  std::unique_ptr<transport::Connection>& conn = self.conn;
  struct Wake {
    const DataChannel* channel;
    const ConnectionThread* self;
  } wake{this, &self};
  while (true) {
    Queued next;
    DataTask& task = next.task;
    std::optional<ConnectionThread::Handoff> handoff;
    bool cancelled = false;
    {
      absl::MutexLock lock(&mu_);
      self.waiting = true;
      mu_.Await(absl::Condition(
          +[](Wake* wake) ABSL_NO_THREAD_SAFETY_ANALYSIS { return wake->channel->HasWork(*wake->self); }, &wake));
      self.waiting = false;
      cancelled = cancelled_;
      if (self.handoff.has_value()) {
        handoff = std::move(self.handoff);
        self.handoff.reset();
        // Its request is on `conn`: Cancel shuts it down from now on.
        if (!cancelled && handoff->write_status.ok()) self.busy = conn.get();
      } else if (tasks_.empty()) {
        return;  // stopping, and everything submitted has run
      } else {
        next = std::move(tasks_.front());
        tasks_.pop_front();
      }
    }
    if (handoff.has_value()) {  // a submitting thread wrote the request: read its answer
      if (cancelled || !handoff->write_status.ok()) {
        conn.reset();
        handoff->read(cancelled ? CancelledStatus() : handoff->write_status);
        continue;
      }
      // Its answer often comes within microseconds (a CUDA IPC call, a small gather): wait
      // for it awake for as long as Await waits for the caller.
      conn->PollReadable(kAwaitSpin);
      const bool reusable = handoff->read(conn.get());
      SetIdle(self);
      if (!reusable) conn.reset();
      continue;
    }
    if (cancelled) {
      task(CancelledStatus());
      continue;
    }
    // An idle connection the server has closed (it restarted, or the connection sat idle
    // past its limit) would fail the task: open a fresh one instead.
    if (conn != nullptr && conn->PeerClosed()) conn.reset();
    if (conn == nullptr) {
      absl::StatusOr<std::unique_ptr<transport::Connection>> opened = Open(next.stop);
      if (!opened.ok()) {
        task(opened.status());
        continue;
      }
      conn = std::move(*opened);
    }
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) {
        cancelled = true;
      } else {
        self.busy = conn.get();
      }
    }
    if (cancelled) {
      task(CancelledStatus());
      continue;
    }
    const bool reusable = task(conn.get());
    SetIdle(self);
    if (!reusable) conn.reset();
  }
}

void DataChannel::SetIdle(ConnectionThread& self) {
  absl::MutexLock lock(&mu_);
  self.busy = nullptr;
}

}  // namespace flatshard::client_internal
