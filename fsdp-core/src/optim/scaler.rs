//! Dynamic loss scaling for low-precision (f16) training with sharded gradients: the sharded
//! grad scaler, and its local counterpart.
//!
//! The loss is multiplied by a scale `S` before backward ([`ShardedGradScaler::scale`]) so small
//! f16 gradients do not flush to zero; before the optimizer step the sharded gradients are
//! multiplied by `1/S` ([`ShardedGradScaler::unscale`]) and checked for inf/NaN. With sharding, a
//! rank sees only its shard of each gradient, so an overflow may be visible on some ranks only:
//! each rank's found-inf flag is all-reduced with `Max` over the shard group **and** the replicate
//! group (hybrid sharding), i.e. over every rank, so every rank takes the same decision.
//! [`ShardedGradScaler::step`] skips the optimizer step when an inf/NaN was found;
//! [`ShardedGradScaler::update`] then backs the scale off (`S·backoff_factor`) or, after
//! `growth_interval` consecutive good steps, grows it (`S·growth_factor`, if finite) — the same
//! arithmetic on every rank, so scales stay identical. [`LocalGradScaler`] applies the same
//! unscale kernel and the same schedule to plain parameters: FSDP with a sharded scaler makes
//! exactly the local scaler's decisions and, with the optimizers of [`crate::optim`], equals
//! local training bitwise.
//!
//! One iteration:
//! ```
//! use std::sync::Arc;
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::{nn::Linear, InitContext, Tensor};
//! use fsdp_collectives::{ProcessGroup, ThreadGroup};
//! use fsdp_core::optim::Sgd;
//! use fsdp_core::scaler::{GradScalerConfig, ShardedGradScaler};
//! use fsdp_core::{Fsdp, FsdpConfig};
//!
//! let dev = Device::cpu(0);
//! let model = Linear::new(&InitContext::eager(&dev, 0), 4, 2, true)?;
//! let pg: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).remove(0));
//! let fsdp = Fsdp::wrap(model, &dev, pg, FsdpConfig::default())?;
//! let mut opt = Sgd::new(0.1);
//! let mut scaler = ShardedGradScaler::new(GradScalerConfig {
//!     init_scale: 1024.0,
//!     ..GradScalerConfig::default()
//! })?;
//! let x = Tensor::ones(&[3, 4], DType::F32, &dev)?;
//! let loss = fsdp.forward(&x)?.sum()?;
//! scaler.scale(&loss)?.backward()?;
//! let stepped = scaler.step(&fsdp, &mut opt)?; // unscales, checks all ranks, steps
//! assert!(stepped);
//! scaler.update()?;
//! fsdp.zero_grad();
//! assert_eq!(scaler.get_scale(), 1024.0); // grows only after `growth_interval` good steps
//! # Ok::<(), fsdp_core::FsdpError>(())
//! ```
//!
//! # Limitations
//! - The sharded gradients are f32 (as FSDP keeps them under mixed precision); the check happens
//!   after the reduction, so an inf that a reduction cancelled into a NaN is still caught, but
//!   overflow *inside* a low-precision reduction shows up only as its inf/NaN result.
//! - Reading the found-inf flag is a host synchronization (as in PyTorch's `scaler.step`).
//! - Host-accessible (CPU) memory only, like the optimizers.

use fsdp_alloc::DType;
use fsdp_autograd::{current_stream, with_stream, Parameter, Tensor};
use fsdp_collectives::{DeviceSlice, ReduceOp};

use crate::error::{ArgumentError, ConfigError, FsdpError, Result, ScalerMisuse, StateError};
use crate::optim::{LocalOptimizer, ShardedOptimizer};
use fsdp_alloc::Stream;
use fsdp_autograd::kernels::optim::Unscale;
use fsdp_autograd::kernels::{Kernels, Operand};

use super::sharded::{f32_operand, kernels_for, zeros_on, ShardedParams};

