//! Exclusive locks on what a run writes (issue #37, 1): two runs on one `--checkpoint-dir`,
//! `--metrics`, `--save`, … would overwrite each other's work, so the second is refused before
//! step 1 (exit 2), naming the path and the process that holds it.
//!
//! A lock is an advisory `flock(2)` on a small lock file:
//! - for a file output `DIR/NAME`: `DIR/.NAME.lock` beside it (the output itself is replaced by
//!   a rename when it is written, so it cannot carry the lock);
//! - for a directory output (`--checkpoint-dir`, `--export-hf`): `DIR/.train_gpt.lock` inside.
//!
//! Paths are resolved first (symbolic links followed, `.`/`..` removed), so every spelling of
//! one output names one lock file. The holder writes its process id into the lock file; a
//! refused run reads it back for its message. The kernel releases the lock when the process
//! ends, however it ends (SIGKILL included), so a lock file left behind never blocks anyone: the
//! next run takes it over. A run removes its lock files when it ends normally or on SIGINT,
//! SIGTERM and SIGHUP (module `cleanup`), only after checking that the path still names the
//! file it locked; a run that finds the path replaced after locking (another run removed it
//! meanwhile) locks the new file instead.
//!
//! With several processes (MPI ranks, one process per GPU) only the primary process (rank 0)
//! takes the locks: it alone writes `--metrics`, `--save`, `--plot`, `--profile` and
//! `--export-hf`, and the checkpoint directory's lock stands for the whole job (the other ranks'
//! shards go into rank 0's staging directory, which rank 0 publishes). A second job on the same
//! outputs is refused on its rank 0, which stops that job. `flock` locks reach across machines
//! only where the file system supports them (local file systems, NFSv4, Lustre with `flock`
//! mounts); on a file system without them a lock protects against runs on the same machine only.
//!
//! A run that must wait rather than fail (a token cache another process is writing: both
//! runs, or all MPI ranks, want the same cache) uses [`Lock::wait`].

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::cleanup::OnSignal;

/// The lock file of a directory output, inside it.
pub const DIR_LOCK: &str = ".train_gpt.lock";

