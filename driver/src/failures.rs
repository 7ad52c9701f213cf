//! Failed calls by outcome and by what the failure said: the status text of a broker's or
//! provider's error reply (`service not found: EchoServic`, `overloaded: …`), so that a
//! report names the cause of its failures instead of only counting them.
//!
//! The texts come from peers, so everything is bounded: a text is cleaned (control
//! characters become spaces, invalid UTF-8 is replaced) and cut at [`MAX_TEXT_BYTES`]; a
//! tally keeps at most [`MAX_TEXTS`] distinct texts, and counts the failures whose text
//! came after those only by outcome ("other texts"). Failures without a text (the driver's
//! own findings, such as `no_reply`, and replies that said nothing) are the rest of their
//! outcome's count.
//!
//! [`FailureTexts`] is what a tally keeps (recorded only for failed calls, compared in
//! place: a text already kept costs no allocation); [`FailureGroup`] and [`groups`] are the
//! report's breakdown, largest first.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use rpcmesh_common::format::thousands;

use crate::outcome::CallOutcome;

/// The longest status text kept, in bytes (longer ones are cut, with "…"): a line of a
/// report, enough for any message rpcmesh writes with its service and method names, and
/// a bound on what a peer can make the driver hold.
pub const MAX_TEXT_BYTES: usize = 120;
/// Distinct status texts a tally keeps: a failure's cause is rarely more than a few texts,
/// and a peer that puts ids in its texts cannot grow the tally (or the report) beyond
/// this; the failures whose texts came after are counted as "other texts".
pub const MAX_TEXTS: usize = 32;
/// Texts the text report lists per outcome, largest first; the rest are summed.
pub const TEXTS_PER_LINE: usize = 3;

/// The status texts of one tally's failed calls.
#[derive(Debug, Clone, Default)]
pub struct FailureTexts {
    /// (outcome index, cleaned text, calls), at most [`MAX_TEXTS`].
    kept: Vec<(usize, Box<str>, u64)>,
    /// Calls whose text was not kept (beyond [`MAX_TEXTS`]), by outcome index.
    others: [u64; CallOutcome::COUNT],
}

impl FailureTexts {
    /// A failed call with `outcome` said `raw` (nothing is recorded for an empty text).
    pub fn record(&mut self, outcome: CallOutcome, raw: &[u8]) {
        let text = clean(raw);
        if !text.is_empty() {
            self.count(outcome.index(), &text, 1);
        }
    }

    fn count(&mut self, outcome: usize, text: &str, n: u64) {
        if let Some(e) = self
            .kept
            .iter_mut()
            .find(|(o, t, _)| *o == outcome && **t == *text)
        {
            e.2 += n;
        } else if self.kept.len() < MAX_TEXTS {
            self.kept.push((outcome, text.into(), n));
        } else {
            self.others[outcome] += n;
        }
    }

    /// Adds another tally's texts (beyond [`MAX_TEXTS`], as other texts).
    pub fn add(&mut self, o: &FailureTexts) {
        for (outcome, text, n) in &o.kept {
            self.count(*outcome, text, *n);
        }
        for (a, b) in self.others.iter_mut().zip(o.others) {
            *a += b;
        }
    }

    /// Forgets every text, keeping the memory of the table.
    pub fn clear(&mut self) {
        self.kept.clear();
        self.others = [0; CallOutcome::COUNT];
    }

    /// Whether no text is kept or counted.
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty() && self.others.iter().all(|n| *n == 0)
    }
}

/// `raw` as a report shows it: UTF-8 (invalid bytes replaced), control characters as
/// spaces, trimmed, and at most [`MAX_TEXT_BYTES`] (cut at a character, with "…").
/// Borrowed when already so.
pub fn clean(raw: &[u8]) -> Cow<'_, str> {
    let mut text = String::from_utf8_lossy(raw);
    if text.chars().any(char::is_control) {
        text = Cow::Owned(
            text.chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect(),
        );
    }
    let trimmed = text.trim();
    if trimmed.len() == text.len() && text.len() <= MAX_TEXT_BYTES {
        return text;
    }
    if trimmed.len() <= MAX_TEXT_BYTES {
        return Cow::Owned(trimmed.to_string());
    }
    let mut cut = MAX_TEXT_BYTES - '…'.len_utf8();
    while !trimmed.is_char_boundary(cut) {
        cut -= 1;
    }
    Cow::Owned(format!("{}…", trimmed[..cut].trim_end()))
}

