// Host emulation of the few CUDA built-ins ../kernels.cu uses, for tests on machines without a
// GPU (see harness.cpp). It is not a GPU: the harness runs every thread of every block one
// after another. That is exact for these kernels, which share nothing between threads (no
// shared memory, no barriers, no atomics; every element is read and written by one thread).
// What it checks: the kernels' arithmetic (the rank-order fold, the accumulators, the half
// conversions), indexing, vector/tail split and grid-stride bounds, and the host plans'
// launches. What it cannot check: real GPUs (NVRTC compilation, memory ordering between
// streams, the driver).

#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#define FSDP_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};

inline float __uint_as_float(unsigned x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}

inline unsigned __float_as_uint(float f) {
    unsigned x;
    memcpy(&x, &f, 4);
    return x;
}
