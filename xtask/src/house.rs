//! `cargo xtask house`: the import-circle checker.
//!
//! For every crate it builds the file-level import graph of `src/` and fails on any cycle
//! (a file that imports, directly or through other files, a file that imports it) and on any
//! `use super::*;` outside `#[cfg(test)]` code.
//!
//! What counts as "file A imports file B" is what a reader of A sees A name:
//! - a `use` declaration in A (any visibility, including `pub use` re-exports and `use` inside
//!   function bodies) whose path resolves to an item defined in B, or to the module B itself;
//! - an inline path anywhere in A's code (`crate::a::b::X`, `super::X`, `self::x::Y`, or
//!   `child::X` where `child` is a submodule of the current module, or a module a `use`
//!   brought in): in expressions, types, function arguments, macro arguments, and in
//!   attributes (`#[arg(default_value_t = crate::cli::MAX_STEPS)]`, `#[cfg_attr(…, …)]`).
//!
//! A path is resolved through the module tree (`mod x;` → `x.rs` or `x/mod.rs`; inline
//! `mod x { … }` belongs to its file) to the deepest module it names; the item after it is then
//! followed only through that module's *public face*: a `pub use` (explicit or glob) of an item
//! of the module's own descendant. So `use crate::kernels::Backend` where `kernels/mod.rs` says
//! `pub use backend::Backend` is an import of `kernels/backend.rs`, not of `kernels/mod.rs`.
//! Any other `use` that brings the item into the named module (a sibling's item re-exported,
//! as `pub(crate) use crate::strides::contiguous_strides` in `launch.rs`; a parent's private
//! import reached by a child as `super::X`) makes the path an import of the named module's own
//! file: `crate::launch::contiguous_strides` imports `launch.rs`, as a reader sees it. A leaf
//! file that holds a shared item therefore breaks a cycle only where importers name it (or
//! reach it through a public face), not behind a sibling's re-export.
//! Declaring a module (`mod x;`) is not an import, and neither is a parent module re-exporting
//! an item of its own descendant (`pub use child::X;` in `mod.rs`/`lib.rs`: the module's public
//! face, which users are resolved through); a private `use child::X;` in the parent, or a
//! `pub use` of a sibling's item, is an import. Code under a `#[cfg(…test…)]` attribute
//! (`cfg(test)`, `cfg(all(test, …))`: test modules, test-only files, test-only items, with the
//! other attributes stacked on them) is left out; `cfg(any(test, …))` is code. Doc comments
//! and string literals are not code.
//!
//! The parser is a small hand-written lexer, not a full Rust parser: it knows comments,
//! strings (raw and byte), char literals vs lifetimes, attributes, `mod`, `use` trees and item
//! keywords. Macros that build paths from fragments are not expanded.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The crates checked by `cargo xtask house` (directories under the workspace root holding a
/// `src/lib.rs` or `src/main.rs`): a cycle or `use super::*` in one of these fails the check.
pub const CRATES: &[&str] = &[
    "fsdp-flatparam",
    "fsdp-alloc",
    "fsdp-collectives",
    "fsdp-autograd",
    "fsdp-init",
    "fsdp-core",
    "fsdp-plan",
    "fsdp-train",
    "xtask",
    "examples/candle-mlp",
    "tests",
];

/// Crates whose findings are printed but do not fail the check yet; move a crate to [`CRATES`]
/// once it is clean. Empty: fsdp-train's shared types live in `fsdp-train/src/job.rs` and
/// xtask's process helpers in `xtask/src/util.rs`, so every package is enforced.
pub const REPORTED: &[&str] = &[];

// ---------------------------------------------------------------------------------------------
// Lexer
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
    /// A string, char or number literal (its text does not matter here).
    Lit,
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

