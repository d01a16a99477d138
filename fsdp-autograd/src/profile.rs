//! A process-wide kernel profiler: time spent *inside stream work*, per operation type.
//!
//! Off by default (one relaxed atomic load per launch). When on, every kernel launched by this
//! crate measures its own run time on the stream worker and adds it to a table keyed by the
//! operation name (`"matmul"`, `"gelu"`, `"layer_norm_backward"`, …). Launch overhead on the
//! issuing thread is not included; waiting for events is not included.
//!
//! ```
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::{profile, Tensor};
//!
//! let dev = Device::cpu(0);
//! profile::set_enabled(true);
//! let a = Tensor::ones(&[8, 8], DType::F32, &dev)?;
//! let _c = a.matmul(&a)?;
//! dev.synchronize()?;
//! profile::set_enabled(false);
//! let report = profile::take();
//! assert!(report.iter().any(|e| e.op == "matmul" && e.count >= 1));
//! # Ok::<(), fsdp_autograd::AutogradError>(())
//! ```

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TABLE: Mutex<BTreeMap<&'static str, (Duration, u64)>> = Mutex::new(BTreeMap::new());

/// Time spent in one operation type.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileEntry {
    /// Operation name.
    pub op: &'static str,
    /// Total time inside stream work.
    pub total: Duration,
    /// Number of kernel runs.
    pub count: u64,
}

/// Turns the profiler on or off (process-wide).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// True while the profiler is on.
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

pub(crate) fn record(op: &'static str, elapsed: Duration) {
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let e = t.entry(op).or_insert((Duration::ZERO, 0));
    e.0 += elapsed;
    e.1 += 1;
}

/// Returns the table (sorted by total time, largest first) and clears it. Synchronize the
/// streams first so that all launched work has been counted.
pub fn take() -> Vec<ProfileEntry> {
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<ProfileEntry> = std::mem::take(&mut *t)
        .into_iter()
        .map(|(op, (total, count))| ProfileEntry { op, total, count })
        .collect();
    v.sort_by(|a, b| b.total.cmp(&a.total).then(a.op.cmp(b.op)));
    v
}
