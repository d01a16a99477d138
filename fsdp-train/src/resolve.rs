//! From the parsed command line to the configuration a run trains with, before anything
//! trains: the flags' validation into a [`TrainConfig`] (`Cli::into_config`), the path checks
//! (module `paths`) and the output checks, the interop preparation (`--init-from`'s shape,
//! `--tokenizer gpt2`'s token file: `interop::prepare`) and, with `--plan`, the planner's table
//! and `--apply`'s top plan (`plan::apply`). Each step takes the configuration by value and
//! returns the next one; nothing edits it afterwards.

use std::process::ExitCode;
use std::time::Duration;

use crate::cli::Cli;
use crate::job::{CudaLaunch, TrainConfig};
use crate::probe::{self, Probe};
use crate::{cli, cuda, interop, paths, plan};

/// Why `train_gpt` stops before or during a run: the exit code and the line printed after
/// `train_gpt: ` on stderr.
#[derive(Debug)]
pub struct Exit {
    /// 2 for a usage error, 1 for anything else.
    pub code: u8,
    /// The message.
    pub line: String,
}

impl Exit {
    /// A command line that parses but does not make sense (exit 2).
    pub fn usage(line: impl Into<String>) -> Exit {
        Exit {
            code: 2,
            line: line.into(),
        }
    }

    /// A failure of the run (exit 1), printed as `error: …`.
    pub fn error(e: impl std::fmt::Display) -> Exit {
        Exit {
            code: 1,
            line: format!("error: {e}"),
        }
    }

    /// Prints the line and returns the exit code.
    pub fn exit(&self, prog: &str) -> ExitCode {
        eprintln!("{prog}: {}", self.line);
        ExitCode::from(self.code)
    }
}

/// A command-line parse failure: `--help`/`--version` print and succeed; anything else prints
/// one line (clap's first line names the flag, the value and the allowed range) and exits 2.
pub fn parse_failure(prog: &str, e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    if e.kind() == ErrorKind::InvalidUtf8 {
        return Exit::usage(non_utf8_line(std::env::args_os())).exit(prog);
    }
    Exit::usage(format!("{} (see --help)", one_line(&e.to_string()))).exit(prog)
}

/// A clap error message as one line: its first line with the indented lines right below it
/// (e.g. the names after "the following required arguments were not provided:"), without the
/// usage block and the "For more information" tip.
fn one_line(msg: &str) -> String {
    let mut lines = msg.lines().skip_while(|l| l.trim().is_empty());
    let mut out = lines
        .next()
        .unwrap_or("usage error")
        .trim_start_matches("error: ")
        .trim_end()
        .to_string();
    for l in lines.take_while(|l| l.starts_with(' ') && !l.trim().is_empty()) {
        out.push(' ');
        out.push_str(l.trim());
    }
    out
}

/// The one line for an argument that is not valid UTF-8 where text is expected (paths may be
/// any bytes; a prompt, a number or a name may not): names the flag and shows the value with
/// the bad bytes escaped.
fn non_utf8_line(args: impl Iterator<Item = std::ffi::OsString>) -> String {
    let args: Vec<std::ffi::OsString> = args.collect();
    let Some(i) = args.iter().position(|a| a.to_str().is_none()) else {
        return "an argument is not valid UTF-8 (see --help)".into();
    };
    let shown = format!("{:?}", args[i]);
    let arg = args[i].to_string_lossy();
    let flag = match arg.split_once('=') {
        Some((f, _)) if f.starts_with("--") => Some(f.to_string()),
        _ => args
            .get(i.wrapping_sub(1))
            .and_then(|p| p.to_str())
            .filter(|p| p.starts_with("--"))
            .map(str::to_string),
    };
    match flag {
        Some(f) => format!(
            "{f}: the value {shown} is not valid UTF-8; {f} takes text (only paths may be \
             any bytes) (see --help)"
        ),
        None => format!("the argument {shown} is not valid UTF-8 (see --help)"),
    }
}

/// A run ready to train.
pub struct Resolved {
    /// The configuration, final.
    pub config: TrainConfig,
    /// The GEMM probe, when `--plan` needed it already (the run reuses it).
    pub probe: Option<Probe>,
    /// Whether this process prints (see [`primary_process`]).
    pub primary: bool,
    /// The locks of the outputs (the primary process's; empty on the others), held while the
    /// run writes them.
    pub locks: paths::Locks,
}

