//! [`CudaBackend`]: the CUDA kernels of one device as the ops' CUDA launches see them
//! ([`Op::cuda`](crate::kernels::Op::cuda) is handed one): the device's [`CudaKernels`], the
//! deferred index checks, and the helpers the launches share ([`F32Scope`] for operands the
//! kernels take only in `f32`, the dispatch tests [`typed`] and [`one_dtype`], error mapping).
//! `backend.rs` implements the seam's `Backend` trait for it.

use std::sync::Mutex;

use fsdp_alloc::{Buffer, BufferRef, DType, Stream};

use super::typed::{type_code, TBuf};
use super::{CudaKernelError, CudaKernels, IndexCheck};
use crate::error::{AutogradError, Result};
use crate::kernels::operand::Operand;

/// The CUDA kernels behind the seam: one per CUDA device, created on first use (compiling
/// the kernels with NVRTC once per process). Float operands in `f16`/`bf16` are cast to `f32`
/// temporaries on the stream, computed, and cast back, as the CPU backend does on the host,
/// except where a kernel takes them directly: matrix products with A and B of one half type
/// (cuBLAS Ex on the tensor cores, f32 accumulation), the fused attention with one dtype
/// throughout, and the typed kernels (any mix of f32/f16/bf16 operands, same bits as the
/// cast-around path) for add, mul, scale, axpy, row-bias add, sum and mean, column sums,
/// GELU and its backward, layer norm and its backward, cross-entropy and
/// embedding and their backwards. f32 products use TF32 when
/// [`set_allow_tf32`](crate::kernels::cuda::set_allow_tf32) is on; attention is fused
/// ([`Backend::attention_save`](crate::kernels::Backend::attention_save) says `Lse`) unless
/// [`set_fused_attention`](crate::kernels::cuda::set_fused_attention) is off or `d` is above
/// [`FUSED_ATTENTION_MAX_D`](crate::kernels::cuda::FUSED_ATTENTION_MAX_D).
///
/// Deferred index checks (embedding ids, cross-entropy targets) are collected and reported
/// by the next readback (the next synchronization), like the CPU's stream failure.
#[derive(Debug)]
pub struct CudaBackend {
    k: CudaKernels,
    pending: Mutex<Vec<IndexCheck>>,
}

/// Maps a kernel error of `op` to the seam's error.
pub(crate) fn err(op: &'static str) -> impl Fn(CudaKernelError) -> AutogradError {
    move |e| AutogradError::Backend {
        backend: "cuda",
        op,
        detail: e.to_string(),
    }
}

/// [`AutogradError::Unsupported`] "on a CUDA device".
pub(crate) fn unsupported(op: &'static str, detail: &str) -> AutogradError {
    AutogradError::Unsupported {
        op,
        detail: format!("on a CUDA device: {detail}"),
    }
}

impl CudaBackend {
    /// The backend over `k`.
    pub(crate) fn new(k: CudaKernels) -> CudaBackend {
        CudaBackend {
            k,
            pending: Mutex::new(Vec::new()),
        }
    }

    /// The device's kernels.
    pub fn kernels(&self) -> &CudaKernels {
        &self.k
    }

    /// Keeps `check` until the next readback reports it.
    pub(crate) fn defer(&self, check: IndexCheck) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(check);
    }

    /// The deferred index checks launched so far (to drain after a readback).
    pub(crate) fn take_checks(&self) -> Vec<IndexCheck> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reports the first failed index check of `checks`; those of `synced` (a stream the
    /// caller synchronized after they were launched) cost no further host wait, the others
    /// synchronize their streams.
    pub(crate) fn drain_checks(&self, checks: Vec<IndexCheck>, synced: &Stream) -> Result<()> {
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

    /// A scope of `f32` temporaries for op `op` on `s`.
    pub(crate) fn scope<'a>(&'a self, op: &'static str, s: &'a Stream) -> F32Scope<'a> {
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
pub(crate) struct F32Scope<'a> {
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

    /// `o` as `f32` device memory to read: itself, or a temporary holding its values.
    pub(crate) fn input(&mut self, o: &Operand) -> Result<BufferRef> {
        if o.dtype != DType::F16 && o.dtype != DType::BF16 {
            return Ok(o.buf.clone());
        }
        let t = self.temp(o.numel())?;
        self.to_f32(o, &t)?;
        Ok(t)
    }

    /// [`F32Scope::input`] of each operand.
    pub(crate) fn inputs<const N: usize>(&mut self, os: [&Operand; N]) -> Result<[BufferRef; N]> {
        let mut bufs = Vec::with_capacity(N);
        for o in os {
            bufs.push(self.input(o)?);
        }
        Ok(std::array::from_fn(|i| bufs[i].clone()))
    }

    /// [`F32Scope::output`] of each operand, none loaded.
    pub(crate) fn outputs<const N: usize>(&mut self, os: [&Operand; N]) -> Result<[BufferRef; N]> {
        let mut bufs = Vec::with_capacity(N);
        for o in os {
            bufs.push(self.output(o, false)?);
        }
        Ok(std::array::from_fn(|i| bufs[i].clone()))
    }

    /// `o` as `f32` device memory to write: itself, or a temporary (holding its values if
    /// `load`) that [`F32Scope::finish`] casts back.
    pub(crate) fn output(&mut self, o: &Operand, load: bool) -> Result<BufferRef> {
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

    /// Casts the temporaries of half outputs back into them.
    pub(crate) fn finish(self) -> Result<()> {
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
pub(crate) fn one_dtype(ops: &[&Operand]) -> Option<DType> {
    let d = ops.first()?.dtype;
    ops.iter().all(|o| o.dtype == d).then_some(d)
}

/// Whether an op's float operands go to the typed kernels (`*_t`): some operand is f16 or bf16
/// and every one is f32, f16 or bf16. The typed kernels read and write the half operands
/// directly, bit for bit what the f32 temporaries of [`F32Scope`] give.
pub(crate) fn typed(ops: &[&Operand]) -> bool {
    let half = |d: DType| d == DType::F16 || d == DType::BF16;
    ops.iter().any(|o| half(o.dtype)) && ops.iter().all(|o| type_code(o.dtype).is_some())
}

/// An operand as a typed-kernel argument.
pub(crate) fn tb(o: &Operand) -> TBuf<'_> {
    (&o.buf, o.dtype)
}

/// Byte range of `count` elements of `o` from element `first`.
pub(crate) fn elems(o: &Operand, first: usize, count: usize) -> Result<BufferRef> {
    let sz = o.dtype.size();
    Ok(o.buf.slice(first * sz, count * sz)?)
}
