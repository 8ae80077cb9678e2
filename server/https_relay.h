// HttpsRelay: TLS in front of an HTTP endpoint of this process, for the metrics endpoint
// of a server whose control plane speaks TLS (civetweb's own TLS, which prometheus-cpp's
// Exposer would use, does not work with Debian 12's OpenSSL 3). It listens on HOST:PORT,
// completes a TLS handshake (TLS 1.2 or later) with this server's certificate chain and
// key, reads one HTTP request head, passes it to the endpoint at 127.0.0.1:`backend_port`
// with the sending side then closed, and relays the endpoint's answer back until the
// endpoint closes (it answers one request per connection). A client that does not speak
// TLS gets a handshake failure and nothing else; so does one without a certificate of the
// client CAs where TlsOptions::metrics_client_certificates asks for one. With TlsFiles,
// each connection gets their current pair and client CAs (server/tls_files.h).
//
// Up to kMaxConnections are served at once, each on a thread of its own with kIoTimeout
// per read or write; a connection past that is closed at once. The destructor stops
// accepting, cuts the connections in progress and waits for their threads.
// Thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto relay, HttpsRelay::Start("0.0.0.0", 7072, tls, files, endpoint_port));
#ifndef FLATSHARD_SERVER_HTTPS_RELAY_H_
#define FLATSHARD_SERVER_HTTPS_RELAY_H_

#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/tls.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace flatshard::server {

class TlsFiles;  // server/tls_files.h

class HttpsRelay {
 public:
  static constexpr int kMaxConnections = 16;
  static constexpr absl::Duration kIoTimeout = absl::Seconds(10);
  static constexpr size_t kMaxRequestHead = 16 << 10;

  // Unavailable when HOST:PORT cannot be bound (port 0 picks one); InvalidArgument when
  // OpenSSL refuses `tls` (enabled; ValidateTls checks it first). `files` (null: `tls`
  // for good) outlive the relay.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HttpsRelay>> Start(const std::string& host, int port,
                                                                       const TlsOptions& tls, const TlsFiles* files,
                                                                       int backend_port);
  ~HttpsRelay();
  HttpsRelay(const HttpsRelay&) = delete;
  HttpsRelay& operator=(const HttpsRelay&) = delete;

  int port() const { return port_; }

 private:
  using Context = std::shared_ptr<ssl_ctx_st>;
  HttpsRelay(Context context, const TlsFiles* files, int listen_fd, int port, int backend_port);
  void AcceptLoop();
  // The context for the next connection: of the files' current pair.
  Context CurrentContext();
  // Relays one connection (its descriptor, registered in open_) with `context`; closes it.
  void Serve(int fd, const Context& context);

  // The acceptor thread's: the context new connections get, of `files_`' pair of
  // generation `generation_`.
  Context context_;
  const TlsFiles* const files_;
  uint64_t generation_ = 0;
  const int listen_fd_;
  const int port_;
  const int backend_port_;
  std::thread acceptor_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::set<int> open_ ABSL_GUARDED_BY(mu_);  // connections being served
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_HTTPS_RELAY_H_
