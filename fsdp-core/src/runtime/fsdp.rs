//! The FSDP runtime: wrapping a model, the unshard / reshard / reduce choreography driven by
//! module and autograd hooks, prefetching, rate limiting, and the sharded optimizer step.
//!
//! This file decides *when* a unit's work runs: the hooks, the execution order (recorded, and
//! verified across ranks) and the prefetch decisions. *What* a unit does — gather, views, free,
//! reduce its gradient, accumulate the sharded gradient — is
//! [`FlatParamHandle`](crate::runtime::handle::FlatParamHandle)'s, within the rank's
//! [`CommContext`](crate::runtime::comm::CommContext) (streams, groups, rate limiter, statistics).
//!
//! ## One iteration, per unit (the paper's §4)
//! - **pre-forward** (module pre-hook): all-gather the unit's shards into a buffer on the
//!   *unshard* stream (through the rate limiter), make the compute stream wait on it, and point the
//!   original parameters at autograd views of the gathered flat parameter. With forward prefetch,
//!   also issue the next unit's all-gather (from the previous iteration's order).
//! - **post-forward** (module post-hook): reshard (free the gathered buffer) unless the strategy
//!   keeps it (`ShardGradOp`, `NoShard`), the unit is the root, or it ran last in the previous
//!   forward (its backward comes first; [`FsdpConfig::keep_last_unit_unsharded`]); register a
//!   gradient hook on the unit's output — the **pre-backward** point.
//! - **pre-backward** (tensor hook on the output): unshard again; with `BackwardPre`, issue the
//!   next unit's all-gather (reverse forward order) before this unit's reduce-scatter.
//! - **post-backward** (post-accumulate-grad hook on the unit's flat leaf, fired once its gradient
//!   is final): reduce-scatter the flat gradient on the *reduce* stream into the sharded gradient
//!   (accumulating), all-reduce across replicas for `HybridShard`, free the unsharded gradient,
//!   reshard; with `BackwardPost`, prefetch the next unit after issuing the reduction.
//! - **end of backward** (queued callback): the compute stream waits for every pending reduction;
//!   units still unsharded are resharded; the forward order is kept for the next iteration.
//!
//! The adaptive rate limiter and quantized collectives are described on [`Fsdp`].

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use fsdp_alloc::{trace, DType, Device, Event, RateLimiter, Stream};
use fsdp_autograd::nn::Module;
use fsdp_autograd::{
    in_backward, queue_callback_fallible, with_stream, Parameter, Storage, Tensor,
};
use fsdp_collectives::ProcessGroup;
use fsdp_flatparam::FlatParamLayout;
use fsdp_init::InitPlan;

pub use crate::runtime::comm::{CommStats, LimiterStatus};
// Collective plumbing, here for the modules that import it from `crate::runtime::fsdp`.
pub(crate) use crate::runtime::comm::{gather_flat, tensor_slice};

use crate::config::{BackwardPrefetch, DeferredInit, FsdpConfig, LimitAllGathers, Quantization};
use crate::error::{ConfigError, DtypeError, FsdpError, Result};
use crate::runtime::comm::{AutoLimit, CommContext, Ledger};
use crate::runtime::handle::FlatParamHandle;
use crate::runtime::offload;
use crate::runtime::units::{describe, for_each_module};
pub use crate::runtime::units::{Comm, FullParameter, ParamBytes, UnitInfo, UnitShard};
use crate::wrap::plan_units;

#[derive(Default)]
struct IterState {
    /// A forward has started and its backward has not finished.
    open: bool,
    /// Units in the order their forward started this iteration.
    order: Vec<usize>,
    /// The previous iteration's order (drives forward prefetch).
    prev_order: Vec<usize>,
    /// The end-of-backward callback is queued.
    callback_queued: bool,
    /// Completion events of reductions the compute stream has not waited on yet.
    pending_reductions: Vec<Event>,
    /// Backward passes whose forward order was compared across ranks.
    orders_verified: usize,
}

struct State {
    units: Vec<FlatParamHandle>,
    iter: IterState,
    /// Reduce gradients in post-backward (off inside `no_sync`).
    sync_grads: bool,
    /// The shards are up to date once this event (after the optimizer step) completes.
    params_ready: Event,
    /// Open timeline spans per unit (forward: pre- to post-forward hook; backward: pre- to
    /// post-backward hook), only while `fsdp_alloc::trace` records.
    spans: Vec<[Option<trace::Span>; 2]>,
}

