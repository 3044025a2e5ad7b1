//! The sync engine driven through its channels with a fake dataplane: changes are
//! coalesced, failures retried, everything resynced periodically, and a stop tears the
//! dataplane down; and a slow sync leaves the async side (health checks, the sources)
//! answering, because it runs on the engine's own thread.

mod common;

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use common::{node, web_service};
use proxy_userland::{
    admin::{self, AdminState, healthcheck::HealthCheckServers, http},
    dataplane::{Dataplane, Scope, SyncReport},
    events::EventRecorder,
    model::{NodeInfo, ProxyState, ServiceKey},
    source::SourceEvent,
    sync::{Engine, EngineConfig, EngineEvent, SyncOutcome, SyncPeriods, report::Reports},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};

/// One call of the fake's sync.
#[derive(Clone, Debug)]
struct Call {
    full: bool,
    keys: BTreeSet<ServiceKey>,
}

#[derive(Default)]
struct Shared {
    calls: Mutex<Vec<Call>>,
    /// Services whose next sync fails (once each).
    fail_once: Mutex<BTreeSet<ServiceKey>>,
    in_sync: AtomicBool,
    torn_down: AtomicBool,
}

/// Records what it is asked to do; fails where told to; takes `delay` per sync.
struct Fake {
    shared: Arc<Shared>,
    delay: Duration,
}

impl Dataplane for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn sync(&mut self, state: &ProxyState, _node: &NodeInfo, scope: Scope<'_>) -> SyncReport {
        self.shared.in_sync.store(true, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        let (full, keys) = match scope {
            Scope::Full => (true, state.services.keys().cloned().collect()),
            Scope::Changed(keys) => (false, keys.clone()),
        };
        let mut report = SyncReport {
            services_synced: keys.len(),
            ..Default::default()
        };
        let mut fail = self.shared.fail_once.lock().unwrap();
        for key in &keys {
            if fail.remove(key) {
                report
                    .failed
                    .push((key.clone(), "the fake refuses it once".into()));
            }
        }
        self.shared.calls.lock().unwrap().push(Call { full, keys });
        self.shared.in_sync.store(false, Ordering::SeqCst);
        report
    }

    fn teardown(self) {
        self.shared.torn_down.store(true, Ordering::SeqCst);
    }
}

fn fake(delay: Duration) -> (Fake, Arc<Shared>) {
    let shared = Arc::new(Shared::default());
    (
        Fake {
            shared: shared.clone(),
            delay,
        },
        shared,
    )
}

fn key(name: &str) -> ServiceKey {
    ServiceKey::new("demo", name)
}

fn service(name: &str, last_octet: u8) -> SourceEvent {
    SourceEvent::Service {
        key: key(name),
        service: Some(web_service(name, Ipv4Addr::new(198, 19, 0, last_octet))),
    }
}

/// The next sync the engine reports, within `secs`.
async fn next_sync(rx: &mut mpsc::UnboundedReceiver<EngineEvent>, secs: u64) -> SyncOutcome {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(EngineEvent::Synced(outcome))) => return *outcome,
            Ok(Some(_)) => {}
            Ok(None) => panic!("the engine stopped"),
            Err(_) => panic!("no sync within {secs} s"),
        }
    }
}

