//! The crate's layers, checked on its source (`src/**/*.rs`; DESIGN.md, "Layers of the code").
//!
//! Every top-level module has a place in `LAYERS`, and may use only modules of its own layer
//! and lower ones. A module missing from the table (or a table entry with no module) fails
//! the test. On top of that, no two files may depend on each other, directly or through
//! others: the file graph has no cycle.
//!
//! How the source is read (a small lexer, no compiler): comments, string and character
//! literals are dropped; then every `use` tree (`use crate::a::{b, c::{self, d}}`, `pub use`,
//! `use super::*`, inside functions too) and every path in code that starts with `crate::`,
//! `super::`, `self::` or the name of a child module (`llama::Llama::load`, a macro as
//! `crate::switches::tuned!`) is resolved to an absolute module path. `super` climbs from the
//! module the path is written in, inline modules (`mod tests { .. }`) included, so a chain of
//! `super::` that leaves the top-level module is caught like a `crate::` path. A path refers to
//! the file of the longest module it names: `crate::kv::FloatWindow` is `src/kv/mod.rs`, even
//! where that file re-exports the item from another one, and `crate::kv::cache::X` is
//! `src/kv/cache.rs`; a directory's module is its `mod.rs`. `mod x;` declarations are not
//! uses. Test code is checked like the rest: no `#[cfg(test)]` module is skipped.
//! `src/main.rs` is the binary, a crate of its own (it uses `iris::`), and `src/lib.rs` only
//! declares the modules.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

/// The layers, lowest first, numbered as in DESIGN.md; a module may use its own layer and
/// the ones before it.
const LAYERS: &[(&str, &[&str])] = &[
    // Parsed configs, SIMD helpers, environment switches, the device: they use nothing above.
    ("0", &["config", "simd", "switches", "device"]),
    // Tensor ops, and the flat batch (with its attention metadata) they read.
    ("1", &["ops", "batch", "parallel"]),
    // A model's files and inputs: tensors, vocabulary, images.
    ("2", &["weights", "tokenizer", "media"]),
    ("3", &["kv"]),
    ("4", &["layers"]),
    ("5", &["models"]),
    // A model location -> model + tokenizer, for the engine and the CLI.
    ("5.5", &["loader"]),
    ("6", &["engine"]),
    // The entry points, and fetching models for the CLI (the default one; Hugging Face ids).
    ("7", &["server", "cli", "fetch", "hub"]),
];

#[test]
fn modules_only_use_lower_layers() {
    let problems = check(&source(), LAYERS).layers;
    assert!(problems.is_empty(), "{problems}");
}

#[test]
fn files_have_no_cycles() {
    let problems = check(&source(), LAYERS).cycles;
    assert!(
        problems.is_empty(),
        "{problems}break each cycle: what both sides need goes into a file of its own that both use"
    );
}

/// `src/`, as relative path -> source.
fn source() -> BTreeMap<String, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    read_tree(&root, &root, &mut files);
    assert!(files.len() > 50 && files.contains_key("lib.rs"), "src/ not found at {}", root.display());
    files
}

