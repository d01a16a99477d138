//! Parameters and the context that creates them.
//!
//! A [`Parameter`] is a shared slot (identity = the `Arc`, so a tied parameter is *one*
//! `Parameter` used by two modules) holding the parameter's current [`Tensor`] — or nothing, for
//! a parameter created on the fake device — plus what was declared about it: its
//! fully-qualified name, shape, dtype, `requires_grad`, and the [`InitOp`]s that initialize it.
//! FSDP swaps views of its unsharded flat parameter into the slot with [`Parameter::set`];
//! fsdp-init materializes fake parameters from the recorded ops.
//!
//! [`InitContext`] creates parameters under a name prefix (`ctx.child("blocks").child("3")`):
//! eagerly on a device (values computed by [`init::fill_whole`] in stream work) or on the fake
//! device (nothing allocated, ops recorded).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};

use fsdp_alloc::{DType, Device};

use crate::context::current_stream;
use crate::error::{AutogradError, Result};
use crate::init::{self, InitError, InitOp};
use crate::launch::{launch, Arg};
use crate::tensor::{checked_numel, numel_of, Tensor};

static NEXT_PARAM_ID: AtomicU64 = AtomicU64::new(1);

struct ParamInner {
    id: u64,
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    requires_grad: bool,
    init_ops: Vec<InitOp>,
    seed: u64,
    tensor: RwLock<Option<Tensor>>,
}

/// A named model parameter: a shared slot for its current tensor plus its declaration.
/// Cheap to clone; clones are the same parameter ([`Parameter::ptr_eq`]).
#[derive(Clone)]
pub struct Parameter {
    inner: Arc<ParamInner>,
}

impl std::fmt::Debug for Parameter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parameter")
            .field("name", &self.inner.name)
            .field("shape", &self.inner.shape)
            .field("dtype", &self.inner.dtype)
            .field("materialized", &self.is_materialized())
            .finish()
    }
}

impl Parameter {
    /// A parameter holding `tensor` (which becomes a leaf requiring grad if `requires_grad`).
    /// `init_ops` and `seed` record how it was (or would be) initialized.
    ///
    /// # Errors
    /// [`AutogradError::RequiresGrad`] if `tensor` is not a float leaf but `requires_grad`.
    pub fn new(
        name: impl Into<String>,
        tensor: Tensor,
        requires_grad: bool,
        init_ops: Vec<InitOp>,
        seed: u64,
    ) -> Result<Parameter> {
        if requires_grad {
            tensor.set_requires_grad(true)?;
        }
        Ok(Parameter {
            inner: Arc::new(ParamInner {
                id: NEXT_PARAM_ID.fetch_add(1, Ordering::Relaxed),
                name: name.into(),
                shape: tensor.shape().to_vec(),
                dtype: tensor.dtype(),
                requires_grad,
                init_ops,
                seed,
                tensor: RwLock::new(Some(tensor)),
            }),
        })
    }

    /// A parameter without a tensor (the fake device): only its declaration is kept.
    pub fn unmaterialized(
        name: impl Into<String>,
        shape: &[usize],
        dtype: DType,
        requires_grad: bool,
        init_ops: Vec<InitOp>,
        seed: u64,
    ) -> Parameter {
        Parameter {
            inner: Arc::new(ParamInner {
                id: NEXT_PARAM_ID.fetch_add(1, Ordering::Relaxed),
                name: name.into(),
                shape: shape.to_vec(),
                dtype,
                requires_grad,
                init_ops,
                seed,
                tensor: RwLock::new(None),
            }),
        }
    }

    /// The current tensor.
    ///
    /// # Errors
    /// [`AutogradError::NoTensor`] for an unmaterialized (fake) parameter.
    pub fn get(&self) -> Result<Tensor> {
        self.try_get().ok_or_else(|| AutogradError::NoTensor {
            name: self.inner.name.clone(),
        })
    }

