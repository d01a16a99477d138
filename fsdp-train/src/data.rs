//! Training data: the embedded synthetic stream, or a file read with positioned reads (text
//! bytes, nanoGPT-style little-endian u16 token ids, or little-endian u32 ids for vocabularies
//! over 65,536, such as Llama 3's).
//!
//! Sequences are addressed by a *global sequence index*: at optimizer step `s`, micro-batch `m`
//! of `accum`, the global batch is `G = ranks × batch` sequences numbered
//! `(s·accum + m)·G .. +G`, and rank `r` takes `r·batch .. +batch` of them. A sequence's content
//! depends only on `(seed, index)`, so
//! - the order is deterministic from the seed and the step: a resumed run sees the same batches;
//! - `W` ranks with batch `b` see exactly the sequences of `W'` ranks with `b' = W·b/W'` (only
//!   their split over ranks differs);
//! - each rank reads only its own sequences (positioned reads of just those bytes; nothing else
//!   is read).
//!
//! The file is read with `pread`, not memory-mapped: a file truncated or shortened while training
//! runs is a typed error naming it ([`DataError::Changed`], exit 1), never a SIGBUS. A file
//! rewritten in place with the same length is not detected (the data read then changes).
//!
//! From a file, sequence `g` starts at a pseudo-random offset of the training part (a SplitMix64
//! hash of `(seed, g)`), and the validation split is the file's tail (`--val-fraction`): a fixed
//! set of `--eval-seqs` sequences at evenly spaced offsets of it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How a data file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormat {
    /// Every byte is a token (vocab 256).
    Text,
    /// Little-endian u16 token ids (nanoGPT's `train.bin`).
    U16,
    /// Little-endian u32 token ids (a `tokenizer.json` cache of a vocabulary over 65,536 ids).
    U32,
}

impl DataFormat {
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            DataFormat::Text => 1,
            DataFormat::U16 => 2,
            DataFormat::U32 => 4,
        }
    }

    /// `text bytes`, `u16 ids`, `u32 ids`.
    pub fn describe(self) -> &'static str {
        match self {
            DataFormat::Text => "text bytes",
            DataFormat::U16 => "u16 ids",
            DataFormat::U32 => "u32 ids",
        }
    }
}

/// A data problem, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be opened or mapped.
    #[error("--data {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `--data` is not a regular file (a directory, FIFO, device, socket).
    #[error("--data {path}: it is {what}, not a regular file; give a text or u16 token file")]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// The file changed under the run (shrank, or could no longer be read).
    #[error("--data {path}: the file changed while training: {detail}; training stopped (restart it with --resume from the last checkpoint once the file is back)")]
    Changed {
        /// The file.
        path: PathBuf,
        /// What happened.
        detail: String,
    },
    /// A u16 or u32 file whose length is not a whole number of tokens.
    #[error("--data {path}: {len} bytes is not a whole number of {width}-byte tokens (is it a .bin of such ids? use --data-format text for text)")]
    OddLength {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
        /// Bytes per token.
        width: u64,
    },
    /// Too few tokens for one sequence in a split.
    #[error("--data {path}: the {split} split has {tokens} tokens, fewer than one sequence of --seq-len {seq} needs ({need}); use a larger file, a shorter --seq-len or another --val-fraction")]
    TooShort {
        /// The file.
        path: PathBuf,
        /// `train` or `validation`.
        split: &'static str,
        /// Tokens in the split.
        tokens: u64,
        /// Sequence length.
        seq: usize,
        /// Tokens needed.
        need: u64,
    },
    /// A token id the model's vocabulary cannot hold.
    #[error("--data {path}: token id {id} at token position {pos} is out of range for --vocab {vocab}; pass a --vocab above the file's largest id")]
    TokenOutOfRange {
        /// The file.
        path: PathBuf,
        /// Token position in the file.
        pos: u64,
        /// The id.
        id: u64,
        /// The vocabulary size.
        vocab: usize,
    },
}

/// One sequence of inputs and next-token targets.
pub type Sequence = (Vec<i64>, Vec<i64>);

/// Where batches come from (cheap to clone: a file is shared, mapped once per process).
#[derive(Debug, Clone)]
pub enum Dataset {
    /// Counting sequences: sequence `k` starts at `(7k + 3 + seed) mod vocab` and counts up by
    /// `1 + k mod 3` (the generator of the parity tests and of the original main job).
    Synthetic {
        /// Vocabulary size.
        vocab: usize,
    },
    /// A token file (read with positioned reads).
    File(Arc<TokenFile>),
}

/// A token file and its train/validation split.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    file: File,
    /// Its length in bytes when opened.
    len: u64,
    format: DataFormat,
    /// Tokens in the file.
    tokens: u64,
    /// First token of the validation split.
    val_start: u64,
    vocab: usize,
}

/// Index space of the synthetic validation sequences (far from any training index).
const SYNTHETIC_VAL_BASE: u64 = 1 << 40;

