//! Connection URLs: `scheme://[user[:password]@]host[:port][,host[:port]…][/path][?k=v&…]`.
//!
//! Comma-separated host lists (`redlock://a:6379,b:6379`) are not valid in the WHATWG URL
//! grammar, so the authority is split here by hand. Query parameters carry options; each
//! backend takes the ones it knows and [`ConnectUrl::finish`] rejects whatever is left, so
//! a misspelt option is an error rather than silently ignored.
//!
//! A password may be given inline, or with `password_env=VAR` (read from the environment)
//! or `password_file=PATH` (first line of a file). It is kept in a [`Secret`] that never
//! prints, and [`ConnectUrl`]'s `Display`/`Debug` show `***` in its place.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Replace the password of every URL in a text by `***` (errors and `Debug` output of
/// dlock are redacted already; this is for a URL a program logs itself).
pub use crate::error::redact_secrets;
use crate::error::{Error, Result};
/// The duration syntax of URL options (`500ms`, `30s`, `2m`, `1h`) — also that of the
/// `dlock` command's flags, for programs that take the same.
pub use crate::options::parse_duration;

/// A password that never shows itself in `Debug` or `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `text` (the typed options of backends that log in).
    #[cfg_attr(
        not(any(
            feature = "redis",
            feature = "etcd",
            feature = "postgres",
            feature = "mysql"
        )),
        allow(dead_code)
    )]
    pub(crate) fn new(text: &str) -> Self {
        Secret(text.to_owned())
    }

    /// The secret text, for handing to a driver.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// One `host[:port]` of the authority.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port, when given.
    pub port: Option<u16>,
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]", self.host)?;
        } else {
            f.write_str(&self.host)?;
        }
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

/// A parsed connection URL.
#[derive(Clone)]
pub struct ConnectUrl {
    scheme: String,
    /// Text after `scheme:` (or `scheme://`) and before `?`, as written.
    body: String,
    username: Option<String>,
    password: Option<Secret>,
    hosts: Vec<HostPort>,
    path: String,
    params: BTreeMap<String, String>,
    redacted: String,
}

impl fmt::Debug for ConnectUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectUrl")
            .field("url", &self.redacted)
            .finish()
    }
}

impl fmt::Display for ConnectUrl {
    /// The URL with its password replaced by `***`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted)
    }
}

