//! A plain HTTP GET on 127.0.0.1 (a program's `/metrics`, Prometheus's API in the system
//! tier), with ureq: a status other than 2xx is an error, never a body read as if it were
//! the answer.

use std::net::SocketAddr;
use std::time::Duration;

/// How long a GET waits to connect: the servers asked are on this machine and listening,
/// so a connection that takes longer is a server that is not there.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a whole GET may take: a scrape or an API query answers in milliseconds; this
/// only stops a hung server from stalling the test.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// An agent for 127.0.0.1: no proxy (whatever the environment says), bounded waits, and
/// statuses over 299 reported as errors.
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .proxy(None)
        .timeout_connect(Some(CONNECT_TIMEOUT))
        .timeout_global(Some(ANSWER_TIMEOUT))
        .http_status_as_error(true)
        .build()
        .new_agent()
}

/// The body of `GET http://{to}{path}`; an error when nothing answers or the status is not
/// a success.
pub fn get(to: SocketAddr, path: &str) -> Result<String, ureq::Error> {
    get_query(to, path, &[])
}

/// As [`get`], with `query`'s pairs percent-encoded into the URL's query.
pub fn get_query(
    to: SocketAddr,
    path: &str,
    query: &[(&str, &str)],
) -> Result<String, ureq::Error> {
    let mut request = agent().get(format!("http://{to}{path}"));
    for (k, v) in query {
        request = request.query(*k, *v);
    }
    request.call()?.body_mut().read_to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::io::{BufRead, BufReader, Write};

    /// A server that answers one request with `status` and a body, and returns the
    /// request's first line.
    fn answer_once(status: &'static str) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let served = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut lines = BufReader::new(s.try_clone().unwrap()).lines();
            let first = lines.next().unwrap().unwrap();
            for line in lines.by_ref() {
                if line.unwrap().is_empty() {
                    break;
                }
            }
            let body = "the body";
            write!(
                &s,
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            first
        });
        (addr, served)
    }

    #[test]
    fn a_success_gives_the_body_and_the_query_is_encoded() {
        let (addr, served) = answer_once("200 OK");
        let body = get_query(addr, "/api", &[("query", "up{job=\"a b\"}")]).unwrap();
        assert_eq!(body, "the body");
        let first = served.join().unwrap();
        let target = first
            .strip_prefix("GET ")
            .and_then(|r| r.strip_suffix(" HTTP/1.1"))
            .unwrap_or_else(|| panic!("{first}"));
        assert!(target.starts_with("/api?query=up"), "{first}");
        assert!(
            !target.contains(['"', '{', ' ']),
            "the query is percent-encoded: {first}"
        );
    }

    #[test]
    fn a_status_that_is_not_a_success_is_an_error_not_a_body() {
        let (addr, served) = answer_once("404 Not Found");
        match get(addr, "/metrics") {
            Err(ureq::Error::StatusCode(404)) => {}
            other => panic!("{other:?}"),
        }
        served.join().unwrap();
    }
}
