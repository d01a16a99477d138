//! The command line's paths, checked before anything is read or written (issues #26, #37): no
//! output may be the same file as an input or as another output, file outputs must not be
//! directories and directory outputs not files, every input must be a regular file (or the
//! expected directory: a FIFO would block the read forever), a token cache is never read
//! through a symbolic link, `--export-hf` never writes into its `--init-from` model, and a fresh
//! run (no `--resume`) never writes into a checkpoint directory that already holds checkpoints
//! ([`check`], usage errors, exit 2, nothing changed on disk).
//!
//! Then, on the process that writes them (module `lock`): every output's directory is created
//! and the output locked ([`lock_outputs`]); with the locks held, outputs that would lose
//! earlier work are refused ([`check_existing`]: an existing `--metrics` file unless `--resume`
//! appends to it or `--overwrite`, an existing `--export-hf` model unless `--overwrite`); and
//! once the model's size is known, every output that holds the model is checked for free space
//! ([`check_space`]).
//!
//! Sameness is decided by device and inode, not by spelling: `a.txt`, `./a.txt`, a hard link and
//! a symbolic link to it are the same file. A path that does not exist yet is identified by its
//! parent directory's device and inode and its file name.
//!
//! `--save` over `--load` (the same file) is allowed on purpose: the state dict loaded at the
//! start is replaced, all-or-nothing, by the trained one after the last step.
//!
//! To add an output: one [`Output`] in [`outputs`] (its flag, path and whether it is a
//! directory); locking, the sameness checks and the probes follow from that row.

use std::path::{Path, PathBuf};

use fsdp_core::checkpoint::{self, CheckpointManager};
use fsdp_core::state_dict::check_save_target;

use crate::cli::Cli;
use crate::data::{file_kind, DataFormat};
use crate::input::check_regular;
use crate::job::{DataSpec, TrainConfig};
use crate::lock::{dir_lock_path, file_lock_path, Lock, LockError};
use crate::tokenizer::{cache_paths, cache_tag};

/// The hf directory files `--init-from DIR` must hold (kept here as plain names so that this
/// module needs nothing of `hf`).
const HF_FILES: [&str; 2] = ["model.safetensors", "config.json"];

/// The paths of the command line that are not part of [`TrainConfig`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CliPaths<'a> {
    /// `--metrics`.
    pub metrics: Option<&'a Path>,
    /// `--plot`.
    pub plot: Option<&'a Path>,
    /// `--cluster` (a file, or a preset name when no such file exists).
    pub cluster: Option<&'a Path>,
    /// `--tensorboard` (a directory of event files).
    pub tensorboard: Option<&'a Path>,
    /// `--overwrite`: replace an existing `--metrics` file or `--export-hf` model.
    pub overwrite: bool,
}

impl<'a> CliPaths<'a> {
    /// The paths of `cli`.
    pub fn of(cli: &'a Cli) -> CliPaths<'a> {
        CliPaths {
            metrics: cli.logging.metrics.as_deref(),
            plot: cli.logging.plot.as_deref(),
            cluster: cli.planning.cluster.as_deref(),
            tensorboard: cli.logging.tensorboard.as_deref(),
            overwrite: cli.logging.overwrite,
        }
    }
}

/// One output of a run.
#[derive(Debug, Clone, Copy)]
pub struct Output<'a> {
    /// Its flag.
    pub flag: &'static str,
    /// The path given.
    pub path: &'a Path,
    /// A directory (`--checkpoint-dir`, `--export-hf`), else a file.
    pub dir: bool,
}

