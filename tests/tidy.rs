//! Tidy: the shape every Rust source file of the tree keeps, checked on the
//! files themselves (`src/`, `testkit/`, `tests/`, `bench/`, `examples/`,
//! `fuzz/`).
//!
//! * No file over [`MAX_FILE_LINES`] lines: one concept a file.
//! * No function over [`MAX_FN_LINES`] lines, counted from the line of its
//!   `fn` to the line of its closing brace (closures and nested functions
//!   count as part of the function that holds them).
//! * A function over [`MARKED_FN_LINES`] lines says why in a plain line
//!   comment (or doc comment) containing [`LONG_MARKER`] (`// Long because
//!   the table of every request kind reads best whole`), directly above it,
//!   among its doc comments and attributes.
//! * Every `unsafe { .. }` block has a `// SAFETY:` comment on the line or
//!   lines directly above the line it starts on.
//!
//! The scanner blanks comments, string literals (raw ones included) and
//! character literals before it looks for `fn` and braces, so a brace in a
//! string or a comment never moves a count. [`PENDING`] lists what is still
//! over the limits while it is being split; everything else must pass, and
//! an entry that no longer fails must leave the list.

use std::fs;
use std::path::{Path, PathBuf};

/// The longest a source file may be.
const MAX_FILE_LINES: usize = 1_000;
/// The longest a function may be.
const MAX_FN_LINES: usize = 80;
/// Past this many lines a function carries a [`LONG_MARKER`] comment.
const MARKED_FN_LINES: usize = 70;
/// What the comment above a long function contains, before its reason.
const LONG_MARKER: &str = "Long because";
/// What the comment above an `unsafe` block contains.
const SAFETY_MARKER: &str = "SAFETY:";
/// The directories walked, from the repository's root.
const ROOTS: &[&str] = &["src", "testkit", "tests", "bench", "examples", "fuzz"];

