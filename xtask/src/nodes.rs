//! A two-node cluster emulated on one machine: `cargo xtask mpi-test --nodes 2` and
//! `cargo xtask bench nodes`.
//!
//! Two network namespaces (`fsdpn<pid>a`, `fsdpn<pid>b`) joined by a veth pair (10.231.0.1 and
//! 10.231.0.2), each holding two MPI ranks. `mpirun` runs inside the first namespace with a
//! hostfile naming two hosts; OpenMPI starts its daemon on each "host" through a launcher agent
//! (a shell script given as `plm_rsh_agent`, in place of ssh) that enters the host's namespace
//! with `ip netns exec` and a fresh UTS namespace carrying the host's name, so OpenMPI sees two
//! nodes: ranks 0–1 on one, 2–3 on the other, shared memory inside a node, TCP over the veth
//! pair between them. The link is shaped on both ends: `netem` (10 Gbit/s, 50 µs) where the
//! kernel has it, else `tbf` at 10 Gbit/s (no added delay; the kernel of the development machine
//! has no `netem`), and the shaping used is printed. Everything stays inside the two namespaces;
//! they (and the veth pair) are deleted when the cluster is dropped.
//!
//! Needs root (or `CAP_NET_ADMIN`) for `ip netns add`: without it the test says so and is
//! skipped, except under `CI=true` as root, where a failure to build the cluster fails the run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::mpi::{alive, capture, field, is_root};
use crate::{root, run};

/// Ranks per emulated node.
pub const PER_NODE: usize = 2;
const SUBNET: &str = "10.231.0.0/24";

