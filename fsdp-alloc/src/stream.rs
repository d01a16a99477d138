//! Streams and events.
//!
//! A [`Stream`] is an in-order queue of work. In the default [`StreamMode::Async`] each stream
//! owns one worker thread: [`Stream::launch`] enqueues a closure and returns at once, exactly like
//! a CUDA kernel launch. [`Event`]s mark a point in a stream; [`Stream::wait_event`] makes later
//! work on another stream wait for that point, without blocking the issuing thread.
//!
//! A panic inside launched work does not kill the worker: the stream records the failure, skips
//! the work queued after it (its inputs can no longer be trusted), completes every event recorded
//! after it as *failed*, and reports the panic message from the next [`Stream::synchronize`] or
//! [`Event::synchronize`]. Streams that wait on a failed event fail in turn, so an error
//! propagates along the dependency graph instead of hanging it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;

use crossbeam::channel::{unbounded, Sender};

use crate::error::{AllocError, Result};
use crate::DeviceId;

static NEXT_STREAM_ID: AtomicU64 = AtomicU64::new(1);

/// How a stream executes launched work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamMode {
    /// Each stream has a worker thread; `launch` returns at once (the GPU-like default).
    #[default]
    Async,
    /// Work runs on the launching thread before `launch` returns (fast, no overlap).
    Inline,
}

/// A process-unique stream identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s{}", self.0)
    }
}

type Work = Box<dyn FnOnce() + Send + 'static>;

enum Job {
    Work(Work),
    Wait(Event),
    Record(Event),
}

/// Failure state shared by a stream's handles and its worker.
#[derive(Default)]
struct Health {
    failure: Mutex<Option<String>>,
}

impl Health {
    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    fn fail(&self, msg: String) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(msg);
        }
    }
}

struct StreamInner {
    id: StreamId,
    name: String,
    device: DeviceId,
    mode: StreamMode,
    tx: Option<Sender<Job>>,
    health: Arc<Health>,
    /// Number of jobs launched so far (the position an event recorded now marks).
    launched: AtomicU64,
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Closing the channel lets the worker drain what is queued and exit; we do not join,
        // because the last handle may be dropped by the worker itself (inside launched work).
        self.tx.take();
    }
}

/// An in-order queue of device work. Cheap to clone; clones are the same stream.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.inner.id)
            .field("name", &self.inner.name)
            .field("device", &self.inner.device)
            .field("mode", &self.inner.mode)
            .finish()
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.inner.id == other.inner.id
    }
}
impl Eq for Stream {}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

fn run_job(job: Job, health: &Health, label: &str) {
    match job {
        Job::Work(w) => {
            if health.failure().is_some() {
                return; // skip work queued after a failure
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(w)) {
                health.fail(panic_message(p.as_ref()));
            }
        }
        Job::Wait(ev) => {
            if let Err(e) = ev.wait_raw() {
                health.fail(format!("waited on a failed event: {e}"));
            }
        }
        Job::Record(ev) => match health.failure() {
            None => ev.complete(Ok(())),
            Some(m) => ev.complete(Err(format!("{label}: {m}"))),
        },
    }
}

