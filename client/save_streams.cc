#include "client/save_streams.h"

#include <algorithm>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace flatshard::client_internal {

struct SaveStreams::Stream {
  size_t server = 0;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SaveCheckpointStep, v1::SaveCheckpointEvent>> stream;
  v1::SaveCheckpointEvent event;  // the last answer
  bool finished = false;

  // Sends `step` and reads the answer; the server's status if it ends the stream instead.
  absl::Status Exchange(const ControlPlane& control, const v1::SaveCheckpointStep& step) {
    if (stream->Write(step) && stream->Read(&event)) return absl::OkStatus();
    return Finish(control);
  }
  // The server's outcome; an error also if it ended the stream without one.
  absl::Status Finish(const ControlPlane& control) {
    finished = true;
    const absl::Status status = control.Named(server, stream->Finish());
    if (!status.ok()) return status;
    return absl::InternalError(
        absl::StrCat("server ", control.address(server), " ended the save before it was asked to write"));
  }
};

SaveStreams::SaveStreams(const ControlPlane& control, std::vector<bool> writers)
    : control_(control), writers_(std::move(writers)), streams_(writers_.size()) {}

SaveStreams::~SaveStreams() {
  for (const std::unique_ptr<Stream>& stream : streams_) {
    if (stream == nullptr || stream->finished) continue;
    stream->ctx.TryCancel();  // the server drops its pins and writes nothing
    (void)stream->stream->Finish();
  }
}

absl::Status SaveStreams::OnEveryStream(const std::function<absl::Status(Stream&)>& call) {
  return control_.OnAllServersInParallel([&](size_t server) {
    if (server >= writers_.size() || !writers_[server]) return absl::OkStatus();
    return call(*streams_[server]);
  });
}

absl::Status SaveStreams::Pin(const v1::SaveCheckpointRequest& request, int max_rounds) {
  for (size_t server = 0; server < writers_.size(); ++server) {
    if (!writers_[server]) continue;
    streams_[server] = std::make_unique<Stream>();
    Stream& stream = *streams_[server];
    stream.server = server;
    control_.Prepare(stream.ctx);
    stream.stream = control_.stub(server).SaveCheckpoint(&stream.ctx);
  }
  v1::SaveCheckpointStep step;
  *step.mutable_request() = request;
  std::map<std::string, int64_t> cut(request.versions().begin(), request.versions().end());
  for (int round = 1;; ++round) {
    FLATSHARD_RETURN_IF_ERROR(OnEveryStream([&](Stream& stream) { return stream.Exchange(control_, step); }));
    bool pinned = true;
    for (const std::unique_ptr<Stream>& stream : streams_) {
      if (stream == nullptr || stream->event.pinned()) continue;
      pinned = false;
      for (const auto& [group, version] : stream->event.versions()) cut[group] = std::max(cut[group], version);
    }
    if (pinned) return absl::OkStatus();
    if (round == max_rounds) {
      return absl::AbortedError(absl::StrCat("checkpoint '", request.name(), "': training moved past the save's cut ",
                                             max_rounds, " times before every server had pinned it; save again"));
    }
    step.Clear();
    step.mutable_repin()->insert(cut.begin(), cut.end());
  }
}

absl::Status SaveStreams::Write() {
  v1::SaveCheckpointStep step;
  step.set_write(true);
  return OnEveryStream([&](Stream& stream) {
    stream.finished = true;
    if (!stream.stream->Write(step)) return control_.Named(stream.server, stream.stream->Finish());
    stream.stream->WritesDone();
    return control_.Named(stream.server, stream.stream->Finish());
  });
}

}  // namespace flatshard::client_internal
