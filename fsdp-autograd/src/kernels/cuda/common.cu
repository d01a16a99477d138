// The shared part of the NVRTC program of fsdp_autograd's kernels: types, conversions, the typed
// operand helpers, block reductions, the in-order column reduction and the index check. The
// program is this file followed by every op family's .cu file (kernels/program.rs,
// `FAMILIES`), compiled by NVRTC at first use.
//
// Conventions shared with the Rust launch code:
// - Every kernel is launched with BLOCK threads per block (a power of two: the block reductions
//   below depend on it) and a one-dimensional grid; loops stride over the grid, so any grid size
//   is correct and the host caps it.
// - Sizes are `u64`, pointers are device addresses, element types are spelled out (float,
//   double, i64, u32, u16 for the raw bits of f16/bf16).
// - The program is compiled with --fmad=false (no contraction of a*b+c into an FMA), so each
//   floating-point expression is evaluated operation by operation, like the CPU kernels.
// - Reductions are fixed-shape trees over the BLOCK threads of one block (or sequential loops),
//   never atomics, so every result is bit-reproducible run to run. The only atomic is the
//   integer atomicMin in check_ids, whose result does not depend on the order.
// - The parameter list of every `extern "C" __global__` function is declared once in Rust, in
//   the `declare_kernels!` table of its op's file; a unit test compares the two.
//
// No header is included: NVRTC provides the math functions and intrinsics used here. When the
// program is compiled on the host by the emulation harness (emu/), FSDP_HOST_EMULATION is defined
// and the harness supplies the CUDA built-ins and the two PTX-assembly helpers.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

#define BLOCK 256
#define MAX_RANK 8

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)
#define ROW_LOOP(r, rows) for (u64 r = blockIdx.x; r < (rows); r += gridDim.x)
#define COL_LOOP(j, cols) for (u64 j = threadIdx.x; j < (cols); j += BLOCK)

__device__ float neg_inf_f32() { return __uint_as_float(0xff800000u); }
__device__ float nan_f32() { return __uint_as_float(0x7fc00000u); }
__device__ double nan_f64() { return __longlong_as_double(0x7ff8000000000000LL); }

// Half-precision conversions. f16 uses the PTX conversion instructions (round to nearest even);
// bf16 follows the `half` crate's bit algorithms exactly (round to nearest even, NaNs quieted).

#ifndef FSDP_HOST_EMULATION
__device__ u16 f32_to_f16_bits(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ float f16_bits_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#endif

__device__ u16 f32_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    u16 h = (u16)(x >> 16);
    if ((x & 0x8000u) != 0u && (x & 0x17fffu) != 0u) h = (u16)(h + 1);
    return h;
}

// Typed kernels (suffix _t): kernels with each float operand in f32, f16 or bf16, so that half
// tensors need no f32 temporaries. The first parameter `types` holds operand i's element code in
// bits 2i..2i+1 (operands numbered in parameter order, pointers only; TY_* below). Half values
// are widened exactly on load (bf16 signaling NaNs quieted, as cast_bf16_f32 does), everything is
// computed in f32 with the very expressions of the f32 kernels, and each result is rounded once
// on store (cast_f32_f16 / cast_f32_bf16's rounding): bit for bit the cast-around path (cast in,
// f32 kernel, cast out). The f32 kernels are these bodies with every code TY_F32 (a constant,
// folded away).
#define TY_F32 0u
#define TY_F16 1u
#define TY_BF16 2u
#define TYPES_F32 0ull

__device__ unsigned ty_of(u64 types, unsigned i) { return (unsigned)(types >> (2u * i)) & 3u; }

__device__ float ld_t(const void* p, u64 i, unsigned ty) {
    if (ty == TY_F32) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    if (ty == TY_F16) return f16_bits_to_f32(h);
    u32 b = h;
    if ((b & 0x7fffu) > 0x7f80u) b |= 0x0040u;
    return __uint_as_float(b << 16);
}

__device__ void st_t(void* p, u64 i, unsigned ty, float x) {
    if (ty == TY_F32) {
        ((float*)p)[i] = x;
    } else if (ty == TY_F16) {
        ((u16*)p)[i] = f32_to_f16_bits(x);
    } else {
        ((u16*)p)[i] = f32_to_bf16_bits(x);
    }
}

// ---------------------------------------------------------------------------------------------
// Block reductions: a fixed binary tree over the BLOCK lanes. Every thread of the block must call
// them (they contain barriers); the result is returned to all threads and `sh` is reusable after.

