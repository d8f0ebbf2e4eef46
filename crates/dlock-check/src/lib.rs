//! What `dlock check` runs on, published so that anyone can check a lock the same way:
//!
//! - [`FencedStore`]: a small loopback server that keeps, per lock, a value, a version
//!   and the highest fencing token seen; fenced (it rejects operations with a lower
//!   token) or not, with a log of every operation on its own clock;
//! - [`check`]: the offline checker of a history (grants as the collector saw them, and
//!   the store's log): overlapping critical sections, stale operations accepted and
//!   rejected, duplicate and inverted tokens, lost updates; [`concurrency`]: how many
//!   holders of a semaphore were inside at once; [`writer_overlaps`]: writers of a
//!   read-write lock beside anyone;
//! - [`FaultProxy`]: a loopback TCP proxy that delays, blackholes, drops replies or
//!   resets connections between a client and its server.
//!
//! Nothing here touches an address outside 127.0.0.0/8.

mod checker;
mod fenced;
mod proxy;

pub use checker::{Findings, Grant, check, concurrency, writer_overlaps};
pub use fenced::{FencedStore, StoreClient, StoreOp, StoreReply};
pub use proxy::{Fault, FaultProxy};
