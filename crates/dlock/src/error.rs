//! The one error type of dlock.
//!
//! Every backend maps its driver errors into [`Error`]; no driver type leaks into the
//! public API. Messages never contain a password: URLs are redacted before they are
//! stored in an error, and driver messages pass through [`redact_secrets`].

use std::fmt;
use std::time::Duration;

/// Result alias used throughout dlock.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a held lock was lost.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LossReason {
    /// The local lease deadline passed without a successful renewal. The server may
    /// already have handed the lock to someone else (or will shortly).
    LeaseExpired,
    /// The server says the lock is no longer held by this owner (expired and taken,
    /// or deleted by hand).
    NotOwner,
    /// The backend session that carried the lock ended (connection, ZooKeeper
    /// session, etcd lease).
    SessionLost(String),
    /// The configured maximum hold time was reached, so renewal stopped.
    MaxHoldTime,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::LeaseExpired => f.write_str("lease expired without a successful renewal"),
            LossReason::NotOwner => f.write_str("the server no longer lists this owner as holder"),
            LossReason::SessionLost(why) => write!(f, "backend session lost: {why}"),
            LossReason::MaxHoldTime => f.write_str("maximum hold time reached"),
        }
    }
}

/// Everything that can go wrong in dlock.
///
/// "The lock is busy" is not an error: [`crate::Locker::try_lock`] returns `Ok(None)`.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Waiting for the lock took longer than allowed.
    #[error("timed out after {waited:?} waiting for lock {name:?}")]
    Timeout {
        /// The lock name.
        name: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The lock was lost while (or before) it was used.
    #[error("lock {name:?} lost: {reason}")]
    LockLost {
        /// The lock name.
        name: String,
        /// Why it was lost.
        reason: LossReason,
    },
    /// The caller is not the owner of the lock it tried to release or extend.
    #[error("lock {name:?} is not held by this owner")]
    NotOwner {
        /// The lock name.
        name: String,
    },
    /// A quorum backend could not get a majority because too few nodes answered in
    /// time (a lock held by another owner is not an error: it is waited for, or
    /// `try_lock` gives `None`). Also: fewer replicas than `min_replicas` acknowledged.
    #[error(
        "no quorum: {granted} of the {needed} needed nodes granted the lock ({unreachable} did not answer in time)"
    )]
    NoQuorum {
        /// Nodes (or replicas) that granted or acknowledged.
        granted: usize,
        /// Nodes (or replicas) needed.
        needed: usize,
        /// Nodes that did not answer in time (unreachable, paused, or too slow).
        unreachable: usize,
    },
    /// The connection URL is malformed or names unknown options.
    #[error("invalid URL {url}: {reason}")]
    InvalidUrl {
        /// The URL with any password replaced by `***`.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The lock name is not acceptable.
    #[error("invalid lock name {name}: {reason}")]
    InvalidName {
        /// The name, escaped for display and cut to a readable length.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An option value is out of range or malformed.
    #[error("invalid option {option}: {reason}")]
    InvalidOption {
        /// The option's name.
        option: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The URL names a backend that this build of dlock was compiled without.
    #[error("the {scheme}:// backend is not compiled in: enable the cargo feature `{feature}`")]
    BackendNotEnabled {
        /// URL scheme.
        scheme: String,
        /// Cargo feature that provides it.
        feature: String,
    },
    /// A write hold of a read-write lock asked for by an owner that holds a read of it:
    /// refused, because two readers upgrading at once would wait for each other
    /// forever. Release the read first (or take the write from the start).
    #[error(
        "read-write lock {name:?}: this owner holds a read; upgrading it to a write is refused (two upgrades would wait for each other forever)"
    )]
    UpgradeRefused {
        /// The read-write lock's name.
        name: String,
    },
    /// A downgrade of a write hold ([`crate::RwLock::downgrade`]) whose read could not
    /// be let in at once: on a backend that orders a read-write lock's contenders by
    /// arrival (etcd, ZooKeeper), a writer of another owner waits, and a read now would
    /// queue behind it. The write is kept as it was.
    #[error(
        "read-write lock {name:?}: the downgrade's read cannot be let in at once (a writer of another owner waits, and this backend orders contenders by arrival); the write is kept"
    )]
    DowngradeRefused {
        /// The read-write lock's name.
        name: String,
    },
    /// The backend cannot do what was asked.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Could not reach the backend (or the connection broke); usually worth a retry.
    #[error("connection to {backend} failed: {message}")]
    Connection {
        /// Backend scheme.
        backend: &'static str,
        /// Redacted driver message.
        message: String,
    },
    /// The server refused the credentials, or refused this user the operation
    /// (authentication or permission): not worth a retry until the configuration
    /// changes.
    #[error("{backend} refused access: {message}")]
    Denied {
        /// Backend scheme.
        backend: &'static str,
        /// Redacted server message.
        message: String,
    },
    /// The backend answered with an error.
    #[error("{backend} error: {message}")]
    Backend {
        /// Backend scheme.
        backend: &'static str,
        /// Redacted driver message.
        message: String,
    },
}

impl Error {
    /// Whether trying the same operation again later may succeed.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. } | Error::Connection { .. } | Error::NoQuorum { .. }
        )
    }

    pub(crate) fn option(option: &str, reason: impl Into<String>) -> Self {
        Error::InvalidOption {
            option: option.to_owned(),
            reason: reason.into(),
        }
    }

    pub(crate) fn backend(backend: &'static str, message: impl fmt::Display) -> Self {
        Error::Backend {
            backend,
            message: redact_secrets(&message.to_string()),
        }
    }

    #[cfg_attr(
        not(any(
            feature = "postgres",
            feature = "mysql",
            feature = "redis",
            feature = "etcd"
        )),
        allow(dead_code)
    )]
    pub(crate) fn denied(backend: &'static str, message: impl fmt::Display) -> Self {
        Error::Denied {
            backend,
            message: redact_secrets(&message.to_string()),
        }
    }

    pub(crate) fn connection(backend: &'static str, message: impl fmt::Display) -> Self {
        Error::Connection {
            backend,
            message: redact_secrets(&message.to_string()),
        }
    }
}

/// Replace the password part of anything that looks like `scheme://user:password@host`
/// in `text` with `***`.
///
/// Driver error messages sometimes echo the connection string; every message that
/// enters an [`Error`] passes through here.
#[must_use]
pub fn redact_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        // The authority ends at the first '/', '?', '#' or whitespace.
        let end = tail
            .find(|c: char| c == '/' || c == '?' || c == '#' || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon]);
                        out.push_str(":***");
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_in_urls() {
        let s = redact_secrets("failed: redis://bob:s3cr3t@h:1/0 and postgres://x:y@z/db?a=b");
        assert!(!s.contains("s3cr3t"), "{s}");
        assert!(!s.contains(":y@"), "{s}");
        assert_eq!(
            s,
            "failed: redis://bob:***@h:1/0 and postgres://x:***@z/db?a=b"
        );
    }

    #[test]
    fn leaves_plain_text_alone() {
        assert_eq!(redact_secrets("no url here"), "no url here");
        assert_eq!(redact_secrets("redis://h:1"), "redis://h:1");
        assert_eq!(redact_secrets("redis://user@h:1"), "redis://user@h:1");
    }

    #[test]
    fn retryable_classification() {
        assert!(Error::connection("redis", "x").is_retryable());
        assert!(!Error::option("ttl", "x").is_retryable());
        assert!(!Error::NotOwner { name: "a".into() }.is_retryable());
    }
}
