# flatshard's front door. `make test` and `make demo` work on a fresh Debian 12 machine.
#
#   make build   configure and build (FLATSHARD_CUDA=AUTO) into build/
#   make test    install deps, build, run every test; also build and test CPU-only
#   make demo    the main job: a local cluster, training workers, a state-dict export
#   make bench   benchmarks, with ratios to anchors measured in the same run
#   make sanitize  every test under AddressSanitizer (SANITIZE=undefined: UBSan)

BUILD_DIR ?= build
CPU_BUILD_DIR ?= build-cpu
BUILD_TYPE ?= RelWithDebInfo
FLATSHARD_CUDA ?= AUTO
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
CTEST_FLAGS ?= --output-on-failure --timeout 600 -j $(JOBS)
SANITIZE ?= address

.PHONY: all deps configure build build-cpu test test-cpu demo bench sanitize clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DFLATSHARD_CUDA=$(FLATSHARD_CUDA) $(CMAKE_FLAGS)

configure: $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

build-cpu:
	cmake -S . -B $(CPU_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DFLATSHARD_CUDA=OFF -DFLATSHARD_BUILD_BENCH=OFF $(CMAKE_FLAGS)
	cmake --build $(CPU_BUILD_DIR) -j $(JOBS)

# The README's test command: both configurations compile and pass.
test: deps
	@$(MAKE) --no-print-directory build
	cd $(BUILD_DIR) && ctest $(CTEST_FLAGS)
	@$(MAKE) --no-print-directory test-cpu

test-cpu: build-cpu
	cd $(CPU_BUILD_DIR) && ctest $(CTEST_FLAGS)

demo: deps
	@$(MAKE) --no-print-directory build
	@scripts/demo.sh $(BUILD_DIR)

bench: deps
	@$(MAKE) --no-print-directory build
	@scripts/bench.sh $(BUILD_DIR)

# Every test in a sanitized CPU-only tree (SANITIZE=address or undefined), the Python
# suites against its server; fails on any sanitizer report of any process.
sanitize: deps
	@JOBS=$(JOBS) scripts/sanitize.sh $(SANITIZE) "" $(CPU_BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR) $(CPU_BUILD_DIR)
