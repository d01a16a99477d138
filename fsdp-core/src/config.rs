//! FSDP configuration.

use std::str::FromStr;

use fsdp_alloc::{DType, Device};

pub use crate::strategy::ShardingStrategy;
use crate::wrap::WrapPolicy;

/// When to issue the next unit's all-gather during backward (the paper's §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackwardPrefetch {
    /// No prefetch: a unit is all-gathered when its backward starts.
    None,
    /// Issue the next unit's all-gather when the current unit's backward *starts*, i.e. before
    /// the current reduce-scatter (more overlap, one more unsharded unit in memory).
    #[default]
    BackwardPre,
    /// Issue the next unit's all-gather after the current unit's reduce-scatter is issued.
    BackwardPost,
}

impl FromStr for BackwardPrefetch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "none" | "off" => Ok(BackwardPrefetch::None),
            "pre" | "backwardpre" => Ok(BackwardPrefetch::BackwardPre),
            "post" | "backwardpost" => Ok(BackwardPrefetch::BackwardPost),
            _ => Err(format!(
                "unknown backward prefetch `{s}` (expected none, pre or post)"
            )),
        }
    }
}

/// How the lifetime of an all-gathered buffer that another stream used is managed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BufferLifetime {
    /// FSDP1: `record_stream` on the consuming stream; the allocator defers reuse.
    #[default]
    RecordStream,
    /// FSDP2: keep the buffer alive until the consumer's event completes (no `record_stream`).
    Explicit,
}

/// Mixed precision (the paper's §5.2): parameters are kept in f32 shards; each unshard casts the
/// shard to `param_dtype` once and all-gathers in it, so forward and backward compute in
/// `param_dtype` and the unsharded parameters take `param_dtype.size()` bytes per element;
/// gradients are reduced in `reduce_dtype` (accumulating in f32 inside the collective) and the
/// sharded gradient is kept in f32 for the optimizer.
///
/// fsdp-autograd modules have no non-parameter buffers, so there is no `buffer_dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecision {
    /// Dtype of the unsharded parameters (all-gather and compute): f32, bf16 or f16.
    pub param_dtype: DType,
    /// Dtype gradients are communicated in: f32, bf16 or f16.
    pub reduce_dtype: DType,
}

impl MixedPrecision {
    /// Parameters and reductions in `dtype`.
    pub fn uniform(dtype: DType) -> MixedPrecision {
        MixedPrecision {
            param_dtype: dtype,
            reduce_dtype: dtype,
        }
    }
}

/// How [`crate::Fsdp::wrap`] builds shards of parameters that were created on the fake device
/// (deferred init). Materialized parameters are always copied piece by piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeferredInit {
    /// Generate only this rank's chunk of each unit, straight from the recorded position-wise
    /// init ops (whole-tensor ops build just that parameter, temporarily).
    #[default]
    ShardOnly,
    /// Build each unit whole on the device, take this rank's chunk, free the unit.
    UnitByUnit,
}

impl FromStr for DeferredInit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "shardonly" | "shard" => Ok(DeferredInit::ShardOnly),
            "unitbyunit" | "unit" => Ok(DeferredInit::UnitByUnit),
            _ => Err(format!(
                "unknown deferred-init mode `{s}` (expected shard-only or unit-by-unit)"
            )),
        }
    }
}

/// The adaptive rate limiter's setting ([`LimitAllGathers::Auto`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveLimiter {
    /// Iterations in a row without an allocator retry after which the limiter turns off again.
    /// Each time it has to turn back on (retries came back after it turned off), this doubles,
    /// up to 1024 times the setting, so a workload that needs the limiter does not flap. `0` is
    /// treated as 1.
    pub clean_iterations_to_disable: usize,
}

impl Default for AdaptiveLimiter {
    fn default() -> Self {
        AdaptiveLimiter {
            clean_iterations_to_disable: 10,
        }
    }
}

/// Whether FSDP bounds in-flight all-gathers with the rate limiter (the paper's §3.4, §6.4: it
/// helps some models a lot — T5-11B up to 5× under memory pressure — and costs others a little
/// by blocking the issuing thread).
///
/// [`FsdpConfig`] keeps the plain on/off switch in `limit_all_gathers: bool` (so existing
/// configurations keep compiling) and the adaptive mode in `adaptive_limiter`; this enum is the
/// combined view ([`FsdpConfig::limit_mode`], [`FsdpConfig::with_limit_all_gathers`]) and what
/// command lines parse (`on`, `off`, `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitAllGathers {
    /// Never limit.
    Off,
    /// Always limit to `max_inflight_all_gathers` (the default, as in PyTorch FSDP1).
    On,
    /// Start off; turn on as soon as the device's allocator reports a free-and-retry
    /// (`num_alloc_retries` grew — checked before every all-gather and at every iteration
    /// start), and off again after `clean_iterations_to_disable` iterations without one. The
    /// limiter only delays the issuing thread: results are bit for bit those of `Off` and `On`.
    Auto(AdaptiveLimiter),
}

