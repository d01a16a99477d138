// Reductions: column sums in row order (through common.cu's col_reduce) and the f64 sum/mean,
// f32 and typed (kernels/reduce/*.rs declare and launch them).

// What col_sums adds: x[r, j] (element code tx).
struct ColSumSrc {
    const void* x;
    u64 cols;
    unsigned tx;
    __device__ void load(u64 r, u64 j, float* v) const { v[0] = ld_t(x, r * cols + j, tx); }
};

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

extern "C" __global__ void col_sums_t(u64 types, u64 rows, u64 cols, const void* x, void* out) {
    col_reduce<1>(rows, cols, ColSumSrc{x, cols, ty_of(types, 0)}, out, out, ty_of(types, 1),
                  TY_F32);
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
