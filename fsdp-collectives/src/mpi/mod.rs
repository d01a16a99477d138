//! The MPI backend (`mpi` feature): one rank per OS process, launched by `mpirun`/`srun`.
//!
//! ## How a collective runs
//! [`MpiGroup`] implements [`ProcessGroup`] like the thread backend: a collective is *launched*
//! on the caller's stream and returns a [`Work`] at once; the stream's worker thread runs it
//! when the stream reaches it. Collectives of one group run one at a time in issue order (a turn
//! lock per group), so every rank hands MPI the same sequence whatever order its streams reach
//! them in. MPI is initialized with `MPI_THREAD_MULTIPLE` because stream threads call it.
//!
//! Every collective starts with a **header exchange**: the ranks all-gather a small descriptor
//! (op, dtypes, lengths, reduce op, accumulation dtype, root, buffer problems) and run the same
//! validation as the thread backend, so mismatched sizes or dtypes give every rank the same
//! typed [`CollectiveError`] — never an MPI abort or a hang.
//!
//! ## Data paths
//! - **Shared memory** (every rank of the group on one node, the default when that holds): the
//!   group allocates an MPI-3 shared-memory window (`MPI_Win_allocate_shared` over the
//!   `MPI_COMM_TYPE_SHARED` split) with a ring of [`MpiConfig::slots`] staging slots per rank.
//!   In each step a rank copies its contribution into its own slot, the ranks meet at a barrier
//!   made of per-rank counters in the window (no MPI call: a few spins and `yield`s, then a
//!   futex sleep on a bell word in the window that the publishing rank rings — four processes
//!   on two cores do not steal each other's compute by spinning or polling), and each rank copies or reduces straight from the peers' slots into its
//!   output. Large buffers stream through the ring in [`MpiConfig::slot_bytes`] pieces; with
//!   more than two slots a rank may run ahead of slower readers by `slots − 2` steps, and small
//!   slots keep the staged bytes in the shared cache while the peers read them. A rank's own
//!   piece never goes through the window (it copies or reduces it from its own buffer), and
//!   large outputs (≥ 8 MiB) are written with streaming stores that bypass the caches.
//! - **Hierarchical** (a group that spans nodes, each node holding the same number `L ≥ 2` of
//!   consecutive ranks, as `mpirun --map-by slot` places them): all-gathers (and the all-gather
//!   half of all-reduce) first exchange pieces over MPI between the peers of the same local rank
//!   on every node (`MPI_Iallgather` on a sub-communicator of `nodes` ranks), then inside each node
//!   through that node's shared-memory window (`nodes` pieces per rank per step). Each byte
//!   crosses the network once per remote node instead of once per remote rank: per rank,
//!   `(nodes − 1)` pieces cross the link instead of `(nodes − 1) · L`. Reduce-scatter, all-to-all
//!   and broadcast on such a group take the flat MPI path (see *Determinism* for why reduce-scatter
//!   has no hierarchical form here). [`MpiConfig::hierarchical`] off (`FSDP_MPI_HIER=0`), or a
//!   layout that does not fit, gives the flat path for everything.
//! - **Flat MPI** (a group that spans nodes without the hierarchical path, or `shared_memory`
//!   off): byte-wise `MPI_Iallgather` (all-gather), `MPI_Ialltoall` (reduce-scatter, all-to-all,
//!   the first half of all-reduce) and `MPI_Ibcast` move the pieces, each polled with a deadline;
//!   the header exchange is a polled `MPI_Iallgather` too.
//!
//! ## Determinism
//! Reductions never use MPI's reduction operators: the pieces are exchanged, then every rank
//! folds them **in rank order** with the thread backend's kernel, so results equal
//! [`crate::ThreadGroup`]'s bit for bit on every path and layout. **All-reduce** is a
//! reduce-scatter followed by an all-gather: rank `d` folds part `d` (`⌈n / W⌉` elements) of
//! every rank's buffer in rank order, then the folded parts are gathered — each element folded
//! once, in the same order as the thread backend folds it — so a rank sends `2 (W − 1) / W` of
//! the buffer ([`MpiGroup::bytes_sent`]), not `W − 1` buffers.
//! **Why reduce-scatter stays flat across nodes:** the rank-ordered fold `((v0 + v1) + v2) + v3`
//! cannot be split into per-node partial sums `(v0 + v1) + (v2 + v3)` without changing the bits
//! (float addition does not associate). The exact alternative, a chain that carries each node's
//! partial fold (in the accumulation dtype) to the next node, moves `B` bytes per node over the
//! link in its busy direction where the flat path moves `B · L / nodes` (`B`: one rank's input):
//! the same at 2 nodes × 2 ranks (the emulated cluster), a gain only for `L > nodes`; not built.
//! A node-aware fold order (partial sums per node, then across nodes) would need the thread
//! backend, the reference, to fold that way too.
//! A non-deterministic mode with MPI's native reductions is not provided.
//!
//! ## Performance (measured, and what is not reached)
//! `cargo xtask bench mpi` (64 MiB, W = 4 processes on the 2-core development machine, per-rank
//! output bytes per second) could only be run while other jobs loaded the machine (load average
//! 10–20): there MPI all-gather ran at 0.93 GB/s vs 0.71 for the thread backend in the same run
//! (the previous two-slot protocol: 0.60–0.78), reduce-scatter at 0.64–0.83 vs 0.89–0.95 for the
//! thread backend (previous: 0.63–0.65). The issue's targets (2.35 / 1.5 GB/s) were not reached
//! under that load; a plain streaming-store copy of the same bytes reached ~4 GB/s per rank at
//! load 3 in a C probe, so the ceiling is there. Reduce-scatter stages `(W−1)/W` of its input
//! through the window, which the thread backend (reading peers' buffers in place) does not.
//!
//! ## Timeouts and failures
//! - **Every wait has a deadline.** A rank that does not reach a collective, or stops answering
//!   in the middle of one, gives every other rank a typed [`CollectiveError::Timeout`] (or
//!   [`CollectiveError::PeerFailed`], when a node peer that timed out first published it) within
//!   [`MpiConfig::timeout`] of the wait's start: every MPI data transfer is a non-blocking call
//!   polled with `MPI_Test` against a deadline (the header exchange, every flat-path step, the
//!   cross-node step of the hierarchical path), and every shared-memory barrier has the same
//!   bound. The group is then broken and fails every later collective at once; the timed-out
//!   request cannot be cancelled (MPI has no cancel for collectives), so its buffers are leaked.
//!   `cargo xtask mpi-test --nodes 2` checks this by stopping one rank (`SIGSTOP`) in the middle
//!   of a 64 MiB cross-node all-gather.
//! - **Group creation** (`MPI_Comm_dup` of the world, `MPI_Comm_split`,
//!   `MPI_Comm_split_type`, `MPI_Win_allocate_shared`) uses blocking MPI calls, but each is
//!   preceded by an arrival handshake on its parent communicator: an `MPI_Ibarrier` polled with
//!   `MPI_Test` against [`MpiConfig::timeout`]. A rank that never reaches group creation gives
//!   the others [`CollectiveError::Timeout`] (op `barrier`, group `"<name> (group creation)"`,
//!   no `missing` ranks: a barrier cannot tell which ranks did not arrive) instead of a hang;
//!   after it the parent is broken (the barrier request cannot be cancelled): a failed split
//!   breaks the parent group, and a world group that failed this way must not be created again
//!   in the process (end the job). **Remaining window:** a peer that passes the handshake and
//!   then stops or dies before entering the blocking call still blocks the others inside it (a
//!   killed peer ends the job through `mpirun`, see below; a stopped one hangs them).
//!   `MPI_Init` itself (inside the first [`MpiGroup::world`]) is not bounded by the handshake.
//!   Freeing a group's window (`MPI_Win_free`, on drop) is collective and blocking too.
//!   `cargo xtask mpi-test` checks the handshake: of 3 ranks, one never creates a second world
//!   group and the other two must get the typed timeout within the timeout + 5 s.
//! - A rank that fails locally in the middle of a shared-memory collective (e.g. a buffer
//!   access error) marks itself failed in the window; its peers get
//!   [`CollectiveError::PeerFailed`]. On the flat MPI path it calls `MPI_Abort`, ending the job
//!   (its peers would otherwise only learn of it through their timeout).
//! - **A process that dies** (crash, `kill -9`): `mpirun` (OpenMPI's runtime) notices the exit
//!   of a process that did not call `MPI_Finalize` and kills every other process of the job,
//!   then exits non-zero; processes blocked in MPI or in a shared-memory barrier are killed, not
//!   left hanging. `cargo xtask mpi-test` checks this (the job ends within seconds). Under other
//!   launchers the behaviour is theirs (Slurm's `srun --kill-on-bad-exit` does the same).
//!
//! ## Life cycle
//! MPI can be initialized once per process: [`MpiGroup::world`] does it on first use and MPI is
//! finalized when the last group handle (and every split) is dropped. Dropping a group frees
//! its window, which is collective: drop groups in the same order on every rank (as SPMD code
//! does).

