//! How a run ended, for the shell: [`Verdict`], read from the report, and its exit status.
//! A script that runs the driver learns from the status alone whether the figures are
//! those it asked for: every request it meant to offer was sent, and the run was not cut
//! short. The statuses are listed in `driver --help` ([`EXIT_STATUSES`]).

use rpcmesh_common::format::thousands;

use crate::report::{Ending, Report};

/// What `driver --help` says of the exit statuses (after its flags).
pub const EXIT_STATUSES: &str = "\
Exit status:
  0    the run completed: calls succeeded, and every request due was sent
  1    no call succeeded, or the run could not be made (a target that cannot be reached,
       a file that cannot be written)
  2    the command line or the environment was refused (the message says what to change)
  3    open loop: requests due were not sent (every slot busy and the backlog full), so
       the rate sent was below the rate asked; --allow-unsent makes this 0
  130  interrupted (SIGINT or SIGTERM): the report is of the part measured";

/// How a run ended, as its exit status tells it; the first that holds, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// SIGINT or SIGTERM stopped it: its figures are partial.
    Interrupted,
    /// No call succeeded: it measured nothing.
    NothingSucceeded,
    /// Open loop: requests due were not sent, and that was not allowed.
    NotSent,
    /// What was asked was measured.
    Completed,
}

impl Verdict {
    /// The verdict of `report`; `allow_unsent` (`--allow-unsent`) takes requests not
    /// sent as part of what was asked.
    pub fn of(report: &Report, allow_unsent: bool) -> Verdict {
        if report.ended == Ending::Interrupted {
            Verdict::Interrupted
        } else if report.calls.ok == 0 {
            Verdict::NothingSucceeded
        } else if report.requests.not_sent > 0 && !allow_unsent {
            Verdict::NotSent
        } else {
            Verdict::Completed
        }
    }

    /// The exit status ([`EXIT_STATUSES`]).
    pub fn exit_code(self) -> u8 {
        match self {
            Verdict::Completed => 0,
            Verdict::NothingSucceeded => 1,
            Verdict::NotSent => 3,
            // 128 + SIGINT, as a shell reports a command that Ctrl-C stopped.
            Verdict::Interrupted => 130,
        }
    }

    /// What to tell the user on stderr, beside the report; `None` for a run that
    /// completed.
    pub fn message(self, report: &Report) -> Option<String> {
        let q = &report.requests;
        match self {
            Verdict::Completed => None,
            Verdict::Interrupted => Some(format!(
                "interrupted after {:.1} s measured: the report is partial",
                report.measured_seconds
            )),
            Verdict::NothingSucceeded => Some(format!(
                "no call succeeded ({} sent, {} failed connection attempts)",
                thousands(report.calls.sent as f64),
                thousands(report.calls.connect_failures as f64)
            )),
            Verdict::NotSent => Some(format!(
                "{} of the {} requests due were not sent: raise --concurrency (or --backlog), lower the rate, or pass --allow-unsent",
                thousands(q.not_sent as f64),
                thousands(q.due as f64)
            )),
        }
    }
}

/// The exit status of a command line or environment that was refused.
pub const REFUSED: u8 = 2;
/// The exit status of a run that could not be made.
pub const FAILED: u8 = 1;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{ByteFigures, CallFigures, RequestFigures, Setup};
    use crate::stats::Tally;

    fn report(ok: u64, not_sent: u64, ended: Ending) -> Report {
        let mut t = Tally {
            requests_not_sent: not_sent,
            requests_due: 10 + not_sent,
            ..Tally::default()
        };
        t.outcomes[0] = ok;
        t.sent = ok.max(1);
        Report {
            version: String::new(),
            started_unix: 0,
            setup: Setup {
                workload: "echo".into(),
                payload_size: 32,
                targets: Vec::new(),
                embedded: false,
                concurrency: 1,
                connections: 1,
                fanout: 1,
                parallel: false,
                compression: false,
                plain_v1: false,
                warmup_seconds: 0.0,
                rate: None,
                schedule: None,
                arrival: None,
                pacing: None,
            },
            measured_seconds: 2.0,
            ended,
            requests: RequestFigures::of(&t, 2.0, true, None),
            calls: CallFigures::of(&t, 2.0, true, 0, 0),
            bytes: ByteFigures::of(&t),
            steps: Vec::new(),
        }
    }

    #[test]
    fn the_exit_status_says_whether_the_figures_are_those_asked_for() {
        use Ending::{Completed, Interrupted};
        for (ok, not_sent, ended, allow, verdict, code) in [
            (5, 0, Completed, false, Verdict::Completed, 0),
            (0, 0, Completed, false, Verdict::NothingSucceeded, 1),
            (5, 3, Completed, false, Verdict::NotSent, 3),
            (5, 3, Completed, true, Verdict::Completed, 0),
            (0, 3, Completed, true, Verdict::NothingSucceeded, 1),
            (5, 3, Interrupted, false, Verdict::Interrupted, 130),
            (0, 0, Interrupted, false, Verdict::Interrupted, 130),
        ] {
            let r = report(ok, not_sent, ended);
            let v = Verdict::of(&r, allow);
            assert_eq!(
                (v, v.exit_code()),
                (verdict, code),
                "{ok} {not_sent} {ended:?}"
            );
            assert_eq!(v.message(&r).is_none(), code == 0);
        }
        let r = report(5, 3, Interrupted);
        let text = r.render_text();
        assert!(text.contains("interrupted after 2.0 s measured"), "{text}");
        assert!(
            text.contains("NOT SENT: 3 of the 13 requests due"),
            "{text}"
        );
    }
}
