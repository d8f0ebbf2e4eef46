//! The etcd v3 gRPC client under the backend: tonic over HTTP/2 with the prost messages
//! of [`super::proto`], load-balanced over the URL's endpoints, with password
//! authentication (the token goes in each request's `token` metadata and is renewed
//! once when the server says it is no longer valid).
//!
//! Only what dlock needs: KV (range, put, delete, txn), leases (grant, revoke,
//! keep-alive stream) and watches.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use http::uri::PathAndQuery;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic_prost::ProstCodec;

use super::proto;

/// Why an RPC failed.
#[derive(Debug, Clone)]
pub(crate) enum RpcError {
    /// The server (or the channel) answered with a gRPC status.
    Status(tonic::Code, String),
    /// The connection could not be made.
    Transport(String),
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RpcError::Status(code, msg) if msg.is_empty() => write!(f, "{code}"),
            RpcError::Status(code, msg) => write!(f, "{code}: {msg}"),
            RpcError::Transport(msg) => f.write_str(msg),
        }
    }
}

impl RpcError {
    /// Whether trying again may work: the server could not be reached or did not
    /// answer in time (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE).
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            RpcError::Transport(_) => true,
            RpcError::Status(code, _) => matches!(
                code,
                tonic::Code::Cancelled | tonic::Code::DeadlineExceeded | tonic::Code::Unavailable
            ),
        }
    }

    fn from_status(s: &tonic::Status) -> Self {
        // The message of a transport failure carries its cause's chain; keep the first
        // line (the cause first, no dump).
        let msg = s.message().lines().next().unwrap_or_default().to_owned();
        RpcError::Status(s.code(), msg)
    }
}

/// How to reach the cluster.
#[derive(Clone, Default)]
pub(crate) struct ConnectOptions {
    /// Per request, and for connecting.
    pub timeout: Option<Duration>,
    /// HTTP/2 keep-alive pings: (interval, timeout).
    pub keep_alive: Option<(Duration, Duration)>,
    /// `user`, `password`.
    pub credentials: Option<(String, String)>,
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("timeout", &self.timeout)
            .field("user", &self.credentials.as_ref().map(|c| &c.0))
            .finish_non_exhaustive()
    }
}

/// A client; cheap to clone (clones share the channel and the token).
#[derive(Clone)]
pub(crate) struct Client {
    channel: Channel,
    credentials: Option<Arc<(String, String)>>,
    token: Arc<RwLock<Option<MetadataValue<Ascii>>>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

const RANGE: &str = "/etcdserverpb.KV/Range";
const PUT: &str = "/etcdserverpb.KV/Put";
const DELETE_RANGE: &str = "/etcdserverpb.KV/DeleteRange";
const TXN: &str = "/etcdserverpb.KV/Txn";
const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
const LEASE_REVOKE: &str = "/etcdserverpb.Lease/LeaseRevoke";
const LEASE_KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";
const WATCH: &str = "/etcdserverpb.Watch/Watch";
const AUTHENTICATE: &str = "/etcdserverpb.Auth/Authenticate";

/// A stream of requests fed from a channel (keep-alives, watch requests).
pub(crate) type Sender<T> = tokio::sync::mpsc::Sender<T>;
/// The server's side of a bidirectional stream.
pub(crate) type Streaming<T> = tonic::codec::Streaming<T>;

impl Client {
    /// Connect to `endpoints` (`http://host:port` or `https://…`), balancing requests
    /// over them, and authenticate when credentials are given.
    pub(crate) async fn connect(
        endpoints: &[String],
        opts: ConnectOptions,
    ) -> Result<Self, RpcError> {
        let mut list = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let mut ep = Endpoint::from_shared(e.clone())
                .map_err(|err| RpcError::Transport(format!("{e}: {err}")))?;
            if let Some(t) = opts.timeout {
                ep = ep.timeout(t).connect_timeout(t);
            }
            if let Some((interval, timeout)) = opts.keep_alive {
                ep = ep
                    .http2_keep_alive_interval(interval)
                    .keep_alive_timeout(timeout)
                    .keep_alive_while_idle(true);
            }
            if let Some(tls) = &opts.tls {
                ep = ep
                    .tls_config(tls.clone())
                    .map_err(|err| RpcError::Transport(format!("{e}: {err}")))?;
            }
            list.push(ep);
        }
        let channel = match list.as_slice() {
            [one] => one
                .connect()
                .await
                .map_err(|err| RpcError::Transport(first_cause(&err)))?,
            _ => Channel::balance_list(list.into_iter()),
        };
        let client = Client {
            channel,
            credentials: opts.credentials.map(Arc::new),
            token: Arc::new(RwLock::new(None)),
        };
        if client.credentials.is_some() {
            client.authenticate().await?;
        }
        Ok(client)
    }

    async fn authenticate(&self) -> Result<(), RpcError> {
        let Some(creds) = &self.credentials else {
            return Ok(());
        };
        let req = proto::AuthenticateRequest {
            name: creds.0.clone(),
            password: creds.1.clone(),
        };
        let resp: proto::AuthenticateResponse = self.call_once(AUTHENTICATE, req, false).await?;
        let token = MetadataValue::try_from(resp.token.as_str())
            .map_err(|_| RpcError::Transport("the server's auth token is not ASCII".into()))?;
        *self
            .token
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(token);
        Ok(())
    }

