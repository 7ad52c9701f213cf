//! Walking a program's flags (its `clap` command, subcommands included) for the checks
//! every program's flags pass alike: a duration flag refuses a number without a unit
//! ([`bare_durations_accepted`]).

use std::any::TypeId;
use std::time::Duration;

use rpcmesh_common::cli::DurationArg;

/// A flag of a command: the words before it (the program, its subcommands) and its long
/// name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    /// The program and the subcommands the flag belongs to.
    pub path: Vec<String>,
    /// `--name`.
    pub long: String,
}

impl std::fmt::Display for Flag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.path.join(" "), self.long)
    }
}

/// Every flag of `cmd` and its subcommands whose value is parsed as a duration: by the
/// shared [`DurationArg`], as a plain [`Duration`], or a value of another type whose
/// default is a duration (a distribution of durations, say), and those named in `also`
/// (flags whose value is a duration or a word, such as `--busy-poll`).
pub fn duration_flags(cmd: &clap::Command, also: &[&str]) -> Vec<Flag> {
    let mut out = Vec::new();
    walk(cmd, &mut vec![cmd.get_name().to_string()], also, &mut out);
    out
}

fn walk(cmd: &clap::Command, path: &mut Vec<String>, also: &[&str], out: &mut Vec<Flag>) {
    let duration_types = [TypeId::of::<DurationArg>(), TypeId::of::<Duration>()];
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let parsed_as = arg.get_value_parser().type_id();
        let typed = duration_types.iter().any(|t| parsed_as == *t);
        let by_default = arg.get_default_values().first().is_some_and(|d| {
            let d = d.to_string_lossy();
            d.chars().any(|c| c.is_ascii_alphabetic())
                && rpcmesh_common::cli::values::parse_duration(&d).is_ok()
        });
        if typed || by_default || also.contains(&long) {
            out.push(Flag {
                path: path.clone(),
                long: format!("--{long}"),
            });
        }
    }
    for sub in cmd.get_subcommands() {
        path.push(sub.get_name().to_string());
        walk(sub, path, also, out);
        path.pop();
    }
}

/// The flags of `flags` that take `5` (a number without a unit) without the error that
/// asks for one: none, when every duration flag refuses it. `cmd` parses the words.
pub fn bare_durations_accepted(cmd: &clap::Command, flags: &[Flag]) -> Vec<String> {
    flags
        .iter()
        .filter_map(|f| {
            let mut words = f.path.clone();
            words.extend([f.long.clone(), "5".to_string()]);
            match cmd.clone().try_get_matches_from(&words) {
                Err(e) if e.to_string().contains("has no unit") => None,
                Err(e) => Some(format!("{f} 5: {e}")),
                Ok(_) => Some(format!("{f} 5: accepted")),
            }
        })
        .collect()
}
