//! `FlatParamHandle`: one FSDP unit and its runtime.
//!
//! A unit's parameters live as one flat parameter laid out by [`FlatParamLayout`]. Between uses
//! each rank holds only its *shard* (`chunk_numel` elements, f32). To compute, the unit is
//! *unsharded*: the shards are all-gathered into a buffer from the device allocator, the buffer is
//! attached to the unit's flat [`Storage`], and the original parameters become autograd-visible
//! views into it. *Resharding* releases the buffer again (PyTorch's `storage.resize_(0)`), while
//! the views — and the autograd graph that saved them — stay valid for the next unshard.
//!
//! The handle's methods do one unit's work given the [`CommContext`] (streams, groups, rate
//! limiter): [`FlatParamHandle::unshard`], [`FlatParamHandle::wait_for_unshard`],
//! [`FlatParamHandle::ensure_views`], [`FlatParamHandle::reshard`], and the post-backward steps
//! [`FlatParamHandle::take_unsharded_grad`], [`FlatParamHandle::keep_unsynced_grad`],
//! [`FlatParamHandle::reduce_grad`], [`FlatParamHandle::accumulate_shard_grad`]. *When* they run —
//! the hooks, the execution order, prefetching — is decided in `fsdp.rs`.

use fsdp_alloc::{DType, Event};
use fsdp_autograd::{no_grad, with_stream, Parameter, Storage, Tensor};
use fsdp_collectives::DeviceSlice;
use fsdp_flatparam::FlatParamLayout;

use crate::error::{ArgumentError, FsdpError, Result};
use crate::runtime::comm::{cast_on, CommContext};
use crate::runtime::offload;

/// One unit's runtime state.
pub(crate) struct FlatParamHandle {
    /// Module path of the unit ("" for the root).
    path: String,
    /// Layout of the flat parameter over the shard group.
    layout: FlatParamLayout,
    /// The original parameters, in layout order.
    params: Vec<Parameter>,
    /// Fully-qualified name of each parameter (first use).
    names: Vec<String>,
    /// This rank's shard (f32, `chunk_numel`); for `NoShard`, the whole padded flat parameter.
    shard: Tensor,
    /// The reduced gradient of the shard (f32), once a backward has produced one.
    shard_grad: Option<Tensor>,
    /// Dtype of the unsharded flat parameter (the mixed-precision param dtype, else f32).
    param_dtype: DType,
    /// Storage of the unsharded flat parameter (`padded_numel` of `param_dtype`); allocated only while
    /// unsharded. For `NoShard` it is the shard's own storage and is never released.
    storage: Storage,
    /// This iteration's flat leaf (created at the first unshard of an iteration).
    flat: Option<Tensor>,
    /// Whether `flat` and the views were created with grad mode on (a forward under `no_grad`
    /// creates views autograd does not track; a later training forward must not reuse them).
    flat_tracks_grad: bool,
    /// True while the storage holds the gathered parameters.
    unsharded: bool,
    /// Completion of the all-gather the compute stream has not waited on yet.
    pending_unshard: Option<Event>,
    /// Unsharded gradient accumulated locally while gradient sync is off (`no_sync`).
    unsynced_grad: Option<Tensor>,
    /// The post-backward reduction has run for this iteration.
    post_backward_done: bool,
}

impl FlatParamHandle {
    /// A unit holding `shard`, sharded (nothing gathered, no views yet).
    pub fn new(
        path: String,
        layout: FlatParamLayout,
        params: Vec<Parameter>,
        names: Vec<String>,
        shard: Tensor,
        param_dtype: DType,
        storage: Storage,
    ) -> FlatParamHandle {
        FlatParamHandle {
            path,
            layout,
            params,
            names,
            shard,
            shard_grad: None,
            param_dtype,
            storage,
            flat: None,
            flat_tracks_grad: false,
            unsharded: false,
            pending_unshard: None,
            unsynced_grad: None,
            post_backward_done: false,
        }
    }

    /// Module path of the unit ("" for the root).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Layout of the flat parameter over the shard group.
    pub fn layout(&self) -> &FlatParamLayout {
        &self.layout
    }

