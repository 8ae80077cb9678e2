#!/usr/bin/env bash
# On a lent device machine (GPU), from the repository root: runs the GPU tests and the GPU
# benchmarks from the binaries scripts/device-carry.sh put in .devcarry/, logs under
# /tmp/device-check and, with $OUT set (the device tool), packed into
# $OUT/device-check.tar.gz after each command, so that a run stopped at its time limit
# still brings back what ran. Steps: any of tests, training (with GPU workers over a TLS
# data plane too), bench, ipc-wait (the CUDA IPC rows waited for by get() and by Await,
# alternated), kernels-bench, safetensors, python, stops (device transfers that a stop or
# the client's end cuts short, and the waits a server ends for a caller that went or for
# its own shutdown), integration-device, integration-pinned (the whole integration suite
# with every server on that tier; default: tests training bench).
set -uo pipefail
carry=$PWD/.devcarry
out=/tmp/device-check
mkdir -p "$out"
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$carry/lib${nccl_lib:+:$nccl_lib}"
export FLATSHARD_NCCL_LIBRARY="${nccl_lib:+$nccl_lib/libnccl.so.2}"
# integration_test starts the server and the CLI from the paths it was built with; where
# they exist (the machine that built them), they are the same binaries.
for binary in flatshard-server flatshard; do
  [[ -e /work/main/build/bin/$binary ]] ||
    { mkdir -p /work/main/build/bin && ln -s "$carry/bin/$binary" /work/main/build/bin/$binary; }
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
steps=("${@:-tests training bench}")
status=0
pack() { [[ -z "${OUT:-}" ]] || tar -czf "$OUT/device-check.tar.gz" -C "$out" .; }
# One command may take $STEP_LIMIT seconds (default 300): a test that hangs costs that,
# not the rest of the lease (seen: one hung test took a whole 510-second call). Servers it
# left behind (a test killed mid-way does not stop its cluster) are killed after it.
step_limit=${STEP_LIMIT:-300}
run() {  # name, command...
  local name=$1; shift
  echo "== $name"
  local started=$SECONDS
  timeout -k 5 "$step_limit" "$@" >"$out/$name.log" 2>&1; local rc=$?
  [[ $rc != 124 && $rc != 137 ]] || echo "== $name: killed after ${step_limit}s" | tee -a "$out/$name.log"
  pkill -KILL -f "^($carry|/work/main/build)/bin/flatshard-server" || true
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - started)) s"
  [[ $rc == 0 ]] || status=1
  pack
}
for step in ${steps[*]}; do
  case $step in
    tests)
      run kernels_cuda_test "$carry/bin/kernels_cuda_test"
      run server_cuda_test "$carry/bin/server_cuda_test" ;;
    training)
      run integration_training "$carry/bin/integration_test" --gtest_filter='Training*:TlsTest.*Gpu*' ;;
    stops)
      run integration_stops "$carry/bin/integration_test" \
        --gtest_filter='StoppedNccl*:AbandonedWait*:ClientShutdown*:StoppedBigTransfer*:*NcclScatterGivenUp*' ;;
    bench)
      run gpu_planes_bench "$carry/bin/gpu_planes_bench" ;;
    ipc-wait)
      # The CUDA IPC rows with transfers waited for by future.get() and by
      # flatshard::Await (the default), alternated.
      for round in 1 2; do
        run "gpu_planes_ipc_get_$round" "$carry/bin/gpu_planes_bench" --planes=cuda-ipc --spin_us=0
        run "gpu_planes_ipc_await_$round" "$carry/bin/gpu_planes_bench" --planes=cuda-ipc
      done ;;
    kernels-bench)
      run kernels_cuda_bench "$carry/bin/kernels_cuda_bench" --json="$out/kernels.json"
      run torch_adamw_bench python3 bench/torch_adamw_bench.py "$out/kernels.json" ;;
    python)
      # The module for this machine's Python, from the carried client libraries.
      package=/tmp/flatshard-python
      mkdir -p "$package" && cp -r python/flatshard "$package/"
      run python_module g++ -std=c++20 -O2 -fPIC -shared -o \
        "$package/flatshard/_native$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
        python/module.cc -I. -Iclient/include -I"$carry/include" \
        -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
        -I"$(python3 -c 'import pybind11; print(pybind11.get_include())')" \
        -Wl,--start-group "$carry"/static/*.a -Wl,--end-group "$carry"/lib/*.so*
      export PYTHONPATH="$package:$PWD/tests/python" FLATSHARD_SERVER_BINARY="$carry/bin/flatshard-server"
      pushd tests/python >/dev/null
      run python_cuda_tensors python3 -m unittest -v test_cuda_tensors
      for memory in host device pinned; do
        FLATSHARD_TEST_MEMORY=$memory run "python_client_$memory" python3 -m unittest -v test_client
      done
      run python_parity_cuda python3 -m unittest -v -k cuda test_torch_parity
      for memory in device pinned; do
        FLATSHARD_TEST_MEMORY=$memory run "python_parity_$memory" python3 -m unittest -v test_torch_parity
      done
      popd >/dev/null ;;
    integration-device|integration-pinned)
      # In 6 shards at once, as ctest -j runs the suite (the tests pick free ports).
      export FLATSHARD_TEST_MEMORY=${step#integration-}
      for shard in 0 1 2 3 4 5; do
        GTEST_TOTAL_SHARDS=6 GTEST_SHARD_INDEX=$shard timeout -k 5 "$step_limit" "$carry/bin/integration_test" \
          >"$out/$step-$shard.log" 2>&1 &
      done
      shard_status=0 started=$SECONDS
      for job in $(jobs -p); do wait "$job" || shard_status=1; done
      pkill -KILL -f "^($carry|/work/main/build)/bin/flatshard-server" || true
      unset FLATSHARD_TEST_MEMORY
      echo "== $step: exit $shard_status after $((SECONDS - started)) s"
      grep -a -h -E "^\[  (PASSED|FAILED)|FAILED  \]|^\[  SKIPPED \]" "$out/$step"-*.log | sort | uniq -c
      [[ $shard_status == 0 ]] || status=1 ;;
    safetensors)
      run safetensors_library python3 tests/python/safetensors_library_check.py check \
        "$carry/safetensors-sample" ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
  pack
done
exit $status
