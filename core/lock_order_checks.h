// Abseil's lock-order checks, process-wide. Debian's Abseil is built without NDEBUG, so by
// default every absl::Mutex::Lock checks lock order in a process-wide graph under one
// global lock: 3.5x the cost of an uncontended lock on one thread and 20x on two threads
// taking locks of their own (bench/RESULTS.md, "Metadata at scale, JSON, and Abseil's lock
// checks"). A debugging aid: flatshard's processes run without it unless asked
// (flatshard-server --mutex_deadlock_detection; the Python client and the benchmarks by an
// environment variable), and the tests ask. Call early, before other threads take locks.
//
//   SetLockOrderChecks(absl::GetFlag(FLAGS_mutex_deadlock_detection));
//   SetLockOrderChecksFromEnvironment("FLATSHARD_MUTEX_DEADLOCK_DETECTION");
#ifndef FLATSHARD_CORE_LOCK_ORDER_CHECKS_H_
#define FLATSHARD_CORE_LOCK_ORDER_CHECKS_H_

namespace flatshard {

// On: a cycle in the order locks are taken aborts the process, naming the locks.
void SetLockOrderChecks(bool on);
// On when the environment variable `variable` is "1", off otherwise.
void SetLockOrderChecksFromEnvironment(const char* variable);

}  // namespace flatshard

#endif  // FLATSHARD_CORE_LOCK_ORDER_CHECKS_H_
