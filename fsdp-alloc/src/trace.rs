//! A timeline recorder: what ran where, and when, written as a Chrome trace.
//!
//! [`start`] turns recording on for the whole process; [`stop`] turns it off and returns the
//! [`Trace`] recorded in between, which [`Trace::write_chrome_json`] writes in the Chrome trace
//! event format (open it in <https://ui.perfetto.dev> or `chrome://tracing`).
//!
//! Three kinds of intervals are recorded, all as complete (`"ph": "X"`) events with
//! `pid` = the rank (the device index) and one `tid` per stream or thread (named by metadata
//! events, so both viewers show the stream or thread name). Where ranks share a device index —
//! thread ranks sharing one GPU, whose devices are all `cuda:0` — each rank thread sets its
//! [`lane`]: what that thread records (host spans, and the GPU intervals of the work it
//! enqueues) goes to `pid` = the lane instead, so every rank's streams are tracks of its own
//! timeline:
//!
//! - **stream work** (`cat` `"work"`): every job a CPU stream's worker runs. Its name is the one
//!   given to [`crate::Stream::launch_named`], else the innermost [`span`] open on the thread
//!   that launched it, else `"work"`.
//! - **stream waits** (`cat` `"wait"`): time a stream's worker spent blocked in a
//!   [`crate::Stream::wait_event`] before it could run what follows — a stream that is idle
//!   because another stream has not caught up.
//! - **host spans** (`cat` `"host"`): intervals opened with [`span`] on an issuing thread (FSDP
//!   marks unshard, the forward and backward of each unit, reduce-scatter issue, the optimizer).
//!
//! - **GPU work** (`cat` `"kernel"`, `"copy"`, `"nccl"`; feature `cuda`): every kernel, cuBLAS
//!   call, copy and NCCL collective enqueued on a CUDA stream while recording, timed by a pair
//!   of CUDA events around it (`gpu_begin` / `gpu_end`), on a track `"gpu <stream name>"`.
//!   The events are resolved when [`stop`] is called (after `Device::synchronize`), relative to
//!   one *anchor* event per device: recorded and waited for once at the device's first GPU
//!   interval of the recording (one host wait per device per trace), its completion taken as
//!   the host time it happened. GPU times are therefore exact relative to each other and
//!   aligned with the host tracks to within the anchor's completion latency (microseconds).
//!   [`place_gpu_interval`] is that arithmetic, unit-tested without a GPU.
//!
//! Time outside any interval on a track is idle time of that stream or thread.
//!
//! When recording is off, the cost on the launch path is one relaxed atomic load ([`is_enabled`])
//! and nothing on the worker. When it is on, each interval takes one short global lock at its end;
//! timestamps come from [`std::time::Instant`] and are relative to the [`start`] call.
//! CUDA streams' host-function jobs are not recorded as `"work"`; their GPU work is recorded as
//! GPU intervals (above).
//!
//! ```
//! use fsdp_alloc::{trace, Device};
//!
//! let dev = Device::cpu(0);
//! trace::start();
//! {
//!     let _s = trace::span(dev.id(), "step");
//!     dev.default_stream().launch_named("fill", || {});
//!     dev.synchronize().unwrap();
//! }
//! let t = trace::stop();
//! assert!(t.events().iter().any(|e| &*e.name == "fill" && e.track == "default"));
//! assert!(t.events().iter().any(|e| &*e.name == "step" && e.cat == "host"));
//! let json = t.to_chrome_json();
//! assert!(json.contains("\"traceEvents\""));
//! ```

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::DeviceId;

static ENABLED: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<Option<Recording>> = Mutex::new(None);

struct Recording {
    epoch: Instant,
    events: Vec<TraceEvent>,
    /// GPU intervals waiting for their events to be resolved at [`stop`].
    #[cfg(feature = "cuda")]
    gpu: Vec<gpu::Pending>,
    /// One anchor per device: an event and the host instant it completed.
    #[cfg(feature = "cuda")]
    anchors: Vec<(DeviceId, cudarc::driver::CudaEvent, Instant)>,
}

