//! Simulated service times, for capacity experiments with a known truth: each call draws a
//! time from a distribution (`--service-time`), and either waits it out without using the
//! CPU (the default: a handler that waits on a database, say) or burns the CPU for it
//! (`--service-work`: a CPU-bound handler, so that a provider can saturate).
//!
//! Owns the distributions (their parsing, sampling and mean) and the wrapping of handlers.
//! Waiting precisely is the session's (it holds the answers until their instant on a
//! `PreciseTimer`): Tokio's own timer would add about a millisecond to every call. (A
//! handler that answers later, none of the built-in ones, waits out the rest of its time
//! on Tokio's timer, sleeping in either mode.)
//!
//! | `--service-time` | distribution |
//! |---|---|
//! | `5ms` or `fixed:5ms` | always 5 ms |
//! | `uniform:1ms,9ms` | uniform between 1 and 9 ms (mean 5 ms) |
//! | `exp:5ms` | exponential with mean 5 ms (memoryless, as an M/M/1 queue assumes) |
//! | `lognormal:5ms,50ms` | log-normal with median 5 ms and p99 50 ms (the long tail real services have) |

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rpcmesh_common::cli::DurationArg;
use rpcmesh_common::cli::values::parse_duration;
use rpcmesh_wire::proto::rpc::RpcRequest;

use super::{Handler, Outcome};

/// The standard normal quantile of 0.99: a log-normal's p99 is `median · e^(σ·Z99)`.
const Z99: f64 = 2.326_347_874_040_841;

/// A service-time distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServiceTime {
    /// Always this long.
    Fixed(Duration),
    /// Uniform between two bounds.
    Uniform {
        /// Shortest.
        min: Duration,
        /// Longest.
        max: Duration,
    },
    /// Exponential with this mean.
    Exponential {
        /// The mean.
        mean: Duration,
    },
    /// Log-normal with this median and 99th percentile.
    LogNormal {
        /// The median.
        p50: Duration,
        /// The 99th percentile.
        p99: Duration,
    },
}

impl ServiceTime {
    /// True when calls take no simulated time at all (every draw is zero).
    pub fn is_zero(&self) -> bool {
        self.mean().is_zero()
    }

    /// The distribution's mean.
    pub fn mean(&self) -> Duration {
        match *self {
            ServiceTime::Fixed(d) => d,
            ServiceTime::Uniform { min, max } => (min + max) / 2,
            ServiceTime::Exponential { mean } => mean,
            ServiceTime::LogNormal { p50, p99 } => {
                let (mu, sigma) = log_normal(p50, p99);
                Duration::from_secs_f64((mu + sigma * sigma / 2.0).exp())
            }
        }
    }

    /// Draws one service time.
    pub fn sample(&self, rng: &mut fastrand::Rng) -> Duration {
        match *self {
            ServiceTime::Fixed(d) => d,
            ServiceTime::Uniform { min, max } => min + (max - min).mul_f64(rng.f64()),
            ServiceTime::Exponential { mean } => {
                // 1 - U is in (0, 1]: its logarithm is finite.
                mean.mul_f64(-(1.0 - rng.f64()).ln())
            }
            ServiceTime::LogNormal { p50, p99 } => {
                let (mu, sigma) = log_normal(p50, p99);
                Duration::from_secs_f64((mu + sigma * standard_normal(rng)).exp())
            }
        }
    }
}

/// μ and σ of the log-normal with median `p50` and 99th percentile `p99` (in seconds).
fn log_normal(p50: Duration, p99: Duration) -> (f64, f64) {
    let mu = p50.as_secs_f64().ln();
    let sigma = (p99.as_secs_f64() / p50.as_secs_f64()).ln() / Z99;
    (mu, sigma)
}

/// One draw of the standard normal (Box–Muller).
fn standard_normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = 1.0 - rng.f64();
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl FromStr for ServiceTime {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let expected = "expected DURATION, fixed:D, uniform:MIN,MAX, exp:MEAN or lognormal:P50,P99";
        let (kind, args) = s.split_once(':').unwrap_or(("fixed", s));
        let args: Vec<Duration> = args
            .split(',')
            .map(|a| parse_duration(a.trim()))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{s}: {e} ({expected})"))?;
        let t = match (kind, args.as_slice()) {
            ("fixed", [d]) => ServiceTime::Fixed(*d),
            ("uniform", [min, max]) if min <= max => ServiceTime::Uniform {
                min: *min,
                max: *max,
            },
            ("exp", [mean]) => ServiceTime::Exponential { mean: *mean },
            ("lognormal", [p50, p99]) if !p50.is_zero() && p50 < p99 => ServiceTime::LogNormal {
                p50: *p50,
                p99: *p99,
            },
            ("uniform", [_, _]) => return Err(format!("{s}: MIN is above MAX")),
            ("lognormal", [_, _]) => {
                return Err(format!("{s}: P50 must be above zero and below P99"));
            }
            _ => return Err(format!("{s}: {expected}")),
        };
        Ok(t)
    }
}

