//! The three bodies of RPCF v1: a request (service, method, payload), a response (status,
//! payload) and a heartbeat (service name, node id, clock, extra pairs).
//!
//! Pure, like [`crate::frame`], which owns the header, the CRC and the frame around a body.
//! The payload inside a request or response body is the protobuf envelope, read and written
//! by [`crate::envelope`].

use bytes::{BufMut, Bytes, BytesMut};

use crate::frame::{Flags, FrameError, FrameWriter, MsgType, be_u32, be_u64};

/// The body prefixes of a request and of a response, written in place so that the payload
/// can be encoded straight after them.
impl FrameWriter {
    /// Starts a request frame and writes the service and method names; the caller then
    /// appends the payload bytes.
    pub fn begin_request(
        dst: &mut BytesMut,
        flags: Flags,
        req_id: u64,
        service: &[u8],
        method: &[u8],
    ) -> Result<Self, FrameError> {
        FrameWriter::begin_request_after(dst, flags, req_id, &[], service, method)
    }

    /// As [`FrameWriter::begin_request`], behind an extension block (`crate::ext`): a
    /// non-empty `block` makes the frame an extension request carrying it before the
    /// v1 request body; an empty one, a plain request.
    pub fn begin_request_after(
        dst: &mut BytesMut,
        flags: Flags,
        req_id: u64,
        block: &[u8],
        service: &[u8],
        method: &[u8],
    ) -> Result<Self, FrameError> {
        let msg_type = if block.is_empty() {
            MsgType::Request
        } else {
            MsgType::ExtRequest
        };
        let mut w = FrameWriter::begin(dst, msg_type, flags, req_id);
        dst.extend_from_slice(block);
        put_short_str(dst, service)?;
        put_short_str(dst, method)?;
        w.payload_len_at = Some(dst.len());
        dst.put_u32(0);
        Ok(w)
    }

    /// Starts a response frame and writes the status; the caller then appends the payload.
    pub fn begin_response(dst: &mut BytesMut, flags: Flags, req_id: u64, status: u8) -> Self {
        let mut w = FrameWriter::begin(dst, MsgType::Response, flags, req_id);
        dst.put_u8(status);
        w.payload_len_at = Some(dst.len());
        dst.put_u32(0);
        w
    }
}

/// A request body: `service`, `method` (both UTF-8, checked) and the payload. All three
/// are slices of the frame body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Service name bytes (valid UTF-8).
    pub service: Bytes,
    /// Method name bytes (valid UTF-8).
    pub method: Bytes,
    /// Protobuf `rpc.RpcRequest`, zlib-compressed when the frame says so.
    pub payload: Bytes,
}

impl Request {
    /// Splits a request body.
    pub fn parse(body: &Bytes) -> Result<Request, FrameError> {
        let (service, method, payload_at) = request_names(body)?;
        let payload = read_payload(body, payload_at, "request")?;
        Ok(Request {
            service: body.slice(service),
            method: body.slice(method),
            payload,
        })
    }

    /// The service name, for messages.
    pub fn service_name(&self) -> &str {
        std::str::from_utf8(&self.service).unwrap_or("<non-utf8>")
    }

    /// The method name, for messages.
    pub fn method_name(&self) -> &str {
        std::str::from_utf8(&self.method).unwrap_or("<non-utf8>")
    }

    /// Appends this request as a whole frame.
    pub fn put(&self, dst: &mut BytesMut, flags: Flags, req_id: u64) -> Result<(), FrameError> {
        let w = FrameWriter::begin_request(dst, flags, req_id, &self.service, &self.method)?;
        dst.extend_from_slice(&self.payload);
        w.finish(dst)
    }
}

/// Reads only the service and method names of a request body, as the broker does, and
/// checks that the payload length adds up. Returns the byte ranges of both names.
pub fn request_names(
    body: &[u8],
) -> Result<(std::ops::Range<usize>, std::ops::Range<usize>, usize), FrameError> {
    let bad = |reason| FrameError::BadBody {
        what: "request",
        reason,
    };
    let service = short_str_range(body, 0).ok_or_else(|| bad("service name overruns the body"))?;
    let method =
        short_str_range(body, service.end).ok_or_else(|| bad("method name overruns the body"))?;
    if !is_utf8(&body[service.clone()]) || !is_utf8(&body[method.clone()]) {
        return Err(bad("service or method name is not UTF-8"));
    }
    let payload_at = method.end;
    let p = body
        .get(payload_at..payload_at + 4)
        .ok_or_else(|| bad("payload length overruns the body"))?;
    if payload_at + 4 + be_u32(p) as usize != body.len() {
        return Err(bad("payload length does not match the body length"));
    }
    Ok((service, method, payload_at))
}

/// The service and method names of a request whose body is still arriving, when `head`
/// (its first bytes) holds them whole and they are UTF-8: what a reader that answers the
/// call before its body comes counts it under.
pub fn request_names_head(head: &[u8]) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let service = short_str_range(head, 0)?;
    let method = short_str_range(head, service.end)?;
    (is_utf8(&head[service.clone()]) && is_utf8(&head[method.clone()])).then_some((service, method))
}

