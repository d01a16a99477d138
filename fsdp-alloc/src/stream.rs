//! Streams and events.
//!
//! A [`Stream`] is an in-order queue of work. In the default [`StreamMode::Async`] each stream
//! owns one worker thread: [`Stream::launch`] enqueues a closure and returns at once, exactly like
//! a CUDA kernel launch. When the last handle of a stream goes (e.g. with its device), the worker
//! drains the queued work and exits, and the dropping thread joins it — for at most
//! [`WORKER_JOIN_BOUND`], and not when the drop happens on a stream worker (inside launched
//! work), where the worker is left to exit on its own. [`Event`]s mark a point in a stream; [`Stream::wait_event`] makes later
//! work on another stream wait for that point, without blocking the issuing thread.
//!
//! A panic inside launched work does not kill the worker: the stream records the failure, skips
//! the work queued after it (its inputs can no longer be trusted), completes every event recorded
//! after it as *failed*, and reports the panic message from the next [`Stream::synchronize`] or
//! [`Event::synchronize`]. Streams that wait on a failed event fail in turn, so an error
//! propagates along the dependency graph instead of hanging it.
//!
//! A *checked* stream ([`Stream::with_checking`], or a device built with
//! `DeviceConfig { checked: true, .. }`) also tracks which positions of which streams each job is
//! ordered after, so that the guards of [`crate::BufferRef`] can detect unordered cross-stream
//! accesses (see the `checked` module docs in the crate documentation).
//!
//! On a CUDA device (feature `cuda`) a stream wraps a CUDA stream: `launch` enqueues the closure
//! as a host function (`cuLaunchHostFunc`, so it runs in stream order and must not call CUDA),
//! events are CUDA events, and `wait_event` is `cuStreamWaitEvent`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::thread;
use std::time::Instant;

use crossbeam::channel::{unbounded, Sender};

use crate::checked;
use crate::clock::Clock;
use crate::error::{AllocError, Result};
use crate::health::Health;
pub use crate::stream_id::StreamId;
use crate::trace;
use crate::work::{run_work, Work};
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

enum Job {
    Work {
        work: Work,
        pos: u64,
        host: Option<Arc<Clock>>,
        /// Set when tracing was on at launch: the name this job is recorded under.
        label: Option<trace::Label>,
    },
    Wait {
        event: Event,
        pos: u64,
    },
    Record(Event),
}

pub(crate) struct StreamInner {
    id: StreamId,
    name: String,
    device: DeviceId,
    mode: StreamMode,
    tx: Option<Sender<Job>>,
    /// The worker thread of an async CPU stream (joined on drop).
    worker: Option<Worker>,
    health: Arc<Health>,
    /// Number of jobs launched so far (the position an event recorded now marks).
    launched: AtomicU64,
    /// Serializes "take a position, enqueue" so queue order equals position order.
    submit_lock: Mutex<()>,
    #[cfg(feature = "cuda")]
    cuda: Option<crate::cuda::StreamBackend>,
}

/// How long dropping the last handle of a stream waits for its worker thread to drain the
/// queued work and exit before leaving it detached (it then exits on its own when done).
pub const WORKER_JOIN_BOUND: std::time::Duration = std::time::Duration::from_secs(2);

thread_local! {
    /// True on stream worker threads.
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A CPU stream's worker thread: its handle and a channel that disconnects when it leaves its
/// loop (so that the join can be bounded).
struct Worker {
    handle: thread::JoinHandle<()>,
    done: crossbeam::channel::Receiver<()>,
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Closing the channel lets the worker drain what is queued and exit.
        self.tx.take();
        let Some(w) = self.worker.take() else {
            return;
        };
        // Joined (bounded) so that a dropped stream — a dropped device — leaves no thread
        // behind. Not when the last handle goes on a stream worker (inside launched work, this
        // stream's own or another's: joining could wait for work ordered after the caller).
        if ON_WORKER.with(std::cell::Cell::get) {
            return;
        }
        match w.done.recv_timeout(WORKER_JOIN_BOUND) {
            Err(crossbeam::channel::RecvTimeoutError::Timeout) => {} // still busy: detached
            Ok(()) | Err(crossbeam::channel::RecvTimeoutError::Disconnected) => {
                let _ = w.handle.join();
            }
        }
    }
}

