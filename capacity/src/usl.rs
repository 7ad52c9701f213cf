//! The Universal Scalability Law (Gunther): throughput X(N) = X(1)·N / (1 + σ(N−1) +
//! κN(N−1)) against concurrency N, fitted by least squares to a sweep's measurements.
//!
//! This module owns the model ([`UslFit`], [`UslFit::throughput`]) and its fit ([`fit`]) from
//! `(users, throughput)` points; turning a sweep into points and presenting the fit are the
//! report's business.
//!
//! The fit runs in three steps:
//!
//! 1. **Linear estimate.** The model rearranges to N/X = a + b(N−1) + c·N(N−1), with
//!    x1 = 1/a, σ = b/a and κ = c/a, which is linear in (a, b, c) and solved by ordinary
//!    least squares (an SVD of the column-scaled design matrix, via `nalgebra`). It needs no
//!    starting guess and is exact for noiseless data, but it minimises errors in N/X rather
//!    than in X, so it weights points unevenly: the high-N points, where N/X is large, dominate,
//!    and a few per cent of noise there pulls σ and κ noticeably.
//! 2. **Refinement.** Levenberg–Marquardt (the `levenberg-marquardt` crate) then minimises the
//!    squared residuals of X itself, in throughput units, starting from the linear estimate.
//!    If it fails, wanders to parameters that make the model meaningless (x1 ≤ 0, or a
//!    non-positive denominator at a measured N), or does not lower the residual, the linear
//!    estimate is kept.
//! 3. **Constraint.** σ and κ are costs (a serial share, a per-pair coherency delay), so as
//!    Gunther does the fit is the least-squares one under σ ≥ 0 and κ ≥ 0. A few noisy points
//!    readily pull an unconstrained fit to, say, κ < 0, which describes no system (throughput
//!    that would eventually grow faster than linearly) and hides the contention that is there.
//!    If the refined fit has σ, κ ≥ 0 it is kept. Otherwise the boundary models are fitted the
//!    same way, linear estimate then Levenberg–Marquardt: κ = 0 (Amdahl's law,
//!    N/X = a + b(N−1)) and σ = 0 (N/X = a + c·N(N−1)); and σ = κ = 0 (X = x1·N) in closed
//!    form. A boundary fit whose free parameter comes out negative is dropped; of the rest the
//!    one with the smallest residual in X is kept, and [`UslFit::constrained`] is set. Data so
//!    far outside the model that the unconstrained linear estimate itself is meaningless (a
//!    non-positive X(1), or a non-positive throughput at a measured N) remain an error rather
//!    than a constrained fit.
//!
//! `r_squared` is 1 − SS_res/SS_tot of the fitted X against the measured X. A σ or κ whose
//! whole contribution over the measured range is at rounding level is taken as exactly 0 (so a
//! tiny negative one does not count as breaking the constraint), and noiseless data with no
//! coherency cost report no peak rather than one at ~10⁹ users.

use levenberg_marquardt::{LeastSquaresProblem, LevenbergMarquardt, TerminationReason};
use nalgebra::{DMatrix, DVector, Dyn, Owned, SVD};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A fitted USL.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct UslFit {
    /// σ: contention (the serial share); ≥ 0.
    pub sigma: f64,
    /// κ: coherency (the cost of keeping state consistent, per pair); ≥ 0.
    pub kappa: f64,
    /// X(1): throughput of one user, requests per second.
    pub x1: f64,
    /// Coefficient of determination of the fitted throughput against the measured.
    pub r_squared: f64,
    /// The concurrency of peak throughput, √((1−σ)/κ); `None` when κ = 0 or σ ≥ 1 (no peak).
    pub peak_users: Option<f64>,
    /// The throughput at `peak_users`.
    pub peak_throughput: Option<f64>,
    /// Measurements fitted.
    pub points: usize,
    /// True when a bound was hit: the unconstrained fit had σ < 0 or κ < 0, so σ, κ or both
    /// were held at 0 and this is the best fit so constrained. A value at rounding level in the
    /// unconstrained fit, reported as 0, does not count.
    pub constrained: bool,
}

