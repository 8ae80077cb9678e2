#include "tls/tls_connection.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "transport/tcp/tcp_transport.h"

namespace flatshard::tls {
namespace {

// Buffers of one Send smaller than this go out together, as one TLS record (its largest).
constexpr size_t kRecordBytes = 16 << 10;
// Records are written to the socket, and read from it, this many bytes at a time: OpenSSL
// writes each 16 KiB record with a call of its own, and reads each in two (its header,
// then its body), which cost more than the encryption at loopback speeds.
constexpr int kSocketChunkBytes = 256 << 10;
constexpr absl::string_view kHandshakeFailed = "TLS handshake with ";
// SendOrHold holds at most this many bytes of records back (as over TCP).
constexpr size_t kHoldBytes = size_t{64} << 10;

// The first error OpenSSL queued on this thread, as text; the queue is cleared.
std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "unknown error";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

// A BIO over a blocking socket (its descriptor as the BIO's data). OpenSSL's own socket
// BIO writes with write(), which raises SIGPIPE once the peer has gone; this one sends
// with MSG_NOSIGNAL. A timeout (SO_RCVTIMEO/SO_SNDTIMEO: EAGAIN) reads as a retry, which
// SSL reports as SSL_ERROR_WANT_READ/WRITE; the end of the stream as BIO_eof, which SSL
// (SSL_OP_IGNORE_UNEXPECTED_EOF) reports as SSL_ERROR_ZERO_RETURN.
int SocketOfBio(BIO* bio) { return static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(bio))); }

int SocketWrite(BIO* bio, const char* data, int size) {
  BIO_clear_retry_flags(bio);
  for (;;) {
    const ssize_t sent = send(SocketOfBio(bio), data, static_cast<size_t>(size), MSG_NOSIGNAL);
    if (sent >= 0) return static_cast<int>(sent);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_write(bio);
    return -1;
  }
}

// Records of answers that SendOrHold left in an SSL's write buffer: the socket's read BIO
// (whose app data this is) sends them before it reads, since the peer may wait for them
// before it sends more. OpenSSL reads the socket only when what it read ahead does not
// hold the record it needs, which is exactly when holding must end.
struct HeldRecords {
  BIO* buffer = nullptr;  // the write buffer
  size_t bytes = 0;       // the answers' bytes held there; 0: none (what a failed send left is not sent)
};

int SocketRead(BIO* bio, char* data, int size) {
  BIO_clear_retry_flags(bio);
  auto* const held = static_cast<HeldRecords*>(BIO_get_app_data(bio));
  if (held != nullptr && held->bytes > 0) {
    held->bytes = 0;
    if (BIO_flush(held->buffer) != 1) {
      if (BIO_should_retry(held->buffer)) BIO_set_retry_read(bio);  // the send timed out: as the read's timeout
      return -1;                                                    // errno says why
    }
  }
  for (;;) {
    const ssize_t got = recv(SocketOfBio(bio), data, static_cast<size_t>(size), 0);
    if (got == 0) BIO_set_flags(bio, BIO_FLAGS_IN_EOF);  // BIO_eof: how SSL tells a close from an error
    if (got >= 0) return static_cast<int>(got);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_read(bio);
    return -1;
  }
}

long SocketControl(BIO* bio, int command, long, void*) {
  switch (command) {
    case BIO_CTRL_FLUSH:
      return 1;
    case BIO_CTRL_EOF:
      return BIO_test_flags(bio, BIO_FLAGS_IN_EOF) != 0 ? 1 : 0;
    default:
      return 0;
  }
}

const BIO_METHOD* SocketMethod() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* made = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "flatshard socket");
    BIO_meth_set_write(made, SocketWrite);
    BIO_meth_set_read(made, SocketRead);
    BIO_meth_set_ctrl(made, SocketControl);
    return made;
  }();
  return method;
}

