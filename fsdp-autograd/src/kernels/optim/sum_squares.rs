//! Deterministic sums of squares (gradient clipping's norms, LAMB's trust ratio): the pieces
//! ([`SqPiece`]), the host kernel ([`sum_sq`]) and the op ([`SumSquares`]).

use fsdp_alloc::Stream;

use super::common::{check_optim, f32_arg};
use crate::error::Result;
use crate::kernels::op::{invalid, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch;

/// Σ x² accumulated in f64, sequentially.
pub fn sum_sq(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum()
}

/// One piece of a [`SumSquares`]: elements `start..start + len` of input `input`, whose squares
/// are added to output `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqPiece {
    /// Index into the op's inputs.
    pub input: usize,
    /// First element of the piece in that input.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
    /// Index of the output element the squares are added to.
    pub out: usize,
}

/// Deterministic sums of squares: `out[o] = Σ` (over the pieces with `out == o`, in order) of
/// the piece's `Σ x²`; every sum accumulates in f64 and is rounded to f32 once; outputs no piece
/// names are 0. No float atomics (CPU: sequential; CUDA: fixed-shape blocked sums).
#[derive(Debug, Clone, Copy)]
pub struct SumSquares<'a> {
    /// The inputs.
    pub xs: &'a [Operand],
    /// The pieces, in summation order.
    pub pieces: &'a [SqPiece],
    /// The sums (overwritten).
    pub out: &'a Operand,
}

