//! HdrHistogram interval logs, and the merging of a driver fleet's logs into one report.
//!
//! `driver --hdr-log FILE` writes the standard interval log (format V2, compressed, as
//! HdrHistogram's own `HistogramLogWriter` does; the `hdrhistogram` crate writes and reads
//! it): one interval a second, four histograms each, tagged `requests`, `calls` (latency of
//! the successful ones from the intended start) and `requests_uncorrected`, `calls_uncorrected` (from the actual
//! start; open loop only). Values are microseconds (HdrHistogram's `HistogramLogProcessor`
//! prints milliseconds with `-outputValueUnitRatio 1000`). Each interval holds exactly the
//! measured samples that completed in it, so the intervals of a log add up to the run's
//! report, and the logs of several drivers add up to the fleet's.
//!
//! `driver merge FILE...` adds the histograms of every interval of every file, by tag (no
//! percentile is averaged), and reports the fleet's counts, rates and percentiles.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use hdrhistogram::Histogram;
use hdrhistogram::serialization::interval_log::{
    IntervalLogIterator, IntervalLogWriterBuilder, LogEntry, Tag,
};
use hdrhistogram::serialization::{Deserializer, V2DeflateSerializer};
use serde::{Deserialize, Serialize};

use crate::report::{ms, thousands};
use crate::stats::{Latency, LatencySummary, Tally};

/// The tags of the four histograms of an interval: [`Tally::LATENCIES`].
pub const TAGS: [&str; 4] = Tally::LATENCIES;

/// Why a log could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum HdrLogError {
    /// The file could not be created, written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The log could not be written (the crate's writer failed).
    #[error("{path}: writing the interval log: {reason}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A line of the file is not an interval log's.
    #[error("{path}: not an HdrHistogram interval log (at byte {offset})")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Where parsing stopped.
        offset: usize,
    },
    /// An interval's histogram does not decode.
    #[error("{path}: an interval's histogram does not decode: {reason}")]
    Histogram {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
}

/// What the log's writer is sent.
#[derive(Debug)]
pub enum LogEntryOut {
    /// One interval (boxed: it holds four histograms).
    Interval(Box<Interval>),
    /// The run is over: its measured window lasted this long (a comment line, which
    /// `merge` reads to give exact rates).
    End(Duration),
}

/// The comment that ends a log, with the measured window's length in seconds.
const MEASURED_SECONDS: &str = "rpcmesh measured_seconds=";

/// One second of a run's measured samples.
#[derive(Debug)]
pub struct Interval {
    /// When it starts, from the log's base time (the run's start).
    pub start: Duration,
    /// How long it lasts.
    pub length: Duration,
    /// Its figures.
    pub tally: Tally,
}

/// The writer of an interval log: where to send what it writes, and its thread.
pub type LogWriter = (
    std::sync::mpsc::Sender<LogEntryOut>,
    std::thread::JoinHandle<Result<(), HdrLogError>>,
);

/// Writes the intervals it is sent to an interval log, on a thread of its own (file I/O
/// stays off the runtime). Dropping the sender ends the log. The log's BaseTime and
/// StartTime are both `measured_from`, the measured window's start: the intervals'
/// timestamps are offsets from it (a BaseTime earlier than the intervals' origin would
/// shift them, and HdrHistogram's log processor would skip the first as before the start).
pub fn spawn_writer(path: PathBuf, measured_from: SystemTime) -> Result<LogWriter, HdrLogError> {
    let io = |path: &Path, source| HdrLogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(&path).map_err(|e| io(&path, e))?;
    let (tx, rx) = std::sync::mpsc::channel::<LogEntryOut>();
    let name = path.clone();
    let thread = std::thread::Builder::new()
        .name("driver-hdr-log".into())
        .spawn(move || write_log(&path, file, measured_from, rx))
        .map_err(|e| io(&name, e))?;
    Ok((tx, thread))
}

