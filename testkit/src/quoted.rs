//! The constants the docs quote, read from the docs so that each crate's `docs_constants`
//! test can hold them to the code: the rules of what counts as a quote live here, once.
//!
//! A constant is quoted checkably in one of two ways:
//!
//! - **In the limits table** of `docs/architecture.md` ("Limits, timeouts, batching"): its
//!   `constant` column names, in backticks, the constants behind the quantities of its
//!   `default` column, in the same order, separated by commas (names joined by "and" stand
//!   for one quantity together); `–` for a row without a number.
//! - **In prose**, anywhere in `docs/`: a quantity followed, within the same clause, by the
//!   constant's name in backticks opening a parenthesis: "looked at every 1 s
//!   (`broker::FILE_POLL`)".
//!
//! A name is `CRATE::NAME` (`wire`, `common`, `broker`, `provider`, `driver`), or a sum of
//! such names (`broker::A + broker::B`). A quantity is a number (thousands separated by
//! commas) with an optional unit: `ns`, `µs`, `us`, `ms`, `s`, `min`, `h` (a duration),
//! `B`, `bytes`, `KiB`, `MiB`, `GiB` (a size), or none (a count).
//!
//! [`check`] fails once, listing every quote that differs from the code (naming the file,
//! and the table row or the line), every quote of the crate that its test does not know,
//! and every constant the test knows that no doc quotes.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The crates whose constants the docs may name, as the names' prefixes.
pub const CRATES: [&str; 5] = ["wire", "common", "broker", "provider", "driver"];

/// The heading of the limits table's section in `docs/architecture.md`.
const LIMITS_HEADING: &str = "## Limits, timeouts, batching";

/// A quoted or known value, with its kind of unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// A number without a unit.
    Count(u64),
    /// A size in bytes.
    Bytes(u64),
    /// A duration.
    Time(Duration),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Value::Count(n) => write!(f, "{n}"),
            Value::Bytes(n) => {
                for (unit, size) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
                    if n >= size && n % size == 0 {
                        return write!(f, "{} {unit}", n / size);
                    }
                }
                write!(f, "{n} B")
            }
            Value::Time(d) => write!(f, "{d:?}"),
        }
    }
}

/// A count, from any unsigned integer constant.
pub fn count(n: impl TryInto<u64>) -> Value {
    Value::Count(n.try_into().unwrap_or(u64::MAX))
}

/// A size in bytes, from any unsigned integer constant.
pub fn bytes(n: impl TryInto<u64>) -> Value {
    Value::Bytes(n.try_into().unwrap_or(u64::MAX))
}

/// A duration.
pub fn time(d: Duration) -> Value {
    Value::Time(d)
}

/// One constant quoted in a doc.
#[derive(Debug, Clone)]
pub struct Quote {
    /// The doc, relative to the workspace root.
    pub file: String,
    /// Where in it: the table row or the line.
    pub place: String,
    /// The constant's name as written (`broker::MAX_RETRIES`).
    pub name: String,
    /// The value the doc gives it.
    pub value: Value,
}

