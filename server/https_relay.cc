#include "server/https_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/tls_files.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::server {
namespace {

// The first error OpenSSL queued, as text (and the queue cleared).
std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "unknown error";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

// A server context with `tls`'s certificate chain (leaf first) and key, TLS 1.2 or later,
// asking clients for a certificate of tls.client_root_certs with metrics_client_certificates.
absl::StatusOr<SSL_CTX*> ServerContext(const TlsOptions& tls) {
  SSL_CTX* context = SSL_CTX_new(TLS_server_method());
  if (context == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpenSslError()));
  auto refuse = [&](absl::string_view what) {
    const std::string why = OpenSslError();
    SSL_CTX_free(context);
    return absl::InvalidArgumentError(absl::StrCat("metrics over TLS: ", what, ": ", why));
  };
  SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION);
  BIO* chain = BIO_new_mem_buf(tls.cert_chain.data(), static_cast<int>(tls.cert_chain.size()));
  X509* leaf = chain != nullptr ? PEM_read_bio_X509(chain, nullptr, nullptr, nullptr) : nullptr;
  const bool used = leaf != nullptr && SSL_CTX_use_certificate(context, leaf) == 1;
  X509_free(leaf);
  // The intermediates after the leaf; the context owns each one added.
  for (X509* intermediate; used && (intermediate = PEM_read_bio_X509(chain, nullptr, nullptr, nullptr)) != nullptr;) {
    if (SSL_CTX_add0_chain_cert(context, intermediate) != 1) X509_free(intermediate);
  }
  BIO_free(chain);
  ERR_clear_error();  // the end of the chain reads as an error
  if (!used) return refuse("the certificate of --tls_cert_file");
  BIO* key_pem = BIO_new_mem_buf(tls.private_key.data(), static_cast<int>(tls.private_key.size()));
  EVP_PKEY* key = key_pem != nullptr ? PEM_read_bio_PrivateKey(key_pem, nullptr, nullptr, nullptr) : nullptr;
  BIO_free(key_pem);
  const bool key_used = key != nullptr && SSL_CTX_use_PrivateKey(context, key) == 1;
  EVP_PKEY_free(key);
  if (!key_used || SSL_CTX_check_private_key(context) != 1) return refuse("the key of --tls_key_file");
  if (tls.metrics_client_certificates) {
    // Handshakes end unless the client presents a certificate these CAs signed for client
    // use (OpenSSL's server side verifies with the ssl_client purpose).
    X509_STORE* store = SSL_CTX_get_cert_store(context);
    BIO* bundle = BIO_new_mem_buf(tls.client_root_certs.data(), static_cast<int>(tls.client_root_certs.size()));
    int added = 0;
    for (X509* ca; bundle != nullptr && (ca = PEM_read_bio_X509(bundle, nullptr, nullptr, nullptr)) != nullptr;) {
      added += X509_STORE_add_cert(store, ca) == 1 ? 1 : 0;
      X509_free(ca);
    }
    BIO_free(bundle);
    ERR_clear_error();  // the end of the bundle reads as an error
    if (added == 0) return refuse("the CAs of --tls_client_ca_file");
    SSL_CTX_set_verify(context, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return context;
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
  FLATSHARD_ASSIGN_OR_RETURN(SSL_CTX * made, ServerContext(files != nullptr ? files->current() : tls));
  Context context(made, SSL_CTX_free);
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
  absl::StatusOr<SSL_CTX*> made = ServerContext(files_->current());  // validated: OpenSSL takes it
  if (made.ok()) context_ = Context(*made, SSL_CTX_free);
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
    std::thread([this, fd, context = std::move(context)] { Serve(fd, context); }).detach();
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
