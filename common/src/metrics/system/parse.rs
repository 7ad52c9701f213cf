//! Parsing the text of the `/proc` files the system metrics come from: pure functions from
//! text to values, with no I/O and no metrics, so that each is tested on made-up text.
//!
//! Owns the parsing of `/proc/softirqs` (no crate parses it), the numbering of the CPUs of
//! `/proc/stat` (its other fields are `procfs`'s), the context-switch lines of a thread's
//! `status` file, and the CPU modes that become the `mode` label. Leaves reading the files,
//! and what the values become, to the collector (`collector.rs`).

use std::collections::HashSet;

use procfs::{CpuTime, FromReadSI, KernelStats};

use super::SysError;

/// The contents of `/proc/softirqs`: for each vector, its count on each CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Softirqs {
    /// The CPU number of each column, in column order, as the header names it (`CPU3` → 3).
    pub cpus: Vec<u32>,
    /// One row per vector, in file order.
    pub rows: Vec<SoftirqRow>,
}

/// One row of `/proc/softirqs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftirqRow {
    /// The vector, lower-cased as the kernel writes it upper-cased (`NET_RX` → `net_rx`).
    pub vector: String,
    /// The count on each CPU, in the header's column order; shorter than
    /// [`Softirqs::cpus`] when the row stops early.
    pub counts: Vec<u64>,
}

/// Parses the text of `/proc/softirqs`: a header of `CPU<n>` columns, then one
/// `NAME: count …` row per vector. Any whitespace separates columns, blank lines are
/// skipped, a row may stop before the last CPU, and rows of any name are kept.
pub fn parse_softirqs(text: &str) -> Result<Softirqs, SysError> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim().is_empty());

    let (header_line, header) = lines.next().ok_or(SysError::NoHeader)?;
    let mut cpus = Vec::new();
    let mut seen = HashSet::new();
    for token in header.split_whitespace() {
        let cpu = token
            .strip_prefix("CPU")
            .and_then(decimal)
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| seen.insert(n))
            .ok_or_else(|| SysError::BadHeader {
                line: header_line,
                token: token.to_owned(),
            })?;
        cpus.push(cpu);
    }

    let mut rows: Vec<SoftirqRow> = Vec::new();
    for (line, text) in lines {
        let (name, counts) = text.split_once(':').ok_or(SysError::BadRow { line })?;
        let vector = name.trim().to_ascii_lowercase();
        if vector.is_empty() {
            return Err(SysError::BadRow { line });
        }
        let counts = counts
            .split_whitespace()
            .map(|t| {
                decimal(t).ok_or_else(|| SysError::BadCount {
                    line,
                    token: t.to_owned(),
                })
            })
            .collect::<Result<Vec<u64>, SysError>>()?;
        if counts.len() > cpus.len() {
            return Err(SysError::TooManyCounts {
                line,
                counts: counts.len(),
                cpus: cpus.len(),
            });
        }
        if rows.iter().any(|r| r.vector == vector) {
            return Err(SysError::DuplicateVector { line, vector });
        }
        rows.push(SoftirqRow { vector, counts });
    }
    Ok(Softirqs { cpus, rows })
}

/// The time of each CPU from the text of `/proc/stat`, parsed by `procfs`, with the CPU's
/// number from its `cpu<n>` line: `procfs` keeps only the order, and `/proc/stat` lists
/// online CPUs only, so once one is offline (say, SMT switched off) the position is no
/// longer the number.
pub fn parse_stat(text: &str) -> Result<Vec<(u32, CpuTime)>, SysError> {
    let stats = KernelStats::from_read(text.as_bytes(), procfs::current_system_info())
        .map_err(SysError::Stat)?;
    // The same test procfs applies to pick per-CPU lines, so the two lists line up.
    let ids = text
        .lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .map(|l| {
            let name = l.split_whitespace().next().unwrap_or_default();
            name.strip_prefix("cpu")
                .and_then(decimal)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| SysError::StatCpu {
                    name: name.to_owned(),
                })
        })
        .collect::<Result<Vec<u32>, SysError>>()?;
    if ids.len() != stats.cpu_time.len() {
        return Err(SysError::StatCpu {
            name: format!("{} cpu lines for {} CPUs", ids.len(), stats.cpu_time.len()),
        });
    }
    Ok(ids.into_iter().zip(stats.cpu_time).collect())
}

/// A non-negative decimal integer: digits only (no sign, no spaces), fitting 64 bits.
fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// A thread's voluntary and involuntary context switches, from the text of its
/// `/proc/<pid>/task/<tid>/status` (the `voluntary_ctxt_switches:` and
/// `nonvoluntary_ctxt_switches:` lines); a line that is missing or not a count counts 0.
pub(super) fn parse_context_switches(status: &str) -> [u64; 2] {
    let mut counts = [0u64; 2];
    for line in status.lines() {
        let (i, rest) = if let Some(r) = line.strip_prefix("voluntary_ctxt_switches:") {
            (0, r)
        } else if let Some(r) = line.strip_prefix("nonvoluntary_ctxt_switches:") {
            (1, r)
        } else {
            continue;
        };
        counts[i] += rest.trim().parse::<u64>().unwrap_or(0);
    }
    counts
}

