//! Every SQL statement the PostgreSQL backend runs, built once per backend from the
//! validated table prefix `P`.
//!
//! Tables: `P_locks` (lease mode: one row per name, kept after release so the key stays
//! cheap to take again), `P_holders` (session modes: who holds a lock, for `inspect`
//! and the token), `P_rows` (row mode: the rows locked `FOR UPDATE`) and the sequence
//! `P_fence` that every grant's fencing token comes from. A grant's `nextval` is
//! committed by the same statement that records it, so the sequence's advance is on disk
//! before the token is reported, and tokens never repeat after a crash.

use super::marks::notify_if_marked;

/// The SQL text for one table prefix.
#[derive(Debug)]
pub(super) struct Statements {
    pub schema: String,
    pub tables: String,
    /// Whether the holder records have the column row mode keeps the locking
    /// transaction's id in (tables made before it lack it).
    pub holders_xact: String,
    /// Adds that column (run only when it is missing: it takes the table's strongest
    /// lock and needs its owner).
    pub add_xact: String,
    pub channel: String,
    pub acquire: String,
    /// How long a busy name's lease has left (ms), lock delay included: asked
    /// after a busy acquire, so the acquire itself stays one small statement.
    pub busy_left: String,
    pub renew: String,
    /// [`Statements::renew`] for several holds: see [`super::super::renewer`].
    pub renew_many: String,
    pub release: String,
    /// An operator's forced release of the hold with a given token.
    pub break_lease: String,
    pub inspect_lease: String,
    /// Names with a lease row / a holder record beginning with a prefix (byte order).
    pub names_lease: String,
    pub names_session: String,
    /// Run once on each advisory-mode session connection, when it is made: reads the
    /// session's `backend_start`, which [`Statements::advisory_acquire`] is given.
    pub advisory_session: String,
    pub advisory_acquire: String,
    pub advisory_release: String,
    pub inspect_advisory: String,
    pub row_ensure: String,
    /// Row mode's two statements, prepared once per session connection: planning
    /// them on every simple query cost the server more than running them.
    pub row_prepare: String,
    /// The text of row mode's locking batch before and after the key's hex digits
    /// ([`Statements::row_lock_batch`]).
    pub row_lock: (String, String),
    pub row_holder: String,
    /// The parts of row mode's release batch ([`Statements::row_release_batch`]).
    pub row_release: (String, String),
    pub inspect_row: String,
    /// Semaphores and read-write locks (`super::super::shared`).
    pub shared: SharedStatements,
}

/// The statements of semaphores and read-write locks.
#[derive(Debug)]
pub(super) struct SharedStatements {
    pub tables: String,
    pub schema: String,
    /// The attempt's first round trip, a template for
    /// [`super::super::shared::fill_in`].
    pub begin: String,
    pub put: String,
    pub renew: String,
    pub remove: String,
    pub holders: String,
}

