//! Lower-case hex text for tokens and digests, without the formatting machinery (an
//! owner token and a nonce are made on every acquisition).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Every byte's two hex digits, by the byte: one load per byte, where splitting it
/// into nibbles and looking each up took several times the instructions.
const PAIRS: [[u8; 2]; 256] = {
    let mut pairs = [[0u8; 2]; 256];
    let mut b = 0;
    while b < 256 {
        pairs[b] = [DIGITS[b >> 4], DIGITS[b & 0x0f]];
        b += 1;
    }
    pairs
};

/// The two hex digits of `b`.
fn digits(b: u8) -> [u8; 2] {
    PAIRS[usize::from(b)]
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
/// `bytes` as lower-case hex, two digits per byte.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push(&mut out, bytes);
    out
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
/// `head`, `bytes` as lower-case hex, then each of `tails`: statement text with a key
/// inlined, built in one allocation (with room for a number written after it), not
/// around a hex string of its own.
pub(crate) fn inlined(head: &str, bytes: &[u8], tails: &[&str]) -> String {
    let tails_len: usize = tails.iter().map(|t| t.len()).sum();
    let mut text = String::with_capacity(head.len() + bytes.len() * 2 + tails_len + 24);
    text.push_str(head);
    push(&mut text, bytes);
    for tail in tails {
        text.push_str(tail);
    }
    text
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
/// Appends `bytes` as lower-case hex to `out`, through a buffer on the stack.
fn push(out: &mut String, bytes: &[u8]) {
    for chunk in bytes.chunks(32) {
        let mut digits_of = [0u8; 64];
        for (pair, b) in digits_of.chunks_exact_mut(2).zip(chunk) {
            pair.copy_from_slice(&digits(*b));
        }
        // Never a shared fallback: two names' keys must not become one.
        out.push_str(&ascii(&digits_of[..chunk.len() * 2]));
    }
}

/// 16 bytes as 32 lower-case hex digits (ASCII), without allocating.
pub(crate) fn encode_16(bytes: &[u8; 16]) -> [u8; 32] {
    let mut pairs = [[0u8; 2]; 16];
    for (pair, b) in pairs.iter_mut().zip(bytes) {
        *pair = digits(*b);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(pairs.as_flattened());
    out
}

#[cfg_attr(not(any(feature = "redis", feature = "zookeeper")), allow(dead_code))]
/// `n` as 32 lower-case hex digits (zero-padded), like `format!("{n:032x}")`.
pub(crate) fn u128_32(n: u128) -> String {
    ascii(&encode_16(&n.to_be_bytes())).into_owned()
}

/// Hex digits as text: borrowed after a check (they are ASCII, so it passes, and costs
/// less than a lossy view); were it ever to fail, the lossy view, never a shared
/// fallback (an owner token or a nonce must stay unique).
pub(crate) fn ascii(digits: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(digits) {
        Ok(text) => std::borrow::Cow::Borrowed(text),
        Err(_) => String::from_utf8_lossy(digits),
    }
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
        // Longer than one chunk of `push`.
        let long: Vec<u8> = (0..=255).collect();
        let expected: String = long.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(encode(&long), expected);
        assert_eq!(
            inlined("x'", &[0xab; 33], &["'", " END"]),
            format!("x'{}' END", "ab".repeat(33))
        );
        let n = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210_u128;
        assert_eq!(
            std::str::from_utf8(&encode_16(&n.to_be_bytes())).expect("ASCII"),
            format!("{n:032x}")
        );
    }
}