/// The run `cli` asks for; `None` when there is nothing to train (`--plan` without `--apply`,
/// after printing the table). Prints the interop notes (and the plan) on the primary process.
/// Sets the process-wide TF32 switch (`--tf32`) before anything touches a GPU.
///
/// # Errors
/// Usage errors (exit 2): `--apply` without `--plan`, flags that do not combine, unsafe paths.
/// Errors (exit 1): no CUDA device, outputs that cannot be written, `--init-from` or
/// `--tokenizer` failures, a planning failure or a top plan this run cannot take.
pub fn resolve(cli: &Cli) -> Result<Option<Resolved>, Exit> {
    if cli.planning.apply && !cli.planning.plan {
        return Err(Exit::usage(
            "--apply needs --plan (it trains with the planner's top plan) (see --help)",
        ));
    }
    if let Ok(Some(launch)) = cli::cuda_launch(cli.parallel.device, cli.parallel.backend) {
        // A typed error, never a panic: `Device::cuda` checks for the driver library before
        // touching cudarc.
        cuda::preflight(launch).map_err(|e| Exit {
            code: 1,
            line: format!("--device cuda: {e}"),
        })?;
    }
    let config = cli
        .clone()
        .into_config()
        .map_err(|e| Exit::usage(format!("{e} (see --help)")))?;
    // Outputs that would destroy inputs or each other, a directory as --save, a non-file as
    // an input, a fresh run into a used checkpoint directory: usage errors before anything runs.
    let x = paths::CliPaths::of(cli);
    paths::check(&config, &x).map_err(Exit::usage)?;
    interop::check_gelu(&config).map_err(Exit::usage)?;
    let primary = primary_process(&config);
    // The writing process locks every output (another run holding one: exit 2), then, with
    // the locks held, refuses to lose earlier work and probes every output.
    let locks = if primary {
        let locks = paths::lock_outputs(&config, &x).map_err(|e| match e {
            paths::LockFailure::Held(m) => Exit::usage(m),
            paths::LockFailure::Io(m) => Exit::error(m),
        })?;
        paths::check_existing(&config, &x).map_err(Exit::usage)?;
        locks
    } else {
        paths::Locks::default()
    };
    paths::check_writable(&config, &x).map_err(Exit::error)?;
    fsdp_autograd::kernels::cuda::set_allow_tf32(config.tf32);
    let (config, notes) = interop::prepare(config).map_err(Exit::error)?;
    if primary {
        for note in notes {
            println!("{note}");
        }
        // The model is known now (`--init-from` sets its shape): room for what holds it.
        let slots = config.build_optimizer().state_slots() as u64;
        paths::check_space(&config, config.model.params(), slots).map_err(Exit::error)?;
    }
    if !cli.planning.plan {
        return Ok(Some(Resolved {
            config,
            probe: None,
            primary,
            locks,
        }));
    }
    // `--plan`: the ranked table (the primary process prints it); `--apply` trains with the
    // top plan. The plan needs the GEMM rate of the device the model trains on.
    let probe = gemm_probe(&config)?;
    let config = match planned(cli, config, probe.flops_per_s, primary).map_err(Exit::error)? {
        Some(c) => c,
        None => return Ok(None),
    };
    Ok(Some(Resolved {
        config,
        probe: Some(probe),
        primary,
        locks,
    }))
}

/// `--plan`: prints the ranked table; with `--apply`, the configuration of the top plan.
fn planned(
    cli: &Cli,
    c: TrainConfig,
    gemm_rate: f64,
    primary: bool,
) -> Result<Option<TrainConfig>, String> {
    let (cluster, hardware) = plan::cluster(&cli.planning, c.ranks, gemm_rate)?;
    let planner = plan::planner(&c, cluster, hardware)?;
    let top = if primary {
        plan::print_plan(&c, &planner)?
    } else {
        planner.plan().ok().and_then(|p| p.first().copied())
    };
    if !cli.planning.apply {
        return Ok(None);
    }
    let Some(top) = top else {
        return Err(planner
            .plan()
            .err()
            .map_or("no plan".into(), |e| e.to_string()));
    };
    if c.mpi && cli.planning.cluster_tflops.is_none() && cli.planning.cluster.is_none() {
        return Err(
            "--plan --apply with --backend mpi: give the compute rate (--cluster-tflops or \
             --cluster FILE) so every process plans alike (each process's GEMM probe differs)"
                .into(),
        );
    }
    if cluster.world() != c.ranks {
        return Err(format!(
            "--apply: the assumed cluster has {} ranks ({} node(s) × {}), but this run has \
             --ranks {}; plan for the ranks you train on",
            cluster.world(),
            cluster.nodes,
            cluster.ranks_per_node,
            c.ranks
        ));
    }
    plan::apply(c, &top).map(Some).map_err(|e| e.0)
}

/// The GEMM rate of the device the model trains on, at its precision: a ~0.2 s probe (module
/// `probe`) on all cores of this machine for CPU ranks, on the first GPU with `--device cuda`.
///
/// # Errors
/// The probe's device or kernel error.
pub fn gemm_probe(c: &TrainConfig) -> Result<Probe, Exit> {
    probe::run(c, cores(), Duration::from_millis(200))
        .map_err(|e| Exit::error(format!("GEMM probe: {e}")))
}