/// Checks every quote of `krate`'s constants against `known` (name → the code's value),
/// and the shape of the limits table; panics with every problem found.
pub fn check(krate: &str, known: &[(&str, Value)]) {
    assert!(CRATES.contains(&krate), "{krate} is not one of {CRATES:?}");
    let (quotes, mut problems) = read_quotes(&crate::paths::workspace_root());
    for q in quotes.iter().filter(|q| crate_of(&q.name) == krate) {
        match known.iter().find(|(name, _)| *name == q.name) {
            None => problems.push(format!(
                "{} ({}) quotes {}, which the test of {krate} does not know: add it to its \
                 list, or fix the name",
                q.file, q.place, q.name
            )),
            Some((_, v)) if *v != q.value => problems.push(format!(
                "{} ({}) quotes {} = {}, but the code says {v}",
                q.file, q.place, q.name, q.value
            )),
            Some(_) => {}
        }
    }
    for (name, _) in known {
        assert_eq!(crate_of(name), krate, "{name} is not a constant of {krate}");
        if !quotes.iter().any(|q| q.name == *name) {
            problems.push(format!(
                "no doc quotes {name} any more: drop it from the list"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "the docs and the code disagree:\n  {}",
        problems.join("\n  ")
    );
}

/// The crate a name belongs to (the prefix of its first part).
fn crate_of(name: &str) -> &str {
    name.split("::").next().unwrap_or("")
}

/// Whether a code span's text is a constant's name (or a sum of names) this module reads.
fn is_name(span: &str) -> bool {
    span.split(" + ").all(|part| {
        part.split_once("::").is_some_and(|(krate, rest)| {
            CRATES.contains(&krate)
                && !rest.is_empty()
                && rest
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
    })
}

/// Every quote in the docs, and the problems of their form (a limits row whose names do not
/// match its quantities, a prose name with no quantity before it).
pub fn read_quotes(root: &Path) -> (Vec<Quote>, Vec<String>) {
    let mut quotes = Vec::new();
    let mut problems = Vec::new();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    for path in docs {
        let file = format!(
            "docs/{}",
            path.file_name().expect("a file name").to_string_lossy()
        );
        let text = std::fs::read_to_string(&path).expect("a readable doc");
        if file == "docs/architecture.md" {
            limits_table(&file, &text, &mut quotes, &mut problems);
        }
        prose(&file, &text, &mut quotes, &mut problems);
    }
    (quotes, problems)
}

/// The quotes of the limits table.
fn limits_table(file: &str, text: &str, quotes: &mut Vec<Quote>, problems: &mut Vec<String>) {
    let Some(start) = text.find(LIMITS_HEADING) else {
        problems.push(format!("{file} has no section \"{LIMITS_HEADING}\""));
        return;
    };
    let rows: Vec<Vec<String>> = text[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(cells)
        .collect();
    let Some(header) = rows.first() else {
        problems.push(format!("{file}: the limits section has no table"));
        return;
    };
    let column = |name: &str| header.iter().position(|c| c == name);
    let (Some(what), Some(default), Some(constant)) =
        (column("what"), column("default"), column("constant"))
    else {
        problems.push(format!(
            "{file}: the limits table needs the columns what, default and constant; it has {header:?}"
        ));
        return;
    };
    for row in rows.iter().skip(2) {
        let cell = |i: usize| row.get(i).map_or("", String::as_str);
        let place = format!("limits table, row \"{}\"", cell(what));
        let values = quantities(&without_code(cell(default)));
        let groups: Vec<Vec<String>> = if cell(constant) == "–" {
            Vec::new()
        } else {
            cell(constant)
                .split(", ")
                .map(|group| code_spans(group).into_iter().map(|(_, s)| s).collect())
                .collect()
        };
        if groups.len() != values.len() || groups.iter().any(Vec::is_empty) {
            problems.push(format!(
                "{file} ({place}): the default column has {} quantities ({}), the constant \
                 column {} names (\"{}\"): give one name per quantity, or – for none",
                values.len(),
                values
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                groups.len(),
                cell(constant)
            ));
            continue;
        }
        for (names, value) in groups.into_iter().zip(values) {
            for name in names {
                if !is_name(&name) {
                    problems.push(format!(
                        "{file} ({place}): `{name}` is not CRATE::NAME with CRATE one of {CRATES:?}"
                    ));
                    continue;
                }
                quotes.push(Quote {
                    file: file.to_string(),
                    place: place.clone(),
                    name,
                    value,
                });
            }
        }
    }
}

/// The quotes in running text: a name in backticks right after a "(", with a quantity
/// before it in the same clause.
fn prose(file: &str, text: &str, quotes: &mut Vec<Quote>, problems: &mut Vec<String>) {
    let text = without_fences(text);
    for (at, span) in code_spans(&text) {
        if !is_name(&span) || !text[..at].ends_with("(`") {
            continue;
        }
        let line = text[..at].matches('\n').count() + 1;
        let place = format!("line {line}");
        let before = &text[..at - 2];
        let clause_start = [", ", "; ", ": ", ". ", "(", "|", "\n\n"]
            .iter()
            .filter_map(|b| before.rfind(b).map(|i| i + b.len()))
            .max()
            .unwrap_or(0);
        match quantities(&without_code(&before[clause_start..])).last() {
            Some(&value) => quotes.push(Quote {
                file: file.to_string(),
                place,
                name: span,
                value,
            }),
            None => problems.push(format!(
                "{file} ({place}): `{span}` follows no quantity in its clause \
                 (\"{}\")",
                before[clause_start..].trim()
            )),
        }
    }
}

/// The cells of a table row, trimmed (`\|` is a pipe within a cell).
fn cells(line: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = line.trim().trim_start_matches('|').chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                chars.next();
                out.last_mut().expect("a cell").push('|');
            }
            '|' => out.push(String::new()),
            _ => out.last_mut().expect("a cell").push(c),
        }
    }
    if out.last().is_some_and(|c| c.trim().is_empty()) {
        out.pop();
    }
    out.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The code spans of `text` (single backticks), with the byte offset of each one's text.
fn code_spans(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut rest = 0;
    while let Some(open) = text[rest..].find('`').map(|i| rest + i) {
        let Some(close) = text[open + 1..].find('`').map(|i| open + 1 + i) else {
            break;
        };
        out.push((open + 1, text[open + 1..close].to_string()));
        rest = close + 1;
    }
    out
}

/// `text` with its code spans blanked (their numbers are flags and names, not quantities).
fn without_code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 0 {
            out.push_str(part);
        } else {
            out.push(' ');
        }
    }
    out
}

/// `text` with its fenced code blocks blanked (line breaks kept, for the line numbers).
fn without_fences(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// The quantities in `text`, in order: numbers that do not continue a word (`p99`, `v1`),
/// each with the unit that follows it, if it is one.
fn quantities(text: &str) -> Vec<Value> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts = chars[i].is_ascii_digit()
            && (i == 0 || !(chars[i - 1].is_alphanumeric() || "_.-/".contains(chars[i - 1])));
        if !starts {
            i += 1;
            continue;
        }
        let mut digits = String::new();
        while i < chars.len() {
            let c = chars[i];
            // A comma between thousands: three digits after it, and no fourth.
            let grouped = c == ','
                && chars.len() >= i + 4
                && chars[i + 1..i + 4].iter().all(char::is_ascii_digit)
                && chars.get(i + 4).is_none_or(|c| !c.is_ascii_digit());
            if c.is_ascii_digit() || c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)
            {
                digits.push(c);
            } else if !grouped {
                break;
            }
            i += 1;
        }
        let mut j = i;
        while j < chars.len() && chars[j] == ' ' {
            j += 1;
        }
        let unit: String = chars[j..]
            .iter()
            .take_while(|c| c.is_alphabetic())
            .collect();
        let number: f64 = digits.parse().unwrap_or(f64::NAN);
        let value = match unit.as_str() {
            "ns" => Some(Value::Time(Duration::from_nanos(number as u64))),
            "µs" | "us" => Some(Value::Time(Duration::from_nanos((number * 1e3) as u64))),
            "ms" => Some(Value::Time(Duration::from_nanos((number * 1e6) as u64))),
            "s" => Some(Value::Time(Duration::from_secs_f64(number))),
            "min" => Some(Value::Time(Duration::from_secs_f64(number * 60.0))),
            "h" => Some(Value::Time(Duration::from_secs_f64(number * 3600.0))),
            "B" | "bytes" => Some(Value::Bytes(number as u64)),
            "KiB" => Some(Value::Bytes((number * 1024.0) as u64)),
            "MiB" => Some(Value::Bytes((number * 1024.0 * 1024.0) as u64)),
            "GiB" => Some(Value::Bytes((number * 1024.0 * 1024.0 * 1024.0) as u64)),
            _ => None,
        };
        match value {
            Some(v) => {
                out.push(v);
                i = j + unit.chars().count();
            }
            None => out.push(Value::Count(number as u64)),
        }
    }
    out
}