impl ConnectUrl {
    /// Parse `url`.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a missing scheme, a malformed host list or port, a
    /// duplicated or malformed query parameter, or an unreadable password source.
    pub fn parse(url: &str) -> Result<Self> {
        let redacted = redact_secrets(url);
        let bad = |reason: &str| Error::InvalidUrl {
            url: redacted.clone(),
            reason: reason.to_owned(),
        };
        let colon = url
            .find(':')
            .ok_or_else(|| bad("missing scheme (expected e.g. sqlite:///path.db)"))?;
        let scheme = url[..colon].to_ascii_lowercase();
        if scheme.is_empty()
            || !scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.')
        {
            return Err(bad("malformed scheme"));
        }
        let after = &url[colon + 1..];
        let (hierarchical, after) = match after.strip_prefix("//") {
            Some(rest) => (true, rest),
            None => (false, after),
        };
        let (body, query) = match after.find('?') {
            Some(q) => (&after[..q], Some(&after[q + 1..])),
            None => (after, None),
        };
        let mut params = BTreeMap::new();
        if let Some(query) = query {
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                let k = percent_decode(k).ok_or_else(|| bad("bad percent-encoding in query"))?;
                let v = percent_decode(v).ok_or_else(|| bad("bad percent-encoding in query"))?;
                if params.insert(k.clone(), v).is_some() {
                    return Err(bad(&format!("query parameter {k:?} given twice")));
                }
            }
        }
        let mut parsed = ConnectUrl {
            scheme,
            body: body.to_owned(),
            username: None,
            password: None,
            hosts: Vec::new(),
            path: String::new(),
            params,
            redacted: redacted.clone(),
        };
        if hierarchical {
            let (authority, path) = match body.find('/') {
                Some(p) => (&body[..p], &body[p..]),
                None => (body, ""),
            };
            parsed.path =
                percent_decode(path).ok_or_else(|| bad("bad percent-encoding in path"))?;
            let hostlist = match authority.rfind('@') {
                Some(at) => {
                    let userinfo = &authority[..at];
                    let (user, pass) = match userinfo.split_once(':') {
                        Some((u, p)) => (u, Some(p)),
                        None => (userinfo, None),
                    };
                    let user = percent_decode(user)
                        .ok_or_else(|| bad("bad percent-encoding in user name"))?;
                    if !user.is_empty() {
                        parsed.username = Some(user);
                    }
                    if let Some(p) = pass {
                        let p = percent_decode(p)
                            .ok_or_else(|| bad("bad percent-encoding in password"))?;
                        parsed.password = Some(Secret(p));
                    }
                    &authority[at + 1..]
                }
                None => authority,
            };
            if !hostlist.is_empty() {
                for item in hostlist.split(',') {
                    parsed.hosts.push(parse_host(item).map_err(|r| bad(&r))?);
                }
            }
        }
        if let Some(var) = parsed.params.remove("password_env") {
            let value = std::env::var(&var).map_err(|_| {
                bad(&format!(
                    "password_env names {var:?}, which is not set in the environment"
                ))
            })?;
            parsed.set_password(value, &bad)?;
        }
        if let Some(file) = parsed.params.remove("password_file") {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| bad(&format!("cannot read password_file {file:?}: {}", e.kind())))?;
            let first = text.lines().next().unwrap_or("").to_owned();
            parsed.set_password(first, &bad)?;
        }
        Ok(parsed)
    }

    /// A URL made of parts (the typed options of `dlock::connect`): nothing is pasted
    /// into a string and parsed again, so no value needs escaping.
    pub(crate) fn from_parts(
        scheme: &str,
        username: Option<String>,
        password: Option<Secret>,
        hosts: Vec<HostPort>,
        path: String,
        params: BTreeMap<String, String>,
    ) -> Self {
        let mut authority = String::new();
        if username.is_some() || password.is_some() {
            authority.push_str(&percent_encode(username.as_deref().unwrap_or(""), ""));
            if password.is_some() {
                authority.push_str(":***");
            }
            authority.push('@');
        }
        let hostlist: Vec<String> = hosts.iter().map(ToString::to_string).collect();
        authority.push_str(&hostlist.join(","));
        let body = format!("{authority}{}", percent_encode(&path, "/:"));
        // Hosts or an absolute path: `scheme://…`; else an opaque body (`sqlite:rel.db`,
        // `sqlite::memory:`), as `parse` reads them.
        let mut redacted = if authority.is_empty() && !path.starts_with('/') {
            format!("{scheme}:{body}")
        } else {
            format!("{scheme}://{body}")
        };
        for (i, (k, v)) in params.iter().enumerate() {
            redacted.push(if i == 0 { '?' } else { '&' });
            redacted.push_str(&percent_encode(k, ""));
            redacted.push('=');
            redacted.push_str(&percent_encode(v, "/:"));
        }
        ConnectUrl {
            scheme: scheme.to_owned(),
            body,
            username,
            password,
            hosts,
            path,
            params,
            redacted,
        }
    }

    /// The query options not taken yet.
    pub(crate) fn params(&self) -> &BTreeMap<String, String> {
        &self.params
    }

    fn set_password(&mut self, value: String, bad: &dyn Fn(&str) -> Error) -> Result<()> {
        if self.password.is_some() {
            return Err(bad(
                "the password is given twice (inline and password_env/password_file)",
            ));
        }
        self.password = Some(Secret(value));
        Ok(())
    }

    /// The scheme, lower-cased (`redis`, `sqlite`, `redis+sentinel`, …).
    #[must_use]
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// Everything between `scheme:`/`scheme://` and `?`, as written (used by `sqlite:`).
    #[must_use]
    pub fn body(&self) -> &str {
        &self.body
    }

    /// User name, if any.
    #[must_use]
    pub fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    /// Password, if any (inline, `password_env` or `password_file`).
    #[must_use]
    pub fn password(&self) -> Option<&Secret> {
        self.password.as_ref()
    }

    /// The hosts of the authority, in order.
    #[must_use]
    pub fn hosts(&self) -> &[HostPort] {
        &self.hosts
    }

    /// The path after the authority, percent-decoded (`""` when absent).
    #[must_use]
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Set query option `key` to `value` unless the URL already gives it: a program's
    /// own default that its user can still override (`dlock run` sets SQLite's
    /// `wal_autocheckpoint` so). The URL as shown ([`fmt::Display`]) stays as written.
    pub fn default_param(&mut self, key: &str, value: &str) {
        self.params
            .entry(key.to_owned())
            .or_insert_with(|| value.to_owned());
    }

    /// Remove and return query parameter `key`.
    pub fn take_param(&mut self, key: &str) -> Option<String> {
        self.params.remove(key)
    }

    /// Remove query parameter `key` and parse it as a boolean (`true/false/1/0/yes/no`).
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] when the value is not a boolean.
    pub fn take_bool(&mut self, key: &str) -> Result<Option<bool>> {
        match self.params.remove(key) {
            None => Ok(None),
            Some(v) => match v.to_ascii_lowercase().as_str() {
                "" | "true" | "1" | "yes" | "on" => Ok(Some(true)),
                "false" | "0" | "no" | "off" => Ok(Some(false)),
                _ => Err(self.invalid(&format!("{key}={v:?} is not a boolean"))),
            },
        }
    }

    /// Remove query parameter `key` and parse it as a duration above zero (`500ms`,
    /// `2s`, …), or `default` when it is absent.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] when it does not parse, [`Error::InvalidUrl`] when zero.
    pub fn take_duration(&mut self, key: &str, default: Duration) -> Result<Duration> {
        let Some(v) = self.params.remove(key) else {
            return Ok(default);
        };
        let d = crate::options::parse_duration(key, &v)?;
        if d.is_zero() {
            return Err(self.invalid(&format!("{key} must be above zero")));
        }
        Ok(d)
    }

    /// Remove query parameter `key` and parse it as a whole number within `range`.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] when it is not a whole number within `range`.
    pub fn take_count(
        &mut self,
        key: &str,
        range: std::ops::RangeInclusive<u32>,
    ) -> Result<Option<u32>> {
        let Some(v) = self.params.remove(key) else {
            return Ok(None);
        };
        match v.parse::<u32>() {
            Ok(n) if range.contains(&n) => Ok(Some(n)),
            _ => Err(self.invalid(&format!(
                "{key}={v:?} must be a whole number from {} to {}",
                range.start(),
                range.end()
            ))),
        }
    }

    /// Take `lock_delay` (default none): how long a lock whose lease ran out without a
    /// release stays ungrantable to others (the Chubby/Consul lock-delay).
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] / [`Error::InvalidOption`] when it is not a duration of
    /// at most one hour.
    pub fn take_lock_delay(&mut self) -> Result<Duration> {
        let Some(v) = self.params.remove("lock_delay") else {
            return Ok(Duration::ZERO);
        };
        let d = crate::options::parse_duration("lock_delay", &v)?;
        if d > Duration::from_secs(3600) {
            return Err(self.invalid("lock_delay must be at most 1h"));
        }
        Ok(d)
    }

    /// An [`Error::InvalidUrl`] about this URL.
    #[must_use]
    pub fn invalid(&self, reason: &str) -> Error {
        Error::InvalidUrl {
            url: self.redacted.clone(),
            reason: reason.to_owned(),
        }
    }

    /// Fail if any query parameter was not taken by the backend.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] naming the unknown parameters and the accepted ones.
    pub fn finish(&self, accepted: &[&str]) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        let unknown: Vec<&str> = self.params.keys().map(String::as_str).collect();
        let mut known: Vec<&str> = accepted.to_vec();
        known.extend(["ttl", "password_env", "password_file"]);
        Err(self.invalid(&format!(
            "unknown query parameter(s) {} (accepted here: {})",
            unknown.join(", "),
            known.join(", ")
        )))
    }
}

