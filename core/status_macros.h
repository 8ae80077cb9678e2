// Status propagation macros used across flatshard (Debian's Abseil 20220623 has none).
//
//   FLATSHARD_RETURN_IF_ERROR(file.Write(bytes));
//   FLATSHARD_ASSIGN_OR_RETURN(FlatLayout layout, FlatLayout::Create(specs, 0, 4));
//
// The CUDA and NCCL variants expand to code that names the CUDA runtime / NCCL API, so
// they compile only in translation units that include those headers (kernels/cuda/,
// transport/nccl/); this header itself depends on neither.
#ifndef FLATSHARD_CORE_STATUS_MACROS_H_
#define FLATSHARD_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define FLATSHARD_INTERNAL_CONCAT_IMPL(a, b) a##b
#define FLATSHARD_INTERNAL_CONCAT(a, b) FLATSHARD_INTERNAL_CONCAT_IMPL(a, b)

// Evaluates `expr` (an absl::Status) once and returns it from the caller if not OK.
#define FLATSHARD_RETURN_IF_ERROR(expr)                 \
  do {                                                  \
    ::absl::Status flatshard_status_ = (expr);          \
    if (!flatshard_status_.ok()) return flatshard_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status from the caller,
// otherwise move-assigns the value to `lhs` (which may be a declaration).
#define FLATSHARD_ASSIGN_OR_RETURN(lhs, rexpr) \
  FLATSHARD_INTERNAL_ASSIGN_OR_RETURN(         \
      FLATSHARD_INTERNAL_CONCAT(flatshard_statusor_, __LINE__), lhs, rexpr)

#define FLATSHARD_INTERNAL_ASSIGN_OR_RETURN(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                        \
  if (!statusor.ok()) return std::move(statusor).status();        \
  lhs = std::move(statusor).value()

// Returns Internal("<call> failed at file:line: <cuda message>") when a CUDA runtime call
// does not return cudaSuccess.
#define FLATSHARD_CUDA_RETURN_IF_ERROR(expr)                                          \
  do {                                                                                \
    const cudaError_t flatshard_cuda_err_ = (expr);                                   \
    if (flatshard_cuda_err_ != cudaSuccess) {                                         \
      return ::absl::InternalError(::absl::StrCat(#expr, " failed at ", __FILE__, ":", \
                                                  __LINE__, ": ",                     \
                                                  cudaGetErrorString(flatshard_cuda_err_))); \
    }                                                                                 \
  } while (0)

// Returns Internal("<call> failed at file:line: <nccl message>") when an NCCL call does
// not return ncclSuccess (ncclInProgress counts as success for non-blocking comms).
#define FLATSHARD_NCCL_RETURN_IF_ERROR(expr)                                          \
  do {                                                                                \
    const ncclResult_t flatshard_nccl_res_ = (expr);                                  \
    if (flatshard_nccl_res_ != ncclSuccess && flatshard_nccl_res_ != ncclInProgress) { \
      return ::absl::InternalError(::absl::StrCat(#expr, " failed at ", __FILE__, ":", \
                                                  __LINE__, ": ",                     \
                                                  ncclGetErrorString(flatshard_nccl_res_))); \
    }                                                                                 \
  } while (0)

#endif  // FLATSHARD_CORE_STATUS_MACROS_H_