impl Stream {
    /// Creates a stream on `device`. Prefer `Device::new_stream`, which also registers the stream
    /// with the device so that `Device::synchronize` covers it.
    pub fn new(device: DeviceId, name: &str, mode: StreamMode) -> Stream {
        let id = StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed));
        let health = Arc::new(Health::default());
        let tx = match mode {
            StreamMode::Inline => None,
            StreamMode::Async => {
                let (tx, rx) = unbounded::<Job>();
                let h = Arc::clone(&health);
                let label = format!("{device}/{name}");
                thread::Builder::new()
                    .name(format!("stream-{device}-{name}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            run_job(job, &h, &label);
                        }
                    })
                    .expect("failed to spawn a stream worker thread");
                Some(tx)
            }
        };
        Stream {
            inner: Arc::new(StreamInner {
                id,
                name: name.to_string(),
                device,
                mode,
                tx,
                health,
                launched: AtomicU64::new(0),
            }),
        }
    }

    /// This stream's process-unique id.
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// This stream's name (for messages).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> DeviceId {
        self.inner.device
    }

    /// How this stream runs work.
    pub fn mode(&self) -> StreamMode {
        self.inner.mode
    }

    /// Number of jobs (work, waits and event records) enqueued so far.
    pub fn launched(&self) -> u64 {
        self.inner.launched.load(Ordering::Acquire)
    }

    fn submit(&self, job: Job) {
        self.inner.launched.fetch_add(1, Ordering::AcqRel);
        match &self.inner.tx {
            Some(tx) => {
                // The worker only exits once every sender is gone, and we hold one.
                if let Err(e) = tx.send(job) {
                    run_job(e.into_inner(), &self.inner.health, &self.inner.name);
                }
            }
            None => run_job(job, &self.inner.health, &self.label()),
        }
    }

    fn label(&self) -> String {
        format!("{}/{}", self.inner.device, self.inner.name)
    }

    /// Enqueues `work`; returns at once in async mode. Work runs after everything launched before
    /// it on this stream, and after every event this stream was told to wait on before it.
    pub fn launch<F: FnOnce() + Send + 'static>(&self, work: F) {
        self.submit(Job::Work(Box::new(work)));
    }

    /// Records a new event at the current end of this stream.
    pub fn record_event(&self) -> Event {
        let ev = Event::pending(self.inner.id, self.inner.device, self.launched() + 1);
        self.submit(Job::Record(ev.clone()));
        ev
    }

    /// Makes all work launched on this stream from now on wait until `event` completes.
    /// The issuing thread does not block.
    pub fn wait_event(&self, event: &Event) {
        if event.query() && event.error().is_none() {
            return; // already complete: nothing to order
        }
        self.submit(Job::Wait(event.clone()));
    }

    /// Blocks until all work launched so far has run. Returns the first failure of this stream.
    pub fn synchronize(&self) -> Result<()> {
        self.record_event().synchronize()?;
        self.check()
    }

    /// Returns the stream's failure, if any work on it has failed so far (non-blocking).
    pub fn check(&self) -> Result<()> {
        match self.inner.health.failure() {
            None => Ok(()),
            Some(message) => Err(AllocError::StreamFailed {
                device: self.inner.device,
                stream: self.inner.name.clone(),
                message,
            }),
        }
    }
}

#[derive(Debug)]
enum EventState {
    Pending,
    Done,
    Failed(String),
}

struct EventInner {
    stream: Option<StreamId>,
    device: Option<DeviceId>,
    position: u64,
    state: Mutex<EventState>,
    cv: Condvar,
}

/// A point in a stream. Complete once all work launched on that stream before it has run.
/// Cheap to clone; clones are the same event. An event that was never recorded is complete.
#[derive(Clone)]
pub struct Event {
    inner: Arc<EventInner>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("stream", &self.inner.stream)
            .field("position", &self.inner.position)
            .field("complete", &self.query())
            .finish()
    }
}

impl Default for Event {
    fn default() -> Self {
        Event::completed()
    }
}

impl Event {
    fn pending(stream: StreamId, device: DeviceId, position: u64) -> Event {
        Event {
            inner: Arc::new(EventInner {
                stream: Some(stream),
                device: Some(device),
                position,
                state: Mutex::new(EventState::Pending),
                cv: Condvar::new(),
            }),
        }
    }

    /// An event that is already complete (like a CUDA event that was never recorded).
    pub fn completed() -> Event {
        Event {
            inner: Arc::new(EventInner {
                stream: None,
                device: None,
                position: 0,
                state: Mutex::new(EventState::Done),
                cv: Condvar::new(),
            }),
        }
    }

    /// Records a new event at the current end of `stream` (same as [`Stream::record_event`]).
    pub fn record(stream: &Stream) -> Event {
        stream.record_event()
    }

    /// The stream this event was recorded on (`None` for [`Event::completed`]).
    pub fn stream_id(&self) -> Option<StreamId> {
        self.inner.stream
    }

    /// The event's position in its stream (number of jobs before and including it).
    pub fn position(&self) -> u64 {
        self.inner.position
    }

    fn complete(&self, r: std::result::Result<(), String>) {
        let mut s = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        *s = match r {
            Ok(()) => EventState::Done,
            Err(m) => EventState::Failed(m),
        };
        self.inner.cv.notify_all();
    }

    /// True once the event has completed (successfully or not). Never blocks.
    pub fn query(&self) -> bool {
        !matches!(
            *self.inner.state.lock().unwrap_or_else(|e| e.into_inner()),
            EventState::Pending
        )
    }