__device__ double block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = sh[threadIdx.x] + sh[threadIdx.x + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// Maximum, skipping NaNs (fmaxf), like the CPU kernels' f32::max. Exact, so order-independent.
__device__ float block_max(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// The statistics of a softmax over row[0..n): the row maximum (into *m, NaNs skipped) and the f64
// sum of expf(row[j] - max) over the fixed tree. Every thread of the block must call it and gets
// both.
// The typed form reads the row at x + o (elements of code tx; see "Typed kernels").
__device__ double max_and_exp_sum_t(const void* x, u64 o, unsigned tx, u64 n, float* m,
                                    double* shd, float* shf) {
    float mx = neg_inf_f32();
    COL_LOOP(j, n) mx = fmaxf(mx, ld_t(x, o + j, tx));
    mx = block_max(mx, shf);
    double s = 0.0;
    COL_LOOP(j, n) s = s + (double)expf(ld_t(x, o + j, tx) - mx);
    *m = mx;
    return block_sum(s, shd);
}

__device__ double max_and_exp_sum(const float* row, u64 n, float* m, double* shd, float* shf) {
    return max_and_exp_sum_t(row, 0, TY_F32, n, m, shd, shf);
}

// Column reductions in row order (col_sums, layer_norm_bwd_params): out[j] = sum over r of
// v(r, j), rows added in order 0, 1, ... in f32 -- the CPU kernels' order, bit for bit. That order
// is a serial chain per column, so the parallelism is across columns only; what must be fast is
// feeding the chains. Each block owns COL_GROUP adjacent columns at a time (one 32-byte sector of
// an f32 row). All BLOCK threads stage a tile of COL_TILE rows x COL_GROUP columns into shared
// memory (thread t loads column t % COL_GROUP of rows t / COL_GROUP + k * COL_PASS: a warp reads
// four rows' sectors per instruction, COL_PER_THREAD independent loads per thread in flight),
// then thread c < COL_GROUP adds column c's staged rows in order. The next tile's loads are
// issued into registers before the adding starts (register double buffering), so the global
// loads of tile t + 1 overlap the in-order additions of tile t. The host launches one block per
// column group (capped at the grid limit; blocks loop over the groups).

#define COL_GROUP 8
#define COL_TILE 256
#define COL_PASS (BLOCK / COL_GROUP)
#define COL_PER_THREAD (COL_TILE / COL_PASS)

// Loads this thread's share of the tile at rows [base, base + COL_TILE) of column j (zeros past
// the matrix; the adding loop never reads them).
template <int N, class S>
__device__ void col_stage_load(const S& src, u64 rows, u64 cols, u64 base, u64 j, float (*v)[N]) {
    const u64 r0 = base + threadIdx.x / COL_GROUP;
    for (int k = 0; k < COL_PER_THREAD; ++k) {
        u64 r = r0 + (u64)k * COL_PASS;
        if (j < cols && r < rows) {
            src.load(r, j, v[k]);
        } else {
            for (int a = 0; a < N; ++a) v[k][a] = 0.0f;
        }
    }
}

// The N column sums of `src` (N = 1 or 2) into out0 (and out1), of element codes t0 (and t1).
// Every thread of the block runs every barrier: the loops' bounds are the same for the whole
// block.
template <int N, class S>
__device__ void col_reduce(u64 rows, u64 cols, const S& src, void* out0, void* out1, unsigned t0,
                           unsigned t1) {
    __shared__ float tile[N][COL_TILE][COL_GROUP];
    const unsigned c = threadIdx.x % COL_GROUP;
    const unsigned r0 = threadIdx.x / COL_GROUP;
    const u64 groups = (cols + COL_GROUP - 1) / COL_GROUP;
    for (u64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const u64 j = g * COL_GROUP + c;
        float v[COL_PER_THREAD][N];
        col_stage_load<N>(src, rows, cols, 0, j, v);
        float acc[N];
        for (int a = 0; a < N; ++a) acc[a] = 0.0f;
        for (u64 base = 0; base < rows; base += COL_TILE) {
            for (int k = 0; k < COL_PER_THREAD; ++k)
                for (int a = 0; a < N; ++a) tile[a][r0 + k * COL_PASS][c] = v[k][a];
            __syncthreads();
            if (base + COL_TILE < rows) col_stage_load<N>(src, rows, cols, base + COL_TILE, j, v);
            if (threadIdx.x < COL_GROUP) {
                const unsigned n = rows - base < COL_TILE ? (unsigned)(rows - base) : COL_TILE;
#pragma unroll 8
                for (unsigned r = 0; r < n; ++r)
                    for (int a = 0; a < N; ++a) acc[a] = acc[a] + tile[a][r][threadIdx.x];
            }
            // The tile is free for the next round's stores once every adder is done with it.
            __syncthreads();
        }
        if (threadIdx.x < COL_GROUP && j < cols) {
            st_t(out0, j, t0, acc[0]);
            if constexpr (N > 1) st_t(out1, j, t1, acc[1]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Index validation (embedding ids, cross-entropy targets): *first_bad (initialized to
// 0xffff...ff by the host) becomes the smallest position whose index is outside 0..bound.

__device__ bool in_range(i64 v, u64 bound) { return v >= 0 && (u64)v < bound; }

extern "C" __global__ void check_ids(u64 n, const i64* ids, u64 bound, u64* first_bad) {
    GRID_STRIDE(i, n) {
        if (!in_range(ids[i], bound)) atomicMin(first_bad, i);
    }
}
