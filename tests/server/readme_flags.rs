//! The flags the documentation names are the flags the binaries take: every
//! `--flag` in README.md and in docs/OPERATIONS.md's flag tables appears in
//! the `--help` of the built `ticketd` or `ticket` it belongs to, and the
//! server flag table of docs/OPERATIONS.md lists every flag of
//! `ticketd --help`.

use std::collections::BTreeSet;

use ticketd_testkit::process as common;

/// Which program a flag in the docs is given to.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Owner {
    /// `ticketd`.
    Server,
    /// `ticket`.
    Client,
    /// Named in prose, or on its own: either of the two.
    Either,
    /// Another program (`cargo`, `openssl`, ...): not checked.
    Other,
}

/// A flag as the docs write it, and where.
#[derive(Debug)]
struct Mention {
    flag: String,
    owner: Owner,
    line: usize,
}

fn help(bin: &str, args: &[&str]) -> String {
    let out = common::bin_command(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {bin} {args:?}: {e}"));
    assert!(out.status.success(), "{bin} {args:?}: {:?}", out.status);
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// Every `--flag` in `text`: `--` and a lowercase letter, not inside a word.
fn flags_in(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 2 < b.len() {
        let starts = b[i] == b'-'
            && b[i + 1] == b'-'
            && b[i + 2].is_ascii_lowercase()
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'-'));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i + 2;
        while j < b.len() && (b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'-') {
            j += 1;
        }
        out.push(text[i..j].trim_end_matches('-').to_string());
        i = j;
    }
    out
}

/// The program a command word runs: `ticketd`, `ticket`, or another.
fn program(word: &str) -> Owner {
    let word = word.rsplit("$(").next().unwrap_or(word).trim_matches('"');
    match word.rsplit('/').next().unwrap_or(word) {
        "ticketd" => Owner::Server,
        "ticket" => Owner::Client,
        _ => Owner::Other,
    }
}

/// The flags of one line of shell, each with the program it is given to.
/// `owner` is the program of a continued line (or `Either` for a fragment
/// that starts with a flag); commands start the line, follow `&&`, `|`,
/// `;`, `do`, `then` or an assignment, or open a `$(`.
fn shell_flags(code: &str, mut owner: Owner, out: &mut Vec<(String, Owner)>) -> Owner {
    let mut command_next = true;
    for word in code.split_whitespace() {
        if word.starts_with('#') {
            break;
        }
        if word.starts_with("--") {
            out.extend(flags_in(word).into_iter().map(|f| (f, owner)));
        } else if command_next || word.contains("$(") {
            if word.contains('=') && !word.contains("$(") {
                continue; // an assignment before the command
            }
            owner = program(word);
        }
        command_next =
            matches!(word, "&&" | "||" | "|" | ";" | "do" | "then") || word.ends_with(';');
    }
    owner
}

/// Every flag `markdown` mentions: in code blocks and code spans by the
/// program the shell line gives it to, in prose as `Either`.
fn mentions(markdown: &str) -> Vec<Mention> {
    let mut out = Vec::new();
    let mut fenced = false;
    let mut continued: Option<Owner> = None;
    for (n, line) in markdown.lines().enumerate() {
        let mut found = Vec::new();
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || line.starts_with("    ") {
            let owner = shell_flags(line, continued.unwrap_or(Owner::Either), &mut found);
            continued = line.trim_end().ends_with('\\').then_some(owner);
        } else {
            continued = None;
            prose_flags(line, &mut found);
        }
        out.extend(found.into_iter().map(|(flag, owner)| Mention {
            flag,
            owner,
            line: n + 1,
        }));
    }
    out
}

/// The flags of a line of prose: each code span read as shell, the text
/// around them as `Either`.
fn prose_flags(line: &str, out: &mut Vec<(String, Owner)>) {
    for (i, part) in line.split('`').enumerate() {
        if i % 2 == 1 {
            shell_flags(part, Owner::Either, out);
        } else {
            out.extend(flags_in(part).into_iter().map(|f| (f, Owner::Either)));
        }
    }
}

/// The flags of `help` that a line of their own defines (`    --flag ...`,
/// `    -h, --help ...`: the text before the description), not those the
/// descriptions name.
fn defined_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter_map(|l| l.strip_prefix("    "))
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| flags_in(l.split("  ").next().unwrap_or(l)))
        .collect()
}

/// Every flag named anywhere in the help texts of both binaries: the
/// server's (with its cluster flags) and the client's (every subcommand).
fn known_flags() -> (BTreeSet<String>, BTreeSet<String>, String) {
    let server_bin = env!("CARGO_BIN_EXE_ticketd");
    let server_help = help(server_bin, &["--help"]);
    let mut server: BTreeSet<String> = flags_in(&server_help).into_iter().collect();
    server.extend(flags_in(&help(server_bin, &["--cluster", "--help"])));
    let client_bin = env!("CARGO_BIN_EXE_ticket");
    let client_help = help(client_bin, &["--help"]);
    let mut client: BTreeSet<String> = flags_in(&client_help).into_iter().collect();
    let subcommands: BTreeSet<&str> = client_help
        .lines()
        .filter_map(|l| l.strip_prefix("    ticket "))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|w| w.chars().all(|c| c.is_ascii_lowercase()) && *w != "help")
        .collect();
    assert!(
        subcommands.len() >= 5,
        "ticket --help lists subcommands: {subcommands:?}"
    );
    for sub in subcommands {
        client.extend(flags_in(&help(client_bin, &[sub, "--help"])));
    }
    (server, client, server_help)
}

