//! Files this process must not leave behind (issue #37, 6): a temporary file being written
//! (the token cache's `FILE.gpt2.bin.tmpPID`) and the lock files of the run's outputs (module
//! `lock`).
//!
//! A [`TempFile`] removes its file when dropped — on success after the rename (then there is
//! nothing left to remove), on every error path, and on a panic that unwinds. A signal that ends
//! the process (SIGINT from Ctrl-C, SIGTERM, SIGHUP) runs no destructor, so every registered
//! path is also known to a signal thread (started at the first registration, with the
//! `signal-hook` crate): on such a signal it removes them all and then ends the process the way
//! the signal would have (the default action, so the exit status still says "killed by
//! SIGINT"). SIGKILL cannot be caught; a left-over lock file is harmless (the kernel released its
//! lock; the next run takes it over) and a left-over temporary file is named by its process id.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// The paths to remove on a fatal signal, by registration id.
fn registry() -> &'static Mutex<BTreeMap<u64, PathBuf>> {
    static PATHS: OnceLock<Mutex<BTreeMap<u64, PathBuf>>> = OnceLock::new();
    PATHS.get_or_init(|| Mutex::new(BTreeMap::new()))
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Starts the signal thread once (best effort: without it, only destructors clean up).
fn watch_signals() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("cleanup-on-signal".into())
            .spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    remove_all();
                    // The signal's own default action (terminate): the exit status is as if
                    // the handler had never been installed.
                    let _ = signal_hook::low_level::emulate_default_handler(sig);
                    signal_hook::low_level::exit(128 + sig);
                }
            });
        drop(spawned);
    });
}

/// Removes every registered path (the signal thread, right before the process ends).
fn remove_all() {
    let paths = match registry().lock() {
        Ok(g) => g.values().cloned().collect::<Vec<_>>(),
        Err(poisoned) => poisoned.into_inner().values().cloned().collect(),
    };
    for p in paths {
        let _ = std::fs::remove_file(p);
    }
}

/// A path registered for removal on a fatal signal; unregistered (not removed) when dropped.
#[derive(Debug)]
pub struct OnSignal {
    id: u64,
}

impl OnSignal {
    /// Registers `path` (and starts the signal thread if it is not running yet).
    pub fn register(path: &Path) -> OnSignal {
        watch_signals();
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut g) = registry().lock() {
            g.insert(id, path.to_path_buf());
        }
        OnSignal { id }
    }
}

impl Drop for OnSignal {
    fn drop(&mut self) {
        if let Ok(mut g) = registry().lock() {
            g.remove(&self.id);
        }
    }
}

/// A temporary file: removed when the guard is dropped and on a fatal signal (see the module
/// docs). Call [`TempFile::keep`] once it has been renamed into place.
#[derive(Debug)]
pub struct TempFile {
    path: PathBuf,
    keep: bool,
    _signal: OnSignal,
}

impl TempFile {
    /// Guards `path` (not created here).
    pub fn new(path: PathBuf) -> TempFile {
        let signal = OnSignal::register(&path);
        TempFile {
            path,
            keep: false,
            _signal: signal,
        }
    }

    /// The guarded path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file was renamed into place: nothing to remove any more.
    pub fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guard removes its file on drop and on an error path; a kept one stays; the signal
    /// registry holds exactly the live guards.
    #[test]
    fn temp_files_go_on_drop_unless_kept() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.tmp");
        let b = dir.path().join("b.tmp");
        std::fs::write(&a, b"x").unwrap();
        std::fs::write(&b, b"y").unwrap();
        let failing = || -> Result<(), String> {
            let _g = TempFile::new(a.clone());
            Err("tokenizing failed".into())
        };
        assert!(failing().is_err());
        assert!(!a.exists(), "removed on the error path");
        let g = TempFile::new(b.clone());
        assert!(registry().lock().unwrap().values().any(|p| p == &b));
        g.keep();
        assert!(b.exists(), "kept after the rename");
        assert!(!registry().lock().unwrap().values().any(|p| p == &b));
    }
}
