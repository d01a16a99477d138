//! Shape and view operations: reshape/view, transpose/permute, contiguous, narrow, split,
//! expand. Views share storage (and the version counter) with their base; their backward puts
//! the gradient back in the base's layout.

use fsdp_alloc::DType;

use crate::autograd::node::BackwardFn;
use crate::autograd::{needs_grad, record, record1};
use crate::context::current_stream;
use crate::error::{arg_err, shape_err, Result};
use crate::kernels::elementwise::Fill;
use crate::kernels::layout::StridedCopy;
use crate::kernels::operand::contiguous_strides;
use crate::kernels::{Kernels, View};
use crate::tensor::{checked_numel, numel_of, Tensor};

impl Tensor {
    /// The same elements with another shape, sharing storage when the tensor is contiguous
    /// (otherwise a contiguous copy is made first).
    ///
    /// # Errors
    /// [`crate::AutogradError::Shape`] if the element counts differ.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.is_contiguous() {
            self.view(shape)
        } else {
            self.contiguous()?.view(shape)
        }
    }

    /// A view with another shape (no copy). The tensor must be contiguous.
    ///
    /// # Errors
    /// [`crate::AutogradError::Shape`] if the element counts differ or the tensor is not
    /// contiguous.
    pub fn view(&self, shape: &[usize]) -> Result<Tensor> {
        if checked_numel("view", shape)? != self.numel() {
            return Err(shape_err(
                "view",
                format!(
                    "cannot view shape {:?} ({} elements) as {shape:?} ({} elements)",
                    self.shape(),
                    self.numel(),
                    numel_of(shape)
                ),
            ));
        }
        if !self.is_contiguous() {
            return Err(shape_err(
                "view",
                format!(
                    "view needs a contiguous tensor (shape {:?}, strides {:?}); use reshape",
                    self.shape(),
                    self.strides()
                ),
            ));
        }
        let out = self.view_raw(shape.to_vec(), contiguous_strides(shape), self.offset());
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        let in_shape = self.shape().to_vec();
        Ok(record1(
            "view",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                Ok(vec![g[0]
                    .as_ref()
                    .map(|g| g.reshape(&in_shape))
                    .transpose()?])
            },
        ))
    }

    /// Flattens all dimensions into one.
    pub fn flatten(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])
    }

    /// Swaps dimensions `d0` and `d1` (a view).
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Tensor> {
        let nd = self.dim();
        if d0 >= nd || d1 >= nd {
            return Err(arg_err(
                "transpose",
                format!("dimensions ({d0}, {d1}) of a {nd}-d tensor"),
            ));
        }
        let mut perm: Vec<usize> = (0..nd).collect();
        perm.swap(d0, d1);
        self.permute(&perm)
    }

    /// Transpose of a 2-D tensor (a view).
    pub fn t(&self) -> Result<Tensor> {
        if self.dim() != 2 {
            return Err(arg_err(
                "t",
                format!("t() needs a 2-d tensor, got shape {:?}", self.shape()),
            ));
        }
        self.transpose(0, 1)
    }

    /// Reorders dimensions: output dimension `i` is input dimension `perm[i]` (a view).
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let nd = self.dim();
        let mut seen = vec![false; nd];
        if perm.len() != nd
            || perm
                .iter()
                .any(|&p| p >= nd || std::mem::replace(&mut seen[p], true))
        {
            return Err(arg_err(
                "permute",
                format!("{perm:?} is not a permutation of the {nd} dimensions"),
            ));
        }
        let shape = perm.iter().map(|&p| self.shape()[p]).collect();
        let strides = perm.iter().map(|&p| self.strides()[p]).collect();
        let out = self.view_raw(shape, strides, self.offset());
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        let mut inv = vec![0; nd];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(record1(
            "permute",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                Ok(vec![g[0].as_ref().map(|g| g.permute(&inv)).transpose()?])
            },
        ))
    }

    /// A contiguous tensor with the same values: `self` if already contiguous, else a copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.contiguous_copy()
    }

    /// A contiguous copy in new memory (always copies). Differentiable.
    pub fn contiguous_copy(&self) -> Result<Tensor> {
        let out = self.copy_raw("contiguous")?;
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        Ok(record1(
            "contiguous",
            &[self],
            out,
            |g: Vec<Option<Tensor>>| Ok(g),
        ))
    }

    /// `self` if contiguous, else a contiguous copy; never recorded (for kernel inputs).
    pub(crate) fn contig(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            Ok(self.clone())
        } else {
            self.copy_raw("contiguous")
        }
    }

    /// A contiguous copy without autograd.
    pub(crate) fn copy_raw(&self, op: &'static str) -> Result<Tensor> {
        let stream = current_stream(self.device());
        let out = Tensor::empty_on(self.shape(), self.dtype(), self.device(), &stream)?;
        let src = self.span_operand(op, &stream)?;
        let dst = out.operand_on(op, &stream)?;
        Kernels::for_device(self.device())?.launch(
            &stream,
            &StridedCopy {
                src_view: &self.span_view(),
                src: &src,
                dst_view: &View::contiguous(self.shape(), 0),
                dst: &dst,
            },
        )?;
        Ok(out)
    }

    /// Elements `start..start + len` of dimension `dim` (a view). Backward writes the gradient
    /// into a zero tensor of the input's shape.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        if dim >= self.dim() || start.checked_add(len).is_none_or(|e| e > self.shape()[dim]) {
            return Err(arg_err(
                "narrow",
                format!(
                    "range {start}..{} of dimension {dim} of shape {:?}",
                    start.saturating_add(len),
                    self.shape()
                ),
            ));
        }
        let mut shape = self.shape().to_vec();
        shape[dim] = len;
        let offset = self.offset() + start * self.strides()[dim];
        let out = self.view_raw(shape, self.strides().to_vec(), offset);
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        let in_shape = self.shape().to_vec();
        Ok(record1(
            "narrow",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                let g = g.into_iter().next().flatten();
                let Some(g) = g else { return Ok(vec![None]) };
                Ok(vec![Some(scatter_pieces(
                    &in_shape,
                    g.dtype(),
                    &g,
                    dim,
                    &[(start, len, Some(g.clone()))],
                )?)])
            },
        ))
    }

    /// Splits dimension 0 into consecutive pieces of the given sizes (views).
    ///
    /// Autograd records **one** node for all pieces: its backward writes every piece's gradient
    /// into one gradient of the input's shape at the piece's offset, with zeros where a piece
    /// received no gradient. Splitting a flat 1-D leaf therefore gives the leaf one flat
    /// gradient, with no per-piece accumulation buffers left behind (what FSDP's flat
    /// parameters need).
    ///
    /// # Errors
    /// [`crate::AutogradError::Argument`] if the sizes do not add up to dimension 0.
    ///
    /// ```
    /// use fsdp_alloc::{DType, Device};
    /// use fsdp_autograd::Tensor;
    ///
    /// let dev = Device::cpu(0);
    /// let flat = Tensor::zeros(&[6], DType::F32, &dev)?.requires_grad_(true)?;
    /// let parts = flat.split(&[2, 4])?;
    /// let w = parts[1].view(&[2, 2])?;
    /// w.sum()?.backward()?; // only the second piece is used
    /// assert_eq!(flat.grad().unwrap().to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
    /// # Ok::<(), fsdp_autograd::AutogradError>(())
    /// ```
    pub fn split(&self, sizes: &[usize]) -> Result<Vec<Tensor>> {
        self.split_dim(sizes, 0)
    }

    /// [`Tensor::split`] along dimension `dim`.
    pub fn split_dim(&self, sizes: &[usize], dim: usize) -> Result<Vec<Tensor>> {
        let total = sizes.iter().try_fold(0usize, |a, &n| a.checked_add(n));
        if dim >= self.dim() || total != Some(self.shape()[dim]) {
            return Err(arg_err(
                "split",
                format!(
                    "sizes {sizes:?} do not add up to dimension {dim} of shape {:?}",
                    self.shape()
                ),
            ));
        }
        let mut outs = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in sizes {
            let mut shape = self.shape().to_vec();
            shape[dim] = len;
            let offset = self.offset() + start * self.strides()[dim];
            outs.push(self.view_raw(shape, self.strides().to_vec(), offset));
            start += len;
        }
        if !needs_grad(&[self]) {
            return Ok(outs);
        }
        let mut starts = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in sizes {
            starts.push(start);
            start += len;
        }
        let backward = SplitBackward {
            in_shape: self.shape().to_vec(),
            dtype: self.dtype(),
            dim,
            sizes: sizes.to_vec(),
            starts,
            piece_shapes: None,
            acc: None,
            filled: vec![false; sizes.len()],
        };
        Ok(record("split", &[self], &outs, backward))
    }

    /// Splits a contiguous 1-D tensor into consecutive pieces, each viewed with its own shape —
    /// one autograd node whose backward folds every piece's gradient into one gradient of `self`
    /// as soon as it arrives (so the pieces' gradients never wait next to the whole). This is how
    /// FSDP exposes original parameters as views of one flat parameter.
    ///
    /// ```
    /// use fsdp_alloc::{DType, Device};
    /// use fsdp_autograd::Tensor;
    ///
    /// let dev = Device::cpu(0);
    /// let flat = Tensor::from_vec((0..7).map(|i| i as f32).collect::<Vec<_>>(), &[7], &dev)?;
    /// let parts = flat.split_shaped(&[&[2, 3], &[1]])?;
    /// assert_eq!(parts[0].shape(), &[2, 3]);
    /// assert_eq!(parts[1].to_vec::<f32>()?, vec![6.0]);
    /// # Ok::<(), fsdp_autograd::AutogradError>(())
    /// ```
    ///
    /// # Errors
    /// [`crate::AutogradError::Shape`] / `Argument` if `self` is not a contiguous 1-D tensor or
    /// the shapes do not add up to its length.
    pub fn split_shaped(&self, shapes: &[&[usize]]) -> Result<Vec<Tensor>> {
        if self.dim() != 1 || !self.is_contiguous() {
            return Err(shape_err(
                "split_shaped",
                format!(
                    "needs a contiguous 1-D tensor, got shape {:?} strides {:?}",
                    self.shape(),
                    self.strides()
                ),
            ));
        }
        let sizes: Vec<usize> = shapes
            .iter()
            .map(|s| checked_numel("split_shaped", s))
            .collect::<Result<_>>()?;
        let total = sizes.iter().try_fold(0usize, |a, &n| a.checked_add(n));
        if total != Some(self.shape()[0]) {
            return Err(arg_err(
                "split_shaped",
                format!(
                    "pieces of {sizes:?} elements do not add up to the tensor's {}",
                    self.shape()[0]
                ),
            ));
        }
        let mut outs = Vec::with_capacity(shapes.len());
        let mut starts = Vec::with_capacity(shapes.len());
        let mut start = 0;
        for (shape, &len) in shapes.iter().zip(&sizes) {
            starts.push(start);
            outs.push(self.view_raw(
                shape.to_vec(),
                contiguous_strides(shape),
                self.offset() + start,
            ));
            start += len;
        }
        if !needs_grad(&[self]) {
            return Ok(outs);
        }
        let backward = SplitBackward {
            in_shape: self.shape().to_vec(),
            dtype: self.dtype(),
            dim: 0,
            sizes: sizes.clone(),
            starts,
            piece_shapes: Some(shapes.iter().map(|s| s.to_vec()).collect()),
            acc: None,
            filled: vec![false; sizes.len()],
        };
        Ok(record("split_shaped", &[self], &outs, backward))
    }

    /// Broadcasts to `shape` (a view with zero strides on broadcast dimensions; dimensions are
    /// aligned from the right, missing leading ones are added). Backward sums over them.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let out = self.expand_raw(shape)?;
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        let in_shape = self.shape().to_vec();
        Ok(record1(
            "expand",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                Ok(vec![g[0]
                    .as_ref()
                    .map(|g| crate::ops::reduce::sum_to(g, &in_shape))
                    .transpose()?])
            },
        ))
    }

    /// [`Tensor::expand`] without autograd.
    pub(crate) fn expand_raw(&self, shape: &[usize]) -> Result<Tensor> {
        checked_numel("expand", shape)?;
        let nd = shape.len();
        if self.dim() > nd {
            return Err(shape_err(
                "expand",
                format!("cannot expand {:?} to {shape:?}", self.shape()),
            ));
        }
        let lead = nd - self.dim();
        let mut strides = vec![0; nd];
        for i in 0..self.dim() {
            let (n, s) = (self.shape()[i], self.strides()[i]);
            if n == shape[lead + i] {
                strides[lead + i] = s;
            } else if n == 1 {
                strides[lead + i] = 0;
            } else {
                return Err(shape_err(
                    "expand",
                    format!("cannot expand {:?} to {shape:?}", self.shape()),
                ));
            }
        }
        Ok(self.view_raw(shape.to_vec(), strides, self.offset()))
    }

    /// Inserts a dimension of size 1 at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.dim() {
            return Err(arg_err(
                "unsqueeze",
                format!("dimension {dim} of a {}-d tensor", self.dim()),
            ));
        }
        let mut shape = self.shape().to_vec();
        shape.insert(dim, 1);
        self.reshape(&shape)
    }
}

