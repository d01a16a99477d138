//! `cargo xtask mpi-test` and `cargo xtask bench mpi`: the multi-process (MPI) suite and bench.
//!
//! Both need OpenMPI (`mpirun`, `libopenmpi-dev`) and libclang (bindgen) installed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{cargo, root, run};

pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `mpirun -n W` with the flags this machine needs: `--oversubscribe` (more ranks than cores)
/// and `--allow-run-as-root` when running as root.
pub(crate) fn mpirun(w: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["-n", &w.to_string(), "--oversubscribe"]);
    if is_root() {
        c.arg("--allow-run-as-root");
    }
    // Waiting ranks yield the core instead of spinning in MPI progress.
    c.env("OMPI_MCA_mpi_yield_when_idle", "1");
    c.current_dir(root());
    c
}

pub(crate) fn check_mpirun() -> Result<(), String> {
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err(
            "mpirun was not found: install OpenMPI (Debian: openmpi-bin libopenmpi-dev, \
                  and libclang-dev for the bindings)"
                .into(),
        ),
    }
}

fn example(profile: &str, name: &str) -> PathBuf {
    target_dir().join(profile).join("examples").join(name)
}

/// Builds the MPI test examples `names` (debug, the MPI features of fsdp-collectives and
/// fsdp-tests), for `mpi-test` and `mpi-test --nodes 2`.
pub(crate) fn build_test_examples(names: &[&str]) -> Result<(), String> {
    let mut c = cargo();
    c.args([
        "build",
        "-p",
        "fsdp-collectives",
        "-p",
        "fsdp-tests",
        "--features",
        "fsdp-collectives/mpi,fsdp-tests/mpi",
    ]);
    for n in names {
        c.args(["--example", n]);
    }
    run("build MPI test binaries", &mut c)
}

/// Builds the MPI test binaries, runs the conformance and parity suites on W = 1..=4 processes
/// (both data paths; host staging included), the kill test, the group-creation stall test and
/// train_gpt over MPI with host staging (`FSDP_HOST_STAGING=1`).
pub fn mpi_test() -> Result<(), String> {
    check_mpirun()?;
    build_test_examples(&["mpi_conformance", "mpi_parity", "mpi_group_stall"])?;
    let conformance = example("debug", "mpi_conformance");
    let parity = example("debug", "mpi_parity");
    for w in 1..=4 {
        run(
            &format!("mpi conformance W={w} (shared memory)"),
            mpirun(w).arg(&conformance),
        )?;
        run(
            &format!("mpi conformance W={w} (MPI collectives)"),
            mpirun(w).args(["-x", "FSDP_MPI_SHM=0"]).arg(&conformance),
        )?;
        run(&format!("mpi parity W={w}"), mpirun(w).arg(&parity))?;
    }
    run(
        "mpi parity W=3 (MPI collectives)",
        mpirun(3).args(["-x", "FSDP_MPI_SHM=0"]).arg(&parity),
    )?;
    kill_test(&parity)?;
    group_stall_test(&example("debug", "mpi_group_stall"))?;
    train_gpt_host_staging_test()?;
    eprintln!("xtask: mpi-test passed");
    Ok(())
}

