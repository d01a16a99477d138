//! Durable, all-or-nothing file-system operations: write-fsync-rename of single files,
//! publication of a staged directory by one rename, and the pre-training check of a save target.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use super::check::format_err;
use super::error::{Result, StateDictError};
use std::path::{Path, PathBuf};

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StateDictError + 'a {
    move |source| StateDictError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// A fresh value for temporary names and save generations: time, process id and a counter,
/// mixed (not secret, only unique).
pub(super) fn fresh_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = crc32fast::Hasher::new();
    h.update(&t.to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    h.update(&c.to_le_bytes());
    (t.rotate_left(17) ^ u64::from(h.finalize()) << 32 ^ c).max(1)
}

/// Refuses to replace anything that exists at `path` and is not a regular file (a symlink, a
/// device node, a directory, a FIFO).
pub(super) fn check_replaceable(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => Err(StateDictError::NotRegularFile {
            path: path.to_path_buf(),
        }),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("inspect", path)(e)),
    }
}

/// fsyncs a directory so that renames and creations inside it survive a power loss.
pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err("fsync directory", dir))
}

/// The directory holding `path` (`.` for a bare file name, whose parent is empty).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Writes `bytes` to `path` all-or-nothing: a temporary file in the same directory (mode from
/// the umask), fsync, one rename over the target, fsync of the directory. The temporary file is
/// removed on every failure path; a non-regular target is refused before anything is written.
pub(super) fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    check_replaceable(path)?;
    let parent = parent_of(path);
    let name = path
        .file_name()
        .ok_or_else(|| format_err(path, "the path has no file name"))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{:016x}",
        name.to_string_lossy(),
        fresh_id()
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        f.write_all(bytes).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("fsync", &tmp))?;
        drop(f);
        // Checked again right before the rename: the target may have appeared meanwhile.
        check_replaceable(path)?;
        std::fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
        sync_dir(parent)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The staging directory of a sharded save of `dir` with generation `gen`: a sibling of `dir`.
pub(super) fn staging_dir(dir: &Path, gen: u64) -> Result<PathBuf> {
    let name = dir
        .file_name()
        .ok_or_else(|| format_err(dir, "the checkpoint path has no directory name"))?;
    Ok(parent_of(dir).join(format!(".{}.staging-{gen:016x}", name.to_string_lossy())))
}

/// Publishes the finished staging directory `tmp` as `dir`: one rename when `dir` does not exist;
/// when it does (a directory), an atomic exchange (Linux `renameat2(RENAME_EXCHANGE)`) and then
/// removal of the old contents, so a reader sees the old or the new checkpoint, never a mix.
pub(super) fn publish_dir(tmp: &Path, dir: &Path) -> Result<()> {
    sync_dir(tmp)?;
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::rename(tmp, dir).map_err(io_err("rename into place", dir))?;
        }
        Err(e) => return Err(io_err("inspect", dir)(e)),
        Ok(m) if !m.file_type().is_dir() => {
            return Err(StateDictError::NotRegularFile {
                path: dir.to_path_buf(),
            })
        }
        Ok(_) => {
            exchange(tmp, dir)?;
            // `tmp` now holds the previous checkpoint.
            std::fs::remove_dir_all(tmp).map_err(io_err("remove the replaced checkpoint", tmp))?;
        }
    }
    sync_dir(parent_of(dir))
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let ca = CString::new(a.as_os_str().as_bytes()).map_err(|_| format_err(a, "NUL in path"))?;
    let cb = CString::new(b.as_os_str().as_bytes()).map_err(|_| format_err(b, "NUL in path"))?;
    // SAFETY: both pointers are valid NUL-terminated C strings owned by `ca` / `cb` for the
    // duration of the call; AT_FDCWD resolves relative paths like `std::fs::rename` does.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io_err("exchange with the previous checkpoint", b)(
            std::io::Error::last_os_error(),
        ))
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    // No atomic exchange: move the old one aside, then the new one in (a crash in between
    // leaves the old checkpoint under `a`'s name and none under `b`).
    let aside = parent_of(b).join(format!(".aside-{:016x}", fresh_id()));
    std::fs::rename(b, &aside).map_err(io_err("move the previous checkpoint aside", b))?;
    std::fs::rename(a, b).map_err(io_err("rename into place", b))?;
    std::fs::rename(&aside, a).map_err(io_err("rename", a))
}

