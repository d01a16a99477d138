//! [`CudaBackend`]: the seam's CUDA implementation over [`kernels::cuda`](super)'s
//! `CudaKernels` (feature `cuda`). Without the feature the type exists with the same
//! constructor, which returns [`AutogradError::CudaNotBuilt`].
//!
//! The kernels it calls run on the host emulator in CI and this glue is compile-checked there;
//! `cargo xtask gpu-test` runs it on a real GPU (it has run on one H100: the ops, fsdp and
//! kernel-time suites and GPT-2 training go through it).

#[cfg(not(feature = "cuda"))]
mod imp {
    use std::sync::Arc;

    use fsdp_alloc::Device;

    use crate::error::{AutogradError, Result};
    use crate::kernels::backend::Backend;

    /// The CUDA kernels behind the seam. This build has no CUDA support: no value of this type
    /// can be created, and [`CudaBackend::for_device`] says so.
    #[derive(Debug)]
    pub struct CudaBackend {
        _never: std::convert::Infallible,
    }

    impl CudaBackend {
        /// The backend of a CUDA device.
        ///
        /// # Errors
        /// Always [`AutogradError::CudaNotBuilt`] in this build (the `cuda` feature is off).
        pub fn for_device(device: &Device) -> Result<Arc<dyn Backend>> {
            Err(AutogradError::CudaNotBuilt {
                op: "kernels",
                device: device.id().to_string(),
            })
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use fsdp_alloc::{Buffer, BufferRef, DType, Device, DeviceId, Stream};

    use crate::error::{AutogradError, Result};
    use crate::kernels::backend::{
        Attention, AttentionLayout, AttentionSave, AttentionSaved, AttentionStats, Backend,
        BinaryOp, Launch, Operand, ReadFn, View,
    };
    use crate::kernels::cuda::typed::{type_code, TBuf};
    use crate::kernels::cuda::{CudaKernelError, CudaKernels, GemmPrecision, IndexCheck};

    /// The CUDA kernels behind the seam: one per CUDA device, created on first use (compiling
    /// the kernels with NVRTC once per process). Float operands in `f16`/`bf16` are cast to `f32`
    /// temporaries on the stream, computed, and cast back, as the CPU backend does on the host,
    /// except where a kernel takes them directly: matrix products with A and B of one half type
    /// (cuBLAS Ex on the tensor cores, f32 accumulation), the fused attention with one dtype
    /// throughout, and the typed kernels (any mix of f32/f16/bf16 operands, same bits as the
    /// cast-around path) for add, mul, scale, axpy, row-bias add, sum and mean, column sums,
    /// GELU and its backward, layer norm and its backward, cross-entropy and embedding and their
    /// backwards. f32 products use TF32 when [`set_allow_tf32`](crate::kernels::cuda::set_allow_tf32) is on;
    /// attention is fused ([`Backend::attention_save`] says `Lse`) unless
    /// [`set_fused_attention`](crate::kernels::cuda::set_fused_attention) is off or `d` is above
    /// [`FUSED_ATTENTION_MAX_D`](crate::kernels::cuda::FUSED_ATTENTION_MAX_D).
    ///
    /// Deferred index checks (embedding ids, cross-entropy targets) are collected and reported
    /// by the next [`Backend::read`] (the next synchronization), like the CPU's stream failure.
    #[derive(Debug)]
    pub struct CudaBackend {
        k: CudaKernels,
        pending: Mutex<Vec<IndexCheck>>,
    }

    fn err(op: &'static str) -> impl Fn(CudaKernelError) -> AutogradError {
        move |e| AutogradError::Backend {
            backend: "cuda",
            op,
            detail: e.to_string(),
        }
    }

    fn unsupported(op: &'static str, detail: &str) -> AutogradError {
        AutogradError::Unsupported {
            op,
            detail: format!("on a CUDA device: {detail}"),
        }
    }

    impl CudaBackend {
        /// The backend of a CUDA device (cached per device).
        ///
        /// # Errors
        /// [`AutogradError::Backend`] if the kernels cannot be compiled or loaded (NVRTC, cuBLAS
        /// or the driver missing or failing).
        pub fn for_device(device: &Device) -> Result<Arc<dyn Backend>> {
            static CACHE: OnceLock<Mutex<HashMap<DeviceId, Arc<CudaBackend>>>> = OnceLock::new();
            let mut cache = CACHE
                .get_or_init(Default::default)
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(b) = cache.get(&device.id()) {
                return Ok(Arc::clone(b) as Arc<dyn Backend>);
            }
            let k = CudaKernels::new(device).map_err(err("kernels"))?;
            let b = Arc::new(CudaBackend {
                k,
                pending: Mutex::new(Vec::new()),
            });
            cache.insert(device.id(), Arc::clone(&b));
            Ok(b)
        }

        fn defer(&self, check: IndexCheck) {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(check);
        }

        /// The deferred index checks launched so far (to drain after a readback).
        fn take_checks(&self) -> Vec<IndexCheck> {
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()))
        }

