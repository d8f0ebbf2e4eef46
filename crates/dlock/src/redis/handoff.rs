//! In-process hand-off: when a holder releases a lock that other tasks of this process
//! wait for, the release script passes the lock straight to the longest-waiting of them
//! (one command, no unlock message, no race with the releaser's own next attempt).
//!
//! Without it the releasing task wins its lock back almost every time: its next attempt
//! leaves before the woken waiter's, so the lock rarely changes hands. A hand-off streak
//! is capped (`handoff_burst`, default 16): at its end, if another connection listens on
//! the unlock channel (a waiter in another process), the lock is released to everyone
//! and this process's waiters hold back for [`YIELD`], so the other process's waiter,
//! woken by the unlock message, gets there first.
//!
//! The table also counts this process's holders of each lock (with their latest lease
//! end): while a local task holds the lock, a local newcomer sends no attempt at all —
//! the holder's release will hand the lock to it, or publish the unlock message it is
//! subscribed to by then (the holder's release and the newcomer's check take the same
//! mutex, so one of the two always happens).
//!
//! A waiter registers a [`Slot`] when it subscribes and states what it wants (lease,
//! metadata) on each attempt. Slots belong to one acquisition each, never to an owner:
//! several tasks may wait with one owner (and different leases), and each must get
//! exactly the lease it asked for. The releaser takes an [`Offer`] for the first waiting
//! slot, runs the hand-off script and delivers the grant into the slot; the waiter
//! picks it up on its next attempt without a command. A waiter that leaves with a grant
//! in its slot gets it back to release; a delivery to a waiter that has left fails and
//! the releaser releases the grant itself.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::backend::AcquisitionId;
use crate::notify::KeyHasher;
use crate::options::Owner;

/// How long this process's attempts on a lock hold back after a streak ended with a
/// release to everyone: long enough for a waiter elsewhere to hear the unlock message
/// and send its attempt.
pub(crate) const YIELD: Duration = Duration::from_millis(5);

/// What a waiter asks for when the lock is handed to it.
#[derive(Debug, Clone)]
pub(crate) struct Want {
    pub(crate) ttl: Duration,
    /// The metadata the hand-off stores (JSON, the value of its hold's own field).
    pub(crate) metadata: String,
    /// The nonce written with the grant: if the hand-off's reply is lost, the waiter's
    /// next attempt recovers the grant by it instead of taking a second hold.
    pub(crate) nonce: String,
}

#[derive(Debug)]
enum State<G> {
    /// Waiting; `None` until its first attempt states what it wants.
    Waiting(Option<Want>),
    /// A releaser is handing the lock to it.
    Offered(Want),
    /// Handed over; waiting to be picked up.
    Granted(G),
    /// A hand-off may or may not have happened (its reply was lost): the next attempt
    /// must recover by this nonce. The instant is when the hand-off was sent: if it
    /// landed, its lease runs from (at the latest) then.
    Uncertain(String, Instant),
    /// Picked up, or the waiter left.
    Done,
}

/// One waiting acquisition of one lock.
#[derive(Debug)]
pub(crate) struct Slot<G> {
    acquisition: AcquisitionId,
    owner: Owner,
    state: Mutex<State<G>>,
    wake: Notify,
}

impl<G> Slot<G> {
    fn state(&self) -> MutexGuard<'_, State<G>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Resolves when a grant (or an uncertain hand-off) is put into this slot; a
    /// delivery made while nobody awaited is kept for the next call.
    pub(crate) async fn handed(&self) {
        self.wake.notified().await;
    }
}

#[derive(Debug)]
struct Line<G> {
    slots: VecDeque<Arc<Slot<G>>>,
    /// Consecutive in-process hand-offs since the lock was last released to everyone.
    streak: u32,
    /// After a release to everyone: this process's attempts wait until then.
    yield_until: Option<Instant>,
}