    /// The current tensor, `None` if unmaterialized.
    pub fn try_get(&self) -> Option<Tensor> {
        self.inner
            .tensor
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts `tensor` in the slot (e.g. FSDP's view into its unsharded flat parameter, or
    /// fsdp-init's materialized values) and returns the previous one. The shape must match the
    /// declared shape; the dtype may differ (mixed precision).
    ///
    /// # Errors
    /// [`AutogradError::Parameter`] if the shape differs.
    pub fn set(&self, tensor: Tensor) -> Result<Option<Tensor>> {
        if tensor.shape() != self.inner.shape.as_slice() {
            return Err(AutogradError::Parameter {
                name: self.inner.name.clone(),
                detail: format!(
                    "cannot set a tensor of shape {:?}; the parameter is {:?}",
                    tensor.shape(),
                    self.inner.shape
                ),
            });
        }
        Ok(self
            .inner
            .tensor
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .replace(tensor))
    }

    /// Puts freshly initialized values in the slot (fsdp-init's materialization): `tensor` must
    /// be a leaf of the declared shape and dtype; it is marked `requires_grad` as declared.
    /// Returns the previous tensor.
    ///
    /// # Errors
    /// [`AutogradError::Parameter`] if the shape or dtype differs or `tensor` is not a leaf.
    pub fn materialize(&self, tensor: Tensor) -> Result<Option<Tensor>> {
        if tensor.dtype() != self.inner.dtype || !tensor.is_leaf() {
            return Err(AutogradError::Parameter {
                name: self.inner.name.clone(),
                detail: format!(
                    "materialize needs a leaf of dtype {}, got a {} {}",
                    self.inner.dtype,
                    tensor.dtype(),
                    if tensor.is_leaf() { "leaf" } else { "non-leaf" }
                ),
            });
        }
        if self.inner.requires_grad {
            tensor.set_requires_grad(true)?;
        }
        self.set(tensor)
    }

    /// Empties the slot, returning the tensor it held.
    pub fn take(&self) -> Option<Tensor> {
        self.inner
            .tensor
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// True if the slot holds a tensor.
    pub fn is_materialized(&self) -> bool {
        self.try_get().is_some()
    }

    /// Fully-qualified name given at creation (e.g. `blocks.3.attn.qkv.weight`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Declared shape.
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel_of(&self.inner.shape)
    }

    /// Declared dtype (the dtype it was created with).
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// Whether the parameter is trained.
    pub fn requires_grad(&self) -> bool {
        self.inner.requires_grad
    }

    /// The recorded init ops.
    pub fn init_ops(&self) -> &[InitOp] {
        &self.inner.init_ops
    }

    /// The RNG seed of its init context.
    pub fn seed(&self) -> u64 {
        self.inner.seed
    }

    /// Process-unique id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// True if both handles are the same parameter.
    pub fn ptr_eq(&self, other: &Parameter) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The gradient of the current tensor, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.try_get().and_then(|t| t.grad())
    }
}

struct CtxShared {
    device: Option<Device>,
    seed: u64,
    params: Mutex<(Vec<Parameter>, HashMap<String, Parameter>)>,
}

/// Creates named parameters, eagerly on a device or on the fake device. Cheap to clone; children
/// share the parent's registry of created parameters (for [`InitOp::CopyFrom`] and
/// [`InitContext::params`]).
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
///
/// let ctx = InitContext::fake(0);
/// let p = ctx.child("blocks").child("3").param("bias", &[4], DType::F32, vec![InitOp::Fill(0.0)])?;
/// assert_eq!(p.name(), "blocks.3.bias");
/// assert!(!p.is_materialized()); // the fake device allocates nothing
///
/// let dev = Device::cpu(0);
/// let eager = InitContext::eager(&dev, 0);
/// let w = eager.param("w", &[2, 2], DType::F32, vec![InitOp::Fill(0.5), InitOp::Scale(2.0)])?;
/// assert_eq!(w.get()?.to_vec::<f32>()?, vec![1.0; 4]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
#[derive(Clone)]
pub struct InitContext {
    shared: Arc<CtxShared>,
    prefix: String,
}

impl std::fmt::Debug for InitContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InitContext")
            .field("prefix", &self.prefix)
            .field("fake", &self.is_fake())
            .field("seed", &self.shared.seed)
            .finish()
    }
}

impl InitContext {
    fn with_device(device: Option<Device>, seed: u64) -> InitContext {
        InitContext {
            shared: Arc::new(CtxShared {
                device,
                seed,
                params: Mutex::new((Vec::new(), HashMap::new())),
            }),
            prefix: String::new(),
        }
    }

    /// Parameters are allocated on `device` and initialized at once (on its current stream).
    pub fn eager(device: &Device, seed: u64) -> InitContext {
        InitContext::with_device(Some(device.clone()), seed)
    }

    /// Parameters are only declared (shape, dtype, init ops); nothing is allocated.
    pub fn fake(seed: u64) -> InitContext {
        InitContext::with_device(None, seed)
    }

