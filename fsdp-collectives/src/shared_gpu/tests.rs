//! The shared-GPU kernels and plans on the host emulator (`emu/`), against the thread backend.
//!
//! Every case runs one collective twice from the same bytes: on W thread ranks over CPU devices
//! ([`ThreadGroup`], the reference), and as the launches [`plan`] gives each rank, executed by
//! the emulator (the kernels of `kernels.cu` compiled for the host) on buffers at the same
//! offsets, each phase's ranks in a shuffled order. The whole of every rank's buffer is then
//! compared **bit for bit** (in f32 and, by the thread backend's rule, in f16/bf16 with either
//! accumulation, i32, i64), so a wrong fold order, accumulator, rounding, chunk, offset or a
//! write outside the output fails. The emulator is built with the system C++ compiler;
//! without one the tests print why and pass, unless `FSDP_EMU_REQUIRED=1` (CI).

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

use fsdp_alloc::{DType, Device};
use half::{bf16, f16};

use super::plan::{plan, Launch, RankBuffers, ReduceKernel};
use crate::desc::OpDesc;
use crate::group::ProcessGroup;
use crate::thread::ThreadGroup;
use crate::types::{DeviceSlice, ReduceOp};

// ---------------------------------------------------------------------------------------------
// The emulator process.

/// The emulator binary, built on first use; `Err` says why it is unavailable.
fn harness() -> Result<&'static Path, String> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(build).as_deref().map_err(Clone::clone)
}

