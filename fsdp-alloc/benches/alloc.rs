//! Allocator bench: `cargo xtask bench alloc` (= `cargo bench -p fsdp-alloc --bench alloc`).
//!
//! 1. Alloc+free latency, caching allocator vs the non-caching path (every request a raw host
//!    allocation and every free a raw free), same sizes, same run.
//! 2. A repeated training-like pattern (FSDP-style unshard/compute/reshard over units, forward
//!    and backward, rate limited): raw mallocs after warm-up (must be 0) and
//!    peak reserved / peak allocated with the default (compact) policy — the JSON's
//!    `reserved_over_peak_allocated` — and, on the text line only, with PyTorch's policy.
//! 3. The paper's rate-limiter scenario under a capacity cap: a fast issuing thread all-gathers
//!    unit after unit on a comm stream; a slower compute stream consumes each unit and frees it
//!    with `record_stream`. Without the limiter the issuer runs ahead, blocks pile up waiting for
//!    compute's events and the allocator has to synchronize and flush (`num_alloc_retries`);
//!    with `RateLimiter::new(2)` it does not.
//!
//! The last line of stdout is one JSON object.

use std::time::{Duration, Instant};

use fsdp_alloc::{Capacity, Device, DeviceConfig, MemoryStats, RateLimiter, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn p50(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Median ns of one alloc + free over a mix of sizes.
fn alloc_free_ns(dev: &Device, sizes: &[usize], rounds: usize) -> u64 {
    let s = dev.default_stream().clone();
    // warm-up (fills the cache of the caching device)
    for &n in sizes {
        drop(dev.alloc(n, &s).expect("alloc"));
    }
    let mut samples = Vec::with_capacity(sizes.len() * rounds);
    for _ in 0..rounds {
        for &n in sizes {
            let t = Instant::now();
            let b = dev.alloc(n, &s).expect("alloc");
            drop(b);
            samples.push(t.elapsed().as_nanos() as u64);
        }
    }
    p50(&mut samples)
}

/// One iteration of an FSDP-like pattern over `units` units: forward (unshard, activations,
/// reshard), backward (unshard, gradients, reduce-scatter output, reshard), optimizer step.
fn training_iteration(
    dev: &Device,
    compute: &Stream,
    comm: &Stream,
    limiter: &RateLimiter,
    units: usize,
) {
    let unit_bytes = 16 * MIB + 4 * KIB;
    let shard_bytes = unit_bytes / 4;
    let mut activations = Vec::new();
    for u in 0..units {
        limiter.acquire().expect("acquire");
        let mut full = dev.alloc(unit_bytes, comm).expect("unshard");
        let w = full.data().slice(0, 4096).expect("slice");
        comm.launch(move || w.write::<u8>().expect("w").fill(1));
        compute.wait_event(&comm.record_event());
        let act = dev
            .alloc((2 + u % 3) * MIB + 512 * (u % 5), compute)
            .expect("act");
        let tmp = dev.alloc(96 * KIB * (1 + u % 4), compute).expect("tmp");
        let (r, a) = (full.data().clone(), act.data().clone());
        compute.launch(move || {
            let x = r.read::<u8>().expect("r")[0];
            a.write::<u8>().expect("a")[..64].fill(x);
        });
        drop(tmp);
        activations.push(act);
        full.record_stream(compute);
        drop(full);
        limiter.release(compute.record_event());
    }
    for _u in (0..units).rev() {
        limiter.acquire().expect("acquire");
        let mut full = dev.alloc(unit_bytes, comm).expect("unshard");
        compute.wait_event(&comm.record_event());
        let grad = dev.alloc(unit_bytes, compute).expect("grad");
        let act = activations.pop().expect("activation");
        let (r, g) = (full.data().clone(), grad.data().clone());
        compute.launch(move || {
            let x = r.read::<u8>().expect("r")[0];
            g.write::<u8>().expect("g")[..64].fill(x);
        });
        drop(act);
        full.record_stream(compute);
        drop(full);
        limiter.release(compute.record_event());
        // reduce-scatter on comm into a shard-sized output
        comm.wait_event(&compute.record_event());
        let mut grad = grad;
        let shard = dev.alloc(shard_bytes, comm).expect("shard");
        let (g, o) = (grad.data().clone(), shard.data().clone());
        comm.launch(move || {
            let x = g.read::<u8>().expect("g")[0];
            o.write::<u8>().expect("o")[..64].fill(x);
        });
        grad.record_stream(comm);
        drop(grad);
        drop(shard);
    }
    dev.synchronize().expect("step");
}

/// The training-like pattern on a fresh device: 3 warm-up iterations, then `iters` timed ones.
/// Returns ms per iteration, raw mallocs after warm-up and the statistics of the timed part.
fn training_pattern(config: DeviceConfig, units: usize, iters: usize) -> (f64, u64, MemoryStats) {
    let dev = Device::cpu_with(2, config);
    let compute = dev.default_stream().clone();
    let comm = dev.new_stream("comm");
    let limiter = RateLimiter::new(2);
    for _ in 0..3 {
        training_iteration(&dev, &compute, &comm, &limiter, units);
    }
    let warm = dev.memory_stats();
    dev.reset_peak_stats();
    let t = Instant::now();
    for _ in 0..iters {
        training_iteration(&dev, &compute, &comm, &limiter, units);
    }
    let iter_ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
    let after = dev.memory_stats();
    (iter_ms, after.num_raw_mallocs - warm.num_raw_mallocs, after)
}

struct LimiterRun {
    retries: u64,
    ms: f64,
    peak_reserved: usize,
}

/// The rate-limiter scenario: `units` all-gathers of `unit_bytes` on `comm`, each consumed on
/// `compute` for `compute_time`, under `capacity`.
fn limiter_scenario(
    limit: Option<usize>,
    units: usize,
    unit_bytes: usize,
    compute_time: Duration,
    capacity: usize,
) -> LimiterRun {
    let dev = Device::cpu_with(
        0,
        // PyTorch's policy: the compact one reuses pending blocks behind a stream wait, so the
        // issuer running ahead costs no flush-and-retry there.
        DeviceConfig::default()
            .with_capacity(Capacity::Bytes(capacity))
            .with_compact(false),
    );
    let compute = dev.default_stream().clone();
    let comm = dev.new_stream("comm");
    let limiter = limit.map(RateLimiter::new);
    let t = Instant::now();
    for _ in 0..units {
        if let Some(l) = &limiter {
            l.acquire().expect("acquire");
        }
        let mut buf = dev.alloc(unit_bytes, &comm).expect("all-gather output");
        let out = buf.data().clone();
        // The "all-gather": writes the whole unit.
        comm.launch(move || out.write::<u8>().expect("gather").fill(3));
        compute.wait_event(&comm.record_event());
        let inp = buf.data().clone();
        compute.launch(move || {
            std::thread::sleep(compute_time);
            let g = inp.read::<u8>().expect("consume");
            assert_eq!(g[g.len() - 1], 3);
        });
        buf.record_stream(&compute);
        drop(buf);
        if let Some(l) = &limiter {
            l.release(compute.record_event());
        }
    }
    dev.synchronize().expect("run");
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let st = dev.memory_stats();
    assert_eq!(st.allocated_bytes, 0);
    LimiterRun {
        retries: st.num_alloc_retries,
        ms,
        peak_reserved: st.peak_reserved_bytes,
    }
}

fn main() {
    // 1. latency
    let sizes = [
        512,
        3 * KIB,
        64 * KIB,
        700 * KIB,
        MIB + 512,
        4 * MIB,
        12 * MIB,
        32 * MIB,
    ];
    let rounds = 2000;
    let cached = Device::cpu(0);
    let system = Device::cpu_with(1, DeviceConfig::default().with_caching(false));
    let cached_ns = alloc_free_ns(&cached, &sizes, rounds);
    let system_ns = alloc_free_ns(&system, &sizes, rounds);
    let sys_stats = system.memory_stats();
    println!(
        "alloc+free p50 over {} sizes x {rounds}: cached {cached_ns} ns, system (non-caching) {system_ns} ns; \
         cached raw mallocs {}, system raw mallocs {}",
        sizes.len(),
        cached.memory_stats().num_raw_mallocs,
        sys_stats.num_raw_mallocs
    );

    // 2. training-like pattern, default (compact) policy, then PyTorch's for comparison
    let (units, iters) = (8, 10);
    let (iter_ms, raw_after_warmup, after) =
        training_pattern(DeviceConfig::default(), units, iters);
    let ratio = after.peak_reserved_bytes as f64 / after.peak_allocated_bytes as f64;
    let (pt_ms, pt_raw, pt) =
        training_pattern(DeviceConfig::default().with_compact(false), units, iters);
    let pt_ratio = pt.peak_reserved_bytes as f64 / pt.peak_allocated_bytes as f64;
    println!(
        "training pattern: {units} units, {iters} iterations after warm-up, {iter_ms:.2} ms/iter; \
         raw mallocs after warm-up {raw_after_warmup}; peak reserved {:.1} MiB, peak allocated \
         {:.1} MiB (ratio {ratio:.3}); allocated at the end {}. PyTorch's policy: {pt_ms:.2} \
         ms/iter, raw mallocs after warm-up {pt_raw}, peak reserved {:.1} MiB, peak allocated \
         {:.1} MiB (ratio {pt_ratio:.3})",
        after.peak_reserved_bytes as f64 / MIB as f64,
        after.peak_allocated_bytes as f64 / MIB as f64,
        after.allocated_bytes,
        pt.peak_reserved_bytes as f64 / MIB as f64,
        pt.peak_allocated_bytes as f64 / MIB as f64,
    );

    // 3. rate limiter under a capacity cap
    let (units, unit_bytes, compute_time) = (40, 12 * MIB, Duration::from_millis(3));
    let capacity = 5 * unit_bytes;
    let without = limiter_scenario(None, units, unit_bytes, compute_time, capacity);
    let with = limiter_scenario(Some(2), units, unit_bytes, compute_time, capacity);
    println!(
        "rate limiter ({units} units of {} MiB, {} ms compute each, capacity {} MiB): \
         without: {} retries, {:.1} ms, peak reserved {} MiB; with (2 in flight): {} retries, \
         {:.1} ms, peak reserved {} MiB",
        unit_bytes / MIB,
        compute_time.as_millis(),
        capacity / MIB,
        without.retries,
        without.ms,
        without.peak_reserved / MIB,
        with.retries,
        with.ms,
        with.peak_reserved / MIB
    );

    println!(
        "{{\"cached_alloc_free_ns_p50\": {cached_ns}, \"system_alloc_free_ns_p50\": {system_ns}, \
         \"raw_mallocs_after_warmup\": {raw_after_warmup}, \"reserved_over_peak_allocated\": {ratio:.4}, \
         \"retries_without_limiter\": {}, \"retries_with_limiter\": {}, \
         \"ms_without_limiter\": {:.1}, \"ms_with_limiter\": {:.1}}}",
        without.retries, with.retries, without.ms, with.ms
    );
}