impl UslFit {
    /// The fitted throughput at `users`.
    pub fn throughput(&self, users: f64) -> f64 {
        self.x1 * users / (1.0 + self.sigma * (users - 1.0) + self.kappa * users * (users - 1.0))
    }
}

/// Why no fit could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum UslError {
    /// Fewer distinct concurrencies than parameters.
    #[error("{0} distinct concurrencies measured; the fit needs at least 3")]
    TooFewPoints(usize),
    /// A measurement with a non-finite or non-positive concurrency or throughput.
    #[error("point {index} (users {users}, throughput {throughput}) is not finite and positive")]
    BadPoint {
        /// Its position in the input.
        index: usize,
        /// Its concurrency.
        users: f64,
        /// Its throughput.
        throughput: f64,
    },
    /// The measurements admit no meaningful USL (e.g. a fitted X(1) that is not positive, a
    /// rank-deficient system, or non-finite parameters).
    #[error("the measurements admit no meaningful USL fit: {0}")]
    Degenerate(&'static str),
}

/// Singular values below this fraction of the largest (of the column-scaled design matrix)
/// count as zero: the concurrencies are too close together to separate the terms.
const RANK_TOLERANCE: f64 = 1e-12;

/// A σ or κ contributing less than this fraction of the denominator anywhere in the measured
/// range is rounding noise and is taken as 0.
const PARAM_NOISE: f64 = 1e-10;

/// Iteration cap for the SVD, which otherwise loops until convergence.
const SVD_MAX_ITERATIONS: usize = 10_000;

/// The parameters a fit lets vary, as indices into (x1, σ, κ), equally into the linear terms
/// (1, N−1, N(N−1)), in order; one left out is held at 0. x1 (index 0) is always free.
type Free = &'static [usize];

/// The full USL.
const FULL: Free = &[0, 1, 2];
/// Amdahl's law: κ held at 0.
const AMDAHL: Free = &[0, 1];
/// σ held at 0.
const NO_CONTENTION: Free = &[0, 2];

/// Parameters (x1, σ, κ) as one value, for the solvers.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Params {
    x1: f64,
    sigma: f64,
    kappa: f64,
}

impl Params {
    /// The denominator 1 + σ(N−1) + κN(N−1).
    fn denominator(&self, n: f64) -> f64 {
        1.0 + self.sigma * (n - 1.0) + self.kappa * n * (n - 1.0)
    }

    /// True when the parameters are finite, x1 is positive and the model is positive (finite
    /// and with a positive denominator) at every measured concurrency.
    fn is_meaningful(&self, points: &[(f64, f64)]) -> bool {
        self.x1.is_finite()
            && self.sigma.is_finite()
            && self.kappa.is_finite()
            && self.x1 > 0.0
            && points.iter().all(|&(n, _)| {
                let d = self.denominator(n);
                d.is_finite() && d > 0.0
            })
    }

    /// True when σ ≥ 0 and κ ≥ 0.
    fn is_feasible(&self) -> bool {
        self.sigma >= 0.0 && self.kappa >= 0.0
    }

    /// The `free` parameters as a vector, for the solver.
    fn to_vector(self, free: Free) -> DVector<f64> {
        let all = [self.x1, self.sigma, self.kappa];
        DVector::from_iterator(free.len(), free.iter().map(|&i| all[i]))
    }

    /// The inverse of [`Params::to_vector`]: the parameters not in `free` are 0.
    fn from_vector(v: &DVector<f64>, free: Free) -> Self {
        let mut all = [0.0; 3];
        for (&i, &value) in free.iter().zip(v.iter()) {
            all[i] = value;
        }
        Self {
            x1: all[0],
            sigma: all[1],
            kappa: all[2],
        }
    }

