//! Replaying recorded init ops on a real device: the whole model, one unit, or one rank's shard
//! of a unit's flat parameter.

use std::sync::Arc;

use fsdp_alloc::{AllocError, Buffer, BufferRef, DType, Device, Stream};
use fsdp_autograd::nn::Module;
use fsdp_autograd::{current_stream, Parameter, Tensor};
use fsdp_flatparam::FlatParamLayout;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{MaterializeError, Result};
use crate::placement::{generation_device, host_readable, to_target};
use crate::plan::{InitPlan, Recipe};

/// Fails the current stream work with a message (the stream reports it at the next
/// synchronization, which every public function here performs before returning).
#[cold]
fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    panic!("fsdp-init: {what}: {e}")
}

/// Allocates on `stream`, turning an out-of-memory into [`MaterializeError::OutOfMemory`] with
/// context.
fn alloc(
    device: &Device,
    stream: &Stream,
    nbytes: usize,
    what: impl FnOnce() -> String,
) -> Result<Buffer> {
    device.alloc(nbytes, stream).map_err(|e| match e {
        e @ AllocError::OutOfMemory { .. } => MaterializeError::OutOfMemory {
            device: device.id(),
            what: what(),
            source: e,
        },
        e => MaterializeError::Alloc(e),
    })
}

/// Inside stream work: gives `f` the `f32` values to write into `dst` (a `dtype` range) and
/// stores them (converted for half dtypes, as the tensors' own kernels convert).
fn write_f32(dst: &BufferRef, dtype: DType, what: &str, f: impl FnOnce(&mut [f32])) {
    match dtype {
        DType::F32 => {
            let mut g = dst.write::<f32>().unwrap_or_else(|e| fail(what, e));
            f(&mut g);
        }
        DType::F16 => {
            let mut g = dst.write::<f16>().unwrap_or_else(|e| fail(what, e));
            let mut v = vec![0.0f32; g.len()];
            f(&mut v);
            g.convert_from_f32_slice(&v);
        }
        DType::BF16 => {
            let mut g = dst.write::<bf16>().unwrap_or_else(|e| fail(what, e));
            let mut v = vec![0.0f32; g.len()];
            f(&mut v);
            g.convert_from_f32_slice(&v);
        }
        d => fail(what, format!("dtype {d} is not a float type")),
    }
}

/// Inside stream work: reads `src` (a `dtype` range) as `f32`.
fn read_f32(src: &BufferRef, dtype: DType, what: &str) -> Vec<f32> {
    match dtype {
        DType::F32 => src.read::<f32>().unwrap_or_else(|e| fail(what, e)).to_vec(),
        DType::F16 => {
            let g = src.read::<f16>().unwrap_or_else(|e| fail(what, e));
            let mut v = vec![0.0f32; g.len()];
            g.convert_to_f32_slice(&mut v);
            v
        }
        DType::BF16 => {
            let g = src.read::<bf16>().unwrap_or_else(|e| fail(what, e));
            let mut v = vec![0.0f32; g.len()];
            g.convert_to_f32_slice(&mut v);
            v
        }
        d => fail(what, format!("dtype {d} is not a float type")),
    }
}

/// A byte sub-range of a buffer holding `dtype` elements.
fn elems(buf: &BufferRef, dtype: DType, start: usize, len: usize) -> Result<BufferRef> {
    let s = dtype.size();
    Ok(buf.slice(start * s, len * s)?)
}

/// Dtype shared by a unit's parameters (f32 for an empty unit).
fn unit_dtype(unit: &[Parameter]) -> Result<DType> {
    let Some(first) = unit.first() else {
        return Ok(DType::F32);
    };
    for p in unit {
        if p.dtype() != first.dtype() {
            return Err(MaterializeError::MixedDtypes {
                first: first.name().to_string(),
                first_dtype: first.dtype(),
                other: p.name().to_string(),
                other_dtype: p.dtype(),
            });
        }
    }
    if !first.dtype().is_float() {
        return Err(MaterializeError::UnsupportedDType {
            param: first.name().to_string(),
            dtype: first.dtype(),
        });
    }
    Ok(first.dtype())
}

