//! The command line's paths, checked before anything is read or written (issue #26): no output
//! may be the same file as an input or as another output, `--save` and the other output files
//! must not be directories, `--data` must be a regular file, and a fresh run (no `--resume`)
//! never writes into a checkpoint directory that already holds checkpoints.
//!
//! Sameness is decided by device and inode, not by spelling: `a.txt`, `./a.txt`, a hard link and
//! a symbolic link to it are the same file. A path that does not exist yet is identified by its
//! parent directory's device and inode and its file name. A failure is a usage error (exit 2),
//! reported before step 1 with nothing changed on disk.

use std::path::{Path, PathBuf};

use fsdp_core::checkpoint;

use crate::data::file_kind;
use crate::job::{DataSpec, TrainConfig};

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

/// Checks the paths of `c` (see the module docs). `Err` holds the one-line message of a usage
/// error (exit 2).
pub fn check(c: &TrainConfig, metrics: Option<&Path>, plot: Option<&Path>) -> Result<(), String> {
    let mut inputs: Vec<(&str, &Path)> = Vec::new();
    if let DataSpec::File { path, .. } = &c.data {
        match std::fs::metadata(path) {
            Ok(m) if !m.is_file() => {
                return Err(format!(
                    "--data {}: it is {}, not a regular file; give a text or u16 token file",
                    path.display(),
                    file_kind(m.file_type())
                ))
            }
            Ok(_) => inputs.push(("--data", path)),
            Err(e) => return Err(format!("--data {}: {e}", path.display())),
        }
    }
    if let Some(p) = &c.load {
        inputs.push(("--load", p));
    }
    let mut outputs: Vec<(&str, &Path)> = Vec::new();
    for (flag, p) in [
        ("--save", c.save.as_deref()),
        ("--metrics", metrics),
        ("--plot", plot),
        ("--profile", c.profile.as_deref()),
    ] {
        if let Some(p) = p {
            if std::fs::metadata(p).is_ok_and(|m| m.is_dir()) {
                return Err(format!(
                    "{flag} {}: it is a directory; {flag} writes a file: give a file path",
                    p.display()
                ));
            }
            outputs.push((flag, p));
        }
    }
    if let Some(d) = &c.checkpoint_dir {
        outputs.push(("--checkpoint-dir", d));
    }
    let ids: Vec<Identity> = outputs.iter().map(|(_, p)| identity(p)).collect();
    for (i, (flag, p)) in outputs.iter().enumerate() {
        for (in_flag, q) in &inputs {
            // `--save` over `--load` is allowed: the trained state replaces the loaded one, all-or-nothing, after training.
            if (*flag, *in_flag) == ("--save", "--load") {
                continue;
            }
            if ids[i] == identity(q) {
                return Err(format!(
                    "{flag} {} is the same file as {in_flag} {}: writing it would destroy the \
                     input; choose another path",
                    p.display(),
                    q.display()
                ));
            }
        }
        for (j, (other, q)) in outputs.iter().enumerate().take(i) {
            if ids[i] == ids[j] {
                return Err(format!(
                    "{other} {} and {flag} {} are the same file; give each output its own path",
                    q.display(),
                    p.display()
                ));
            }
        }
    }
    if let (Some(d), false) = (&c.checkpoint_dir, c.resume) {
        // Any `step_N` directory, complete or damaged, belongs to an earlier run.
        let (found, skipped) = checkpoint::latest_valid(d)
            .map_err(|e| format!("--checkpoint-dir {}: {e}", d.display()))?;
        let first = found.or_else(|| skipped.into_iter().next().map(|s| s.dir));
        if let Some(newest) = first {
            return Err(format!(
                "--checkpoint-dir {} already holds checkpoints of an earlier run (newest: {}); \
                 continue that run with --resume, or give a new or empty directory (nothing was \
                 changed)",
                d.display(),
                newest.display()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::Parser;

    fn check_args(args: &[&str]) -> Result<(), String> {
        let mut v = vec!["train_gpt"];
        v.extend(args);
        let cli = Cli::try_parse_from(v).unwrap();
        let c = cli.clone().into_config().unwrap();
        check(
            &c,
            cli.logging.metrics.as_deref(),
            cli.logging.plot.as_deref(),
        )
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
}