/// A contiguous tensor of `shape` whose slices `start..start+len` along `dim` hold the given
/// gradients (zeros where `None` and outside every piece): a fill if needed, then one copy per
/// piece.
fn scatter_pieces(
    shape: &[usize],
    dtype: DType,
    like: &Tensor,
    dim: usize,
    pieces: &[(usize, usize, Option<Tensor>)],
) -> Result<Tensor> {
    let dev = like.device().clone();
    let stream = current_stream(&dev);
    let out = Tensor::empty_on(shape, dtype, &dev, &stream)?;
    let dst = out.operand_on("split_backward", &stream)?;
    let cs = contiguous_strides(shape);
    let covered: usize = pieces.iter().filter(|p| p.2.is_some()).map(|p| p.1).sum();
    let zero_all = covered != shape[dim];
    let mut copies = Vec::new();
    for (start, len, g) in pieces {
        let Some(g) = g else { continue };
        let mut pshape = shape.to_vec();
        pshape[dim] = *len;
        if g.shape() != pshape.as_slice() {
            return Err(shape_err(
                "split_backward",
                format!("piece gradient {:?}, expected {pshape:?}", g.shape()),
            ));
        }
        let src = g.span_operand("split_backward", &stream)?;
        let src_view = g.span_view();
        let dst_view = View {
            shape: pshape,
            strides: cs.clone(),
            offset: start * cs[dim],
        };
        copies.push((src, src_view, dst_view));
    }
    let k = Kernels::for_device(&dev)?;
    if zero_all {
        k.launch(
            &stream,
            &Fill {
                n: out.numel(),
                value: 0.0,
                out: &dst,
            },
        )?;
    }
    for (src, src_view, dst_view) in &copies {
        k.launch(
            &stream,
            &StridedCopy {
                src_view,
                src,
                dst_view,
                dst: &dst,
            },
        )?;
    }
    Ok(out)
}