fn write_log(
    path: &Path,
    file: std::fs::File,
    measured_from: SystemTime,
    rx: std::sync::mpsc::Receiver<LogEntryOut>,
) -> Result<(), HdrLogError> {
    let fail = |reason: String| HdrLogError::Write {
        path: path.to_path_buf(),
        reason,
    };
    let mut out = BufWriter::new(file);
    let mut serializer = V2DeflateSerializer::new();
    let mut log = IntervalLogWriterBuilder::new()
        .add_comment(&format!(
            "rpcmesh driver {}: latency in microseconds of successful requests and calls; from the intended start, *_uncorrected from the actual one",
            env!("CARGO_PKG_VERSION")
        ))
        .with_base_time(measured_from)
        .with_start_time(measured_from)
        .with_max_value_divisor(1000.0)
        .begin_log_with(&mut out, &mut serializer)
        .map_err(|e| fail(e.to_string()))?;
    for entry in rx {
        let interval = match entry {
            LogEntryOut::Interval(i) => i,
            LogEntryOut::End(window) => {
                log.write_comment(&format!("{MEASURED_SECONDS}{:.6}", window.as_secs_f64()))
                    .map_err(|e| fail(e.to_string()))?;
                continue;
            }
        };
        for (tag, h) in TAGS.iter().zip(interval.tally.latencies()) {
            if h.count() == 0 {
                continue;
            }
            log.write_histogram(
                h.histogram(),
                interval.start,
                interval.length,
                Tag::new(tag),
            )
            .map_err(|e| fail(format!("{e:?}")))?;
        }
    }
    drop(log);
    out.flush().map_err(|source| HdrLogError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Every second from `started` (the measured window's start) until `done`, sends the
/// workers' measured figures of that second to the log `writer`, then the last part;
/// hands the writer back.
pub(crate) async fn record(
    shared: std::sync::Arc<crate::shared::RunShared>,
    started: std::time::Instant,
    writer: std::sync::mpsc::Sender<LogEntryOut>,
    done: rpcmesh_common::net::shutdown::CancellationToken,
) -> std::sync::mpsc::Sender<LogEntryOut> {
    let mut tick = tokio::time::interval_at(
        (started + Duration::from_secs(1)).into(),
        Duration::from_secs(1),
    );
    let mut last = started;
    loop {
        let end = tokio::select! {
            _ = tick.tick() => false,
            () = done.cancelled() => true,
        };
        let now = std::time::Instant::now();
        let mut tally = Tally::default();
        tally.take_from(&shared.logs);
        let interval = Interval {
            start: last.duration_since(started),
            length: now.duration_since(last),
            tally,
        };
        last = now;
        if writer
            .send(LogEntryOut::Interval(Box::new(interval)))
            .is_err()
            || end
        {
            return writer;
        }
    }
}

/// The combined figures of a fleet's logs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MergedReport {
    /// The logs merged.
    pub files: Vec<String>,
    /// Intervals read, in all.
    pub intervals: u64,
    /// From the earliest interval's start to the latest one's end, seconds.
    pub window_seconds: f64,
    /// The measured window of each log (what its driver's report divides by), seconds.
    pub measured_seconds: Vec<f64>,
    /// Per tag ([`TAGS`]): samples, their rate over the window, and their percentiles.
    pub figures: BTreeMap<String, MergedFigures>,
}

/// The figures of one tag across the fleet.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MergedFigures {
    /// Samples (successful requests, or successful calls).
    pub count: u64,
    /// Per second: the sum of each driver's rate (its samples over its measured window),
    /// which is the fleet's rate when the drivers ran together.
    pub per_second: f64,
    /// Percentiles, ms.
    pub latency: LatencySummary,
}

/// One interval of a log, as read.
#[derive(Debug)]
pub struct LoggedInterval {
    /// When it starts, seconds from the log's base time (the measured window's start).
    pub start: f64,
    /// How long it lasts, seconds.
    pub length: f64,
    /// Its tag ([`TAGS`]).
    pub tag: String,
    /// Its histogram, µs.
    pub histogram: Histogram<u64>,
}

/// A log as read: its base time and its intervals, in order.
#[derive(Debug)]
pub struct Log {
    /// The base time, seconds since the Unix epoch (the measured window's start).
    pub base_unix: f64,
    /// Its intervals.
    pub intervals: Vec<LoggedInterval>,
    /// The driver's measured window, seconds, when the log says it.
    pub measured_seconds: Option<f64>,
}

/// Reads the interval log at `path`.
pub fn read(path: &Path) -> Result<Log, HdrLogError> {
    let bytes = std::fs::read(path).map_err(|source| HdrLogError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut deserializer = Deserializer::new();
    let mut base = 0.0;
    let mut intervals = Vec::new();
    for entry in IntervalLogIterator::new(&bytes) {
        let entry = entry.map_err(|e| match e {
            hdrhistogram::serialization::interval_log::LogIteratorError::ParseError { offset } => {
                HdrLogError::Parse {
                    path: path.to_path_buf(),
                    offset,
                }
            }
        })?;
        let interval = match entry {
            LogEntry::BaseTime(t) => {
                base = t.as_secs_f64();
                continue;
            }
            LogEntry::StartTime(_) => continue,
            LogEntry::Interval(i) => i,
        };
        let bad = |reason: String| HdrLogError::Histogram {
            path: path.to_path_buf(),
            reason,
        };
        let raw = base64::engine::general_purpose::STANDARD
            .decode(interval.encoded_histogram())
            .map_err(|e| bad(e.to_string()))?;
        let histogram: Histogram<u64> = deserializer
            .deserialize(&mut raw.as_slice())
            .map_err(|e| bad(format!("{e:?}")))?;
        intervals.push(LoggedInterval {
            start: interval.start_timestamp().as_secs_f64(),
            length: interval.duration().as_secs_f64(),
            tag: interval
                .tag()
                .map_or("untagged", |t| t.as_str())
                .to_string(),
            histogram,
        });
    }
    // The driver's own measured window, when the log says it.
    let measured_seconds = String::from_utf8_lossy(&bytes).lines().rev().find_map(|l| {
        l.strip_prefix('#')?
            .strip_prefix(MEASURED_SECONDS)?
            .trim()
            .parse::<f64>()
            .ok()
    });
    Ok(Log {
        base_unix: base,
        intervals,
        measured_seconds,
    })
}

/// Reads every log and adds their histograms by tag.
pub fn merge(paths: &[PathBuf]) -> Result<MergedReport, HdrLogError> {
    let mut sums: BTreeMap<String, Latency> = BTreeMap::new();
    let mut rates: BTreeMap<String, f64> = BTreeMap::new();
    let mut measured_seconds = Vec::new();
    let mut intervals = 0u64;
    let mut window: Option<(f64, f64)> = None;
    for path in paths {
        let log = read(path)?;
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        let mut first_last: Option<(f64, f64)> = None;
        for i in &log.intervals {
            let bad = |reason: String| HdrLogError::Histogram {
                path: path.clone(),
                reason,
            };
            sums.entry(i.tag.clone())
                .or_default()
                .add_histogram(&i.histogram)
                .map_err(|e| bad(format!("{e:?}")))?;
            *counts.entry(i.tag.clone()).or_default() += i.histogram.len();
            intervals += 1;
            let start = log.base_unix + i.start;
            let end = start + i.length;
            let span =
                |w: Option<(f64, f64)>| w.map_or((start, end), |(a, b)| (a.min(start), b.max(end)));
            window = Some(span(window));
            first_last = Some(span(first_last));
        }
        // The driver's own measured window, when the log says it (else the intervals').
        let secs = log
            .measured_seconds
            .unwrap_or_else(|| first_last.map_or(0.0, |(a, b)| b - a));
        measured_seconds.push(secs);
        for (tag, n) in counts {
            *rates.entry(tag).or_default() += n as f64 / secs.max(1e-9);
        }
    }
    let window_seconds = window.map_or(0.0, |(a, b)| (b - a).max(0.0));
    let figures = sums
        .into_iter()
        .map(|(tag, l)| {
            let count = l.count();
            let f = MergedFigures {
                count,
                per_second: rates.get(&tag).copied().unwrap_or_default(),
                latency: l.summary(),
            };
            (tag, f)
        })
        .collect();
    Ok(MergedReport {
        files: paths.iter().map(|p| p.display().to_string()).collect(),
        intervals,
        window_seconds,
        measured_seconds,
        figures,
    })
}

impl MergedReport {
    /// The report as text.
    pub fn render_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "rpcmesh driver {} — merged {} interval logs ({} intervals, {:.1} s window)",
            env!("CARGO_PKG_VERSION"),
            self.files.len(),
            self.intervals,
            self.window_seconds
        );
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "  {:<22} {:>12} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "", "count", "per second", "p50", "p99", "p99.9", "max", "mean"
        );
        for tag in TAGS {
            if let Some(f) = self.figures.get(tag) {
                let l = &f.latency;
                let _ = writeln!(
                    o,
                    "  {:<22} {:>12} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9}",
                    tag,
                    thousands(f.count as f64),
                    thousands(f.per_second),
                    ms(l.p50_ms),
                    ms(l.p99_ms),
                    ms(l.p999_ms),
                    ms(l.max_ms),
                    ms(l.mean_ms)
                );
            }
        }
        let _ = writeln!(
            o,
            "  (latency in ms; histograms added across the fleet, not percentiles averaged)"
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::CallOutcome;
    use crate::stats::Took;

    fn interval(start_s: u64, samples: &[u64]) -> Interval {
        let mut tally = Tally::default();
        for &us in samples {
            let took = Took {
                us,
                uncorrected_us: Some(us / 2),
            };
            tally.request(false, took);
            tally.call(CallOutcome::Ok, took);
        }
        Interval {
            start: Duration::from_secs(start_s),
            length: Duration::from_secs(1),
            tally,
        }
    }

    fn write(path: &Path, intervals: Vec<Interval>) {
        let base = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let (tx, thread) = spawn_writer(path.to_path_buf(), base).unwrap();
        for i in intervals {
            tx.send(LogEntryOut::Interval(Box::new(i))).unwrap();
        }
        tx.send(LogEntryOut::End(Duration::from_secs(2))).unwrap();
        drop(tx);
        thread.join().unwrap().unwrap();
    }

    #[test]
    fn two_drivers_logs_merge_into_the_figures_of_all_their_samples() {
        let dir = std::env::temp_dir().join(format!("rpcmesh-hdr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.hlog"), dir.join("b.hlog"));
        let a_samples: [&[u64]; 2] = [&[100, 200, 300], &[150, 5_000]];
        let b_samples: [&[u64]; 2] = [&[120, 900_000], &[250]];
        write(
            &a,
            vec![interval(0, a_samples[0]), interval(1, a_samples[1])],
        );
        write(
            &b,
            vec![interval(0, b_samples[0]), interval(1, b_samples[1])],
        );
        let merged = merge(&[a.clone(), b.clone()]).unwrap();

        let mut all = Latency::default();
        let mut all_uncorrected = Latency::default();
        for s in a_samples.iter().chain(&b_samples).flat_map(|s| s.iter()) {
            all.record_us(*s);
            all_uncorrected.record_us(*s / 2);
        }
        assert_eq!(merged.intervals, 16, "4 tags × 2 intervals × 2 files");
        assert_eq!(merged.window_seconds, 2.0);
        let requests = &merged.figures["requests"];
        assert_eq!(requests.count, 8);
        assert_eq!(requests.latency, all.summary());
        assert_eq!(merged.figures["calls"].latency, all.summary());
        assert_eq!(
            merged.figures["requests_uncorrected"].latency,
            all_uncorrected.summary()
        );
        assert_eq!(merged.measured_seconds, [2.0, 2.0]);
        // Each driver made its samples over its 2 s: 5 and 3 requests, 2.5 + 1.5 a second.
        assert_eq!(requests.per_second, 4.0);
        let text = merged.render_text();
        assert!(text.contains("merged 2 interval logs"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_that_is_not_a_log_is_refused_with_its_name() {
        let path = std::env::temp_dir().join(format!("rpcmesh-not-a-log-{}", std::process::id()));
        std::fs::write(&path, "this is not,an interval log\n").unwrap();
        let e = merge(std::slice::from_ref(&path)).unwrap_err();
        assert!(e.to_string().contains("rpcmesh-not-a-log"), "{e}");
        let _ = std::fs::remove_file(&path);
    }
}