/// The mentions `known` does not account for, one line each.
fn unknown(
    doc: &str,
    found: &[Mention],
    server: &BTreeSet<String>,
    client: &BTreeSet<String>,
) -> Vec<String> {
    found
        .iter()
        .filter(|m| match m.owner {
            Owner::Server => !server.contains(&m.flag),
            Owner::Client => !client.contains(&m.flag),
            Owner::Either => !server.contains(&m.flag) && !client.contains(&m.flag),
            Owner::Other => false,
        })
        .map(|m| format!("{doc}:{}: {} ({:?})", m.line, m.flag, m.owner))
        .collect()
}

#[test]
fn every_flag_the_readme_names_is_in_the_help_of_its_binary() {
    let (server, client, _) = known_flags();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let found = mentions(&readme);
    let checked = found.iter().filter(|m| m.owner != Owner::Other).count();
    assert!(
        checked >= 10,
        "README.md names only {checked} flags: {found:?}"
    );
    let missing = unknown("README.md", &found, &server, &client);
    assert!(
        missing.is_empty(),
        "flags README.md names that no --help of ticketd or ticket has:\n{}",
        missing.join("\n")
    );
}

/// The rows of every table in `markdown` whose first header cell is
/// `flag`, with their line numbers, and whether the table follows a
/// heading containing `server_heading`.
fn flag_table_rows<'a>(markdown: &'a str, server_heading: &str) -> Vec<(usize, &'a str, bool)> {
    let mut rows = Vec::new();
    let (mut in_table, mut under_server) = (false, false);
    for (n, line) in markdown.lines().enumerate() {
        if line.starts_with('#') {
            under_server = line.contains(server_heading);
        }
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        if line.starts_with("| flag |") {
            in_table = true;
        } else if in_table && !line.starts_with("|---") {
            rows.push((n + 1, line, under_server));
        }
    }
    rows
}

#[test]
fn the_operations_flag_tables_match_ticketd_help() {
    let (server, client, server_help) = known_flags();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/OPERATIONS.md"))
        .unwrap();
    let rows = flag_table_rows(&doc, "Server flags");
    assert!(
        rows.iter().filter(|r| r.2).count() >= 20,
        "the server flag table: {rows:?}"
    );
    let mut found = Vec::new();
    let mut in_server_table = BTreeSet::new();
    for &(line, row, under_server) in &rows {
        let first = row.split('|').nth(1).unwrap_or("");
        for flag in flags_in(first) {
            if under_server {
                in_server_table.insert(flag.clone());
            }
            found.push(Mention {
                flag,
                owner: Owner::Server,
                line,
            });
        }
        let rest = row.splitn(3, '|').nth(2).unwrap_or("");
        let mut others = Vec::new();
        prose_flags(rest, &mut others);
        found.extend(
            others
                .into_iter()
                .map(|(flag, owner)| Mention { flag, owner, line }),
        );
    }
    let unknown_flags = unknown("docs/OPERATIONS.md", &found, &server, &client);
    let defined = defined_flags(&server_help);
    assert!(defined.len() >= 20, "ticketd --help defines: {defined:?}");
    let absent: Vec<&String> = defined.difference(&in_server_table).collect();
    assert!(
        unknown_flags.is_empty() && absent.is_empty(),
        "flags docs/OPERATIONS.md's flag tables name that ticketd --help (or ticket --help) \
         lacks:\n{}\nticketd --help flags missing from the \"Server flags\" table of \
         docs/OPERATIONS.md: {absent:?}",
        unknown_flags.join("\n")
    );
}

#[test]
fn the_doc_parser_attributes_flags_to_their_program() {
    let md = "Run `ticketd --listen X` or `--max-keys`, then --admin.\n\n    \
              token=$(ticket acquire k --wait 1) || exit\n    \
              cargo build --release --features x\n    \
              for n in 1 2; do ticketd --cluster \\\n        --peers p &\n";
    let got: Vec<(String, Owner)> = mentions(md)
        .into_iter()
        .map(|m| (m.flag, m.owner))
        .collect();
    let want = [
        ("--listen", Owner::Server),
        ("--max-keys", Owner::Either),
        ("--admin", Owner::Either),
        ("--wait", Owner::Client),
        ("--release", Owner::Other),
        ("--features", Owner::Other),
        ("--cluster", Owner::Server),
        ("--peers", Owner::Server),
    ];
    let want: Vec<(String, Owner)> = want.iter().map(|(f, o)| ((*f).to_string(), *o)).collect();
    assert_eq!(got, want);
    let help = "FLAGS:\n    --listen ADDR   x [127.0.0.1]\n                    --allow-uid too\n    -h, --help      print\n";
    let defined: Vec<String> = defined_flags(help).into_iter().collect();
    assert_eq!(defined, ["--help", "--listen"]);
    assert_eq!(flags_in("|---|---| a-- --x-y, `--z`"), ["--x-y", "--z"]);
}
