#!/usr/bin/env bash
# The README's main command (make demo). Until the server lands (issue: the shard server
# and the TCP data plane), it shows what a user can already run: the layout planner.
set -euo pipefail
build_dir=${1:-build}
echo "make demo: the cluster demo arrives with flatshard-server; for now, the layout planner:"
"$build_dir/bin/flatshard" layout <<'SPEC'
{"servers": 3, "align": 4, "tensors": [
  {"name": "fc1.weight", "shape": [1024, 512]}, {"name": "fc1.bias", "shape": [1024]},
  {"name": "fc2.weight", "shape": [10, 1024], "dtype": "bfloat16"}, {"name": "fc2.bias", "shape": [10]}]}
SPEC
