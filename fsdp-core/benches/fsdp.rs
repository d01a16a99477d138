//! FSDP step time on 4 CPU thread ranks, GPT-mini (the `train_gpt` example's run shape):
//! `cargo xtask bench fsdp` (= `cargo bench -p fsdp-core --bench fsdp`).
//!
//! Model: GPT-mini (vocab 256, d_model 256, 4 layers, 4 heads, seq 128), one FSDP unit per
//! `Block` plus the root, batch 4 sequences per rank, plain SGD, f32, 1 matmul thread per rank
//! (4 ranks share the machine's cores). A step is forward + loss + backward + SGD on the shards +
//! a full synchronization of the rank's streams; its time is rank 0's wall time from a barrier
//! (on a separate, un-emulated group) to the end of that synchronization.
//!
//! Every configuration is wrapped once per rank (its own device and its own process group) and
//! the configurations are stepped *interleaved*: each round runs one step of each, in a rotating
//! order, so machine noise hits them alike. The first rounds are warm-up and not counted; each
//! reported time is the median over the counted rounds.
//!
//! 1. **No link emulation**: NoShard (DDP: all-reduce of gradients) vs FullShard vs ShardGradOp,
//!    BackwardPre, rate limiter on. `fsdp_over_ddp` = FullShard / NoShard (goal ≤ 1.05).
//! 2. **Link emulation** ([`LinkModel`]: each collective completes `latency + bytes/bandwidth`
//!    after all ranks arrive, a sleep on the communication stream). The bandwidth is derived from
//!    part 1: a block's forward compute is estimated as `⅓ · noshard_step / n_layers`, with the
//!    fastest NoShard step of part 1 (the least disturbed by other load; backward ≈
//!    twice forward; the root unit's compute — embeddings, final norm, head — is small), and the
//!    link is set so one block's all-gather (what one rank receives, `(W−1)/W` of the block's
//!    bytes) takes that long: half the block's backward compute, so a block's all-gather plus its
//!    reduce-scatter match its backward. FullShard with BackwardPre vs `BackwardPrefetch::None`
//!    → `backward_prefetch_speedup` = none / pre (goal > 1.1), and BackwardPre with forward
//!    prefetch on vs off → `forward_prefetch_speedup` = off / on. The "off" configuration *is* the
//!    BackwardPre one, so `link_no_fwd_prefetch_step_ms` = `link_pre_step_ms` (one measurement).
//!
//!    Two link flavours run side by side in the same session:
//!    - **built-in** (the headline fields): [`ThreadGroup`]'s link — one link per rank and group,
//!      collectives of a group running in issue order on each rank, as on one NCCL communicator
//!      (FSDP's all-gathers on its unshard stream and its reduce-scatters on its reduce stream
//!      share it). Without backward prefetch the next all-gather is issued after the current
//!      reduce-scatter and queues behind it — the setting the paper's prefetch is designed for;
//!    - **in order** (the `*_in_order` fields): the same link behind this bench's own wrapper
//!      ([`InOrder`]), which also serializes collectives in issue order — a cross-check of the
//!      built-in model (it was the only in-order model before the thread backend had one).
//!
//! 3. **Capped devices** (the paper's rate-limiter story, end to end): a wider GPT (vocab 256,
//!    d 384, 6 layers, seq 64, batch 2, deferred init) on 2 ranks whose devices are capped at
//!    1.6 × the peak allocated bytes of an uncapped rate-limited run, trained 3 steps with the
//!    rate limiter and without it (with forward prefetch, so the issuing thread runs ahead):
//!    whether each finishes (`capped_with_limiter_ok`, `capped_without_limiter_ok`) and the
//!    allocation retries (`capped_*_retries`). Not a timing: the outcome of the capped runs can
//!    depend on how far the issuing thread gets ahead, so it is reported, not asserted (the
//!    test suite asserts only that the limited run fits).
//!
//! Diagnostics (text lines, not in the JSON): per configuration, the median host time until
//! `forward` returned and until `backward` returned, as a fraction of the step — how far the
//! issuing thread runs ahead of the streams; and rank 0's peak allocated bytes over the counted
//! and warm-up rounds, raw device mallocs per counted step, and allocation retries.
//!
//! The last stdout line is one JSON object with the ratios (ratios of medians), the raw medians,
//! the link parameters, and `*_paired` companions of each ratio: the median over rounds of the
//! per-round ratio (the two steps of one ratio ran back to back, so slow drifts in the machine's
//! load cancel — the steadier estimate on a shared machine).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fsdp_alloc::{DType, Device, Event, Stream};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::{cross_entropy, InitContext, Tensor};
use fsdp_collectives::{
    DeviceSlice, GroupConfig, LinkModel, ProcessGroup, ReduceOp, ThreadGroup, Work,
};
use fsdp_core::{BackwardPrefetch, Fsdp, FsdpConfig, ParamBytes, ShardingStrategy, WrapPolicy};

