#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"

namespace flatshard::transport {
namespace {

absl::Status ErrnoStatus(absl::string_view what, int err) {
  if (err == EAGAIN || err == EWOULDBLOCK || err == ETIMEDOUT) {
    return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

absl::StatusOr<sockaddr_in> ResolveIpv4(absl::string_view host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port ", port, " out of range"));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const std::string name(host);
  if (inet_pton(AF_INET, name.c_str(), &addr.sin_addr) == 1) return addr;
  if (name.empty() || name.find(':') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", host, "' is neither an IPv4 address nor a host name (use e.g. 127.0.0.1)"));
  }
  // A name (a Kubernetes pod's DNS name, say): its first IPv4 address.
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int resolved = getaddrinfo(name.c_str(), nullptr, &hints, &found);
  if (resolved != 0 || found == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot resolve '", host, "' to an IPv4 address: ", resolved != 0 ? gai_strerror(resolved) : "no address"));
  }
  addr.sin_addr = reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr;
  freeaddrinfo(found);
  return addr;
}

// poll()'s timeout argument for waiting until `deadline`: -1 (forever) for an infinite
// one, else the milliseconds left, rounded up and clamped to what an int holds.
int PollMilliseconds(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
      std::numeric_limits<int>::max()));
}

void TuneSocket(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // Socket buffers are left to the kernel's autotuning: fixing them (4 MiB) measured
  // slower on loopback (bench/cluster_bench: 0.67x -> 0.74x of iperf3 for one stream).
}

std::string PeerName(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &addr.sin_addr, text, sizeof(text));
  return absl::StrCat(text, ":", ntohs(addr.sin_port));
}

// A Recv of fewer bytes than this goes through the connection's read-ahead buffer,
// which takes whatever the socket holds, up to kReadAheadBytes: a pipeline's requests
// (or answers) that arrived together cost one recv rather than two or three each. Larger
// ones land straight in the caller's memory once the bytes read ahead are taken.
constexpr size_t kDirectRecvBytes = size_t{16} << 10;
constexpr size_t kReadAheadBytes = size_t{64} << 10;
// SendOrHold holds at most this many bytes back: what does not fit goes out at once with
// what was held (copies cost more than they save past this).
constexpr size_t kHoldBytes = size_t{64} << 10;

class TcpConnection final : public Connection {
 public:
  explicit TcpConnection(int fd) : fd_(fd), peer_(PeerName(fd)) {}
  ~TcpConnection() override { close(fd_); }

  absl::Status SendOrHold(std::initializer_list<absl::Span<const std::byte>> buffers) override {
    size_t bytes = 0;
    for (absl::Span<const std::byte> buffer : buffers) bytes += buffer.size();
    if (ahead_end_ == ahead_begin_ || held_.size() + bytes > kHoldBytes) return Send(buffers);
    for (absl::Span<const std::byte> buffer : buffers) held_.insert(held_.end(), buffer.begin(), buffer.end());
    return absl::OkStatus();
  }

  absl::Status SendHeld() override { return held_.empty() ? absl::OkStatus() : Send({}); }