fn parse_host(item: &str) -> Result<HostPort, String> {
    if item.is_empty() {
        return Err("empty host in host list".to_owned());
    }
    let (host, port) = if let Some(rest) = item.strip_prefix('[') {
        let close = rest
            .find(']')
            .ok_or_else(|| format!("unclosed '[' in host {item:?}"))?;
        let host = &rest[..close];
        let tail = &rest[close + 1..];
        let port = match tail.strip_prefix(':') {
            Some(p) => Some(p),
            None if tail.is_empty() => None,
            None => return Err(format!("unexpected text after ']' in {item:?}")),
        };
        (host, port)
    } else {
        match item.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (item, None),
        }
    };
    if host.is_empty() {
        return Err(format!("missing host name in {item:?}"));
    }
    if host.contains(|c: char| c.is_whitespace() || c == '/' || c == '@') {
        return Err(format!("invalid host name {host:?}"));
    }
    let port = match port {
        None => None,
        Some(p) => Some(
            p.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("invalid port {p:?} (expected 1-65535)"))?,
        ),
    };
    Ok(HostPort {
        host: host.to_owned(),
        port,
    })
}

/// `%XX` for every byte of `s` but unreserved characters and those in `keep`.
pub(crate) fn percent_encode(s: &str, keep: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let c = char::from(b);
        if b.is_ascii_alphanumeric()
            || matches!(c, '-' | '.' | '_' | '~')
            || (b.is_ascii() && keep.contains(c))
        {
            out.push(c);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decode `%XX` escapes; `None` for a malformed escape or invalid UTF-8.
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    if !s.contains('%') {
        return Some(s.to_owned());
    }
    crate::name::decode(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_whole_numbers_within_their_range() {
        let mut url = ConnectUrl::parse("redis://h:1?a=0&b=64&c=65&d=-1&e=x").expect("url");
        assert_eq!(url.take_count("a", 0..=64).expect("0"), Some(0));
        assert_eq!(url.take_count("b", 1..=64).expect("64"), Some(64));
        assert_eq!(url.take_count("absent", 1..=64).expect("absent"), None);
        for key in ["c", "d", "e"] {
            let e = url.take_count(key, 1..=64).expect_err(key);
            assert!(
                matches!(e, Error::InvalidUrl { .. }) && e.to_string().contains("from 1 to 64"),
                "{key}: {e}"
            );
        }
    }

    #[test]
    fn multi_host_authority() {
        let u = ConnectUrl::parse("redlock://a:6379,b:6380,[::1]:6381/2?ttl=5s").expect("parses");
        assert_eq!(u.scheme(), "redlock");
        let hosts: Vec<String> = u.hosts().iter().map(ToString::to_string).collect();
        assert_eq!(hosts, ["a:6379", "b:6380", "[::1]:6381"]);
        assert_eq!(u.path(), "/2");
    }

    #[test]
    fn password_is_redacted_everywhere() {
        let u = ConnectUrl::parse("redis://user:hunter2@h:1/0").expect("parses");
        assert_eq!(u.password().map(Secret::expose), Some("hunter2"));
        assert_eq!(u.username(), Some("user"));
        for shown in [
            format!("{u}"),
            format!("{u:?}"),
            format!("{:?}", u.password()),
        ] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
        let err = ConnectUrl::parse("redis://user:hunter2@h:99999").expect_err("bad port");
        assert!(!err.to_string().contains("hunter2"));
        assert!(!format!("{err:?}").contains("hunter2"));
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "nocolon",
            "redis://a:1,,b:2",
            "redis://a:0",
            "redis://a:x",
            "redis://[::1",
            "redis://h?x=1&x=2",
            "sqlite:///p?%zz=1",
        ] {
            assert!(
                matches!(ConnectUrl::parse(bad), Err(Error::InvalidUrl { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn unknown_params_are_errors() {
        let mut u = ConnectUrl::parse("redis://h?ttl=1s&tll=2s").expect("parses");
        assert_eq!(u.take_param("ttl").as_deref(), Some("1s"));
        let err = u.finish(&[]).expect_err("tll is unknown");
        assert!(err.to_string().contains("tll"), "{err}");
    }

    #[test]
    fn password_from_env() {
        // SAFETY: the variable name is unique to this test.
        unsafe { std::env::set_var("DLOCK_TEST_PW_ENV_123", "from-env") };
        let u = ConnectUrl::parse("redis://u@h?password_env=DLOCK_TEST_PW_ENV_123").expect("ok");
        assert_eq!(u.password().map(Secret::expose), Some("from-env"));
        assert!(ConnectUrl::parse("redis://h?password_env=DLOCK_TEST_NOPE_987").is_err());
    }
}
