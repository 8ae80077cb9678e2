#!/usr/bin/env bash
# Runs every benchmark in bench/ and prints their ratio tables (make bench).
# BENCH_ARGS is passed to cluster_bench (e.g. BENCH_ARGS=--quick).
set -euo pipefail
build_dir=${1:-build}
echo "== CPU kernels (ratio to memcpy bandwidth, same run) =="
"$build_dir/bin/kernels_bench" --benchmark_min_time=0.3
echo
echo "== data plane, optimizer, latency (ratios to iperf3, triad bandwidth, gRPC no-op) =="
"$build_dir/bin/cluster_bench" ${BENCH_ARGS:-}

# GPU rows: only where this build has CUDA and the machine a device.
if [[ -x "$build_dir/bin/kernels_cuda_bench" ]]; then
  echo
  echo "== GPU kernels (ratio to device-to-device copy bandwidth, same run) =="
  json=$(mktemp)
  trap 'rm -f "$json"' EXIT
  "$build_dir/bin/kernels_cuda_bench" --json="$json"
  if [[ -s "$json" ]] && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    python3 bench/torch_adamw_bench.py "$json"
  fi
  echo
  echo "== GPU data planes: CUDA IPC (ratio to cudaMemcpy) and NCCL (ratio to plain NCCL), same run =="
  "$build_dir/bin/gpu_planes_bench"
fi