/// Backward of `split`: every piece's gradient lands in one gradient of the input. Gradients are
/// folded in as they arrive ([`BackwardFn::accept`]): the first one allocates the input
/// gradient, each is copied into its place and freed right away, so the pieces' gradients never
/// coexist with the whole — the memory FSDP's flat-parameter views rely on. Several
/// contributions to one piece are added in arrival order, the same sums the engine's buffering
/// gives; gradients of hooked pieces arrive buffered in `run`.
struct SplitBackward {
    in_shape: Vec<usize>,
    dtype: DType,
    dim: usize,
    sizes: Vec<usize>,
    starts: Vec<usize>,
    /// For `split_shaped`: each piece's own shape (its gradient arrives in that shape).
    piece_shapes: Option<Vec<Vec<usize>>>,
    acc: Option<Tensor>,
    filled: Vec<bool>,
}

impl SplitBackward {
    fn region(&self, acc: &Tensor, slot: usize) -> Result<Tensor> {
        let r = acc.narrow(self.dim, self.starts[slot], self.sizes[slot])?;
        match &self.piece_shapes {
            Some(shapes) => r.view(&shapes[slot]),
            None => Ok(r),
        }
    }
}

impl BackwardFn for SplitBackward {
    fn accept(&mut self, slot: usize, g: Tensor) -> Result<Option<Tensor>> {
        // Pieces are contiguous regions of the input gradient only when every dimension before
        // `dim` has size 1 (always for 1-D splits, like FSDP's flat parameter); otherwise keep
        // the buffered path and its single strided scatter.
        let contiguous_pieces = self.in_shape[..self.dim].iter().all(|&d| d == 1);
        if !contiguous_pieces || slot >= self.filled.len() {
            return Ok(Some(g));
        }
        let acc = match &self.acc {
            Some(a) => a.clone(),
            None => {
                // Uninitialized: every piece is either overwritten by its gradient or zeroed in
                // `run` (pieces that got none, e.g. FSDP's padding) — no full memset.
                let a = Tensor::empty(&self.in_shape, self.dtype, g.device())?;
                self.acc = Some(a.clone());
                a
            }
        };
        // Later contributions are added in arrival order, as the engine's buffer would.
        let region = self.region(&acc, slot)?;
        if self.filled[slot] {
            region.add_(&g)?;
        } else {
            region.copy_(&g)?;
        }
        self.filled[slot] = true;
        Ok(None)
    }