/// The emulated cluster; torn down on drop.
pub struct Cluster {
    ns: [String; 2],
    dir: PathBuf,
    /// How the link is shaped (for the reports).
    pub shaping: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip`: {e} (install iproute2)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn tc(ns: &str, dev: &str, qdisc: &[&str]) -> Result<(), String> {
    let mut args = vec![
        "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
    ];
    args.extend_from_slice(qdisc);
    ip(&args)
}

impl Cluster {
    /// Builds the cluster. `Ok(None)`: namespaces cannot be made here (the reason is printed);
    /// under `CI=true` as root that is an error instead.
    pub fn up() -> Result<Option<Cluster>, String> {
        let in_ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        let pid = std::process::id();
        let ns = [format!("fsdpn{pid}a"), format!("fsdpn{pid}b")];
        if let Err(e) = ip(&["netns", "add", &ns[0]]) {
            let why = format!(
                "cannot create network namespaces ({e}); the two-node cluster needs root or \
                 CAP_NET_ADMIN"
            );
            if in_ci && is_root() {
                return Err(why);
            }
            eprintln!("xtask: two-node cluster: SKIPPED, not run: {why}");
            return Ok(None);
        }
        let dir = std::env::temp_dir().join(format!("fsdp-nodes-{pid}"));
        let mut c = Cluster {
            ns: ns.clone(),
            dir,
            shaping: String::new(),
        };
        c.build().map(|()| Some(c))
    }

    fn build(&mut self) -> Result<(), String> {
        let [a, b] = &self.ns;
        let pid = std::process::id();
        let (va, vb) = (format!("fv{pid}a"), format!("fv{pid}b"));
        ip(&["netns", "add", b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        for (ns, dev, addr) in [(a, &va, "10.231.0.1/24"), (b, &vb, "10.231.0.2/24")] {
            ip(&["link", "set", dev, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        let netem = [
            "netem", "delay", "50us", "rate", "10gbit", "limit", "100000",
        ];
        let tbf = ["tbf", "rate", "10gbit", "burst", "1mb", "latency", "50ms"];
        self.shaping = if tc(a, &va, &netem).is_ok() {
            tc(b, &vb, &netem)?;
            "netem 10 Gbit/s, 50 µs delay".into()
        } else {
            tc(a, &va, &tbf)?;
            tc(b, &vb, &tbf)?;
            "tbf 10 Gbit/s (netem is not in this kernel: no added delay)".into()
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        // The launcher agent: `agent HOST CMD…` runs CMD in HOST's namespace under its name.
        let agent = format!(
            "#!/bin/sh\nhost=\"$1\"; shift\ncase \"$host\" in\n  node0) ns={a} ;;\n  node1) \
             ns={b} ;;\n  *) echo \"agent: unknown host $host\" >&2; exit 1 ;;\nesac\nexec ip \
             netns exec \"$ns\" unshare --uts sh -c 'hostname \"$0\"; exec /bin/sh -c \"$1\"' \
             \"$host\" \"$*\"\n"
        );
        let path = self.agent();
        std::fs::write(&path, agent).map_err(|e| format!("{}: {e}", path.display()))?;
        run("chmod agent", Command::new("chmod").arg("+x").arg(&path))?;
        let hosts = format!("node0 slots={PER_NODE}\nnode1 slots={PER_NODE}\n");
        std::fs::write(self.hostfile(), hosts).map_err(|e| format!("hostfile: {e}"))?;
        eprintln!(
            "xtask: two-node cluster: namespaces {a} (10.231.0.1) and {b} (10.231.0.2), {} \
             ranks each, link: {}",
            PER_NODE, self.shaping
        );
        Ok(())
    }

    fn agent(&self) -> PathBuf {
        self.dir.join("agent.sh")
    }

    fn hostfile(&self) -> PathBuf {
        self.dir.join("hosts")
    }

    /// `mpirun` over the two nodes, ranks 0–1 on node0 and 2–3 on node1, run from node0's
    /// namespace; `env` is passed to every rank.
    pub fn mpirun(&self, env: &[(&str, &str)]) -> Command {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &self.ns[0],
            "mpirun",
            "--allow-run-as-root",
        ]);
        c.args(["-n", &(2 * PER_NODE).to_string(), "--map-by", "slot"]);
        c.arg("--hostfile").arg(self.hostfile());
        c.arg("--mca").arg("plm_rsh_agent").arg(self.agent());
        for (k, v) in [
            ("oob_tcp_if_include", SUBNET),
            ("btl_tcp_if_include", SUBNET),
            ("btl", "self,vader,tcp"),
            ("mpi_yield_when_idle", "1"),
        ] {
            c.args(["--mca", k, v]);
        }
        for (k, v) in env {
            c.arg("-x").arg(format!("{k}={v}"));
        }
        c.current_dir(root());
        c
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and with it the pair.
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `cmd` and returns its standard output (it must succeed).
fn capture_text(step: &str, cmd: &mut Command) -> Result<String, String> {
    eprintln!("xtask: {step}: {cmd:?}");
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    if !out.status.success() {
        return Err(format!("{step} failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn example(profile: &str, name: &str) -> PathBuf {
    crate::mpi::target_dir()
        .join(profile)
        .join("examples")
        .join(name)
}

/// `cargo xtask mpi-test --nodes 2`: conformance (hierarchical and flat paths), the FSDP parity
/// suite (FullShard, HybridShard with one shard group per node, bf16, no_sync, …) and the
/// stall/kill tests of a 64 MiB cross-node all-gather, on the emulated two-node cluster.
pub fn mpi_test_nodes() -> Result<(), String> {
    crate::mpi::check_mpirun()?;
    let Some(cluster) = Cluster::up()? else {
        return Ok(());
    };
    crate::mpi::build_test_examples(&["mpi_conformance", "mpi_parity", "mpi_stall"])?;
    let conformance = example("debug", "mpi_conformance");
    run(
        "mpi conformance, 2 nodes × 2 (hierarchical)",
        cluster
            .mpirun(&[("FSDP_EXPECT_LAYOUT", "hierarchical")])
            .arg(&conformance),
    )?;
    run(
        "mpi conformance, 2 nodes × 2 (flat MPI)",
        cluster
            .mpirun(&[("FSDP_MPI_HIER", "0"), ("FSDP_EXPECT_LAYOUT", "flat")])
            .arg(&conformance),
    )?;
    run(
        "mpi parity, 2 nodes × 2 (hierarchical)",
        cluster
            .mpirun(&[("FSDP_EXPECT_LAYOUT", "hierarchical")])
            .arg(example("debug", "mpi_parity")),
    )?;
    let stall = example("debug", "mpi_stall");
    stall_test(&cluster, &stall, "STOP")?;
    stall_test(&cluster, &stall, "KILL")?;
    eprintln!("xtask: mpi-test --nodes 2 passed ({})", cluster.shaping);
    Ok(())
}

/// The per-collective timeout of the stall tests, seconds.
const STALL_TIMEOUT_S: u64 = 5;

/// Stops (`SIGSTOP`) or kills (`SIGKILL`) rank 3 (node1) while every rank loops over 64 MiB
/// all-gathers. Every other rank must end with a typed timeout (it writes `rank<r>.result`) or be
/// gone with the job, within the timeout + 5 s.
fn stall_test(cluster: &Cluster, bin: &Path, signal: &str) -> Result<(), String> {
    let dir = cluster.dir.join(format!("stall-{signal}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let timeout = STALL_TIMEOUT_S.to_string();
    eprintln!("xtask: stall test (SIG{signal} rank 3 inside a 64 MiB cross-node all-gather)");
    let mut job = cluster
        .mpirun(&[("FSDP_MPI_TIMEOUT_S", &timeout)])
        .arg(bin)
        .arg(&dir)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("stall test: cannot start mpirun: {e}"))?;
    let world = 2 * PER_NODE;
    let pid_of = |r: usize| -> Option<u32> {
        std::fs::read_to_string(dir.join(format!("rank{r}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let finish = |job: &mut std::process::Child, pids: &[u32], r: Result<(), String>| {
        for &p in pids {
            let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
        }
        let _ = job.kill();
        let _ = job.wait();
        r
    };
    // Wait for every rank to be inside its all-gather loop (it writes its pid after the first
    // all-gather).
    let start = Instant::now();
    let pids = loop {
        let pids: Vec<u32> = (0..world).filter_map(pid_of).collect();
        if pids.len() == world {
            break pids;
        }
        if start.elapsed() > Duration::from_secs(120) {
            return finish(
                &mut job,
                &pids,
                Err("stall test: ranks did not start".into()),
            );
        }
        if let Ok(Some(s)) = job.try_wait() {
            return Err(format!("stall test: the job ended before the signal ({s})"));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(700));
    let victim = pids[world - 1];
    run(
        &format!("kill -{signal} rank {}", world - 1),
        Command::new("kill").args([&format!("-{signal}"), &victim.to_string()]),
    )?;
    let t0 = Instant::now();
    let bound = Duration::from_secs(STALL_TIMEOUT_S + 5);
    // Each survivor: a typed timeout result, or gone (the job ended).
    let outcome = |r: usize| -> Option<String> {
        if let Ok(s) = std::fs::read_to_string(dir.join(format!("rank{r}.result"))) {
            return Some(s.trim().to_string());
        }
        (!alive(pids[r])).then(|| "gone (the job ended)".into())
    };
    let result = loop {
        let outs: Vec<Option<String>> = (0..world - 1).map(outcome).collect();
        if outs.iter().all(Option::is_some) {
            let secs = t0.elapsed().as_secs_f64();
            for (r, o) in outs.iter().enumerate() {
                eprintln!(
                    "xtask: stall test SIG{signal}: rank {r}: {}",
                    o.as_deref().unwrap_or("")
                );
            }
            let typed = outs
                .iter()
                .flatten()
                .filter(|o| o.contains("Timeout") || o.contains("PeerFailed"))
                .count();
            if signal == "STOP" && typed != world - 1 {
                break Err(format!(
                    "stall test SIGSTOP: {typed} of {} ranks reported a typed timeout",
                    world - 1
                ));
            }
            eprintln!(
                "xtask: stall test SIG{signal} passed: every other rank ended within {secs:.2} s \
                 (bound {bound:?}); {typed} with a typed error"
            );
            break Ok(());
        }
        if t0.elapsed() > bound {
            break Err(format!(
                "stall test SIG{signal}: not every rank ended within {bound:?}: {outs:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    finish(&mut job, &pids, result)
}

/// `cargo xtask bench nodes`: on the emulated two-node cluster, the per-rank all-gather rate of
/// the hierarchical and the flat path, the all-reduce bytes, train_gpt tokens/s with
/// HybridShard(F=2) vs FullShard, and the planner's predicted step time against the measured
/// one (`planner_step_time_error`: the larger relative error of the two strategies' step times,
/// each the median over [`ROUNDS`] runs); one JSON line last.
///
/// The planner's inputs are measured hardware figures, never the training step itself: the
/// link as shaped (10 Gbit/s shared by a node's 2 ranks, 50 µs), and the compute rate per rank
/// on the model's own kernels as the 4 ranks get it on this machine's shared cores — the
/// planner's FLOPs of one step over the compute-only step of [`compute_calibration`] (4
/// one-rank processes with 1 matmul thread each, no collectives), measured right before and
/// after each training run. The GEMM probe's peak rate split over the ranks (train_gpt's
/// default, `full_predicted_step_ms_gemm_probe_rate`) predicts too little compute here (189 ms
/// against a measured 250 ms step on a quiet machine): the model's kernels (attention, norms,
/// element-wise ops, small matmuls) run below the GEMM peak. Stderr shows each strategy's
/// predicted compute + exposed communication (and the links' busy time) against the measured
/// compute-only step + the rest. Not modelled: under other jobs' load, collectives wait for
/// preempted peers (the rest grows with the load, FullShard more than HybridShard).
pub fn bench_nodes() -> Result<(), String> {
    crate::mpi::check_mpirun()?;
    let Some(cluster) = Cluster::up()? else {
        return Err("bench nodes needs network namespaces (run as root)".into());
    };
    crate::mpi::build_bench_binaries()?;
    let bench = example("release", "mpi_bench");
    let hier = capture(
        "all-gather, hierarchical path",
        cluster.mpirun(&[]).arg(&bench).arg("--no-thread"),
    )?;
    let flat = capture(
        "all-gather, flat path",
        cluster
            .mpirun(&[("FSDP_MPI_HIER", "0")])
            .arg(&bench)
            .arg("--no-thread"),
    )?;
    let hier_ag = field(&hier, "mpi_all_gather_gbps")?;
    let flat_ag = field(&flat, "mpi_all_gather_gbps")?;
    let ar_bytes = field(&hier, "all_reduce_bytes_over_buffer")?;
    let train_gpt = crate::mpi::target_dir().join("release").join("train_gpt");
    let common = [
        "--backend",
        "mpi",
        "--steps",
        STEPS,
        "--json",
        "--backward-prefetch",
        "pre",
        "--limit-all-gathers",
        "on",
    ];
    // ROUNDS rounds of: compute calibration (4 one-rank processes sharing the cores),
    // FullShard, calibration, HybridShard; a last calibration closes them. Each training run's
    // compute-only figure is the mean of the calibrations just before and after it, so load
    // drift on this shared machine hits the prediction and the measurement alike; each figure
    // below is the median over the rounds.
    let mut calib = vec![compute_calibration(&cluster, &train_gpt)?];
    let (mut full, mut hybrid) = (Vec::new(), Vec::new());
    let (mut full_c, mut hybrid_c) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let line = capture(
            &format!("train_gpt FullShard, 2 nodes × 2 (round {})", round + 1),
            cluster
                .mpirun(&[])
                .arg(&train_gpt)
                .args(common)
                .args(["--strategy", "full-shard"]),
        )?;
        full.push(line);
        calib.push(compute_calibration(&cluster, &train_gpt)?);
        full_c.push((calib[calib.len() - 2] + calib[calib.len() - 1]) / 2.0);
        let line = capture(
            &format!(
                "train_gpt HybridShard F=2, 2 nodes × 2 (round {})",
                round + 1
            ),
            cluster.mpirun(&[]).arg(&train_gpt).args(common).args([
                "--strategy",
                "hybrid-shard",
                "--shard-size",
                "2",
            ]),
        )?;
        hybrid.push(line);
        calib.push(compute_calibration(&cluster, &train_gpt)?);
        hybrid_c.push((calib[calib.len() - 2] + calib[calib.len() - 1]) / 2.0);
    }
    let median_of = |lines: &[String], key: &str| -> Result<f64, String> {
        let v = lines
            .iter()
            .map(|l| field(l, key))
            .collect::<Result<Vec<f64>, String>>()?;
        Ok(median(v))
    };
    let full_tps = median_of(&full, "tokens_per_s")?;
    let hybrid_tps = median_of(&hybrid, "tokens_per_s")?;
    // The planner's compute rate per rank on the model's own kernels with 4 ranks sharing this
    // machine's cores: its FLOPs of one step over the measured compute-only step. A measured
    // hardware figure, like the link's; never the measured training step.
    let plan = |tflops: f64| -> Result<String, String> {
        capture_text(
            "train_gpt --plan for the emulated cluster",
            Command::new(&train_gpt)
                .current_dir(root())
                .args(PLAN_ARGS)
                .arg("--cluster-tflops")
                .arg(format!("{tflops:e}")),
        )
    };
    const FULL: &str = "full-shard F=4 bwd=pre fwd=off lim=on";
    const HYBRID: &str = "hybrid-shard F=2 bwd=pre fwd=off lim=on";
    let row = |table: &str, label: &str| -> Result<PlanRow, String> {
        plan_row(table, label)
            .ok_or_else(|| format!("no `{label}` row with a step time in the plan table"))
    };
    // At 1 GFLOP/s the compute column (ms) is the FLOPs of one step / 1e6.
    let unit = plan(1e-3)?;
    let step_flops = row(&unit, FULL)?.compute_ms * 1e6;
    let rate = |compute_ms: f64| step_flops / (compute_ms * 1e-3) / 1e12;
    let (full_compute, hybrid_compute) = (median(full_c), median(hybrid_c));
    let (full_tflops, hybrid_tflops) = (rate(full_compute), rate(hybrid_compute));
    let full_table = plan(full_tflops)?;
    print!("{full_table}");
    let full_pred = row(&full_table, FULL)?;
    let hybrid_pred = row(&plan(hybrid_tflops)?, HYBRID)?;
    // What train_gpt's default rate (the GEMM probe's peak split over the ranks) predicts, for
    // comparison.
    let probe_table = capture_text(
        "train_gpt --plan for the emulated cluster, GEMM-probe rate",
        Command::new(&train_gpt).current_dir(root()).args(PLAN_ARGS),
    )?;
    let full_probe = row(&probe_table, FULL)?;
    let full_ms = median_of(&full, "step_ms_median")?;
    let hybrid_ms = median_of(&hybrid, "step_ms_median")?;
    for (name, p, meas, compute) in [
        ("full-shard F=4", &full_pred, full_ms, full_compute),
        ("hybrid-shard F=2", &hybrid_pred, hybrid_ms, hybrid_compute),
    ] {
        eprintln!(
            "xtask: bench nodes: {name}: predicted step {:.1} ms = compute {:.1} + exposed comm \
             {:.1} (links busy {:.1}); measured step {meas:.1} ms = compute alone {compute:.1} \
             + the rest {:.1}",
            p.step_ms,
            p.compute_ms,
            p.step_ms - p.compute_ms,
            p.comm_ms,
            meas - compute
        );
    }
    let rel = |pred: f64, meas: f64| (pred - meas).abs() / meas;
    let plan_err = rel(full_pred.step_ms, full_ms).max(rel(hybrid_pred.step_ms, hybrid_ms));
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    println!(
        "{{\"hier_all_gather_gbps\": {hier_ag:.4}, \"flat_all_gather_gbps\": {flat_ag:.4}, \
         \"hier_over_flat_all_gather\": {:.3}, \"all_reduce_bytes_over_buffer\": {ar_bytes:.4}, \
         \"full_shard_tokens_per_s\": {full_tps:.1}, \"hybrid_tokens_per_s\": {hybrid_tps:.1}, \
         \"hybrid_over_full_tokens\": {:.3}, \"compute_only_step_ms_runs\": {calib:.1?}, \
         \"full_calibrated_tflops_per_rank\": {full_tflops:.5}, \
         \"hybrid_calibrated_tflops_per_rank\": {hybrid_tflops:.5}, \
         \"full_step_ms\": {full_ms:.1}, \
         \"full_predicted_step_ms\": {:.1}, \"full_predicted_step_ms_gemm_probe_rate\": {:.1}, \
         \"full_predicted_compute_ms\": {:.1}, \
         \"full_predicted_comm_busy_ms\": {:.1}, \"hybrid_step_ms\": {hybrid_ms:.1}, \
         \"hybrid_predicted_step_ms\": {:.1}, \"hybrid_predicted_compute_ms\": {:.1}, \
         \"hybrid_predicted_comm_busy_ms\": {:.1}, \"planner_step_time_error\": \
         {plan_err:.3}, \"link\": \"{}\", \"load_average\": {load:.2}}}",
        hier_ag / flat_ag,
        hybrid_tps / full_tps,
        full_pred.step_ms,
        full_probe.step_ms,
        full_pred.compute_ms,
        full_pred.comm_ms,
        hybrid_pred.step_ms,
        hybrid_pred.compute_ms,
        hybrid_pred.comm_ms,
        cluster.shaping
    );
    Ok(())
}

/// Steps of every train_gpt run of the bench (the first is not timed).
const STEPS: &str = "10";

/// Rounds of (calibration, FullShard, calibration, HybridShard) in `bench nodes`.
const ROUNDS: usize = 3;

/// The median of `v` (the mean of the middle two for an even count; NaN when empty).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// `train_gpt --plan` arguments for the emulated cluster (the training runs' model and batch are
/// train_gpt's defaults): 2 nodes × 2 ranks, the link's 10 Gbit/s shared by a node's 2 ranks
/// (0.625 GB/s per rank) and 50 µs; inside a node train_gpt's defaults (10 GB/s, 10 µs). The
/// compute rate is added by the caller.
const PLAN_ARGS: [&str; 11] = [
    "--ranks",
    "4",
    "--plan",
    "--cluster-nodes",
    "2",
    "--cluster-ranks-per-node",
    "2",
    "--cluster-inter-gbps",
    "0.625",
    "--cluster-inter-latency-us",
    "50",
];

/// The compute-only step (ms) of the training runs' model and per-rank batch with 4 ranks
/// sharing this machine's cores as the MPI ranks do: 4 processes started together on the
/// cluster by `mpirun`, each a train_gpt of one thread rank (`--backend thread --ranks 1`, no
/// collectives) with 1 matmul thread (what each of the 4 MPI ranks gets on 2 cores). The median
/// over the 4 processes of their median step.
fn compute_calibration(cluster: &Cluster, train_gpt: &Path) -> Result<f64, String> {
    let out = capture_text(
        "compute calibration: 4 one-rank train_gpt processes sharing the cores",
        // `--tag-output`: mpirun forwards each process's lines whole, prefixed with its rank
        // (without it, two processes' JSON lines can come out spliced into one).
        cluster
            .mpirun(&[])
            .arg("--tag-output")
            .arg(train_gpt)
            .args([
                "--backend",
                "thread",
                "--ranks",
                "1",
                "--matmul-threads",
                "1",
                "--steps",
                STEPS,
                "--json",
            ]),
    )?;
    let steps: Vec<f64> = out
        .lines()
        .filter(|l| l.contains('{'))
        .filter_map(|l| field(l, "step_ms_median").ok())
        .collect();
    if steps.len() != 2 * PER_NODE {
        return Err(format!(
            "compute calibration: {} of {} processes printed a step time",
            steps.len(),
            2 * PER_NODE
        ));
    }
    Ok(median(steps))
}

/// One row of `train_gpt --plan`'s table: predicted step, compute and links' busy time, ms.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PlanRow {
    step_ms: f64,
    compute_ms: f64,
    comm_ms: f64,
}

/// The predicted figures of the plan `label` (`STRATEGY F=N bwd=B fwd=F lim=L`) in
/// `train_gpt --plan`'s table (columns after the plan: `alike`, step ms, compute, comm busy, …).
/// The table merges candidates whose predictions print the same into one row (`bwd=pre|post`,
/// `fwd=any`, …) followed by an `alike` count; a row matches when every setting of `label` is
/// among its alternatives or the row says `any`.
fn plan_row(table: &str, label: &str) -> Option<PlanRow> {
    let want: Vec<&str> = label.split_whitespace().collect();
    table.lines().find_map(|line| {
        let toks: Vec<&str> = line.split_whitespace().collect();
        let start = toks.iter().position(|t| *t == want[0])?;
        let row = toks.get(start..start + want.len())?;
        let matches = row.iter().zip(&want).all(|(got, want)| {
            match (got.split_once('='), want.split_once('=')) {
                (Some((gk, gv)), Some((wk, wv))) => {
                    gk == wk && (gv == "any" || gv.split('|').any(|v| v == wv))
                }
                _ => got == want,
            }
        });
        if !matches {
            return None;
        }
        let mut rest = toks[start + want.len()..].iter().peekable();
        // Newer tables put the `alike` count (an integer) before the step time.
        if !rest.peek()?.contains('.') {
            rest.next();
        }
        let mut num = || -> Option<f64> { rest.next()?.parse().ok() };
        Some(PlanRow {
            step_ms: num()?,
            compute_ms: num()?,
            comm_ms: num()?,
        })
    })
}

#[cfg(test)]
mod plan_table_tests {
    use super::{median, plan_row, PlanRow};

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn finds_merged_and_plain_rows() {
        let merged = "rank  plan  alike  step ms  compute  comm busy\n   \
            1  hybrid-shard F=2 bwd=pre fwd=any lim=any  4  205.24  201.68  12.50  3.1  1 yes\n   \
            3  full-shard F=4 bwd=pre|post fwd=off lim=any 4 211.00  201.65  30.25  3.0  2 yes\n";
        let row = |step_ms, compute_ms, comm_ms| {
            Some(PlanRow {
                step_ms,
                compute_ms,
                comm_ms,
            })
        };
        assert_eq!(
            plan_row(merged, "hybrid-shard F=2 bwd=pre fwd=off lim=on"),
            row(205.24, 201.68, 12.5)
        );
        assert_eq!(
            plan_row(merged, "full-shard F=4 bwd=post fwd=off lim=on"),
            row(211.0, 201.65, 30.25)
        );
        assert_eq!(
            plan_row(merged, "full-shard F=4 bwd=none fwd=off lim=on"),
            None
        );
        let plain = "   1  full-shard F=4 bwd=pre fwd=off lim=on     233.10   200.0  20.5\n";
        assert_eq!(
            plan_row(plain, "full-shard F=4 bwd=pre fwd=off lim=on"),
            row(233.1, 200.0, 20.5)
        );
        // A row cut short has no figures.
        let short = "   1  full-shard F=4 bwd=pre fwd=off lim=on     233.10\n";
        assert_eq!(
            plan_row(short, "full-shard F=4 bwd=pre fwd=off lim=on"),
            None
        );
    }
}