impl Op for SumSquares<'_> {
    fn name(&self) -> &'static str {
        "sum_squares"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, xs, out) = (self.name(), self.xs, self.out);
        let mut t: Vec<Spec<'_>> = xs.iter().map(|x| f32_arg("xs", x, x.numel())).collect();
        t.push(f32_arg("out", out, out.numel()));
        for (i, pc) in self.pieces.iter().enumerate() {
            let x = xs.get(pc.input).ok_or_else(|| {
                invalid(
                    op,
                    format!("piece {i} names input {} of {}", pc.input, xs.len()),
                )
            })?;
            if pc.start.checked_add(pc.len).is_none_or(|e| e > x.numel()) || pc.out >= out.numel() {
                let reason = format!(
                    "piece {i} ({pc:?}) reaches outside input {} ({} elements) or the {} outputs",
                    pc.input,
                    x.numel(),
                    out.numel()
                );
                return Err(invalid(op, reason));
            }
        }
        check_optim(c, op, out.numel(), &t, &[out])
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let op = self.name();
        let (xs, pieces, out) = (self.xs.to_vec(), self.pieces.to_vec(), self.out.clone());
        launch(s, op, move || {
            use rayon::prelude::*;
            let reads: Vec<_> = xs.iter().map(|x| x.read_f32(op)).collect();
            let slices: Vec<&[f32]> = reads.iter().map(|r| &r[..]).collect();
            // Each piece's sum on its own core (a GPT-2 shard's ~150 pieces took ~100 ms on one
            // thread under CPU offload); each is still one sequential f64 sum and the pieces are
            // added in order, so the bits are those of the serial loop.
            let sums: Vec<f64> = pieces
                .par_iter()
                .map(|pc| sum_sq(&slices[pc.input][pc.start..pc.start + pc.len]))
                .collect();
            let mut acc = vec![0f64; out.numel()];
            for (pc, s) in pieces.iter().zip(sums) {
                acc[pc.out] += s;
            }
            drop(slices);
            drop(reads);
            out.f32_mut(op, false, |o| {
                for (o, a) in o.iter_mut().zip(&acc) {
                    *o = *a as f32;
                }
            });
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let bufs: Vec<fsdp_alloc::BufferRef> = self.xs.iter().map(|x| x.buf.clone()).collect();
        b.kernels()
            .sum_squares(s, &bufs, self.pieces, &self.out.buf)
            .map_err(err(self.name()))
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{CudaKernels, Elem};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{grid_for, sum_parts, PArg, Plan, Ptr};
    use crate::kernels::optim::SqPiece;
    use crate::kernels::KernelError;

    crate::kernels::cuda::kernel::declare_kernels! {
        OPT_SUMSQ_PARTIAL = "opt_sumsq_partial" [U64, Ptr, Ptr];
        OPT_SUMSQ_ACCUM = "opt_sumsq_accum" [U64, Ptr, Ptr];
        OPT_SUMSQ_FINAL = "opt_sumsq_final" [U64, Ptr, Ptr];
    }

    /// Sums of squares of `pieces` — (address of the piece's first element, its length, output
    /// index) — into `n_out` f32 outputs at `out`: an f64 accumulator (zeroed), per non-empty piece
    /// a partial-sum launch and an accumulate launch (in order, one stream), then the rounding.
    pub(crate) fn plan_sum_squares(pieces: &[(u64, u64, usize)], n_out: u64, out: Ptr) -> Plan {
        let mut plan = Plan::new();
        if n_out == 0 {
            return plan;
        }
        let acc = plan.scratch(n_out as usize, Elem::F64);
        plan.memset(Ptr::scratch(acc), 0, n_out as usize * 8);
        let max_parts = pieces
            .iter()
            .filter(|pc| pc.1 > 0)
            .map(|pc| sum_parts(pc.1))
            .max();
        if let Some(max_parts) = max_parts {
            // One partial-sum slot reused by every piece: the accumulate launch reads it before the
            // next piece's partial launch writes it (stream order).
            let partial = plan.scratch(max_parts as usize, Elem::F64);
            for &(addr, len, o) in pieces.iter().filter(|pc| pc.1 > 0) {
                let parts = sum_parts(len);
                plan.launch(
                    OPT_SUMSQ_PARTIAL,
                    parts,
                    vec![
                        PArg::U64(len),
                        PArg::Ptr(Ptr::Dev(addr)),
                        PArg::Ptr(Ptr::scratch(partial)),
                    ],
                );
                plan.launch(
                    OPT_SUMSQ_ACCUM,
                    1,
                    vec![
                        PArg::U64(parts as u64),
                        PArg::Ptr(Ptr::scratch(partial)),
                        PArg::Ptr(Ptr::Scratch {
                            slot: acc,
                            offset: o as u64 * 8,
                        }),
                    ],
                );
            }
        }
        plan.launch(
            OPT_SUMSQ_FINAL,
            grid_for(n_out),
            vec![
                PArg::U64(n_out),
                PArg::Ptr(Ptr::scratch(acc)),
                PArg::Ptr(out),
            ],
        );
        plan
    }

    impl CudaKernels {
        /// Deterministic sums of squares (CPU: the seam's `SumSquares` on the CPU, sequential f64):
        /// `out[o] = Σ` over the pieces naming `o`, in order, of the piece's f64 sum of squares,
        /// rounded to f32 once; outputs no piece names are 0.
        ///
        /// # Errors
        /// Pieces outside their input or the outputs, buffer/stream errors, `out` overlapping an
        /// input.
        pub fn sum_squares(
            &self,
            stream: &Stream,
            xs: &[BufferRef],
            pieces: &[SqPiece],
            out: &BufferRef,
        ) -> Result<()> {
            let op = "sum_squares";
            let c = self.call(op, stream)?;
            let [dout] = c.f32_bufs([("out", out)])?;
            let mut devs = Vec::with_capacity(xs.len());
            for x in xs {
                devs.push(c.buf("xs", x, Elem::F32)?);
                c.disjoint(&[("out", out)], &[("xs", x)])?;
            }
            let mut plan_pieces = Vec::with_capacity(pieces.len());
            for (i, pc) in pieces.iter().enumerate() {
                let bad = || {
                    KernelError::InvalidShape {
                        op,
                        reason: format!(
                            "piece {i} ({pc:?}) reaches outside its input or the outputs"
                        ),
                    }
                    .into()
                };
                let d = devs.get(pc.input).ok_or_else(bad)?;
                if pc.start.checked_add(pc.len).is_none_or(|e| e > d.len) || pc.out >= dout.len {
                    return Err(bad());
                }
                plan_pieces.push((d.ptr + pc.start as u64 * 4, pc.len as u64, pc.out));
            }
            let plan = plan_sum_squares(&plan_pieces, dout.len as u64, dout.as_ptr());
            // SAFETY: every piece lies inside its input (checked), out holds n_out f32 and overlaps
            // no input; scratch is sized by the plan.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
