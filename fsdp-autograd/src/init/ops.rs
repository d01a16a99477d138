//! What an initializer is: [`InitOp`] (the recorded description of one step of a parameter's
//! initialization), its arguments ([`FanMode`], [`Nonlinearity`], [`CustomInit`]) and the fans of a
//! shape ([`compute_fans`]). Pure data; evaluation lives in `fill` and `orthogonal`.

use std::fmt;
use std::sync::Arc;

/// Which fan a Kaiming initializer scales by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FanMode {
    /// Preserve the variance of activations in the forward pass (`fan_in`).
    FanIn,
    /// Preserve the variance of gradients in the backward pass (`fan_out`).
    FanOut,
}

/// The nonlinearity a Kaiming or Xavier gain is computed for ([`Nonlinearity::gain`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Nonlinearity {
    /// Identity (also linear convolutions and sigmoid in PyTorch): gain 1.
    Linear,
    /// ReLU: gain √2.
    Relu,
    /// Leaky ReLU with the given negative slope: gain √(2 / (1 + slope²)). PyTorch's default
    /// `nn.Linear` weight init is Kaiming uniform with `LeakyRelu(√5)`.
    LeakyRelu(f32),
    /// tanh: gain 5/3.
    Tanh,
    /// GELU: gain √2. PyTorch's `calculate_gain` has no GELU entry; we use ReLU's gain, which GELU
    /// approaches for large inputs. Documented choice, not a PyTorch parity claim.
    Gelu,
}

impl Nonlinearity {
    /// The recommended gain, as `torch.nn.init.calculate_gain` (in `f64`).
    ///
    /// ```
    /// use fsdp_autograd::init::Nonlinearity;
    /// assert_eq!(Nonlinearity::Linear.gain(), 1.0);
    /// assert!((Nonlinearity::Relu.gain() - 2f64.sqrt()).abs() < 1e-15);
    /// assert!((Nonlinearity::LeakyRelu(0.0).gain() - 2f64.sqrt()).abs() < 1e-15);
    /// ```
    pub fn gain(&self) -> f64 {
        match *self {
            Nonlinearity::Linear => 1.0,
            Nonlinearity::Relu | Nonlinearity::Gelu => 2f64.sqrt(),
            Nonlinearity::LeakyRelu(slope) => {
                let s = f64::from(slope);
                (2.0 / (1.0 + s * s)).sqrt()
            }
            Nonlinearity::Tanh => 5.0 / 3.0,
        }
    }
}

/// The closure type of a [`CustomInit`]: it receives the whole tensor's values (row-major, after
/// the ops before it) and the shape, and overwrites or edits the values in place.
pub type CustomInitFn = dyn Fn(&mut [f32], &[usize]) + Send + Sync;

/// A named user initializer over the whole tensor (for example an orthogonal init).
///
/// It needs every element at once, so it is not position-wise: a deferred materializer must build
/// the whole parameter to run it. It must be deterministic (a pure function of its inputs) for
/// deferred init to reproduce eager init; if it needs randomness, derive it from values it is
/// given or capture a seed.
#[derive(Clone)]
pub struct CustomInit {
    name: String,
    f: Arc<CustomInitFn>,
}

impl CustomInit {
    /// A custom initializer called `name` (used in error messages and `Debug`).
    ///
    /// ```
    /// use fsdp_autograd::init::CustomInit;
    /// let eye = CustomInit::new("eye", |v: &mut [f32], shape: &[usize]| {
    ///     let cols = shape.last().copied().unwrap_or(1);
    ///     for (i, x) in v.iter_mut().enumerate() {
    ///         *x = if i / cols == i % cols { 1.0 } else { 0.0 };
    ///     }
    /// });
    /// let mut v = vec![5.0; 4];
    /// eye.apply(&mut v, &[2, 2]);
    /// assert_eq!(v, [1.0, 0.0, 0.0, 1.0]);
    /// ```
    pub fn new(
        name: impl Into<String>,
        f: impl Fn(&mut [f32], &[usize]) + Send + Sync + 'static,
    ) -> Self {
        CustomInit {
            name: name.into(),
            f: Arc::new(f),
        }
    }