/// `mpirun -n 2 train_gpt --backend mpi` with `FSDP_HOST_STAGING=1` (every collective staged
/// through a host staging device and back: the path of GPU ranks on MPI, `--device cuda`, run
/// with CPU devices) against the same job unstaged and on 2 thread ranks: every step's loss
/// bit-equal, and the staged run counting more host waits per step (one per collective), which
/// shows the staging ran.
fn train_gpt_host_staging_test() -> Result<(), String> {
    run(
        "build train_gpt (mpi)",
        cargo().args([
            "build",
            "-p",
            "fsdp-train",
            "--features",
            "mpi",
            "--bin",
            "train_gpt",
        ]),
    )?;
    let bin = target_dir().join("debug").join("train_gpt");
    let dir = std::env::temp_dir().join(format!("fsdp-mpi-staging-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let args = |metrics: &Path| -> Vec<String> {
        [
            "--steps",
            "4",
            "--batch",
            "2",
            "--no-progress",
            "--json",
            "--metrics",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(std::iter::once(metrics.display().to_string()))
        .collect()
    };
    let losses = |p: &Path| -> Result<Vec<String>, String> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        text.lines()
            .map(|l| {
                let v: serde_json::Value =
                    serde_json::from_str(l).map_err(|e| format!("{}: {e}", p.display()))?;
                Ok(v["loss"].to_string())
            })
            .collect()
    };
    let (m_threads, m_mpi, m_staged) = (
        dir.join("threads.jsonl"),
        dir.join("mpi.jsonl"),
        dir.join("staged.jsonl"),
    );
    let result = (|| -> Result<(), String> {
        capture(
            "train_gpt on 2 thread ranks",
            Command::new(&bin)
                .current_dir(root())
                .args(["--ranks", "2"])
                .args(args(&m_threads)),
        )?;
        let plain = capture(
            "mpirun -n 2 train_gpt --backend mpi",
            mpirun(2)
                .arg(&bin)
                .args(["--backend", "mpi"])
                .args(args(&m_mpi)),
        )?;
        let staged = capture(
            "mpirun -n 2 train_gpt --backend mpi with FSDP_HOST_STAGING=1",
            mpirun(2)
                .args(["-x", "FSDP_HOST_STAGING=1"])
                .arg(&bin)
                .args(["--backend", "mpi"])
                .args(args(&m_staged)),
        )?;
        let want = losses(&m_threads)?;
        for (label, p) in [("MPI", &m_mpi), ("MPI with host staging", &m_staged)] {
            let got = losses(p)?;
            if got != want || want.is_empty() {
                return Err(format!(
                    "train_gpt over {label}: losses {got:?} vs thread ranks {want:?}"
                ));
            }
        }
        let (h_plain, h_staged) = (
            field(&plain, "host_syncs_per_step")?,
            field(&staged, "host_syncs_per_step")?,
        );
        if h_staged <= h_plain {
            return Err(format!(
                "FSDP_HOST_STAGING=1 did not stage: {h_staged} host waits per step vs {h_plain} \
                 unstaged"
            ));
        }
        eprintln!(
            "xtask: train_gpt host staging test passed: {} losses bit-equal on threads, MPI and \
             MPI with host staging ({h_staged} host waits per step staged, {h_plain} unstaged)",
            want.len()
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

pub(crate) fn alive(pid: u32) -> bool {
    // A zombie still has a /proc entry; count only processes that are not zombies.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// `kill -9` one rank of a 4-process training job; every process must be gone and `mpirun`
/// must exit non-zero within a bounded time.
fn kill_test(parity: &Path) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("fsdp-mpi-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "xtask: kill test: mpirun -n 4 {} --kill-test",
        parity.display()
    );
    let mut job = mpirun(4)
        .arg(parity)
        .arg("--kill-test")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("kill test: cannot start mpirun: {e}"))?;
    let fail = |job: &mut std::process::Child, msg: String| {
        let _ = job.kill();
        let _ = job.wait();
        let _ = std::fs::remove_dir_all(&dir);
        Err(msg)
    };
    // Wait for every rank to be training (pid files), then a little more.
    let start = Instant::now();
    let pids: Vec<u32> = loop {
        let pids: Vec<u32> = (0..4)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("rank{r}.pid"))).ok())
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        if pids.len() == 4 {
            break pids;
        }
        if start.elapsed() > Duration::from_secs(120) {
            return fail(
                &mut job,
                "kill test: the ranks did not start within 120 s".into(),
            );
        }
        if let Ok(Some(status)) = job.try_wait() {
            return fail(
                &mut job,
                format!("kill test: the job ended before the kill ({status})"),
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_secs(2));
    let victim = pids[1];
    let killed = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .map_err(|e| format!("kill test: cannot run kill: {e}"))?;
    if !killed.success() {
        return fail(&mut job, format!("kill test: kill -9 {victim} failed"));
    }
    let t0 = Instant::now();
    let bound = Duration::from_secs(30);
    let status = loop {
        if let Ok(Some(status)) = job.try_wait() {
            break status;
        }
        if t0.elapsed() > bound {
            return fail(
                &mut job,
                format!("kill test: the job did not end within {bound:?} of killing rank 1"),
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let ended = t0.elapsed();
    // The launcher is gone; the other ranks must be too (give the OS a moment to reap them).
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let survivors: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    let _ = std::fs::remove_dir_all(&dir);
    if status.success() {
        return Err("kill test: mpirun exited 0 after a rank was killed".into());
    }
    if !survivors.is_empty() {
        return Err(format!(
            "kill test: processes {survivors:?} survived the job's end"
        ));
    }
    eprintln!(
        "xtask: kill test passed: rank 1 (pid {victim}) killed, job ended in {:.2} s ({status}), \
         no process left",
        ended.as_secs_f64()
    );
    Ok(())
}

/// The per-wait timeout of the group-creation stall test, seconds.
const GROUP_STALL_TIMEOUT_S: u64 = 3;

/// Group creation with a rank that never arrives (`mpi_group_stall` on 3 processes: rank 2
/// skips the second world group): ranks 0 and 1 must each report a typed timeout, both within
/// the timeout + 5 s of the call (measured in the rank) and of the moment every rank was up.
fn group_stall_test(bin: &Path) -> Result<(), String> {
    const W: usize = 3;
    let dir = std::env::temp_dir().join(format!("fsdp-mpi-group-stall-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    eprintln!(
        "xtask: group-creation stall test: mpirun -n {W} {}",
        bin.display()
    );
    let mut job = mpirun(W)
        .args(["-x", &format!("FSDP_MPI_TIMEOUT_S={GROUP_STALL_TIMEOUT_S}")])
        .arg(bin)
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("group stall test: cannot start mpirun: {e}"))?;
    let read = |name: String| std::fs::read_to_string(dir.join(name)).ok();
    let pids = |_: ()| -> Vec<u32> {
        (0..W)
            .filter_map(|r| read(format!("rank{r}.pid")))
            .filter_map(|s| s.trim().parse().ok())
            .collect()
    };
    let finish = |job: &mut std::process::Child, r: Result<(), String>| {
        for p in pids(()) {
            let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
        }
        let _ = job.kill();
        let _ = job.wait();
        let _ = std::fs::remove_dir_all(&dir);
        r
    };
    let start = Instant::now();
    while pids(()).len() < W {
        if start.elapsed() > Duration::from_secs(120) {
            return finish(
                &mut job,
                Err("group stall test: ranks did not start".into()),
            );
        }
        if let Ok(Some(s)) = job.try_wait() {
            return finish(
                &mut job,
                Err(format!("group stall test: the job ended early ({s})")),
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let t0 = Instant::now();
    let limit = GROUP_STALL_TIMEOUT_S as f64 + 5.0;
    let bound = Duration::from_secs_f64(limit);
    let result = loop {
        let outs: Vec<Option<String>> = (0..W - 1)
            .map(|r| read(format!("rank{r}.result")).map(|s| s.trim().to_string()))
            .collect();
        if outs.iter().all(Option::is_some) {
            let outs: Vec<String> = outs.into_iter().flatten().collect();
            for (r, o) in outs.iter().enumerate() {
                eprintln!("xtask: group stall test: rank {r}: {o}");
            }
            // "<variant> after <secs> s …": the rank's own measure of the failing call.
            let secs = |o: &str| -> Option<f64> { o.split_whitespace().nth(2)?.parse().ok() };
            let bad: Vec<&String> = outs
                .iter()
                .filter(|o| !o.starts_with("Timeout") || !secs(o).is_some_and(|s| s <= limit))
                .collect();
            if !bad.is_empty() {
                break Err(format!(
                    "group stall test: not a typed timeout within {limit} s: {bad:?}"
                ));
            }
            eprintln!(
                "xtask: group stall test passed: ranks 0..{} got a typed timeout within {:.2} s \
                 (bound {bound:?})",
                W - 2,
                t0.elapsed().as_secs_f64()
            );
            break Ok(());
        }
        if t0.elapsed() > bound {
            break Err(format!(
                "group stall test: ranks did not return from group creation within {bound:?} \
                 (hung in a blocking MPI call?): {outs:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    finish(&mut job, result)
}

/// The value of `"key": number` in a JSON line (the benches print flat objects).
fn json_number(line: &str, key: &str) -> Option<f64> {
    let pat = format!("\"{key}\":");
    let at = line.find(&pat)? + pat.len();
    let rest = line[at..].trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | 'e' | 'E' | '+')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// `key`'s number in the JSON line `line`, or an error naming both.
pub(crate) fn field(line: &str, key: &str) -> Result<f64, String> {
    json_number(line, key).ok_or_else(|| format!("no {key} in {line}"))
}

fn last_json_line(out: &[u8]) -> Option<String> {
    String::from_utf8_lossy(out)
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .map(str::to_string)
}

pub(crate) fn capture(step: &str, cmd: &mut Command) -> Result<String, String> {
    eprintln!("xtask: {step}: {cmd:?}");
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    if !out.status.success() {
        return Err(format!("{step} failed ({})", out.status));
    }
    last_json_line(&out.stdout).ok_or_else(|| format!("{step}: no JSON line in its output"))
}

/// Builds the MPI benches' binaries (release, feature `mpi`): the `mpi_bench` example and
/// `train_gpt`. Shared by `bench mpi` and `bench nodes`.
pub(crate) fn build_bench_binaries() -> Result<(), String> {
    run(
        "build MPI bench binaries",
        cargo().args([
            "build",
            "--release",
            "-p",
            "fsdp-collectives",
            "-p",
            "fsdp-train",
            "--features",
            "fsdp-collectives/mpi,fsdp-train/mpi",
            "--example",
            "mpi_bench",
            "--bin",
            "train_gpt",
        ]),
    )
}

/// `cargo xtask bench mpi`: collective throughput over MPI vs threads, and train_gpt tokens/s
/// over MPI vs threads, in one run; prints one JSON object as the last line (with the 1-minute
/// load average at the end: the development machine is shared, absolute figures drift with it).
pub fn bench_mpi() -> Result<(), String> {
    check_mpirun()?;
    build_bench_binaries()?;
    let coll = capture(
        "mpi collectives bench",
        mpirun(4).arg(example("release", "mpi_bench")),
    )?;
    let field =
        |line: &str, k: &str| json_number(line, k).ok_or_else(|| format!("no {k} in {line}"));
    let train_gpt = target_dir().join("release").join("train_gpt");
    let steps = ["--steps", "10", "--json"];
    // Interleaved thread, MPI, thread, MPI: load changes hit both alike; each figure is the
    // mean of its two runs.
    let (mut thread_tps, mut mpi_tps) = (0.0, 0.0);
    for round in 1..=2 {
        let thread_line = capture(
            &format!("train_gpt threads W=4 (run {round} of 2)"),
            Command::new(&train_gpt)
                .current_dir(root())
                .args(["--ranks", "4"])
                .args(steps),
        )?;
        let mpi_line = capture(
            &format!("train_gpt mpi W=4 (run {round} of 2)"),
            mpirun(4)
                .arg(&train_gpt)
                .args(["--backend", "mpi"])
                .args(steps),
        )?;
        thread_tps += field(&thread_line, "tokens_per_s")? / 2.0;
        mpi_tps += field(&mpi_line, "tokens_per_s")? / 2.0;
    }
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    println!(
        "{{\"mpi_all_gather_gbps\": {:.4}, \"mpi_reduce_scatter_gbps\": {:.4}, \
         \"thread_all_gather_gbps\": {:.4}, \"thread_reduce_scatter_gbps\": {:.4}, \
         \"mpi_tokens_per_s\": {mpi_tps:.1}, \"thread_tokens_per_s\": {thread_tps:.1}, \
         \"mpi_over_thread_tokens\": {:.3}, \"load_average\": {load:.2}}}",
        field(&coll, "mpi_all_gather_gbps")?,
        field(&coll, "mpi_reduce_scatter_gbps")?,
        field(&coll, "thread_all_gather_gbps")?,
        field(&coll, "thread_reduce_scatter_gbps")?,
        mpi_tps / thread_tps,
    );
    Ok(())
}
