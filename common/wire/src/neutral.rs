//! Request ids that keep a frame's CRC: a forwarder that gives a frame an id of its own
//! with [`neutral_id`] (and later the caller's id back) writes the 8 id bytes and nothing
//! else, and the CRC trailer stays right, so a forwarded frame is copied as it is instead
//! of being checked and summed again (two CRC passes per forwarded call, each way).
//!
//! Why it works: CRC-32 is linear over GF(2), so changing bytes of a frame changes its CRC
//! by the CRC (with a zero register, no final inversion) of the change alone, followed by
//! as many zero bytes as the frame has after it; and zero bytes after a change that leaves
//! the register at zero leave it at zero. So an 8-byte change whose own raw CRC is zero
//! leaves the CRC of every frame unchanged, whatever its length or body. Four of the eight
//! bytes can be anything (the forwarder's key: which slot of its table the call has); the
//! other four are then the unique bytes that bring the register back to zero, found as
//! CRC forgers do, by running the table backwards.
//!
//! The key is the id's low 32 bits; the high 32 follow from it and from the caller's id,
//! and carry no meaning of their own. A reply matched by its key must still be checked
//! against the whole id the forwarder gave (a late reply can meet a reused key).

/// The CRC-32 polynomial (IEEE 802.3, reflected), as `crc32fast` and the trailer use it.
const POLY: u32 = 0xEDB8_8320;

/// The byte-at-a-time table of the reflected CRC.
const TABLE: [u32; 256] = table();

/// For each possible top byte of a table entry, the index of that entry (the 256 entries'
/// top bytes are all different, which is what makes the table reversible).
const REVERSE: [u8; 256] = reverse(&TABLE);

const fn table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { POLY ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

const fn reverse(t: &[u32; 256]) -> [u8; 256] {
    let mut r = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        r[(t[i] >> 24) as usize] = i as u8;
        i += 1;
    }
    r
}

/// The register after `bytes`, from `reg` (raw: no inversion before or after).
const fn forward(mut reg: u32, bytes: &[u8]) -> u32 {
    let mut i = 0;
    while i < bytes.len() {
        reg = TABLE[((reg ^ bytes[i] as u32) & 0xff) as usize] ^ (reg >> 8);
        i += 1;
    }
    reg
}

/// The register before `bytes` that leads to `reg` after them.
const fn backward(mut reg: u32, bytes: &[u8]) -> u32 {
    let mut i = bytes.len();
    while i > 0 {
        i -= 1;
        let k = REVERSE[(reg >> 24) as usize];
        reg = ((reg ^ TABLE[k as usize]) << 8) | (k ^ bytes[i]) as u32;
    }
    reg
}

/// The four bytes that take the register from `from` to `to`.
const fn forge(from: u32, to: u32) -> [u8; 4] {
    let mut ks = [0u8; 4];
    let mut reg = to;
    let mut i = 4;
    while i > 0 {
        i -= 1;
        ks[i] = REVERSE[(reg >> 24) as usize];
        reg = (reg ^ TABLE[ks[i] as usize]) << 8;
    }
    let mut out = [0u8; 4];
    let mut reg = from;
    let mut i = 0;
    while i < 4 {
        out[i] = (reg as u8) ^ ks[i];
        reg = TABLE[ks[i] as usize] ^ (reg >> 8);
        i += 1;
    }
    out
}

/// The high half of the neutral change whose low half is `lo`: the four bytes that, put
/// before `lo`'s, make the eight bytes' raw CRC zero. Linear in `lo`.
const fn high_of(lo: u32) -> u32 {
    let mid = backward(0, &lo.to_be_bytes());
    u32::from_be_bytes(forge(0, mid))
}

/// [`high_of`] for each byte of the low half in each position: a linear map is the XOR of
/// what it makes of each byte, so four lookups give it.
const HIGH_OF: [[u32; 256]; 4] = high_tables();

const fn high_tables() -> [[u32; 256]; 4] {
    let mut t = [[0u32; 256]; 4];
    let mut pos = 0;
    while pos < 4 {
        let mut b = 0;
        while b < 256 {
            t[pos][b] = high_of((b as u32) << (8 * (3 - pos)));
            b += 1;
        }
        pos += 1;
    }
    t
}

/// An id whose low 32 bits are `key` and which can be written over `original` (or
/// `original` over it) in any frame without changing the frame's CRC.
pub fn neutral_id(original: u64, key: u32) -> u64 {
    let [a, b, c, d] = (original as u32 ^ key).to_be_bytes();
    let high = HIGH_OF[0][usize::from(a)]
        ^ HIGH_OF[1][usize::from(b)]
        ^ HIGH_OF[2][usize::from(c)]
        ^ HIGH_OF[3][usize::from(d)];
    ((u64::from(high ^ (original >> 32) as u32)) << 32) | u64::from(key)
}

/// The raw CRC of the change from id `a` to id `b`: zero when either may replace the other
/// with the CRC unchanged.
pub fn id_change_crc(a: u64, b: u64) -> u32 {
    forward(0, &(a ^ b).to_be_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Flags, Frame, HEADER_LEN, Header, MsgType, put_frame};
    use bytes::{Bytes, BytesMut};
    use proptest::prelude::*;

    #[test]
    fn the_table_is_crc32fasts() {
        let data = b"123456789";
        let ours = !forward(!0, data);
        assert_eq!(ours, crc32fast::hash(data));
        assert_eq!(ours, 0xCBF4_3926);
    }

    #[test]
    fn the_tables_give_what_the_forger_gives() {
        for lo in [0u32, 1, 0x8000_0000, 0xdead_beef, u32::MAX] {
            let id = neutral_id(0, lo);
            assert_eq!((id >> 32) as u32, high_of(lo));
        }
    }

    #[test]
    fn forging_reaches_the_register_asked_for() {
        for (from, to) in [(0, 0), (0, 1), (0xdead_beef, 0x1234_5678), (!0, 0)] {
            assert_eq!(forward(from, &forge(from, to)), to);
        }
        assert_eq!(backward(forward(7, b"abcd"), b"abcd"), 7);
    }

    proptest! {
        #[test]
        fn a_neutral_id_keeps_any_frames_crc(
            original in any::<u64>(),
            key in any::<u32>(),
            body in proptest::collection::vec(any::<u8>(), 0..300),
            flags in prop::sample::select(vec![0x00u8, 0x20, 0x40, 0x60, 0x80, 0xe0]),
        ) {
            let id = neutral_id(original, key);
            prop_assert_eq!(id as u32, key);
            prop_assert_eq!(id_change_crc(original, id), 0);
            let header = Header {
                msg_type: MsgType::Request,
                flags: Flags::from_bits(flags),
                body_len: body.len() as u32,
                req_id: original,
            };
            let mut wire = BytesMut::new();
            put_frame(&mut wire, &header, &body);
            wire[HEADER_LEN - 8..HEADER_LEN].copy_from_slice(&id.to_be_bytes());
            let frame = Frame::from_bytes(Bytes::from(wire.to_vec()));
            prop_assert!(frame.is_ok(), "{:?}", frame);
            prop_assert_eq!(frame.map(|f| f.header.req_id).ok(), Some(id));
        }
    }
}
