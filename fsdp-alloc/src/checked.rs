//! The checked mode: a happens-before race detector for stream-ordered device memory.
//!
//! Every stream of a checked device keeps a *vector clock*: for each stream it is ordered after,
//! the last position (job index) of that stream it has waited for. Events carry a snapshot of
//! their stream's clock when they are reached, [`crate::Stream::wait_event`] merges it into the
//! waiting stream's clock, and a host thread that observes an event as complete
//! ([`crate::Event::synchronize`], a successful [`crate::Event::query`]) merges it into its own
//! thread-local clock, which work it launches afterwards inherits. That is exactly the ordering
//! CUDA gives: stream order, event waits, and host synchronization followed by a launch.
//!
//! Every read or write guard taken *inside launched work* of a checked stream is an access by
//! (stream, position). Each segment remembers, per byte range, its last write and the reads since
//! then. An access that conflicts with a remembered one (write/any or read/write) must be ordered
//! after it: same stream, or a clock entry at least the remembered position. Otherwise it is an
//! [`crate::AllocError::OrderingViolation`] naming the block, both streams and, when the two
//! accesses belong to different allocations of the same memory, that the block was freed and
//! reused. The violating stream is failed with that message, so the bug surfaces at its next
//! synchronize even if the work ignored the error.
//!
//! Limits: accesses made by host threads outside launched work are neither checked nor
//! remembered; synchronization that does not go through events (barriers, channels between
//! threads) is invisible unless the code reports it with [`OrderPoint`]s (the thread backend's
//! collectives do, at each rendezvous); other code that orders streams that way must not run in
//! checked mode. The unit of ordering is the job: accesses made inside one launched job all
//! count as that job's position.

use std::cell::{Cell, RefCell};
use std::sync::{Arc, Mutex};

use crate::clock::Clock;
use crate::error::{AllocError, Result};
use crate::health::Health;
use crate::stream_id::StreamId;

/// A point in the checked mode's happens-before order, for code that orders launched work by
/// means the checked mode cannot see — a rendezvous of several streams' jobs, as in a thread
/// backend's collectives.
///
/// Events, `wait_event` and host synchronization are tracked automatically (see the crate docs,
/// "Checked mode"). A rendezvous is not: when stream A's job waits inside its work until stream
/// B's job has written something, nothing tells the checked mode that A's later reads are
/// ordered after B's writes, and it reports a violation. The participants of such a
/// rendezvous tell it instead: each one takes an `OrderPoint` when it arrives, the points are
/// exchanged through the rendezvous, and each participant calls [`OrderPoint::join`] with all of
/// them once the rendezvous is complete.
///
/// Outside checked streams every point is empty and `join` does nothing, so a backend can use
/// this unconditionally: it costs a clock copy only when the checked mode is on.
///
/// ```
/// use fsdp_alloc::{Device, DeviceConfig, OrderPoint};
/// use std::sync::{Arc, Barrier, Mutex};
///
/// let dev = Device::cpu_with(0, DeviceConfig { checked: true, ..DeviceConfig::default() });
/// let (a, b) = (dev.new_stream("a"), dev.new_stream("b"));
/// let g = dev.alloc(64, &a)?;
/// let buf = g.data().clone();
/// let points = Arc::new(Mutex::new(Vec::new()));
/// let barrier = Arc::new(Barrier::new(2));
/// // A writes, then meets B; B reads after the meeting.
/// let (p, bar, w) = (points.clone(), barrier.clone(), buf.clone());
/// a.launch(move || {
///     w.write::<u8>().unwrap().fill(7);
///     p.lock().unwrap().push(OrderPoint::current());
///     bar.wait();
/// });
/// let (p, bar, r) = (points.clone(), barrier.clone(), buf.clone());
/// b.launch(move || {
///     p.lock().unwrap().push(OrderPoint::current());
///     bar.wait();
///     OrderPoint::join(&p.lock().unwrap());
///     assert_eq!(r.read::<u8>().unwrap()[0], 7); // ordered after A's write: no violation
/// });
/// dev.synchronize()?;
/// # Ok::<(), fsdp_alloc::AllocError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct OrderPoint(Option<Arc<Clock>>);

