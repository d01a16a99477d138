//! Tensor storage: one device allocation shared by a tensor and all of its views, which can be
//! released and re-attached (PyTorch's `storage().resize_(0)`, which FSDP uses to free an
//! unsharded flat parameter while the autograd graph still references views of it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fsdp_alloc::{Buffer, BufferRef, Device, Stream};

use crate::error::{AutogradError, Result};

static NEXT_STORAGE_ID: AtomicU64 = AtomicU64::new(1);

struct StorageInner {
    id: u64,
    device: Device,
    nbytes: usize,
    buffer: Mutex<Option<Buffer>>,
    /// Version counter shared by every tensor viewing this storage; in-place ops bump it.
    version: AtomicU64,
}

/// The memory behind one or more tensors: a [`Buffer`] from the device's caching allocator (or
/// nothing, while released), its fixed byte size, and the version counter shared by all views.
///
/// Cheap to clone; clones are the same storage.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::Tensor;
///
/// let dev = Device::cpu(0);
/// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], &dev)?;
/// let view = t.narrow(0, 1, 2)?;
/// let buf = t.storage().release().expect("allocated");
/// assert!(!view.storage().is_allocated()); // views share the storage
/// assert!(view.to_vec::<f32>().is_err()); // a released storage cannot be read
/// t.storage().attach(buf)?;
/// assert_eq!(view.to_vec::<f32>()?, vec![2.0, 3.0]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
#[derive(Clone)]
pub struct Storage {
    inner: Arc<StorageInner>,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage")
            .field("id", &self.inner.id)
            .field("device", &self.inner.device.id())
            .field("nbytes", &self.inner.nbytes)
            .field("allocated", &self.is_allocated())
            .field("version", &self.version())
            .finish()
    }
}

impl Storage {
    /// Wraps an allocation of `device` (its byte size becomes the storage's fixed size).
    ///
    /// # Errors
    /// [`AutogradError::Attach`] if the buffer belongs to another device.
    pub fn new(buffer: Buffer, device: &Device) -> Result<Storage> {
        let id = NEXT_STORAGE_ID.fetch_add(1, Ordering::Relaxed);
        if buffer.device() != device.id() {
            return Err(AutogradError::Attach {
                storage: id,
                detail: format!(
                    "the buffer lives on {} but the storage is for {}",
                    buffer.device(),
                    device.id()
                ),
            });
        }
        Ok(Storage {
            inner: Arc::new(StorageInner {
                id,
                device: device.clone(),
                nbytes: buffer.len(),
                buffer: Mutex::new(Some(buffer)),
                version: AtomicU64::new(0),
            }),
        })
    }

    /// A storage of `nbytes` bytes on `device` with no memory attached: it allocates nothing
    /// until a buffer of exactly `nbytes` bytes is [attached](Storage::attach). FSDP's unsharded
    /// flat parameters start this way — their memory exists only while a unit is unsharded.
    ///
    /// ```
    /// use fsdp_alloc::Device;
    /// use fsdp_autograd::Storage;
    ///
    /// let dev = Device::cpu(0);
    /// let s = Storage::unallocated(4096, &dev);
    /// assert!(!s.is_allocated());
    /// assert_eq!(dev.memory_stats().allocated_bytes, 0);
    /// s.attach(dev.alloc(4096, dev.default_stream())?)?;
    /// assert!(s.is_allocated());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn unallocated(nbytes: usize, device: &Device) -> Storage {
        Storage {
            inner: Arc::new(StorageInner {
                id: NEXT_STORAGE_ID.fetch_add(1, Ordering::Relaxed),
                device: device.clone(),
                nbytes,
                buffer: Mutex::new(None),
                version: AtomicU64::new(0),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Buffer>> {
        self.inner.buffer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Process-unique id (for messages and identity).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The device the storage belongs to.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Byte size (fixed for the storage's lifetime, also while released).
    pub fn nbytes(&self) -> usize {
        self.inner.nbytes
    }

    /// True while a buffer is attached.
    pub fn is_allocated(&self) -> bool {
        self.lock().is_some()
    }

    /// Bytes the allocator reserved for the attached buffer (its rounded size), or 0 if released.
    pub fn allocated_size(&self) -> usize {
        self.lock().as_ref().map_or(0, Buffer::allocated_size)
    }

    /// Detaches and returns the buffer (`None` if already released). Tensors viewing this storage
    /// keep their shapes but cannot be used by kernels until a buffer is attached again. Dropping
    /// the returned buffer frees the memory; work already launched on it still completes safely
    /// (it holds its own reference to the memory, and the allocator orders reuse by stream).
    pub fn release(&self) -> Option<Buffer> {
        self.lock().take()
    }

    /// Attaches `buffer` (exactly [`Storage::nbytes`] bytes, same device). Does not bump the
    /// version counter: the values are whatever the buffer holds (FSDP all-gathers into it).
    ///
    /// # Errors
    /// [`AutogradError::Attach`] if a buffer is already attached, or the size or device differs.
    pub fn attach(&self, buffer: Buffer) -> Result<()> {
        let err = |detail: String| AutogradError::Attach {
            storage: self.inner.id,
            detail,
        };
        if buffer.device() != self.inner.device.id() {
            return Err(err(format!(
                "the buffer lives on {} but the storage on {}",
                buffer.device(),
                self.inner.device.id()
            )));
        }
        if buffer.len() != self.inner.nbytes {
            return Err(err(format!(
                "the buffer has {} bytes but the storage needs exactly {}",
                buffer.len(),
                self.inner.nbytes
            )));
        }
        let mut slot = self.lock();
        if slot.is_some() {
            return Err(err(
                "a buffer is already attached; release it first".to_string()
            ));
        }
        *slot = Some(buffer);
        Ok(())
    }

    /// The attached memory as a handle launched work can capture (`None` while released).
    pub fn buffer_ref(&self) -> Option<BufferRef> {
        self.lock().as_ref().map(|b| b.data().clone())
    }

    /// Runs `f` on the attached buffer (`None` while released), e.g. to `record_stream` it.
    pub fn with_buffer<R>(&self, f: impl FnOnce(&mut Buffer) -> R) -> Option<R> {
        self.lock().as_mut().map(f)
    }

    /// The memory for a kernel launched on `stream`: records the stream on the buffer if it is
    /// not the buffer's own stream (so the allocator does not reuse it too early).
    pub(crate) fn use_on(&self, stream: &Stream, op: &'static str) -> Result<BufferRef> {
        let mut slot = self.lock();
        match slot.as_mut() {
            Some(b) => {
                if b.stream() != stream {
                    b.record_stream(stream);
                }
                Ok(b.data().clone())
            }
            None => Err(AutogradError::StorageReleased {
                op,
                storage: self.inner.id,
                nbytes: self.inner.nbytes,
            }),
        }
    }

    /// The version counter shared by every tensor on this storage.
    pub fn version(&self) -> u64 {
        self.inner.version.load(Ordering::Acquire)
    }

    /// Bumps the version counter (done by every in-place op).
    pub fn bump_version(&self) {
        self.inner.version.fetch_add(1, Ordering::AcqRel);
    }

    /// True if both handles are the same storage.
    pub fn ptr_eq(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Number of handles (tensors) sharing this storage.
    pub(crate) fn handle_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }
}
