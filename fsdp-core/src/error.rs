//! The crate's error type, [`FsdpError`], and the structured reasons its variants carry: a leaf
//! of the crate (it imports no other module of it). State-dict errors wrap it
//! ([`crate::StateDictError::Fsdp`]), not the reverse.
//!
//! Every reason is a typed value a caller can match on — which unit, parameter, slot or setting;
//! the sizes, dtypes and devices expected and found — and its message says what to do.

use fsdp_alloc::{AllocError, DType, DeviceId};
use fsdp_autograd::AutogradError;
use fsdp_collectives::CollectiveError;
use fsdp_flatparam::LayoutError;

/// Everything that can go wrong in FSDP.
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// Unit planning failed (bad policy, bad module tree).
    #[error("wrapping: {0}")]
    Wrap(WrapError),
    /// A configuration that cannot work (e.g. a strategy without the process groups it needs).
    #[error("configuration: {0}")]
    Config(ConfigError),
    /// A tensor had the wrong element type for the operation (e.g. a gradient in f16 where the
    /// optimizer keeps f32 state).
    #[error("wrong dtype: {0}")]
    Dtype(DtypeError),
    /// A tensor or module lives on the wrong device (e.g. a model built on another rank's device).
    #[error("wrong device: {0}")]
    Device(DeviceError),
    /// An argument out of its domain (a wrong size, a negative learning rate, a non-finite clip
    /// norm, a non-contiguous tensor).
    #[error("invalid argument: {0}")]
    InvalidArgument(ArgumentError),
    /// A call made in a state where it cannot work (storage released, an optimizer state of
    /// another model, the grad scaler's calls out of order): the message says what to call
    /// first.
    #[error("invalid state: {0}")]
    State(StateError),
    /// A unit index that does not exist.
    #[error("unit {unit} does not exist (there are {units})")]
    UnknownUnit {
        /// The index asked for.
        unit: usize,
        /// How many units the model has.
        units: usize,
    },
    /// A device-runtime error (out of memory, a failed stream).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A tensor or autograd error.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A collective failed (a peer died, sizes disagreed, a timeout).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Building shards from recorded init ops or from existing parameters failed.
    #[error(transparent)]
    Init(#[from] fsdp_init::MaterializeError),
    /// A flat-parameter layout error.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Ranks ran their units in different orders in one iteration (see
    /// [`crate::FsdpConfig::verify_execution_order`]).
    #[error(
        "units ran in different orders on rank {rank} ({ours}) and rank {peer} ({theirs}) of \
         group `{group}`: FSDP pairs the ranks' collectives by issue order, so every rank must \
         run its units in the same order; make the forward's control flow the same on every \
         rank, or wrap the modules whose order varies into one unit"
    )]
    ExecutionOrder {
        /// This rank (in `group`).
        rank: usize,
        /// The first rank whose order differs.
        peer: usize,
        /// The group the orders were compared in.
        group: String,
        /// This rank's forward order, as unit paths.
        ours: String,
        /// The peer's forward order, as unit paths.
        theirs: String,
    },
}

/// Why unit planning failed ([`FsdpError::Wrap`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WrapError {
    /// The module list is empty.
    #[error("the model has no modules")]
    NoModules,
    /// The first module is not the root.
    #[error("the first module must be the root (path \"\"), got `{path}`")]
    RootNotFirst {
        /// The first module's path.
        path: String,
    },
    /// An explicit policy path names no module.
    #[error(
        "wrap policy names module `{path}`, but the model has no module at that path; module \
         paths look like `blocks.0` (see named_modules)"
    )]
    UnknownPath {
        /// The path the policy names.
        path: String,
    },
    /// A module comes before its parent.
    #[error(
        "module `{module}` appears before its parent `{parent}`: modules must be in pre-order"
    )]
    NotPreOrder {
        /// The module out of order.
        module: String,
        /// Its parent's path.
        parent: String,
    },
}

