//! Every SQL statement the MySQL/MariaDB backend runs, built once per backend from the
//! validated table prefix `P`.
//!
//! Tables: `P_locks` (lease mode), `P_holders` (session modes: who holds a lock, and the
//! lock's token counter), `P_rows` (row mode). Rows are never deleted: a lock's row is
//! its fencing counter, bumped with `LAST_INSERT_ID(fence + 1)` by the statement that
//! grants it, so the new token comes back in the statement's OK packet (no second round
//! trip) and tokens of a name strictly increase for as long as the table lives.
//!
//! # Why this cannot deadlock
//! Every statement but the batched renewal touches exactly one row, by primary key, in
//! its own autocommitted transaction (READ COMMITTED, so no gap locks). Once a name's
//! row exists, taking and giving back the lock are single-row updates that queue on one
//! record lock. The batched renewal ([`Statements::renew_many`]) locks its rows in
//! primary-key order (it reads them by the key list, through the primary key), so two
//! of them take their locks in one order, and a single-row statement it waits for holds
//! nothing else. Only the very first insert of a name can race with another first
//! insert; the rare deadlock that InnoDB may report there (1213) is retried by the
//! backend. Semaphores and read-write locks have tables of their own, where an attempt
//! is a short transaction that takes its name's gate row first (every other row it
//! writes is that name's): the same holds there.

/// The batch sizes [`Statements::renew_many`] has a text for (few texts, so few
/// prepared statements per connection).
pub(super) const RENEW_MANY_SIZES: [usize; 4] = [4, 16, 64, 256];

// The largest batch the renewer sends fits the largest text.
const _: () = assert!(RENEW_MANY_SIZES[3] >= crate::sql::renewer::MAX_BATCH);

/// Which of `n` holds are held: `WHERE` of [`renew_many`] and of [`held_of_many`].
/// A lease that has run out is not held, by the clock when the row is read (as the
/// single renewal: one that started before the end and ran after it must not bring
/// the ended lease back). Binds: the `n` keys, then `n` times key, owner, fence. The key list alone lets the
/// server look the rows up by primary key whatever it makes of the row-value list.
fn held_among(n: usize) -> String {
    let keys = vec!["?"; n].join(", ");
    let rows = vec!["(?, ?, ?)"; n].join(", ");
    format!(
        "lock_key IN ({keys}) AND (lock_key, owner, fence) IN ({rows})
           AND holds > 0 AND expires_at > SYSDATE(6)"
    )
}

/// The renewal of `n` holds in one statement. Binds: ttl µs, then as
/// [`held_among`]. Found rows: how many of the holds were renewed (a grant named twice
/// counts once).
fn renew_many(p: &str, n: usize) -> String {
    sql_text!(
        "UPDATE {p}_locks SET expires_at = GREATEST(expires_at, {NOW} + INTERVAL ? MICROSECOND)
         WHERE {}",
        held_among(n)
    )
}

/// Which of `n` holds are held now (their key and token), read after a
/// [`renew_many`] that found fewer rows than holds: a row held now was held, and so
/// renewed, by that statement (a grant's token is never held again once let go).
/// Binds as [`held_among`].
fn held_of_many(p: &str, n: usize) -> String {
    sql_text!(
        "SELECT lock_key, fence FROM {p}_locks WHERE {}",
        held_among(n)
    )
}

/// The SQL text for one table prefix.
#[derive(Debug)]
pub(super) struct Statements {
    pub schema: [String; 3],
    pub tables: String,
    pub acquire: String,
    pub renew: String,
    /// [`Statements::renew`] for several holds, one text per size of
    /// [`RENEW_MANY_SIZES`] (a batch is padded up to the next one).
    pub renew_many: Vec<(usize, String)>,
    /// Which of several holds are held ([`held_of_many`]), per size as `renew_many`.
    pub held_of_many: Vec<(usize, String)>,
    pub release: String,
    /// An operator's forced release of the hold with a given token.
    pub break_lease: String,
    pub inspect_lease: String,
    /// Names with a lease row / a holder record beginning with a prefix (byte order).
    pub names_lease: String,
    pub names_session: String,
    pub named_acquire: String,
    pub inspect_named: String,
    pub row_ensure: String,
    pub row_lock: String,
    pub row_holder: String,
    /// The head of row mode's release batch ([`Statements::row_release_batch`]).
    pub row_release: String,
    pub row_probe: String,
    /// Clears the record a failed attempt wrote ([`super::super::dialect::Dialect::row_forget`]).
    pub row_forget: String,
    pub inspect_row: String,
    /// Semaphores and read-write locks (`super::super::shared`).
    pub shared: SharedStatements,
}

