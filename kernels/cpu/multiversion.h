// FLATSHARD_MULTIVERSION: compiles a CPU kernel for x86-64-v4 (AVX-512), v3 (AVX2) and the
// baseline and picks the best at load time (GCC target_clones, an ifunc), so one binary
// is both portable and fast. Results are bitwise identical across the versions: the
// project compiles with -ffp-contract=off (no a*b+c -> FMA) and the kernels never
// reassociate. Expands to nothing on other compilers or architectures.
#ifndef FLATSHARD_KERNELS_CPU_MULTIVERSION_H_
#define FLATSHARD_KERNELS_CPU_MULTIVERSION_H_

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define FLATSHARD_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLATSHARD_MULTIVERSION
#endif

#endif  // FLATSHARD_KERNELS_CPU_MULTIVERSION_H_