fn check_layout(unit: &[Parameter], layout: &FlatParamLayout) -> Result<()> {
    if layout.num_params() != unit.len() {
        return Err(MaterializeError::LayoutMismatch {
            detail: format!(
                "the layout has {} parameters but the unit has {}",
                layout.num_params(),
                unit.len()
            ),
        });
    }
    for (i, (p, info)) in unit.iter().zip(layout.params()).enumerate() {
        if p.shape() != info.shape() {
            return Err(MaterializeError::LayoutMismatch {
                detail: format!(
                    "parameter {i} `{}` has shape {:?} but the layout says {:?}",
                    p.name(),
                    p.shape(),
                    info.shape()
                ),
            });
        }
    }
    Ok(())
}

fn describe_unit(unit: &[Parameter]) -> String {
    match unit {
        [] => "an empty unit".into(),
        [p] => format!("unit {{`{}`}}", p.name()),
        [p, .., q] => format!(
            "unit of {} parameters (`{}` … `{}`)",
            unit.len(),
            p.name(),
            q.name()
        ),
    }
}

impl InitPlan {
    /// Materializes every unmaterialized parameter of the plan on `device` (values bitwise equal
    /// to eager init; see [`InitPlan::materialize_unit`]).
    ///
    /// # Errors
    /// As [`InitPlan::materialize_unit`].
    pub fn materialize_all(&self, device: &Device) -> Result<()> {
        self.materialize_unit(self.params(), device)
    }

    /// Materializes the unmaterialized parameters of `unit` on `device`: each gets a tensor of
    /// its shape and dtype holding exactly the values an eager [`fsdp_autograd::InitContext`]
    /// with the same seed gives it, and becomes a leaf requiring grad if the parameter does.
    /// Already-materialized parameters are left alone.
    ///
    /// `CopyFrom` sources outside the unit are replayed from their recorded ops when they are
    /// position-wise ([`InitPlan::cross_unit_dependencies`]); the sources themselves stay
    /// unmaterialized. Work runs on the thread's current stream for `device`; the function waits
    /// for it, so errors (including a failing custom closure) are returned here.
    ///
    /// # Errors
    /// [`MaterializeError::CrossUnitDependency`], [`MaterializeError::UnknownSource`],
    /// [`MaterializeError::DependencyCycle`], invalid op arguments ([`MaterializeError::Init`]),
    /// [`MaterializeError::OutOfMemory`]. On error, parameters materialized before the failure
    /// keep their tensors.
    ///
    /// On a device without host-accessible memory (CUDA), each parameter is generated on a host
    /// staging device and copied over ([`crate::InitPlacement::HostThenCopy`]): same bits, one
    /// parameter at a time in host memory.
    pub fn materialize_unit(&self, unit: &[Parameter], device: &Device) -> Result<()> {
        self.check_unit(unit)?;
        let gen = generation_device(device);
        let stream = current_stream(&gen);
        let mut done: Vec<&Parameter> = Vec::new();
        for p in unit {
            if p.is_materialized() || done.iter().any(|q| q.ptr_eq(p)) {
                continue;
            }
            let r = self.recipe(p)?;
            let t = launch_whole(&r, &gen, &stream)?;
            let t = to_target(t, &gen, device)?;
            t.set_requires_grad(p.requires_grad())?;
            p.set(t)?;
            done.push(p);
        }
        stream.synchronize()?;
        Ok(())
    }

    /// Rank `rank`'s shard of `unit`'s flat parameter (laid out by `layout`, which must list the
    /// unit's shapes in order), as a 1-D tensor of `layout.chunk_numel()` elements of the unit's
    /// dtype on `device`, with zeros in the padding. The parameters themselves are not changed.
    ///
    /// * Unmaterialized, position-wise parameters (fill, uniform, normal, truncated normal,
    ///   Kaiming/Xavier, scale, and copies of such parameters): only this rank's elements are
    ///   generated, straight into the shard — nothing else is allocated.
    /// * Unmaterialized parameters with a whole-tensor op (`Orthogonal`, `Custom`) that this
    ///   rank holds a piece of: the whole parameter is built in a temporary `f32` buffer on `device`, its piece
    ///   copied, and the buffer freed before the next parameter (peak: shard + that parameter).
    /// * Materialized parameters (streaming an existing model): this rank's piece is copied from
    ///   the parameter's tensor (any device; converted to the unit's dtype if needed).
    ///
    /// Concatenating every rank's shard gives the flat parameter of the eager-initialized unit,
    /// bit for bit. All ranks check the whole unit (cross-unit dependencies, op arguments), so
    /// they agree on errors.
    ///
    /// # Errors
    /// [`MaterializeError::LayoutMismatch`], [`MaterializeError::MixedDtypes`],
    /// [`MaterializeError::Layout`] for a bad rank, the dependency errors of
    /// [`InitPlan::materialize_unit`], [`MaterializeError::Unreadable`] for a materialized
    /// parameter whose tensor is released or not contiguous, [`MaterializeError::OutOfMemory`].
    ///
    /// On a device without host-accessible memory (CUDA), the shard is generated on a host
    /// staging device and copied over ([`crate::InitPlacement::HostThenCopy`]); materialized
    /// parameters in device memory are first copied to the host whole.
    pub fn materialize_shard(
        &self,
        unit: &[Parameter],
        layout: &FlatParamLayout,
        rank: usize,
        device: &Device,
    ) -> Result<Tensor> {
        self.check_shard_args(unit, layout, rank)?;
        let gen = generation_device(device);
        let sources = unit
            .iter()
            .map(|p| p.try_get().map(|t| host_readable(p, t, &gen)).transpose())
            .collect::<Result<Vec<Option<Tensor>>>>()?;
        let shard = self.shard_from(unit, &sources, layout, rank, &gen)?;
        to_target(shard, &gen, device)
    }

