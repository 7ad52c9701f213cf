//! The compression extension: zlib (`flate2`) of a frame's protobuf payload, with a size
//! threshold below which payloads travel plain, and inflation bounded by a limit.
//!
//! Owns only bytes ↔ bytes. Which frames are compressed, and the flag that says so, are
//! [`crate::envelope`]'s and [`crate::frame`]'s. The zlib state is kept and reset between
//! payloads, so a connection pays its ~300 KiB of deflate state once, not per call.

use bytes::BytesMut;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// Payloads shorter than this are sent plain: below about 64 bytes zlib's 6-byte envelope
/// and block header cost more than a protobuf message's few repeats save.
pub const DEFAULT_COMPRESS_THRESHOLD: usize = 64;
/// zlib level 6, zlib's own default and what the reference report measured with.
pub const DEFAULT_COMPRESS_LEVEL: u32 = 6;
/// Largest payload an inflation may produce: the frame limit (10 MiB), so compression
/// never lets a peer send more than it could have sent plain, and a zlib bomb stops there.
pub const DEFAULT_MAX_INFLATED_LEN: usize = crate::frame::DEFAULT_MAX_BODY_LEN as usize;

/// Why a payload could not be inflated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompressError {
    /// The inflated payload would exceed the limit.
    #[error("payload inflates past the limit of {limit} bytes")]
    TooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// Not a valid zlib stream (bad header, bad data, wrong checksum, cut short).
    #[error("payload is not a valid zlib stream: {0}")]
    Corrupt(String),
}

/// When and how hard to compress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompressionConfig {
    /// Payloads shorter than this travel plain.
    pub threshold: usize,
    /// zlib level 0–9.
    pub level: u32,
}

impl Default for CompressionConfig {
    fn default() -> Self {
        CompressionConfig {
            threshold: DEFAULT_COMPRESS_THRESHOLD,
            level: DEFAULT_COMPRESS_LEVEL,
        }
    }
}

/// A reusable zlib compressor.
#[derive(Debug)]
pub struct Compressor {
    config: CompressionConfig,
    /// The zlib state (about 340 KiB with zlib-rs), made by the first payload that is
    /// compressed: a connection that never compresses (most, and every idle one) never
    /// holds it.
    z: Option<Compress>,
}

impl Compressor {
    /// A compressor with the given threshold and level (its state is made when first
    /// needed).
    pub fn new(config: CompressionConfig) -> Self {
        Compressor { config, z: None }
    }

    /// Payloads shorter than this are never compressed.
    pub fn threshold(&self) -> usize {
        self.config.threshold.max(1)
    }

    /// Appends the zlib stream of `input` to `dst` and returns true, when `input` is at
    /// least the threshold long and its compressed form is strictly shorter. Otherwise
    /// leaves `dst` as it was and returns false: the caller sends the payload plain.
    pub fn compress_into(&mut self, input: &[u8], dst: &mut BytesMut) -> bool {
        if input.len() < self.threshold() {
            return false;
        }
        let level = Compression::new(self.config.level.min(9));
        let z = self.z.get_or_insert_with(|| Compress::new(level, true));
        z.reset();
        let start = dst.len();
        // Room for one byte less than the input: if deflate does not finish in it, the
        // compressed form is no smaller and the payload goes plain.
        let room = input.len() - 1;
        dst.resize(start + room, 0);
        let res = z.compress(input, &mut dst[start..], FlushCompress::Finish);
        let written = z.total_out() as usize;
        match res {
            Ok(Status::StreamEnd) if written < input.len() => {
                dst.truncate(start + written);
                true
            }
            _ => {
                dst.truncate(start);
                false
            }
        }
    }
}

/// A reusable, bounded zlib inflater.
#[derive(Debug)]
pub struct Inflater {
    limit: usize,
    /// The zlib state, made by the first compressed payload that arrives.
    z: Option<Decompress>,
}

impl Inflater {
    /// An inflater that refuses output longer than `limit` bytes (its state is made when
    /// first needed).
    pub fn new(limit: usize) -> Self {
        Inflater { limit, z: None }
    }

