//! One shared pub/sub connection per backend, for every waiter of every lock.
//!
//! A waiter registers interest in a lock's unlock channel ([`Subscriber::watch`]); the
//! first interest SUBSCRIBEs, and [`LINGER`] after the last one left (if nobody came
//! back meanwhile) the channel is UNSUBSCRIBEd — so tasks taking turns on a lock do not
//! subscribe and unsubscribe on every turn. Each unlock message
//! wakes **one** local waiter of that lock (`Notify::notify_one`, which hands the wake-up
//! to the next waiter if the chosen one has gone), in the order they started waiting,
//! so a release costs one attempt per process instead of a stampede. If the pub/sub
//! connection drops, every waiter is woken to re-poll and the next wait re-subscribes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use tokio::sync::Notify;

use crate::error::{Error, Result};

/// How long a channel stays subscribed after its last waiter left.
pub(crate) const LINGER: Duration = Duration::from_millis(250);

#[derive(Debug)]
struct Entry {
    notify: Arc<Notify>,
    /// Live [`Watch`]es of this channel in this process.
    watchers: usize,
    /// Whether the server has confirmed our SUBSCRIBE on the current connection.
    subscribed: bool,
    /// When the last watcher left (while `watchers` is 0).
    idle_since: Option<std::time::Instant>,
    /// A task is waiting to unsubscribe this channel once it has been idle for LINGER.
    reaper: bool,
}

/// Where the pub/sub connection goes.
pub(crate) enum Source {
    /// A fixed server (single, or the first node of a cluster).
    Fixed(redis::Client),
    /// Whatever Sentinel reports as master at (re)connect time.
    Sentinel(super::conn::SentinelConn),
}

/// The shared subscriber of one backend.
pub(crate) struct Subscriber {
    source: Source,
    channels: Mutex<HashMap<String, Entry>>,
    /// The live connection's sink; network operations are serialized through it.
    sink: tokio::sync::Mutex<Option<PubSubSink>>,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the client: its connection info holds the password.
        f.debug_struct("Subscriber").finish_non_exhaustive()
    }
}

fn redis_err(e: &redis::RedisError) -> Error {
    Error::connection("redis", format!("pub/sub: {e}"))
}

impl Subscriber {
    pub(crate) fn new(source: Source) -> Arc<Self> {
        Arc::new(Subscriber {
            source,
            channels: Mutex::new(HashMap::new()),
            sink: tokio::sync::Mutex::new(None),
        })
    }

    fn channels(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.channels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether this process watches any channel (a check that needs no channel name).
    pub(crate) fn watching_any(&self) -> bool {
        !self.channels().is_empty()
    }

    /// How many waiters of this process wait on `channel`.
    pub(crate) fn watchers(&self, channel: &str) -> usize {
        self.channels().get(channel).map_or(0, |e| e.watchers)
    }

    /// Wake one local waiter of `channel`, as a message would (a grant passing the
    /// wake-up on to a waiter that may be let in beside it).
    pub(crate) fn wake_one(&self, channel: &str) {
        if let Some(entry) = self.channels().get(channel)
            && entry.watchers > 0
        {
            entry.notify.notify_one();
        }
    }

    /// Register interest in `channel` and make sure the server has confirmed the
    /// subscription before returning.
    pub(crate) async fn watch(self: &Arc<Self>, channel: &str) -> Result<Watch> {
        let notify = {
            let mut map = self.channels();
            let entry = map.entry(channel.to_owned()).or_insert_with(|| Entry {
                notify: Arc::new(Notify::new()),
                watchers: 0,
                subscribed: false,
                idle_since: None,
                reaper: false,
            });
            entry.watchers += 1;
            entry.idle_since = None;
            Arc::clone(&entry.notify)
        };
        let watch = Watch {
            subscriber: Arc::clone(self),
            channel: channel.to_owned(),
            notify,
        };
        self.ensure_subscribed(channel).await?;
        Ok(watch)
    }

    /// Subscribe `channel` unless it is; `true` when it was not (a release meanwhile
    /// went unannounced to this process, so the caller must look again).
    async fn ensure_subscribed(self: &Arc<Self>, channel: &str) -> Result<bool> {
        if self.channels().get(channel).is_some_and(|e| e.subscribed) {
            return Ok(false);
        }
        let mut sink = self.sink.lock().await;
        if sink.is_none() {
            *sink = Some(self.connect().await?);
        }
        // Re-check under the network lock: someone may have subscribed meanwhile (after
        // this caller found it unsubscribed: it must look again all the same).
        if self.channels().get(channel).is_some_and(|e| e.subscribed) {
            return Ok(true);
        }
        let Some(s) = sink.as_mut() else {
            return Err(Error::connection("redis", "pub/sub connection unavailable"));
        };
        if let Err(e) = s.subscribe(channel).await {
            *sink = None;
            return Err(redis_err(&e));
        }
        if let Some(e) = self.channels().get_mut(channel) {
            e.subscribed = true;
        }
        Ok(true)
    }

    async fn connect(self: &Arc<Self>) -> Result<PubSubSink> {
        let connecting = async {
            let client = match &self.source {
                Source::Fixed(c) => c.clone(),
                Source::Sentinel(s) => s.master_client().await?,
            };
            client.get_async_pubsub().await
        };
        let pubsub = tokio::time::timeout(Duration::from_secs(5), connecting)
            .await
            .map_err(|_| Error::connection("redis", "pub/sub connect timed out"))?
            .map_err(|e| redis_err(&e))?;
        let (sink, mut stream) = pubsub.split();
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(msg) = stream.next().await {
                let Some(this) = weak.upgrade() else { return };
                let channel = msg.get_channel_name();
                if let Some(entry) = this.channels().get(channel) {
                    entry.notify.notify_one();
                }
            }
            // The connection is gone: every subscription with it. Wake everyone to
            // re-poll; their next wait subscribes again on a new connection.
            if let Some(this) = weak.upgrade() {
                for entry in this.channels().values_mut() {
                    entry.subscribed = false;
                    entry.notify.notify_waiters();
                }
                *this.sink.lock().await = None;
            }
        });
        Ok(sink)
    }

    fn leave(self: &Arc<Self>, channel: &str) {
        let start_reaper = {
            let mut map = self.channels();
            match map.get_mut(channel) {
                Some(e) => {
                    e.watchers = e.watchers.saturating_sub(1);
                    if e.watchers == 0 {
                        e.idle_since = Some(std::time::Instant::now());
                    }
                    let start = e.watchers == 0 && !e.reaper;
                    if start {
                        e.reaper = true;
                    }
                    start
                }
                None => false,
            }
        };
        if !start_reaper {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.channels().remove(channel);
            return;
        };
        // One reaper per idle channel: it unsubscribes once the channel has had no
        // watcher for LINGER, and stands down if a watcher came back.
        let weak = Arc::downgrade(self);
        let channel = channel.to_owned();
        rt.spawn(async move {
            let mut wait = LINGER;
            loop {
                tokio::time::sleep(wait).await;
                let Some(this) = weak.upgrade() else { return };
                {
                    let mut map = this.channels();
                    let Some(e) = map.get_mut(&channel) else {
                        return;
                    };
                    match e.idle_since {
                        None => {
                            e.reaper = false;
                            return;
                        }
                        Some(since) if since.elapsed() < LINGER => {
                            wait = LINGER - since.elapsed();
                            continue;
                        }
                        Some(_) => {}
                    }
                }
                let mut sink = this.sink.lock().await;
                // Only if still nobody watches (a new waiter may have come meanwhile).
                let unsubscribe = {
                    let mut map = this.channels();
                    match map.get(&channel) {
                        Some(e) if e.watchers == 0 => {
                            let was = e.subscribed;
                            map.remove(&channel);
                            was
                        }
                        Some(_) => {
                            if let Some(e) = map.get_mut(&channel) {
                                e.reaper = false;
                            }
                            false
                        }
                        None => false,
                    }
                };
                if unsubscribe
                    && let Some(s) = sink.as_mut()
                    && s.unsubscribe(&channel).await.is_err()
                {
                    *sink = None;
                }
                return;
            }
        });
    }
}

