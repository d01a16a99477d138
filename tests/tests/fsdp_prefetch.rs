//! Forward prefetch only moves all-gathers earlier in forward: the backward's collectives are
//! issued in the same order as without it, and the results are the same bit for bit.
//!
//! Regression: prefetching used to create the prefetched unit's parameter views at the time its
//! gather was issued, i.e. before the current unit's forward. Autograd runs backward work in
//! reverse creation order, so the prefetched unit's gradient — and its reduce-scatter — came
//! after the backward of the unit that ran before it; on a link that runs a group's collectives
//! in issue order, the late reduce-scatter held back the next all-gather (a 4–7% slower step).

use std::sync::{Arc, Mutex};

use fsdp_alloc::{DType, Device, Stream};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_collectives::{DeviceSlice, OpKind, ProcessGroup, ReduceOp, ThreadGroup, Work};
use fsdp_core::{Fsdp, FsdpConfig, WrapPolicy};
use fsdp_tests::{fsdp_sgd_step, token_tensors};

/// A process group that records the kind and length of every collective issued through it.
#[derive(Debug)]
struct Recording {
    inner: ThreadGroup,
    log: Arc<Mutex<OpLog>>,
}

impl Recording {
    fn push(&self, op: OpKind, len: usize) {
        self.log.lock().unwrap().push((op, len));
    }
}

impl ProcessGroup for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> String {
        self.inner.name()
    }
    fn all_gather_into(&self, input: &DeviceSlice, output: &DeviceSlice, stream: &Stream) -> Work {
        self.push(OpKind::AllGather, output.len());
        self.inner.all_gather_into(input, output, stream)
    }
    fn reduce_scatter_with(
        &self,
        input: &DeviceSlice,
        output: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work {
        self.push(OpKind::ReduceScatter, input.len());
        self.inner
            .reduce_scatter_with(input, output, op, accum, stream)
    }
    fn all_reduce_with(
        &self,
        buf: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work {
        self.push(OpKind::AllReduce, buf.len());
        self.inner.all_reduce_with(buf, op, accum, stream)
    }
    fn broadcast(&self, buf: &DeviceSlice, root: usize, stream: &Stream) -> Work {
        self.push(OpKind::Broadcast, buf.len());
        self.inner.broadcast(buf, root, stream)
    }
    fn barrier(&self) -> fsdp_collectives::Result<()> {
        self.inner.barrier()
    }
    fn split(&self, parts: &[Vec<usize>]) -> fsdp_collectives::Result<Arc<dyn ProcessGroup>> {
        self.inner.split(parts)
    }
}

/// Collectives in issue order: (kind, length of the larger buffer).
type OpLog = Vec<(OpKind, usize)>;

/// Per rank: (the collectives of the third step, the three losses).
fn run(forward_prefetch: bool) -> Vec<(OpLog, Vec<u32>)> {
    let groups = ThreadGroup::new(2);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let log = Arc::new(Mutex::new(Vec::new()));
                    let pg: Arc<dyn ProcessGroup> = Arc::new(Recording {
                        inner: g,
                        log: Arc::clone(&log),
                    });
                    let dev = Device::cpu(rank);
                    let model = Gpt::new(
                        &InitContext::eager(&dev, 3),
                        &GptConfig::new(32, 16, 4, 2, 8),
                    )
                    .unwrap();
                    let config = FsdpConfig {
                        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
                        forward_prefetch,
                        ..FsdpConfig::default()
                    };
                    let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
                    let mut losses = Vec::new();
                    for step in 0..3 {
                        log.lock().unwrap().clear();
                        let (x, y) = token_tensors(step * 2 + rank, 2, 8, 32, &dev);
                        losses.push(fsdp_sgd_step(&fsdp, &x, &y, 2, 0.05).to_bits());
                    }
                    let ops = log.lock().unwrap().clone();
                    (ops, losses)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn forward_prefetch_keeps_the_backward_order_and_the_results() {
    let (off, on) = (run(false), run(true));
    for (rank, (a, b)) in off.iter().zip(&on).enumerate() {
        assert_eq!(a.1, b.1, "rank {rank}: the same losses");
        // Forward: the same all-gathers (prefetch only issues them earlier).
        let first_rs = |ops: &[(OpKind, usize)]| {
            ops.iter()
                .position(|(k, _)| *k == OpKind::ReduceScatter)
                .unwrap()
        };
        let (ia, ib) = (first_rs(&a.0), first_rs(&b.0));
        assert!(ia > 0 && ib > 0);
        // Backward: from the first reduce-scatter on, the same sequence of collectives.
        assert_eq!(
            a.0[ia - 1..],
            b.0[ib - 1..],
            "rank {rank}: backward collectives differ with forward prefetch"
        );
        assert_eq!(a.0.len(), b.0.len(), "rank {rank}: as many collectives");
    }
}
