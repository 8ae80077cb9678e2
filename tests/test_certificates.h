// MakeTestCertificates: TLS files for tests, made by the openssl command line into an
// existing directory `dir`: a CA (ca.pem, ca.key), a certificate for 127.0.0.1 and
// localhost signed by it (server.pem) with its key (server.key; server.csr is the
// request), a second one as if renewed (server2.pem, server2.key: another key and
// serial, valid for three days), an unrelated CA (other-ca.pem, other-ca.key) and a
// certificate for 127.0.0.1 it signed (other-server.pem, other-server.key), and one the
// first CA signed for another host (elsewhere.pem, elsewhere.key: DNS name
// elsewhere.invalid, valid for one day), and one for 127.0.0.1 that has expired
// (expired.pem, expired.key); for mutual TLS, client certificates (extendedKeyUsage
// clientAuth, no host) the first CA signed (client.pem, client.key; client2.pem,
// client2.key as if renewed, valid for three days) and the other CA signed
// (other-client.pem, other-client.key), and a certificate for 127.0.0.1 that may not
// prove a client (server-only.pem, server-only.key: extendedKeyUsage serverAuth). P-256
// keys, valid for two days unless said; each certificate's common name is its file's.
// Returns whether openssl made them all.
#ifndef FLATSHARD_TESTS_TEST_CERTIFICATES_H_
#define FLATSHARD_TESTS_TEST_CERTIFICATES_H_

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace flatshard::testing {

inline bool MakeTestCertificates(const std::string& dir) {
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
  const std::string script = absl::StrCat(
      "set -e; cd '", dir, "'\n",
      "openssl req -x509 ", key, " -keyout ca.key -out ca.pem -days 2 -subj /CN=flatshard-test-ca\n",
      "openssl req -x509 ", key, " -keyout other-ca.key -out other-ca.pem -days 2 -subj /CN=other-ca\n",
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.cnf\n",
      "printf 'subjectAltName=DNS:elsewhere.invalid\\n' > elsewhere.cnf\n",
      "printf 'extendedKeyUsage=clientAuth\\n' > client.cnf\n",
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n' > server-only.cnf\n",
      "for made in 'server ca san 2' 'server2 ca san 3' 'other-server other-ca san 2' 'elsewhere ca elsewhere 1' \\\n",
      "            'expired ca san 0' 'client ca client 2' 'client2 ca client 3' 'other-client other-ca client 2' \\\n",
      "            'server-only ca server-only 2'; do\n",
      "  set -- $made\n",
      "  openssl req ", key, " -keyout $1.key -out $1.csr -subj /CN=$1\n",
      "  openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -days $4 -extfile $3.cnf -out $1.pem\n",
      "done\n");
  const std::string path = absl::StrCat(dir, "/make-certificates.sh");
  std::ofstream(path) << script;
  return std::system(absl::StrCat("bash '", path, "' 2>/dev/null").c_str()) == 0;
}

}  // namespace flatshard::testing

#endif  // FLATSHARD_TESTS_TEST_CERTIFICATES_H_
