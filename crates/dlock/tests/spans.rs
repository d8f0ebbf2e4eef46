//! Every public async operation opens a `tracing` span named after it, with the lock's
//! name and the backend's scheme — and nothing from the URL's secrets.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock::Locker;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// A span as opened: its name and its fields as `k=v`.
type Opened = (String, Vec<String>);

/// Every span opened.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Opened>>>);

struct Fields(Vec<String>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push(format!("{}={value:?}", field.name()));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push(format!("{}={value}", field.name()));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        let mut fields = Fields(Vec::new());
        attrs.record(&mut fields);
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((attrs.metadata().name().to_owned(), fields.0));
    }
}

#[test]
fn public_operations_have_spans_with_lock_and_scheme() {
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    let _default = tracing::subscriber::set_default(subscriber);
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let locker = Locker::connect(&url).await.expect("connect");
        let guard = locker.lock("job").await.expect("lock");
        guard.extend(Duration::from_secs(20)).await.expect("extend");
        assert!(locker.inspect("job").await.expect("inspect").is_some());
        assert!(locker.try_lock("job").await.expect("try_lock").is_none());
        guard.release().await.expect("release");
    });
    let seen = spans
        .0
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let has = |name: &str, field: &str| {
        seen.iter()
            .any(|(n, f)| n == name && f.iter().any(|kv| kv == field))
    };
    assert!(has("connect", "scheme=sqlite"), "{seen:?}");
    for op in ["lock", "try_lock", "inspect", "extend", "release"] {
        assert!(has(op, "lock=job"), "no {op} span with lock=job: {seen:?}");
        assert!(
            has(op, "scheme=sqlite"),
            "no {op} span with scheme=sqlite: {seen:?}"
        );
    }
}