/// Every output of the run: the one list the checks, the locks and the probes follow.
pub fn outputs<'a>(c: &'a TrainConfig, x: &CliPaths<'a>) -> Vec<Output<'a>> {
    let file = |flag, path| Output {
        flag,
        path,
        dir: false,
    };
    let dir = |flag, path| Output {
        flag,
        path,
        dir: true,
    };
    let mut v = Vec::new();
    v.extend(c.save.as_deref().map(|p| file("--save", p)));
    v.extend(x.metrics.map(|p| file("--metrics", p)));
    v.extend(x.plot.map(|p| file("--plot", p)));
    v.extend(c.profile.as_deref().map(|p| file("--profile", p)));
    v.extend(
        c.checkpoint_dir
            .as_deref()
            .map(|p| dir("--checkpoint-dir", p)),
    );
    v.extend(
        c.interop
            .export_hf
            .as_deref()
            .map(|p| dir("--export-hf", p)),
    );
    v.extend(x.tensorboard.map(|p| dir("--tensorboard", p)));
    v
}

/// What identifies a file system object (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Identity {
    /// An existing object: (device, inode).
    Existing(u64, u64),
    /// A name to be created: the parent's (device, inode) and the file name.
    ToCreate(u64, u64, std::ffi::OsString),
    /// Neither could be determined (the parent does not exist yet): the path as written,
    /// made absolute.
    Spelled(PathBuf),
}

fn identity(path: &Path) -> Identity {
    use std::os::unix::fs::MetadataExt;
    if let Ok(m) = std::fs::metadata(path) {
        return Identity::Existing(m.dev(), m.ino());
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match (std::fs::metadata(parent), path.file_name()) {
        (Ok(m), Some(name)) => Identity::ToCreate(m.dev(), m.ino(), name.to_os_string()),
        _ => Identity::Spelled(std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())),
    }
}

/// The directory a `--init-from` path stands for (the path itself, or a file's directory).
fn init_from_dir(p: &Path) -> PathBuf {
    if p.is_dir() {
        p.to_path_buf()
    } else {
        match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        }
    }
}

/// The inputs of `c`, each checked to be a regular file (or the expected directory); `(flag,
/// path)` for the sameness checks.
fn inputs<'a>(
    c: &'a TrainConfig,
    x: &CliPaths<'a>,
) -> Result<Vec<(&'static str, PathBuf)>, String> {
    let mut inputs: Vec<(&'static str, PathBuf)> = Vec::new();
    if let DataSpec::File { path, format, .. } = &c.data {
        check_regular("--data", path, "give a text or u16 token file")?;
        inputs.push(("--data", path.clone()));
        let tag = cache_tag(&c.interop.tokenizer).filter(|_| *format == DataFormat::Text);
        if let Some(tag) = tag {
            // The token cache is read and written beside the text: never through a link, never
            // anything but a regular file, and never an output of this run.
            let (bin, side) = cache_paths(path, &tag);
            for p in [bin, side] {
                if let Ok(m) = std::fs::symlink_metadata(&p) {
                    let t = m.file_type();
                    if t.is_symlink() {
                        return Err(format!(
                            "token cache {}: it is a symbolic link; a token cache is never read \
                             through a link (it could point at anything): remove it and \
                             train_gpt tokenizes --data {} again",
                            p.display(),
                            path.display()
                        ));
                    }
                    if !t.is_file() {
                        return Err(format!(
                            "token cache {}: it is {}, not a regular file; remove it and \
                             train_gpt tokenizes --data {} again",
                            p.display(),
                            file_kind(t),
                            path.display()
                        ));
                    }
                }
                inputs.push(("the token cache", p));
            }
        }
    }
    if let Some(p) = &c.load {
        check_regular(
            "--load",
            p,
            "give a safetensors state dict (train_gpt --save)",
        )?;
        inputs.push(("--load", p.clone()));
    }
    if let Some(p) = &c.interop.init_from {
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => {
                for name in HF_FILES {
                    let f = p.join(name);
                    if f.exists() {
                        check_regular("--init-from", &f, "a model directory holds regular files")?;
                    }
                    inputs.push(("--init-from", f));
                }
            }
            Ok(_) => {
                check_regular(
                    "--init-from",
                    p,
                    "give a Hugging Face model directory or its model.safetensors",
                )?;
                inputs.push(("--init-from", p.clone()));
                let cfg = init_from_dir(p).join(HF_FILES[1]);
                if cfg.exists() {
                    check_regular("--init-from", &cfg, "config.json must be a regular file")?;
                }
                inputs.push(("--init-from", cfg));
            }
            // A missing model is reported by its loader (naming what it looked for).
            Err(_) => {}
        }
    }
    if let Some(p) = x.cluster.filter(|p| p.exists()) {
        check_regular(
            "--cluster",
            p,
            "give a cluster file (TOML) or a preset name",
        )?;
        inputs.push(("--cluster", p.to_path_buf()));
    }
    Ok(inputs)
}

