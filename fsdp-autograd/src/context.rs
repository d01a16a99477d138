//! Thread-local execution context: the current stream per device and the grad mode.
//!
//! Every tensor operation launches its kernel on the issuing thread's *current stream* for the
//! tensor's device and allocates its outputs on that stream. The current stream is the device's
//! default stream unless a [`with_stream`] scope says otherwise. Grad mode (on by default)
//! decides whether operations record the autograd graph; [`no_grad`] turns it off for a scope.

use std::cell::{Cell, RefCell};

use fsdp_alloc::{Device, Stream};

thread_local! {
    static STREAMS: RefCell<Vec<Stream>> = const { RefCell::new(Vec::new()) };
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

struct StreamScope;

impl Drop for StreamScope {
    fn drop(&mut self) {
        STREAMS.with(|s| {
            s.borrow_mut().pop();
        });
    }
}

/// Runs `f` with `stream` as this thread's current stream for the stream's device.
///
/// Scopes nest; the innermost scope for a device wins. The device is matched by
/// [`fsdp_alloc::DeviceId`], so two distinct `Device` objects with the same id on one thread
/// share scopes (give each rank thread its own device id).
///
/// ```
/// use fsdp_alloc::Device;
/// use fsdp_autograd::{current_stream, with_stream, Tensor};
///
/// let dev = Device::cpu(0);
/// let side = dev.new_stream("side");
/// let t = with_stream(&side, || {
///     assert_eq!(current_stream(&dev), side);
///     Tensor::ones(&[4], fsdp_alloc::DType::F32, &dev) // launched on `side`
/// })?;
/// side.synchronize()?;
/// assert_eq!(current_stream(&dev), *dev.default_stream());
/// assert_eq!(t.to_vec::<f32>()?, vec![1.0; 4]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
pub fn with_stream<R>(stream: &Stream, f: impl FnOnce() -> R) -> R {
    STREAMS.with(|s| s.borrow_mut().push(stream.clone()));
    let _scope = StreamScope;
    f()
}

/// This thread's current stream for `device` (its default stream outside any [`with_stream`]).
pub fn current_stream(device: &Device) -> Stream {
    let id = device.id();
    STREAMS
        .with(|s| {
            s.borrow()
                .iter()
                .rev()
                .find(|st| st.device() == id)
                .cloned()
        })
        .unwrap_or_else(|| device.default_stream().clone())
}

/// True if operations on this thread currently record the autograd graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Restores the previous grad mode when dropped. Made by [`GradModeGuard::new`].
#[must_use = "the grad mode is restored when the guard is dropped"]
pub struct GradModeGuard {
    prev: bool,
}

impl GradModeGuard {
    /// Sets this thread's grad mode to `enabled` until the guard is dropped.
    pub fn new(enabled: bool) -> GradModeGuard {
        let prev = GRAD_ENABLED.with(|g| g.replace(enabled));
        GradModeGuard { prev }
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

/// Runs `f` with grad mode off: operations inside record no graph (outputs do not require
/// grad), and in-place updates of parameters are allowed.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{no_grad, Tensor};
///
/// let dev = Device::cpu(0);
/// let w = Tensor::ones(&[2], DType::F32, &dev)?;
/// w.set_requires_grad(true)?;
/// let y = no_grad(|| w.scale(2.0))?;
/// assert!(!y.requires_grad());
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = GradModeGuard::new(false);
    f()
}

/// Runs `f` with grad mode on (e.g. inside a [`no_grad`] scope).
pub fn enable_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = GradModeGuard::new(true);
    f()
}
