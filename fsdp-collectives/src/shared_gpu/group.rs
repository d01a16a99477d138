//! [`SharedGpuGroup`]: the [`ProcessGroup`] of thread ranks whose devices are one GPU.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fsdp_alloc::{DeviceId, Event, Stream};

use crate::desc::{BufferProblem, OpDesc};
use crate::error::{CollectiveError, Result};
use crate::group::{collectives_via_issue, fail_on_stream, Call, Issue, ProcessGroup};
use crate::thread::{GroupConfig, Posted, ThreadGroup, MID};
use crate::types::{DeviceSlice, OpKind, Outcome, Work};

use super::plan::{plan, Launch, RankBuffers, MAX_SOURCES};

/// The most ranks one [`SharedGpuGroup`] can have (the sources one launch takes).
pub const MAX_SHARED_GPU_RANKS: usize = MAX_SOURCES;

/// Configuration of a [`SharedGpuGroup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedGpuConfig {
    /// The CUDA device every rank computes on.
    pub ordinal: usize,
    /// How long a rank waits for the others to issue the same collective before failing with
    /// [`CollectiveError::Timeout`] (default 120 s). Dropped handles are detected at once.
    pub timeout: Duration,
}

impl SharedGpuConfig {
    /// Device `ordinal`, 120-second timeout.
    pub fn new(ordinal: usize) -> SharedGpuConfig {
        SharedGpuConfig {
            ordinal,
            timeout: GroupConfig::default().timeout,
        }
    }

    /// This configuration with `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> SharedGpuConfig {
        self.timeout = timeout;
        self
    }
}

/// What a rank exchanges through the rendezvous besides its buffers: the CUDA events that order
/// the ranks' streams.
struct RankEvents {
    /// Recorded on the caller's stream at issue: this rank's buffers are ready. `None` when the
    /// call was not on a CUDA stream of the group's GPU (every rank then fails validation).
    ready: Option<Event>,
    /// All-reduce: this rank's reduction of its chunk has run.
    mid: Mutex<Option<Event>>,
    /// This rank's launches have run: it is done reading its peers' buffers.
    done: Mutex<Option<Event>>,
}

