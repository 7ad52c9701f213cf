//! Configuration validation: every problem found in a program's settings, reported together
//! so that an operator fixes them in one go ([`ConfigProblems`]).
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
