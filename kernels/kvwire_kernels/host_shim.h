// Compiles a CUDA kernel as plain C++ so its logic can be checked on a machine without a
// GPU (tests/test_kernels.py): one "thread" per call, lanes looped over by the host.
// Float multiply/add go through volatile temporaries so the compiler cannot fuse them,
// matching the kernel's explicit __fmul_rn / __fadd_rn. Build with -ffp-contract=off.
#pragma once
#include <stdint.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)

struct kvw_dim3 { int x, y, z; };
static kvw_dim3 blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, threadIdx = {0, 0, 0};

template <typename T> static inline T __ldg(const T* p) { return *p; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }

// Run a kernel for threads 0..n-1 of a one-dimensional grid.
#define KVW_HOST_LAUNCH(n, call) \
    do { for (int kvw_t = 0; kvw_t < (n); ++kvw_t) { threadIdx.x = kvw_t; call; } } while (0)