    /// The checks every sharded materialization makes before it writes anything: the layout
    /// against the unit, one dtype, the rank, and the whole unit's dependencies and op
    /// arguments (so all ranks agree on errors).
    fn check_shard_args(
        &self,
        unit: &[Parameter],
        layout: &FlatParamLayout,
        rank: usize,
    ) -> Result<()> {
        check_layout(unit, layout)?;
        unit_dtype(unit)?;
        layout.rank_pieces(rank)?;
        self.check_unit(unit)
    }

    /// The unit-by-unit path: builds the unit's unmaterialized parameters whole in temporary
    /// tensors on `device`, copies rank `rank`'s shard out of them, and frees them. Peak device
    /// memory: what was allocated before + the whole unit + one shard. Returns the same shard,
    /// bit for bit, as [`InitPlan::materialize_shard`]. The parameters are not changed, so rank
    /// threads may share one fake model.
    ///
    /// # Errors
    /// As [`InitPlan::materialize_shard`].
    pub fn materialize_unit_sharded(
        &self,
        unit: &[Parameter],
        layout: &FlatParamLayout,
        rank: usize,
        device: &Device,
    ) -> Result<Tensor> {
        self.check_shard_args(unit, layout, rank)?;
        // CUDA targets: the unit is built on a host staging device and only the shard is copied
        // over, so the device's peak is the shards alone.
        let gen = generation_device(device);
        let stream = current_stream(&gen);
        let mut built: Vec<Tensor> = Vec::with_capacity(unit.len());
        for (i, p) in unit.iter().enumerate() {
            let t = match (p.try_get(), unit[..i].iter().position(|q| q.ptr_eq(p))) {
                (Some(t), _) => host_readable(p, t, &gen)?,
                (None, Some(j)) => built[j].clone(),
                (None, None) => launch_whole(&self.recipe(p)?, &gen, &stream)?,
            };
            built.push(t);
        }
        let sources: Vec<Option<Tensor>> = built.into_iter().map(Some).collect();
        let shard = self.shard_from(unit, &sources, layout, rank, &gen);
        // The unit's temporaries are freed here (stream order makes reuse safe).
        drop(sources);
        to_target(shard?, &gen, device)
    }