/// The checker on a made-up crate: it must see each kind of violation.
#[test]
fn the_checker_catches_what_it_should() {
    let layers: &[(&str, &[&str])] = &[("0", &["low"]), ("1", &["mid"]), ("2", &["high"])];
    let tree = |extra: &[(&str, &str)]| -> BTreeMap<String, String> {
        let mut t: BTreeMap<String, String> = [
            ("lib.rs", "pub mod low; pub mod mid; pub mod high;"),
            (
                "low.rs",
                "//! crate::high::X in a comment\nconst S: &str = \"crate::high::X\"; const R: &str = r#\"crate::high::X\"#;\n\
                 const C: char = '\"'; fn f<'a>(x: &'a str) -> &'a str { /* crate::high::X */ x }",
            ),
            ("mid/mod.rs", "mod a; mod b; pub use a::A; use crate::low::{self, L as _};"),
            ("mid/a.rs", "pub struct A;"),
            ("mid/b.rs", "use super::A; fn f() { super::super::low::g(); }"),
            ("high.rs", "use crate::mid::{A, b::*}; mod tests { use super::*; }"),
        ]
        .into_iter()
        .map(|(p, s)| (p.to_string(), s.to_string()))
        .collect();
        for (p, s) in extra {
            t.insert(p.to_string(), s.to_string());
        }
        t
    };
    assert_eq!(check(&tree(&[]), layers).all(), "");
    for (file, src, needle) in [
        ("low.rs", "use crate::mid::A;", "low.rs:1: low (layer 0) uses crate::mid::A"),
        ("low.rs", "fn f() { crate::high::g() }", "uses crate::high::g"),
        ("low.rs", "use crate::{mid::{a::{self}}};", "uses crate::mid::a"),
        ("mid/a.rs", "fn f() { super::super::high::g(); }", "mid (layer 1) uses crate::high::g"),
        ("mid/a.rs", "mod t { fn f() { super::super::super::high::h!(); } }", "uses crate::high::h"),
        ("mid/a.rs", "use super::b::f;", "cycle: mid/a.rs, mid/b.rs, mid/mod.rs"),
        // `b` here is the child module mid::a::b, not mid::b
        ("mid/a.rs", "fn f() { b::g() } mod b;", "cycle: mid/a.rs, mid/a/b.rs"),
        // a test module's bare path: a child of the file's module (through `use super::*`)
        ("mid/mod.rs", "mod a; mod b; mod tests { use super::*; fn t() { b::g() } }", "cycle: mid/b.rs, mid/mod.rs"),
        ("extra.rs", "", "top-level module `extra` has no layer"),
    ] {
        let problems = check(&tree(&[(file, src), ("mid/a/b.rs", "use super::X;")]), layers).all();
        assert!(problems.contains(needle), "{file}: `{src}` should give `{needle}`, got:\n{problems}");
    }
    let stale: &[(&str, &[&str])] = &[("0", &["low", "gone"]), ("1", &["mid"]), ("2", &["high"])];
    assert!(check(&tree(&[]), stale).layers.contains("LAYERS lists `gone`"));
}