/// What an attempt should do, as far as hand-offs go.
#[derive(Debug)]
pub(crate) enum Before<G> {
    /// The lock was handed over: here is the grant.
    Granted(G),
    /// Send the acquire script with this nonce, in recovery mode (a hand-off to this
    /// acquisition may have landed, sent at this instant).
    Recover(String, Instant),
    /// Send the acquire script as usual.
    Ask,
    /// Hold back this long: the lock was just released to waiters elsewhere.
    Yield(Duration),
}

/// A releaser's claim on the first waiting slot.
#[derive(Debug)]
pub(crate) struct Offer<G> {
    slot: Arc<Slot<G>>,
    pub(crate) want: Want,
    /// The streak is spent: release to everyone instead if others listen.
    pub(crate) last: bool,
}

impl<G> Offer<G> {
    pub(crate) fn owner(&self) -> &Owner {
        &self.slot.owner
    }
}

/// This process's holders of one lock: 24 bytes, since a process may hold 100,000
/// locks and each has an entry.
#[derive(Debug)]
struct Holders {
    /// A hash of each hold's owner (a reentrant owner appears once per hold).
    owners: Owners,
    /// The latest lease end any of them was granted or renewed to, as nanoseconds
    /// after the table's `base`.
    lease_end: u64,
}

/// The owner hashes of a lock's local holds, never empty: the first in place, any
/// further (a reentrant owner's, or shared holds) on the heap — a lock held once, the
/// usual case, costs no allocation of its own.
#[derive(Debug)]
struct Owners {
    first: u64,
    #[expect(
        clippy::box_collection,
        reason = "8 bytes in every entry instead of a 24-byte Vec; few locks need it"
    )]
    more: Option<Box<Vec<u64>>>,
}

impl Owners {
    fn one(owner: u64) -> Self {
        Owners {
            first: owner,
            more: None,
        }
    }

    fn contains(&self, owner: u64) -> bool {
        self.first == owner || self.more.as_ref().is_some_and(|m| m.contains(&owner))
    }

    fn push(&mut self, owner: u64) {
        self.more.get_or_insert_with(Box::default).push(owner);
    }

    /// Take one hold of `owner` out (none if it has none); `true` when no hold is left.
    fn remove(&mut self, owner: u64) -> bool {
        let more = self.more.as_mut();
        if self.first == owner {
            match more.and_then(|m| m.pop()) {
                Some(last) => self.first = last,
                None => return true,
            }
        } else if let Some(m) = more
            && let Some(i) = m.iter().position(|o| *o == owner)
        {
            m.swap_remove(i);
        }
        if self.more.as_ref().is_some_and(|m| m.is_empty()) {
            self.more = None;
        }
        false
    }
}

#[derive(Debug)]
struct Table<G> {
    lines: HashMap<String, Line<G>, KeyHasher>,
    /// By a hash of the lock key, seeded per table. A collision (odds 2^-64 per pair of
    /// keys, and no way to aim for one without the seed) would make a newcomer to one
    /// lock hold back while the other is held here; grants stay the server's.
    holders: HashMap<u64, Holders, KeyHasher>,
    /// Hashes lock keys and owners for `holders`.
    keys: KeyHasher,
    /// When the table was made: `holders` keeps its instants as nanoseconds after it.
    base: Instant,
}

impl<G> Table<G> {
    fn key_hash(&self, key: &str) -> u64 {
        use std::hash::BuildHasher;
        self.keys.hash_one(key)
    }

    /// `at` as nanoseconds after the table's base (0 before it, saturating).
    fn nanos(&self, at: Instant) -> u64 {
        crate::lease::nanos_of(at.saturating_duration_since(self.base))
    }
}

/// Every lock's local waiters, in arrival order, and its local holders.
#[derive(Debug)]
pub(crate) struct Handoffs<G> {
    table: Mutex<Table<G>>,
    burst: u32,
}

impl<G> Handoffs<G> {
    /// `burst`: most consecutive hand-offs of one lock (must be at least 1).
    pub(crate) fn new(burst: u32) -> Self {
        Handoffs {
            table: Mutex::new(Table {
                lines: HashMap::default(),
                holders: HashMap::default(),
                keys: KeyHasher::default(),
                base: Instant::now(),
            }),
            burst,
        }
    }