/// Known offenders while they are being split (none today): `path` for a
/// file over the limit, `path:name` for a function of that name in it that
/// is too long or unmarked, `path:unsafe` for unsafe blocks without a
/// SAFETY comment in it. An entry leaves as its split lands; one that no
/// longer offends fails the test.
const PENDING: &[&str] = &[];

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Offence {
    /// Path from the repository's root, `/`-separated.
    path: String,
    /// 1-based line.
    line: usize,
    /// What [`PENDING`] names it by.
    key: String,
    /// What is wrong.
    what: String,
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Bytes of the UTF-8 character that starts with `b`.
fn utf8_len(b: u8) -> usize {
    match b {
        0xf0..=0xff => 4,
        0xe0..=0xef => 3,
        0xc0..=0xdf => 2,
        _ => 1,
    }
}

/// Overwrites `code[from..to]` with spaces, newlines kept.
fn blank_range(code: &mut [u8], from: usize, to: usize) {
    let to = to.min(code.len());
    for b in &mut code[from..to] {
        if *b != b'\n' {
            *b = b' ';
        }
    }
}

/// Where a raw string starting at `i` (`r"`, `r#"`, `br##"`, `cr"`...)
/// ends (one past its last byte), or `None` when none starts there.
fn raw_string_end(src: &[u8], i: usize) -> Option<usize> {
    let mut j = i;
    if matches!(src.get(j), Some(b'b' | b'c')) {
        j += 1;
    }
    if src.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = src[j..].iter().take_while(|&&b| b == b'#').count();
    j += hashes;
    if src.get(j) != Some(&b'"') {
        return None;
    }
    let close: Vec<u8> = std::iter::once(b'"')
        .chain(std::iter::repeat_n(b'#', hashes))
        .collect();
    let rest = &src[j + 1..];
    let at = rest
        .windows(close.len())
        .position(|w| w == close.as_slice())?;
    Some(j + 1 + at + close.len())
}

/// Where the quoted literal (string, or character when `quote` is `'`)
/// whose opening quote is at `i` ends: one past its closing quote.
fn quoted_end(src: &[u8], i: usize, quote: u8) -> usize {
    let mut j = i + 1;
    while j < src.len() && src[j] != quote {
        j += if src[j] == b'\\' { 2 } else { 1 };
    }
    (j + 1).min(src.len())
}

/// Where a character literal starting at `i` ends, or `None` when the
/// quote there starts a lifetime or a label.
fn char_end(src: &[u8], i: usize) -> Option<usize> {
    let next = *src.get(i + 1)?;
    if next == b'\\' {
        return Some(quoted_end(src, i, b'\''));
    }
    let after = i + 1 + utf8_len(next);
    (src.get(after) == Some(&b'\'')).then_some(after + 1)
}

/// `src` with comments, strings and character literals blanked to spaces
/// (newlines kept, so lines and byte offsets stay where they were).
fn code_only(src: &str) -> Vec<u8> {
    let src = src.as_bytes();
    let mut code = src.to_vec();
    let mut i = 0;
    while i < src.len() {
        let after_ident = i > 0 && is_ident(src[i - 1]);
        let end = match (src[i], src.get(i + 1).copied()) {
            (b'/', Some(b'/')) => src[i..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(src.len(), |p| i + p),
            (b'/', Some(b'*')) => block_comment_end(src, i),
            (b'b' | b'c' | b'r', _) if !after_ident => match raw_string_end(src, i) {
                Some(e) => e,
                None => {
                    i += 1;
                    continue;
                }
            },
            (b'"', _) => quoted_end(src, i, b'"'),
            (b'\'', _) => match char_end(src, i) {
                Some(e) => e,
                None => {
                    i += 1;
                    continue;
                }
            },
            _ => {
                i += 1;
                continue;
            }
        };
        blank_range(&mut code, i, end);
        i = end.max(i + 1);
    }
    code
}

/// One past the end of the (possibly nested) block comment at `i`.
fn block_comment_end(src: &[u8], i: usize) -> usize {
    let (mut depth, mut j) = (0usize, i);
    while j + 1 < src.len() {
        match (src[j], src[j + 1]) {
            (b'/', b'*') => {
                depth += 1;
                j += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                j += 2;
                if depth == 0 {
                    return j;
                }
            }
            _ => j += 1,
        }
    }
    src.len()
}

/// The 1-based line of a byte offset in `code`.
fn line_index(code: &[u8]) -> impl Fn(usize) -> usize {
    let starts: Vec<usize> = code
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(k, _)| k + 1)
        .collect();
    move |at| starts.partition_point(|&s| s <= at) + 1
}

/// A function found by [`functions`].
#[derive(Debug, PartialEq, Eq)]
struct Function {
    name: String,
    /// 1-based lines of its `fn` and of its closing brace.
    first: usize,
    last: usize,
}

impl Function {
    fn lines(&self) -> usize {
        self.last - self.first + 1
    }
}

/// Whether the word `word` starts at `at` in `code` (not inside a longer
/// identifier).
fn word_at(code: &[u8], at: usize, word: &str) -> bool {
    code[at..].starts_with(word.as_bytes())
        && (at == 0 || !is_ident(code[at - 1]))
        && code.get(at + word.len()).is_none_or(|&b| !is_ident(b))
}

/// The functions with a body in `code` (from [`code_only`]), outermost
/// only: a function inside another's body is part of it.
fn functions(code: &[u8]) -> Vec<Function> {
    let line_of = line_index(code);
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        if !word_at(code, i, "fn") {
            i += 1;
            continue;
        }
        let name_at = i
            + 2
            + code[i + 2..]
                .iter()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
        let name_len = code[name_at..].iter().take_while(|&&b| is_ident(b)).count();
        let starts_ident = code
            .get(name_at)
            .is_some_and(|b| b.is_ascii_alphabetic() || *b == b'_');
        if !starts_ident {
            i += 2; // a `fn(..)` pointer type, or a macro's `fn $name`
            continue;
        }
        let Some(open) = body_open(code, name_at + name_len) else {
            i = name_at + name_len;
            continue;
        };
        let close = matching_close(code, open);
        out.push(Function {
            name: String::from_utf8_lossy(&code[name_at..name_at + name_len]).into_owned(),
            first: line_of(i),
            last: line_of(close),
        });
        i = close + 1;
    }
    out
}