/// Interest in one channel; dropping it may unsubscribe.
#[derive(Debug)]
pub(crate) struct Watch {
    subscriber: Arc<Subscriber>,
    channel: String,
    notify: Arc<Notify>,
}

impl Watch {
    /// Wait for an unlock message (or `max`). If the connection was lost since the
    /// last wait, subscribe again and return at once: a release while nobody listened
    /// went unannounced, so the caller must look again before it waits.
    pub(crate) async fn changed(&mut self, max: Duration) -> Result<()> {
        match self.subscriber.ensure_subscribed(&self.channel).await {
            Ok(false) => {}
            Ok(true) => return Ok(()),
            Err(e) => {
                // No pub/sub now: fall back to a short sleep; the caller re-polls.
                tracing::debug!(error = %e, "redis pub/sub unavailable; polling");
                tokio::time::sleep(max.min(Duration::from_millis(50))).await;
                return Ok(());
            }
        }
        let _ = tokio::time::timeout(max, self.notify.notified()).await;
        Ok(())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.subscriber.leave(&self.channel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After the pub/sub connection was lost, the next wait subscribes again and
    /// returns at once instead of sleeping until its limit: a release published while
    /// nobody listened would otherwise be noticed only at the holder's PTTL.
    #[tokio::test]
    async fn a_wait_after_a_lost_subscription_looks_again_at_once() {
        let Some(server) = dlock_testkit::RedisServer::start() else {
            return;
        };
        let client = redis::Client::open(server.url()).expect("client");
        let subscriber = Subscriber::new(Source::Fixed(client));
        let mut watch = subscriber.watch("chan").await.expect("watch");
        let killed = dlock_testkit::redis_command(
            server.addr(),
            &["CLIENT", "KILL", "TYPE", "pubsub"],
            Duration::from_secs(2),
        );
        assert!(killed.is_ok(), "{killed:?}");
        // The reader notices the closed connection and marks the channel unsubscribed.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while subscriber
            .channels()
            .get("chan")
            .is_some_and(|e| e.subscribed)
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the drop went unnoticed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let started = std::time::Instant::now();
        watch
            .changed(Duration::from_secs(30))
            .await
            .expect("changed");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "waited {:?} after re-subscribing instead of looking again",
            started.elapsed()
        );
        // Subscribed again: the next wait does wait for a message.
        let started = std::time::Instant::now();
        watch
            .changed(Duration::from_millis(300))
            .await
            .expect("changed");
        assert!(started.elapsed() >= Duration::from_millis(250));
    }
}
