//! `--kernel-times`: each kernel's share of the profiled step's device time, read back from the
//! `--profile` Chrome trace.
//!
//! On `--device cuda` the trace holds GPU intervals (CUDA events around every kernel, cuBLAS
//! call, copy and collective; `fsdp_alloc::trace`): the table is their kernel time by name,
//! with copies and collective time summed apart — NCCL's (`"nccl"`) and the shared-GPU
//! backend's (`"shared-gpu"`: thread ranks on one GPU; its intervals include the wait for the
//! peers to reach the collective, as an NCCL kernel's do). On CPU devices it is the CPU streams'
//! named work (`"work"` intervals) by name. Shares are of the summed time, over all ranks'
//! streams; concurrent streams overlap, so the sum can exceed the step's wall time.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use fsdp_alloc::trace::{gpu_time_shares, Trace, TraceEvent};
use serde_json::Value;

/// The trace at `path` as recorded events (metadata events name the tracks).
pub fn read_trace(path: &Path) -> Result<Trace, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--kernel-times: reading {}: {e}", path.display()))?;
    parse_trace(&text).map_err(|e| format!("--kernel-times: {}: {e}", path.display()))
}

/// Parses `fsdp_alloc::trace::Trace::to_chrome_json` output back into events.
pub fn parse_trace(text: &str) -> Result<Trace, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let events = v["traceEvents"].as_array().ok_or("no traceEvents array")?;
    let mut tracks: BTreeMap<(u64, u64), String> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
    {
        if let (Some(p), Some(t), Some(n)) = (
            e["pid"].as_u64(),
            e["tid"].as_u64(),
            e["args"]["name"].as_str(),
        ) {
            tracks.insert((p, t), n.to_string());
        }
    }
    let mut out = Vec::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let (Some(pid), Some(tid)) = (e["pid"].as_u64(), e["tid"].as_u64()) else {
            continue;
        };
        let cat: &'static str = match e["cat"].as_str() {
            Some("kernel") => "kernel",
            Some("copy") => "copy",
            Some("nccl") => "nccl",
            Some("shared-gpu") => "shared-gpu",
            Some("work") => "work",
            Some("wait") => "wait",
            _ => "host",
        };
        out.push(TraceEvent {
            name: Arc::from(e["name"].as_str().unwrap_or("?")),
            cat,
            pid: pid as usize,
            track: tracks.get(&(pid, tid)).cloned().unwrap_or_default(),
            start_us: e["ts"].as_f64().unwrap_or(0.0),
            dur_us: e["dur"].as_f64().unwrap_or(0.0),
        });
    }
    Ok(Trace::from_events(out))
}

/// The GPU categories summed apart from the kernel shares: copies and the collectives of each
/// backend that times them on the GPU.
pub const COLLECTIVE_AND_COPY: [&str; 3] = ["copy", "nccl", "shared-gpu"];

/// The kernel table: (source, rows of (name, µs, share)). GPU kernels when the trace has any,
/// else the CPU streams' work.
pub fn shares(t: &Trace) -> (&'static str, Vec<(String, f64, f64)>) {
    let gpu = gpu_time_shares(t, "kernel");
    if !gpu.is_empty() {
        return ("GPU kernels (CUDA events)", gpu);
    }
    let mut by: BTreeMap<String, f64> = BTreeMap::new();
    for e in t.events().iter().filter(|e| e.cat == "work") {
        *by.entry(e.name.to_string()).or_insert(0.0) += e.dur_us;
    }
    let sum: f64 = by.values().sum();
    let mut rows: Vec<(String, f64, f64)> = by
        .into_iter()
        .map(|(n, us)| (n, us, if sum > 0.0 { us / sum } else { 0.0 }))
        .collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ("CPU stream work (kernels and collectives)", rows)
}