// A context of `method`: TLS 1.2 or later, no session tickets or cache (nothing crosses
// an idle connection), the end of the stream without close_notify read as a close.
absl::StatusOr<SslContext> NewContext(const SSL_METHOD* method) {
  SSL_CTX* context = SSL_CTX_new(method);
  if (context == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", OpenSslError()));
  SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION);
  SSL_CTX_set_options(context, SSL_OP_NO_TICKET | SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION);
  SSL_CTX_set_num_tickets(context, 0);
  SSL_CTX_set_session_cache_mode(context, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_read_ahead(context, 1);
  SSL_CTX_set_default_read_buffer_len(context, kSocketChunkBytes);
  return SslContext(context, SSL_CTX_free);
}

// Presents `cert_chain` (leaf first, then its intermediates) with `private_key`.
absl::Status UseIdentity(SSL_CTX* context, const std::string& cert_chain, absl::string_view cert_what,
                         const std::string& private_key, absl::string_view key_what) {
  BIO* chain = BIO_new_mem_buf(cert_chain.data(), static_cast<int>(cert_chain.size()));
  X509* leaf = chain != nullptr ? PEM_read_bio_X509(chain, nullptr, nullptr, nullptr) : nullptr;
  const bool used = leaf != nullptr && SSL_CTX_use_certificate(context, leaf) == 1;
  X509_free(leaf);
  // The intermediates after the leaf; the context owns each one added.
  for (X509* intermediate; used && (intermediate = PEM_read_bio_X509(chain, nullptr, nullptr, nullptr)) != nullptr;) {
    if (SSL_CTX_add0_chain_cert(context, intermediate) != 1) X509_free(intermediate);
  }
  BIO_free(chain);
  ERR_clear_error();  // the end of the chain reads as an error
  if (!used) return absl::InvalidArgumentError(absl::StrCat("the certificate of ", cert_what, ": ", OpenSslError()));
  BIO* key_pem = BIO_new_mem_buf(private_key.data(), static_cast<int>(private_key.size()));
  EVP_PKEY* key = key_pem != nullptr ? PEM_read_bio_PrivateKey(key_pem, nullptr, nullptr, nullptr) : nullptr;
  BIO_free(key_pem);
  const bool key_used = key != nullptr && SSL_CTX_use_PrivateKey(context, key) == 1;
  EVP_PKEY_free(key);
  if (!key_used || SSL_CTX_check_private_key(context) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("the key of ", key_what, ": ", OpenSslError()));
  }
  return absl::OkStatus();
}

// Trusts the CAs of `pem`; InvalidArgument naming `what` when it holds none.
absl::Status TrustCertificates(SSL_CTX* context, const std::string& pem, absl::string_view what) {
  X509_STORE* store = SSL_CTX_get_cert_store(context);
  BIO* bundle = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  int added = 0;
  for (X509* ca; bundle != nullptr && (ca = PEM_read_bio_X509(bundle, nullptr, nullptr, nullptr)) != nullptr;) {
    added += X509_STORE_add_cert(store, ca) == 1 ? 1 : 0;
    X509_free(ca);
  }
  BIO_free(bundle);
  ERR_clear_error();  // the end of the bundle reads as an error
  if (added == 0) return absl::InvalidArgumentError(absl::StrCat(what, " holds no CA certificate"));
  return absl::OkStatus();
}

class TlsConnection final : public transport::Connection {
 public:
  // Owns `ssl`, which moves its bytes on `tcp`'s socket.
  TlsConnection(std::unique_ptr<transport::Connection> tcp, SSL* ssl)
      : tcp_(std::move(tcp)), ssl_(ssl), held_{.buffer = SSL_get_wbio(ssl)} {
    BIO_set_app_data(SSL_get_rbio(ssl), &held_);
  }
  ~TlsConnection() override { SSL_free(ssl_); }  // then tcp_ closes the socket

  absl::Status SendOrHold(std::initializer_list<absl::Span<const std::byte>> buffers) override {
    size_t bytes = 0;
    for (absl::Span<const std::byte> buffer : buffers) bytes += buffer.size();
    // Held: records in the write buffer. Read ahead: bytes OpenSSL holds, whole or part of
    // a record, that the peer sent after what this side has received.
    if (SSL_has_pending(ssl_) != 1 || held_.bytes + bytes > kHoldBytes) return Send(buffers);
    FLATSHARD_RETURN_IF_ERROR(WriteRecords(buffers));
    held_.bytes += bytes;
    return absl::OkStatus();
  }

  absl::Status SendHeld() override { return held_.bytes > 0 ? Flush() : absl::OkStatus(); }

  absl::Status Send(std::initializer_list<absl::Span<const std::byte>> buffers) override {
    FLATSHARD_RETURN_IF_ERROR(WriteRecords(buffers));
    return Flush();
  }

  absl::Status Recv(absl::Span<std::byte> buffer) override {
    size_t done = 0;
    while (done < buffer.size()) {
      size_t got = 0;
      const int result = SSL_read_ex(ssl_, buffer.data() + done, buffer.size() - done, &got);
      if (result != 1) {
        return Failed(result, absl::StrCat("receive from ", tcp_->peer(), " after ", done, " of ", buffer.size(),
                                           " bytes"));
      }
      done += got;
    }
    return absl::OkStatus();
  }

