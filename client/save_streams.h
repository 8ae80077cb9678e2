// SaveStreams: one save's SaveCheckpoint streams, one per server that writes a part
// (proto/flatshard.proto, SaveCheckpointStep). A save first has every server pin one cut,
// in as many rounds as it takes (training may overtake a cut on a server before that
// server pins it: the next round pins a later one), and only then has them write, so no
// server writes a part that another server could not cut. Internal to the client
// library. Not thread-safe: one caller drives the rounds; each round reaches the servers
// in parallel. Destroying it before Write cancels the streams: the servers drop their
// pins and write nothing.
//
//   SaveStreams streams(control, writers);
//   FLATSHARD_ASSIGN_OR_RETURN(const bool pinned, streams.Pin(request, 10));
//   FLATSHARD_RETURN_IF_ERROR(streams.Write());
#ifndef FLATSHARD_CLIENT_SAVE_STREAMS_H_
#define FLATSHARD_CLIENT_SAVE_STREAMS_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/control_plane.h"

namespace flatshard::client_internal {

class SaveStreams {
 public:
  // Streams to the servers `writers[i]` says write a part. `control` must outlive this.
  SaveStreams(const ControlPlane& control, std::vector<bool> writers);
  ~SaveStreams();
  SaveStreams(const SaveStreams&) = delete;
  SaveStreams& operator=(const SaveStreams&) = delete;

  // Sends `request` and has every server pin its cut (request.versions), then, while
  // some server answers that training overtook it, a cut later by what that server
  // reports, for at most `max_rounds` rounds. Aborted after that; a server's error as it
  // is.
  [[nodiscard]] absl::Status Pin(const v1::SaveCheckpointRequest& request, int max_rounds);
  // Has every server write its part (async saves: copy the cut) and returns the first
  // error, in rank order. Call once, after Pin.
  [[nodiscard]] absl::Status Write();

 private:
  struct Stream;
  // Runs `call` on each writing server's stream in parallel; the first error wins. A
  // stream that fails is finished, with the server's status.
  absl::Status OnEveryStream(const std::function<absl::Status(Stream&)>& call);

  const ControlPlane& control_;
  const std::vector<bool> writers_;
  std::vector<std::unique_ptr<Stream>> streams_;  // by rank; null where none writes
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_SAVE_STREAMS_H_