/// The statements of semaphores and read-write locks.
#[derive(Debug)]
pub(super) struct SharedStatements {
    pub schema: [String; 2],
    pub tables: String,
    /// The attempt's first round trip, a template for
    /// [`super::super::shared::fill_in`].
    pub begin: String,
    pub put: String,
    pub renew: String,
    pub remove: String,
    pub holders: String,
}

impl SharedStatements {
    fn new(p: &str) -> Self {
        SharedStatements {
            schema: [
                sql_text!(
                    "CREATE TABLE IF NOT EXISTS {p}_shared_gate (
                        lock_key BINARY(32) NOT NULL,
                        family   VARCHAR(16) NOT NULL,
                        fence    BIGINT NOT NULL DEFAULT 0,
                        PRIMARY KEY (lock_key, family)
                     ) ENGINE=InnoDB"
                ),
                sql_text!(
                    "CREATE TABLE IF NOT EXISTS {p}_shared (
                        lock_key    BINARY(32) NOT NULL,
                        family      VARCHAR(16) NOT NULL,
                        acquisition BIGINT NOT NULL,
                        name        TEXT NOT NULL,
                        owner       VARBINARY(255) NOT NULL,
                        kind        VARCHAR(16) NOT NULL,
                        fence       BIGINT NOT NULL,
                        expires_at  DATETIME(6) NOT NULL,
                        metadata    TEXT NOT NULL,
                        PRIMARY KEY (lock_key, family, acquisition)
                     ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
                ),
            ],
            tables: sql_text!(
                "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()
                 AND TABLE_NAME IN ('{p}_shared_gate', '{p}_shared')"
            ),
            // Begins; creates the gate row or takes its record lock until the end of the
            // transaction (an upsert locks exclusively at once: no shared-then-exclusive
            // upgrade to deadlock on), drawing the next token (its last_insert_id: the
            // server sends each statement's answer as it goes, a wake-up for the client
            // each, so the token is not read back by a statement of its own); deletes
            // the dead rows; reads the live ones.
            begin: sql_text!(
                "BEGIN;
                 INSERT INTO {p}_shared_gate (lock_key, family, fence)
                 VALUES (x'{{key}}', '{{family}}', LAST_INSERT_ID(1))
                 ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1);
                 DELETE FROM {p}_shared WHERE lock_key = x'{{key}}' AND family = '{{family}}'
                   AND expires_at <= {NOW};
                 SELECT kind, owner, acquisition,
                        CAST(TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) DIV 1000 AS SIGNED)
                 FROM {p}_shared WHERE lock_key = x'{{key}}' AND family = '{{family}}'"
            ),
            // Binds: key, family, acquisition, name, owner, kind, fence, ttl µs, metadata.
            put: sql_text!(
                "INSERT INTO {p}_shared (lock_key, family, acquisition, name, owner, kind, fence, expires_at, metadata)
                 VALUES (?, ?, ?, ?, ?, ?, ?, {NOW} + INTERVAL ? MICROSECOND, ?)
                 ON DUPLICATE KEY UPDATE kind = VALUES(kind), fence = VALUES(fence),
                    owner = VALUES(owner), expires_at = VALUES(expires_at),
                    metadata = VALUES(metadata)"
            ),
            // Binds: ttl µs, key, family, acquisition, fence. Found rows: 1 when renewed.
            renew: sql_text!(
                "UPDATE {p}_shared SET expires_at = GREATEST(expires_at, {NOW} + INTERVAL ? MICROSECOND)
                 WHERE lock_key = ? AND family = ? AND acquisition = ? AND fence = ?
                   AND kind <> 'want-write' AND expires_at > {NOW}"
            ),
            holders: sql_text!(
                "SELECT kind, owner, fence,
                        CAST(TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) DIV 1000 AS SIGNED),
                        metadata
                 FROM {p}_shared WHERE lock_key = ? AND family = ? AND kind <> 'want-write'
                   AND expires_at > {NOW}
                 ORDER BY fence"
            ),
            // Binds: key, family, acquisition, what, what, what, fence.
            remove: sql_text!(
                "DELETE FROM {p}_shared
                 WHERE lock_key = ? AND family = ? AND acquisition = ?
                   AND (? = 'any' OR (? = 'want' AND kind = 'want-write')
                        OR (? = 'token' AND kind <> 'want-write' AND fence = ?))"
            ),
        }
    }
}

