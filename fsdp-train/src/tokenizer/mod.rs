//! `--tokenizer bytes|gpt2|PATH`: text as bytes (vocab 256), GPT-2's byte-pair encoding
//! (r50k_base, vocab 50257, the ranks shipped inside the `tiktoken-rs` crate: nothing is fetched
//! at run time), or a Hugging Face `tokenizer.json` (`json.rs`, through the `tokenizers` crate).
//! A tokenized text file is cached beside it (`cache.rs`).

mod cache;
mod json;

pub use cache::{cache_paths, cache_tag, token_bin};
pub use json::JsonTokenizer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tiktoken_rs::CoreBPE;

/// GPT-2's vocabulary size (50,000 merges + 256 bytes + `<|endoftext|>`).
pub const GPT2_VOCAB: usize = 50257;
/// `<|endoftext|>`.
pub const GPT2_EOT: u32 = 50256;

/// Which tokenizer reads text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Tokenizer {
    /// Every byte is a token (vocab 256).
    #[default]
    Bytes,
    /// GPT-2's r50k_base byte-pair encoding (vocab 50257).
    Gpt2,
    /// A Hugging Face `tokenizer.json`.
    Json(Arc<JsonTokenizer>),
}

impl Tokenizer {
    /// The tokenizer of a `tokenizer.json` at `path`.
    ///
    /// # Errors
    /// [`JsonTokenizer::open`]'s.
    pub fn json(path: &Path) -> Result<Tokenizer, String> {
        Ok(Tokenizer::Json(Arc::new(JsonTokenizer::open(path)?)))
    }

    /// The smallest vocabulary a model needs for this tokenizer's ids.
    pub fn vocab(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => GPT2_VOCAB,
            Tokenizer::Json(t) => t.vocab(),
        }
    }

    /// `bytes`, `gpt2`, or the `tokenizer.json`'s path (for messages).
    pub fn name(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes".into(),
            Tokenizer::Gpt2 => "gpt2".into(),
            Tokenizer::Json(t) => t.path().display().to_string(),
        }
    }

    /// The token a prompt starts with when it is empty: `<|endoftext|>` for GPT-2, a newline
    /// for bytes, a `tokenizer.json`'s start-of-text token (or its encoding of a newline).
    ///
    /// # Errors
    /// A `tokenizer.json` with neither.
    pub fn start(&self) -> Result<u32, String> {
        match self {
            Tokenizer::Bytes => Ok(u32::from(b'\n')),
            Tokenizer::Gpt2 => Ok(GPT2_EOT),
            Tokenizer::Json(t) => match t.bos() {
                Some(b) => Ok(b),
                None => t.encode("\n")?.first().copied().ok_or_else(|| {
                    format!(
                        "{}: no start token and no id for a newline",
                        t.path().display()
                    )
                }),
            },
        }
    }

    /// Token ids of `text` (no special tokens).
    ///
    /// # Errors
    /// The encoder could not be built (it is built from the crate's embedded ranks).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Gpt2 => Ok(gpt2()?.encode_ordinary(text)),
            Tokenizer::Json(t) => t.encode(text),
        }
    }

    /// The text of `ids` (invalid UTF-8, e.g. half a character, shown as U+FFFD).
    ///
    /// # Errors
    /// An id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match self {
            Tokenizer::Json(t) => t.decode(ids),
            _ => Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned()),
        }
    }

    /// The bytes of `ids` (a GPT-2 token may hold part of a UTF-8 character: text streamed
    /// token by token is decoded from the bytes, see `sample`). A `tokenizer.json`'s decoder
    /// gives text: its bytes (a token ending inside a character decodes to U+FFFD on its own).
    ///
    /// # Errors
    /// An id outside the vocabulary.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, String> {
        Ok(match self {
            Tokenizer::Json(t) => t.decode(ids)?.into_bytes(),
            Tokenizer::Bytes => ids
                .iter()
                .map(|&i| u8::try_from(i).map_err(|_| format!("token id {i} is not a byte")))
                .collect::<Result<Vec<u8>, String>>()?,
            Tokenizer::Gpt2 => gpt2()?
                .decode_bytes(ids)
                .map_err(|e| format!("GPT-2 decoding: {e}"))?,
        })
    }
}

/// `--tokenizer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerArg {
    /// every byte is a token (vocab 256)
    Bytes,
    /// GPT-2's byte-pair encoding (r50k_base, vocab 50257)
    Gpt2,
    /// a Hugging Face `tokenizer.json`
    Json(PathBuf),
}

/// `bytes`, `gpt2`, or a path (which must name a file).
pub fn parse_tokenizer(s: &str) -> Result<TokenizerArg, String> {
    match s {
        "bytes" => Ok(TokenizerArg::Bytes),
        "gpt2" => Ok(TokenizerArg::Gpt2),
        p if Path::new(p).is_file() => Ok(TokenizerArg::Json(PathBuf::from(p))),
        p => Err(format!(
            "`{p}` is neither bytes, gpt2 nor a tokenizer.json file"
        )),
    }
}

impl TokenizerArg {
    /// The tokenizer (a `tokenizer.json` is read and parsed).
    ///
    /// # Errors
    /// An unreadable or malformed `tokenizer.json`.
    pub fn load(&self) -> Result<Tokenizer, String> {
        match self {
            TokenizerArg::Bytes => Ok(Tokenizer::Bytes),
            TokenizerArg::Gpt2 => Ok(Tokenizer::Gpt2),
            TokenizerArg::Json(p) => Tokenizer::json(p),
        }
    }
}

/// The `tokenizer.json` beside a Hugging Face checkpoint at `path` (a directory or a file in
/// it), if there is one.
pub fn beside(path: &Path) -> Option<PathBuf> {
    let dir = if path.is_dir() { path } else { path.parent()? };
    Some(dir.join("tokenizer.json")).filter(|p| p.is_file())
}

/// The r50k_base encoder (built once per process from the embedded ranks).
pub(crate) fn gpt2() -> Result<&'static CoreBPE, String> {
    static BPE: std::sync::OnceLock<Result<CoreBPE, String>> = std::sync::OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| format!("GPT-2 tokenizer: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_round_trips_and_knows_its_ids() {
        let t = Tokenizer::Gpt2;
        let ids = t.encode("Hello world").unwrap();
        assert_eq!(ids, vec![15496, 995]); // GPT-2's well-known ids
        assert_eq!(t.decode(&ids).unwrap(), "Hello world");
        assert_eq!(t.decode(&[GPT2_EOT]).unwrap(), "<|endoftext|>");
        assert_eq!(Tokenizer::Bytes.encode("hé").unwrap(), vec![104, 195, 169]);
        assert!(Tokenizer::Bytes.decode(&[300]).is_err());
    }
}
