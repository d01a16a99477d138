// Device kernels of fsdp_collectives::shared_gpu, compiled by NVRTC at first use (exec.rs).
//
// Two kernels move every collective of thread ranks sharing one GPU (plan.rs says which
// launches each rank makes):
// - sg_copy: blockIdx.y picks source k of `nsrc`; it copies its range into bytes
//   [k*chunk, min((k+1)*chunk, total)) of dst (a zero source address is skipped: the in-place
//   chunk, or the rank's own chunk). All-gather, broadcast, all-to-all and the second half of
//   all-reduce. Words of `unit` bytes (16: one 16-byte load and store), a byte tail.
// - sg_reduce_<type>: dst[i] = fold of src[0][i], src[1][i], ... strictly in source (= rank)
//   order, with the thread backend's accumulators (fsdp-collectives/src/kernels.rs): f32 in f32;
//   f16/bf16 widened into f32 and rounded once at the end, or in their own precision, rounded
//   after every step; i32/i64 wrapping. Average divides the accumulator by `world` before the
//   store. With `vec`, 16 bytes per source per load. dst may be one of the sources (the in-place
//   forms): each element is read from every source before it is written, by the same thread.
//
// Conventions (shared with plan.rs): one-dimensional blocks of SG_BLOCK threads, grid-stride
// loops (any grid is correct), addresses as u64, at most SG_MAX_SOURCES sources per launch
// (passed by value). Compiled with --fmad=false and IEEE division like fsdp-autograd's kernels.
// The half conversions are the `half` crate's algorithms in integer code (round to nearest
// even; NaNs quieted, payload kept), so a result's bits equal the thread backend's even for
// NaN inputs. No header is included; under FSDP_HOST_EMULATION the emulator (emu/) supplies
// the CUDA built-ins.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef int i32;
typedef unsigned short u16;
typedef unsigned char u8;

#define SG_BLOCK 256
#define SG_MAX_SOURCES 64

#define SG_SUM 1
#define SG_AVG 2
#define SG_MAX 3
#define SG_MIN 4

// Full unrolling keeps a 16-byte group's accumulators in registers (the emulator has no such
// pragma).
#ifdef FSDP_HOST_EMULATION
#define SG_UNROLL
#else
#define SG_UNROLL _Pragma("unroll")
#endif

struct SgSources {
    u64 p[SG_MAX_SOURCES];
};

// ---- half precision, bit for bit the `half` crate -----------------------------------------

__device__ __forceinline__ float sg_f16_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 e = ((u32)h >> 10) & 0x1fu;
    u32 m = (u32)h & 0x3ffu;
    if ((h & 0x7fffu) == 0u) return __uint_as_float(sign);
    if (e == 0x1fu) {
        if (m == 0u) return __uint_as_float(sign | 0x7f800000u);
        return __uint_as_float(sign | 0x7fc00000u | (m << 13));
    }
    if (e == 0u) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24: exact
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

__device__ __forceinline__ u16 sg_f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = x & 0x80000000u;
    u32 exp = x & 0x7f800000u;
    u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        u32 nan_bit = man == 0u ? 0u : 0x0200u;
        return (u16)((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }
    u32 half_sign = sign >> 16;
    i32 half_exp = (i32)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) return (u16)(half_sign | 0x7c00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (u16)half_sign;
        u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) half_man += 1u;
        return (u16)(half_sign | half_man);
    }
    u32 bits = half_sign | ((u32)half_exp << 10) | (man >> 13);
    u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) bits += 1u;
    return (u16)bits;
}

__device__ __forceinline__ float sg_bf16_to_f32(u16 h) {
    if ((h & 0x7fffu) > 0x7f80u) return __uint_as_float(((u32)h | 0x0040u) << 16);
    return __uint_as_float((u32)h << 16);
}

__device__ __forceinline__ u16 sg_f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) return (u16)((x >> 16) + 1u);
    return (u16)(x >> 16);
}

// ---- accumulators: the thread backend's `Accum` impls --------------------------------------
// load (first rank), add / max / min (each later rank), div (average), store.

