# Compile options for flatshard's own targets (generated code does not get -Werror).
#
#   flatshard_target_defaults(<target>)  warnings as errors, repository-rooted includes.

# -fno-math-errno lets GCC vectorize loops that call sqrtf (the optimizer kernels);
# PyTorch builds with it too. It changes no result: only errno is left untouched.
add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fno-math-errno>)
# No a*b+c -> fma contraction: the multiversioned kernels (kernels/cpu/multiversion.h)
# must give the same bits on every CPU, and reductions must be reproducible.
add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-ffp-contract=off>)

if(FLATSHARD_SANITIZE)
  if(NOT FLATSHARD_SANITIZE MATCHES "^(address|undefined|thread)$")
    message(FATAL_ERROR "FLATSHARD_SANITIZE must be address, undefined or thread, not '${FLATSHARD_SANITIZE}'")
  endif()
  set(_flatshard_san -fsanitize=${FLATSHARD_SANITIZE} -fno-omit-frame-pointer)
  if(FLATSHARD_SANITIZE STREQUAL "undefined")
    list(APPEND _flatshard_san -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_flatshard_san}>")
  if(FLATSHARD_SANITIZE STREQUAL "thread" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC warns (-Wtsan) that TSan cannot model the atomic_thread_fence in Abseil's flag
    # headers; that is Abseil's code, not ours, and -Werror would stop the build. (With
    # Debian's uninstrumented Abseil and oneTBB, TSan reports false races inside
    # absl::Mutex sections and TBB tasks: see the README.) GCC 12 also takes the
    # instrumented reference counting of libstdc++'s std::stop_token for a use after free
    # (-Wuse-after-free in <stop_token>, copying a token while another is destroyed).
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Wno-tsan> $<$<COMPILE_LANGUAGE:CXX>:-Wno-use-after-free>)
  endif()
  add_link_options(${_flatshard_san})
endif()

function(flatshard_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror>)
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:include>)
endfunction()