/// The name of a recorded interval: static for op names, shared for span names.
pub type Label = Arc<str>;

thread_local! {
    /// The spans open on this thread, innermost last (only maintained while recording).
    static OPEN: RefCell<Vec<Label>> = const { RefCell::new(Vec::new()) };
    /// The timeline this thread's records go to, when set with [`lane`].
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Sends what this thread records — host spans, and the GPU intervals of work it enqueues on
/// CUDA streams — to timeline `pid` (the trace's "process" `rank {pid}`) instead of its
/// device's index, until the returned guard is dropped (the previous lane, if any, comes back).
/// For ranks whose devices share an index: W thread ranks on one GPU each set `lane(rank)`, so
/// their identically named streams (`default`, `fsdp-unshard`, …) stay apart. Work recorded by
/// CPU stream workers keeps its device's index (CPU devices have distinct indices anyway).
pub fn lane(pid: usize) -> Lane {
    Lane {
        prev: LANE.with(|l| l.replace(Some(pid))),
    }
}

/// Restores the thread's previous [`lane`] when dropped.
#[must_use = "the lane applies while the guard lives: bind it with `let _lane = ...`"]
pub struct Lane {
    prev: Option<usize>,
}

impl Drop for Lane {
    fn drop(&mut self) {
        LANE.with(|l| l.set(self.prev));
    }
}

/// True while recording is on. One relaxed atomic load: cheap enough for every launch.
#[inline]
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Starts recording (process-wide), discarding anything recorded before. Timestamps of the
/// trace are relative to this call.
pub fn start() {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    *s = Some(Recording {
        epoch: Instant::now(),
        events: Vec::new(),
        #[cfg(feature = "cuda")]
        gpu: Vec::new(),
        #[cfg(feature = "cuda")]
        anchors: Vec::new(),
    });
    ENABLED.store(true, Ordering::Release);
}

/// Stops recording and returns what was recorded since [`start`] (empty if it was not started).
/// Stream work still running keeps its interval only if it ends before this call; call
/// `Device::synchronize` first to capture everything launched.
pub fn stop() -> Trace {
    ENABLED.store(false, Ordering::Release);
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    #[allow(unused_mut)]
    let mut events = match s.take() {
        None => Vec::new(),
        #[cfg(not(feature = "cuda"))]
        Some(r) => r.events,
        #[cfg(feature = "cuda")]
        Some(r) => gpu::resolve(r),
    };
    events.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    Trace { events }
}

/// The pid a record made on this thread for `device` uses: the thread's [`lane`] if set, else
/// the device's index (the rank on thread-rank runs).
fn pid_of(device: DeviceId) -> usize {
    LANE.with(Cell::get).unwrap_or(match device {
        DeviceId::Cpu(i) | DeviceId::Cuda(i) => i,
    })
}

/// Records one interval `[begin, end)` if recording is on (no-op otherwise).
pub(crate) fn record(
    device: DeviceId,
    track: &str,
    cat: &'static str,
    name: Label,
    begin: Instant,
    end: Instant,
) {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = s.as_mut() {
        let start_us = us(begin.saturating_duration_since(r.epoch));
        let dur_us = us(end.saturating_duration_since(begin));
        r.events.push(TraceEvent {
            name,
            cat,
            pid: pid_of(device),
            track: track.to_string(),
            start_us,
            dur_us,
        });
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The label a launch on this thread gets when the launch names nothing: the innermost open
/// [`span`], or `"work"`. Only called while recording.
pub(crate) fn launch_label(name: Option<&'static str>) -> Label {
    if let Some(n) = name {
        return Arc::from(n);
    }
    OPEN.with(|o| o.borrow().last().cloned())
        .unwrap_or_else(|| Arc::from("work"))
}

/// An open host span; records `[open, drop)` on the opening thread's track when dropped.
#[must_use = "a span records its interval when dropped; bind it with `let _span = ...`"]
pub struct Span {
    open: Option<(DeviceId, Label, Instant)>,
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((device, name, begin)) = self.open.take() {
            let end = Instant::now();
            // Spans may close out of order (FSDP's hooks open a unit's span in one hook and
            // close it in another): remove this one, wherever it is.
            OPEN.with(|o| {
                let mut o = o.borrow_mut();
                if let Some(i) = o.iter().rposition(|l| Arc::ptr_eq(l, &name)) {
                    o.remove(i);
                }
            });
            let thread = std::thread::current();
            let track = match thread.name() {
                Some(n) => format!("host {n}"),
                None => format!("host {:?}", thread.id()),
            };
            record(device, &track, "host", name, begin, end);
        }
    }
}

/// Opens a span named `name` on the calling thread, on `device`'s timeline (pid = its index).
/// Work launched on a stream from this thread while the span is open, without a name of its
/// own, is labelled with it. Costs one relaxed load when recording is off.
pub fn span(device: DeviceId, name: impl Into<Cow<'static, str>>) -> Span {
    if !is_enabled() {
        return Span { open: None };
    }
    let label: Label = match name.into() {
        Cow::Borrowed(s) => Arc::from(s),
        Cow::Owned(s) => Arc::from(s),
    };
    OPEN.with(|o| o.borrow_mut().push(Arc::clone(&label)));
    Span {
        open: Some((device, label, Instant::now())),
    }
}

/// Like [`span`], but builds the name only when recording is on (for names with formatting).
pub fn span_with(device: DeviceId, name: impl FnOnce() -> String) -> Span {
    if !is_enabled() {
        return Span { open: None };
    }
    span(device, name())
}

/// Places a GPU interval on the trace's host timeline: `anchor_us` is the host time (µs after
/// [`start`]) at which the device's anchor event completed; `start_ms` / `end_ms` are the CUDA
/// event times of the interval's two events relative to the anchor (`cuEventElapsedTime`).
/// An end before the start (which the driver does not produce, but a clock quirk must not turn
/// into a negative duration) gives a zero-length interval at the start.
pub fn place_gpu_interval(
    anchor_us: f64,
    start_ms: f32,
    end_ms: f32,
    pid: usize,
    track: String,
    cat: &'static str,
    name: Label,
) -> TraceEvent {
    let start_us = anchor_us + f64::from(start_ms) * 1e3;
    let dur_us = (f64::from(end_ms) - f64::from(start_ms)).max(0.0) * 1e3;
    TraceEvent {
        name,
        cat,
        pid,
        track,
        start_us,
        dur_us,
    }
}

/// GPU time per name of the GPU intervals of category `cat` (`"kernel"`, `"copy"`, `"nccl"`),
/// largest first, with each one's share of their sum: the kernel-time table of a profiled step.
pub fn gpu_time_shares(trace: &Trace, cat: &str) -> Vec<(String, f64, f64)> {
    let mut by: BTreeMap<String, f64> = BTreeMap::new();
    for e in trace
        .events
        .iter()
        .filter(|e| e.cat == cat && e.track.starts_with("gpu "))
    {
        *by.entry(e.name.to_string()).or_insert(0.0) += e.dur_us;
    }
    let sum: f64 = by.values().sum();
    let mut out: Vec<(String, f64, f64)> = by
        .into_iter()
        .map(|(n, us)| (n, us, if sum > 0.0 { us / sum } else { 0.0 }))
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out
}

/// A GPU interval opened by [`gpu_begin`] (feature `cuda`): the start event, recorded on the
/// stream before the work. Close it with [`gpu_end`] after enqueueing the work.
#[cfg(feature = "cuda")]
pub struct GpuMark {
    device: DeviceId,
    /// The timeline it goes to (the issuing thread's [`lane`], else the device index).
    pid: usize,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    start: cudarc::driver::CudaEvent,
}

/// Opens a GPU interval on `stream` of `device` if recording is on: records a timing event on
/// the stream (and, the first time for this device in this recording, the device's anchor,
/// waiting for it). `None` when recording is off (one relaxed load) or an event could not be
/// made (the trace then lacks this interval; nothing fails).
#[cfg(feature = "cuda")]
pub fn gpu_begin(
    device: DeviceId,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
) -> Option<GpuMark> {
    if !is_enabled() {
        return None;
    }
    gpu::begin(device, stream)
}

/// Closes a GPU interval: records the end event after the work and queues the pair for
/// resolution at [`stop`], on track `"gpu <track>"`. `mark == None` does nothing.
#[cfg(feature = "cuda")]
pub fn gpu_end(mark: Option<GpuMark>, track: &str, cat: &'static str, name: Label) {
    if let Some(m) = mark {
        gpu::end(m, track, cat, name);
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    //! The CUDA side of GPU intervals: events, anchors, and their resolution at `stop`.
    use std::time::Instant;

    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::CudaEvent;

    use super::{pid_of, place_gpu_interval, us, GpuMark, Label, Recording, TraceEvent, STATE};
    use crate::DeviceId;

    pub(super) struct Pending {
        device: DeviceId,
        pid: usize,
        track: String,
        cat: &'static str,
        name: Label,
        start: CudaEvent,
        end: CudaEvent,
    }

    fn timing_event(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Option<CudaEvent> {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .ok()
    }

    pub(super) fn begin(
        device: DeviceId,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Option<GpuMark> {
        let has_anchor = {
            let s = STATE.lock().unwrap_or_else(|e| e.into_inner());
            s.as_ref()?.anchors.iter().any(|(d, _, _)| *d == device)
        };
        if !has_anchor {
            // The anchor: recorded behind whatever the stream has queued, waited for, and
            // stamped with the host time it completed. Taken outside the lock.
            let anchor = timing_event(stream)?;
            // A host wait (once per device and trace), counted like every other.
            crate::host_waits::count_host_sync();
            anchor.synchronize().ok()?;
            let at = Instant::now();
            let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
            let r = s.as_mut()?;
            if !r.anchors.iter().any(|(d, _, _)| *d == device) {
                r.anchors.push((device, anchor, at));
            }
        }
        let start = timing_event(stream)?;
        Some(GpuMark {
            device,
            pid: pid_of(device),
            stream: std::sync::Arc::clone(stream),
            start,
        })
    }

    pub(super) fn end(m: GpuMark, track: &str, cat: &'static str, name: Label) {
        let Some(end) = timing_event(&m.stream) else {
            return;
        };
        let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = s.as_mut() {
            r.gpu.push(Pending {
                device: m.device,
                pid: m.pid,
                track: format!("gpu {track}"),
                cat,
                name,
                start: m.start,
                end,
            });
        }
    }

    /// The recording's events with its GPU intervals resolved (each waits for its events:
    /// call `stop` after synchronizing the devices, and this does not block). An interval whose
    /// events cannot be read is dropped.
    pub(super) fn resolve(r: Recording) -> Vec<TraceEvent> {
        let mut events = r.events;
        for p in r.gpu {
            let Some((_, anchor, at)) = r.anchors.iter().find(|(d, _, _)| *d == p.device) else {
                continue;
            };
            let (Ok(a), Ok(b)) = (anchor.elapsed_ms(&p.start), anchor.elapsed_ms(&p.end)) else {
                continue;
            };
            let anchor_us = us(at.saturating_duration_since(r.epoch));
            events.push(place_gpu_interval(
                anchor_us, a, b, p.pid, p.track, p.cat, p.name,
            ));
        }
        events
    }
}

/// One recorded interval.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEvent {
    /// What ran: the op or span name.
    pub name: Label,
    /// `"work"` (stream work), `"wait"` (a stream blocked on an event), `"host"` (a span), or
    /// on a `"gpu …"` track `"kernel"`, `"copy"`, `"nccl"`, `"shared-gpu"` (GPU intervals).
    pub cat: &'static str,
    /// The timeline: the recording thread's [`lane`], else the device index (the rank).
    pub pid: usize,
    /// The stream name (stream work and waits) or `"host <thread name>"` (spans).
    pub track: String,
    /// Start, in microseconds after [`start`].
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
}

/// A recorded timeline (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    events: Vec<TraceEvent>,
}

/// Total time per (category, track kind, name) — see [`Trace::totals`].
#[derive(Debug, Clone, PartialEq)]
pub struct Total {
    /// Event category (`"work"`, `"wait"`, `"host"`).
    pub cat: &'static str,
    /// The track (stream or host thread) name, without the rank.
    pub track: String,
    /// The event name.
    pub name: String,
    /// Number of intervals.
    pub count: usize,
    /// Summed duration in microseconds (over all ranks).
    pub total_us: f64,
}

impl Trace {
    /// A trace of these intervals (sorted into start order): for assembling or filtering traces
    /// outside a recording.
    pub fn from_events(mut events: Vec<TraceEvent>) -> Trace {
        events.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
        Trace { events }
    }

    /// The recorded intervals, in start order.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// Wall time covered: from the first start to the last end, in microseconds.
    pub fn span_us(&self) -> f64 {
        let first = self
            .events
            .iter()
            .map(|e| e.start_us)
            .fold(f64::INFINITY, f64::min);
        let last = self
            .events
            .iter()
            .map(|e| e.start_us + e.dur_us)
            .fold(0.0, f64::max);
        if first.is_finite() {
            (last - first).max(0.0)
        } else {
            0.0
        }
    }

    /// Summed durations per (category, track, name) over all ranks, largest first: the "where
    /// does the time go" table. Host spans nest, so their totals overlap each other.
    pub fn totals(&self) -> Vec<Total> {
        let mut m: BTreeMap<(&'static str, String, String), (usize, f64)> = BTreeMap::new();
        for e in &self.events {
            let track = if e.cat == "host" {
                "host".to_string()
            } else {
                e.track.clone()
            };
            let v = m
                .entry((e.cat, track, e.name.to_string()))
                .or_insert((0, 0.0));
            v.0 += 1;
            v.1 += e.dur_us;
        }
        let mut out: Vec<Total> = m
            .into_iter()
            .map(|((cat, track, name), (count, total_us))| Total {
                cat,
                track,
                name,
                count,
                total_us,
            })
            .collect();
        out.sort_by(|a, b| b.total_us.total_cmp(&a.total_us));
        out
    }

    /// The trace in the Chrome trace event format (a JSON object with `traceEvents`).
    pub fn to_chrome_json(&self) -> String {
        // Stable numeric tids per (pid, track), named by "thread_name" metadata events.
        let mut tids: BTreeMap<(usize, &str), usize> = BTreeMap::new();
        for e in &self.events {
            let n = tids.len();
            tids.entry((e.pid, e.track.as_str())).or_insert(n + 1);
        }
        let mut out = String::with_capacity(64 + self.events.len() * 120);
        out.push_str("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[");
        let mut first = true;
        let mut sep = |out: &mut String| {
            if !first {
                out.push_str(",\n");
            }
            first = false;
        };
        let pids: std::collections::BTreeSet<usize> = tids.keys().map(|(p, _)| *p).collect();
        for p in pids {
            sep(&mut out);
            out.push_str(&format!(
                "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{p},\"tid\":0,\"args\":{{\"name\":\"rank {p}\"}}}}"
            ));
        }
        for ((pid, track), tid) in &tids {
            sep(&mut out);
            out.push_str(&format!(
                "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"name\":{}}}}}",
                json_string(track)
            ));
        }
        for e in &self.events {
            sep(&mut out);
            let tid = tids[&(e.pid, e.track.as_str())];
            out.push_str(&format!(
                "{{\"ph\":\"X\",\"name\":{},\"cat\":\"{}\",\"pid\":{},\"tid\":{},\"ts\":{:.3},\"dur\":{:.3}}}",
                json_string(&e.name),
                e.cat,
                e.pid,
                tid,
                e.start_us,
                e.dur_us
            ));
        }
        out.push_str("]}\n");
        out
    }

    /// Writes [`Trace::to_chrome_json`] to `path`.
    pub fn write_chrome_json(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        f.write_all(self.to_chrome_json().as_bytes())?;
        f.flush()
    }
}

fn json_string(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str, start_us: f64, dur_us: f64) -> TraceEvent {
        TraceEvent {
            name: Arc::from(name),
            cat: "host",
            pid: 0,
            track: "host main".into(),
            start_us,
            dur_us,
        }
    }

    #[test]
    fn gpu_intervals_land_after_their_anchor_in_device_time() {
        // Anchor completed 1 ms after start; a kernel ran from 0.25 ms to 0.75 ms after it.
        let e = place_gpu_interval(
            1000.0,
            0.25,
            0.75,
            3,
            "gpu default".into(),
            "kernel",
            Arc::from("gelu_f32"),
        );
        assert_eq!((e.start_us, e.dur_us, e.pid), (1250.0, 500.0, 3));
        // An end before the start never gives a negative duration.
        let z = place_gpu_interval(0.0, 2.0, 1.0, 0, "gpu s".into(), "copy", Arc::from("h2d"));
        assert_eq!((z.start_us, z.dur_us), (2000.0, 0.0));
    }

    #[test]
    fn gpu_and_host_tracks_assemble_into_one_chrome_trace() {
        let g = |name: &str, track: &str, cat: &'static str, a: f32, b: f32| {
            place_gpu_interval(100.0, a, b, 0, format!("gpu {track}"), cat, Arc::from(name))
        };
        let t = Trace::from_events(vec![
            g("sgemm", "default", "kernel", 0.2, 0.5),
            host("forward", 50.0, 600.0),
            g("all_gather", "unshard", "nccl", 0.0, 0.3),
            g("h2d", "offload", "copy", 0.1, 0.15),
            g("gelu", "default", "kernel", 0.5, 0.6),
        ]);
        // Start order across host and GPU tracks.
        let starts: Vec<f64> = t.events().iter().map(|e| e.start_us).collect();
        assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{starts:?}");
        assert_eq!(t.events()[0].name.as_ref(), "forward");
        // One named track per stream: three GPU streams and the host thread.
        let json = t.to_chrome_json();
        for track in ["gpu default", "gpu unshard", "gpu offload", "host main"] {
            assert_eq!(
                json.matches(&format!("\"args\":{{\"name\":\"{track}\"}}"))
                    .count(),
                1,
                "{track}"
            );
        }
        assert!(json.contains("\"cat\":\"nccl\""));
        // From the host span's start (50 µs) to the last GPU end (gelu: 100 + 600 µs).
        assert!((t.span_us() - 650.0).abs() < 1e-3, "{}", t.span_us());
        // Kernel shares: sgemm 300 µs, gelu 100 µs of 400 µs; copies and NCCL apart.
        let k = gpu_time_shares(&t, "kernel");
        assert_eq!(k.len(), 2);
        assert_eq!(k[0].0, "sgemm");
        assert!((k[0].1 - 300.0).abs() < 1e-3 && (k[0].2 - 0.75).abs() < 1e-6);
        assert!((k[1].2 - 0.25).abs() < 1e-6);
        assert_eq!(gpu_time_shares(&t, "nccl").len(), 1);
        // Host spans never count as GPU time.
        assert!(gpu_time_shares(&t, "host").is_empty());
    }
}