    /// A context whose names are prefixed by `name.` (relative to this one).
    pub fn child(&self, name: &str) -> InitContext {
        InitContext {
            shared: Arc::clone(&self.shared),
            prefix: self.fqn(name),
        }
    }

    /// The current name prefix (`""` at the root).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The fully-qualified name of `name` in this context.
    pub fn fqn(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// True for the fake device.
    pub fn is_fake(&self) -> bool {
        self.shared.device.is_none()
    }

    /// The device (`None` for the fake device).
    pub fn device(&self) -> Option<&Device> {
        self.shared.device.as_ref()
    }

    /// The init seed.
    pub fn seed(&self) -> u64 {
        self.shared.seed
    }

    /// Every parameter created through this context tree, in creation order.
    pub fn params(&self) -> Vec<Parameter> {
        self.shared
            .params
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// Declares a trainable parameter `name` (relative to this context) of `shape` and `dtype`
    /// initialized by `ops` (applied in order to zeros).
    ///
    /// Eager: allocates it and computes the values with [`init::fill_whole`] inside stream work
    /// (`CopyFrom` sources resolved among parameters this context tree created earlier), then
    /// waits for that work so that init errors are returned here. Fake: records only.
    ///
    /// # Errors
    /// [`AutogradError::Parameter`] for a duplicate name, a non-float dtype or an unknown
    /// `CopyFrom` source; [`AutogradError::Init`] for invalid ops.
    pub fn param(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        ops: Vec<InitOp>,
    ) -> Result<Parameter> {
        let fqn = self.fqn(name);
        let perr = |detail: String| AutogradError::Parameter {
            name: fqn.clone(),
            detail,
        };
        if !dtype.is_float() {
            return Err(perr(format!("parameters must be float, got {dtype}")));
        }
        if checked_numel("param", shape)?
            .checked_mul(dtype.size())
            .is_none()
        {
            return Err(perr(format!("shape {shape:?} overflows the address space")));
        }
        let mut reg = self.shared.params.lock().unwrap_or_else(|e| e.into_inner());
        if reg.1.contains_key(&fqn) {
            return Err(perr("a parameter with this name already exists".into()));
        }
        let seed = self.shared.seed;
        let p = match &self.shared.device {
            None => Parameter::unmaterialized(fqn.clone(), shape, dtype, true, ops, seed),
            Some(dev) => {
                // Sources of CopyFrom: their current memory, read inside the work.
                let stream = current_stream(dev);
                let mut sources: HashMap<String, Arg> = HashMap::new();
                for op in &ops {
                    if let InitOp::CopyFrom { source } = op {
                        let src = reg.1.get(source).ok_or_else(|| {
                            perr(format!(
                                "CopyFrom source `{source}` was not created earlier by this \
                                 context; create the source first"
                            ))
                        })?;
                        let t = src.get()?.contig()?;
                        sources.insert(source.clone(), t.arg("init", &stream)?);
                    }
                }
                let t = Tensor::empty_on(shape, dtype, dev, &stream)?;
                let out = t.arg("init", &stream)?;
                let (tx, rx) = mpsc::channel::<std::result::Result<(), InitError>>();
                let (ops2, fqn2, shape2) = (ops.clone(), fqn.clone(), shape.to_vec());
                launch(&stream, "init", move || {
                    let r = out.f32_mut("init", false, |o| {
                        let mut resolve = |src: &str| -> std::result::Result<Vec<f32>, InitError> {
                            match sources.get(src) {
                                Some(a) => Ok(a.f32("init", <[f32]>::to_vec)),
                                None => Err(InitError::Unresolved {
                                    source_fqn: src.to_string(),
                                    reason: "not a parameter of this context".into(),
                                }),
                            }
                        };
                        init::fill_whole(&ops2, seed, &fqn2, &shape2, o, &mut resolve)
                    });
                    let _ = tx.send(r);
                });
                match rx.recv() {
                    Ok(r) => r?,
                    Err(_) => {
                        stream.synchronize()?;
                    }
                }
                Parameter::new(fqn.clone(), t, true, ops, seed)?
            }
        };
        reg.0.push(p.clone());
        reg.1.insert(fqn, p.clone());
        Ok(p)
    }

    /// Registers an existing parameter under its own name (e.g. a tied parameter created
    /// elsewhere), so that later `CopyFrom` ops can name it.
    ///
    /// # Errors
    /// [`AutogradError::Parameter`] if another parameter already has that name.
    pub fn register(&self, p: &Parameter) -> Result<()> {
        let mut reg = self.shared.params.lock().unwrap_or_else(|e| e.into_inner());
        match reg.1.get(p.name()) {
            Some(q) if q.ptr_eq(p) => Ok(()),
            Some(_) => Err(AutogradError::Parameter {
                name: p.name().to_string(),
                detail: "a different parameter with this name already exists".into(),
            }),
            None => {
                reg.0.push(p.clone());
                reg.1.insert(p.name().to_string(), p.clone());
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_from_duplicates_and_materialize() {
        let dev = Device::cpu(0);
        let ctx = InitContext::eager(&dev, 3);
        let a = ctx
            .child("a")
            .param(
                "w",
                &[2, 3],
                DType::F32,
                vec![InitOp::Normal {
                    mean: 0.0,
                    std: 1.0,
                }],
            )
            .unwrap();
        let b = ctx
            .param(
                "b",
                &[6],
                DType::F32,
                vec![
                    InitOp::CopyFrom {
                        source: "a.w".into(),
                    },
                    InitOp::Scale(2.0),
                ],
            )
            .unwrap();
        let av = a.get().unwrap().to_vec::<f32>().unwrap();
        let bv = b.get().unwrap().to_vec::<f32>().unwrap();
        assert_eq!(bv, av.iter().map(|v| v * 2.0).collect::<Vec<_>>());
        assert!(a.get().unwrap().requires_grad());
        // Errors: duplicate name, unknown source, invalid op, integer dtype.
        let dup = ctx.child("a").param("w", &[1], DType::F32, vec![]);
        assert!(matches!(dup, Err(AutogradError::Parameter { .. })));
        let unknown = ctx.param(
            "c",
            &[1],
            DType::F32,
            vec![InitOp::CopyFrom {
                source: "nope".into(),
            }],
        );
        assert!(unknown.unwrap_err().to_string().contains("nope"));
        let bad = ctx.param(
            "d",
            &[2],
            DType::F32,
            vec![InitOp::Normal {
                mean: 0.0,
                std: -1.0,
            }],
        );
        assert!(matches!(bad, Err(AutogradError::Init(_))), "{bad:?}");
        assert!(ctx.param("e", &[2], DType::I64, vec![]).is_err());
        assert_eq!(ctx.params().len(), 2);

        // Materializing a fake parameter.
        let fake = InitContext::fake(3)
            .param("w", &[2], DType::F32, vec![InitOp::Fill(1.0)])
            .unwrap();
        assert!(matches!(fake.get(), Err(AutogradError::NoTensor { .. })));
        assert!(fake
            .materialize(Tensor::zeros(&[3], DType::F32, &dev).unwrap())
            .is_err());
        assert!(fake
            .materialize(Tensor::zeros(&[2], DType::BF16, &dev).unwrap())
            .is_err());
        fake.materialize(Tensor::ones(&[2], DType::F32, &dev).unwrap())
            .unwrap();
        assert!(fake.get().unwrap().requires_grad());
        assert_eq!(
            fake.take().unwrap().to_vec::<f32>().unwrap(),
            vec![1.0, 1.0]
        );
        assert!(!fake.is_materialized());
    }

    #[test]
    fn eager_values_are_the_counter_based_init_of_the_name() {
        let dev = Device::cpu(0);
        let ctx = InitContext::eager(&dev, 11).child("blocks").child("0");
        let ops = vec![
            InitOp::Normal {
                mean: 0.0,
                std: 0.02,
            },
            InitOp::Scale(0.5),
        ];
        let p = ctx.param("w", &[4, 5], DType::F32, ops.clone()).unwrap();
        let mut want = vec![0.0f32; 20];
        init::fill_positionwise(&ops, 11, "blocks.0.w", &[4, 5], 0, &mut want).unwrap();
        assert_eq!(p.get().unwrap().to_vec::<f32>().unwrap(), want);
        // Half-precision parameters hold the rounded values.
        let h = ctx.param("h", &[4, 5], DType::BF16, ops.clone()).unwrap();
        let mut want = vec![0.0f32; 20];
        init::fill_positionwise(&ops, 11, "blocks.0.h", &[4, 5], 0, &mut want).unwrap();
        let want: Vec<f32> = want
            .iter()
            .map(|&v| f32::from(half::bf16::from_f32(v)))
            .collect();
        assert_eq!(h.get().unwrap().to_vec_f32().unwrap(), want);
    }
}