/// Whether `s` is UTF-8. Names are ASCII in practice, and checking that takes a word at a
/// time, where `from_utf8` walks a short string byte by byte: this check runs twice per
/// call the broker forwards.
fn is_utf8(s: &[u8]) -> bool {
    s.is_ascii() || std::str::from_utf8(s).is_ok()
}

/// The service name of a request body whose names were already checked
/// ([`request_names`]); empty if the body is too short.
pub fn request_service(body: &[u8]) -> &[u8] {
    short_str_range(body, 0)
        .and_then(|r| body.get(r))
        .unwrap_or_default()
}

/// A response body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// Status byte as sent (see [`crate::status::Status`]).
    pub status: u8,
    /// Protobuf `rpc.RpcResponse`, zlib-compressed when the frame says so.
    pub payload: Bytes,
}

impl Response {
    /// Splits a response body.
    pub fn parse(body: &Bytes) -> Result<Response, FrameError> {
        let status = *body.first().ok_or(FrameError::BadBody {
            what: "response",
            reason: "empty body",
        })?;
        let payload = read_payload(body, 1, "response")?;
        Ok(Response { status, payload })
    }

    /// Appends this response as a whole frame.
    pub fn put(&self, dst: &mut BytesMut, flags: Flags, req_id: u64) -> Result<(), FrameError> {
        let w = FrameWriter::begin_response(dst, flags, req_id, self.status);
        dst.extend_from_slice(&self.payload);
        w.finish(dst)
    }
}

/// A heartbeat body. Rare, so its fields are owned.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Heartbeat {
    /// Name of the sender's service (or role).
    pub service_name: String,
    /// Name of the sending node.
    pub node_id: String,
    /// Sender's clock, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// Extra key/value pairs, in order.
    pub extra: Vec<(String, String)>,
}

impl Heartbeat {
    /// Parses a heartbeat body.
    pub fn parse(body: &[u8]) -> Result<Heartbeat, FrameError> {
        let mut extra = Vec::new();
        let (service_name, node_id, timestamp_ms) = walk_heartbeat(body, |k, v| {
            if extra.len() < usize::from(u16::MAX) {
                extra.push((k.to_string(), v.to_string()));
            }
        })?;
        Ok(Heartbeat {
            service_name: service_name.to_string(),
            node_id: node_id.to_string(),
            timestamp_ms,
            extra,
        })
    }

    /// The value of the first extra pair named `key` in heartbeat body `body`, read in
    /// place (nothing allocated: the broker reads its providers' answers every second on
    /// every connection); `Ok(None)` when the pair is not there.
    pub fn extra_value_in<'a>(body: &'a [u8], key: &str) -> Result<Option<&'a str>, FrameError> {
        let mut found = None;
        walk_heartbeat(body, |k, v| {
            if found.is_none() && k == key {
                found = Some(v);
            }
        })?;
        Ok(found)
    }

    /// Appends this heartbeat as a whole frame.
    pub fn put(&self, dst: &mut BytesMut, req_id: u64) -> Result<(), FrameError> {
        put_heartbeat(
            dst,
            req_id,
            &self.service_name,
            &self.node_id,
            self.timestamp_ms,
            &self.extra,
        )
    }

    /// Appends the heartbeat every rpcmesh program sends and answers with: from
    /// `service_name` on `node_id`, stamped now, no extra pairs (nothing allocated).
    pub fn put_now(
        dst: &mut BytesMut,
        req_id: u64,
        service_name: &str,
        node_id: &str,
    ) -> Result<(), FrameError> {
        Heartbeat::put_now_with::<&str, &str>(dst, req_id, service_name, node_id, &[])
    }

    /// The same, with `extra` pairs (rpcmesh's own questions and answers, which plain v1
    /// peers are never sent), owned or borrowed.
    pub fn put_now_with<K: AsRef<str>, V: AsRef<str>>(
        dst: &mut BytesMut,
        req_id: u64,
        service_name: &str,
        node_id: &str,
        extra: &[(K, V)],
    ) -> Result<(), FrameError> {
        put_heartbeat(dst, req_id, service_name, node_id, now_ms(), extra)
    }

    /// The value of the first extra pair named `key`, if any.
    pub fn extra_value(&self, key: &str) -> Option<&str> {
        self.extra
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Checks heartbeat body `body` whole and hands each extra pair to `pair`, in order;
/// returns the service name, the node id and the timestamp, all read in place.
fn walk_heartbeat<'a>(
    body: &'a [u8],
    mut pair: impl FnMut(&'a str, &'a str),
) -> Result<(&'a str, &'a str, u64), FrameError> {
    let bad = |reason| FrameError::BadBody {
        what: "heartbeat",
        reason,
    };
    let mut at = 0;
    let string = |at: &mut usize| -> Result<&'a str, FrameError> {
        let r = short_str_range(body, *at).ok_or_else(|| bad("string overruns the body"))?;
        *at = r.end;
        std::str::from_utf8(&body[r]).map_err(|_| bad("string is not UTF-8"))
    };
    let service_name = string(&mut at)?;
    let node_id = string(&mut at)?;
    let ts = body
        .get(at..at + 8)
        .ok_or_else(|| bad("timestamp overruns the body"))?;
    let timestamp_ms = be_u64(ts);
    at += 8;
    let n = body
        .get(at..at + 2)
        .ok_or_else(|| bad("pair count overruns the body"))?;
    let n = u16::from_be_bytes([n[0], n[1]]);
    at += 2;
    for _ in 0..n {
        let k = string(&mut at)?;
        let v = string(&mut at)?;
        pair(k, v);
    }
    if at != body.len() {
        return Err(bad("trailing bytes after the last pair"));
    }
    Ok((service_name, node_id, timestamp_ms))
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn put_heartbeat<K: AsRef<str>, V: AsRef<str>>(
    dst: &mut BytesMut,
    req_id: u64,
    service_name: &str,
    node_id: &str,
    timestamp_ms: u64,
    extra: &[(K, V)],
) -> Result<(), FrameError> {
    let w = FrameWriter::begin(dst, MsgType::Heartbeat, Flags::NONE, req_id);
    let body = (|| {
        put_short_str(dst, service_name.as_bytes())?;
        put_short_str(dst, node_id.as_bytes())?;
        dst.put_u64(timestamp_ms);
        let n =
            u16::try_from(extra.len()).map_err(|_| FrameError::Unencodable { len: extra.len() })?;
        dst.put_u16(n);
        for (k, v) in extra {
            put_short_str(dst, k.as_ref().as_bytes())?;
            put_short_str(dst, v.as_ref().as_bytes())?;
        }
        Ok(())
    })();
    match body {
        Ok(()) => w.finish(dst),
        Err(e) => {
            w.abandon(dst);
            Err(e)
        }
    }
}

