//! `all_to_all_into` of the thread backend against a plain reference (every world size in
//! {1, 2, 3, 4, 5, 8}, several dtypes, with and without link emulation), its argument errors on
//! every rank, and the int8 codec's error bound as a property.

mod common;

use std::time::Duration;

use common::*;
use fsdp_alloc::DType;
use fsdp_collectives::{
    CollectiveError, DeviceSlice, GroupConfig, Int8Codec, LinkModel, OpKind, ProcessGroup,
    ThreadGroup,
};
use half::bf16;
use proptest::prelude::*;

/// What rank `r` must hold after the exchange: chunk `r` of every rank's input, in rank order.
fn expected<T: TestElem>(seed: u64, w: usize, n: usize, r: usize) -> Vec<T> {
    (0..w)
        .flat_map(|p| data::<T>(seed, p, w * n)[r * n..(r + 1) * n].to_vec())
        .collect()
}

fn check_all_to_all<T: TestElem>(groups: Vec<ThreadGroup>, n: usize, seed: u64) {
    let w = groups.len();
    let outs = run_ranks(groups, |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, w * n));
        let (_ob, output) = alloc_out::<T>(&r.dev, &r.stream, w * n);
        r.pg.all_to_all_into(&input, &output, &r.stream)
            .wait()
            .unwrap();
        download::<T>(&output)
    });
    for (rank, o) in outs.iter().enumerate() {
        assert_eq!(
            bits(o),
            bits(&expected::<T>(seed, w, n, rank)),
            "all_to_all {} W={w} n={n} rank {rank}",
            T::DTYPE
        );
    }
}

#[test]
fn every_world_size_and_dtype_matches_the_reference() {
    for w in [1, 2, 3, 4, 5, 8] {
        for n in [0, 1, 7, 100] {
            check_all_to_all::<f32>(ThreadGroup::new(w), n, 11 + w as u64);
            check_all_to_all::<u8>(ThreadGroup::new(w), n, 12);
            check_all_to_all::<bf16>(ThreadGroup::new(w), n, 13);
            check_all_to_all::<i64>(ThreadGroup::new(w), n, 14);
        }
    }
}

#[test]
fn link_emulation_keeps_the_result_and_charges_the_wire_bytes() {
    // 4 ranks, 64 KiB per rank, a 10 MB/s link: each rank receives 3/4 of 64 KiB = 48 KiB,
    // about 4.9 ms on the link.
    let link = LinkModel {
        latency: Duration::ZERO,
        bytes_per_sec: 10e6,
    };
    let t0 = std::time::Instant::now();
    check_all_to_all::<f32>(
        ThreadGroup::with_config(4, GroupConfig::default().with_link(link)),
        4096,
        5,
    );
    assert!(
        t0.elapsed() >= Duration::from_micros(4900),
        "{:?}",
        t0.elapsed()
    );
}

/// Every rank runs `issue` with its own (input length, output length, dtype) and must get the
/// same kind of error.
fn all_fail(
    w: usize,
    args: impl Fn(usize) -> (usize, usize, DType) + Sync,
) -> Vec<CollectiveError> {
    run_ranks(ThreadGroup::new(w), |r| {
        let (ilen, olen, dtype) = args(r.rank);
        let ib = r.dev.alloc(ilen * dtype.size(), &r.stream).unwrap();
        let ob = r.dev.alloc(olen * dtype.size(), &r.stream).unwrap();
        let input = DeviceSlice::from_buffer(&ib, dtype).unwrap();
        let output = DeviceSlice::from_buffer(&ob, dtype).unwrap();
        r.pg.all_to_all_into(&input, &output, &r.stream)
            .wait()
            .unwrap_err()
    })
}