    /// These parameters with a σ or κ whose whole contribution over the measured range is
    /// rounding noise (see [`PARAM_NOISE`]) set to exactly 0.
    fn snapped(mut self, points: &[(f64, f64)]) -> Self {
        let n_max = points.iter().map(|&(n, _)| n).fold(0.0_f64, f64::max);
        let sigma_term = self.sigma.abs() * (n_max - 1.0);
        let kappa_term = self.kappa.abs() * n_max * (n_max - 1.0);
        let whole = 1.0 + sigma_term + kappa_term;
        if sigma_term <= PARAM_NOISE * whole {
            self.sigma = 0.0;
        }
        if kappa_term <= PARAM_NOISE * whole {
            self.kappa = 0.0;
        }
        self
    }
}

/// Fits the USL to `(users, throughput)` points: least squares in throughput under σ ≥ 0 and
/// κ ≥ 0 (see the module doc).
pub fn fit(points: &[(f64, f64)]) -> Result<UslFit, UslError> {
    validate(points)?;
    let linear = linear_estimate(points, FULL)?;
    if !linear.is_meaningful(points) {
        return Err(UslError::Degenerate(
            "the linear fit predicts non-positive throughput",
        ));
    }
    if !ss_res(points, &linear).is_finite() {
        return Err(UslError::Degenerate(
            "non-finite residuals of the linear estimate",
        ));
    }
    let unconstrained = refined_or_start(points, FULL, linear).snapped(points);
    if unconstrained.is_feasible() {
        finish(points, unconstrained, false)
    } else {
        finish(points, constrained(points), true)
    }
}

/// Checks every point and that there are at least 3 distinct concurrencies.
fn validate(points: &[(f64, f64)]) -> Result<(), UslError> {
    for (index, &(users, throughput)) in points.iter().enumerate() {
        let good = |v: f64| v.is_finite() && v > 0.0;
        if !good(users) || !good(throughput) {
            return Err(UslError::BadPoint {
                index,
                users,
                throughput,
            });
        }
    }
    let mut users: Vec<f64> = points.iter().map(|&(n, _)| n).collect();
    users.sort_by(f64::total_cmp);
    users.dedup();
    if users.len() < 3 {
        return Err(UslError::TooFewPoints(users.len()));
    }
    Ok(())
}

/// Step 1: ordinary least squares on N/X = a + b(N−1) + c·N(N−1), with only the `free` terms
/// (the others' coefficients are 0). The result has x1 > 0 but may be meaningless elsewhere
/// (a non-positive denominator); the caller checks.
///
/// The columns span 1 … N² in magnitude, so each is scaled to unit maximum before the SVD and
/// the solution unscaled after, which keeps the rank test and the solve well conditioned.
fn linear_estimate(points: &[(f64, f64)], free: Free) -> Result<Params, UslError> {
    let rows = points.len();
    let mut design = DMatrix::<f64>::from_fn(rows, free.len(), |i, j| {
        let n = points[i].0;
        match free[j] {
            0 => 1.0,
            1 => n - 1.0,
            _ => n * (n - 1.0),
        }
    });
    let rhs = DVector::<f64>::from_iterator(rows, points.iter().map(|&(n, x)| n / x));

    let mut scale = vec![1.0_f64; free.len()];
    for (j, s) in scale.iter_mut().enumerate() {
        let max = design.column(j).amax();
        if max > 0.0 && max.is_finite() {
            *s = max;
            design.column_mut(j).unscale_mut(max);
        }
    }

    let svd = SVD::try_new(design, true, true, f64::EPSILON * 5.0, SVD_MAX_ITERATIONS)
        .ok_or(UslError::Degenerate("the SVD did not converge"))?;
    let largest = svd.singular_values.max();
    let cutoff = largest * RANK_TOLERANCE;
    if !(largest.is_finite() && largest > 0.0) || svd.rank(cutoff) < free.len() {
        return Err(UslError::Degenerate(
            "the concurrencies do not determine the model's parameters",
        ));
    }
    let solution = svd
        .solve(&rhs, cutoff)
        .map_err(|_| UslError::Degenerate("the SVD could not solve the linear system"))?;

    let mut coefficients = [0.0_f64; 3];
    for (j, &term) in free.iter().enumerate() {
        coefficients[term] = solution[j] / scale[j];
    }
    let [a, b, c] = coefficients;
    if !(a.is_finite() && b.is_finite() && c.is_finite()) {
        return Err(UslError::Degenerate("non-finite linear coefficients"));
    }
    if a <= 0.0 {
        return Err(UslError::Degenerate(
            "the linear fit gives a non-positive 1/X(1)",
        ));
    }
    Ok(Params {
        x1: 1.0 / a,
        sigma: b / a,
        kappa: c / a,
    })
}

