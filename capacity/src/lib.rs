//! rpcmesh's capacity planner: how many requests per second a path holds under an SLO, what
//! compression or TLS does to that, and how throughput scales with users.
//!
//! The planner is the experiment's logic and its outputs, and nothing that touches a
//! socket: it decides which step runs next and judges what the step measured, while a
//! [`StepRunner`] (the driver's load engine, with its CPU probes) runs each step. So the
//! whole experiment runs, in tests, against made-up steps.
//!
//! In time order ([`experiment::run`]): the search ([`search`]) offers open-loop steps at
//! growing, then bisected, rates, each judged by the SLO ([`slo`]), and confirms the
//! highest passing one; with `--compare-compression` (or `--compare-tls`) two searches
//! (off and on) take turns step by step, so that drift on a shared machine hits both
//! alike, and then run once more each at a common rate. Then a closed-loop sweep over users, fitted with the Universal
//! Scalability Law ([`usl`]). The results are data ([`report`], JSON with a schema),
//! text and Markdown ([`text`]) and HTML with charts ([`html`]). The planner's own flags
//! are [`args`]; the command that runs it flattens them beside its load's.
//!
//! - [`args`]: the planner's flags, their defaults and why, validation into a [`Plan`].
//! - [`step`]: the [`StepRunner`] trait, what a step hands back ([`Measured`]), and its
//!   figures in the report.
//! - [`search`]: the choice of the next rate, as a pure state machine.
//! - [`slo`]: parsing `--slo`, and judging a step by it.
//! - [`experiment`]: the searches, the comparison and the sweep, in time order.
//! - [`usl`]: the Universal Scalability Law and its least-squares fit.
//! - [`report`]: the report's data and its JSON Schema.
//! - [`text`]: the report as text and Markdown.
//! - [`html`]: the report as one HTML page with charts (the fault lab's too).
//! - [`faults`]: the fault lab's report (`scripts/faults`): phases, time to detect and to
//!   recover, against a control; beside the planner, it shares its reports' charts.

pub mod args;
pub mod experiment;
pub mod faults;
pub mod html;
pub mod report;
pub mod search;
pub mod slo;
pub mod step;
pub mod text;
pub mod usl;

pub use args::{OutputArgs, Plan, PlanArgs};
pub use experiment::{LoadSetup, run};
pub use report::CapacityReport;
pub use step::{Compared, Measured, Setting, StepRunner};