fn put_short_str(dst: &mut BytesMut, s: &[u8]) -> Result<(), FrameError> {
    let n = u16::try_from(s.len()).map_err(|_| FrameError::Unencodable { len: s.len() })?;
    dst.put_u16(n);
    dst.extend_from_slice(s);
    Ok(())
}

fn short_str_range(body: &[u8], at: usize) -> Option<std::ops::Range<usize>> {
    let n = body.get(at..at + 2)?;
    let start = at + 2;
    let end = start + usize::from(u16::from_be_bytes([n[0], n[1]]));
    (end <= body.len()).then_some(start..end)
}

fn read_payload(body: &Bytes, at: usize, what: &'static str) -> Result<Bytes, FrameError> {
    Ok(body.slice(payload_range(body, at, what)?))
}

/// Where the length-prefixed payload that starts at `at` and must end the body lies.
pub(crate) fn payload_range(
    body: &[u8],
    at: usize,
    what: &'static str,
) -> Result<std::ops::Range<usize>, FrameError> {
    let bad = |reason| FrameError::BadBody { what, reason };
    let p = body
        .get(at..at + 4)
        .ok_or_else(|| bad("payload length overruns the body"))?;
    let start = at + 4;
    if start + be_u32(p) as usize != body.len() {
        return Err(bad("payload length does not match the body length"));
    }
    Ok(start..body.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Frame;

    #[test]
    fn request_body_with_lying_lengths_is_rejected() {
        let body = Bytes::from_static(b"\x00\x05Echo");
        assert!(Request::parse(&body).is_err());
        let body = Bytes::from_static(b"\x00\x01S\x00\x01M\x00\x00\x00\x05ab");
        assert!(Request::parse(&body).is_err());
        let body = Bytes::from_static(b"\x00\x01S\x00\x01M\x00\x00\x00\x02ab");
        assert_eq!(
            Request::parse(&body).unwrap().payload,
            Bytes::from_static(b"ab")
        );
    }

    #[test]
    fn heartbeat_round_trips() {
        let hb = Heartbeat {
            service_name: "broker".into(),
            node_id: "n1".into(),
            timestamp_ms: 1_700_000_000_000,
            extra: vec![("k".into(), "v".into())],
        };
        let mut b = BytesMut::new();
        hb.put(&mut b, 9).unwrap();
        let f = Frame::from_bytes(b.freeze()).unwrap();
        assert_eq!(Heartbeat::parse(&f.body).unwrap(), hb);
    }

    #[test]
    fn names_must_be_utf8_and_need_not_be_ascii() {
        // (service, method) → whether request_names takes them.
        let body = |service: &[u8], method: &[u8]| {
            let mut b = Vec::new();
            b.extend_from_slice(&(service.len() as u16).to_be_bytes());
            b.extend_from_slice(service);
            b.extend_from_slice(&(method.len() as u16).to_be_bytes());
            b.extend_from_slice(method);
            b.extend_from_slice(&0u32.to_be_bytes());
            b
        };
        assert!(request_names(&body(b"EchoService", b"Echo")).is_ok());
        assert!(request_names(&body("Dienst\u{e4}".as_bytes(), "\u{1f600}".as_bytes())).is_ok());
        let e = request_names(&body(b"Echo\xffService", b"Echo")).unwrap_err();
        assert!(e.to_string().contains("not UTF-8"), "{e}");
        assert!(request_names(&body(b"EchoService", b"\xc3")).is_err());
    }
}
