//! The token cache of a text file (issue #37, 6; any tokenizer: issue #39).
//!
//! A GPT-2-tokenized text is cached next to it as a nanoGPT-compatible `.bin` (little-endian u16
//! ids, nothing else: `--data FILE.gpt2.bin` reads it as any u16 file), `FILE.gpt2.bin`, with
//! its header beside it in `FILE.gpt2.json`. A text read with a `tokenizer.json` is cached the
//! same way as `FILE.tok-HASH.bin` (HASH: the start of the tokenizer file's SHA-256, which the
//! header's `tokenizer` holds in full), in u16 ids when the tokenizer's vocabulary fits them and
//! as `FILE.tok-HASH.u32.bin` (little-endian u32) when it exceeds 65,536 ids. The header:
//!
//! | field | what |
//! |---|---|
//! | `format`, `version` | `fsdp-rs token cache`, [`VERSION`] |
//! | `tokenizer` | `gpt2 r50k_base`, or the `tokenizer.json`'s identity with its SHA-256 |
//! | `source_size`, `source_mtime_ns`, `source_sha256` | the text the ids came from |
//! | `tokens`, `max_id` | the ids in the `.bin` (`2·tokens` or `4·tokens` bytes) and the largest |
//! | `body_sha256` | SHA-256 of the `.bin`'s bytes |
//!
//! The next run reuses the `.bin` only when every field still holds: the text's size, time and
//! hash (recomputed: a streaming read), the `.bin`'s length, hash and largest id (recomputed:
//! one streaming read of it), `max_id` below the tokenizer's vocabulary. Anything else — flipped bytes,
//! a truncated or foreign `.bin`, an older header — re-tokenizes, and the note says why. A cache
//! file that is a symbolic link or not a regular file is never read (`paths::check` refuses it
//! before this runs, and the files are opened without following links).
//!
//! Writing: under an exclusive lock (`.FILE.gpt2.bin.lock`, module `lock`; a second run, or
//! another MPI rank, waits for the first and then reuses its cache), into `FILE.gpt2.bin.tmpPID`
//! guarded by a [`TempFile`] (removed on every error path and on SIGINT/SIGTERM/SIGHUP), then
//! renamed into place; the header is written last (to a temporary name, renamed), so a header
//! always describes a complete `.bin`.
//!
//! Tokenizing streams: the source is read in chunks of about 1 MiB that end at a line break
//! followed by a non-space character, each chunk is encoded and its ids appended to the output
//! through a buffered writer, so memory holds one chunk and its ids — never the whole token
//! stream, let alone twice. Cutting there gives exactly the ids of encoding the whole text: GPT-2's
//! pre-tokenizer never joins a line break with a following letter, digit or punctuation (the
//! `\s+(?!\S)` / `\s+` alternatives stop before it), and byte-pair merges stay within a pre-token.
//! The same holds for byte-level BPE `tokenizer.json`s whose pre-tokenizer splits that way
//! (Llama 3's and GPT-2's patterns); a tokenizer that merges across line starts (e.g. a
//! SentencePiece model without pre-tokenizer) may tokenize the ~1 MiB chunk boundaries
//! differently from one whole-text encoding.
//!
//! The source's SHA-256 is computed from the very bytes tokenized, and a source that changes
//! while it is read is an error.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::Tokenizer;
use crate::cleanup::TempFile;
use crate::data::DataFormat;
use crate::input::open_regular;
use crate::lock::{file_lock_path, Lock};

/// The header's `format`.
pub const FORMAT: &str = "fsdp-rs token cache";
/// The header's `version` (1 was the unversioned sidecar of source size, time and hash).
pub const VERSION: u64 = 2;

/// The cache of `src` for the tokenizer named `tag` (`gpt2`, `tok-HASH`, `tok-HASH.u32`):
/// `(FILE.TAG.bin, FILE.TAG.json)` (the name kept byte for byte, UTF-8 or not).
pub fn cache_paths(src: &Path, tag: &str) -> (PathBuf, PathBuf) {
    let name = src
        .file_name()
        .map_or_else(|| OsString::from("data"), |n| n.to_os_string());
    let dir = src.parent().unwrap_or(Path::new(""));
    let with = |ext: &str| {
        let mut n = name.clone();
        n.push(ext);
        dir.join(n)
    };
    (with(&format!(".{tag}.bin")), with(&format!(".{tag}.json")))
}