  absl::Status Send(std::initializer_list<absl::Span<const std::byte>> buffers) override {
    absl::InlinedVector<iovec, 5> iov;  // no allocation per send
    if (!held_.empty()) iov.push_back({held_.data(), held_.size()});  // first: sent before these
    absl::Cleanup sent_held = [this] {
      if (!held_.empty()) held_.clear();  // sent, or never will be (the connection is broken)
    };
    for (absl::Span<const std::byte> buffer : buffers) {
      if (!buffer.empty()) {
        iov.push_back({const_cast<std::byte*>(buffer.data()), buffer.size()});
      }
    }
    size_t first = 0;
    while (first < iov.size()) {
      msghdr msg{};
      msg.msg_iov = iov.data() + first;
      msg.msg_iovlen = iov.size() - first;
      const ssize_t sent = sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(absl::StrCat("send to ", peer_), errno);
      }
      size_t left = static_cast<size_t>(sent);
      while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
      if (first < iov.size()) {
        iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Recv(absl::Span<std::byte> buffer) override {
    // Later calls fail after Shutdown (transport.h), whatever was read ahead or is still
    // queued in the socket (which a shut-down socket would hand out).
    if (shut_down_.load(std::memory_order_relaxed)) {
      return absl::UnavailableError(absl::StrCat("receive from ", peer_, ": the connection was shut down"));
    }
    size_t done = TakeAhead(buffer);
    if (done < buffer.size()) FLATSHARD_RETURN_IF_ERROR(SendHeld());  // the peer may wait for them
    while (done < buffer.size()) {
      const bool direct = buffer.size() - done >= kDirectRecvBytes;
      if (!direct && ahead_ == nullptr) ahead_ = std::make_unique<std::byte[]>(kReadAheadBytes);
      std::byte* const into = direct ? buffer.data() + done : ahead_.get();
      const ssize_t got = recv(fd_, into, direct ? buffer.size() - done : kReadAheadBytes, 0);
      if (got == 0) {
        return absl::UnavailableError(absl::StrCat(peer_, " closed the connection after ", done,
                                                   " of ", buffer.size(), " bytes"));
      }
      if (got < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(absl::StrCat("receive from ", peer_, " after ", done, " of ",
                                        buffer.size(), " bytes"),
                           errno);
      }
      if (direct) {
        done += static_cast<size_t>(got);
      } else {
        ahead_begin_ = 0;
        ahead_end_ = static_cast<size_t>(got);
        done += TakeAhead(buffer.subspan(done));
      }
    }
    return absl::OkStatus();
  }

  absl::Status SetTimeout(absl::Duration timeout) override {
    if (timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("timeout ", absl::FormatDuration(timeout), " is not positive"));
    }
    // A zero timeval means "no timeout" to the kernel: round tiny timeouts up.
    timeval tv{};
    if (timeout != absl::InfiniteDuration()) {
      tv = absl::ToTimeval(std::max(timeout, absl::Microseconds(1)));
    }
    if (setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
        setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
      return ErrnoStatus("setsockopt(SO_RCVTIMEO)", errno);
    }
    return absl::OkStatus();
  }

  void Shutdown() override {
    shut_down_.store(true, std::memory_order_relaxed);
    shutdown(fd_, SHUT_RDWR);
  }
  void CloseSend() override { shutdown(fd_, SHUT_WR); }

  bool PeerClosed() override {
    pollfd pfd{fd_, POLLIN | POLLRDHUP, 0};
    if (poll(&pfd, 1, 0) <= 0) return false;  // nothing pending: open
    if (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
    std::byte byte;  // readable: a FIN reads as 0 bytes, an unexpected byte as data
    return recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) <= 0;
  }

  bool PollReadable(absl::Duration poll_for) override {
    if (ahead_end_ > ahead_begin_) return true;
    if (!SendHeld().ok()) return true;  // Recv reports the broken connection
    const absl::Time until = absl::Now() + poll_for;
    while (true) {
      pollfd pfd{fd_, POLLIN, 0};
      if (poll(&pfd, 1, 0) != 0) return true;  // readable, closed, or an error Recv reports
      if (absl::Now() >= until) return false;
      std::this_thread::yield();
    }
  }

  bool WaitReadable(absl::Duration timeout) override {
    if (ahead_end_ > ahead_begin_) return true;
    if (!SendHeld().ok()) return true;  // Recv reports the broken connection
    const bool limited = timeout != absl::InfiniteDuration();
    const absl::Time until = absl::Now() + timeout;
    while (true) {
      int wait_ms = -1;  // no limit
      if (limited) {
        const absl::Duration left = std::max(until - absl::Now(), absl::ZeroDuration());
        wait_ms = static_cast<int>(std::min<int64_t>(
            absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), std::numeric_limits<int>::max()));
      }
      pollfd pfd{fd_, POLLIN, 0};
      const int ready = poll(&pfd, 1, wait_ms);
      if (ready > 0) return true;                    // readable, closed, shut down, or an error Recv reports
      if (ready < 0 && errno != EINTR) return true;  // Recv reports it
      if (limited && absl::Now() >= until) return false;
    }
  }

  std::string peer() const override { return peer_; }

  int fd() const { return fd_; }

 private:
  // Moves what was read ahead into the front of `buffer`; returns how many bytes.
  size_t TakeAhead(absl::Span<std::byte> buffer) {
    const size_t taken = std::min(buffer.size(), ahead_end_ - ahead_begin_);
    if (taken > 0) std::memcpy(buffer.data(), ahead_.get() + ahead_begin_, taken);
    ahead_begin_ += taken;
    return taken;
  }

  const int fd_;
  const std::string peer_;
  std::atomic<bool> shut_down_{false};
  // Bytes read ahead (the receiver's: see Connection's rules): [ahead_begin_, ahead_end_)
  // of ahead_, which is allocated with the first Recv that uses it.
  std::unique_ptr<std::byte[]> ahead_;
  size_t ahead_begin_ = 0;
  size_t ahead_end_ = 0;
  // Bytes SendOrHold held back (the sender's, who is then the receiver too).
  std::vector<std::byte> held_;
};

class TcpListener final : public Listener {
 public:
  TcpListener(int fd, int port) : fd_(fd), port_(port) {}
  ~TcpListener() override { close(fd_); }

