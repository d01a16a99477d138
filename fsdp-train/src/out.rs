//! Printing that never stops the program: `train_gpt`'s own `print!`, `println!`, `eprint!` and
//! `eprintln!` (issue #37, 9).
//!
//! The standard macros panic when the stream is closed (`train_gpt … | head -1`: EPIPE once
//! `head` exits), which killed rank 0 in the middle of training and lost `--save`. These write
//! to the same streams but ignore every write error: after the first failure the stream is taken
//! as gone and nothing more is written to it, so training and every output (checkpoints,
//! `--save`, `--metrics`, `--export-hf`) finish as if it were open, and the exit code is the
//! run's own.
//!
//! `main.rs` declares this module first with `#[macro_use]`, so these macros shadow the
//! standard ones everywhere in the crate (textual scope comes before the prelude): a
//! `println!` anywhere in `train_gpt` is this one.

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once a write to stdout failed (closed pipe, full disk, …).
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
/// Set once a write to stderr failed.
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

/// Writes `args` (and a newline with `newline`) to stdout, or nothing once stdout is gone.
pub fn stdout(args: fmt::Arguments<'_>, newline: bool) {
    write_to(&mut std::io::stdout().lock(), &STDOUT_GONE, args, newline);
}

/// Writes `args` (and a newline with `newline`) to stderr, or nothing once stderr is gone.
pub fn stderr(args: fmt::Arguments<'_>, newline: bool) {
    write_to(&mut std::io::stderr().lock(), &STDERR_GONE, args, newline);
}

/// Flushes stdout (text printed piece by piece, e.g. `train_gpt sample`'s tokens); a failure
/// marks it gone like a failed write.
pub fn flush_stdout() {
    if !STDOUT_GONE.load(Ordering::Relaxed) && std::io::stdout().lock().flush().is_err() {
        STDOUT_GONE.store(true, Ordering::Relaxed);
    }
}

fn write_to(w: &mut impl Write, gone: &AtomicBool, args: fmt::Arguments<'_>, newline: bool) {
    if gone.load(Ordering::Relaxed) {
        return;
    }
    let r = w
        .write_fmt(args)
        .and_then(|()| if newline { w.write_all(b"\n") } else { Ok(()) });
    if r.is_err() {
        gone.store(true, Ordering::Relaxed);
    }
}

/// `print!` that never panics (see the module docs).
macro_rules! print {
    ($($arg:tt)*) => { $crate::out::stdout(format_args!($($arg)*), false) };
}

/// `println!` that never panics (see the module docs).
macro_rules! println {
    () => { $crate::out::stdout(format_args!(""), true) };
    ($($arg:tt)*) => { $crate::out::stdout(format_args!($($arg)*), true) };
}

/// `eprint!` that never panics (see the module docs).
#[allow(unused_macros)]
macro_rules! eprint {
    ($($arg:tt)*) => { $crate::out::stderr(format_args!($($arg)*), false) };
}

/// `eprintln!` that never panics (see the module docs).
macro_rules! eprintln {
    () => { $crate::out::stderr(format_args!(""), true) };
    ($($arg:tt)*) => { $crate::out::stderr(format_args!($($arg)*), true) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that fails like a closed pipe.
    struct Closed(usize);
    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            self.0 += 1;
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Issue #37 (9): a closed stream is written to once, quietly, and then left alone.
    #[test]
    fn a_closed_stream_is_given_up_quietly() {
        let gone = AtomicBool::new(false);
        let mut w = Closed(0);
        write_to(&mut w, &gone, format_args!("step {}", 1), true);
        assert!(gone.load(Ordering::Relaxed));
        let tries = w.0;
        write_to(&mut w, &gone, format_args!("step {}", 2), true);
        assert_eq!(
            w.0, tries,
            "nothing more is written once the stream is gone"
        );
        let mut buf = Vec::new();
        let open = AtomicBool::new(false);
        write_to(&mut buf, &open, format_args!("a{}", 1), true);
        write_to(&mut buf, &open, format_args!("b"), false);
        assert_eq!(buf, b"a1\nb");
    }
}