    fn run(&mut self, grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        let Some(acc) = self.acc.take() else {
            // Nothing arrived early (or every slot is hooked): one scatter of all pieces.
            let pieces: Vec<(usize, usize, Option<Tensor>)> = self
                .starts
                .iter()
                .zip(&self.sizes)
                .zip(grads)
                .map(|((s, l), g)| -> Result<_> {
                    // split_shaped pieces arrive in their own shapes: flatten them to 1-D.
                    let g = match (&self.piece_shapes, g) {
                        (Some(_), Some(g)) => Some(g.reshape(&[*l])?),
                        (_, g) => g,
                    };
                    Ok((*s, *l, g))
                })
                .collect::<Result<_>>()?;
            let Some(any) = pieces.iter().find_map(|p| p.2.clone()) else {
                return Ok(vec![None]);
            };
            return Ok(vec![Some(scatter_pieces(
                &self.in_shape,
                self.dtype,
                &any,
                self.dim,
                &pieces,
            )?)]);
        };
        for (slot, g) in grads.into_iter().enumerate() {
            let region = self.region(&acc, slot)?;
            match g {
                Some(g) if self.filled[slot] => region.add_(&g)?,
                Some(g) => region.copy_(&g)?,
                None if !self.filled[slot] => region.zero_()?,
                None => {}
            }
        }
        // The node may run again (views reused by a later forward, or nodes without saved
        // tensors run by another backward): start that one from scratch.
        self.filled.iter_mut().for_each(|f| *f = false);
        Ok(vec![Some(acc)])
    }
}
