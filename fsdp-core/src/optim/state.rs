//! Optimizer state: per slot one f32 tensor per unit (sharded) or per parameter (local), plus
//! step counts; shared by every optimizer and checked when loaded.

use fsdp_alloc::{DType, Device, Stream};
use fsdp_autograd::{Parameter, Tensor};

use super::sharded::zeros_on;
use crate::error::{
    ArgumentError, DeviceError, DtypeError, ExpectedDevice, FsdpError, Result, StateError,
};

/// Optimizer state by slot: `(slot name, one tensor per unit (sharded) or per parameter
/// (local), `None` where no step has created it yet)`.
pub type OptimizerState = Vec<(String, Vec<Option<Tensor>>)>;

/// State slots plus step counts.
#[derive(Debug, Clone)]
pub(crate) struct Slots {
    pub(crate) names: &'static [&'static str],
    /// `tensors[slot][unit or parameter]`.
    tensors: Vec<Vec<Option<Tensor>>>,
    pub(crate) steps: Vec<u64>,
}

impl Slots {
    /// Slots sized on first use (sharded optimizers: the model is known at the first step).
    pub(crate) fn new(names: &'static [&'static str]) -> Slots {
        Slots {
            names,
            tensors: vec![Vec::new(); names.len()],
            steps: Vec::new(),
        }
    }

    /// Slots for `n` parameters, known up front (local optimizers).
    pub(crate) fn sized(names: &'static [&'static str], n: usize) -> Slots {
        Slots {
            names,
            tensors: vec![vec![None; n]; names.len()],
            steps: vec![0; n],
        }
    }

    /// Sizes the state for `n` units on first use; afterwards `n` must not change.
    ///
    /// # Errors
    /// [`FsdpError::State`] when the state was made for another number of units.
    pub(crate) fn ensure(&mut self, n: usize, op: &str) -> Result<()> {
        if self.steps.is_empty() && self.tensors.iter().all(|t| t.is_empty()) {
            self.steps = vec![0; n];
            for t in &mut self.tensors {
                *t = vec![None; n];
            }
        }
        if self.steps.len() != n {
            return Err(FsdpError::State(StateError::ForeignOptimizerState {
                op: op.into(),
                what: "units/parameters".into(),
                held: self.steps.len(),
                model: n,
            }));
        }
        Ok(())
    }

    /// The state as handed out by `state()`.
    pub(crate) fn export(&self) -> OptimizerState {
        self.names
            .iter()
            .zip(&self.tensors)
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect()
    }

    /// The state tensor `tensors[slot][i]`, created as `n` zeros on `stream` if missing.
    /// Returns (tensor, created).
    ///
    /// # Errors
    /// [`FsdpError::State`] for a tensor of another size (state of another model).
    pub(crate) fn tensor(
        &mut self,
        slot: usize,
        i: usize,
        n: usize,
        device: &Device,
        stream: &Stream,
    ) -> Result<(Tensor, bool)> {
        match &self.tensors[slot][i] {
            Some(t) if t.numel() == n => Ok((t.clone(), false)),
            Some(t) => Err(FsdpError::State(StateError::ForeignOptimizerState {
                op: "optimizer step".into(),
                what: format!("elements in slot `{}` entry {i}", self.names[slot]),
                held: t.numel(),
                model: n,
            })),
            None => {
                let t = zeros_on(n, device, stream)?;
                self.tensors[slot][i] = Some(t.clone());
                Ok((t, true))
            }
        }
    }

    /// Validates and adopts `state`; `numel[i]` is the required size of entry `i`.
    ///
    /// # Errors
    /// [`FsdpError::InvalidArgument`] for missing or unknown slots and wrong counts or sizes,
    /// [`FsdpError::Dtype`] for non-f32 tensors, [`FsdpError::Device`] for tensors elsewhere.
    pub(crate) fn import(
        &mut self,
        op: &str,
        mut state: OptimizerState,
        steps: Vec<u64>,
        numel: &[usize],
        device: &Device,
    ) -> Result<()> {
        let n = numel.len();
        if steps.len() != n {
            return Err(FsdpError::InvalidArgument(ArgumentError::Count {
                op: op.into(),
                what: "the step counts (one per unit/parameter)".into(),
                counted: "entries",
                actual: steps.len(),
                expected: n,
            }));
        }
        let mut got: Vec<&str> = state.iter().map(|(s, _)| s.as_str()).collect();
        got.sort_unstable();
        let mut want: Vec<&str> = self.names.to_vec();
        want.sort_unstable();
        if got != want {
            return Err(FsdpError::InvalidArgument(ArgumentError::Slots {
                op: op.into(),
                actual: got.iter().map(|s| s.to_string()).collect(),
                expected: want.iter().map(|s| s.to_string()).collect(),
            }));
        }
        let mut tensors = Vec::with_capacity(self.names.len());
        for name in self.names {
            let i = state
                .iter()
                .position(|(s, _)| s == name)
                .expect("slot names checked above");
            let (_, per) = state.swap_remove(i);
            if per.len() != n {
                return Err(FsdpError::InvalidArgument(ArgumentError::Count {
                    op: op.into(),
                    what: format!("slot `{name}` (one entry per unit/parameter)"),
                    counted: "entries",
                    actual: per.len(),
                    expected: n,
                }));
            }
            for (j, (t, &want)) in per.iter().zip(numel).enumerate() {
                let Some(t) = t else { continue };
                if t.dtype() != DType::F32 {
                    return Err(FsdpError::Dtype(DtypeError {
                        op: op.into(),
                        what: format!("slot `{name}` entry {j}"),
                        actual: t.dtype(),
                        expected: DType::F32,
                        why: "optimizer state is f32",
                    }));
                }
                if t.numel() != want {
                    return Err(FsdpError::InvalidArgument(ArgumentError::Count {
                        op: op.into(),
                        what: format!("slot `{name}` entry {j}"),
                        counted: "elements",
                        actual: t.numel(),
                        expected: want,
                    }));
                }
                if !t.is_contiguous() {
                    return Err(FsdpError::InvalidArgument(ArgumentError::NotContiguous {
                        op: op.into(),
                        what: format!("slot `{name}` entry {j}"),
                        shape: t.shape().to_vec(),
                        strides: t.strides().to_vec(),
                    }));
                }
                if t.device().id() != device.id() {
                    return Err(FsdpError::Device(DeviceError {
                        op: op.into(),
                        what: format!("slot `{name}` entry {j}"),
                        actual: t.device().id(),
                        expected: ExpectedDevice::Exactly(device.id()),
                        fix: "load optimizer state onto the parameters' device".into(),
                    }));
                }
            }
            tensors.push(per);
        }
        self.tensors = tensors;
        self.steps = steps;
        Ok(())
    }
}

/// Numels of `params` and their (common) device.
///
/// # Errors
/// [`FsdpError::Device`] for parameters on several devices, [`FsdpError::State`] when none is
/// materialized.
pub(crate) fn local_sizes(params: &[Parameter], op: &str) -> Result<(Vec<usize>, Device)> {
    let mut device: Option<Device> = None;
    for p in params {
        if let Some(t) = p.try_get() {
            match &device {
                None => device = Some(t.device().clone()),
                Some(d) if d.id() != t.device().id() => {
                    return Err(FsdpError::Device(DeviceError {
                        op: op.into(),
                        what: format!("parameter `{}`", p.name()),
                        actual: t.device().id(),
                        expected: ExpectedDevice::Exactly(d.id()),
                        fix: "local optimizers keep all parameters on one device (the first \
                              parameter's)"
                            .into(),
                    }))
                }
                Some(_) => {}
            }
        }
    }
    let device = device
        .ok_or_else(|| FsdpError::State(StateError::NothingMaterialized { op: op.into() }))?;
    Ok((params.iter().map(|p| p.numel()).collect(), device))
}
