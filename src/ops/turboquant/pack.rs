//! Bit packing of b-bit codes, least significant bits first: code i occupies bits
//! [b i, b i + b) of the byte string (bit k of the string is bit k % 8 of byte k / 8).

/// Bytes that `n` codes of `bits` bits occupy.
pub fn packed_len(n: usize, bits: u8) -> usize {
    (n * bits as usize).div_ceil(8)
}

/// Packs `codes` (each < 2^bits) into `out` (`packed_len` bytes, overwritten).
pub fn pack(codes: &[u8], bits: u8, out: &mut [u8]) {
    debug_assert_eq!(out.len(), packed_len(codes.len(), bits));
    pack_iter(codes.iter().copied(), bits, out)
}

/// `pack` for codes computed on the fly.
pub fn pack_iter(codes: impl Iterator<Item = u8>, bits: u8, out: &mut [u8]) {
    let b = bits as u32;
    let mut acc: u32 = 0;
    let mut filled: u32 = 0;
    let mut o = 0;
    for c in codes {
        acc |= (c as u32) << filled;
        filled += b;
        while filled >= 8 {
            out[o] = acc as u8;
            o += 1;
            acc >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out[o] = acc as u8;
    }
}

/// The code at index `i` of a packed string.
#[inline(always)]
pub fn code_at(packed: &[u8], bits: u8, i: usize) -> u8 {
    let bit = i * bits as usize;
    let (byte, shift) = (bit / 8, bit % 8);
    // A code straddles at most two bytes (bits <= 8).
    let lo = packed[byte] as u16;
    let hi = packed.get(byte + 1).copied().unwrap_or(0) as u16;
    (((lo | (hi << 8)) >> shift) & ((1u16 << bits) - 1)) as u8
}

/// Unpacks `out.len()` codes.
pub fn unpack(packed: &[u8], bits: u8, out: &mut [u8]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = code_at(packed, bits, i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_width_and_length() {
        let mut x: u64 = 0x1234_5678_9abc_def1;
        for bits in 1..=8u8 {
            for n in [1, 7, 8, 15, 16, 17, 64, 80, 128, 256] {
                let codes: Vec<u8> = (0..n)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x % (1u64 << bits)) as u8
                    })
                    .collect();
                let mut packed = vec![0xAAu8; packed_len(n, bits)];
                pack(&codes, bits, &mut packed);
                let mut back = vec![0u8; n];
                unpack(&packed, bits, &mut back);
                assert_eq!(back, codes, "bits={bits} n={n}");
            }
        }
    }

    #[test]
    fn layout_is_lsb_first() {
        // 3-bit codes 1, 2, 3, 4 -> bits 001 010 011 100 from the bottom: 0b11_010_001, 0b100_0
        let mut out = [0u8; 2];
        pack(&[1, 2, 3, 4], 3, &mut out);
        assert_eq!(out, [0b1101_0001, 0b0000_1000]);
        assert_eq!(packed_len(128, 3), 48);
    }
}
