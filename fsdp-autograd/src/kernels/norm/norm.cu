// Row normalizations: softmax and layer norm (one block per row for the row statistics and dx;
// the layer-norm parameter gradients are column reductions in row order, as on the CPU: see
// common.cu's col_reduce), f32 and typed (kernels/norm/*.rs declare and launch them).

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

// ---------------------------------------------------------------------------------------------
// Layer norm.

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

// ---------------------------------------------------------------------------------------------
// RMS norm (Llama): y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + eps) per row, computed in
// f32 with the row sums in f64 over block_sum's fixed tree (the CPU kernel, kernels/norm/
// rms_norm.rs, adds in the same lane-then-tree order, so the bits match), each output rounded
// once. One block per row; dgamma is a column reduction in row order (col_reduce), as on the CPU.
// Typed only: all-f32 operands have the code word 0.

// Operand codes in `types`: x 0, gamma 1, y 2 (rstd, 3, is f32).
extern "C" __global__ void rms_norm_fwd(u64 types, u64 rows, u64 cols, float eps, const void* x,
                                        const void* gamma, void* y, float* rstd) {
    __shared__ double shd[BLOCK];
    const unsigned tx = ty_of(types, 0), tg = ty_of(types, 1), ty = ty_of(types, 2);
    ROW_LOOP(r, rows) {
        const u64 o = r * cols;
        double acc = 0.0;
        COL_LOOP(j, cols) {
            double v = (double)ld_t(x, o + j, tx);
            acc = acc + v * v;
        }
        double ss = block_sum(acc, shd);
        float rs = (float)(1.0 / sqrt(ss / (double)cols + (double)eps));
        if (threadIdx.x == 0) rstd[r] = rs;
        COL_LOOP(j, cols) st_t(y, o + j, ty, ld_t(x, o + j, tx) * rs * ld_t(gamma, j, tg));
    }
}

// dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * gamma.
// Operand codes in `types`: x 0, gamma 1, dy 3, dx 4 (rstd, 2, is f32).
extern "C" __global__ void rms_norm_bwd_dx(u64 types, u64 rows, u64 cols, const void* x,
                                           const void* gamma, const float* rstd, const void* dy,
                                           void* dx) {
    __shared__ double shd[BLOCK];
    const unsigned tx = ty_of(types, 0), tg = ty_of(types, 1), tdy = ty_of(types, 3),
                   tdx = ty_of(types, 4);
    ROW_LOOP(r, rows) {
        const u64 o = r * cols;
        const float rs = rstd[r];
        double acc = 0.0;
        COL_LOOP(j, cols) {
            float g = ld_t(dy, o + j, tdy) * ld_t(gamma, j, tg);
            acc = acc + (double)g * (double)ld_t(x, o + j, tx);
        }
        float k = (float)(block_sum(acc, shd) / (double)cols) * rs * rs;
        COL_LOOP(j, cols) {
            float g = ld_t(dy, o + j, tdy) * ld_t(gamma, j, tg);
            st_t(dx, o + j, tdx, rs * (g - ld_t(x, o + j, tx) * k));
        }
    }
}

// What rms_norm_bwd_dgamma adds: dy * (x * rstd[r]).
struct RmsGammaSrc {
    const void* x;
    const float* rstd;
    const void* dy;
    u64 cols;
    unsigned tx, tdy;
    __device__ void load(u64 r, u64 j, float* v) const {
        v[0] = ld_t(dy, r * cols + j, tdy) * (ld_t(x, r * cols + j, tx) * rstd[r]);
    }
};

// dgamma[j] = sum_r dy * (x * rstd), rows in order (see col_reduce).
// Operand codes in `types`: x 0, dy 2, dgamma 3 (rstd, 1, is f32).
extern "C" __global__ void rms_norm_bwd_dgamma(u64 types, u64 rows, u64 cols, const void* x,
                                               const float* rstd, const void* dy, void* dgamma) {
    col_reduce<1>(rows, cols, RmsGammaSrc{x, rstd, dy, cols, ty_of(types, 0), ty_of(types, 2)},
                  dgamma, dgamma, ty_of(types, 3), TY_F32);
}