/// `start` refined by [`refine`] over the `free` parameters, or `start` itself when the
/// refinement fails or does not lower the residual. `start` must be meaningful.
fn refined_or_start(points: &[(f64, f64)], free: Free, start: Params) -> Params {
    match refine(points, free, &start) {
        Some(refined) if ss_res(points, &refined) <= ss_res(points, &start) => refined,
        _ => start,
    }
}

/// Step 2: Levenberg–Marquardt on the residuals of X over the `free` parameters. `None` when
/// it fails or ends somewhere meaningless; the caller compares residuals with the start.
fn refine(points: &[(f64, f64)], free: Free, start: &Params) -> Option<Params> {
    let problem = UslProblem {
        points,
        free,
        params: start.to_vector(free),
    };
    let (problem, report) = LevenbergMarquardt::new().minimize(problem);
    // On these the crate may leave an unaccepted trial point in the problem, or never moved.
    let failed = matches!(
        report.termination,
        TerminationReason::User(_)
            | TerminationReason::Numerical(_)
            | TerminationReason::WrongDimensions(_)
            | TerminationReason::NoParameters
            | TerminationReason::NoResiduals
    );
    if failed {
        return None;
    }
    let refined = Params::from_vector(&problem.params, free);
    refined.is_meaningful(points).then_some(refined)
}

/// Step 3: the best fit with σ, κ or both held at 0, for when the unconstrained fit breaks
/// σ ≥ 0 or κ ≥ 0. The proportional fit (both 0) is always feasible; a one-parameter boundary
/// replaces it when feasible with a strictly smaller residual.
fn constrained(points: &[(f64, f64)]) -> Params {
    let mut best = proportional(points);
    let mut best_ss = ss_res(points, &best);
    for candidate in [AMDAHL, NO_CONTENTION]
        .into_iter()
        .filter_map(|free| boundary(points, free))
    {
        let ss = ss_res(points, &candidate);
        if ss < best_ss {
            (best, best_ss) = (candidate, ss);
        }
    }
    best
}

/// The fit of x1 and one of σ, κ (`free`), the other held at 0: the linear estimate, its free
/// parameter raised to 0 if negative so the start is meaningful, then refined. `None` when
/// there is no linear estimate or the free parameter comes out negative (infeasible).
fn boundary(points: &[(f64, f64)], free: Free) -> Option<Params> {
    let mut start = linear_estimate(points, free).ok()?;
    start.sigma = start.sigma.max(0.0);
    start.kappa = start.kappa.max(0.0);
    if !start.is_meaningful(points) {
        return None;
    }
    let fitted = refined_or_start(points, free, start).snapped(points);
    fitted.is_feasible().then_some(fitted)
}

/// σ = κ = 0, X = x1·N: least squares in X gives x1 = ΣN·X / ΣN².
fn proportional(points: &[(f64, f64)]) -> Params {
    let (nx, nn) = points
        .iter()
        .fold((0.0, 0.0), |(nx, nn), &(n, x)| (nx + n * x, nn + n * n));
    Params {
        x1: nx / nn,
        sigma: 0.0,
        kappa: 0.0,
    }
}