impl OrderPoint {
    /// Everything the calling code is ordered after, *including* what it has done so far: inside
    /// launched work of a checked stream, the running job (all of its accesses, before and after
    /// this call, count as this point — the checked mode's unit is the job); on a host thread,
    /// what the thread has observed complete. Empty elsewhere.
    pub fn current() -> OrderPoint {
        match CURRENT.with(|c| c.borrow().clone()) {
            Some(ctx) => OrderPoint(Some(Arc::clone(&ctx.clock))),
            None => OrderPoint(host_clock()),
        }
    }

    /// Like [`OrderPoint::current`], but *excluding* the running job's own accesses: what the
    /// job was ordered after when it started, plus any points it joined since. Take this on
    /// arrival at a rendezvous after which peers write memory the job also accesses, so that the
    /// job's accesses made after the rendezvous are still checked against the peers'.
    pub fn before_current_job() -> OrderPoint {
        match CURRENT.with(|c| c.borrow().clone()) {
            Some(ctx) => OrderPoint(Some(Arc::new(
                ctx.clock.with_entry(ctx.stream, ctx.pos.saturating_sub(1)),
            ))),
            None => OrderPoint(host_clock()),
        }
    }

    /// True if this point orders nothing (taken outside checked streams, or before anything
    /// was observed).
    pub fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|c| c.0.is_empty())
    }

    /// Orders the rest of the running job — and everything its stream runs after it — after
    /// all of `points`. On a host thread, work the thread launches from now on is ordered after
    /// them. Call it only when the calling code really is ordered after every point (the
    /// rendezvous they were exchanged through is complete); a wrong join hides real races.
    pub fn join(points: &[OrderPoint]) {
        let clocks: Vec<&Arc<Clock>> = points.iter().filter_map(|p| p.0.as_ref()).collect();
        if clocks.is_empty() {
            return;
        }
        match CURRENT.with(|c| c.borrow().clone()) {
            Some(ctx) => {
                let mut merged = (*ctx.clock).clone();
                for c in &clocks {
                    merged.merge(c);
                }
                ctx.health.merge_clock(&merged);
                let joined = Arc::new(JobCtx {
                    stream: ctx.stream,
                    name: Arc::clone(&ctx.name),
                    pos: ctx.pos,
                    clock: Arc::new(merged),
                    health: Arc::clone(&ctx.health),
                });
                CURRENT.with(|c| *c.borrow_mut() = Some(joined));
            }
            None => {
                for c in clocks {
                    observe(c);
                }
            }
        }
    }
}

/// What the guard of a running job needs to attribute and check an access.
pub(crate) struct JobCtx {
    pub(crate) stream: StreamId,
    pub(crate) name: Arc<str>,
    pub(crate) pos: u64,
    pub(crate) clock: Arc<Clock>,
    pub(crate) health: Arc<Health>,
}

thread_local! {
    /// The checked job running on this thread, if any.
    static CURRENT: RefCell<Option<Arc<JobCtx>>> = const { RefCell::new(None) };
    /// What this host thread has observed as complete.
    static HOST: RefCell<Option<Arc<Clock>>> = const { RefCell::new(None) };
    /// The stream whose job this thread is running right now (checked or not).
    static RUNNING_ON: Cell<Option<StreamId>> = const { Cell::new(None) };
}

/// Runs `f` with `ctx` as the current checked job (restoring the previous one after).
pub(crate) fn with_job<R>(ctx: Option<Arc<JobCtx>>, stream: StreamId, f: impl FnOnce() -> R) -> R {
    let prev = CURRENT.with(|c| c.replace(ctx));
    let prev_running = RUNNING_ON.with(|r| r.replace(Some(stream)));
    struct Restore(Option<Arc<JobCtx>>, Option<StreamId>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let p = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = p);
            RUNNING_ON.with(|r| r.set(self.1));
        }
    }
    let _restore = Restore(prev, prev_running);
    f()
}

/// The stream whose launched work is running on this thread, if any (used to avoid a worker
/// synchronizing its own stream, which would deadlock).
pub(crate) fn running_on() -> Option<StreamId> {
    RUNNING_ON.with(|r| r.get())
}

