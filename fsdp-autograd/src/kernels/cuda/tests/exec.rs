//! The backend-neutral test interface: buffers by handle, ops as data, and two executors —
//! [`super::gpu::GpuExec`] (the public [`CudaKernels`](crate::kernels::cuda::CudaKernels) API on
//! a real GPU) and [`super::emu::EmuExec`] (the same launch plans run by the host emulator).

use fsdp_alloc::DType;

use crate::kernels::attention::Attention;
use crate::kernels::cuda::CudaKernelError;

/// A buffer handle of an executor.
pub(super) type H = usize;

/// The four casts.
#[derive(Debug, Clone, Copy)]
pub(super) enum CastKind {
    F32ToF16,
    F16ToF32,
    F32ToBf16,
    Bf16ToF32,
}

/// One call of the CUDA kernel API, with buffers as handles.
#[derive(Debug, Clone)]
pub(super) enum Op {
    Add {
        a: H,
        b: H,
        out: H,
    },
    Mul {
        a: H,
        b: H,
        out: H,
    },
    Scale {
        x: H,
        alpha: f32,
        out: H,
    },
    ScaleInplace {
        y: H,
        alpha: f32,
    },
    AddScaled {
        y: H,
        alpha: f32,
        x: H,
    },
    AddRowBias {
        x: H,
        bias: H,
        out: H,
    },
    AddRowBiasInplace {
        y: H,
        bias: H,
    },
    ColSums {
        x: H,
        out: H,
    },
    Sum {
        x: H,
        out: H,
    },
    Mean {
        x: H,
        out: H,
    },
    Gelu {
        kind: crate::kernels::Gelu,
        x: H,
        y: H,
    },
    GeluBackward {
        kind: crate::kernels::Gelu,
        x: H,
        dy: H,
        dx: H,
    },
    Softmax {
        x: H,
        y: H,
        cols: usize,
    },
    SoftmaxBackward {
        y: H,
        dy: H,
        dx: H,
        cols: usize,
    },
    LayerNorm {
        x: H,
        gamma: H,
        beta: H,
        y: H,
        mean: H,
        rstd: H,
        cols: usize,
        eps: f32,
    },
    LayerNormBackward {
        x: H,
        gamma: H,
        mean: H,
        rstd: H,
        dy: H,
        dx: H,
        dgamma: H,
        dbeta: H,
        cols: usize,
    },
    Embedding {
        ids: H,
        table: H,
        out: H,
        dim: usize,
    },
    EmbeddingBackward {
        ids: H,
        dy: H,
        dtable: H,
        dim: usize,
    },
    CrossEntropy {
        logits: H,
        targets: H,
        cols: usize,
        lse: H,
        loss: H,
    },
    CrossEntropyBackward {
        logits: H,
        targets: H,
        lse: H,
        dloss: H,
        dlogits: H,
        cols: usize,
    },
    /// The unfused kernels (`a` multi-head, head-split).
    Attention {
        q: H,
        k: H,
        v: H,
        out: H,
        probs: H,
        a: Attention,
    },
    AttentionBackward {
        q: H,
        k: H,
        v: H,
        probs: H,
        dout: H,
        dq: H,
        dk: H,
        dv: H,
        a: Attention,
    },
    Bmm {
        a: H,
        b: H,
        c: H,
        batch: usize,
        m: usize,
        k: usize,
        n: usize,
        ta: bool,
        tb: bool,
        acc: bool,
    },
    GemmEx {
        a: H,
        b: H,
        c: H,
        g: crate::kernels::gemm::Gemm,
        p: crate::kernels::gemm::GemmPrecision,
    },
    /// The fused kernels for shape `a`; `a.layout` [`AttentionLayout::Packed`]
    /// (crate::kernels::attention::AttentionLayout::Packed): q = k = v the whole
    /// `[batch, t, heads + 2·kv_heads, d]` qkv, out / dout `[batch, t, heads, d]`, dq = dk = dv.
    Flash {
        dtype: DType,
        q: H,
        k: H,
        v: H,
        out: H,
        lse: H,
        a: Attention,
    },
    /// The tensor-core forward (`attention/flash_mma.cu`; bf16 / f16, d 64 or 128), operands
    /// as [`Op::Flash`]. On a GPU it fails unless the device has compute capability 8.0+.
    FlashMma {
        dtype: DType,
        q: H,
        k: H,
        v: H,
        out: H,
        lse: H,
        a: Attention,
    },
    FlashBackward {
        dtype: DType,
        q: H,
        k: H,
        v: H,
        out: H,
        lse: H,
        dout: H,
        dq: H,
        dk: H,
        dv: H,
        a: Attention,
    },
    Cast {
        kind: CastKind,
        src: H,
        dst: H,
    },
    StridedCopy {
        src: H,
        offset: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
        dst: H,
        dtype: DType,
    },
    StridedAdd {
        dst: H,
        offset: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
        src: H,
    },
    Zero {
        buf: H,
    },
    Copy {
        src: H,
        dst: H,
    },
    // Optimizer, clipping, grad scaler.
    SgdStep {
        rule: crate::kernels::optim::SgdRule,
        first: bool,
        p: H,
        g: H,
        buf: Option<H>,
    },
    AdamWStep {
        c: crate::kernels::optim::AdamCoeffs,
        p: H,
        g: H,
        m: H,
        v: H,
    },
    LambDirection {
        c: crate::kernels::optim::LambCoeffs,
        p: H,
        g: H,
        m: H,
        v: H,
        u: H,
    },
    LambApply {
        lr: f32,
        w_sq: usize,
        u_sq: usize,
        sums: H,
        u: H,
        p: H,
    },
    SumSquares {
        xs: Vec<H>,
        pieces: Vec<crate::kernels::optim::SqPiece>,
        out: H,
    },
    Unscale {
        inv: f32,
        g: H,
        flag: H,
    },
    /// A typed kernel (`kernels/cuda/typed.rs`).
    Typed(TypedOp),
}

