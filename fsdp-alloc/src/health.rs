//! [`Health`]: the state a stream's handles share with whatever runs its work (its worker
//! thread, or the CUDA driver's host functions): its failure and, in the checked mode, its
//! vector clock.

use std::sync::{Arc, Mutex};

use crate::clock::Clock;
use crate::stream_id::StreamId;
use crate::DeviceId;

/// State shared by a stream's handles and its worker: failure, and (checked mode) its clock.
pub(crate) struct Health {
    pub(crate) id: StreamId,
    pub(crate) name: Arc<str>,
    /// The device and the stream's own name (trace tracks).
    pub(crate) device: DeviceId,
    pub(crate) stream_name: Arc<str>,
    pub(crate) checked: bool,
    failure: Mutex<Option<String>>,
    clock: Mutex<Clock>,
}

impl Health {
    pub(crate) fn new(
        id: StreamId,
        device: DeviceId,
        stream: &str,
        name: &str,
        checked: bool,
    ) -> Health {
        Health {
            id,
            name: Arc::from(name),
            device,
            stream_name: Arc::from(stream),
            checked,
            failure: Mutex::new(None),
            clock: Mutex::new(Clock::default()),
        }
    }

    pub(crate) fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn fail(&self, msg: String) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(msg);
        }
    }

    pub(crate) fn clock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.clock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checked mode: orders everything this stream runs from now on after `other` (see
    /// [`crate::OrderPoint`]).
    pub(crate) fn merge_clock(&self, other: &Clock) {
        self.clock().merge(other);
    }
}
