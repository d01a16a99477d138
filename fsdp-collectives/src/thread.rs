//! The embedded backend: W ranks as W threads of one process.
//!
//! ## How a collective runs
//! Issuing a collective (on the rank's own thread) assigns it the next *sequence number* of the
//! rank, posts a descriptor (lengths, dtypes, op, root and the [`BufferRef`]s) into the group's
//! slot for that number, and launches the collective's work on the given stream. When the stream
//! reaches it, the work meets the other ranks' work in three steps:
//!
//! 1. **Arrival.** Wait until every rank's work has arrived (so every rank's buffers are ready on
//!    its own stream). Meanwhile, as soon as all descriptors are posted they are validated — the
//!    same deterministic check on every rank — so a bad call fails on *every* rank at once, even
//!    while the offending rank's stream is still busy. A rank that dropped its handle without
//!    posting, or whose stream failed before reaching the collective, makes the others fail at
//!    once; a rank that is merely absent makes them fail after [`GroupConfig::timeout`].
//! 2. **Data movement.** Ranks read and write each other's buffers directly through `fsdp-alloc`
//!    guards (no staging copies, no channels of data), and the W stream threads work in
//!    parallel on disjoint ranges: in reduce-scatter rank r *pulls* chunk r of every input and
//!    reduces it into its own output; in all-gather rank r *pushes* its input into chunk r of
//!    every output, block by block, so each input is read from memory once for all W copies;
//!    all-reduce is a reduce-scatter in place followed (after a middle rendezvous) by an
//!    all-gather in place; in broadcast every other rank pulls the root's buffer; in
//!    all-to-all rank r pulls chunk r of every input into its output.
//!    Reductions fold ranks in order 0, 1, …, W−1, so results are bitwise reproducible and equal
//!    on every rank.
//! 3. **Departure.** Wait until every rank is done reading, so no rank's later stream work can
//!    overwrite an input a peer is still reading; then report: if any rank failed during data
//!    movement, every rank returns an error.
//!
//! Waiting uses one mutex and condition variable per group with timed waits (never spinning).
//! The optional [`LinkModel`] delays each rank's completion with a sleep, emulating a network
//! without burning CPU.
//!
//! ## Checked streams
//! A rendezvous orders streams without events, which `fsdp-alloc`'s checked (race-detecting)
//! mode cannot see by itself. Each rank's work therefore leaves an [`OrderPoint`] at every
//! rendezvous (on arrival: what its work was ordered after; at the middle and departure: its
//! work so far) and joins all ranks' points when the rendezvous completes. So a peer's writes
//! into this rank's output are ordered before this rank's later work, and a consumer stream that
//! waits on the collective's event is ordered after them — while a consumer that does *not* wait
//! is still reported. Collectives may be issued on checked streams.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fsdp_alloc::{AllocError, BufferRef, OrderPoint, Stream};

use crate::desc::{validate, OpDesc};
use crate::error::{CollectiveError, Result};
use crate::group::{
    collectives_via_issue, launch_collective, locate_part, Call, Issue, ProcessGroup,
};
use crate::kernels;
use crate::types::{OpKind, Work};

static NEXT_GROUP: AtomicU64 = AtomicU64::new(1);

/// Emulated link: each collective completes no earlier than `latency + bytes / bytes_per_sec`
/// after all ranks arrived, where `bytes` is what one rank receives in a ring algorithm
/// (all-gather and reduce-scatter: (W−1)/W of the large buffer; all-reduce: twice that;
/// broadcast: the whole buffer; all-to-all: (W−1)/W of the output). Each rank has **one** link per group: collectives running at
/// the same time on different streams (an all-gather on the unshard stream, a reduce-scatter on
/// the reduce stream) queue for it, each transfer starting when the previous one finished — as
/// on one NIC. With a link, a group's collectives also run **in issue order** on each rank, as
/// on one NCCL communicator (whose kernels run on one internal stream): a collective issued on
/// one stream starts after the rank's previously issued one finished, whatever stream that was
/// on. Together these make the order FSDP issues collectives in (backward prefetch) matter.
/// The delay is a sleep: it costs no CPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Fixed cost per collective.
    pub latency: Duration,
    /// Bandwidth per rank.
    pub bytes_per_sec: f64,
}

