//! The connection a session-mode hold is pinned to, with the session's start time it
//! read once, when it was made.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::types::Oid;
use sqlx::postgres::{
    PgArgumentBuffer, PgConnection, PgTypeInfo, PgValueFormat, PgValueRef, Postgres,
};

use super::super::session::SessionConn;

/// A session mode's connection. Advisory mode binds `started` into each acquisition's
/// holder record (`Statements::advisory_acquire`): looked up by the server on every
/// acquisition, even from a session setting, it cost about a microsecond of server
/// time each.
#[derive(Debug)]
pub(crate) struct PgSession {
    pub conn: PgConnection,
    /// The session's `backend_start` (advisory mode; `None` in row mode, which records
    /// no start).
    pub started: Option<BackendStart>,
}

impl SessionConn for PgSession {
    fn ping(&mut self) -> impl Future<Output = std::result::Result<(), sqlx::Error>> + Send + '_ {
        sqlx::Connection::ping(&mut self.conn)
    }
}

/// A session's `backend_start` as the server sends a `timestamptz` in binary
/// (microseconds since 2000-01-01 UTC): only written back to the server, which compares
/// it with `pg_stat_activity`, never read as a time here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BackendStart(i64);

/// `timestamptz`'s type id, fixed in every PostgreSQL.
const TIMESTAMPTZ: Oid = Oid(1184);

impl sqlx::Type<Postgres> for BackendStart {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(TIMESTAMPTZ)
    }
}

impl sqlx::Encode<'_, Postgres> for BackendStart {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        buf.extend_from_slice(&self.0.to_be_bytes());
        Ok(IsNull::No)
    }
}

impl sqlx::Decode<'_, Postgres> for BackendStart {
    fn decode(value: PgValueRef<'_>) -> Result<Self, BoxDynError> {
        if value.format() != PgValueFormat::Binary {
            return Err("a timestamptz in text form where binary was asked for".into());
        }
        let bytes: [u8; 8] = value
            .as_bytes()?
            .try_into()
            .map_err(|_| "a binary timestamptz that is not 8 bytes long")?;
        Ok(BackendStart(i64::from_be_bytes(bytes)))
    }
}
