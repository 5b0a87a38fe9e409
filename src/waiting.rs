//! Bounded waiting for a slot (`wait_ms` on allocate; docs/executor-protocol.md).
//!
//! An allocation that finds every candidate busy may wait, up to its `wait_ms`, for a slot to free
//! up. It waits without polling the database:
//! - **Notifications.** PostgreSQL sends `credpool_slot_freed` when a lease's slot is freed
//!   (release, force release, reaper, refit: a trigger on `lease_slots`, delivered at commit, so
//!   from every replica) and `credpool_pool_changed` when a pool's version moves (a credential
//!   added, enabled, raised, drained...). Each service process LISTENs on ONE connection of its
//!   own, opened the first time an allocation waits (a pooler in transaction mode cannot carry
//!   LISTEN: there it needs `--db-listen-url`, a direct URL).
//! - **Timers.** A lease that runs out, or a cooldown that ends, changes no row at that moment, so
//!   nothing is sent: each waiter also sleeps until the moment its last attempt said something
//!   ends (the `Retry-After` it would have been given, to the millisecond).
//!
//! Waiters are served roughly in arrival order: a freed slot wakes ONE waiter of its pool, the
//! longest-waiting one that is not already awake and whose model the freed credential serves
//! (as far as this process's candidate view knows), and that waiter's next claim tries the freed
//! credential first. A changed pool (or a reconnected listener, which may have missed
//! notifications) wakes every waiter of the pool. A woken waiter claims through the same
//! statement as every allocation; it may lose the slot to an allocation that did not wait (no
//! slot is ever held back), and then waits again in its place in the queue.
//!
//! A waiter whose caller goes away is dropped with the request (its registration removes itself),
//! so it never takes a slot afterwards; a caller gone while its claim is in flight has the lease
//! given back at once (`src/groups.rs`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::Deserialize;
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::{Notify, watch};

use crate::candidates::CandidateViews;
use crate::domain::{KeyId, ModelName, PoolName, ProviderName};

/// The channel a freed slot is announced on (trigger `lease_slots_freed`).
pub const SLOT_FREED_CHANNEL: &str = "credpool_slot_freed";
/// The channel a changed pool is announced on (trigger `pool_versions_changed`).
pub const POOL_CHANGED_CHANNEL: &str = "credpool_pool_changed";

/// Where the listening connection comes from.
#[derive(Debug, Clone)]
pub enum ListenTarget {
    /// A connection with the same options as this pool's (direct mode), in a pool of its own so
    /// that it never takes one of the service's connections.
    SameAs(PgPool),
    /// This URL (`--db-listen-url`: a direct connection when the service talks to a pooler).
    Url(String),
    /// No listening connection: waiters wake on their timers and on this process's own releases
    /// only.
    None,
}

type PoolKey = (ProviderName, PoolName);

/// A freed slot's pool and credential: the woken waiter tries that credential first.
pub type Hint = (PoolName, KeyId);

/// The waiters of one service process, and its listening connection. Shared (`Arc`).
#[derive(Debug)]
pub struct Waits {
    pools: Mutex<HashMap<PoolKey, BTreeMap<u64, Arc<Waiter>>>>,
    next_ticket: AtomicU64,
    views: Arc<CandidateViews>,
    target: ListenTarget,
    /// Set once the listener task has been started.
    started: AtomicBool,
    /// True while the listening connection is up: this process's releases then come back as
    /// notifications, and are not announced locally a second time.
    listening: Arc<AtomicBool>,
    /// Told when the listener first connects (or gives up its first try).
    first_connect: watch::Sender<bool>,
    /// Dropped with the waits: stops the listener task.
    _stop: watch::Sender<()>,
    stop: watch::Receiver<()>,
}

