//! Reading a Prometheus text exposition (what [`Telemetry::render`] writes and a program's
//! `/metrics` serves): the value of a series picked by its exact name and labels
//! ([`sample`], for the tests, the test kit and the capacity probe), and whether a sample
//! line carries a label ([`LabelPair`], for the rendering that leaves series out).
//!
//! Owns matching series by name and labels. Leaves the grammar of the format (names, label
//! lists, escapes, values) to the `prom_text_format_parser` crate, and writing the
//! exposition to the recorder ([`crate::metrics::recorder`]).
//!
//! Each sample line is parsed on its own, and only once a look at its text says it may
//! match (it starts with the name asked for; it holds the label's text): most lines of a
//! scrape are of series no one asked for, and a look costs far less than a parse. Parsed
//! alone, each line of a histogram is a series of its own, named as queries name it
//! (`…_bucket` with its `le`, `…_sum`, `…_count`).
//!
//! Label values are compared in their escaped form (`\\`, `\"`, `\n`), the form the
//! exposition writes and the crate returns: the format has those three escapes and no
//! other, so two values are equal exactly when their escaped forms are.
//!
//! [`Telemetry::render`]: crate::metrics::Telemetry::render

use prom_text_format_parser::{Labels, parse_scrape};

/// The sum of the samples in `text` whose series is called `name` (a histogram's
/// `…_bucket`, `…_sum` or `…_count` included) and whose labels include each of `labels`
/// with exactly that value (unescaped, as given to the recorder); `None` when no sample
/// matches. Comment lines and lines that are not a well-formed sample are skipped.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let wanted: Vec<(&str, String)> = labels
        .iter()
        .map(|(k, v)| (*k, escape_label_value(v)))
        .collect();
    let mut found = None;
    for line in text.lines() {
        // The look before the parse: the name, then its labels or its value.
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !rest.starts_with(['{', ' ', '\t']) {
            continue;
        }
        let Some(s) = SampleLine::parse(line) else {
            continue;
        };
        if s.name == name && wanted.iter().all(|(k, v)| s.has(k, v)) {
            *found.get_or_insert(0.0) += s.value;
        }
    }
    found
}

/// A label with one value, to find the sample lines that carry it.
#[derive(Debug)]
pub struct LabelPair {
    name: String,
    /// The value as the exposition writes it.
    escaped: String,
    /// `name="escaped"`, which a line carrying the pair contains.
    text: String,
}

impl LabelPair {
    /// The label `name` with the (unescaped) `value`.
    pub fn new(name: &str, value: &str) -> Self {
        let escaped = escape_label_value(value);
        LabelPair {
            text: format!("{name}=\"{escaped}\""),
            name: name.to_string(),
            escaped,
        }
    }

    /// Whether `line` is a sample whose labels hold this one with this value (a comment
    /// line, or one that is not a well-formed sample, holds none).
    pub fn carried_by(&self, line: &str) -> bool {
        line.contains(&self.text)
            && SampleLine::parse(line).is_some_and(|s| s.has(&self.name, &self.escaped))
    }
}

/// One sample line, parsed.
struct SampleLine {
    /// The series name, with the suffix of a histogram's line.
    name: String,
    /// Its labels, values escaped.
    labels: Labels,
    value: f64,
}

impl SampleLine {
    /// `line` as a sample; `None` for a comment, a blank line or a malformed one.
    fn parse(line: &str) -> Option<SampleLine> {
        if line.trim_start().starts_with('#') {
            return None;
        }
        let (metrics, problems) = parse_scrape(line);
        if problems.is_some() {
            return None;
        }
        let metric = metrics.into_iter().next()?;
        let sample = metric.samples.into_iter().next()?;
        Some(SampleLine {
            name: metric.name,
            labels: sample.labels,
            value: sample.value.value.parse().ok()?,
        })
    }

    /// Whether the label `name` has the value `escaped` (in its escaped form).
    fn has(&self, name: &str, escaped: &str) -> bool {
        self.labels
            .iter()
            .any(|l| l.key == name && l.value == escaped)
    }
}