/// One group of failed calls: an outcome and what its failures said.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FailureGroup {
    /// The outcome, as in `errors` (`failed`, `unavailable`, `no_reply`, …).
    pub outcome: String,
    /// What the failures said: the reply's status text, cleaned and cut at 120 bytes.
    /// `None` for failures that said nothing (the driver's own findings, replies without a
    /// text) and, with `other_texts`, for the texts beyond those kept.
    pub text: Option<String>,
    /// True for the failures of this outcome whose texts came after the 32 kept: summed,
    /// their texts left off.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub other_texts: bool,
    /// Calls.
    pub count: u64,
}

/// The failed calls of `outcomes` (a tally's counts by outcome index) grouped by outcome
/// and text: every failed call in exactly one group, largest groups first (at most
/// [`MAX_TEXTS`] with a text, and two more per outcome).
pub fn groups(outcomes: &[u64; CallOutcome::COUNT], texts: &FailureTexts) -> Vec<FailureGroup> {
    let mut out = Vec::new();
    for o in &CallOutcome::ALL[1..] {
        let i = o.index();
        let total = outcomes[i];
        if total == 0 {
            continue;
        }
        let mut with_text = 0;
        for (_, text, n) in texts.kept.iter().filter(|(k, _, _)| *k == i) {
            with_text += n;
            out.push(FailureGroup {
                outcome: o.label().to_string(),
                text: Some(text.to_string()),
                other_texts: false,
                count: *n,
            });
        }
        let others = texts.others[i];
        if others > 0 {
            out.push(FailureGroup {
                outcome: o.label().to_string(),
                text: None,
                other_texts: true,
                count: others,
            });
        }
        // Texts are counted for calls of the measured window only, as `outcomes` are, so
        // they never exceed them; `saturating_sub` keeps a report whole if they did.
        let silent = total.saturating_sub(with_text + others);
        if silent > 0 {
            out.push(FailureGroup {
                outcome: o.label().to_string(),
                text: None,
                other_texts: false,
                count: silent,
            });
        }
    }
    out.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then_with(|| a.outcome.cmp(&b.outcome))
            .then_with(|| a.text.cmp(&b.text))
    });
    out
}

