//! Test support for dlock (dev-only, unpublished): real lock servers started from PATH
//! on free 127.0.0.1 ports in temp dirs (killed on Drop), the matrix of every backend,
//! and `dlock check` runs over it. The fault proxy, fenced store and checker come from
//! `dlock-check` and are re-exported here.
//!
//! A test whose server binary is missing prints `skipped: … not found` and returns,
//! unless `DLOCK_REQUIRE_SERVERS=1`, in which case it fails: CI never passes by skipping.
//! No test here touches an address outside 127.0.0.0/8.

mod etcd;
mod matrix;
mod restart;
mod scenarios;
mod server;
mod sql;
mod sysv_shm;
mod template;
mod tls;
mod zookeeper;

// What `dlock check` ships lives in the publishable `dlock-check`; tests use it from here.
pub use dlock_check::{
    Fault, FaultProxy, FencedStore, Findings, Grant, StoreClient, StoreOp, StoreReply, check,
};
pub use etcd::EtcdServer;
pub use matrix::{Matrix, Target};
pub use restart::{Restartable, SharedServer, lock_server};
pub use scenarios::{SCENARIOS, Scenario, run_check};
pub use server::{
    PortHolder, RedisCluster, RedisNodes, RedisOptions, RedisSentinel, RedisServer, ServerProcess,
    find_binary, free_port, redis_command, redis_ping, redis_subscribers,
    servers_die_with_this_thread, servers_required, skip,
};
pub use sql::{
    MariaDbServer, PG_PASSWORD, PgServer, sql_server_settings, sql_servers_at_default_sizes,
};
pub use sysv_shm::segments_created_by;
pub use tls::TestCerts;
pub use zookeeper::{ZkServer, zk_four_letters};
