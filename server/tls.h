// TLS for the gRPC control plane (DESIGN.md, "Security"). A server given a certificate
// and its key serves gRPC over TLS and calls its peers over TLS, checking their
// certificates against the CA bundle it was given (the system's roots when none). Each
// server's certificate must name the host of its --listen address (an IP or DNS
// subject alternative name), since that is the name clients and peers dial. Without a
// certificate the control plane is plaintext, as before.
//
// With a client CA bundle (--tls_client_ca_file) the control plane asks every caller for
// a certificate and completes only handshakes whose certificate one of those CAs signed
// for client use (mutual TLS); the cluster token is still asked for on every call. A
// server presents its own certificate in its calls to its peers, so the bundle must
// hold the CA of the servers' certificates too, and those must allow client
// authentication (extendedKeyUsage clientAuth, or none): ValidateTls checks both. With
// metrics_client_certificates the metrics endpoint asks its scrapes for one as well (and
// still for the metrics token).
//
// A renewed certificate is served without a restart: with a reload interval, the
// certificate and key files are read again that often, and at once on SIGHUP
// (server/tls_files.h), and a new
// pair that goes together is presented by the control plane and the metrics endpoint in
// the handshakes that follow; a pair that does not (one file replaced before the other,
// a wrong key) is ignored until it does. So are the CA bundles: the handshakes that follow
// a change check against the new one, so a CA can be rotated without a restart (add the
// new CA to every bundle, renew the certificates, drop the old CA).
//
// The data plane stays plain TCP by default, for speed: a data connection is accepted
// only with a session token the server issued over this control plane, so with TLS the
// token never crosses the network in the clear, but the tensor bytes and the session
// token in the hello do (run it on a trusted network, or under IPsec or WireGuard). With
// data_plane (--tls_data_plane) its connections speak TLS too (tls/tls_connection.h),
// with this server's certificate, checked by clients and peers as the control plane's
// is, and asking for client certificates as the control plane does; renewals and CA
// changes reach the connections opened after them.
//
//   TlsOptions tls{.cert_chain = pem, .private_key = key_pem, .root_certs = ca_pem};
//   FLATSHARD_RETURN_IF_ERROR(ValidateTls(tls));
//   builder.AddListeningPort(address, ServerCredentials(tls), &port);
#ifndef FLATSHARD_SERVER_TLS_H_
#define FLATSHARD_SERVER_TLS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/data_protocol.h"
#include "transport/transport.h"

namespace grpc {
class ServerCredentials;
class ChannelCredentials;
}  // namespace grpc

namespace flatshard::server {

class TlsFiles;  // server/tls_files.h

// PEM texts, as read from --tls_cert_file, --tls_key_file and --tls_ca_file.
struct TlsOptions {
  std::string cert_chain;   // this server's certificate (then its intermediates); empty: no TLS
  std::string private_key;  // the certificate's key
  std::string root_certs;   // CAs that sign the peers' certificates; empty: the system's
  // CAs that sign the certificates every caller must present; empty: none is asked for.
  std::string client_root_certs = {};
  // Whether scrapes of the metrics endpoint must present such a certificate too
  // (--metrics_client_certificates); needs client CAs.
  bool metrics_client_certificates = false;
  // Whether the data plane speaks TLS too (--tls_data_plane, tls/tls_connection.h): its
  // connections complete a handshake before their hello, with the same certificate and,
  // with client CAs, asking for a client certificate as the control plane does.
  bool data_plane = false;
  // Where cert_chain, private_key, root_certs and client_root_certs were read, and how
  // often to read them again (zero, or no certificate files: never).
  std::string cert_file = {};
  std::string key_file = {};
  std::string ca_file = {};
  std::string client_ca_file = {};
  absl::Duration reload_interval = absl::ZeroDuration();

  bool enabled() const { return !cert_chain.empty(); }
  bool requires_client_certificates() const { return enabled() && (!client_root_certs.empty() || !client_ca_file.empty()); }
  bool reloads() const {
    return enabled() && !cert_file.empty() && !key_file.empty() && reload_interval > absl::ZeroDuration();
  }
};

// InvalidArgument naming the flag unless: certificate and key are given together, the
// key parses and is the certificate's, every certificate of the chain parses and none
// has expired, a CA bundle (only with a certificate; one given as ca_file or
// client_ca_file) holds at least one certificate and every one of them parses, and with
// client CAs, this server's certificate verifies against them as a client's (its peers
// would refuse it otherwise). Metrics client certificates need client CAs.
[[nodiscard]] absl::Status ValidateTls(const TlsOptions& tls);

// OK if tls.cert_chain verifies as a client's against tls.client_root_certs, as the
// peers that ask for client certificates check it; InvalidArgument saying why not.
[[nodiscard]] absl::Status CheckPeersAccept(const TlsOptions& tls);

// What the control plane serves with (TLS when enabled, asking callers for a
// certificate signed by the client CAs when there are any; plaintext otherwise), and
// what this server calls its peers with (checking the host name they are called by
// against their certificate, and the certificate against the CA bundle; presenting this
// server's certificate when asked). With `files`, their current pair and bundles,
// watched. Preconditions: ValidateTls(tls) is OK; `files` outlives what is returned.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsOptions& tls, const TlsFiles* files = nullptr);
std::shared_ptr<grpc::ChannelCredentials> PeerCredentials(const TlsOptions& tls, const TlsFiles* files = nullptr);

// The data plane's TLS (tls.data_plane): what wraps each connection the data server
// accepts (this server's certificate; asking for a client certificate of the client CAs
// when there are any), and what wraps this server's connections to its peers' data
// planes (checked as PeerCredentials checks their control planes; presenting this
// server's certificate when asked). Each connection gets the files in use when it is
// made: `files`' current ones, or `tls`'s. Preconditions as above.
transport::SecureAcceptedLayer DataServerTls(const TlsOptions& tls, const TlsFiles* files = nullptr);
transport::SecureLayer PeerDataTls(const TlsOptions& tls, const TlsFiles* files = nullptr);

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_TLS_H_