/// The text report's lines of `groups`: one per outcome, the outcomes with most failures
/// first, each naming its [`TEXTS_PER_LINE`] largest texts with their counts
/// (`failed 28,850: service not found: EchoServic ×28,850`) and summing the rest.
pub fn render(groups: &[FailureGroup], indent: &str) -> String {
    let mut outcomes: Vec<(&str, u64)> = Vec::new();
    for g in groups {
        match outcomes.iter_mut().find(|(o, _)| *o == g.outcome) {
            Some((_, n)) => *n += g.count,
            None => outcomes.push((&g.outcome, g.count)),
        }
    }
    outcomes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut o = String::new();
    for (outcome, total) in outcomes {
        let mine: Vec<&FailureGroup> = groups.iter().filter(|g| g.outcome == outcome).collect();
        let mut parts: Vec<String> = Vec::new();
        let texts: Vec<&&FailureGroup> = mine.iter().filter(|g| g.text.is_some()).collect();
        for g in texts.iter().take(TEXTS_PER_LINE) {
            let text = g.text.as_deref().unwrap_or_default();
            parts.push(format!("{text} ×{}", thousands(g.count as f64)));
        }
        let rest: u64 = texts
            .iter()
            .skip(TEXTS_PER_LINE)
            .map(|g| g.count)
            .sum::<u64>()
            + mine
                .iter()
                .filter(|g| g.other_texts)
                .map(|g| g.count)
                .sum::<u64>();
        if rest > 0 {
            parts.push(format!("other texts ×{}", thousands(rest as f64)));
        }
        let silent: u64 = mine
            .iter()
            .filter(|g| g.text.is_none() && !g.other_texts)
            .map(|g| g.count)
            .sum();
        if silent > 0 && !parts.is_empty() {
            parts.push(format!("without a text ×{}", thousands(silent as f64)));
        }
        let _ = write!(o, "{indent}{outcome} {}", thousands(total as f64));
        if !parts.is_empty() {
            let _ = write!(o, ": {}", parts.join(", "));
        }
        o.push('\n');
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpcmesh_wire::Status;

    const FAILED: CallOutcome = CallOutcome::Replied(Status::Failed);
    const UNAVAILABLE: CallOutcome = CallOutcome::Replied(Status::Unavailable);

    fn counts(of: &[(CallOutcome, u64)]) -> [u64; CallOutcome::COUNT] {
        let mut c = [0; CallOutcome::COUNT];
        for (o, n) in of {
            c[o.index()] += n;
        }
        c
    }

    #[test]
    fn failures_are_told_apart_by_outcome_and_text_largest_first() {
        let mut t = FailureTexts::default();
        for _ in 0..5 {
            t.record(FAILED, b"service not found: EchoServic");
        }
        t.record(UNAVAILABLE, b"unavailable: no provider of EchoService");
        t.record(FAILED, b"");
        let c = counts(&[(FAILED, 7), (UNAVAILABLE, 1), (CallOutcome::NoReply, 2)]);
        let g = groups(&c, &t);
        let row = |g: &FailureGroup| (g.outcome.clone(), g.text.clone(), g.count);
        assert_eq!(
            g.iter().map(row).collect::<Vec<_>>(),
            [
                (
                    "failed".into(),
                    Some("service not found: EchoServic".into()),
                    5
                ),
                ("failed".into(), None, 2),
                ("no_reply".into(), None, 2),
                (
                    "unavailable".into(),
                    Some("unavailable: no provider of EchoService".into()),
                    1
                ),
            ]
        );
        let text = render(&g, "  ");
        assert_eq!(
            text,
            "  failed 7: service not found: EchoServic ×5, without a text ×2\n  \
             no_reply 2\n  unavailable 1: unavailable: no provider of EchoService ×1\n"
        );
    }

    #[test]
    fn a_peer_cannot_grow_the_texts_beyond_their_bounds() {
        let mut t = FailureTexts::default();
        for i in 0..1000 {
            t.record(FAILED, format!("request {i} failed").as_bytes());
        }
        t.record(FAILED, &[b'x'; 10_000]);
        assert_eq!(t.kept.len(), MAX_TEXTS);
        let g = groups(&counts(&[(FAILED, 1001)]), &t);
        assert_eq!(
            g.iter().map(|g| g.count).sum::<u64>(),
            1001,
            "every call counted"
        );
        let others = g.iter().find(|g| g.other_texts).unwrap();
        assert_eq!(others.count, 1001 - MAX_TEXTS as u64);
        let text = render(&g, "");
        assert!(
            text.contains("other texts ×998"),
            "all but the three named: {text}"
        );
        assert_eq!(text.lines().count(), 1, "{text}");
        let mut merged = FailureTexts::default();
        merged.add(&t);
        merged.add(&t);
        assert_eq!(merged.kept.len(), MAX_TEXTS);
        assert_eq!(merged.others[FAILED.index()], 2 * (1001 - MAX_TEXTS as u64));
    }

    #[test]
    fn texts_are_cleaned_and_cut_on_a_character() {
        assert!(matches!(clean(b"plain text"), Cow::Borrowed("plain text")));
        assert_eq!(clean(b" two\nlines\x1b[31m "), "two lines [31m");
        assert_eq!(clean(b"bad \xff byte"), "bad \u{fffd} byte");
        let long = "é".repeat(100);
        let cut = clean(long.as_bytes());
        assert!(cut.len() <= MAX_TEXT_BYTES && cut.ends_with('…'), "{cut}");
        let mut t = FailureTexts::default();
        t.record(FAILED, long.as_bytes());
        t.record(FAILED, long.as_bytes());
        assert_eq!(t.kept.len(), 1, "one text, counted twice");
        assert_eq!(t.kept[0].2, 2);
    }
}