    /// The failure message if the event's stream failed before reaching it.
    pub fn error(&self) -> Option<String> {
        match &*self.inner.state.lock().unwrap_or_else(|e| e.into_inner()) {
            EventState::Failed(m) => Some(m.clone()),
            _ => None,
        }
    }

    fn wait_raw(&self) -> std::result::Result<(), String> {
        let mut s = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*s {
                EventState::Pending => s = self.inner.cv.wait(s).unwrap_or_else(|e| e.into_inner()),
                EventState::Done => return Ok(()),
                EventState::Failed(m) => return Err(m.clone()),
            }
        }
    }

    /// Blocks the calling thread until the event completes; an error if its stream failed.
    pub fn synchronize(&self) -> Result<()> {
        self.wait_raw().map_err(|m| self.failed(m))
    }

    fn failed(&self, message: String) -> AllocError {
        AllocError::StreamFailed {
            device: self.inner.device.unwrap_or(DeviceId::Cpu(0)),
            stream: self.inner.stream.map(|s| s.to_string()).unwrap_or_default(),
            message,
        }
    }

    /// Blocks until the event completes or `timeout` passes; `Ok(true)` if it completed.
    pub fn synchronize_timeout(&self, timeout: std::time::Duration) -> Result<bool> {
        let deadline = std::time::Instant::now() + timeout;
        let mut s = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*s {
                EventState::Done => return Ok(true),
                EventState::Failed(m) => return Err(self.failed(m.clone())),
                EventState::Pending => {
                    let now = std::time::Instant::now();
                    if now >= deadline {
                        return Ok(false);
                    }
                    s = self
                        .inner
                        .cv
                        .wait_timeout(s, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    fn s(name: &str) -> Stream {
        Stream::new(DeviceId::Cpu(0), name, StreamMode::Async)
    }

    #[test]
    fn launch_returns_before_work_runs() {
        let st = s("a");
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g = Arc::clone(&gate);
        st.launch(move || {
            let mut open = g.0.lock().unwrap();
            while !*open {
                open = g.1.wait(open).unwrap();
            }
        });
        let ev = st.record_event();
        assert!(!ev.query(), "work is blocked, the event cannot be complete");
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        ev.synchronize().unwrap();
        assert!(ev.query());
    }

    #[test]
    fn work_runs_in_order() {
        let st = s("order");
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..100 {
            let l = Arc::clone(&log);
            st.launch(move || l.lock().unwrap().push(i));
        }
        st.synchronize().unwrap();
        assert_eq!(*log.lock().unwrap(), (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn wait_event_orders_streams() {
        let a = s("a");
        let b = s("b");
        let flag = Arc::new(AtomicUsize::new(0));
        let f = Arc::clone(&flag);
        a.launch(move || {
            thread::sleep(Duration::from_millis(50));
            f.store(1, Ordering::SeqCst);
        });
        let ev = a.record_event();
        b.wait_event(&ev);
        let f = Arc::clone(&flag);
        let seen = Arc::new(AtomicUsize::new(99));
        let s2 = Arc::clone(&seen);
        b.launch(move || s2.store(f.load(Ordering::SeqCst), Ordering::SeqCst));
        b.synchronize().unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn panic_surfaces_at_synchronize_and_propagates() {
        let a = s("a");
        let b = s("b");
        a.launch(|| panic!("kernel exploded"));
        let ran = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&ran);
        a.launch(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        let err = a.synchronize().unwrap_err();
        assert!(err.to_string().contains("kernel exploded"), "{err}");
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "work after a failure is skipped"
        );
        let ev = a.record_event();
        b.wait_event(&ev);
        let err = b.synchronize().unwrap_err();
        assert!(err.to_string().contains("kernel exploded"), "{err}");
    }

    #[test]
    fn inline_mode_runs_immediately() {
        let st = Stream::new(DeviceId::Cpu(0), "inline", StreamMode::Inline);
        let x = Arc::new(AtomicUsize::new(0));
        let y = Arc::clone(&x);
        st.launch(move || {
            y.store(7, Ordering::SeqCst);
        });
        assert_eq!(x.load(Ordering::SeqCst), 7);
        st.launch(|| panic!("inline boom"));
        assert!(st.check().is_err());
    }

    #[test]
    fn never_recorded_event_is_complete() {
        assert!(Event::completed().query());
        Event::default().synchronize().unwrap();
    }
}