/// The least-squares problem in throughput units: residual_i = X̂(N_i) − X_i over the `free`
/// parameters, the others held at 0.
#[derive(Debug)]
struct UslProblem<'a> {
    points: &'a [(f64, f64)],
    free: Free,
    params: DVector<f64>,
}

impl LeastSquaresProblem<f64, Dyn, Dyn> for UslProblem<'_> {
    type ResidualStorage = Owned<f64, Dyn>;
    type JacobianStorage = Owned<f64, Dyn, Dyn>;
    type ParameterStorage = Owned<f64, Dyn>;

    fn set_params(&mut self, x: &DVector<f64>) {
        self.params.copy_from(x);
    }

    fn params(&self) -> DVector<f64> {
        self.params.clone()
    }

    fn residuals(&self) -> Option<DVector<f64>> {
        let p = Params::from_vector(&self.params, self.free);
        let mut out = DVector::<f64>::zeros(self.points.len());
        for (r, &(n, x)) in out.iter_mut().zip(self.points) {
            let d = p.denominator(n);
            if !(d.is_finite() && d > 0.0) {
                return None;
            }
            *r = p.x1 * n / d - x;
            if !r.is_finite() {
                return None;
            }
        }
        Some(out)
    }

    fn jacobian(&self) -> Option<DMatrix<f64>> {
        let p = Params::from_vector(&self.params, self.free);
        let mut jac = DMatrix::<f64>::zeros(self.points.len(), self.free.len());
        for (i, &(n, _)) in self.points.iter().enumerate() {
            let d = p.denominator(n);
            if !(d.is_finite() && d > 0.0) {
                return None;
            }
            // X̂ = x1·N/D: ∂/∂x1 = N/D, ∂/∂σ = −x1·N·(N−1)/D², ∂/∂κ = −x1·N·N(N−1)/D².
            let model_over_d = p.x1 * n / (d * d);
            let partials = [
                n / d,
                -model_over_d * (n - 1.0),
                -model_over_d * n * (n - 1.0),
            ];
            for (j, &param) in self.free.iter().enumerate() {
                jac[(i, j)] = partials[param];
            }
        }
        jac.iter().all(|v| v.is_finite()).then_some(jac)
    }
}

/// Sum of squared residuals of X.
fn ss_res(points: &[(f64, f64)], p: &Params) -> f64 {
    points
        .iter()
        .map(|&(n, x)| {
            let r = p.x1 * n / p.denominator(n) - x;
            r * r
        })
        .sum()
}

