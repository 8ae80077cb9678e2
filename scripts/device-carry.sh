#!/usr/bin/env bash
# Here (no GPU): copies the GPU test and benchmark binaries of build/ and the non-system
# shared libraries they need into .devcarry/, which a lent device machine receives with
# `carry: [".devcarry"]` and runs with scripts/device-check.sh, with a checkpoint for the
# safetensors library check. NCCL is not carried
# (218 MB): the binaries load it at run time from the device's PyTorch environment.
set -euo pipefail
build_dir=${1:-build}
carry=.devcarry
rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib"
binaries=("$build_dir"/tests/{kernels_cuda_test,server_cuda_test,integration_test}
          "$build_dir"/bin/{gpu_planes_bench,kernels_cuda_bench,flatshard-server,flatshard,mlp_worker})
cp "${binaries[@]}" "$carry/bin/"
strip --strip-debug "$carry"/bin/*
ldd "${binaries[@]}" | awk '/=> \//{print $3}' | sort -u |
  grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|libz)\.so' |
  xargs -r cp -L -t "$carry/lib/"
# What the device needs to compile the Python module for its own Python (3.12 there,
# 3.11 here): the client's static libraries and the headers they expose.
mkdir -p "$carry/static" "$carry/include/google" "$carry/include/proto"
cp "$build_dir"/{client/libflatshard_client,core/libflatshard_core,transport/libflatshard_transport,tls/libflatshard_tls}.a \
   "$build_dir"/proto/libflatshard_proto{,_convert}.a \
   "$build_dir"/kernels/{libflatshard_kernels,cuda/libflatshard_kernels_cuda}.a "$carry/static/"
strip --strip-debug "$carry"/static/*.a
cp -r /usr/include/absl "$carry/include/"
cp -r /usr/include/google/protobuf "$carry/include/google/"
cp "$build_dir"/proto/gen/proto/*.pb.h "$carry/include/proto/"
# A FULL checkpoint for the safetensors library there (Debian has no package of it).
if [[ -d "$build_dir/python/flatshard" ]]; then
  PYTHONPATH="$build_dir/python:tests/python" /usr/bin/python3 \
    tests/python/safetensors_library_check.py make "$carry/safetensors-sample"
fi
du -sh "$carry"