const FWD: usize = 0;
const BWD: usize = 1;

pub(crate) struct Inner {
    /// Streams, groups, rate limiter and the collectives' bookkeeping.
    ctx: CommContext,
    config: FsdpConfig,
    state: Mutex<State>,
}

/// A model wrapped with Fully Sharded Data Parallel.
///
/// Built by [`Fsdp::wrap`] on every rank with the same model (same seed, same structure).
/// Call [`Fsdp::forward`] (not the model's `call`) so the root unit's hooks run, then `backward`
/// on the loss as usual, then [`Fsdp::sgd_step`] and [`Fsdp::zero_grad`].
///
/// ## The adaptive rate limiter
/// With [`crate::LimitAllGathers::Auto`] the limiter starts off. Before every all-gather (and at
/// the start of every iteration, to count retries of the optimizer step) the runtime reads the
/// device allocator's `num_alloc_retries`; a new retry turns the limiter on at once. After
/// `clean_iterations_to_disable` iterations in a row without a retry it turns off again; each
/// time it has to come back on, the clean streak it needs doubles (so a model that needs it
/// does not flap). The limiter only delays the issuing thread, never changes what is computed:
/// every parity law holds in all three modes. While off, the runtime does exactly what it does
/// with `limit_all_gathers: false`. [`Fsdp::limiter_status`] reports the state.
///
/// ## Quantized collectives
/// With [`FsdpConfig::quantize_collectives`] = [`Quantization::Int8`] (sharded strategies, f32
/// communication), each unshard quantizes this rank's f32 shard into int8 codes with one f32
/// scale per block (`scale = max|x|/127`, round to nearest; [`fsdp_collectives::Int8Codec`]),
/// all-gathers those packets as bytes and dequantizes every rank's packet into the unsharded
/// f32 flat parameter, on the unshard stream. Each post-backward reduction quantizes the W
/// destination chunks of the f32 flat gradient, exchanges them with
/// [`fsdp_collectives::ProcessGroup::all_to_all_into`], and sums the W dequantized chunks in
/// f32 in rank order on the reduce stream (each contribution is quantized once, so errors do
/// not compound across ranks). [`CommStats`] counts the packets' bytes: about a quarter of the
/// f32 bytes plus 4 bytes per block per rank. HybridShard's replicate all-reduce stays f32.
///
/// What changes, precisely: the forward and backward compute on dequantized parameters (each
/// element within `max|block|/254` of the f32 shard value) and the optimizer sees the sum of
/// dequantized gradient chunks (each rank's contribution within `max|block|/254` per element).
/// So these laws **do not hold** with quantization on: FSDP == local training bit for bit (in
/// every strategy, with prefetching, gradient accumulation, clipping, scalers, CPU offload), and
/// results independent of the world size or the shard-group size (each size quantizes other
/// chunks in other blocks). These still hold: the thread and MPI backends equal each other bit
/// for bit (the same deterministic codec and rank-ordered sum on both); determinism run to run;
/// every rank computing on the same dequantized parameters; the shards and the optimizer state
/// staying f32 (quantization is on the wire only); exact state dicts and `full_parameters`
/// (they gather unquantized f32); and with quantization off, everything bit for bit as before.
pub struct Fsdp<M: Module> {
    model: M,
    inner: Arc<Inner>,
}

impl<M: Module> std::fmt::Debug for Fsdp<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fsdp")
            .field("device", &self.inner.ctx.device.id())
            .field("group", &self.inner.ctx.group.name())
            .field("config", &self.inner.config)
            .finish()
    }
}