/// The cache name of `tok`'s ids (`gpt2`, `tok-HASH`, `tok-HASH.u32` past 65,536 ids), `None`
/// for `bytes` (read as is, never cached).
pub fn cache_tag(tok: &Tokenizer) -> Option<String> {
    let wide = tok.vocab() > 1 << 16;
    match tok {
        Tokenizer::Bytes => None,
        Tokenizer::Gpt2 => Some("gpt2".into()),
        Tokenizer::Json(t) => Some(format!(
            "tok-{}{}",
            t.short(),
            if wide { ".u32" } else { "" }
        )),
    }
}

/// Opens a cache file for reading: never through a symbolic link, never a non-regular file.
fn open_cache(path: &Path) -> std::io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(f)
}

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Size and modification time (ns since the epoch) of `m`.
fn stamp(m: &std::fs::Metadata) -> (u64, u64) {
    let mtime = m
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    (m.len(), mtime)
}

/// SHA-256 of everything `r` yields.
fn sha256_of(mut r: impl Read) -> std::io::Result<String> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok(hex(h.finalize()));
        }
        h.update(&buf[..n]);
    }
}

/// What the `.bin`'s bytes hold, read as little-endian ids of `width` bytes (2: u16, 4: u32):
/// (tokens, largest id, SHA-256), in one streaming read.
fn scan_body(mut f: File, width: usize) -> std::io::Result<(u64, u32, String)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let (mut len, mut max) = (0u64, 0u32);
    // The bytes of an id split across reads.
    let mut part: Vec<u8> = Vec::with_capacity(4);
    let id = |b: &[u8]| match b {
        [a, b] => u32::from(u16::from_le_bytes([*a, *b])),
        [a, b, c, d] => u32::from_le_bytes([*a, *b, *c, *d]),
        _ => 0,
    };
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        len += n as u64;
        let mut bytes = &buf[..n];
        if !part.is_empty() {
            let take = (width - part.len()).min(bytes.len());
            part.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if part.len() < width {
                continue;
            }
            max = max.max(id(&part));
            part.clear();
        }
        let mut ids = bytes.chunks_exact(width);
        for p in &mut ids {
            max = max.max(id(p));
        }
        part.extend_from_slice(ids.remainder());
    }
    if !part.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{len} bytes is not a whole number of {}-byte ids", width),
        ));
    }
    Ok((len / width as u64, max, hex(h.finalize())))
}

/// Whether a cache can be reused.
enum Check {
    /// Every header field holds.
    Valid,
    /// There is no cache (no header).
    Missing,
    /// Why it cannot be reused.
    Stale(String),
}

/// How a tokenizer's ids are cached: its header name, the `.bin`'s id width and its vocabulary.
struct Ids {
    tokenizer: String,
    width: usize,
    vocab: usize,
}

/// Checks every header field of the cache of `src` (see the module docs).
fn check(src: &Path, bin: &Path, side: &Path, ids: &Ids) -> Result<Check, String> {
    let header = match open_cache(side).and_then(|mut f| {
        let mut s = Vec::new();
        f.read_to_end(&mut s).map(|_| s)
    }) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Check::Missing),
        Err(e) => return Ok(Check::Stale(format!("its header cannot be read: {e}"))),
    };
    let Ok(h) = serde_json::from_slice::<Value>(&header) else {
        return Ok(Check::Stale("its header is not JSON".into()));
    };
    if h["format"] != FORMAT || h["version"] != VERSION || h["tokenizer"] != ids.tokenizer.as_str()
    {
        return Ok(Check::Stale(
            "its header is of another format (an older train_gpt, or another tokenizer)".into(),
        ));
    }
    let io = |e: std::io::Error| format!("--data {}: {e}", src.display());
    let (size, mtime) = stamp(&std::fs::metadata(src).map_err(io)?);
    if h["source_size"] != size || h["source_mtime_ns"] != mtime {
        return Ok(Check::Stale(
            "the text changed (size or modification time)".into(),
        ));
    }
    if h["source_sha256"] != sha256_of(open_regular(src).map_err(io)?).map_err(io)? {
        return Ok(Check::Stale("the text changed (SHA-256)".into()));
    }
    let body = match open_cache(bin) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Check::Stale("the .bin is missing".into()))
        }
        Err(e) => return Ok(Check::Stale(format!("the .bin cannot be read: {e}"))),
    };
    let (tokens, max, sum) = match scan_body(body, ids.width) {
        Ok(x) => x,
        Err(e) => return Ok(Check::Stale(format!("the .bin is damaged: {e}"))),
    };
    if h["tokens"] != tokens {
        return Ok(Check::Stale(format!(
            "the .bin holds {tokens} ids, its header says {}: truncated or replaced",
            h["tokens"]
        )));
    }
    if h["body_sha256"] != sum.as_str() {
        return Ok(Check::Stale(
            "the .bin's bytes do not match the SHA-256 its header records: damaged or edited"
                .into(),
        ));
    }
    if h["max_id"] != max || max as usize >= ids.vocab {
        return Ok(Check::Stale(if max as usize >= ids.vocab {
            format!(
                "the .bin holds id {max}, outside the tokenizer's vocabulary of {}: damaged",
                ids.vocab
            )
        } else {
            format!(
                "the .bin's largest id is {max}, its header says {}",
                h["max_id"]
            )
        }));
    }
    Ok(Check::Valid)
}