/// The calling host thread's clock (what it has observed complete), if non-empty.
pub(crate) fn host_clock() -> Option<Arc<Clock>> {
    HOST.with(|h| h.borrow().clone())
}

/// What the calling thread knows has happened right now: its host clock, joined with the clock
/// of the launched job it is running (if any). A block freed here is reused by work ordered
/// after this point.
pub(crate) fn free_point() -> Option<Arc<Clock>> {
    let job = CURRENT.with(|c| c.borrow().as_ref().map(|j| Arc::clone(&j.clock)));
    match (job, host_clock()) {
        (None, h) => h,
        (Some(j), None) => Some(j),
        (Some(j), Some(h)) => {
            let mut c = (*j).clone();
            c.merge(&h);
            Some(Arc::new(c))
        }
    }
}

/// Records that the calling thread observed a point whose clock is `clock`.
pub(crate) fn observe(clock: &Arc<Clock>) {
    HOST.with(|h| {
        let mut h = h.borrow_mut();
        match h.as_mut() {
            None => *h = Some(Arc::clone(clock)),
            Some(cur) => {
                if !cur.covers(clock) {
                    Arc::make_mut(cur).merge(clock);
                }
            }
        }
    });
}

#[derive(Debug, Clone)]
struct AccessRecord {
    start: usize,
    end: usize,
    write: bool,
    stream: StreamId,
    name: Arc<str>,
    pos: u64,
    block: u64,
}

/// A segment's access history (empty unless checked streams touch it).
#[derive(Debug, Default)]
pub(crate) struct History(Mutex<Vec<AccessRecord>>);

/// Checks and records an access to bytes `start..end` of segment `seg` by the current checked job,
/// if any. `block` is the allocation id of the `BufferRef` used.
pub(crate) fn on_access(
    hist: &History,
    seg: u64,
    start: usize,
    end: usize,
    write: bool,
    block: u64,
) -> Result<()> {
    let Some(ctx) = CURRENT.with(|c| c.borrow().clone()) else {
        return Ok(());
    };
    if start >= end {
        return Ok(());
    }
    let mut h = hist.0.lock().unwrap_or_else(|e| e.into_inner());
    let ordered = |r: &AccessRecord| r.stream == ctx.stream || ctx.clock.get(r.stream) >= r.pos;
    if let Some(r) = h
        .iter()
        .find(|r| r.start < end && start < r.end && (write || r.write) && !ordered(r))
    {
        let this = if write { "writes" } else { "reads" };
        let that = if r.write { "wrote" } else { "read" };
        let msg = if r.block != block {
            format!(
                "block {block} (segment {seg} bytes {start}..{end}) is the memory of freed \
                 allocation {old} reused: stream `{cur}` (job {pos}) {this} it while stream `{other}` \
                 (job {opos}) {that} the old allocation with no ordering between them; call \
                 Buffer::record_stream(`{other}`) before dropping the old buffer, or keep it alive \
                 until an event recorded on `{other}` completes",
                old = r.block,
                cur = ctx.name,
                pos = ctx.pos,
                other = r.name,
                opos = r.pos,
            )
        } else {
            format!(
                "block {block} (segment {seg} bytes {start}..{end}): stream `{cur}` (job {pos}) \
                 {this} it but stream `{other}` {that} it at job {opos} and `{cur}` never waited \
                 for that; record an event on `{other}` after its work and make `{cur}` \
                 wait_event on it",
                cur = ctx.name,
                pos = ctx.pos,
                other = r.name,
                opos = r.pos,
            )
        };
        drop(h);
        ctx.health.fail(format!("stream-ordering violation: {msg}"));
        return Err(AllocError::OrderingViolation(msg));
    }
    if write {
        // Everything this write covers is ordered before it, hence before whatever is ordered
        // after it: those records add nothing.
        h.retain(|r| !(r.start >= start && r.end <= end));
    } else {
        h.retain(|r| !(r.stream == ctx.stream && !r.write && r.start >= start && r.end <= end));
    }
    h.push(AccessRecord {
        start,
        end,
        write,
        stream: ctx.stream,
        name: Arc::clone(&ctx.name),
        pos: ctx.pos,
        block,
    });
    Ok(())
}