impl<M: Module + 'static> Fsdp<M> {
    /// Wraps `model` (already built, with the same values, on every rank) for training on
    /// `device` over `comm`. Each unit's parameters are flattened and this rank keeps only its
    /// shard; the original parameter tensors are freed.
    ///
    /// # Errors
    /// A policy naming a missing module, `HybridShard` without a mesh, a parameter that is not
    /// f32 or not materialized, or device/collective errors.
    pub fn wrap(
        model: M,
        device: &Device,
        comm: impl Into<Comm>,
        config: FsdpConfig,
    ) -> Result<Self> {
        let comm = comm.into();
        let (group, replicate) = match (&comm, config.strategy.replicates()) {
            (Comm::Mesh(m), true) => (
                Arc::clone(m.shard_group()),
                Some(Arc::clone(m.replicate_group())),
            ),
            (Comm::Group(_), true) => {
                return Err(FsdpError::Config(ConfigError::NeedsMesh {
                    strategy: config.strategy.name(),
                }))
            }
            (Comm::Mesh(m), _) => (Arc::clone(m.world()), None),
            (Comm::Group(g), _) => (Arc::clone(g), None),
        };
        let (param_dtype, reduce_dtype) = match config.mixed_precision {
            None => (DType::F32, DType::F32),
            Some(mp) => (mp.param_dtype, mp.reduce_dtype),
        };
        for (field, d) in [("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)] {
            if !matches!(d, DType::F32 | DType::BF16 | DType::F16) {
                return Err(FsdpError::Config(ConfigError::MixedPrecisionDtype {
                    field,
                    dtype: d,
                }));
            }
        }
        if !config.strategy.is_sharded() && param_dtype != DType::F32 {
            return Err(FsdpError::Config(ConfigError::NeedsShardedStrategy {
                setting: "mixed_precision (low-precision parameters)",
                reason: "NoShard keeps full f32 parameters in place",
            }));
        }
        let quant = match config.quantize_collectives {
            None => None,
            Some(Quantization::Int8 { block }) => {
                if !config.strategy.is_sharded() {
                    return Err(FsdpError::Config(ConfigError::NeedsShardedStrategy {
                        setting: "quantize_collectives",
                        reason: "it quantizes the all-gathers and reduce-scatters of a sharded \
                                 strategy, and NoShard only all-reduces",
                    }));
                }
                if (param_dtype, reduce_dtype) != (DType::F32, DType::F32) {
                    return Err(FsdpError::Config(ConfigError::QuantizedMixedPrecision));
                }
                Some(
                    fsdp_collectives::Int8Codec::new(block)
                        .map_err(|e| FsdpError::Config(ConfigError::Quantization(Box::new(e))))?,
                )
            }
        };
        let factor = if config.strategy.is_sharded() {
            group.size()
        } else {
            1
        };
        let rank = if config.strategy.is_sharded() {
            group.rank()
        } else {
            0
        };

        let (infos, all_params) = describe(&model);
        let init_plan = InitPlan::new(all_params.iter().cloned())?;
        let plans = plan_units(&infos, &config.wrap_policy)?;
        let compute = fsdp_autograd::current_stream(device);
        let unshard_stream = device.new_stream("fsdp-unshard");
        let reduce_stream = device.new_stream("fsdp-reduce");
        let (host, host_stream, offload) = match &config.cpu_offload {
            Some(h) => {
                offload::check_offload_devices(device.id(), h.id())?;
                if !config.strategy.is_sharded() {
                    return Err(FsdpError::Config(ConfigError::NeedsShardedStrategy {
                        setting: "cpu_offload",
                        reason: "NoShard computes on the full parameters in place",
                    }));
                }
                if h == device {
                    return Err(FsdpError::Config(ConfigError::OffloadToComputeDevice {
                        device: device.id(),
                    }));
                }
                (h.clone(), fsdp_autograd::current_stream(h), true)
            }
            None => (device.clone(), compute.clone(), false),
        };
        // CPU offload: every host↔device copy runs on its own stream of the compute device.
        let copy_stream = if offload {
            device.new_stream("fsdp-offload-copy")
        } else {
            compute.clone()
        };

        let mut units = Vec::with_capacity(plans.len());
        for plan in &plans {
            let params: Vec<Parameter> = plan
                .params
                .iter()
                .map(|(_, id, _)| all_params[*id].clone())
                .collect();
            let names: Vec<String> = plan.params.iter().map(|(n, _, _)| n.clone()).collect();
            let shapes: Vec<Vec<usize>> = params.iter().map(|p| p.shape().to_vec()).collect();
            let layout = FlatParamLayout::new(&shapes, factor)?;
            for (p, n) in params.iter().zip(&names) {
                if p.dtype() != DType::F32 {
                    return Err(FsdpError::Dtype(DtypeError {
                        op: "Fsdp::wrap".into(),
                        what: format!("parameter `{n}`"),
                        actual: p.dtype(),
                        expected: DType::F32,
                        why: "FSDP keeps f32 parameters (low precision comes from mixed \
                              precision, not from the stored dtype)",
                    }));
                }
            }
            // This rank's shard: copied from materialized parameters (an eager or streamed
            // model), generated directly from the recorded init ops for parameters built on the
            // fake device (deferred init) — bit for bit what eager init would have produced.
            let shard = with_stream(&host_stream, || match config.deferred_init {
                DeferredInit::ShardOnly => {
                    init_plan.materialize_shard(&params, &layout, rank, &host)
                }
                DeferredInit::UnitByUnit => {
                    init_plan.materialize_unit_sharded(&params, &layout, rank, &host)
                }
            })?;
            let storage = if config.strategy.is_sharded() {
                // No memory until the unit is first unsharded.
                Storage::unallocated(layout.padded_numel() * param_dtype.size(), device)
            } else {
                shard.storage().clone()
            };
            // Free the original parameter tensors: from now on the parameters are views.
            for p in &params {
                drop(p.take());
            }
            units.push(FlatParamHandle::new(
                plan.path.clone(),
                layout,
                params,
                names,
                shard,
                param_dtype,
                storage,
            ));
        }
        let params_ready = host_stream.record_event();
        let mode = config.limit_mode();
        let limiter = (mode != LimitAllGathers::Off && config.strategy.is_sharded())
            .then(|| RateLimiter::new(config.max_inflight_all_gathers));
        let auto_limit = match mode {
            LimitAllGathers::Auto(a) if limiter.is_some() => Some(AutoLimit::new(a, device)),
            _ => None,
        };
        let ctx = CommContext {
            device: device.clone(),
            compute,
            host,
            host_stream,
            offload,
            copy_stream,
            unshard_stream,
            reduce_stream,
            group,
            replicate,
            sharded: config.strategy.is_sharded(),
            buffer_lifetime: config.buffer_lifetime,
            reduce_dtype,
            limiter,
            auto_limit,
            quant,
            ledger: Mutex::new(Ledger::default()),
        };
        let inner = Arc::new(Inner {
            ctx,
            config,
            state: Mutex::new(State {
                units,
                iter: IterState::default(),
                sync_grads: true,
                params_ready,
                spans: Vec::new(),
            }),
        });

        // Install the unit hooks on the unit modules.
        let unit_paths: Vec<String> = plans.iter().map(|p| p.path.clone()).collect();
        for_each_module(&model, "", &mut |path, m| {
            if let Some(u) = unit_paths.iter().position(|p| p == path) {
                let w = Arc::downgrade(&inner);
                m.hooks().register_forward_pre_hook(move |_x| {
                    Inner::upgrade(&w)?.pre_forward(u)?;
                    Ok(None)
                });
                let w = Arc::downgrade(&inner);
                m.hooks().register_forward_hook(move |_x, y| {
                    Inner::upgrade(&w)?.post_forward(u, y)?;
                    Ok(None)
                });
            }
        });
        Ok(Fsdp { model, inner })
    }

    /// The wrapped model.
    pub fn module(&self) -> &M {
        &self.model
    }

    /// Runs the model's forward through its hooks (the root unit's included).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.ctx.check_works()?;
        Ok(self.model.call(x)?)
    }

    /// Returns the first error among this instance's completed collectives (keeps the running
    /// ones): what every step entry point checks first.
    pub(crate) fn check_works(&self) -> Result<()> {
        self.inner.ctx.check_works()
    }

    /// Every unit's sharded state on this rank (cheap handles; see [`UnitShard`]).
    pub fn shards(&self) -> Vec<UnitShard> {
        let st = self.inner.lock();
        let rank = if self.inner.config.strategy.is_sharded() {
            self.inner.ctx.group.rank()
        } else {
            0
        };
        st.units
            .iter()
            .map(|h| UnitShard {
                path: h.path().to_string(),
                names: h.names().to_vec(),
                layout: h.layout().clone(),
                rank,
                shard: h.shard().clone(),
                grad: h.shard_grad().cloned(),
                requires_grad: h.params().iter().map(|p| p.requires_grad()).collect(),
            })
            .collect()
    }

    /// Replaces unit `unit`'s sharded gradient (e.g. after unscaling into a new tensor);
    /// `None` drops it.
    pub fn set_shard_grad(&self, unit: usize, grad: Option<Tensor>) -> Result<()> {
        let mut st = self.inner.lock();
        let n = st.units.len();
        st.units
            .get_mut(unit)
            .ok_or(FsdpError::UnknownUnit { unit, units: n })?
            .set_shard_grad(grad)
    }

    /// Tells FSDP the shards were updated on the compute stream (after an optimizer step or a
    /// state-dict load): the next all-gather waits for everything launched there so far.
    pub fn params_updated(&self) {
        let ev = self.inner.ctx.host_stream.record_event();
        let mut st = self.inner.lock();
        st.params_ready = ev;
        self.inner.drop_stale_gathers(&mut st);
    }

    /// The group parameters are sharded over (all ranks for FullShard/ShardGradOp/NoShard, the
    /// shard group for HybridShard).
    pub fn shard_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.inner.ctx.group
    }

    /// For HybridShard, the group of ranks holding the same shard (replicas).
    pub fn replicate_group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.inner.ctx.replicate.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.inner.config
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.inner.ctx.device
    }

    /// The compute stream (the device's current stream when wrapping).
    pub fn compute_stream(&self) -> &Stream {
        &self.inner.ctx.compute
    }

    /// Where the shards and sharded gradients live and optimizer work must be launched: the
    /// host stream under CPU offload, else the compute stream.
    pub fn optimizer_stream(&self) -> &Stream {
        &self.inner.ctx.host_stream
    }

    /// Under CPU offload, the compute device's stream that every host↔device copy runs on
    /// (shard uploads before their all-gathers, gradient downloads after their reductions),
    /// ordered by events; `None` without offload. Work launched on it delays the copies, never
    /// what they compute (the tests hold it up to show that).
    pub fn offload_copy_stream(&self) -> Option<&Stream> {
        self.inner
            .ctx
            .offload
            .then_some(&self.inner.ctx.copy_stream)
    }

    /// The device holding the shards: the offload host device, else the compute device.
    pub fn shard_device(&self) -> &Device {
        &self.inner.ctx.host
    }

    /// Turns gradient synchronization off (`false`) or back on. While off, post-backward keeps
    /// each unit's *unsharded* gradient on this rank and accumulates into it (no communication,
    /// more memory: one full gradient per unit); the first backward with sync on adds the kept
    /// gradient and reduces once. PyTorch's `set_requires_gradient_sync`.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.inner.lock().sync_grads = sync;
    }

    /// Runs `f` (forward and backward of micro-batches) with gradient synchronization off; see
    /// [`Fsdp::set_requires_gradient_sync`]. Sync is turned back on afterwards, also on error.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a Inner);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.lock().sync_grads = true;
            }
        }
        self.set_requires_gradient_sync(false);
        let _restore = Restore(&self.inner);
        f()
    }

    /// Drops the sharded gradients (and unsharded ones kept by [`Fsdp::no_sync`]).
    pub fn zero_grad(&self) {
        for h in &mut self.inner.lock().units {
            h.zero_grad();
        }
    }

    /// Waits for all work of this rank and reports the first collective or stream error.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.ctx.device.synchronize()?;
        let works = self.inner.ctx.take_works();
        for w in works {
            w.wait()?;
        }
        Ok(())
    }

    /// Bytes communicated since wrapping, in the dtypes communicated (see [`CommStats`]).
    pub fn comm_stats(&self) -> CommStats {
        self.inner.ctx.stats()
    }

    /// The all-gather rate limiter's state: whether it is on now and, in the adaptive mode
    /// ([`crate::LimitAllGathers::Auto`]), how often it turned on and off.
    pub fn limiter_status(&self) -> LimiterStatus {
        self.inner.ctx.limiter_status()
    }

    /// Number of units (the root included).
    pub fn num_units(&self) -> usize {
        self.inner.lock().units.len()
    }

    /// Every unit, in unit order (the root first): path, parameter names, sizes.
    pub fn units(&self) -> Vec<UnitInfo> {
        self.inner
            .lock()
            .units
            .iter()
            .map(|h| UnitInfo {
                path: h.path().to_string(),
                names: h.names().to_vec(),
                total_numel: h.layout().total_numel(),
                shard_numel: h.layout().chunk_numel(),
            })
            .collect()
    }

    /// Bytes of the parameters in f32 — in the largest unit (4·ψ_max) and in all units (4·Ψ) —
    /// the same under every mixed-precision setting (see [`ParamBytes`]).
    pub fn param_bytes(&self) -> ParamBytes {
        let st = self.inner.lock();
        let bytes = st.units.iter().map(FlatParamHandle::f32_bytes);
        ParamBytes {
            max_unit: bytes.clone().max().unwrap_or(0),
            total: bytes.sum(),
        }
    }

    /// This rank's shard of every unit (host copies), in unit order.
    pub fn local_shards(&self) -> Result<Vec<Vec<f32>>> {
        let shards: Vec<Tensor> = self
            .inner
            .lock()
            .units
            .iter()
            .map(|h| h.shard().clone())
            .collect();
        shards.iter().map(|s| Ok(s.to_vec::<f32>()?)).collect()
    }

    /// The full (unsharded) value of every parameter, gathered from all ranks: a collective, so
    /// every rank must call it. Returns (fully-qualified name, shape, values) in unit order.
    pub fn full_parameters(&self) -> Result<Vec<FullParameter>> {
        self.synchronize()?;
        let inner = &self.inner;
        let (shards, layouts, names, ready) = {
            let st = inner.lock();
            (
                st.units
                    .iter()
                    .map(|h| h.shard().clone())
                    .collect::<Vec<_>>(),
                st.units
                    .iter()
                    .map(|h| h.layout().clone())
                    .collect::<Vec<_>>(),
                st.units
                    .iter()
                    .map(|h| h.names().to_vec())
                    .collect::<Vec<_>>(),
                st.params_ready.clone(),
            )
        };
        let mut out = Vec::new();
        for ((shard, layout), names) in shards.iter().zip(&layouts).zip(&names) {
            let flat: Vec<f32> = if inner.config.strategy.is_sharded() {
                let ctx = &inner.ctx;
                let shard = offload::shard_on_device(ctx, shard, &ctx.compute, &ready)?;
                gather_flat(&ctx.group, &shard, &ctx.compute, &ctx.device)?.to_vec::<f32>()?
            } else {
                shard.to_vec::<f32>()?
            };
            for ((v, name), info) in layout
                .unflatten(&flat)?
                .into_iter()
                .zip(names)
                .zip(layout.params())
            {
                out.push((name.clone(), info.shape().to_vec(), v.to_vec()));
            }
        }
        Ok(out)
    }
}

