//! The [`Tensor`] handle: layout (shape, strides, offset), element type, storage, and the
//! autograd state (grad function for op outputs; grad slot and hooks for leaves).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytemuck::Pod;
use fsdp_alloc::{Buffer, DType, Device, Stream};
use half::{bf16, f16};

use crate::context::{current_stream, is_grad_enabled};
use crate::error::{arg_err, shape_err, AutogradError, Result};
use crate::kernels::elementwise::{Arange, Fill};
use crate::kernels::operand::contiguous_strides;
use crate::kernels::{Kernels, Operand, View};
use crate::launch::{strided_copy, Arg};
use crate::storage::Storage;
use graph::{Edge, Node, PostHookFn, TensorHookFn};

static NEXT_TENSOR_ID: AtomicU64 = AtomicU64::new(1);

/// Element types a tensor can be built from and read back as.
pub trait Element: Pod + Send + Sync + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element!(f32 => F32, f16 => F16, bf16 => BF16, i64 => I64, i32 => I32, u8 => U8);

/// Autograd state of a leaf.
#[derive(Default)]
pub(crate) struct LeafMeta {
    pub grad: Option<Tensor>,
    pub hooks: Vec<(u64, TensorHookFn)>,
    pub post_hooks: Vec<(u64, PostHookFn)>,
    /// The leaf's gradient accumulator node, alive while some graph references it.
    pub accumulator: Weak<Node>,
}

pub(crate) struct TensorImpl {
    id: u64,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    dtype: DType,
    storage: Storage,
    grad_fn: Option<Edge>,
    requires_grad: AtomicBool,
    leaf: Mutex<LeafMeta>,
}

/// An n-dimensional array on a device: a cheap, clonable handle (`Arc`); clones are the same
/// tensor (same grad, same hooks).
///
/// A tensor is a view (shape, strides, offset in elements) into a [`Storage`] shared with its
/// other views. Operations launch their kernels on the thread's current stream
/// ([`crate::with_stream`]) and return at once; only readback ([`Tensor::to_vec`],
/// [`Tensor::item`]) waits. Supported element types: `f32`, `f16`, `bf16` (computed in `f32`),
/// and `i64` for token ids and targets.
///
/// ```
/// use fsdp_alloc::Device;
/// use fsdp_autograd::Tensor;
///
/// let dev = Device::cpu(0);
/// let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], &dev)?;
/// w.set_requires_grad(true)?;
/// let x = Tensor::from_vec(vec![1.0f32, -1.0], &[1, 2], &dev)?;
/// let loss = x.matmul(&w)?.sum()?; // (1·1 − 1·3) + (1·2 − 1·4) = −4
/// assert_eq!(loss.item()?, -4.0);
/// loss.backward()?;
/// assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![1.0, 1.0, -1.0, -1.0]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
#[derive(Clone)]
pub struct Tensor {
    pub(crate) inner: Arc<TensorImpl>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Tensor");
        d.field("id", &self.inner.id)
            .field("shape", &self.inner.shape)
            .field("dtype", &self.inner.dtype)
            .field("device", &self.device().id());
        if !self.is_contiguous() || self.inner.offset != 0 {
            d.field("strides", &self.inner.strides)
                .field("offset", &self.inner.offset);
        }
        d.field("requires_grad", &self.requires_grad());
        if let Some(e) = &self.inner.grad_fn {
            d.field("grad_fn", &e.node.name);
        }
        d.finish()
    }
}

pub(crate) fn numel_of(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The element count of `shape`, or a shape error if it overflows `usize`.
pub(crate) fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .ok_or_else(|| {
            shape_err(
                op,
                format!("the element count of {shape:?} overflows usize"),
            )
        })
}

impl Tensor {
    // ------------------------------------------------------------------ construction

