//! Embedding lookup: [`Embedding`] (a gather of table rows by `i64` id) and
//! [`EmbeddingBackward`] (the rows' gradients summed per id, in position order).

use fsdp_alloc::{DType, Stream};

use super::cpu;
use super::op::{mul, Check, Op, Spec};
use super::operand::Operand;
use crate::error::Result;
use crate::launch::launch_f32;

/// Embedding lookup of `ids` (`i64`) into a `vocab × dim` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingShape {
    /// Number of ids.
    pub ids: usize,
    /// Table rows.
    pub vocab: usize,
    /// Table columns.
    pub dim: usize,
}

/// Embedding lookup; an id out of range fails the stream.
#[derive(Debug, Clone, Copy)]
pub struct Embedding<'a> {
    /// The sizes.
    pub e: EmbeddingShape,
    /// Ids (`i64`).
    pub ids: &'a Operand,
    /// The `vocab × dim` table.
    pub table: &'a Operand,
    /// Output rows.
    pub out: &'a Operand,
}

impl Op for Embedding<'_> {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, e) = (self.name(), self.e);
        let args = [
            Spec::exact("ids", self.ids, DType::I64, "ids", e.ids),
            Spec::float("table", self.table, mul(op, e.vocab, e.dim)?),
            Spec::float("out", self.out, mul(op, e.ids, e.dim)?),
        ];
        c.args(op, || format!("{e:?}"), &args)?;
        Ok(e.ids > 0 && e.dim > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (ids, dim, op) = (self.ids.clone(), self.e.dim, "embedding");
        launch_f32(s, op, [self.table], [self.out], false, move |[t], [o]| {
            ids.typed::<i64, _>(op, |i| cpu::embedding(i, t, o, dim))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, dim) = ("embedding", b.kernels(), self.e.dim);
        let (ids, table, out) = (&self.ids.buf, self.table, self.out);
        if typed(&[table, out]) {
            let check = k
                .embedding_t(s, ids, tb(table), tb(out), dim)
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let (t, o) = (f.input(table)?, f.output(out, false)?);
        let check = k.embedding(s, ids, &t, &o, dim).map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}

/// Embedding backward; overwrites `dtable` (deterministic order).
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingBackward<'a> {
    /// The sizes.
    pub e: EmbeddingShape,
    /// Ids (`i64`).
    pub ids: &'a Operand,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// Gradient of the table.
    pub dtable: &'a Operand,
}

impl Op for EmbeddingBackward<'_> {
    fn name(&self) -> &'static str {
        "embedding_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, e) = (self.name(), self.e);
        let args = [
            Spec::exact("ids", self.ids, DType::I64, "ids", e.ids),
            Spec::float("dy", self.dy, mul(op, e.ids, e.dim)?),
            Spec::float("dtable", self.dtable, mul(op, e.vocab, e.dim)?),
        ];
        c.args(op, || format!("{e:?}"), &args)?;
        Ok(e.vocab > 0 && e.dim > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (ids, dim, op) = (self.ids.clone(), self.e.dim, "embedding_backward");
        launch_f32(s, op, [self.dy], [self.dtable], false, move |[g], [d]| {
            ids.typed::<i64, _>(op, |i| cpu::embedding_backward(i, g, d, dim))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, dim) = ("embedding_backward", b.kernels(), self.e.dim);
        let (ids, dy, dtable) = (&self.ids.buf, self.dy, self.dtable);
        if typed(&[dy, dtable]) {
            let check = k
                .embedding_backward_t(s, ids, tb(dy), tb(dtable), dim)
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let (g, d) = (f.input(dy)?, f.output(dtable, false)?);
        let check = k.embedding_backward(s, ids, &g, &d, dim).map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}