/// The `{` that opens the body of a function whose signature continues at
/// `from`, or `None` when a `;` ends it first (a declaration).
fn body_open(code: &[u8], from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, &b) in code.iter().enumerate().skip(from) {
        match b {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth -= 1,
            b'{' if depth <= 0 => return Some(k),
            b';' if depth <= 0 => return None,
            _ => {}
        }
    }
    None
}

/// The `}` matching the `{` at `open` (the last byte when unbalanced).
fn matching_close(code: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, &b) in code.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    code.len().saturating_sub(1)
}

/// The lines directly above line `first` (1-based) that are comments or
/// attributes, nearest first.
fn lines_above<'a>(lines: &[&'a str], first: usize, attributes: bool) -> Vec<&'a str> {
    lines[..first - 1]
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|t| {
            t.starts_with("//") || (attributes && (t.starts_with("#[") || t.starts_with(")]")))
        })
        .collect()
}

/// Whether a comment directly above the function (among its doc comments
/// and attributes) carries the [`LONG_MARKER`].
fn marked_long(lines: &[&str], first: usize) -> bool {
    lines_above(lines, first, true)
        .iter()
        .any(|t| t.starts_with("//") && !t.starts_with("//!") && t.contains(LONG_MARKER))
}

/// The lines (1-based) of `unsafe {` blocks in `code` with no
/// [`SAFETY_MARKER`] comment directly above.
fn unsafe_without_safety(code: &[u8], lines: &[&str]) -> Vec<usize> {
    let line_of = line_index(code);
    let mut out = Vec::new();
    for at in 0..code.len() {
        if !word_at(code, at, "unsafe") {
            continue;
        }
        let next = code[at + 6..].iter().find(|b| !b.is_ascii_whitespace());
        if next != Some(&b'{') {
            continue; // `unsafe fn`, `unsafe impl`, `unsafe extern`
        }
        let line = statement_start(lines, line_of(at));
        if !lines_above(lines, line, false)
            .iter()
            .any(|t| t.contains(SAFETY_MARKER))
        {
            out.push(line);
        }
    }
    out
}

/// The first line of the statement that line `line` (1-based) continues:
/// a line continues the one above unless that one ends a statement or opens
/// or closes a block (`;`, `{`, `}`, `,`), or is a comment or empty. Three
/// lines up at most.
fn statement_start(lines: &[&str], line: usize) -> usize {
    let mut l = line;
    while l > 1 && line - l < 3 {
        let above = lines[l - 2].trim();
        let ends =
            above.is_empty() || above.starts_with("//") || above.ends_with([';', '{', '}', ',']);
        if ends {
            break;
        }
        l -= 1;
    }
    l
}

/// Every rule `src` (the text of the file at `path`) breaks.
fn check_source(path: &str, src: &str) -> Vec<Offence> {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = Vec::new();
    let mut offend = |line: usize, key: String, what: String| {
        out.push(Offence {
            path: path.to_string(),
            line,
            key,
            what,
        });
    };
    if lines.len() > MAX_FILE_LINES {
        offend(
            1,
            path.to_string(),
            format!("{} lines (limit {MAX_FILE_LINES})", lines.len()),
        );
    }
    let code = code_only(src);
    for f in functions(&code) {
        let key = format!("{path}:{}", f.name);
        if f.lines() > MAX_FN_LINES {
            let what = format!(
                "fn `{}` is {} lines (limit {MAX_FN_LINES})",
                f.name,
                f.lines()
            );
            offend(f.first, key, what);
        } else if f.lines() > MARKED_FN_LINES && !marked_long(&lines, f.first) {
            let what = format!(
                "fn `{}` is {} lines (over {MARKED_FN_LINES}) with no `// {LONG_MARKER} ...` comment above",
                f.name,
                f.lines()
            );
            offend(f.first, key, what);
        }
    }
    for line in unsafe_without_safety(&code, &lines) {
        let what = format!("`unsafe` block with no `// {SAFETY_MARKER}` comment directly above");
        offend(line, format!("{path}:unsafe"), what);
    }
    out
}

