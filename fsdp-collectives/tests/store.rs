//! The TCP rendezvous store on loopback (127.0.0.1, ephemeral ports, bounded timeouts), with
//! several client threads, and the launch-environment parsing. Hostile-client tests: a flood of
//! short connections, random byte streams, unauthenticated clients, wrong barrier world sizes,
//! oversized keys and values.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use fsdp_collectives::store::{Launcher, StoreLimits, StoreOptions, StoreSecret, StoreServer};
use fsdp_collectives::{CollectiveError, RendezvousEnv, TcpStore};
use proptest::prelude::*;

const T: Duration = Duration::from_secs(10);

/// The descriptor-count test needs the process to itself: it takes this for writing, every
/// other test for reading.
static FDS: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    FDS.read().unwrap_or_else(|e| e.into_inner())
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    FDS.write().unwrap_or_else(|e| e.into_inner())
}

fn secret(s: &str) -> StoreSecret {
    StoreSecret::new(s.as_bytes().to_vec()).unwrap()
}

fn opts() -> StoreOptions {
    StoreOptions::new(T)
}

#[test]
fn clients_set_get_add_and_barrier_across_threads() {
    let _g = shared();
    let host = TcpStore::host("127.0.0.1:0", T).unwrap();
    assert!(host.is_host());
    let addr = host.addr().to_string();
    let n = 4;
    let seen = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let addr = addr.clone();
                s.spawn(move || {
                    let c = TcpStore::connect(&addr, T).unwrap();
                    assert!(!c.is_host());
                    c.set(&format!("rank/{i}"), format!("hello from {i}").as_bytes())
                        .unwrap();
                    c.add("count", 1).unwrap();
                    c.barrier("b0", n).unwrap();
                    // After the barrier every rank's key is set.
                    assert!(c.check(&format!("rank/{}", (i + 1) % n)).unwrap());
                    let all: Vec<String> = (0..n)
                        .map(|j| String::from_utf8(c.get(&format!("rank/{j}")).unwrap()).unwrap())
                        .collect();
                    all
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for all in seen {
        assert_eq!(
            all,
            (0..n)
                .map(|j| format!("hello from {j}"))
                .collect::<Vec<_>>()
        );
    }
    assert_eq!(host.add("count", 0).unwrap(), n as i64);
    assert!(!host.check("never-set").unwrap());
}

#[test]
fn get_blocks_until_another_client_sets_the_key() {
    let _g = shared();
    let host = TcpStore::host("127.0.0.1:0", T).unwrap();
    let addr = host.addr().to_string();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            TcpStore::connect(&addr, T)
                .unwrap()
                .set("late", b"value")
                .unwrap();
        });
        assert_eq!(host.get("late").unwrap(), b"value");
    });
    assert!(t0.elapsed() >= Duration::from_millis(100));
    host.wait(&["late"]).unwrap();
}

