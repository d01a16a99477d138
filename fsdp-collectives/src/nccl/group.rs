//! [`NcclGroup`]: the [`ProcessGroup`] handle, talking to its rank's communicator thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam::channel::{bounded, unbounded, Sender};
use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};
use fsdp_alloc::{DeviceId, Stream};

use crate::desc::{BufferProblem, OpDesc};
use crate::error::{CollectiveError, Result};
use crate::group::{
    collectives_via_issue, fail_on_stream, finish_on_stream, locate_part, Issue, ProcessGroup,
};
use crate::store::{RendezvousEnv, TcpStore};
use crate::types::{DeviceSlice, OpKind, Outcome, Work};

use super::comm::*;
use super::nccl_available;
use super::raw::*;

/// Configuration of an [`NcclGroup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclConfig {
    /// CUDA device of this rank.
    pub ordinal: usize,
    /// Bound on every wait (communicator creation, each collective).
    pub timeout: Duration,
    /// Distinguishes several groups rendezvousing through one store.
    pub name: String,
}

impl NcclConfig {
    /// Device `ordinal`, 10-minute timeout, name `world`.
    pub fn new(ordinal: usize) -> NcclConfig {
        NcclConfig {
            ordinal,
            timeout: Duration::from_secs(600),
            name: "world".into(),
        }
    }
}

/// One rank's handle to an NCCL communicator (see the module docs; never run here).
pub struct NcclGroup {
    rank: usize,
    size: usize,
    ordinal: usize,
    comm: usize,
    name: String,
    timeout: Duration,
    tx: Sender<Request>,
    seq: AtomicU64,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl NcclGroup {
    /// Creates this rank's communicator, collectively: rank 0 publishes the NCCL id in `store`,
    /// the others read it. Errors (typed, never a panic) if CUDA or NCCL is missing.
    pub fn new(
        store: &TcpStore,
        rank: usize,
        world_size: usize,
        config: NcclConfig,
    ) -> Result<NcclGroup> {
        nccl_available()?;
        if rank >= world_size {
            return Err(CollectiveError::InvalidGroup {
                group: config.name.clone(),
                rank,
                detail: format!("rank {rank} is not below the world size {world_size}"),
            });
        }
        let key = format!("fsdp-collectives/nccl/{}/id", config.name);
        let id = if rank == 0 {
            let id =
                result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", rank, e.0))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = store.get_timeout(&key, config.timeout)?;
            if bytes.len() != 128 {
                return Err(CollectiveError::StoreProtocol {
                    addr: store.addr().to_string(),
                    detail: format!(
                        "NCCL id under {key:?} has {} bytes, expected 128",
                        bytes.len()
                    ),
                });
            }
            let mut internal = [0 as std::ffi::c_char; 128];
            for (d, &b) in internal.iter_mut().zip(&bytes) {
                *d = b as std::ffi::c_char;
            }
            sys::ncclUniqueId { internal }
        };
        let (tx, rx) = unbounded();
        let (ready_tx, ready_rx) = bounded(1);
        let (ordinal, timeout) = (config.ordinal, config.timeout);
        std::thread::Builder::new()
            .name(format!("nccl-comm-rank{rank}"))
            .spawn(move || comm_thread_main(ordinal, rank, world_size, id, timeout, ready_tx, rx))
            .map_err(|e| {
                CollectiveError::CudaUnavailable(format!(
                    "cannot spawn the communicator thread: {e}"
                ))
            })?;
        match ready_rx.recv_timeout(timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(CollectiveError::Timeout {
                    op: OpKind::Barrier,
                    group: config.name,
                    seq: 0,
                    rank,
                    waited: timeout,
                    missing: Vec::new(),
                })
            }
        }
        Ok(NcclGroup {
            rank,
            size: world_size,
            ordinal,
            comm: 0,
            name: format!("nccl/{}", config.name),
            timeout,
            tx,
            seq: AtomicU64::new(0),
        })
    }

