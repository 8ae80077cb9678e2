#!/usr/bin/env bash
# Runs every benchmark in bench/ and prints their ratio tables (make bench).
set -euo pipefail
build_dir=${1:-build}
echo "== CPU kernels (ratio to memcpy bandwidth, same run) =="
"$build_dir/bin/kernels_bench" --benchmark_min_time=0.3
