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