    /// The initializer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Run the closure on a whole tensor's values.
    pub fn apply(&self, values: &mut [f32], shape: &[usize]) {
        (self.f)(values, shape)
    }
}

impl fmt::Debug for CustomInit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomInit")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// One step of a parameter's initialization. A parameter's values are the result of applying its
/// ops in order to a tensor of zeros.
///
/// Every op except [`InitOp::CopyFrom`], [`InitOp::Orthogonal`] and [`InitOp::Custom`] is
/// *position-wise*: the new value of element `i` depends only on its old value, `i` and the op's
/// key (see the [`init`](super) module docs), so any sub-range can be computed alone
/// ([`fill_positionwise`](super::fill_positionwise)).
#[derive(Debug, Clone)]
pub enum InitOp {
    /// Every element set to the value (zeros, ones, constants).
    Fill(f32),
    /// Uniform on `[low, high)`. Needs `low ≤ high`, both finite.
    Uniform {
        /// Inclusive lower bound.
        low: f32,
        /// Exclusive upper bound (equal bounds fill with `low`).
        high: f32,
    },
    /// Normal with the given mean and standard deviation (`std ≥ 0`, finite).
    Normal {
        /// Mean.
        mean: f32,
        /// Standard deviation.
        std: f32,
    },
    /// Normal(mean, std) conditioned on `[a, b]` (absolute bounds, as PyTorch's `trunc_normal_`).
    /// Needs `std ≥ 0` and `a ≤ b`, all finite.
    TruncatedNormal {
        /// Mean of the untruncated normal.
        mean: f32,
        /// Standard deviation of the untruncated normal.
        std: f32,
        /// Lower bound.
        a: f32,
        /// Upper bound.
        b: f32,
    },
    /// Uniform on `[−bound, bound)` with `bound = gain · √(3 / fan)` (PyTorch `kaiming_uniform_`).
    KaimingUniform {
        /// Which fan to scale by.
        mode: FanMode,
        /// The nonlinearity the gain is for.
        nonlinearity: Nonlinearity,
    },
    /// Normal(0, gain / √fan) (PyTorch `kaiming_normal_`).
    KaimingNormal {
        /// Which fan to scale by.
        mode: FanMode,
        /// The nonlinearity the gain is for.
        nonlinearity: Nonlinearity,
    },
    /// Uniform on `[−a, a)` with `a = gain · √(6 / (fan_in + fan_out))` (PyTorch
    /// `xavier_uniform_`).
    XavierUniform {
        /// Multiplier of the bound.
        gain: f32,
    },
    /// Normal(0, gain · √(2 / (fan_in + fan_out))) (PyTorch `xavier_normal_`).
    XavierNormal {
        /// Multiplier of the standard deviation.
        gain: f32,
    },
    /// Multiply the current values by the factor (in `f32`), e.g. GPT-2's residual-projection
    /// scaling by `1/√(2·n_layers)`.
    Scale(f32),
    /// Overwrite with the current values of another parameter with the same number of elements,
    /// named by its fully-qualified name (a cross-parameter dependency; whole tensor).
    CopyFrom {
        /// Fully-qualified name of the source parameter.
        source: String,
    },
    /// A (semi-)orthogonal matrix times `gain` (PyTorch `orthogonal_`): the tensor is viewed as
    /// `rows = shape[0]` × `cols = numel / rows`; a standard-normal matrix drawn from the op's
    /// counter-based stream (element `i` from block `i`, as [`InitOp::Normal`]) is QR-factorized
    /// on the host in `f64` (Householder), and `Q` — made unique by giving `R` a positive diagonal
    /// — is the result (its transpose when `rows < cols`): orthonormal columns if `rows ≥ cols`,
    /// orthonormal rows otherwise. Needs at least 2 dimensions and a finite gain. Whole-tensor
    /// (every element depends on all draws), `O(rows · cols · min(rows, cols))` host work.
    Orthogonal {
        /// Multiplier of the result.
        gain: f32,
    },
    /// A user closure over the whole tensor.
    Custom(CustomInit),
}

