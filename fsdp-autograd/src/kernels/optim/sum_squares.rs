//! Deterministic sums of squares (gradient clipping's norms, LAMB's trust ratio): the pieces
//! ([`SqPiece`]), the host kernel ([`sum_sq`]) and the op ([`SumSquares`]).

use fsdp_alloc::Stream;

use super::{check_optim, f32_arg};
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