    /// Appends the inflated form of the zlib stream `input` to `dst`.
    pub fn inflate_into(&mut self, input: &[u8], dst: &mut BytesMut) -> Result<(), CompressError> {
        let z = self.z.get_or_insert_with(|| Decompress::new(true));
        z.reset(true);
        let start = dst.len();
        // Small payloads inflate in one step; bigger ones grow the room geometrically up
        // to one byte past the limit, so that a payload of exactly `limit` bytes fits.
        let cap = self.limit.saturating_add(1);
        let mut room = input.len().saturating_mul(4).max(256).min(cap);
        let result = loop {
            let out = dst.len() - start;
            if out == room {
                if room == cap {
                    break Err(CompressError::TooLarge { limit: self.limit });
                }
                room = room.saturating_mul(2).min(cap);
            }
            let (in_before, out_before) = (z.total_in(), z.total_out());
            dst.resize(start + room, 0);
            let res = z.decompress(
                &input[in_before as usize..],
                &mut dst[start + out..],
                FlushDecompress::None,
            );
            let out = z.total_out() as usize;
            dst.truncate(start + out);
            if out > self.limit {
                break Err(CompressError::TooLarge { limit: self.limit });
            }
            match res {
                Ok(Status::StreamEnd) if z.total_in() as usize == input.len() => {
                    break Ok(());
                }
                Ok(Status::StreamEnd) => {
                    break Err(CompressError::Corrupt(
                        "trailing bytes after the zlib stream".into(),
                    ));
                }
                Ok(_) => {
                    let stuck = z.total_in() == in_before && z.total_out() == out_before;
                    if stuck && out < room {
                        break Err(CompressError::Corrupt("stream cut short".into()));
                    }
                }
                Err(e) => break Err(CompressError::Corrupt(e.to_string())),
            }
        };
        if result.is_err() {
            dst.truncate(start);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zlib_state_is_made_only_when_a_payload_needs_it() {
        let mut c = Compressor::new(CompressionConfig::default());
        let mut i = Inflater::new(1 << 20);
        assert!(c.z.is_none() && i.z.is_none(), "nothing allocated up front");
        let mut out = BytesMut::new();
        // Below the threshold: sent plain, still no state.
        assert!(!c.compress_into(b"short", &mut out));
        assert!(c.z.is_none());
        let payload = vec![b'x'; 1000];
        assert!(c.compress_into(&payload, &mut out));
        assert!(c.z.is_some());
        let mut back = BytesMut::new();
        i.inflate_into(&out, &mut back).unwrap();
        assert!(i.z.is_some());
        assert_eq!(&back[..], &payload[..]);
    }

    #[test]
    fn compressible_payloads_round_trip() {
        let mut c = Compressor::new(CompressionConfig::default());
        let mut i = Inflater::new(1 << 20);
        let input =
            b"DESKTOP-NDOHT79 DESKTOP-NDOHT79 DESKTOP-NDOHT79 20160101 20160101 20160101".repeat(3);
        let mut z = BytesMut::new();
        assert!(c.compress_into(&input, &mut z));
        assert!(z.len() < input.len());
        let mut out = BytesMut::from(&b"keep"[..]);
        i.inflate_into(&z, &mut out).unwrap();
        assert_eq!(&out[4..], &input[..]);
        // the state is reused
        let mut z2 = BytesMut::new();
        assert!(c.compress_into(&input, &mut z2));
        assert_eq!(z, z2);
    }

    #[test]
    fn small_or_incompressible_payloads_stay_plain() {
        let mut c = Compressor::new(CompressionConfig::default());
        let mut z = BytesMut::from(&b"x"[..]);
        assert!(!c.compress_into(b"short", &mut z));
        let noise: Vec<u8> = (0..200u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        assert!(!c.compress_into(&noise, &mut z));
        assert_eq!(&z[..], b"x");
    }

    #[test]
    fn inflation_stops_at_the_limit() {
        let mut c = Compressor::new(CompressionConfig {
            threshold: 1,
            level: 9,
        });
        let bomb = vec![0u8; 100_000];
        let mut z = BytesMut::new();
        assert!(c.compress_into(&bomb, &mut z));
        let mut out = BytesMut::new();
        let mut i = Inflater::new(10_000);
        assert_eq!(
            i.inflate_into(&z, &mut out),
            Err(CompressError::TooLarge { limit: 10_000 })
        );
        assert!(out.is_empty());
        let mut big = Inflater::new(100_000);
        big.inflate_into(&z, &mut out).unwrap();
        assert_eq!(out.len(), 100_000);
    }

    #[test]
    fn garbage_and_truncated_streams_are_corrupt() {
        let mut i = Inflater::new(1 << 20);
        let mut out = BytesMut::new();
        assert!(matches!(
            i.inflate_into(b"not zlib at all", &mut out),
            Err(CompressError::Corrupt(_))
        ));
        let mut c = Compressor::new(CompressionConfig {
            threshold: 1,
            level: 6,
        });
        let mut z = BytesMut::new();
        assert!(c.compress_into(&[7u8; 500], &mut z));
        assert!(matches!(
            i.inflate_into(&z[..z.len() - 3], &mut out),
            Err(CompressError::Corrupt(_))
        ));
        assert!(out.is_empty());
    }
}