struct AccF32 {  // f32 buffers, f32 accumulation
    typedef float T;
    typedef float A;
    static __device__ __forceinline__ A load(T x) { return x; }
    static __device__ __forceinline__ A add(A a, T x) { return a + x; }
    static __device__ __forceinline__ A max(A a, T x) { return fmaxf(a, x); }
    static __device__ __forceinline__ A min(A a, T x) { return fminf(a, x); }
    static __device__ __forceinline__ A div(A a, u32 n) { return a / (float)n; }
    static __device__ __forceinline__ T store(A a) { return a; }
};

// Half buffers widened into f32: round once at the end.
#define SG_WIDE(NAME, TO_F32, FROM_F32)                                                       \
    struct NAME {                                                                             \
        typedef u16 T;                                                                        \
        typedef float A;                                                                      \
        static __device__ __forceinline__ A load(T x) { return TO_F32(x); }                  \
        static __device__ __forceinline__ A add(A a, T x) { return a + TO_F32(x); }          \
        static __device__ __forceinline__ A max(A a, T x) { return fmaxf(a, TO_F32(x)); }    \
        static __device__ __forceinline__ A min(A a, T x) { return fminf(a, TO_F32(x)); }    \
        static __device__ __forceinline__ A div(A a, u32 n) { return a / (float)n; }         \
        static __device__ __forceinline__ T store(A a) { return FROM_F32(a); }               \
    };

// Half buffers in their own precision: round after every step.
#define SG_OWN(NAME, TO_F32, FROM_F32)                                                        \
    struct NAME {                                                                             \
        typedef u16 T;                                                                        \
        typedef u16 A;                                                                        \
        static __device__ __forceinline__ A load(T x) { return x; }                          \
        static __device__ __forceinline__ A add(A a, T x) {                                  \
            return FROM_F32(TO_F32(a) + TO_F32(x));                                           \
        }                                                                                     \
        static __device__ __forceinline__ A max(A a, T x) {                                  \
            return FROM_F32(fmaxf(TO_F32(a), TO_F32(x)));                                     \
        }                                                                                     \
        static __device__ __forceinline__ A min(A a, T x) {                                  \
            return FROM_F32(fminf(TO_F32(a), TO_F32(x)));                                     \
        }                                                                                     \
        static __device__ __forceinline__ A div(A a, u32 n) {                                \
            return FROM_F32(TO_F32(a) / (float)n);                                            \
        }                                                                                     \
        static __device__ __forceinline__ T store(A a) { return a; }                         \
    };

SG_WIDE(AccF16F32, sg_f16_to_f32, sg_f32_to_f16)
SG_WIDE(AccBf16F32, sg_bf16_to_f32, sg_f32_to_bf16)
SG_OWN(AccF16, sg_f16_to_f32, sg_f32_to_f16)
SG_OWN(AccBf16, sg_bf16_to_f32, sg_f32_to_bf16)

// Integers: wrapping sum (in unsigned arithmetic), truncating average.
#define SG_INT(NAME, S, U)                                                                    \
    struct NAME {                                                                             \
        typedef S T;                                                                          \
        typedef S A;                                                                          \
        static __device__ __forceinline__ A load(T x) { return x; }                          \
        static __device__ __forceinline__ A add(A a, T x) { return (S)((U)a + (U)x); }       \
        static __device__ __forceinline__ A max(A a, T x) { return a < x ? x : a; }          \
        static __device__ __forceinline__ A min(A a, T x) { return x < a ? x : a; }          \
        static __device__ __forceinline__ A div(A a, u32 n) { return a / (S)n; }             \
        static __device__ __forceinline__ T store(A a) { return a; }                         \
    };

SG_INT(AccI32, i32, u32)
SG_INT(AccI64, i64, u64)

template <class R>
__device__ __forceinline__ typename R::A sg_step(u32 op, typename R::A a, typename R::T x) {
    if (op == SG_MAX) return R::max(a, x);
    if (op == SG_MIN) return R::min(a, x);
    return R::add(a, x);
}