/// Why a configuration cannot work ([`FsdpError::Config`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A strategy with a replicate dimension was given a single process group.
    #[error(
        "{strategy} needs a DeviceMesh (shard and replicate groups); pass \
         Comm::Mesh(DeviceMesh::new(world, shard_size)?)"
    )]
    NeedsMesh {
        /// The strategy's name in the strategy table (`hybrid-shard`).
        strategy: &'static str,
    },
    /// A mixed-precision dtype FSDP cannot compute or communicate in.
    #[error("mixed precision {field} must be f32, bf16 or f16, got {dtype}")]
    MixedPrecisionDtype {
        /// `param_dtype` or `reduce_dtype`.
        field: &'static str,
        /// The dtype given.
        dtype: DType,
    },
    /// A setting that only a sharded strategy supports, asked of `NoShard`.
    #[error(
        "{setting} needs a sharded strategy: {reason} (use FullShard, ShardGradOp or HybridShard)"
    )]
    NeedsShardedStrategy {
        /// The [`crate::FsdpConfig`] field: `mixed_precision`, `quantize_collectives` or
        /// `cpu_offload`.
        setting: &'static str,
        /// Why `NoShard` cannot do it.
        reason: &'static str,
    },
    /// Quantized collectives asked together with mixed precision.
    #[error(
        "quantize_collectives quantizes f32 parameters and gradients; it does not combine with \
         mixed_precision yet (pick one)"
    )]
    QuantizedMixedPrecision,
    /// The quantization codec refused its setting (e.g. a block of 0 values).
    #[error("quantize_collectives: {0}")]
    Quantization(#[source] Box<CollectiveError>),
    /// `cpu_offload` names the compute device.
    #[error(
        "cpu_offload names the compute device {device} itself; give it a separate host device \
         (e.g. Device::cpu(1000 + rank))"
    )]
    OffloadToComputeDevice {
        /// The compute device.
        device: DeviceId,
    },
    /// A grad-scaler setting out of its domain.
    #[error("grad scaler: {field} is {value}; it must be {requirement}")]
    GradScaler {
        /// The [`crate::GradScalerConfig`] field.
        field: &'static str,
        /// The value given.
        value: String,
        /// What the value must be.
        requirement: &'static str,
    },
}

/// A tensor of the wrong element type ([`FsdpError::Dtype`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {what} is {actual}, expected {expected}: {why}")]
pub struct DtypeError {
    /// The operation (e.g. `AdamW::step`, `Fsdp::wrap`).
    pub op: String,
    /// The tensor (e.g. ``parameter `blocks.0.fc.weight` ``, ``slot `exp_avg` entry 2``).
    pub what: String,
    /// Its dtype.
    pub actual: DType,
    /// The dtype the operation needs.
    pub expected: DType,
    /// Why, or what to do.
    pub why: &'static str,
}

/// A tensor or module on the wrong device ([`FsdpError::Device`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {what} lives on {actual}, expected {expected}; {fix}")]
pub struct DeviceError {
    /// The operation.
    pub op: String,
    /// The tensor or device in question.
    pub what: String,
    /// Where it lives.
    pub actual: DeviceId,
    /// Where it should live.
    pub expected: ExpectedDevice,
    /// What to do.
    pub fix: String,
}

/// The device an operation needs ([`DeviceError::expected`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpectedDevice {
    /// This device (the stream's, the parameters').
    Exactly(DeviceId),
    /// Any CPU device (host memory).
    Cpu,
}

impl std::fmt::Display for ExpectedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpectedDevice::Exactly(d) => write!(f, "{d}"),
            ExpectedDevice::Cpu => f.write_str("a CPU device"),
        }
    }
}