/// One waiting allocation.
#[derive(Debug)]
struct Waiter {
    model: ModelName,
    notify: Notify,
    /// Woken by a freed slot and not yet back to waiting: a second freed slot goes to the next
    /// waiter. (A wake-up for everybody does not set it: it claims no particular slot, so a slot
    /// freed meanwhile still goes to the longest-waiting waiter.)
    woken: AtomicBool,
    /// The pool and credential whose freed slot woke it, tried first.
    hint: Mutex<Option<Hint>>,
}

impl Waiter {
    fn wake(&self, hint: Option<Hint>) {
        if let Some(hint) = hint {
            *self.hint.lock().unwrap_or_else(|p| p.into_inner()) = Some(hint);
            self.woken.store(true, Ordering::SeqCst);
        }
        self.notify.notify_one();
    }
}

/// A notification payload (both channels; `key_id` only on `credpool_slot_freed`).
#[derive(Debug, Deserialize)]
struct Announcement {
    provider: ProviderName,
    pool: PoolName,
    key_id: Option<KeyId>,
}

impl Waits {
    /// Waits over `views` (to tell which waiters a freed credential can serve), listening through
    /// `target` once the first allocation waits.
    pub fn new(views: Arc<CandidateViews>, target: ListenTarget) -> Arc<Self> {
        let (stop_tx, stop_rx) = watch::channel(());
        Arc::new(Self {
            pools: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(0),
            views,
            target,
            started: AtomicBool::new(false),
            listening: Arc::new(AtomicBool::new(false)),
            first_connect: watch::channel(false).0,
            _stop: stop_tx,
            stop: stop_rx,
        })
    }

    /// Whether the listening connection is up now.
    pub fn listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    /// Registers a waiter for `model` in every pool of `pools` (the request's pool sequence),
    /// behind every waiter already there. It leaves the queues when the registration is dropped.
    /// Starts the listening connection the first time, waiting up to `connect_within` for it.
    pub async fn register(
        self: &Arc<Self>,
        provider: &ProviderName,
        pools: &[PoolName],
        model: &ModelName,
        connect_within: Duration,
    ) -> Registration {
        self.start_listener(connect_within).await;
        let ticket = self.next_ticket.fetch_add(1, Ordering::SeqCst);
        let waiter = Arc::new(Waiter {
            model: model.clone(),
            notify: Notify::new(),
            woken: AtomicBool::new(false),
            hint: Mutex::new(None),
        });
        let keys: Vec<PoolKey> = pools
            .iter()
            .map(|p| (provider.clone(), p.clone()))
            .collect();
        {
            let mut queues = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            for key in &keys {
                queues
                    .entry(key.clone())
                    .or_default()
                    .insert(ticket, waiter.clone());
            }
        }
        crate::telemetry::waiters(1);
        Registration {
            waits: self.clone(),
            keys,
            ticket,
            waiter,
        }
    }

    /// A slot of `key_id` in `provider`/`pool` was freed: wakes the longest-waiting waiter of the
    /// pool that is not awake and whose model the credential serves (unknown: any).
    pub fn slot_freed(&self, provider: &ProviderName, pool: &PoolName, key_id: &KeyId) {
        let queues = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let Some(queue) = queues.get(&(provider.clone(), pool.clone())) else {
            return;
        };
        let chosen = queue.values().find(|w| {
            !w.woken.load(Ordering::SeqCst)
                && self.views.serves(provider, pool, key_id, &w.model) != Some(false)
        });
        if let Some(waiter) = chosen {
            waiter.wake(Some((pool.clone(), key_id.clone())));
        }
    }

    /// `provider`/`pool` changed (or may have: `None` for every pool): wakes all its waiters.
    pub fn pool_changed(&self, pool: Option<(&ProviderName, &PoolName)>) {
        let queues = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        for (key, queue) in queues.iter() {
            if pool.is_none_or(|(provider, pool)| key.0 == *provider && key.1 == *pool) {
                for waiter in queue.values() {
                    waiter.wake(None);
                }
            }
        }
    }