/// The reader's own rules, on made-up text (each crate's test runs them, so that a change
/// of the reader is tried wherever it is used).
pub fn self_test() {
    assert_eq!(
        quantities("10,000 / 4,096, 60 s idle, 3 probes 10 s apart; 512 MiB, 50 µs, p99 v1 1/20"),
        vec![
            count(10_000),
            count(4_096),
            time(Duration::from_secs(60)),
            count(3),
            time(Duration::from_secs(10)),
            bytes(512 << 20),
            time(Duration::from_micros(50)),
            count(1),
        ],
    );
    assert_eq!(quantities("8 KiB (gRPC's)"), vec![bytes(8 << 10)]);
    assert_eq!(
        quantities("0.5 ms, 1,5"),
        vec![time(Duration::from_micros(500)), count(1), count(5)]
    );
    assert_eq!(
        cells("| a | `x \\| y` | b |"),
        vec!["a".to_string(), "`x | y`".to_string(), "b".to_string()]
    );
    let mut quotes = Vec::new();
    let mut problems = Vec::new();
    prose(
        "t.md",
        "routed again at most 3 times (`broker::MAX_RETRIES`), every 1 s\n(`broker::FILE_POLL`), \
         none (`broker::NONE`), `--flag 7` and 2 (`--not-a-name`)\n```\n5 (`broker::IN_FENCE`)\n```\n",
        &mut quotes,
        &mut problems,
    );
    let found: Vec<(String, Value)> = quotes.into_iter().map(|q| (q.name, q.value)).collect();
    assert_eq!(
        found,
        vec![
            ("broker::MAX_RETRIES".to_string(), count(3)),
            (
                "broker::FILE_POLL".to_string(),
                time(Duration::from_secs(1))
            ),
        ]
    );
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("broker::NONE"), "{problems:?}");
}
