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

/// Where the line `heading` begins in `doc` (a whole line, not part of one).
fn heading_at(doc: &str, heading: &str) -> Option<usize> {
    let line_end = |at: usize| {
        doc[at + heading.len()..].is_empty() || doc[at + heading.len()..].starts_with('\n')
    };
    if doc.starts_with(heading) && line_end(0) {
        return Some(0);
    }
    doc.match_indices(&format!("\n{heading}"))
        .map(|(i, _)| i + 1)
        .find(|&at| line_end(at))
}

/// Write `section` over the section of the document at `path` that begins with the
/// line `heading` — everything from it to the next `## ` heading, or to the end —
/// keeping what comes before and after it. A document without that heading yet gets
/// `section` inserted before the line `before`, or appended if it has neither (or
/// `before` is `None`); a document that does not exist yet is made.
///
/// # Errors
/// When the document exists but cannot be read, or cannot be written.
pub fn replace_section(
    path: &str,
    heading: &str,
    before: Option<&str>,
    section: &str,
) -> std::io::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let Some(at) = heading_at(&old, heading) else {
        let at = before
            .and_then(|b| heading_at(&old, b))
            .unwrap_or(old.len());
        return std::fs::write(path, format!("{}{section}{}", &old[..at], &old[at..]));
    };
    let end = old[at + heading.len()..]
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
        replace_section(path, "## A", Some("## B"), "## A\n\nnew\n").expect("replace");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\n## A\n\nnew\n## B\n\nb\n"
        );
        replace_section(path, "## B", None, "## B\n\nlast\n").expect("replace the last");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\n## A\n\nnew\n## B\n\nlast\n"
        );
        replace_section(path, "## C", Some("## Z"), "## C\n\nc\n").expect("append");
        assert!(
            std::fs::read_to_string(path)
                .expect("read")
                .ends_with("## B\n\nlast\n## C\n\nc\n")
        );
        replace_section(path, "## A0", Some("## B"), "## A0\n\nz\n").expect("insert");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\n## A\n\nnew\n## A0\n\nz\n## B\n\nlast\n## C\n\nc\n"
        );
        // Only a whole line is the heading: "## A" is not "## A0", nor inside a line.
        replace_section(path, "## A", None, "## A\n\nagain\n").expect("replace");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "# Doc\n\n## A\n\nagain\n## A0\n\nz\n## B\n\nlast\n## C\n\nc\n"
        );
        std::fs::write(path, "see ## X here\n").expect("write");
        replace_section(path, "## X", None, "## X\n\nx\n").expect("append");
        assert_eq!(
            std::fs::read_to_string(path).expect("read"),
            "see ## X here\n## X\n\nx\n"
        );
        // A document that cannot be read is an error, not an empty document.
        let dir_path = dir.path().to_str().expect("utf-8 path");
        assert!(replace_section(dir_path, "## X", None, "## X\n").is_err());
    }
}
