#!/usr/bin/env bash
# Builds a sanitized CPU-only tree and runs every test under it (make sanitize).
#
#   scripts/sanitize.sh address|undefined [build_dir] [cpu_build_dir]
#
# The tests start servers as other processes, whose sanitizer reports a test sees at
# best as a lost connection (LeakSanitizer's, at a server's exit, not at all). So every
# process writes its reports into one fresh folder (log_path), and the run fails when
# any of them reports an error, whatever the tests said. The sanitized tree builds no
# Python package (the interpreter lacks the runtime): the Python suites run from the
# CPU tree's package (`make test-cpu` builds it) against the sanitized server.
# ThreadSanitizer needs Abseil, oneTBB and protobuf built with it: see the README.
set -euo pipefail
kind=${1:-address}
case "$kind" in
  address) default_dir=build-asan ;;
  undefined) default_dir=build-ubsan ;;
  *) echo "usage: $0 address|undefined [build_dir] [cpu_build_dir] (thread: see the README)" >&2; exit 2 ;;
esac
build_dir=$(realpath -m "${2:-$default_dir}")
cpu_build_dir=$(realpath -m "${3:-build-cpu}")
jobs=${JOBS:-$(nproc)}
root=$(cd "$(dirname "$0")/.." && pwd)

cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLATSHARD_CUDA=OFF \
  -DFLATSHARD_BUILD_BENCH=OFF -DFLATSHARD_SANITIZE="$kind" > /dev/null
cmake --build "$build_dir" -j "$jobs"

reports=$(mktemp -d /tmp/flatshard-sanitize-XXXXXX)
export ASAN_OPTIONS="log_path=$reports/asan"
export UBSAN_OPTIONS="log_path=$reports/ubsan:print_stacktrace=1"
export LSAN_OPTIONS="suppressions=$root/tests/lsan.supp"  # ctest sets it too, per test
failed=0
(cd "$build_dir" && ctest --output-on-failure --timeout 900 -j "$jobs") || failed=1

if [[ -d "$cpu_build_dir/python/flatshard" ]]; then
  echo "== Python suites ($cpu_build_dir's package) against $build_dir/bin/flatshard-server =="
  (cd "$cpu_build_dir" &&
     FLATSHARD_SERVER_BINARY="$build_dir/bin/flatshard-server" ctest -R '^Python\.' --output-on-failure --timeout 1200) ||
    failed=1
else
  echo "Python suites skipped: no package in $cpu_build_dir/python (make test-cpu builds it)"
fi

# A report file that only lists the suppressions LeakSanitizer used is no error.
errors=$(grep -l -E "ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:" "$reports"/* 2> /dev/null || true)
if [[ -n "$errors" ]]; then
  for file in $(head -n 5 <<< "$errors"); do  # a bug in the server repeats in every one started
    echo "== $file =="
    cat "$file"
  done
  echo "sanitize ($kind): $(wc -l <<< "$errors") process(es) reported errors (at most 5 shown); reports in $reports" >&2
  exit 1
fi
if [[ $failed != 0 ]]; then
  echo "sanitize ($kind): tests failed, no sanitizer reports (in $reports)" >&2
  exit 1
fi
rm -rf "$reports"
echo "sanitize ($kind): every test passed, no sanitizer reports"