mod exec;
mod raw;
mod shm;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fsdp_alloc::{BufferRef, Stream};

use crate::desc::{validate, OpDesc, WORDS};
use crate::error::{CollectiveError, Result};
use crate::group::{
    collectives_via_issue, launch_collective, locate_part, Call, Issue, ProcessGroup,
};
use crate::kernels;
use crate::types::{OpKind, Work};

use exec::{Exec, Pattern};
use raw::{Comm, Gate, SharedWindow, Xfer};
use shm::Shm;

/// Configuration of an [`MpiGroup`] (inherited by its splits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiConfig {
    /// Bound on every wait for the other ranks: the header exchange, every MPI data transfer
    /// (non-blocking, polled) and every shared-memory barrier.
    pub timeout: Duration,
    /// Bytes of one staging slot of the shared-memory path (also the piece size of the MPI
    /// path). Larger slots mean fewer steps per collective; slots that fit the shared cache
    /// (about 1 MiB here) make the staging copy cheap.
    pub slot_bytes: usize,
    /// Staging slots per rank in the shared-memory ring (at least 2): the window holds
    /// `slots × slot_bytes` per rank and group.
    pub slots: usize,
    /// Use the shared-memory path when every rank of a group is on one node. Off: MPI
    /// collectives always (the environment variable `FSDP_MPI_SHM=0` turns it off by default).
    pub shared_memory: bool,
    /// For a group that spans nodes (with `shared_memory` on): use the hierarchical path
    /// (shared memory inside each node, MPI between peers of the same local rank) for
    /// all-gathers when every node holds the same number of consecutive ranks. Off: the flat
    /// MPI path (the environment variable `FSDP_MPI_HIER=0` turns it off by default).
    pub hierarchical: bool,
}

/// A positive integer from environment variable `var`, else `default` (unset or unreadable).
fn env_count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(default)
}

impl Default for MpiConfig {
    /// 120 s timeout, 8 slots of 1 MiB, shared memory and the hierarchical path on. The
    /// environment variables `FSDP_MPI_TIMEOUT_S`, `FSDP_MPI_SLOT_BYTES`, `FSDP_MPI_SLOTS`,
    /// `FSDP_MPI_SHM=0` and `FSDP_MPI_HIER=0` change the defaults (for tuning a machine, or
    /// comparing paths, without rebuilding).
    fn default() -> Self {
        MpiConfig {
            timeout: Duration::from_secs(env_count("FSDP_MPI_TIMEOUT_S", 120) as u64),
            slot_bytes: env_count("FSDP_MPI_SLOT_BYTES", 1 << 20),
            slots: env_count("FSDP_MPI_SLOTS", 8),
            shared_memory: std::env::var("FSDP_MPI_SHM").map_or(true, |v| v.trim() != "0"),
            hierarchical: std::env::var("FSDP_MPI_HIER").map_or(true, |v| v.trim() != "0"),
        }
    }
}