/// What [`tokenize_file`] wrote.
struct Tokenized {
    tokens: u64,
    max_id: u32,
    body_sha256: String,
    source_size: u64,
    source_sha256: String,
}

/// Where a chunk of `buf` (at most `want` bytes, more if no cut point comes earlier) can end:
/// after a `\n` followed by a byte that is not ASCII whitespace; `buf.len()` when `eof`.
fn cut(buf: &[u8], want: usize, eof: bool) -> Option<usize> {
    if buf.len() <= want && eof {
        return Some(buf.len());
    }
    let from = want.min(buf.len().saturating_sub(1));
    // Search backwards from `want`, then forwards.
    let ok = |i: usize| buf[i] == b'\n' && i + 1 < buf.len() && !buf[i + 1].is_ascii_whitespace();
    (0..from)
        .rev()
        .find(|&i| ok(i))
        .or_else(|| (from..buf.len()).find(|&i| ok(i)))
        .map(|i| i + 1)
        .or(eof.then_some(buf.len()))
}

/// A writer that hashes what it writes.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(b)?;
        self.hash.update(&b[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Tokenizes `src` with `tok` into `out` (little-endian u16, or u32 when `wide`; created new),
/// streaming.
fn tokenize_file(src: &Path, out: &Path, tok: &Tokenizer, wide: bool) -> Result<Tokenized, String> {
    const CHUNK: usize = 1 << 20;
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |e: std::io::Error| format!("{p}: {e}")
    };
    let mut f = open_regular(src).map_err(io(src))?;
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)
        .map_err(io(out))?;
    let mut w = BufWriter::new(Hashing {
        inner: file,
        hash: Sha256::new(),
    });
    let mut src_hash = Sha256::new();
    let mut read = |f: &mut File, buf: &mut Vec<u8>| -> Result<bool, String> {
        let start = buf.len();
        buf.resize(start + CHUNK, 0);
        let n = f.read(&mut buf[start..]).map_err(io(src))?;
        buf.truncate(start + n);
        src_hash.update(&buf[start..]);
        Ok(n == 0)
    };
    let mut buf: Vec<u8> = Vec::with_capacity(2 * CHUNK);
    let (mut eof, mut offset, mut tokens, mut max_id) = (false, 0u64, 0u64, 0u32);
    loop {
        while !eof && buf.len() < 2 * CHUNK {
            eof = read(&mut f, &mut buf)?;
        }
        let Some(end) = cut(&buf, CHUNK, eof) else {
            // No cut point in 2 MiB: read on (a very long line).
            if buf.len() >= 64 * CHUNK {
                return Err(format!(
                    "--data {}: a line of more than 64 MiB; --tokenizer {} tokenizes line by line",
                    src.display(),
                    tok.name()
                ));
            }
            eof = read(&mut f, &mut buf)?;
            continue;
        };
        if end == 0 {
            break;
        }
        let text = std::str::from_utf8(&buf[..end]).map_err(|e| {
            format!(
                "--data {}: not UTF-8 at byte {} (--tokenizer {} reads UTF-8 text; use --tokenizer bytes)",
                src.display(),
                offset + e.valid_up_to() as u64,
                tok.name()
            )
        })?;
        for id in tok.encode(text)? {
            if wide {
                w.write_all(&id.to_le_bytes()).map_err(io(out))?;
            } else {
                let id =
                    u16::try_from(id).map_err(|_| format!("token id {id} does not fit u16"))?;
                w.write_all(&id.to_le_bytes()).map_err(io(out))?;
            }
            max_id = max_id.max(id);
            tokens += 1;
        }
        offset += end as u64;
        buf.drain(..end);
        if eof && buf.is_empty() {
            break;
        }
    }
    let Hashing { inner, hash } = w
        .into_inner()
        .map_err(|e| format!("{}: {e}", out.display()))?;
    inner.sync_all().map_err(io(out))?;
    Ok(Tokenized {
        tokens,
        max_id,
        body_sha256: hex(hash.finalize()),
        source_size: offset,
        source_sha256: hex(src_hash.finalize()),
    })
}

