//! An in-process fenced store for the shared-state behaviours: it keeps, per lock, the
//! highest token it has seen and which critical sections are inside, and judges the
//! lock from outside — never by asking the lock itself.
//!
//! A section enters with its grant's token and owner and exits saying whether its
//! guard still believed it held the lock. The book records a violation when one token
//! shows up with two owners (a token was granted twice), and [`FencedBook::exit`]
//! reports a section that exits still believing it holds although a section with a
//! *higher* token entered before it exited: a newer grant existed while the older
//! holder had not been told of its loss (two holders, or an inversion of tokens). The
//! caller decides whether that is a violation ([`FencedBook::exit_strict`]) or whether
//! the holder must hear of its loss within a window ([`FencedBook::violation`]).
//!
//! Reentrant holds of one owner share their grant's token, so they may be inside
//! together. Writes are fenced: a write with a token below the highest seen is
//! rejected and counted.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;

/// A critical section's place in the book.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SectionId(u64);

#[derive(Debug)]
struct Inside {
    token: u64,
    /// When a higher token was first seen (at or after this section's entry).
    newer_at: Option<Instant>,
    label: String,
}

#[derive(Debug, Default)]
struct Book {
    next: u64,
    highest: u64,
    owners: HashMap<u64, String>,
    inside: HashMap<SectionId, Inside>,
    sections: u64,
    writes: u64,
    stale_rejected: u64,
    violations: Vec<String>,
}

/// The store: one per behaviour run (one lock).
#[derive(Debug, Default)]
pub struct FencedBook {
    book: Mutex<Book>,
}

/// What the book saw, once every task is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BookReport {
    /// Critical sections entered.
    pub sections: u64,
    /// Writes accepted.
    pub writes: u64,
    /// Writes rejected for carrying a token below the highest seen.
    pub stale_rejected: u64,
    /// The highest token seen.
    pub highest: u64,
    /// Sections still inside (a task that never exited).
    pub still_inside: usize,
    /// What broke, one line each.
    pub violations: Vec<String>,
}

impl FencedBook {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A section holding `token` for `owner` starts (`label` says who, for messages).
    pub fn enter(&self, token: u64, owner: &str, label: &str) -> SectionId {
        let mut b = self.book();
        match b.owners.get(&token) {
            Some(o) if o != owner => {
                let v = format!("token {token} granted to two owners ({o} and {owner})");
                b.violations.push(v);
            }
            Some(_) => {}
            None => {
                b.owners.insert(token, owner.to_owned());
            }
        }
        let now = Instant::now();
        for other in b.inside.values_mut() {
            if token > other.token && other.newer_at.is_none() {
                other.newer_at = Some(now);
            }
        }
        // A token below one already seen: a newer grant exists, so this one must end
        // up lost (an inversion otherwise).
        let newer_at = (b.highest > token).then_some(now);
        b.highest = b.highest.max(token);
        b.next += 1;
        b.sections += 1;
        let id = SectionId(b.next);
        b.inside.insert(
            id,
            Inside {
                token,
                newer_at,
                label: label.to_owned(),
            },
        );
        id
    }

    /// A fenced write with `token`: accepted unless a higher token was seen.
    pub fn write(&self, token: u64) -> bool {
        let mut b = self.book();
        if token < b.highest {
            b.stale_rejected += 1;
            return false;
        }
        b.writes += 1;
        true
    }

    /// The section ends; `still_held`: its guard had not been told of a loss. Returns
    /// when a newer grant first showed up if the section still believed it held: its
    /// holder had to be told of the loss by then (or within the backend's window).
    pub fn exit(&self, id: SectionId, still_held: bool) -> Option<Instant> {
        let s = self.book().inside.remove(&id)?;
        if still_held { s.newer_at } else { None }
    }

    /// [`FencedBook::exit`], where any such overlap is a violation.
    pub fn exit_strict(&self, id: SectionId, still_held: bool) {
        let label = self
            .book()
            .inside
            .get(&id)
            .map(|s| (s.label.clone(), s.token));
        if let (Some(_), Some((label, token))) = (self.exit(id, still_held), label) {
            self.violation(format!(
                "{label} held token {token} and was not told of its loss while a newer grant worked"
            ));
        }
    }

    /// Record a violation.
    pub fn violation(&self, what: String) {
        self.book().violations.push(what);
    }

    /// What the book saw.
    pub fn report(&self) -> BookReport {
        let b = self.book();
        BookReport {
            sections: b.sections,
            writes: b.writes,
            stale_rejected: b.stale_rejected,
            highest: b.highest,
            still_inside: b.inside.len(),
            violations: b.violations.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reentrant_holds_share_a_token_and_are_not_an_overlap() {
        let book = FencedBook::default();
        let a = book.enter(5, "x", "a");
        let b = book.enter(5, "x", "b");
        assert!(book.write(5));
        book.exit_strict(b, true);
        book.exit_strict(a, true);
        assert!(book.report().violations.is_empty());
    }

    #[test]
    fn a_holder_that_overlaps_a_newer_grant_unaware_is_a_violation() {
        let book = FencedBook::default();
        let a = book.enter(5, "x", "a");
        let b = book.enter(6, "y", "b");
        assert!(!book.write(5), "stale write accepted");
        book.exit_strict(b, true);
        book.exit_strict(a, true);
        assert_eq!(book.report().violations.len(), 1);
        // Told of the loss in time: not a violation.
        let c = book.enter(7, "z", "c");
        let d = book.enter(8, "w", "d");
        book.exit_strict(c, false);
        book.exit_strict(d, true);
        assert_eq!(book.report().violations.len(), 1);
    }

    #[test]
    fn one_token_for_two_owners_is_a_violation() {
        let book = FencedBook::default();
        let a = book.enter(3, "x", "a");
        book.exit_strict(a, true);
        let b = book.enter(3, "y", "b");
        book.exit_strict(b, true);
        assert_eq!(book.report().violations.len(), 1);
    }

    #[test]
    fn an_older_token_entering_after_a_newer_one_must_end_lost() {
        let book = FencedBook::default();
        let a = book.enter(6, "x", "a");
        book.exit_strict(a, true);
        let b = book.enter(5, "y", "b");
        book.exit_strict(b, true);
        assert_eq!(book.report().violations.len(), 1);
    }
}
