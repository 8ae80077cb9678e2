// Internal to the client: LinkPool lends a worker's NCCL links with one server
// (client/nccl_link.h) one transfer at a time. A server moves a channel's transfers one
// at a time, in request order, so one link would serialize every transfer with that
// server; with a link per transfer in flight, transfers of different groups run at once
// on separate communicators and streams. The data channel's connection count bounds how
// many transfers ask at once, so the pool opens at most that many links per device.
//
// A lease gives its link back when it ends: kept for the next transfer unless it failed
// (its communicator was aborted) or the lease was told to drop it (the server closed the
// channel). Links are opened without the pool's lock (opening is an RPC and a collective
// join, which the caller's stop token ends). Thread-safe. A template so that the tests
// can lend fakes.
//
//   LinkPool<NcclLink> pool(2, [&](int device, const std::stop_token& stop) {
//     return OpenLink(server, device, stop);
//   });
//   FLATSHARD_ASSIGN_OR_RETURN(auto lease, pool.Acquire(device, stop));
//   lease->Send(...);   // the link is this caller's until `lease` ends
#ifndef FLATSHARD_CLIENT_LINK_POOL_H_
#define FLATSHARD_CLIENT_LINK_POOL_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <stop_token>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::client_internal {

// Link: has `int device() const` and `bool failed() const`.
template <typename Link>
class LinkPool {
 public:
  using Opener = std::function<absl::StatusOr<std::shared_ptr<Link>>(int device, const std::stop_token& stop)>;

  // Keeps at most `max_idle` idle links (at least 1); `open` makes a link on a device,
  // ending Cancelled once a stop is asked of `stop`.
  LinkPool(int max_idle, Opener open) : max_idle_(std::max(1, max_idle)), open_(std::move(open)) {}

  class Lease {
   public:
    Lease(Lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)), link_(std::move(other.link_)), drop_(other.drop_) {}
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (pool_ != nullptr) pool_->Return(std::move(link_), drop_);
    }
    Link* operator->() const { return link_.get(); }
    Link& operator*() const { return *link_; }
    // The link goes when the lease ends, even if it did not fail.
    void Drop() { drop_ = true; }

   private:
    friend class LinkPool;
    Lease(LinkPool* pool, std::shared_ptr<Link> link) : pool_(pool), link_(std::move(link)) {}
    LinkPool* pool_;
    std::shared_ptr<Link> link_;
    bool drop_ = false;
  };

  // An idle, healthy link on `device`, or one opened with `stop` (the opener's error if
  // that fails). Idle links on other devices are closed: a worker moved to another GPU.
  absl::StatusOr<Lease> Acquire(int device, const std::stop_token& stop = {}) {
    {
      absl::MutexLock lock(&mu_);
      std::erase_if(idle_, [device](const std::shared_ptr<Link>& link) {
        return link->failed() || link->device() != device;
      });
      if (!idle_.empty()) {
        std::shared_ptr<Link> link = std::move(idle_.back());
        idle_.pop_back();
        return Lease(this, std::move(link));
      }
    }
    absl::StatusOr<std::shared_ptr<Link>> opened = open_(device, stop);
    if (!opened.ok()) return opened.status();
    return Lease(this, *std::move(opened));
  }

  int idle_links() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(idle_.size());
  }

 private:
  void Return(std::shared_ptr<Link> link, bool drop) {
    if (drop || link->failed()) return;
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(idle_.size()) < max_idle_) idle_.push_back(std::move(link));
  }

  const int max_idle_;
  const Opener open_;
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Link>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::client_internal

#endif  // FLATSHARD_CLIENT_LINK_POOL_H_
