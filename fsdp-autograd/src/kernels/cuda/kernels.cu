// Device kernels of fsdp_autograd::kernels::cuda, compiled by NVRTC at first use (see program.rs).
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
// - The parameter list of every `extern "C" __global__` function is mirrored by
//   `Kernel::signature` in program.rs; a unit test compares the two.
//
// No header is included: NVRTC provides the math functions and intrinsics used here. When the
// file is compiled on the host by the emulation harness (emu/), FSDP_HOST_EMULATION is defined
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

// Element codes of the typed kernels (see "Typed kernels" below).
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

// ---------------------------------------------------------------------------------------------
// Elementwise.

extern "C" __global__ void ew_add(u64 n, const float* a, const float* b, float* out) {
    GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

extern "C" __global__ void ew_mul(u64 n, const float* a, const float* b, float* out) {
    GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}

extern "C" __global__ void ew_scale(u64 n, const float* x, float alpha, float* out) {
    GRID_STRIDE(i, n) out[i] = alpha * x[i];
}

extern "C" __global__ void ew_scale_inplace(u64 n, float* y, float alpha) {
    GRID_STRIDE(i, n) y[i] = y[i] * alpha;
}

// y <- y + alpha * x: the product is rounded, then the sum (no FMA), as on the CPU.
extern "C" __global__ void ew_axpy(u64 n, float* y, float alpha, const float* x) {
    GRID_STRIDE(i, n) y[i] = y[i] + alpha * x[i];
}

extern "C" __global__ void add_row_bias(u64 n, u64 cols, const float* x, const float* bias,
                                        float* out) {
    GRID_STRIDE(i, n) out[i] = x[i] + bias[i % cols];
}

extern "C" __global__ void add_row_bias_inplace(u64 n, u64 cols, float* y, const float* bias) {
    GRID_STRIDE(i, n) y[i] = y[i] + bias[i % cols];
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

// What col_sums adds: x[r, j] (element code tx).
struct ColSumSrc {
    const void* x;
    u64 cols;
    unsigned tx;
    __device__ void load(u64 r, u64 j, float* v) const { v[0] = ld_t(x, r * cols + j, tx); }
};

// What layer_norm_bwd_params adds: dy * xhat into dgamma and dy into dbeta, with
// xhat = (x - mean[r]) * rstd[r]. Each product is rounded on its own (--fmad=false), so computing
// it in the loading thread gives the same bits as computing it in the adding one.
struct LnParamsSrc {
    const void* x;
    const float* mean;
    const float* rstd;
    const void* dy;
    u64 cols;
    unsigned tx, tdy;
    __device__ void load(u64 r, u64 j, float* v) const {
        float d = ld_t(dy, r * cols + j, tdy);
        float xhat = (ld_t(x, r * cols + j, tx) - mean[r]) * rstd[r];
        v[0] = d * xhat;
        v[1] = d;
    }
};

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

extern "C" __global__ void col_sums(u64 rows, u64 cols, const float* x, float* out) {
    col_reduce<1>(rows, cols, ColSumSrc{x, cols, TY_F32}, out, out, TY_F32, TY_F32);
}

// Stage 1 of sum/mean: block b writes the f64 sum of its grid-strided elements to partial[b].
extern "C" __global__ void sum_partial(u64 n, const float* x, double* partial) {
    __shared__ double sh[BLOCK];
    double acc = 0.0;
    GRID_STRIDE(i, n) acc = acc + (double)x[i];
    double s = block_sum(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// Stage 2 (one block): out[0] = (sum of partial[0..count]) / divisor, rounded to f32 (and then,
// for a half `out` of code `to`, to its type).
__device__ void sum_final_body(u64 count, const double* partial, double divisor, void* out,
                               unsigned to) {
    __shared__ double sh[BLOCK];
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < count; i += BLOCK) acc = acc + partial[i];
    double s = block_sum(acc, sh);
    if (threadIdx.x == 0) st_t(out, 0, to, (float)(s / divisor));
}

extern "C" __global__ void sum_final(u64 count, const double* partial, double divisor, float* out) {
    sum_final_body(count, partial, divisor, out, TY_F32);
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation, in the CPU kernel's form: y = x / (1 + exp(-2u)).

#define SQRT_2_OVER_PI 0.7978846f
#define GELU_C 0.044715f

__device__ float gelu_arg(float x) { return SQRT_2_OVER_PI * (x + GELU_C * x * x * x); }
__device__ float exp_neg_2u(float u) { return expf(fminf(-2.0f * u, 88.0f)); }

__device__ float gelu_tanh_value(float v) { return v / (1.0f + exp_neg_2u(gelu_arg(v))); }

__device__ float gelu_tanh_grad(float v, float g) {
    float e = exp_neg_2u(gelu_arg(v));
    float s = 1.0f / (1.0f + e);
    float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * v * v);
    return g * (s + 2.0f * v * (e * s * s) * du);
}

extern "C" __global__ void gelu_fwd(u64 n, const float* x, float* y) {
    GRID_STRIDE(i, n) y[i] = gelu_tanh_value(x[i]);
}

extern "C" __global__ void gelu_bwd(u64 n, const float* x, const float* dy, float* dx) {
    GRID_STRIDE(i, n) dx[i] = gelu_tanh_grad(x[i], dy[i]);
}

// ---------------------------------------------------------------------------------------------
// GELU, exact form: y = x * Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2 (no cancellation for x < 0);
// dx = dy * (Phi(x) + x * phi(x)), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).

#define FRAC_1_SQRT_2 0.70710677f
#define INV_SQRT_2PI 0.3989423f

__device__ float normal_cdf(float x) { return 0.5f * erfcf(-x * FRAC_1_SQRT_2); }

__device__ float gelu_exact_value(float v) { return v * normal_cdf(v); }

__device__ float gelu_exact_grad(float v, float g) {
    float pdf = INV_SQRT_2PI * expf(fmaxf(-0.5f * v * v, -104.0f));
    return g * (normal_cdf(v) + v * pdf);
}

extern "C" __global__ void gelu_exact_fwd(u64 n, const float* x, float* y) {
    GRID_STRIDE(i, n) y[i] = gelu_exact_value(x[i]);
}

extern "C" __global__ void gelu_exact_bwd(u64 n, const float* x, const float* dy, float* dx) {
    GRID_STRIDE(i, n) dx[i] = gelu_exact_grad(x[i], dy[i]);
}

// ---------------------------------------------------------------------------------------------
// Row softmax (one block per row), plain and causal.

extern "C" __global__ void softmax_fwd(u64 rows, u64 cols, const float* x, float* y) {
    __shared__ double shd[BLOCK];
    __shared__ float shf[BLOCK];
    ROW_LOOP(r, rows) {
        const float* xr = x + r * cols;
        float* yr = y + r * cols;
        float m;
        double s = max_and_exp_sum(xr, cols, &m, shd, shf);
        float inv = (float)(1.0 / s);
        COL_LOOP(j, cols) yr[j] = expf(xr[j] - m) * inv;
    }
}

extern "C" __global__ void softmax_bwd(u64 rows, u64 cols, const float* y, const float* dy,
                                       float* dx) {
    __shared__ double shd[BLOCK];
    ROW_LOOP(r, rows) {
        const float* yr = y + r * cols;
        const float* gr = dy + r * cols;
        float* dr = dx + r * cols;
        double acc = 0.0;
        COL_LOOP(j, cols) acc = acc + (double)yr[j] * (double)gr[j];
        float dot = (float)block_sum(acc, shd);
        COL_LOOP(j, cols) dr[j] = yr[j] * (gr[j] - dot);
    }
}

// In place on p: rows of t scores; row r is query position r % t of its (batch, head) and sees
// keys 0..=r % t. Masked entries become exactly 0.
extern "C" __global__ void causal_softmax(u64 rows, u64 t, float* p) {
    __shared__ double shd[BLOCK];
    __shared__ float shf[BLOCK];
    ROW_LOOP(r, rows) {
        float* row = p + r * t;
        u64 vis = r % t + 1;
        float m;
        double s = max_and_exp_sum(row, vis, &m, shd, shf);
        float inv = (float)(1.0 / s);
        COL_LOOP(j, t) row[j] = j < vis ? expf(row[j] - m) * inv : 0.0f;
    }
}

// In place on ds, which holds dP = dout * v^T on entry and dS on exit:
// dS = P * (dP - sum_{j <= i} P * dP) on the visible part, 0 above the diagonal.
extern "C" __global__ void causal_softmax_bwd(u64 rows, u64 t, const float* p, float* ds) {
    __shared__ double shd[BLOCK];
    ROW_LOOP(r, rows) {
        const float* pr = p + r * t;
        float* dr = ds + r * t;
        u64 vis = r % t + 1;
        double acc = 0.0;
        COL_LOOP(j, vis) acc = acc + (double)pr[j] * (double)dr[j];
        float dot = (float)block_sum(acc, shd);
        COL_LOOP(j, t) dr[j] = j < vis ? pr[j] * (dr[j] - dot) : 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// Layer norm (one block per row for the row statistics and dx; the parameter gradients are
// column reductions in row order, as on the CPU: see col_reduce).

// Operand codes in `types`: x 0, gamma 1, beta 2, y 3 (mean and rstd are f32).
__device__ void layer_norm_fwd_body(u64 types, u64 rows, u64 cols, float eps, const void* x,
                                    const void* gamma, const void* beta, void* y, float* mean,
                                    float* rstd) {
    __shared__ double shd[BLOCK];
    const unsigned tx = ty_of(types, 0), tg = ty_of(types, 1), tb = ty_of(types, 2),
                   ty = ty_of(types, 3);
    ROW_LOOP(r, rows) {
        const u64 o = r * cols;
        double acc = 0.0;
        COL_LOOP(j, cols) acc = acc + (double)ld_t(x, o + j, tx);
        double mu = block_sum(acc, shd) / (double)cols;
        double vacc = 0.0;
        COL_LOOP(j, cols) {
            double d = (double)ld_t(x, o + j, tx) - mu;
            vacc = vacc + d * d;
        }
        double var = block_sum(vacc, shd);
        float rs = (float)(1.0 / sqrt(var / (double)cols + (double)eps));
        float m = (float)mu;
        if (threadIdx.x == 0) {
            mean[r] = m;
            rstd[r] = rs;
        }
        COL_LOOP(j, cols) {
            st_t(y, o + j, ty, (ld_t(x, o + j, tx) - m) * rs * ld_t(gamma, j, tg) + ld_t(beta, j, tb));
        }
    }
}

extern "C" __global__ void layer_norm_fwd(u64 rows, u64 cols, float eps, const float* x,
                                          const float* gamma, const float* beta, float* y,
                                          float* mean, float* rstd) {
    layer_norm_fwd_body(TYPES_F32, rows, cols, eps, x, gamma, beta, y, mean, rstd);
}

// Operand codes in `types`: x 0, gamma 1, dy 4, dx 5 (2 and 3 are mean and rstd, always f32).
__device__ void layer_norm_bwd_dx_body(u64 types, u64 rows, u64 cols, const void* x,
                                       const void* gamma, const float* mean, const float* rstd,
                                       const void* dy, void* dx) {
    __shared__ double shd[BLOCK];
    const unsigned tx = ty_of(types, 0), tg = ty_of(types, 1), tdy = ty_of(types, 4),
                   tdx = ty_of(types, 5);
    ROW_LOOP(r, rows) {
        const u64 o = r * cols;
        float m = mean[r];
        float rs = rstd[r];
        double sg = 0.0;
        double sgx = 0.0;
        COL_LOOP(j, cols) {
            float xhat = (ld_t(x, o + j, tx) - m) * rs;
            float g = ld_t(dy, o + j, tdy) * ld_t(gamma, j, tg);
            sg = sg + (double)g;
            sgx = sgx + (double)g * (double)xhat;
        }
        float mean_g = (float)(block_sum(sg, shd) / (double)cols);
        float mean_gx = (float)(block_sum(sgx, shd) / (double)cols);
        COL_LOOP(j, cols) {
            float xhat = (ld_t(x, o + j, tx) - m) * rs;
            float g = ld_t(dy, o + j, tdy) * ld_t(gamma, j, tg);
            st_t(dx, o + j, tdx, rs * (g - mean_g - xhat * mean_gx));
        }
    }
}

extern "C" __global__ void layer_norm_bwd_dx(u64 rows, u64 cols, const float* x,
                                             const float* gamma, const float* mean,
                                             const float* rstd, const float* dy, float* dx) {
    layer_norm_bwd_dx_body(TYPES_F32, rows, cols, x, gamma, mean, rstd, dy, dx);
}

// dgamma[j] = sum_r dy * xhat, dbeta[j] = sum_r dy, rows in order (see col_reduce).
extern "C" __global__ void layer_norm_bwd_params(u64 rows, u64 cols, const float* x,
                                                 const float* mean, const float* rstd,
                                                 const float* dy, float* dgamma, float* dbeta) {
    col_reduce<2>(rows, cols, LnParamsSrc{x, mean, rstd, dy, cols, TY_F32, TY_F32}, dgamma, dbeta,
                  TY_F32, TY_F32);
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

// ---------------------------------------------------------------------------------------------
// Embedding. Forward: a gather (rows of invalid ids become NaN). Backward without atomics: a
// stable counting sort of the positions by id, then one block per table row adds its dy rows in
// position order — the CPU kernel's summation order, bit for bit.

// Operand codes in `types`: table 1, out 2 (ids are i64).
__device__ void embedding_fwd_body(u64 types, u64 total, u64 dim, u64 rows, const i64* ids,
                                   const void* table, void* out) {
    const unsigned tt = ty_of(types, 1), to = ty_of(types, 2);
    GRID_STRIDE(e, total) {
        u64 i = e / dim;
        u64 j = e - i * dim;
        i64 v = ids[i];
        st_t(out, e, to, in_range(v, rows) ? ld_t(table, (u64)v * dim + j, tt) : nan_f32());
    }
}

extern "C" __global__ void embedding_fwd(u64 total, u64 dim, u64 rows, const i64* ids,
                                         const float* table, float* out) {
    embedding_fwd_body(TYPES_F32, total, dim, rows, ids, table, out);
}

// One block. count[0..rows] must be zero on entry. Positions are processed in tiles of BLOCK, in
// order; within a tile each thread counts the equal ids before and after it. On exit
// rank[i] = #{j < i : ids[j] == ids[i]} for every valid i, and count[r] = #{i : ids[i] == r}.
extern "C" __global__ void emb_rank(u64 n, const i64* ids, u64 rows, u32* count, u32* rank) {
    __shared__ i64 tile[BLOCK];
    for (u64 base = 0; base < n; base += BLOCK) {
        u64 i = base + threadIdx.x;
        i64 id = -1;
        if (i < n && in_range(ids[i], rows)) id = ids[i];
        tile[threadIdx.x] = id;
        __syncthreads();
        u32 before = 0;
        bool last = true;
        if (id >= 0) {
            for (unsigned t = 0; t < BLOCK; ++t) {
                if (tile[t] == id) {
                    if (t < threadIdx.x) before += 1;
                    else if (t > threadIdx.x) last = false;
                }
            }
            rank[i] = count[id] + before;
        }
        // Every read of count[] for this tile happens before any update of it.
        __syncthreads();
        if (id >= 0 && last) count[id] = count[id] + before + 1;
        // Updates are visible to the whole block before the next tile reads them.
        __syncthreads();
    }
}

// One block: start[r] = count[0] + ... + count[r - 1] (exclusive prefix sum).
extern "C" __global__ void emb_scan(u64 rows, const u32* count, u32* start) {
    __shared__ u32 part[BLOCK];
    u64 chunk = (rows + BLOCK - 1) / BLOCK;
    u64 lo = (u64)threadIdx.x * chunk;
    u64 hi = lo + chunk;
    if (lo > rows) lo = rows;
    if (hi > rows) hi = rows;
    u32 s = 0;
    for (u64 r = lo; r < hi; ++r) s += count[r];
    part[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (unsigned t = 0; t < BLOCK; ++t) {
            u32 c = part[t];
            part[t] = acc;
            acc += c;
        }
    }
    __syncthreads();
    u32 acc = part[threadIdx.x];
    for (u64 r = lo; r < hi; ++r) {
        start[r] = acc;
        acc += count[r];
    }
}

// order[start[id] + rank[i]] = i: the positions grouped by id, each group in position order.
extern "C" __global__ void emb_scatter(u64 n, u64 rows, const i64* ids, const u32* start,
                                       const u32* rank, u32* order) {
    GRID_STRIDE(i, n) {
        i64 v = ids[i];
        if (in_range(v, rows)) order[start[v] + rank[i]] = (u32)i;
    }
}

// dtable[r, :] = sum of dy[i, :] over the positions i of id r, in position order (0 if none).
// Operand codes in `types`: dy 3, dtable 4 (start, count, order are u32).
__device__ void emb_accum_body(u64 types, u64 rows, u64 dim, const u32* start, const u32* count,
                               const u32* order, const void* dy, void* dtable) {
    const unsigned tg = ty_of(types, 3), td = ty_of(types, 4);
    ROW_LOOP(r, rows) {
        u32 s = start[r];
        u32 c = count[r];
        COL_LOOP(j, dim) {
            float acc = 0.0f;
            for (u32 p = 0; p < c; ++p) acc = acc + ld_t(dy, (u64)order[s + p] * dim + j, tg);
            st_t(dtable, r * dim + j, td, acc);
        }
    }
}

extern "C" __global__ void emb_accum(u64 rows, u64 dim, const u32* start, const u32* count,
                                     const u32* order, const float* dy, float* dtable) {
    emb_accum_body(TYPES_F32, rows, dim, start, count, order, dy, dtable);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy with integer targets. Forward writes lse[r] and the f64 row loss
// lse_r - logits[r, t_r] (NaN for an invalid target); sum_final then takes the mean.

// Operand codes in `types`: logits 0 (targets, lse and row_loss are i64, f32, f64).
__device__ void ce_fwd_body(u64 types, u64 rows, u64 cols, const void* logits,
                            const i64* targets, float* lse, double* row_loss) {
    __shared__ double shd[BLOCK];
    __shared__ float shf[BLOCK];
    const unsigned tl = ty_of(types, 0);
    ROW_LOOP(r, rows) {
        const u64 o = r * cols;
        float m;
        double s = max_and_exp_sum_t(logits, o, tl, cols, &m, shd, shf);
        double l = (double)m + log(s);
        if (threadIdx.x == 0) {
            lse[r] = (float)l;
            i64 t = targets[r];
            row_loss[r] = in_range(t, cols) ? l - (double)ld_t(logits, o + (u64)t, tl) : nan_f64();
        }
    }
}

extern "C" __global__ void ce_fwd(u64 rows, u64 cols, const float* logits, const i64* targets,
                                  float* lse, double* row_loss) {
    ce_fwd_body(TYPES_F32, rows, cols, logits, targets, lse, row_loss);
}

// dlogits[r, j] = (dloss[0] / rows) * (exp(logits[r, j] - lse[r]) - [j == t_r]); NaN rows for
// invalid targets. Operand codes in `types`: logits 0, dloss 3, dlogits 4.
__device__ void ce_bwd_body(u64 types, u64 rows, u64 cols, const void* logits,
                            const i64* targets, const float* lse, const void* dloss,
                            void* dlogits) {
    const unsigned tl = ty_of(types, 0), tg = ty_of(types, 3), td = ty_of(types, 4);
    float g = ld_t(dloss, 0, tg) / (float)rows;
    ROW_LOOP(r, rows) {
        const u64 o = r * cols;
        float l = lse[r];
        i64 t = targets[r];
        bool ok = in_range(t, cols);
        COL_LOOP(j, cols) {
            float p = expf(ld_t(logits, o + j, tl) - l);
            float v = (ok && j == (u64)t) ? g * (p - 1.0f) : g * p;
            st_t(dlogits, o + j, td, ok ? v : nan_f32());
        }
    }
}

extern "C" __global__ void ce_bwd(u64 rows, u64 cols, const float* logits, const i64* targets,
                                  const float* lse, const float* dloss, float* dlogits) {
    ce_bwd_body(TYPES_F32, rows, cols, logits, targets, lse, dloss, dlogits);
}

// ---------------------------------------------------------------------------------------------
// Casts (conversion helpers at the top of the file).

extern "C" __global__ void cast_f32_f16(u64 n, const float* src, u16* dst) {
    GRID_STRIDE(i, n) dst[i] = f32_to_f16_bits(src[i]);
}

extern "C" __global__ void cast_f16_f32(u64 n, const u16* src, float* dst) {
    GRID_STRIDE(i, n) dst[i] = f16_bits_to_f32(src[i]);
}

extern "C" __global__ void cast_f32_bf16(u64 n, const float* src, u16* dst) {
    GRID_STRIDE(i, n) dst[i] = f32_to_bf16_bits(src[i]);
}

// Exact; a signaling NaN is quieted (bit 0x40 set), as `half` does.
extern "C" __global__ void cast_bf16_f32(u64 n, const u16* src, float* dst) {
    GRID_STRIDE(i, n) {
        u32 h = src[i];
        if ((h & 0x7fffu) > 0x7f80u) h |= 0x0040u;
        dst[i] = __uint_as_float(h << 16);
    }
}

// ---------------------------------------------------------------------------------------------
// Typed kernels (suffix _t): the elementwise, bias, column-sum, GELU and layer-norm kernels with
// each float operand in f32, f16 or bf16, so that half tensors need no f32 temporaries. The
// first parameter `types` holds operand i's element code in bits 2i..2i+1 (operands numbered in
// parameter order, pointers only; TY_* below). Half values are widened exactly on load (bf16
// signaling NaNs quieted, as cast_bf16_f32 does), everything is computed in f32 with the very
// expressions of the f32 kernels, and each result is rounded once on store (cast_f32_f16 /
// cast_f32_bf16's rounding): bit for bit the cast-around path (cast in, f32 kernel, cast out).
// The f32 kernels are these bodies with every code TY_F32 (a constant, folded away).

extern "C" __global__ void ew_add_t(u64 types, u64 n, const void* a, const void* b, void* out) {
    const unsigned ta = ty_of(types, 0), tb = ty_of(types, 1), to = ty_of(types, 2);
    GRID_STRIDE(i, n) st_t(out, i, to, ld_t(a, i, ta) + ld_t(b, i, tb));
}

// y <- y + alpha * x (as ew_axpy).
extern "C" __global__ void ew_axpy_t(u64 types, u64 n, void* y, float alpha, const void* x) {
    const unsigned ty = ty_of(types, 0), tx = ty_of(types, 1);
    GRID_STRIDE(i, n) st_t(y, i, ty, ld_t(y, i, ty) + alpha * ld_t(x, i, tx));
}

extern "C" __global__ void add_row_bias_t(u64 types, u64 n, u64 cols, const void* x,
                                          const void* bias, void* out) {
    const unsigned tx = ty_of(types, 0), tb = ty_of(types, 1), to = ty_of(types, 2);
    GRID_STRIDE(i, n) st_t(out, i, to, ld_t(x, i, tx) + ld_t(bias, i % cols, tb));
}

extern "C" __global__ void add_row_bias_inplace_t(u64 types, u64 n, u64 cols, void* y,
                                                  const void* bias) {
    const unsigned ty = ty_of(types, 0), tb = ty_of(types, 1);
    GRID_STRIDE(i, n) st_t(y, i, ty, ld_t(y, i, ty) + ld_t(bias, i % cols, tb));
}

extern "C" __global__ void col_sums_t(u64 types, u64 rows, u64 cols, const void* x, void* out) {
    col_reduce<1>(rows, cols, ColSumSrc{x, cols, ty_of(types, 0)}, out, out, ty_of(types, 1),
                  TY_F32);
}

extern "C" __global__ void gelu_fwd_t(u64 types, u64 n, const void* x, void* y) {
    const unsigned tx = ty_of(types, 0), ty = ty_of(types, 1);
    GRID_STRIDE(i, n) st_t(y, i, ty, gelu_tanh_value(ld_t(x, i, tx)));
}

extern "C" __global__ void gelu_bwd_t(u64 types, u64 n, const void* x, const void* dy, void* dx) {
    const unsigned tx = ty_of(types, 0), tg = ty_of(types, 1), td = ty_of(types, 2);
    GRID_STRIDE(i, n) st_t(dx, i, td, gelu_tanh_grad(ld_t(x, i, tx), ld_t(dy, i, tg)));
}

extern "C" __global__ void gelu_exact_fwd_t(u64 types, u64 n, const void* x, void* y) {
    const unsigned tx = ty_of(types, 0), ty = ty_of(types, 1);
    GRID_STRIDE(i, n) st_t(y, i, ty, gelu_exact_value(ld_t(x, i, tx)));
}

extern "C" __global__ void gelu_exact_bwd_t(u64 types, u64 n, const void* x, const void* dy,
                                            void* dx) {
    const unsigned tx = ty_of(types, 0), tg = ty_of(types, 1), td = ty_of(types, 2);
    GRID_STRIDE(i, n) st_t(dx, i, td, gelu_exact_grad(ld_t(x, i, tx), ld_t(dy, i, tg)));
}

// Operands: x, gamma, beta, y (typed); mean and rstd are always f32.
extern "C" __global__ void layer_norm_fwd_t(u64 types, u64 rows, u64 cols, float eps,
                                            const void* x, const void* gamma, const void* beta,
                                            void* y, float* mean, float* rstd) {
    layer_norm_fwd_body(types, rows, cols, eps, x, gamma, beta, y, mean, rstd);
}

// Operands: x, gamma, (mean, rstd: f32), dy, dx.
extern "C" __global__ void layer_norm_bwd_dx_t(u64 types, u64 rows, u64 cols, const void* x,
                                               const void* gamma, const float* mean,
                                               const float* rstd, const void* dy, void* dx) {
    layer_norm_bwd_dx_body(types, rows, cols, x, gamma, mean, rstd, dy, dx);
}

// Operands: x, (mean, rstd: f32), dy, dgamma, dbeta.
extern "C" __global__ void layer_norm_bwd_params_t(u64 types, u64 rows, u64 cols, const void* x,
                                                   const float* mean, const float* rstd,
                                                   const void* dy, void* dgamma, void* dbeta) {
    col_reduce<2>(rows, cols,
                  LnParamsSrc{x, mean, rstd, dy, cols, ty_of(types, 0), ty_of(types, 3)}, dgamma,
                  dbeta, ty_of(types, 4), ty_of(types, 5));
}

extern "C" __global__ void ew_mul_t(u64 types, u64 n, const void* a, const void* b, void* out) {
    const unsigned ta = ty_of(types, 0), tb = ty_of(types, 1), to = ty_of(types, 2);
    GRID_STRIDE(i, n) st_t(out, i, to, ld_t(a, i, ta) * ld_t(b, i, tb));
}

extern "C" __global__ void ew_scale_t(u64 types, u64 n, const void* x, float alpha, void* out) {
    const unsigned tx = ty_of(types, 0), to = ty_of(types, 1);
    GRID_STRIDE(i, n) st_t(out, i, to, alpha * ld_t(x, i, tx));
}

extern "C" __global__ void ew_scale_inplace_t(u64 types, u64 n, void* y, float alpha) {
    const unsigned ty = ty_of(types, 0);
    GRID_STRIDE(i, n) st_t(y, i, ty, ld_t(y, i, ty) * alpha);
}

// Operands: x (typed), partial (f64).
extern "C" __global__ void sum_partial_t(u64 types, u64 n, const void* x, double* partial) {
    __shared__ double sh[BLOCK];
    const unsigned tx = ty_of(types, 0);
    double acc = 0.0;
    GRID_STRIDE(i, n) acc = acc + (double)ld_t(x, i, tx);
    double s = block_sum(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// Operands: partial (f64), out (typed).
extern "C" __global__ void sum_final_t(u64 types, u64 count, const double* partial,
                                       double divisor, void* out) {
    sum_final_body(count, partial, divisor, out, ty_of(types, 1));
}

// Operands: logits (typed), targets, lse, row_loss.
extern "C" __global__ void ce_fwd_t(u64 types, u64 rows, u64 cols, const void* logits,
                                    const i64* targets, float* lse, double* row_loss) {
    ce_fwd_body(types, rows, cols, logits, targets, lse, row_loss);
}

// Operands: logits, targets, lse, dloss, dlogits (logits, dloss and dlogits typed).
extern "C" __global__ void ce_bwd_t(u64 types, u64 rows, u64 cols, const void* logits,
                                    const i64* targets, const float* lse, const void* dloss,
                                    void* dlogits) {
    ce_bwd_body(types, rows, cols, logits, targets, lse, dloss, dlogits);
}

// Operands: ids, table, out (table and out typed).
extern "C" __global__ void embedding_fwd_t(u64 types, u64 total, u64 dim, u64 rows,
                                           const i64* ids, const void* table, void* out) {
    embedding_fwd_body(types, total, dim, rows, ids, table, out);
}

// Operands: start, count, order, dy, dtable (dy and dtable typed).
extern "C" __global__ void emb_accum_t(u64 types, u64 rows, u64 dim, const u32* start,
                                       const u32* count, const u32* order, const void* dy,
                                       void* dtable) {
    emb_accum_body(types, rows, dim, start, count, order, dy, dtable);
}

// ---------------------------------------------------------------------------------------------
// Strided views (element strides, row-major enumeration of the view's indices). The struct
// layout is mirrored by `ViewDesc` (#[repr(C)]) in layout.rs.

struct View {
    u64 rank;
    u64 offset;
    u64 shape[MAX_RANK];
    u64 strides[MAX_RANK];
};

__device__ u64 view_offset(const View& v, u64 e) {
    u64 off = v.offset;
    for (u64 k = v.rank; k > 0; --k) {
        u64 d = k - 1;
        u64 s = v.shape[d];
        u64 idx = e % s;
        e = e / s;
        off += idx * v.strides[d];
    }
    return off;
}

extern "C" __global__ void strided_copy_b2(u64 n, View v, const u16* src, u16* dst) {
    GRID_STRIDE(e, n) dst[e] = src[view_offset(v, e)];
}

extern "C" __global__ void strided_copy_b4(u64 n, View v, const u32* src, u32* dst) {
    GRID_STRIDE(e, n) dst[e] = src[view_offset(v, e)];
}

extern "C" __global__ void strided_copy_b8(u64 n, View v, const u64* src, u64* dst) {
    GRID_STRIDE(e, n) dst[e] = src[view_offset(v, e)];
}

// The host only launches this for views whose elements are pairwise distinct, so every
// destination element has one writer.
extern "C" __global__ void strided_add_f32(u64 n, View v, float* dst, const float* src) {
    GRID_STRIDE(e, n) {
        u64 o = view_offset(v, e);
        dst[o] = dst[o] + src[e];
    }
}

// =============================================================================================
// Optimizer, gradient clipping and grad scaler (the seam's SgdStep, AdamWStep, LambDirection,
// LambApply, SumSquares, Unscale; CPU kernels in kernels/cpu/optim.rs, launch side in
// kernels/cuda/optim.rs). Each element is updated by one thread with the CPU kernel's operations
// in the CPU kernel's order (no FMA: --fmad=false), so the elementwise updates are bit-identical
// to the CPU. Every kernel takes all of a tensor's state slots at once: one launch per unit shard.

// A non-finite test that needs no math header: x - x is 0 for finite x, NaN for inf and NaN.
__device__ bool opt_finite_f32(float x) { return x - x == 0.0f; }
__device__ bool opt_finite_f64(double x) { return x - x == 0.0; }

// SGD without momentum: d = g (+ wd*p); p = p + neg_lr*d.
extern "C" __global__ void opt_sgd(u64 n, float neg_lr, float wd, float* p, const float* g) {
    GRID_STRIDE(i, n) {
        float d = g[i];
        if (wd != 0.0f) d = d + wd * p[i];
        p[i] = p[i] + neg_lr * d;
    }
}

// SGD with momentum (flags: bit 0 = first step, bit 1 = Nesterov):
// d = g (+ wd*p); b = first ? d : mu*b + d; d = nesterov ? d + mu*b : b; p = p + neg_lr*d.
extern "C" __global__ void opt_sgd_momentum(u64 n, u64 flags, float neg_lr, float mu, float wd,
                                            float* p, const float* g, float* b) {
    bool first = (flags & 1) != 0, nesterov = (flags & 2) != 0;
    GRID_STRIDE(i, n) {
        float d = g[i];
        if (wd != 0.0f) d = d + wd * p[i];
        float bi = first ? d : mu * b[i] + d;
        b[i] = bi;
        float step = nesterov ? d + mu * bi : bi;
        p[i] = p[i] + neg_lr * step;
    }
}

// AdamW, PyTorch's single-tensor algorithm: p = p*decay; m = m + (1-b1)*(g - m);
// v = b2*v + (1-b2)*(g*g); denom = sqrt(v)/sqrt(bc2) + eps; p = p + neg_step*(m/denom).
extern "C" __global__ void opt_adamw(u64 n, float decay, float omb1, float b2, float omb2,
                                     float neg_step, float bc2_sqrt, float eps, float* p,
                                     const float* g, float* m, float* v) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float decayed = p[i] * decay;
        float mi = m[i] + omb1 * (gi - m[i]);
        float vi = b2 * v[i] + omb2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = decayed + neg_step * (mi / denom);
    }
}

// LAMB phase 1: the moments, then u = (m/bc1) / (sqrt(v/bc2) + eps) + wd*p.
extern "C" __global__ void opt_lamb_dir(u64 n, float omb1, float b2, float omb2, float eps,
                                        float bc1, float bc2, float wd, const float* p,
                                        const float* g, float* m, float* v, float* u) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float mi = m[i] + omb1 * (gi - m[i]);
        float vi = b2 * v[i] + omb2 * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        float m_hat = mi / bc1;
        float v_hat = vi / bc2;
        u[i] = m_hat / (sqrtf(v_hat) + eps) + wd * p[i];
    }
}

// LAMB phase 2: ratio = ||w|| / ||u|| from the squared norms sums[w_sq], sums[u_sq] (in f64; 1 if
// either is 0 or not finite), then p = p + (-(lr*ratio))*u. The ratio never visits the host.
extern "C" __global__ void opt_lamb_apply(u64 n, float lr, u64 w_sq, u64 u_sq, const float* sums,
                                          const float* u, float* p) {
    double w = sqrt((double)sums[w_sq]), un = sqrt((double)sums[u_sq]);
    float ratio = (w > 0.0 && un > 0.0 && opt_finite_f64(w) && opt_finite_f64(un))
                      ? (float)(w / un) : 1.0f;
    float a = -(lr * ratio);
    GRID_STRIDE(i, n) p[i] = p[i] + a * u[i];
}

// Sums of squares, stage 1: block b writes the f64 sum of squares of its grid-strided elements.
extern "C" __global__ void opt_sumsq_partial(u64 n, const float* x, double* partial) {
    __shared__ double sh[BLOCK];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)x[i];
        acc = acc + v * v;
    }
    double s = block_sum(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// Stage 2 (one block): acc[0] += the sum of partial[0..count] (f64, fixed tree). Pieces are added
// in launch order on one stream: no atomics.
extern "C" __global__ void opt_sumsq_accum(u64 count, const double* partial, double* acc) {
    __shared__ double sh[BLOCK];
    double s = 0.0;
    for (u64 i = threadIdx.x; i < count; i += BLOCK) s = s + partial[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) acc[0] = acc[0] + s;
}

// Stage 3: out[i] = acc[i] rounded to f32.
extern "C" __global__ void opt_sumsq_final(u64 n, const double* acc, float* out) {
    GRID_STRIDE(i, n) out[i] = (float)acc[i];
}

// Grad-scaler unscale: g = g*inv; flag[0] = 1 if any element was inf or NaN. Every writer stores
// the same value 1.0f, so the result does not depend on the order (no atomics).
extern "C" __global__ void opt_unscale(u64 n, float inv, float* g, float* flag) {
    GRID_STRIDE(i, n) {
        float x = g[i];
        if (!opt_finite_f32(x)) flag[0] = 1.0f;
        g[i] = x * inv;
    }
}
