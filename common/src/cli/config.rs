//! Configuration validation: every problem found in a program's settings, reported together
//! so that an operator fixes them in one go ([`ConfigProblems`]), and the settings that are
//! valid but do nothing as given (a flag that matters only with another), logged at the
//! start ([`ConfigWarnings`]).
//!
//! Owns only the collecting; what is a problem is each program's `config.rs`.

/// Every problem found while validating a configuration.
#[derive(Debug, Default, thiserror::Error, PartialEq, Eq)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigProblems(pub Vec<String>);

impl ConfigProblems {
    /// Records a problem when `bad` holds.
    pub fn check(&mut self, bad: bool, problem: impl FnOnce() -> String) {
        if bad {
            self.0.push(problem());
        }
    }

    /// `Ok(value)` when no problem was recorded.
    pub fn into_result<T>(self, value: T) -> Result<T, ConfigProblems> {
        if self.0.is_empty() {
            Ok(value)
        } else {
            Err(self)
        }
    }
}

/// Settings that are valid but do nothing as given, or less than they seem (a flag that
/// matters only with another one): the program starts, and logs each at warn.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ConfigWarnings(pub Vec<String>);

impl ConfigWarnings {
    /// Records a warning when `odd` holds.
    pub fn check(&mut self, odd: bool, warning: impl FnOnce() -> String) {
        if odd {
            self.0.push(warning());
        }
    }

    /// Logs every warning (once logging is up: at the start of the program's `run`).
    pub fn log(&self) {
        for w in &self.0 {
            tracing::warn!("{w}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_listed_together() {
        let mut p = ConfigProblems::default();
        p.check(true, || "one".into());
        p.check(false, || "never".into());
        p.check(true, || "two".into());
        let e = p.into_result(()).unwrap_err();
        assert_eq!(e.to_string(), "invalid configuration:\n  - one\n  - two");
        assert_eq!(ConfigProblems::default().into_result(5), Ok(5));
    }
}
