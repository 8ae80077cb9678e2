#include "client/early_answer.h"

#include <utility>

namespace flatshard::client_internal {

bool EarlyAnswer::Failed() {
  if (answer_.has_value() || !conn_.PollReadable(absl::ZeroDuration())) return false;
  answer_ = transport::RecvResponse(conn_, {});
  return !answer_->ok() || !(*answer_)->status.ok();
}

absl::StatusOr<transport::Response> EarlyAnswer::Take() {
  if (!answer_.has_value()) return transport::RecvResponse(conn_, {});
  absl::StatusOr<transport::Response> answer = *std::move(answer_);
  answer_.reset();
  return answer;
}

}  // namespace flatshard::client_internal