/// An argument out of its domain ([`FsdpError::InvalidArgument`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgumentError {
    /// A count that does not match: the elements of a gradient or a state tensor, the entries
    /// of a state slot, the names or `requires_grad` flags of a unit.
    #[error("{op}: {what} has {actual} {counted}, expected {expected}")]
    Count {
        /// The operation.
        op: String,
        /// What was counted (e.g. ``the gradient of unit `blocks.0` ``).
        what: String,
        /// The unit of the count: `elements`, `entries`, `names`, `flags`.
        counted: &'static str,
        /// The count found.
        actual: usize,
        /// The count needed.
        expected: usize,
    },
    /// A tensor that must be contiguous is not.
    #[error(
        "{op}: {what} is not contiguous (shape {shape:?}, strides {strides:?}); pass a contiguous \
         copy"
    )]
    NotContiguous {
        /// The operation.
        op: String,
        /// The tensor.
        what: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Its strides.
        strides: Vec<usize>,
    },
    /// A hyper-parameter or setting out of its range (a non-finite learning rate, a beta of 1,
    /// a negative clip norm, a scale of 0).
    #[error("{op}: {name} is {value}; it must be {requirement}")]
    Value {
        /// The operation.
        op: String,
        /// The hyper-parameter (`lr`, `beta2`, `eps`, `max_norm`, …).
        name: String,
        /// The value given.
        value: String,
        /// What it must be.
        requirement: String,
    },
    /// Optimizer state with other slots than the optimizer keeps.
    #[error("{op}: state slots {actual:?}, but this optimizer keeps {expected:?}")]
    Slots {
        /// The operation.
        op: String,
        /// The slots given.
        actual: Vec<String>,
        /// The slots the optimizer keeps.
        expected: Vec<String>,
    },
}

/// A call made in a state where it cannot work ([`FsdpError::State`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// A tensor without memory (its storage was released).
    #[error(
        "{op}: {what} has no memory attached (its storage was released); materialize or gather \
         it before this call"
    )]
    StorageReleased {
        /// The operation.
        op: String,
        /// The tensor.
        what: String,
    },
    /// Optimizer state made for another model (another number of units, another shard size).
    #[error(
        "{op}: the optimizer holds {held} {what} where the model has {model}; the state belongs \
         to another model (use one optimizer per wrapped model)"
    )]
    ForeignOptimizerState {
        /// The operation.
        op: String,
        /// What was counted (`units/parameters`, ``elements in slot `exp_avg` entry 0``).
        what: String,
        /// The optimizer's count.
        held: usize,
        /// The model's count.
        model: usize,
    },
    /// A local optimizer's first step with no parameter materialized.
    #[error(
        "{op}: no parameter is materialized, so there is no device for the state; materialize \
         the parameters first"
    )]
    NothingMaterialized {
        /// The operation.
        op: String,
    },
    /// An optimizer rule launched with another number of state operands than it keeps.
    #[error("{op}: {actual} state operands passed where the rule keeps {expected}")]
    StateOperands {
        /// The rule's kernel name.
        op: String,
        /// Operands passed.
        actual: usize,
        /// Slots the rule keeps.
        expected: usize,
    },
    /// The grad scaler's calls out of order.
    #[error("{op}: {misuse}")]
    GradScaler {
        /// The call (`unscale`, `step`, `update()`).
        op: String,
        /// What was out of order.
        misuse: ScalerMisuse,
    },
    /// A kernel whose result never arrived although its stream reports no failure.
    #[error("{op}: the {kernel} kernel did not run and the stream reports no failure")]
    KernelDidNotRun {
        /// The operation.
        op: String,
        /// The kernel.
        kernel: &'static str,
    },
}

/// The grad scaler's calls out of order ([`StateError::GradScaler`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ScalerMisuse {
    /// A second unscale before `update()`.
    #[error(
        "the gradients were already unscaled since the last update(); call update() once per \
         iteration after step()"
    )]
    AlreadyUnscaled,
    /// A second step before `update()`.
    #[error("already stepped since the last update(); call update() once per iteration")]
    AlreadyStepped,
    /// `update()` without an unscale or step since the last one.
    #[error(
        "no inf/NaN check was recorded since the last update(); call unscale() or step() first"
    )]
    NothingRecorded,
}

impl From<FsdpError> for AutogradError {
    /// FSDP errors raised inside module or autograd hooks travel through autograd whole, as
    /// [`AutogradError::HookFailed`]; [`FsdpError::from_backward`] gets them back.
    fn from(e: FsdpError) -> AutogradError {
        match e {
            FsdpError::Autograd(a) => a,
            other => AutogradError::HookFailed(fsdp_autograd::HookError::new("FSDP", other)),
        }
    }
}