    /// A tensor viewing `storage` with the given layout (no autograd history).
    ///
    /// # Errors
    /// [`AutogradError::Shape`] if the view reaches past the end of the storage or the shape and
    /// strides differ in length.
    pub fn from_storage(
        storage: Storage,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        if shape.len() != strides.len() {
            return Err(shape_err(
                "from_storage",
                format!("shape {shape:?} and strides {strides:?} differ in length"),
            ));
        }
        checked_numel("from_storage", shape)?;
        let span = checked_span(shape, strides).ok_or_else(|| {
            shape_err(
                "from_storage",
                format!("shape {shape:?} with strides {strides:?} overflows usize"),
            )
        })?;
        let need = offset
            .checked_add(span)
            .and_then(|e| e.checked_mul(dtype.size()))
            .unwrap_or(usize::MAX);
        if span > 0 && need > storage.nbytes() {
            return Err(shape_err(
                "from_storage",
                format!(
                    "a {dtype} view with shape {shape:?}, strides {strides:?} and offset {offset} \
                     needs {need} bytes but the storage has {}",
                    storage.nbytes()
                ),
            ));
        }
        Ok(Tensor::from_parts(
            storage,
            shape.to_vec(),
            strides.to_vec(),
            offset,
            dtype,
        ))
    }

    pub(crate) fn from_parts(
        storage: Storage,
        shape: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
        dtype: DType,
    ) -> Tensor {
        Tensor {
            inner: Arc::new(TensorImpl {
                id: NEXT_TENSOR_ID.fetch_add(1, Ordering::Relaxed),
                shape,
                strides,
                offset,
                dtype,
                storage,
                grad_fn: None,
                requires_grad: AtomicBool::new(false),
                leaf: Mutex::new(LeafMeta::default()),
            }),
        }
    }

    /// Wraps an existing allocation of `device` (e.g. an all-gathered flat parameter) as a
    /// contiguous tensor of `shape` and `dtype`.
    ///
    /// # Errors
    /// [`AutogradError::Shape`] if the buffer is smaller than the tensor;
    /// [`AutogradError::Attach`] if it belongs to another device.
    pub fn from_buffer(
        buffer: Buffer,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let storage = Storage::new(buffer, device)?;
        Tensor::from_storage(storage, shape, &contiguous_strides(shape), 0, dtype)
    }

    /// An uninitialized contiguous tensor allocated on `stream`.
    pub(crate) fn empty_on(
        shape: &[usize],
        dtype: DType,
        device: &Device,
        stream: &Stream,
    ) -> Result<Tensor> {
        let nbytes = checked_numel("empty", shape)?
            .checked_mul(dtype.size())
            .ok_or_else(|| {
                shape_err(
                    "empty",
                    format!("{shape:?} of {dtype} overflows usize bytes"),
                )
            })?;
        let buffer = device.alloc(nbytes, stream)?;
        let storage = Storage::new(buffer, device)?;
        Ok(Tensor::from_parts(
            storage,
            shape.to_vec(),
            contiguous_strides(shape),
            0,
            dtype,
        ))
    }

    /// A contiguous tensor with unspecified contents (reused allocator memory), allocated on the
    /// current stream. Use it as the destination of a kernel that overwrites every element.
    pub fn empty(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::empty_on(shape, dtype, device, &current_stream(device))
    }

    /// A tensor filled with `value` (converted to `dtype`; floats and integer types).
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        let stream = current_stream(device);
        let t = Tensor::empty_on(shape, dtype, device, &stream)?;
        let a = t.operand_on("full", &stream)?;
        Kernels::for_device(device)?.launch(
            &stream,
            &Fill {
                n: t.numel(),
                value,
                out: &a,
            },
        )?;
        Ok(t)
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// A 0-dimensional `f32` tensor.
    pub fn scalar(value: f32, device: &Device) -> Result<Tensor> {
        Tensor::full(&[], value as f64, DType::F32, device)
    }

    /// The `i64` tensor `[0, 1, …, n-1]`.
    pub fn arange(n: usize, device: &Device) -> Result<Tensor> {
        let stream = current_stream(device);
        let t = Tensor::empty_on(&[n], DType::I64, device, &stream)?;
        let a = t.operand_on("arange", &stream)?;
        Kernels::for_device(device)?.launch(&stream, &Arange { n, out: &a })?;
        Ok(t)
    }