impl SharedStatements {
    /// `gate_limit`: how long an attempt's transaction may wait for its client, and
    /// how long it may wait for its name's gate (the module documentation says why).
    fn new(p: &str, gate_limit: std::time::Duration) -> Self {
        // Within the settings' range (an `int` of milliseconds).
        let limit_ms = gate_limit.as_millis().clamp(1, i32::MAX as u128);
        let notify_remove = notify_if_marked("$6", "$7", "$1");
        SharedStatements {
            tables: sql_text!(
                "SELECT to_regclass('{p}_shared') IS NOT NULL AND to_regclass('{p}_shared_gate') IS NOT NULL"
            ),
            schema: sql_text!(
                "CREATE TABLE IF NOT EXISTS {p}_shared_gate (
                    lock_key bytea NOT NULL,
                    family   text NOT NULL,
                    fence    bigint NOT NULL DEFAULT 0,
                    PRIMARY KEY (lock_key, family)
                 );
                 CREATE TABLE IF NOT EXISTS {p}_shared (
                    lock_key    bytea NOT NULL,
                    family      text NOT NULL,
                    acquisition bigint NOT NULL,
                    name        text NOT NULL,
                    owner       text NOT NULL,
                    kind        text NOT NULL,
                    fence       bigint NOT NULL,
                    expires_at  timestamptz NOT NULL,
                    metadata    text NOT NULL,
                    PRIMARY KEY (lock_key, family, acquisition)
                 );"
            ),
            // Begins (READ COMMITTED whatever the server's default: each statement sees
            // what was committed before it began, so the rows read after the gate
            // include those committed while it was awaited); creates the gate row or
            // locks it until the end of the transaction, drawing the next token (the
            // first row); deletes the dead rows; reads the live ones (the next rows) —
            // in statements of their own: a read in the deleting statement would see
            // the rows as they were before the gate, one whose renewal committed
            // meanwhile as dead. "Now" is the clock's (`clock_timestamp`): every
            // statement of a batch has the batch's arrival, before the wait, as its
            // `statement_timestamp`.
            // Then the limits on the attempt's hold of the gate (the module
            // documentation), `SET LOCAL`: for this transaction only, and through a
            // connection pooler too, where a connection's startup options would not
            // reach the session or be refused.
            begin: sql_text!(
                "BEGIN ISOLATION LEVEL READ COMMITTED;
                 SET LOCAL idle_in_transaction_session_timeout = {limit_ms};
                 SET LOCAL lock_timeout = {limit_ms};
                 INSERT INTO {p}_shared_gate AS g (lock_key, family, fence)
                 VALUES (decode('{{key}}', 'hex'), '{{family}}', 1)
                 ON CONFLICT (lock_key, family) DO UPDATE SET fence = g.fence + 1
                 RETURNING fence;
                 DELETE FROM {p}_shared WHERE lock_key = decode('{{key}}', 'hex')
                   AND family = '{{family}}' AND expires_at <= clock_timestamp();
                 SELECT kind, owner, acquisition,
                        (EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000)::bigint
                 FROM {p}_shared WHERE lock_key = decode('{{key}}', 'hex')
                   AND family = '{{family}}'"
            ),
            // Binds: 1 key, 2 family, 3 acquisition, 4 name, 5 owner, 6 kind, 7 fence,
            // 8 ttl µs, 9 metadata.
            put: sql_text!(
                "INSERT INTO {p}_shared (lock_key, family, acquisition, name, owner, kind, fence, expires_at, metadata)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, statement_timestamp() + $8 * interval '1 microsecond', $9)
                 ON CONFLICT (lock_key, family, acquisition) DO UPDATE SET
                    kind = excluded.kind, fence = excluded.fence, owner = excluded.owner,
                    expires_at = excluded.expires_at, metadata = excluded.metadata"
            ),
            // Binds: 1 key, 2 family, 3 acquisition, 4 fence, 5 ttl µs.
            renew: sql_text!(
                "UPDATE {p}_shared
                 SET expires_at = GREATEST(expires_at, statement_timestamp() + $5 * interval '1 microsecond')
                 WHERE lock_key = $1 AND family = $2 AND acquisition = $3 AND fence = $4
                   AND kind <> 'want-write' AND expires_at > statement_timestamp()"
            ),
            holders: sql_text!(
                "SELECT kind, owner, fence,
                        (EXTRACT(EPOCH FROM (expires_at - statement_timestamp())) * 1000)::bigint,
                        metadata
                 FROM {p}_shared WHERE lock_key = $1 AND family = $2 AND kind <> 'want-write'
                   AND expires_at > statement_timestamp()
                 ORDER BY fence"
            ),
            // Binds: 1 key, 2 family, 3 acquisition, 4 what (token | want | any),
            // 5 fence, 6 channel, 7 key hex. Notifies when a row went.
            remove: sql_text!(
                "WITH d AS (
                    DELETE FROM {p}_shared
                    WHERE lock_key = $1 AND family = $2 AND acquisition = $3
                      AND CASE $4 WHEN 'want' THEN kind = 'want-write'
                                  WHEN 'any' THEN true
                                  ELSE kind <> 'want-write' AND fence = $5 END
                    RETURNING 1)
                 SELECT count(*) FROM d
                 LEFT JOIN LATERAL (SELECT {notify_remove}) n ON true"
            ),
        }
    }
}

/// Remaining lease of row `l` in whole milliseconds (negative: expired).
const REMAINING_MS: &str =
    "(EXTRACT(EPOCH FROM (l.expires_at - statement_timestamp())) * 1000)::bigint";

impl Statements {
    /// Row mode's locking batch for a key (inlined as hex digits: no quoting needed).
    pub(super) fn row_lock_batch(&self, key: &[u8; 32]) -> String {
        let (head, tail) = &self.row_lock;
        crate::hex::inlined(head, key, &[tail])
    }