  absl::Status SetTimeout(absl::Duration timeout) override { return tcp_->SetTimeout(timeout); }
  void Shutdown() override { tcp_->Shutdown(); }
  void CloseSend() override { tcp_->CloseSend(); }
  bool PeerClosed() override { return tcp_->PeerClosed(); }
  // Read ahead, or on the socket once what is held has gone (a failure to send it: Recv
  // reports the broken connection).
  bool PollReadable(absl::Duration poll_for) override {
    return SSL_has_pending(ssl_) == 1 || !SendHeld().ok() || tcp_->PollReadable(poll_for);
  }
  bool WaitReadable(absl::Duration timeout) override {
    return SSL_has_pending(ssl_) == 1 || !SendHeld().ok() || tcp_->WaitReadable(timeout);
  }
  std::string peer() const override { return tcp_->peer(); }

 private:
  // Writes `buffers` as records into the write buffer (small ones together, one record at
  // most 16 KiB); the buffer sends what does not fit in it.
  absl::Status WriteRecords(std::initializer_list<absl::Span<const std::byte>> buffers) {
    pending_.clear();
    for (absl::Span<const std::byte> buffer : buffers) {
      if (pending_.size() + buffer.size() <= kRecordBytes) {
        pending_.insert(pending_.end(), buffer.begin(), buffer.end());
        continue;
      }
      if (!pending_.empty()) {  // topped up to a whole record from this buffer's head
        const size_t taken = kRecordBytes - pending_.size();
        pending_.insert(pending_.end(), buffer.begin(), buffer.begin() + static_cast<ptrdiff_t>(taken));
        buffer.remove_prefix(taken);
        FLATSHARD_RETURN_IF_ERROR(Write(pending_.data(), pending_.size()));
        pending_.clear();
      }
      if (buffer.size() <= kRecordBytes) {
        pending_.insert(pending_.end(), buffer.begin(), buffer.end());
      } else {
        FLATSHARD_RETURN_IF_ERROR(Write(buffer.data(), buffer.size()));
      }
    }
    if (!pending_.empty()) FLATSHARD_RETURN_IF_ERROR(Write(pending_.data(), pending_.size()));
    return absl::OkStatus();
  }

  absl::Status Write(const std::byte* data, size_t size) {
    while (size > 0) {
      size_t written = 0;
      const int result = SSL_write_ex(ssl_, data, size, &written);
      if (result != 1) return Failed(result, absl::StrCat("send to ", tcp_->peer()));
      data += written;
      size -= written;
    }
    return absl::OkStatus();
  }

  // Writes out the records the write buffer holds.
  absl::Status Flush() {
    held_.bytes = 0;
    BIO* buffer = held_.buffer;
    if (BIO_flush(buffer) == 1) return absl::OkStatus();
    const int saved_errno = errno;
    ERR_clear_error();
    const std::string what = absl::StrCat("send to ", tcp_->peer());
    if (BIO_should_retry(buffer)) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(saved_errno)));
  }

  // The status of an SSL call that returned `result`, doing `what`.
  absl::Status Failed(int result, const std::string& what) {
    const int saved_errno = errno;
    const int error = SSL_get_error(ssl_, result);
    std::string reason;
    switch (error) {
      case SSL_ERROR_WANT_READ:
      case SSL_ERROR_WANT_WRITE:  // the socket's timeout passed
        ERR_clear_error();
        return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
      case SSL_ERROR_ZERO_RETURN:
        ERR_clear_error();
        return absl::UnavailableError(absl::StrCat(what, ": ", tcp_->peer(), " closed the connection"));
      case SSL_ERROR_SYSCALL:
        reason = saved_errno != 0 ? std::strerror(saved_errno) : "the connection ended";
        ERR_clear_error();
        break;
      default:
        reason = OpenSslError();
    }
    if (SSL_is_init_finished(ssl_) != 1) {
      const long verified = SSL_get_verify_result(ssl_);
      if (verified != X509_V_OK) {
        reason = absl::StrCat("certificate verify failed: ", X509_verify_cert_error_string(verified));
      }
      return absl::UnavailableError(absl::StrCat(kHandshakeFailed, tcp_->peer(), " failed: ", reason));
    }
    return absl::UnavailableError(absl::StrCat(what, ": ", reason));
  }

  const std::unique_ptr<transport::Connection> tcp_;
  SSL* const ssl_;
  std::vector<std::byte> pending_;  // a Send's small buffers, sent as one record
  HeldRecords held_;                // what SendOrHold left in the write buffer
};

// A socket BIO on `fd`, or null.
BIO* NewSocketBio(int fd) {
  BIO* bio = BIO_new(SocketMethod());
  if (bio == nullptr) return nullptr;
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  BIO_set_init(bio, 1);
  return bio;
}