/// An in-order queue of device work. Cheap to clone; clones are the same stream.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

/// A handle that does not keep the stream (and its worker thread) alive.
#[derive(Clone)]
pub(crate) struct WeakStream(Weak<StreamInner>);

impl WeakStream {
    pub(crate) fn upgrade(&self) -> Option<Stream> {
        self.0.upgrade().map(|inner| Stream { inner })
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.inner.id)
            .field("name", &self.inner.name)
            .field("device", &self.inner.device)
            .field("mode", &self.inner.mode)
            .field("checked", &self.inner.health.checked)
            .finish()
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.inner.id == other.inner.id
    }
}
impl Eq for Stream {}

fn run_job(job: Job, health: &Arc<Health>, label: &str) {
    match job {
        Job::Work {
            work,
            pos,
            host,
            label: None,
        } => run_work(work, pos, host, health),
        Job::Work {
            work,
            pos,
            host,
            label: Some(label),
        } => {
            let begin = Instant::now();
            run_work(work, pos, host, health);
            let end = Instant::now();
            trace::record(
                health.device,
                &health.stream_name,
                "work",
                label,
                begin,
                end,
            );
        }
        Job::Wait { event, pos } => {
            let begin = trace::is_enabled().then(Instant::now);
            if let Err(e) = event.wait_raw() {
                health.fail(format!("waited on a failed event: {e}"));
            }
            if let Some(begin) = begin {
                let end = Instant::now();
                // Only waits that actually blocked are worth a box on the timeline.
                if end.duration_since(begin) >= std::time::Duration::from_micros(2) {
                    trace::record(
                        health.device,
                        &health.stream_name,
                        "wait",
                        Arc::from("wait"),
                        begin,
                        end,
                    );
                }
            }
            if health.checked {
                let mut c = health.clock();
                c.advance(health.id, pos);
                if let Some(ec) = event.inner.clock.get() {
                    c.merge(ec);
                }
            }
        }
        Job::Record(ev) => {
            if health.checked {
                let mut c = health.clock();
                c.advance(health.id, ev.inner.position);
                let _ = ev.inner.clock.set(Arc::new(c.clone()));
            }
            match health.failure() {
                None => ev.complete(Ok(())),
                Some(m) => ev.complete(Err(format!("{label}: {m}"))),
            }
        }
    }
}

impl Stream {
    /// Creates a stream on `device`. Prefer `Device::new_stream`, which also registers the stream
    /// with the device so that `Device::synchronize` covers it.
    pub fn new(device: DeviceId, name: &str, mode: StreamMode) -> Stream {
        Stream::with_checking(device, name, mode, false)
    }

