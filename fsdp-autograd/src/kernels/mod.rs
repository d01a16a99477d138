//! Pure CPU kernels on slices (`kernels::cpu`): matmul through `gemm`, activations, norms,
//! attention, losses and casts. Owned by the kernels helper; filled in separately.
