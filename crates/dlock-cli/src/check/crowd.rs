//! `dlock check --workload crowd`: in every worker process several tasks share one
//! `Locker`, and some share an owner — the paths where a backend's in-process shared
//! state (slots, hand-off registries, queue maps, session keys, a lease row that
//! several reentrant holds renew) could give two holders, an orphan or a stale token.
//!
//! Each task loops: pick an owner (one of the process's two shared owners, or a fresh
//! one), a lease (half, once or twice `--ttl`, renewed or not) and a way to ask (a
//! short wait, `try_lock`, a wait cancelled at a random point, a long wait). Under the
//! lock it reads the fenced store with its token, thinks, writes value + 1 — tasks of
//! one shared owner take turns for that (they are one holder: reentrancy lets them
//! hold together, not race each other's updates) — and now and then re-enters with the
//! same owner and hands that hold to a task of its own that keeps it past the outer
//! release. A grant whose (owner, token) this process has seen before is reported as
//! `reenter`, not as a new grant: a new grant to an owner always carries a new token,
//! so only a re-entry repeats one — whatever the order in which the server and the
//! tasks saw the holds come and go — and the checker's duplicate-token count stays
//! exact across owners. Every wait and every loop is bounded.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock::{Error, LockGuard, LockOptions, Locker, Owner, Renewal, Wait};
use dlock_check::{StoreClient, StoreReply};
use serde_json::json;

use crate::args::CheckWorkerArgs;
use crate::exit::Failure;
use crate::fleet::emit;

/// What the tasks of one worker process share.
struct Ctx {
    locker: Locker,
    args: CheckWorkerArgs,
    store: SocketAddr,
    shared: [Owner; 2],
    /// Every (owner, token) granted in this process: a grant found here is a re-entry.
    seen: Mutex<HashSet<(String, u64)>>,
    /// Tasks of one shared owner take turns at the store.
    turns: [tokio::sync::Mutex<()>; 2],
}

impl Ctx {
    /// Note a hold; `true` when its grant was seen here before (a re-entry).
    fn reentered(&self, owner: &Owner, token: u64) -> bool {
        !self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((owner.as_str().to_owned(), token))
    }
}

/// The worker process of the crowd workload.
pub async fn worker(args: CheckWorkerArgs) -> Result<i32, Failure> {
    let locker = Locker::connect(&args.url).await?;
    let store = args
        .store
        .parse()
        .map_err(|e| Failure::internal(format!("store address: {e}")))?;
    let tasks = args.tasks.clamp(1, 63);
    let per_task = args.ops.div_ceil(tasks);
    let ctx = Arc::new(Ctx {
        locker,
        args,
        store,
        shared: [Owner::random(), Owner::random()],
        seen: Mutex::new(HashSet::new()),
        turns: [tokio::sync::Mutex::new(()), tokio::sync::Mutex::new(())],
    });
    let mut joins = tokio::task::JoinSet::new();
    for t in 0..tasks {
        joins.spawn(task(Arc::clone(&ctx), t, per_task));
    }
    while let Some(done) = joins.join_next().await {
        done.map_err(|e| Failure::internal(format!("crowd task: {e}")))??;
    }
    Ok(0)
}

fn io(e: std::io::Error) -> Failure {
    Failure::internal(format!("store: {e}"))
}