/// True if this process looks launched by an MPI launcher (OpenMPI's `mpirun`, MPICH/PMI's
/// `mpiexec` or Slurm's PMI): whether [`MpiGroup::world`] would see more than itself.
pub fn mpi_launched() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// The hierarchical path of a group spanning nodes: `nodes` nodes of `local_size` consecutive
/// ranks each (rank = node × local_size + local rank).
struct Hier {
    /// The shared-memory window over this node's ranks (local ranks).
    local: Shm,
    /// The peers of this rank's local rank on every node (rank `n` of it is on node `n`).
    cross: Comm,
    local_rank: usize,
    local_size: usize,
    nodes: usize,
}
struct Inner {
    comm: Arc<Comm>,
    /// The shared-memory window when every rank of the group is on one node.
    shm: Option<Shm>,
    /// The hierarchical path when the group spans nodes (see [`MpiConfig::hierarchical`]).
    hier: Option<Hier>,
    /// Bytes this rank has sent to other ranks in data phases (see [`MpiGroup::bytes_sent`]).
    bytes_sent: AtomicU64,
    name: String,
    config: MpiConfig,
    next_seq: AtomicU64,
    exec: Mutex<Exec>,
    cv: Condvar,
}

/// One rank's handle to a group of MPI processes (feature `mpi`). See the [module docs](self).
#[derive(Clone)]
pub struct MpiGroup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("name", &self.inner.name)
            .field("rank", &self.inner.comm.rank())
            .field("size", &self.inner.comm.size())
            .field("shared_memory", &self.inner.shm.is_some())
            .finish()
    }
}

impl MpiGroup {
    /// Every process of the job (`MPI_COMM_WORLD`, duplicated), with the default configuration.
    /// Initializes MPI on first use. Collective: every process calls it.
    pub fn world() -> Result<MpiGroup> {
        MpiGroup::world_with_config(MpiConfig::default())
    }

    /// [`MpiGroup::world`] with `config`.
    pub fn world_with_config(config: MpiConfig) -> Result<MpiGroup> {
        let rt = raw::runtime()?;
        let name = String::from("mpi");
        let gate = Gate {
            timeout: config.timeout,
            group: &name,
            seq: 0,
        };
        let comm = Arc::new(Comm::world_dup(&rt, &gate)?);
        MpiGroup::over(comm, name, config)
    }

    fn over(comm: Arc<Comm>, name: String, config: MpiConfig) -> Result<MpiGroup> {
        if config.slot_bytes < 4096 || config.slots < 2 {
            return Err(CollectiveError::Mpi {
                call: "MpiGroup",
                rank: comm.rank(),
                message: format!(
                    "slot_bytes {} / slots {}: use at least 4096 bytes and 2 slots",
                    config.slot_bytes, config.slots
                ),
            });
        }
        // Every communicator-creating call below first waits (bounded) for every rank of its
        // parent to arrive; a new group has issued no collective yet, so its errors say #0.
        let gate = Gate {
            timeout: config.timeout,
            group: &name,
            seq: 0,
        };
        // Collective on every rank regardless of the setting, so the calls match.
        let local = Arc::new(comm.split_shared(&gate)?);
        let shm = if config.shared_memory && local.size() == comm.size() {
            let seg = shm::segment_bytes(config.slot_bytes, config.slots);
            let win = SharedWindow::allocate(Arc::clone(&local), seg, &gate)?;
            Some(Shm::new(
                win,
                comm.rank(),
                comm.size(),
                config.slot_bytes,
                config.slots,
                config.timeout,
            ))
        } else {
            None
        };
        let hier = if shm.is_none() {
            Hier::build(&comm, &local, &config, &gate)?
        } else {
            None
        };
        Ok(MpiGroup {
            inner: Arc::new(Inner {
                comm,
                shm,
                hier,
                bytes_sent: AtomicU64::new(0),
                name,
                config,
                next_seq: AtomicU64::new(0),
                exec: Mutex::new(Exec {
                    turn: 0,
                    step: 0,
                    broken: None,
                    scratch: Vec::new(),
                }),
                cv: Condvar::new(),
            }),
        })
    }

    /// True if this group moves data through a shared-memory window (all ranks on one node).
    pub fn uses_shared_memory(&self) -> bool {
        self.inner.shm.is_some()
    }

    /// True if this group spans nodes and all-gathers take the hierarchical path (shared memory
    /// inside each node, MPI between nodes); see [`MpiConfig::hierarchical`].
    pub fn uses_hierarchical(&self) -> bool {
        self.inner.hier.is_some()
    }

    /// `(nodes, ranks per node)` of the hierarchical path, if this group takes it.
    pub fn node_layout(&self) -> Option<(usize, usize)> {
        self.inner.hier.as_ref().map(|h| (h.nodes, h.local_size))
    }

    /// Bytes this rank has sent to other ranks in the data phases of its collectives so far
    /// (header exchanges not counted): a piece staged in a shared-memory slot counts once per
    /// peer that reads it, an MPI exchange once per peer it goes to. All-reduce moves
    /// `2 (W − 1) / W` of its buffer (a reduce-scatter, then an all-gather).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent.load(Ordering::Relaxed)
    }

    /// The group's configuration.
    pub fn config(&self) -> &MpiConfig {
        &self.inner.config
    }

    /// Ends the whole MPI job with `code` (`MPI_Abort`): every process exits.
    pub fn abort(&self, code: i32) -> ! {
        self.inner.comm.abort(code)
    }
}

