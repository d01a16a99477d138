//! The token cache of a text file.
//!
//! A GPT-2-tokenized text is cached next to it as a nanoGPT-compatible `.bin` (little-endian u16
//! ids), `FILE.gpt2.bin`, with `FILE.gpt2.json` recording the source's size, modification time
//! and SHA-256 and the tokenizer. The next run reuses the `.bin` when all of them still match (the
//! hash is recomputed, a streaming read of the source) and re-tokenizes otherwise. A text read
//! with a `tokenizer.json` is cached the same way as `FILE.tok-HASH.bin` (HASH: the start of the
//! tokenizer file's SHA-256, which the record also holds in full), in u16 ids when the
//! tokenizer's vocabulary fits them and as `FILE.tok-HASH.u32.bin` (little-endian u32) when it
//! exceeds 65,536 ids.
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

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::Tokenizer;
use crate::data::DataFormat;

/// The cache of `src` for the tokenizer named `tag` (`gpt2`, `tok-HASH`, `tok-HASH.u32`):
/// `(FILE.TAG.bin, FILE.TAG.json)`.
pub fn cache_paths(src: &Path, tag: &str) -> (PathBuf, PathBuf) {
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    let dir = src.parent().unwrap_or(Path::new("."));
    (
        dir.join(format!("{name}.{tag}.bin")),
        dir.join(format!("{name}.{tag}.json")),
    )
}

/// Size, modification time (ns since the epoch) and SHA-256 of `src`, and the tokenizer.
fn key(src: &Path, tokenizer: &str) -> Result<Value, String> {
    let io = |e: std::io::Error| format!("--data {}: {e}", src.display());
    let meta = std::fs::metadata(src).map_err(io)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    let mut f = File::open(src).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(json!({ "size": meta.len(), "mtime_ns": mtime, "sha256": hex, "tokenizer": tokenizer }))
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

/// Tokenizes `src` with `tok` into `out` (little-endian u16, or u32 when `wide`), streaming.
/// Returns the number of tokens.
fn tokenize_file(src: &Path, out: &Path, tok: &Tokenizer, wide: bool) -> Result<u64, String> {
    const CHUNK: usize = 1 << 20;
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |e: std::io::Error| format!("{p}: {e}")
    };
    let mut f = File::open(src).map_err(io(src))?;
    let mut w = BufWriter::new(File::create(out).map_err(io(out))?);
    let mut buf: Vec<u8> = Vec::with_capacity(2 * CHUNK);
    let (mut eof, mut offset, mut tokens) = (false, 0u64, 0u64);
    loop {
        while !eof && buf.len() < 2 * CHUNK {
            let start = buf.len();
            buf.resize(start + CHUNK, 0);
            let n = f.read(&mut buf[start..]).map_err(io(src))?;
            buf.truncate(start + n);
            eof = n == 0;
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
            let start = buf.len();
            buf.resize(start + CHUNK, 0);
            let n = f.read(&mut buf[start..]).map_err(io(src))?;
            buf.truncate(start + n);
            eof = n == 0;
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
            tokens += 1;
        }
        offset += end as u64;
        buf.drain(..end);
        if eof && buf.is_empty() {
            break;
        }
    }
    w.into_inner()
        .map_err(|e| format!("{}: {e}", out.display()))?
        .sync_all()
        .map_err(io(out))?;
    Ok(tokens)
}

/// The token file of text `src` read with `tok` (GPT-2 or a `tokenizer.json`): the cached
/// `.bin` when its key still matches the source and the tokenizer, otherwise a fresh one
/// (written to a temporary name, then renamed). Returns the `.bin`, its format (u16, or u32 for
/// a vocabulary over 65,536 ids) and whether the cache was reused.
///
/// # Errors
/// I/O errors, non-UTF-8 text; `tok` is `bytes` (nothing to cache).
pub fn token_bin(src: &Path, tok: &Tokenizer) -> Result<(PathBuf, DataFormat, bool), String> {
    let wide = tok.vocab() > 1 << 16;
    let (tag, id) = match tok {
        Tokenizer::Bytes => return Err("--tokenizer bytes reads the text itself".into()),
        Tokenizer::Gpt2 => ("gpt2".to_string(), "gpt2 r50k_base".to_string()),
        Tokenizer::Json(t) => (
            format!("tok-{}{}", t.short(), if wide { ".u32" } else { "" }),
            t.id(),
        ),
    };
    let (format, width) = if wide {
        (DataFormat::U32, 4)
    } else {
        (DataFormat::U16, 2)
    };
    let (bin, side) = cache_paths(src, &tag);
    let now = key(src, &id)?;
    let cached = std::fs::read(&side)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    if let Some(c) = cached {
        let same = ["size", "mtime_ns", "sha256", "tokenizer"]
            .iter()
            .all(|k| c.get(*k) == now.get(*k));
        let len_ok = std::fs::metadata(&bin).is_ok_and(|m| {
            Some(m.len()) == c.get("tokens").and_then(Value::as_u64).map(|t| width * t)
        });
        if same && len_ok {
            return Ok((bin, format, true));
        }
    }
    // Per process: MPI ranks each tokenize; the last rename wins with identical content.
    let tmp = bin.with_extension(format!("bin.tmp{}", std::process::id()));
    let tokens = tokenize_file(src, &tmp, tok, wide)?;
    std::fs::rename(&tmp, &bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    let mut rec = now;
    rec["tokens"] = json!(tokens);
    std::fs::write(&side, rec.to_string() + "\n")
        .map_err(|e| format!("{}: {e}", side.display()))?;
    Ok((bin, format, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2_bin(src: &Path) -> Result<(PathBuf, bool), String> {
        token_bin(src, &Tokenizer::Gpt2).map(|(bin, format, reused)| {
            assert_eq!(format, DataFormat::U16);
            (bin, reused)
        })
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
        let (bin, reused) = gpt2_bin(&src).unwrap();
        assert!(!reused);
        let bytes = std::fs::read(&bin).unwrap();
        let ids: Vec<u32> = bytes
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect();
        assert_eq!(ids, Tokenizer::Gpt2.encode(&text).unwrap());
        assert!(gpt2_bin(&src).unwrap().1, "second run reuses the cache");
        // Same size, different content: the hash catches it.
        let mut changed = text.clone().into_bytes();
        changed[10] = b'X';
        std::fs::write(&src, &changed).unwrap();
        assert!(!gpt2_bin(&src).unwrap().1);
        let bad = dir.path().join("b.txt");
        std::fs::write(&bad, [b'a', 0xff, b'\n']).unwrap();
        assert!(gpt2_bin(&bad).unwrap_err().contains("not UTF-8 at byte 1"));
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
        let (bin, format, reused) = token_bin(&src, &tok).unwrap();
        assert_eq!((format, reused), (DataFormat::U16, false));
        let ids: Vec<u32> = std::fs::read(&bin)
            .unwrap()
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect();
        assert_eq!(ids, tok.encode(&text).unwrap());
        assert!(token_bin(&src, &tok).unwrap().2, "reused");

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
        let (bin32, format, reused) = token_bin(&src, &wide).unwrap();
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