// An SSL of `context` on `tcp`'s socket, in neither state yet: it reads from the socket
// (ahead, kSocketChunkBytes at a time) and writes through a buffer of that size, which
// SSL flushes in its handshake and Send at its end (and a read from the socket, of the
// answers SendOrHold held there: HeldRecords).
absl::StatusOr<SSL*> NewSsl(const transport::Connection& tcp, const SslContext& context) {
  const int fd = transport::SocketOf(tcp);
  if (fd < 0) return absl::InvalidArgumentError("TLS goes over a TCP connection of the data plane");
  SSL* ssl = SSL_new(context.get());
  BIO* reads = ssl != nullptr ? NewSocketBio(fd) : nullptr;
  BIO* writes = reads != nullptr ? NewSocketBio(fd) : nullptr;
  BIO* buffer = writes != nullptr ? BIO_new(BIO_f_buffer()) : nullptr;
  if (buffer == nullptr || BIO_set_write_buffer_size(buffer, kSocketChunkBytes) != 1) {
    BIO_free(buffer);
    BIO_free(writes);
    BIO_free(reads);
    SSL_free(ssl);
    return absl::InternalError(absl::StrCat("SSL_new: ", OpenSslError()));
  }
  SSL_set_bio(ssl, reads, BIO_push(buffer, writes));  // the SSL owns the three
  return ssl;
}

}  // namespace

bool IsHandshakeFailure(const absl::Status& status) {
  return absl::IsUnavailable(status) && absl::StartsWith(status.message(), kHandshakeFailed);
}

absl::StatusOr<SslContext> ServerContext(const std::string& cert_chain, absl::string_view cert_what,
                                         const std::string& private_key, absl::string_view key_what,
                                         const std::string& client_roots, absl::string_view client_roots_what) {
  FLATSHARD_ASSIGN_OR_RETURN(SslContext context, NewContext(TLS_server_method()));
  FLATSHARD_RETURN_IF_ERROR(UseIdentity(context.get(), cert_chain, cert_what, private_key, key_what));
  if (!client_roots.empty()) {
    // OpenSSL's server side checks the client's certificate for the ssl_client purpose.
    FLATSHARD_RETURN_IF_ERROR(TrustCertificates(context.get(), client_roots, client_roots_what));
    SSL_CTX_set_verify(context.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return context;
}

absl::StatusOr<SslContext> ClientContext(const std::string& roots, const std::string& cert_chain,
                                         const std::string& private_key, absl::string_view what) {
  FLATSHARD_ASSIGN_OR_RETURN(SslContext context, NewContext(TLS_client_method()));
  if (roots.empty()) {
    if (SSL_CTX_set_default_verify_paths(context.get()) != 1) {
      return absl::InternalError(absl::StrCat("the system's CAs: ", OpenSslError()));
    }
  } else {
    FLATSHARD_RETURN_IF_ERROR(TrustCertificates(context.get(), roots, absl::StrCat("the CA bundle of ", what)));
  }
  SSL_CTX_set_verify(context.get(), SSL_VERIFY_PEER, nullptr);
  if (!cert_chain.empty()) {
    FLATSHARD_RETURN_IF_ERROR(UseIdentity(context.get(), cert_chain, absl::StrCat("the client certificate of ", what),
                                          private_key, absl::StrCat("the client key of ", what)));
  }
  return context;
}

absl::StatusOr<std::unique_ptr<transport::Connection>> ServerSide(std::unique_ptr<transport::Connection> tcp,
                                                                  SslContext context) {
  FLATSHARD_ASSIGN_OR_RETURN(SSL * ssl, NewSsl(*tcp, context));
  SSL_set_accept_state(ssl);
  return std::make_unique<TlsConnection>(std::move(tcp), ssl);
}

absl::StatusOr<std::unique_ptr<transport::Connection>> ClientSide(std::unique_ptr<transport::Connection> tcp,
                                                                  SslContext context, const std::string& host) {
  FLATSHARD_ASSIGN_OR_RETURN(SSL * ssl, NewSsl(*tcp, context));
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  in_addr address{};
  const bool named = inet_pton(AF_INET, host.c_str(), &address) == 1
                         ? X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) == 1
                         : SSL_set1_host(ssl, host.c_str()) == 1 && SSL_set_tlsext_host_name(ssl, host.c_str()) == 1;
  if (!named) {
    SSL_free(ssl);
    return absl::InvalidArgumentError(absl::StrCat("'", host, "' cannot name a TLS server: ", OpenSslError()));
  }
  SSL_set_connect_state(ssl);
  return std::make_unique<TlsConnection>(std::move(tcp), ssl);
}

}  // namespace flatshard::tls