    /// A contiguous tensor holding `data` (moved to the device by a kernel on the current stream).
    ///
    /// # Errors
    /// [`AutogradError::Shape`] if `data.len()` is not the number of elements of `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize], device: &Device) -> Result<Tensor> {
        let numel = checked_numel("from_vec", shape)?;
        if data.len() != numel {
            return Err(shape_err(
                "from_vec",
                format!(
                    "{} values do not fill shape {shape:?} ({numel} elements)",
                    data.len()
                ),
            ));
        }
        let stream = current_stream(device);
        let t = Tensor::empty_on(shape, T::DTYPE, device, &stream)?;
        let a = t.operand_on("from_vec", &stream)?;
        let bytes = bytemuck::cast_slice::<T, u8>(&data).to_vec();
        Kernels::for_device(device)?.write(&stream, bytes, &a)?;
        Ok(t)
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize], device: &Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    // ------------------------------------------------------------------ layout accessors

    /// Process-unique id of this tensor handle (views and op outputs get new ids).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }

    /// Number of dimensions.
    pub fn dim(&self) -> usize {
        self.inner.shape.len()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.inner.strides
    }

    /// Offset of the first element in the storage, in elements.
    pub fn offset(&self) -> usize {
        self.inner.offset
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// The device.
    pub fn device(&self) -> &Device {
        self.inner.storage.device()
    }

    /// The storage (shared with every view of it).
    pub fn storage(&self) -> &Storage {
        &self.inner.storage
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel_of(&self.inner.shape)
    }

    /// The storage's version counter (bumped by in-place operations on any view of it).
    pub fn version(&self) -> u64 {
        self.inner.storage.version()
    }

    /// True if the elements are laid out row-major without gaps (dimensions of size 1 may have
    /// any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&n, &s) in self.inner.shape.iter().zip(&self.inner.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n;
        }
        true
    }

    /// True if both handles are the same tensor.
    pub fn ptr_eq(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Size of dimension `d`.
    pub fn size(&self, d: usize) -> Result<usize> {
        self.inner.shape.get(d).copied().ok_or_else(|| {
            arg_err(
                "size",
                format!("dimension {d} of a {}-d tensor", self.dim()),
            )
        })
    }

    // ------------------------------------------------------------------ autograd state

    /// True if gradients flow to this tensor (a leaf marked with [`Tensor::set_requires_grad`],
    /// or the output of a recorded operation).
    pub fn requires_grad(&self) -> bool {
        self.inner.grad_fn.is_some() || self.inner.requires_grad.load(Ordering::Acquire)
    }

    /// True unless this tensor is the recorded output of an operation.
    pub fn is_leaf(&self) -> bool {
        self.inner.grad_fn.is_none()
    }

    /// Name of the operation that produced this tensor (`None` for leaves).
    pub fn grad_fn_name(&self) -> Option<&'static str> {
        self.inner.grad_fn.as_ref().map(|e| e.node.name)
    }

    /// Marks a leaf as requiring (or not) gradients.
    ///
    /// # Errors
    /// [`AutogradError::RequiresGrad`] on non-leaves and on integer tensors.
    pub fn set_requires_grad(&self, requires: bool) -> Result<()> {
        if !self.is_leaf() {
            return Err(AutogradError::RequiresGrad(format!(
                "only leaves can change requires_grad; this tensor is the output of `{}` (use \
                 `.detach()` to get a leaf)",
                self.grad_fn_name().unwrap_or("?")
            )));
        }
        if requires && !self.dtype().is_float() {
            return Err(AutogradError::RequiresGrad(format!(
                "only floating-point tensors can require gradients, this one is {}",
                self.dtype()
            )));
        }
        self.inner.requires_grad.store(requires, Ordering::Release);
        Ok(())
    }

    /// [`Tensor::set_requires_grad`], returning the tensor for chaining.
    pub fn requires_grad_(self, requires: bool) -> Result<Tensor> {
        self.set_requires_grad(requires)?;
        Ok(self)
    }

    pub(crate) fn leaf_meta(&self) -> MutexGuard<'_, LeafMeta> {
        self.inner.leaf.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The accumulated gradient (leaves), `None` before the first backward or after zeroing.
    pub fn grad(&self) -> Option<Tensor> {
        self.leaf_meta().grad.clone()
    }

    /// Replaces the gradient (`None` clears it, like `zero_grad(set_to_none=True)`).
    ///
    /// # Errors
    /// [`AutogradError::Shape`] / [`AutogradError::DType`] if the new gradient's shape or dtype
    /// differs from the tensor's.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.shape() != self.shape() {
                return Err(shape_err(
                    "set_grad",
                    format!(
                        "gradient shape {:?} differs from the tensor's {:?}",
                        g.shape(),
                        self.shape()
                    ),
                ));
            }
            if g.dtype() != self.dtype() {
                return Err(AutogradError::DType {
                    op: "set_grad",
                    got: g.dtype(),
                    expected: self.dtype().to_string(),
                });
            }
        }
        self.leaf_meta().grad = grad;
        Ok(())
    }

    /// Clears the gradient (sets it to `None`).
    pub fn zero_grad(&self) {
        self.leaf_meta().grad = None;
    }

    /// A new leaf sharing this tensor's storage (and version counter), without history and
    /// not requiring grad.
    pub fn detach(&self) -> Tensor {
        Tensor::from_parts(
            self.inner.storage.clone(),
            self.inner.shape.clone(),
            self.inner.strides.clone(),
            self.inner.offset,
            self.inner.dtype,
        )
    }

    pub(crate) fn grad_fn(&self) -> Option<&Edge> {
        self.inner.grad_fn.as_ref()
    }

    /// Where this tensor's gradient goes in the graph: its grad function, its leaf accumulator
    /// (created on first use), or nowhere.
    pub(crate) fn grad_edge(&self) -> Option<Edge> {
        if let Some(e) = &self.inner.grad_fn {
            return Some(e.clone());
        }
        if !self.inner.requires_grad.load(Ordering::Acquire) {
            return None;
        }
        let mut m = self.leaf_meta();
        if let Some(node) = m.accumulator.upgrade() {
            return Some(Edge { node, slot: 0 });
        }
        let node = Arc::new(Node::accumulate(self.clone()));
        m.accumulator = Arc::downgrade(&node);
        Some(Edge { node, slot: 0 })
    }

    /// The same tensor (layout, storage) as the output `edge` of a recorded operation.
    pub(crate) fn with_grad_fn(&self, edge: Edge) -> Tensor {
        Tensor {
            inner: Arc::new(TensorImpl {
                id: NEXT_TENSOR_ID.fetch_add(1, Ordering::Relaxed),
                shape: self.inner.shape.clone(),
                strides: self.inner.strides.clone(),
                offset: self.inner.offset,
                dtype: self.inner.dtype,
                storage: self.inner.storage.clone(),
                grad_fn: Some(edge),
                requires_grad: AtomicBool::new(false),
                leaf: Mutex::new(LeafMeta::default()),
            }),
        }
    }

    /// A raw view of the same storage with another layout (no autograd history).
    pub(crate) fn view_raw(&self, shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Tensor {
        Tensor::from_parts(
            self.inner.storage.clone(),
            shape,
            strides,
            offset,
            self.inner.dtype,
        )
    }

    pub(crate) fn weak(&self) -> Weak<TensorImpl> {
        Arc::downgrade(&self.inner)
    }

    pub(crate) fn from_weak(w: &Weak<TensorImpl>) -> Option<Tensor> {
        w.upgrade().map(|inner| Tensor { inner })
    }

    /// True if nothing but this handle refers to the tensor or its storage, and it covers its
    /// whole storage contiguously: then its memory may be adopted (e.g. as a leaf's `.grad`).
    pub(crate) fn is_exclusive(&self) -> bool {
        Arc::strong_count(&self.inner) == 1
            && self.inner.storage.handle_count() == 1
            && self.inner.offset == 0
            && self.is_contiguous()
            && self.numel() * self.dtype().size() == self.inner.storage.nbytes()
    }

    // ------------------------------------------------------------------ kernel arguments

    fn check_host_kernels(&self, op: &'static str) -> Result<()> {
        if let fsdp_alloc::DeviceId::Cuda(_) = self.device().id() {
            return Err(AutogradError::Unsupported {
                op,
                detail: format!(
                    "this step runs host code on the tensor's memory, and {} is a CUDA device; \
                     create the tensor on a CPU device and move it with `Tensor::to`",
                    self.device().id()
                ),
            });
        }
        Ok(())
    }

    /// The tensor's elements for host code launched on a CPU `stream` (contiguous tensors only;
    /// CUDA tensors are refused). Kernels go through [`Tensor::operand`] and the backend seam.
    pub(crate) fn arg(&self, op: &'static str, stream: &Stream) -> Result<Arg> {
        self.check_host_kernels(op)?;
        self.operand_on(op, stream)
    }

    /// The tensor's elements as a kernel [`Operand`] on the current stream of its device
    /// (recording that stream on the memory). Contiguous tensors only.
    ///
    /// # Errors
    /// [`AutogradError::Shape`] for a non-contiguous view (use `.contiguous()`);
    /// [`AutogradError::StorageReleased`] if the storage is released.
    pub fn operand(&self) -> Result<Operand> {
        self.operand_on("operand", &current_stream(self.device()))
    }

    /// [`Tensor::operand`] for a kernel launched on `stream`.
    pub(crate) fn operand_on(&self, op: &'static str, stream: &Stream) -> Result<Operand> {
        if !self.is_contiguous() {
            return Err(shape_err(
                op,
                format!(
                    "a kernel operand must be contiguous; shape {:?} has strides {:?} \
                     (call `.contiguous()` first)",
                    self.shape(),
                    self.strides()
                ),
            ));
        }
        let buf = self.inner.storage.use_on(stream, op)?;
        let sz = self.dtype().size();
        let buf = buf.slice(self.inner.offset * sz, self.numel() * sz)?;
        Ok(Operand {
            buf,
            dtype: self.dtype(),
        })
    }

    /// The memory spanned by this (possibly strided) view, starting at its first element; the
    /// element at index `i` sits at `Σ i·strides` in it. With [`Tensor::span_view`] it describes
    /// the view to the layout kernels.
    pub(crate) fn span_operand(&self, op: &'static str, stream: &Stream) -> Result<Operand> {
        let buf = self.inner.storage.use_on(stream, op)?;
        let sz = self.dtype().size();
        let span = span_of(self.shape(), self.strides());
        let buf = buf.slice(self.inner.offset * sz, span * sz)?;
        Ok(Operand {
            buf,
            dtype: self.dtype(),
        })
    }

    /// This tensor's layout relative to [`Tensor::span_operand`].
    pub(crate) fn span_view(&self) -> View {
        View {
            shape: self.shape().to_vec(),
            strides: self.strides().to_vec(),
            offset: 0,
        }
    }

    pub(crate) fn check_same_device(&self, other: &Tensor, op: &'static str) -> Result<()> {
        if self.device() != other.device() {
            let (a, b) = (self.device().id(), other.device().id());
            let (a, b) = if a == b {
                (
                    format!("{a} (one Device object)"),
                    format!("{b} (another Device object)"),
                )
            } else {
                (a.to_string(), b.to_string())
            };
            return Err(AutogradError::Device { op, a, b });
        }
        Ok(())
    }

    pub(crate) fn check_float(&self, op: &'static str) -> Result<()> {
        if !self.dtype().is_float() {
            return Err(AutogradError::DType {
                op,
                got: self.dtype(),
                expected: "f32, f16 or bf16".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn check_inplace(&self, op: &'static str) -> Result<()> {
        if is_grad_enabled() && self.requires_grad() {
            return Err(AutogradError::InPlaceOnGradTensor { op });
        }
        Ok(())
    }

    // ------------------------------------------------------------------ readback

    /// Copies the elements (row-major) to the host, waiting for the work that produces them.
    ///
    /// # Errors
    /// [`AutogradError::DType`] if `T` is not the tensor's dtype; the stream's failure
    /// ([`fsdp_alloc::AllocError::StreamFailed`]) if an earlier kernel failed;
    /// [`AutogradError::StorageReleased`] if the storage is released.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype() != T::DTYPE {
            return Err(AutogradError::DType {
                op: "to_vec",
                got: self.dtype(),
                expected: format!("{} (the element type requested)", T::DTYPE),
            });
        }
        let stream = current_stream(self.device());
        let src = self.span_operand("to_vec", &stream)?;
        let shape = self.shape().to_vec();
        let strides = self.strides().to_vec();
        let contiguous = self.is_contiguous();
        let (tx, rx) = mpsc::channel();
        let read = move |bytes: &[u8]| {
            let mut s = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut s).copy_from_slice(bytes);
            let out = if contiguous {
                s
            } else {
                let mut out = vec![T::zeroed(); numel_of(&shape)];
                let cs = contiguous_strides(&shape);
                strided_copy(&s, 0, &strides, &mut out, 0, &cs, &shape);
                out
            };
            let _ = tx.send(out);
        };
        Kernels::for_device(self.device())?.read(&stream, &src, Box::new(read))?;
        recv(rx, &stream)
    }

    /// The bytes of a contiguous tensor on the host (waits for the work producing them).
    pub(crate) fn read_bytes(&self, op: &'static str) -> Result<Vec<u8>> {
        let stream = current_stream(self.device());
        let src = self.operand_on(op, &stream)?;
        let (tx, rx) = mpsc::channel();
        let read = move |bytes: &[u8]| {
            let _ = tx.send(bytes.to_vec());
        };
        Kernels::for_device(self.device())?.read(&stream, &src, Box::new(read))?;
        recv(rx, &stream)
    }

    /// Copies the elements to the host as `f32` (converting `f16`/`bf16`), waiting for them.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match self.dtype() {
            DType::F32 => self.to_vec::<f32>(),
            DType::F16 => Ok(self.to_vec::<f16>()?.into_iter().map(f32::from).collect()),
            DType::BF16 => Ok(self.to_vec::<bf16>()?.into_iter().map(f32::from).collect()),
            d => Err(AutogradError::DType {
                op: "to_vec_f32",
                got: d,
                expected: "f32, f16 or bf16".into(),
            }),
        }
    }

    /// The value of a one-element float tensor, as `f32` (waits for it).
    pub fn item(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(shape_err(
                "item",
                format!(
                    "item() needs exactly one element, the shape is {:?}",
                    self.shape()
                ),
            ));
        }
        Ok(self.to_vec_f32()?[0])
    }
}