impl RankEvents {
    fn get(slot: &Mutex<Option<Event>>) -> Option<Event> {
        slot.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(slot: &Mutex<Option<Event>>, event: Event) {
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(event);
    }
}

/// One rank's handle to a group of thread ranks that share one GPU (see the module docs).
///
/// `SharedGpuGroup::new(W, ordinal)` returns W handles; hand one to each rank thread, which
/// computes on its own `fsdp_alloc::Device::cuda(ordinal)` (its own allocator, statistics and
/// streams). Dropping a handle tells the other ranks that this rank is gone, as with
/// [`ThreadGroup`].
pub struct SharedGpuGroup {
    /// The rendezvous (rank, size, name, timeout, dropped-rank detection).
    host: ThreadGroup,
    ordinal: usize,
    #[cfg(feature = "cuda")]
    kernels: Arc<super::exec::Kernels>,
}

impl std::fmt::Debug for SharedGpuGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedGpuGroup")
            .field("name", &self.host.name())
            .field("rank", &self.host.rank())
            .field("size", &self.host.size())
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl SharedGpuGroup {
    /// A group of `world_size` thread ranks on CUDA device `ordinal`, one handle per rank in
    /// rank order (default configuration).
    ///
    /// # Errors
    /// See [`SharedGpuGroup::with_config`].
    pub fn new(world_size: usize, ordinal: usize) -> Result<Vec<SharedGpuGroup>> {
        SharedGpuGroup::with_config(world_size, SharedGpuConfig::new(ordinal))
    }

    /// A group of `world_size` thread ranks with `config`. Opens the device's primary context
    /// and compiles the kernels with NVRTC (once per process) and loads them (once per context),
    /// so every missing piece is reported here.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidGroup`] for 0 or more than [`MAX_SHARED_GPU_RANKS`] ranks;
    /// [`CollectiveError::CudaUnavailable`] when this build has no `cuda` feature, or there is
    /// no CUDA driver, no such device or no NVRTC library; [`CollectiveError::Cuda`] when
    /// NVRTC or the driver refuses the kernels.
    pub fn with_config(world_size: usize, config: SharedGpuConfig) -> Result<Vec<SharedGpuGroup>> {
        if world_size == 0 || world_size > MAX_SHARED_GPU_RANKS {
            return Err(CollectiveError::InvalidGroup {
                group: "shared-gpu".into(),
                rank: 0,
                detail: format!(
                    "a shared-GPU group has 1 to {MAX_SHARED_GPU_RANKS} ranks, not {world_size}"
                ),
            });
        }
        #[cfg(feature = "cuda")]
        let kernels = open(config.ordinal)?;
        #[cfg(not(feature = "cuda"))]
        built_without_cuda(config.ordinal)?;
        let hosts = ThreadGroup::named(
            "shared-gpu",
            world_size,
            GroupConfig::default().with_timeout(config.timeout),
        );
        Ok(hosts
            .into_iter()
            .map(|host| SharedGpuGroup {
                host,
                ordinal: config.ordinal,
                #[cfg(feature = "cuda")]
                kernels: Arc::clone(&kernels),
            })
            .collect())
    }

    /// The CUDA device the ranks share.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// True if the call's buffers and stream are where this backend works: device memory of
    /// the group's GPU and a CUDA stream of it.
    fn placed(
        &self,
        input: Option<&DeviceSlice>,
        output: Option<&DeviceSlice>,
        stream: &Stream,
    ) -> bool {
        let gpu = DeviceId::Cuda(self.ordinal);
        let on_gpu = |s: &DeviceSlice| s.data().device_ptr().is_some() && s.data().device() == gpu;
        is_cuda(stream)
            && stream.device() == gpu
            && input.is_none_or(on_gpu)
            && output.is_some_and(on_gpu)
    }

    /// Meets the other ranks and enqueues this rank's part of collective `seq` on `stream`.
    fn run(&self, seq: u64, desc: OpDesc, stream: &Stream, mine: &RankEvents) -> Result<()> {
        let (rank, shared) = (self.host.rank(), self.host.shared());
        // Arrival: every rank has issued; the descriptors agree (else every rank fails here).
        let posted = shared.arrive(rank, seq)?;
        let events: Vec<Option<Arc<RankEvents>>> = posted
            .iter()
            .map(|p| {
                p.extra
                    .clone()
                    .and_then(|e| e.downcast::<RankEvents>().ok())
            })
            .collect();
        let local = self.move_data(seq, desc, &posted, &events, stream, mine);
        let r = shared.depart(rank, seq, desc.kind, local);
        // Departure: this rank's later work waits until every rank is done with its buffers
        // (device-side; also after a failure, so no peer still reads what later work writes).
        for (p, ev) in events.iter().enumerate() {
            if let Some(done) = ev
                .as_ref()
                .filter(|_| p != rank)
                .and_then(|e| RankEvents::get(&e.done))
            {
                stream.wait_event(&done);
            }
        }
        r
    }

    /// This rank's launches, ordered after every rank's `ready` event (and, for all-reduce, the
    /// middle rendezvous); records this rank's `done`.
    fn move_data(
        &self,
        seq: u64,
        desc: OpDesc,
        posted: &[Arc<Posted>],
        events: &[Option<Arc<RankEvents>>],
        stream: &Stream,
        mine: &RankEvents,
    ) -> Result<()> {
        let (rank, op) = (self.host.rank(), desc.kind);
        let phases = self.prepare(desc, posted, events);
        let mark = timeline::begin(stream);
        let first = phases.as_ref().map_err(Clone::clone).and_then(|phases| {
            for (p, ev) in events.iter().enumerate() {
                if let Some(ready) = ev
                    .as_ref()
                    .filter(|_| p != rank)
                    .and_then(|e| e.ready.as_ref())
                {
                    stream.wait_event(ready);
                }
            }
            self.enqueue(op, stream, &phases[0])
        });
        if op == OpKind::AllReduce {
            // Every rank reaches the middle, with or without an error, so none waits in vain.
            if first.is_ok() {
                RankEvents::set(&mine.mid, stream.record_event());
            }
            self.host.shared().reach(rank, seq, op, MID, &first)?;
            first?;
            for (p, ev) in events.iter().enumerate() {
                if let Some(mid) = ev
                    .as_ref()
                    .filter(|_| p != rank)
                    .and_then(|e| RankEvents::get(&e.mid))
                {
                    stream.wait_event(&mid);
                }
            }
            let phases = phases?;
            self.enqueue(op, stream, &phases[1])?;
        } else {
            first?;
        }
        timeline::end(mark, stream, op);
        RankEvents::set(&mine.done, stream.record_event());
        Ok(())
    }

    /// The launches of this rank, by phase, from every rank's (validated) descriptor.
    fn prepare(
        &self,
        desc: OpDesc,
        posted: &[Arc<Posted>],
        events: &[Option<Arc<RankEvents>>],
    ) -> Result<Vec<Vec<Launch>>> {
        let (rank, op) = (self.host.rank(), desc.kind);
        let internal = |detail: String| CollectiveError::InvalidBuffer { op, rank, detail };
        if events.iter().any(Option::is_none) {
            return Err(internal(
                "a rank posted no stream events (internal error of the shared-GPU backend)".into(),
            ));
        }
        let address = |b: &Option<fsdp_alloc::BufferRef>| b.as_ref().and_then(|b| b.device_ptr());
        let bufs = posted
            .iter()
            .enumerate()
            .map(|(p, posted)| {
                Ok(RankBuffers {
                    input: address(&posted.input),
                    output: address(&posted.output)
                        .ok_or_else(|| internal(format!("rank {p} posted no device output")))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut phases = plan(rank, &desc, &bufs).map_err(internal)?;
        phases.resize_with(2, Vec::new);
        Ok(phases)
    }

    /// Enqueues `launches` on `stream`.
    #[cfg(feature = "cuda")]
    fn enqueue(&self, op: OpKind, stream: &Stream, launches: &[Launch]) -> Result<()> {
        if launches.is_empty() {
            return Ok(());
        }
        let rank = self.host.rank();
        let driver = |call: &'static str, what: &str, e: cudarc::driver::DriverError| {
            CollectiveError::Cuda {
                call,
                rank,
                message: format!("{op} ({what}): {e}"),
            }
        };
        let cuda = stream
            .cuda_stream()
            .ok_or_else(|| CollectiveError::InvalidBuffer {
                op,
                rank,
                detail: "not a CUDA stream".into(),
            })?;
        cuda.context()
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", "binding the context", e))?;
        for l in launches {
            // SAFETY: the addresses come from every rank's validated descriptor and buffers
            // (device memory of this GPU, of the lengths the even-size rules give, placed
            // checked on every rank), so each launch stays inside them. They stay allocated and
            // unwritten by others until the launch has run: it is enqueued after every owner's
            // `ready` event (all-reduce: after every rank's middle event), and every owner's
            // stream waits for this rank's `done` event before its later work (departure, in
            // `run`), which is also what the owners' allocators order block reuse by; a segment
            // returned to the driver is freed only after a device synchronization. The stream
            // is a stream of the GPU's primary context, into which the kernels were loaded.
            unsafe { self.kernels.launch(cuda, l) }
                .map_err(|e| driver("cuLaunchKernel", l.kernel_name(), e))?;
        }
        Ok(())
    }

    /// Without CUDA nothing can be enqueued (and nothing is ever placed on a GPU).
    #[cfg(not(feature = "cuda"))]
    fn enqueue(&self, op: OpKind, _stream: &Stream, launches: &[Launch]) -> Result<()> {
        if launches.is_empty() {
            return Ok(());
        }
        Err(CollectiveError::Unsupported {
            op,
            rank: self.host.rank(),
            group: self.host.name(),
            detail: "this build has no CUDA support".into(),
        })
    }
}

/// Without the `cuda` feature a group cannot be made: the typed error that says how to rebuild.
#[cfg(not(feature = "cuda"))]
fn built_without_cuda(ordinal: usize) -> Result<()> {
    Err(CollectiveError::CudaUnavailable(format!(
        "cuda:{ordinal}: this build of fsdp-collectives has no CUDA support, so the shared-GPU \
         backend cannot run; rebuild with `--features cuda` (thread ranks on CPU devices use \
         ThreadGroup)"
    )))
}

/// The device context, compiled and loaded kernels of `cuda:ordinal`.
#[cfg(feature = "cuda")]
fn open(ordinal: usize) -> Result<Arc<super::exec::Kernels>> {
    // SAFETY: `is_culib_present` only tries to load the driver library; no precondition.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CollectiveError::CudaUnavailable(format!(
            "cuda:{ordinal}: libcuda (the CUDA driver library) was not found; the shared-GPU \
             backend needs a GPU machine (thread ranks on CPU devices use ThreadGroup)"
        )));
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| {
        CollectiveError::CudaUnavailable(format!(
            "cuda:{ordinal}: could not open the device: {e}; check the ordinal and the driver"
        ))
    })?;
    super::exec::Kernels::for_context(&ctx)
}

