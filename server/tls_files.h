// TlsFiles: the certificate chain and key a TLS server presents, and the CA bundles it
// checks its peers and its callers against, kept current from the files it was given
// (TlsOptions::cert_file, key_file, ca_file, client_ca_file) without a restart. Every
// reload_interval a thread reads them again. A new pair is a tls::KeyPair's (taken when
// it makes an identity a peer would accept: the key is the certificate's, no certificate
// cut short or expired); a new bundle a tls::CaBundle's (taken when every certificate of
// it parses). With client CAs, a new pair must also verify against the client bundle in
// use, and a new client bundle must verify the pair in use (CheckPeersAccept): the peers
// would refuse this server's calls otherwise. What is not taken is ignored and the last
// good files stay; a renewal that needs both (a pair of a new CA, and the bundle adding
// it) is taken over two reads.
//
// The control plane's and peer calls' gRPC file watchers read the files the KeyPair and
// CaBundles publish (tls/credentials.h); the metrics endpoint's relay takes current()
// when generation() moves.
//
// What it takes is logged (spdlog), and why it did not take files, once per reason.
//
// Thread-safe.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto files, TlsFiles::Start(tls));  // tls.reloads()
//   builder.AddListeningPort(address, ServerCredentials(tls, files.get()), &port);
//   PeerClient peers(cluster, rank, token, PeerCredentials(tls, files.get()));
#ifndef FLATSHARD_SERVER_TLS_FILES_H_
#define FLATSHARD_SERVER_TLS_FILES_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/tls.h"
#include "tls/ca_bundle.h"
#include "tls/key_pair.h"
#include "tls/reloader.h"

namespace flatshard::server {

class TlsFiles {
 public:
  // Precondition: tls.reloads(). InvalidArgument for files that cannot be read or do not
  // parse, Internal when a published file cannot be made, FailedPrecondition when it
  // cannot be read by its path (no /proc).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TlsFiles>> Start(const TlsOptions& tls);
  ~TlsFiles();  // stops the thread
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  const tls::KeyPair& pair() const { return *pair_; }
  // The CA bundles of tls.ca_file and tls.client_ca_file; null without one (peers are
  // checked against the system's roots; callers present no certificate).
  const tls::CaBundle* ca_bundle() const { return roots_.get(); }
  const tls::CaBundle* client_roots() const { return client_roots_.get(); }
  // The pair and CA bundles in use (as the options were given, with their PEM texts),
  // and how many times they have changed.
  TlsOptions current() const;
  uint64_t generation() const;
  // When the pair in use expires: its chain's earliest notAfter.
  absl::Time expiry() const;
  // Reads the files now (the thread does it every interval, Server::ReloadTls on SIGHUP;
  // one read at a time): whether anything changed.
  bool Reload() ABSL_LOCKS_EXCLUDED(reload_mu_, mu_);

 private:
  TlsFiles(const TlsOptions& tls, std::unique_ptr<tls::KeyPair> pair, std::unique_ptr<tls::CaBundle> roots,
           std::unique_ptr<tls::CaBundle> client_roots);

  const TlsOptions initial_;
  const std::unique_ptr<tls::KeyPair> pair_;
  const std::unique_ptr<tls::CaBundle> roots_;
  const std::unique_ptr<tls::CaBundle> client_roots_;
  absl::Mutex reload_mu_;  // held through a Reload: KeyPair's and CaBundle's are one at a time
  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(reload_mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_refused_ ABSL_GUARDED_BY(mu_);  // why the last read's files were not taken
  std::unique_ptr<tls::Reloader> reloader_;          // last: stopped first
};

}  // namespace flatshard::server

#endif  // FLATSHARD_SERVER_TLS_FILES_H_
