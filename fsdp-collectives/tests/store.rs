//! The TCP rendezvous store on loopback (127.0.0.1, ephemeral ports, bounded timeouts), with
//! several client threads, and the launch-environment parsing.

use std::collections::HashMap;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use fsdp_collectives::{CollectiveError, RendezvousEnv, TcpStore};

const T: Duration = Duration::from_secs(10);

#[test]
fn clients_set_get_add_and_barrier_across_threads() {
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

#[test]
fn oversized_keys_are_refused_locally() {
    let host = TcpStore::host("127.0.0.1:0", T).unwrap();
    let e = host.set(&"k".repeat(5000), b"v").unwrap_err();
    assert!(matches!(e, CollectiveError::StoreProtocol { .. }), "{e}");
    // The connection is still in step afterwards.
    host.set("k", b"v").unwrap();
    assert_eq!(host.get("k").unwrap(), b"v");
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
