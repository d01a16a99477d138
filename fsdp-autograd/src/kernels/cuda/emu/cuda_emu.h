// Host emulation of the subset of CUDA that the program (../kernels.cu) uses, for tests on
// machines without a GPU. It is NOT a GPU: it runs each block's BLOCK threads as host threads (a persistent pool,
// one block at a time), maps __syncthreads to a barrier, __shared__ to function statics (shared
// by the threads of the one running block), and provides the intrinsics with host code.
//
// What it checks: the kernels' indexing, loop bounds, barriers and reductions, and the host
// plans' kernel sequences, grids and argument order (see harness.cpp and tests/emu.rs).
// What it cannot check: anything about real GPUs (memory model beyond what host threads
// exhibit, warp scheduling, PTX compilation by NVRTC, the f16 PTX conversions, cuBLAS itself).

#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <barrier>

#define FSDP_HOST_EMULATION 1
#define __global__
#define __device__
#define __launch_bounds__(...)  // occupancy hint: nothing to do on the host
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
inline thread_local std::barrier<>* emu_block_barrier = nullptr;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

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

inline double __longlong_as_double(long long x) {
    double d;
    memcpy(&d, &x, 8);
    return d;
}

// flash.cu's register-tiled kernels: 16-byte shared tiles, float4 loads, explicit FMA. fmaf is
// correctly rounded like the device's fma.rn.f32.
#define __align__(n) __attribute__((aligned(n)))

struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};

inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    std::atomic_ref<unsigned long long> a(*p);
    unsigned long long old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

// The device uses PTX `cvt.rn.f16.f32` / `cvt.f32.f16`; these software conversions (round to
// nearest even) stand in for them, so emulated f16 casts check the plumbing, not the hardware.
inline unsigned short f32_to_f16_bits(float f) {
    unsigned x = __float_as_uint(f);
    unsigned sign = (x >> 16) & 0x8000u;
    unsigned exp = (x >> 23) & 0xffu;
    unsigned man = x & 0x7fffffu;
    if (exp == 0xffu) return (unsigned short)(sign | 0x7c00u | (man ? 0x0200u | (man >> 13) : 0u));
    int e = (int)exp - 127 + 15;
    if (e >= 0x1f) return (unsigned short)(sign | 0x7c00u);
    unsigned full, shift, q;
    if (e <= 0) {
        if (e < -10) return (unsigned short)sign;
        full = man | 0x800000u;
        shift = (unsigned)(14 - e);
        q = full >> shift;
    } else {
        full = man;
        shift = 13;
        q = ((unsigned)e << 10) | (man >> 13);
    }
    unsigned rem = full & ((1u << shift) - 1u);
    unsigned half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q += 1u;
    return (unsigned short)(sign | q);
}

inline float f16_bits_to_f32(unsigned short h) {
    unsigned sign = ((unsigned)h & 0x8000u) << 16;
    unsigned e = ((unsigned)h >> 10) & 0x1fu;
    unsigned m = (unsigned)h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0u) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