impl Dataset {
    /// Opens `path` (a regular file, read with positioned reads) for sequences of `seq` tokens
    /// and a model of `vocab`.
    pub fn open(
        path: &Path,
        format: DataFormat,
        val_fraction: f64,
        seq: usize,
        vocab: usize,
    ) -> Result<Dataset, DataError> {
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        // Checked before opening: opening a FIFO for reading would block forever.
        let kind = std::fs::metadata(path).map_err(io)?.file_type();
        if !kind.is_file() {
            return Err(DataError::NotRegular {
                path: path.to_path_buf(),
                what: file_kind(kind),
            });
        }
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            // Replaced between the two looks.
            return Err(DataError::NotRegular {
                path: path.to_path_buf(),
                what: file_kind(meta.file_type()),
            });
        }
        let len = meta.len();
        let tokens = match format {
            DataFormat::Text => len,
            DataFormat::U16 | DataFormat::U32 => {
                let width = format.width() as u64;
                if len % width != 0 {
                    return Err(DataError::OddLength {
                        path: path.to_path_buf(),
                        len,
                        width,
                    });
                }
                len / width
            }
        };
        let val_tokens = ((tokens as f64) * val_fraction).floor() as u64;
        let val_start = tokens - val_tokens;
        let need = seq as u64 + 1;
        for (split, n) in [("train", val_start), ("validation", val_tokens)] {
            if n < need {
                return Err(DataError::TooShort {
                    path: path.to_path_buf(),
                    split,
                    tokens: n,
                    seq,
                    need,
                });
            }
        }
        Ok(Dataset::File(Arc::new(TokenFile {
            path: path.to_path_buf(),
            file,
            len,
            format,
            tokens,
            val_start,
            vocab,
        })))
    }

    /// Training sequence number `g` (see the module docs).
    pub fn train_sequence(&self, g: u64, seq: usize, seed: u64) -> Result<Sequence, DataError> {
        match self {
            Dataset::Synthetic { vocab } => Ok(counting(g, seq, *vocab, seed)),
            Dataset::File(f) => {
                let span = f.val_start - seq as u64; // >= 1: checked at open
                let start = splitmix64(seed ^ splitmix64(g)) % span;
                f.read(start, seq)
            }
        }
    }

    /// Validation sequence number `i` (`i < n`, the fixed evaluation set of `n` sequences).
    pub fn val_sequence(
        &self,
        i: u64,
        n: u64,
        seq: usize,
        seed: u64,
    ) -> Result<Sequence, DataError> {
        match self {
            Dataset::Synthetic { vocab } => Ok(counting(SYNTHETIC_VAL_BASE + i, seq, *vocab, seed)),
            Dataset::File(f) => {
                let span = f.tokens - f.val_start - seq as u64; // >= 1: checked at open
                let start = f.val_start + (i * span) / n.max(1);
                f.read(start, seq)
            }
        }
    }

    /// A one-line description for the banner.
    pub fn describe(&self) -> String {
        match self {
            Dataset::Synthetic { .. } => "synthetic counting sequences".into(),
            Dataset::File(f) => format!(
                "{} ({} tokens as {}; train {} / validation {} tokens)",
                f.path.display(),
                f.tokens,
                f.format.describe(),
                f.val_start,
                f.tokens - f.val_start
            ),
        }
    }
}

/// A file type in words (for [`DataError::NotRegular`]).
pub fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

impl TokenFile {
    /// The bytes of tokens `start .. start + n`, read with one positioned read; a file that
    /// shrank below its opening length (or cannot be read any more) is [`DataError::Changed`].
    fn bytes(&self, start: u64, n: usize) -> Result<Vec<u8>, DataError> {
        let width = self.format.width();
        let changed = |detail: String| DataError::Changed {
            path: self.path.clone(),
            detail,
        };
        let now = self
            .file
            .metadata()
            .map_err(|e| changed(format!("cannot inspect it: {e}")))?
            .len();
        if now < self.len {
            return Err(changed(format!(
                "it shrank from {} to {now} bytes",
                self.len
            )));
        }
        let mut buf = vec![0u8; n * width];
        self.file
            .read_exact_at(&mut buf, start * width as u64)
            .map_err(|e| changed(format!("reading {} bytes at token {start}: {e}", n * width)))?;
        Ok(buf)
    }

    /// Tokens `start .. start + seq + 1` as (inputs, targets).
    fn read(&self, start: u64, seq: usize) -> Result<Sequence, DataError> {
        let mut ids = Vec::with_capacity(seq);
        let mut targets = Vec::with_capacity(seq);
        let raw = self.bytes(start, seq + 1)?;
        for t in 0..=seq as u64 {
            let pos = start + t;
            let i = t as usize;
            let id = match self.format {
                DataFormat::Text => u64::from(raw[i]),
                DataFormat::U16 => u64::from(u16::from_le_bytes([raw[2 * i], raw[2 * i + 1]])),
                DataFormat::U32 => u64::from(u32::from_le_bytes([
                    raw[4 * i],
                    raw[4 * i + 1],
                    raw[4 * i + 2],
                    raw[4 * i + 3],
                ])),
            };
            if id >= self.vocab as u64 {
                return Err(DataError::TokenOutOfRange {
                    path: self.path.clone(),
                    pos,
                    id,
                    vocab: self.vocab,
                });
            }
            if t < seq as u64 {
                ids.push(id as i64);
            }
            if t > 0 {
                targets.push(id as i64);
            }
        }
        Ok((ids, targets))
    }
}

