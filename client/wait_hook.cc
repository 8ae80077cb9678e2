#include "client/wait_hook.h"

namespace flatshard {
namespace {

thread_local const std::function<void()>* innermost_hook = nullptr;

}  // namespace

WhileWaiting::WhileWaiting(std::function<void()> hook) : hook_(std::move(hook)), outer_(innermost_hook) {
  innermost_hook = &hook_;
}

WhileWaiting::~WhileWaiting() { innermost_hook = outer_; }

namespace client_internal {

const std::function<void()>* ThreadWaitHook() { return innermost_hook; }

}  // namespace client_internal
}  // namespace flatshard
