// TLS on the data plane: a transport::Connection that moves its bytes through OpenSSL over
// a TCP connection of the data plane (transport::SocketOf), for servers started with
// --tls_data_plane. The TCP connection stays underneath, owned by the TLS one: its
// timeouts (SetTimeout, SO_RCVTIMEO/SO_SNDTIMEO on the blocking socket) bound every read
// and write, the handshake's included, and its Shutdown, CloseSend and PeerClosed act on
// the socket, so they may still be called from another thread while a Send or Recv runs
// (an SSL object may not be used by two threads; those never touch it). A CloseSend or a
// close reads as the end of the stream to the peer (no close_notify is sent, and none is
// required: the protocol's messages carry their lengths). No session tickets are sent,
// so an idle connection carries no bytes and PeerClosed stays a look at the socket.
//
// The handshake happens on the first Send or Recv, which fail with Unavailable naming the
// peer and OpenSSL's reason (the certificate check's, where it failed) if it fails. A
// client checks the server's certificate against its CAs and the host it dialed (an IP
// address or DNS subject alternative name); a server asks the client for a certificate
// only when it was given client CAs (then one they signed for client use, or no
// handshake). TLS 1.2 or later. Writes never raise SIGPIPE (send with MSG_NOSIGNAL).
// Records go out through a 256 KiB buffer that each Send flushes before it returns, and
// come in 256 KiB reads ahead (PollReadable counts what was read ahead): OpenSSL would
// otherwise make a system call per 16 KiB record written and two per record read. While
// the peer's next request is read ahead (whole or in part), SendOrHold leaves up to 64 KiB
// of answers' records in that buffer, to go out with the next Send, SendHeld, or before a
// read needs the socket (a Recv, PollReadable or WaitReadable that what was read ahead
// does not satisfy), as over TCP (transport.h).
//
// Contexts are immutable once made and shared between connections (thread-safe); a
// connection is used by one sender and one receiver, not at once (transport.h).
//
//   FLATSHARD_ASSIGN_OR_RETURN(tls::SslContext context, tls::ClientContext(roots_pem, nullptr));
//   FLATSHARD_ASSIGN_OR_RETURN(auto conn, transport::ConnectTcp(host, port, timeout));
//   FLATSHARD_ASSIGN_OR_RETURN(conn, tls::ClientSide(std::move(conn), context, host));
#ifndef FLATSHARD_TLS_TLS_CONNECTION_H_
#define FLATSHARD_TLS_TLS_CONNECTION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace flatshard::tls {

using SslContext = std::shared_ptr<ssl_ctx_st>;

// A server's context presenting `cert_chain` (leaf first) with `private_key`; with
// `client_roots` (PEM; empty: none asked), handshakes end unless the client presents a
// certificate those CAs signed for client use. InvalidArgument naming `cert_what`,
// `key_what` or `client_roots_what` (where each came from) when OpenSSL refuses it.
[[nodiscard]] absl::StatusOr<SslContext> ServerContext(const std::string& cert_chain, absl::string_view cert_what,
                                                       const std::string& private_key, absl::string_view key_what,
                                                       const std::string& client_roots = "",
                                                       absl::string_view client_roots_what = "");

// A client's context checking servers against `roots` (PEM; empty: the system's CAs) and
// presenting `cert_chain` with `private_key` to servers that ask (both empty: none).
// InvalidArgument naming `what` when OpenSSL refuses them.
[[nodiscard]] absl::StatusOr<SslContext> ClientContext(const std::string& roots, const std::string& cert_chain,
                                                       const std::string& private_key, absl::string_view what);

// Whether `status` is a Send's or Recv's for a handshake that failed.
bool IsHandshakeFailure(const absl::Status& status);

// `tcp` (a TCP connection: transport::SocketOf) as the server's side of TLS with
// `context`. InvalidArgument for another kind of connection.
[[nodiscard]] absl::StatusOr<std::unique_ptr<transport::Connection>> ServerSide(
    std::unique_ptr<transport::Connection> tcp, SslContext context);

// `tcp` as the client's side of TLS with `context`, expecting a certificate that names
// `host` (an IPv4 address or a DNS name). InvalidArgument for another kind of connection.
[[nodiscard]] absl::StatusOr<std::unique_ptr<transport::Connection>> ClientSide(
    std::unique_ptr<transport::Connection> tcp, SslContext context, const std::string& host);

}  // namespace flatshard::tls

#endif  // FLATSHARD_TLS_TLS_CONNECTION_H_
