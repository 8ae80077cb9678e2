// CutStreams: the streams of one save or export, one per server that writes a part
// (SaveCheckpoint or ExportStateDict; proto/flatshard.proto, SaveCheckpointStep). Every
// server first pins one cut, in as many rounds as it takes (training may move past a cut
// on a server before that server pins it: the next round pins a later one), and only
// then do they write, so no server writes a part that another could not cut. A save asks
// server 0 first: each server refuses a second save of a name while it holds one, so of
// two saves started at once, the one server 0 takes is the one every server takes, and
// one of them wins. A stream may stay open after Write for one last step (a blocking
// save's commit: Close). The streams' deadline is ClientOptions::model_timeout (none
// by default), their requests' cut_wait_ms what bounds the pinning rounds' waits.
// Internal to the client library. Not thread-safe: one caller
// drives the rounds; each round reaches the servers in parallel. Destroying it cancels
// the streams not yet finished (before Write, the servers drop their pins and write
// nothing) and ends those left open by Write without their last step (a save is not
// committed), waiting for their servers to let go of it. A `cancellation` (optional)
// cancels the streams, as destroying it does, while it is not sealed.
//
//   CutStreams<v1::SaveCheckpointStep, v1::SaveAnswer> streams(control, writers, &Stub::SaveCheckpoint);
//   FLATSHARD_RETURN_IF_ERROR(streams.Pin(first_step, cut, "checkpoint 'x'", 10, &server_zero_now));
//   FLATSHARD_RETURN_IF_ERROR(streams.Write(read_written));
//   FLATSHARD_RETURN_IF_ERROR(streams.Close(commit_step, {true, false}));
#ifndef FLATSHARD_CLIENT_CUT_STREAMS_H_
#define FLATSHARD_CLIENT_CUT_STREAMS_H_

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/control_plane.h"
#include "core/status_macros.h"

namespace flatshard::client_internal {

inline const v1::CutAnswer& CutOf(const v1::SaveAnswer& answer) { return answer.cut(); }
inline const v1::CutAnswer& CutOf(const v1::ExportMessage& message) { return message.cut(); }

template <typename Step, typename Answer>
class CutStreams {
 public:
  using Stream = grpc::ClientReaderWriter<Step, Answer>;
  using Method = std::unique_ptr<Stream> (v1::Flatshard::Stub::*)(grpc::ClientContext*);

  // One server's stream.
  struct Server {
    size_t index = 0;
    grpc::ClientContext ctx;
    std::unique_ptr<Stream> stream;
    Answer answer;  // the last one read
    bool finished = false;
    bool open = false;  // kept open after Write for Close
    std::optional<Registration> registered;  // with the cancellation, until ctx goes
  };

  // Streams of `method` to the servers `writers[i]` says write a part. `control` must
  // outlive this.
  CutStreams(const ControlPlane& control, std::vector<bool> writers, Method method,
             Cancellation* cancellation = nullptr)
      : control_(control),
        writers_(std::move(writers)),
        method_(method),
        cancellation_(cancellation),
        servers_(writers_.size()) {}
  ~CutStreams() {
    for (const std::unique_ptr<Server>& server : servers_) {
      if (server == nullptr || server->finished) continue;
      if (server->open) {
        // It wrote its part and waits for its last step (a blocking save's commit, which
        // will not come): ended in order, it lets go of the save's name before it
        // answers, so a save of the name right after this one failed is not refused.
        server->stream->WritesDone();
      } else {
        server->ctx.TryCancel();  // the server drops its pins and writes nothing
      }
      (void)server->stream->Finish();
    }
  }
  CutStreams(const CutStreams&) = delete;
  CutStreams& operator=(const CutStreams&) = delete;

