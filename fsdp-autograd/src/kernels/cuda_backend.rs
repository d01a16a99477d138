//! [`CudaBackend`]: the seam's CUDA implementation over [`kernels::cuda`](super::cuda)'s
//! `CudaKernels` (feature `cuda`). Without the feature the type exists with the same
//! constructor, which returns [`AutogradError::CudaNotBuilt`].
//!
//! **Never run on a GPU** (no GPU exists where this was written): the kernels it calls run on
//! the host emulator in tests, and this glue is compile-checked only; `cargo xtask gpu-test` runs
//! it on a real GPU.

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
        Attention, Backend, BinaryOp, EmbeddingShape, Gemm, LayerNormShape, Operand, ReadFn, Rows,
        SumTo, View,
    };
    use crate::kernels::cuda::{CudaKernelError, CudaKernels, IndexCheck};
    use crate::kernels::Gelu;

    /// The CUDA kernels behind the seam: one per CUDA device, created on first use (compiling
    /// the kernels with NVRTC once per process). Float operands in `f16`/`bf16` are cast to `f32`
    /// temporaries on the stream, computed, and cast back, as the CPU backend does on the host.
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

        /// Reports the first failed deferred index check (synchronizes their streams).
        fn drain_checks(&self) -> Result<()> {
            let checks: Vec<IndexCheck> =
                std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
            let mut first = Ok(());
            for c in checks {
                let op = c.op();
                if let Err(e) = c.wait() {
                    if first.is_ok() {
                        first = Err(err(op)(e));
                    }
                }
            }
            first
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

    /// Byte range of `count` elements of `o` from element `first`.
    fn elems(o: &Operand, first: usize, count: usize) -> Result<BufferRef> {
        let sz = o.dtype.size();
        Ok(o.buf.slice(first * sz, count * sz)?)
    }

    impl Backend for CudaBackend {
        fn name(&self) -> &'static str {
            "cuda"
        }

        fn gemm(&self, s: &Stream, g: &Gemm, a: &Operand, b: &Operand, c: &Operand) -> Result<()> {
            let mut f = self.scope("matmul", s);
            let (a, b, c) = (f.input(a)?, f.input(b)?, f.output(c, g.accumulate)?);
            if g.batch == 1 {
                self.k.matmul(
                    s,
                    &a,
                    &b,
                    &c,
                    g.m,
                    g.k,
                    g.n,
                    g.trans_a,
                    g.trans_b,
                    g.accumulate,
                )
            } else {
                self.k.bmm(
                    s,
                    &a,
                    &b,
                    &c,
                    g.batch,
                    g.m,
                    g.k,
                    g.n,
                    g.trans_a,
                    g.trans_b,
                    g.accumulate,
                )
            }
            .map_err(err("matmul"))?;
            f.finish()
        }

        fn binary(
            &self,
            s: &Stream,
            op: BinaryOp,
            rows: Rows,
            a: &Operand,
            b: &Operand,
            out: &Operand,
        ) -> Result<()> {
            let name = match op {
                BinaryOp::Add => "add",
                BinaryOp::Mul => "mul",
            };
            let full = b.numel() == a.numel();
            let mut f = self.scope(name, s);
            let (x, y, o) = (f.input(a)?, f.input(b)?, f.output(out, false)?);
            match (op, full) {
                (BinaryOp::Add, true) => self.k.add(s, &x, &y, &o).map_err(err(name))?,
                (BinaryOp::Mul, true) => self.k.mul(s, &x, &y, &o).map_err(err(name))?,
                (BinaryOp::Add, false) => self.k.add_row_bias(s, &x, &y, &o).map_err(err(name))?,
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

        fn scale(
            &self,
            s: &Stream,
            _n: usize,
            alpha: f32,
            x: &Operand,
            out: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("scale", s);
            let (x, o) = (f.input(x)?, f.output(out, false)?);
            self.k.scale(s, &x, alpha, &o).map_err(err("scale"))?;
            f.finish()
        }

        fn scale_inplace(&self, s: &Stream, _n: usize, alpha: f32, y: &Operand) -> Result<()> {
            let mut f = self.scope("scale_", s);
            let y = f.output(y, true)?;
            self.k.scale_inplace(s, &y, alpha).map_err(err("scale_"))?;
            f.finish()
        }

        fn axpy_rows(
            &self,
            s: &Stream,
            rows: Rows,
            alpha: f32,
            x: &Operand,
            y: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("axpy", s);
            let (x, y) = (f.input(x)?, f.output(y, true)?);
            if rows.rows == 1 {
                self.k.add_scaled(s, &y, alpha, &x).map_err(err("axpy"))?;
            } else if alpha == 1.0 {
                self.k
                    .add_row_bias_inplace(s, &y, &x)
                    .map_err(err("axpy"))?;
            } else {
                let bytes = rows.cols * 4;
                for r in 0..rows.rows {
                    let yr = y.slice(r * bytes, bytes)?;
                    self.k.add_scaled(s, &yr, alpha, &x).map_err(err("axpy"))?;
                }
            }
            f.finish()
        }

        fn sum(&self, s: &Stream, _n: usize, mean: bool, x: &Operand, out: &Operand) -> Result<()> {
            let op = if mean { "mean" } else { "sum" };
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

        fn col_sums(&self, s: &Stream, _rows: Rows, x: &Operand, out: &Operand) -> Result<()> {
            let mut f = self.scope("col_sums", s);
            let (x, o) = (f.input(x)?, f.output(out, false)?);
            self.k.col_sums(s, &x, &o).map_err(err("col_sums"))?;
            f.finish()
        }

        fn sum_to(&self, _s: &Stream, st: &SumTo, _x: &Operand, _out: &Operand) -> Result<()> {
            Err(unsupported(
                "sum_to",
                &format!(
                    "the general broadcast-undoing sum over {:?} has no CUDA kernel (only the row \
                     broadcast of bias-like shapes does); reshape so the broadcast dimensions lead",
                    st.shape
                ),
            ))
        }

        fn gelu(&self, s: &Stream, kind: Gelu, _n: usize, x: &Operand, y: &Operand) -> Result<()> {
            let mut f = self.scope("gelu", s);
            let (x, y) = (f.input(x)?, f.output(y, false)?);
            self.k.gelu(s, kind, &x, &y).map_err(err("gelu"))?;
            f.finish()
        }

        fn gelu_backward(
            &self,
            s: &Stream,
            kind: Gelu,
            _n: usize,
            x: &Operand,
            dy: &Operand,
            dx: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("gelu_backward", s);
            let (x, dy, dx) = (f.input(x)?, f.input(dy)?, f.output(dx, false)?);
            self.k
                .gelu_backward(s, kind, &x, &dy, &dx)
                .map_err(err("gelu_backward"))?;
            f.finish()
        }

        fn softmax(&self, s: &Stream, rows: Rows, x: &Operand, y: &Operand) -> Result<()> {
            let mut f = self.scope("softmax", s);
            let (x, y) = (f.input(x)?, f.output(y, false)?);
            self.k
                .softmax_rows(s, &x, &y, rows.cols)
                .map_err(err("softmax"))?;
            f.finish()
        }

        fn softmax_backward(
            &self,
            s: &Stream,
            rows: Rows,
            y: &Operand,
            dy: &Operand,
            dx: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("softmax_backward", s);
            let (y, dy, dx) = (f.input(y)?, f.input(dy)?, f.output(dx, false)?);
            self.k
                .softmax_rows_backward(s, &y, &dy, &dx, rows.cols)
                .map_err(err("softmax_backward"))?;
            f.finish()
        }

        fn layer_norm(
            &self,
            s: &Stream,
            ln: LayerNormShape,
            x: &Operand,
            gamma: &Operand,
            beta: &Operand,
            y: &Operand,
            mean: &Operand,
            rstd: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("layer_norm", s);
            let (x, g, b, y) = (
                f.input(x)?,
                f.input(gamma)?,
                f.input(beta)?,
                f.output(y, false)?,
            );
            self.k
                .layer_norm(
                    s,
                    &x,
                    &g,
                    &b,
                    &y,
                    &mean.buf,
                    &rstd.buf,
                    ln.rows.cols,
                    ln.eps,
                )
                .map_err(err("layer_norm"))?;
            f.finish()
        }

        fn layer_norm_backward(
            &self,
            s: &Stream,
            ln: LayerNormShape,
            x: &Operand,
            gamma: &Operand,
            mean: &Operand,
            rstd: &Operand,
            dy: &Operand,
            dx: &Operand,
            dgamma: &Operand,
            dbeta: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("layer_norm_backward", s);
            let (x, g, dy) = (f.input(x)?, f.input(gamma)?, f.input(dy)?);
            let (dx, dg, db) = (
                f.output(dx, false)?,
                f.output(dgamma, false)?,
                f.output(dbeta, false)?,
            );
            self.k
                .layer_norm_backward(
                    s,
                    &x,
                    &g,
                    &mean.buf,
                    &rstd.buf,
                    &dy,
                    &dx,
                    &dg,
                    &db,
                    ln.rows.cols,
                )
                .map_err(err("layer_norm_backward"))?;
            f.finish()
        }

        fn embedding(
            &self,
            s: &Stream,
            e: EmbeddingShape,
            ids: &Operand,
            table: &Operand,
            out: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("embedding", s);
            let (t, o) = (f.input(table)?, f.output(out, false)?);
            let check = self
                .k
                .embedding(s, &ids.buf, &t, &o, e.dim)
                .map_err(err("embedding"))?;
            self.defer(check);
            f.finish()
        }

        fn embedding_backward(
            &self,
            s: &Stream,
            e: EmbeddingShape,
            ids: &Operand,
            dy: &Operand,
            dtable: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("embedding_backward", s);
            let (g, d) = (f.input(dy)?, f.output(dtable, false)?);
            let check = self
                .k
                .embedding_backward(s, &ids.buf, &g, &d, e.dim)
                .map_err(err("embedding_backward"))?;
            self.defer(check);
            f.finish()
        }

        fn attention(
            &self,
            s: &Stream,
            a: Attention,
            q: &Operand,
            k: &Operand,
            v: &Operand,
            out: &Operand,
            probs: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("attention", s);
            let (q, kk, v, o) = (f.input(q)?, f.input(k)?, f.input(v)?, f.output(out, false)?);
            self.k
                .causal_attention(s, &q, &kk, &v, &o, &probs.buf, a.batch, a.heads, a.t, a.d)
                .map_err(err("attention"))?;
            f.finish()
        }

        fn attention_backward(
            &self,
            s: &Stream,
            a: Attention,
            q: &Operand,
            k: &Operand,
            v: &Operand,
            probs: &Operand,
            dout: &Operand,
            dq: &Operand,
            dk: &Operand,
            dv: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("attention_backward", s);
            let (q, kk, v, g) = (f.input(q)?, f.input(k)?, f.input(v)?, f.input(dout)?);
            let (dq, dk, dv) = (
                f.output(dq, false)?,
                f.output(dk, false)?,
                f.output(dv, false)?,
            );
            self.k
                .causal_attention_backward(
                    s, &q, &kk, &v, &probs.buf, &g, &dq, &dk, &dv, a.batch, a.heads, a.t, a.d,
                )
                .map_err(err("attention_backward"))?;
            f.finish()
        }

        fn cross_entropy(
            &self,
            s: &Stream,
            rows: Rows,
            logits: &Operand,
            targets: &Operand,
            loss: &Operand,
            lse: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("cross_entropy", s);
            let (l, o) = (f.input(logits)?, f.output(loss, false)?);
            let check = self
                .k
                .cross_entropy(s, &l, &targets.buf, rows.cols, &lse.buf, &o)
                .map_err(err("cross_entropy"))?;
            self.defer(check);
            f.finish()
        }

        fn cross_entropy_backward(
            &self,
            s: &Stream,
            rows: Rows,
            logits: &Operand,
            targets: &Operand,
            lse: &Operand,
            dloss: &Operand,
            dlogits: &Operand,
        ) -> Result<()> {
            let mut f = self.scope("cross_entropy_backward", s);
            let (l, g, d) = (f.input(logits)?, f.input(dloss)?, f.output(dlogits, false)?);
            let check = self
                .k
                .cross_entropy_backward(s, &l, &targets.buf, &lse.buf, &g, &d, rows.cols)
                .map_err(err("cross_entropy_backward"))?;
            self.defer(check);
            f.finish()
        }

        fn cast(&self, s: &Stream, _n: usize, x: &Operand, out: &Operand) -> Result<()> {
            if x.dtype == out.dtype {
                return self.k.copy(s, &x.buf, &out.buf).map_err(err("cast"));
            }
            // Through f32, as on the CPU: x → f32 (a temporary unless x is f32), then → out.
            let mut f = self.scope("cast", s);
            let xf = f.input(x)?;
            let o = f.output(out, false)?;
            // f32 bits to f32 bits; `finish` casts a temporary output into a half `out`.
            self.k.copy(s, &xf, &o).map_err(err("cast"))?;
            f.finish()
        }

        fn fill(&self, s: &Stream, n: usize, value: f64, out: &Operand) -> Result<()> {
            if value == 0.0 && value.is_sign_positive() {
                return self.k.zero(s, &out.buf).map_err(err("fill"));
            }
            // One element converted on the host, then broadcast by a stride-0 copy.
            let one = crate::tensor::host_scalar_bytes(out.dtype, value);
            if out.dtype.size() == 1 {
                let bytes = vec![one[0]; n];
                return self.k.upload(s, &bytes, &out.buf).map_err(err("fill"));
            }
            let tmp = self.k.device().alloc(one.len(), s)?;
            self.k.upload(s, &one, tmp.data()).map_err(err("fill"))?;
            self.k
                .strided_copy(s, tmp.data(), 0, &[n], &[0], &out.buf, out.dtype)
                .map_err(err("fill"))
        }

        fn arange(&self, s: &Stream, n: usize, out: &Operand) -> Result<()> {
            let host: Vec<i64> = (0..n as i64).collect();
            self.k.upload(s, &host, &out.buf).map_err(err("arange"))
        }

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
            self.k
                .strided_copy(
                    s,
                    &src.buf,
                    src_view.offset,
                    &src_view.shape,
                    &src_view.strides,
                    &d,
                    src.dtype,
                )
                .map_err(err("copy"))
        }

        fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()> {
            self.k.upload(s, &bytes, &dst.buf).map_err(err("write"))
        }

        fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
            self.drain_checks()?;
            let mut host = vec![0u8; src.buf.len()];
            self.k
                .download(s, &src.buf, &mut host)
                .map_err(err("read"))?;
            f(&host);
            Ok(())
        }
    }
}

pub use imp::CudaBackend;