impl Hier {
    /// The hierarchical path for a group `comm` whose ranks are not all on one node (`local`:
    /// this node's ranks), or `None` where it does not apply: every rank wants it (config), the
    /// nodes hold the same number (≥ 2) of consecutive ranks. Collective over `comm`; every
    /// rank takes the same decision (from the same gathered words).
    fn build(
        comm: &Arc<Comm>,
        local: &Arc<Comm>,
        config: &MpiConfig,
        gate: &Gate<'_>,
    ) -> Result<Option<Hier>> {
        let (rank, w) = (comm.rank(), comm.size());
        if local.size() == w {
            return Ok(None);
        }
        let want = config.shared_memory && config.hierarchical;
        let mine: Vec<u8> = [u64::from(want), local.rank() as u64, local.size() as u64]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut all = Vec::new();
        if !comm.exchange(Xfer::Gather, mine, &mut all, config.timeout)? {
            return Err(CollectiveError::Mpi {
                call: "MpiGroup (node layout exchange)",
                rank,
                message: format!(
                    "the other ranks did not create the group within {:?}",
                    config.timeout
                ),
            });
        }
        let words: Vec<u64> = all
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let l = local.size();
        let usable = l >= 2
            && w % l == 0
            && words
                .chunks_exact(3)
                .enumerate()
                .all(|(r, x)| x[0] == 1 && x[1] as usize == r % l && x[2] as usize == l);
        if !usable {
            return Ok(None);
        }
        let cross = comm.split(local.rank(), rank, gate)?;
        if cross.rank() != rank / l || cross.size() != w / l {
            return Err(CollectiveError::Mpi {
                call: "MpiGroup (node layout)",
                rank,
                message: format!(
                    "rank {rank} is rank {} of {} among its local-rank peers, expected {} of {}",
                    cross.rank(),
                    cross.size(),
                    rank / l,
                    w / l
                ),
            });
        }
        let seg = shm::segment_bytes(config.slot_bytes, config.slots);
        let win = SharedWindow::allocate(Arc::clone(local), seg, gate)?;
        Ok(Some(Hier {
            local: Shm::new(
                win,
                local.rank(),
                l,
                config.slot_bytes,
                config.slots,
                config.timeout,
            ),
            cross,
            local_rank: local.rank(),
            local_size: l,
            nodes: w / l,
        }))
    }
}

/// The one-byte-per-word header: the descriptor words plus an "abandoned" flag.
const HEADER_WORDS: usize = WORDS + 1;