    fn table(&self) -> MutexGuard<'_, Table<G>> {
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `owner` is among this process's holders of `lock` (a reentrant attempt
    /// of a local holder must go to the server, never wait for a hand-off).
    pub(crate) fn is_local_holder(&self, lock: &str, owner: &str) -> bool {
        let t = self.table();
        t.holders
            .get(&t.key_hash(lock))
            .is_some_and(|h| h.owners.contains(t.key_hash(owner)))
    }

    /// `owner`, a task of this process, now holds `lock` until `lease_end` (at the
    /// latest).
    pub(crate) fn note_held(&self, lock: &str, owner: &str, lease_end: Instant) {
        let mut t = self.table();
        let (lock, owner) = (t.key_hash(lock), t.key_hash(owner));
        let lease_end = t.nanos(lease_end);
        match t.holders.entry(lock) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let h = e.get_mut();
                h.owners.push(owner);
                h.lease_end = h.lease_end.max(lease_end);
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Holders {
                    owners: Owners::one(owner),
                    lease_end,
                });
            }
        }
    }

    /// A local holder's lease was renewed to `lease_end`.
    pub(crate) fn note_renewed(&self, lock: &str, lease_end: Instant) {
        let mut t = self.table();
        let lock = t.key_hash(lock);
        let lease_end = t.nanos(lease_end);
        if let Some(h) = t.holders.get_mut(&lock) {
            h.lease_end = h.lease_end.max(lease_end);
        }
    }

    /// A hold of `owner`, a local holder, is gone (released, or dropped) without an
    /// offer.
    pub(crate) fn note_gone(&self, lock: &str, owner: &str) {
        Self::holder_left(&mut self.table(), lock, owner);
    }

    fn holder_left(t: &mut Table<G>, lock: &str, owner: &str) {
        let (key, owner) = (t.key_hash(lock), t.key_hash(owner));
        if let Some(h) = t.holders.get_mut(&key)
            && h.owners.remove(owner)
        {
            t.holders.remove(&key);
        }
    }

    /// The acquisition `acquisition` of `owner` starts waiting for `lock`.
    pub(crate) fn register(
        &self,
        lock: &str,
        acquisition: AcquisitionId,
        owner: &Owner,
    ) -> Arc<Slot<G>> {
        let slot = Arc::new(Slot {
            acquisition,
            owner: owner.clone(),
            state: Mutex::new(State::Waiting(None)),
            wake: Notify::new(),
        });
        self.table()
            .lines
            .entry(lock.to_owned())
            .or_insert_with(|| Line {
                slots: VecDeque::new(),
                streak: 0,
                yield_until: None,
            })
            .slots
            .push_back(Arc::clone(&slot));
        slot
    }

    /// Before an attempt of `acquisition` (of `owner`) on `lock`: take a grant handed
    /// to it, or record what it wants (`want` is called only then).
    pub(crate) fn before_attempt(
        &self,
        lock: &str,
        acquisition: AcquisitionId,
        owner: &str,
        want: impl FnOnce() -> Want,
    ) -> Before<G> {
        let t = self.table();
        // Nothing held or waited for here (every uncontended attempt): ask, without
        // reading the clock or hashing the key.
        if t.holders.is_empty() && t.lines.is_empty() {
            return Before::Ask;
        }
        let now = Instant::now();
        // A local holder will hand over or publish: no need to ask the server (unless
        // the holder is this very owner, re-entering).
        let local_hold = t
            .holders
            .get(&t.key_hash(lock))
            .filter(|h| !h.owners.contains(t.key_hash(owner)))
            .map(|h| Duration::from_nanos(h.lease_end.saturating_sub(t.nanos(now))));
        let Some(line) = t.lines.get(lock) else {
            return local_hold
                .filter(|d| !d.is_zero())
                .map_or(Before::Ask, Before::Yield);
        };
        let held_back = line
            .yield_until
            .map(|t| t.saturating_duration_since(now))
            .max(local_hold)
            .filter(|d| !d.is_zero());
        let Some(slot) = line.slots.iter().find(|s| s.acquisition == acquisition) else {
            return held_back.map_or(Before::Ask, Before::Yield);
        };
        let mut state = slot.state();
        match std::mem::replace(&mut *state, State::Done) {
            State::Granted(g) => Before::Granted(g),
            State::Uncertain(nonce, sent_at) => {
                *state = State::Waiting(Some(want()));
                Before::Recover(nonce, sent_at)
            }
            State::Offered(w) => {
                // A hand-off to this acquisition is running: whichever lands first wins
                // (the acquire script takes it reentrantly if the hand-off came first;
                // the grant left in the slot is given back when the waiter leaves).
                *state = State::Offered(w);
                Before::Ask
            }
            State::Waiting(_) | State::Done => {
                *state = State::Waiting(Some(want()));
                held_back.map_or(Before::Ask, Before::Yield)
            }
        }
    }

    /// A releaser of `lock` (counted as a local holder under `holder`, and no longer
    /// from now on): claim the first waiting slot. The offer says whether the streak
    /// is spent.
    pub(crate) fn offer(&self, lock: &str, holder: Option<&str>) -> Option<Offer<G>> {
        let mut t = self.table();
        if let Some(owner) = holder {
            Self::holder_left(&mut t, lock, owner);
        }
        let line = t.lines.get_mut(lock)?;
        let last = line.streak >= self.burst;
        for slot in &line.slots {
            let mut state = slot.state();
            if let State::Waiting(Some(want)) = &*state {
                let want = want.clone();
                *state = State::Offered(want.clone());
                return Some(Offer {
                    slot: Arc::clone(slot),
                    want,
                    last,
                });
            }
        }
        None
    }

    /// The hand-off landed: put the grant in the slot, or give it back if the waiter
    /// has left meanwhile.
    pub(crate) fn deliver(&self, lock: &str, offer: Offer<G>, grant: G) -> Result<(), G> {
        let mut t = self.table();
        let mut state = offer.slot.state();
        if !matches!(&*state, State::Offered(_)) {
            return Err(grant);
        }
        *state = State::Granted(grant);
        drop(state);
        if let Some(line) = t.lines.get_mut(lock) {
            line.streak = line.streak.saturating_add(1);
        }
        offer.slot.wake.notify_one();
        Ok(())
    }

    /// The streak ended with a release to everyone: the streak starts again, and this
    /// process's attempts hold back for [`YIELD`].
    pub(crate) fn released_to_everyone(&self, lock: &str, offer: Offer<G>) {
        if let Some(line) = self.table().lines.get_mut(lock) {
            line.streak = 0;
            line.yield_until = Some(Instant::now() + YIELD);
        }
        self.decline(offer);
    }

    /// The hand-off did not happen (the releaser still held other holds, or no longer
    /// held the lock): the slot waits on, woken to try again at once — the lock may
    /// be free (the releaser's hold was gone: expired, or broken) with no unlock
    /// message to come, and the waiter may have sent no attempt for the step it sleeps
    /// (a local holder was counted). A wake with nothing handed over is an attempt
    /// more, no more.
    pub(crate) fn decline(&self, offer: Offer<G>) {
        let mut state = offer.slot.state();
        if matches!(&*state, State::Offered(_)) {
            *state = State::Waiting(Some(offer.want));
            drop(state);
            offer.slot.wake.notify_one();
        }
    }

    /// The hand-off's reply was lost: it may have landed. The waiter recovers by nonce
    /// (and dates the lease from `sent_at`, when the hand-off left). If the waiter has
    /// left meanwhile, its owner and the hand-off's nonce: the caller must give back
    /// that hold if it landed, or void the hand-off (`Leftover::Maybe`).
    pub(crate) fn uncertain(&self, offer: Offer<G>, sent_at: Instant) -> Option<(Owner, String)> {
        let mut state = offer.slot.state();
        if matches!(&*state, State::Offered(_)) {
            *state = State::Uncertain(offer.want.nonce, sent_at);
            drop(state);
            offer.slot.wake.notify_one();
            return None;
        }
        drop(state);
        Some((offer.slot.owner.clone(), offer.want.nonce))
    }

    /// The waiter of `slot` stops waiting. Returns a grant it had not picked up (the
    /// caller must release it) or the nonce of an uncertain hand-off (the caller must
    /// release that owner's hold if it landed, else void the hand-off).
    pub(crate) fn leave(&self, lock: &str, slot: &Arc<Slot<G>>) -> Option<Leftover<G>> {
        let mut t = self.table();
        if let Some(line) = t.lines.get_mut(lock) {
            line.slots.retain(|s| !Arc::ptr_eq(s, slot));
            if line.slots.is_empty() {
                t.lines.remove(lock);
            }
        }
        match std::mem::replace(&mut *slot.state(), State::Done) {
            State::Granted(g) => Some(Leftover::Grant(g)),
            State::Uncertain(nonce, _) => Some(Leftover::Maybe {
                owner: slot.owner.clone(),
                nonce,
            }),
            _ => None,
        }
    }
}