  absl::StatusOr<std::unique_ptr<Connection>> Accept() override {
    while (true) {
      if (shut_down_.load()) return absl::CancelledError("listener shut down");
      pollfd pfd{fd_, POLLIN, 0};
      const int ready = poll(&pfd, 1, 200);  // wake up regularly to notice Shutdown()
      if (ready < 0 && errno != EINTR) return ErrnoStatus("poll", errno);
      if (ready <= 0) continue;
      const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) {
        const int err = errno;
        if (err == EINTR || err == EAGAIN || err == ECONNABORTED) continue;
        if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
          // The peer stays in the backlog and the socket readable: a caller that tried
          // again at once would spin until descriptors or memory come free.
          absl::SleepFor(kOutOfResourcesPause);
          return absl::ResourceExhaustedError(absl::StrCat("accept: ", std::strerror(err)));
        }
        return ErrnoStatus("accept", err);
      }
      TuneSocket(conn);
      return std::make_unique<TcpConnection>(conn);
    }
  }

  void Shutdown() override { shut_down_.store(true); }
  int port() const override { return port_; }

 private:
  const int fd_;
  const int port_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace

absl::StatusOr<std::vector<int>> PickFreeLoopbackPorts(int count) {
  std::vector<std::unique_ptr<Listener>> held;
  std::vector<int> ports;
  for (int i = 0; i < count; ++i) {
    FLATSHARD_ASSIGN_OR_RETURN(std::unique_ptr<Listener> listener, ListenTcp("127.0.0.1", 0));
    ports.push_back(listener->port());
    held.push_back(std::move(listener));
  }
  return ports;  // `held` closes every socket here
}

absl::Status SplitHostPort(absl::string_view address, std::string& host, int& port) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not HOST:PORT (e.g. 127.0.0.1:7070)"));
  }
  host = std::string(address.substr(0, colon));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Listener>> ListenTcp(absl::string_view host, int port) {
  FLATSHARD_ASSIGN_OR_RETURN(const auto listening, ListenTcpSocket(host, port));
  return std::make_unique<TcpListener>(listening.first, listening.second);
}

absl::StatusOr<std::pair<int, int>> ListenTcpSocket(absl::string_view host, int port) {
  FLATSHARD_ASSIGN_OR_RETURN(sockaddr_in addr, ResolveIpv4(host, port));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", errno);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoStatus(absl::StrCat("bind ", host, ":", port), err);
  }
  if (listen(fd, 512) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoStatus("listen", err);
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::make_pair(fd, static_cast<int>(ntohs(addr.sin_port)));
}

int SocketOf(const Connection& conn) {
  const auto* tcp = dynamic_cast<const TcpConnection*>(&conn);
  return tcp != nullptr ? tcp->fd() : -1;
}

absl::StatusOr<std::unique_ptr<Connection>> ConnectTcp(absl::string_view host, int port, absl::Duration timeout,
                                                       std::stop_token stop) {
  FLATSHARD_ASSIGN_OR_RETURN(sockaddr_in addr, ResolveIpv4(host, port));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return ErrnoStatus("socket", errno);
  const std::string what = absl::StrCat("connect to ", host, ":", port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) {
      const int err = errno;
      close(fd);
      return ErrnoStatus(what, err);
    }
    const absl::Time deadline = absl::Now() + timeout;
    pollfd pfd{fd, POLLOUT, 0};
    int ready = 0;
    // In slices when a stop may come (nothing wakes a poll for it).
    const bool stoppable = stop.stop_possible();
    do {
      if (stop.stop_requested()) {
        close(fd);
        return absl::CancelledError(absl::StrCat(what, ": stopped"));
      }
      const absl::Time until = stoppable ? std::min(deadline, absl::Now() + kConnectStopCheck) : deadline;
      ready = poll(&pfd, 1, PollMilliseconds(until));
    } while ((ready < 0 && errno == EINTR) || (ready == 0 && stoppable && absl::Now() < deadline));
    int err = 0;
    socklen_t len = sizeof(err);
    if (ready <= 0) {
      err = ready == 0 ? ETIMEDOUT : errno;
    } else {
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err != 0) {
      close(fd);
      return ErrnoStatus(what, err);
    }
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  TuneSocket(fd);
  return std::make_unique<TcpConnection>(fd);
}

}  // namespace flatshard::transport