fn encode(desc: &OpDesc, abandoned: bool) -> Vec<u8> {
    let mut words = desc.to_words().to_vec();
    words.push(i64::from(abandoned));
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn decode(bytes: &[u8]) -> Option<(OpDesc, bool)> {
    let words: Vec<i64> = bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    if words.len() != HEADER_WORDS {
        return None;
    }
    Some((OpDesc::from_words(&words[..WORDS])?, words[WORDS] != 0))
}

impl Inner {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn lock(&self) -> MutexGuard<'_, Exec> {
        self.exec.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn timeout_error(&self, op: OpKind, seq: u64, missing: Vec<usize>) -> CollectiveError {
        CollectiveError::Timeout {
            op,
            group: self.name.clone(),
            seq,
            rank: self.rank(),
            waited: self.config.timeout,
            missing,
        }
    }

    /// Runs collective `seq` when its turn comes: header exchange, validation, then `body`.
    /// Always advances the turn, so later collectives are not held up by a failed one.
    fn run_turn<T>(
        &self,
        seq: u64,
        desc: OpDesc,
        abandoned: bool,
        body: impl FnOnce(&Inner, &mut Exec) -> Result<T>,
    ) -> Result<T> {
        let op = desc.kind;
        let deadline = Instant::now() + self.config.timeout;
        let mut ex = self.lock();
        while ex.turn != seq {
            let now = Instant::now();
            if now >= deadline {
                // An earlier collective of this rank never ran (its stream is stuck): the
                // sequence can no longer be kept.
                let e = self.timeout_error(op, seq, vec![self.rank()]);
                ex.broken.get_or_insert_with(|| e.clone());
                return Err(e);
            }
            ex = self
                .cv
                .wait_timeout(ex, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let r = match ex.broken.clone() {
            Some(e) => Err(e),
            None => self
                .agree(&mut ex, seq, &desc, abandoned)
                .and_then(|()| body(self, &mut ex)),
        };
        ex.turn += 1;
        drop(ex);
        self.cv.notify_all();
        r
    }

    /// The header exchange and validation (the same on every rank).
    fn agree(&self, ex: &mut Exec, seq: u64, desc: &OpDesc, abandoned: bool) -> Result<()> {
        let op = desc.kind;
        let mine = encode(desc, abandoned);
        let len = mine.len();
        let headers: Vec<Vec<u8>> = match &self.shm {
            Some(shm) => {
                let views = shm.step(ex, Pattern::Gather, len, |slot| {
                    slot.copy_from_slice(&mine);
                    Ok(())
                });
                let views = views.map_err(|e| self.on_step_error(ex, op, seq, e))?;
                views.iter().map(|v| v.to_vec()).collect()
            }
            None => {
                let mut recv = std::mem::take(&mut ex.scratch);
                if !self
                    .comm
                    .exchange(Xfer::Gather, mine, &mut recv, self.config.timeout)?
                {
                    let e = self.timeout_error(op, seq, Vec::new());
                    ex.broken = Some(e.clone());
                    return Err(e);
                }
                let out = recv.chunks_exact(len).map(<[u8]>::to_vec).collect();
                ex.scratch = recv;
                out
            }
        };
        let mut descs = Vec::with_capacity(headers.len());
        for (r, h) in headers.iter().enumerate() {
            let (d, gone) = decode(h).ok_or_else(|| CollectiveError::Mpi {
                call: "header exchange",
                rank: self.rank(),
                message: format!("rank {r} sent a header this build cannot read"),
            })?;
            if gone && r != self.rank() {
                return Err(CollectiveError::PeerFailed {
                    op,
                    group: self.name.clone(),
                    seq,
                    rank: self.rank(),
                    peer: r,
                    message: "its stream had failed before reaching the collective, so it never \
                              ran"
                    .into(),
                });
            }
            descs.push(d);
        }
        if abandoned {
            return Err(CollectiveError::StreamFailed {
                op,
                rank: self.rank(),
                message: "the stream failed before the collective".into(),
            });
        }
        validate(&self.name, seq, &descs)
    }

    /// A step error on the shared-memory path breaks the group (the ranks' step counters may
    /// no longer agree).
    fn on_step_error(
        &self,
        ex: &mut Exec,
        op: OpKind,
        seq: u64,
        e: shm::StepError,
    ) -> CollectiveError {
        // On the hierarchical path the window is the node's: its ranks are local ranks.
        let group_rank = |p: usize| match &self.hier {
            Some(h) => (self.rank() / h.local_size) * h.local_size + p,
            None => p,
        };
        let err = match e {
            shm::StepError::Timeout(missing) => {
                self.timeout_error(op, seq, missing.into_iter().map(group_rank).collect())
            }
            shm::StepError::PeerFailed(peer) => CollectiveError::PeerFailed {
                op,
                group: self.name.clone(),
                seq,
                rank: self.rank(),
                peer: group_rank(peer),
                message: "it failed inside this collective".into(),
            },
            shm::StepError::Local(e) => e,
        };
        ex.broken.get_or_insert_with(|| err.clone());
        err
    }

    /// One step of a collective's data phase: `fill` writes this rank's contribution, `consume`
    /// reads every rank's piece (in rank order). On the shared-memory path a local failure is
    /// published to the peers; on the MPI path it aborts the job (peers are inside MPI).
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        ex: &mut Exec,
        op: OpKind,
        seq: u64,
        pattern: Pattern,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
        consume: impl FnOnce(&[&[u8]]) -> Result<()>,
    ) -> Result<()> {
        match &self.shm {
            Some(shm) => {
                self.count_sent(pattern, len, self.size());
                let views = shm
                    .step(ex, pattern, len, fill)
                    .map_err(|e| self.on_step_error(ex, op, seq, e))?;
                consume(&views).inspect_err(|e| {
                    shm.fail(ex);
                    ex.broken.get_or_insert_with(|| e.clone());
                })
            }
            None => {
                let (w, r) = (self.size(), self.rank());
                let send_len = match pattern {
                    Pattern::ToAll => w * len,
                    _ => len,
                };
                let mut send = vec![0u8; send_len];
                let contributes = !matches!(pattern, Pattern::FromRoot(root) if root != r);
                if contributes {
                    if let Err(e) = fill(&mut send) {
                        eprintln!(
                            "fsdp-collectives: rank {r} failed inside {op} #{seq} of {} on the \
                             MPI path; aborting the job: {e}",
                            self.name
                        );
                        self.comm.abort(3);
                    }
                }
                let mut recv = std::mem::take(&mut ex.scratch);
                let xfer = match pattern {
                    Pattern::Gather => Xfer::Gather,
                    Pattern::ToAll => Xfer::ToAll,
                    Pattern::FromRoot(root) => {
                        recv.clear();
                        recv.extend_from_slice(&send);
                        Xfer::FromRoot(root)
                    }
                };
                self.count_sent(pattern, len, w);
                let moved = self
                    .comm
                    .exchange(xfer, send, &mut recv, self.config.timeout)
                    .and_then(|done| {
                        if done {
                            Ok(())
                        } else {
                            Err(self.timeout_error(op, seq, Vec::new()))
                        }
                    });
                let result = moved.and_then(|()| {
                    let views: Vec<&[u8]> = match pattern {
                        Pattern::FromRoot(_) => vec![&recv[..]; w],
                        _ => recv.chunks_exact(len.max(1)).take(w).collect(),
                    };
                    if len == 0 {
                        return consume(&vec![&[][..]; w]);
                    }
                    consume(&views)
                });
                ex.scratch = recv;
                if let Err(e) = &result {
                    ex.broken.get_or_insert_with(|| e.clone());
                }
                result
            }
        }
    }

    /// Counts the bytes one step of `pattern` with `len`-byte pieces sends to the other ranks
    /// of a `size`-rank exchange.
    fn count_sent(&self, pattern: Pattern, len: usize, size: usize) {
        let peers = size.saturating_sub(1);
        let bytes = match pattern {
            Pattern::Gather | Pattern::ToAll => len * peers,
            Pattern::FromRoot(root) if root == self.rank() => len * peers,
            Pattern::FromRoot(_) => 0,
        };
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// An all-gather on the hierarchical path, in `chunks` steps: in step `k` this rank's piece
    /// `mine(k)` (the same length on every rank within a step) goes to every rank, and
    /// `put(k, p, piece)` receives rank `p`'s piece for every rank `p` but this one. In each
    /// step the peers of this local rank on every node exchange their pieces over MPI
    /// (`MPI_Iallgather` on the cross-node communicator, polled against the group's timeout),
    /// then the node's ranks exchange what they received through the node's shared-memory
    /// window. Pipelined: step `k + 1`'s cross-node exchange is started before step `k`'s node
    /// exchange and is driven (`MPI_Test`) between the pieces that step copies out.
    #[allow(clippy::too_many_arguments)]
    fn hier_gather(
        &self,
        ex: &mut Exec,
        op: OpKind,
        seq: u64,
        h: &Hier,
        chunks: usize,
        mut mine: impl FnMut(usize) -> Result<Vec<u8>>,
        mut put: impl FnMut(usize, usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let (n, l) = (h.nodes, h.local_size);
        let fail = |ex: &mut Exec, e: CollectiveError| {
            // Tell this node's ranks at once (they are, or will be, waiting in a node step).
            h.local.fail(ex);
            ex.broken.get_or_insert_with(|| e.clone());
            e
        };
        let mut start = |k: usize, recv: Vec<u8>| -> Result<raw::Pending> {
            let piece = mine(k)?;
            let len = piece.len();
            self.bytes_sent.fetch_add(
                (len * (n - 1) + n * len * (l - 1)) as u64,
                Ordering::Relaxed,
            );
            h.cross.start(Xfer::Gather, piece, recv)
        };
        if chunks == 0 {
            return Ok(());
        }
        let mut spare = Vec::new();
        let mut next = match start(0, std::mem::take(&mut ex.scratch)) {
            Ok(p) => Some(p),
            Err(e) => return Err(fail(ex, e)),
        };
        for k in 0..chunks {
            let Some(cur) = next.take() else {
                break;
            };
            let (send, recv) = match cur.wait(self.config.timeout) {
                Ok(Some(bufs)) => bufs,
                Ok(None) => {
                    let e = self.timeout_error(op, seq, Vec::new());
                    return Err(fail(ex, e));
                }
                Err(e) => return Err(fail(ex, e)),
            };
            let len = send.len();
            if k + 1 < chunks {
                match start(k + 1, std::mem::take(&mut spare)) {
                    Ok(p) => next = Some(p),
                    Err(e) => return Err(fail(ex, e)),
                }
            }
            // Drive the next cross-node exchange while waiting for the node's ranks (an error
            // there shows again when that exchange is waited for).
            let mut drive = || {
                if let Some(p) = next.as_mut() {
                    let _ = p.test();
                }
            };
            let views = h
                .local
                .step_with(
                    ex,
                    Pattern::Gather,
                    n * len,
                    |dst| {
                        dst.copy_from_slice(&recv[..n * len]);
                        Ok(())
                    },
                    Some(&mut drive),
                )
                .map_err(|e| self.on_step_error(ex, op, seq, e))?;
            let mut result: Result<()> = Ok(());
            'copy: for (p, v) in views.iter().enumerate() {
                // Our own node column straight from `recv` (the same bytes as our slot).
                let v: &[u8] = if p == h.local_rank { &recv } else { v };
                for node in 0..n {
                    let r = node * l + p;
                    if r != self.rank() {
                        if let Err(e) = put(k, r, &v[node * len..(node + 1) * len]) {
                            result = Err(e);
                            break 'copy;
                        }
                    }
                }
                // Drive the next cross-node exchange while this step copies.
                if let Some(p) = next.as_mut() {
                    if let Err(e) = p.test() {
                        result = Err(e);
                        break 'copy;
                    }
                }
            }
            if let Err(e) = result {
                return Err(fail(ex, e));
            }
            spare = recv;
        }
        ex.scratch = spare;
        Ok(())
    }

    /// The data phase of a validated collective.
    fn data_phase(
        &self,
        ex: &mut Exec,
        seq: u64,
        desc: &OpDesc,
        input: Option<&BufferRef>,
        output: Option<&BufferRef>,
    ) -> Result<()> {
        let (w, rank) = (self.size(), self.rank());
        let op = desc.kind;
        let es = desc.in_dtype.size();
        let slot = self.config.slot_bytes;
        let buf_err = |source| CollectiveError::Buffer { op, rank, source };
        let missing = || CollectiveError::InvalidBuffer {
            op,
            rank,
            detail: "no buffer".into(),
        };
        match op {
            OpKind::Barrier => Ok(()),
            OpKind::AllGather => {
                let (input, output) = (input.ok_or_else(missing)?, output.ok_or_else(missing)?);
                let total = input.len();
                let put = put_for(output.len());
                if let Some(h) = &self.hier {
                    // Hierarchical: the node's shared slot carries `nodes` pieces per rank.
                    let chunk = (slot / h.nodes / es).max(1) * es;
                    let span = |k: usize| (k * chunk, chunk.min(total - k * chunk));
                    let input_at = |k: usize| {
                        let (off, len) = span(k);
                        input.slice(off, len).map_err(buf_err)
                    };
                    return self.hier_gather(
                        ex,
                        op,
                        seq,
                        h,
                        total.div_ceil(chunk),
                        |k| {
                            let (off, len) = span(k);
                            let src = input_at(k)?;
                            let mine = src.read::<u8>().map_err(buf_err)?.to_vec();
                            let own = output.slice(rank * total + off, len).map_err(buf_err)?;
                            if own.location() != src.location() {
                                put(&mut own.write::<u8>().map_err(buf_err)?, &mine);
                            }
                            Ok(mine)
                        },
                        |k, p, v| {
                            let (off, len) = span(k);
                            let out = output.slice(p * total + off, len).map_err(buf_err)?;
                            put(&mut out.write::<u8>().map_err(buf_err)?, v);
                            Ok(())
                        },
                    );
                }
                let chunk = (slot / es).max(1) * es;
                let mut off = 0;
                while off < total {
                    let len = chunk.min(total - off);
                    let src = || input.slice(off, len).map_err(buf_err);
                    self.step(
                        ex,
                        op,
                        seq,
                        Pattern::Gather,
                        len,
                        |dst| {
                            dst.copy_from_slice(&src()?.read::<u8>().map_err(buf_err)?);
                            Ok(())
                        },
                        |views| {
                            let src = src()?;
                            for (p, v) in views.iter().enumerate() {
                                let out = output.slice(p * total + off, len).map_err(buf_err)?;
                                if p != rank {
                                    put(&mut out.write::<u8>().map_err(buf_err)?, v);
                                } else if out.location() != src.location() {
                                    // Our own piece straight from the input (not in place).
                                    let s = src.read::<u8>().map_err(buf_err)?;
                                    put(&mut out.write::<u8>().map_err(buf_err)?, &s);
                                }
                            }
                            Ok(())
                        },
                    )?;
                    off += len;
                }
                Ok(())
            }
            OpKind::ReduceScatter => {
                let (input, output) = (input.ok_or_else(missing)?, output.ok_or_else(missing)?);
                let (rop, accum) = desc.reduction();
                let total = output.len();
                let chunk = (slot / w / es).max(1) * es;
                // Not in place: our own piece is reduced straight from the input and never
                // staged. In place it is the output itself, so it goes through the slot.
                let direct = !output.overlaps(input);
                let mut off = 0;
                while off < total {
                    let len = chunk.min(total - off);
                    self.step(
                        ex,
                        op,
                        seq,
                        Pattern::ToAll,
                        len,
                        |dst| {
                            for d in (0..w).filter(|&d| !(direct && d == rank)) {
                                let src = input.slice(d * total + off, len).map_err(buf_err)?;
                                dst[d * len..(d + 1) * len]
                                    .copy_from_slice(&src.read::<u8>().map_err(buf_err)?);
                            }
                            Ok(())
                        },
                        |views| {
                            let out = output.slice(off, len).map_err(buf_err)?;
                            let own = input.slice(rank * total + off, len).map_err(buf_err)?;
                            let guard;
                            let mut views = views.to_vec();
                            if direct {
                                guard = own.read::<u8>().map_err(buf_err)?;
                                views[rank] = &guard;
                            }
                            kernels::reduce(desc.in_dtype, accum, &views[..], &out, rop, w)
                                .map_err(buf_err)
                        },
                    )?;
                    off += len;
                }
                Ok(())
            }
            OpKind::AllToAll => {
                // The reduce-scatter's exchange without the reduction: piece d of our input goes
                // to rank d; the piece from rank p lands in chunk p of our output.
                let (input, output) = (input.ok_or_else(missing)?, output.ok_or_else(missing)?);
                let total = output.len() / w;
                let chunk = (slot / w / es).max(1) * es;
                let mut off = 0;
                while off < total {
                    let len = chunk.min(total - off);
                    self.step(
                        ex,
                        op,
                        seq,
                        Pattern::ToAll,
                        len,
                        |dst| {
                            for d in 0..w {
                                let src = input.slice(d * total + off, len).map_err(buf_err)?;
                                dst[d * len..(d + 1) * len]
                                    .copy_from_slice(&src.read::<u8>().map_err(buf_err)?);
                            }
                            Ok(())
                        },
                        |views| {
                            for (p, v) in views.iter().enumerate() {
                                let out = output.slice(p * total + off, len).map_err(buf_err)?;
                                out.write::<u8>().map_err(buf_err)?.copy_from_slice(v);
                            }
                            Ok(())
                        },
                    )?;
                    off += len;
                }
                Ok(())
            }
            OpKind::AllReduce => {
                let buf = output.ok_or_else(missing)?;
                self.all_reduce(ex, seq, desc, buf)
            }
            OpKind::Broadcast => {
                let buf = output.ok_or_else(missing)?;
                let total = buf.len();
                let put = put_for(total);
                let chunk = (slot / es).max(1) * es;
                let root = desc.root.unwrap_or(0);
                let mut off = 0;
                while off < total {
                    let len = chunk.min(total - off);
                    let piece = || buf.slice(off, len).map_err(buf_err);
                    let fill = |dst: &mut [u8]| {
                        dst.copy_from_slice(&piece()?.read::<u8>().map_err(buf_err)?);
                        Ok(())
                    };
                    self.step(ex, op, seq, Pattern::FromRoot(root), len, fill, |views| {
                        if rank != root {
                            put(&mut piece()?.write::<u8>().map_err(buf_err)?, views[root]);
                        }
                        Ok(())
                    })?;
                    off += len;
                }
                Ok(())
            }
        }
    }

    /// All-reduce as a reduce-scatter followed by an all-gather, deterministic: the buffer is
    /// cut into `W` parts of `⌈n / W⌉` elements (the last ones shorter or empty); rank `d`
    /// folds part `d` of every rank's buffer in rank order with the thread backend's kernel,
    /// then every rank gathers the folded parts. Each element is folded once, in rank order,
    /// exactly as the thread backend folds it, so the bits agree; each rank sends
    /// `2 (W − 1) / W` of the buffer instead of `W − 1` buffers. Pieces are padded with zeros to
    /// a common length inside a step (the padding is never folded into a result or written).
    fn all_reduce(&self, ex: &mut Exec, seq: u64, desc: &OpDesc, buf: &BufferRef) -> Result<()> {
        let (w, rank) = (self.size(), self.rank());
        let op = desc.kind;
        let es = desc.in_dtype.size();
        let slot = self.config.slot_bytes;
        let buf_err = |source| CollectiveError::Buffer { op, rank, source };
        let (rop, accum) = desc.reduction();
        let n = buf.len() / es;
        let q = n.div_ceil(w);
        // Element range of part `d`.
        let part = |d: usize| (d * q).min(n)..((d + 1) * q).min(n);
        // Bytes of part `d` at element offset `o` in a step of `c` elements.
        let valid = |d: usize, o: usize, c: usize| part(d).len().saturating_sub(o).min(c) * es;
        let bytes_at =
            |d: usize, o: usize, v: usize| buf.slice((part(d).start + o) * es, v).map_err(buf_err);
        // Reduce-scatter: every rank's part d, in pieces, to rank d.
        let chunk = (slot / w / es).max(1);
        let mut o = 0;
        while o < q {
            let c = chunk.min(q - o);
            let len = c * es;
            self.step(
                ex,
                op,
                seq,
                Pattern::ToAll,
                len,
                |dst| {
                    for d in 0..w {
                        let v = valid(d, o, c);
                        let piece = &mut dst[d * len..(d + 1) * len];
                        if v > 0 {
                            piece[..v].copy_from_slice(
                                &bytes_at(d, o, v)?.read::<u8>().map_err(buf_err)?,
                            );
                        }
                        piece[v..].fill(0);
                    }
                    Ok(())
                },
                |views| {
                    let v = valid(rank, o, c);
                    if v == 0 {
                        return Ok(());
                    }
                    let views: Vec<&[u8]> = views.iter().map(|x| &x[..v]).collect();
                    kernels::reduce(
                        desc.in_dtype,
                        accum,
                        &views[..],
                        &bytes_at(rank, o, v)?,
                        rop,
                        w,
                    )
                    .map_err(buf_err)
                },
            )?;
            o += c;
        }
        // All-gather of the folded parts.
        let put = put_for(buf.len());
        let write = |p: usize, o: usize, c: usize, piece: &[u8]| {
            let v = valid(p, o, c);
            if v > 0 {
                put(
                    &mut bytes_at(p, o, v)?.write::<u8>().map_err(buf_err)?,
                    &piece[..v],
                );
            }
            Ok(())
        };
        let mine = |o: usize, c: usize| -> Result<Vec<u8>> {
            let mut piece = vec![0u8; c * es];
            let v = valid(rank, o, c);
            if v > 0 {
                piece[..v].copy_from_slice(&bytes_at(rank, o, v)?.read::<u8>().map_err(buf_err)?);
            }
            Ok(piece)
        };
        let per_step = match &self.hier {
            Some(h) => slot / h.nodes,
            None => slot,
        };
        let chunk = (per_step / es).max(1);
        if let Some(h) = &self.hier {
            let at = |k: usize| (k * chunk, chunk.min(q - k * chunk));
            return self.hier_gather(
                ex,
                op,
                seq,
                h,
                q.div_ceil(chunk),
                |k| {
                    let (o, c) = at(k);
                    mine(o, c)
                },
                |k, p, v| {
                    let (o, c) = at(k);
                    write(p, o, c, v)
                },
            );
        }
        let mut o = 0;
        while o < q {
            let c = chunk.min(q - o);
            self.step(
                ex,
                op,
                seq,
                Pattern::Gather,
                c * es,
                |dst| {
                    dst.copy_from_slice(&mine(o, c)?);
                    Ok(())
                },
                |views| {
                    for (p, v) in views.iter().enumerate() {
                        if p != rank {
                            write(p, o, c, v)?;
                        }
                    }
                    Ok(())
                },
            )?;
            o += c;
        }
        Ok(())
    }
}

/// How the data phase writes a piece into a user buffer whose collective writes `out_bytes` in
/// all: streaming stores for large outputs (see [`kernels::copy_streaming`]), else `memcpy`.
fn put_for(out_bytes: usize) -> fn(&mut [u8], &[u8]) {
    if out_bytes >= kernels::STREAMING_MIN {
        kernels::copy_streaming
    } else {
        <[u8]>::copy_from_slice
    }
}

impl Issue for MpiGroup {
    fn issue_rank(&self) -> usize {
        self.inner.rank()
    }

    fn launch(&self, call: Call<'_>, stream: &Stream) -> Work {
        let desc = call.desc;
        let seq = self.inner.next_seq.fetch_add(1, Ordering::Relaxed);
        let (input, output) = call.buffers();
        let (inner, peers) = (Arc::clone(&self.inner), Arc::clone(&self.inner));
        let run = move || {
            inner.run_turn(seq, desc, false, |inner, ex| {
                inner.data_phase(ex, seq, &desc, input.as_ref(), output.as_ref())
            })
        };
        // Dropped unrun (its stream had failed): still take the turn, flagged, so the peers
        // fail at once instead of waiting for this rank.
        let abandon = move || {
            let _ = peers.run_turn(seq, desc, true, |_, _| Ok(()));
        };
        launch_collective(&call, seq, stream, run, abandon)
    }
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn name(&self) -> String {
        self.inner.name.clone()
    }

    collectives_via_issue!();

    fn barrier(&self) -> Result<()> {
        let seq = self.inner.next_seq.fetch_add(1, Ordering::Relaxed);
        self.inner
            .run_turn(seq, OpDesc::barrier(), false, |_, _| Ok(()))
    }

    fn split(&self, parts: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        let inner = &self.inner;
        let (part, local) = locate_part(parts, inner.size(), inner.rank(), &inner.name)?;
        // Every rank must pass the same partition: agree on a digest of it in the header
        // (as the "input length" of a barrier-like exchange).
        let digest = parts
            .iter()
            .flatten()
            .chain(parts.iter().map(Vec::len).collect::<Vec<_>>().iter())
            .fold(1469598103934665603u64, |h, &x| {
                (h ^ x as u64).wrapping_mul(1099511628211)
            });
        let desc = OpDesc {
            in_len: (digest >> 1) as usize,
            out_len: (digest >> 1) as usize,
            ..OpDesc::barrier()
        };
        let seq = inner.next_seq.fetch_add(1, Ordering::Relaxed);
        let comm = inner
            .run_turn(seq, desc, false, |inner, ex| {
                let gate = Gate {
                    timeout: inner.config.timeout,
                    group: &inner.name,
                    seq,
                };
                let r = inner.comm.split(part, local, &gate);
                if let Err(e @ CollectiveError::Timeout { .. }) = &r {
                    // The timed-out barrier is still pending on the parent: it is broken.
                    ex.broken.get_or_insert_with(|| e.clone());
                }
                r
            })
            .map_err(|e| match e {
                CollectiveError::InconsistentArgs { .. } => CollectiveError::InvalidGroup {
                    group: inner.name.clone(),
                    rank: inner.rank(),
                    detail: "the ranks passed different partitions to split; every rank must \
                             split with the same partition"
                        .into(),
                },
                e => e,
            })?;
        let name = format!("{}/split{seq}.{part}", inner.name);
        Ok(Arc::new(MpiGroup::over(
            Arc::new(comm),
            name,
            inner.config.clone(),
        )?))
    }
}