    /// Like [`Stream::new`], with the checked mode on or off (see the crate docs). A checked
    /// stream maintains a vector clock so that unordered cross-stream accesses to device memory
    /// are reported as [`AllocError::OrderingViolation`].
    pub fn with_checking(device: DeviceId, name: &str, mode: StreamMode, checked: bool) -> Stream {
        let id = StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed));
        // Checked-mode reports name streams by device too: collectives of the thread backend
        // touch other ranks' memory from streams that share their names with local ones.
        let health = Arc::new(Health::new(
            id,
            device,
            name,
            &format!("{device}/{name}"),
            checked,
        ));
        let (tx, worker) = match mode {
            StreamMode::Inline => (None, None),
            StreamMode::Async => {
                let (tx, rx) = unbounded::<Job>();
                let (done_tx, done) = crossbeam::channel::bounded::<()>(0);
                let h = Arc::clone(&health);
                let label = format!("{device}/{name}");
                let handle = thread::Builder::new()
                    .name(format!("stream-{device}-{name}"))
                    .spawn(move || {
                        ON_WORKER.with(|w| w.set(true));
                        while let Ok(job) = rx.recv() {
                            run_job(job, &h, &label);
                        }
                        drop(done_tx); // disconnects `done`: the loop is over
                    })
                    .expect("failed to spawn a stream worker thread");
                (Some(tx), Some(Worker { handle, done }))
            }
        };
        Stream {
            inner: Arc::new(StreamInner {
                id,
                name: name.to_string(),
                device,
                mode,
                tx,
                worker,
                health,
                launched: AtomicU64::new(0),
                submit_lock: Mutex::new(()),
                #[cfg(feature = "cuda")]
                cuda: None,
            }),
        }
    }

    /// A stream over a CUDA stream (no worker thread: the CUDA driver runs it).
    #[cfg(feature = "cuda")]
    pub(crate) fn new_cuda(
        device: DeviceId,
        name: &str,
        backend: crate::cuda::StreamBackend,
    ) -> Stream {
        let id = StreamId(NEXT_STREAM_ID.fetch_add(1, Ordering::Relaxed));
        Stream {
            inner: Arc::new(StreamInner {
                id,
                name: name.to_string(),
                device,
                mode: StreamMode::Async,
                tx: None,
                worker: None,
                health: Arc::new(Health::new(id, device, name, name, false)),
                launched: AtomicU64::new(0),
                submit_lock: Mutex::new(()),
                cuda: Some(backend),
            }),
        }
    }

    /// A new CUDA stream of `ctx`; if the driver refuses, a stream already failed with the
    /// driver's error.
    #[cfg(feature = "cuda")]
    pub(crate) fn new_cuda_on(
        device: DeviceId,
        name: &str,
        ctx: &Arc<cudarc::driver::CudaContext>,
    ) -> Stream {
        match crate::cuda::new_backend(ctx) {
            Ok(b) => Stream::new_cuda(device, name, b),
            Err(e) => {
                let s = Stream::new_cuda(device, name, crate::cuda::default_backend(ctx));
                s.fail(format!("cuStreamCreate failed: {e}"));
                s
            }
        }
    }

    /// The CUDA stream under this stream, if it is a CUDA stream.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        self.inner.cuda.as_ref().map(|b| b.stream())
    }

    /// Marks the stream failed with `message` (reported by `check`/`synchronize`).
    #[cfg(feature = "cuda")]
    pub(crate) fn fail(&self, message: String) {
        self.inner.health.fail(message);
    }

    pub(crate) fn downgrade(&self) -> WeakStream {
        WeakStream(Arc::downgrade(&self.inner))
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

    /// True if the checked mode is on for this stream.
    pub fn is_checked(&self) -> bool {
        self.inner.health.checked
    }

    /// Number of jobs (work, waits and event records) enqueued so far.
    pub fn launched(&self) -> u64 {
        self.inner.launched.load(Ordering::Acquire)
    }

    /// Takes the next position and enqueues the job built for it (CPU streams).
    fn submit(&self, make: impl FnOnce(u64) -> Job) -> u64 {
        match &self.inner.tx {
            Some(tx) => {
                let _g = self
                    .inner
                    .submit_lock
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                let pos = self.inner.launched.fetch_add(1, Ordering::AcqRel) + 1;
                // The worker only exits once every sender is gone, and we hold one.
                if let Err(e) = tx.send(make(pos)) {
                    run_job(e.into_inner(), &self.inner.health, &self.inner.name);
                }
                pos
            }
            None => {
                let pos = self.inner.launched.fetch_add(1, Ordering::AcqRel) + 1;
                run_job(make(pos), &self.inner.health, &self.label());
                pos
            }
        }
    }

    fn label(&self) -> String {
        format!("{}/{}", self.inner.device, self.inner.name)
    }

    /// Enqueues `work`; returns at once in async mode. Work runs after everything launched before
    /// it on this stream, and after every event this stream was told to wait on before it.
    pub fn launch<F: FnOnce() + Send + 'static>(&self, work: F) {
        self.launch_inner(None, work)
    }

    /// Like [`Stream::launch`], naming the work for the [`crate::trace`] timeline (a kernel or
    /// collective name). The name costs nothing when tracing is off.
    pub fn launch_named<F: FnOnce() + Send + 'static>(&self, name: &'static str, work: F) {
        self.launch_inner(Some(name), work)
    }

    fn launch_inner<F: FnOnce() + Send + 'static>(&self, name: Option<&'static str>, work: F) {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.inner.cuda {
            let pos = self.inner.launched.fetch_add(1, Ordering::AcqRel) + 1;
            if let Err(e) = crate::cuda::launch_host(cuda, Box::new(work), pos, &self.inner.health)
            {
                self.inner.health.fail(e);
            }
            return;
        }
        let host = if self.inner.health.checked {
            checked::host_clock()
        } else {
            None
        };
        let label = trace::is_enabled().then(|| trace::launch_label(name));
        self.submit(move |pos| Job::Work {
            work: Box::new(work),
            pos,
            host,
            label,
        });
    }

    /// Records a new event at the current end of this stream.
    pub fn record_event(&self) -> Event {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.inner.cuda {
            let pos = self.inner.launched.fetch_add(1, Ordering::AcqRel) + 1;
            return match crate::cuda::record(cuda) {
                Ok(ev) => Event::cuda(
                    self.inner.id,
                    self.inner.device,
                    pos,
                    ev,
                    &self.inner.health,
                ),
                Err(e) => {
                    self.inner.health.fail(e.clone());
                    let ev = Event::pending(self.inner.id, self.inner.device, pos);
                    ev.complete(Err(e));
                    ev
                }
            };
        }
        let (id, device) = (self.inner.id, self.inner.device);
        let mut out = None;
        self.submit(|pos| {
            let ev = Event::pending(id, device, pos);
            out = Some(ev.clone());
            Job::Record(ev)
        });
        out.expect("submit always builds the job")
    }

    /// Makes all work launched on this stream from now on wait until `event` completes.
    /// The issuing thread does not block.
    pub fn wait_event(&self, event: &Event) {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.inner.cuda {
            self.inner.launched.fetch_add(1, Ordering::AcqRel);
            if let Err(e) = cuda_wait(cuda, event, &self.inner.health) {
                self.inner.health.fail(e);
            }
            return;
        }
        if event.query() && event.error().is_none() {
            return; // already complete: nothing to order (the host clock now covers it)
        }
        let event = event.clone();
        self.submit(move |pos| Job::Wait { event, pos });
    }

    /// Orders all work launched from now on after `events`, which the allocator has observed as
    /// complete (checked mode: merges their clocks even though no waiting is needed).
    pub(crate) fn order_after(&self, events: &[Event]) {
        if !self.inner.health.checked {
            return;
        }
        for e in events {
            let event = e.clone();
            self.submit(move |pos| Job::Wait { event, pos });
        }
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

/// Makes the CUDA stream `s` wait for `event` (a CUDA event, or a CPU event via a host function).
#[cfg(feature = "cuda")]
fn cuda_wait(
    s: &crate::cuda::StreamBackend,
    event: &Event,
    health: &Arc<Health>,
) -> std::result::Result<(), String> {
    if let Some(ev) = event.cuda_backend() {
        return crate::cuda::wait_event(s, ev);
    }
    if event.query() && event.error().is_none() {
        return Ok(());
    }
    let ev = event.clone();
    // The host function runs in this stream's order; a failed event fails the waiting stream.
    crate::cuda::launch_host(
        s,
        Box::new(move || {
            if let Err(e) = ev.synchronize() {
                panic!("waited on a failed event: {e}");
            }
        }),
        0,
        health,
    )
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
    /// Checked mode: the recording stream's clock at this point.
    clock: OnceLock<Arc<Clock>>,
    #[cfg(feature = "cuda")]
    cuda: Option<(crate::cuda::EventBackend, Arc<Health>)>,
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
    fn make(
        stream: Option<StreamId>,
        device: Option<DeviceId>,
        position: u64,
        state: EventState,
    ) -> EventInner {
        EventInner {
            stream,
            device,
            position,
            state: Mutex::new(state),
            cv: Condvar::new(),
            clock: OnceLock::new(),
            #[cfg(feature = "cuda")]
            cuda: None,
        }
    }

    fn pending(stream: StreamId, device: DeviceId, position: u64) -> Event {
        Event {
            inner: Arc::new(Event::make(
                Some(stream),
                Some(device),
                position,
                EventState::Pending,
            )),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        stream: StreamId,
        device: DeviceId,
        position: u64,
        ev: crate::cuda::EventBackend,
        health: &Arc<Health>,
    ) -> Event {
        let mut inner = Event::make(Some(stream), Some(device), position, EventState::Pending);
        inner.cuda = Some((ev, Arc::clone(health)));
        Event {
            inner: Arc::new(inner),
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_backend(&self) -> Option<&crate::cuda::EventBackend> {
        self.inner.cuda.as_ref().map(|(e, _)| e)
    }

    /// A complete event standing for a point whose clock is `clock` (checked mode: ordering
    /// after it orders after everything that clock covers).
    pub(crate) fn observed_at(clock: Arc<Clock>) -> Event {
        let inner = Event::make(None, None, 0, EventState::Done);
        let _ = inner.clock.set(clock);
        Event {
            inner: Arc::new(inner),
        }
    }

    /// An event that is already complete (like a CUDA event that was never recorded).
    pub fn completed() -> Event {
        Event {
            inner: Arc::new(Event::make(None, None, 0, EventState::Done)),
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

    /// The calling thread has seen this event complete: in checked mode, work it launches from
    /// now on is ordered after the event.
    fn observed(&self) {
        if let Some(c) = self.inner.clock.get() {
            checked::observe(c);
        }
    }

    /// True once the event has completed (successfully or not). Never blocks.
    pub fn query(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some((ev, _)) = &self.inner.cuda {
            return crate::cuda::query(ev);
        }
        let done = !matches!(
            *self.inner.state.lock().unwrap_or_else(|e| e.into_inner()),
            EventState::Pending
        );
        if done {
            self.observed();
        }
        done
    }

    /// The failure message if the event's stream failed before reaching it.
    pub fn error(&self) -> Option<String> {
        #[cfg(feature = "cuda")]
        if let Some((_, health)) = &self.inner.cuda {
            return health.failure();
        }
        match &*self.inner.state.lock().unwrap_or_else(|e| e.into_inner()) {
            EventState::Failed(m) => Some(m.clone()),
            _ => None,
        }
    }

    fn wait_raw(&self) -> std::result::Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some((ev, health)) = &self.inner.cuda {
            crate::cuda::synchronize(ev)?;
            return match health.failure() {
                None => Ok(()),
                Some(m) => Err(m),
            };
        }
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
    /// Counted by [`host_syncs`].
    pub fn synchronize(&self) -> Result<()> {
        count_host_sync();
        let r = self.wait_raw().map_err(|m| self.failed(m));
        if r.is_ok() {
            self.observed();
        }
        r
    }

    fn failed(&self, message: String) -> AllocError {
        AllocError::StreamFailed {
            device: self.inner.device.unwrap_or(DeviceId::Cpu(0)),
            stream: self.inner.stream.map(|s| s.to_string()).unwrap_or_default(),
            message,
        }
    }

    /// Blocks until the event completes or `timeout` passes; `Ok(true)` if it completed.
    /// Counted by [`host_syncs`] (once per call).
    pub fn synchronize_timeout(&self, timeout: std::time::Duration) -> Result<bool> {
        count_host_sync();
        #[cfg(feature = "cuda")]
        if self.inner.cuda.is_some() {
            let deadline = std::time::Instant::now() + timeout;
            loop {
                if self.query() {
                    return self.synchronize().map(|()| true);
                }
                if std::time::Instant::now() >= deadline {
                    return Ok(false);
                }
                thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        let deadline = std::time::Instant::now() + timeout;
        let mut s = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*s {
                EventState::Done => {
                    drop(s);
                    self.observed();
                    return Ok(true);
                }
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

// ============================================================================ host waits

// The counter lives in its own lower file (`host_waits.rs`), so that `cuda.rs` and `trace.rs`,
// which this file imports, can count waits without importing this file.
pub use crate::host_waits::{count_host_sync, host_syncs};

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    fn s(name: &str) -> Stream {
        Stream::new(DeviceId::Cpu(0), name, StreamMode::Async)
    }

    /// Live threads of this process whose name starts with `prefix` (Linux: `/proc`, names
    /// truncated to 15 bytes).
    #[cfg(target_os = "linux")]
    fn threads_named(prefix: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|n| n.starts_with(prefix))
            .count()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_dropped_device_leaves_no_worker_thread_behind() {
        // "stream-cpu:4242" is exactly the 15 bytes Linux keeps of these workers' names, and no
        // other test uses device cpu:4242.
        const PREFIX: &str = "stream-cpu:4242";
        let ran = Arc::new(AtomicUsize::new(0));
        {
            let dev = crate::Device::cpu(4242);
            let extra = dev.new_stream("extra");
            // A worker names itself when it starts: wait for both names to show.
            let t = Instant::now();
            while threads_named(PREFIX) < 2 && t.elapsed() < Duration::from_secs(10) {
                thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(
                threads_named(PREFIX),
                2,
                "the default and the extra stream's worker"
            );
            for st in [dev.default_stream().clone(), extra] {
                let r = Arc::clone(&ran);
                // Queued work still running when the last handle goes: the drop waits for it.
                st.launch(move || {
                    thread::sleep(Duration::from_millis(500));
                    r.fetch_add(1, Ordering::SeqCst);
                });
            }
        }
        assert_eq!(
            ran.load(Ordering::SeqCst),
            2,
            "the queued work ran before the drop returned"
        );
        // A joined thread leaves /proc a moment after the join returns (the kernel wakes the
        // joiner before it reaps the task): poll briefly — far less than the queued work's
        // 500 ms, which a detached worker would still be sleeping through.
        let t = Instant::now();
        while threads_named(PREFIX) > 0 && t.elapsed() < Duration::from_millis(250) {
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(threads_named(PREFIX), 0, "no worker left behind");
    }

    #[test]
    fn a_stream_dropped_inside_its_own_work_does_not_wait_for_itself() {
        let st = s("self-drop");
        let (go_tx, go) = std::sync::mpsc::channel::<()>();
        let (tx, rx) = std::sync::mpsc::channel();
        let mine = st.clone();
        st.launch(move || {
            go.recv().unwrap();
            drop(mine); // the last handle, dropped on the stream's own worker
            tx.send(()).unwrap();
        });
        drop(st); // not the last handle: the queued work holds one
        let t = Instant::now();
        go_tx.send(()).unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(t.elapsed() < WORKER_JOIN_BOUND, "{:?}", t.elapsed());
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
    fn host_waits_are_counted_per_thread() {
        let s = s("count");
        let before = host_syncs();
        s.launch(|| {});
        assert_eq!(host_syncs(), before, "launching is not a wait");
        s.synchronize().unwrap();
        s.record_event().synchronize().unwrap();
        assert!(s
            .record_event()
            .synchronize_timeout(Duration::from_secs(5))
            .unwrap());
        assert_eq!(host_syncs(), before + 3);
        // Another thread's waits are its own.
        let s2 = s.clone();
        std::thread::spawn(move || s2.synchronize().unwrap())
            .join()
            .unwrap();
        assert_eq!(host_syncs(), before + 3);
        count_host_sync();
        assert_eq!(host_syncs(), before + 4);
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