#[cfg(feature = "cuda")]
fn is_cuda(stream: &Stream) -> bool {
    stream.cuda_stream().is_some()
}

#[cfg(not(feature = "cuda"))]
fn is_cuda(_stream: &Stream) -> bool {
    false
}

/// `--profile`: one GPU interval per collective and rank on the caller's stream's track, from
/// where the stream reaches the collective (waiting for the peers included, as an NCCL kernel's
/// interval includes its wait) to the end of this rank's launches; category `"shared-gpu"`.
mod timeline {
    use fsdp_alloc::Stream;

    use crate::types::OpKind;

    #[cfg(feature = "cuda")]
    pub(super) type Mark = Option<fsdp_alloc::trace::GpuMark>;
    /// Nothing to time without CUDA.
    #[cfg(not(feature = "cuda"))]
    pub(super) struct Mark;

    #[cfg(feature = "cuda")]
    pub(super) fn begin(stream: &Stream) -> Mark {
        stream
            .cuda_stream()
            .and_then(|cuda| fsdp_alloc::trace::gpu_begin(stream.device(), cuda))
    }

    #[cfg(not(feature = "cuda"))]
    pub(super) fn begin(_stream: &Stream) -> Mark {
        Mark
    }

    #[cfg(feature = "cuda")]
    pub(super) fn end(mark: Mark, stream: &Stream, op: OpKind) {
        fsdp_alloc::trace::gpu_end(mark, stream.name(), "shared-gpu", op.name().into());
    }

