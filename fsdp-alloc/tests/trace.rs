//! The timeline recorder: stream work, waits and host spans land on the right tracks, with the
//! right names, and the Chrome trace written to disk parses as JSON with the expected fields.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fsdp_alloc::{trace, Device};

/// `trace` is process-wide: the tests of this file take turns.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn records_named_work_waits_and_spans_and_writes_parsable_chrome_json() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::cpu(3);
    let compute = dev.default_stream().clone();
    let comm = dev.new_stream("comm");
    trace::start();
    {
        let _step = trace::span(dev.id(), "step");
        comm.launch_named("all_gather", || {
            std::thread::sleep(Duration::from_millis(20))
        });
        let gathered = comm.record_event();
        compute.wait_event(&gathered);
        {
            let _fwd = trace::span(dev.id(), "forward u1");
            compute.launch_named("matmul", || std::thread::sleep(Duration::from_millis(5)));
            // Unnamed work takes the innermost open span's name.
            compute.launch(|| {});
        }
        compute.launch(|| {});
        dev.synchronize().unwrap();
    }
    let t = trace::stop();
    let ev = t.events();
    let find = |name: &str| {
        ev.iter()
            .find(|e| &*e.name == name)
            .unwrap_or_else(|| panic!("no event {name} in {ev:?}"))
    };
    let ag = find("all_gather");
    assert_eq!((ag.cat, ag.track.as_str(), ag.pid), ("work", "comm", 3));
    assert!(ag.dur_us >= 19_000.0, "{ag:?}");
    let mm = find("matmul");
    assert_eq!((mm.cat, mm.track.as_str()), ("work", "default"));
    assert!(
        mm.start_us >= ag.start_us + ag.dur_us,
        "compute waited for the gather: {mm:?} {ag:?}"
    );
    let wait = find("wait");
    assert_eq!((wait.cat, wait.track.as_str()), ("wait", "default"));
    assert!(
        wait.dur_us >= 10_000.0,
        "the compute stream idled ~20 ms: {wait:?}"
    );
    assert!(ev
        .iter()
        .any(|e| &*e.name == "forward u1" && e.cat == "work"));
    assert!(ev.iter().any(|e| &*e.name == "step" && e.cat == "work"));
    let step = ev
        .iter()
        .find(|e| &*e.name == "step" && e.cat == "host")
        .unwrap();
    let fwd = find("forward u1");
    assert_eq!(fwd.cat, "host");
    assert!(
        step.start_us <= fwd.start_us && fwd.start_us + fwd.dur_us <= step.start_us + step.dur_us
    );
    assert!(t
        .totals()
        .iter()
        .any(|x| x.name == "all_gather" && x.count == 1));

    let path = std::env::temp_dir().join(format!("fsdp_trace_test_{}.json", std::process::id()));
    t.write_chrome_json(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let v: serde_json::Value = serde_json::from_str(&text).expect("the trace is valid JSON");
    let events = v["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), ev.len());
    for e in &complete {
        assert_eq!(e["pid"], 3);
        assert!(e["ts"].as_f64().unwrap() >= 0.0);
        assert!(e["dur"].as_f64().unwrap() >= 0.0);
        assert!(e["tid"].as_u64().is_some());
        assert!(e["name"].as_str().is_some());
    }
    // Every tid is named by a thread_name metadata event: the stream or the host thread.
    let names: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"comm") && names.contains(&"default"),
        "{names:?}"
    );
    assert!(names.iter().any(|n| n.starts_with("host")), "{names:?}");
    for e in &complete {
        let tid = &e["tid"];
        assert!(events
            .iter()
            .any(|m| m["ph"] == "M" && m["name"] == "thread_name" && &m["tid"] == tid));
    }
}

#[test]
fn nothing_is_recorded_while_off_and_spans_may_close_out_of_order() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::cpu(0);
    let ran = Arc::new(Mutex::new(0));
    let r = Arc::clone(&ran);
    dev.default_stream()
        .launch_named("off", move || *r.lock().unwrap() += 1);
    {
        let _s = trace::span(dev.id(), "off span");
    }
    dev.synchronize().unwrap();
    assert_eq!(*ran.lock().unwrap(), 1);
    trace::start();
    let a = trace::span(dev.id(), "a");
    let b = trace::span(dev.id(), "b");
    drop(a); // closes before b, as FSDP's hook-opened spans can
    dev.default_stream().launch(|| {});
    dev.synchronize().unwrap();
    drop(b);
    let t = trace::stop();
    assert!(
        t.events().iter().all(|e| !e.name.contains("off")),
        "{:?}",
        t.events()
    );
    let work: Vec<_> = t.events().iter().filter(|e| e.cat == "work").collect();
    assert_eq!(work.len(), 1);
    assert_eq!(
        &*work[0].name, "b",
        "the innermost span still open names the launch"
    );
    assert_eq!(t.events().iter().filter(|e| e.cat == "host").count(), 2);
    // A stopped recorder hands back an empty trace.
    assert!(trace::stop().events().is_empty());
}

#[test]
fn lanes_keep_ranks_that_share_a_device_index_apart() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Two rank threads whose devices have the same index (as thread ranks sharing cuda:0 do):
    // with a lane each, their spans land on their own timelines; without, both on pid 5.
    trace::start();
    std::thread::scope(|s| {
        for rank in 0..2usize {
            s.spawn(move || {
                let dev = Device::cpu(5);
                {
                    let _lane = trace::lane(rank);
                    let _s = trace::span(dev.id(), format!("rank {rank} step"));
                    {
                        // Nested lanes restore the outer one.
                        let _inner = trace::lane(7);
                        let _n = trace::span(dev.id(), format!("rank {rank} inner"));
                    }
                }
                let _plain = trace::span(dev.id(), format!("rank {rank} unlaned"));
            });
        }
    });
    let t = trace::stop();
    let pid = |name: &str| {
        t.events()
            .iter()
            .find(|e| &*e.name == name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", t.events()))
            .pid
    };
    for rank in 0..2 {
        assert_eq!(pid(&format!("rank {rank} step")), rank);
        assert_eq!(pid(&format!("rank {rank} inner")), 7);
        assert_eq!(pid(&format!("rank {rank} unlaned")), 5);
    }
    let json = t.to_chrome_json();
    for p in [0, 1, 5, 7] {
        assert!(
            json.contains(&format!("\"args\":{{\"name\":\"rank {p}\"}}")),
            "timeline {p} is named"
        );
    }
}