    /// Rank `rank`'s shard: pieces of parameters with a tensor in `sources` are copied from it,
    /// the others generated. The caller checked the unit and the layout.
    fn shard_from(
        &self,
        unit: &[Parameter],
        sources: &[Option<Tensor>],
        layout: &FlatParamLayout,
        rank: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let dtype = unit_dtype(unit)?;
        let pieces = layout.rank_pieces(rank)?;
        let padding = layout.shard(rank)?.padding_range_in_shard();
        let stream = current_stream(device);
        let chunk = layout.chunk_numel();
        let shard = alloc(device, &stream, chunk * dtype.size(), || {
            format!(
                "rank {rank}'s shard ({chunk} elements of {dtype}) of {}",
                describe_unit(unit)
            )
        })?;
        let sref = shard.data().clone();
        // Padding: zeros (reused allocator memory holds stale bytes).
        if !padding.is_empty() {
            let dst = elems(&sref, dtype, padding.start, padding.len())?;
            stream.launch(move || write_f32(&dst, dtype, "zero padding", |v| v.fill(0.0)));
        }
        for piece in pieces {
            let p = &unit[piece.param_index];
            let dst = elems(&sref, dtype, piece.offset_in_shard, piece.len)?;
            if let Some(t) = &sources[piece.param_index] {
                launch_copy_piece(
                    p.name(),
                    t,
                    piece.offset_in_param,
                    piece.len,
                    dst,
                    dtype,
                    &stream,
                )?;
                continue;
            }
            let r = self.recipe(p)?;
            let start = piece.offset_in_param;
            if r.positionwise {
                stream.launch(move || {
                    write_f32(&dst, dtype, &r.name, |v| {
                        r.eval_range(start, v).unwrap_or_else(|e| fail(&r.name, e))
                    })
                });
            } else {
                // Whole-tensor fallback: build the parameter, copy this rank's piece, free.
                let tmp = alloc(device, &stream, r.numel * 4, || {
                    format!(
                        "a temporary copy of `{}` ({} f32 elements; its init op `{}` needs the \
                         whole tensor) for rank {rank}'s shard",
                        r.name,
                        r.numel,
                        r.first_whole_op().unwrap_or_default()
                    )
                })?;
                let tref = tmp.data().clone();
                let len = piece.len;
                stream.launch(move || {
                    {
                        let mut g = tref.write::<f32>().unwrap_or_else(|e| fail(&r.name, e));
                        r.eval_whole(&mut g).unwrap_or_else(|e| fail(&r.name, e));
                    }
                    let g = tref.read::<f32>().unwrap_or_else(|e| fail(&r.name, e));
                    write_f32(&dst, dtype, &r.name, |v| {
                        v.copy_from_slice(&g[start..start + len])
                    });
                });
                // Freed now: later work on this stream may reuse it (stream order).
                drop(tmp);
            }
        }
        let t = Tensor::from_buffer(shard, &[chunk], dtype, device)?;
        stream.synchronize()?;
        Ok(t)
    }
}

/// Allocates `r`'s tensor on `stream` and launches the computation of all its values.
fn launch_whole(r: &Arc<Recipe>, device: &Device, stream: &Stream) -> Result<Tensor> {
    let nbytes = r.numel * r.dtype.size();
    let buf = alloc(device, stream, nbytes, || {
        format!(
            "parameter `{}` ({:?}, {}, {nbytes} bytes)",
            r.name, r.shape, r.dtype
        )
    })?;
    let dst = buf.data().clone();
    let r2 = Arc::clone(r);
    let dtype = r.dtype;
    stream.launch(move || {
        write_f32(&dst, dtype, &r2.name, |v| {
            r2.eval_whole(v).unwrap_or_else(|e| fail(&r2.name, e))
        })
    });
    Ok(Tensor::from_buffer(buf, &r.shape, r.dtype, device)?)
}

/// Launches the copy of elements `[start, start + len)` of a materialized parameter's tensor
/// into `dst` (a range of the shard, `dtype`), ordered after the work that produced the tensor.
fn launch_copy_piece(
    name: &str,
    t: &Tensor,
    start: usize,
    len: usize,
    dst: BufferRef,
    dtype: DType,
    stream: &Stream,
) -> Result<()> {
    let unreadable = |detail: String| MaterializeError::Unreadable {
        param: name.to_string(),
        detail,
    };
    if !t.is_contiguous() {
        return Err(unreadable(
            "its tensor is not contiguous; store a contiguous tensor in the parameter".into(),
        ));
    }
    if !t.dtype().is_float() {
        return Err(MaterializeError::UnsupportedDType {
            param: name.to_string(),
            dtype: t.dtype(),
        });
    }
    let buf = t.storage().buffer_ref().ok_or_else(|| {
        unreadable(
            "its storage is released (an FSDP-resharded view?); unshard it or re-create it".into(),
        )
    })?;
    let src_dtype = t.dtype();
    let src = elems(&buf, src_dtype, t.offset() + start, len)?;
    let src_stream = current_stream(t.device());
    if src_stream.id() != stream.id() {
        stream.wait_event(&src_stream.record_event());
    }
    let name = name.to_string();
    stream.launch(move || {
        if src_dtype == dtype {
            let s = src.read::<u8>().unwrap_or_else(|e| fail(&name, e));
            let mut d = dst.write::<u8>().unwrap_or_else(|e| fail(&name, e));
            d.copy_from_slice(&s);
        } else {
            let v = read_f32(&src, src_dtype, &name);
            write_f32(&dst, dtype, &name, |o| o.copy_from_slice(&v));
        }
    });
    Ok(())
}