/// Loss-scaling hyper-parameters (PyTorch's `GradScaler` defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The initial scale (default 2¹⁶).
    pub init_scale: f32,
    /// Factor applied after `growth_interval` consecutive steps without inf/NaN (default 2).
    pub growth_factor: f32,
    /// Factor applied after a step with inf/NaN (default 0.5).
    pub backoff_factor: f32,
    /// Number of consecutive good steps before the scale grows (default 2000).
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl GradScalerConfig {
    fn check(&self) -> Result<()> {
        let bad = |field: &'static str, value: String, requirement: &'static str| {
            Err(FsdpError::Config(ConfigError::GradScaler {
                field,
                value,
                requirement,
            }))
        };
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(
                "init_scale",
                self.init_scale.to_string(),
                "positive and finite",
            );
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(
                "growth_factor",
                self.growth_factor.to_string(),
                "finite and above 1",
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(
                "backoff_factor",
                self.backoff_factor.to_string(),
                "between 0 and 1 (exclusive)",
            );
        }
        if self.growth_interval == 0 {
            return bad("growth_interval", "0".into(), "at least 1");
        }
        Ok(())
    }
}

/// Where an iteration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Nothing unscaled since the last update.
    Ready,
    /// Gradients unscaled; the step has not been taken.
    Unscaled { found_inf: bool },
    /// The step was taken or skipped.
    Stepped { found_inf: bool },
}

/// The scale, the growth tracker and the iteration's stage; the arithmetic every rank (and the
/// local scaler) shares.
#[derive(Debug, Clone)]
struct Schedule {
    cfg: GradScalerConfig,
    scale: f32,
    tracker: u32,
    stage: Stage,
}

impl Schedule {
    fn new(cfg: GradScalerConfig) -> Result<Schedule> {
        cfg.check()?;
        Ok(Schedule {
            cfg,
            scale: cfg.init_scale,
            tracker: 0,
            stage: Stage::Ready,
        })
    }

    /// `1/S` for an unscale, refused if this iteration already unscaled.
    fn inv_scale(&self, op: &str) -> Result<f32> {
        match self.stage {
            Stage::Ready => Ok((1.0 / self.scale as f64) as f32),
            _ => Err(FsdpError::State(StateError::GradScaler {
                op: op.into(),
                misuse: ScalerMisuse::AlreadyUnscaled,
            })),
        }
    }

    /// Before a step: the inf/NaN check unscale recorded this iteration (`None`: none yet, the
    /// caller unscales first).
    ///
    /// # Errors
    /// [`FsdpError::State`] when this iteration already stepped.
    fn recorded_check(&self, op: &str) -> Result<Option<bool>> {
        match self.stage {
            Stage::Ready => Ok(None),
            Stage::Unscaled { found_inf } => Ok(Some(found_inf)),
            Stage::Stepped { .. } => Err(FsdpError::State(StateError::GradScaler {
                op: op.into(),
                misuse: ScalerMisuse::AlreadyStepped,
            })),
        }
    }

    /// Records the step (taken unless `found_inf`); returns whether it was taken.
    fn stepped(&mut self, found_inf: bool) -> bool {
        self.stage = Stage::Stepped { found_inf };
        !found_inf
    }

    fn update(&mut self) -> Result<f32> {
        let found_inf = match self.stage {
            Stage::Stepped { found_inf } | Stage::Unscaled { found_inf } => found_inf,
            Stage::Ready => {
                return Err(FsdpError::State(StateError::GradScaler {
                    op: "grad scaler update()".into(),
                    misuse: ScalerMisuse::NothingRecorded,
                }))
            }
        };
        if found_inf {
            self.scale *= self.cfg.backoff_factor;
            self.tracker = 0;
        } else {
            self.tracker += 1;
            if self.tracker == self.cfg.growth_interval {
                let grown = self.scale * self.cfg.growth_factor;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.tracker = 0;
            }
        }
        self.stage = Stage::Ready;
        Ok(self.scale)
    }

    fn load(&mut self, scale: f32, tracker: u32) -> Result<()> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(FsdpError::InvalidArgument(ArgumentError::Value {
                op: "grad scaler load_state".into(),
                name: "scale".into(),
                value: scale.to_string(),
                requirement: "positive and finite".into(),
            }));
        }
        if tracker >= self.cfg.growth_interval {
            return Err(FsdpError::InvalidArgument(ArgumentError::Value {
                op: "grad scaler load_state".into(),
                name: "growth tracker".into(),
                value: tracker.to_string(),
                requirement: format!("below the growth interval {}", self.cfg.growth_interval),
            }));
        }
        self.scale = scale;
        self.tracker = tracker;
        self.stage = Stage::Ready;
        Ok(())
    }
}