/// Writes `bytes` to `path` through a guarded temporary file and a rename.
fn replace_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let mut name = OsString::from(".");
    name.push(path.file_name().unwrap_or(path.as_os_str()));
    name.push(format!(".tmp{}", std::process::id()));
    let tmp = TempFile::new(path.with_file_name(name));
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(tmp.path())
        .map_err(err)?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(err)?;
    std::fs::rename(tmp.path(), path).map_err(err)?;
    tmp.keep();
    Ok(())
}

/// The token file of text `src` read with `tok` (GPT-2 or a `tokenizer.json`): the cached
/// `.bin` when its header still holds (see the module docs), otherwise a fresh one. Returns the
/// `.bin`, its format (u16, or u32 for a vocabulary over 65,536 ids) and what happened, for the
/// note printed before training: `reusing`, `wrote`, or `rebuilt (WHY)`. `on_wait` is called
/// with the holder's process id if another process is writing the cache (this one then waits).
///
/// # Errors
/// I/O errors, non-UTF-8 text, a text that changes while it is tokenized; `tok` is `bytes`
/// (nothing to cache).
pub fn token_bin(
    src: &Path,
    tok: &Tokenizer,
    on_wait: &mut dyn FnMut(Option<u32>),
) -> Result<(PathBuf, DataFormat, String), String> {
    let wide = tok.vocab() > 1 << 16;
    let tag = cache_tag(tok).ok_or("--tokenizer bytes reads the text itself")?;
    let tokenizer = match tok {
        Tokenizer::Json(t) => t.id(),
        _ => "gpt2 r50k_base".to_string(),
    };
    let (format, width) = if wide {
        (DataFormat::U32, 4)
    } else {
        (DataFormat::U16, 2)
    };
    let ids = Ids {
        tokenizer,
        width,
        vocab: tok.vocab(),
    };
    let (bin, side) = cache_paths(src, &tag);
    let _lock = Lock::wait("token cache", &bin, &file_lock_path(&bin), on_wait)
        .map_err(|e| e.to_string())?;
    let why = match check(src, &bin, &side, &ids)? {
        Check::Valid => return Ok((bin, format, "reusing".into())),
        Check::Missing => None,
        Check::Stale(w) => Some(w),
    };
    let io = |e: std::io::Error| format!("--data {}: {e}", src.display());
    let before = stamp(&std::fs::metadata(src).map_err(io)?);
    let mut tmp_name = bin.file_name().unwrap_or(bin.as_os_str()).to_os_string();
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = TempFile::new(bin.with_file_name(tmp_name));
    let _ = std::fs::remove_file(tmp.path());
    let t = tokenize_file(src, tmp.path(), tok, wide)?;
    let after = stamp(&std::fs::metadata(src).map_err(io)?);
    if after != before || t.source_size != before.0 {
        return Err(format!(
            "--data {}: the file changed while it was tokenized; run again once it is complete",
            src.display()
        ));
    }
    std::fs::rename(tmp.path(), &bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    tmp.keep();
    let header = json!({
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": ids.tokenizer,
        "source_size": before.0,
        "source_mtime_ns": before.1,
        "source_sha256": t.source_sha256,
        "tokens": t.tokens,
        "max_id": t.max_id,
        "body_sha256": t.body_sha256,
    });
    replace_file(&side, (header.to_string() + "\n").as_bytes())?;
    Ok((
        bin,
        format,
        match why {
            None => "wrote".into(),
            Some(w) => format!("rebuilt ({w})"),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bin_of(src: &Path) -> Result<(PathBuf, String), String> {
        token_bin(src, &Tokenizer::Gpt2, &mut |_| {
            panic!("nobody else holds the lock")
        })
        .map(|(bin, format, how)| {
            assert_eq!(format, DataFormat::U16);
            (bin, how)
        })
    }

    /// [`token_bin`] with nobody else holding the lock: (bin, format, reused).
    fn tok_bin(src: &Path, tok: &Tokenizer) -> Result<(PathBuf, DataFormat, bool), String> {
        token_bin(src, tok, &mut |_| panic!("nobody else holds the lock"))
            .map(|(bin, format, how)| (bin, format, how == "reusing"))
    }

    /// The chunked file tokenization equals encoding the whole text at once, and the cache is
    /// reused until the source changes.
    #[test]
    fn streamed_file_equals_whole_text_and_cache_is_keyed() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("t.txt");
        let mut text = String::new();
        for i in 0..60_000 {
            text.push_str(&format!(
                "Line {i}: the quick brown fox, {} times.\n",
                i % 7
            ));
            if i % 5 == 0 {
                text.push_str("\n  indented  \n\n");
            }
        }
        std::fs::write(&src, &text).unwrap();
        assert!(text.len() > 2 << 20, "several chunks");
        let (bin, how) = bin_of(&src).unwrap();
        assert_eq!(how, "wrote");
        let bytes = std::fs::read(&bin).unwrap();
        let ids: Vec<u32> = bytes
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect();
        assert_eq!(ids, Tokenizer::Gpt2.encode(&text).unwrap());
        assert_eq!(
            bin_of(&src).unwrap().1,
            "reusing",
            "second run reuses the cache"
        );
        // Same size, different content: the hash catches it.
        let mut changed = text.clone().into_bytes();
        changed[10] = b'X';
        std::fs::write(&src, &changed).unwrap();
        assert!(bin_of(&src)
            .unwrap()
            .1
            .starts_with("rebuilt (the text changed"));
        let bad = dir.path().join("b.txt");
        std::fs::write(&bad, [b'a', 0xff, b'\n']).unwrap();
        let err = bin_of(&bad).unwrap_err();
        assert!(err.contains("not UTF-8 at byte 1"), "{err}");
    }

    /// Issue #37 (6): a damaged cache is never used silently — flipped bytes, a truncated body,
    /// a planted out-of-vocabulary id (even with a header edited to match) and an old header
    /// are each rebuilt, saying why; a failed tokenization leaves no temporary file behind; a
    /// symlink in the cache's place is never read.
    #[test]
    fn damaged_caches_are_rebuilt_and_failures_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("text.txt");
        std::fs::write(&src, "Hello world.\nThe quick brown fox.\n".repeat(50)).unwrap();
        let (bin, how) = bin_of(&src).unwrap();
        assert_eq!(how, "wrote");
        let good = std::fs::read(&bin).unwrap();
        let (_, side) = cache_paths(&src, "gpt2");
        let header: Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
        for key in [
            "format",
            "version",
            "source_size",
            "source_mtime_ns",
            "source_sha256",
        ] {
            assert!(header.get(key).is_some(), "{key}");
        }
        assert_eq!(header["tokens"], good.len() as u64 / 2);
        let rebuilt = |damage: &dyn Fn()| {
            damage();
            let (_, how) = bin_of(&src).unwrap();
            assert_eq!(
                std::fs::read(&bin).unwrap(),
                good,
                "rebuilt to the same ids"
            );
            how
        };
        let how = rebuilt(&|| {
            let mut b = good.clone();
            b[7] ^= 0x40;
            std::fs::write(&bin, b).unwrap();
        });
        assert!(how.contains("SHA-256"), "{how}");
        let how = rebuilt(&|| std::fs::write(&bin, &good[..good.len() - 2]).unwrap());
        assert!(how.contains("truncated"), "{how}");
        // A planted 0xFFFF id with the header's checksum and maximum edited to match.
        let how = rebuilt(&|| {
            let mut b = good.clone();
            b[0] = 0xff;
            b[1] = 0xff;
            let mut h = header.clone();
            let (_, _, sum) = scan_body(tempfile_with(&b), 2).unwrap();
            h["body_sha256"] = json!(sum);
            h["max_id"] = json!(0xffff);
            std::fs::write(&bin, b).unwrap();
            std::fs::write(&side, h.to_string()).unwrap();
        });
        assert!(
            how.contains("id 65535") && how.contains("vocabulary"),
            "{how}"
        );
        let how = rebuilt(&|| {
            let old =
                json!({"size": 1, "mtime_ns": 2, "sha256": "x", "tokenizer": "gpt2 r50k_base"});
            std::fs::write(&side, old.to_string()).unwrap();
        });
        assert!(how.contains("another format"), "{how}");
        assert_eq!(bin_of(&src).unwrap().1, "reusing");
        // A symlinked cache is never opened (paths::check refuses it first; here the open).
        let other = dir.path().join("other.bin");
        std::fs::write(&other, [1u8, 0, 2, 0]).unwrap();
        std::fs::remove_file(&bin).unwrap();
        std::os::unix::fs::symlink(&other, &bin).unwrap();
        assert!(open_cache(&bin).is_err());
        std::fs::remove_file(&bin).unwrap();
        // A failed tokenization (not UTF-8) leaves no temporary file.
        std::fs::write(&src, [b'a', 0xff, b'\n']).unwrap();
        assert!(bin_of(&src).is_err());
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("tmp") || n.ends_with(".lock"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    fn tempfile_with(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        std::io::Seek::rewind(&mut f).unwrap();
        f
    }

    /// A `tokenizer.json` cache: the ids of encoding the whole text, keyed by the tokenizer
    /// (another tokenizer file writes another cache), and u32 ids once the vocabulary passes
    /// 65,536 (an added token of id 70,000 appears in the file).
    #[test]
    fn json_tokenizer_cache_is_keyed_by_the_tokenizer_and_widens_to_u32() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("t.txt");
        let mut text = String::new();
        for i in 0..60_000 {
            text.push_str(&format!("Layer {i} gathers its shards, über {}.\n", i % 9));
            if i % 7 == 0 {
                text.push_str("\n  <big> rotary\n");
            }
        }
        std::fs::write(&src, &text).unwrap();
        assert!(text.len() > 2 << 20, "several chunks");
        let fixture = crate::tokenizer::json::tests::fixture();
        let tok = Tokenizer::json(&fixture).unwrap();
        let (bin, format, reused) = tok_bin(&src, &tok).unwrap();
        assert_eq!((format, reused), (DataFormat::U16, false));
        let ids: Vec<u32> = std::fs::read(&bin)
            .unwrap()
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect();
        assert_eq!(ids, tok.encode(&text).unwrap());
        assert!(tok_bin(&src, &tok).unwrap().2, "reused");

        // The same tokenizer with a token of id 70,000 (in the model's vocabulary, matched as an
        // added token).
        let mut v: Value = serde_json::from_slice(&std::fs::read(&fixture).unwrap()).unwrap();
        v["model"]["vocab"]["<big>"] = json!(70_000);
        v["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": 70_000, "content": "<big>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false
        }));
        let big = dir.path().join("big.json");
        std::fs::write(&big, v.to_string()).unwrap();
        let wide = Tokenizer::json(&big).unwrap();
        assert_eq!(wide.vocab(), 70_001);
        let (bin32, format, reused) = tok_bin(&src, &wide).unwrap();
        assert_eq!((format, reused), (DataFormat::U32, false));
        assert_ne!(bin32, bin);
        assert!(bin32.to_string_lossy().ends_with(".u32.bin"));
        let ids: Vec<u32> = std::fs::read(&bin32)
            .unwrap()
            .chunks(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert!(ids.contains(&70_000));
        assert_eq!(ids, wide.encode(&text).unwrap());
        // The data path reads the u32 ids back.
        let d = crate::data::Dataset::open(&bin32, DataFormat::U32, 0.1, 64, 70_001).unwrap();
        assert!(d.describe().contains("u32 ids"));
        assert!(matches!(
            crate::data::Dataset::open(&bin32, DataFormat::U32, 0.1, 64, 70_000)
                .and_then(|d| (0..2000).try_for_each(|g| d.train_sequence(g, 64, 1).map(|_| ()))),
            Err(crate::data::DataError::TokenOutOfRange { id: 70_000, .. })
        ));
    }
}