impl InitOp {
    /// Whether the op is position-wise (everything except [`InitOp::CopyFrom`],
    /// [`InitOp::Orthogonal`] and [`InitOp::Custom`]).
    ///
    /// ```
    /// use fsdp_autograd::init::InitOp;
    /// assert!(InitOp::Fill(0.0).is_positionwise());
    /// assert!(!InitOp::CopyFrom { source: "wte.weight".into() }.is_positionwise());
    /// ```
    pub fn is_positionwise(&self) -> bool {
        !matches!(
            self,
            InitOp::CopyFrom { .. } | InitOp::Orthogonal { .. } | InitOp::Custom(_)
        )
    }

    /// Whether the op ignores the current values (it overwrites every element). `Scale` and
    /// `Custom` read the current values; every other op overwrites.
    pub fn overwrites(&self) -> bool {
        !matches!(self, InitOp::Scale(_) | InitOp::Custom(_))
    }

    /// A short description for messages, e.g. `normal(mean=0, std=0.02)`.
    pub fn describe(&self) -> String {
        match self {
            InitOp::Fill(v) => format!("fill({v})"),
            InitOp::Uniform { low, high } => format!("uniform(low={low}, high={high})"),
            InitOp::Normal { mean, std } => format!("normal(mean={mean}, std={std})"),
            InitOp::TruncatedNormal { mean, std, a, b } => {
                format!("trunc_normal(mean={mean}, std={std}, a={a}, b={b})")
            }
            InitOp::KaimingUniform { mode, nonlinearity } => {
                format!("kaiming_uniform({mode:?}, {nonlinearity:?})")
            }
            InitOp::KaimingNormal { mode, nonlinearity } => {
                format!("kaiming_normal({mode:?}, {nonlinearity:?})")
            }
            InitOp::XavierUniform { gain } => format!("xavier_uniform(gain={gain})"),
            InitOp::XavierNormal { gain } => format!("xavier_normal(gain={gain})"),
            InitOp::Scale(s) => format!("scale({s})"),
            InitOp::CopyFrom { source } => format!("copy_from({source})"),
            InitOp::Orthogonal { gain } => format!("orthogonal(gain={gain})"),
            InitOp::Custom(c) => format!("custom({})", c.name()),
        }
    }

    /// A custom op from a name and a closure (shorthand for `InitOp::Custom(CustomInit::new(..))`).
    pub fn custom(
        name: impl Into<String>,
        f: impl Fn(&mut [f32], &[usize]) + Send + Sync + 'static,
    ) -> Self {
        InitOp::Custom(CustomInit::new(name, f))
    }
}

/// `(fan_in, fan_out)` of a shape, as PyTorch (see the `init` module docs; 1-D: both equal the length).
///
/// ```
/// use fsdp_autograd::init::compute_fans;
/// assert_eq!(compute_fans(&[3, 5]), Some((5, 3)));
/// assert_eq!(compute_fans(&[8, 4, 3, 3]), Some((36, 72)));
/// assert_eq!(compute_fans(&[7]), Some((7, 7)));
/// assert_eq!(compute_fans(&[]), None);
/// ```
pub fn compute_fans(shape: &[usize]) -> Option<(usize, usize)> {
    match shape.len() {
        0 => None,
        1 => Some((shape[0], shape[0])),
        _ => {
            let rf: usize = shape[2..].iter().product();
            Some((shape[1] * rf, shape[0] * rf))
        }
    }
}