  // Sends `first` (its request's versions set here) and has every server pin `cut`,
  // then, while some server answers that training moved past it, a cut later by what
  // that server reports, for at most `max_rounds` rounds; after that Aborted, naming
  // `what` and a group past the cut (FailedPrecondition with one round: a cut the caller
  // chose). With `server_zero_first` (a save: of two saves of a name, the one server 0
  // takes is the one every server takes), server 0 takes `first` alone, with the cut
  // `*server_zero_first` (its versions now, so that it answers at once rather than hold a
  // future cut that the others, not yet asked, could let training pass), then pins `cut`
  // with the others. A server's error as it is.
  [[nodiscard]] absl::Status Pin(const Step& first, std::map<std::string, int64_t> cut, const std::string& what,
                                 int max_rounds, const std::map<std::string, int64_t>* server_zero_first = nullptr) {
    auto exchange = [&](Server& server, const Step& step) -> absl::Status {
      if (server.stream->Write(step) && server.stream->Read(&server.answer)) return absl::OkStatus();
      server.finished = true;
      FLATSHARD_RETURN_IF_ERROR(control_.Named(server.index, server.stream->Finish()));
      return absl::InternalError(
          absl::StrCat("server ", control_.address(server.index), " ended the stream before it was asked to write"));
    };
    auto with_cut = [&](const std::map<std::string, int64_t>& versions) {
      Step step = first;
      auto& request_versions = *step.mutable_request()->mutable_versions();
      request_versions.clear();
      request_versions.insert(versions.begin(), versions.end());
      return step;
    };
    Step repin;
    auto set_repin = [&] {
      repin.Clear();
      repin.mutable_repin()->insert(cut.begin(), cut.end());
    };
    set_repin();
    const bool zero_first = server_zero_first != nullptr && !writers_.empty() && writers_[0];
    if (zero_first) {
      Open(0);
      FLATSHARD_RETURN_IF_ERROR(exchange(*servers_[0], with_cut(*server_zero_first)));
    }
    for (size_t i = 0; i < writers_.size(); ++i) {
      if (writers_[i] && servers_[i] == nullptr) Open(i);
    }
    const Step opening = with_cut(cut);
    for (int round = 1;; ++round) {
      FLATSHARD_RETURN_IF_ERROR(OnEveryServer([&](Server& server) {
        if (round > 1) return exchange(server, repin);
        if (!zero_first || server.index != 0) return exchange(server, opening);
        // Server 0 has answered for its own cut; it may be this one.
        return *server_zero_first == cut ? absl::OkStatus() : exchange(server, repin);
      }));
      bool pinned = true;
      std::string overtaken;  // a group some server has past the cut
      std::map<std::string, int64_t> later = cut;
      for (const std::unique_ptr<Server>& server : servers_) {
        if (server == nullptr || CutOf(server->answer).pinned()) continue;
        pinned = false;
        for (const auto& [group, version] : CutOf(server->answer).versions()) {
          const int64_t asked = cut.contains(group) ? cut.at(group) : 0;
          if (version > asked && overtaken.empty()) {
            overtaken = absl::StrCat("group '", group, "' is at version ", version, " on server ",
                                     control_.address(server->index), ", past the cut's ", asked);
          }
          later[group] = std::max(later[group], version);
        }
      }
      if (pinned) return absl::OkStatus();
      if (overtaken.empty()) overtaken = "training moved past it";
      if (max_rounds == 1) return absl::FailedPreconditionError(absl::StrCat(what, ": ", overtaken));
      if (round == max_rounds) {
        return absl::AbortedError(absl::StrCat(what, ": training moved past the cut ", max_rounds,
                                               " times before every server had pinned it (", overtaken,
                                               "); try again"));
      }
      cut = std::move(later);
      set_repin();
    }
  }

  // Has every server write (after Pin) and runs `then` (if any) on each server's stream
  // while it does. A stream that `then` marks `open` stays open for Close; the others end
  // here. Returns the first error in rank order: `then`'s, else the server's outcome.
  // Call once.
  [[nodiscard]] absl::Status Write(const std::function<absl::Status(Server&)>& then = nullptr) {
    Step step;
    step.set_write(true);
    return OnEveryServer([&](Server& server) {
      absl::Status status;
      if (server.stream->Write(step) && then != nullptr) status = then(server);
      if (!status.ok()) server.open = false;
      return server.open ? absl::OkStatus() : End(server, status);
    });
  }

  // Sends `last` to the servers `to[i]` says, and ends every stream (each must have been
  // left open by Write); the first error in rank order. Call once, after Write succeeded.
  [[nodiscard]] absl::Status Close(const Step& last, const std::vector<bool>& to) {
    return OnEveryServer([&](Server& server) {
      if (!server.open) {
        return absl::InternalError(
            absl::StrCat("server ", control_.address(server.index), " ended the stream before its last step"));
      }
      server.open = false;
      if (server.index < to.size() && to[server.index]) (void)server.stream->Write(last);
      return End(server, absl::OkStatus());
    });
  }

 private:
  void Open(size_t i) {
    servers_[i] = std::make_unique<Server>();
    servers_[i]->index = i;
    control_.Prepare(servers_[i]->ctx, control_.model_timeout());
    servers_[i]->registered.emplace(cancellation_, &servers_[i]->ctx);
    servers_[i]->stream = (control_.stub(i).*method_)(&servers_[i]->ctx);
  }

  // Closes `server`'s side and waits for its outcome: `status` if that is an error.
  absl::Status End(Server& server, const absl::Status& status) {
    server.finished = true;
    server.stream->WritesDone();
    const absl::Status outcome = control_.Named(server.index, server.stream->Finish());
    return status.ok() ? outcome : status;
  }

  absl::Status OnEveryServer(const std::function<absl::Status(Server&)>& call) {
    return control_.OnAllServersInParallel([&](size_t i) {
      if (i >= servers_.size() || servers_[i] == nullptr) return absl::OkStatus();
      return call(*servers_[i]);
    });
  }

  const ControlPlane& control_;
  const std::vector<bool> writers_;
  const Method method_;
  Cancellation* const cancellation_;
  std::vector<std::unique_ptr<Server>> servers_;  // by rank; null where none writes
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_CUT_STREAMS_H_