template <class R>
__device__ __forceinline__ typename R::T sg_finish(u32 op, u32 world, typename R::A a) {
    return R::store(op == SG_AVG ? R::div(a, world) : a);
}

template <class R>
__device__ void sg_reduce(const SgSources& src, u32 nsrc, u64 dst, u64 n, u32 op, u32 world,
                          u32 vec) {
    typedef typename R::T T;
    typedef typename R::A A;
    constexpr u32 PER = 16 / sizeof(T);
    union Pack {
        uint4 v;
        T e[16 / sizeof(T)];
    };
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 groups = vec ? n / PER : 0;
    for (u64 g = tid; g < groups; g += stride) {
        Pack in, out;
        A acc[16 / sizeof(T)];
        in.v = ((const uint4*)src.p[0])[g];
        SG_UNROLL for (u32 j = 0; j < PER; j++) acc[j] = R::load(in.e[j]);
        for (u32 k = 1; k < nsrc; k++) {
            in.v = ((const uint4*)src.p[k])[g];
            SG_UNROLL for (u32 j = 0; j < PER; j++) acc[j] = sg_step<R>(op, acc[j], in.e[j]);
        }
        SG_UNROLL for (u32 j = 0; j < PER; j++) out.e[j] = sg_finish<R>(op, world, acc[j]);
        ((uint4*)dst)[g] = out.v;
    }
    for (u64 i = groups * PER + tid; i < n; i += stride) {
        A acc = R::load(((const T*)src.p[0])[i]);
        for (u32 k = 1; k < nsrc; k++) acc = sg_step<R>(op, acc, ((const T*)src.p[k])[i]);
        ((T*)dst)[i] = sg_finish<R>(op, world, acc);
    }
}

#define SG_REDUCE_ENTRY(NAME, R)                                                             \
    extern "C" __global__ void NAME(SgSources src, u32 nsrc, u64 dst, u64 n, u32 op,         \
                                    u32 world, u32 vec) {                                    \
        sg_reduce<R>(src, nsrc, dst, n, op, world, vec);                                     \
    }

SG_REDUCE_ENTRY(sg_reduce_f32, AccF32)
SG_REDUCE_ENTRY(sg_reduce_f16_f32, AccF16F32)
SG_REDUCE_ENTRY(sg_reduce_f16, AccF16)
SG_REDUCE_ENTRY(sg_reduce_bf16_f32, AccBf16F32)
SG_REDUCE_ENTRY(sg_reduce_bf16, AccBf16)
SG_REDUCE_ENTRY(sg_reduce_i32, AccI32)
SG_REDUCE_ENTRY(sg_reduce_i64, AccI64)

// ---- copies -------------------------------------------------------------------------------

template <class W>
__device__ void sg_copy_words(u64 from, u64 to, u64 len) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 words = len / sizeof(W);
    const W* s = (const W*)from;
    W* d = (W*)to;
    for (u64 i = tid; i < words; i += stride) d[i] = s[i];
    const u8* sb = (const u8*)from;
    u8* db = (u8*)to;
    for (u64 i = words * sizeof(W) + tid; i < len; i += stride) db[i] = sb[i];
}

extern "C" __global__ void sg_copy(SgSources src, u32 nsrc, u64 dst, u64 chunk, u64 total,
                                   u32 unit) {
    const u32 k = blockIdx.y;
    if (k >= nsrc || src.p[k] == 0) return;
    const u64 begin = (u64)k * chunk;
    if (begin >= total) return;
    const u64 len = chunk < total - begin ? chunk : total - begin;
    const u64 from = src.p[k], to = dst + begin;
    if (unit == 16) sg_copy_words<uint4>(from, to, len);
    else if (unit == 8) sg_copy_words<u64>(from, to, len);
    else if (unit == 4) sg_copy_words<u32>(from, to, len);
    else if (unit == 2) sg_copy_words<u16>(from, to, len);
    else sg_copy_words<u8>(from, to, len);
}