    /// Torchrun-style creation: reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
    /// (and `LOCAL_RANK` for the device, else the rank), rendezvouses through a [`TcpStore`] and
    /// creates the world communicator. Returns the store too (keep it alive on rank 0).
    pub fn from_env(timeout: Duration) -> Result<(NcclGroup, TcpStore)> {
        let env = RendezvousEnv::from_env()?;
        let ordinal = match std::env::var("LOCAL_RANK") {
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .map_err(|e| CollectiveError::InvalidEnv {
                    var: "LOCAL_RANK",
                    value: v.clone(),
                    reason: format!("not a non-negative integer ({e})"),
                })?,
            Err(_) => env.rank,
        };
        let store = TcpStore::rendezvous(&env, timeout)?;
        let config = NcclConfig {
            timeout,
            ..NcclConfig::new(ordinal)
        };
        let group = NcclGroup::new(&store, env.rank, env.world_size, config)?;
        Ok((group, store))
    }

    fn issue_op(
        &self,
        desc: OpDesc,
        input: Option<&DeviceSlice>,
        output: Option<&DeviceSlice>,
        stream: &Stream,
    ) -> Work {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let outcome: Outcome = Arc::new(Mutex::new(None));
        let mut desc = desc;
        let on_device = |s: Option<&DeviceSlice>| s.map(|s| s.data().device_ptr().is_some());
        if let Some(cuda) = stream.cuda_stream() {
            let placed = stream.device() == DeviceId::Cuda(self.ordinal)
                && on_device(input) != Some(false)
                && on_device(output) == Some(true);
            if !placed && desc.bad_buffer.is_none() {
                desc.bad_buffer = Some(BufferProblem::Placement);
            }
            return self.issue_device(seq, desc, input, output, stream, cuda, outcome);
        }
        if (on_device(input) == Some(true) || on_device(output) == Some(true))
            && desc.bad_buffer.is_none()
        {
            desc.bad_buffer = Some(BufferProblem::Placement);
        }
        let ticket = Ticket {
            tx: self.tx.clone(),
            comm: self.comm,
            seq,
            desc,
            armed: true,
        };
        let (input, output) = (
            input.map(|s| s.data().clone()),
            output.map(|s| s.data().clone()),
        );
        let (slot, timeout, rank) = (Arc::clone(&outcome), self.timeout, self.rank);
        stream.launch(move || {
            let mut ticket = ticket;
            ticket.armed = false;
            let (reply, answer) = bounded(1);
            let sent = ticket.tx.send(Request::Op {
                comm: ticket.comm,
                seq,
                desc,
                input,
                output,
                abandoned: false,
                reply,
            });
            let r = match sent {
                Err(_) => Err(CollectiveError::CudaUnavailable(
                    "the communicator thread has exited".into(),
                )),
                Ok(()) => answer
                    .recv_timeout(timeout * 2 + Duration::from_secs(5))
                    .unwrap_or_else(|_| {
                        Err(CollectiveError::Timeout {
                            op: desc.kind,
                            group: "nccl".into(),
                            seq,
                            rank,
                            waited: timeout * 2,
                            missing: Vec::new(),
                        })
                    }),
            };
            finish_on_stream(&slot, r);
        });
        Work::new(desc.kind, self.rank, seq, stream.record_event(), outcome)
    }
}

