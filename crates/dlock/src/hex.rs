//! Lower-case hex text for tokens and digests, without the formatting machinery (an
//! owner token and a nonce are made on every acquisition).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// `bytes` as lower-case hex, two digits per byte.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// `bytes` as lower-case hex written into `out` (twice as long), without allocating.
pub(crate) fn encode_into<'a>(bytes: &[u8], out: &'a mut [u8]) -> &'a str {
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0x0f)];
    }
    let n = (bytes.len() * 2).min(out.len());
    // Only ASCII digits were written.
    std::str::from_utf8(&out[..n]).unwrap_or_default()
}

#[cfg_attr(not(any(feature = "redis", feature = "zookeeper")), allow(dead_code))]
/// `n` as 32 lower-case hex digits (zero-padded), like `format!("{n:032x}")`.
pub(crate) fn u128_32(n: u128) -> String {
    encode(&n.to_be_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_formatter() {
        for n in [0u128, 1, 0xdead_beef, u128::MAX, 1 << 100] {
            assert_eq!(u128_32(n), format!("{n:032x}"));
        }
        assert_eq!(encode(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        let mut out = [0u8; 8];
        assert_eq!(encode_into(&[0x00, 0x0f, 0xa5, 0xff], &mut out), "000fa5ff");
    }
}
