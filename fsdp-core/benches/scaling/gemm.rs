//! The scaling bench's GEMM measurements: the machine's f32 GEMM rate through our kernel and
//! through the reference BLAS (`fsdp_autograd::kernels::cpu::ReferenceGemm`, OpenBLAS), and the
//! per-shape rates of the products the models run, ours against the reference, interleaved.

use std::time::Instant;

use fsdp_autograd::kernels::cpu::{matmul, set_matmul_threads, ReferenceGemm};
use fsdp_autograd::nn::GptConfig;

/// Which GEMM a measurement runs.
#[derive(Clone, Copy)]
pub enum Impl {
    /// `fsdp_autograd::kernels::cpu::matmul` (gemm's kernels at the process's CPU level).
    Ours,
    /// The reference BLAS's `cblas_sgemm`.
    Reference(&'static ReferenceGemm),
}

impl Impl {
    /// Sets the thread count every later call of this implementation uses.
    fn threads(self, n: usize) {
        match self {
            Impl::Ours => set_matmul_threads(n),
            Impl::Reference(r) => {
                r.set_threads(n);
            }
        }
    }

    /// One product `c = op(a)·op(b)` (overwriting `c`).
    #[allow(clippy::too_many_arguments)]
    fn mul(self, s: &Shape, a: &[f32], b: &[f32], c: &mut [f32]) {
        let r = match self {
            Impl::Ours => matmul(a, b, c, s.m, s.k, s.n, s.trans_a, s.trans_b, false),
            Impl::Reference(r) => r.matmul(a, b, c, s.m, s.k, s.n, s.trans_a, s.trans_b, false),
        };
        r.expect("the bench's operands match their shapes");
    }
}

/// One product shape, stored as the model's kernels store it.
#[derive(Clone, Debug)]
pub struct Shape {
    pub model: &'static str,
    pub op: String,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
}

impl Shape {
    pub fn flops(&self) -> f64 {
        2.0 * (self.m * self.k * self.n) as f64
    }
}

/// The matrix products of one training step of `cfg` with `tokens` tokens per rank, as
/// `fsdp_autograd::linear` issues them (weights stored `[out, in]`): for each linear layer
/// (`qkv` d→3d, `proj` d→d, `fc` d→4d, `out` 4d→d, the LM `head` d→vocab) the forward
/// `y = x·Wᵀ` (m = tokens, k = in, n = out, B transposed), the input gradient `dx = dy·W`
/// (m = tokens, k = out, n = in) and the weight gradient `dW = dyᵀ·x` (m = out, k = tokens,
/// n = in, A transposed). Attention's own products (blocks of at most 32 positions) are not
/// listed.
pub fn model_shapes(model: &'static str, cfg: &GptConfig, tokens: usize) -> Vec<Shape> {
    let d = cfg.d_model;
    let layers = [
        ("qkv", d, 3 * d),
        ("proj", d, d),
        ("fc", d, 4 * d),
        ("out", 4 * d, d),
        ("head", d, cfg.vocab),
    ];
    let mut v = Vec::new();
    for (name, inp, out) in layers {
        let s = |op: &str, m, k, n, trans_a, trans_b| Shape {
            model,
            op: format!("{name} {op}"),
            m,
            k,
            n,
            trans_a,
            trans_b,
        };
        v.push(s("fwd", tokens, inp, out, false, true));
        v.push(s("dx", tokens, out, inp, false, false));
        v.push(s("dW", out, tokens, inp, true, false));
    }
    v
}

/// Deterministic operands in [-0.5, 0.5).
fn operand(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32) / 1000.0 - 0.5)
        .collect()
}

/// A clock for [`time_shape`]: the calling thread's CPU time where every product runs on the
/// calling thread (one thread each: time other processes take from the core is not counted, so
/// a shared machine's load does not swamp the comparison), wall time otherwise.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    ThreadCpu,
    Wall,
}

impl Clock {
    /// The clock for products on `threads` threads.
    pub fn for_threads(threads: usize) -> Clock {
        if threads == 1 && thread_cpu_secs().is_some() {
            Clock::ThreadCpu
        } else {
            Clock::Wall
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Clock::ThreadCpu => "thread CPU time",
            Clock::Wall => "wall time",
        }
    }

    fn now(self, origin: Instant) -> f64 {
        match self {
            Clock::ThreadCpu => thread_cpu_secs().unwrap_or(f64::NAN),
            Clock::Wall => origin.elapsed().as_secs_f64(),
        }
    }
}

/// The calling thread's CPU time in seconds (Linux `CLOCK_THREAD_CPUTIME_ID`).
#[cfg(target_os = "linux")]
fn thread_cpu_secs() -> Option<f64> {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec (two 64-bit fields on 64-bit Linux) to `t`.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    (rc == 0).then_some(t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9)
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu_secs() -> Option<f64> {
    None
}

/// Seconds per product of `s` by `imp` on `clock`: the best of `reps` timings, each of enough
/// back-to-back products to take about 20 ms (at least 2).
fn time_shape(
    imp: Impl,
    clock: Clock,
    s: &Shape,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    reps: usize,
) -> f64 {
    let origin = Instant::now();
    imp.mul(s, a, b, c); // warm-up (packing buffers, thread pools)
    let t = clock.now(origin);
    imp.mul(s, a, b, c);
    let once = (clock.now(origin) - t).max(1e-7);
    let inner = ((0.02 / once) as usize).clamp(2, 10_000);
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = clock.now(origin);
        for _ in 0..inner {
            imp.mul(s, a, b, c);
        }
        best = best.min((clock.now(origin) - t) / inner as f64);
    }
    best
}

