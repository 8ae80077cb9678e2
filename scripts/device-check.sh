#!/usr/bin/env bash
# On a lent device machine (GPU), from the repository root: runs the GPU tests and the GPU
# benchmarks from the binaries scripts/device-carry.sh put in .devcarry/, logs under
# ${OUT:-/tmp/device-check}. Steps: any of tests, training, bench, kernels-bench,
# safetensors, python (default: tests training bench).
set -uo pipefail
carry=$PWD/.devcarry
out=${OUT:-/tmp/device-check}
mkdir -p "$out"
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$carry/lib${nccl_lib:+:$nccl_lib}"
export FLATSHARD_NCCL_LIBRARY="${nccl_lib:+$nccl_lib/libnccl.so.2}"
# integration_test starts the server from the path it was built with.
mkdir -p /work/main/build/bin && ln -sf "$carry/bin/flatshard-server" /work/main/build/bin/flatshard-server
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
steps=("${@:-tests training bench}")
status=0
run() {  # name, command...
  local name=$1; shift
  echo "== $name"
  "$@" >"$out/$name.log" 2>&1; local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc"
  [[ $rc == 0 ]] || status=1
}
for step in ${steps[*]}; do
  case $step in
    tests)
      run kernels_cuda_test "$carry/bin/kernels_cuda_test"
      run server_cuda_test "$carry/bin/server_cuda_test" ;;
    training)
      run integration_training "$carry/bin/integration_test" --gtest_filter='Training*' ;;
    bench)
      run gpu_planes_bench "$carry/bin/gpu_planes_bench" ;;
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
      for suite in test_cuda_tensors test_client \
                   test_torch_parity.ParityTest.test_cuda_model_with_gpu_servers_over_cuda_ipc; do
        run "python_${suite%%.*}" python3 -m unittest -v "$suite"
      done
      popd >/dev/null ;;
    safetensors)
      run safetensors_library python3 tests/python/safetensors_library_check.py check \
        "$carry/safetensors-sample" ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