    fn request<T>(&self, msg: T, with_token: bool) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if with_token
            && let Some(t) = self
                .token
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        {
            req.metadata_mut().insert("token", t);
        }
        req
    }

    async fn call_once<Req, Resp>(
        &self,
        path: &'static str,
        msg: Req,
        with_token: bool,
    ) -> Result<Resp, RpcError>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| RpcError::Transport(first_cause(&e)))?;
        grpc.unary(
            self.request(msg, with_token),
            PathAndQuery::from_static(path),
            ProstCodec::default(),
        )
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| RpcError::from_status(&s))
    }

    /// A unary call; an expired auth token is renewed once.
    async fn call<Req, Resp>(&self, path: &'static str, msg: Req) -> Result<Resp, RpcError>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        match self.call_once(path, msg.clone(), true).await {
            Err(RpcError::Status(tonic::Code::Unauthenticated, m))
                if self.credentials.is_some() && m.contains("token") =>
            {
                self.authenticate().await?;
                self.call_once(path, msg, true).await
            }
            other => other,
        }
    }

    async fn stream<Req, Resp>(
        &self,
        path: &'static str,
        first: Req,
    ) -> Result<(Sender<Req>, Streaming<Resp>), RpcError>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let (tx, rx) = tokio::sync::mpsc::channel::<Req>(16);
        tx.send(first)
            .await
            .map_err(|_| RpcError::Transport("request stream closed".into()))?;
        let requests =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| RpcError::Transport(first_cause(&e)))?;
        let resp = grpc
            .streaming(
                self.request(requests, true),
                PathAndQuery::from_static(path),
                ProstCodec::default(),
            )
            .await
            .map_err(|s| RpcError::from_status(&s))?;
        Ok((tx, resp.into_inner()))
    }

    pub(crate) async fn range(
        &self,
        r: proto::RangeRequest,
    ) -> Result<proto::RangeResponse, RpcError> {
        self.call(RANGE, r).await
    }

    pub(crate) async fn put(&self, r: proto::PutRequest) -> Result<proto::PutResponse, RpcError> {
        self.call(PUT, r).await
    }

    pub(crate) async fn delete_range(
        &self,
        r: proto::DeleteRangeRequest,
    ) -> Result<proto::DeleteRangeResponse, RpcError> {
        self.call(DELETE_RANGE, r).await
    }

    pub(crate) async fn txn(&self, r: proto::TxnRequest) -> Result<proto::TxnResponse, RpcError> {
        self.call(TXN, r).await
    }

    pub(crate) async fn lease_grant(
        &self,
        ttl_secs: i64,
    ) -> Result<proto::LeaseGrantResponse, RpcError> {
        self.call(
            LEASE_GRANT,
            proto::LeaseGrantRequest {
                ttl: ttl_secs,
                id: 0,
            },
        )
        .await
    }

    pub(crate) async fn lease_revoke(
        &self,
        id: i64,
    ) -> Result<proto::LeaseRevokeResponse, RpcError> {
        self.call(LEASE_REVOKE, proto::LeaseRevokeRequest { id })
            .await
    }

    /// Open a keep-alive stream for lease `id` (its first request already sent).
    pub(crate) async fn lease_keep_alive(
        &self,
        id: i64,
    ) -> Result<
        (
            Sender<proto::LeaseKeepAliveRequest>,
            Streaming<proto::LeaseKeepAliveResponse>,
        ),
        RpcError,
    > {
        self.stream(LEASE_KEEP_ALIVE, proto::LeaseKeepAliveRequest { id })
            .await
    }

    /// Watch `key` from now (the create request already sent).
    pub(crate) async fn watch(
        &self,
        key: &[u8],
    ) -> Result<(Sender<proto::WatchRequest>, Streaming<proto::WatchResponse>), RpcError> {
        let create = proto::WatchRequest {
            request_union: Some(proto::WatchRequestUnion::Create(
                proto::WatchCreateRequest {
                    key: key.to_vec(),
                    ..proto::WatchCreateRequest::default()
                },
            )),
        };
        self.stream(WATCH, create).await
    }
}

impl Client {
    /// Watch every key from `key` to `range_end`, from `start_revision` on.
    pub(crate) async fn watch_range(
        &self,
        key: &[u8],
        range_end: &[u8],
        start_revision: i64,
    ) -> Result<(Sender<proto::WatchRequest>, Streaming<proto::WatchResponse>), RpcError> {
        let create = proto::WatchRequest {
            request_union: Some(proto::WatchRequestUnion::Create(
                proto::WatchCreateRequest {
                    key: key.to_vec(),
                    range_end: range_end.to_vec(),
                    start_revision,
                    ..proto::WatchCreateRequest::default()
                },
            )),
        };
        self.stream(WATCH, create).await
    }
}

/// The innermost cause of a transport error, on one line.
fn first_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause: &(dyn std::error::Error + 'static) = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    let text = cause.to_string();
    text.lines().next().unwrap_or_default().to_owned()
}

/// `key` and every key below it (etcd's prefix range end: the key with its last byte
/// that is not 0xff incremented, and what follows dropped).
pub(crate) fn prefix_end(key: &[u8]) -> Vec<u8> {
    let mut end = key.to_vec();
    while let Some(last) = end.last_mut() {
        if *last < 0xff {
            *last += 1;
            return end;
        }
        end.pop();
    }
    // Every key: the whole keyspace from `key` on.
    vec![0]
}

/// A transaction comparison: `key`'s create revision equals `rev` (0: no such key;
/// with `prefix`, no key under it).
pub(crate) fn create_revision_is(key: &[u8], rev: i64, prefix: bool) -> proto::Compare {
    proto::Compare {
        result: proto::CompareResult::Equal as i32,
        target: proto::CompareTarget::Create as i32,
        key: key.to_vec(),
        target_union: Some(proto::TargetUnion::CreateRevision(rev)),
        range_end: if prefix { prefix_end(key) } else { Vec::new() },
    }
}

/// The header revision of a reply (0 if absent).
pub(crate) fn revision(h: Option<&proto::ResponseHeader>) -> i64 {
    h.map_or(0, |h| h.revision)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"a/"), b"a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