/// Checks the paths of `c` (see the module docs). `Err` holds the one-line message of a usage
/// error (exit 2). Changes nothing on disk.
pub fn check(c: &TrainConfig, x: &CliPaths<'_>) -> Result<(), String> {
    let inputs = inputs(c, x)?;
    let outputs = outputs(c, x);
    for o in &outputs {
        match std::fs::metadata(o.path) {
            Ok(m) if m.is_dir() && !o.dir => {
                return Err(format!(
                    "{flag} {}: it is a directory; {flag} writes a file: give a file path",
                    o.path.display(),
                    flag = o.flag
                ))
            }
            Ok(m) if !m.is_dir() && o.dir => {
                return Err(format!(
                    "{flag} {}: it is {}; {flag} writes a directory: give a new or existing \
                     directory (nothing was written)",
                    o.path.display(),
                    file_kind(m.file_type()),
                    flag = o.flag
                ))
            }
            _ => {}
        }
    }
    if let (Some(out), Some(src)) = (&c.interop.export_hf, &c.interop.init_from) {
        if identity(out) == identity(&init_from_dir(src)) {
            return Err(format!(
                "--export-hf {} is the --init-from model's directory: exporting would replace the \
                 model this run starts from; export into another directory",
                out.display()
            ));
        }
    }
    let ids: Vec<Identity> = outputs.iter().map(|o| identity(o.path)).collect();
    for (i, o) in outputs.iter().enumerate() {
        for (in_flag, q) in &inputs {
            // `--save` over `--load` is allowed: the trained state replaces the loaded one,
            // all-or-nothing, after training.
            if (o.flag, *in_flag) == ("--save", "--load") {
                continue;
            }
            if ids[i] == identity(q) {
                return Err(format!(
                    "{} {} is the same file as {in_flag} {}: writing it would destroy the \
                     input; choose another path",
                    o.flag,
                    o.path.display(),
                    q.display()
                ));
            }
        }
        for (j, other) in outputs.iter().enumerate().take(i) {
            if ids[i] == ids[j] {
                return Err(format!(
                    "{} {} and {} {} are the same file; give each output its own path",
                    other.flag,
                    other.path.display(),
                    o.flag,
                    o.path.display()
                ));
            }
        }
    }
    if let Some(d) = &c.checkpoint_dir {
        if let (false, Ok(m)) = (c.resume, std::fs::metadata(d)) {
            if m.is_dir() {
                // Any `step_N` directory, complete or damaged, belongs to an earlier run.
                let (found, skipped) = checkpoint::latest_valid(d)
                    .map_err(|e| format!("--checkpoint-dir {}: {e}", d.display()))?;
                let first = found.or_else(|| skipped.into_iter().next().map(|s| s.dir));
                if let Some(newest) = first {
                    return Err(format!(
                        "--checkpoint-dir {} already holds checkpoints of an earlier run (newest: \
                         {}); continue that run with --resume, or give a new or empty directory \
                         (nothing was changed)",
                        d.display(),
                        newest.display()
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The locks of a run's outputs, held until dropped (the end of the process).
#[derive(Debug, Default)]
pub struct Locks(#[allow(dead_code)] Vec<Lock>);

/// Why the outputs could not be locked.
#[derive(Debug)]
pub enum LockFailure {
    /// Another run holds one (a usage error, exit 2).
    Held(String),
    /// A directory or lock file could not be made (exit 1).
    Io(String),
}

/// Creates every output's directory (a file output's parent, a directory output itself) and
/// locks every output (module `lock`), in the order of [`outputs`]. Call it on the process that
/// writes the outputs (rank 0), before step 1.
///
/// # Errors
/// [`LockFailure::Held`] naming the output and the process holding it; [`LockFailure::Io`].
pub fn lock_outputs(c: &TrainConfig, x: &CliPaths<'_>) -> Result<Locks, LockFailure> {
    let mut held = Vec::new();
    for o in outputs(c, x) {
        let dir = if o.dir {
            o.path.to_path_buf()
        } else {
            match o.path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            }
        };
        std::fs::create_dir_all(&dir).map_err(|e| {
            LockFailure::Io(format!(
                "{} {}: cannot create directory {}: {e}",
                o.flag,
                o.path.display(),
                dir.display()
            ))
        })?;
        let lock_file = if o.dir {
            dir_lock_path(o.path)
        } else {
            file_lock_path(o.path)
        };
        let lock = Lock::try_take(o.flag, o.path, &lock_file).map_err(|e| match e {
            LockError::Held { .. } => LockFailure::Held(e.to_string()),
            LockError::Io { .. } => LockFailure::Io(e.to_string()),
        })?;
        held.push(lock);
    }
    Ok(Locks(held))
}

/// With the locks held: refuses outputs whose earlier contents a run would lose (a usage
/// error, exit 2): an existing, non-empty `--metrics` file unless `--resume` (lines are
/// appended) or `--overwrite`; an `--export-hf` directory that already holds a model
/// (`config.json` or `model.safetensors`) unless `--overwrite`.
pub fn check_existing(c: &TrainConfig, x: &CliPaths<'_>) -> Result<(), String> {
    if let Some(m) = x.metrics {
        let len = std::fs::metadata(m).map_or(0, |m| m.len());
        if len > 0 && !c.resume && !x.overwrite {
            return Err(format!(
                "--metrics {} already holds {len} bytes (an earlier run's lines); --resume \
                 appends to it, --overwrite replaces it, or choose another path (nothing was \
                 changed)",
                m.display()
            ));
        }
    }
    if let Some(d) = &c.interop.export_hf {
        let present: Vec<&str> = HF_FILES
            .iter()
            .copied()
            .filter(|f| std::fs::symlink_metadata(d.join(f)).is_ok())
            .collect();
        if !present.is_empty() && !x.overwrite {
            return Err(format!(
                "--export-hf {} already holds a model ({}); --overwrite replaces it, or export \
                 into another directory (nothing was changed)",
                d.display(),
                present.join(", ")
            ));
        }
    }
    Ok(())
}

/// Bytes of f32 values a model of `params` parameters takes, plus `slots` optimizer tensors of
/// the same size, plus 1 MiB for headers, names and metadata.
fn model_bytes(params: u64, slots: u64) -> u64 {
    params
        .saturating_mul(4)
        .saturating_mul(1 + slots)
        .saturating_add(1 << 20)
}

/// Checks, before step 1, that every output that holds the model fits on its file system: a
/// checkpoint (parameters and optimizer state: `4·Ψ·(1 + slots)` bytes), `--save` and
/// `--export-hf` (`4·Ψ`), each on its own (fsdp-core's `check_save_target`: the directory is
/// writable and `statvfs` reports that many free bytes). `params`: the model's parameter
/// count; `slots`: the optimizer's state tensors per parameter. Each target is checked alone:
/// outputs sharing a file system are not added up.
///
/// # Errors
/// The flag, the path, the bytes free and the bytes needed.
pub fn check_space(c: &TrainConfig, params: u64, slots: u64) -> Result<(), String> {
    if let Some(d) = &c.checkpoint_dir {
        let mut need = model_bytes(params, slots);
        // The newest checkpoint's real size, when there is one (with the metric history).
        if let Ok(Some(newest)) = checkpoint::latest_complete(d) {
            need = need.max(fsdp_core::state_dict::disk_usage(newest).unwrap_or(0));
        }
        check_save_target(d.join(checkpoint::step_dir_name(0)), Some(need))
            .map_err(|e| format!("--checkpoint-dir: {e}"))?;
    }
    if let Some(p) = &c.save {
        check_save_target(p, Some(model_bytes(params, 0))).map_err(|e| format!("--save: {e}"))?;
    }
    if let Some(d) = &c.interop.export_hf {
        check_save_target(d.join(HF_FILES[0]), Some(model_bytes(params, 0)))
            .map_err(|e| format!("--export-hf: {e}"))?;
    }
    Ok(())
}

/// Checks every output location before step 1 (fsdp-core's fail-early checks: the directory
/// exists or can be created, a file can be created in it, the target is not a symlink or
/// device) — writability only; the free space follows in [`check_space`] once the model is
/// known.
///
/// # Errors
/// The flag and the reason (exit 1).
pub fn check_writable(c: &TrainConfig, x: &CliPaths<'_>) -> Result<(), String> {
    for o in outputs(c, x) {
        if o.flag == "--checkpoint-dir" {
            CheckpointManager::new(o.path, c.keep_checkpoints)
                .and_then(|m| m.check_target())
                .map_err(|e| format!("--checkpoint-dir: {e}"))?;
        } else if o.flag == "--tensorboard" {
            // Event files get fresh names; writability of the directory is what matters.
            check_save_target(o.path.join("events.out.tfevents.probe"), None)
                .map_err(|e| format!("{}: {e}", o.flag))?;
        } else if o.dir {
            check_save_target(o.path.join(HF_FILES[0]), None)
                .map_err(|e| format!("{}: {e}", o.flag))?;
        } else {
            check_save_target(o.path, None).map_err(|e| format!("{}: {e}", o.flag))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn check_args(args: &[&str]) -> Result<(), String> {
        let mut v = vec!["train_gpt"];
        v.extend(args);
        let cli = Cli::try_parse_from(v).unwrap();
        let c = cli.clone().into_config().unwrap();
        check(&c, &CliPaths::of(&cli))
    }

    /// Issue #26 (2) and (4): outputs that are inputs or each other (by inode, whatever the
    /// spelling), a directory as `--save`, and non-regular `--data` are refused before
    /// anything is written; the input stays unchanged.
    #[test]
    fn outputs_cannot_clobber_inputs_or_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("precious.txt");
        std::fs::write(&data, vec![b'a'; 4096]).unwrap();
        let d = data.to_str().unwrap();
        let e = check_args(&["--data", d, "--metrics", d]).unwrap_err();
        assert!(
            e.contains("--metrics") && e.contains("same file as --data"),
            "{e}"
        );
        let e = check_args(&["--data", d, "--save", d]).unwrap_err();
        assert!(e.contains("--save"), "{e}");
        // --tensorboard is an output like the others (regression: it was outside the list).
        let e = check_args(&["--data", d, "--tensorboard", d]).unwrap_err();
        assert!(e.contains("--tensorboard"), "{e}");
        // Another spelling and a hard link are the same file.
        let dotted = format!("{}/./precious.txt", dir.path().display());
        assert!(check_args(&["--data", d, "--plot", &format!("{dotted}.svg")]).is_ok());
        let link = dir.path().join("link.svg");
        std::fs::hard_link(&data, &link).unwrap();
        let e = check_args(&["--data", &dotted, "--plot", link.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("--plot"), "{e}");
        // Two outputs naming one file that does not exist yet.
        let m = dir.path().join("m.svg");
        let m2 = format!(
            "{}/../{}/m.svg",
            dir.path().display(),
            dir.path().file_name().unwrap().to_str().unwrap()
        );
        let e = check_args(&["--metrics", m.to_str().unwrap(), "--plot", &m2]).unwrap_err();
        assert!(e.contains("--metrics") && e.contains("--plot"), "{e}");
        // --save naming a directory; --data naming a directory or a FIFO.
        let e = check_args(&["--save", dir.path().to_str().unwrap()]).unwrap_err();
        assert!(e.contains("is a directory"), "{e}");
        let e = check_args(&["--data", dir.path().to_str().unwrap()]).unwrap_err();
        assert!(e.contains("a directory, not a regular file"), "{e}");
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let e = check_args(&["--data", fifo.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("FIFO"), "{e}");
        assert_eq!(std::fs::read(&data).unwrap(), vec![b'a'; 4096]);
        // --save over --load is allowed (the loaded state is replaced after training).
        assert!(check_args(&["--load", d, "--save", d]).is_ok());
        // --profile in a place that cannot hold a file is caught by the writability check
        // (main's check_outputs); here: --profile naming the data.
        let e = check_args(&["--data", d, "--profile", d]).unwrap_err();
        assert!(e.contains("--profile"), "{e}");
    }

    /// Issue #26 (1): a fresh run never writes into a checkpoint directory of an earlier run
    /// (whose higher steps would outlive, and be resumed instead of, the new checkpoints);
    /// `--resume` continues it.
    #[test]
    fn a_fresh_run_refuses_a_used_checkpoint_directory() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ck");
        let ck_s = ck.to_str().unwrap();
        assert!(check_args(&["--checkpoint-dir", ck_s]).is_ok());
        std::fs::create_dir_all(ck.join("step_01")).unwrap(); // not a checkpoint name
        assert!(check_args(&["--checkpoint-dir", ck_s]).is_ok());
        std::fs::create_dir_all(ck.join("step_000000000012")).unwrap();
        let e = check_args(&["--checkpoint-dir", ck_s]).unwrap_err();
        assert!(
            e.contains("--resume") && e.contains("step_000000000012"),
            "{e}"
        );
        assert!(check_args(&["--checkpoint-dir", ck_s, "--resume"]).is_ok());
    }

    /// Issue #37 (7): every output that holds the model is checked for room before step 1,
    /// with the numbers in the message (a model of 2^50 parameters fits nowhere; a tiny one
    /// fits in any temporary directory).
    #[test]
    fn outputs_are_checked_for_room_for_the_model() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
        let cli = Cli::try_parse_from([
            "train_gpt",
            "--checkpoint-dir",
            &p("ck"),
            "--save",
            &p("s.st"),
            "--export-hf",
            &p("hf"),
        ])
        .unwrap();
        let c = cli.into_config().unwrap();
        check_space(&c, 1000, 2).unwrap();
        let huge = 1u64 << 50;
        let e = check_space(&c, huge, 2).unwrap_err();
        assert!(
            e.starts_with("--checkpoint-dir") && e.contains("bytes free"),
            "{e}"
        );
        assert!(e.contains(&(huge * 4 * 3 + (1 << 20)).to_string()), "{e}");
        let only_save = Cli::try_parse_from(["train_gpt", "--save", &p("s.st")]).unwrap();
        let e = check_space(&only_save.into_config().unwrap(), huge, 2).unwrap_err();
        assert!(e.starts_with("--save") && e.contains(&(huge * 4 + (1 << 20)).to_string()));
        let only_hf = Cli::try_parse_from(["train_gpt", "--export-hf", &p("hf")]).unwrap();
        let e = check_space(&only_hf.into_config().unwrap(), huge, 0).unwrap_err();
        assert!(e.starts_with("--export-hf"), "{e}");
    }
}
