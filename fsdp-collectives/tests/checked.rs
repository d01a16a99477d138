//! The thread backend on checked (race-detecting) devices: a consumer that waits on the
//! collective's event is ordered after every peer's writes into its memory; a consumer that does
//! not wait, or a collective that does not wait for the producer of its input, is reported —
//! naming the streams of the two ranks involved.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fsdp_alloc::{AllocError, BufferRef, DType, Device, DeviceConfig, Stream};
use fsdp_collectives::{DeviceSlice, ProcessGroup, ReduceOp, ThreadGroup};

/// What a rank thread gets: a checked device, its default stream (`compute`) and `comm`.
struct Rank {
    pg: ThreadGroup,
    rank: usize,
    dev: Device,
    compute: Stream,
    comm: Stream,
}

fn run_checked<T: Send>(world: usize, f: impl Fn(Rank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ThreadGroup::new(world)
            .into_iter()
            .map(|pg| {
                let f = &f;
                s.spawn(move || {
                    let rank = pg.rank();
                    let dev = Device::cpu_with(rank, DeviceConfig::default().with_checked(true));
                    let compute = dev.default_stream().clone();
                    let comm = dev.new_stream("comm");
                    assert!(compute.is_checked() && comm.is_checked());
                    f(Rank {
                        pg,
                        rank,
                        dev,
                        compute,
                        comm,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// A buffer of `n` f32 allocated for `stream`, filled with `vals` by work launched on it (so the
/// write is a checked access, unlike a host upload).
fn produced(dev: &Device, stream: &Stream, vals: Vec<f32>) -> (fsdp_alloc::Buffer, DeviceSlice) {
    let buf = dev.alloc(vals.len() * 4, stream).unwrap();
    let data = buf.data().clone();
    stream.launch(move || data.write::<f32>().unwrap().copy_from_slice(&vals));
    let slice = DeviceSlice::from_buffer(&buf, DType::F32).unwrap();
    (buf, slice)
}

/// Where a consumer's read lands: the values, or the checked mode's error.
type Consumed = Arc<Mutex<Option<Result<Vec<f32>, AllocError>>>>;

/// Reads `data` from work launched on `stream` after `delay`; the values (or the error) land in
/// the returned slot once the stream ran it.
fn consume(stream: &Stream, data: &BufferRef, delay: Duration) -> Consumed {
    let slot = Arc::new(Mutex::new(None));
    let (s, d) = (Arc::clone(&slot), data.clone());
    stream.launch(move || {
        std::thread::sleep(delay);
        *s.lock().unwrap() = Some(d.read::<f32>().map(|g| g.to_vec()));
    });
    slot
}

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 100 + i) as f32).collect()
}

#[test]
fn every_op_is_ordered_for_consumers_that_wait() {
    let (world, n) = (3, 8);
    let results = run_checked(world, |r| {
        let mut out = Vec::new();
        // all-gather: peers push into this rank's output.
        let (_ib, inp) = produced(&r.dev, &r.compute, input(r.rank, n));
        let (_ob, outp) = produced(&r.dev, &r.compute, vec![0.0; world * n]);
        r.comm.wait_event(&r.compute.record_event());
        let w = r.pg.all_gather_into(&inp, &outp, &r.comm);
        r.compute.wait_event(w.event());
        out.push(consume(&r.compute, outp.data(), Duration::ZERO));
        // reduce-scatter: peers pull from this rank's input.
        let (_ib2, inp2) = produced(&r.dev, &r.compute, input(r.rank, world * n));
        let (_ob2, outp2) = produced(&r.dev, &r.compute, vec![0.0; n]);
        r.comm.wait_event(&r.compute.record_event());
        let w = r.pg.reduce_scatter(&inp2, &outp2, ReduceOp::Sum, &r.comm);
        r.compute.wait_event(w.event());
        out.push(consume(&r.compute, outp2.data(), Duration::ZERO));
        // all-reduce: reduce-scatter and all-gather in place, with a rendezvous between.
        let (_b3, buf3) = produced(&r.dev, &r.compute, input(r.rank, world * n));
        r.comm.wait_event(&r.compute.record_event());
        let w = r.pg.all_reduce(&buf3, ReduceOp::Sum, &r.comm);
        r.compute.wait_event(w.event());
        out.push(consume(&r.compute, buf3.data(), Duration::ZERO));
        // broadcast from rank 1: the others pull from its buffer.
        let (_b4, buf4) = produced(&r.dev, &r.compute, input(r.rank, n));
        r.comm.wait_event(&r.compute.record_event());
        let w = r.pg.broadcast(&buf4, 1, &r.comm);
        r.compute.wait_event(w.event());
        out.push(consume(&r.compute, buf4.data(), Duration::ZERO));
        // The buffers are reused by later collectives on comm: the next round frees and
        // reallocates them, exercising reuse across ranks' writes.
        r.dev.synchronize().expect("no ordering violation");
        out.into_iter()
            .map(|s| s.lock().unwrap().take().unwrap().unwrap())
            .collect::<Vec<_>>()
    });
    let gathered: Vec<f32> = (0..world).flat_map(|r| input(r, n)).collect();
    let summed: Vec<f32> = (0..world * n)
        .map(|i| (0..world).map(|r| input(r, world * n)[i]).sum())
        .collect();
    for (rank, got) in results.iter().enumerate() {
        assert_eq!(got[0], gathered, "all-gather on rank {rank}");
        assert_eq!(
            got[1],
            summed[rank * n..(rank + 1) * n],
            "reduce-scatter {rank}"
        );
        assert_eq!(got[2], summed, "all-reduce on rank {rank}");
        assert_eq!(got[3], input(1, n), "broadcast on rank {rank}");
    }
}

#[test]
fn repeated_collectives_reusing_cached_blocks_stay_ordered() {
    // Output blocks go back to the cache and are handed to the next iteration's collective,
    // whose peers write into them: the allocator's stream-ordered reuse plus the rendezvous
    // points must order those writes after this rank's earlier reads.
    let (world, n) = (2, 256);
    run_checked(world, |r| {
        for round in 0..10 {
            let (_ib, inp) = produced(&r.dev, &r.compute, input(r.rank + round, n));
            let mut ob = r.dev.alloc(world * n * 4, &r.comm).unwrap();
            let outp = DeviceSlice::from_buffer(&ob, DType::F32).unwrap();
            r.comm.wait_event(&r.compute.record_event());
            let w = r.pg.all_gather_into(&inp, &outp, &r.comm);
            r.compute.wait_event(w.event());
            let got = consume(
                &r.compute,
                outp.data(),
                Duration::from_millis(round as u64 % 3),
            );
            ob.record_stream(&r.compute);
            drop(ob);
            r.compute.synchronize().expect("no ordering violation");
            let got = got.lock().unwrap().take().unwrap().unwrap();
            assert_eq!(got[..n], input(round, n)[..]);
        }
    });
}

#[test]
fn consumer_reading_a_peers_chunk_without_waiting_is_reported() {
    let (world, n) = (2, 64);
    let errors = run_checked(world, |r| {
        let (_ib, inp) = produced(&r.dev, &r.compute, input(r.rank, n));
        let (_ob, outp) = produced(&r.dev, &r.compute, vec![0.0; world * n]);
        r.comm.wait_event(&r.compute.record_event());
        let w = r.pg.all_gather_into(&inp, &outp, &r.comm);
        // BUG: no r.compute.wait_event(w.event()) before reading the chunk the peer pushed.
        // The consumer really reads after the push (it waits on a channel, which orders it in
        // time but is invisible to the checked mode), so the report lands on the consumer.
        let peer = 1 - r.rank;
        let peers_chunk = outp.chunk(peer, world).unwrap();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let data = peers_chunk.data().clone();
        r.compute.launch(move || {
            wait.recv().unwrap();
            let _ = data.read::<f32>().map(|g| g[0]);
        });
        w.wait().unwrap(); // the collective itself is fine
        go.send(()).unwrap();
        let err = r.compute.synchronize().unwrap_err();
        (r.rank, err.to_string())
    });
    for (rank, msg) in errors {
        let peer = 1 - rank;
        assert!(msg.contains("stream-ordering violation"), "{msg}");
        assert!(
            msg.contains(&format!("`cpu:{rank}/default`"))
                && msg.contains(&format!("`cpu:{peer}/comm`")),
            "rank {rank}: the report names this rank's consumer and the peer's comm stream: {msg}"
        );
    }
}

#[test]
fn collective_not_waiting_for_its_inputs_producer_is_reported() {
    let (world, n) = (2, 64);
    let outcomes = run_checked(world, |r| {
        let (_ib, inp) = produced(&r.dev, &r.compute, input(r.rank, world * n));
        let (_ob, outp) = produced(&r.dev, &r.comm, vec![0.0; n]);
        // BUG: no r.comm.wait_event(&r.compute.record_event()): the peer pulls this rank's
        // input in reduce-scatter while nothing orders it after the compute stream's write.
        // (The host learns through a channel — invisible to the checked mode — that the write
        // has run, so the report lands on the reading peer, deterministically.)
        let (done, written) = std::sync::mpsc::channel::<()>();
        r.compute.launch(move || done.send(()).unwrap());
        written.recv().unwrap();
        let w = r.pg.reduce_scatter(&inp, &outp, ReduceOp::Sum, &r.comm);
        let res = w.wait().map_err(|e| e.to_string());
        let _ = r.dev.synchronize();
        res
    });
    let reports: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert!(
        reports.iter().any(|m| {
            m.contains("stream-ordering violation")
                && (0..world).any(|p| {
                    m.contains(&format!("`cpu:{p}/default`"))
                        && m.contains(&format!("`cpu:{}/comm`", 1 - p))
                })
        }),
        "expected a cross-rank report: {outcomes:?}"
    );
}