/// Goodness of fit and the peak; `constrained` is passed through to [`UslFit::constrained`].
fn finish(points: &[(f64, f64)], p: Params, constrained: bool) -> Result<UslFit, UslError> {
    if !p.is_meaningful(points) {
        return Err(UslError::Degenerate(
            "non-finite or non-positive fitted model",
        ));
    }

    let count = points.len() as f64;
    let mean = points.iter().map(|&(_, x)| x).sum::<f64>() / count;
    let ss_tot: f64 = points.iter().map(|&(_, x)| (x - mean) * (x - mean)).sum();
    let ss_res = ss_res(points, &p);
    let r_squared = if ss_tot > 0.0 {
        1.0 - ss_res / ss_tot
    } else {
        // Flat throughput: a perfect fit if the residuals are rounding noise, none otherwise.
        let scale: f64 = points.iter().map(|&(_, x)| x * x).sum();
        if ss_res <= scale * 1e-20 { 1.0 } else { 0.0 }
    };
    if !r_squared.is_finite() {
        return Err(UslError::Degenerate(
            "non-finite coefficient of determination",
        ));
    }

    let mut fitted = UslFit {
        sigma: p.sigma,
        kappa: p.kappa,
        x1: p.x1,
        r_squared,
        peak_users: None,
        peak_throughput: None,
        points: points.len(),
        constrained,
    };
    if p.kappa > 0.0 && p.sigma < 1.0 {
        let peak = ((1.0 - p.sigma) / p.kappa).sqrt();
        let at_peak = fitted.throughput(peak);
        if peak.is_finite() && at_peak.is_finite() {
            fitted.peak_users = Some(peak);
            fitted.peak_throughput = Some(at_peak);
        }
    }
    Ok(fitted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(sigma: f64, kappa: f64, x1: f64, n: f64) -> f64 {
        x1 * n / (1.0 + sigma * (n - 1.0) + kappa * n * (n - 1.0))
    }

    fn synthetic(sigma: f64, kappa: f64, x1: f64, users: &[f64]) -> Vec<(f64, f64)> {
        users
            .iter()
            .map(|&n| (n, model(sigma, kappa, x1, n)))
            .collect()
    }

    fn rel(got: f64, want: f64) -> f64 {
        ((got - want) / want).abs()
    }

    /// Deterministic pseudo-noise in [−amplitude, +amplitude] (a fixed LCG, no RNG crate).
    fn noise(amplitude: f64, count: usize) -> Vec<f64> {
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        (0..count)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                let unit = (state >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
                amplitude * (2.0 * unit - 1.0)
            })
            .collect()
    }

    const POWERS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

    #[test]
    fn recovers_known_parameters() {
        let got = fit(&synthetic(0.05, 0.0002, 1000.0, &POWERS)).expect("fit");
        assert!(rel(got.sigma, 0.05) < 0.01, "{got:?}");
        assert!(rel(got.kappa, 0.0002) < 0.01, "{got:?}");
        assert!(rel(got.x1, 1000.0) < 0.01, "{got:?}");
        assert!(got.r_squared > 0.9999, "{got:?}");
        assert_eq!(got.points, 8);
    }

    #[test]
    fn recovers_heavier_contention() {
        let users: Vec<f64> = (1..=40).step_by(3).map(f64::from).collect();
        let got = fit(&synthetic(0.2, 0.001, 250.0, &users)).expect("fit");
        assert!(rel(got.sigma, 0.2) < 0.01, "{got:?}");
        assert!(rel(got.kappa, 0.001) < 0.01, "{got:?}");
        assert!(rel(got.x1, 250.0) < 0.01, "{got:?}");
        assert!(got.r_squared > 0.9999, "{got:?}");
        assert_eq!(got.points, users.len());
    }

    #[test]
    fn no_coherency_means_no_peak() {
        let got = fit(&synthetic(0.1, 0.0, 500.0, &POWERS)).expect("fit");
        assert!(got.kappa.abs() < 1e-9, "{got:?}");
        assert!(rel(got.sigma, 0.1) < 0.01, "{got:?}");
        assert!(rel(got.x1, 500.0) < 0.01, "{got:?}");
        assert_eq!(got.peak_users, None);
        assert_eq!(got.peak_throughput, None);
        assert!(got.r_squared > 0.9999, "{got:?}");
    }

    #[test]
    fn peak_matches_closed_form() {
        let (sigma, kappa, x1) = (0.05, 0.0002, 1000.0);
        let got = fit(&synthetic(sigma, kappa, x1, &POWERS)).expect("fit");
        let want = ((1.0 - sigma) / kappa).sqrt();
        let peak = got.peak_users.expect("a peak");
        assert!(rel(peak, want) < 0.01, "{peak} vs {want}");
        let at_peak = got.peak_throughput.expect("a peak throughput");
        assert!(
            rel(at_peak, model(sigma, kappa, x1, want)) < 0.01,
            "{at_peak}"
        );
        // It is a maximum of the fitted curve.
        assert!(at_peak >= got.throughput(peak * 0.9));
        assert!(at_peak >= got.throughput(peak * 1.1));
    }

    #[test]
    fn noisy_data_still_fits() {
        let (sigma, kappa, x1) = (0.05, 0.0002, 1000.0);
        let users: Vec<f64> = (1..=128).step_by(4).map(f64::from).collect();
        let jitter = noise(0.02, users.len());
        let points: Vec<(f64, f64)> = users
            .iter()
            .zip(&jitter)
            .map(|(&n, e)| (n, model(sigma, kappa, x1, n) * (1.0 + e)))
            .collect();
        let got = fit(&points).expect("fit");
        assert!(rel(got.sigma, sigma) < 0.2, "{got:?}");
        assert!(rel(got.kappa, kappa) < 0.2, "{got:?}");
        assert!(rel(got.x1, x1) < 0.05, "{got:?}");
        assert!(got.r_squared > 0.95, "{got:?}");

        // The refinement is never worse than the linear start in throughput units.
        let linear = linear_estimate(&points, FULL).expect("linear");
        let refined = Params {
            x1: got.x1,
            sigma: got.sigma,
            kappa: got.kappa,
        };
        assert!(ss_res(&points, &refined) <= ss_res(&points, &linear));
    }

    #[test]
    fn replicated_concurrencies_are_fine() {
        let mut points = synthetic(0.05, 0.0002, 1000.0, &POWERS);
        points.extend(synthetic(0.05, 0.0002, 1000.0, &[4.0, 16.0]));
        let got = fit(&points).expect("fit");
        assert_eq!(got.points, 10);
        assert!(rel(got.sigma, 0.05) < 0.01, "{got:?}");
    }

    #[test]
    fn too_few_points() {
        let two = synthetic(0.05, 0.0002, 1000.0, &[1.0, 2.0]);
        assert_eq!(fit(&two), Err(UslError::TooFewPoints(2)));
        assert_eq!(fit(&[]), Err(UslError::TooFewPoints(0)));
        // Three points but only two distinct concurrencies.
        let repeated = [(1.0, 100.0), (2.0, 180.0), (2.0, 181.0)];
        assert_eq!(fit(&repeated), Err(UslError::TooFewPoints(2)));
    }

    #[test]
    fn bad_points_are_rejected() {
        let mut zero = synthetic(0.05, 0.0002, 1000.0, &POWERS);
        zero[3].1 = 0.0;
        assert!(matches!(
            fit(&zero),
            Err(UslError::BadPoint { index: 3, .. })
        ));

        let mut nan = synthetic(0.05, 0.0002, 1000.0, &POWERS);
        nan[5].1 = f64::NAN;
        assert!(matches!(
            fit(&nan),
            Err(UslError::BadPoint { index: 5, .. })
        ));

        let mut users = synthetic(0.05, 0.0002, 1000.0, &POWERS);
        users[0].0 = -1.0;
        assert!(matches!(
            fit(&users),
            Err(UslError::BadPoint { index: 0, .. })
        ));

        let mut inf = synthetic(0.05, 0.0002, 1000.0, &POWERS);
        inf[7].1 = f64::INFINITY;
        assert!(matches!(
            fit(&inf),
            Err(UslError::BadPoint { index: 7, .. })
        ));
    }

    #[test]
    fn throughput_rising_faster_than_linear_is_degenerate() {
        // N/X falls with N, so 1/X(1) comes out negative or the model goes non-positive.
        let points = [(1.0, 10.0), (2.0, 100.0), (3.0, 1000.0), (4.0, 10_000.0)];
        assert!(
            matches!(fit(&points), Err(UslError::Degenerate(_))),
            "{:?}",
            fit(&points)
        );
    }

    #[test]
    fn flat_throughput_is_fully_serial() {
        let points = [(1.0, 100.0), (2.0, 100.0), (4.0, 100.0), (8.0, 100.0)];
        let got = fit(&points).expect("fit");
        assert!((got.sigma - 1.0).abs() < 1e-6, "{got:?}");
        assert!(got.r_squared.is_finite());
        assert_eq!(got.peak_users, None);
    }

    /// Every fit `fit` reports satisfies the bounds.
    fn assert_feasible(got: &UslFit) {
        assert!(got.sigma >= 0.0 && got.kappa >= 0.0, "{got:?}");
    }

    #[test]
    fn measured_negative_kappa_is_held_at_zero() {
        // A real sweep whose unconstrained fit gives κ ≈ −0.0015.
        let points = [(1.0, 578.0), (4.0, 1556.0), (16.0, 2750.0), (64.0, 5648.0)];
        let linear = linear_estimate(&points, FULL).expect("linear");
        let unconstrained = refined_or_start(&points, FULL, linear);
        assert!(unconstrained.kappa < 0.0, "{unconstrained:?}");

        let got = fit(&points).expect("fit");
        assert_eq!(got.kappa, 0.0, "{got:?}");
        assert_feasible(&got);
        assert!(got.constrained, "{got:?}");
        assert!(got.r_squared.is_finite() && got.r_squared <= 1.0, "{got:?}");
        assert_eq!(got.peak_users, None);
        assert_eq!(got.peak_throughput, None);
        assert_eq!(got.points, 4);

        // The least-squares fit on κ = 0: no nearby (x1, σ ≥ 0) does better, nor do the other
        // boundaries.
        let at = |x1: f64, sigma: f64| {
            ss_res(
                &points,
                &Params {
                    x1,
                    sigma,
                    kappa: 0.0,
                },
            )
        };
        let best = at(got.x1, got.sigma);
        for (dx, ds) in [(1.001, 1.0), (0.999, 1.0), (1.0, 1.001), (1.0, 0.999)] {
            assert!(best <= at(got.x1 * dx, got.sigma * ds), "{got:?}");
        }
        assert!(best <= ss_res(&points, &proportional(&points)));
        if let Some(other) = boundary(&points, NO_CONTENTION) {
            assert!(best <= ss_res(&points, &other));
        }
    }

    #[test]
    fn negative_kappa_tendency_is_held_at_zero() {
        let users = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];
        let got = fit(&synthetic(0.1, -0.0005, 1000.0, &users)).expect("fit");
        assert_eq!(got.kappa, 0.0, "{got:?}");
        assert_feasible(&got);
        assert!(got.constrained, "{got:?}");
        assert_eq!(got.peak_users, None);
    }

    #[test]
    fn superlinear_tendency_falls_back_to_linear_scaling() {
        // σ < 0 with κ = 0: every one-parameter boundary comes out negative, so σ = κ = 0.
        let got = fit(&synthetic(-0.001, 0.0, 100.0, &POWERS[..7])).expect("fit");
        assert_eq!((got.sigma, got.kappa), (0.0, 0.0), "{got:?}");
        assert!(got.constrained, "{got:?}");
        assert!(
            rel(
                got.x1,
                proportional(&synthetic(-0.001, 0.0, 100.0, &POWERS[..7])).x1
            ) < 1e-12
        );
    }

    #[test]
    fn coherency_without_contention_is_recovered() {
        let got = fit(&synthetic(0.0, 0.0002, 1000.0, &POWERS)).expect("fit");
        assert_feasible(&got);
        assert!(got.sigma < 1e-6, "{got:?}");
        assert!(rel(got.kappa, 0.0002) < 0.01, "{got:?}");
        assert!(rel(got.x1, 1000.0) < 0.01, "{got:?}");
        assert!(got.r_squared > 0.9999, "{got:?}");
        assert!(got.peak_users.is_some(), "{got:?}");
    }

    #[test]
    fn feasible_fits_are_not_flagged() {
        let got = fit(&synthetic(0.05, 0.0002, 1000.0, &POWERS)).expect("fit");
        assert!(!got.constrained, "{got:?}");
        // A κ of 0 within rounding does not count as a bound hit either.
        let got = fit(&synthetic(0.1, 0.0, 500.0, &POWERS)).expect("fit");
        assert_eq!(got.kappa, 0.0, "{got:?}");
        assert!(!got.constrained, "{got:?}");
    }
}
