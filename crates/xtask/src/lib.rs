//! What the generators of BENCHMARKS.md and RELIABILITY.md share.

/// The backends the primitives beyond the mutex are measured and checked on: the SQL
/// backends keep those primitives' rows the same way in every mode, so one mode each;
/// Redlock offers elections only.
pub const PRIMITIVE_BACKENDS: [&str; 7] = [
    "sqlite",
    "redis (no persistence)",
    "etcd",
    "zookeeper",
    "postgres lease",
    "mariadb lease",
    "redlock (5 nodes)",
];

/// The machine's CPU model, from `/proc/cpuinfo` (empty when unknown).
#[must_use]
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default()
}

/// Write `section` over the last section of the document at `path` — everything from
/// `heading`, which begins `section`, to the end — keeping what comes before it; the
/// whole of `section` is appended when the document has no such heading yet.
///
/// # Errors
/// When the document cannot be written.
pub fn replace_last_section(path: &str, heading: &str, section: &str) -> std::io::Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let kept = old.find(heading).map_or(old.as_str(), |at| &old[..at]);
    std::fs::write(path, format!("{kept}{section}"))
}

/// Write `section` over the section of the document at `path` that begins with
/// `heading` — everything from it to the next `## ` heading, or to the end — keeping
/// what comes before and after it. A document without that heading yet gets `section`
/// inserted before the heading `before`, or appended if it has neither.
///
/// # Errors
/// When the document cannot be written.
pub fn replace_section(
    path: &str,
    heading: &str,
    before: &str,
    section: &str,
) -> std::io::Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let Some(at) = old.find(heading) else {
        let at = old.find(before).unwrap_or(old.len());
        return std::fs::write(path, format!("{}{section}{}", &old[..at], &old[at..]));
    };
    let rest = &old[at + heading.len()..];
    let end = rest
        .find("\n## ")
        .map_or(old.len(), |i| at + heading.len() + i + 1);
    std::fs::write(path, format!("{}{section}{}", &old[..at], &old[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A middle section is replaced up to the next heading; the rest is kept byte for
    /// byte; a document without it gets it before the heading named, else at the end.
    #[test]
    fn a_middle_section_is_replaced_and_the_rest_kept() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("DOC.md");
        let path = path.to_str().expect("utf-8 path");
        std::fs::write(path, "# Doc\n\n## A\n\na\n## B\n\nb\n").expect("write");
        replace_section(path, "## A", "## B", "## A\n\nnew\n").expect("replace");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\n## A\n\nnew\n## B\n\nb\n"
        );
        replace_section(path, "## B", "## Z", "## B\n\nlast\n").expect("replace the last");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\n## A\n\nnew\n## B\n\nlast\n"
        );
        replace_section(path, "## C", "## Z", "## C\n\nc\n").expect("append");
        assert!(
            std::fs::read_to_string(path)
                .expect("read")
                .ends_with("## B\n\nlast\n## C\n\nc\n")
        );
        replace_section(path, "## A0", "## B", "## A0\n\nz\n").expect("insert");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\n## A\n\nnew\n## A0\n\nz\n## B\n\nlast\n## C\n\nc\n"
        );
    }

    /// The last section is replaced from its heading on; a document without it gets
    /// the section appended; what came before is kept byte for byte.
    #[test]
    fn the_last_section_is_replaced_and_the_rest_kept() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("DOC.md");
        let path = path.to_str().expect("utf-8 path");
        std::fs::write(path, "# Doc\n\nbefore\n").expect("write");
        replace_last_section(path, "## Last", "## Last\n\none\n").expect("append");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\nbefore\n## Last\n\none\n"
        );
        replace_last_section(path, "## Last", "## Last\n\ntwo\n").expect("replace");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\nbefore\n## Last\n\ntwo\n"
        );
    }
}