    #[cfg(not(feature = "cuda"))]
    pub(super) fn end(_mark: Mark, _stream: &Stream, _op: OpKind) {}
}

impl Issue for SharedGpuGroup {
    fn issue_rank(&self) -> usize {
        self.host.rank()
    }

    /// Device buffers on a CUDA stream of the group's GPU; anything else is a placement error
    /// every rank agrees on.
    const HOST_ONLY: bool = false;

    fn launch(&self, call: Call<'_>, stream: &Stream) -> Work {
        let (rank, op) = (self.host.rank(), call.desc.kind);
        let mut desc = call.desc;
        let placed = self.placed(call.input, call.output, stream);
        if !placed && desc.bad_buffer.is_none() {
            desc.bad_buffer = Some(BufferProblem::Placement);
        }
        let (input, output) = call.buffers();
        let outcome: Outcome = Arc::new(Mutex::new(None));
        if let Err(failed) = stream.check() {
            // As with the thread backend's rank whose stream failed before the collective: this
            // rank does not take part, and its peers fail at once instead of waiting for it.
            let seq = self.host.shared().post(
                rank,
                Posted {
                    desc,
                    input,
                    output,
                    extra: None,
                },
            );
            let why = format!(
                "its stream `{}` had failed before the collective: {failed}",
                stream.name()
            );
            self.host.shared().abandon(rank, seq, why);
            let e = CollectiveError::StreamFailed {
                op,
                rank,
                message: failed.to_string(),
            };
            return fail_on_stream(op, rank, seq, stream, outcome, e);
        }
        let mine = Arc::new(RankEvents {
            ready: placed.then(|| stream.record_event()),
            mid: Mutex::new(None),
            done: Mutex::new(None),
        });
        let seq = self.host.shared().post(
            rank,
            Posted {
                desc,
                input,
                output,
                extra: Some(Arc::clone(&mine) as Arc<dyn std::any::Any + Send + Sync>),
            },
        );
        match self.run(seq, desc, stream, &mine) {
            Ok(()) => Work::new(op, rank, seq, stream.record_event(), outcome),
            Err(e) => fail_on_stream(op, rank, seq, stream, outcome, e),
        }
    }
}

impl ProcessGroup for SharedGpuGroup {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn name(&self) -> String {
        self.host.name()
    }

    collectives_via_issue!();

    /// A host rendezvous, as [`ThreadGroup::barrier`]: it orders the rank threads, not their
    /// streams.
    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }

    fn split(&self, parts: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        let host = self
            .host
            .split_with_config(parts, self.host.config().clone())?;
        Ok(Arc::new(SharedGpuGroup {
            host,
            ordinal: self.ordinal,
            #[cfg(feature = "cuda")]
            kernels: Arc::clone(&self.kernels),
        }))
    }
}
