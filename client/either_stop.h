// Internal to the client: EitherStop, one std::stop_token that is asked to stop as soon
// as either of two others is (a caller's stop, the client's destruction). A token that
// has already stopped stops it at once. Neither copied nor moved: the callbacks it
// registers point at its own source, and end with it. Thread-safe as the tokens are.
//
//   const EitherStop either(stop, destroying.get_token());
//   Wait(either.token());  // ends when the caller stops it or the client goes
#ifndef FLATSHARD_CLIENT_EITHER_STOP_H_
#define FLATSHARD_CLIENT_EITHER_STOP_H_

#include <stop_token>

namespace flatshard::client_internal {

class EitherStop {
 public:
  EitherStop(const std::stop_token& first, const std::stop_token& second)
      : first_(first, PassOn{&either_}), second_(second, PassOn{&either_}) {}
  EitherStop(const EitherStop&) = delete;
  EitherStop& operator=(const EitherStop&) = delete;

  // Valid while this object lives.
  std::stop_token token() const { return either_.get_token(); }

 private:
  struct PassOn {
    std::stop_source* either;
    void operator()() const { either->request_stop(); }
  };

  std::stop_source either_;  // before the callbacks, which may run as they are made
  const std::stop_callback<PassOn> first_;
  const std::stop_callback<PassOn> second_;
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_EITHER_STOP_H_