    /// Row mode's release batch for a key (inlined as hex digits).
    pub(super) fn row_release_batch(&self, key: &[u8; 32]) -> String {
        let (head, tail) = &self.row_release;
        crate::hex::inlined(head, key, &["', 'hex')", tail])
    }

    /// `lock_delay`: how long a lease that ran out without a release still blocks
    /// other owners (a number in the SQL text, not user input).
    /// `gate_limit`: how long a semaphore's or read-write lock's attempt may wait for
    /// its client inside its transaction, or for its name's gate.
    pub(super) fn new(
        p: &str,
        lock_delay: std::time::Duration,
        gate_limit: std::time::Duration,
    ) -> Self {
        let delay = sql_text!("interval '{} microseconds'", lock_delay.as_micros());
        // What a renewal inserts should the row be gone (deleted by hand: the name
        // shows again, free): the row free (no hold, its lease ended — at a finite
        // time, which a busy acquire subtracts from), keeping its token.
        let free_copy =
            "lock_key, name, owner, 0, fence, LEAST(expires_at, statement_timestamp()), metadata";
        // Releases wake waiters only where a process marked the key (see `marks`).
        let notify_break = notify_if_marked("$3", "$4", "$1");
        let notify_release = notify_if_marked("$4", "$5", "$1");
        Statements {
            shared: SharedStatements::new(p, gate_limit),
            schema: sql_text!(
                "CREATE TABLE IF NOT EXISTS {p}_locks (
                    lock_key   bytea PRIMARY KEY,
                    name       text NOT NULL,
                    owner      text NOT NULL,
                    holds      integer NOT NULL,
                    fence      bigint NOT NULL,
                    expires_at timestamptz NOT NULL,
                    metadata   text NOT NULL
                 );
                 CREATE SEQUENCE IF NOT EXISTS {p}_fence;
                 CREATE TABLE IF NOT EXISTS {p}_holders (
                    lock_key      bytea PRIMARY KEY,
                    name          text NOT NULL,
                    owner         text NOT NULL,
                    fence         bigint NOT NULL,
                    metadata      text NOT NULL,
                    pid           integer NOT NULL,
                    backend_start timestamptz,
                    xact          bigint
                 );
                 CREATE TABLE IF NOT EXISTS {p}_rows (lock_key bytea PRIMARY KEY);"
            ),
            tables: sql_text!(
                "SELECT to_regclass('{p}_locks') IS NOT NULL AND to_regclass('{p}_fence') IS NOT NULL \
                 AND to_regclass('{p}_holders') IS NOT NULL AND to_regclass('{p}_rows') IS NOT NULL"
            ),
            // Behind a long reader the ALTER would queue every other statement on the
            // table behind it: it gives up after 2 s instead.
            add_xact: sql_text!(
                "SET LOCAL lock_timeout = '2s';
                 ALTER TABLE {p}_holders ADD COLUMN IF NOT EXISTS xact bigint"
            ),
            holders_xact: sql_text!(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('{p}_holders') \
                                AND attname = 'xact' AND NOT attisdropped)"
            ),
            channel: format!("{p}_released"),
            // Binds: 1 key, 2 name, 3 owner, 4 ttl µs, 5 metadata, 6 how long the
            // statement may run and still grant (µs, below the client's timeout: a
            // statement that waited for the row past it grants nothing, as its client
            // has given up and would never know of the grant).
            // Granted: one row (the fence). Busy: none (`busy_left` tells for how long).
            // An existing row is decided once it is locked, which the statement may
            // have waited for (or been preempted before) while other clients changed
            // it: the update draws the token then (the `nextval` of the inserted values
            // came earlier, so it may be below a token another client was granted and
            // released meanwhile; rows are never deleted, so an insert has no earlier
            // token to follow), and whether the row is a live hold of this owner, to be
            // re-entered with its token, is judged once, by the clock at that moment
            // (`clock_timestamp()`: the statement's start may come before a lease that
            // has ended since). Another owner's lease is judged by the statement's
            // start, which can only find it live longer. The clock of that moment is
            // read once, by the first assignment that asks for `c` (a CTE is evaluated
            // when first read, and once: every later read sees the same instant), so
            // all four assignments judge alike. (A sub-select per row that judged once
            // and fed all four cost the server more per acquisition, as
            // `pg_stat_statements` showed.)
            acquire: sql_text!(
                "WITH c AS (SELECT clock_timestamp() AS now)
                 INSERT INTO {p}_locks AS l (lock_key, name, owner, holds, fence, expires_at, metadata)
                    VALUES ($1, $2, $3, 1, nextval('{p}_fence'), statement_timestamp() + $4 * interval '1 microsecond', $5)
                    ON CONFLICT (lock_key) DO UPDATE SET
                        holds = CASE WHEN {live} THEN l.holds + 1 ELSE 1 END,
                        fence = CASE WHEN {live} THEN l.fence ELSE nextval('{p}_fence') END,
                        expires_at = CASE WHEN {live} THEN GREATEST(l.expires_at, excluded.expires_at)
                                          ELSE excluded.expires_at END,
                        metadata = CASE WHEN {live} THEN l.metadata ELSE excluded.metadata END,
                        name = excluded.name,
                        owner = excluded.owner
                    WHERE (l.owner = $3 OR l.holds <= 0 OR l.expires_at + {delay} <= statement_timestamp())
                      AND clock_timestamp() < statement_timestamp() + $6 * interval '1 microsecond'
                 RETURNING l.fence",
                live = "(l.owner = $3 AND l.holds > 0 AND l.expires_at > (SELECT now FROM c))"
            ),
            // Binds: 1 key. One row (ms; ≤ 0: free now, released since the acquire
            // included) unless the row is gone.
            busy_left: sql_text!(
                "SELECT CASE WHEN l.holds > 0
                        THEN (EXTRACT(EPOCH FROM (l.expires_at + {delay} - statement_timestamp())) * 1000)::bigint
                        ELSE 0 END
                 FROM {p}_locks l WHERE l.lock_key = $1"
            ),
            // Never shortens the lease: other holds of the owner rely on it. A lease
            // that has run out is not renewed, judged by the clock once the row is
            // locked (a renewal that started before the end and ran after it must not
            // bring the ended lease back for a later re-entry of its owner). A plain
            // UPDATE cannot judge then: it evaluates its condition when it reads the
            // row, and after waiting for a transaction that only locked the row (a
            // busy acquire's ON CONFLICT, a `FOR UPDATE`) it goes on with that old
            // answer. ON CONFLICT DO UPDATE locks the row first and evaluates its
            // WHERE on it, so the renewal is an insert of a copy of the row (dlock
            // never deletes rows: it conflicts) whose conflict updates. Should the row
            // be gone (deleted by hand) the copy that lands is a free one — no hold,
            // an ended lease — and renews nothing: only rows holding count.
            // Binds: 1 key, 2 owner, 3 fence, 4 ttl µs. A row (holds) when renewed.
            renew: sql_text!(
                "WITH r AS (
                    INSERT INTO {p}_locks AS l (lock_key, name, owner, holds, fence, expires_at, metadata)
                    SELECT {free_copy} FROM {p}_locks WHERE lock_key = $1
                    ON CONFLICT (lock_key) DO UPDATE
                    SET expires_at = GREATEST(l.expires_at, statement_timestamp() + $4 * interval '1 microsecond')
                    WHERE l.owner = $2 AND l.fence = $3 AND l.holds > 0
                      AND l.expires_at > clock_timestamp()
                    RETURNING l.holds)
                 SELECT holds FROM r WHERE holds > 0"
            ),
            // The same for several holds, in one statement, the rows locked in key
            // order (two batches never wait for each other crosswise). Binds: 1 keys,
            // 2 owners, 3 fences (arrays, one element per hold), 4 ttl µs. Returns
            // the renewed rows' key and fence (a grant renewed twice in the batch,
            // once).
            renew_many: sql_text!(
                "WITH r AS (
                    INSERT INTO {p}_locks AS l (lock_key, name, owner, holds, fence, expires_at, metadata)
                    SELECT {free_copy} FROM {p}_locks WHERE lock_key = ANY($1::bytea[])
                    ORDER BY lock_key
                    ON CONFLICT (lock_key) DO UPDATE
                    SET expires_at = GREATEST(l.expires_at, statement_timestamp() + $4 * interval '1 microsecond')
                    WHERE l.holds > 0 AND l.expires_at > clock_timestamp()
                      AND EXISTS (SELECT 1 FROM unnest($1::bytea[], $2::text[], $3::bigint[]) AS v(lock_key, owner, fence)
                                  WHERE v.lock_key = l.lock_key AND v.owner = l.owner AND v.fence = l.fence)
                    RETURNING l.lock_key, l.fence, l.holds)
                 SELECT lock_key, fence FROM r WHERE holds > 0"
            ),
            // Binds: 1 key, 2 fence, 3 channel, 4 key hex. Notifies at the last hold.
            break_lease: sql_text!(
                "WITH b AS (
                    UPDATE {p}_locks SET holds = 0
                    WHERE lock_key = $1 AND fence = $2 AND holds > 0
                      AND expires_at > statement_timestamp()
                    RETURNING lock_key)
                 SELECT count(*) FROM b
                 LEFT JOIN LATERAL (SELECT {notify_break}) n ON true"
            ),
            // Binds: 1 key, 2 owner, 3 fence, 4 channel, 5 key hex. A row (holds
            // left) when released; notifies at the last hold. The announcement is a
            // `RETURNING` expression, evaluated once for the updated row (a join
            // around a CTE costs the server more to set up on every run).
            release: sql_text!(
                "UPDATE {p}_locks SET holds = holds - 1
                 WHERE lock_key = $1 AND owner = $2 AND fence = $3 AND holds > 0
                 RETURNING holds, (CASE WHEN holds = 0 THEN {notify_release} END) IS NULL"
            ),
            // Binds: 1 key.
            names_lease: sql_text!("SELECT name FROM {p}_locks WHERE left(name, length($1)) = $1 ORDER BY name COLLATE \"C\" LIMIT $2"),
            names_session: sql_text!("SELECT name FROM {p}_holders WHERE left(name, length($1)) = $1 ORDER BY name COLLATE \"C\" LIMIT $2"),
            inspect_lease: sql_text!(
                "SELECT l.name, l.owner, l.holds, l.fence, l.metadata, {REMAINING_MS}
                 FROM {p}_locks l
                 WHERE l.lock_key = $1 AND l.holds > 0 AND l.expires_at > statement_timestamp()"
            ),
            advisory_session:
                "SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
                    .to_owned(),
            // On the pinned connection. Binds: 1 advisory key, 2 key, 3 name, 4 owner,
            // 5 metadata, 6 the session's `backend_start` (NULL if unknown, which
            // `inspect` takes as a match: the pid alone). One row (the fence) when the
            // lock was taken.
            advisory_acquire: sql_text!(
                "WITH g AS (SELECT pg_try_advisory_lock($1) AS ok)
                 INSERT INTO {p}_holders AS h (lock_key, name, owner, fence, metadata, pid, backend_start)
                 SELECT $2, $3, $4, nextval('{p}_fence'), $5, pg_backend_pid(), $6
                 FROM g WHERE g.ok
                 ON CONFLICT (lock_key) DO UPDATE SET
                    name = excluded.name, owner = excluded.owner, fence = excluded.fence,
                    metadata = excluded.metadata, pid = excluded.pid,
                    backend_start = excluded.backend_start
                 RETURNING h.fence"
            ),
            // On the pinned connection. Binds: 1 advisory key, 2 channel, 3 key hex.
            advisory_release: sql_text!(
                "SELECT pg_advisory_unlock($1), {}",
                notify_if_marked("$2", "$3", "decode($3, 'hex')")
            ),
            // Asks what the acquire asks: is the advisory key taken (in this database)?
            // Then who holds it: the holder record of this name's session, if any (none:
            // a client outside dlock, or dlock under a name with the same key).
            // Binds: 1 key, 2 advisory key. Row: name, owner, fence, metadata (empty
            // without a record), backend pid.
            inspect_advisory: sql_text!(
                "SELECT COALESCE(h.name, ''), COALESCE(h.owner, ''), COALESCE(h.fence, 0::bigint),
                        COALESCE(h.metadata, '{{}}'), k.pid
                 FROM pg_locks k
                 LEFT JOIN {p}_holders h ON h.lock_key = $1 AND h.pid = k.pid
                   AND EXISTS (SELECT 1 FROM pg_stat_activity a
                               WHERE a.pid = h.pid
                                 AND COALESCE(a.backend_start = h.backend_start, true))
                 WHERE k.locktype = 'advisory' AND k.granted
                   AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND k.classid = (($2 >> 32) & 4294967295)::text::oid
                   AND k.objid = ($2 & 4294967295)::text::oid
                   AND k.objsubid = 1
                 ORDER BY h.owner IS NULL
                 LIMIT 1"
            ),
            // Binds: 1 key.
            row_ensure: sql_text!(
                "INSERT INTO {p}_rows (lock_key) VALUES ($1) ON CONFLICT (lock_key) DO NOTHING"
            ),
            // `{p}_row_lock(key)` answers the session's pid and the transaction's id
            // once the row is locked. `{p}_row_release(key)` announces the release
            // (delivered at commit). The record is left as it is: `inspect` shows it
            // only while the transaction that locked the row is open.
            row_prepare: sql_text!(
                "PREPARE {p}_row_lock(bytea) AS
                    SELECT pg_backend_pid()::int8, txid_current() FROM {p}_rows
                    WHERE lock_key = $1 FOR UPDATE NOWAIT;
                 PREPARE {p}_row_release(bytea) AS
                    SELECT {notify_row}",
                notify_row = notify_if_marked(&format!("'{p}_released'"), "encode($1, 'hex')", "$1")
            ),
            // Opens the pinned transaction and locks the row in one round trip (a
            // simple query: no binds; the key is hex digits, decoded by the server,
            // so `standard_conforming_strings` does not matter). READ COMMITTED
            // whatever the server's default, as the token's statement checks it
            // from another connection.
            row_lock: (
                sql_text!("BEGIN ISOLATION LEVEL READ COMMITTED; EXECUTE {p}_row_lock(decode('"),
                "', 'hex'))".to_owned(),
            ),
            // Autocommitted beside the pinned transaction. Binds: 1 key, 2 name, 3 owner,
            // 4 metadata, 5 pid, 6 the pinned transaction's id (kept for `inspect`).
            // Answers the token only
            // if that transaction (which holds the row) was still open *after* the
            // token was taken: the outer select reads the insert's row, so it runs
            // after `nextval`, and a later holder's token comes after ours. Otherwise
            // the statement fails (22P02, a cast that cannot succeed; of a column, so
            // the planner cannot fold it early), so the record it wrote is rolled back
            // and cannot cover the real holder's.
            row_holder: sql_text!(
                "WITH ins AS (
                    INSERT INTO {p}_holders AS h (lock_key, name, owner, fence, metadata, pid, xact)
                    VALUES ($1, $2, $3, nextval('{p}_fence'), $4, $5, $6)
                    ON CONFLICT (lock_key) DO UPDATE SET
                       name = excluded.name, owner = excluded.owner, fence = excluded.fence,
                       metadata = excluded.metadata, pid = excluded.pid,
                       backend_start = NULL, xact = excluded.xact
                    RETURNING h.fence)
                 SELECT CASE WHEN txid_status($6) = 'in progress' THEN ins.fence
                             ELSE ('the row lock''s session ended: ' || ins.fence)::bigint END
                 FROM ins"
            ),
            // The pinned transaction's end, in one round trip: the prepared release,
            // then the commit that unlocks the row.
            row_release: (
                sql_text!("EXECUTE {p}_row_release(decode('"),
                "); COMMIT".to_owned(),
            ),
            // The record's holder holds the row for exactly as long as the transaction
            // that locked it is open: asked of the server's commit log, which every role
            // may read (not by pid and session start: the start is hidden from roles
            // outside `pg_read_all_stats`, and a dead holder's pid can be reused). A
            // visible record was committed before this statement's snapshot, and its
            // transaction began before that: a transaction id at or past the snapshot's
            // horizon is from another cluster (a restored dump), which `txid_status`
            // rejects as "in the future", and is not in progress here. Binds: 1 key.
            inspect_row: sql_text!(
                "SELECT h.name, h.owner, h.fence, h.metadata FROM {p}_holders h
                 WHERE h.lock_key = $1
                   AND CASE WHEN h.xact < txid_snapshot_xmax(txid_current_snapshot())
                            THEN txid_status(h.xact) = 'in progress' ELSE false END"
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
            std::time::Duration::from_secs(10),
        );
        crate::sql::assert_sent_compacted(&format!("{sql:?}"));
    }

    /// The row batches inline the key exactly where the statement text expects it.
    #[test]
    fn row_batches_inline_the_key_as_hex() {
        let sql = Statements::new(
            "dlock",
            std::time::Duration::ZERO,
            std::time::Duration::from_secs(10),
        );
        let key = [0xa5u8; 32];
        let hex = "a5".repeat(32);
        let (head, tail) = &sql.row_lock;
        assert_eq!(sql.row_lock_batch(&key), format!("{head}{hex}{tail}"));
        let (head, tail) = &sql.row_release;
        assert_eq!(
            sql.row_release_batch(&key),
            format!("{head}{hex}', 'hex'){tail}")
        );
    }
}
