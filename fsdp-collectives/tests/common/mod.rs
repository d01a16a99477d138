//! Test support: rank threads, typed uploads/downloads, seeded data, plain reference reductions.
#![allow(dead_code)]

use std::sync::Arc;

use fsdp_alloc::{Buffer, DType, Device, Stream};
use fsdp_collectives::{DeviceSlice, ProcessGroup, ReduceOp};
use half::{bf16, f16};

/// What a rank thread gets.
pub struct Rank<G> {
    pub pg: G,
    pub rank: usize,
    pub dev: Device,
    pub stream: Stream,
}

/// Runs `f` on one thread per group handle (rank order); returns the results in rank order.
/// Panics in a rank thread are propagated.
pub fn run_ranks<G, T, F>(groups: Vec<G>, f: F) -> Vec<T>
where
    G: ProcessGroup + 'static,
    T: Send,
    F: Fn(Rank<G>) -> T + Sync,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                let f = &f;
                s.spawn(move || {
                    let rank = pg.rank();
                    let dev = Device::cpu(rank);
                    let stream = dev.new_stream("comm");
                    f(Rank {
                        pg,
                        rank,
                        dev,
                        stream,
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

/// Same for shared handles (e.g. mesh subgroups).
pub fn run_arcs<T, F>(groups: Vec<Arc<dyn ProcessGroup>>, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize, Arc<dyn ProcessGroup>, Device, Stream) -> T + Sync,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(i, pg)| {
                let f = &f;
                s.spawn(move || {
                    let dev = Device::cpu(i);
                    let stream = dev.new_stream("comm");
                    f(i, pg, dev, stream)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// A tiny deterministic generator (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-100, 100).
    pub fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 200.0 - 100.0
    }
}

/// Element types the tests cover, with a plain reference reduction.
pub trait TestElem: bytemuck::Pod + PartialEq + std::fmt::Debug + Send + Sync + 'static {
    const DTYPE: DType;
    fn random(rng: &mut Rng) -> Self;
    /// Reduces `vals` (one per rank, rank order) as the documented semantics say: f16/bf16 fold
    /// in f32 and round once unless `own` (then round after every step).
    fn reduce_ref(vals: &[Self], op: ReduceOp, own: bool) -> Self;
}

fn fold_f32(vals: impl Iterator<Item = f32>, op: ReduceOp, n: usize) -> f32 {
    let mut acc: Option<f32> = None;
    for x in vals {
        acc = Some(match (acc, op) {
            (None, _) => x,
            (Some(a), ReduceOp::Sum | ReduceOp::Avg) => a + x,
            (Some(a), ReduceOp::Max) => a.max(x),
            (Some(a), ReduceOp::Min) => a.min(x),
        });
    }
    let a = acc.unwrap_or(0.0);
    if op == ReduceOp::Avg {
        a / n as f32
    } else {
        a
    }
}

impl TestElem for f32 {
    const DTYPE: DType = DType::F32;
    fn random(rng: &mut Rng) -> f32 {
        rng.f32()
    }
    fn reduce_ref(vals: &[f32], op: ReduceOp, _own: bool) -> f32 {
        fold_f32(vals.iter().copied(), op, vals.len())
    }
}

macro_rules! half_elem {
    ($t:ty, $d:expr) => {
        impl TestElem for $t {
            const DTYPE: DType = $d;
            fn random(rng: &mut Rng) -> $t {
                <$t>::from_f32(rng.f32())
            }
            fn reduce_ref(vals: &[$t], op: ReduceOp, own: bool) -> $t {
                if !own {
                    return <$t>::from_f32(fold_f32(
                        vals.iter().map(|v| v.to_f32()),
                        op,
                        vals.len(),
                    ));
                }
                let mut acc = vals[0];
                for &x in &vals[1..] {
                    let (a, b) = (acc.to_f32(), x.to_f32());
                    acc = <$t>::from_f32(match op {
                        ReduceOp::Sum | ReduceOp::Avg => a + b,
                        ReduceOp::Max => a.max(b),
                        ReduceOp::Min => a.min(b),
                    });
                }
                if op == ReduceOp::Avg {
                    acc = <$t>::from_f32(acc.to_f32() / vals.len() as f32);
                }
                acc
            }
        }
    };
}
half_elem!(f16, DType::F16);
half_elem!(bf16, DType::BF16);

macro_rules! int_elem {
    ($t:ty, $d:expr) => {
        impl TestElem for $t {
            const DTYPE: DType = $d;
            fn random(rng: &mut Rng) -> $t {
                rng.next_u64() as $t
            }
            fn reduce_ref(vals: &[$t], op: ReduceOp, _own: bool) -> $t {
                let mut acc = vals[0];
                for &x in &vals[1..] {
                    acc = match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(x),
                        ReduceOp::Max => acc.max(x),
                        ReduceOp::Min => acc.min(x),
                    };
                }
                if op == ReduceOp::Avg {
                    acc = acc.wrapping_div(vals.len() as $t);
                }
                acc
            }
        }
    };
}
int_elem!(i32, DType::I32);
int_elem!(i64, DType::I64);

impl TestElem for u8 {
    const DTYPE: DType = DType::U8;
    fn random(rng: &mut Rng) -> u8 {
        rng.next_u64() as u8
    }
    fn reduce_ref(_: &[u8], _: ReduceOp, _: bool) -> u8 {
        unreachable!("u8 is not reducible")
    }
}

/// Seeded data for `rank`.
pub fn data<T: TestElem>(seed: u64, rank: usize, n: usize) -> Vec<T> {
    let mut rng = Rng(seed ^ (rank as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    (0..n).map(|_| T::random(&mut rng)).collect()
}

/// Allocates a buffer on `dev` holding `vals`.
pub fn upload<T: TestElem>(dev: &Device, stream: &Stream, vals: &[T]) -> (Buffer, DeviceSlice) {
    let buf = dev.alloc(std::mem::size_of_val(vals), stream).unwrap();
    buf.data().write::<T>().unwrap().copy_from_slice(vals);
    let s = DeviceSlice::from_buffer(&buf, T::DTYPE).unwrap();
    (buf, s)
}

/// Allocates a buffer of `n` elements filled with a sentinel pattern (so unwritten outputs show).
pub fn alloc_out<T: TestElem>(dev: &Device, stream: &Stream, n: usize) -> (Buffer, DeviceSlice) {
    let buf = dev.alloc(n * std::mem::size_of::<T>(), stream).unwrap();
    buf.data().write::<u8>().unwrap().fill(0xA5);
    let s = DeviceSlice::from_buffer(&buf, T::DTYPE).unwrap();
    (buf, s)
}

pub fn download<T: TestElem>(s: &DeviceSlice) -> Vec<T> {
    s.data().read::<T>().unwrap().to_vec()
}

/// Bitwise equality (NaN-safe, -0.0-sensitive).
pub fn bits<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// Runs `$body` with `$t` bound to the Rust type of `$dtype`.
#[macro_export]
macro_rules! with_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            fsdp_alloc::DType::F32 => {
                type $t = f32;
                $body
            }
            fsdp_alloc::DType::F16 => {
                type $t = half::f16;
                $body
            }
            fsdp_alloc::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            fsdp_alloc::DType::I32 => {
                type $t = i32;
                $body
            }
            fsdp_alloc::DType::I64 => {
                type $t = i64;
                $body
            }
            fsdp_alloc::DType::U8 => {
                type $t = u8;
                $body
            }
        }
    };
}

pub const WORLDS: [usize; 6] = [1, 2, 3, 4, 5, 8];
pub const ALL_DTYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::I32,
    DType::I64,
    DType::U8,
];
pub const REDUCIBLE: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];
pub const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