        /// Reports the first failed index check of `checks`; those of `synced` (a stream the
        /// caller synchronized after they were launched) cost no further host wait, the others
        /// synchronize their streams.
        fn drain_checks(&self, checks: Vec<IndexCheck>, synced: &Stream) -> Result<()> {
            let mut first = Ok(());
            for c in checks {
                let op = c.op();
                if let Err(e) = c.wait_after(Some(synced)) {
                    if first.is_ok() {
                        first = Err(err(op)(e));
                    }
                }
            }
            first
        }

        /// [`Launch::Fill`]: zeros by a memset, else one element converted on the host and
        /// broadcast by a stride-0 copy.
        fn fill(&self, s: &Stream, n: usize, value: f64, out: &Operand) -> Result<()> {
            if value == 0.0 && value.is_sign_positive() {
                return self.k.zero(s, &out.buf).map_err(err("fill"));
            }
            let one = crate::tensor::host_scalar_bytes(out.dtype, value);
            if out.dtype.size() == 1 {
                let bytes = vec![one[0]; n];
                return self
                    .k
                    .upload_async(s, &bytes, &out.buf)
                    .map_err(err("fill"));
            }
            let tmp = self.k.device().alloc(one.len(), s)?;
            self.k
                .upload_async(s, &one, tmp.data())
                .map_err(err("fill"))?;
            self.k
                .strided_copy(s, tmp.data(), 0, &[n], &[0], &out.buf, out.dtype)
                .map_err(err("fill"))
        }

        /// [`Launch::Copy`] into a contiguous destination view (the only kind with a kernel).
        fn copy(
            &self,
            s: &Stream,
            src_view: &View,
            src: &Operand,
            dst_view: &View,
            dst: &Operand,
        ) -> Result<()> {
            if !dst_view.is_contiguous() {
                return Err(unsupported(
                    "copy",
                    "a copy into a non-contiguous destination view (the backward of `split` or \
                     `narrow` along an inner dimension) has no CUDA kernel; split along the first \
                     dimension",
                ));
            }
            if src.dtype.size() == 1 {
                return Err(unsupported("copy", "strided copies of 1-byte elements"));
            }
            let d = elems(dst, dst_view.offset, dst_view.numel())?;
            let v = src_view;
            self.k
                .strided_copy(s, &src.buf, v.offset, &v.shape, &v.strides, &d, src.dtype)
                .map_err(err("copy"))
        }

        /// The optimizer launches (f32 operands, checked by the seam's front): one fused
        /// kernel per launch, see `kernels/cuda/optim.rs`.
        fn optim(&self, s: &Stream, l: &Launch<'_>) -> Result<()> {
            let k = &self.k;
            let op = l.name();
            match *l {
                Launch::SgdStep {
                    rule,
                    first,
                    p,
                    g,
                    buf,
                    ..
                } => k.sgd_step(s, &rule, first, &p.buf, &g.buf, buf.map(|b| &b.buf)),
                Launch::AdamWStep { c, p, g, m, v, .. } => {
                    k.adamw_step(s, &c, &p.buf, &g.buf, &m.buf, &v.buf)
                }
                Launch::LambDirection {
                    c, p, g, m, v, u, ..
                } => k.lamb_direction(s, &c, &p.buf, &g.buf, &m.buf, &v.buf, &u.buf),
                Launch::LambApply {
                    lr,
                    w_sq,
                    u_sq,
                    sums,
                    u,
                    p,
                    ..
                } => k.lamb_apply(s, lr, w_sq, u_sq, &sums.buf, &u.buf, &p.buf),
                Launch::SumSquares { xs, pieces, out } => {
                    let bufs: Vec<BufferRef> = xs.iter().map(|x| x.buf.clone()).collect();
                    k.sum_squares(s, &bufs, pieces, &out.buf)
                }
                Launch::Unscale {
                    inv, g, found_inf, ..
                } => k.unscale(s, inv, &g.buf, &found_inf.buf),
                _ => unreachable!("optim is called for the optimizer launches only"),
            }
            .map_err(err(op))
        }