impl LinkModel {
    /// Modelled time to receive `bytes`.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        let secs = if self.bytes_per_sec > 0.0 && self.bytes_per_sec.is_finite() {
            bytes as f64 / self.bytes_per_sec
        } else {
            0.0
        };
        self.latency + Duration::from_secs_f64(secs.min(1e9))
    }
}

/// Configuration of a [`ThreadGroup`].
#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    /// How long a rank waits for the others at a rendezvous before failing with
    /// [`CollectiveError::Timeout`] (default 120 s). Dropped handles are detected at once.
    pub timeout: Duration,
    /// Optional link emulation (off by default).
    pub link: Option<LinkModel>,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            timeout: Duration::from_secs(120),
            link: None,
        }
    }
}

impl GroupConfig {
    /// This configuration with `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This configuration with link emulation.
    pub fn with_link(mut self, link: LinkModel) -> Self {
        self.link = Some(link);
        self
    }
}

/// What one rank posted for one collective.
pub(crate) struct Posted {
    pub(crate) desc: OpDesc,
    pub(crate) input: Option<BufferRef>,
    pub(crate) output: Option<BufferRef>,
    /// What another backend built on this rendezvous exchanges besides the buffers (the
    /// shared-GPU backend: each rank's stream events); `None` for the thread backend.
    pub(crate) extra: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

/// The phase of [`Shared::reach`] in the middle of a collective (all-reduce).
pub(crate) const MID: usize = 0;
const DEPART: usize = 1;

struct Slot {
    posted: Vec<Option<Arc<Posted>>>,
    arrived: Vec<bool>,
    n_arrived: usize,
    /// Per phase (MID, DEPART): who reached it.
    reached: [Vec<bool>; 2],
    n_reached: [usize; 2],
    /// Checked mode: per rank, what its work was ordered after on arrival, and at each later
    /// phase; joined by every rank once the rendezvous is complete (empty when unchecked).
    arrival_points: Vec<OrderPoint>,
    phase_points: [Vec<OrderPoint>; 2],
    n_left: usize,
    abandoned: Option<(usize, String)>,
    failure: Option<CollectiveError>,
    errors: Vec<Option<String>>,
}

impl Slot {
    fn new(world: usize) -> Slot {
        Slot {
            posted: vec![None; world],
            arrived: vec![false; world],
            n_arrived: 0,
            reached: [vec![false; world], vec![false; world]],
            n_reached: [0, 0],
            arrival_points: vec![OrderPoint::default(); world],
            phase_points: [
                vec![OrderPoint::default(); world],
                vec![OrderPoint::default(); world],
            ],
            n_left: 0,
            abandoned: None,
            failure: None,
            errors: vec![None; world],
        }
    }
}

struct SplitEntry {
    parts: Vec<Vec<usize>>,
    groups: Vec<Arc<Shared>>,
    taken: usize,
}

struct State {
    alive: Vec<bool>,
    next_seq: Vec<u64>,
    slots: HashMap<u64, Slot>,
    next_split: Vec<u64>,
    splits: HashMap<u64, SplitEntry>,
}

/// The rendezvous of one group: shared by its ranks' handles (and reused by the shared-GPU
/// backend, which runs the same arrival, middle and departure on its issuing threads).
pub(crate) struct Shared {
    name: String,
    world: usize,
    config: GroupConfig,
    state: Mutex<State>,
    cv: Condvar,
    /// Per rank: when its emulated link is free again.
    link_free_at: Mutex<Vec<Instant>>,
    /// Per rank (link emulation only): the sequence number allowed to run next.
    turn: Mutex<Vec<u64>>,
    turn_cv: Condvar,
}

fn vanished(op: OpKind, group: &str, seq: u64, rank: usize) -> CollectiveError {
    CollectiveError::PeerFailed {
        op,
        group: group.to_string(),
        seq,
        rank,
        peer: rank,
        message: "the collective's rendezvous state is gone (internal error)".into(),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic with a non-string payload".into())
}

impl Shared {
    fn new(name: String, world: usize, config: GroupConfig) -> Arc<Shared> {
        Arc::new(Shared {
            name,
            world,
            config,
            state: Mutex::new(State {
                alive: vec![true; world],
                next_seq: vec![0; world],
                slots: HashMap::new(),
                next_split: vec![0; world],
                splits: HashMap::new(),
            }),
            cv: Condvar::new(),
            link_free_at: Mutex::new(vec![Instant::now(); world]),
            turn: Mutex::new(vec![0; world]),
            turn_cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The error of a rendezvous that `rank` gave up on after `waited`; `missing` did not come.
    fn timed_out(
        &self,
        op: OpKind,
        seq: u64,
        rank: usize,
        waited: Duration,
        missing: Vec<usize>,
    ) -> CollectiveError {
        CollectiveError::Timeout {
            op,
            group: self.name.clone(),
            seq,
            rank,
            waited,
            missing,
        }
    }

    pub(crate) fn post(&self, rank: usize, posted: Posted) -> u64 {
        let mut st = self.lock();
        let seq = st.next_seq[rank];
        st.next_seq[rank] += 1;
        let world = self.world;
        st.slots
            .entry(seq)
            .or_insert_with(|| Slot::new(world))
            .posted[rank] = Some(Arc::new(posted));
        drop(st);
        self.cv.notify_all();
        seq
    }

    fn leave(&self, st: &mut State, seq: u64) {
        if let Some(slot) = st.slots.get_mut(&seq) {
            slot.n_left += 1;
            if slot.n_left >= self.world {
                st.slots.remove(&seq);
            }
        }
        self.cv.notify_all();
    }

    /// The collective's work was dropped without running (its stream had failed): the peers
    /// fail at once with [`CollectiveError::PeerFailed`].
    pub(crate) fn abandon(&self, rank: usize, seq: u64, why: String) {
        let mut st = self.lock();
        if let Some(slot) = st.slots.get_mut(&seq) {
            slot.abandoned.get_or_insert((rank, why));
        }
        self.leave(&mut st, seq);
    }

    /// Step 1: wait for every rank's work to arrive; validate all descriptors.
    pub(crate) fn arrive(&self, rank: usize, seq: u64) -> Result<Vec<Arc<Posted>>> {
        let world = self.world;
        let started = Instant::now();
        let deadline = started + self.config.timeout;
        let mut st = self.lock();
        let own = {
            let Some(slot) = st.slots.get_mut(&seq) else {
                return Err(vanished(OpKind::Barrier, &self.name, seq, rank));
            };
            slot.arrived[rank] = true;
            slot.n_arrived += 1;
            // Only what this work was ordered after: its own accesses come after the arrival.
            slot.arrival_points[rank] = OrderPoint::before_current_job();
            match &slot.posted[rank] {
                Some(p) => p.desc,
                None => return Err(vanished(OpKind::Barrier, &self.name, seq, rank)),
            }
        };
        self.cv.notify_all();
        let op = own.kind;
        // An error caused by a peer; a rank whose own arguments are bad reports those instead.
        let prefer_local = |e: CollectiveError| match own.local_check(rank, world) {
            Err(local) => local,
            Ok(()) => e,
        };
        loop {
            let State { alive, slots, .. } = &mut *st;
            let Some(slot) = slots.get_mut(&seq) else {
                return Err(vanished(op, &self.name, seq, rank));
            };
            let verdict = if let Some(f) = &slot.failure {
                Some(Err(f.clone()))
            } else if let Some((peer, msg)) = &slot.abandoned {
                Some(Err(prefer_local(CollectiveError::PeerFailed {
                    op,
                    group: self.name.clone(),
                    seq,
                    rank,
                    peer: *peer,
                    message: msg.clone(),
                })))
            } else if slot.posted.iter().all(Option::is_some) {
                let descs: Vec<OpDesc> = slot.posted.iter().flatten().map(|p| p.desc).collect();
                match validate(&self.name, seq, &descs) {
                    Err(e) => Some(Err(e)),
                    Ok(()) if slot.n_arrived == world => Some(Ok((
                        slot.posted.iter().flatten().cloned().collect::<Vec<_>>(),
                        slot.arrival_points.clone(),
                    ))),
                    Ok(()) => None,
                }
            } else {
                (0..world)
                    .find(|&p| slot.posted[p].is_none() && !alive[p])
                    .map(|peer| {
                        Err(prefer_local(CollectiveError::PeerGone {
                            op,
                            group: self.name.clone(),
                            seq,
                            rank,
                            peer,
                        }))
                    })
            };
            match verdict {
                Some(Ok((posted, points))) => {
                    drop(st);
                    // Every rank's buffers are ready: this rank's reads and writes of its peers'
                    // memory are ordered after whatever the peers' work was ordered after.
                    OrderPoint::join(&points);
                    return Ok(posted);
                }
                Some(Err(e)) => {
                    self.leave(&mut st, seq);
                    return Err(e);
                }
                None => {}
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..world).filter(|&p| !slot.arrived[p]).collect();
                let e = self.timed_out(op, seq, rank, now - started, missing);
                slot.failure = Some(e.clone());
                self.leave(&mut st, seq);
                return Err(prefer_local(e));
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// A rendezvous after arrival (middle of all-reduce, or departure). Records this rank's
    /// failure so far; returns the failure of the collective if the phase itself failed.
    pub(crate) fn reach(
        &self,
        rank: usize,
        seq: u64,
        op: OpKind,
        phase: usize,
        local: &Result<()>,
    ) -> Result<()> {
        let world = self.world;
        let started = Instant::now();
        let deadline = started + self.config.timeout;
        let mut st = self.lock();
        {
            let Some(slot) = st.slots.get_mut(&seq) else {
                return Err(vanished(op, &self.name, seq, rank));
            };
            slot.reached[phase][rank] = true;
            slot.n_reached[phase] += 1;
            slot.phase_points[phase][rank] = OrderPoint::current();
            if let Err(e) = local {
                slot.errors[rank].get_or_insert_with(|| e.to_string());
            }
        }
        self.cv.notify_all();
        loop {
            let Some(slot) = st.slots.get_mut(&seq) else {
                return Err(vanished(op, &self.name, seq, rank));
            };
            if slot.n_reached[phase] == world {
                let points = slot.phase_points[phase].clone();
                drop(st);
                // Every rank is done with the previous step: what they wrote is ordered before
                // what this rank does next (and, at departure, before its stream's later work).
                OrderPoint::join(&points);
                return Ok(());
            }
            if let Some(f) = &slot.failure {
                return Err(f.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..world).filter(|&p| !slot.reached[phase][p]).collect();
                let e = self.timed_out(op, seq, rank, now - started, missing);
                slot.failure = Some(e.clone());
                self.cv.notify_all();
                return Err(e);
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Step 3: wait until every rank is done with every buffer; the collective's final result.
    pub(crate) fn depart(
        &self,
        rank: usize,
        seq: u64,
        op: OpKind,
        local: Result<()>,
    ) -> Result<()> {
        let phase = self.reach(rank, seq, op, DEPART, &local);
        let mut st = self.lock();
        let peer_error = st.slots.get(&seq).and_then(|slot| {
            slot.errors
                .iter()
                .enumerate()
                .find_map(|(p, e)| e.clone().map(|m| (p, m)))
        });
        self.leave(&mut st, seq);
        drop(st);
        local?;
        phase?;
        match peer_error {
            Some((peer, message)) => Err(CollectiveError::PeerFailed {
                op,
                group: self.name.clone(),
                seq,
                rank,
                peer,
                message,
            }),
            None => Ok(()),
        }
    }

    /// Step 2 for `rank`.
    fn move_data(&self, rank: usize, seq: u64, posted: &[Arc<Posted>]) -> Result<()> {
        let world = self.world;
        let me = &posted[rank];
        let d = me.desc;
        let op = d.kind;
        let sz = d.in_dtype.size();
        let buf_err = |source: AllocError| CollectiveError::Buffer { op, rank, source };
        let guarded = |f: &dyn Fn() -> std::result::Result<(), AllocError>| -> Result<()> {
            match catch_unwind(AssertUnwindSafe(f)) {
                Ok(r) => r.map_err(buf_err),
                Err(p) => Err(CollectiveError::InvalidBuffer {
                    op,
                    rank,
                    detail: format!("the copy kernel panicked: {}", panic_text(p.as_ref())),
                }),
            }
        };
        let missing = || AllocError::BadAccess("descriptor without its buffer".into());
        match op {
            OpKind::Barrier => Ok(()),
            OpKind::AllGather => guarded(&|| {
                // Push: this rank writes its input into chunk `rank` of every rank's output,
                // block by block, so the input is read from memory once for all W copies (and
                // the W ranks push in parallel). In place, its own chunk is already there.
                let n = d.in_len * sz;
                let src = me.input.as_ref().ok_or_else(missing)?;
                let dsts = posted
                    .iter()
                    .map(|p| p.output.as_ref().ok_or_else(missing)?.slice(rank * n, n))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                kernels::copy_to_all(src, &dsts)
            }),
            OpKind::ReduceScatter => guarded(&|| {
                let n = d.out_len * sz;
                let srcs = posted
                    .iter()
                    .map(|p| p.input.as_ref().ok_or_else(missing)?.slice(rank * n, n))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                let out = me.output.as_ref().ok_or_else(missing)?;
                let (red, accum) = d.reduction();
                kernels::reduce(d.in_dtype, accum, &srcs[..], out, red, world)
            }),
            OpKind::AllReduce => {
                let len = d.in_len;
                let bounds = |i: usize| (i * len / world) * sz..((i + 1) * len / world) * sz;
                let chunk = |p: &Posted, i: usize| {
                    let r = bounds(i);
                    p.output
                        .as_ref()
                        .ok_or_else(missing)?
                        .slice(r.start, r.len())
                };
                // Phase A: reduce chunk `rank` of every rank's buffer into our own, in place.
                let a = guarded(&|| {
                    let srcs = posted
                        .iter()
                        .map(|p| chunk(p, rank))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    let (red, accum) = d.reduction();
                    kernels::reduce(d.in_dtype, accum, &srcs[..], &srcs[rank], red, world)
                });
                self.reach(rank, seq, op, MID, &a)?;
                a?;
                // Phase B: push our reduced chunk into every other rank's buffer (as in
                // all-gather); the others' pushes fill the rest of ours.
                guarded(&|| {
                    let dsts = posted
                        .iter()
                        .map(|p| chunk(p, rank))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    kernels::copy_to_all(&chunk(me, rank)?, &dsts)
                })
            }
            OpKind::AllToAll => guarded(&|| {
                // Pull: chunk `rank` of every rank's input lands in chunk p of our output.
                let n = d.in_len / world * sz;
                let out = me.output.as_ref().ok_or_else(missing)?;
                for (p, peer) in posted.iter().enumerate() {
                    let src = peer
                        .input
                        .as_ref()
                        .ok_or_else(missing)?
                        .slice(rank * n, n)?;
                    kernels::copy(&src, &out.slice(p * n, n)?)?;
                }
                Ok(())
            }),
            OpKind::Broadcast => guarded(&|| {
                let root = d.root.unwrap_or(0);
                if rank == root {
                    return Ok(());
                }
                let src = posted[root].output.as_ref().ok_or_else(missing)?;
                let dst = me.output.as_ref().ok_or_else(missing)?;
                kernels::copy(src, dst)
            }),
        }
    }

    /// Bytes one rank receives in a ring implementation (for the link model).
    fn wire_bytes(&self, d: &OpDesc) -> usize {
        let w = self.world;
        let sz = d.in_dtype.size();
        match d.kind {
            OpKind::AllGather => (w - 1) * d.in_len * sz,
            OpKind::ReduceScatter => (w - 1) * d.out_len * sz,
            OpKind::AllReduce => 2 * (w - 1) * d.in_len * sz / w,
            OpKind::Broadcast => d.in_len * sz,
            OpKind::Barrier => 0,
            OpKind::AllToAll => (w - 1) * (d.in_len / w) * sz,
        }
    }

    fn link_delay(&self, rank: usize, since: Instant, d: &OpDesc) {
        if let Some(link) = &self.config.link {
            if self.world > 1 {
                // The transfer starts once this rank's link is free, and occupies it.
                let until = {
                    let mut free = self.link_free_at.lock().unwrap_or_else(|e| e.into_inner());
                    let start = since.max(free[rank]);
                    let until = start + link.transfer_time(self.wire_bytes(d));
                    free[rank] = until;
                    until
                };
                let now = Instant::now();
                if until > now {
                    std::thread::sleep(until - now);
                }
            }
        }
    }

    /// With link emulation: waits until every collective this rank issued before `seq` has
    /// finished (issue order, as on one NCCL communicator). Bounded by the group's timeout.
    fn wait_turn(&self, rank: usize, seq: u64, op: OpKind) -> Result<()> {
        if self.config.link.is_none() {
            return Ok(());
        }
        let started = Instant::now();
        let deadline = started + self.config.timeout;
        let mut turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        while turn[rank] < seq {
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(op, seq, rank, now - started, Vec::new()));
            }
            turn = self
                .turn_cv
                .wait_timeout(turn, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Lets the collective after `seq` run (link emulation); called however `seq` ended.
    fn end_turn(&self, rank: usize, seq: u64) {
        if self.config.link.is_none() {
            return;
        }
        let mut turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        turn[rank] = turn[rank].max(seq + 1);
        self.turn_cv.notify_all();
    }

    /// The whole collective for `rank`, run by its stream work.
    fn run(&self, rank: usize, seq: u64) -> Result<()> {
        let r = self.run_in_turn(rank, seq);
        self.end_turn(rank, seq);
        r
    }

    fn run_in_turn(&self, rank: usize, seq: u64) -> Result<()> {
        let op = {
            let st = self.lock();
            st.slots
                .get(&seq)
                .and_then(|s| s.posted.get(rank).cloned().flatten())
                .map(|p| p.desc.kind)
                .unwrap_or(OpKind::Barrier)
        };
        self.wait_turn(rank, seq, op)?;
        let posted = self.arrive(rank, seq)?;
        let t0 = Instant::now();
        let d = posted[rank].desc;
        let local = self.move_data(rank, seq, &posted);
        self.link_delay(rank, t0, &d);
        self.depart(rank, seq, d.kind, local)
    }
}

/// One rank's handle to an in-process group of threads (the embedded default backend).
///
/// `ThreadGroup::new(W)` returns W handles; hand one to each rank thread. Dropping a handle
/// tells the other ranks that this rank is gone: collectives it has not issued fail on the
/// others at once with [`CollectiveError::PeerGone`] (collectives it already issued still run).
/// A rank thread that panics drops its handle while unwinding, so the same applies.
pub struct ThreadGroup {
    shared: Arc<Shared>,
    rank: usize,
}

impl std::fmt::Debug for ThreadGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadGroup")
            .field("name", &self.shared.name)
            .field("rank", &self.rank)
            .field("size", &self.shared.world)
            .finish()
    }
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.alive[self.rank] = false;
        drop(st);
        self.shared.cv.notify_all();
    }
}

impl ThreadGroup {
    /// A group of `world_size` ranks with the default configuration: one handle per rank, in
    /// rank order.
    pub fn new(world_size: usize) -> Vec<ThreadGroup> {
        ThreadGroup::with_config(world_size, GroupConfig::default())
    }

    /// A group of `world_size` ranks with `config`.
    pub fn with_config(world_size: usize, config: GroupConfig) -> Vec<ThreadGroup> {
        ThreadGroup::named("threads", world_size, config)
    }

    /// A group named `<prefix>#<n>` (the shared-GPU backend's rendezvous is one of these).
    pub(crate) fn named(prefix: &str, world_size: usize, config: GroupConfig) -> Vec<ThreadGroup> {
        let name = format!("{prefix}#{}", NEXT_GROUP.fetch_add(1, Ordering::Relaxed));
        let shared = Shared::new(name, world_size, config);
        (0..world_size)
            .map(|rank| ThreadGroup {
                shared: Arc::clone(&shared),
                rank,
            })
            .collect()
    }

    /// The group's configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.shared.config
    }

    /// The group's rendezvous (for backends that run their own collectives over it).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Like [`ProcessGroup::split`], giving the subgroups `config` (e.g. a slower
    /// [`LinkModel`] for inter-node replicate groups). It does not block: the first rank to
    /// call creates all subgroups and the others pick theirs up. Ranks must call their splits in
    /// the same order with the same partition (and config: the first caller's is used).
    pub fn split_with_config(
        &self,
        parts: &[Vec<usize>],
        config: GroupConfig,
    ) -> Result<ThreadGroup> {
        let world = self.shared.world;
        let (part, local) = locate_part(parts, world, self.rank, &self.shared.name)?;
        let invalid = |detail: String| CollectiveError::InvalidGroup {
            group: self.shared.name.clone(),
            rank: self.rank,
            detail,
        };
        let mut st = self.shared.lock();
        let k = st.next_split[self.rank];
        st.next_split[self.rank] += 1;
        let name = &self.shared.name;
        let entry = st.splits.entry(k).or_insert_with(|| SplitEntry {
            parts: parts.to_vec(),
            groups: parts
                .iter()
                .enumerate()
                .map(|(i, p)| Shared::new(format!("{name}/split{k}.{i}"), p.len(), config.clone()))
                .collect(),
            taken: 0,
        });
        if entry.parts != parts {
            return Err(invalid(format!(
                "split #{k} of this rank asks for the partition {parts:?}, but another rank \
                 asked for {:?}; every rank must split with the same partition",
                entry.parts
            )));
        }
        entry.taken += 1;
        let shared = Arc::clone(&entry.groups[part]);
        if entry.taken == world {
            st.splits.remove(&k);
        }
        Ok(ThreadGroup {
            shared,
            rank: local,
        })
    }
}

impl Issue for ThreadGroup {
    fn issue_rank(&self) -> usize {
        self.rank
    }

    fn launch(&self, call: Call<'_>, stream: &Stream) -> Work {
        let (input, output) = call.buffers();
        let (desc, rank) = (call.desc, self.rank);
        let seq = self.shared.post(
            rank,
            Posted {
                desc,
                input,
                output,
                extra: None,
            },
        );
        let (shared, peers) = (Arc::clone(&self.shared), Arc::clone(&self.shared));
        let stream_name = stream.name().to_string();
        let run = move || shared.run(rank, seq);
        // Dropped unrun (its stream had failed): tell the peers.
        let abandon = move || {
            peers.end_turn(rank, seq);
            let why = format!(
                "its stream `{stream_name}` had failed before reaching the collective, so it \
                 never ran"
            );
            peers.abandon(rank, seq, why);
        };
        launch_collective(&call, seq, stream, run, abandon)
    }
}

impl ProcessGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.world
    }

    fn name(&self) -> String {
        self.shared.name.clone()
    }

    collectives_via_issue!();

    fn barrier(&self) -> Result<()> {
        let desc = OpDesc::barrier();
        let seq = self.shared.post(
            self.rank,
            Posted {
                desc,
                input: None,
                output: None,
                extra: None,
            },
        );
        let r = self
            .shared
            .wait_turn(self.rank, seq, OpKind::Barrier)
            .and_then(|()| self.shared.arrive(self.rank, seq));
        if let Err(e) = r {
            self.shared.end_turn(self.rank, seq);
            return Err(e);
        }
        let t0 = Instant::now();
        let mut st = self.shared.lock();
        self.shared.leave(&mut st, seq);
        drop(st);
        self.shared.link_delay(self.rank, t0, &desc);
        self.shared.end_turn(self.rank, seq);
        Ok(())
    }

    fn split(&self, parts: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        Ok(Arc::new(
            self.split_with_config(parts, self.shared.config.clone())?,
        ))
    }
}