/// The cores of this machine (the GEMM probe's threads, the ranks' matmul share).
pub fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Whether this process prints: always with thread ranks; with `--backend mpi` or one process
/// per GPU, rank 0 (from the launcher's environment).
pub fn primary_process(c: &TrainConfig) -> bool {
    if c.cuda == Some(CudaLaunch::Processes) {
        return fsdp_collectives::RendezvousEnv::from_env().is_ok_and(|e| e.rank == 0);
    }
    if !c.mpi {
        return true;
    }
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .is_none_or(|r| r.trim() == "0")
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn resolved(args: &[&str]) -> Result<Option<Resolved>, Exit> {
        let cli =
            Cli::try_parse_from(std::iter::once("train_gpt").chain(args.iter().copied())).unwrap();
        resolve(&cli)
    }

    /// Issue #37 (4): a non-UTF-8 value is named by its flag, with the bad bytes escaped.
    #[test]
    fn non_utf8_values_name_their_flag() {
        use std::os::unix::ffi::OsStringExt;
        let bad = std::ffi::OsString::from_vec(b"ab\xff".to_vec());
        let args = ["train_gpt", "sample", "--prompt"]
            .into_iter()
            .map(std::ffi::OsString::from)
            .chain([bad]);
        let line = non_utf8_line(args);
        assert!(
            line.starts_with("--prompt: the value \"ab\\xFF\" is not valid UTF-8"),
            "{line}"
        );
        let eq = std::ffi::OsString::from_vec(b"--steps=1\xfe".to_vec());
        let line = non_utf8_line([std::ffi::OsString::from("train_gpt"), eq].into_iter());
        assert!(line.starts_with("--steps:"), "{line}");
    }

    /// Usage errors exit 2 with the old one-line messages; a run without `--plan` is the parsed
    /// configuration itself.
    #[test]
    fn usage_errors_and_the_plain_run() {
        let e = resolved(&["--apply"]).err().unwrap();
        assert_eq!(e.code, 2);
        assert!(e.line.starts_with("--apply needs --plan"), "{}", e.line);
        let e = resolved(&["--tf32"]).err().unwrap();
        assert_eq!(e.code, 2);
        assert!(e.line.contains("--tf32") && e.line.ends_with("(see --help)"));
        let r = resolved(&["--steps", "7", "--optimizer", "lamb"])
            .unwrap()
            .unwrap();
        assert!(r.probe.is_none() && r.primary);
        assert_eq!((r.config.steps, r.config.lr), (7, 1e-3));
    }

    /// Regression (#41): a clap error whose names follow on indented lines keeps them on the
    /// one line printed (it said "required arguments were not provided:" and named none).
    #[test]
    fn clap_errors_keep_the_names_that_follow() {
        use clap::{Arg, Command};
        let e = Command::new("t")
            .arg(Arg::new("a").long("a").required(true))
            .arg(Arg::new("b").long("b").required(true))
            .try_get_matches_from(["t"])
            .unwrap_err();
        let line = one_line(&e.to_string());
        assert!(line.contains("not provided") && line.contains("--a") && line.contains("--b"));
        assert!(!line.contains("Usage") && !line.contains('\n'), "{line}");
        let e = Cli::try_parse_from(["train_gpt", "--steps", "x"]).unwrap_err();
        let line = one_line(&e.to_string());
        assert!(line.starts_with("invalid value 'x' for '--steps"), "{line}");
    }

    /// `--plan` alone trains nothing; `--plan --apply` trains with the top plan's settings and
    /// hands the probe on (it runs once).
    #[test]
    fn plan_alone_stops_and_apply_takes_the_top_plan() {
        fn with(extra: &[&'static str]) -> Vec<&'static str> {
            let small = [
                "--d-model",
                "32",
                "--layers",
                "2",
                "--heads",
                "2",
                "--seq-len",
                "16",
            ];
            [&small[..], extra].concat()
        }
        assert!(resolved(&with(&["--plan"])).unwrap().is_none());
        let r = resolved(&with(&["--plan", "--apply", "--strategy", "no-shard"]))
            .unwrap()
            .unwrap();
        assert!(r.probe.is_some());
        // The top plan decides the limiter outright.
        assert!(r.config.adaptive_limiter.is_none());
        let e = resolved(&with(&[
            "--plan",
            "--apply",
            "--cluster-nodes",
            "2",
            "--cluster-ranks-per-node",
            "4",
        ]))
        .err()
        .unwrap();
        assert_eq!(e.code, 1);
        assert!(
            e.line.contains("plan for the ranks you train on"),
            "{}",
            e.line
        );
    }
}
