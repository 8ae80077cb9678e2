// TCP implementation of the data plane (transport/transport.h): blocking sockets with
// TCP_NODELAY, autotuned socket buffers and SO_RCVTIMEO/SO_SNDTIMEO inactivity timeouts.
// Small receives read ahead (up to 64 KiB of what the socket holds, into a buffer of that
// size a connection gets with its first small receive), so that messages that arrive
// together cost one system call; SendOrHold holds up to 64 KiB of answers back while
// bytes are read ahead, which then leave in one sendmsg.
// Factories are thread-safe; each Connection follows the interface's rules.
//
//   FLATSHARD_ASSIGN_OR_RETURN(auto listener, transport::ListenTcp("127.0.0.1", 0));
//   FLATSHARD_ASSIGN_OR_RETURN(auto conn, transport::ConnectTcp("127.0.0.1",
//                                                               listener->port(), absl::Seconds(5)));
#ifndef FLATSHARD_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define FLATSHARD_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <memory>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace flatshard::transport {

// Hosts are IPv4 addresses or names resolved to one (getaddrinfo, AF_INET: the first
// address; Unavailable naming the host when it does not resolve).
//
// Binds and listens on host:port (port 0 picks a free port). Returns Unavailable with
// errno's text if the address cannot be bound.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Listener>> ListenTcp(absl::string_view host, int port);
// The same, as a listening socket the caller owns (closes), for a server that speaks
// another protocol over it (TLS): its descriptor and the port bound.
[[nodiscard]] absl::StatusOr<std::pair<int, int>> ListenTcpSocket(absl::string_view host, int port);

// Connects to host:port within `timeout` (absl::InfiniteDuration(): the kernel's own
// limit). Returns Unavailable (refused, unreachable, not resolved) or DeadlineExceeded;
// InvalidArgument for a host that is neither an IPv4 address nor a name (an IPv6 one,
// say) or a port outside [0, 65535]; Cancelled within kConnectStopCheck of a stop asked
// of `stop` (a host that does not answer holds a connect for the whole timeout).
inline constexpr absl::Duration kConnectStopCheck = absl::Milliseconds(50);
[[nodiscard]] absl::StatusOr<std::unique_ptr<Connection>> ConnectTcp(absl::string_view host, int port,
                                                                     absl::Duration timeout, std::stop_token stop = {});

// The socket of a connection ConnectTcp or a TCP listener made, for a layer over it (TLS)
// that moves bytes on it itself while the connection keeps it (and its timeouts,
// Shutdown, CloseSend, PeerClosed); -1 for another kind of connection. Take it before
// any Recv on the connection: bytes it read ahead would be missing from the socket.
int SocketOf(const Connection& conn);

// `count` distinct loopback ports that were free a moment ago: all are bound to port 0
// at once (so none is handed out twice), then released for servers to bind. For tests,
// benchmarks and local development clusters; another process may take one meanwhile.
[[nodiscard]] absl::StatusOr<std::vector<int>> PickFreeLoopbackPorts(int count);

// Splits "host:port"; InvalidArgument naming the text otherwise.
[[nodiscard]] absl::Status SplitHostPort(absl::string_view address, std::string& host, int& port);

}  // namespace flatshard::transport

#endif  // FLATSHARD_TRANSPORT_TCP_TCP_TRANSPORT_H_