/// `g ← g·inv` in place through the seam (`Unscale`); sets `flag[0] = 1` if any element was
/// inf or NaN before scaling.
fn unscale_on(k: &Kernels, stream: &Stream, g: &Operand, inv: f32, flag: &Operand) -> Result<()> {
    let l = Unscale {
        n: g.numel(),
        inv,
        g,
        found_inf: flag,
    };
    Ok(k.launch(stream, &l)?)
}

/// The sharded grad scaler (see the [module docs](self)). The public knobs are in
/// [`GradScalerConfig`]; the current scale is [`ShardedGradScaler::get_scale`].
#[derive(Debug, Clone)]
pub struct ShardedGradScaler {
    sched: Schedule,
}

impl ShardedGradScaler {
    /// A scaler with `cfg`.
    ///
    /// # Errors
    /// A non-positive or non-finite initial scale, a growth factor ≤ 1, a backoff factor outside
    /// (0, 1), or a zero growth interval.
    pub fn new(cfg: GradScalerConfig) -> Result<ShardedGradScaler> {
        Ok(ShardedGradScaler {
            sched: Schedule::new(cfg)?,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GradScalerConfig {
        &self.sched.cfg
    }

    /// The current scale `S`.
    pub fn get_scale(&self) -> f32 {
        self.sched.scale
    }

    /// Consecutive good steps since the scale last changed.
    pub fn growth_tracker(&self) -> u32 {
        self.sched.tracker
    }

    /// Whether this iteration's check found inf/NaN (`None` before unscale/step).
    pub fn found_inf(&self) -> Option<bool> {
        match self.sched.stage {
            Stage::Ready => None,
            Stage::Unscaled { found_inf } | Stage::Stepped { found_inf } => Some(found_inf),
        }
    }

    /// Restores the scale and growth tracker (e.g. from a checkpoint).
    ///
    /// # Errors
    /// A non-positive or non-finite scale, or a tracker not below the growth interval.
    pub fn load_state(&mut self, scale: f32, growth_tracker: u32) -> Result<()> {
        self.sched.load(scale, growth_tracker)
    }

    /// `loss · S` (differentiable), to call `backward` on.
    ///
    /// # Errors
    /// A non-float loss.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.scale(self.sched.scale)?)
    }

    /// Multiplies every sharded gradient by `1/S` (in place, on the optimizer stream) and
    /// checks them for inf/NaN; the flag is all-reduced with `Max` over the shard and replicate
    /// groups, so the returned answer is the same on every rank. A collective: every rank calls
    /// it. At most once per iteration ([`Self::step`] calls it if you did not).
    ///
    /// # Errors
    /// A second unscale before [`Self::update`]; non-f32 or released gradients; a failed
    /// all-reduce.
    pub fn unscale(&mut self, model: &dyn ShardedParams) -> Result<bool> {
        const OP: &str = "ShardedGradScaler::unscale";
        let inv = self.sched.inv_scale(OP)?;
        let stream = model.optimizer_stream().clone();
        let flag = zeros_on(1, model.shard_device(), &stream)?;
        let flag_op = f32_operand(&flag, OP, "the found-inf flag", &stream)?;
        let flag_mem = flag_op.buf.clone();
        let k = kernels_for(model.shard_device())?;
        for s in model.shards() {
            let Some(g) = &s.grad else { continue };
            let gm = f32_operand(
                g,
                OP,
                &format!("the gradient of unit `{}`", s.path),
                &stream,
            )?;
            unscale_on(&k, &stream, &gm, inv, &flag_op)?;
            g.storage().bump_version();
        }
        // Max over every rank: the shard group, then the replicas (hybrid sharding). Also with
        // NoShard, so a flag raised on one rank only is never missed.
        let slice = DeviceSlice::new(flag_mem, DType::F32)?;
        let mut works = Vec::new();
        let groups = std::iter::once(model.shard_group()).chain(model.replicate_group());
        for g in groups {
            if g.size() > 1 {
                works.push(g.all_reduce(&slice, ReduceOp::Max, &stream));
            }
        }
        let v = with_stream(&stream, || flag.to_vec::<f32>());
        for w in works {
            super::sharded::outcome(&w)?;
        }
        let found_inf = v?[0] != 0.0;
        self.sched.stage = Stage::Unscaled { found_inf };
        Ok(found_inf)
    }

    /// Unscales (unless [`Self::unscale`] already ran this iteration), then takes the optimizer
    /// step unless an inf/NaN was found on any rank. Returns whether the step was taken.
    ///
    /// # Errors
    /// A second step before [`Self::update`]; the unscale's and the optimizer's errors.
    pub fn step(
        &mut self,
        model: &dyn ShardedParams,
        optimizer: &mut dyn ShardedOptimizer,
    ) -> Result<bool> {
        let found_inf = match self.sched.recorded_check("ShardedGradScaler::step")? {
            Some(found_inf) => found_inf,
            None => self.unscale(model)?,
        };
        if !found_inf {
            optimizer.step(model)?;
        }
        Ok(self.sched.stepped(found_inf))
    }

    /// Ends the iteration: backs the scale off after an inf/NaN, or grows it after
    /// `growth_interval` consecutive good iterations (only if the result is finite). The same
    /// arithmetic on every rank. Returns the new scale.
    ///
    /// # Errors
    /// No unscale/step since the last update.
    pub fn update(&mut self) -> Result<f32> {
        self.sched.update()
    }
}

/// The local counterpart of [`ShardedGradScaler`] for plain parameters: the same unscale kernel,
/// the same schedule; no communication.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_core::optim::{LocalOptimizer, LocalSgd};
/// use fsdp_core::scaler::{GradScalerConfig, LocalGradScaler};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[2], DType::F32, vec![InitOp::Fill(1.0)])?;
/// let mut opt = LocalSgd::new(vec![p.clone()], 0.5);
/// let cfg = GradScalerConfig { init_scale: 3.0e38, ..GradScalerConfig::default() };
/// let mut scaler = LocalGradScaler::new(cfg)?;
/// // 2·S overflows f32: the gradient is inf, the step is skipped, the scale backs off.
/// scaler.scale(&p.get()?.sum()?.scale(2.0)?)?.backward()?;
/// assert!(!scaler.step(&mut opt)?);
/// assert_eq!(scaler.update()?, 1.5e38);
/// assert_eq!(p.get()?.to_vec::<f32>()?, vec![1.0, 1.0]);
/// # Ok::<(), fsdp_core::FsdpError>(())
/// ```
#[derive(Debug, Clone)]
pub struct LocalGradScaler {
    sched: Schedule,
}

impl LocalGradScaler {
    /// A scaler with `cfg`.
    ///
    /// # Errors
    /// As [`ShardedGradScaler::new`].
    pub fn new(cfg: GradScalerConfig) -> Result<LocalGradScaler> {
        Ok(LocalGradScaler {
            sched: Schedule::new(cfg)?,
        })
    }

    /// The current scale.
    pub fn get_scale(&self) -> f32 {
        self.sched.scale
    }

    /// Consecutive good steps since the scale last changed.
    pub fn growth_tracker(&self) -> u32 {
        self.sched.tracker
    }

    /// Restores the scale and growth tracker.
    ///
    /// # Errors
    /// As [`ShardedGradScaler::load_state`].
    pub fn load_state(&mut self, scale: f32, growth_tracker: u32) -> Result<()> {
        self.sched.load(scale, growth_tracker)
    }

    /// `loss · S`.
    ///
    /// # Errors
    /// A non-float loss.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.scale(self.sched.scale)?)
    }

    /// Multiplies the gradients of `params` by `1/S` in place and reports whether any was
    /// inf/NaN. At most once per iteration.
    ///
    /// # Errors
    /// A second unscale before update; non-f32 or non-contiguous gradients.
    pub fn unscale(&mut self, params: &[Parameter]) -> Result<bool> {
        const OP: &str = "LocalGradScaler::unscale";
        let inv = self.sched.inv_scale(OP)?;
        let mut flags = Vec::new();
        for p in params {
            let Some(g) = p.grad() else { continue };
            let stream = current_stream(g.device());
            let gm = f32_operand(&g, OP, &format!("the gradient of `{}`", p.name()), &stream)?;
            let flag = zeros_on(1, g.device(), &stream)?;
            let fm = f32_operand(&flag, OP, "the found-inf flag", &stream)?;
            unscale_on(&kernels_for(g.device())?, &stream, &gm, inv, &fm)?;
            g.storage().bump_version();
            flags.push(flag);
        }
        let mut found_inf = false;
        for f in flags {
            found_inf |= f.to_vec::<f32>()?[0] != 0.0;
        }
        self.sched.stage = Stage::Unscaled { found_inf };
        Ok(found_inf)
    }

    /// Unscales the optimizer's parameters (unless done this iteration) and steps unless an
    /// inf/NaN was found. Returns whether the step was taken.
    ///
    /// # Errors
    /// A second step before update; the unscale's and the optimizer's errors.
    pub fn step(&mut self, optimizer: &mut dyn LocalOptimizer) -> Result<bool> {
        let found_inf = match self.sched.recorded_check("LocalGradScaler::step")? {
            Some(found_inf) => found_inf,
            None => {
                let params = optimizer.params().to_vec();
                self.unscale(&params)?
            }
        };
        if !found_inf {
            optimizer.step()?;
        }
        Ok(self.sched.stepped(found_inf))
    }

    /// Ends the iteration (see [`ShardedGradScaler::update`]). Returns the new scale.
    ///
    /// # Errors
    /// No unscale/step since the last update.
    pub fn update(&mut self) -> Result<f32> {
        self.sched.update()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(interval: u32) -> Schedule {
        Schedule::new(GradScalerConfig {
            init_scale: 8.0,
            growth_factor: 2.0,
            backoff_factor: 0.25,
            growth_interval: interval,
        })
        .unwrap()
    }

    fn iterate(s: &mut Schedule, found_inf: bool) -> f32 {
        s.inv_scale("t").unwrap();
        s.stage = Stage::Stepped { found_inf };
        s.update().unwrap()
    }

    #[test]
    fn backs_off_on_inf_and_grows_after_the_interval() {
        let mut s = sched(3);
        assert_eq!(iterate(&mut s, true), 2.0);
        assert_eq!(iterate(&mut s, false), 2.0);
        assert_eq!(iterate(&mut s, false), 2.0);
        assert_eq!(s.tracker, 2);
        assert_eq!(iterate(&mut s, false), 4.0);
        assert_eq!(s.tracker, 0);
        // An inf resets the tracker.
        iterate(&mut s, false);
        iterate(&mut s, false);
        assert_eq!(iterate(&mut s, true), 1.0);
        assert_eq!(s.tracker, 0);
    }

    #[test]
    fn never_grows_to_infinity() {
        let mut s = sched(1);
        s.scale = f32::MAX;
        assert_eq!(iterate(&mut s, false), f32::MAX);
        assert_eq!(s.tracker, 0);
    }

    #[test]
    fn stages_are_enforced() {
        let mut s = sched(2);
        assert!(s.update().is_err(), "update before any check");
        s.inv_scale("t").unwrap();
        s.stage = Stage::Unscaled { found_inf: false };
        assert!(s.inv_scale("t").is_err(), "second unscale");
        assert_eq!(s.update().unwrap(), 8.0);
        assert!(s.inv_scale("t").is_ok());
    }

    #[test]
    fn unscale_kernel_flags_inf_and_nan() {
        use fsdp_autograd::kernels::optim::unscale as unscale_kernel;
        let mut g = [2.0f32, 4.0];
        assert!(!unscale_kernel(&mut g, 0.5));
        assert_eq!(g, [1.0, 2.0]);
        assert!(unscale_kernel(&mut [1.0, f32::INFINITY], 0.5));
        assert!(unscale_kernel(&mut [f32::NAN], 0.5));
        assert!(unscale_kernel(&mut [f32::NEG_INFINITY, 0.0], 1.0));
    }

    #[test]
    fn configs_are_checked() {
        let d = GradScalerConfig::default();
        assert!(d.check().is_ok());
        for bad in [
            GradScalerConfig {
                init_scale: 0.0,
                ..d
            },
            GradScalerConfig {
                init_scale: f32::INFINITY,
                ..d
            },
            GradScalerConfig {
                growth_factor: 1.0,
                ..d
            },
            GradScalerConfig {
                backoff_factor: 1.0,
                ..d
            },
            GradScalerConfig {
                growth_interval: 0,
                ..d
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        let mut s = sched(4);
        assert!(s.load(-1.0, 0).is_err());
        assert!(s.load(2.0, 4).is_err());
        s.load(2.0, 3).unwrap();
        assert_eq!((s.scale, s.tracker), (2.0, 3));
    }
}
