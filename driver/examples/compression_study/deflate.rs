//! A small deflate parser (RFC 1951 inside RFC 1950's zlib wrapper): where the bits of a
//! zlib stream go, split into fixed overhead (the 2-byte header, block headers,
//! end-of-block codes, padding, the 4-byte Adler-32) and coded payload (literals,
//! matches). Kept by hand because no deflate crate reports a stream's bits by kind: they
//! inflate, and this only counts (and checks that what it decoded is the input).

#[derive(Default, Clone)]
pub(crate) struct Anatomy {
    pub(crate) total: usize,
    /// Block types in order: S(tored), F(ixed Huffman), D(ynamic Huffman).
    pub(crate) blocks: String,
    pub(crate) header_bits: usize,
    pub(crate) eob_bits: usize,
    pub(crate) pad_bits: usize,
    pub(crate) literals: usize,
    pub(crate) literal_bits: usize,
    pub(crate) matches: Vec<(usize, usize)>,
    pub(crate) match_bits: usize,
}

impl Anatomy {
    /// Bytes that do not depend on the payload: zlib header + Adler-32 + deflate block
    /// headers + end-of-block codes + padding to a byte.
    pub(crate) fn fixed_bytes(&self) -> f64 {
        6.0 + (self.header_bits + self.eob_bits + self.pad_bits) as f64 / 8.0
    }
    pub(crate) fn matched_bytes(&self) -> usize {
        self.matches.iter().map(|m| m.0).sum()
    }
}

pub(crate) struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bits<'_> {
    fn bit(&mut self) -> u32 {
        let b = (self.data[self.pos / 8] >> (self.pos % 8)) & 1;
        self.pos += 1;
        u32::from(b)
    }
    fn bits(&mut self, n: u32) -> u32 {
        (0..n).fold(0, |v, i| v | (self.bit() << i))
    }
}

/// Canonical Huffman code, decoded as zlib's `puff` does.
pub(crate) struct Huff {
    count: [u16; 16],
    symbol: Vec<u16>,
}

impl Huff {
    fn new(lengths: &[u8]) -> Huff {
        let mut count = [0u16; 16];
        for &l in lengths {
            count[l as usize] += 1;
        }
        count[0] = 0;
        let mut offs = [0u16; 16];
        for len in 1..15 {
            offs[len + 1] = offs[len] + count[len];
        }
        let mut symbol = vec![0u16; lengths.len()];
        for (s, &l) in lengths.iter().enumerate() {
            if l != 0 {
                symbol[offs[l as usize] as usize] = s as u16;
                offs[l as usize] += 1;
            }
        }
        Huff { count, symbol }
    }

    /// (symbol, bits used)
    fn decode(&self, b: &mut Bits<'_>) -> (usize, usize) {
        let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
        for len in 1..16 {
            code |= b.bit() as i32;
            let count = i32::from(self.count[len]);
            if code - count < first {
                return (self.symbol[(index + code - first) as usize] as usize, len);
            }
            index += count;
            first += count;
            first <<= 1;
            code <<= 1;
        }
        panic!("bad Huffman code");
    }
}

pub(crate) const LBASE: [usize; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
pub(crate) const LEXT: [u32; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];
pub(crate) const DBASE: [usize; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
    2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
];
pub(crate) const DEXT: [u32; 30] = [
    0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13,
    13,
];

/// Takes a zlib stream apart and checks that it inflates to `expect`.
pub(crate) fn anatomy(z: &[u8], expect: &[u8]) -> Anatomy {
    let mut a = Anatomy {
        total: z.len(),
        ..Anatomy::default()
    };
    assert!(z.len() >= 6 && (u16::from(z[0]) << 8 | u16::from(z[1])) % 31 == 0);
    let mut b = Bits {
        data: &z[..z.len() - 4],
        pos: 16,
    };
    let mut out: Vec<u8> = Vec::new();
    loop {
        let start = b.pos;
        let last = b.bit() == 1;
        let btype = b.bits(2);
        match btype {
            0 => {
                a.blocks.push('S');
                b.pos = b.pos.div_ceil(8) * 8;
                let len = b.bits(16) as usize;
                let _nlen = b.bits(16);
                a.header_bits += b.pos - start;
                for _ in 0..len {
                    out.push(b.bits(8) as u8);
                }
                a.literals += len;
                a.literal_bits += 8 * len;
            }
            1 | 2 => {
                let (lit, dist) = if btype == 1 {
                    a.blocks.push('F');
                    let mut l = [8u8; 288];
                    l[144..256].fill(9);
                    l[256..280].fill(7);
                    (Huff::new(&l), Huff::new(&[5u8; 30]))
                } else {
                    a.blocks.push('D');
                    let hlit = b.bits(5) as usize + 257;
                    let hdist = b.bits(5) as usize + 1;
                    let hclen = b.bits(4) as usize + 4;
                    const ORDER: [usize; 19] = [
                        16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15,
                    ];
                    let mut cl = [0u8; 19];
                    for &o in &ORDER[..hclen] {
                        cl[o] = b.bits(3) as u8;
                    }
                    let clh = Huff::new(&cl);
                    let mut lens = Vec::with_capacity(hlit + hdist);
                    while lens.len() < hlit + hdist {
                        let (sym, _) = clh.decode(&mut b);
                        match sym {
                            0..=15 => lens.push(sym as u8),
                            16 => {
                                let prev = *lens.last().expect("repeat after a length");
                                let n = 3 + b.bits(2);
                                lens.extend(std::iter::repeat_n(prev, n as usize));
                            }
                            17 => {
                                let n = 3 + b.bits(3);
                                lens.extend(std::iter::repeat_n(0, n as usize));
                            }
                            _ => {
                                let n = 11 + b.bits(7);
                                lens.extend(std::iter::repeat_n(0, n as usize));
                            }
                        }
                    }
                    (Huff::new(&lens[..hlit]), Huff::new(&lens[hlit..]))
                };
                a.header_bits += b.pos - start;
                loop {
                    let (sym, n) = lit.decode(&mut b);
                    if sym < 256 {
                        out.push(sym as u8);
                        a.literals += 1;
                        a.literal_bits += n;
                    } else if sym == 256 {
                        a.eob_bits += n;
                        break;
                    } else {
                        let s = sym - 257;
                        let len = LBASE[s] + b.bits(LEXT[s]) as usize;
                        let (d, dn) = dist.decode(&mut b);
                        let distance = DBASE[d] + b.bits(DEXT[d]) as usize;
                        a.match_bits += n + LEXT[s] as usize + dn + DEXT[d] as usize;
                        a.matches.push((len, distance));
                        for _ in 0..len {
                            out.push(out[out.len() - distance]);
                        }
                    }
                }
            }
            _ => panic!("reserved block type"),
        }
        if last {
            break;
        }
    }
    a.pad_bits = (8 - b.pos % 8) % 8;
    let bits = 16 + a.header_bits + a.eob_bits + a.pad_bits + a.literal_bits + a.match_bits + 32;
    assert_eq!(
        bits,
        8 * z.len(),
        "every bit of the stream is accounted for"
    );
    assert_eq!(out, expect, "the parser inflates the stream to the payload");
    a
}
