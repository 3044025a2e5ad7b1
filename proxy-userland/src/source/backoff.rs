//! How long a watcher waits after an error before it asks the API server again.
//!
//! kube-rs's `default_backoff` grows to 30 s and only resets after two quiet minutes, so
//! after an API server outage the grown delay applied again to the 410 Gone that the
//! resumed watch got, and only then did the watcher relist: changes landed 40-60 s after
//! the server was back. Here the delay starts at [`MIN_DELAY`], doubles to at most
//! [`MAX_DELAY`] (each wait is drawn between half and all of it, so that the nodes of a
//! cluster do not come back in lockstep), and starts over at the first success. A 410
//! Gone is answered by relisting at once (client-go's reflector does the same), unless
//! the previous error was a 410 too, which would otherwise loop without pause.

use std::{
    hash::{BuildHasher, RandomState},
    time::Duration,
};

use futures::{Stream, StreamExt};
use kube::runtime::watcher;

/// The first wait after an error.
pub const MIN_DELAY: Duration = Duration::from_millis(200);
/// The longest wait: with the runner's minimum sync period this keeps a change made
/// during an outage programmed within a few seconds of the server's return.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
pub struct WatchBackoff {
    /// The ceiling of the next wait; `None` after a success.
    next: Option<Duration>,
    /// The last item was a 410 that we did not wait after.
    relisted_at_once: bool,
}

impl WatchBackoff {
    /// Any event: the server answers, so the next error starts from the shortest wait.
    pub fn succeeded(&mut self) {
        self.next = None;
        self.relisted_at_once = false;
    }

    /// How long to wait after an error; `gone` is a 410 (history compacted: relist).
    pub fn failed(&mut self, gone: bool) -> Duration {
        if gone && !self.relisted_at_once {
            self.relisted_at_once = true;
            return Duration::ZERO;
        }
        self.relisted_at_once = false;
        let ceiling = self.next.unwrap_or(MIN_DELAY);
        self.next = Some((ceiling * 2).min(MAX_DELAY));
        jitter(ceiling)
    }
}

/// A wait between half and all of `ceiling`.
fn jitter(ceiling: Duration) -> Duration {
    // RandomState is randomly seeded; enough to spread retries, no crate needed.
    let r = RandomState::new().hash_one(std::time::SystemTime::now());
    let half = ceiling / 2;
    half + Duration::from_nanos(r % (half.as_nanos() as u64).max(1))
}

/// Whether a watcher error is a 410 Gone: the resourceVersion we resume from is older
/// than the server's history, and only a fresh list brings us back in step.
pub fn is_gone(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// `stream` (a kube-rs watcher) with [`WatchBackoff`] applied: after an error, the next
/// poll of the watcher waits as long as the backoff says.
pub fn with_backoff<K, S>(
    stream: S,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    K: Send + 'static,
{
    let state = (stream.boxed(), WatchBackoff::default(), Duration::ZERO);
    futures::stream::unfold(state, |(mut stream, mut backoff, wait)| async move {
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let item = stream.next().await?;
        let wait = match &item {
            Ok(_) => {
                backoff.succeeded();
                Duration::ZERO
            }
            Err(e) => backoff.failed(is_gone(e)),
        };
        Some((item, (stream, backoff, wait)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_starts_over_after_a_success() {
        let mut b = WatchBackoff::default();
        let waits: Vec<Duration> = (0..8).map(|_| b.failed(false)).collect();
        for (i, w) in waits.iter().enumerate() {
            let ceiling = (MIN_DELAY * 2u32.pow(i as u32)).min(MAX_DELAY);
            assert!(
                *w >= ceiling / 2 && *w <= ceiling,
                "wait {i}: {w:?} for ceiling {ceiling:?}"
            );
        }
        assert!(waits[7] >= MAX_DELAY / 2, "capped, not reset: {waits:?}");
        b.succeeded();
        assert!(b.failed(false) <= MIN_DELAY, "a success starts over");
    }

    #[test]
    fn a_410_after_an_outage_relists_at_once_but_never_loops() {
        let mut b = WatchBackoff::default();
        for _ in 0..10 {
            b.failed(false); // the server is away: the waits grow
        }
        assert_eq!(
            b.failed(true),
            Duration::ZERO,
            "the server is back and says 410: relist now"
        );
        // The relist itself answered 410: wait, do not spin.
        assert!(b.failed(true) >= MAX_DELAY / 2);
        b.succeeded();
        assert_eq!(b.failed(true), Duration::ZERO);
    }

    #[test]
    fn recognizes_410_in_every_shape() {
        let status = |code| {
            let mut s = kube::core::Status::failure("expired", "Expired");
            s.code = code;
            s
        };
        assert!(is_gone(&watcher::Error::WatchError(Box::new(status(410)))));
        assert!(!is_gone(&watcher::Error::WatchError(Box::new(status(500)))));
        assert!(is_gone(&watcher::Error::InitialListFailed(
            kube::Error::Api(Box::new(status(410)))
        )));
        assert!(!is_gone(&watcher::Error::NoResourceVersion));
    }

    #[tokio::test]
    async fn the_stream_waits_after_errors_only() {
        let gone = || {
            let mut s = kube::core::Status::failure("expired", "Expired");
            s.code = 410;
            Err::<watcher::Event<()>, _>(watcher::Error::WatchError(Box::new(s)))
        };
        let items = vec![
            Err(watcher::Error::NoResourceVersion),
            Err(watcher::Error::NoResourceVersion),
            gone(),
            Ok(watcher::Event::Init),
        ];
        let mut s = std::pin::pin!(with_backoff(futures::stream::iter(items)));
        let t0 = tokio::time::Instant::now();
        let mut at = vec![];
        while let Some(item) = s.next().await {
            at.push((item.is_ok(), t0.elapsed()));
        }
        assert_eq!(at.len(), 4);
        let slack = Duration::from_millis(100);
        assert!(at[0].1 < slack, "{at:?}");
        assert!(at[1].1 >= MIN_DELAY / 2, "{at:?}");
        let after_second = at[2].1 - at[1].1;
        assert!(
            after_second >= MIN_DELAY && after_second <= MIN_DELAY * 2 + slack,
            "{at:?}"
        );
        assert!(at[3].1 - at[2].1 < slack, "no wait after the 410: {at:?}");
    }
}