const NOW: &str = "UTC_TIMESTAMP(6)";

impl Statements {
    /// Row mode's lock, on the pinned connection in one round trip: opens the
    /// transaction and locks the row, answering the connection id (no row: the row
    /// is missing; error 3572 or 1205: it is locked). The key is inlined as hex digits.
    pub(super) fn row_lock_batch(&self, key: &[u8; 32]) -> String {
        crate::hex::inlined(&self.row_lock, key, &["' FOR UPDATE NOWAIT"])
    }

    /// Row mode's release, on the pinned connection in one round trip: the record
    /// stops naming the connection (it may lock other rows later), then the commit
    /// unlocks the row. The key is inlined as hex digits and the token as a number:
    /// no quoting needed.
    pub(super) fn row_release_batch(&self, key: &[u8; 32], fence: u64) -> String {
        use std::fmt::Write as _;
        let mut text = crate::hex::inlined(&self.row_release, key, &["' AND fence = "]);
        // Writing to a String cannot fail.
        let _ = write!(text, "{fence}; COMMIT");
        text
    }

    /// `lock_delay`: how long a lease that ran out without a release still blocks
    /// other owners (a number in the SQL text, not user input).
    /// `grant_budget`: how long an acquire may have run on the server and still grant
    /// ([`crate::sql::grant_budget`]; a number in the SQL text, not user input).
    pub(super) fn new(
        p: &str,
        lock_delay: std::time::Duration,
        grant_budget: std::time::Duration,
    ) -> Self {
        // A hold is live iff expires_at > now. A lease left to run out blocks others
        // until expires_at + lock_delay; a release that drops the last hold sets
        // expires_at to now − lock_delay, so the lock is free at once and `holds <= 0`
        // never needs checking on its own (holds is assigned mid-statement, so a later
        // condition could not read its old value).
        let d = lock_delay.as_micros();
        // Free for this owner: released, or run out past the lock-delay — or its own
        // lease ran out (then a *new* grant with a new token: the paused holder of the
        // old one must be fenced out, so it is never re-entered). Its own lease is
        // judged by the clock when the row is locked (`SYSDATE(6)`, in UTC as every
        // connection's `time_zone` is): the statement may have waited for the row
        // while that lease ended, and `UTC_TIMESTAMP(6)` is the statement's start.
        // Another owner's lease is judged by the start, which can only find it live
        // longer. Neither a grant nor a re-entry is made by a statement that ran longer
        // than `grant_budget` (it waited for the row, as long as
        // `innodb_lock_wait_timeout` allows, past its client's timeout: a grant its
        // client never hears of would keep the name taken for a TTL, or a re-entry
        // keep it taken after the real hold's release). Both are evaluated once, into
        // `@dlock_in` and `@dlock_free`, by the first assignment: the clock must not
        // give the later ones another answer (and a variable a statement did not
        // assign keeps the session's last value, so both are always assigned, the
        // first as the left operand). Binds the owner.
        let b = grant_budget.as_micros();
        let free = sql_text!(
            "(@dlock_free := ((@dlock_in := (SYSDATE(6) < {NOW} + INTERVAL {b} MICROSECOND)) \
                              AND (expires_at <= {NOW} - INTERVAL {d} MICROSECOND \
                                   OR (owner = ? AND expires_at <= SYSDATE(6)))))"
        );
        Statements {
            shared: SharedStatements::new(p),
            schema: [
                sql_text!(
                    "CREATE TABLE IF NOT EXISTS {p}_locks (
                        lock_key   BINARY(32) NOT NULL PRIMARY KEY,
                        name       TEXT NOT NULL,
                        owner      VARBINARY(255) NOT NULL,
                        holds      INT NOT NULL,
                        fence      BIGINT NOT NULL,
                        expires_at DATETIME(6) NOT NULL,
                        metadata   TEXT NOT NULL
                     ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
                ),
                sql_text!(
                    "CREATE TABLE IF NOT EXISTS {p}_holders (
                        lock_key BINARY(32) NOT NULL PRIMARY KEY,
                        name     TEXT NOT NULL,
                        owner    VARBINARY(255) NOT NULL,
                        fence    BIGINT NOT NULL,
                        metadata TEXT NOT NULL,
                        conn_id  BIGINT UNSIGNED NOT NULL
                     ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
                ),
                sql_text!(
                    "CREATE TABLE IF NOT EXISTS {p}_rows (
                        lock_key BINARY(32) NOT NULL PRIMARY KEY
                     ) ENGINE=InnoDB"
                ),
            ],
            tables: sql_text!(
                "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()
                 AND TABLE_NAME IN ('{p}_locks', '{p}_holders', '{p}_rows')"
            ),
            // Whether the row is free is decided once, by the first assignment. Not
            // free, in time and `owner = me` means a live hold of mine: re-entered,
            // same token. Every condition reads only columns no earlier assignment
            // changed, or reads them where either value gives the same answer
            // (`expires_at`: the owner is mine both before and after when it is not
            // free), so the statement means the same whether assignments see earlier
            // ones (MySQL, MariaDB's default) or all read the old row (MariaDB's
            // `SIMULTANEOUS_ASSIGNMENT`).
            // The name is not assigned: the key is its SHA-256, so a row's name never
            // changes (assigning it anyway cost the server more on every acquisition).
            // Binds: key, name, owner, ttl µs, metadata, then owner (free), owner for
            // fence, owner for holds, metadata, owner, and owner, ttl µs for
            // expires_at. last_insert_id = fence when granted, else 0.
            acquire: sql_text!(
                "INSERT INTO {p}_locks (lock_key, name, owner, holds, fence, expires_at, metadata)
                 VALUES (?, ?, ?, 1, LAST_INSERT_ID(1), {NOW} + INTERVAL ? MICROSECOND, ?)
                 ON DUPLICATE KEY UPDATE
                    fence = IF({free}, LAST_INSERT_ID(fence + 1),
                               IF(@dlock_in AND owner = ?, LAST_INSERT_ID(fence), fence + LAST_INSERT_ID(0))),
                    holds = IF(@dlock_free, 1, IF(@dlock_in AND owner = ?, holds + 1, holds)),
                    metadata = IF(@dlock_free, ?, metadata),
                    owner = IF(@dlock_free, ?, owner),
                    expires_at = IF(@dlock_free OR (@dlock_in AND owner = ?),
                                    GREATEST(expires_at, {NOW} + INTERVAL ? MICROSECOND),
                                    expires_at)"
            ),
            // Never shortens the lease: other holds of the owner rely on it. A lease
            // that has run out is not renewed, judged by the clock when the row is
            // read (`SYSDATE`, as the acquire judges its owner's own lease).
            // Binds: ttl µs, key, owner, fence. Affected (found) rows: 1 when renewed.
            renew: sql_text!(
                "UPDATE {p}_locks SET expires_at = GREATEST(expires_at, {NOW} + INTERVAL ? MICROSECOND)
                 WHERE lock_key = ? AND owner = ? AND fence = ? AND holds > 0 AND expires_at > SYSDATE(6)"
            ),
            renew_many: RENEW_MANY_SIZES
                .iter()
                .map(|&n| (n, renew_many(p, n)))
                .collect(),
            held_of_many: RENEW_MANY_SIZES
                .iter()
                .map(|&n| (n, held_of_many(p, n)))
                .collect(),
            // Binds: key, owner, fence.
            break_lease: sql_text!(
                "UPDATE {p}_locks SET holds = 0, expires_at = {NOW} - INTERVAL {d} MICROSECOND
                 WHERE lock_key = ? AND fence = ? AND holds > 0 AND expires_at > {NOW}"
            ),
            release: sql_text!(
                "UPDATE {p}_locks SET expires_at = IF(holds <= 1, {NOW} - INTERVAL {d} MICROSECOND, expires_at),
                        holds = holds - 1
                 WHERE lock_key = ? AND owner = ? AND fence = ? AND holds > 0"
            ),
            // Binds: key.
            names_lease: sql_text!("SELECT name FROM {p}_locks WHERE LEFT(name, CHAR_LENGTH(?)) = BINARY ? ORDER BY BINARY name LIMIT ?"),
            names_session: sql_text!("SELECT name FROM {p}_holders WHERE LEFT(name, CHAR_LENGTH(?)) = BINARY ? ORDER BY BINARY name LIMIT ?"),
            inspect_lease: sql_text!(
                "SELECT name, owner, holds, fence, metadata,
                        TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at)
                 FROM {p}_locks WHERE lock_key = ? AND holds > 0 AND expires_at > {NOW}"
            ),
            // On the pinned connection. Binds: key, name, owner, metadata, lock name,
            // name, owner, metadata. last_insert_id = fence when taken, else 0.
            named_acquire: sql_text!(
                "INSERT INTO {p}_holders (lock_key, name, owner, fence, metadata, conn_id)
                 SELECT ?, ?, ?, LAST_INSERT_ID(1), ?, CONNECTION_ID() FROM DUAL
                 WHERE GET_LOCK(?, 0) = 1
                 ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1), name = ?, owner = ?,
                    metadata = ?, conn_id = CONNECTION_ID()"
            ),
            // Asks what the acquire asks: is the named lock taken? Then who holds it: the
            // holder record of that connection, if any (none: a client outside dlock).
            // Binds: lock name, key. Row: name, owner, fence, metadata (empty without a
            // record), connection id.
            inspect_named: sql_text!(
                "SELECT COALESCE(h.name, ''), COALESCE(h.owner, ''), COALESCE(h.fence, 0),
                        COALESCE(h.metadata, '{{}}'), u.conn
                 FROM (SELECT IS_USED_LOCK(?) AS conn) u
                 LEFT JOIN {p}_holders h ON h.lock_key = ? AND h.conn_id = u.conn
                 WHERE u.conn IS NOT NULL"
            ),
            // Binds: key.
            row_ensure: sql_text!("INSERT IGNORE INTO {p}_rows (lock_key) VALUES (?)"),
            // See [`Statements::row_lock_batch`].
            row_lock: sql_text!(
                "BEGIN; SELECT CONNECTION_ID() FROM {p}_rows WHERE lock_key = x'"
            ),
            // Autocommitted beside the pinned transaction. Binds: key, name, owner,
            // metadata, conn id, name, owner, metadata, conn id.
            row_holder: sql_text!(
                "INSERT INTO {p}_holders (lock_key, name, owner, fence, metadata, conn_id)
                 VALUES (?, ?, ?, LAST_INSERT_ID(1), ?, ?)
                 ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1), name = ?, owner = ?,
                    metadata = ?, conn_id = ?"
            ),
            // Binds: key, conn id, owner.
            row_forget: sql_text!(
                "UPDATE {p}_holders SET conn_id = 0 WHERE lock_key = ? AND conn_id = ? AND owner = ?"
            ),
            // The pinned transaction's end: see [`Statements::row_release_batch`].
            row_release: sql_text!("UPDATE {p}_holders SET conn_id = 0 WHERE lock_key = x'"),
            // Asks what the acquire asks: can the row be locked? A shared lock, with
            // NOWAIT, for the one autocommitted statement: busy means held. (Not
            // `INNODB_TRX`: InnoDB refreshes that view only when nobody read it for
            // 100 ms, so an observer polling faster saw a past holder or none for
            // ever; and it needs PROCESS.) MySQL 8 spells it `FOR SHARE NOWAIT`
            // (`open` rewrites it there). Binds: key.
            row_probe: sql_text!(
                "SELECT 1 FROM {p}_rows WHERE lock_key = ? LOCK IN SHARE MODE NOWAIT"
            ),
            // Once the probe found the row held: who holds it, by the holder record
            // (none: a transaction outside dlock, or a holder about to write its
            // record). Binds: key.
            inspect_row: sql_text!(
                "SELECT COALESCE(h.name, ''), COALESCE(h.owner, ''), COALESCE(h.fence, 0),
                        COALESCE(h.metadata, '{{}}'), CAST(COALESCE(h.conn_id, 0) AS UNSIGNED)
                 FROM (SELECT 1) AS one
                 LEFT JOIN {p}_holders h ON h.lock_key = ? AND h.conn_id <> 0"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement is sent without its source indentation (no line of any of
    /// them begins with a space), and keeps its line breaks.
    #[test]
    fn statements_are_sent_without_their_indentation() {
        let sql = Statements::new(
            "dlock",
            std::time::Duration::ZERO,
            std::time::Duration::from_secs(5),
        );
        crate::sql::assert_sent_compacted(&format!("{sql:?}"));
    }

    /// The row batches inline the key exactly where the statement text expects it.
    #[test]
    fn row_batches_inline_the_key_as_hex() {
        let sql = Statements::new(
            "dlock",
            std::time::Duration::ZERO,
            std::time::Duration::from_secs(5),
        );
        let key = [0x0fu8; 32];
        let hex = "0f".repeat(32);
        assert_eq!(
            sql.row_lock_batch(&key),
            format!("{}{hex}' FOR UPDATE NOWAIT", sql.row_lock)
        );
        assert_eq!(
            sql.row_release_batch(&key, 42),
            format!("{}{hex}' AND fence = 42; COMMIT", sql.row_release)
        );
    }
}