/// The `.rs` files under `dir`, `target/` and hidden directories skipped.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// Every offence in the tree, in path and line order.
fn offences() -> Vec<Offence> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ROOTS {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(
        files.len() > 50,
        "tidy found only {} files under {root:?}",
        files.len()
    );
    let mut out = Vec::new();
    for file in files {
        let rel = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let src = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{rel}: {e}"));
        out.extend(check_source(&rel, &src));
    }
    out.sort_by(|a, b| (&a.path, a.line).cmp(&(&b.path, b.line)));
    out
}

#[test]
fn every_source_file_keeps_the_tidy_rules() {
    let bad: Vec<String> = offences()
        .into_iter()
        .filter(|o| !PENDING.contains(&o.key.as_str()))
        .map(|o| format!("{}:{}: {}", o.path, o.line, o.what))
        .collect();
    assert!(bad.is_empty(), "tidy:\n{}", bad.join("\n"));
}

#[test]
fn every_pending_entry_still_fails() {
    let all = offences();
    let stale: Vec<&str> = PENDING
        .iter()
        .copied()
        .filter(|p| !all.iter().any(|o| o.key == *p))
        .collect();
    assert!(
        stale.is_empty(),
        "tidy: these PENDING entries pass now; remove them: {stale:?}"
    );
}

#[test]
fn the_scanner_skips_strings_chars_and_comments() {
    let src = r####"
fn a() {
    let s = "}}} { fn fake() {";
    let r = r#"a "quoted" } brace"#;
    let rr = br##"}"# still inside"##;
    let c = '}';
    let e = '\'';
    let u = '\u{7d}';
    let l: &'static str = "x";
    // } fn commented() {
    /* } /* nested } */ fn also_commented() { */
    let f: fn(u8) -> u8 = |x| x;
    fn inner() {}
}
trait T {
    fn declared(&self) -> u8;
    fn defaulted(&self) {
        'outer: loop { break 'outer; }
    }
}
"####;
    let code = code_only(src);
    let code_text = String::from_utf8(code.clone()).unwrap();
    assert!(
        !code_text.contains("fake") && !code_text.contains("commented"),
        "{code_text}"
    );
    assert!(
        code_text.contains("'static") && code_text.contains("'outer"),
        "{code_text}"
    );
    assert_eq!(code.len(), src.len());
    assert_eq!(code_text.lines().count(), src.lines().count());
    let fns = functions(&code);
    let found: Vec<(&str, usize, usize)> = fns
        .iter()
        .map(|f| (f.name.as_str(), f.first, f.last))
        .collect();
    assert_eq!(found, [("a", 2, 14), ("defaulted", 17, 19)]);
}

#[test]
fn the_rules_name_file_line_and_what_is_wrong() {
    let body = |n: usize| "    let _ = 1;\n".repeat(n);
    let long = format!("fn long() {{\n{}}}\n", body(85));
    let unmarked = format!("fn unmarked() {{\n{}}}\n", body(75));
    let marked = format!(
        "// Long because it is one table, read whole\n#[test]\nfn marked() {{\n{}}}\n",
        body(75)
    );
    let safe = "fn s() {\n    // SAFETY: nothing to uphold\n    unsafe { f() }\n}\n";
    let continued = "fn c() {\n    // SAFETY: none\n    let x =\n        unsafe { f() };\n}\n";
    let unsafe_bare = "fn u() {\n    let x = 1;\n    unsafe { f() }\n}\n";
    let src = [
        long,
        unmarked,
        marked,
        safe.to_string(),
        continued.to_string(),
        unsafe_bare.to_string(),
    ]
    .concat();
    let got: Vec<(usize, String)> = check_source("x.rs", &src)
        .into_iter()
        .map(|o| (o.line, o.key))
        .collect();
    let unmarked_at = 1 + 87;
    let unsafe_at = src.lines().position(|l| l == "fn u() {").unwrap() + 3;
    assert_eq!(
        got,
        [
            (1, "x.rs:long".to_string()),
            (unmarked_at, "x.rs:unmarked".to_string()),
            (unsafe_at, "x.rs:unsafe".to_string()),
        ]
    );
    let big = "\n".repeat(MAX_FILE_LINES + 1);
    assert_eq!(check_source("big.rs", &big)[0].key, "big.rs");
    assert!(check_source("ok.rs", &"\n".repeat(MAX_FILE_LINES)).is_empty());
}
