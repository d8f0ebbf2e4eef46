//! Lock names: validation and an injective, path-safe encoding.
//!
//! A lock name is any non-empty UTF-8 string of at most [`MAX_NAME_LEN`] bytes without
//! control characters (NUL included). Backends that store names as path segments or keys
//! with structure (etcd prefixes, ZooKeeper nodes) use [`LockName::encoded`]: every byte
//! outside `[A-Za-z0-9_.:-]` (and `%` itself) becomes `%XX`, so distinct names never map
//! to the same segment and the segment never contains `/`.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// Longest accepted name, in bytes of UTF-8.
pub const MAX_NAME_LEN: usize = 512;

/// A validated lock name. Cloning one is cheap (the text is shared): a hold, its
/// backend's record of it and every attempt's request keep one copy between them.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(Arc<str>);

impl LockName {
    /// Validate `name`.
    ///
    /// # Errors
    /// [`Error::InvalidName`] when the name is empty, longer than [`MAX_NAME_LEN`] bytes,
    /// or contains a control character (NUL included).
    pub fn new(name: &str) -> Result<Self> {
        let reason = if name.is_empty() {
            Some("a lock name must not be empty".to_owned())
        } else if name.len() > MAX_NAME_LEN {
            Some(format!(
                "a lock name is at most {MAX_NAME_LEN} bytes, this one has {}",
                name.len()
            ))
        } else if printable_ascii(name) {
            // Printable ASCII, the usual name: no character to decode.
            None
        } else {
            name.char_indices()
                .find(|(_, c)| c.is_control())
                .map(|(i, c)| {
                    format!(
                        "control character U+{:04X} at byte {i} is not allowed",
                        u32::from(c)
                    )
                })
        };
        match reason {
            Some(reason) => Err(Error::InvalidName {
                name: display_name(name),
                reason,
            }),
            None => Ok(LockName(Arc::from(name))),
        }
    }

    /// The name as given.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The text itself, shared (for keys that are the name as it is).
    #[cfg(feature = "redis")]
    pub(crate) fn shared(&self) -> &Arc<str> {
        &self.0
    }

    /// The injective, path-safe form used as a key segment (see the module docs).
    #[must_use]
    pub fn encoded(&self) -> String {
        encode(&self.0)
    }
}

/// Whether every byte is printable ASCII (`0x20..0x7f`): every lock call checks its
/// name, so the check reads all of it without stopping early, which lets the compiler
/// test many bytes per instruction (a name is at most [`MAX_NAME_LEN`] bytes).
fn printable_ascii(name: &str) -> bool {
    name.bytes()
        .fold(true, |ok, b| ok & (b.wrapping_sub(0x20) < 0x5f))
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn keeps(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':')
}

/// Percent-encode every byte outside `[A-Za-z0-9_.:-]`; a name made only of dots has
/// its dots encoded too, so the result is never `.` or `..`.
fn encode(name: &str) -> String {
    let all_dots = name.bytes().all(|b| b == b'.');
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if keeps(b) && !(all_dots && b == b'.') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Inverse of [`LockName::encoded`]; `None` for text that no name encodes to.
#[must_use]
pub fn decode(encoded: &str) -> Option<String> {
    let bytes = encoded.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = encoded.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A name made safe to show in an error: escaped, and cut at 80 characters.
pub(crate) fn display_name(name: &str) -> String {
    let mut shown: String = name.chars().take(80).collect();
    if shown.len() < name.len() {
        shown.push('…');
    }
    format!("{shown:?}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects_bad_names() {
        for bad in [
            "",
            "a\0b",
            "tab\there",
            "new\nline",
            "del\u{7f}",
            "c1\u{85}",
        ] {
            assert!(
                matches!(LockName::new(bad), Err(Error::InvalidName { .. })),
                "{bad:?}"
            );
        }
        let long = "x".repeat(MAX_NAME_LEN + 1);
        assert!(matches!(
            LockName::new(&long),
            Err(Error::InvalidName { .. })
        ));
        assert!(LockName::new(&"x".repeat(MAX_NAME_LEN)).is_ok());
    }

    #[test]
    fn encoding_is_path_safe() {
        let n = LockName::new("jobs/a").expect("valid");
        assert_eq!(n.encoded(), "jobs%2Fa");
        assert_eq!(LockName::new(".").expect("valid").encoded(), "%2E");
        assert_eq!(LockName::new("..").expect("valid").encoded(), "%2E%2E");
        assert_eq!(LockName::new("a.b").expect("valid").encoded(), "a.b");
        assert_eq!(LockName::new("100%").expect("valid").encoded(), "100%25");
    }

    #[test]
    fn printable_ascii_is_exactly_0x20_to_0x7e() {
        for b in 0u8..0x80 {
            let one = char::from(b).to_string();
            assert_eq!(printable_ascii(&one), (0x20..0x7f).contains(&b), "{b:#x}");
            // Past the compiler's vector width, and at its end.
            let long = format!("{}{one}", "x".repeat(70));
            assert_eq!(printable_ascii(&long), (0x20..0x7f).contains(&b), "{b:#x}");
        }
        assert!(!printable_ascii("caf\u{e9}"));
    }

    proptest! {
        #[test]
        fn encoding_round_trips_and_never_contains_slash(s in "\\PC{1,64}") {
            if let Ok(n) = LockName::new(&s) {
                let e = n.encoded();
                prop_assert!(!e.contains('/'));
                prop_assert!(e != "." && e != "..");
                prop_assert_eq!(decode(&e), Some(s.clone()));
            }
        }

        #[test]
        fn distinct_names_never_collide(a in "[a-z/%.:_\\-é]{1,12}", b in "[a-z/%.:_\\-é]{1,12}") {
            let (na, nb) = (LockName::new(&a).expect("valid"), LockName::new(&b).expect("valid"));
            prop_assert_eq!(a == b, na.encoded() == nb.encoded());
        }
    }
}