/// Reads every `.rs` file under `dir`, keyed by its path relative to `root` (`/`-separated).
fn read_tree(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_tree(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).unwrap().components();
            let rel: Vec<String> = rel.map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            out.insert(rel.join("/"), std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// What is wrong, one line each (empty when all is well).
struct Problems {
    /// Modules missing from the table (or listed without a module), and uses of higher layers.
    layers: String,
    /// Cycles of files, each with the uses that make it.
    cycles: String,
}

impl Problems {
    fn all(&self) -> String {
        format!("{}{}", self.layers, self.cycles)
    }
}

/// Checks `files` (relative path -> source) against `layers`.
fn check(files: &BTreeMap<String, String>, layers: &[(&str, &[&str])]) -> Problems {
    let mut out = String::new();
    let layer_of = |m: &str| layers.iter().position(|(_, ms)| ms.contains(&m));
    let name = |l: usize| layers[l].0;

    // Modules: one per file (a directory's is its mod.rs), plus the inline ones, which belong
    // to the file they are written in.
    let mut modules: BTreeMap<Vec<String>, String> = BTreeMap::new();
    let mut lexed = Vec::new();
    for (file, src) in files {
        let Some(module) = module_of(file) else { continue };
        let toks = lex(src);
        for inline in inline_modules(&toks) {
            modules.insert(module.iter().chain(&inline).cloned().collect(), file.clone());
        }
        modules.insert(module.clone(), file.clone());
        lexed.push((file, module, toks));
    }

    let tops: BTreeSet<&str> = modules.keys().filter(|m| m.len() == 1).map(|m| m[0].as_str()).collect();
    for top in &tops {
        if layer_of(top).is_none() {
            let _ = writeln!(out, "top-level module `{top}` has no layer: add it to LAYERS in tests/layering.rs");
        }
    }
    for (_, ms) in layers {
        for m in ms.iter().filter(|m| !tops.contains(*m)) {
            let _ = writeln!(out, "LAYERS lists `{m}`, which has no module in src/: remove it");
        }
    }

    // file -> file it uses -> (line, path) of the first such use
    let mut edges: BTreeMap<&str, BTreeMap<&str, (usize, String)>> = BTreeMap::new();
    for (file, module, toks) in &lexed {
        for r in references(toks, module, &modules) {
            let shown = format!("crate::{}", r.path.join("::"));
            if let (Some(from), Some(to)) = (module.first(), r.path.first()) {
                if let (Some(lf), Some(lt)) = (layer_of(from), layer_of(to)) {
                    if lt > lf {
                        let (nf, nt) = (name(lf), name(lt));
                        let _ = writeln!(out, "{file}:{}: {from} (layer {nf}) uses {shown} ({to}, layer {nt})", r.line);
                    }
                }
            }
            let target = (0..=r.path.len()).rev().find_map(|n| modules.get(&r.path[..n])).unwrap();
            if target != *file {
                edges.entry(file.as_str()).or_default().entry(target.as_str()).or_insert((r.line, shown));
            }
        }
    }

    let mut cycle_lines = String::new();
    for scc in cycles(&edges) {
        let out = &mut cycle_lines;
        let _ = writeln!(out, "cycle: {}", scc.join(", "));
        for a in &scc {
            for (b, (line, path)) in &edges[a] {
                if scc.contains(b) {
                    let _ = writeln!(out, "    {a}:{line} uses {path} ({b})");
                }
            }
        }
    }
    Problems { layers: out, cycles: cycle_lines }
}

/// The module a file defines: `ops/mod.rs` and `ops.rs` are `ops`, `lib.rs` the crate root;
/// None for the binary's `main.rs`.
fn module_of(file: &str) -> Option<Vec<String>> {
    if file == "main.rs" {
        return None;
    }
    let mut parts: Vec<String> = file.trim_end_matches(".rs").split('/').map(String::from).collect();
    if parts == ["lib"] || parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    Some(parts)
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

/// Identifiers, `::` and punctuation with their lines; comments, literals, lifetimes dropped.
fn lex(src: &str) -> Vec<(usize, Tok)> {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    // Skips a quoted literal whose opening quote is at `i`; returns the index after it.
    let skip_quoted = |mut i: usize, quote: char, line: &mut usize| {
        i += 1;
        while i < c.len() && c[i] != quote {
            if c[i] == '\\' {
                i += 1;
            }
            if at(i) == '\n' {
                *line += 1;
            }
            i += 1;
        }
        i + 1
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_quoted(i, '"', &mut line);
        } else if ch == '\'' {
            if at(i + 1) == '\\' || at(i + 2) == '\'' {
                i = skip_quoted(i, '\'', &mut line); // a character literal
            } else {
                i += 1; // a lifetime or label: its name is dropped below
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            match (word.as_str(), at(i)) {
                ("r" | "br" | "cr", '"' | '#') => {
                    // a raw string r#"..."#, or a raw identifier r#name
                    let hashes = (i..).take_while(|&j| at(j) == '#').count();
                    if at(i + hashes) != '"' {
                        i += hashes;
                        continue;
                    }
                    i += hashes + 1;
                    let close: String = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
                    while i < c.len() && !c[i..].starts_with(&close.chars().collect::<Vec<_>>()) {
                        line += usize::from(c[i] == '\n');
                        i += 1;
                    }
                    i += close.len();
                }
                ("b" | "c", '"') => i = skip_quoted(i, '"', &mut line),
                ("b", '\'') => i = skip_quoted(i, '\'', &mut line),
                _ if ch.is_ascii_digit() => {} // a number
                _ => out.push((line, Tok::Ident(word))),
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((line, Tok::Sep));
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push((line, Tok::Punct(ch)));
            }
            i += 1;
        }
    }
    out
}

fn ident(t: Option<&(usize, Tok)>) -> Option<&str> {
    match t {
        Some((_, Tok::Ident(s))) => Some(s),
        _ => None,
    }
}

fn is(t: Option<&(usize, Tok)>, tok: &Tok) -> bool {
    t.is_some_and(|(_, t)| t == tok)
}

/// Inline modules (`mod name { .. }`), as paths relative to the file's module.
fn inline_modules(toks: &[(usize, Tok)]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    walk_modules(toks, |i, stack| {
        if i == 0 || ident(toks.get(i - 1)) != Some("mod") || !is(toks.get(i + 1), &Tok::Punct('{')) {
            return;
        }
        if let Some(name) = ident(toks.get(i)) {
            out.push(stack.iter().cloned().chain([name.to_string()]).collect());
        }
    });
    out
}

/// Calls `f(i, inline module stack at token i)` for every token.
fn walk_modules(toks: &[(usize, Tok)], mut f: impl FnMut(usize, &[String])) {
    // (module name, brace depth just outside its body)
    let mut stack: Vec<(String, usize)> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut depth = 0;
    for i in 0..toks.len() {
        f(i, &names);
        match &toks[i].1 {
            Tok::Punct('{') => {
                if i >= 2 && ident(toks.get(i - 2)) == Some("mod") {
                    if let Some(name) = ident(toks.get(i - 1)) {
                        stack.push((name.to_string(), depth));
                        names.push(name.to_string());
                    }
                }
                depth += 1;
            }
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if stack.last().is_some_and(|(_, d)| *d == depth) {
                    stack.pop();
                    names.pop();
                }
            }
            _ => {}
        }
    }
}

/// A use of something in the crate: its absolute path (without `crate`) and line.
struct Reference {
    line: usize,
    path: Vec<String>,
}

/// Every `use` tree and every path in code that names something of this crate.
fn references(
    toks: &[(usize, Tok)],
    file_module: &[String],
    modules: &BTreeMap<Vec<String>, String>,
) -> Vec<Reference> {
    let mut out = Vec::new();
    let mut skip_to = 0;
    walk_modules(toks, |i, inline| {
        if i < skip_to {
            return;
        }
        let here: Vec<String> = file_module.iter().chain(inline).cloned().collect();
        let line = toks[i].0;
        let mut resolved = |path: Vec<String>| {
            if let Some(path) = resolve(&here, file_module.len(), &path, modules) {
                out.push(Reference { line, path });
            }
        };
        if ident(toks.get(i)) == Some("use") {
            let mut j = i + 1;
            let mut paths = Vec::new();
            use_tree(toks, &mut j, Vec::new(), &mut paths);
            paths.into_iter().for_each(&mut resolved);
            skip_to = j;
            return;
        }
        let starts_path = is(toks.get(i + 1), &Tok::Sep) && (i == 0 || !is(toks.get(i - 1), &Tok::Sep));
        if let (true, Some(first)) = (starts_path, ident(toks.get(i))) {
            let mut path = vec![first.to_string()];
            let mut j = i + 1;
            while is(toks.get(j), &Tok::Sep) {
                match ident(toks.get(j + 1)) {
                    Some(s) => path.push(s.to_string()),
                    None => break, // `::<` or `::{`
                }
                j += 2;
            }
            resolved(path);
            skip_to = j;
        }
    });
    out
}

/// The paths of one use tree starting at `*i` (after `use`), each prefixed with `prefix`;
/// leaves `*i` after the tree.
fn use_tree(toks: &[(usize, Tok)], i: &mut usize, mut prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    if is(toks.get(*i), &Tok::Sep) {
        *i += 1;
        prefix.push("::".into()); // `use ::name`: another crate
    }
    loop {
        match toks.get(*i).map(|t| &t.1) {
            Some(Tok::Ident(s)) => {
                prefix.push(s.clone());
                *i += 1;
                if is(toks.get(*i), &Tok::Sep) {
                    *i += 1;
                    continue;
                }
                if ident(toks.get(*i)) == Some("as") {
                    *i += 2;
                }
                out.push(prefix);
                return;
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push(prefix);
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                while toks.get(*i).is_some() && !is(toks.get(*i), &Tok::Punct('}')) {
                    let before = *i;
                    use_tree(toks, i, prefix.clone(), out);
                    if is(toks.get(*i), &Tok::Punct(',')) {
                        *i += 1;
                    }
                    if *i == before {
                        *i += 1; // not a use tree: step over it
                    }
                }
                *i += 1;
                return;
            }
            _ => return,
        }
    }
}

/// `path`, written in module `here` (of which the first `file_depth` names are the file's
/// module, the rest inline modules), as an absolute module path; None for other crates' paths
/// and for local names. A bare first name is a child module of `here`, or of an enclosing
/// inline module's parent in the same file (`mod tests { use super::*; .. }` sees those).
fn resolve(
    here: &[String],
    file_depth: usize,
    path: &[String],
    modules: &BTreeMap<Vec<String>, String>,
) -> Option<Vec<String>> {
    let mut base: Vec<String> = match path.first()?.as_str() {
        "crate" => vec![],
        "self" | "super" => here.to_vec(),
        "::" => return None,
        child => {
            let scope = (file_depth..=here.len())
                .rev()
                .find(|&n| modules.contains_key(&[&here[..n], &[child.to_string()]].concat()))?;
            here[..scope].to_vec()
        }
    };
    let mut rest = path.iter().skip(usize::from(path[0] == "crate" || path[0] == "self")).peekable();
    while rest.peek().is_some_and(|s| *s == "super") {
        rest.next();
        base.pop()?;
    }
    base.extend(rest.filter(|s| *s != "self").cloned());
    Some(base)
}

/// The strongly connected components of more than one file (Tarjan), each sorted.
fn cycles<'a>(edges: &BTreeMap<&'a str, BTreeMap<&'a str, (usize, String)>>) -> Vec<Vec<&'a str>> {
    struct State<'a, 'e> {
        edges: &'e BTreeMap<&'a str, BTreeMap<&'a str, (usize, String)>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(s: &mut State<'a, '_>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let next: Vec<&'a str> = s.edges.get(v).map(|e| e.keys().copied().collect()).unwrap_or_default();
        for w in next {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                scc.push(w);
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                s.out.push(scc);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out.sort();
    s.out
}
