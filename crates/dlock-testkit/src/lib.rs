//! Test support for dlock: real lock servers started from PATH on free 127.0.0.1 ports
//! in temp dirs (killed on Drop), and a loopback TCP proxy that injects faults.
//!
//! A test whose server binary is missing prints `skipped: … not found` and returns,
//! unless `DLOCK_REQUIRE_SERVERS=1`, in which case it fails: CI never passes by skipping.
//! No test here touches an address outside 127.0.0.0/8.

mod checker;
mod etcd;
mod fenced;
mod matrix;
mod proxy;
mod restart;
mod scenarios;
mod server;
mod sql;
mod tls;
mod zookeeper;

pub use checker::{Findings, Grant, check};
pub use etcd::EtcdServer;
pub use fenced::{FencedStore, StoreClient, StoreOp, StoreReply};
pub use matrix::{Matrix, Target};
pub use proxy::{Fault, FaultProxy};
pub use restart::{Restartable, SharedServer, lock_server};
pub use scenarios::{SCENARIOS, Scenario, run_check};
pub use server::{
    PortHolder, RedisCluster, RedisNodes, RedisOptions, RedisSentinel, RedisServer, ServerProcess,
    find_binary, free_port, redis_command, redis_ping, servers_required, skip,
};
pub use sql::{MariaDbServer, PG_PASSWORD, PgServer};
pub use tls::TestCerts;
pub use zookeeper::{ZkServer, zk_four_letters};