#[tokio::test]
async fn engine_coalesces_changes_retries_failures_resyncs_and_stops() {
    let (dp, shared) = fake(Duration::ZERO);
    let periods = SyncPeriods {
        min: Duration::from_millis(300),
        max: Duration::from_millis(2500),
        retry: Duration::from_millis(400),
    };
    let (tx, input) = mpsc::channel(1024);
    let (engine, mut out) = Engine::spawn(
        dp,
        EngineConfig {
            periods,
            node: node(),
            service_ranges: Vec::new(),
        },
        input,
    )
    .unwrap();

    // Nothing is programmed before the initial lists are complete; then one full sync.
    tx.send(SourceEvent::ReplaceAll {
        services: vec![
            web_service("a", Ipv4Addr::new(198, 19, 0, 1)),
            web_service("b", Ipv4Addr::new(198, 19, 0, 2)),
        ],
        slices: vec![],
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        shared.calls.lock().unwrap().is_empty(),
        "synced before the source said it had listed everything"
    );
    tx.send(SourceEvent::Synced).await.unwrap();
    let first = next_sync(&mut out, 5).await;
    assert!(first.record.full, "the first sync is a full one");
    assert_eq!(first.record.services, 2);

    // A burst of 100 changes to two services: a few syncs at most, not one per change.
    let before = shared.calls.lock().unwrap().len();
    for i in 0..50u8 {
        tx.send(service("c", 10 + i)).await.unwrap();
        tx.send(service("d", 100 + i)).await.unwrap();
    }
    let burst_end = Instant::now();
    let mut seen = BTreeSet::new();
    while seen.len() < 2 {
        let o = next_sync(&mut out, 5).await;
        assert!(!o.record.full, "changes need no full sync");
        assert_eq!(o.record.failed, 0);
        seen.extend(
            shared
                .calls
                .lock()
                .unwrap()
                .last()
                .unwrap()
                .keys
                .iter()
                .cloned(),
        );
    }
    assert_eq!(seen, BTreeSet::from([key("c"), key("d")]));
    let burst_syncs = shared.calls.lock().unwrap().len() - before;
    assert!(burst_syncs <= 2, "100 changes took {burst_syncs} syncs");
    assert!(
        burst_end.elapsed() < Duration::from_secs(2),
        "the burst waited {:?}",
        burst_end.elapsed()
    );

    // A service the dataplane refuses once: reported, then retried alone without any new
    // change, and programmed.
    shared.fail_once.lock().unwrap().insert(key("e"));
    tx.send(service("e", 200)).await.unwrap();
    let failed = next_sync(&mut out, 5).await;
    assert_eq!(
        failed
            .failed
            .iter()
            .map(|(k, _)| k.clone())
            .collect::<Vec<_>>(),
        [key("e")]
    );
    assert_eq!(failed.record.failed, 1);
    let failed_at = Instant::now();
    let retried = next_sync(&mut out, 5).await;
    assert!(
        failed_at.elapsed() >= Duration::from_millis(300),
        "retried after {:?}",
        failed_at.elapsed()
    );
    let call = shared.calls.lock().unwrap().last().unwrap().clone();
    assert!(
        !call.full && call.keys == BTreeSet::from([key("e")]),
        "the retry: {call:?}"
    );
    assert_eq!(retried.record.failed, 0);
    assert!(retried.failed.is_empty());

    // No changes at all: a full resync within the max period.
    let quiet = Instant::now();
    let periodic = next_sync(&mut out, 5).await;
    assert!(periodic.record.full, "an idle engine resyncs everything");
    assert_eq!(periodic.record.services, 5);
    assert!(
        quiet.elapsed() <= Duration::from_millis(2500 + 500),
        "resync after {:?}",
        quiet.elapsed()
    );

    // Stopping tears the dataplane down, and the engine's reports end.
    let stop = Instant::now();
    engine.shutdown().await.expect("a clean stop");
    assert!(stop.elapsed() < Duration::from_secs(5));
    assert!(
        shared.torn_down.load(Ordering::SeqCst),
        "the dataplane was not torn down"
    );
    while let Some(ev) = out.recv().await {
        assert!(!matches!(ev, EngineEvent::Synced(_)) || shared.torn_down.load(Ordering::SeqCst));
    }
}

async fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

// A current-thread runtime: anything blocking on it would stall every request below.
#[tokio::test(flavor = "current_thread")]
async fn a_slow_sync_does_not_block_health_checks_or_sources() {
    let (dp, shared) = fake(Duration::from_secs(2));
    let admin = AdminState::new(Duration::from_secs(60));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(http::serve(
        listener,
        admin::health_handler(admin.clone()),
        std::future::pending(),
    ));

    let (tx, input) = mpsc::channel(1024);
    let (engine, out) = Engine::spawn(
        dp,
        EngineConfig {
            periods: SyncPeriods::default(),
            node: node(),
            service_ranges: Vec::new(),
        },
        input,
    )
    .unwrap();
    let reports = Reports {
        admin: admin.clone(),
        health_checks: HealthCheckServers::new(Ipv4Addr::LOCALHOST.into(), admin.clone()),
        recorder: EventRecorder::disabled(),
    };
    let reports = tokio::spawn(reports.run(out));

    tx.send(SourceEvent::ReplaceAll {
        services: vec![web_service("a", Ipv4Addr::new(198, 19, 0, 1))],
        slices: vec![],
    })
    .await
    .unwrap();
    tx.send(SourceEvent::Synced).await.unwrap();
    let waited = Instant::now();
    while !shared.in_sync.load(Ordering::SeqCst) {
        assert!(
            waited.elapsed() < Duration::from_secs(5),
            "the sync never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // While the dataplane is busy for 2 s: probes answer at once, and the source's events
    // are taken without waiting for the sync.
    let mut answered_during_sync = 0;
    let mut slowest = Duration::ZERO;
    for i in 0..10u8 {
        let t = Instant::now();
        let healthz = get(addr, "/healthz").await;
        let readyz = get(addr, "/readyz").await;
        tx.send(service("b", 10 + i)).await.unwrap();
        slowest = slowest.max(t.elapsed());
        assert!(healthz.starts_with("HTTP/1.1 200"), "{healthz}");
        if shared.in_sync.load(Ordering::SeqCst) {
            assert!(
                readyz.starts_with("HTTP/1.1 503"),
                "ready before the first sync ended: {readyz}"
            );
            answered_during_sync += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        answered_during_sync >= 5,
        "only {answered_during_sync} rounds overlapped the sync"
    );
    assert!(
        slowest < Duration::from_millis(250),
        "a round took {slowest:?} during the sync"
    );

    // Once the sync is over, the proxy is ready.
    let waited = Instant::now();
    while !get(addr, "/readyz").await.starts_with("HTTP/1.1 200") {
        assert!(waited.elapsed() < Duration::from_secs(5), "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The stop waits for a sync under way (the changes above started one), then tears down.
    engine.shutdown().await.expect("a clean stop");
    assert!(shared.torn_down.load(Ordering::SeqCst));
    reports.await.unwrap();
    server.abort();
}
