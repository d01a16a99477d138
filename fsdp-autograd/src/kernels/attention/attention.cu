// The unfused causal attention's row kernels: the masked softmax of the scores and its
// backward (kernels/attention/unfused.rs launches them between cuBLAS products).

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
