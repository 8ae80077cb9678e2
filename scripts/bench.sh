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

# ShardedModule's step: where the Python package was built (python3-dev, pybind11-dev,
# python3-torch: what `make test` installs).
echo
echo "== flatshard.torch.ShardedModule step (ratio to torch.optim in one process, same run) =="
if [[ -d "$build_dir/python/flatshard" ]] && /usr/bin/python3 -c "import torch" 2>/dev/null; then
  PYTHONPATH="$build_dir/python" /usr/bin/python3 bench/sharded_module_bench.py
  # Models with BatchNorm: their running statistics on the servers too (one more group).
  PYTHONPATH="$build_dir/python" /usr/bin/python3 bench/sharded_module_bench.py --quick --batchnorm
  # Each layer's parameters freed after its forward, gathered again for its backward.
  PYTHONPATH="$build_dir/python" /usr/bin/python3 bench/sharded_module_bench.py --quick --reshard
  if command -v openssl > /dev/null; then  # the same over TLS on both planes, the smaller models
    PYTHONPATH="$build_dir/python" /usr/bin/python3 bench/sharded_module_bench.py --quick --tls
  fi
else
  echo "skipped: no Python package in $build_dir/python or no torch for /usr/bin/python3"
fi

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