impl From<bool> for LimitAllGathers {
    fn from(on: bool) -> Self {
        if on {
            LimitAllGathers::On
        } else {
            LimitAllGathers::Off
        }
    }
}

impl FromStr for LimitAllGathers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "on" | "true" | "1" => Ok(LimitAllGathers::On),
            "off" | "false" | "0" => Ok(LimitAllGathers::Off),
            "auto" | "adaptive" => Ok(LimitAllGathers::Auto(AdaptiveLimiter::default())),
            _ => Err(format!(
                "unknown all-gather limit `{s}` (expected on, off or auto)"
            )),
        }
    }
}

/// Quantization of FSDP's collectives ([`FsdpConfig::quantize_collectives`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// Int8 block quantization with one f32 scale per `block` values
    /// ([`fsdp_collectives::Int8Codec`]): parameter all-gathers move int8 codes and scales
    /// (each rank quantizes its shard once per unshard); gradient reduce-scatters quantize each
    /// destination chunk, exchange them with an all-to-all, and sum the dequantized chunks in
    /// f32 in rank order.
    Int8 {
        /// Values per scale (64 by default: 4 scale bytes per 64 values, so the bytes moved are
        /// ≈ 0.266× the f32 bytes; 256 gives ≈ 0.254× with 4× coarser scales).
        block: usize,
    },
}

impl Quantization {
    /// The default block size of [`Quantization::Int8`].
    pub const DEFAULT_BLOCK: usize = 64;

    /// Int8 with the default block size.
    pub fn int8() -> Quantization {
        Quantization::Int8 {
            block: Self::DEFAULT_BLOCK,
        }
    }
}

impl FromStr for Quantization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" => Ok(Quantization::int8()),
            _ => Err(format!("unknown quantization `{s}` (expected int8)")),
        }
    }
}

/// Everything [`crate::Fsdp::wrap`] needs to know.
#[derive(Debug, Clone, PartialEq)]
pub struct FsdpConfig {
    /// The sharding strategy.
    pub strategy: ShardingStrategy,
    /// Which modules become units (the root always is one).
    pub wrap_policy: WrapPolicy,
    /// Backward prefetch mode.
    pub backward_prefetch: BackwardPrefetch,
    /// Issue the next unit's all-gather before the current unit's forward compute (static graphs).
    pub forward_prefetch: bool,
    /// Bound in-flight all-gathers with the rate limiter (ignored when `adaptive_limiter` is
    /// set). See [`LimitAllGathers`].
    pub limit_all_gathers: bool,
    /// The adaptive rate limiter ([`LimitAllGathers::Auto`]): when set, the limiter starts off
    /// and follows the allocator's retries, whatever `limit_all_gathers` says. Default `None`.
    pub adaptive_limiter: Option<AdaptiveLimiter>,
    /// The limit when the limiter is on.
    pub max_inflight_all_gathers: usize,
    /// Lifetime management of gathered buffers.
    pub buffer_lifetime: BufferLifetime,
    /// How shards of fake-device (deferred-init) parameters are built.
    pub deferred_init: DeferredInit,
    /// Mixed precision; `None` computes and communicates in f32.
    pub mixed_precision: Option<MixedPrecision>,
    /// CPU offload: keep the sharded parameters and sharded gradients on this host device (with
    /// its own allocator and statistics) and run the optimizer step there; each unshard copies
    /// the shard to the compute device, each reduction copies the gradient shard back — on a
    /// copy stream of the compute device ([`crate::Fsdp::offload_copy_stream`]), ordered by
    /// events, without host waits. The host must be a CPU device; the compute device a CPU
    /// device (host-memory copies) or a CUDA device (asynchronous copies when the host is
    /// page-locked, `fsdp_alloc::Device::cpu_pinned`, synchronous ones from pageable memory;
    /// what has run on a GPU is in the repository's `docs/GPU-STATUS.md`).
    pub cpu_offload: Option<Device>,
    /// Compare the units' forward order across ranks at the end of the first this-many backward
    /// passes (one all-gather of a number per unit and a host wait, each time); a difference is
    /// [`crate::FsdpError::ExecutionOrder`], raised from `backward` on every rank. FSDP pairs
    /// collectives by issue order, so ranks that run units in different orders (a rank- or
    /// data-dependent forward) would otherwise exchange one unit's shards for another's —
    /// silently when their sizes match. `0` disables the check, `usize::MAX` checks every
    /// iteration. Default 1: the first iteration.
    pub verify_execution_order: usize,
    /// With a strategy that reshards after forward (FullShard, HybridShard): keep the unit whose
    /// forward ran last in the previous iteration unsharded after its forward, because its
    /// backward comes first and would all-gather it again at once — one all-gather per step
    /// saved, no higher peak (it is held through the loss only). After a forward without a
    /// backward (evaluation) it stays unsharded, like the root, until a backward ends or the shards
    /// are updated (an optimizer step frees such stale copies). Default on.
    pub keep_last_unit_unsharded: bool,
    /// Quantize the parameter all-gathers and gradient reduce-scatters (sharded strategies;
    /// default `None`: communicate in f32 or the mixed-precision dtypes). With int8, bytes moved
    /// drop to about a quarter and results change (see [`crate::Fsdp`]'s "Quantized
    /// collectives" docs for the laws that no longer hold). Needs f32 communication (no
    /// `mixed_precision`); `NoShard`'s all-reduce and HybridShard's replicate all-reduce stay
    /// in f32; state dicts and `full_parameters` gather exact f32 values.
    pub quantize_collectives: Option<Quantization>,
}