/// Why a lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds it.
    #[error("{what} {} is in use by another run (process {}, holding {}); wait for it to finish, or choose another path", target.display(), pid.map_or("of unknown id".to_string(), |p| p.to_string()), lock.display())]
    Held {
        /// The flag (`--checkpoint-dir`, `--metrics`, …) or what the output is.
        what: String,
        /// The output.
        target: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The holder's process id, as it wrote it into the lock file.
        pid: Option<u32>,
    },
    /// The lock file could not be created or locked.
    #[error("{what} {}: cannot lock {}: {source}", target.display(), lock.display())]
    Io {
        /// The flag or what the output is.
        what: String,
        /// The output.
        target: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// An exclusive lock, held until dropped (then its lock file is removed).
#[derive(Debug)]
pub struct Lock {
    path: PathBuf,
    file: File,
    _signal: OnSignal,
}

/// `path` with its directory part resolved (symbolic links followed; the last component too
/// when it exists), or as written when that fails.
fn resolved(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(parent), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// The lock file of the file output `path`: `.NAME.lock` in its (resolved) directory.
pub fn file_lock_path(path: &Path) -> PathBuf {
    let p = resolved(path);
    let mut name = OsString::from(".");
    name.push(p.file_name().unwrap_or(p.as_os_str()));
    name.push(".lock");
    p.parent().unwrap_or(Path::new(".")).join(name)
}

/// The lock file of the directory output `dir`: `DIR/.train_gpt.lock` (the directory resolved).
pub fn dir_lock_path(dir: &Path) -> PathBuf {
    resolved(dir).join(DIR_LOCK)
}

impl Lock {
    /// Takes the lock `lock_file` for output `target` (`what`: its flag), or says who holds it.
    ///
    /// # Errors
    /// [`LockError::Held`] when another process holds it; [`LockError::Io`] when the lock file
    /// cannot be created (no such directory, no permission, a symlink or non-file in its place).
    pub fn try_take(what: &str, target: &Path, lock_file: &Path) -> Result<Lock, LockError> {
        Self::take(what, target, lock_file, None)
    }

    /// Takes the lock, waiting while another process holds it; `on_wait` is called once, with
    /// the holder's process id, before waiting.
    ///
    /// # Errors
    /// [`LockError::Io`] as for [`Lock::try_take`].
    pub fn wait(
        what: &str,
        target: &Path,
        lock_file: &Path,
        on_wait: &mut dyn FnMut(Option<u32>),
    ) -> Result<Lock, LockError> {
        Self::take(what, target, lock_file, Some(on_wait))
    }

    fn take(
        what: &str,
        target: &Path,
        lock_file: &Path,
        mut on_wait: Option<&mut dyn FnMut(Option<u32>)>,
    ) -> Result<Lock, LockError> {
        let io = |source: std::io::Error| LockError::Io {
            what: what.to_string(),
            target: target.to_path_buf(),
            lock: lock_file.to_path_buf(),
            source,
        };
        let mut told = false;
        loop {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o644)
                // Never through a symlink, never blocking on a FIFO planted there.
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(lock_file)
                .map_err(io)?;
            let meta = file.metadata().map_err(io)?;
            if !meta.is_file() {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "it is not a regular file",
                )));
            }
            match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let pid = holder(&mut file);
                    let Some(f) = on_wait.as_mut() else {
                        return Err(LockError::Held {
                            what: what.to_string(),
                            target: target.to_path_buf(),
                            lock: lock_file.to_path_buf(),
                            pid,
                        });
                    };
                    // Said once, however often the holder changes while we wait.
                    if !told {
                        f(pid);
                        told = true;
                    }
                    flock(&file, libc::LOCK_EX).map_err(io)?;
                }
                Err(e) => return Err(io(e)),
            }
            // The holder before us may have removed the path after we opened it: then our lock
            // is on a file nobody else will find. Lock what the path names now.
            let same = std::fs::symlink_metadata(lock_file)
                .is_ok_and(|m| (m.dev(), m.ino()) == (meta.dev(), meta.ino()));
            if !same {
                continue;
            }
            file.set_len(0).map_err(io)?;
            file.rewind().map_err(io)?;
            writeln!(file, "{}", std::process::id()).map_err(io)?;
            return Ok(Lock {
                path: lock_file.to_path_buf(),
                file,
                _signal: OnSignal::register(lock_file),
            });
        }
    }

    /// The lock file.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `flock(2)` on `file` (`op`: `LOCK_EX`, with `LOCK_NB` not to wait), retried when a signal