/// One row of the per-shape table.
pub struct ShapeRate {
    pub shape: Shape,
    pub ours_gflops: f64,
    pub reference_gflops: Option<f64>,
}

impl ShapeRate {
    pub fn ratio(&self) -> Option<f64> {
        self.reference_gflops.map(|r| self.ours_gflops / r)
    }
}

/// Ours and the reference on every shape, on `threads` threads each, interleaved (ours, then
/// the reference, per repetition round) so that a change of the machine's load hits both;
/// timed on [`Clock::for_threads`].
pub fn shape_rates(
    shapes: &[Shape],
    reference: Option<&'static ReferenceGemm>,
    threads: usize,
    rounds: usize,
) -> Vec<ShapeRate> {
    Impl::Ours.threads(threads);
    if let Some(r) = reference {
        Impl::Reference(r).threads(threads);
    }
    let clock = Clock::for_threads(threads);
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let a = operand(s.m * s.k, 3 * i);
            let b = operand(s.k * s.n, 3 * i + 1);
            let mut c = vec![0.0f32; s.m * s.n];
            let (mut ours, mut theirs) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..rounds {
                ours = ours.min(time_shape(Impl::Ours, clock, s, &a, &b, &mut c, 2));
                if let Some(r) = reference {
                    let imp = Impl::Reference(r);
                    theirs = theirs.min(time_shape(imp, clock, s, &a, &b, &mut c, 2));
                }
            }
            ShapeRate {
                shape: s.clone(),
                ours_gflops: s.flops() / ours / 1e9,
                reference_gflops: reference.map(|_| s.flops() / theirs / 1e9),
            }
        })
        .collect()
}

/// Total FLOPs over total time of a set of rows (what a step made of these products would
/// reach): `(ours, reference)` in GFLOP/s.
pub fn aggregate(rows: &[&ShapeRate]) -> (f64, Option<f64>) {
    let flops: f64 = rows.iter().map(|r| r.shape.flops()).sum();
    let ours: f64 = rows
        .iter()
        .map(|r| r.shape.flops() / r.ours_gflops)
        .sum::<f64>();
    let theirs: Option<f64> = rows
        .iter()
        .map(|r| r.reference_gflops.map(|g| r.shape.flops() / g))
        .sum();
    (flops / ours, theirs.map(|t| flops / t))
}

/// The machine's f32 GEMM rates through one implementation on 1024³ products, GFLOP/s.
#[derive(Clone, Copy, Debug)]
pub struct Peak {
    /// One call on all cores (best of three).
    pub all_cores: f64,
    /// One concurrent 1-thread call per core (best of three).
    pub concurrent: f64,
    /// One 1-thread call on the calling thread's CPU time (best of three): what one core does,
    /// whatever else the machine runs.
    pub one_core: f64,
}

impl Peak {
    /// The element-wise best of two measurements.
    pub fn best(self, o: Peak) -> Peak {
        Peak {
            all_cores: self.all_cores.max(o.all_cores),
            concurrent: self.concurrent.max(o.concurrent),
            one_core: self.one_core.max(o.one_core),
        }
    }

    /// The best measured multi-core rate (`gemm_peak_gflops` for ours).
    pub fn measured(self) -> f64 {
        self.all_cores.max(self.concurrent)
    }

    /// The machine's limit through this implementation: the best measured multi-core rate, or
    /// every core at the one-core rate, whichever is higher (a library whose threads scale
    /// badly, or a shared machine, does not lower it).
    pub fn limit(self, cores: usize) -> f64 {
        self.measured().max(self.one_core * cores as f64)
    }
}

/// [`Peak`] through `imp` on `cores` cores.
pub fn peak(imp: Impl, cores: usize) -> Peak {
    const N: usize = 1024;
    let s = Shape {
        model: "peak",
        op: "1024³".into(),
        m: N,
        k: N,
        n: N,
        trans_a: false,
        trans_b: false,
    };
    let a = operand(N * N, 7);
    let b = operand(N * N, 11);
    let mut cs: Vec<Vec<f32>> = (0..cores.max(1)).map(|_| vec![0f32; N * N]).collect();
    imp.threads(1);
    imp.mul(&s, &a, &b, &mut cs[0]); // warm-up (packing buffers, thread pools)
    let mut p = Peak {
        all_cores: 0.0,
        concurrent: 0.0,
        one_core: 0.0,
    };
    let cpu = Clock::for_threads(1);
    for _ in 0..3 {
        imp.threads(1);
        let t0 = Instant::now();
        let t = cpu.now(t0);
        imp.mul(&s, &a, &b, &mut cs[0]);
        p.one_core = p.one_core.max(s.flops() / (cpu.now(t0) - t) / 1e9);
        imp.threads(cores.max(1));
        let t = Instant::now();
        imp.mul(&s, &a, &b, &mut cs[0]);
        p.all_cores = p.all_cores.max(s.flops() / t.elapsed().as_secs_f64() / 1e9);
        imp.threads(1);
        let t = Instant::now();
        std::thread::scope(|sc| {
            for c in cs.iter_mut() {
                let (s, a, b) = (&s, &a, &b);
                sc.spawn(move || imp.mul(s, a, b, c));
            }
        });
        p.concurrent = p
            .concurrent
            .max(cores as f64 * s.flops() / t.elapsed().as_secs_f64() / 1e9);
    }
    p
}