impl FsdpConfig {
    /// The rate limiter setting `limit_all_gathers` and `adaptive_limiter` describe together.
    pub fn limit_mode(&self) -> LimitAllGathers {
        match self.adaptive_limiter {
            Some(a) => LimitAllGathers::Auto(a),
            None => self.limit_all_gathers.into(),
        }
    }

    /// This configuration with the rate limiter set to `mode` (`true`/`false` convert).
    pub fn with_limit_all_gathers(mut self, mode: impl Into<LimitAllGathers>) -> Self {
        match mode.into() {
            LimitAllGathers::Off => {
                self.limit_all_gathers = false;
                self.adaptive_limiter = None;
            }
            LimitAllGathers::On => {
                self.limit_all_gathers = true;
                self.adaptive_limiter = None;
            }
            LimitAllGathers::Auto(a) => {
                self.limit_all_gathers = false;
                self.adaptive_limiter = Some(a);
            }
        }
        self
    }
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            strategy: ShardingStrategy::FullShard,
            wrap_policy: WrapPolicy::RootOnly,
            backward_prefetch: BackwardPrefetch::BackwardPre,
            forward_prefetch: false,
            limit_all_gathers: true,
            adaptive_limiter: None,
            max_inflight_all_gathers: 2,
            buffer_lifetime: BufferLifetime::RecordStream,
            deferred_init: DeferredInit::ShardOnly,
            mixed_precision: None,
            cpu_offload: None,
            verify_execution_order: 1,
            keep_last_unit_unsharded: true,
            quantize_collectives: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_parse() {
        assert_eq!("full-shard".parse(), Ok(ShardingStrategy::FullShard));
        assert_eq!("SHARD_GRAD_OP".parse(), Ok(ShardingStrategy::ShardGradOp));
        assert_eq!("ddp".parse(), Ok(ShardingStrategy::NoShard));
        assert_eq!("hybrid".parse(), Ok(ShardingStrategy::HybridShard));
        assert!("zero4"
            .parse::<ShardingStrategy>()
            .unwrap_err()
            .contains("zero4"));
        assert_eq!("post".parse(), Ok(BackwardPrefetch::BackwardPost));
        assert!("sideways".parse::<BackwardPrefetch>().is_err());
        assert_eq!("on".parse(), Ok(LimitAllGathers::On));
        assert_eq!("false".parse(), Ok(LimitAllGathers::Off));
        assert!(matches!("auto".parse(), Ok(LimitAllGathers::Auto(_))));
        assert!("sometimes".parse::<LimitAllGathers>().is_err());
        assert_eq!("int8".parse(), Ok(Quantization::int8()));
        assert!("int4".parse::<Quantization>().is_err());
    }

    #[test]
    fn limit_modes_round_trip_through_the_two_fields() {
        let auto = LimitAllGathers::Auto(AdaptiveLimiter {
            clean_iterations_to_disable: 3,
        });
        for mode in [LimitAllGathers::Off, LimitAllGathers::On, auto] {
            assert_eq!(
                FsdpConfig::default()
                    .with_limit_all_gathers(mode)
                    .limit_mode(),
                mode
            );
        }
        assert_eq!(FsdpConfig::default().limit_mode(), LimitAllGathers::On);
        let off = FsdpConfig::default().with_limit_all_gathers(false);
        assert!(!off.limit_all_gathers && off.adaptive_limiter.is_none());
    }
}