    /// A release by this process freed a slot: announced here only while no listening connection
    /// is up (otherwise the notification does it, once).
    pub fn released_here(&self, provider: &ProviderName, pool: &PoolName, key_id: &KeyId) {
        if !self.listening() {
            self.slot_freed(provider, pool, key_id);
        }
    }

    async fn start_listener(self: &Arc<Self>, connect_within: Duration) {
        if matches!(self.target, ListenTarget::None) {
            return;
        }
        if !self.started.swap(true, Ordering::SeqCst) {
            tokio::spawn(listen(
                Arc::downgrade(self),
                self.target.clone(),
                self.listening.clone(),
                self.first_connect.clone(),
                self.stop.clone(),
            ));
        }
        let mut connected = self.first_connect.subscribe();
        let _ = tokio::time::timeout(connect_within, connected.wait_for(|done| *done)).await;
    }

    fn remove(&self, keys: &[PoolKey], ticket: u64) {
        let mut queues = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        for key in keys {
            if let Some(queue) = queues.get_mut(key) {
                queue.remove(&ticket);
                if queue.is_empty() {
                    queues.remove(key);
                }
            }
        }
        crate::telemetry::waiters(-1);
    }
}

/// A waiter's place in the queues of its pools; dropping it leaves them.
#[derive(Debug)]
pub struct Registration {
    waits: Arc<Waits>,
    keys: Vec<PoolKey>,
    ticket: u64,
    waiter: Arc<Waiter>,
}

impl Registration {
    /// Waits until woken; returns the pool and credential whose freed slot woke it, if that is
    /// why, and marks the waiter awake no more (a slot freed from now on may wake it again).
    pub async fn woken(&self) -> Option<Hint> {
        self.waiter.notify.notified().await;
        self.take_hint()
    }

    /// The hint left by a wake-up that came while the waiter was busy, if any; marks it waiting.
    pub fn take_hint(&self) -> Option<Hint> {
        self.waiter.woken.store(false, Ordering::SeqCst);
        self.waiter
            .hint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.waits.remove(&self.keys, self.ticket);
    }
}