#[test]
fn bad_arguments_fail_on_every_rank() {
    // Not a multiple of the world size.
    for e in all_fail(3, |_| (8, 8, DType::F32)) {
        assert!(
            matches!(
                e,
                CollectiveError::SizeMismatch {
                    op: OpKind::AllToAll,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("multiple of the world size"), "{e}");
    }
    // Input and output lengths differ.
    for e in all_fail(2, |_| (8, 4, DType::F32)) {
        assert!(matches!(e, CollectiveError::SizeMismatch { .. }), "{e}");
    }
    // One rank passes other lengths than the others: every rank reports it.
    for e in all_fail(2, |r| {
        if r == 0 {
            (4, 4, DType::U8)
        } else {
            (6, 6, DType::U8)
        }
    }) {
        assert!(matches!(e, CollectiveError::InconsistentArgs { .. }), "{e}");
    }
}

#[test]
fn overlapping_buffers_are_refused() {
    let errs = run_ranks(ThreadGroup::new(2), |r| {
        let b = r.dev.alloc(64, &r.stream).unwrap();
        let s = DeviceSlice::from_buffer(&b, DType::F32).unwrap();
        r.pg.all_to_all_into(&s, &s, &r.stream).wait().unwrap_err()
    });
    for e in errs {
        assert!(
            matches!(
                e,
                CollectiveError::InvalidBuffer {
                    op: OpKind::AllToAll,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("no in-place form"), "{e}");
    }
}

#[test]
fn other_process_groups_get_a_typed_unsupported_error() {
    /// A group that implements only the required methods (delegating to a thread group).
    #[derive(Debug)]
    struct Minimal(ThreadGroup);
    impl ProcessGroup for Minimal {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn size(&self) -> usize {
            self.0.size()
        }
        fn name(&self) -> String {
            "minimal".into()
        }
        fn all_gather_into(
            &self,
            i: &DeviceSlice,
            o: &DeviceSlice,
            s: &fsdp_alloc::Stream,
        ) -> fsdp_collectives::Work {
            self.0.all_gather_into(i, o, s)
        }
        fn reduce_scatter_with(
            &self,
            i: &DeviceSlice,
            o: &DeviceSlice,
            op: fsdp_collectives::ReduceOp,
            a: DType,
            s: &fsdp_alloc::Stream,
        ) -> fsdp_collectives::Work {
            self.0.reduce_scatter_with(i, o, op, a, s)
        }
        fn all_reduce_with(
            &self,
            b: &DeviceSlice,
            op: fsdp_collectives::ReduceOp,
            a: DType,
            s: &fsdp_alloc::Stream,
        ) -> fsdp_collectives::Work {
            self.0.all_reduce_with(b, op, a, s)
        }
        fn broadcast(
            &self,
            b: &DeviceSlice,
            root: usize,
            s: &fsdp_alloc::Stream,
        ) -> fsdp_collectives::Work {
            self.0.broadcast(b, root, s)
        }
        fn barrier(&self) -> fsdp_collectives::Result<()> {
            self.0.barrier()
        }
        fn split(
            &self,
            parts: &[Vec<usize>],
        ) -> fsdp_collectives::Result<std::sync::Arc<dyn ProcessGroup>> {
            self.0.split(parts)
        }
    }
    let g = Minimal(ThreadGroup::new(1).pop().unwrap());
    let dev = fsdp_alloc::Device::cpu(0);
    let stream = dev.new_stream("s");
    let (_ib, input) = upload(&dev, &stream, &[1f32, 2.0]);
    let (_ob, output) = alloc_out::<f32>(&dev, &stream, 2);
    let e = g
        .all_to_all_into(&input, &output, &stream)
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            e,
            CollectiveError::Unsupported {
                op: OpKind::AllToAll,
                ..
            }
        ),
        "{e}"
    );
    // The stream is failed: nothing after it consumes the unwritten output.
    assert!(stream.synchronize().is_err());
}

fn values() -> impl Strategy<Value = Vec<f32>> {
    let magnitude = prop_oneof![Just(1e-30f32), Just(1e-3), Just(1.0), Just(1e4), Just(1e30)];
    (magnitude, prop::collection::vec(-1.0f32..1.0, 0..600))
        .prop_map(|(m, v)| v.into_iter().map(|x| x * m).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every decoded value is within half a step (`scale / 2 = max|block| / 254`) of the input,
    /// up to the f32 rounding of `code × scale`; decode_add adds exactly the decoded values.
    #[test]
    fn int8_error_is_at_most_half_a_step(v in values(), block in 1usize..300) {
        let codec = Int8Codec::new(block).unwrap();
        let mut packet = vec![0u8; codec.packed_len(v.len())];
        codec.encode(&v, &mut packet).unwrap();
        let mut out = vec![0f32; v.len()];
        codec.decode(&packet, &mut out).unwrap();
        for (b, (xs, ys)) in v.chunks(block).zip(out.chunks(block)).enumerate() {
            let absmax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = absmax / 127.0;
            // Half a step, plus a few ulps of the operands for the float arithmetic.
            let bound = scale / 2.0 + absmax * 4.0 * f32::EPSILON;
            for (x, y) in xs.iter().zip(ys) {
                prop_assert!(
                    (x - y).abs() <= bound,
                    "block {b}: {x} decoded as {y}, error {} > {bound} (absmax {absmax})",
                    (x - y).abs()
                );
            }
        }
        let mut acc = out.clone();
        codec.decode_add(&packet, &mut acc).unwrap();
        for (a, o) in acc.iter().zip(&out) {
            prop_assert_eq!(*a, o + o);
        }
    }
}
