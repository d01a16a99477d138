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
    collectives_via_issue, fail_on_stream, launch_collective, locate_part, Call, Issue,
    ProcessGroup,
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

/// One rank's handle to an NCCL communicator (see the module docs).
pub struct NcclGroup {
    rank: usize,
    size: usize,
    ordinal: usize,
    comm: usize,
    name: String,
    timeout: Duration,
    tx: Sender<Request>,
    seq: AtomicU64,
    /// Joins the communicator thread when the last group of this rank is dropped. Declared
    /// after `tx`, so this handle's sender is closed before the owner's drop runs.
    _owner: Arc<CommOwner>,
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
        let (done_tx, done_rx) = bounded::<()>(1);
        let thread = std::thread::Builder::new()
            .name(format!("nccl-comm-rank{rank}"))
            .spawn(move || {
                comm_thread_main(ordinal, rank, world_size, id, timeout, ready_tx, rx);
                // Every communicator, the stream and the context are gone by now.
                drop(done_tx);
            })
            .map_err(|e| {
                CollectiveError::CudaUnavailable(format!(
                    "cannot spawn the communicator thread: {e}"
                ))
            })?;
        match ready_rx.recv_timeout(timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // The thread has returned after sending its error.
                let _ = thread.join();
                return Err(e);
            }
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
        let owner = Arc::new(CommOwner::new(tx.clone(), done_rx, thread, rank, timeout));
        Ok(NcclGroup {
            rank,
            size: world_size,
            ordinal,
            comm: 0,
            name: format!("nccl/{}", config.name),
            timeout,
            tx,
            seq: AtomicU64::new(0),
            _owner: owner,
        })
    }

    /// Creation from the launch environment: reads rank, world size and local rank from any
    /// common launcher (torchrun's `RANK`/`WORLD_SIZE`/`LOCAL_RANK`, `mpirun`, MPICH/PMI, Slurm;
    /// see [`RendezvousEnv`]) plus `MASTER_ADDR`/`MASTER_PORT`, uses device
    /// [`RendezvousEnv::device_ordinal`], rendezvouses through a [`TcpStore`] and creates the
    /// world communicator. Returns the store too (keep it alive on rank 0).
    pub fn from_env(timeout: Duration) -> Result<(NcclGroup, TcpStore)> {
        let env = RendezvousEnv::from_env()?;
        let ordinal = env.device_ordinal();
        let store = TcpStore::rendezvous(&env, timeout)?;
        let config = NcclConfig {
            timeout,
            ..NcclConfig::new(ordinal)
        };
        let group = NcclGroup::new(&store, env.rank, env.world_size, config)?;
        Ok((group, store))
    }
}

impl Issue for NcclGroup {
    fn issue_rank(&self) -> usize {
        self.rank
    }

    /// NCCL places buffers itself: device buffers on a CUDA stream, host buffers otherwise.
    const HOST_ONLY: bool = false;

    fn launch(&self, call: Call<'_>, stream: &Stream) -> Work {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut desc = call.desc;
        let on_device = |s: Option<&DeviceSlice>| s.map(|s| s.data().device_ptr().is_some());
        let (on_in, on_out) = (on_device(call.input), on_device(call.output));
        if let Some(cuda) = stream.cuda_stream() {
            let placed = stream.device() == DeviceId::Cuda(self.ordinal)
                && on_in != Some(false)
                && on_out == Some(true);
            if !placed && desc.bad_buffer.is_none() {
                desc.bad_buffer = Some(BufferProblem::Placement);
            }
            return self.issue_device(seq, Call { desc, ..call }, stream, cuda);
        }
        if (on_in == Some(true) || on_out == Some(true)) && desc.bad_buffer.is_none() {
            desc.bad_buffer = Some(BufferProblem::Placement);
        }
        let (input, output) = call.buffers();
        let (tx, abandon_tx, comm) = (self.tx.clone(), self.tx.clone(), self.comm);
        let (timeout, rank) = (self.timeout, self.rank);
        let run = move || {
            let (reply, answer) = bounded(1);
            let sent = tx.send(Request::Op {
                comm,
                seq,
                desc,
                input,
                output,
                abandoned: false,
                reply,
            });
            match sent {
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
            }
        };
        // Dropped unrun (the stream had failed): still join the descriptor exchange, flagged,
        // so the peers fail at once instead of waiting inside NCCL.
        let abandon = move || {
            let (reply, _answer) = bounded(1);
            let _ = abandon_tx.send(Request::Op {
                comm,
                seq,
                desc,
                input: None,
                output: None,
                abandoned: true,
                reply,
            });
        };
        launch_collective(&Call { desc, ..call }, seq, stream, run, abandon)
    }
}

impl NcclGroup {
    /// The device path: hand the collective to the communicator thread, which agrees on the
    /// descriptors with the other ranks and enqueues the kernel on `cuda`; then record the
    /// work's event after it. On failure nothing was enqueued; the stream is failed (a host
    /// function that fails it), as with the thread backend.
    fn issue_device(
        &self,
        seq: u64,
        call: Call<'_>,
        stream: &Stream,
        cuda: &Arc<CudaStream>,
    ) -> Work {
        let (rank, desc, input) = (self.rank, call.desc, call.input);
        let op = desc.kind;
        let outcome: Outcome = Arc::new(Mutex::new(None));
        let Some(output) = call.output else {
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
        // `--profile`: CUDA events on `cuda` around the NCCL kernel the communicator thread
        // enqueues while this thread waits for its answer.
        let mark = fsdp_alloc::trace::gpu_begin(stream.device(), cuda);
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
            Ok(()) => {
                fsdp_alloc::trace::gpu_end(mark, stream.name(), "nccl", Arc::from(op.name()));
                Work::new(op, rank, seq, stream.record_event(), outcome)
            }
        }
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
            _owner: Arc::clone(&self._owner),
        }))
    }
}