/// Prints the table for the trace at `path` (at most 20 rows, the rest summed).
pub fn print(path: &Path) -> Result<(), String> {
    let t = read_trace(path)?;
    let (source, rows) = shares(&t);
    let total: f64 = rows.iter().map(|r| r.1).sum();
    println!(
        "kernel times: {source}, one profiled step ({}), {:.3} ms summed over streams",
        path.display(),
        total / 1e3
    );
    for (name, us, share) in rows.iter().take(20) {
        println!("  {:>6.2}%  {:>10.3} ms  {name}", share * 100.0, us / 1e3);
    }
    if rows.len() > 20 {
        let rest: f64 = rows[20..].iter().map(|r| r.1).sum();
        println!(
            "  {:>6.2}%  {:>10.3} ms  ({} more)",
            100.0 * rest / total.max(f64::MIN_POSITIVE),
            rest / 1e3,
            rows.len() - 20
        );
    }
    for cat in COLLECTIVE_AND_COPY {
        let us: f64 = gpu_time_shares(&t, cat).iter().map(|r| r.1).sum();
        if us > 0.0 {
            println!(
                "  GPU {cat} time {:.3} ms (not in the shares above)",
                us / 1e3
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_alloc::trace::place_gpu_interval;

    fn ev(name: &str, cat: &'static str, track: &str, start_us: f64, dur_us: f64) -> TraceEvent {
        TraceEvent {
            name: Arc::from(name),
            cat,
            pid: 0,
            track: track.into(),
            start_us,
            dur_us,
        }
    }

    #[test]
    fn gpu_kernels_are_read_back_from_the_chrome_json() {
        let gpu = |n: &str, cat: &'static str, a: f32, b: f32| {
            place_gpu_interval(10.0, a, b, 0, "gpu default".into(), cat, Arc::from(n))
        };
        let t = Trace::from_events(vec![
            gpu("sgemm", "kernel", 0.0, 0.3),
            gpu("sgemm", "kernel", 0.4, 0.7),
            gpu("softmax", "kernel", 0.7, 0.9),
            gpu("all_gather", "nccl", 0.0, 1.0),
            ev("forward", "host", "host main", 0.0, 900.0),
            ev("gelu", "work", "default", 0.0, 50.0),
        ]);
        let back = parse_trace(&t.to_chrome_json()).unwrap();
        assert_eq!(back.events().len(), 6);
        let (src, rows) = shares(&back);
        assert!(src.starts_with("GPU"));
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].0, "sgemm");
        assert!((rows[0].1 - 600.0).abs() < 1e-3, "{rows:?}");
        assert!((rows[0].2 - 0.75).abs() < 1e-6 && (rows[1].2 - 0.25).abs() < 1e-6);
    }

    #[test]
    fn shared_gpu_collectives_are_read_back_and_kept_out_of_the_kernel_shares() {
        let gpu = |n: &str, cat: &'static str, pid: usize, a: f32, b: f32| {
            place_gpu_interval(
                10.0,
                a,
                b,
                pid,
                "gpu fsdp-unshard".into(),
                cat,
                Arc::from(n),
            )
        };
        let t = Trace::from_events(vec![
            gpu("all_gather", "shared-gpu", 0, 0.0, 0.5),
            gpu("all_gather", "shared-gpu", 1, 0.1, 0.5),
            gpu("reduce_scatter", "shared-gpu", 1, 0.6, 0.8),
            gpu("sgemm", "kernel", 0, 0.0, 0.4),
        ]);
        let back = parse_trace(&t.to_chrome_json()).unwrap();
        assert!(back.events().iter().all(|e| e.cat != "host"), "{back:?}");
        // Each rank's interval keeps its own timeline.
        let pids: Vec<usize> = back.events().iter().map(|e| e.pid).collect();
        assert!(pids.contains(&0) && pids.contains(&1), "{pids:?}");
        let (_, rows) = shares(&back);
        assert_eq!(rows.len(), 1, "collectives are not kernels: {rows:?}");
        let sg = gpu_time_shares(&back, "shared-gpu");
        assert_eq!(sg[0].0, "all_gather");
        assert!((sg[0].1 - 900.0).abs() < 1e-3, "{sg:?}");
        assert!((sg[1].1 - 200.0).abs() < 1e-3, "{sg:?}");
        assert!(COLLECTIVE_AND_COPY.contains(&"shared-gpu"));
    }

    #[test]
    fn without_gpu_intervals_the_cpu_stream_work_is_shared_out() {
        let t = Trace::from_events(vec![
            ev("matmul", "work", "default", 0.0, 300.0),
            ev("gelu", "work", "default", 300.0, 100.0),
            ev("step", "host", "host main", 0.0, 500.0),
        ]);
        let (src, rows) = shares(&parse_trace(&t.to_chrome_json()).unwrap());
        assert!(src.starts_with("CPU"));
        assert_eq!(
            rows.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
            ["matmul", "gelu"]
        );
        assert!((rows[0].2 - 0.75).abs() < 1e-9);
    }
}