/// interrupts it.
fn flock(file: &File, op: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: the descriptor belongs to `file`, open for the whole call; `flock` only
        // changes the lock of that open file description.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The process id a lock file holds (its first line), if readable.
fn holder(file: &mut File) -> Option<u32> {
    let mut s = String::new();
    file.rewind().ok()?;
    file.take(64).read_to_string(&mut s).ok()?;
    s.lines().next()?.trim().parse().ok()
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Only our own file: while we hold the lock no run replaces it, but a user may have.
        let ours = match (self.file.metadata(), std::fs::symlink_metadata(&self.path)) {
            (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
            _ => false,
        };
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
        // Closing the file (after this) releases the lock.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #37 (1): a second taker is refused with the holder's pid; every spelling of a path
    /// names one lock file; the lock file goes when the lock is dropped and the next taker gets
    /// it; a waiting taker gets it once the holder lets go.
    #[test]
    fn one_holder_at_a_time_named_by_pid() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("m.jsonl");
        let lf = file_lock_path(&out);
        assert_eq!(lf.file_name().unwrap(), ".m.jsonl.lock");
        let dotted = dir.path().join(".").join("sub").join("..").join("m.jsonl");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        assert_eq!(file_lock_path(&dotted), lf);
        let held = Lock::try_take("--metrics", &out, &lf).unwrap();
        assert_eq!(
            std::fs::read_to_string(&lf).unwrap().trim(),
            std::process::id().to_string()
        );
        let e = Lock::try_take("--metrics", &out, &lf).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, LockError::Held { pid: Some(p), .. } if p == std::process::id()));
        assert!(
            msg.contains("--metrics") && msg.contains("m.jsonl"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("process {}", std::process::id())),
            "{msg}"
        );
        drop(held);
        assert!(!lf.exists(), "the lock file goes with the lock");
        let again = Lock::try_take("--metrics", &out, &lf).unwrap();
        // A waiter: called once with the holder's pid, then gets the lock when it is released.
        let lf2 = lf.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let mut seen = None;
            let l = Lock::wait("token cache", Path::new("x"), &lf2, &mut |pid| {
                seen = pid;
                tx.send(()).unwrap();
            })
            .unwrap();
            (seen, l.path().to_path_buf())
        });
        rx.recv().unwrap();
        drop(again);
        let (seen, path) = waiter.join().unwrap();
        assert_eq!(seen, Some(std::process::id()));
        assert_eq!(path, lf);
        // A symlink in the lock file's place is never followed.
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        let lf3 = dir.path().join(".link.lock");
        std::os::unix::fs::symlink(&target, &lf3).unwrap();
        assert!(matches!(
            Lock::try_take("--save", Path::new("link"), &lf3),
            Err(LockError::Io { .. })
        ));
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert_eq!(
            dir_lock_path(dir.path()),
            dir.path().canonicalize().unwrap().join(DIR_LOCK)
        );
    }

    /// Regression (d23a05f): a waiting taker whose holder removed the lock file, after a third
    /// taker made and locked a new one, keeps waiting for the third (said once) instead of
    /// answering "held". Deterministic: the test waits until the kernel shows the waiter
    /// blocked on the new file (`/proc/locks`) before the third lets go.
    #[test]
    fn a_waiter_keeps_waiting_when_a_third_taker_holds_the_new_file() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("t.bin");
        let lf = file_lock_path(&out);
        let first = Lock::try_take("token cache", &out, &lf).unwrap();
        let lf2 = lf.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let mut calls = 0;
            let r = Lock::wait("token cache", Path::new("t.bin"), &lf2, &mut |_| {
                calls += 1;
                let _ = tx.send(());
            });
            (r.map(|l| l.path().to_path_buf()), calls)
        });
        rx.recv().unwrap();
        let old_ino = std::fs::metadata(&lf).unwrap().ino();
        wait_blocked_on(old_ino);
        // The first holder's exit as another process would do it: the path removed, then a
        // third taker creates and locks a new file there before the waiter looks again.
        std::fs::remove_file(&lf).unwrap();
        let third = Lock::try_take("token cache", &out, &lf).unwrap();
        let new_ino = std::fs::metadata(&lf).unwrap().ino();
        assert_ne!(new_ino, old_ino);
        drop(first); // releases the old file (not ours any more: the path is left alone)
        assert!(lf.exists());
        wait_blocked_on(new_ino);
        assert!(
            !waiter.is_finished(),
            "the waiter still waits for the third"
        );
        drop(third);
        let (r, calls) = waiter.join().unwrap();
        assert_eq!(r.unwrap(), lf, "the waiter gets the lock");
        assert_eq!(calls, 1, "the wait is announced once");
    }

    /// Polls `/proc/locks` until some taker is blocked (`->`) on an flock of inode `ino`.
    fn wait_blocked_on(ino: u64) {
        let t0 = std::time::Instant::now();
        let suffix = format!(":{ino}");
        loop {
            let locks = std::fs::read_to_string("/proc/locks").unwrap();
            let blocked = locks.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(1) == Some(&"->")
                    && f.get(2) == Some(&"FLOCK")
                    && f.get(6).is_some_and(|dev_ino| dev_ino.ends_with(&suffix))
            });
            if blocked {
                return;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "no taker blocked on inode {ino}:\n{locks}"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