/// A buffer with the float dtype it holds (f32, f16 or bf16).
pub(super) type TH = (H, DType);

/// Calls of the typed kernels: float operands of any of f32, f16, bf16.
#[derive(Debug, Clone)]
pub(super) enum TypedOp {
    Add {
        a: TH,
        b: TH,
        out: TH,
    },
    Mul {
        a: TH,
        b: TH,
        out: TH,
    },
    Scale {
        x: TH,
        alpha: f32,
        out: TH,
    },
    ScaleInplace {
        y: TH,
        alpha: f32,
    },
    Sum {
        x: TH,
        out: TH,
        mean: bool,
    },
    AddScaled {
        y: TH,
        alpha: f32,
        x: TH,
    },
    AddRowBias {
        x: TH,
        bias: TH,
        out: TH,
    },
    AddRowBiasInplace {
        y: TH,
        bias: TH,
    },
    ColSums {
        x: TH,
        out: TH,
    },
    Gelu {
        kind: crate::kernels::Gelu,
        x: TH,
        y: TH,
    },
    GeluBackward {
        kind: crate::kernels::Gelu,
        x: TH,
        dy: TH,
        dx: TH,
    },
    LayerNorm {
        x: TH,
        gamma: TH,
        beta: TH,
        y: TH,
        mean: H,
        rstd: H,
        cols: usize,
        eps: f32,
    },
    LayerNormBackward {
        x: TH,
        gamma: TH,
        mean: H,
        rstd: H,
        dy: TH,
        dx: TH,
        dgamma: TH,
        dbeta: TH,
        cols: usize,
    },
    RmsNorm {
        x: TH,
        gamma: TH,
        y: TH,
        rstd: H,
        cols: usize,
        eps: f32,
    },
    Dropout {
        x: TH,
        y: TH,
        cols: usize,
        mask: crate::kernels::dropout::DropoutMask,
    },
    RmsNormBackward {
        x: TH,
        gamma: TH,
        rstd: H,
        dy: TH,
        dx: TH,
        dgamma: TH,
        cols: usize,
    },
    SiluMul {
        gate: TH,
        up: TH,
        y: TH,
    },
    SiluMulBackward {
        gate: TH,
        up: TH,
        dy: TH,
        dgate: TH,
        dup: TH,
    },
    /// RoPE (`backward: false`, input `[b, t, h, d]`) or its backward (input `[b, h, t, d]`).
    Rope {
        backward: bool,
        input: TH,
        cos: H,
        sin: H,
        output: TH,
        s: crate::kernels::rope::RopeShape,
    },
    Embedding {
        ids: H,
        table: TH,
        out: TH,
        dim: usize,
    },
    EmbeddingBackward {
        ids: H,
        dy: TH,
        dtable: TH,
        dim: usize,
    },
    CrossEntropy {
        logits: TH,
        targets: H,
        cols: usize,
        lse: H,
        loss: TH,
    },
    CrossEntropyBackward {
        logits: TH,
        targets: H,
        lse: H,
        dloss: TH,
        dlogits: TH,
        cols: usize,
    },
}

/// An executor of [`Op`]s on its own buffers.
pub(super) trait Exec {
    /// A new buffer of `bytes` whose contents are unspecified.
    fn alloc(&mut self, bytes: usize) -> H;
    /// A new buffer holding `bytes`.
    fn upload(&mut self, bytes: &[u8]) -> H;
    /// The current contents of `h` (waits for all enqueued work).
    fn download(&mut self, h: H) -> Vec<u8>;
    /// Runs `op`, waiting on its index check if it has one.
    fn run(&mut self, op: &Op) -> Result<(), CudaKernelError>;
}

/// Uploads f32 data.
pub(super) fn up_f32(e: &mut dyn Exec, v: &[f32]) -> H {
    e.upload(bytemuck::cast_slice(v))
}

/// Uploads i64 data.
pub(super) fn up_i64(e: &mut dyn Exec, v: &[i64]) -> H {
    e.upload(bytemuck::cast_slice(v))
}

/// Uploads u16 data (f16/bf16 bits).
pub(super) fn up_u16(e: &mut dyn Exec, v: &[u16]) -> H {
    e.upload(bytemuck::cast_slice(v))
}

/// Uploads u64 data.
pub(super) fn up_u64(e: &mut dyn Exec, v: &[u64]) -> H {
    e.upload(bytemuck::cast_slice(v))
}

/// An f32 output buffer pre-filled with NaN, so unwritten elements show.
pub(super) fn nan_f32(e: &mut dyn Exec, n: usize) -> H {
    up_f32(e, &vec![f32::NAN; n])
}

/// Reinterprets bytes as a vector of `T` (copying, so alignment does not matter).
fn from_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

/// Downloads f32 data.
pub(super) fn down_f32(e: &mut dyn Exec, h: H) -> Vec<f32> {
    from_bytes(&e.download(h))
}

/// Downloads u16 data.
pub(super) fn down_u16(e: &mut dyn Exec, h: H) -> Vec<u16> {
    from_bytes(&e.download(h))
}

/// Downloads u64 data.
pub(super) fn down_u64(e: &mut dyn Exec, h: H) -> Vec<u64> {
    from_bytes(&e.download(h))
}

/// Runs `op` and panics with the executor's error if it fails.
pub(super) fn run(e: &mut dyn Exec, op: Op) {
    if let Err(err) = e.run(&op) {
        panic!("{op:?} failed: {err}");
    }
}
