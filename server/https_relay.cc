#include "server/https_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/tls_files.h"
#include "tls/tls_connection.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::server {
namespace {

// A server context with `tls`'s certificate chain and key (tls::ServerContext), asking
// scrapes for a certificate of the client CAs with metrics_client_certificates.
absl::StatusOr<tls::SslContext> MetricsContext(const TlsOptions& tls) {
  absl::StatusOr<tls::SslContext> context = tls::ServerContext(
      tls.cert_chain, "--tls_cert_file", tls.private_key, "--tls_key_file",
      tls.metrics_client_certificates ? tls.client_root_certs : "", "--tls_client_ca_file");
  if (context.ok()) return context;
  return absl::Status(context.status().code(), absl::StrCat("metrics over TLS: ", context.status().message()));
}

void SetTimeouts(int fd, absl::Duration timeout) {
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// A connection to 127.0.0.1:`port`, or -1.
int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  SetTimeouts(fd, HttpsRelay::kIoTimeout);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t sent = send(fd, data, size, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    data += sent;
    size -= static_cast<size_t>(sent);
  }
  return true;
}

bool SslWriteAll(SSL* ssl, const char* data, size_t size) {
  while (size > 0) {
    size_t written = 0;
    if (SSL_write_ex(ssl, data, size, &written) != 1) return false;
    data += written;
    size -= written;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpsRelay>> HttpsRelay::Start(const std::string& host, int port,
                                                              const TlsOptions& tls, const TlsFiles* files,
                                                              int backend_port) {
  FLATSHARD_ASSIGN_OR_RETURN(Context context, MetricsContext(files != nullptr ? files->current() : tls));
  FLATSHARD_ASSIGN_OR_RETURN(const auto listening, transport::ListenTcpSocket(host, port));
  std::unique_ptr<HttpsRelay> relay(
      new HttpsRelay(std::move(context), files, listening.first, listening.second, backend_port));
  relay->acceptor_ = std::thread([relay = relay.get()] { relay->AcceptLoop(); });
  return relay;
}

HttpsRelay::HttpsRelay(Context context, const TlsFiles* files, int listen_fd, int port, int backend_port)
    : context_(std::move(context)),
      files_(files),
      generation_(files != nullptr ? files->generation() : 0),
      listen_fd_(listen_fd),
      port_(port),
      backend_port_(backend_port) {}

HttpsRelay::Context HttpsRelay::CurrentContext() {
  if (files_ == nullptr || files_->generation() == generation_) return context_;
  generation_ = files_->generation();
  absl::StatusOr<Context> made = MetricsContext(files_->current());  // validated: OpenSSL takes it
  if (made.ok()) context_ = *std::move(made);
  return context_;
}

HttpsRelay::~HttpsRelay() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (int fd : open_) shutdown(fd, SHUT_RDWR);
  }
  shutdown(listen_fd_, SHUT_RDWR);  // wakes the acceptor's poll
  acceptor_.join();
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](std::set<int>* open) { return open->empty(); }, &open_));
  }
  close(listen_fd_);
}

void HttpsRelay::AcceptLoop() {
  // A client gone in the middle of an answer makes SSL_write's write() raise SIGPIPE,
  // which would end the process: blocked here, it is only EPIPE (the serving threads
  // inherit the mask).
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  for (;;) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (poll(&pfd, 1, -1) < 0 && errno != EINTR) return;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      if (errno == EINVAL) return;  // shut down
      absl::SleepFor(absl::Milliseconds(100));  // out of descriptors or memory: the peer waits
      continue;
    }
    Context context = CurrentContext();  // before the lock: it may read the files
    absl::MutexLock lock(&mu_);
    if (stopping_ || open_.size() >= kMaxConnections) {
      close(fd);
      continue;
    }
    open_.insert(fd);
    try {
      std::thread([this, fd, context = std::move(context)] { Serve(fd, context); }).detach();
    } catch (const std::system_error&) {  // out of threads: this scrape fails, the server goes on
      open_.erase(fd);
      close(fd);
    }
  }
}

void HttpsRelay::Serve(int fd, const Context& context) {
  SetTimeouts(fd, kIoTimeout);
  SSL* ssl = SSL_new(context.get());
  int backend = -1;
  if (ssl != nullptr && SSL_set_fd(ssl, fd) == 1 && SSL_accept(ssl) == 1) {
    // The request head (a scrape is a GET: nothing follows it).
    std::string request;
    char buffer[16 << 10];
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestHead) {
      size_t read = 0;
      if (SSL_read_ex(ssl, buffer, sizeof(buffer), &read) != 1) break;
      request.append(buffer, read);
    }
    backend = request.empty() ? -1 : ConnectLoopback(backend_port_);
    if (backend >= 0 && SendAll(backend, request.data(), request.size())) {
      shutdown(backend, SHUT_WR);
      for (ssize_t got; (got = recv(backend, buffer, sizeof(buffer), 0)) > 0;) {
        if (!SslWriteAll(ssl, buffer, static_cast<size_t>(got))) break;
      }
      SSL_shutdown(ssl);
    }
  }
  ERR_clear_error();  // this thread's queue: a failed handshake or a client gone
  SSL_free(ssl);
  if (backend >= 0) close(backend);
  absl::MutexLock lock(&mu_);
  close(fd);
  open_.erase(fd);
}

}  // namespace flatshard::server