impl NcclGroup {
    /// The device path: hand the collective to the communicator thread, which agrees on the
    /// descriptors with the other ranks and enqueues the kernel on `cuda`; then record the
    /// work's event after it. On failure nothing was enqueued; the stream is failed (a host
    /// function that fails it), as with the thread backend.
    #[allow(clippy::too_many_arguments)]
    fn issue_device(
        &self,
        seq: u64,
        desc: OpDesc,
        input: Option<&DeviceSlice>,
        output: Option<&DeviceSlice>,
        stream: &Stream,
        cuda: &Arc<CudaStream>,
        outcome: Outcome,
    ) -> Work {
        let rank = self.rank;
        let op = desc.kind;
        let Some(output) = output else {
            return Work::failed(
                op,
                rank,
                CollectiveError::InvalidBuffer {
                    op,
                    rank,
                    detail: "no output buffer".into(),
                },
            );
        };
        let (reply, answer) = bounded(1);
        let sent = self.tx.send(Request::Enqueue {
            comm: self.comm,
            seq,
            desc,
            input: input.map(|s| s.data().clone()),
            output: output.data().clone(),
            stream: Arc::clone(cuda),
            outcome: Arc::clone(&outcome),
            reply,
        });
        let r = match sent {
            Err(_) => Err(CollectiveError::CudaUnavailable(
                "the communicator thread has exited".into(),
            )),
            Ok(()) => answer
                .recv_timeout(self.timeout + Duration::from_secs(5))
                .unwrap_or_else(|_| {
                    Err(CollectiveError::Timeout {
                        op,
                        group: self.name.clone(),
                        seq,
                        rank,
                        waited: self.timeout,
                        missing: Vec::new(),
                    })
                }),
        };
        match r {
            Err(e) => fail_on_stream(op, rank, seq, stream, outcome, e),
            Ok(()) => Work::new(op, rank, seq, stream.record_event(), outcome),
        }
    }
}

/// Dropped unrun (the stream had failed): still joins the descriptor exchange, flagged, so the
/// peers fail at once instead of waiting inside NCCL.
struct Ticket {
    tx: Sender<Request>,
    comm: usize,
    seq: u64,
    desc: OpDesc,
    armed: bool,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.armed {
            let (reply, _answer) = bounded(1);
            let _ = self.tx.send(Request::Op {
                comm: self.comm,
                seq: self.seq,
                desc: self.desc,
                input: None,
                output: None,
                abandoned: true,
                reply,
            });
        }
    }
}

impl Issue for NcclGroup {
    fn issue_rank(&self) -> usize {
        self.rank
    }

    fn issue(
        &self,
        desc: OpDesc,
        input: Option<&DeviceSlice>,
        output: Option<&DeviceSlice>,
        stream: &Stream,
    ) -> Work {
        self.issue_op(desc, input, output, stream)
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    collectives_via_issue!();

    fn barrier(&self) -> Result<()> {
        let (reply, answer) = bounded(1);
        self.tx
            .send(Request::Op {
                comm: self.comm,
                seq: self.seq.fetch_add(1, Ordering::Relaxed),
                desc: OpDesc::barrier(),
                input: None,
                output: None,
                abandoned: false,
                reply,
            })
            .map_err(|_| {
                CollectiveError::CudaUnavailable("the communicator thread has exited".into())
            })?;
        answer
            .recv_timeout(self.timeout * 2 + Duration::from_secs(5))
            .unwrap_or_else(|_| {
                Err(CollectiveError::Timeout {
                    op: OpKind::Barrier,
                    group: self.name.clone(),
                    seq: 0,
                    rank: self.rank,
                    waited: self.timeout * 2,
                    missing: Vec::new(),
                })
            })
    }

    fn split(&self, parts: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        let (part, local) = locate_part(parts, self.size, self.rank, &self.name)?;
        let (reply, answer) = bounded(1);
        self.tx
            .send(Request::Split {
                comm: self.comm,
                seq: self.seq.fetch_add(1, Ordering::Relaxed),
                color: part as i32,
                key: local as i32,
                size: parts[part].len(),
                reply,
            })
            .map_err(|_| {
                CollectiveError::CudaUnavailable("the communicator thread has exited".into())
            })?;
        let comm = answer
            .recv_timeout(self.timeout + Duration::from_secs(5))
            .map_err(|_| {
                CollectiveError::CudaUnavailable("ncclCommSplit did not return in time".into())
            })??;
        Ok(Arc::new(NcclGroup {
            rank: local,
            size: parts[part].len(),
            ordinal: self.ordinal,
            comm,
            name: format!("{}/split{part}", self.name),
            timeout: self.timeout,
            tx: self.tx.clone(),
            seq: AtomicU64::new(0),
        }))
    }
}