impl FsdpError {
    /// The FSDP error behind an autograd error, when FSDP raised it inside a hook (the forward's
    /// module hooks or backward's hooks and callbacks: an unshard, a reduction, the order check).
    ///
    /// ```no_run
    /// # fn demo(loss: fsdp_autograd::Tensor) {
    /// use fsdp_core::FsdpError;
    /// if let Err(e) = loss.backward() {
    ///     match FsdpError::from_backward(&e) {
    ///         Some(FsdpError::Collective(c)) => eprintln!("a collective failed: {c}"),
    ///         Some(other) => eprintln!("FSDP failed in backward: {other}"),
    ///         None => eprintln!("autograd failed: {e}"),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn from_backward(e: &AutogradError) -> Option<&FsdpError> {
        match e {
            AutogradError::HookFailed(h) => h.downcast_ref::<FsdpError>(),
            _ => None,
        }
    }

    /// This error with autograd's hook wrapping removed: for `FsdpError::Autograd` of an error
    /// FSDP raised in a hook, that FSDP error; otherwise `self`. Use it to match on errors that
    /// came back through `?` from `forward` or `backward`.
    pub fn root(&self) -> &FsdpError {
        match self {
            FsdpError::Autograd(a) => FsdpError::from_backward(a).map_or(self, FsdpError::root),
            _ => self,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = FsdpError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_raised_in_hooks_come_back_by_type() {
        let bad = || ConfigError::NeedsMesh {
            strategy: "hybrid-shard",
        };
        let through_autograd: AutogradError = FsdpError::Config(bad()).into();
        assert_eq!(
            through_autograd.to_string(),
            format!("a backward hook failed (FSDP): configuration: {}", bad())
        );
        assert!(matches!(
            FsdpError::from_backward(&through_autograd),
            Some(FsdpError::Config(ConfigError::NeedsMesh {
                strategy: "hybrid-shard"
            }))
        ));
        let returned: FsdpError = through_autograd.into();
        assert!(matches!(
            returned.root(),
            FsdpError::Config(ConfigError::NeedsMesh {
                strategy: "hybrid-shard"
            })
        ));
        // Autograd's own errors pass through unchanged and are their own root.
        let plain = FsdpError::Autograd(AutogradError::Backward("no graph".into()));
        assert!(matches!(plain.root(), FsdpError::Autograd(_)));
        let back: AutogradError = FsdpError::Autograd(AutogradError::NotInBackward).into();
        assert_eq!(back, AutogradError::NotInBackward);
        assert!(FsdpError::from_backward(&back).is_none());
    }

    /// The structured reasons keep the messages' wording: what went wrong, the values, what to
    /// do.
    #[test]
    fn structured_reasons_read_as_sentences() {
        let e = FsdpError::InvalidArgument(ArgumentError::Count {
            op: "AdamW::step".into(),
            what: "the gradient of unit `blocks.0`".into(),
            counted: "elements",
            actual: 12,
            expected: 16,
        });
        assert_eq!(
            e.to_string(),
            "invalid argument: AdamW::step: the gradient of unit `blocks.0` has 12 elements, \
             expected 16"
        );
        let e = FsdpError::Device(DeviceError {
            op: "CPU offload from cuda:0".into(),
            what: "the offload device".into(),
            actual: DeviceId::Cuda(1),
            expected: ExpectedDevice::Cpu,
            fix: "pass cpu_offload: Some(Device::cpu(..))".into(),
        });
        assert_eq!(
            e.to_string(),
            "wrong device: CPU offload from cuda:0: the offload device lives on cuda:1, expected \
             a CPU device; pass cpu_offload: Some(Device::cpu(..))"
        );
        let e = FsdpError::Dtype(DtypeError {
            op: "Fsdp::wrap".into(),
            what: "parameter `w`".into(),
            actual: DType::BF16,
            expected: DType::F32,
            why: "FSDP keeps f32 parameters",
        });
        assert_eq!(
            e.to_string(),
            "wrong dtype: Fsdp::wrap: parameter `w` is bf16, expected f32: FSDP keeps f32 \
             parameters"
        );
        let e = FsdpError::State(StateError::GradScaler {
            op: "grad scaler update()".into(),
            misuse: ScalerMisuse::NothingRecorded,
        });
        assert!(
            e.to_string().ends_with("call unscale() or step() first"),
            "{e}"
        );
        let e = FsdpError::Wrap(WrapError::UnknownPath {
            path: "blocks.7".into(),
        });
        assert!(e.to_string().contains("`blocks.7`"), "{e}");
    }
}