impl Inner {
    fn upgrade(w: &Weak<Inner>) -> fsdp_autograd::Result<Arc<Inner>> {
        w.upgrade()
            .ok_or_else(|| fsdp_autograd::AutogradError::Hook {
                what: "FSDP".into(),
                detail: "the Fsdp wrapper was dropped while its model is still in use".into(),
            })
    }

    /// The shards just changed: gathered copies still held from a forward that had no backward
    /// (an evaluation forward keeps the root, the last unit or — ShardGradOp — every unit
    /// unsharded) are stale. Free them and end that forward's iteration, so the next forward
    /// gathers the updated shards. After a backward nothing is held and this does nothing.
    fn drop_stale_gathers(&self, st: &mut State) {
        if !st.iter.open || st.iter.callback_queued {
            return;
        }
        self.reshard_all(st);
        st.iter.order.clear();
        st.iter.open = false;
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens unit `u`'s forward (`FWD`) or backward (`BWD`) timeline span, closed by
    /// [`Inner::close_span`] from a later hook. Nothing happens unless tracing is on.
    fn open_span(&self, st: &mut State, u: usize, kind: usize) {
        if !trace::is_enabled() {
            return;
        }
        if st.spans.len() <= u {
            st.spans.resize_with(u + 1, || [None, None]);
        }
        let what = if kind == FWD { "forward" } else { "backward" };
        st.spans[u][kind] = Some(trace::span(self.ctx.device.id(), format!("{what} u{u}")));
    }

    /// Closes (records) unit `u`'s open span of `kind`, if any.
    fn close_span(st: &mut State, u: usize, kind: usize) {
        if let Some(slot) = st.spans.get_mut(u) {
            slot[kind] = None;
        }
    }

    fn pre_forward(self: &Arc<Self>, u: usize) -> Result<()> {
        let mut st = self.lock();
        if in_backward() {
            // Recomputation (activation checkpointing) inside backward: just make sure the
            // parameters are there.
            self.unshard(&mut st, u)?;
            self.wait_unshard(&mut st, u)?;
            return Ok(());
        }
        if !st.iter.open {
            self.ctx.iteration_start();
            st.iter.open = true;
            st.iter.order.clear();
            st.iter.callback_queued = false;
            for h in &mut st.units {
                h.start_iteration();
            }
        }
        if !st.iter.order.contains(&u) {
            st.iter.order.push(u);
        }
        self.open_span(&mut st, u, FWD);
        self.unshard(&mut st, u)?;
        self.wait_unshard(&mut st, u)?;
        if self.config.forward_prefetch {
            if let Some(next) = Self::next_forward(&st, u) {
                self.unshard(&mut st, next)?;
            }
        }
        Ok(())
    }

    /// The unit whose forward came after `u`'s in the previous iteration (forward prefetch).
    fn next_forward(st: &State, u: usize) -> Option<usize> {
        let prev = &st.iter.prev_order;
        let i = prev.iter().position(|&x| x == u)?;
        prev.get(i + 1).copied()
    }

    fn post_forward(self: &Arc<Self>, u: usize, output: &Tensor) -> Result<()> {
        if in_backward() {
            return Ok(());
        }
        let mut st = self.lock();
        Self::close_span(&mut st, u, FWD);
        // The unit that ran last in the previous forward starts the backward: keep it.
        let starts_backward =
            self.config.keep_last_unit_unsharded && st.iter.prev_order.last() == Some(&u);
        if self.config.strategy.reshard_after_forward() && u != 0 && !starts_backward {
            self.reshard(&mut st, u);
        }
        drop(st);
        if output.requires_grad() {
            let w = Arc::downgrade(self);
            output.register_hook_fallible(move |_g| {
                Inner::upgrade(&w)?.pre_backward(u)?;
                Ok(None)
            })?;
        }
        Ok(())
    }

    fn pre_backward(self: &Arc<Self>, u: usize) -> Result<()> {
        let mut st = self.lock();
        if !st.iter.callback_queued {
            st.iter.callback_queued = true;
            let w = Arc::downgrade(self);
            queue_callback_fallible(move || Ok(Inner::upgrade(&w)?.finish_backward()?))?;
        }
        if st.units[u].post_backward_done() {
            return Ok(());
        }
        self.open_span(&mut st, u, BWD);
        self.unshard(&mut st, u)?;
        self.wait_unshard(&mut st, u)?;
        if self.config.backward_prefetch == BackwardPrefetch::BackwardPre {
            if let Some(next) = Self::next_backward(&st, u) {
                self.unshard(&mut st, next)?;
            }
        }
        Ok(())
    }

    /// The unit whose backward comes after `u`'s: the one before it in forward order.
    fn next_backward(st: &State, u: usize) -> Option<usize> {
        let order = &st.iter.order;
        let i = order.iter().position(|&x| x == u)?;
        order[..i]
            .iter()
            .rev()
            .copied()
            .find(|&x| !st.units[x].post_backward_done())
    }

    /// The post-accumulate-grad hook of unit `u`'s flat leaf: its flat gradient is final.
    /// Joins the gradient kept by `no_sync`; with gradient sync off keeps the sum, else reduces
    /// it and accumulates the reduced shard; prefetches (`BackwardPost`); reshards.
    fn post_backward(self: &Arc<Self>, u: usize) -> Result<()> {
        let mut st = self.lock();
        let ctx = &self.ctx;
        let Some(grad) = st.units[u].take_unsharded_grad(ctx)? else {
            return Ok(());
        };
        if st.sync_grads {
            let _span = trace::span_with(ctx.device.id(), || format!("reduce-scatter u{u}"));
            let reduced = st.units[u].reduce_grad(ctx, grad)?;
            let done = st.units[u].accumulate_shard_grad(ctx, reduced)?;
            st.iter.pending_reductions.push(done);
        } else {
            st.units[u].keep_unsynced_grad(grad);
        }
        st.units[u].mark_post_backward_done();
        if st.sync_grads && self.config.backward_prefetch == BackwardPrefetch::BackwardPost {
            if let Some(next) = Self::next_backward(&st, u) {
                self.unshard(&mut st, next)?;
            }
        }
        self.reshard(&mut st, u);
        Self::close_span(&mut st, u, BWD);
        Ok(())
    }

    fn finish_backward(self: &Arc<Self>) -> Result<()> {
        let ctx = &self.ctx;
        let _span = trace::span(ctx.device.id(), "finish backward");
        let mut st = self.lock();
        // Units whose post-backward hook did not run (no gradient) close their spans here.
        st.spans.clear();
        if ctx.offload {
            // Every upload (which reads a host shard) and every download (after its reduction)
            // ran on the copy stream. The compute stream waits for the copy stream on the
            // device (not for the host-side accumulation); the host stream, where the
            // accumulations already are in order, waits for it too, so the optimizer neither
            // reads a gradient before it arrived nor overwrites a shard an upload still reads.
            // No host wait: the one wait before the host optimizer is this device-side one.
            st.iter.pending_reductions.clear();
            let copied = ctx.copy_stream.record_event();
            ctx.compute.wait_event(&copied);
            ctx.host_stream.wait_event(&copied);
        } else {
            for ev in std::mem::take(&mut st.iter.pending_reductions) {
                ctx.compute.wait_event(&ev);
            }
        }
        self.reshard_all(&mut st);
        let verify = st.iter.orders_verified < self.config.verify_execution_order;
        if verify {
            st.iter.orders_verified += 1;
        }
        let order = std::mem::take(&mut st.iter.order);
        let paths: Vec<String> = st.units.iter().map(|h| h.path().to_string()).collect();
        st.iter.prev_order = order.clone();
        st.iter.open = false;
        st.iter.callback_queued = false;
        drop(st);
        if verify {
            self.verify_order(&ctx.group, &order, &paths)?;
            if let Some(r) = &ctx.replicate {
                self.verify_order(r, &order, &paths)?;
            }
        }
        Ok(())
    }

    /// All-gathers every rank's forward `order` (unit indices, padded with −1 to the number of
    /// units) over `group` and compares them with this rank's (see
    /// [`FsdpConfig::verify_execution_order`]). Waits on the host.
    fn verify_order(
        &self,
        group: &Arc<dyn ProcessGroup>,
        order: &[usize],
        paths: &[String],
    ) -> Result<()> {
        let world = group.size();
        let n = paths.len();
        if world < 2 || n == 0 {
            return Ok(());
        }
        let mut mine = vec![-1f32; n];
        for (slot, &u) in mine.iter_mut().zip(order) {
            *slot = u as f32;
        }
        let (device, compute) = (&self.ctx.device, &self.ctx.compute);
        let input = with_stream(compute, || Tensor::from_vec(mine.clone(), &[n], device))?;
        let all = gather_flat(group, &input, compute, device)?.to_vec::<f32>()?;
        let name = |v: &[f32]| -> String {
            let units: Vec<&str> = v
                .iter()
                .take_while(|&&x| x >= 0.0)
                .map(|&x| match paths.get(x as usize).map(String::as_str) {
                    Some("") => "(root)",
                    Some(p) => p,
                    None => "?",
                })
                .collect();
            format!("[{}]", units.join(", "))
        };
        let rank = group.rank();
        match (0..world).find(|&p| all[p * n..(p + 1) * n] != mine[..]) {
            None => Ok(()),
            Some(peer) => Err(FsdpError::ExecutionOrder {
                rank,
                peer,
                group: group.name(),
                ours: name(&mine),
                theirs: name(&all[peer * n..(peer + 1) * n]),
            }),
        }
    }

    /// Issues unit `u`'s all-gather ([`FlatParamHandle::unshard`]) after the last update of the
    /// shards.
    fn unshard(&self, st: &mut State, u: usize) -> Result<()> {
        let _span = trace::span_with(self.ctx.device.id(), || format!("unshard u{u}"));
        let ready = st.params_ready.clone();
        st.units[u].unshard(&self.ctx, &ready)
    }

    /// Makes the compute stream wait for unit `u`'s all-gather and points its parameters at this
    /// iteration's views ([`FlatParamHandle::wait_for_unshard`]), with [`Inner::post_backward`]
    /// as the flat leaf's hook.
    fn wait_unshard(self: &Arc<Self>, st: &mut State, u: usize) -> Result<()> {
        let w = Arc::downgrade(self);
        st.units[u].wait_for_unshard(
            &self.ctx,
            move |_| Ok(Inner::upgrade(&w)?.post_backward(u)?),
        )
    }

    /// Reshards every unit and drops this iteration's views (the end of an iteration).
    fn reshard_all(&self, st: &mut State) {
        for h in &mut st.units {
            h.reshard(&self.ctx);
            h.drop_views();
        }
    }

    /// Frees unit `u`'s gathered buffer ([`FlatParamHandle::reshard`]).
    fn reshard(&self, st: &mut State, u: usize) {
        st.units[u].reshard(&self.ctx);
    }
}