/// One task: `ops` critical sections, at most `ops × 20` attempts.
async fn task(ctx: Arc<Ctx>, t: u32, ops: u32) -> Result<(), Failure> {
    let args = &ctx.args;
    let mut store = StoreClient::connect(ctx.store, args.worker * 64 + t)
        .await
        .map_err(io)?;
    let mut rng = fastrand::Rng::with_seed(
        args.seed ^ (u64::from(args.worker) << 32) ^ u64::from(t).wrapping_mul(0x9e37_79b9),
    );
    let (mut done, mut attempts) = (0u32, 0u64);
    let attempt_limit = u64::from(ops) * 20;
    let mut nested = tokio::task::JoinSet::new();
    while done < ops && attempts < attempt_limit {
        attempts += 1;
        let shared = rng.bool().then(|| rng.usize(..2));
        let owner = shared.map_or_else(Owner::random, |i| ctx.shared[i].clone());
        let opts = random_opts(&mut rng, args.ttl).owner(owner.clone());
        let got = match rng.u8(..4) {
            0 => {
                let wait = Duration::from_millis(rng.u64(0..=2 * millis(args.ttl)));
                ctx.locker
                    .lock_with(&args.lock_name, &opts.wait(Wait::Timeout(wait)))
                    .await
                    .map(Some)
            }
            1 => ctx.locker.try_lock_with(&args.lock_name, &opts).await,
            2 => {
                let cancel = Duration::from_millis(rng.u64(0..=millis(args.ttl)));
                let forever = opts.wait(Wait::Forever);
                let waiting = ctx.locker.lock_with(&args.lock_name, &forever);
                match tokio::time::timeout(cancel, waiting).await {
                    Ok(r) => r.map(Some),
                    // Cancelled mid-wait (or mid-attempt).
                    Err(_) => Ok(None),
                }
            }
            _ => ctx
                .locker
                .lock_with(
                    &args.lock_name,
                    &opts.wait(Wait::Timeout(Duration::from_secs(30))),
                )
                .await
                .map(Some),
        };
        let guard = match got {
            Ok(Some(g)) => g,
            Ok(None) | Err(Error::Timeout { .. }) => {
                tokio::time::sleep(Duration::from_millis(rng.u64(0..5))).await;
                continue;
            }
            Err(e) => {
                emit(&json!({"t": "fail", "task": t, "error": e.to_string()}));
                // A server that is down answers at once: do not burn the run on it.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let fault_here = t == 0 && args.fault_at == Some(u64::from(done));
        section(
            &ctx,
            &mut store,
            guard,
            &owner,
            shared,
            t,
            fault_here,
            &mut rng,
            &mut nested,
        )
        .await?;
        done += 1;
    }
    while nested.join_next().await.is_some() {}
    Ok(())
}

/// One critical section of task `t` under `guard`.
#[allow(clippy::too_many_arguments)]
async fn section(
    ctx: &Arc<Ctx>,
    store: &mut StoreClient,
    guard: LockGuard,
    owner: &Owner,
    shared: Option<usize>,
    t: u32,
    fault_here: bool,
    rng: &mut fastrand::Rng,
    nested: &mut tokio::task::JoinSet<()>,
) -> Result<(), Failure> {
    let args = &ctx.args;
    let token = guard.fencing_token();
    let kind = if ctx.reentered(owner, token) {
        "reenter"
    } else {
        "grant"
    };
    emit(&json!({"t": kind, "token": token, "task": t}));
    let watcher = (t == 0).then(|| {
        let lost = guard.lost_token();
        tokio::spawn(async move {
            lost.cancelled().await;
            emit(&json!({"t": "lost"}));
        })
    });
    if fault_here {
        if args.kill_me {
            emit(&json!({"t": "holding"}));
            tokio::time::sleep(Duration::from_secs(3600)).await;
        } else {
            emit(&json!({"t": "pausing"}));
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
        }
    }
    {
        let _turn = match shared {
            Some(i) => Some(ctx.turns[i].lock().await),
            None => None,
        };
        // A hold whose lease ran out while it waited for its turn (renewal off) was
        // told so: it leaves the store alone, as a careful holder would.
        if !guard.is_held() {
            return finish(guard, t, watcher).await;
        }
        let read = store.read(&args.lock_name, token).await.map_err(io)?;
        emit(&json!({"t": "read", "stale": matches!(read, StoreReply::Stale { .. })}));
        if let StoreReply::Ok { value, version } = read {
            if !args.think.is_zero() {
                tokio::time::sleep(args.think).await;
            }
            if !guard.is_held() {
                return finish(guard, t, watcher).await;
            }
            let wrote = store
                .write(&args.lock_name, token, version, value + 1)
                .await
                .map_err(io)?;
            emit(&json!({"t": "write", "stale": matches!(wrote, StoreReply::Stale { .. })}));
        }
    }
    if shared.is_some() && rng.u8(..10) < 3 {
        reenter(ctx, owner, token, rng, nested).await;
    }
    finish(guard, t, watcher).await
}

/// Give a hold back and say so.
async fn finish(
    guard: LockGuard,
    t: u32,
    watcher: Option<tokio::task::JoinHandle<()>>,
) -> Result<(), Failure> {
    let released = guard.release().await.is_ok();
    if let Some(w) = watcher {
        w.abort();
    }
    emit(&json!({"t": "release", "ok": released, "task": t}));
    Ok(())
}

/// The holding owner asks again (another lease); a granted re-entry is kept by a task
/// of its own for a while, possibly past the outer hold's release.
async fn reenter(
    ctx: &Arc<Ctx>,
    owner: &Owner,
    token: u64,
    rng: &mut fastrand::Rng,
    nested: &mut tokio::task::JoinSet<()>,
) {
    let opts = random_opts(rng, ctx.args.ttl).owner(owner.clone());
    let again = match ctx.locker.try_lock_with(&ctx.args.lock_name, &opts).await {
        Ok(Some(g)) => g,
        _ => return,
    };
    let again_token = again.fencing_token();
    let kind = if ctx.reentered(owner, again_token) {
        "reenter"
    } else {
        "grant"
    };
    emit(&json!({"t": kind, "token": again_token, "nested_of": token}));
    let keep = Duration::from_millis(rng.u64(0..=millis(ctx.args.ttl) / 2));
    nested.spawn(async move {
        tokio::time::sleep(keep).await;
        let _ = again.release().await;
    });
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The longest lease a crowd task asks for, as a multiple of `--ttl`: what a dead
/// worker's hold may outlive it by (the orphan check waits that long).
pub(super) const LONGEST_LEASE: u32 = 2;

/// Half, once or [`LONGEST_LEASE`] times `ttl` (at least 50 ms), renewed three times
/// in four.
fn random_opts(rng: &mut fastrand::Rng, ttl: Duration) -> LockOptions {
    let ttl = match rng.u8(..3) {
        0 => ttl / 2,
        1 => ttl,
        _ => ttl * LONGEST_LEASE,
    }
    .max(Duration::from_millis(50));
    let renewal = if rng.u8(..4) == 0 {
        Renewal::Off
    } else {
        Renewal::Auto
    };
    LockOptions::new().ttl(ttl).renewal(renewal)
}
