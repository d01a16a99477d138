//! Property tests: random alloc/free sequences over three streams keep the allocator's
//! invariants, and a block freed with `record_stream` is never used by its next owner before the
//! event recorded on the using stream has completed — it is handed out after the event, or (the
//! compact policy) with the new owner's stream waiting for it; checked mode is on, so any
//! unordered reuse would also fail a stream.

use fsdp_alloc::{AllocError, Buffer, BufferRef, Capacity, Device, DeviceConfig, Event};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        stream: usize,
        size: usize,
    },
    Free {
        idx: usize,
    },
    FreeAfterUse {
        idx: usize,
        user: usize,
        sleep_us: u64,
    },
    EmptyCache,
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..8192,
        3 => 8192usize..(1 << 20) + 1,
        1 => (1usize << 20)..(12 << 20),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0usize..3, size()).prop_map(|(stream, size)| Op::Alloc { stream, size }),
        2 => any::<usize>().prop_map(|idx| Op::Free { idx }),
        3 => (any::<usize>(), 0usize..3, 0u64..300)
            .prop_map(|(idx, user, sleep_us)| Op::FreeAfterUse { idx, user, sleep_us }),
        1 => Just(Op::EmptyCache),
    ]
}

fn head(b: &BufferRef) -> BufferRef {
    b.slice(0, b.len().min(64)).unwrap()
}

fn run(ops: Vec<Op>, capped: bool) -> Result<(), TestCaseError> {
    let cap = if capped {
        Capacity::Bytes(48 << 20)
    } else {
        Capacity::Unlimited
    };
    let dev = Device::cpu_with(
        0,
        DeviceConfig::default()
            .with_checked(true)
            .with_capacity(cap),
    );
    let streams = [
        dev.default_stream().clone(),
        dev.new_stream("comm"),
        dev.new_stream("aux"),
    ];
    let mut live: Vec<(Buffer, usize)> = Vec::new();
    // Freed-with-record_stream blocks: their ref and an event recorded on the user stream
    // after its last use and before the free (so it completes no later than the allocator's).
    let mut pending: Vec<(BufferRef, Event)> = Vec::new();
    for op in ops {
        match op {
            Op::Alloc { stream, size } => {
                let before = dev.memory_stats();
                match dev.alloc(size, &streams[stream]) {
                    Ok(b) => {
                        // Reuse of a block freed with record_stream is ordered after the event
                        // on the using stream: handed out only once it completed, or with the
                        // new stream waiting for it (compact policy). Checked in stream order:
                        // a failing check fails the stream and the final synchronize.
                        for (r, ev) in &pending {
                            if b.data().overlaps(r) && !ev.query() {
                                let ev = ev.clone();
                                streams[stream].launch(move || {
                                    assert!(ev.query(), "block reused before the event");
                                });
                            }
                        }
                        for (o, _) in &live {
                            prop_assert!(!b.data().overlaps(o.data()), "live blocks overlap");
                        }
                        let w = head(b.data());
                        streams[stream].launch(move || w.write::<u8>().unwrap().fill(1));
                        live.push((b, stream));
                    }
                    Err(AllocError::OutOfMemory { requested, .. }) => {
                        prop_assert!(capped, "OOM without a capacity");
                        prop_assert_eq!(requested, size);
                        let after = dev.memory_stats();
                        prop_assert_eq!(after.num_ooms, before.num_ooms + 1);
                        prop_assert!(after.num_alloc_retries > before.num_alloc_retries);
                    }
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            Op::Free { idx } => {
                if !live.is_empty() {
                    let i = idx % live.len();
                    live.swap_remove(i);
                }
            }
            Op::FreeAfterUse {
                idx,
                user,
                sleep_us,
            } => {
                if !live.is_empty() {
                    let (mut b, owner) = live.swap_remove(idx % live.len());
                    let u = &streams[user];
                    u.wait_event(&streams[owner].record_event());
                    let r = head(b.data());
                    u.launch(move || {
                        std::thread::sleep(std::time::Duration::from_micros(sleep_us));
                        let _sum: u32 = r.read::<u8>().unwrap().iter().map(|&x| x as u32).sum();
                    });
                    if user != owner {
                        let ev = u.record_event();
                        b.record_stream(u);
                        pending.push((b.data().clone(), ev));
                    }
                    drop(b);
                }
            }
            Op::EmptyCache => dev.empty_cache(),
        }
        dev.allocator().validate().map_err(TestCaseError::fail)?;
        let st = dev.memory_stats();
        let live_bytes: usize = live.iter().map(|(b, _)| b.allocated_size()).sum();
        prop_assert_eq!(st.allocated_bytes, live_bytes);
        prop_assert_eq!(st.num_allocations as usize, live.len());
        prop_assert!(st.active_bytes >= st.allocated_bytes);
        prop_assert!(st.reserved_bytes >= st.active_bytes);
        if let Capacity::Bytes(c) = cap {
            prop_assert!(st.reserved_bytes <= c);
        }
    }
    drop(live);
    dev.synchronize()
        .map_err(|e| TestCaseError::fail(format!("checked mode found a bug: {e}")))?;
    let st = dev.memory_stats();
    prop_assert_eq!(st.allocated_bytes, 0);
    prop_assert_eq!(st.active_bytes, 0);
    prop_assert_eq!(st.num_pending_frees, 0);
    prop_assert_eq!(st.requested_bytes, 0);
    dev.allocator().validate().map_err(TestCaseError::fail)?;
    dev.empty_cache();
    let st = dev.memory_stats();
    prop_assert_eq!(st.reserved_bytes, 0);
    prop_assert_eq!(st.num_raw_mallocs, st.num_raw_frees);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_invariants(ops in prop::collection::vec(op(), 1..48)) {
        run(ops, false)?;
    }

    #[test]
    fn random_sequences_under_a_capacity_cap(ops in prop::collection::vec(op(), 1..48)) {
        run(ops, true)?;
    }
}
