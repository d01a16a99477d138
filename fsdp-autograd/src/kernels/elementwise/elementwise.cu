// Elementwise kernels: add, mul, scale, axpy, row bias, GELU and the casts, f32 and typed
// (kernels/elementwise/*.rs declare and launch them).

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
// Typed (see common.cu).

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

// ---------------------------------------------------------------------------------------------
// SiLU·mul, the SwiGLU gate (kernels/elementwise/silu_mul.rs): y = silu(gate) * up with
// silu(g) = g / (1 + exp(-g)); the backward from the forward inputs, sig = 1 / (1 + exp(-g)):
// dgate = dy * up * (sig * (1 + g * (1 - sig))), dup = dy * silu(g). The CPU kernel's expressions
// in its order. Typed only: all-f32 operands have the code word 0.

__device__ float silu_value(float g) { return g / (1.0f + expf(-g)); }

// Operand codes in `types`: gate 0, up 1, y 2.
extern "C" __global__ void silu_mul_fwd_t(u64 types, u64 n, const void* gate, const void* up,
                                          void* y) {
    const unsigned tg = ty_of(types, 0), tu = ty_of(types, 1), ty = ty_of(types, 2);
    GRID_STRIDE(i, n) st_t(y, i, ty, silu_value(ld_t(gate, i, tg)) * ld_t(up, i, tu));
}

// Operand codes in `types`: gate 0, up 1, dy 2, dgate 3, dup 4.
extern "C" __global__ void silu_mul_bwd_t(u64 types, u64 n, const void* gate, const void* up,
                                          const void* dy, void* dgate, void* dup) {
    const unsigned tg = ty_of(types, 0), tu = ty_of(types, 1), td = ty_of(types, 2),
                   tdg = ty_of(types, 3), tdu = ty_of(types, 4);
    GRID_STRIDE(i, n) {
        float g = ld_t(gate, i, tg), u = ld_t(up, i, tu), d = ld_t(dy, i, td);
        float e = expf(-g);
        float sig = 1.0f / (1.0f + e);
        st_t(dgate, i, tdg, d * u * (sig * (1.0f + g * (1.0f - sig))));
        st_t(dup, i, tdu, d * (g / (1.0f + e)));
    }
}
