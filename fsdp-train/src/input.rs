//! Opening inputs (issue #37, 3): every file `train_gpt` reads — `--data`, `--load`,
//! `--init-from` and the files inside it, `--cluster`, checkpoint manifests, `sample`'s inputs,
//! token caches — must be a regular file, and is checked before a single byte is read.
//!
//! [`open_regular`] opens with `O_NONBLOCK` (which on a FIFO returns at once instead of waiting
//! for a writer forever, and changes nothing for a regular file) and then asks the *opened* file
//! what it is, so a path swapped for a FIFO between a check and the open is still refused.
//! [`check_regular`] is the same question asked of a path before anything is opened (the
//! up-front checks of `paths::check`), with the one-line message a user sees.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::data::file_kind;

/// Opens `path` for reading if it is a regular file (symbolic links followed); anything else
/// (a FIFO, a device, a directory, a socket) is an [`std::io::ErrorKind::InvalidInput`] error
/// saying what it is. Never blocks.
///
/// # Errors
/// The open's own error, or the not-a-regular-file one.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = f.metadata()?.file_type();
    if !kind.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("it is {}, not a regular file", file_kind(kind)),
        ));
    }
    Ok(f)
}

/// The whole contents of the regular file `path` (see [`open_regular`]).
///
/// # Errors
/// As [`open_regular`], and read errors.
pub fn read_regular(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut f = open_regular(path)?;
    let mut out = Vec::new();
    f.read_to_end(&mut out)?;
    Ok(out)
}

/// Checks that `path` (given as `flag`) is a regular file, before it is opened. `Err` is the
/// one-line message: `FLAG PATH: it is a FIFO (named pipe), not a regular file; WANT`.
pub fn check_regular(flag: &str, path: &Path, want: &str) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(m) => Err(format!(
            "{flag} {}: it is {}, not a regular file; {want}",
            path.display(),
            file_kind(m.file_type())
        )),
        Err(e) => Err(format!("{flag} {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #37 (3): a FIFO, a directory and a device are refused at once (the FIFO would
    /// block a plain open forever); a regular file reads.
    #[test]
    fn only_regular_files_open_and_fifos_never_block() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success(), "mkfifo");
        let e = open_regular(&fifo).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        assert!(read_regular(dir.path())
            .unwrap_err()
            .to_string()
            .contains("a directory"));
        assert!(read_regular(Path::new("/dev/null"))
            .unwrap_err()
            .to_string()
            .contains("character device"));
        let f = dir.path().join("f");
        std::fs::write(&f, b"abc").unwrap();
        assert_eq!(read_regular(&f).unwrap(), b"abc");
        let e = check_regular("--load", &fifo, "give a safetensors file").unwrap_err();
        assert!(e.starts_with("--load ") && e.contains("FIFO") && e.ends_with("file"));
        assert!(check_regular("--load", &f, "").is_ok());
    }
}
