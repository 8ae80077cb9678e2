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