fn build() -> Result<PathBuf, String> {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = std::env::temp_dir().join(format!("fsdp-shared-gpu-emu-{}", std::process::id()));
    // `harness.cpp` includes "sg_emu.h" and "../kernels.cu": the layout keeps those paths.
    let emu = dir.join("emu");
    std::fs::create_dir_all(&emu).map_err(|e| format!("creating {}: {e}", emu.display()))?;
    let src = emu.join("harness.cpp");
    for (path, text) in [
        (src.clone(), include_str!("emu/harness.cpp")),
        (emu.join("sg_emu.h"), include_str!("emu/sg_emu.h")),
        (dir.join("kernels.cu"), include_str!("kernels.cu")),
    ] {
        std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let bin = dir.join("harness");
    let out = Command::new(&compiler)
        .args([
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-fno-strict-aliasing",
            "-Wall",
            "-Werror",
        ])
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .map_err(|e| format!("running the C++ compiler `{compiler}`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{compiler}` failed to build the shared-GPU emulator:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(bin)
}

/// The emulator for a test: panics if the compiler exists but the build failed; `None` (after
/// printing why) without a C++ compiler, unless `FSDP_EMU_REQUIRED=1`.
fn harness_or_skip(test: &str) -> Option<&'static Path> {
    match harness() {
        Ok(p) => Some(p),
        Err(e) if e.starts_with("running the C++ compiler") => {
            if std::env::var("FSDP_EMU_REQUIRED").as_deref() == Ok("1") {
                panic!("{test}: FSDP_EMU_REQUIRED=1 but the emulator cannot be built: {e}");
            }
            eprintln!("SKIPPED {test}: no C++ compiler to build the shared-GPU emulator ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

struct Emu {
    child: Child,
    stdin: BufWriter<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    buffers: u64,
}

impl Emu {
    fn start(bin: &Path) -> Emu {
        let mut child = Command::new(bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the emulator");
        let stdin = BufWriter::new(child.stdin.take().expect("stdin"));
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Emu {
            child,
            stdin,
            stdout,
            buffers: 0,
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("writing to the emulator");
    }

    /// A new buffer holding `bytes`; returns its device address.
    fn upload(&mut self, bytes: &[u8]) -> u64 {
        let id = self.buffers;
        self.buffers += 1;
        self.send(&format!("alloc {}", bytes.len()));
        let hex: String = if bytes.is_empty() {
            "-".into()
        } else {
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        };
        self.send(&format!("write {id} {hex}"));
        (id + 1) << 40
    }

    fn read(&mut self, addr: u64, len: usize) -> Vec<u8> {
        self.send(&format!("read {addr} {len}"));
        self.stdin.flush().expect("flushing to the emulator");
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .expect("reading the emulator");
        assert!(n > 0, "the emulator exited (see its error above)");
        let s = line.trim();
        if s == "-" {
            return Vec::new();
        }
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("emulator hex"))
            .collect()
    }

    /// Runs one launch exactly as `exec.rs` would enqueue it (same kernel, grid, arguments).
    fn launch(&mut self, l: &Launch) {
        let (gx, gy) = l.grid();
        let line = match l {
            Launch::Reduce {
                kernel,
                srcs,
                dst,
                n,
                op,
                world,
                vec,
            } => format!(
                "launch {} {gx} {gy} {} {} {dst} {n} {op} {world} {}",
                kernel.name(),
                srcs.len(),
                join(srcs),
                u32::from(*vec)
            ),
            Launch::Copy {
                srcs,
                dst,
                chunk,
                total,
                unit,
            } => format!(
                "launch {} {gx} {gy} {} {} {dst} {chunk} {total} {unit}",
                l.kernel_name(),
                srcs.len(),
                join(srcs)
            ),
        };
        self.send(&line);
    }
}

fn join(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
}

impl Drop for Emu {
    fn drop(&mut self) {
        self.send("quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Cases.

/// A small deterministic generator (xorshift64*).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A nonzero float with a spread of exponents (`lo..hi` powers of two), sometimes a NaN or
    /// an infinity when `specials` (never a zero: max/min of ±0 is unspecified).
    fn float(&mut self, lo: i32, hi: i32, specials: bool) -> f32 {
        if specials {
            match self.below(16) {
                0 => return f32::NAN,
                1 => return f32::INFINITY,
                2 => return f32::NEG_INFINITY,
                _ => {}
            }
        }
        let m = 1.0 + (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        let e = lo + self.below((hi - lo) as u64) as i32;
        let v = m * 2f32.powi(e);
        if self.next() & 1 == 0 {
            v
        } else {
            -v
        }
    }

    /// `count` random elements of `dtype`, as bytes.
    pub(super) fn elems(&mut self, dtype: DType, count: usize, specials: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(count * dtype.size());
        for _ in 0..count {
            match dtype {
                DType::F32 => out.extend(self.float(-30, 20, specials).to_le_bytes()),
                // f16: from subnormals to values whose sums overflow in f16.
                DType::F16 => out.extend(
                    f16::from_f32(self.float(-24, 13, specials))
                        .to_bits()
                        .to_le_bytes(),
                ),
                DType::BF16 => out.extend(
                    bf16::from_f32(self.float(-30, 20, specials))
                        .to_bits()
                        .to_le_bytes(),
                ),
                DType::I32 => out.extend((self.next() as i32).to_le_bytes()),
                DType::I64 => out.extend((self.next() as i64).to_le_bytes()),
                DType::U8 => out.push(self.next() as u8),
            }
        }
        out
    }
}

/// Which collective a case runs.
#[derive(Debug, Clone, Copy)]
pub(super) enum Coll {
    AllGather,
    ReduceScatter(ReduceOp, DType),
    AllReduce(ReduceOp, DType),
    Broadcast(usize),
    AllToAll,
}

/// One collective on `world` ranks, `n` elements per chunk, buffers `offset` elements into each
/// rank's arena (misaligned offsets take the scalar and narrow-copy paths).
#[derive(Debug, Clone, Copy)]
pub(super) struct Case {
    pub(super) coll: Coll,
    pub(super) dtype: DType,
    pub(super) world: usize,
    pub(super) n: usize,
    pub(super) offset: usize,
    pub(super) in_place: bool,
}

/// Element ranges (start, len) of a case's input and output in a rank's arena, and its length.
pub(super) struct Layout {
    pub(super) input: Option<(usize, usize)>,
    pub(super) output: (usize, usize),
    pub(super) len: usize,
}

impl Case {
    pub(super) fn layout(&self, rank: usize) -> Layout {
        let (w, n, o) = (self.world, self.n, self.offset);
        match self.coll {
            Coll::AllGather if self.in_place => Layout {
                input: Some((o + rank * n, n)),
                output: (o, w * n),
                len: o + w * n + 3,
            },
            Coll::AllGather => Layout {
                input: Some((o, n)),
                output: (o + n + 1, w * n),
                len: o + n + 1 + w * n + 3,
            },
            Coll::ReduceScatter(..) if self.in_place => Layout {
                input: Some((o, w * n)),
                output: (o + rank * n, n),
                len: o + w * n + 3,
            },
            Coll::ReduceScatter(..) => Layout {
                input: Some((o, w * n)),
                output: (o + w * n + 1, n),
                len: o + w * n + 1 + n + 3,
            },
            Coll::AllReduce(..) | Coll::Broadcast(_) => Layout {
                input: None,
                output: (o, n),
                len: o + n + 3,
            },
            Coll::AllToAll => Layout {
                input: Some((o, w * n)),
                output: (o + w * n + 2, w * n),
                len: o + w * n + 2 + w * n + 3,
            },
        }
    }

    /// Max/min cases may hold NaNs and infinities; sums never do (a NaN's payload after a sum
    /// is the CPU's, not the GPU's canonical NaN).
    pub(super) fn specials(&self) -> bool {
        matches!(
            self.coll,
            Coll::ReduceScatter(ReduceOp::Max | ReduceOp::Min, _)
                | Coll::AllReduce(ReduceOp::Max | ReduceOp::Min, _)
        )
    }

    /// The descriptor of rank `rank`'s call (built from CPU slices of the same layout).
    fn desc(&self, rank: usize) -> OpDesc {
        let sz = self.dtype.size();
        let l = self.layout(rank);
        let dev = Device::cpu(0);
        let arena = dev.alloc(l.len * sz, dev.default_stream()).unwrap();
        let slice = |(s, n): (usize, usize)| {
            DeviceSlice::new(arena.data().slice(s * sz, n * sz).unwrap(), self.dtype).unwrap()
        };
        let out = slice(l.output);
        let input = l.input.map(slice);
        match self.coll {
            Coll::AllGather => OpDesc::all_gather(input.as_ref().unwrap(), &out, rank),
            Coll::ReduceScatter(op, accum) => {
                OpDesc::reduce_scatter(input.as_ref().unwrap(), &out, op, accum, rank)
            }
            Coll::AllReduce(op, accum) => OpDesc::all_reduce(&out, op, accum),
            Coll::Broadcast(root) => OpDesc::broadcast(&out, root),
            Coll::AllToAll => OpDesc::all_to_all(input.as_ref().unwrap(), &out),
        }
    }
}

/// Issues `case`'s collective on `g` for `rank`, whose arena is `arena`.
pub(super) fn issue(
    g: &dyn ProcessGroup,
    case: &Case,
    rank: usize,
    arena: &fsdp_alloc::BufferRef,
    st: &fsdp_alloc::Stream,
) -> crate::types::Work {
    let sz = case.dtype.size();
    let l = case.layout(rank);
    let slice = |(start, n): (usize, usize)| {
        DeviceSlice::new(arena.slice(start * sz, n * sz).unwrap(), case.dtype).unwrap()
    };
    let out = slice(l.output);
    let input = l.input.map(slice);
    match case.coll {
        Coll::AllGather => g.all_gather_into(input.as_ref().unwrap(), &out, st),
        Coll::ReduceScatter(op, accum) => {
            g.reduce_scatter_with(input.as_ref().unwrap(), &out, op, accum, st)
        }
        Coll::AllReduce(op, accum) => g.all_reduce_with(&out, op, accum, st),
        Coll::Broadcast(root) => g.broadcast(&out, root, st),
        Coll::AllToAll => g.all_to_all_into(input.as_ref().unwrap(), &out, st),
    }
}

/// The arenas after the collective on W thread ranks (the reference).
pub(super) fn on_threads(case: &Case, arenas: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let groups = ThreadGroup::new(case.world);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                let bytes = &arenas[rank];
                s.spawn(move || {
                    let dev = Device::cpu(rank);
                    let st = dev.new_stream("comm");
                    let arena = dev.alloc(bytes.len(), &st).unwrap();
                    arena.data().write::<u8>().unwrap().copy_from_slice(bytes);
                    let work = issue(&g, case, rank, arena.data(), &st);
                    work.wait()
                        .unwrap_or_else(|e| panic!("{case:?}: thread backend: {e}"));
                    let r = arena.data().read::<u8>().unwrap().to_vec();
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The arenas after the collective as planned launches on the emulator, each phase's ranks in
/// an order drawn from `rng`.
fn on_emulator(emu: &mut Emu, case: &Case, arenas: &[Vec<u8>], rng: &mut Rng) -> Vec<Vec<u8>> {
    let sz = case.dtype.size() as u64;
    let bases: Vec<u64> = arenas.iter().map(|a| emu.upload(a)).collect();
    let bufs: Vec<RankBuffers> = (0..case.world)
        .map(|r| {
            let l = case.layout(r);
            RankBuffers {
                input: l.input.map(|(s, _)| bases[r] + s as u64 * sz),
                output: bases[r] + l.output.0 as u64 * sz,
            }
        })
        .collect();
    let plans: Vec<Vec<Vec<Launch>>> = (0..case.world)
        .map(|r| plan(r, &case.desc(r), &bufs).unwrap_or_else(|e| panic!("{case:?}: {e}")))
        .collect();
    let phases = plans.iter().map(Vec::len).max().unwrap_or(0);
    for phase in 0..phases {
        let mut order: Vec<usize> = (0..case.world).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        for r in order {
            for l in plans[r].get(phase).into_iter().flatten() {
                emu.launch(l);
            }
        }
    }
    bases
        .iter()
        .zip(arenas)
        .map(|(&b, a)| emu.read(b, a.len()))
        .collect()
}

/// Runs `cases` both ways and compares every byte.
fn check(test: &str, cases: &[Case], seed: u64) {
    let Some(bin) = harness_or_skip(test) else {
        return;
    };
    let mut emu = Emu::start(bin);
    let mut rng = Rng(seed);
    for case in cases {
        let specials = case.specials();
        let arenas: Vec<Vec<u8>> = (0..case.world)
            .map(|r| rng.elems(case.dtype, case.layout(r).len, specials))
            .collect();
        let want = on_threads(case, &arenas);
        let got = on_emulator(&mut emu, case, &arenas, &mut rng);
        for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
            if g != w {
                let sz = case.dtype.size();
                let at = (0..w.len()).find(|&i| g[i] != w[i]).unwrap_or(0) / sz;
                panic!(
                    "{test}: {case:?}: rank {rank} differs from the thread backend first at \
                     element {at}: emulated {:02x?} vs thread {:02x?}",
                    &g[at * sz..(at + 1) * sz],
                    &w[at * sz..(at + 1) * sz]
                );
            }
        }
    }
}

pub(super) const REDUCTIONS: [(DType, DType); 7] = [
    (DType::F32, DType::F32),
    (DType::F16, DType::F32),
    (DType::F16, DType::F16),
    (DType::BF16, DType::F32),
    (DType::BF16, DType::BF16),
    (DType::I32, DType::I32),
    (DType::I64, DType::I64),
];

pub(super) const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

#[test]
fn emulated_reductions_equal_the_thread_backend_bit_for_bit() {
    let mut cases = Vec::new();
    for world in [1, 2, 3, 5, 8] {
        for (dtype, accum) in REDUCTIONS {
            for op in OPS {
                // Aligned (16-byte loads, scalar tail) and misaligned by one element (scalar).
                for (n, offset) in [(37, 0), (9, 1)] {
                    for in_place in [false, true] {
                        cases.push(Case {
                            coll: Coll::ReduceScatter(op, accum),
                            dtype,
                            world,
                            n,
                            offset,
                            in_place,
                        });
                    }
                    cases.push(Case {
                        coll: Coll::AllReduce(op, accum),
                        dtype,
                        world,
                        n: n * world + 3,
                        offset,
                        in_place: false,
                    });
                }
            }
        }
    }
    check("emulated_reductions", &cases, 0x5eed_0001);
}

#[test]
fn emulated_copies_equal_the_thread_backend_bit_for_bit() {
    let mut cases = Vec::new();
    for world in [1, 2, 3, 4, 8] {
        for dtype in [DType::F32, DType::BF16, DType::U8, DType::I64] {
            // Offsets and lengths that give every copy unit (16, 8, 4, 2, 1 bytes) and a tail.
            for (n, offset) in [(40, 0), (33, 1), (5, 3), (0, 0)] {
                for in_place in [false, true] {
                    cases.push(Case {
                        coll: Coll::AllGather,
                        dtype,
                        world,
                        n,
                        offset,
                        in_place,
                    });
                }
                cases.push(Case {
                    coll: Coll::AllToAll,
                    dtype,
                    world,
                    n,
                    offset,
                    in_place: false,
                });
                cases.push(Case {
                    coll: Coll::Broadcast(world - 1),
                    dtype,
                    world,
                    n: n * 3 + 1,
                    offset,
                    in_place: false,
                });
            }
        }
    }
    check("emulated_copies", &cases, 0x5eed_0002);
}

/// Every f16 and bf16 bit pattern (NaNs and subnormals included) through the half kernels, with
/// both accumulations: the conversions are the `half` crate's, bit for bit.
#[test]
fn every_half_bit_pattern_folds_like_the_thread_backend() {
    let Some(bin) = harness_or_skip("every_half_bit_pattern") else {
        return;
    };
    let mut emu = Emu::start(bin);
    for (dtype, accum) in REDUCTIONS.into_iter().filter(|(d, _)| d.size() == 2) {
        // Rank 0 holds all 65,536 patterns, rank 1 a rotation of them. Max converts every
        // pattern in and out unchanged (rotated far, so that no two NaNs meet: which NaN max
        // returns is unspecified). Sums and averages pair each value with a near neighbour of
        // the same exponent, so that results need one bit more than the type has and
        // round-to-nearest-even ties are frequent; their NaNs become 1.0 (a NaN sum's payload
        // would be the GPU's own).
        let all: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        for (op, shift) in [
            (ReduceOp::Max, 12_345),
            (ReduceOp::Sum, 3),
            (ReduceOp::Avg, 1),
        ] {
            let mut rot = all.clone();
            rot.rotate_left(2 * shift);
            let case = Case {
                coll: Coll::AllReduce(op, accum),
                dtype,
                world: 2,
                n: 65_536,
                offset: 0,
                in_place: false,
            };
            let pad = |v: &[u8]| [v, &[0u8; 6][..]].concat();
            let mut arenas = vec![pad(&all), pad(&rot)];
            if op != ReduceOp::Max {
                for a in &mut arenas {
                    for c in a.chunks_exact_mut(2) {
                        let b = u16::from_le_bytes([c[0], c[1]]);
                        let nan = match dtype {
                            DType::F16 => f16::from_bits(b).is_nan(),
                            _ => bf16::from_bits(b).is_nan(),
                        };
                        if nan {
                            c.copy_from_slice(&0x3c00u16.to_le_bytes());
                        }
                    }
                }
            }
            let want = on_threads(&case, &arenas);
            let got = on_emulator(&mut emu, &case, &arenas, &mut Rng(7));
            assert!(
                got == want,
                "{case:?}: the emulated half kernels differ from the thread backend"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Plans (no emulator needed).

fn bufs(world: usize, base: u64, input: bool) -> Vec<RankBuffers> {
    (0..world as u64)
        .map(|r| RankBuffers {
            input: input.then_some(base + (r + 1) * (1 << 32)),
            output: base + (r + 1) * (1 << 32) + (1 << 20),
        })
        .collect()
}

#[test]
fn reduce_kernels_cover_every_supported_pair_in_table_order() {
    for (i, k) in ReduceKernel::ALL.iter().enumerate() {
        assert_eq!(k.index(), i);
    }
    for (dtype, accum) in REDUCTIONS {
        let k = ReduceKernel::new(dtype, accum).unwrap();
        assert_eq!(k.elem_size(), dtype.size() as u64);
    }
    assert_eq!(ReduceKernel::new(DType::F32, DType::F16), None);
    assert_eq!(ReduceKernel::new(DType::U8, DType::U8), None);
}

#[test]
fn aligned_buffers_take_the_16_byte_paths_and_misaligned_ones_do_not() {
    let case = |offset| Case {
        coll: Coll::ReduceScatter(ReduceOp::Sum, DType::F32),
        dtype: DType::F32,
        world: 4,
        n: 64,
        offset,
        in_place: false,
    };
    let run = |offset: u64| {
        let c = case(offset as usize);
        plan(1, &c.desc(1), &bufs(4, offset * 4, true)).unwrap()
    };
    match &run(0)[0][..] {
        [Launch::Reduce { vec, n, srcs, .. }] => {
            assert!(*vec);
            assert_eq!(*n, 64);
            // Chunk 1 of every rank's input.
            assert!(srcs.iter().all(|s| s % (1 << 32) == 64 * 4));
        }
        other => panic!("{other:?}"),
    }
    match &run(1)[0][..] {
        [Launch::Reduce { vec, .. }] => assert!(!*vec),
        other => panic!("{other:?}"),
    }
    // An all-gather from 16-byte aligned buffers copies 16-byte words; in place, the rank's
    // own chunk is not copied.
    let ag = Case {
        coll: Coll::AllGather,
        dtype: DType::BF16,
        world: 3,
        n: 8,
        offset: 0,
        in_place: true,
    };
    let mut b = bufs(3, 0, true);
    for (r, x) in b.iter_mut().enumerate() {
        x.input = Some(x.output + r as u64 * 16);
    }
    match &plan(2, &ag.desc(2), &b).unwrap()[0][..] {
        [Launch::Copy {
            srcs,
            unit,
            chunk,
            total,
            ..
        }] => {
            assert_eq!(*unit, 16);
            assert_eq!((*chunk, *total), (16, 48));
            assert_eq!(srcs[2], 0);
            assert!(srcs[0] != 0 && srcs[1] != 0);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn all_reduce_chunks_tile_the_buffer_once() {
    for world in 1..=9usize {
        for len in [0usize, 1, 3, 4, 17, 64, 1001] {
            let case = Case {
                coll: Coll::AllReduce(ReduceOp::Sum, DType::F32),
                dtype: DType::F16,
                world,
                n: len,
                offset: 0,
                in_place: false,
            };
            let b = bufs(world, 0, false);
            let mut reduced = vec![0u32; len];
            for r in 0..world {
                let phases = plan(r, &case.desc(r), &b).unwrap();
                assert_eq!(phases.len(), 2);
                for l in &phases[0] {
                    let Launch::Reduce { dst, n, .. } = l else {
                        panic!("{l:?}")
                    };
                    let start = ((dst - b[r].output) / 2) as usize;
                    for c in &mut reduced[start..start + *n as usize] {
                        *c += 1;
                    }
                }
            }
            assert!(
                reduced.iter().all(|&c| c == 1),
                "W={world} len={len}: {reduced:?}"
            );
        }
    }
}

#[test]
fn groups_beyond_the_kernel_limit_and_empty_groups_are_refused() {
    use crate::error::CollectiveError;
    for w in [0, super::MAX_SHARED_GPU_RANKS + 1] {
        let e = super::SharedGpuGroup::new(w, 0).unwrap_err();
        assert!(matches!(e, CollectiveError::InvalidGroup { .. }), "{e}");
    }
}

/// `cargo xtask nvrtc` (FSDP_NVRTC_REQUIRED=1): NVRTC compiles `kernels.cu` and the PTX has
/// every entry point `plan` launches.
#[cfg(feature = "cuda")]
#[test]
fn nvrtc_compiles_the_shared_gpu_kernels() {
    // SAFETY: `is_culib_present` only tries to load the library; no precondition.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        if std::env::var("FSDP_NVRTC_REQUIRED").as_deref() == Ok("1") {
            panic!("FSDP_NVRTC_REQUIRED=1 but libnvrtc could not be loaded (LD_LIBRARY_PATH?)");
        }
        eprintln!("SKIPPED nvrtc_compiles_the_shared_gpu_kernels: libnvrtc not found");
        return;
    }
    let ptx = super::exec::ptx().unwrap_or_else(|e| panic!("{e}"));
    let text = ptx.to_src();
    let names = ReduceKernel::ALL
        .iter()
        .map(|k| k.name())
        .chain([super::plan::COPY_KERNEL]);
    for name in names {
        assert!(
            text.contains(&format!(".entry {name}(")),
            "the PTX has no entry point {name}"
        );
    }
}