    /// The original parameters, in layout order.
    pub fn params(&self) -> &[Parameter] {
        &self.params
    }

    /// Fully-qualified name of each parameter (first use).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// This rank's shard (f32, `chunk_numel`); for `NoShard`, the whole padded flat parameter.
    pub fn shard(&self) -> &Tensor {
        &self.shard
    }

    /// The reduced gradient of the shard, once a backward has produced one.
    pub fn shard_grad(&self) -> Option<&Tensor> {
        self.shard_grad.as_ref()
    }

    /// Replaces the shard's gradient (`None` drops it).
    ///
    /// # Errors
    /// [`FsdpError::InvalidArgument`] if `grad` does not have the shard's element count.
    pub fn set_shard_grad(&mut self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.numel() != self.shard.numel() {
                return Err(FsdpError::InvalidArgument(ArgumentError::Count {
                    op: "set_shard_grad".into(),
                    what: format!("the gradient for unit `{}`", self.path),
                    counted: "elements",
                    actual: g.numel(),
                    expected: self.shard.numel(),
                }));
            }
        }
        self.shard_grad = grad;
        Ok(())
    }

    /// Drops the shard's gradient and the unsharded one kept while gradient sync is off.
    pub fn zero_grad(&mut self) {
        self.shard_grad = None;
        self.unsynced_grad = None;
    }

    /// Starts an iteration: drops the views of the previous one and clears the post-backward
    /// mark.
    pub fn start_iteration(&mut self) {
        self.drop_views();
        self.post_backward_done = false;
    }

    /// Whether this iteration's post-backward step has run.
    pub fn post_backward_done(&self) -> bool {
        self.post_backward_done
    }

    /// Records that this iteration's post-backward step has run (the gradient was reduced or
    /// kept unsynced).
    pub fn mark_post_backward_done(&mut self) {
        self.post_backward_done = true;
    }

    /// Bytes of the unsharded flat parameter, in the param dtype (what an unshard allocates and
    /// gathers).
    pub fn unsharded_bytes(&self) -> usize {
        self.layout.padded_numel() * self.param_dtype.size()
    }

    /// Bytes of the unsharded flat parameter kept in f32 (the stored precision: parameter
    /// counts and memory predictions do not depend on mixed precision).
    pub fn f32_bytes(&self) -> usize {
        self.layout.padded_numel() * DType::F32.size()
    }

    /// Issues the all-gather of the unit (if it is not unsharded already) into its flat
    /// parameter's storage, on the unshard stream after `params_ready` (the last update of the
    /// shards), through the rate limiter. The compute stream does not wait and the parameters
    /// are not pointed at it yet (see [`FlatParamHandle::wait_for_unshard`]), so a prefetched
    /// gather overlaps the current compute. Under mixed precision the f32 shard is cast once and
    /// gathered in the param dtype.
    pub fn unshard(&mut self, ctx: &CommContext, params_ready: &Event) -> Result<()> {
        if self.unsharded {
            return Ok(());
        }
        if ctx.sharded {
            ctx.acquire_for_all_gather()?;
            ctx.drop_released_buffers();
            ctx.unshard_stream.wait_event(params_ready);
            let bytes = self.unsharded_bytes();
            let buf = ctx.device.alloc(bytes, &ctx.unshard_stream)?;
            let out = DeviceSlice::new(buf.data().clone(), self.param_dtype)?;
            let shard =
                offload::shard_on_device(ctx, &self.shard, &ctx.unshard_stream, params_ready)?;
            let input = cast_on(&ctx.unshard_stream, shard, self.param_dtype)?;
            let gathered = match ctx.quant {
                // Quantized: int8 codes and scales on the wire, dequantized into f32.
                Some(codec) if input.numel() > 0 => ctx.all_gather_int8(codec, &input, &out)?,
                _ => ctx.all_gather(&input, &out, bytes)?,
            };
            self.storage.attach(buf)?;
            self.pending_unshard = Some(gathered);
        }
        self.unsharded = true;
        Ok(())
    }

    /// Makes the compute stream wait for the unit's all-gather, if it has not yet, and points
    /// the parameters at this iteration's views of the gathered flat parameter
    /// ([`FlatParamHandle::ensure_views`], registering `post_backward` if it creates them).
    pub fn wait_for_unshard<F>(&mut self, ctx: &CommContext, post_backward: F) -> Result<()>
    where
        F: Fn(&Tensor) -> fsdp_autograd::Result<()> + Send + Sync + 'static,
    {
        if let Some(ev) = self.pending_unshard.take() {
            ctx.compute.wait_event(&ev);
        }
        // The views are created here, when the unit is about to compute, not when its gather
        // was issued: autograd runs backward work in reverse creation order, so views created
        // early for a prefetched unit would put its gradient (and its reduce-scatter) after the
        // backward of the unit that ran before it.
        self.ensure_views(post_backward)
    }

    /// Creates this iteration's flat leaf and the parameter views, once per iteration; when the
    /// unit has trainable parameters, `post_backward` becomes the flat leaf's
    /// post-accumulate-grad hook (it fires once the unit's flat gradient is final).
    pub fn ensure_views<F>(&mut self, post_backward: F) -> Result<()>
    where
        F: Fn(&Tensor) -> fsdp_autograd::Result<()> + Send + Sync + 'static,
    {
        let grad_mode = fsdp_autograd::is_grad_enabled();
        // Views made under `no_grad` (an evaluation forward) are not reused for training.
        if self.flat.is_some() && (self.flat_tracks_grad || !grad_mode) {
            return Ok(());
        }
        self.flat_tracks_grad = grad_mode;
        let padded = self.layout.padded_numel();
        let total = self.layout.total_numel();
        // Split the padded flat parameter straight into parameter-shaped views (the padding is a
        // last, unused piece): one node, whose backward folds each parameter's gradient into one
        // padded flat gradient the moment it is computed.
        let pad = [padded - total];
        let mut shapes: Vec<&[usize]> = self.params.iter().map(|p| p.shape()).collect();
        shapes.push(&pad);
        let any_trainable = self.params.iter().any(|p| p.requires_grad());
        let dtype = self.param_dtype;
        let flat = Tensor::from_storage(self.storage.clone(), &[padded], &[1], 0, dtype)?;
        if any_trainable {
            flat.set_requires_grad(true)?;
            flat.register_post_accumulate_grad_hook_fallible(post_backward)?;
        }
        // Frozen parameters view a second, gradient-free alias of the same storage.
        let frozen = Tensor::from_storage(self.storage.clone(), &[padded], &[1], 0, dtype)?;
        let trainable_views = flat.split_shaped(&shapes)?;
        let frozen_views = frozen.split_shaped(&shapes)?;
        for ((p, tv), fv) in self.params.iter().zip(trainable_views).zip(frozen_views) {
            p.set(if p.requires_grad() { tv } else { fv })?;
        }
        self.flat = Some(flat);
        Ok(())
    }

    /// Frees the gathered buffer (keeping views and graph valid for the next unshard); the
    /// buffer is reusable once the compute work launched so far has run. Nothing to do for a
    /// sharded unit or under `NoShard`.
    pub fn reshard(&mut self, ctx: &CommContext) {
        if !self.unsharded || !ctx.sharded {
            return;
        }
        self.unsharded = false;
        self.pending_unshard = None;
        let Some(buf) = self.storage.release() else {
            return;
        };
        // The compute stream read the buffer; it is free once the compute work launched so far
        // has run.
        let consumed = ctx.compute.record_event();
        ctx.release_gathered(buf, consumed);
    }

    /// Drops this iteration's flat leaf and views' graph (the end of an iteration).
    pub fn drop_views(&mut self) {
        self.flat = None;
    }

    /// Post-backward step 1: takes the unit's unsharded flat gradient off the flat leaf and adds
    /// the gradient kept from earlier micro-batches without communication (`no_sync`), on the
    /// compute stream. `None` if this iteration produced no gradient for the unit.
    pub fn take_unsharded_grad(&mut self, ctx: &CommContext) -> Result<Option<Tensor>> {
        let Some(flat) = self.flat.clone() else {
            return Ok(None);
        };
        let Some(grad) = flat.grad() else {
            return Ok(None);
        };
        flat.set_grad(None)?;
        Ok(Some(match self.unsynced_grad.take() {
            Some(acc) => {
                with_stream(&ctx.compute, || no_grad(|| acc.add_(&grad)))?;
                acc
            }
            None => grad,
        }))
    }

    /// Post-backward with gradient sync off: keeps the unsharded gradient for the next
    /// micro-batch (no communication).
    pub fn keep_unsynced_grad(&mut self, grad: Tensor) {
        self.unsynced_grad = Some(grad);
    }

    /// Post-backward step 2: reduces the unsharded gradient across ranks on the reduce stream
    /// and returns this rank's reduced gradient shard in f32 (not yet accumulated). The gradient
    /// is cast to the reduce dtype on the compute stream, then reduce-scattered over the shard
    /// group (and all-reduced over the replicate group for HybridShard), or all-reduced whole
    /// for `NoShard`.
    pub fn reduce_grad(&self, ctx: &CommContext, grad: Tensor) -> Result<Tensor> {
        // Mixed precision: communicate in the reduce dtype (cast on the compute stream).
        let grad = cast_on(&ctx.compute, grad, ctx.reduce_dtype)?;
        ctx.reduce_stream.wait_event(&ctx.compute.record_event());
        let reduced = self.issue_reduction(ctx, &grad)?;
        // The unsharded gradient was produced on the compute stream and is read on the reduce
        // stream: its memory must not be reused by compute work before the reduction ran.
        grad.storage()
            .with_buffer(|b| b.record_stream(&ctx.reduce_stream));
        drop(grad);
        // The sharded gradient is kept in f32 for the optimizer.
        cast_on(&ctx.reduce_stream, reduced, DType::F32)
    }

    /// Issues the collectives of [`FlatParamHandle::reduce_grad`] on `grad` (already in the
    /// reduce dtype); returns the tensor that holds the reduced shard once they ran.
    fn issue_reduction(&self, ctx: &CommContext, grad: &Tensor) -> Result<Tensor> {
        if !ctx.sharded {
            ctx.all_reduce(&ctx.group, grad)?;
            return Ok(grad.clone());
        }
        let chunk = self.layout.chunk_numel();
        let out = with_stream(&ctx.reduce_stream, || {
            Tensor::empty(&[chunk], grad.dtype(), &ctx.device)
        })?;
        match ctx.quant {
            Some(codec) if chunk > 0 => ctx.reduce_scatter_int8(codec, grad, &out)?,
            _ => ctx.reduce_scatter(grad, &out)?,
        }
        if let Some(rep) = &ctx.replicate {
            ctx.all_reduce(rep, &out)?;
        }
        Ok(out)
    }

    /// Post-backward step 3: accumulates the reduced f32 gradient shard into the unit's sharded
    /// gradient (or makes it the sharded gradient) where the shards live: on the reduce stream,
    /// or under CPU offload downloaded to the host device on the copy stream and added on the
    /// host stream. Returns the event after which the sharded gradient is complete.
    pub fn accumulate_shard_grad(&mut self, ctx: &CommContext, reduced: Tensor) -> Result<Event> {
        if !ctx.offload {
            match &self.shard_grad {
                Some(acc) => with_stream(&ctx.reduce_stream, || no_grad(|| acc.add_(&reduced)))?,
                None => self.shard_grad = Some(reduced),
            }
            return Ok(ctx.reduce_stream.record_event());
        }
        // Download the reduced shard gradient on the copy stream (after the reduction), into
        // host memory the host stream accumulates from once the copy's event is reached.
        let host_grad = offload::download(
            reduced,
            &ctx.host,
            &ctx.copy_stream,
            &ctx.reduce_stream,
            &ctx.host_stream,
        )?;
        match &self.shard_grad {
            Some(acc) => with_stream(&ctx.host_stream, || no_grad(|| acc.add_(&host_grad)))?,
            None => self.shard_grad = Some(host_grad),
        }
        Ok(ctx.host_stream.record_event())
    }
}