mod common;
use common::{median, token_batch};

const W: usize = 4;
const BATCH: usize = 4;
const LR: f32 = 0.05;
const SEED: u64 = 0;
const WARMUP_ROUNDS: usize = 2;
const PLAIN_ROUNDS: usize = 13;
const LINK_ROUNDS: usize = 9;
const LINK_LATENCY: Duration = Duration::from_micros(500);

/// Part 3: trains the wider GPT on 2 rank threads with devices capped at `cap` bytes (or not),
/// with the rate limiter or without it (then with forward prefetch). Returns rank 0's
/// (finished all steps, peak allocated bytes, allocation retries, the error if any).
fn capped_run(cap: Option<usize>, limiter: bool) -> (bool, usize, u64, String) {
    use fsdp_alloc::{Capacity, DeviceConfig};
    let groups = ThreadGroup::new(2);
    let results: Vec<(bool, usize, u64, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let devices = match cap {
                        Some(c) => DeviceConfig::default().with_capacity(Capacity::Bytes(c)),
                        None => DeviceConfig::default(),
                    };
                    let dev = Device::cpu_with(900 + rank, devices);
                    let cfg = GptConfig::new(256, 384, 6, 6, 64);
                    let run = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
                        let model = Gpt::new(&InitContext::fake(SEED), &cfg)?;
                        let config = FsdpConfig {
                            wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
                            limit_all_gathers: limiter,
                            forward_prefetch: !limiter,
                            ..FsdpConfig::default()
                        };
                        let pg: Arc<dyn ProcessGroup> = Arc::new(g);
                        let fsdp = Fsdp::wrap(model, &dev, pg, config)?;
                        for i in 0..3 {
                            let (ids, tg) = token_batch(i * 2 + rank, 2, 64, 256);
                            let x = Tensor::from_vec(ids, &[2, 64], &dev)?;
                            let y = Tensor::from_vec(tg, &[2 * 64], &dev)?;
                            let logits = fsdp.forward(&x)?.reshape(&[2 * 64, 256])?;
                            cross_entropy(&logits, &y)?.scale(0.5)?.backward()?;
                            fsdp.sgd_step(LR)?;
                            fsdp.zero_grad();
                            fsdp.synchronize()?;
                        }
                        Ok(())
                    };
                    let r = run();
                    let st = dev.memory_stats();
                    let err = r.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
                    (
                        r.is_ok(),
                        st.peak_allocated_bytes,
                        st.num_alloc_retries,
                        err,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    results.into_iter().next().expect("rank 0")
}

fn model_config() -> GptConfig {
    GptConfig::mini()
}

/// A process group whose collectives run one at a time in issue order: each is made to start
/// after the previously issued one completed (its stream waits on that collective's event), like
/// the collectives of one NCCL communicator. Every rank issues the same sequence, so the chain is
/// the same on every rank.
#[derive(Debug)]
struct InOrder {
    inner: ThreadGroup,
    last: Mutex<Option<Event>>,
}

impl InOrder {
    fn new(inner: ThreadGroup) -> InOrder {
        InOrder {
            inner,
            last: Mutex::new(None),
        }
    }

    fn chain(&self, stream: &Stream, issue: impl FnOnce() -> Work) -> Work {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.as_ref() {
            stream.wait_event(prev);
        }
        let work = issue();
        *last = Some(work.event().clone());
        work
    }
}

impl ProcessGroup for InOrder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> String {
        format!("in-order({})", self.inner.name())
    }
    fn all_gather_into(&self, input: &DeviceSlice, output: &DeviceSlice, stream: &Stream) -> Work {
        self.chain(stream, || self.inner.all_gather_into(input, output, stream))
    }
    fn reduce_scatter_with(
        &self,
        input: &DeviceSlice,
        output: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work {
        self.chain(stream, || {
            self.inner
                .reduce_scatter_with(input, output, op, accum, stream)
        })
    }
    fn all_reduce_with(
        &self,
        buf: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work {
        self.chain(stream, || {
            self.inner.all_reduce_with(buf, op, accum, stream)
        })
    }
    fn broadcast(&self, buf: &DeviceSlice, root: usize, stream: &Stream) -> Work {
        self.chain(stream, || self.inner.broadcast(buf, root, stream))
    }
    fn barrier(&self) -> fsdp_collectives::Result<()> {
        self.inner.barrier()
    }
    fn split(&self, parts: &[Vec<usize>]) -> fsdp_collectives::Result<Arc<dyn ProcessGroup>> {
        self.inner.split(parts)
    }
}

/// One configuration to time.
#[derive(Debug, Clone)]
struct Variant {
    name: &'static str,
    strategy: ShardingStrategy,
    backward_prefetch: BackwardPrefetch,
    forward_prefetch: bool,
    link: Option<LinkModel>,
    in_order: bool,
}

impl Variant {
    fn plain(name: &'static str, strategy: ShardingStrategy) -> Variant {
        Variant {
            name,
            strategy,
            backward_prefetch: BackwardPrefetch::BackwardPre,
            forward_prefetch: false,
            link: None,
            in_order: false,
        }
    }

    fn linked(
        name: &'static str,
        link: LinkModel,
        in_order: bool,
        backward_prefetch: BackwardPrefetch,
        forward_prefetch: bool,
    ) -> Variant {
        Variant {
            name,
            strategy: ShardingStrategy::FullShard,
            backward_prefetch,
            forward_prefetch,
            link: Some(link),
            in_order,
        }
    }

    fn config(&self) -> FsdpConfig {
        FsdpConfig {
            strategy: self.strategy,
            wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
            backward_prefetch: self.backward_prefetch,
            forward_prefetch: self.forward_prefetch,
            limit_all_gathers: true,
            ..FsdpConfig::default()
        }
    }
}

/// Host-side timing of one step, seconds: (forward returned, backward returned, step done).
type StepTimes = (f64, f64, f64);

/// One training step of one wrapped model on one rank.
fn step(
    fsdp: &Fsdp<Gpt>,
    dev: &Device,
    index: usize,
) -> Result<StepTimes, Box<dyn std::error::Error + Send + Sync>> {
    let cfg = model_config();
    let (ids, tg) = token_batch(index, BATCH, cfg.seq_len, cfg.vocab);
    let t0 = Instant::now();
    let x = Tensor::from_vec(ids, &[BATCH, cfg.seq_len], dev)?;
    let y = Tensor::from_vec(tg, &[BATCH * cfg.seq_len], dev)?;
    let logits = fsdp.forward(&x)?;
    let t_fwd = t0.elapsed().as_secs_f64();
    let logits = logits.reshape(&[BATCH * cfg.seq_len, cfg.vocab])?;
    let loss = cross_entropy(&logits, &y)?.scale(1.0 / W as f32)?;
    loss.backward()?;
    let t_bwd = t0.elapsed().as_secs_f64();
    fsdp.sgd_step(LR)?;
    fsdp.zero_grad();
    fsdp.synchronize()?;
    Ok((t_fwd, t_bwd, t0.elapsed().as_secs_f64()))
}

/// What one timing session returns: per variant, rank 0's counted step times, and rank 0's
/// (largest unit, all units) parameter bytes.
struct Session {
    times: Vec<Vec<StepTimes>>,
    param_bytes: ParamBytes,
    /// Per variant, rank 0's device after the counted rounds: (peak allocated bytes during the
    /// rounds, raw device mallocs per counted step, allocation retries).
    memory: Vec<(usize, f64, u64)>,
}

/// Wraps every variant on W rank threads (each variant its own device and group) and steps them
/// interleaved for `WARMUP_ROUNDS + rounds` rounds.
fn session(variants: &[Variant], rounds: usize) -> Session {
    // groups[v] yields rank r's handle of variant v's group.
    let mut per_variant: Vec<std::vec::IntoIter<ThreadGroup>> = variants
        .iter()
        .map(|v| {
            let mut c = GroupConfig::default();
            if let Some(l) = v.link {
                c = c.with_link(l);
            }
            ThreadGroup::with_config(W, c).into_iter()
        })
        .collect();
    let control = ThreadGroup::new(W);
    let times = Arc::new(Mutex::new(vec![Vec::new(); variants.len()]));
    let param_bytes = Arc::new(Mutex::new(ParamBytes {
        max_unit: 0,
        total: 0,
    }));
    let memory = Arc::new(Mutex::new(vec![(0, 0.0, 0); variants.len()]));
    let handles: Vec<_> = control
        .into_iter()
        .enumerate()
        .map(|(r, ctl)| {
            let groups: Vec<ThreadGroup> = per_variant
                .iter_mut()
                .map(|it| it.next().expect("one handle per rank"))
                .collect();
            let variants = variants.to_vec();
            let times = Arc::clone(&times);
            let param_bytes = Arc::clone(&param_bytes);
            let memory = Arc::clone(&memory);
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || {
                    let cfg = model_config();
                    let models: Vec<(Device, Fsdp<Gpt>)> = variants
                        .iter()
                        .zip(groups)
                        .enumerate()
                        .map(|(v, (var, g))| {
                            let dev = Device::cpu(v * W + r);
                            let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg)
                                .expect("build GPT-mini");
                            let pg: Arc<dyn ProcessGroup> = if var.in_order {
                                Arc::new(InOrder::new(g))
                            } else {
                                Arc::new(g)
                            };
                            let fsdp = Fsdp::wrap(model, &dev, pg, var.config()).expect("wrap");
                            (dev, fsdp)
                        })
                        .collect();
                    if r == 0 {
                        *param_bytes.lock().expect("lock") = models[0].1.param_bytes();
                    }
                    let n = variants.len();
                    for (dev, _) in &models {
                        dev.reset_peak_stats();
                    }
                    let mut mallocs_after_warmup = vec![0; n];
                    for round in 0..WARMUP_ROUNDS + rounds {
                        if round == WARMUP_ROUNDS {
                            for (v, (dev, _)) in models.iter().enumerate() {
                                mallocs_after_warmup[v] = dev.memory_stats().num_raw_mallocs;
                            }
                        }
                        for k in 0..n {
                            let v = (round + k) % n;
                            let (dev, fsdp) = &models[v];
                            ctl.barrier().expect("barrier");
                            let t = step(fsdp, dev, round * W + r)
                                .unwrap_or_else(|e| panic!("{}: {e}", variants[v].name));
                            if r == 0 && round >= WARMUP_ROUNDS {
                                times.lock().expect("lock")[v].push(t);
                            }
                        }
                    }
                    if r == 0 {
                        let mut mem = memory.lock().expect("lock");
                        for (v, (dev, _)) in models.iter().enumerate() {
                            let st = dev.memory_stats();
                            mem[v] = (
                                st.peak_allocated_bytes,
                                (st.num_raw_mallocs - mallocs_after_warmup[v]) as f64
                                    / rounds.max(1) as f64,
                                st.num_alloc_retries,
                            );
                        }
                    }
                })
                .expect("spawn rank")
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread panicked");
    }
    let times = std::mem::take(&mut *times.lock().expect("lock"));
    let param_bytes = *param_bytes.lock().expect("lock");
    let memory = std::mem::take(&mut *memory.lock().expect("lock"));
    Session {
        times,
        param_bytes,
        memory,
    }
}

fn ms(s: f64) -> f64 {
    s * 1e3
}

/// Prints one line per variant and returns the median step times (seconds).
fn report(label: &str, variants: &[Variant], s: &Session) -> Vec<f64> {
    variants
        .iter()
        .zip(&s.times)
        .zip(&s.memory)
        .map(|((v, t), &(peak, mallocs, retries))| {
            let total = median(t.iter().map(|x| x.2).collect());
            let fwd = median(t.iter().map(|x| x.0 / x.2).collect());
            let bwd = median(t.iter().map(|x| x.1 / x.2).collect());
            println!(
                "{label:<8} {:<19} median {:>7.1} ms | host done with fwd at {:>3.0}%, bwd at {:>3.0}% of the step | \
                 peak {:.1} MiB, {mallocs:.1} raw mallocs/step, {retries} retries | steps {}",
                v.name,
                ms(total),
                fwd * 100.0,
                bwd * 100.0,
                peak as f64 / 1048576.0,
                t.iter()
                    .map(|x| format!("{:.0}", ms(x.2)))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            total
        })
        .collect()
}

fn main() {
    let cfg = model_config();
    // 4 ranks share the cores: one matmul thread each.
    fsdp_autograd::kernels::gemm::set_matmul_threads(1);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "fsdp bench: GPT-mini (vocab {} d {} layers {} heads {} seq {}), {W} ranks on {cores} cores, \
         batch {BATCH}/rank, Block units + root, rate limiter on, 1 matmul thread/rank; \
         {WARMUP_ROUNDS} warm-up rounds, then {PLAIN_ROUNDS} (no link) / {LINK_ROUNDS} (link) counted",
        cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len
    );

    // Part 1: strategies, no link emulation.
    let plain = [
        Variant::plain("no-shard", ShardingStrategy::NoShard),
        Variant::plain("full-shard", ShardingStrategy::FullShard),
        Variant::plain("shard-grad-op", ShardingStrategy::ShardGradOp),
    ];
    let t = Instant::now();
    let s1 = session(&plain, PLAIN_ROUNDS);
    let med1 = report("no link", &plain, &s1);
    let (noshard, fullshard, sgo) = (med1[0], med1[1], med1[2]);
    println!("  (part 1 took {:.1} s)", t.elapsed().as_secs_f64());

    // Derive the link from the measured compute.
    // The fastest NoShard step is the least disturbed measurement of the compute (the machine is
    // shared; the link itself is a sleep and does not slow down with load).
    let compute = s1.times[0]
        .iter()
        .map(|t| t.2)
        .fold(f64::INFINITY, f64::min);
    let ParamBytes { max_unit, total } = s1.param_bytes;
    let block_fwd = compute / 3.0 / cfg.n_layers as f64;
    let received = max_unit as f64 * (W - 1) as f64 / W as f64;
    let transfer = (block_fwd - LINK_LATENCY.as_secs_f64()).max(1e-3);
    let bytes_per_sec = received / transfer;
    let link = LinkModel {
        latency: LINK_LATENCY,
        bytes_per_sec,
    };
    let whole = (total as f64 * (W - 1) as f64 / W as f64) as usize;
    println!(
        "link: fastest noshard step {:.1} ms → a block's forward ≈ step/3/{} = {:.1} ms (backward ≈ {:.1} ms); \
         largest unit {:.2} MiB of Ψ = {:.2} MiB; one rank receives {:.2} MiB per block all-gather → \
         latency {:.2} ms, {:.2} MB/s: block all-gather {:.1} ms, all units once {:.1} ms",
        ms(compute),
        cfg.n_layers,
        ms(block_fwd),
        ms(2.0 * block_fwd),
        max_unit as f64 / 1048576.0,
        total as f64 / 1048576.0,
        received / 1048576.0,
        ms(LINK_LATENCY.as_secs_f64()),
        bytes_per_sec / 1e6,
        ms(link.transfer_time(received as usize).as_secs_f64()),
        ms(link.transfer_time(whole).as_secs_f64()),
    );

    // Part 2: prefetch under the emulated link, both flavours in one interleaved session.
    use BackwardPrefetch::{BackwardPre, None as NoPrefetch};
    let linked = [
        Variant::linked("built-in pre", link, false, BackwardPre, false),
        Variant::linked("built-in none", link, false, NoPrefetch, false),
        Variant::linked("built-in pre+fwd", link, false, BackwardPre, true),
        Variant::linked("in-order pre", link, true, BackwardPre, false),
        Variant::linked("in-order none", link, true, NoPrefetch, false),
        Variant::linked("in-order pre+fwd", link, true, BackwardPre, true),
    ];
    let t = Instant::now();
    let s2 = session(&linked, LINK_ROUNDS);
    let med2 = report("link", &linked, &s2);
    println!("  (part 2 took {:.1} s)", t.elapsed().as_secs_f64());
    let (pre, none, fwd) = (med2[0], med2[1], med2[2]);
    let (pre_io, none_io, fwd_io) = (med2[3], med2[4], med2[5]);

    // Paired estimates: the median over rounds of the per-round ratio (the two steps of a ratio
    // ran back to back, so slow drifts of the machine's load cancel).
    let paired = |s: &Session, num: usize, den: usize| {
        median(
            s.times[num]
                .iter()
                .zip(&s.times[den])
                .map(|(a, b)| a.2 / b.2)
                .collect(),
        )
    };
    let p_ddp = paired(&s1, 1, 0);
    let p_bwd = paired(&s2, 1, 0);
    let p_fwd = paired(&s2, 0, 2);
    let p_bwd_io = paired(&s2, 4, 3);
    let p_fwd_io = paired(&s2, 3, 5);
    println!(
        "paired (median of per-round ratios): fsdp_over_ddp {p_ddp:.3}; built-in link: backward \
         {p_bwd:.3}, forward {p_fwd:.3}; in-order link: backward {p_bwd_io:.3}, forward {p_fwd_io:.3}"
    );
    let fsdp_over_ddp = fullshard / noshard;
    let backward_prefetch_speedup = none / pre;
    let forward_prefetch_speedup = pre / fwd;
    let bwd_io = none_io / pre_io;
    let fwd_io_speedup = pre_io / fwd_io;
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };

    // Part 3: capped devices.
    let t = Instant::now();
    let (_, uncapped_peak, _, _) = capped_run(None, true);
    let cap = uncapped_peak * 8 / 5;
    let (lim_ok, _, lim_retries, lim_err) = capped_run(Some(cap), true);
    let (nolim_ok, _, nolim_retries, nolim_err) = capped_run(Some(cap), false);
    let outcome = |ok: bool, err: &str| {
        if ok {
            "finished".to_string()
        } else {
            format!("failed: {}", err.chars().take(160).collect::<String>())
        }
    };
    println!(
        "capped devices (1.6 × the uncapped peak of {:.1} MiB = {:.1} MiB): with the rate limiter \
         {} ({lim_retries} retries); without it, forward prefetch on: {} ({nolim_retries} retries) \
         (part 3 took {:.1} s)",
        uncapped_peak as f64 / 1048576.0,
        cap as f64 / 1048576.0,
        outcome(lim_ok, &lim_err),
        outcome(nolim_ok, &nolim_err),
        t.elapsed().as_secs_f64()
    );
    println!(
        "fsdp_over_ddp {fsdp_over_ddp:.3} (goal ≤ 1.05: {}); built-in link: backward_prefetch_speedup \
         {backward_prefetch_speedup:.3} (goal > 1.1: {}), forward_prefetch_speedup \
         {forward_prefetch_speedup:.3}; in-order link: backward {bwd_io:.3} (goal > 1.1: {}), forward \
         {fwd_io_speedup:.3}",
        verdict(fsdp_over_ddp <= 1.05),
        verdict(backward_prefetch_speedup > 1.1),
        verdict(bwd_io > 1.1),
    );
    println!(
        "{{\"fsdp_over_ddp\":{:.4},\"backward_prefetch_speedup\":{:.4},\"forward_prefetch_speedup\":{:.4},\
         \"noshard_step_ms\":{:.2},\"fullshard_step_ms\":{:.2},\"shardgradop_step_ms\":{:.2},\
         \"link_pre_step_ms\":{:.2},\"link_none_step_ms\":{:.2},\"link_fwd_prefetch_step_ms\":{:.2},\
         \"link_no_fwd_prefetch_step_ms\":{:.2},\"link_latency_ms\":{:.3},\"link_bytes_per_sec\":{:.0},\
         \"backward_prefetch_speedup_in_order\":{:.4},\"forward_prefetch_speedup_in_order\":{:.4},\
         \"link_pre_step_ms_in_order\":{:.2},\"link_none_step_ms_in_order\":{:.2},\
         \"link_fwd_prefetch_step_ms_in_order\":{:.2},\
         \"fsdp_over_ddp_paired\":{:.4},\"backward_prefetch_speedup_paired\":{:.4},\
         \"forward_prefetch_speedup_paired\":{:.4},\"backward_prefetch_speedup_in_order_paired\":{:.4},\
         \"forward_prefetch_speedup_in_order_paired\":{:.4},\"link_derived_from_step_ms\":{:.2},\
         \"capped_cap_bytes\":{cap},\"capped_with_limiter_ok\":{lim_ok},\
         \"capped_with_limiter_retries\":{lim_retries},\"capped_without_limiter_ok\":{nolim_ok},\
         \"capped_without_limiter_retries\":{nolim_retries},\
         \"ranks\":{W},\"batch_per_rank\":{BATCH},\"rounds_plain\":{PLAIN_ROUNDS},\"rounds_link\":{LINK_ROUNDS}}}",
        fsdp_over_ddp,
        backward_prefetch_speedup,
        forward_prefetch_speedup,
        ms(noshard),
        ms(fullshard),
        ms(sgo),
        ms(pre),
        ms(none),
        ms(fwd),
        ms(pre),
        ms(LINK_LATENCY.as_secs_f64()),
        bytes_per_sec,
        bwd_io,
        fwd_io_speedup,
        ms(pre_io),
        ms(none_io),
        ms(fwd_io),
        p_ddp,
        p_bwd,
        p_fwd,
        p_bwd_io,
        p_fwd_io,
        ms(compute),
    );
}