/// Checks, before training, that a checkpoint can be saved at `path` (a file for full state
/// dicts or a directory for sharded ones and [`crate::checkpoint`]): the parent directory exists
/// or can be created, a file can actually be created and removed in it, the target (if it exists)
/// is a regular file or a directory and not a symlink or device node, and — when `needed_bytes`
/// is given (e.g. the size of the previous checkpoint) — the file system has that much free
/// space. Rank-local, no communication; call it on every rank (or on the saving ranks) before the
/// first step.
///
/// # Errors
/// [`StateDictError::TargetUnusable`] naming the path and the reason.
pub fn check_save_target(path: impl AsRef<Path>, needed_bytes: Option<u64>) -> Result<()> {
    let path = path.as_ref();
    let bad = |reason: String| StateDictError::TargetUnusable {
        path: path.to_path_buf(),
        reason,
    };
    if let Ok(m) = std::fs::symlink_metadata(path) {
        let t = m.file_type();
        if !(t.is_file() || t.is_dir()) {
            return Err(bad(
                "it exists and is not a regular file or directory (symlink, device node, …); \
                 a save would not replace it"
                    .into(),
            ));
        }
    }
    let parent = parent_of(path);
    std::fs::create_dir_all(parent).map_err(|e| {
        bad(format!(
            "cannot create directory `{}`: {e}",
            parent.display()
        ))
    })?;
    let probe = parent.join(format!(".fsdp-write-probe-{:016x}", fresh_id()));
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .and_then(|mut f| f.write_all(b"probe"))
        .map_err(|e| {
            let _ = std::fs::remove_file(&probe);
            bad(format!(
                "cannot create a file in `{}`: {e}",
                parent.display()
            ))
        })?;
    std::fs::remove_file(&probe).map_err(|e| {
        bad(format!(
            "cannot remove a file in `{}`: {e}",
            parent.display()
        ))
    })?;
    if let Some(need) = needed_bytes {
        let free = free_bytes(parent).map_err(|e| {
            bad(format!(
                "cannot query free space of `{}`: {e}",
                parent.display()
            ))
        })?;
        if free < need {
            return Err(bad(format!(
                "{free} bytes free in `{}`, the checkpoint needs about {need}",
                parent.display()
            )));
        }
    }
    Ok(())
}

/// Free bytes (for unprivileged users) of the file system holding `dir`.
#[cfg(unix)]
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: `statvfs` is plain old data, valid when zeroed; `c` is a valid NUL-terminated
    // string and `st` a valid, exclusively borrowed out-pointer for the duration of the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

#[cfg(not(unix))]
fn free_bytes(_dir: &Path) -> std::io::Result<u64> {
    Ok(u64::MAX)
}

/// Total size in bytes of the regular files under `path` (a file or a directory tree); for
/// [`check_save_target`]'s `needed_bytes` from a previous checkpoint.
///
/// # Errors
/// [`StateDictError::Io`].
pub fn disk_usage(path: impl AsRef<Path>) -> Result<u64> {
    let path = path.as_ref();
    let m = std::fs::symlink_metadata(path).map_err(io_err("inspect", path))?;
    if m.is_dir() {
        let mut total = 0;
        for e in std::fs::read_dir(path).map_err(io_err("list", path))? {
            let e = e.map_err(io_err("list", path))?;
            total += disk_usage(e.path())?;
        }
        Ok(total)
    } else if m.is_file() {
        Ok(m.len())
    } else {
        Ok(0)
    }
}