/// Materializes every unmaterialized parameter of `model` on `device`, bitwise equal to eager
/// init with the seed the model was built with.
///
/// ```
/// use fsdp_alloc::Device;
/// use fsdp_autograd::{nn::{Gpt, GptConfig, parameters}, InitContext};
///
/// let cfg = GptConfig::tiny();
/// let fake = Gpt::new(&InitContext::fake(3), &cfg)?; // allocates nothing
/// let dev = Device::cpu(0);
/// fsdp_init::materialize(&fake, &dev)?;
/// let eager = Gpt::new(&InitContext::eager(&dev, 3), &cfg)?;
/// for (a, b) in parameters(&fake).iter().zip(parameters(&eager)) {
///     assert_eq!(a.get()?.to_vec::<f32>()?, b.get()?.to_vec::<f32>()?);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// As [`InitPlan::materialize_unit`].
pub fn materialize(model: &dyn Module, device: &Device) -> Result<()> {
    InitPlan::from_module(model)?.materialize_all(device)
}

/// Materializes one unit's parameters on `device` ([`InitPlan::materialize_unit`] with a plan
/// of just these parameters: a `CopyFrom` source outside them is an
/// [`MaterializeError::UnknownSource`] error — build an [`InitPlan`] of the whole model to
/// replay such sources).
///
/// # Errors
/// As [`InitPlan::materialize_unit`].
pub fn materialize_unit(params: &[Parameter], device: &Device) -> Result<()> {
    InitPlan::new(params.iter().cloned())?.materialize_unit(params, device)
}

/// Rank `rank`'s shard of the unit's flat parameter ([`InitPlan::materialize_shard`] with a plan
/// of just these parameters).
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_flatparam::FlatParamLayout;
///
/// let ctx = InitContext::fake(0);
/// let w = ctx.param("w", &[3, 2], DType::F32, vec![InitOp::Fill(1.0)])?;
/// let b = ctx.param("b", &[3], DType::F32, vec![InitOp::Fill(2.0)])?;
/// let layout = FlatParamLayout::new(&[vec![3, 2], vec![3]], 2)?; // 9 elements, chunk 5
/// let dev = Device::cpu(0);
/// let shard = fsdp_init::materialize_shard(&[w, b], &layout, 1, &dev)?;
/// assert_eq!(shard.to_vec::<f32>()?, [1.0, 2.0, 2.0, 2.0, 0.0]); // last element: padding
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// As [`InitPlan::materialize_shard`].
pub fn materialize_shard(
    params: &[Parameter],
    layout: &FlatParamLayout,
    rank: usize,
    device: &Device,
) -> Result<Tensor> {
    InitPlan::new(params.iter().cloned())?.materialize_shard(params, layout, rank, device)
}

/// Streaming an existing model (the paper's third option): rank `rank`'s shard of a unit whose
/// parameters are all materialized (e.g. a model built eagerly on a CPU device), copied piece
/// by piece onto `device` — only the shard is allocated there. Call it unit by unit; free the
/// source parameters ([`Parameter::take`]) once every rank has its shards.
///
/// ```
/// use fsdp_alloc::Device;
/// use fsdp_autograd::{nn::{parameters, Gpt, GptConfig}, InitContext};
/// use fsdp_flatparam::FlatParamLayout;
///
/// let cpu = Device::cpu(0);
/// let model = Gpt::new(&InitContext::eager(&cpu, 0), &GptConfig::tiny())?;
/// let unit = parameters(&model);
/// let shapes: Vec<Vec<usize>> = unit.iter().map(|p| p.shape().to_vec()).collect();
/// let layout = FlatParamLayout::new(&shapes, 2)?;
/// let rank_dev = Device::cpu(1);
/// let shard = fsdp_init::stream_shard(&unit, &layout, 1, &rank_dev)?;
/// assert_eq!(shard.numel(), layout.chunk_numel());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`MaterializeError::Unreadable`] if a parameter is not materialized (use
/// [`materialize_shard`] for fake parameters) or its tensor is released or not contiguous; the
/// layout, dtype and memory errors of [`InitPlan::materialize_shard`].
pub fn stream_shard(
    params: &[Parameter],
    layout: &FlatParamLayout,
    rank: usize,
    device: &Device,
) -> Result<Tensor> {
    if let Some(p) = params.iter().find(|p| !p.is_materialized()) {
        return Err(MaterializeError::Unreadable {
            param: p.name().to_string(),
            detail: "it is not materialized; use materialize_shard to generate fake parameters"
                .into(),
        });
    }
    InitPlan::new(params.iter().cloned())?.materialize_shard(params, layout, rank, device)
}