fn recv<T>(rx: mpsc::Receiver<T>, stream: &Stream) -> Result<T> {
    // A readback is a host wait on the stream (CPU: the stream's worker sends the bytes; CUDA:
    // the backend synchronized the stream and already sent them), counted by `Kernels::read`.
    match rx.recv() {
        Ok(v) => Ok(v),
        Err(_) => {
            // The work was skipped or failed: the stream knows why.
            stream.synchronize()?;
            Err(AutogradError::Backward(
                "internal: readback work vanished without a stream failure".into(),
            ))
        }
    }
}

/// [`span_of`] with overflow checking (`None` on overflow).
pub(crate) fn checked_span(shape: &[usize], strides: &[usize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().zip(strides).try_fold(1usize, |acc, (&n, &s)| {
        acc.checked_add((n - 1).checked_mul(s)?)
    })
}

/// Number of storage elements a view spans (0 for an empty view).
pub(crate) fn span_of(shape: &[usize], strides: &[usize]) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    1 + shape
        .iter()
        .zip(strides)
        .map(|(&n, &s)| (n - 1) * s)
        .sum::<usize>()
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Tensor>();
    is::<Storage>();
}

/// Autograd graph nodes and edges (re-exported as `crate::autograd::node`). They live in this file
/// because `Tensor` and `Node` refer to each other (a tensor holds the node that made it; a node's
/// backward takes and returns tensors): in separate files the two would import each other.
pub(crate) mod graph {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, MutexGuard};

    use fsdp_alloc::DType;

    use super::Tensor;
    use crate::error::Result;

    static NEXT_SEQ: AtomicU64 = AtomicU64::new(1);
    static NEXT_HOOK: AtomicU64 = AtomicU64::new(1);

    pub(crate) fn next_hook_id() -> u64 {
        NEXT_HOOK.fetch_add(1, Ordering::Relaxed)
    }

    /// A tensor hook: sees a gradient, may replace it.
    pub(crate) type TensorHookFn = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;
    /// A post-accumulate-grad hook: sees the leaf whose `.grad()` is final for this backward.
    pub(crate) type PostHookFn = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

    /// What a gradient flowing into one slot of a node must look like.
    #[derive(Debug, Clone, PartialEq)]
    pub(crate) struct GradMeta {
        pub shape: Vec<usize>,
        pub dtype: DType,
    }

    /// The backward computation of one operation: gradients w.r.t. its outputs (`None` where no
    /// gradient arrived) in, gradients w.r.t. its inputs (`None` where not needed) out. Saved tensors
    /// are taken out (freed) when used, so running a node with saved tensors a second time fails
    /// with `GraphConsumed`; nodes without saved tensors (views, adds, …) can run again.
    pub(crate) trait BackwardFn: Send {
        fn run(&mut self, grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>>;

        /// Offered each incoming gradient of output `slot` as soon as it arrives (when no tensor
        /// hook watches that slot). A node that can fold it into its result right away returns
        /// `Ok(None)` (the engine then does not buffer it, so it is freed at once); `Ok(Some(g))`
        /// hands it back to be buffered and passed to `run` as usual.
        fn accept(&mut self, _slot: usize, g: Tensor) -> Result<Option<Tensor>> {
            Ok(Some(g))
        }
    }

    impl<F> BackwardFn for F
    where
        F: FnMut(Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> + Send,
    {
        fn run(&mut self, grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
            self(grads)
        }
    }

    pub(crate) enum NodeKind {
        /// An operation's backward.
        Function(Mutex<Box<dyn BackwardFn>>),
        /// Accumulates into a leaf's `.grad` (holds the leaf; the leaf holds this node weakly).
        Accumulate(Tensor),
    }

    /// One node of the backward graph.
    pub(crate) struct Node {
        /// Creation order; later nodes run first among ready ones (deterministic order).
        pub seq: u64,
        pub name: &'static str,
        pub kind: NodeKind,
        /// Per forward input: where its gradient goes (`None`: input does not require grad).
        pub next: Vec<Option<Edge>>,
        /// Per forward output (gradient slot): expected gradient shape and dtype.
        pub meta: Vec<GradMeta>,
        /// Tensor hooks of this node's outputs: (slot, hook id, hook), in registration order.
        pub hooks: Mutex<Vec<(usize, u64, TensorHookFn)>>,
    }

    impl Node {
        pub(crate) fn function(
            name: &'static str,
            next: Vec<Option<Edge>>,
            meta: Vec<GradMeta>,
            f: Box<dyn BackwardFn>,
        ) -> Node {
            Node {
                seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
                name,
                kind: NodeKind::Function(Mutex::new(f)),
                next,
                meta,
                hooks: Mutex::new(Vec::new()),
            }
        }

        pub(crate) fn accumulate(leaf: Tensor) -> Node {
            let meta = vec![GradMeta {
                shape: leaf.shape().to_vec(),
                dtype: leaf.dtype(),
            }];
            Node {
                seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
                name: "accumulate_grad",
                kind: NodeKind::Accumulate(leaf),
                next: Vec::new(),
                meta,
                hooks: Mutex::new(Vec::new()),
            }
        }

        pub(crate) fn hooks(&self) -> MutexGuard<'_, Vec<(usize, u64, TensorHookFn)>> {
            self.hooks.lock().unwrap_or_else(|e| e.into_inner())
        }

        pub(crate) fn is_accumulate(&self) -> bool {
            matches!(self.kind, NodeKind::Accumulate(_))
        }
    }

    /// Where a gradient goes: slot `slot` of `node`.
    #[derive(Clone)]
    pub(crate) struct Edge {
        pub node: Arc<Node>,
        pub slot: usize,
    }

    impl std::fmt::Debug for Edge {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "Edge({}#{}, slot {})",
                self.node.name, self.node.seq, self.slot
            )
        }
    }
}
