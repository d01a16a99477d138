//! Cross-entropy with integer targets: [`CrossEntropy`] (mean loss, per-row log-sum-exp saved)
//! and [`CrossEntropyBackward`].

use fsdp_alloc::{DType, Stream};

use super::cpu;
use super::op::{invalid, Check, Op, Rows, Spec};
use super::operand::Operand;
use crate::error::Result;
use crate::launch::launch_f32;

/// Mean cross-entropy of `rows × cols` logits; writes the one-element `loss` and the per-row
/// log-sum-exp `lse` (`f32`). A target out of range fails the stream.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropy<'a> {
    /// The shape of the logits.
    pub rows: Rows,
    /// Logits.
    pub logits: &'a Operand,
    /// Targets (`i64`).
    pub targets: &'a Operand,
    /// One-element loss.
    pub loss: &'a Operand,
    /// Per-row log-sum-exp (`f32`).
    pub lse: &'a Operand,
}

impl Op for CrossEntropy<'_> {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        let table = [
            Spec::float("logits", self.logits, n),
            Spec::exact("targets", self.targets, DType::I64, "targets", rows.rows),
            Spec::float("loss", self.loss, 1),
            Spec::exact("lse", self.lse, DType::F32, "log-sum-exp", rows.rows),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        if rows.rows == 0 {
            return Err(invalid(op, "cross-entropy needs at least one row"));
        }
        Ok(true)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (targets, cols, op) = (self.targets.clone(), self.rows.cols, "cross_entropy");
        let (logits, lse, loss) = (self.logits, self.lse, self.loss);
        launch_f32(s, op, [logits], [lse, loss], false, move |[l], [e, o]| {
            o[0] = targets.typed::<i64, _>(op, |t| cpu::cross_entropy(l, t, cols, e))?;
            Ok(())
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, cols) = ("cross_entropy", b.kernels(), self.rows.cols);
        let (logits, loss) = (self.logits, self.loss);
        let (t, e) = (&self.targets.buf, &self.lse.buf);
        if typed(&[logits, loss]) {
            let check = k
                .cross_entropy_t(s, tb(logits), t, cols, e, tb(loss))
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let (l, o) = (f.input(logits)?, f.output(loss, false)?);
        let check = k.cross_entropy(s, &l, t, cols, e, &o).map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}

/// Cross-entropy backward, the upstream gradient read from the one-element `dloss`.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyBackward<'a> {
    /// The shape of the logits.
    pub rows: Rows,
    /// Logits.
    pub logits: &'a Operand,
    /// Targets (`i64`).
    pub targets: &'a Operand,
    /// The forward's per-row log-sum-exp.
    pub lse: &'a Operand,
    /// One-element upstream gradient.
    pub dloss: &'a Operand,
    /// Gradient of the logits.
    pub dlogits: &'a Operand,
}

impl Op for CrossEntropyBackward<'_> {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        let table = [
            Spec::float("logits", self.logits, n),
            Spec::float("dlogits", self.dlogits, n),
            Spec::exact("targets", self.targets, DType::I64, "targets", rows.rows),
            Spec::exact("lse", self.lse, DType::F32, "log-sum-exp", rows.rows),
            Spec::float("dloss", self.dloss, 1),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        Ok(rows.rows > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (targets, cols) = (self.targets.clone(), self.rows.cols);
        let op = "cross_entropy_backward";
        let ins = [self.logits, self.lse, self.dloss];
        launch_f32(s, op, ins, [self.dlogits], false, move |[l, e, g], [d]| {
            let dl = g[0];
            targets.typed::<i64, _>(op, |t| cpu::cross_entropy_backward(l, t, e, dl, d, cols))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, cols) = ("cross_entropy_backward", b.kernels(), self.rows.cols);
        let (logits, dloss, dlogits) = (self.logits, self.dloss, self.dlogits);
        let (t, e) = (&self.targets.buf, &self.lse.buf);
        if typed(&[logits, dloss, dlogits]) {
            let (l, g, d) = (tb(logits), tb(dloss), tb(dlogits));
            let check = k
                .cross_entropy_backward_t(s, l, t, e, g, d, cols)
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let [l, g] = f.inputs([logits, dloss])?;
        let d = f.output(dlogits, false)?;
        let check = k
            .cross_entropy_backward(s, &l, t, e, &g, &d, cols)
            .map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}