#[test]
fn get_of_a_missing_key_times_out_with_a_typed_error() {
    let _g = shared();
    let store = TcpStore::host("127.0.0.1:0", Duration::from_millis(200)).unwrap();
    let t0 = Instant::now();
    let e = store.get("missing").unwrap_err();
    let took = t0.elapsed();
    assert!(
        matches!(&e, CollectiveError::StoreTimeout { key, .. } if key == "missing"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(e.to_string().contains("MASTER_ADDR/MASTER_PORT"), "{e}");
    let e = store.wait(&["also-missing"]).unwrap_err();
    assert!(matches!(e, CollectiveError::StoreTimeout { .. }));
}

#[test]
fn connecting_to_nothing_fails_within_the_timeout() {
    let _g = shared();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }; // nothing listens there any more
    let t0 = Instant::now();
    let e =
        TcpStore::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, CollectiveError::StoreIo { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[test]
fn a_client_waiting_when_the_server_goes_away_gets_an_error() {
    let _g = shared();
    let host = TcpStore::host("127.0.0.1:0", T).unwrap();
    let client = TcpStore::connect(&host.addr().to_string(), T).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let h = s.spawn(|| client.get("never"));
        std::thread::sleep(Duration::from_millis(100));
        drop(host);
        assert!(h.join().unwrap().is_err());
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
}

fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn launch_environment_is_parsed_with_typed_errors() {
    let good = [
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let e = RendezvousEnv::from_lookup(env(&good)).unwrap();
    assert_eq!(
        e,
        RendezvousEnv {
            rank: 2,
            world_size: 4,
            local_rank: None,
            launcher: Launcher::Torchrun,
            master_addr: "127.0.0.1".into(),
            master_port: 29500
        }
    );
    assert_eq!(e.master(), "127.0.0.1:29500");
    for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        let vars: Vec<_> = good
            .iter()
            .copied()
            .filter(|(k, _)| *k != missing)
            .collect();
        let err = RendezvousEnv::from_lookup(env(&vars)).unwrap_err();
        assert_eq!(err, CollectiveError::MissingEnv { var: missing });
    }
    let bad = |k: &str, v: &str| {
        let vars: Vec<_> = good
            .iter()
            .map(|&(kk, vv)| (kk, if kk == k { v } else { vv }))
            .collect();
        RendezvousEnv::from_lookup(env(&vars)).unwrap_err()
    };
    for (k, v) in [
        ("RANK", "two"),
        ("RANK", "4"),
        ("WORLD_SIZE", "0"),
        ("WORLD_SIZE", "-1"),
        ("MASTER_PORT", "0"),
        ("MASTER_PORT", "70000"),
        ("MASTER_ADDR", "  "),
    ] {
        let err = bad(k, v);
        assert!(
            matches!(&err, CollectiveError::InvalidEnv { var, .. } if *var == k),
            "{k}={v}: {err}"
        );
    }
}

#[test]
fn ranks_rendezvous_through_the_environment() {
    let _g = shared();
    // A free port for rank 0's store (bound and released; loopback only).
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let n = 3;
    let got = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                s.spawn(move || {
                    let vars = [
                        ("RANK", rank.to_string()),
                        ("WORLD_SIZE", n.to_string()),
                        ("MASTER_ADDR", "127.0.0.1".to_string()),
                        ("MASTER_PORT", port.to_string()),
                    ];
                    let lookup =
                        move |k: &str| vars.iter().find(|(kk, _)| *kk == k).map(|(_, v)| v.clone());
                    let e = RendezvousEnv::from_lookup(lookup).unwrap();
                    // Non-zero ranks may start first: connect retries until rank 0 is up.
                    if rank == 0 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    let store = TcpStore::rendezvous(&e, T).unwrap();
                    assert_eq!(store.is_host(), rank == 0);
                    if rank == 0 {
                        store.set("id", b"unique-id-bytes").unwrap();
                    }
                    let id = store.get("id").unwrap();
                    // Rank 0 hosts the server: it leaves only after every other rank is done.
                    if rank == 0 {
                        store.get("all-left").unwrap();
                    } else if store.add("left", 1).unwrap() == (n - 1) as i64 {
                        store.set("all-left", b"").unwrap();
                    }
                    id
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(got.iter().all(|id| id == b"unique-id-bytes"));
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Polls `f` until it holds or `within` passes.
fn eventually(within: Duration, f: impl Fn() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// A raw connection that has read the server's 41-byte greeting.
fn raw(addr: &str) -> (TcpStream, [u8; 41]) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mut greet = [0u8; 41];
    s.read_exact(&mut greet).unwrap();
    (s, greet)
}

/// A hello for an open store (no tag).
fn open_hello() -> Vec<u8> {
    let mut h = b"FSDPSTv1".to_vec();
    h.extend_from_slice(&[7u8; 64]);
    h
}

fn frame(cmd: u8, key: &[u8], arg: u64, value: &[u8]) -> Vec<u8> {
    let mut f = vec![cmd];
    f.extend_from_slice(&(key.len() as u32).to_be_bytes());
    f.extend_from_slice(key);
    f.extend_from_slice(&arg.to_be_bytes());
    f.extend_from_slice(&(value.len() as u32).to_be_bytes());
    f.extend_from_slice(value);
    f
}

/// Reads until the server closes the connection (bounded by the read timeout).
fn read_to_close(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(out)
}

#[test]
fn a_flood_of_short_connections_leaves_descriptors_flat_and_ranks_still_rendezvous() {
    let _g = exclusive();
    let key = "flood-test-secret-0123456789";
    let limits = StoreLimits {
        max_connections: 32,
        handshake_timeout: Duration::from_secs(2),
        ..StoreLimits::default()
    };
    let host = TcpStore::host_with(
        "127.0.0.1:0",
        opts()
            .with_secret(secret(key))
            .with_world_size(2)
            .with_limits(limits),
    )
    .unwrap();
    let addr = host.addr().to_string();
    let server = host.server().unwrap();
    assert_eq!(server.connection_count(), 1);
    let before = fd_count();
    let t0 = Instant::now();
    // 1,000 connections from 8 threads, five kinds in turn: connect-and-close, greeting then
    // close, garbage hello, wrong secret (full client), and a burst held open so the
    // connection limit is hit (those get the busy greeting and are closed by the server).
    std::thread::scope(|s| {
        for t in 0..8 {
            let addr = addr.clone();
            s.spawn(move || {
                let mut held = Vec::new();
                for i in 0..125 {
                    match (t * 125 + i) % 5 {
                        0 => drop(TcpStream::connect(&addr).unwrap()),
                        1 => drop(raw(&addr)),
                        2 => {
                            let (mut c, greet) = raw(&addr);
                            let _ = c.write_all(&[0xAB; 72]);
                            let reply = read_to_close(&mut c).unwrap_or_default();
                            if greet[8] != 2 {
                                // Not refused as busy: the bad hello gets ST_ERROR, then EOF.
                                assert_eq!(reply.first(), Some(&3), "ST_ERROR then closed");
                            }
                        }
                        3 => {
                            let o = StoreOptions::new(Duration::from_secs(2))
                                .with_secret(secret("not-the-right-secret-000"));
                            match TcpStore::connect_with(&addr, o) {
                                Err(CollectiveError::StoreAuth { .. }) => {}
                                // Refused as busy until the deadline: also not in.
                                Err(CollectiveError::StoreIo { message, .. })
                                    if message.contains("busy") => {}
                                other => panic!("wrong-secret client: {other:?}"),
                            }
                        }
                        _ => {
                            held.push(TcpStream::connect(&addr).unwrap());
                            if held.len() == 8 {
                                held.clear();
                            }
                        }
                    }
                }
            });
        }
    });
    let flood_took = t0.elapsed();
    assert!(
        eventually(Duration::from_secs(10), || server.connection_count() == 1),
        "connections left open: {}",
        server.connection_count()
    );
    assert!(
        eventually(Duration::from_secs(10), || fd_count() <= before),
        "descriptors grew from {before} to {} after 1,000 connections",
        fd_count()
    );
    // The real second rank still gets in, and both pass a barrier of the job's size.
    std::thread::scope(|s| {
        s.spawn(|| {
            let rank1 = TcpStore::connect_with(&addr, opts().with_secret(secret(key))).unwrap();
            rank1.set("rank1", b"here").unwrap();
            rank1.barrier("after-flood", 2).unwrap();
        });
        host.barrier("after-flood", 2).unwrap();
        assert_eq!(host.get("rank1").unwrap(), b"here");
    });
    assert!(flood_took < Duration::from_secs(60), "{flood_took:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever bytes a client sends (before or after a valid hello, with or without a valid
    /// command byte first), the store stays usable and the connection is forgotten once the
    /// client is gone.
    #[test]
    fn random_byte_streams_leave_the_store_usable(
        after_hello in any::<bool>(),
        cmd in 0u8..8,
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let _g = shared();
        let limits = StoreLimits { max_total_bytes: 1 << 20, ..StoreLimits::default() };
        let host = TcpStore::host_with("127.0.0.1:0", opts().with_limits(limits)).unwrap();
        let addr = host.addr().to_string();
        {
            let (mut c, greet) = raw(&addr);
            prop_assert_eq!(&greet[..8], b"FSDPSTv1");
            let mut stream = Vec::new();
            if after_hello {
                stream.extend_from_slice(&open_hello());
                stream.push(cmd);
            }
            stream.extend_from_slice(&bytes);
            // The server may close before taking everything: ignore write errors.
            let _ = c.write_all(&stream);
            let _ = c.shutdown(Shutdown::Write);
            // The server ends the connection (EOF, protocol error or hang-up) within bounds.
            let t0 = Instant::now();
            let _ = read_to_close(&mut c);
            prop_assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        }
        host.set("still", b"usable").unwrap();
        prop_assert_eq!(host.get("still").unwrap(), b"usable".to_vec());
        let server = host.server().unwrap();
        prop_assert!(
            eventually(Duration::from_secs(5), || server.connection_count() == 1),
            "connections: {}", server.connection_count()
        );
        let other = TcpStore::connect_with(&addr, opts()).unwrap();
        prop_assert_eq!(other.get("still").unwrap(), b"usable".to_vec());
    }
}

#[test]
fn a_client_without_the_secret_can_neither_read_nor_write() {
    let _g = shared();
    let key = "the-shared-secret-of-this-job";
    let host = TcpStore::host_with("127.0.0.1:0", opts().with_secret(secret(key))).unwrap();
    assert!(host.server().unwrap().is_authenticated());
    host.set("nccl-id", b"precious").unwrap();
    let addr = host.addr().to_string();
    let quick = || StoreOptions::new(Duration::from_secs(2));

    // No secret: refused before sending anything.
    let e = TcpStore::connect_with(&addr, quick()).unwrap_err();
    assert!(matches!(&e, CollectiveError::StoreAuth { .. }), "{e}");
    assert!(e.to_string().contains("FSDP_STORE_SECRET"), "{e}");
    // Wrong secret: the server refuses it.
    let e = TcpStore::connect_with(&addr, quick().with_secret(secret("a-different-secret-xx")))
        .unwrap_err();
    assert!(matches!(&e, CollectiveError::StoreAuth { .. }), "{e}");
    // A hand-written client that ignores the challenge and sends commands anyway: the server
    // answers the bad hello with an auth refusal and closes; nothing it sent is read.
    let (mut c, greet) = raw(&addr);
    assert_eq!(greet[8], 1, "the greeting asks for authentication");
    let mut stream = open_hello();
    stream.extend_from_slice(&frame(1, b"nccl-id", 0, b"overwritten"));
    stream.extend_from_slice(&frame(2, b"nccl-id", 0, b""));
    let _ = c.write_all(&stream);
    let reply = read_to_close(&mut c).unwrap_or_default();
    assert_eq!(reply.first(), Some(&4), "ST_AUTH");
    assert!(!String::from_utf8_lossy(&reply).contains("precious"));
    assert_eq!(host.get("nccl-id").unwrap(), b"precious");
    // A client with a secret refuses an open store (it could be an impostor).
    let open = TcpStore::host_with("127.0.0.1:0", opts()).unwrap();
    let e = TcpStore::connect_with(&open.addr().to_string(), quick().with_secret(secret(key)))
        .unwrap_err();
    assert!(matches!(&e, CollectiveError::StoreAuth { .. }), "{e}");
    // The right secret works, and secrets are checked and redacted.
    let ok = TcpStore::connect_with(&addr, opts().with_secret(secret(key))).unwrap();
    assert_eq!(ok.get("nccl-id").unwrap(), b"precious");
    assert!(!format!("{:?}", secret(key)).contains(key));
    assert!(matches!(
        StoreSecret::new(b"short".to_vec()),
        Err(CollectiveError::InvalidEnv {
            var: "FSDP_STORE_SECRET",
            ..
        })
    ));
}

#[test]
fn a_barrier_with_a_wrong_world_size_is_a_typed_error() {
    let _g = shared();
    // A 2-rank job: a barrier of size 1 must not pass alone.
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let env = |rank: usize| {
        RendezvousEnv::from_lookup(|k| match k {
            "RANK" => Some(rank.to_string()),
            "WORLD_SIZE" => Some("2".into()),
            "MASTER_ADDR" => Some("127.0.0.1".into()),
            "MASTER_PORT" => Some(port.to_string()),
            _ => None,
        })
        .unwrap()
    };
    let o = || StoreOptions::new(Duration::from_secs(5)).with_secret(secret("barrier-secret-0000"));
    std::thread::scope(|s| {
        s.spawn(|| {
            let r1 = TcpStore::rendezvous_with(&env(1), o()).unwrap();
            r1.barrier("together", 2).unwrap();
        });
        let r0 = TcpStore::rendezvous_with(&env(0), o()).unwrap();
        let t0 = Instant::now();
        let e = r0.barrier("alone", 1).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(2), "refused at once");
        assert_eq!(
            e,
            CollectiveError::StoreBarrier {
                addr: r0.addr().to_string(),
                name: "alone".into(),
                got: 1,
                expected: 2,
                source_of_expected: "job's world size",
            }
        );
        r0.barrier("together", 2).unwrap();
        // A barrier name used twice is refused instead of passing at once.
        let e = r0.barrier("together", 2).unwrap_err();
        assert!(
            matches!(&e, CollectiveError::StoreProtocol { detail, .. } if detail.contains("fresh name")),
            "{e}"
        );
    });

    // A store that does not know the job's size: callers must agree with the first one.
    let host =
        TcpStore::host_with("127.0.0.1:0", StoreOptions::new(Duration::from_secs(3))).unwrap();
    let addr = host.addr().to_string();
    std::thread::scope(|s| {
        let h = s.spawn(|| host.barrier("b", 2));
        assert!(eventually(Duration::from_secs(2), || host
            .server()
            .unwrap()
            .stored_bytes()
            > 0));
        let c = TcpStore::connect_with(&addr, StoreOptions::new(Duration::from_secs(3))).unwrap();
        let e = c.barrier("b", 3).unwrap_err();
        assert!(
            matches!(
                e,
                CollectiveError::StoreBarrier {
                    got: 3,
                    expected: 2,
                    ..
                }
            ),
            "{e}"
        );
        c.barrier("b", 2).unwrap();
        h.join().unwrap().unwrap();
    });
    assert!(matches!(
        host.barrier("zero", 0),
        Err(CollectiveError::StoreProtocol { .. })
    ));
}

#[test]
fn oversized_keys_values_and_totals_are_refused() {
    let _g = shared();
    let limits = StoreLimits {
        max_key_len: 64,
        max_value_len: 1000,
        max_total_bytes: 1500,
        ..StoreLimits::default()
    };
    let host = TcpStore::host_with("127.0.0.1:0", opts().with_limits(limits.clone())).unwrap();
    let addr = host.addr().to_string();
    // Checked locally first: the connection stays in step.
    let e = host.set(&"k".repeat(65), b"v").unwrap_err();
    assert!(
        matches!(
            e,
            CollectiveError::StoreLimit {
                what: "key",
                size: 65,
                limit: 64,
                ..
            }
        ),
        "{e}"
    );
    let e = host.set("k", &[0u8; 1001]).unwrap_err();
    assert!(
        matches!(
            e,
            CollectiveError::StoreLimit {
                what: "value",
                size: 1001,
                limit: 1000,
                ..
            }
        ),
        "{e}"
    );
    host.set("k", b"v").unwrap();
    assert_eq!(host.get("k").unwrap(), b"v");
    // A client with bigger limits than the host: the host refuses and closes that connection.
    let big = TcpStore::connect_with(&addr, opts()).unwrap();
    let e = big.set("k", &[1u8; 5000]).unwrap_err();
    assert!(
        matches!(
            e,
            CollectiveError::StoreLimit {
                what: "value",
                size: 5000,
                limit: 1000,
                ..
            }
        ),
        "{e}"
    );
    assert!(big.get("k").is_err(), "closed after the violation");
    assert_eq!(host.get("k").unwrap(), b"v");
    // The total: key and value bytes of everything stored.
    host.set("a", &[0u8; 900]).unwrap();
    let e = host.set("b", &[0u8; 900]).unwrap_err();
    assert!(
        matches!(
            e,
            CollectiveError::StoreLimit {
                what: "total stored bytes",
                size: 1804,
                limit: 1500,
                ..
            }
        ),
        "{e}"
    );
    assert!(!host.check("b").unwrap());
    host.set("a", &[0u8; 10]).unwrap(); // overwriting frees the old value's bytes
    host.set("b", &[0u8; 900]).unwrap();
    assert_eq!(host.server().unwrap().stored_bytes(), 2 + 11 + 901);
    // A raw frame announcing a 4 GiB value is refused without the server allocating it.
    let (mut c, _) = raw(&addr);
    let mut f = open_hello();
    f.extend_from_slice(&[
        1, 0, 0, 0, 1, b'x', 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF,
    ]);
    c.write_all(&f).unwrap();
    let reply = read_to_close(&mut c).unwrap();
    // Handshake OK (5 bytes), then ST_LIMIT and the connection closed.
    assert_eq!(reply[0], 0);
    assert_eq!(reply[5], 5);
    assert_eq!(host.get("k").unwrap(), b"v");
}

#[test]
fn ranks_rendezvous_with_a_secret_from_the_launch_environment() {
    let _g = shared();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let n = 3;
    std::thread::scope(|s| {
        for rank in 0..n {
            s.spawn(move || {
                // Open MPI's variables this time, and the secret the launcher exported.
                let vars = [
                    ("OMPI_COMM_WORLD_RANK", rank.to_string()),
                    ("OMPI_COMM_WORLD_SIZE", n.to_string()),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", rank.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".to_string()),
                    ("MASTER_PORT", port.to_string()),
                    ("FSDP_STORE_SECRET", "launcher-made-secret-1234".to_string()),
                ];
                let lookup =
                    move |k: &str| vars.iter().find(|(kk, _)| *kk == k).map(|(_, v)| v.clone());
                let e = RendezvousEnv::from_lookup(&lookup).unwrap();
                assert_eq!(
                    (e.rank, e.local_rank, e.launcher),
                    (rank, Some(rank), Launcher::OpenMpi)
                );
                let secret = StoreSecret::from_lookup(&lookup).unwrap().unwrap();
                let store = TcpStore::rendezvous_with(&e, opts().with_secret(secret)).unwrap();
                store.set(&format!("r{rank}"), b"x").unwrap();
                store.barrier("all-set", n).unwrap();
                for r in 0..n {
                    assert!(store.check(&format!("r{r}")).unwrap());
                }
                // Rank 0 hosts the server: it leaves last.
                store.barrier("leave", n).unwrap();
            });
        }
    });
}

// ------------------------------------------------------------------ issue #26 (6): bounded

/// Resident memory of this process (bytes), from /proc/self/statm.
fn rss_bytes() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// 255 connections each declaring a 16 MiB value and sending half of it hold at most the
/// in-flight budget (not 16 MiB each), the others are refused before their bytes are read,
/// and the store stays usable.
#[test]
fn half_sent_frames_share_one_byte_budget() {
    let _g = exclusive();
    let host = TcpStore::host_with("127.0.0.1:0", opts()).unwrap();
    let addr = host.addr().to_string();
    let server = host.server().unwrap();
    let before = rss_bytes();
    let value_len = (16usize << 20) - 1024;
    let half = vec![0x5Au8; value_len / 2];
    let mut conns = Vec::new();
    let mut refused = 0;
    for i in 0..255 {
        let (mut c, _) = raw(&addr);
        c.write_all(&open_hello()).unwrap();
        let mut ok = [0u8; 5];
        c.read_exact(&mut ok).unwrap();
        let key = format!("big{i}");
        let mut f = vec![1u8]; // CMD_SET
        f.extend_from_slice(&(key.len() as u32).to_be_bytes());
        f.extend_from_slice(key.as_bytes());
        f.extend_from_slice(&0u64.to_be_bytes());
        f.extend_from_slice(&(value_len as u32).to_be_bytes());
        c.write_all(&f).unwrap();
        // The server either reads the value (the reservation fitted) or refuses at once.
        c.set_nonblocking(true).unwrap();
        let _ = c.write_all(&half);
        c.set_nonblocking(false).unwrap();
        conns.push(c);
        if server.inflight_bytes() > 32 << 20 {
            panic!(
                "in-flight bytes {} above the budget",
                server.inflight_bytes()
            );
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    for c in &mut conns {
        c.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut b = [0u8; 1];
        match c.read(&mut b) {
            Ok(1) if b[0] == 5 => refused += 1, // ST_LIMIT
            // Closed after the refusal (its reply may be lost to the reset of unread bytes).
            Ok(0) => refused += 1,
            Err(e)
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                refused += 1
            }
            _ => {}
        }
    }
    let grown = rss_bytes().saturating_sub(before);
    eprintln!(
        "255 half-sent 16 MiB frames: {refused} refused, in flight {} B, RSS grew {} MiB",
        server.inflight_bytes(),
        grown >> 20
    );
    assert!(refused >= 250, "only {refused} refused");
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    host.set("still", b"usable").unwrap();
    assert_eq!(host.get("still").unwrap(), b"usable");
}

/// The frame deadline is for the whole frame: a client trickling one byte at a time (each read
/// well within the limit) is cut off once the frame's total time passes.
#[test]
fn a_trickling_frame_cannot_outlive_the_frame_deadline() {
    let _g = shared();
    let limits = StoreLimits {
        frame_timeout: Duration::from_millis(800),
        ..StoreLimits::default()
    };
    let host = TcpStore::host_with("127.0.0.1:0", opts().with_limits(limits)).unwrap();
    let addr = host.addr().to_string();
    let (mut c, _) = raw(&addr);
    c.write_all(&open_hello()).unwrap();
    let mut ok = [0u8; 5];
    c.read_exact(&mut ok).unwrap();
    let f = frame(1, b"slow", 0, &[1u8; 64]);
    let t0 = Instant::now();
    let mut cut = None;
    for b in &f {
        // One byte every 200 ms: each read is far below the 800 ms limit.
        if c.write_all(&[*b]).is_err() {
            cut = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        c.set_nonblocking(true).unwrap();
        let mut x = [0u8; 1];
        let r = c.read(&mut x);
        c.set_nonblocking(false).unwrap();
        if matches!(r, Ok(0)) || matches!(&r, Err(e) if e.kind() != std::io::ErrorKind::WouldBlock)
        {
            cut = Some(t0.elapsed());
            break;
        }
    }
    let cut = cut.expect("the trickling frame was never cut off");
    assert!(cut < Duration::from_secs(3), "cut after {cut:?}");
    assert!(!host.check("slow").unwrap());
}

/// With every slot held by clients that connected and never sent a request, a fresh client
/// (and the host's own connection) is still served: the longest-idle never-served connection
/// makes room.
#[test]
fn idle_connections_cannot_lock_out_a_real_client() {
    let _g = exclusive();
    let host = TcpStore::host_with("127.0.0.1:0", opts()).unwrap();
    let addr = host.addr().to_string();
    let server = host.server().unwrap();
    let mut idle = Vec::new();
    for _ in 0..255 {
        let (mut c, _) = raw(&addr);
        c.write_all(&open_hello()).unwrap();
        idle.push(c);
    }
    assert!(eventually(Duration::from_secs(5), || server
        .connection_count()
        == 256));
    let fresh = TcpStore::connect_with(&addr, opts()).unwrap();
    fresh.set("fresh", b"served").unwrap();
    assert_eq!(host.get("fresh").unwrap(), b"served");
    assert!(server.connection_count() <= 256);
}

/// Without a secret the store binds loopback only, unless allowed explicitly.
#[test]
fn an_open_store_binds_loopback_only_unless_allowed() {
    let _g = shared();
    let e = StoreServer::bind_with("0.0.0.0:0", &opts()).unwrap_err();
    assert!(e.to_string().contains("FSDP_STORE_SECRET"), "{e}");
    let mut o = opts();
    o.allow_open_remote = true;
    assert!(StoreServer::bind_with("0.0.0.0:0", &o).is_ok());
    assert!(StoreServer::bind_with(
        "0.0.0.0:0",
        &opts().with_secret(secret("a-long-enough-secret-123"))
    )
    .is_ok());
}
