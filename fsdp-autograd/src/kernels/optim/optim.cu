// Optimizer, gradient clipping and grad scaler: the kernels of the ops SgdStep, AdamWStep,
// LambDirection, LambApply, SumSquares and Unscale (kernels/optim/*.rs: each op's file holds its
// host-slice kernel, its kernel declarations and its launch plan). Each element is updated by one thread with the CPU kernel's operations
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