/// The listener task: one connection, LISTEN on both channels, dispatch to the waits; on a lost
/// connection wake everybody (notifications may have been missed) and reconnect with backoff.
/// Ends when the waits are dropped.
async fn listen(
    waits: Weak<Waits>,
    target: ListenTarget,
    listening: Arc<AtomicBool>,
    first_connect: watch::Sender<bool>,
    mut stop: watch::Receiver<()>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let connected = async {
            let mut listener = match &target {
                ListenTarget::SameAs(pool) => {
                    let own = PgPoolOptions::new()
                        .max_connections(1)
                        .connect_lazy_with(pool.connect_options().as_ref().clone());
                    PgListener::connect_with(&own).await?
                }
                ListenTarget::Url(url) => PgListener::connect(url).await?,
                ListenTarget::None => return Err(sqlx::Error::PoolClosed),
            };
            listener
                .listen_all([SLOT_FREED_CHANNEL, POOL_CHANGED_CHANNEL])
                .await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let listener = tokio::select! {
            _ = stop.changed() => return,
            connected = connected => connected,
        };
        let mut listener = match listener {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(error = %error, "waiting allocations: cannot LISTEN; retrying");
                first_connect.send_replace(true);
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        listening.store(true, Ordering::SeqCst);
        first_connect.send_replace(true);
        tracing::info!("waiting allocations: listening for freed slots");
        // anything freed before the LISTEN took effect was missed
        if let Some(waits) = waits.upgrade() {
            waits.pool_changed(None);
        }
        loop {
            let received = tokio::select! {
                _ = stop.changed() => return,
                received = listener.try_recv() => received,
            };
            let Some(waits) = waits.upgrade() else { return };
            match received {
                Ok(Some(notification)) => {
                    match serde_json::from_str::<Announcement>(notification.payload()) {
                        Ok(Announcement {
                            provider,
                            pool,
                            key_id: Some(key_id),
                        }) if notification.channel() == SLOT_FREED_CHANNEL => {
                            waits.slot_freed(&provider, &pool, &key_id)
                        }
                        Ok(Announcement { provider, pool, .. }) => {
                            waits.pool_changed(Some((&provider, &pool)))
                        }
                        Err(error) => {
                            tracing::warn!(channel = notification.channel(), error = %error, "waiting allocations: unreadable notification")
                        }
                    }
                }
                // the connection was lost: reconnect (a fresh listener) and wake everybody
                Ok(None) | Err(_) => {
                    listening.store(false, Ordering::SeqCst);
                    if let Err(error) = received {
                        tracing::warn!(error = %error, "waiting allocations: listening failed; reconnecting");
                    } else {
                        tracing::warn!(
                            "waiting allocations: listening connection lost; reconnecting"
                        );
                    }
                    waits.pool_changed(None);
                    break;
                }
            }
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::HealthPolicy;
    use crate::scoring::ScoringPolicy;

    /// Waits with no listening connection and no views (every credential may serve any model).
    fn waits() -> Arc<Waits> {
        let pool = PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("a lazy pool");
        let views = CandidateViews::new(
            crate::store::Db::direct(pool),
            ScoringPolicy::default(),
            HealthPolicy::default(),
        );
        Waits::new(views, ListenTarget::None)
    }

    fn names() -> (ProviderName, PoolName, ModelName) {
        (
            ProviderName::parse("openai").unwrap(),
            PoolName::default_pool(),
            ModelName::parse("gpt-4o").unwrap(),
        )
    }

    #[tokio::test]
    async fn freed_slots_go_one_each_to_the_longest_waiting_waiters() {
        let waits = waits();
        let (provider, pool, model) = names();
        let pools = [pool.clone()];
        let first = waits
            .register(&provider, &pools, &model, Duration::ZERO)
            .await;
        let second = waits
            .register(&provider, &pools, &model, Duration::ZERO)
            .await;
        let third = waits
            .register(&provider, &pools, &model, Duration::ZERO)
            .await;
        let (a, b) = (KeyId::parse("a").unwrap(), KeyId::parse("b").unwrap());
        waits.slot_freed(&provider, &pool, &a);
        waits.slot_freed(&provider, &pool, &b);
        assert_eq!(first.woken().await, Some((pool.clone(), a)));
        assert_eq!(second.woken().await, Some((pool.clone(), b)));
        assert_eq!(third.take_hint(), None, "two slots woke three waiters");
    }

    #[tokio::test]
    async fn a_slot_freed_right_after_a_wake_up_for_all_still_goes_to_the_first_waiter() {
        let waits = waits();
        let (provider, pool, model) = names();
        let pools = [pool.clone()];
        let first = waits
            .register(&provider, &pools, &model, Duration::ZERO)
            .await;
        let second = waits
            .register(&provider, &pools, &model, Duration::ZERO)
            .await;
        // the pool changed: everybody looks again; before either has, a slot is freed
        waits.pool_changed(Some((&provider, &pool)));
        let a = KeyId::parse("a").unwrap();
        waits.slot_freed(&provider, &pool, &a);
        assert_eq!(first.woken().await, Some((pool.clone(), a)));
        assert_eq!(second.woken().await, None);
    }

    #[tokio::test]
    async fn a_waiter_leaves_every_queue_when_dropped() {
        let waits = waits();
        let (provider, pool, model) = names();
        let both = [PoolName::parse("vip").unwrap(), pool.clone()];
        let gone = waits
            .register(&provider, &both, &model, Duration::ZERO)
            .await;
        let staying = waits
            .register(
                &provider,
                std::slice::from_ref(&pool),
                &model,
                Duration::ZERO,
            )
            .await;
        drop(gone);
        let a = KeyId::parse("a").unwrap();
        waits.slot_freed(&provider, &pool, &a);
        assert_eq!(staying.woken().await, Some((pool, a)));
        assert!(
            waits.pools.lock().unwrap().len() == 1,
            "the vip queue was not removed"
        );
    }
}