/// A CPU mode of `/proc/stat`, the `mode` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CpuMode {
    User,
    Nice,
    System,
    Idle,
    Iowait,
    Irq,
    Softirq,
    Steal,
}

impl CpuMode {
    pub(super) const ALL: [CpuMode; 8] = [
        CpuMode::User,
        CpuMode::Nice,
        CpuMode::System,
        CpuMode::Idle,
        CpuMode::Iowait,
        CpuMode::Irq,
        CpuMode::Softirq,
        CpuMode::Steal,
    ];

    pub(super) fn label(self) -> &'static str {
        match self {
            CpuMode::User => "user",
            CpuMode::Nice => "nice",
            CpuMode::System => "system",
            CpuMode::Idle => "idle",
            CpuMode::Iowait => "iowait",
            CpuMode::Irq => "irq",
            CpuMode::Softirq => "softirq",
            CpuMode::Steal => "steal",
        }
    }

    /// The ticks of this mode, if the kernel reports it.
    pub(super) fn ticks(self, t: &CpuTime) -> Option<u64> {
        match self {
            CpuMode::User => Some(t.user),
            CpuMode::Nice => Some(t.nice),
            CpuMode::System => Some(t.system),
            CpuMode::Idle => Some(t.idle),
            CpuMode::Iowait => t.iowait,
            CpuMode::Irq => t.irq,
            CpuMode::Softirq => t.softirq,
            CpuMode::Steal => t.steal,
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `cat /proc/softirqs` on the 2-CPU development VM.
    const SOFTIRQS_2CPU: &str = "                    CPU0       CPU1       
          HI:          0          0
       TIMER:      45618      42748
      NET_TX:          4          0
      NET_RX:   10403218   11390023
       BLOCK:          0      72855
    IRQ_POLL:          0          0
     TASKLET:       1128         41
       SCHED:      63101      62838
     HRTIMER:          0          0
         RCU:      71854      76400
";

    /// A made-up 4-CPU file: tabs, runs of spaces, CRLF, blank lines, a row that stops
    /// early, and a vector no kernel has.
    const SOFTIRQS_4CPU_ODD: &str = "\n\t CPU0   CPU1 CPU2\tCPU3   \r\n\
HI:0 0 0 0\n\
   TIMER:\t1  2\t\t3 4\n\
NET_RX:   100 200 300 400   \r\n\
\n\
      BLOCK:  5 6\n\
NEW_THING:    7 8 9 10\n\
IRQ_POLL:\n\
\n\n";

    /// `/proc/stat` on the same VM (the `intr` and `softirq` lines shortened).
    pub(in crate::metrics::system) const STAT_2CPU: &str =
        "cpu  132664 0 30791 296341 1649 0 7043 63 0 0
cpu0 64019 0 14339 151955 503 0 3350 29 0 0
cpu1 68645 0 16452 144386 1146 0 3693 34 0 0
intr 1994375 0 0 0 0
ctxt 4844841
btime 1796059433
processes 41381
procs_running 3
procs_blocked 0
softirq 26714694 0 96402 4 26239781 76560 0 1169 143669 0 157109
";

    fn row<'a>(s: &'a Softirqs, vector: &str) -> &'a [u64] {
        &s.rows
            .iter()
            .find(|r| r.vector == vector)
            .expect("the row is in the capture")
            .counts
    }

    #[test]
    fn parses_a_real_two_cpu_capture() {
        let s = parse_softirqs(SOFTIRQS_2CPU).expect("a real capture parses");
        assert_eq!(s.cpus, vec![0, 1]);
        let vectors: Vec<&str> = s.rows.iter().map(|r| r.vector.as_str()).collect();
        assert_eq!(
            vectors,
            [
                "hi", "timer", "net_tx", "net_rx", "block", "irq_poll", "tasklet", "sched",
                "hrtimer", "rcu"
            ]
        );
        assert_eq!(row(&s, "net_rx"), [10_403_218, 11_390_023]);
        assert_eq!(row(&s, "block"), [0, 72_855]);
        assert!(s.rows.iter().all(|r| r.counts.len() == 2));
    }

    #[test]
    fn tolerates_odd_spacing_short_rows_and_unknown_vectors() {
        let s = parse_softirqs(SOFTIRQS_4CPU_ODD).expect("odd spacing parses");
        assert_eq!(s.cpus, vec![0, 1, 2, 3]);
        assert_eq!(row(&s, "hi"), [0, 0, 0, 0]);
        assert_eq!(row(&s, "timer"), [1, 2, 3, 4]);
        assert_eq!(row(&s, "net_rx"), [100, 200, 300, 400]);
        assert_eq!(row(&s, "block"), [5, 6]);
        assert_eq!(row(&s, "new_thing"), [7, 8, 9, 10]);
        assert_eq!(row(&s, "irq_poll"), [] as [u64; 0]);
        assert_eq!(s.rows.len(), 6);
    }

    #[test]
    fn cpu_numbers_come_from_the_header_not_the_position() {
        let s = parse_softirqs("CPU0 CPU2 CPU7\nNET_RX: 1 2 3\n").expect("parses");
        assert_eq!(s.cpus, vec![0, 2, 7]);
    }

    #[test]
    fn malformed_input_gives_a_typed_error() {
        use SysError as E;
        /// Whether an error is the one expected.
        type Check = fn(&SysError) -> bool;
        let cases: &[(&str, Check)] = &[
            ("", |e| matches!(e, E::NoHeader)),
            (" \n\t\n", |e| matches!(e, E::NoHeader)),
            ("HI: 0 0\n", |e| matches!(e, E::BadHeader { line: 1, .. })),
            (
                "CPU0 CPUx\n",
                |e| matches!(e, E::BadHeader { token, .. } if token == "CPUx"),
            ),
            ("CPU0 CPU\n", |e| matches!(e, E::BadHeader { .. })),
            ("CPU0 CPU+1\n", |e| matches!(e, E::BadHeader { .. })),
            ("CPU0 CPU0\n", |e| matches!(e, E::BadHeader { .. })),
            ("CPU0 CPU99999999999\n", |e| {
                matches!(e, E::BadHeader { .. })
            }),
            ("CPU0\nHI 0\n", |e| matches!(e, E::BadRow { line: 2 })),
            ("CPU0\n  : 0\n", |e| matches!(e, E::BadRow { line: 2 })),
            (
                "CPU0\nHI: 12a\n",
                |e| matches!(e, E::BadCount { token, .. } if token == "12a"),
            ),
            ("CPU0\nHI: -1\n", |e| matches!(e, E::BadCount { .. })),
            ("CPU0\nHI: +1\n", |e| matches!(e, E::BadCount { .. })),
            ("CPU0\nHI: 1.5\n", |e| matches!(e, E::BadCount { .. })),
            ("CPU0\nHI: 99999999999999999999\n", |e| {
                matches!(e, E::BadCount { .. })
            }),
            ("CPU0 CPU1\nHI: 1 2 3\n", |e| {
                matches!(
                    e,
                    E::TooManyCounts {
                        line: 2,
                        counts: 3,
                        cpus: 2
                    }
                )
            }),
            (
                "CPU0\nHI: 1\nhi: 2\n",
                |e| matches!(e, E::DuplicateVector { line: 3, vector } if vector == "hi"),
            ),
        ];
        for (text, expected) in cases {
            match parse_softirqs(text) {
                Err(e) => assert!(expected(&e), "{text:?} gave {e:?}"),
                Ok(s) => panic!("{text:?} parsed as {s:?}"),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn parse_softirqs_never_panics(text in "\\PC*") {
            let _ = parse_softirqs(&text);
        }

        #[test]
        fn parse_softirqs_never_panics_on_near_misses(
            text in "(CPU[0-9]{1,3}[ \t]*){0,5}\n([A-Z_]{0,6}:?[ \t0-9a-]{0,20}\n){0,6}"
        ) {
            let _ = parse_softirqs(&text);
        }
    }

    #[test]
    fn parses_a_real_stat_capture_with_cpu_numbers() {
        let cpus = parse_stat(STAT_2CPU).expect("a real capture parses");
        let ids: Vec<u32> = cpus.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [0, 1]);
        assert_eq!(cpus[1].1.user, 68_645);
        assert_eq!(cpus[1].1.softirq, Some(3_693));
    }

    #[test]
    fn an_offline_cpu_does_not_shift_the_numbers() {
        let text = STAT_2CPU.replace("cpu1 ", "cpu2 ");
        let ids: Vec<u32> = parse_stat(&text)
            .expect("parses")
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(ids, [0, 2]);
    }

    #[test]
    fn a_broken_stat_gives_a_typed_error() {
        assert!(matches!(parse_stat(""), Err(SysError::Stat(_))));
        assert!(matches!(
            parse_stat(&STAT_2CPU.replace("cpu1 68645", "cpu1 x")),
            Err(SysError::Stat(_))
        ));
        assert!(matches!(
            parse_stat(&STAT_2CPU.replace("cpu1 ", "cpux ")),
            Err(SysError::StatCpu { name }) if name == "cpux"
        ));
    }

    #[test]
    fn context_switches_come_from_their_two_lines() {
        let status = "Name:\tprovider\nvoluntary_ctxt_switches:\t120\n\
                      nonvoluntary_ctxt_switches:\t 7\nSigQ:\t0/1\n";
        assert_eq!(parse_context_switches(status), [120, 7]);
        assert_eq!(parse_context_switches("Name:\tx\n"), [0, 0]);
        assert_eq!(
            parse_context_switches("voluntary_ctxt_switches: lots\n"),
            [0, 0]
        );
    }
}