impl fmt::Display for ServiceTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = DurationArg;
        match *self {
            ServiceTime::Fixed(t) => write!(f, "{}", d(t)),
            ServiceTime::Uniform { min, max } => write!(f, "uniform:{},{}", d(min), d(max)),
            ServiceTime::Exponential { mean } => write!(f, "exp:{}", d(mean)),
            ServiceTime::LogNormal { p50, p99 } => write!(f, "lognormal:{},{}", d(p50), d(p99)),
        }
    }
}

/// How a drawn service time is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServiceMode {
    /// Waiting, without the CPU: the answer is held until its time comes.
    #[default]
    Sleep,
    /// Working: the handler burns the CPU for the drawn time (the session's thread is busy
    /// all along, as with a real CPU-bound handler).
    Work,
}

impl fmt::Display for ServiceMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServiceMode::Sleep => "sleep",
            ServiceMode::Work => "work",
        })
    }
}

thread_local! {
    /// Each thread draws from its own generator: no lock on the call path.
    static RNG: std::cell::RefCell<fastrand::Rng> = std::cell::RefCell::new(fastrand::Rng::new());
}

/// A handler that takes a drawn service time before its answer goes out.
pub(super) struct Timed {
    pub inner: Arc<dyn Handler>,
    pub time: ServiceTime,
    pub mode: ServiceMode,
}

impl Handler for Timed {
    fn call(&self, request: RpcRequest, out: &mut BytesMut) -> Outcome {
        let started = Instant::now();
        let until = started + RNG.with(|rng| self.time.sample(&mut rng.borrow_mut()));
        match (self.inner.call(request, out), self.mode) {
            (Outcome::Ready(r), ServiceMode::Sleep) => Outcome::At(until, r),
            (Outcome::Ready(r), ServiceMode::Work) => {
                // Burn the CPU: nothing else runs on this thread meanwhile, as with real work.
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
                Outcome::Ready(r)
            }
            (Outcome::At(at, r), _) => Outcome::At(at.max(until), r),
            (Outcome::Later(f), _) => Outcome::Later(Box::pin(async move {
                let r = f.await;
                // An answer that was itself awaited waits out the rest on Tokio's timer.
                tokio::time::sleep_until(until.into()).await;
                r
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(t: ServiceTime, n: usize) -> Vec<f64> {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut v: Vec<f64> = (0..n).map(|_| t.sample(&mut rng).as_secs_f64()).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len() as f64
    }

    fn quantile(v: &[f64], q: f64) -> f64 {
        v[((v.len() - 1) as f64 * q) as usize]
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_flag_reads_back_what_it_prints() {
        for s in [
            "5ms",
            "uniform:1ms,9ms",
            "exp:5ms",
            "lognormal:5ms,50ms",
            "200us",
        ] {
            let t: ServiceTime = s.parse().unwrap();
            assert_eq!(t.to_string().parse::<ServiceTime>(), Ok(t), "{s}");
        }
        assert_eq!("fixed:2ms".parse(), Ok(ServiceTime::Fixed(2 * MS)));
        for bad in [
            "uniform:9ms,1ms",
            "lognormal:5ms,1ms",
            "exp:1ms,2ms",
            "gauss:1ms",
            "soon",
        ] {
            assert!(bad.parse::<ServiceTime>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_fixed_time_is_always_the_same() {
        let v = draws(ServiceTime::Fixed(5 * MS), 100);
        assert!(v.iter().all(|x| (*x - 0.005).abs() < 1e-12));
    }

    #[test]
    fn uniform_draws_stay_in_bounds_with_the_mean_in_the_middle() {
        let t = ServiceTime::Uniform {
            min: MS,
            max: 9 * MS,
        };
        let v = draws(t, 100_000);
        assert!(v[0] >= 0.001 && v[v.len() - 1] <= 0.009);
        assert!((mean(&v) - 0.005).abs() < 0.005 * 0.01, "{}", mean(&v));
        assert_eq!(t.mean(), 5 * MS);
    }

    #[test]
    fn exponential_draws_have_their_mean_and_median() {
        let t = ServiceTime::Exponential { mean: 5 * MS };
        let v = draws(t, 200_000);
        assert!((mean(&v) - 0.005).abs() < 0.005 * 0.01, "{}", mean(&v));
        // The median of an exponential is mean · ln 2.
        let p50 = quantile(&v, 0.5);
        assert!(
            (p50 - 0.005 * std::f64::consts::LN_2).abs() < 0.005 * 0.02,
            "{p50}"
        );
    }

    #[test]
    fn log_normal_draws_have_the_median_and_p99_asked_for() {
        let t = ServiceTime::LogNormal {
            p50: 5 * MS,
            p99: 50 * MS,
        };
        let v = draws(t, 200_000);
        let (p50, p99) = (quantile(&v, 0.5), quantile(&v, 0.99));
        assert!((p50 - 0.005).abs() < 0.005 * 0.02, "p50 {p50}");
        assert!((p99 - 0.050).abs() < 0.050 * 0.03, "p99 {p99}");
        let m = t.mean().as_secs_f64();
        assert!((mean(&v) - m).abs() < m * 0.02, "mean {} vs {m}", mean(&v));
    }
}