/// A label value as the text exposition writes it (backslash, double quote and newline
/// escaped).
fn escape_label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Telemetry;
    use crate::metrics::catalogue;

    /// Fails with a match by substring, where `mode="idle"` is also found in
    /// `xmode="idle"`.
    #[test]
    fn a_label_matches_its_own_name_only() {
        let text = "# TYPE rpcmesh_cpu_seconds_total counter\n\
            rpcmesh_cpu_seconds_total{role=\"p\",cpu=\"0\",xmode=\"idle\",mode=\"user\"} 5\n\
            rpcmesh_cpu_seconds_total{role=\"p\",cpu=\"0\",mode=\"idle\"} 7\n";
        let at = |mode| sample(text, "rpcmesh_cpu_seconds_total", &[("mode", mode)]);
        assert_eq!(at("idle"), Some(7.0));
        assert_eq!(at("user"), Some(5.0));
        assert_eq!(at("nice"), None);
        assert_eq!(
            sample(text, "rpcmesh_cpu_seconds_total", &[("xmode", "idle")]),
            Some(5.0)
        );
        assert_eq!(sample(text, "rpcmesh_cpu_seconds_total", &[]), Some(12.0));
    }

    /// Fails when the value asked for is looked up as written, not as the exposition
    /// escapes it.
    #[test]
    fn an_escaped_label_value_matches_the_value_given_to_the_recorder() {
        let t = Telemetry::new();
        let f = &catalogue::UPSTREAM_CALLS_TOTAL;
        let odd = "a\"b\\c\nd,status=\"err\"";
        t.counter(
            f,
            &[("role", "broker"), ("upstream", odd), ("status", "ok")],
        )
        .increment(3);
        let text = t.render();
        assert!(
            text.contains(r#"upstream="a\"b\\c\nd,status=\"err\"""#),
            "{text}"
        );
        assert_eq!(sample(&text, f.name, &[("upstream", odd)]), Some(3.0));
        assert_eq!(sample(&text, f.name, &[("status", "ok")]), Some(3.0));
        assert_eq!(sample(&text, f.name, &[("status", "err")]), None);
        assert_eq!(sample(&text, f.name, &[("upstream", "a\"b\\c\nd")]), None);
    }

    #[test]
    fn a_histogram_is_read_by_its_bucket_sum_and_count_series() {
        let t = Telemetry::new();
        let f = &catalogue::STAGE_SECONDS;
        let h = t.histogram(f, &[("role", "p"), ("stage", "handler")]);
        h.record(0.000_3);
        h.record(0.003);
        let text = t.render();
        let bucket = |le| sample(&text, "rpcmesh_stage_seconds_bucket", &[("le", le)]);
        assert_eq!(bucket("0.0002"), Some(0.0));
        assert_eq!(bucket("0.0005"), Some(1.0));
        assert_eq!(bucket("0.005"), Some(2.0));
        assert_eq!(bucket("+Inf"), Some(2.0));
        let sum = sample(&text, "rpcmesh_stage_seconds_sum", &[("stage", "handler")]);
        assert!(sum.is_some_and(|s| (s - 0.003_3).abs() < 1e-12), "{text}");
        assert_eq!(
            sample(&text, "rpcmesh_stage_seconds_count", &[("role", "p")]),
            Some(2.0)
        );
        assert_eq!(sample(&text, f.name, &[]), None, "the family is no series");
    }

    #[test]
    fn other_names_comments_and_malformed_lines_are_skipped() {
        let text = "# HELP m_total m_total{a=\"1\"} 9\n\
            m_total_more{a=\"1\"} 1\n\
            m_total{a=\"1\" 2\n\
            m_total{a=\"1\"} x\n\
            m_total{a=\"1\"} 4 1700000000000\n\
            m_total 8\n";
        assert_eq!(sample(text, "m_total", &[("a", "1")]), Some(4.0));
        assert_eq!(sample(text, "m_total", &[]), Some(12.0));
        assert_eq!(sample(text, "m", &[]), None);
        assert_eq!(sample("", "m_total", &[]), None);
    }

    #[test]
    fn a_label_pair_is_matched_whole_inside_the_braces() {
        let pair = LabelPair::new("upstream", "a:1");
        assert!(pair.carried_by("m{upstream=\"a:1\"} 1\n"));
        assert!(pair.carried_by("m{role=\"b\",upstream=\"a:1\",le=\"1\"} 1\n"));
        assert!(!pair.carried_by("m{upstream=\"a:10\"} 1\n"));
        assert!(!pair.carried_by("m{xupstream=\"a:1\"} 1\n"));
        assert!(!pair.carried_by("# HELP m upstream=\"a:1\"\n"));
        assert!(!pair.carried_by("m 1\n"));
        assert!(LabelPair::new("u", "a\"b").carried_by("m{u=\"a\\\"b\"} 1\n"));
        assert_eq!(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