        fn scope<'a>(&'a self, op: &'static str, s: &'a Stream) -> F32Scope<'a> {
            F32Scope {
                b: self,
                op,
                s,
                temps: Vec::new(),
                writeback: Vec::new(),
            }
        }
    }

    /// Float operands as `f32` device memory: `f32` operands as they are, half operands through
    /// temporaries (cast in for inputs and loaded outputs, cast back out by [`F32Scope::finish`]).
    /// Temporaries return to the allocator when the scope drops, in stream order.
    struct F32Scope<'a> {
        b: &'a CudaBackend,
        op: &'static str,
        s: &'a Stream,
        temps: Vec<Buffer>,
        writeback: Vec<(BufferRef, Operand)>,
    }

    impl F32Scope<'_> {
        fn temp(&mut self, n: usize) -> Result<BufferRef> {
            let buf = self.b.k.device().alloc(n * 4, self.s)?;
            let r = buf.data().clone();
            self.temps.push(buf);
            Ok(r)
        }

        fn to_f32(&self, src: &Operand, dst: &BufferRef) -> Result<()> {
            let k = &self.b.k;
            match src.dtype {
                DType::F16 => k.cast_f16_to_f32(self.s, &src.buf, dst),
                DType::BF16 => k.cast_bf16_to_f32(self.s, &src.buf, dst),
                _ => k.copy(self.s, &src.buf, dst),
            }
            .map_err(err(self.op))
        }

        fn input(&mut self, o: &Operand) -> Result<BufferRef> {
            if o.dtype != DType::F16 && o.dtype != DType::BF16 {
                return Ok(o.buf.clone());
            }
            let t = self.temp(o.numel())?;
            self.to_f32(o, &t)?;
            Ok(t)
        }

        /// [`F32Scope::input`] of each operand.
        fn inputs<const N: usize>(&mut self, os: [&Operand; N]) -> Result<[BufferRef; N]> {
            let mut bufs = Vec::with_capacity(N);
            for o in os {
                bufs.push(self.input(o)?);
            }
            Ok(std::array::from_fn(|i| bufs[i].clone()))
        }

        /// [`F32Scope::output`] of each operand, none loaded.
        fn outputs<const N: usize>(&mut self, os: [&Operand; N]) -> Result<[BufferRef; N]> {
            let mut bufs = Vec::with_capacity(N);
            for o in os {
                bufs.push(self.output(o, false)?);
            }
            Ok(std::array::from_fn(|i| bufs[i].clone()))
        }

        fn output(&mut self, o: &Operand, load: bool) -> Result<BufferRef> {
            if o.dtype != DType::F16 && o.dtype != DType::BF16 {
                return Ok(o.buf.clone());
            }
            let t = self.temp(o.numel())?;
            if load {
                self.to_f32(o, &t)?;
            }
            self.writeback.push((t.clone(), o.clone()));
            Ok(t)
        }

        fn finish(self) -> Result<()> {
            let k = &self.b.k;
            for (t, o) in &self.writeback {
                match o.dtype {
                    DType::F16 => k.cast_f32_to_f16(self.s, t, &o.buf),
                    _ => k.cast_f32_to_bf16(self.s, t, &o.buf),
                }
                .map_err(err(self.op))?;
            }
            Ok(())
        }
    }

    /// The common float dtype of `ops` (the fused attention kernels take one element type), or
    /// `None` if they differ.
    fn one_dtype(ops: &[&Operand]) -> Option<DType> {
        let d = ops.first()?.dtype;
        ops.iter().all(|o| o.dtype == d).then_some(d)
    }

    /// The cuBLAS call that takes a product's operands as they are: all f32, or A and B of one
    /// half type with C of that type or f32. Mixed operand types return `None` (they go through
    /// f32 temporaries).
    fn direct_gemm(a: DType, b: DType, c: DType, tf32: bool) -> Option<GemmPrecision> {
        let half = |d: DType| d == DType::F16 || d == DType::BF16;
        let ok = match (a, c) {
            (DType::F32, DType::F32) => b == DType::F32,
            (x, y) if half(x) => b == x && (y == x || y == DType::F32),
            _ => false,
        };
        ok.then_some(GemmPrecision {
            inputs: a,
            output: c,
            tf32,
        })
    }

    /// Whether a launch's float operands go to the typed kernels (`kernels/cuda/typed.rs`): some
    /// operand is f16 or bf16 and every one is f32, f16 or bf16. The typed kernels read and write
    /// the half operands directly, bit for bit what the f32 temporaries of [`F32Scope`] give.
    fn typed(ops: &[&Operand]) -> bool {
        let half = |d: DType| d == DType::F16 || d == DType::BF16;
        ops.iter().any(|o| half(o.dtype)) && ops.iter().all(|o| type_code(o.dtype).is_some())
    }

    /// An operand as a typed-kernel argument.
    fn tb(o: &Operand) -> TBuf<'_> {
        (&o.buf, o.dtype)
    }

    /// Byte range of `count` elements of `o` from element `first`.
    fn elems(o: &Operand, first: usize, count: usize) -> Result<BufferRef> {
        let sz = o.dtype.size();
        Ok(o.buf.slice(first * sz, count * sz)?)
    }

    impl Backend for CudaBackend {
        fn name(&self) -> &'static str {
            "cuda"
        }

        fn launch(&self, s: &Stream, l: &Launch<'_>) -> Result<()> {
            match *l {
                Launch::Gemm { g, a, b, c } => {
                    let tf32 = crate::kernels::cuda::allow_tf32();
                    if let Some(p) = direct_gemm(a.dtype, b.dtype, c.dtype, tf32) {
                        // f32 (maybe TF32), or f16/bf16 on the tensor cores with f32
                        // accumulation, reading and writing the operands as they are.
                        let (a, b, c) = (&a.buf, &b.buf, &c.buf);
                        return self.k.gemm_ex(s, &g, p, a, b, c).map_err(err("matmul"));
                    }
                    let mut f = self.scope("matmul", s);
                    let (a, b, c) = (f.input(a)?, f.input(b)?, f.output(c, g.accumulate)?);
                    let p = GemmPrecision {
                        tf32,
                        ..GemmPrecision::F32
                    };
                    self.k
                        .gemm_ex(s, &g, p, &a, &b, &c)
                        .map_err(err("matmul"))?;
                    f.finish()
                }
                Launch::Binary {
                    op,
                    rows,
                    a,
                    b,
                    out,
                } => {
                    let name = l.name();
                    let full = b.numel() == a.numel();
                    if typed(&[a, b, out]) {
                        let (x, y, o) = (tb(a), tb(b), tb(out));
                        let e = err(name);
                        return match (op, full) {
                            (BinaryOp::Add, true) => self.k.add_t(s, x, y, o).map_err(e),
                            (BinaryOp::Mul, true) => self.k.mul_t(s, x, y, o).map_err(e),
                            (BinaryOp::Add, false) => self.k.add_row_bias_t(s, x, y, o).map_err(e),
                            (BinaryOp::Mul, false) => {
                                // One launch per row, as for f32.
                                let (xs, os) =
                                    (rows.cols * a.dtype.size(), rows.cols * out.dtype.size());
                                for r in 0..rows.rows {
                                    let xr = a.buf.slice(r * xs, xs)?;
                                    let or = out.buf.slice(r * os, os)?;
                                    let (xr, or) = ((&xr, a.dtype), (&or, out.dtype));
                                    self.k.mul_t(s, xr, y, or).map_err(err(name))?;
                                }
                                Ok(())
                            }
                        };
                    }
                    let mut f = self.scope(name, s);
                    let (x, y, o) = (f.input(a)?, f.input(b)?, f.output(out, false)?);
                    let e = err(name);
                    match (op, full) {
                        (BinaryOp::Add, true) => self.k.add(s, &x, &y, &o).map_err(e)?,
                        (BinaryOp::Mul, true) => self.k.mul(s, &x, &y, &o).map_err(e)?,
                        (BinaryOp::Add, false) => self.k.add_row_bias(s, &x, &y, &o).map_err(e)?,
                        (BinaryOp::Mul, false) => {
                            // No row-broadcast product kernel: one launch per row.
                            let bytes = rows.cols * 4;
                            for r in 0..rows.rows {
                                let xr = x.slice(r * bytes, bytes)?;
                                let or = o.slice(r * bytes, bytes)?;
                                self.k.mul(s, &xr, &y, &or).map_err(err(name))?;
                            }
                        }
                    }
                    f.finish()
                }
                Launch::Scale { alpha, x, out, .. } => {
                    if typed(&[x, out]) {
                        return self
                            .k
                            .scale_t(s, tb(x), alpha, tb(out))
                            .map_err(err("scale"));
                    }
                    let mut f = self.scope("scale", s);
                    let (x, o) = (f.input(x)?, f.output(out, false)?);
                    self.k.scale(s, &x, alpha, &o).map_err(err("scale"))?;
                    f.finish()
                }
                Launch::ScaleInplace { alpha, y, .. } => {
                    if typed(&[y]) {
                        return self
                            .k
                            .scale_inplace_t(s, tb(y), alpha)
                            .map_err(err("scale_"));
                    }
                    let mut f = self.scope("scale_", s);
                    let y = f.output(y, true)?;
                    self.k.scale_inplace(s, &y, alpha).map_err(err("scale_"))?;
                    f.finish()
                }
                Launch::AxpyRows { rows, alpha, x, y } => {
                    if typed(&[x, y]) {
                        let e = err("axpy");
                        if rows.rows == 1 {
                            return self.k.add_scaled_t(s, tb(y), alpha, tb(x)).map_err(e);
                        }
                        if alpha == 1.0 {
                            return self.k.add_row_bias_inplace_t(s, tb(y), tb(x)).map_err(e);
                        }
                        // One launch per row, as for f32.
                        let bytes = rows.cols * y.dtype.size();
                        for r in 0..rows.rows {
                            let yr = y.buf.slice(r * bytes, bytes)?;
                            let yr = (&yr, y.dtype);
                            self.k
                                .add_scaled_t(s, yr, alpha, tb(x))
                                .map_err(err("axpy"))?;
                        }
                        return Ok(());
                    }
                    let mut f = self.scope("axpy", s);
                    let (x, y) = (f.input(x)?, f.output(y, true)?);
                    let e = err("axpy");
                    if rows.rows == 1 {
                        self.k.add_scaled(s, &y, alpha, &x).map_err(e)?;
                    } else if alpha == 1.0 {
                        self.k.add_row_bias_inplace(s, &y, &x).map_err(e)?;
                    } else {
                        let bytes = rows.cols * 4;
                        for r in 0..rows.rows {
                            let yr = y.slice(r * bytes, bytes)?;
                            self.k.add_scaled(s, &yr, alpha, &x).map_err(err("axpy"))?;
                        }
                    }
                    f.finish()
                }
                Launch::Sum { mean, x, out, .. } => {
                    let op = l.name();
                    if typed(&[x, out]) {
                        return self.k.sum_t(s, tb(x), tb(out), mean).map_err(err(op));
                    }
                    let mut f = self.scope(op, s);
                    let (x, o) = (f.input(x)?, f.output(out, false)?);
                    if mean {
                        self.k.mean(s, &x, &o)
                    } else {
                        self.k.sum(s, &x, &o)
                    }
                    .map_err(err(op))?;
                    f.finish()
                }
                Launch::ColSums { x, out, .. } => {
                    if typed(&[x, out]) {
                        let op = "col_sums";
                        return self.k.col_sums_t(s, tb(x), tb(out)).map_err(err(op));
                    }
                    let mut f = self.scope("col_sums", s);
                    let (x, o) = (f.input(x)?, f.output(out, false)?);
                    self.k.col_sums(s, &x, &o).map_err(err("col_sums"))?;
                    f.finish()
                }
                Launch::SumTo { shape, .. } => Err(unsupported(
                    "sum_to",
                    &format!(
                        "the general broadcast-undoing sum over {:?} has no CUDA kernel (only the \
                         row broadcast of bias-like shapes does); reshape so the broadcast \
                         dimensions lead",
                        shape.shape
                    ),
                )),
                Launch::Gelu { kind, x, y, .. } => {
                    if typed(&[x, y]) {
                        return self.k.gelu_t(s, kind, tb(x), tb(y)).map_err(err("gelu"));
                    }
                    let mut f = self.scope("gelu", s);
                    let (x, y) = (f.input(x)?, f.output(y, false)?);
                    self.k.gelu(s, kind, &x, &y).map_err(err("gelu"))?;
                    f.finish()
                }
                Launch::GeluBackward {
                    kind, x, dy, dx, ..
                } => {
                    let op = "gelu_backward";
                    if typed(&[x, dy, dx]) {
                        return self
                            .k
                            .gelu_backward_t(s, kind, tb(x), tb(dy), tb(dx))
                            .map_err(err(op));
                    }
                    let mut f = self.scope(op, s);
                    let (x, dy, dx) = (f.input(x)?, f.input(dy)?, f.output(dx, false)?);
                    self.k
                        .gelu_backward(s, kind, &x, &dy, &dx)
                        .map_err(err(op))?;
                    f.finish()
                }
                Launch::Softmax { rows, x, y } => {
                    let mut f = self.scope("softmax", s);
                    let (x, y) = (f.input(x)?, f.output(y, false)?);
                    let cols = rows.cols;
                    self.k
                        .softmax_rows(s, &x, &y, cols)
                        .map_err(err("softmax"))?;
                    f.finish()
                }
                Launch::SoftmaxBackward { rows, y, dy, dx } => {
                    let op = "softmax_backward";
                    let mut f = self.scope(op, s);
                    let (y, dy, dx) = (f.input(y)?, f.input(dy)?, f.output(dx, false)?);
                    let cols = rows.cols;
                    self.k
                        .softmax_rows_backward(s, &y, &dy, &dx, cols)
                        .map_err(err(op))?;
                    f.finish()
                }
                Launch::LayerNorm {
                    ln,
                    x,
                    gamma,
                    beta,
                    y,
                    mean,
                    rstd,
                } => {
                    let op = "layer_norm";
                    if typed(&[x, gamma, beta, y]) {
                        let (cols, eps) = (ln.rows.cols, ln.eps);
                        let (m, r) = (&mean.buf, &rstd.buf);
                        let [x, g, b, y] = [x, gamma, beta, y].map(tb);
                        return self
                            .k
                            .layer_norm_t(s, x, g, b, y, m, r, cols, eps)
                            .map_err(err(op));
                    }
                    let mut f = self.scope(op, s);
                    let [x, g, b] = f.inputs([x, gamma, beta])?;
                    let y = f.output(y, false)?;
                    let (cols, eps) = (ln.rows.cols, ln.eps);
                    self.k
                        .layer_norm(s, &x, &g, &b, &y, &mean.buf, &rstd.buf, cols, eps)
                        .map_err(err(op))?;
                    f.finish()
                }
                Launch::LayerNormBackward {
                    ln,
                    x,
                    gamma,
                    mean,
                    rstd,
                    dy,
                    dx,
                    dgamma,
                    dbeta,
                } => {
                    let op = "layer_norm_backward";
                    if typed(&[x, gamma, dy, dx, dgamma, dbeta]) {
                        let (m, r) = (&mean.buf, &rstd.buf);
                        let [x, g, dy, dx, dg, db] = [x, gamma, dy, dx, dgamma, dbeta].map(tb);
                        let cols = ln.rows.cols;
                        return self
                            .k
                            .layer_norm_backward_t(s, x, g, m, r, dy, dx, dg, db, cols)
                            .map_err(err(op));
                    }
                    let mut f = self.scope(op, s);
                    let [x, g, dy] = f.inputs([x, gamma, dy])?;
                    let [dx, dg, db] = f.outputs([dx, dgamma, dbeta])?;
                    let (m, r) = (&mean.buf, &rstd.buf);
                    let cols = ln.rows.cols;
                    self.k
                        .layer_norm_backward(s, &x, &g, m, r, &dy, &dx, &dg, &db, cols)
                        .map_err(err(op))?;
                    f.finish()
                }
                Launch::Embedding { e, ids, table, out } => {
                    let op = "embedding";
                    if typed(&[table, out]) {
                        let check = self
                            .k
                            .embedding_t(s, &ids.buf, tb(table), tb(out), e.dim)
                            .map_err(err(op))?;
                        self.defer(check);
                        return Ok(());
                    }
                    let mut f = self.scope(op, s);
                    let (t, o) = (f.input(table)?, f.output(out, false)?);
                    let check = self
                        .k
                        .embedding(s, &ids.buf, &t, &o, e.dim)
                        .map_err(err(op))?;
                    self.defer(check);
                    f.finish()
                }
                Launch::EmbeddingBackward { e, ids, dy, dtable } => {
                    let op = "embedding_backward";
                    if typed(&[dy, dtable]) {
                        let check = self
                            .k
                            .embedding_backward_t(s, &ids.buf, tb(dy), tb(dtable), e.dim)
                            .map_err(err(op))?;
                        self.defer(check);
                        return Ok(());
                    }
                    let mut f = self.scope(op, s);
                    let (g, d) = (f.input(dy)?, f.output(dtable, false)?);
                    let check = self
                        .k
                        .embedding_backward(s, &ids.buf, &g, &d, e.dim)
                        .map_err(err(op))?;
                    self.defer(check);
                    f.finish()
                }
                Launch::Attention {
                    a,
                    q,
                    k,
                    v,
                    out,
                    stats,
                } => {
                    let op = "attention";
                    let (b, h, t, d) = (a.batch, a.heads, a.t, a.d);
                    let probs = match stats {
                        AttentionStats::Probs(p) => p,
                        AttentionStats::Lse(lse) => {
                            let l = &lse.buf;
                            if a.layout == AttentionLayout::Packed {
                                // q = k = v: the whole qkv tensor (checked by the seam's front).
                                let dt = one_dtype(&[q, out]).ok_or_else(|| packed_mixed(op))?;
                                return self
                                    .k
                                    .flash_attention_packed(s, dt, &q.buf, &out.buf, l, b, h, t, d)
                                    .map_err(err(op));
                            }
                            if let Some(dt) = one_dtype(&[q, k, v, out]) {
                                let [q, kk, v, o] = [q, k, v, out].map(|o| &o.buf);
                                return self
                                    .k
                                    .flash_attention(s, dt, q, kk, v, o, l, b, h, t, d)
                                    .map_err(err(op));
                            }
                            let mut f = self.scope(op, s);
                            let [q, kk, v] = f.inputs([q, k, v])?;
                            let o = f.output(out, false)?;
                            self.k
                                .flash_attention(s, DType::F32, &q, &kk, &v, &o, l, b, h, t, d)
                                .map_err(err(op))?;
                            return f.finish();
                        }
                    };
                    packed_unsupported(op, &a)?;
                    let mut f = self.scope(op, s);
                    let [q, kk, v] = f.inputs([q, k, v])?;
                    let o = f.output(out, false)?;
                    let p = &probs.buf;
                    self.k
                        .causal_attention(s, &q, &kk, &v, &o, p, b, h, t, d)
                        .map_err(err(op))?;
                    f.finish()
                }
                Launch::AttentionBackward {
                    a,
                    q,
                    k,
                    v,
                    saved,
                    dout,
                    dq,
                    dk,
                    dv,
                } => {
                    let op = "attention_backward";
                    let (b, h, t, d) = (a.batch, a.heads, a.t, a.d);
                    let probs = match saved {
                        AttentionSaved::Probs(p) => p,
                        AttentionSaved::Lse { lse, out } => {
                            let l = &lse.buf;
                            if a.layout == AttentionLayout::Packed {
                                // q = k = v and dq = dk = dv (checked by the seam's front).
                                let dt = one_dtype(&[q, out, dout, dq])
                                    .ok_or_else(|| packed_mixed(op))?;
                                let [q, o, g, dqkv] = [q, out, dout, dq].map(|o| &o.buf);
                                return self
                                    .k
                                    .flash_attention_packed_backward(
                                        s, dt, q, o, l, g, dqkv, b, h, t, d,
                                    )
                                    .map_err(err(op));
                            }
                            let all = [q, k, v, out, dout, dq, dk, dv];
                            if let Some(dt) = one_dtype(&all) {
                                let [q, kk, v, o, g, dq, dk, dv] = all.map(|o| &o.buf);
                                return self
                                    .k
                                    .flash_attention_backward(
                                        s, dt, q, kk, v, o, l, g, dq, dk, dv, b, h, t, d,
                                    )
                                    .map_err(err(op));
                            }
                            let mut f = self.scope(op, s);
                            let [q, kk, v, o, g] = f.inputs([q, k, v, out, dout])?;
                            let [dq, dk, dv] = f.outputs([dq, dk, dv])?;
                            self.k
                                .flash_attention_backward(
                                    s,
                                    DType::F32,
                                    &q,
                                    &kk,
                                    &v,
                                    &o,
                                    l,
                                    &g,
                                    &dq,
                                    &dk,
                                    &dv,
                                    b,
                                    h,
                                    t,
                                    d,
                                )
                                .map_err(err(op))?;
                            return f.finish();
                        }
                    };
                    packed_unsupported(op, &a)?;
                    let mut f = self.scope(op, s);
                    let [q, kk, v, g] = f.inputs([q, k, v, dout])?;
                    let [dq, dk, dv] = f.outputs([dq, dk, dv])?;
                    let p = &probs.buf;
                    self.k
                        .causal_attention_backward(s, &q, &kk, &v, p, &g, &dq, &dk, &dv, b, h, t, d)
                        .map_err(err(op))?;
                    f.finish()
                }
                Launch::CrossEntropy {
                    rows,
                    logits,
                    targets,
                    loss,
                    lse,
                } => {
                    let op = "cross_entropy";
                    if typed(&[logits, loss]) {
                        let (t, e) = (&targets.buf, &lse.buf);
                        let check = self
                            .k
                            .cross_entropy_t(s, tb(logits), t, rows.cols, e, tb(loss))
                            .map_err(err(op))?;
                        self.defer(check);
                        return Ok(());
                    }
                    let mut f = self.scope(op, s);
                    let (l, o) = (f.input(logits)?, f.output(loss, false)?);
                    let (t, e) = (&targets.buf, &lse.buf);
                    let check = self
                        .k
                        .cross_entropy(s, &l, t, rows.cols, e, &o)
                        .map_err(err(op))?;
                    self.defer(check);
                    f.finish()
                }
                Launch::CrossEntropyBackward {
                    rows,
                    logits,
                    targets,
                    lse,
                    dloss,
                    dlogits,
                } => {
                    let op = "cross_entropy_backward";
                    if typed(&[logits, dloss, dlogits]) {
                        let (t, e) = (&targets.buf, &lse.buf);
                        let (l, g, d) = (tb(logits), tb(dloss), tb(dlogits));
                        let check = self
                            .k
                            .cross_entropy_backward_t(s, l, t, e, g, d, rows.cols)
                            .map_err(err(op))?;
                        self.defer(check);
                        return Ok(());
                    }
                    let mut f = self.scope(op, s);
                    let [l, g] = f.inputs([logits, dloss])?;
                    let d = f.output(dlogits, false)?;
                    let (t, e) = (&targets.buf, &lse.buf);
                    let check = self
                        .k
                        .cross_entropy_backward(s, &l, t, e, &g, &d, rows.cols)
                        .map_err(err(op))?;
                    self.defer(check);
                    f.finish()
                }
                Launch::Cast { x, out, .. } => {
                    if x.dtype == out.dtype {
                        return self.k.copy(s, &x.buf, &out.buf).map_err(err("cast"));
                    }
                    // One cast kernel from x into out where one side is f32 (what the path
                    // through a temporary computes, without the temporary and its copy).
                    let (xb, ob) = (&x.buf, &out.buf);
                    let direct = match (x.dtype, out.dtype) {
                        (DType::F16, DType::F32) => Some(self.k.cast_f16_to_f32(s, xb, ob)),
                        (DType::BF16, DType::F32) => Some(self.k.cast_bf16_to_f32(s, xb, ob)),
                        (DType::F32, DType::F16) => Some(self.k.cast_f32_to_f16(s, xb, ob)),
                        (DType::F32, DType::BF16) => Some(self.k.cast_f32_to_bf16(s, xb, ob)),
                        _ => None,
                    };
                    if let Some(r) = direct {
                        return r.map_err(err("cast"));
                    }
                    // Through f32, as on the CPU: x → f32 (a temporary unless x is f32), then →
                    // out.
                    let mut f = self.scope("cast", s);
                    let xf = f.input(x)?;
                    let o = f.output(out, false)?;
                    // f32 bits to f32 bits; `finish` casts a temporary output into a half `out`.
                    self.k.copy(s, &xf, &o).map_err(err("cast"))?;
                    f.finish()
                }
                Launch::Fill { n, value, out } => self.fill(s, n, value, out),
                Launch::Arange { n, out } => {
                    let host: Vec<i64> = (0..n as i64).collect();
                    self.k
                        .upload_async(s, bytemuck::cast_slice(&host), &out.buf)
                        .map_err(err("arange"))
                }
                Launch::Copy {
                    src_view,
                    src,
                    dst_view,
                    dst,
                } => self.copy(s, src_view, src, dst_view, dst),
                Launch::SgdStep { .. }
                | Launch::AdamWStep { .. }
                | Launch::LambDirection { .. }
                | Launch::LambApply { .. }
                | Launch::SumSquares { .. }
                | Launch::Unscale { .. } => self.optim(s, l),
            }
        }

        fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()> {
            self.k
                .upload_async(s, &bytes, &dst.buf)
                .map_err(err("write"))
        }

        fn copy_host(&self, s: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
            self.k.copy_host(s, src, dst).map_err(err("copy_host"))
        }

        fn attention_save(&self, a: &Attention) -> AttentionSave {
            if crate::kernels::cuda::fused_attention()
                && (1..=crate::kernels::cuda::FUSED_ATTENTION_MAX_D).contains(&a.d)
            {
                AttentionSave::Lse
            } else {
                AttentionSave::Probs
            }
        }

        /// The fused kernels take the packed layout; the unfused ones (probabilities) do not.
        fn attention_packed(&self, a: &Attention) -> bool {
            self.attention_save(a) == AttentionSave::Lse
        }

        fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
            // The checks launched so far; the download synchronizes `s` (one counted host
            // wait), after which the checks of `s` are read without another one.
            let checks = self.take_checks();
            let mut host = vec![0u8; src.buf.len()];
            self.k
                .download(s, &src.buf, &mut host)
                .map_err(err("read"))?;
            self.drain_checks(checks, s)?;
            f(&host);
            Ok(())
        }
    }

    /// The unfused CUDA kernels (probabilities saved) take [`AttentionLayout::Heads`] only
    /// (`attention_packed` says false for them, so `causal_attention_qkv` splits the heads
    /// itself); a packed launch there is a typed error.
    fn packed_unsupported(op: &'static str, a: &Attention) -> Result<()> {
        if a.layout == AttentionLayout::Packed {
            return Err(AutogradError::Argument {
                op,
                detail: "the unfused CUDA attention kernels take the head-split layout only (AttentionLayout::Heads); split the heads first (ops::causal_attention_qkv does where Kernels::attention_packed is false)".into(),
            });
        }
        Ok(())
    }

    /// The packed layout on CUDA needs one float dtype for qkv, out, dout and the gradient.
    fn packed_mixed(op: &'static str) -> AutogradError {
        AutogradError::Argument {
            op,
            detail: "packed attention layout on CUDA: qkv, out, dout and dqkv must share one float dtype (f32, bf16 or f16); cast them first".into(),
        }
    }
}

pub use imp::CudaBackend;
