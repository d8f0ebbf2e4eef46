//! One script call, written straight into a single command buffer.
//!
//! `redis::ScriptInvocation` keeps every key and argument in a vector of its own and
//! copies them all into a command when it is sent: two allocations per argument, on
//! every acquisition and release. A [`Call`] writes `EVALSHA sha numkeys keys… args…`
//! into one [`redis::Cmd`] as it is built, and loads the script when the server does
//! not know it (`NOSCRIPT`: a restarted or flushed server), as the invocation does.

use redis::{Cmd, FromRedisValue, RedisResult, Script, ToRedisArgs};

use super::conn::Conn;
use super::layout::Key;

/// An `EVALSHA` of `script` with its keys given up front and its arguments added after.
pub(crate) struct Call<'s> {
    script: &'s Script,
    cmd: Cmd,
}

impl<'s> Call<'s> {
    /// A call of `script` on `keys` (`KEYS[1]`…), with room for `args` arguments.
    pub(crate) fn new(script: &'s Script, keys: &[Key<'_>], args: usize) -> Self {
        let data =
            script.get_hash().len() + 16 + keys.iter().map(|k| k.len()).sum::<usize>() + 24 * args;
        let mut cmd = Cmd::with_capacity(3 + keys.len() + args, data);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for k in keys {
            cmd.arg(k);
        }
        Call { script, cmd }
    }

    /// Adds `ARGV[n]`.
    pub(crate) fn arg(&mut self, a: impl ToRedisArgs) -> &mut Self {
        self.cmd.arg(a);
        self
    }

    /// Runs the call on a clone of `conn`; on `NOSCRIPT`, loads the script and runs it
    /// once more.
    pub(crate) async fn run<T: FromRedisValue>(&self, conn: &Conn) -> RedisResult<T> {
        let mut conn = conn.clone();
        match conn.send(&self.cmd).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script.prepare_invoke().load_async(&mut conn).await?;
                conn.send(&self.cmd).await
            }
            other => other,
        }
    }
}
