//! `--tokenizer PATH/tokenizer.json`: any Hugging Face `tokenizer.json` (Llama 3's byte-level
//! BPE, GPT-2's, a SentencePiece BPE converted by transformers…) through the `tokenizers` crate,
//! built without its hub download feature: the file is read from disk, nothing is fetched.
//!
//! A file is identified by the SHA-256 of its bytes ([`JsonTokenizer::id`]): the token cache is
//! keyed by it, so editing the tokenizer re-tokenizes the text. Its vocabulary is one more than
//! the largest id it can produce (model vocabulary and added tokens), which may exceed 65,535
//! (Llama 3: 128,256); the token cache then stores u32 ids.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// A loaded `tokenizer.json`.
pub struct JsonTokenizer {
    path: PathBuf,
    sha256: String,
    vocab: usize,
    bos: Option<u32>,
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for JsonTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (vocab {})", self.path.display(), self.vocab)
    }
}

impl PartialEq for JsonTokenizer {
    fn eq(&self, other: &JsonTokenizer) -> bool {
        self.sha256 == other.sha256
    }
}

impl Eq for JsonTokenizer {}

/// Start-of-text tokens, in the order they are looked for (Llama 3, Llama 2 / SentencePiece,
/// GPT-2).
const STARTS: &[&str] = &["<|begin_of_text|>", "<s>", "<|endoftext|>"];

impl JsonTokenizer {
    /// Reads and parses `path`.
    ///
    /// # Errors
    /// The file cannot be read or is not a `tokenizer.json` the crate understands (one line
    /// naming the file).
    pub fn open(path: &Path) -> Result<JsonTokenizer, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("--tokenizer {}: {e}", path.display()))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            format!(
                "--tokenizer {}: not a Hugging Face tokenizer.json ({e}); give bytes, gpt2 or \
                 the path of a tokenizer.json",
                path.display()
            )
        })?;
        let vocab = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        if vocab == 0 {
            return Err(format!(
                "--tokenizer {}: the vocabulary is empty",
                path.display()
            ));
        }
        let sha256 = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let bos = STARTS.iter().find_map(|t| inner.token_to_id(t));
        Ok(JsonTokenizer {
            path: path.to_path_buf(),
            sha256,
            vocab,
            bos,
            inner,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `tokenizer.json sha256:HEX`: what the token cache is keyed by.
    pub fn id(&self) -> String {
        format!("tokenizer.json sha256:{}", self.sha256)
    }

    /// The first 12 hex digits of the file's SHA-256 (the cache file's name).
    pub fn short(&self) -> &str {
        &self.sha256[..12]
    }

    /// One more than the largest id.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The start-of-text token (`<|begin_of_text|>`, `<s>` or `<|endoftext|>`), if the
    /// vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Token ids of `text`, without added special tokens (no BOS: the text is a stream).
    ///
    /// # Errors
    /// The tokenizer's error, as a line.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("--tokenizer {}: {e}", self.path.display()))
    }

    /// The text of `ids` (special tokens kept).
    ///
    /// # Errors
    /// An id outside the vocabulary; the tokenizer's error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        if let Some(i) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(format!(
                "token id {i} is outside the tokenizer's vocab {}",
                self.vocab
            ));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| format!("--tokenizer {}: {e}", self.path.display()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-tiny/tokenizer.json")
    }

    /// The fixture's `tokenizer.json` encodes as Python's `tokenizers` did when the fixture was
    /// made (special tokens in the text matched, none added), and decodes back to the text.
    #[test]
    fn fixture_tokenizer_matches_python() {
        let dir = fixture().parent().unwrap().to_path_buf();
        let want: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let text = want["tokenizer_text"].as_str().unwrap();
        let ids: Vec<u32> = want["tokenizer_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let t = JsonTokenizer::open(&fixture()).unwrap();
        assert_eq!(t.vocab(), 384);
        assert_eq!(t.bos(), Some(0), "<|begin_of_text|>");
        assert_eq!(t.encode(text).unwrap(), ids);
        assert_eq!(t.decode(&ids).unwrap(), text);
        assert!(t.decode(&[384]).unwrap_err().contains("outside"));
        assert_eq!(t, JsonTokenizer::open(&fixture()).unwrap());
        let e = JsonTokenizer::open(&dir.join("config.json")).unwrap_err();
        assert!(e.contains("not a Hugging Face tokenizer.json"), "{e}");
    }
}
