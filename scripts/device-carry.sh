#!/usr/bin/env bash
# Here (no GPU): copies the GPU test and benchmark binaries of build/ and the non-system
# shared libraries they need into .devcarry/, which a lent device machine receives with
# `carry: [".devcarry"]` and runs with scripts/device-check.sh. NCCL is not carried
# (218 MB): the binaries load it at run time from the device's PyTorch environment.
set -euo pipefail
build_dir=${1:-build}
carry=.devcarry
rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib"
binaries=("$build_dir"/tests/{kernels_cuda_test,server_cuda_test,integration_test}
          "$build_dir"/bin/{ipc_cuda_bench,kernels_cuda_bench,flatshard-server,flatshard,mlp_worker})
cp "${binaries[@]}" "$carry/bin/"
strip --strip-debug "$carry"/bin/*
ldd "${binaries[@]}" | awk '/=> \//{print $3}' | sort -u |
  grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|libz)\.so' |
  xargs -r cp -L -t "$carry/lib/"
du -sh "$carry"
