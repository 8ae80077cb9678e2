#!/usr/bin/env bash
# Installs every Debian package flatshard's build, tests, demo and benchmarks need.
# Idempotent: packages already present are not touched, and apt-get update runs only
# when something is missing. Safe to run as root or through sudo.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build ccache pkg-config
  # control plane: gRPC, protobuf, Abseil
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  # JSON (layout specs, safetensors headers), checksums, logging
  nlohmann-json3-dev libxxhash-dev libspdlog-dev libfmt-dev
  # the CPU tiers' kernel threads (server/compute_pool.h)
  libtbb-dev
  # TLS: certificate checks at server start-up; the tests make certificates with openssl
  libssl-dev openssl
  # the server's Prometheus metrics endpoint (--metrics_listen)
  prometheus-cpp-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev iperf3
  # the Python package and its tests (/usr/bin/python3): pybind11 module, numpy, PyTorch
  python3-dev pybind11-dev python3-numpy python3-torch
  # the deployment files' test reads the Kubernetes manifest
  python3-yaml
)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