fn lex(src: &str) -> Vec<Token> {
    let b: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let n = b.len();
    let push = |out: &mut Vec<Token>, tok, line| out.push(Token { tok, line });
    while i < n {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && i + 1 < n && b[i + 1] == '/' {
            while i < n && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && i + 1 < n && b[i + 1] == '*' {
            let mut depth = 0;
            while i < n {
                if b[i] == '/' && i + 1 < n && b[i + 1] == '*' {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && i + 1 < n && b[i + 1] == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == '"' {
            i += 1;
            while i < n && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                if i < n && b[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
            push(&mut out, Tok::Lit, line);
        } else if (c == 'r' || c == 'b')
            && raw_string_start(&b, i).is_some()
            && !prev_is_ident_char(&b, i)
        {
            let (hashes, body) = raw_string_start(&b, i).unwrap_or((0, i));
            i = body;
            loop {
                if i >= n {
                    break;
                }
                if b[i] == '"' && (0..hashes).all(|k| i + 1 + k < n && b[i + 1 + k] == '#') {
                    i += 1 + hashes;
                    break;
                }
                if b[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            push(&mut out, Tok::Lit, line);
        } else if c == 'b' && i + 1 < n && (b[i + 1] == '"' || b[i + 1] == '\'') {
            // byte string / byte char: skip the prefix, the quote is handled next round
            i += 1;
        } else if c == '\'' {
            // char literal or lifetime
            if i + 2 < n && b[i + 1] == '\\' {
                i += 3;
                while i < n && b[i] != '\'' {
                    i += 1;
                }
                i += 1;
                push(&mut out, Tok::Lit, line);
            } else if i + 2 < n && b[i + 2] == '\'' {
                i += 3;
                push(&mut out, Tok::Lit, line);
            } else {
                // lifetime: skip the quote and its name
                i += 1;
                while i < n && (b[i].is_alphanumeric() || b[i] == '_') {
                    i += 1;
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let s = i;
            while i < n && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            let word: String = b[s..i].iter().collect();
            // `r#ident`
            if word == "r" && i < n && b[i] == '#' {
                i += 1;
                continue;
            }
            push(&mut out, Tok::Ident(word), line);
        } else if c.is_ascii_digit() {
            while i < n && (b[i].is_alphanumeric() || b[i] == '_' || b[i] == '.') {
                // `1..n` must not eat the range
                if b[i] == '.' && i + 1 < n && b[i + 1] == '.' {
                    break;
                }
                i += 1;
            }
            push(&mut out, Tok::Lit, line);
        } else if c == ':' && i + 1 < n && b[i + 1] == ':' {
            i += 2;
            push(&mut out, Tok::Path, line);
        } else {
            i += 1;
            push(&mut out, Tok::Punct(c), line);
        }
    }
    out
}

fn prev_is_ident_char(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// `r"…"`, `r#"…"#`, `br"…"`: the number of hashes and the index after the opening quote.
fn raw_string_start(b: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if b.get(j) == Some(&'b') {
        j += 1;
    }
    if b.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while b.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (b.get(j) == Some(&'"')).then_some((hashes, j + 1))
}

// ---------------------------------------------------------------------------------------------
// Module tree and references
// ---------------------------------------------------------------------------------------------

/// How a path starts.
#[derive(Clone, Debug, PartialEq)]
enum Anchor {
    Crate,
    /// `super::` repeated n times (from the module the path appears in).
    Super(usize),
    /// `self::` or a bare first segment (resolved only if it names a child module).
    SelfMod,
}

#[derive(Clone, Debug)]
struct Ref {
    /// Module the path appears in.
    module: usize,
    anchor: Anchor,
    segs: Vec<String>,
    /// `use …::*`
    glob: bool,
    /// The name the `use` binds (alias or last segment); `None` for inline paths and globs.
    binds: Option<String>,
    is_use: bool,
    /// `pub use` (any visibility): a re-export.
    is_pub: bool,
    line: usize,
    text: String,
}

#[derive(Debug)]
struct Module {
    parent: Option<usize>,
    file: usize,
    children: BTreeMap<String, usize>,
    defines: BTreeSet<String>,
}

/// One crate's source tree, parsed.
struct Tree {
    files: Vec<PathBuf>,
    modules: Vec<Module>,
    refs: Vec<Ref>,
    /// `use super::*;` outside test code: (file, line).
    super_globs: Vec<(usize, usize)>,
    /// Files declared with `mod x;` that could not be found.
    missing: Vec<String>,
    /// Per module, the indices in `refs` of its `use` declarations.
    uses: Vec<Vec<usize>>,
}

/// Where the children of a module file live.
fn child_dir(file: &Path, is_root_like: bool) -> PathBuf {
    let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
    if is_root_like {
        dir
    } else {
        dir.join(file.file_stem().unwrap_or_default())
    }
}

fn is_root_like(file: &Path) -> bool {
    matches!(
        file.file_name().and_then(|s| s.to_str()),
        Some("mod.rs" | "lib.rs" | "main.rs")
    )
}

/// Reads a source file: the real file system, or a synthetic tree in the tests.
pub trait Source {
    /// The file's text, or `None` if it does not exist.
    fn read(&self, path: &Path) -> Option<String>;
}

/// The real file system.
pub struct Fs;

impl Source for Fs {
    fn read(&self, path: &Path) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }
}

fn parse_tree(src: &dyn Source, root_file: &Path) -> Tree {
    let mut t = Tree {
        files: vec![],
        modules: vec![],
        refs: vec![],
        super_globs: vec![],
        missing: vec![],
        uses: vec![],
    };
    t.files.push(root_file.to_path_buf());
    t.modules.push(Module {
        parent: None,
        file: 0,
        children: BTreeMap::new(),
        defines: BTreeSet::new(),
    });
    // (module id, file id, dir for children)
    let mut queue = vec![(0usize, 0usize, child_dir(root_file, true))];
    while let Some((m, f, dir)) = queue.pop() {
        let Some(text) = src.read(&t.files[f]) else {
            t.missing.push(t.files[f].display().to_string());
            continue;
        };
        let toks = lex(&text);
        let mut p = Parser {
            toks: &toks,
            i: 0,
            file: f,
            dir,
            tree: &mut t,
            pending_files: vec![],
        };
        p.items(m, false);
        let pending = std::mem::take(&mut p.pending_files);
        for (child, path) in pending {
            let file_id = t.files.len();
            let candidates = [path.with_extension("rs"), path.join("mod.rs")];
            let found = candidates
                .iter()
                .find(|c| src.read(c).is_some())
                .cloned()
                .unwrap_or_else(|| candidates[0].clone());
            t.files.push(found.clone());
            t.modules[child].file = file_id;
            let cdir = child_dir(&found, is_root_like(&found));
            queue.push((child, file_id, cdir));
        }
    }
    t.uses = vec![vec![]; t.modules.len()];
    for (k, r) in t.refs.iter().enumerate() {
        if r.is_use {
            t.uses[r.module].push(k);
        }
    }
    t
}

struct Parser<'a> {
    toks: &'a [Token],
    i: usize,
    file: usize,
    /// Directory holding the children of the file's top module.
    dir: PathBuf,
    tree: &'a mut Tree,
    /// (module id, path without extension) of `mod x;` declarations still to read.
    pending_files: Vec<(usize, PathBuf)>,
}

const ITEM_KEYWORDS: &[&str] = &[
    "fn", "struct", "enum", "trait", "type", "const", "static", "union",
];

impl Parser<'_> {
    fn peek(&self, k: usize) -> Option<&Tok> {
        self.toks.get(self.i + k).map(|t| &t.tok)
    }

    fn ident(&self, k: usize) -> Option<&str> {
        match self.peek(k) {
            Some(Tok::Ident(s)) => Some(s),
            _ => None,
        }
    }

    fn new_module(&mut self, parent: usize, name: &str) -> usize {
        let id = self.tree.modules.len();
        self.tree.modules.push(Module {
            parent: Some(parent),
            file: self.file,
            children: BTreeMap::new(),
            defines: BTreeSet::new(),
        });
        self.tree.modules[parent]
            .children
            .insert(name.to_string(), id);
        self.tree.modules[parent].defines.insert(name.to_string());
        id
    }

    /// Path of a module's directory for its `mod x;` children, relative to this file.
    fn module_dir(&self, m: usize) -> PathBuf {
        // Walk up inline modules until the file's top module.
        let mut names = vec![];
        let mut cur = m;
        while let Some(p) = self.tree.modules[cur].parent {
            if self.tree.modules[p].file != self.file || self.is_file_top(cur) {
                break;
            }
            let name = self.tree.modules[p]
                .children
                .iter()
                .find(|(_, &c)| c == cur)
                .map(|(n, _)| n.clone())
                .unwrap_or_default();
            names.push(name);
            cur = p;
        }
        let mut d = self.dir.clone();
        for n in names.iter().rev() {
            d = d.join(n);
        }
        d
    }

    fn is_file_top(&self, m: usize) -> bool {
        match self.tree.modules[m].parent {
            None => true,
            Some(p) => self.tree.modules[p].file != self.tree.modules[m].file || m == 0,
        }
    }

    /// Reads one attribute `#[…]` / `#![…]` of an item in module `m`; returns whether it is a
    /// `cfg` that holds only under `test`. Inline paths in any other attribute
    /// (`#[arg(default_value_t = crate::cli::MAX_STEPS)]`) are recorded like paths in code: a
    /// reader of the file sees them, and the compiler resolves them.
    fn attribute(&mut self, m: usize) -> bool {
        self.i += 1; // '#'
        if self.peek(0) == Some(&Tok::Punct('!')) {
            self.i += 1;
        }
        if self.peek(0) != Some(&Tok::Punct('[')) {
            return false;
        }
        let start = self.i;
        self.skip_group();
        let end = self.i;
        let body = &self.toks[start..end];
        let is_cfg = matches!(body.get(1).map(|t| &t.tok), Some(Tok::Ident(s)) if s == "cfg");
        let has = |w: &str| {
            body.iter()
                .any(|t| matches!(&t.tok, Tok::Ident(s) if s == w))
        };
        // `cfg(test)`, `cfg(all(test, …))`; not `cfg(any(test, …))` nor `cfg(not(test))`
        let test_only = is_cfg && has("test") && !has("not") && !has("any");
        if !is_cfg {
            self.i = start + 1;
            while self.i < end {
                if self.at_inline_path() {
                    self.inline_path(m);
                } else {
                    self.i += 1;
                }
            }
            self.i = end;
        }
        test_only
    }

    /// Whether the current token starts an inline path worth recording: `crate::`, `super::`,
    /// `self::`, or `name::` not itself after `::`, `.` or `$` (a candidate child module,
    /// resolved later).
    fn at_inline_path(&self) -> bool {
        let Some(Tok::Ident(w)) = self.peek(0) else {
            return false;
        };
        if w == "crate" || w == "super" || w == "self" {
            return true;
        }
        let prev = self.i.checked_sub(1).map(|k| &self.toks[k].tok);
        let after_path = matches!(prev, Some(Tok::Path | Tok::Punct('.') | Tok::Punct('$')));
        !after_path && self.peek(1) == Some(&Tok::Path) && w != "Self"
    }

    /// Skips a balanced `(…)`, `[…]` or `{…}` starting at the current token.
    fn skip_group(&mut self) {
        let mut depth = 0i32;
        while let Some(t) = self.peek(0) {
            match t {
                Tok::Punct('(' | '[' | '{') => depth += 1,
                Tok::Punct(')' | ']' | '}') => depth -= 1,
                _ => {}
            }
            self.i += 1;
            if depth <= 0 {
                return;
            }
        }
    }

    /// Skips one item (after a test-only attribute): up to a `;` outside brackets, or through
    /// the first `{…}` block.
    fn skip_item(&mut self) {
        while let Some(t) = self.peek(0) {
            match t {
                Tok::Punct(';') => {
                    self.i += 1;
                    return;
                }
                Tok::Punct('{') => {
                    self.skip_group();
                    return;
                }
                Tok::Punct('(' | '[') => self.skip_group(),
                Tok::Punct('}') => return,
                _ => self.i += 1,
            }
        }
    }

    /// Parses items of module `m` until the closing `}` (inline module) or end of file.
    fn items(&mut self, m: usize, inline: bool) {
        let mut test_only = false;
        // where the refs recorded by the current run of attributes begin: dropped again if one
        // of them makes the item test-only
        let mut attrs_from: Option<usize> = None;
        while let Some(t) = self.peek(0).cloned() {
            match t {
                Tok::Punct('#') => {
                    attrs_from.get_or_insert(self.tree.refs.len());
                    if self.attribute(m) {
                        test_only = true;
                    }
                    continue;
                }
                Tok::Punct('}') if inline => {
                    self.i += 1;
                    return;
                }
                _ => {}
            }
            let attrs_start = attrs_from.take();
            if test_only {
                // `#[cfg(test)]` applies to the next item: skip it whole, with the paths of the
                // attributes stacked on it (consumed above).
                test_only = false;
                if let Some(k) = attrs_start {
                    self.tree.refs.truncate(k);
                }
                if self.ident(0) == Some("pub") {
                    self.i += 1;
                    if self.peek(0) == Some(&Tok::Punct('(')) {
                        self.skip_group();
                    }
                }
                self.skip_item();
                continue;
            }
            match t {
                Tok::Ident(ref w) if w == "mod" => {
                    let Some(name) = self.ident(1).map(str::to_string) else {
                        self.i += 1;
                        continue;
                    };
                    match self.peek(2) {
                        Some(Tok::Punct(';')) => {
                            let child = self.new_module(m, &name);
                            let path = self.module_dir(m).join(&name);
                            self.pending_files.push((child, path));
                            self.i += 3;
                        }
                        Some(Tok::Punct('{')) => {
                            let child = self.new_module(m, &name);
                            self.i += 3;
                            self.items(child, true);
                        }
                        _ => self.i += 2,
                    }
                }
                Tok::Ident(ref w) if w == "use" => {
                    self.i += 1;
                    self.use_decl(m);
                }
                Tok::Ident(ref w) if w == "macro_rules" => {
                    if let Some(name) = self.ident(2).map(str::to_string) {
                        self.tree.modules[m].defines.insert(name);
                    }
                    self.i += 1;
                }
                Tok::Ident(ref w) if ITEM_KEYWORDS.contains(&w.as_str()) => {
                    if let Some(name) = self.ident(1).map(str::to_string) {
                        self.tree.modules[m].defines.insert(name);
                    }
                    self.i += 1;
                }
                Tok::Ident(_) if self.at_inline_path() => {
                    // `crate::…`, `super::…`, `self::…`, or `child::X` where `child` may be a
                    // submodule (resolved later)
                    self.inline_path(m);
                }
                Tok::Punct('{') => {
                    // a block inside an item (fn body, impl, …): its items belong to `m`
                    self.i += 1;
                    self.items(m, true);
                }
                _ => self.i += 1,
            }
        }
    }

    fn inline_path(&mut self, m: usize) {
        let line = self.toks[self.i].line;
        let mut segs = vec![];
        let prev_dollar = self
            .i
            .checked_sub(1)
            .is_some_and(|k| self.toks[k].tok == Tok::Punct('$'));
        let _ = prev_dollar;
        while let Some(Tok::Ident(s)) = self.peek(0) {
            segs.push(s.clone());
            self.i += 1;
            if self.peek(0) == Some(&Tok::Path) && matches!(self.peek(1), Some(Tok::Ident(_))) {
                self.i += 1;
            } else {
                break;
            }
        }
        if segs.len() < 2 {
            return;
        }
        let text = segs.join("::");
        let (anchor, rest) = anchor_of(&segs);
        self.tree.refs.push(Ref {
            module: m,
            anchor,
            segs: rest,
            glob: false,
            binds: None,
            is_use: false,
            is_pub: false,
            line,
            text,
        });
    }

    /// After `use`: a use tree up to `;`.
    fn use_decl(&mut self, m: usize) {
        // `pub use` / `pub(crate) use` / `pub(super) use`: look back past `use`
        let back = |k: usize| {
            self.i
                .checked_sub(k)
                .and_then(|j| self.toks.get(j))
                .map(|t| &t.tok)
        };
        let is_pub = matches!(back(2), Some(Tok::Ident(s)) if s == "pub")
            || (back(2) == Some(&Tok::Punct(')'))
                && (3..=6).any(|k| matches!(back(k), Some(Tok::Ident(s)) if s == "pub")));
        let line = self.toks.get(self.i).map_or(0, |t| t.line);
        let mut leaves = vec![];
        self.use_tree(&mut vec![], &mut leaves);
        if self.peek(0) == Some(&Tok::Punct(';')) {
            self.i += 1;
        }
        for (segs, glob, binds) in leaves {
            let mut text = segs.join("::");
            if glob {
                text.push_str("::*");
            }
            if segs.is_empty() {
                continue;
            }
            if glob && segs.len() == 1 && segs[0] == "super" {
                self.tree.super_globs.push((self.file, line));
            }
            let (anchor, rest) = anchor_of(&segs);
            self.tree.refs.push(Ref {
                module: m,
                anchor,
                segs: rest,
                glob,
                binds,
                is_use: true,
                is_pub,
                line,
                text: format!("use {text}"),
            });
        }
    }

    fn use_tree(
        &mut self,
        prefix: &mut Vec<String>,
        out: &mut Vec<(Vec<String>, bool, Option<String>)>,
    ) {
        let depth = prefix.len();
        loop {
            match self.peek(0).cloned() {
                Some(Tok::Path) => self.i += 1,
                Some(Tok::Punct('*')) => {
                    self.i += 1;
                    out.push((prefix.clone(), true, None));
                    break;
                }
                Some(Tok::Punct('{')) => {
                    self.i += 1;
                    loop {
                        match self.peek(0) {
                            Some(Tok::Punct('}')) => {
                                self.i += 1;
                                break;
                            }
                            Some(Tok::Punct(',')) => self.i += 1,
                            None => break,
                            _ => {
                                let before = self.i;
                                self.use_tree(prefix, out);
                                if self.i == before {
                                    self.i += 1;
                                }
                            }
                        }
                    }
                    break;
                }
                Some(Tok::Ident(s)) => {
                    self.i += 1;
                    if s == "self" && !prefix.is_empty() && self.peek(0) != Some(&Tok::Path) {
                        // `a::{self}`: the module itself
                        let mut binds = prefix.last().cloned();
                        if self.ident(0) == Some("as") {
                            binds = self.ident(1).map(str::to_string);
                            self.i += 2;
                        }
                        out.push((prefix.clone(), false, binds));
                        break;
                    }
                    prefix.push(s);
                    if self.peek(0) != Some(&Tok::Path) {
                        let mut binds = prefix.last().cloned();
                        if self.ident(0) == Some("as") {
                            binds = self.ident(1).map(str::to_string);
                            self.i += 2;
                        }
                        out.push((prefix.clone(), false, binds));
                        break;
                    }
                }
                _ => break,
            }
        }
        prefix.truncate(depth);
    }
}

fn anchor_of(segs: &[String]) -> (Anchor, Vec<String>) {
    match segs.first().map(String::as_str) {
        Some("crate") => (Anchor::Crate, segs[1..].to_vec()),
        Some("self") => (Anchor::SelfMod, segs[1..].to_vec()),
        Some("super") => {
            let n = segs.iter().take_while(|s| *s == "super").count();
            (Anchor::Super(n), segs[n..].to_vec())
        }
        _ => (Anchor::SelfMod, segs.to_vec()),
    }
}

// ---------------------------------------------------------------------------------------------
// Resolution and cycles
// ---------------------------------------------------------------------------------------------

/// An edge of the import graph: `from` imports `to` at `line` with `text`.
#[derive(Clone, Debug)]
pub struct Edge {
    /// Importing file.
    pub from: PathBuf,
    /// Imported file.
    pub to: PathBuf,
    /// Line in `from`.
    pub line: usize,
    /// The path as written.
    pub text: String,
}

/// What the checker found in one crate.
#[derive(Debug, Default)]
pub struct Report {
    /// Each cycle: its files and the import lines between them.
    pub cycles: Vec<(Vec<PathBuf>, Vec<Edge>)>,
    /// `use super::*;` outside test code: (file, line).
    pub super_globs: Vec<(PathBuf, usize)>,
    /// `mod x;` declarations whose file was not found.
    pub missing: Vec<String>,
    /// Number of files read.
    pub files: usize,
    /// Number of file-to-file import edges.
    pub edges: usize,
}

impl Tree {
    fn start(&self, r: &Ref) -> Option<usize> {
        match r.anchor {
            Anchor::Crate => Some(0),
            Anchor::SelfMod => Some(r.module),
            Anchor::Super(n) => {
                let mut m = r.module;
                for _ in 0..n {
                    m = self.modules[m].parent?;
                }
                Some(m)
            }
        }
    }

    /// Resolves `segs` from module `m` to the file defining what it names.
    fn resolve(
        &self,
        m: usize,
        segs: &[String],
        seen: &mut BTreeSet<(usize, String)>,
    ) -> Option<usize> {
        let mut cur = m;
        let mut k = 0;
        while k < segs.len() {
            match self.modules[cur].children.get(&segs[k]) {
                Some(&c) => cur = c,
                None => {
                    // a module brought into scope by a `use` in `cur` (e.g. `use a::b; b::X`)
                    if k + 1 < segs.len() {
                        if let Some(target) = self.use_module(cur, &segs[k], seen) {
                            cur = target;
                            k += 1;
                            continue;
                        }
                    }
                    break;
                }
            }
            k += 1;
        }
        if k == segs.len() {
            return Some(self.modules[cur].file);
        }
        Some(self.follow(cur, &segs[k], seen))
    }

    /// A `use` in module `m` that binds `name` to a module: that module.
    fn use_module(
        &self,
        m: usize,
        name: &str,
        seen: &mut BTreeSet<(usize, String)>,
    ) -> Option<usize> {
        if !seen.insert((m, format!("mod:{name}"))) {
            return None;
        }
        for r in self.uses[m]
            .iter()
            .map(|&k| &self.refs[k])
            .filter(|r| !r.glob)
        {
            if r.binds.as_deref() == Some(name) {
                let mut cur = self.start(r)?;
                for s in &r.segs {
                    cur = *self.modules[cur].children.get(s)?;
                }
                return Some(cur);
            }
        }
        None
    }

    /// The file a path naming `item` in module `m` imports: the file defining it, followed
    /// through `m`'s public face only. A `pub use` in `m` of an item of `m`'s own descendant
    /// (`pub use backend::Backend` in `kernels/mod.rs`) hands the name on, so the path imports
    /// the descendant's file; any other `use` that brings `item` into `m` (a sibling's item
    /// re-exported, `pub(crate) use crate::strides::contiguous_strides` in `launch.rs`, or a
    /// private import that a child reaches with `super::item`) makes the path an import of
    /// `m`'s file, as a reader sees it: `crate::launch::contiguous_strides` names `launch.rs`.
    fn follow(&self, m: usize, item: &str, seen: &mut BTreeSet<(usize, String)>) -> usize {
        let here = self.modules[m].file;
        if self.modules[m].defines.contains(item) || !seen.insert((m, item.to_string())) {
            return here;
        }
        for r in self.uses[m]
            .iter()
            .map(|&k| &self.refs[k])
            .filter(|r| !r.glob)
        {
            if r.binds.as_deref() == Some(item) {
                if let Some(s) = self.start(r) {
                    if let Some(f) = self.resolve(s, &r.segs, seen) {
                        return if r.is_pub && self.is_descendant_file(f, m) {
                            f
                        } else {
                            here
                        };
                    }
                }
            }
        }
        for r in self.uses[m]
            .iter()
            .map(|&k| &self.refs[k])
            .filter(|r| r.glob)
        {
            let Some(mut cur) = self.start(r) else {
                continue;
            };
            let mut ok = true;
            for s in &r.segs {
                match self.modules[cur].children.get(s) {
                    Some(&c) => cur = c,
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok && self.exports(cur, item, &mut BTreeSet::new()) {
                let face = r.is_pub && self.is_descendant_file(self.modules[cur].file, m);
                return if face {
                    self.follow(cur, item, seen)
                } else {
                    here
                };
            }
        }
        here
    }

    /// Whether module `m` defines or re-exports `item`.
    fn exports(&self, m: usize, item: &str, seen: &mut BTreeSet<usize>) -> bool {
        if !seen.insert(m) {
            return false;
        }
        if self.modules[m].defines.contains(item) {
            return true;
        }
        self.uses[m].iter().map(|&k| &self.refs[k]).any(|r| {
            if !r.glob {
                return r.binds.as_deref() == Some(item);
            }
            let Some(mut cur) = self.start(r) else {
                return false;
            };
            for s in &r.segs {
                match self.modules[cur].children.get(s) {
                    Some(&c) => cur = c,
                    None => return false,
                }
            }
            self.exports(cur, item, seen)
        })
    }

    /// Whether file `f` holds a module strictly below module `m`.
    fn is_descendant_file(&self, f: usize, m: usize) -> bool {
        let Some(top) = (0..self.modules.len()).find(|&k| {
            self.modules[k].file == f
                && self.modules[k]
                    .parent
                    .is_none_or(|p| self.modules[p].file != f)
        }) else {
            return false;
        };
        let mut cur = self.modules[top].parent;
        while let Some(c) = cur {
            if c == m {
                return true;
            }
            cur = self.modules[c].parent;
        }
        false
    }

    fn edges(&self) -> Vec<(usize, usize, usize, String)> {
        let mut out = vec![];
        for r in &self.refs {
            // bare inline paths count only when they start at a child module (or a module
            // imported by a `use`); otherwise they name a local variable, a type or an
            // external crate
            if r.anchor == Anchor::SelfMod && !r.is_use && !r.text.starts_with("self::") {
                let Some(first) = r.segs.first() else {
                    continue;
                };
                if !self.modules[r.module].children.contains_key(first)
                    && self
                        .use_module(r.module, first, &mut BTreeSet::new())
                        .is_none()
                {
                    continue;
                }
            }
            if r.anchor == Anchor::SelfMod
                && r.is_use
                && !r.text.starts_with("use self::")
                && !r
                    .segs
                    .first()
                    .is_some_and(|f| self.modules[r.module].children.contains_key(f))
            {
                continue; // an external crate
            }
            let Some(s) = self.start(r) else { continue };
            let Some(to) = self.resolve(s, &r.segs, &mut BTreeSet::new()) else {
                continue;
            };
            let from = self.modules[r.module].file;
            if r.is_pub && self.is_descendant_file(to, r.module) {
                // a module's public face: `pub use child::X` in a parent is, like `mod child;`,
                // not an import (users of `X` are resolved through it to the child's file)
                continue;
            }
            if from != to {
                out.push((from, to, r.line, r.text.clone()));
            }
        }
        out
    }
}

/// Strongly connected components with more than one node (Tarjan, iterative enough for the
/// few hundred files of a crate).
fn cycles(n: usize, adj: &[BTreeSet<usize>]) -> Vec<Vec<usize>> {
    struct St<'a> {
        adj: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut St, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on[v] = true;
        for &w in s.adj[v].clone().iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = vec![];
            while let Some(w) = s.stack.pop() {
                s.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = St {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: vec![],
        next: 0,
        out: vec![],
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Checks one crate whose root file (`src/lib.rs` or `src/main.rs`) is `root_file`.
pub fn check(src: &dyn Source, root_file: &Path) -> Report {
    let tree = parse_tree(src, root_file);
    let edges = tree.edges();
    let n = tree.files.len();
    let mut adj = vec![BTreeSet::new(); n];
    for (f, t, _, _) in &edges {
        adj[*f].insert(*t);
    }
    let mut report = Report {
        files: n,
        edges: adj.iter().map(BTreeSet::len).sum(),
        missing: tree.missing.clone(),
        ..Report::default()
    };
    for comp in cycles(n, &adj) {
        let set: BTreeSet<usize> = comp.iter().copied().collect();
        let mut seen = HashMap::new();
        let mut lines = vec![];
        for (f, t, line, text) in &edges {
            if set.contains(f)
                && set.contains(t)
                && seen.insert((*f, *line, text.clone()), ()).is_none()
            {
                lines.push(Edge {
                    from: tree.files[*f].clone(),
                    to: tree.files[*t].clone(),
                    line: *line,
                    text: text.clone(),
                });
            }
        }
        report
            .cycles
            .push((comp.iter().map(|&f| tree.files[f].clone()).collect(), lines));
    }
    report.super_globs = tree
        .super_globs
        .iter()
        .map(|&(f, l)| (tree.files[f].clone(), l))
        .collect();
    report
}

/// Formats a report for humans; paths are shown relative to `base`.
pub fn render(name: &str, r: &Report, base: &Path) -> String {
    let rel = |p: &Path| p.strip_prefix(base).unwrap_or(p).display().to_string();
    let mut s = String::new();
    for (i, (files, edges)) in r.cycles.iter().enumerate() {
        let _ = writeln!(
            s,
            "{name}: import cycle {} of {} through {} files: {}",
            i + 1,
            r.cycles.len(),
            files.len(),
            files.iter().map(|f| rel(f)).collect::<Vec<_>>().join(", ")
        );
        // one line per (importing file, imported file): the lines and paths that make it
        let mut by_pair: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for e in edges {
            let v = by_pair.entry((rel(&e.from), rel(&e.to))).or_default();
            let item = format!("{}: `{}`", e.line, e.text);
            if !v.contains(&item) {
                v.push(item);
            }
        }
        for ((from, to), items) in by_pair {
            let _ = writeln!(s, "    {from} -> {to}: {}", items.join(", "));
        }
    }
    for (f, l) in &r.super_globs {
        let _ = writeln!(
            s,
            "{name}: {}:{}: `use super::*;` outside #[cfg(test)]: import the names explicitly",
            rel(f),
            l
        );
    }
    for m in &r.missing {
        let _ = writeln!(s, "{name}: module file not found: {}", rel(Path::new(m)));
    }
    s
}

/// `cargo xtask house`: checks every crate in [`CRATES`]; fails on any cycle or
/// `use super::*;` outside tests.
pub fn house(root: &Path) -> Result<(), String> {
    let mut failed = 0;
    for name in CRATES.iter().chain(REPORTED) {
        let enforced = CRATES.contains(name);
        let src = root.join(name).join("src");
        let root_file = [src.join("lib.rs"), src.join("main.rs")]
            .into_iter()
            .find(|p| p.exists())
            .ok_or_else(|| format!("house: {name} has no src/lib.rs or src/main.rs"))?;
        let r = check(&Fs, &root_file);
        let text = render(name, &r, root);
        if r.cycles.is_empty() && r.super_globs.is_empty() && r.missing.is_empty() {
            eprintln!(
                "xtask: house: {name}: {} files, {} imports between files, no cycles",
                r.files, r.edges
            );
        } else if enforced {
            failed += 1;
            eprint!("{text}");
        } else {
            eprint!("{text}");
            eprintln!(
                "xtask: house: {name}: reported only, not enforced (see REPORTED in house.rs)"
            );
        }
    }
    if failed == 0 {
        Ok(())
    } else {
        Err(format!(
            "house: {failed} crate(s) have import cycles or `use super::*;` outside tests \
             (break a cycle by moving the shared item into its own lower file, or by importing \
             it from the file that defines it instead of through a re-export)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{check, Source};
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    struct Mem(HashMap<PathBuf, String>);

    impl Source for Mem {
        fn read(&self, path: &Path) -> Option<String> {
            self.0.get(path).cloned()
        }
    }

    fn tree(files: &[(&str, &str)]) -> Mem {
        Mem(files
            .iter()
            .map(|(p, t)| (PathBuf::from(p), t.to_string()))
            .collect())
    }

    fn names(files: &[PathBuf]) -> Vec<String> {
        files.iter().map(|f| f.display().to_string()).collect()
    }

    #[test]
    fn finds_a_two_file_cycle_with_its_lines() {
        let t = tree(&[
            ("src/lib.rs", "mod a;\nmod b;\npub use a::A;\n"),
            ("src/a.rs", "use crate::b::B;\npub struct A(B);\n"),
            (
                "src/b.rs",
                "pub struct B;\nfn f() -> crate::a::A { todo!() }\n",
            ),
        ]);
        let r = check(&t, Path::new("src/lib.rs"));
        assert_eq!(r.cycles.len(), 1, "{r:?}");
        assert_eq!(names(&r.cycles[0].0), ["src/a.rs", "src/b.rs"]);
        let lines: Vec<_> = r.cycles[0]
            .1
            .iter()
            .map(|e| (e.line, e.text.clone()))
            .collect();
        assert!(lines.contains(&(1, "use crate::b::B".into())), "{lines:?}");
        assert!(lines.contains(&(2, "crate::a::A".into())), "{lines:?}");
    }

    #[test]
    fn a_clean_tree_passes() {
        let t = tree(&[
            ("src/lib.rs", "mod a;\nmod b;\npub use a::A;\npub use b::B;\n"),
            ("src/a.rs", "use crate::b::B;\n/// uses [`crate::b`]\npub struct A(B);\n#[cfg(test)]\nmod tests {\n use super::*;\n use crate::A;\n}\n"),
            ("src/b.rs", "pub struct B;\n// crate::a::A in a comment\nconst S: &str = \"crate::a::A\";\n"),
        ]);
        let r = check(&t, Path::new("src/lib.rs"));
        assert!(r.cycles.is_empty(), "{r:?}");
        assert!(r.super_globs.is_empty(), "{r:?}");
        assert!(r.missing.is_empty(), "{r:?}");
        assert_eq!(r.files, 3);
    }

    #[test]
    fn re_exports_are_followed_to_the_defining_file() {
        // `b` imports `A` through the crate root's re-export: that is an import of a.rs,
        // so a.rs ↔ b.rs is a cycle even though neither names the other's path.
        let t = tree(&[
            ("src/lib.rs", "mod a;\nmod b;\npub use a::*;\n"),
            ("src/a.rs", "use crate::b::helper;\npub struct A;\n"),
            ("src/b.rs", "use crate::A;\npub fn helper() {}\n"),
        ]);
        let r = check(&t, Path::new("src/lib.rs"));
        assert_eq!(r.cycles.len(), 1, "{r:?}");
        assert_eq!(names(&r.cycles[0].0), ["src/a.rs", "src/b.rs"]);
    }

    #[test]
    fn a_parent_re_export_of_a_child_is_not_a_cycle_but_a_child_re_exporting_its_importer_is() {
        // mod.rs re-exports both; `cuda` uses the trait from `backend`: no cycle.
        let clean = tree(&[
            ("src/lib.rs", "mod k;\n"),
            (
                "src/k/mod.rs",
                "mod backend;\nmod cuda;\npub use backend::Backend;\npub use cuda::Cuda;\n",
            ),
            ("src/k/backend.rs", "pub trait Backend {}\n"),
            (
                "src/k/cuda/mod.rs",
                "use crate::k::Backend;\npub struct Cuda;\nimpl Backend for Cuda {}\n",
            ),
        ]);
        assert!(check(&clean, Path::new("src/lib.rs")).cycles.is_empty());
        // backend.rs re-exports `Cuda`, which imports backend.rs: a cycle.
        let cyclic = tree(&[
            ("src/lib.rs", "mod k;\n"),
            (
                "src/k/mod.rs",
                "mod backend;\nmod cuda;\npub use backend::{Backend, Cuda};\n",
            ),
            (
                "src/k/backend.rs",
                "pub use super::cuda::Cuda;\npub trait Backend {}\n",
            ),
            (
                "src/k/cuda/mod.rs",
                "use crate::k::Backend;\npub struct Cuda;\nimpl Backend for Cuda {}\n",
            ),
        ]);
        let r = check(&cyclic, Path::new("src/lib.rs"));
        assert_eq!(r.cycles.len(), 1, "{r:?}");
        assert_eq!(
            names(&r.cycles[0].0),
            ["src/k/backend.rs", "src/k/cuda/mod.rs"]
        );
    }

    #[test]
    fn a_parent_that_uses_its_child_privately_while_the_child_uses_the_parent_is_a_cycle() {
        let src = |parent_use: &str| {
            tree(&[
                ("src/lib.rs", "mod k;\n"),
                (
                    "src/k/mod.rs",
                    &*Box::leak(
                        format!("mod c;\n{parent_use} c::C;\npub fn helper() {{}}\n")
                            .into_boxed_str(),
                    ),
                ),
                ("src/k/c.rs", "use super::helper;\npub struct C;\n"),
            ])
        };
        assert!(check(&src("pub use"), Path::new("src/lib.rs"))
            .cycles
            .is_empty());
        assert_eq!(check(&src("use"), Path::new("src/lib.rs")).cycles.len(), 1);
    }

    #[test]
    fn super_glob_outside_tests_fails_and_inside_tests_does_not() {
        let t = tree(&[
            ("src/lib.rs", "mod a;\npub struct X;\n"),
            (
                "src/a.rs",
                "use super::*;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
            ),
        ]);
        let r = check(&t, Path::new("src/lib.rs"));
        assert_eq!(r.super_globs.len(), 1, "{r:?}");
        assert_eq!(r.super_globs[0].1, 1);
    }

    #[test]
    fn test_only_files_and_items_are_left_out_and_lexing_survives_lifetimes_and_raw_strings() {
        let t = tree(&[
            ("src/lib.rs", "mod a;\nmod b;\n#[cfg(test)]\nmod tests;\n"),
            ("src/a.rs", "use crate::b::B;\npub struct A<'a>(&'a B);\nconst R: &str = r#\"crate::b::\"x\"# ;\nconst C: char = '{';\n"),
            ("src/b.rs", "pub struct B;\n#[cfg(test)]\nfn t() { let _ = crate::a::A(&B); }\n#[cfg(all(test, feature = \"x\"))]\nuse crate::a::A;\n"),
            ("src/tests.rs", "use crate::a::A;\nuse crate::b::B;\n"),
        ]);
        let r = check(&t, Path::new("src/lib.rs"));
        assert!(r.cycles.is_empty(), "{r:?}");
        assert_eq!(r.files, 3, "tests.rs is not read");
    }

    #[test]
    fn bare_child_paths_and_inline_modules_count() {
        let t = tree(&[
            ("src/lib.rs", "mod a;\nmod b;\n"),
            (
                "src/a.rs",
                "mod inner {\n    pub fn f() -> super::super::b::B { todo!() }\n}\npub struct A;\n",
            ),
            (
                "src/b.rs",
                "pub struct B;\npub fn g() { let _ = crate::a::A; }\n",
            ),
        ]);
        let r = check(&t, Path::new("src/lib.rs"));
        assert_eq!(r.cycles.len(), 1, "{r:?}");
    }

    #[test]
    fn an_inline_path_through_a_sibling_re_export_imports_the_file_it_names() {
        // `backend.rs` names `crate::launch::strides`; `launch.rs` only re-exports it from
        // the leaf `strides.rs`, but a reader sees `launch`: backend.rs ↔ launch.rs is a cycle.
        let t = |path_in_backend: &str| {
            let backend = format!(
                "pub struct Operand;\npub fn view() -> Vec<usize> {{ {path_in_backend}(&[1]) }}\n"
            );
            let files = [
                ("src/lib.rs", "mod backend;\nmod launch;\nmod strides;\n".to_string()),
                ("src/backend.rs", backend),
                (
                    "src/launch.rs",
                    "pub(crate) use crate::strides::strides;\npub type Arg = crate::backend::Operand;\n"
                        .to_string(),
                ),
                ("src/strides.rs", "pub fn strides(_: &[usize]) -> Vec<usize> { vec![] }\n".to_string()),
            ];
            Mem(files
                .iter()
                .map(|(p, t)| (PathBuf::from(p), t.clone()))
                .collect())
        };
        let r = check(&t("crate::launch::strides"), Path::new("src/lib.rs"));
        assert_eq!(r.cycles.len(), 1, "{r:?}");
        assert_eq!(names(&r.cycles[0].0), ["src/backend.rs", "src/launch.rs"]);
        assert!(
            r.cycles[0]
                .1
                .iter()
                .any(|e| e.text == "crate::launch::strides"),
            "{r:?}"
        );
        // naming the defining file is no cycle
        let r = check(&t("crate::strides::strides"), Path::new("src/lib.rs"));
        assert!(r.cycles.is_empty(), "{r:?}");
    }

    #[test]
    fn a_path_in_an_attribute_is_an_import_unless_the_item_is_test_only() {
        let t = |attrs: &str| {
            let interop = format!("{attrs}\npub struct InteropArgs {{ pub steps: u64 }}\n");
            let files = [
                ("src/main.rs", "mod cli;\nmod interop;\nfn main() {}\n".to_string()),
                (
                    "src/cli.rs",
                    "pub const MAX_STEPS: u64 = 10;\npub struct Cli { pub i: crate::interop::InteropArgs }\n"
                        .to_string(),
                ),
                ("src/interop.rs", interop),
            ];
            Mem(files
                .iter()
                .map(|(p, t)| (PathBuf::from(p), t.clone()))
                .collect())
        };
        let main = Path::new("src/main.rs");
        // in an attribute of an item, of a field, an inner attribute
        for attrs in [
            "#[derive(Debug)]\n#[arg(default_value_t = crate::cli::MAX_STEPS)]",
            "#[cfg_attr(any(test, feature = \"x\"), doc = \"x\")]\n#[arg(value_parser = clap::value_parser!(u64).range(0..=crate::cli::MAX_STEPS))]",
            "#![allow(clippy::x)]\n#![doc = \"crate::cli::MAX_STEPS\"]\n#![cfg_attr(all(), x(y = super::cli::MAX_STEPS))]",
            "#[cfg(any(test, feature = \"x\"))]\nuse crate::cli::MAX_STEPS;",
        ] {
            let r = check(&t(attrs), main);
            assert_eq!(r.cycles.len(), 1, "{attrs}: {r:?}");
            assert_eq!(names(&r.cycles[0].0), ["src/cli.rs", "src/interop.rs"]);
        }
        // a string, a doc comment, or an attribute of a test-only item is not
        for attrs in [
            "#[doc = \"crate::cli::MAX_STEPS\"]\n/// [`crate::cli::MAX_STEPS`]",
            "#[arg(default_value_t = crate::cli::MAX_STEPS)]\n#[cfg(test)]\nfn t() {}",
            "#[cfg(all(test, feature = \"x\"))]\n#[arg(default_value_t = crate::cli::MAX_STEPS)]\nfn t() {}",
        ] {
            let r = check(&t(attrs), main);
            assert!(r.cycles.is_empty(), "{attrs}: {r:?}");
        }
    }
}
