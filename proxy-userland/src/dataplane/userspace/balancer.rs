//! Which backend a new connection or UDP flow of one service goes to: round robin, or the
//! client's previous backend while its ClientIP affinity lasts.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

/// Affinity entries kept at most; past this, expired ones are purged, then the oldest.
const MAX_AFFINITY_ENTRIES: usize = 65_536;

#[derive(Debug, Default)]
pub struct Balancer {
    backends: Vec<SocketAddr>,
    next: usize,
    affinity: Option<Duration>,
    sticky: HashMap<IpAddr, (SocketAddr, Instant)>,
}

impl Balancer {
    pub fn new(backends: Vec<SocketAddr>, affinity_secs: Option<u32>) -> Self {
        let mut b = Balancer::default();
        b.update(backends, affinity_secs);
        b
    }

    pub fn backends(&self) -> &[SocketAddr] {
        &self.backends
    }

    /// New backends; clients stuck to a backend that is gone are free again.
    pub fn update(&mut self, backends: Vec<SocketAddr>, affinity_secs: Option<u32>) {
        self.affinity = affinity_secs.map(|s| Duration::from_secs(u64::from(s)));
        self.sticky.retain(|_, (b, _)| backends.contains(b));
        if self.affinity.is_none() {
            self.sticky.clear();
        }
        if self.next >= backends.len() {
            self.next = 0;
        }
        self.backends = backends;
    }

    /// The backend for a new connection from `client`; None if there are none.
    pub fn pick(&mut self, client: IpAddr, now: Instant) -> Option<SocketAddr> {
        if self.backends.is_empty() {
            return None;
        }
        if let Some(ttl) = self.affinity
            && let Some((b, seen)) = self.sticky.get_mut(&client)
            && now.saturating_duration_since(*seen) < ttl
        {
            *seen = now;
            return Some(*b);
        }
        let b = self.backends[self.next % self.backends.len()];
        self.next = (self.next + 1) % self.backends.len();
        if let Some(ttl) = self.affinity {
            if self.sticky.len() >= MAX_AFFINITY_ENTRIES {
                self.sticky
                    .retain(|_, (_, seen)| now.saturating_duration_since(*seen) < ttl);
                if self.sticky.len() >= MAX_AFFINITY_ENTRIES
                    && let Some(oldest) = self
                        .sticky
                        .iter()
                        .min_by_key(|(_, (_, t))| *t)
                        .map(|(k, _)| *k)
                {
                    self.sticky.remove(&oldest);
                }
            }
            self.sticky.insert(client, (b, now));
        }
        Some(b)
    }

    /// The backend after `b` in round-robin order, to retry a failed connect.
    pub fn after(&self, b: SocketAddr) -> Option<SocketAddr> {
        let i = self.backends.iter().position(|x| *x == b)?;
        Some(self.backends[(i + 1) % self.backends.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(n: u8) -> Vec<SocketAddr> {
        (1..=n)
            .map(|i| SocketAddr::from(([198, 18, 1, 10 + i], 8080)))
            .collect()
    }

    #[test]
    fn round_robin_visits_every_backend_in_turn() {
        let mut b = Balancer::new(addrs(3), None);
        let now = Instant::now();
        let client: IpAddr = "198.18.0.1".parse().unwrap();
        let picks: Vec<_> = (0..6).map(|_| b.pick(client, now).unwrap()).collect();
        assert_eq!(picks[..3], addrs(3)[..]);
        assert_eq!(picks[3..], addrs(3)[..]);
    }

    #[test]
    fn affinity_keeps_a_client_until_it_expires_or_the_backend_goes() {
        let mut b = Balancer::new(addrs(3), Some(10));
        let t0 = Instant::now();
        let (c1, c2): (IpAddr, IpAddr) =
            ("198.18.0.1".parse().unwrap(), "198.18.0.2".parse().unwrap());
        let first = b.pick(c1, t0).unwrap();
        assert_ne!(
            b.pick(c2, t0).unwrap(),
            first,
            "another client moves the round robin on"
        );
        for s in 1..5 {
            assert_eq!(b.pick(c1, t0 + Duration::from_secs(s)).unwrap(), first);
        }
        // Idle for longer than the timeout: free to move.
        let later = b.pick(c1, t0 + Duration::from_secs(30)).unwrap();
        assert_ne!(later, first);
        // Its backend removed: moves at once.
        let rest: Vec<_> = addrs(3).into_iter().filter(|a| *a != later).collect();
        b.update(rest.clone(), Some(10));
        assert!(rest.contains(&b.pick(c1, t0 + Duration::from_secs(31)).unwrap()));
    }

    #[test]
    fn no_backends_means_no_pick() {
        let mut b = Balancer::new(vec![], Some(10));
        assert_eq!(b.pick("198.18.0.1".parse().unwrap(), Instant::now()), None);
    }
}
