//! Running one piece of launched work: the code shared by CPU stream workers and the CUDA
//! host-function trampoline (skip after a failure, checked-mode job context, panic capture).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crate::checked::{self, JobCtx};
use crate::clock::Clock;
use crate::health::Health;

/// A launched closure.
pub(crate) type Work = Box<dyn FnOnce() + Send + 'static>;

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Runs launched work on behalf of `health`'s stream: skipped after a failure, a panic becomes
/// the stream's failure. Also used by the CUDA host-function trampoline.
pub(crate) fn run_work(work: Work, pos: u64, host: Option<Arc<Clock>>, health: &Arc<Health>) {
    if health.failure().is_some() {
        return; // skip work queued after a failure
    }
    let ctx = if health.checked {
        let mut c = health.clock();
        if let Some(h) = &host {
            c.merge(h);
        }
        c.advance(health.id, pos);
        Some(Arc::new(JobCtx {
            stream: health.id,
            name: Arc::clone(&health.name),
            pos,
            clock: Arc::new(c.clone()),
            health: Arc::clone(health),
        }))
    } else {
        None
    };
    let r = checked::with_job(ctx, health.id, || catch_unwind(AssertUnwindSafe(work)));
    if let Err(p) = r {
        health.fail(panic_message(p.as_ref()));
    }
}
