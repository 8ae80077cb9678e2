#!/usr/bin/env bash
# The README's main command (make demo): a local cluster of 2 servers on 127.0.0.1,
# 2 training workers of examples/mlp_worker.cc (AdamW on a two-layer MLP), the same as a
# hybrid-sharded job, the cluster's status, a FULL state-dict export (safetensors) and its
# import back into the cluster, then a clean shutdown.
# Ports: FLATSHARD_DEMO_PORT (default 17070) and up.
set -euo pipefail
build_dir=${1:-build}
bin="$build_dir/bin"
port=${FLATSHARD_DEMO_PORT:-17070}
cluster="127.0.0.1:$port,127.0.0.1:$((port + 2))"

checkpoints=$(mktemp -d)
"$bin/flatshard" local-cluster --servers=2 --base_port="$port" --checkpoint_root="$checkpoints" &
cluster_pid=$!
trap 'kill -TERM $cluster_pid 2>/dev/null || true; wait $cluster_pid 2>/dev/null || true; rm -rf "$checkpoints"' EXIT

# Wait until both servers answer.
for _ in $(seq 50); do
  if "$bin/flatshard" status --cluster="$cluster" >/dev/null 2>&1; then break; fi
  sleep 0.1
done

echo "== training: 2 workers, 2 servers, AdamW =="
"$bin/mlp_worker" --cluster="$cluster" --worker_rank=1 --num_workers=2 &
worker1=$!
"$bin/mlp_worker" --cluster="$cluster" --worker_rank=0 --num_workers=2
wait $worker1

echo
echo "== hybrid sharding: the same 2 servers as 2 replica groups, 1 worker in each =="
"$bin/mlp_worker" --cluster="$cluster" --job=mlp-hybrid --replicas=2 --steps=100 \
  --worker_rank=1 --num_workers=2 &
worker1=$!
"$bin/mlp_worker" --cluster="$cluster" --job=mlp-hybrid --replicas=2 --steps=100 \
  --worker_rank=0 --num_workers=2
wait $worker1

echo
echo "== flatshard status =="
"$bin/flatshard" status --cluster="$cluster"

echo
echo "== state-dict export: a FULL checkpoint (safetensors) with optimizer state =="
"$bin/flatshard" save --cluster="$cluster" --job=mlp-demo --name=mlp-final --kind=full --optimizer --cut=boundary
"$bin/flatshard" checkpoints --cluster="$cluster"
ls -l "$checkpoints/mlp-final"
echo
echo "== the same state dict streamed to this machine (flatshard export) =="
"$bin/flatshard" export --cluster="$cluster" --job=mlp-demo --out="$checkpoints/exported" --kind=full --optimizer
ls -l "$checkpoints/exported"
echo
echo "== and back: the exported files become a checkpoint (flatshard import), loaded into the job =="
"$bin/flatshard" import --cluster="$cluster" --name=mlp-reimported --in="$checkpoints/exported"
"$bin/flatshard" load --cluster="$cluster" --job=mlp-demo --name=mlp-reimported

echo
echo "== training is over: the jobs go, with their memory (flatshard delete-job) =="
"$bin/flatshard" delete-job --cluster="$cluster" --job=mlp-demo
"$bin/flatshard" delete-job --cluster="$cluster" --job=mlp-hybrid
"$bin/flatshard" status --cluster="$cluster" | head -3

echo
echo "== layout of a bigger model over 3 servers, 2 workers sending bf16 gradients (flatshard layout) =="
"$bin/flatshard" layout --workers=2 --grad_dtype=bfloat16 <<'SPEC'
{"servers": 3, "align": 4, "tensors": [
  {"name": "fc1.weight", "shape": [1024, 512]}, {"name": "fc1.bias", "shape": [1024]},
  {"name": "fc2.weight", "shape": [10, 1024], "dtype": "bfloat16"}, {"name": "fc2.bias", "shape": [10]}]}
SPEC

# The PyTorch example, where the Python package was built and torch is installed.
if [[ -d "$build_dir/python/flatshard" ]] && /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo
  echo "== PyTorch: 2 workers with flatshard.torch.ShardedModule, checkpoint, restart, resume =="
  PYTHONPATH="$build_dir/python" /usr/bin/python3 examples/torch_train.py
fi
