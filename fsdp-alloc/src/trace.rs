//! A timeline recorder: what ran where, and when, written as a Chrome trace.
//!
//! [`start`] turns recording on for the whole process; [`stop`] turns it off and returns the
//! [`Trace`] recorded in between, which [`Trace::write_chrome_json`] writes in the Chrome trace
//! event format (open it in <https://ui.perfetto.dev> or `chrome://tracing`).
//!
//! Three kinds of intervals are recorded, all as complete (`"ph": "X"`) events with
//! `pid` = the rank (the device index) and one `tid` per stream or thread (named by metadata
//! events, so both viewers show the stream or thread name):
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
//! Time outside any interval on a track is idle time of that stream or thread.
//!
//! When recording is off, the cost on the launch path is one relaxed atomic load ([`is_enabled`])
//! and nothing on the worker. When it is on, each interval takes one short global lock at its end;
//! timestamps come from [`std::time::Instant`] and are relative to the [`start`] call.
//! Streams over CUDA run their work on the driver's thread and are not recorded (use Nsight
//! there); recording is for CPU streams.
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
use std::cell::RefCell;
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
}

/// The name of a recorded interval: static for op names, shared for span names.
pub type Label = Arc<str>;

thread_local! {
    /// The spans open on this thread, innermost last (only maintained while recording).
    static OPEN: RefCell<Vec<Label>> = const { RefCell::new(Vec::new()) };
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
    });
    ENABLED.store(true, Ordering::Release);
}

/// Stops recording and returns what was recorded since [`start`] (empty if it was not started).
/// Stream work still running keeps its interval only if it ends before this call; call
/// `Device::synchronize` first to capture everything launched.
pub fn stop() -> Trace {
    ENABLED.store(false, Ordering::Release);
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let mut events = s.take().map(|r| r.events).unwrap_or_default();
    events.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    Trace { events }
}

/// The pid a device's events use: its index (the rank on thread-rank runs).
fn pid_of(device: DeviceId) -> usize {
    match device {
        DeviceId::Cpu(i) | DeviceId::Cuda(i) => i,
    }
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

/// One recorded interval.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEvent {
    /// What ran: the op or span name.
    pub name: Label,
    /// `"work"` (stream work), `"wait"` (a stream blocked on an event) or `"host"` (a span).
    pub cat: &'static str,
    /// The device index (the rank).
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