/// What a leaving waiter may leave behind.
#[derive(Debug)]
pub(crate) enum Leftover<G> {
    /// A grant handed to it.
    Grant(G),
    /// A hand-off to this owner, written with this nonce, that may have landed.
    Maybe { owner: Owner, nonce: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holds of one lock come and go in any order: the set stays right, and says it is
    /// empty exactly when the last hold left (an owner with no hold takes nothing).
    #[test]
    fn owners_count_every_hold() {
        let mut o = Owners::one(1);
        o.push(2);
        o.push(1);
        assert!(o.contains(1) && o.contains(2) && !o.contains(3));
        assert!(!o.remove(3));
        assert!(!o.remove(1));
        assert!(o.contains(1), "a reentrant owner's second hold stays");
        assert!(!o.remove(1));
        assert!(!o.contains(1));
        assert!(o.contains(2));
        assert!(!o.remove(1), "no hold of 1 left to take");
        assert!(o.more.is_none(), "an emptied overflow is given back");
        assert!(o.remove(2));
    }

    /// Every lock this process holds has an entry in the table: one of 100,000 must
    /// stay a fraction of the hold's own cost (it was 56 bytes with a 16-byte instant
    /// and an inline vector).
    #[test]
    fn a_holders_entry_stays_small() {
        let size = std::mem::size_of::<(u64, Holders)>();
        assert!(size <= 32, "an entry grew to {size} bytes");
    }

    fn own(token: &str) -> Owner {
        token.parse().expect("an owner token")
    }

    /// One acquisition id per label, stable within a test.
    fn acq(label: &str) -> AcquisitionId {
        use std::collections::HashMap;
        use std::sync::OnceLock;
        static IDS: OnceLock<Mutex<HashMap<String, AcquisitionId>>> = OnceLock::new();
        *IDS.get_or_init(Default::default)
            .lock()
            .expect("ids")
            .entry(label.to_owned())
            .or_default()
    }

    fn want(n: &str) -> Want {
        Want {
            ttl: Duration::from_secs(1),
            metadata: "{}".into(),
            nonce: n.into(),
        }
    }

    #[test]
    fn first_waiter_with_a_want_is_offered_and_picks_up_its_grant() {
        let h: Handoffs<u32> = Handoffs::new(16);
        let a = h.register("l", acq("a"), &own("a"));
        let _b = h.register("l", acq("b"), &own("b"));
        // Nobody has stated a want yet: nothing to offer.
        assert!(h.offer("l", None).is_none());
        assert!(matches!(
            h.before_attempt("l", acq("b"), "b", || want("nb")),
            Before::Ask
        ));
        assert!(matches!(
            h.before_attempt("l", acq("a"), "a", || want("na")),
            Before::Ask
        ));
        let offer = h.offer("l", None).expect("a waits");
        assert_eq!(offer.owner().as_str(), "a");
        assert!(h.deliver("l", offer, 7).is_ok());
        assert!(matches!(
            h.before_attempt("l", acq("a"), "a", || want("x")),
            Before::Granted(7)
        ));
        assert!(h.leave("l", &a).is_none());
        assert_eq!(h.offer("l", None).expect("b waits").owner().as_str(), "b");
    }

    #[test]
    fn a_grant_left_behind_goes_back_to_the_caller() {
        let h: Handoffs<u32> = Handoffs::new(16);
        let a = h.register("l", acq("a"), &own("a"));
        let _ = h.before_attempt("l", acq("a"), "a", || want("na"));
        let offer = h.offer("l", None).expect("a waits");
        // Delivered, then the waiter leaves before picking it up.
        assert!(h.deliver("l", offer, 3).is_ok());
        assert!(matches!(h.leave("l", &a), Some(Leftover::Grant(3))));
        // Offered, the waiter leaves, then the hand-off lands: the releaser gets it back.
        let b = h.register("l", acq("b"), &own("b"));
        let _ = h.before_attempt("l", acq("b"), "b", || want("nb"));
        let offer = h.offer("l", None).expect("b waits");
        assert!(h.leave("l", &b).is_none());
        assert_eq!(h.deliver("l", offer, 4), Err(4));
        assert!(h.table().lines.is_empty(), "no line outlives its waiters");
    }

    #[test]
    fn the_streak_is_capped_then_local_attempts_hold_back() {
        let h: Handoffs<u32> = Handoffs::new(2);
        let _a = h.register("l", acq("a"), &own("a"));
        for round in 0..2 {
            let _ = h.before_attempt("l", acq("a"), "a", || want("n"));
            let offer = h.offer("l", None).expect("offered");
            assert!(!offer.last, "within the burst");
            assert!(h.deliver("l", offer, round).is_ok());
            assert!(matches!(
                h.before_attempt("l", acq("a"), "a", || want("n")),
                Before::Granted(_)
            ));
        }
        let _ = h.before_attempt("l", acq("a"), "a", || want("n"));
        let offer = h.offer("l", None).expect("offered");
        assert!(offer.last, "third in a row: the streak is spent");
        h.released_to_everyone("l", offer);
        // The waiter and a newcomer of this process hold back; the streak starts again.
        assert!(matches!(
            h.before_attempt("l", acq("a"), "a", || want("n")),
            Before::Yield(_)
        ));
        assert!(matches!(
            h.before_attempt("l", acq("new"), "new", || want("n")),
            Before::Yield(_)
        ));
        assert!(!h.offer("l", None).expect("offered").last);
    }

    #[test]
    fn while_a_local_task_holds_the_lock_newcomers_wait_without_asking() {
        let h: Handoffs<u32> = Handoffs::new(16);
        let end = Instant::now() + Duration::from_secs(5);
        h.note_held("l", "holder", end);
        assert!(
            matches!(h.before_attempt("l", acq("new"), "new", || want("n")), Before::Yield(d) if d > Duration::from_secs(4))
        );
        // The holder itself re-entering does ask the server.
        assert!(matches!(
            h.before_attempt("l", acq("holder"), "holder", || want("h")),
            Before::Ask
        ));
        let a = h.register("l", acq("a"), &own("a"));
        assert!(matches!(
            h.before_attempt("l", acq("a"), "a", || want("na")),
            Before::Yield(_)
        ));
        // The holder's release offers to the waiter and stops counting as a holder.
        let offer = h.offer("l", Some("holder")).expect("a waits");
        assert!(h.deliver("l", offer, 1).is_ok());
        assert!(matches!(
            h.before_attempt("l", acq("a"), "a", || want("x")),
            Before::Granted(1)
        ));
        assert!(h.leave("l", &a).is_none());
        assert!(matches!(
            h.before_attempt("l", acq("new"), "new", || want("n")),
            Before::Ask
        ));
        // A lease that ran out (the holder vanished unreleased): ask the server.
        h.note_held("m", "holder", Instant::now());
        assert!(matches!(
            h.before_attempt("m", acq("new"), "new", || want("n")),
            Before::Ask
        ));
        h.note_gone("m", "holder");
        assert!(h.table().holders.is_empty());
    }

    /// Two waiters of one owner with different leases: each keeps its own slot and
    /// gets a grant made with its own lease (keyed by owner, the second overwrote the
    /// first's lease and the first picked up a grant made with the other's TTL).
    #[test]
    fn waiters_sharing_an_owner_keep_their_own_wants() {
        let h: Handoffs<u32> = Handoffs::new(16);
        let long = AcquisitionId::new();
        let short = AcquisitionId::new();
        let a = h.register("l", long, &own("x"));
        let b = h.register("l", short, &own("x"));
        let mut w_long = want("nl");
        w_long.ttl = Duration::from_secs(60);
        let mut w_short = want("ns");
        w_short.ttl = Duration::from_millis(300);
        let _ = h.before_attempt("l", long, "x", || w_long.clone());
        let _ = h.before_attempt("l", short, "x", || w_short.clone());
        let first = h.offer("l", None).expect("waiting");
        assert_eq!(first.want.ttl, Duration::from_secs(60));
        assert_eq!(first.want.nonce, "nl");
        assert!(h.deliver("l", first, 1).is_ok());
        // The grant goes to the acquisition it was made for.
        assert!(matches!(
            h.before_attempt("l", short, "x", || w_short.clone()),
            Before::Ask
        ));
        assert!(matches!(
            h.before_attempt("l", long, "x", || w_long.clone()),
            Before::Granted(1)
        ));
        let second = h.offer("l", None).expect("the other still waits");
        assert_eq!(second.want.ttl, Duration::from_millis(300));
        assert!(h.leave("l", &a).is_none());
        assert!(h.leave("l", &b).is_none());
    }

    #[test]
    fn an_uncertain_hand_off_is_recovered_by_nonce() {
        let h: Handoffs<u32> = Handoffs::new(16);
        let a = h.register("l", acq("a"), &own("a"));
        let _ = h.before_attempt("l", acq("a"), "a", || want("na"));
        let offer = h.offer("l", None).expect("a waits");
        let sent_at = Instant::now() - Duration::from_secs(3);
        assert!(h.uncertain(offer, sent_at).is_none(), "its waiter is there");
        // Recovered by its nonce, and dated from when the hand-off was sent (the
        // lease may have run for a while before the recovery asks).
        match h.before_attempt("l", acq("a"), "a", || want("other")) {
            Before::Recover(n, at) => {
                assert_eq!(n, "na");
                assert_eq!(at, sent_at);
            }
            other => panic!("expected recovery, got {other:?}"),
        }
        // The next offer carries the recovering attempt's want, never the recovered
        // nonce again (a void written for it must not meet a live hand-off).
        let again = h.offer("l", None).expect("waiting again");
        assert_eq!(again.want.nonce, "other");
        assert!(h.uncertain(again, Instant::now()).is_none());
        assert!(matches!(
            h.leave("l", &a),
            Some(Leftover::Maybe { owner, nonce }) if owner.as_str() == "a" && nonce == "other"
        ));
        // A waiter that left while its hand-off was on the way: the releaser learns whose
        // hold to look for, since nobody will recover it.
        let b = h.register("l", acq("b"), &own("b"));
        let _ = h.before_attempt("l", acq("b"), "b", || want("nb"));
        let offer = h.offer("l", None).expect("b waits");
        assert!(h.leave("l", &b).is_none(), "nothing landed yet");
        let (owner, nonce) = h.uncertain(offer, Instant::now()).expect("b has gone");
        assert_eq!((owner.as_str(), nonce.as_str()), ("b", "nb"));
    }
}