/// Synthetic sequence `k`: starts at `(7k + 3 + seed) mod vocab`, counts up by `1 + k mod 3`.
fn counting(k: u64, seq: usize, vocab: usize, seed: u64) -> Sequence {
    let v = vocab as u64;
    let offset = seed % v;
    let start = (k % v * 7 + 3 + offset) % v;
    let stride = 1 + (k % 3);
    let at = |t: u64| ((start + stride * (t % v)) % v) as i64;
    let ids = (0..seq as u64).map(at).collect();
    let targets = (0..seq as u64).map(|t| at(t + 1)).collect();
    (ids, targets)
}

/// SplitMix64's finalizer: a well-mixed 64-bit hash.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn synthetic_matches_the_original_generator() {
        // The original main job: k = index·batch + b, start (7k + 3 + seed) mod vocab.
        let (vocab, seq, seed) = (256usize, 8usize, 5u64);
        for k in [0u64, 1, 2, 77, 1000] {
            let (ids, tg) = counting(k, seq, vocab, seed);
            let start = (k as usize * 7 + 3 + seed as usize % vocab) % vocab;
            let stride = 1 + (k as usize % 3);
            for t in 0..seq {
                assert_eq!(ids[t], ((start + stride * t) % vocab) as i64);
                assert_eq!(tg[t], ((start + stride * (t + 1)) % vocab) as i64);
            }
        }
    }

    #[test]
    fn file_sequences_are_deterministic_in_range_and_split() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let text: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&text).unwrap();
        let d = Dataset::open(f.path(), DataFormat::Text, 0.1, 16, 256).unwrap();
        let Dataset::File(tf) = &d else { panic!() };
        assert_eq!((tf.tokens, tf.val_start), (10_000, 9_000));
        for g in 0..200 {
            let (a, ta) = d.train_sequence(g, 16, 3).unwrap();
            let (b, _) = d.train_sequence(g, 16, 3).unwrap();
            assert_eq!(a, b);
            assert_eq!(&a[1..], &ta[..15]);
        }
        assert_ne!(
            d.train_sequence(0, 16, 3).unwrap(),
            d.train_sequence(0, 16, 4).unwrap()
        );
        for i in 0..32 {
            let (v, tv) = d.val_sequence(i, 32, 16, 0).unwrap();
            let off = 9_000 + (i * (1000 - 16)) / 32;
            assert_eq!(v[0], (off % 251) as i64);
            assert_eq!(*tv.last().unwrap(), ((off + 16) % 251) as i64);
        }
    }

    /// Issue #26 (4): a file truncated while training is a typed error naming it (never a
    /// SIGBUS), and non-regular files are refused when opened (a FIFO would block forever).
    #[test]
    fn truncation_under_the_run_is_an_error_and_non_files_are_refused() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let text: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(f.path(), &text).unwrap();
        let d = Dataset::open(f.path(), DataFormat::Text, 0.1, 16, 256).unwrap();
        d.train_sequence(0, 16, 0).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .unwrap()
            .set_len(0)
            .unwrap();
        let e = d.train_sequence(1, 16, 0).unwrap_err();
        assert!(matches!(e, DataError::Changed { .. }), "{e}");
        assert!(e.to_string().contains("shrank from 10000 to 0"), "{e}");
        assert!(d.val_sequence(0, 4, 16, 0).is_err());
        let dir = tempfile::tempdir().unwrap();
        let e = Dataset::open(dir.path(), DataFormat::Text, 0.1, 16, 256).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success(), "mkfifo");
        let e = Dataset::open(&fifo, DataFormat::Text, 0.1, 16, 256).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
    }

    #[test]
    fn u16_ids_are_checked_against_the_vocab() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let ids: Vec<u16> = (0..4096u16).map(|i| i % 1000).collect();
        let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        f.write_all(&bytes).unwrap();
        let ok = Dataset::open(f.path(), DataFormat::U16, 0.25, 32, 1000).unwrap();
        let (a, _) = ok.val_sequence(0, 1, 32, 0).unwrap();
        assert_eq!(a[0], (3072 % 1000) as i64);
        let small = Dataset::open(f.path(), DataFormat::U16, 0.25, 32, 500).unwrap();
        let err = (0..50)
            .find_map(|g| small.train_sequence(g, 32, 0).err())
            .unwrap();
        assert!(
            matches!(err, DataError::TokenOutOfRange { vocab: 500, .. }),
            "{err}"
        );
        let odd = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(odd.path(), [1u8, 2, 3]).unwrap();
        assert!(matches!(
            Dataset::open(odd.path(), DataFormat::U16, 0.1, 1, 10),
            Err(DataError::OddLength { .. })
        ));
        assert!(matches!(
            Dataset::open(f.path(), DataFormat::U16, 0.01, 64, 1000),
            Err(DataError::TooShort {
                split: "validation",
                ..
            })
        ));
    }
}
