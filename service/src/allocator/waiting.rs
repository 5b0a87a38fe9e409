//! Bounded waiting for a slot (`wait_ms` on allocate; docs/executor-protocol.md).
//!
//! An allocation that finds every candidate busy may wait, up to its `wait_ms`, for a slot to free
//! up. It waits without polling the database, but for one floor (below):
//! - **Notifications.** `credpool_slot_freed` tells that a lease's slot was freed, from every
//!   replica: an executor's release is announced by the process that released it, right after
//!   its group committed (its own waiters are woken directly; [`Waits::released_here`]) when the
//!   release said a request waits for its pool, and by a forced release itself (a NOTIFY that
//!   goes out at its commit); a lease that runs out is met by the timers below.
//!   `credpool_pool_changed` tells that a pool's version moved (a credential added, enabled,
//!   raised, drained...). Each service process LISTENs on ONE connection of its own, opened the
//!   first time an allocation waits (a pooler in transaction mode cannot carry LISTEN: there it
//!   needs `--db-listen-url`, a direct URL); it skips its own announcements.
//! - **Timers.** A lease that runs out, or a cooldown that ends, changes no row at that moment, so
//!   nothing is sent: each waiter also sleeps until the moment its last attempt said something
//!   ends (the `Retry-After` it would have been given, to the millisecond).
//! - **Recheck.** The longest-waiting waiter of each pool in each process claims again every
//!   [`RECHECK_EVERY`] however quiet it is: a release announced by a process that stopped between
//!   its commit and its announcement reaches every waiter that way.
//!
//! Waiters are served roughly in arrival order: a freed slot wakes ONE waiter of its pool, the
//! longest-waiting one that is not already awake and whose model the freed credential serves
//! (as far as this process's candidate view knows), and that waiter's next claim tries the freed
//! credential first. A changed pool (or a reconnected listener, which may have missed
//! notifications) wakes every waiter of the pool. A woken waiter claims through the same
//! statement as every allocation; it may lose the slot to an allocation that did not wait (no
//! slot is ever held back), and then waits again in its place in the queue.
//!
//! A wake-up is never lost: a waiter that leaves (served from another slot, or at the end of its
//! wait, or gone with its caller) while it holds a wake-up it has not used hands it to the next
//! waiter that can use it, as if the slot had been freed then.
//!
//! **Fair share** (docs/design.md "Fair share"). Waiting is also known to every replica: the
//! claims of a request that may wait carry its [`WaitingRequest`], and one that grants nothing
//! records the request in `pool_waiters` (its tenant, provider, pool sequence, model, arrival and
//! the end of its wait) until a claim grants it or its wait ends; its process says every
//! [`WAITERS_SEEN_EVERY`] that it is alive. The claim yields (grants nothing) when another
//! tenant, further below its weighted share of the pool, waits for the same pool and model; the
//! yielding waiter hands its wake-up to the longest-waiting waiter of that tenant
//! ([`Waits::yield_to`]): here if this process has one that is not awake, else through an
//! announcement to the other processes (`tenant` in the payload), each of which wakes its own
//! longest-waiting waiter of that tenant. A yield never leaves a free slot to the recheck alone.
//!
//! A waiter whose caller goes away is dropped with the request (its registration removes itself),
//! so it never takes a slot afterwards; a caller gone while its claim is in flight has the lease
//! given back at once ([`super::groups`]), unless the request carries a `request_id` (a retry of
//! it may be waiting for that very lease). When the service's shutdown drain is over,
//! [`Waits::stop_waiting`] ends every wait: each waiter answers 429 at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::Deserialize;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, mpsc, watch};

use super::candidates::CandidateViews;
use crate::background::Supervisor;
use crate::domain::{KeyId, ModelName, PoolName, ProviderName};
use crate::store::leases::ClaimWaiting;
use crate::store::{Db, PoolSettings, Target};

/// How long one attempt of the listening connection may wait for a server, with
/// `--db-listen-url` (with the service's own servers, the service's acquire timeout).
const LISTEN_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// The channel a freed slot is announced on (trigger `lease_slots_freed`).
pub const SLOT_FREED_CHANNEL: &str = "credpool_slot_freed";
/// The channel a changed pool is announced on (trigger `pool_versions_changed`).
pub const POOL_CHANGED_CHANNEL: &str = "credpool_pool_changed";

/// At most this many freed slots are announced in one statement.
const ANNOUNCE_BATCH: usize = 512;

/// How often a process with waiting requests says it is alive (`pool_waiter_processes`): a claim
/// ignores the waiters of a process not heard from for 5 seconds, so a process that stopped
/// without deleting its rows holds no slot back for long.
pub const WAITERS_SEEN_EVERY: Duration = Duration::from_secs(1);

/// How often the longest-waiting waiter of a pool claims again without being told of a freed slot:
/// the floor under announcements that never came (their sender stopped right after its commit).
pub const RECHECK_EVERY: Duration = Duration::from_secs(1);

/// The first and the longest pause between two attempts to send announcements the database did
/// not take; attempts go on for about a minute, then the recheck is what is left.
const ANNOUNCE_RETRY: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(5));
const ANNOUNCE_ATTEMPTS: u32 = 20;

/// Where the listening connection comes from. On a multi-host target it follows the writable
/// server like the service's pool (a standby cannot LISTEN): each (re)connection starts at the
/// server the service uses now, and checks and searches by itself (`crate::store::failover`).
#[derive(Debug, Clone)]
pub enum ListenTarget {
    /// A connection to the same server(s) with the same options as this pool's (direct mode),
    /// in a pool of its own ([`Db::sibling`]) so that it never takes one of the service's
    /// connections.
    SameAs(Db),
    /// This URL (`--db-listen-url`: a direct connection when the service talks to a pooler); one
    /// host or several, like `DATABASE_URL`.
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
    /// Told when the listener first connects (or gives up its first try).
    first_connect: watch::Sender<bool>,
    /// Dropped with the waits: stops the listener task.
    _stop: watch::Sender<()>,
    stop: watch::Receiver<()>,
    /// Set (for good) at the end of a shutdown's drain: waiting is over for everybody, and each
    /// waiter answers with what it has now. A watch channel rather than a notification: a
    /// waiter that starts waiting after it was set sees it at once.
    stopped: watch::Sender<bool>,
    /// This process's name in its announcements (random), so that its listener skips them.
    instance: String,
    /// Runs the listener and the waiters' liveness.
    supervisor: Supervisor,
    /// Sends this process's announcements of freed slots; `None`: nobody is told.
    announcements: Option<mpsc::UnboundedSender<String>>,
    /// Where waiting requests' rows are deleted and this process says it is alive (the database
    /// the announcements go to); `None`: nowhere (tests).
    shared: Option<Db>,
    /// This process's waiting requests, whether the task that says it is alive runs, and how
    /// that task learns that a first one came after none.
    waiting: Arc<AtomicU64>,
    seen_started: AtomicBool,
    first_waiting: Arc<Notify>,
}

/// One waiting allocation.
#[derive(Debug)]
struct Waiter {
    model: ModelName,
    /// Its tenant, when known (a waiter of a tenant further below its share may be woken in
    /// another waiter's stead).
    tenant: Option<String>,
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

/// A notification payload (both channels; `key_id` only on `credpool_slot_freed`, `from` only
/// on a service process's own announcements, `tenant` only on a yield's: wake a waiter of that
/// tenant).
#[derive(Debug, Deserialize)]
struct Announcement {
    provider: ProviderName,
    pool: PoolName,
    key_id: Option<KeyId>,
    from: Option<String>,
    tenant: Option<String>,
}

impl Waits {
    /// Waits over `views` (to tell which waiters a freed credential can serve), listening through
    /// `target` once the first allocation waits, and announcing this process's freed slots
    /// through `announce_on` (`None`: to nobody else; tests). Its tasks (the listener, the
    /// liveness of its waiters, the announcements) run under `supervisor`. Call within a Tokio
    /// runtime.
    pub fn new(
        views: Arc<CandidateViews>,
        target: ListenTarget,
        announce_on: Option<Db>,
        supervisor: Supervisor,
    ) -> Arc<Self> {
        let (stop_tx, stop_rx) = watch::channel(());
        let shared = announce_on.clone();
        let announcements = announce_on.map(|db| {
            let (sender, receiver) = mpsc::unbounded_channel();
            // shared, so that a run made again after a panic takes up the same channel
            let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
            supervisor.spawn("slot_announcer", move || {
                announce(db.clone(), receiver.clone())
            });
            sender
        });
        Arc::new(Self {
            pools: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(0),
            views,
            target,
            started: AtomicBool::new(false),
            first_connect: watch::channel(false).0,
            _stop: stop_tx,
            stop: stop_rx,
            stopped: watch::channel(false).0,
            instance: format!("{:016x}", rand::random::<u64>()),
            announcements,
            shared,
            supervisor,
            waiting: Arc::new(AtomicU64::new(0)),
            first_waiting: Arc::new(Notify::new()),
            seen_started: AtomicBool::new(false),
        })
    }

    /// Ends every wait, now and from now on: each waiting allocation answers with its last
    /// result (a 429 with `Retry-After`) instead of waiting on. The service calls it when its
    /// shutdown drain time is over, so that waiters get an answer rather than a reset connection.
    pub fn stop_waiting(&self) {
        self.stopped.send_replace(true);
    }

    /// Resolves once [`Waits::stop_waiting`] has been called (at once if it was).
    pub async fn waiting_stopped(&self) {
        let mut stopped = self.stopped.subscribe();
        // the sender lives as long as `self`, so this cannot fail while anyone awaits it
        let _ = stopped.wait_for(|stopped| *stopped).await;
    }

    /// Registers a waiter for `model` in every pool of `pools` (the request's pool sequence),
    /// behind every waiter already there; `tenant`: the tenant its claims are made for, if known
    /// (a yield to that tenant may wake it). It leaves the queues when the registration is
    /// dropped. Starts the listening connection the first time, waiting up to `connect_within`
    /// for it.
    pub async fn register(
        self: &Arc<Self>,
        provider: &ProviderName,
        pools: &[PoolName],
        model: &ModelName,
        tenant: Option<String>,
        connect_within: Duration,
    ) -> Registration {
        self.start_listener(connect_within).await;
        let ticket = self.next_ticket.fetch_add(1, Ordering::SeqCst);
        let waiter = Arc::new(Waiter {
            model: model.clone(),
            tenant,
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
            provider: provider.clone(),
            keys,
            ticket,
            waiter,
        }
    }

    /// A request that may wait `wait` for a slot of `provider` in `pools` (its pool sequence):
    /// what its claims record of it (see [`WaitingRequest`]). Starts the task that says this
    /// process is alive the first time.
    pub fn waiting_request(
        self: &Arc<Self>,
        provider: ProviderName,
        pools: Vec<PoolName>,
        wait: Duration,
    ) -> WaitingRequest {
        if self.waiting.fetch_add(1, Ordering::SeqCst) == 0 {
            self.first_waiting.notify_one();
        }
        if let Some(db) = &self.shared
            && !self.seen_started.swap(true, Ordering::SeqCst)
        {
            let (db, instance, waiting, first, stop) = (
                db.clone(),
                self.instance.clone(),
                self.waiting.clone(),
                self.first_waiting.clone(),
                self.stop.clone(),
            );
            self.supervisor.spawn("waiters_alive", move || {
                keep_seen(
                    db.clone(),
                    instance.clone(),
                    waiting.clone(),
                    first.clone(),
                    stop.clone(),
                )
            });
        }
        WaitingRequest {
            waits: self.clone(),
            waiter: uuid::Uuid::new_v4(),
            provider,
            pools,
            arrived: tokio::time::Instant::now(),
            wait,
            recorded: AtomicBool::new(false),
        }
    }

    /// A claim in `provider`/`pool` yielded to `tenant` (further below its share): wakes that
    /// tenant's longest-waiting waiter that is not awake, with the freed slot's `hint` if there
    /// is one; when this process has none, announces it to the other processes, each of which
    /// wakes its own.
    pub fn yield_to(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        tenant: &str,
        hint: Option<&KeyId>,
    ) {
        if self.wake_tenant(provider, pool, tenant, hint) {
            return;
        }
        if let Some(announcements) = &self.announcements {
            let announcement = serde_json::json!({
                "provider": provider.as_str(),
                "pool": pool.as_str(),
                "key_id": hint.map(KeyId::as_str),
                "tenant": tenant,
                "from": self.instance,
            });
            // the receiver ends only with the runtime
            let _ = announcements.send(announcement.to_string());
        }
    }

    /// Wakes the longest-waiting waiter of `tenant` in `provider`/`pool` that is not awake (and
    /// whose model the `hint`'s credential serves, as far as the view knows); whether there was
    /// one.
    fn wake_tenant(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        tenant: &str,
        hint: Option<&KeyId>,
    ) -> bool {
        let queues = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let Some(queue) = queues.get(&(provider.clone(), pool.clone())) else {
            return false;
        };
        let chosen = queue.values().find(|w| {
            w.tenant.as_deref() == Some(tenant)
                && !w.woken.load(Ordering::SeqCst)
                && hint.is_none_or(|key_id| {
                    self.views.serves(provider, pool, key_id, &w.model) != Some(false)
                })
        });
        let Some(waiter) = chosen else {
            return false;
        };
        waiter.wake(hint.map(|key_id| (pool.clone(), key_id.clone())));
        true
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

    /// A release by this process freed a slot, and has committed: wakes a waiter here at once,
    /// and announces the slot to every other process (on `credpool_slot_freed`, from a task of
    /// its own that sends whatever was freed meanwhile in one statement, and sends it again with
    /// backoff while the database does not take it; this process's listener skips it). Should
    /// the announcement never be sent (this process stops between the commit and the
    /// announcement), the longest-waiting waiter of each pool in every process claims again every
    /// [`RECHECK_EVERY`] on its own, so a freed slot is never left unclaimed longer than that.
    pub fn released_here(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        key_id: &KeyId,
        waiters: bool,
    ) {
        self.slot_freed(provider, pool, key_id);
        if !waiters {
            // nobody waits for this pool on any process (the release read `pool_waiters`)
            return;
        }
        if let Some(announcements) = &self.announcements {
            let announcement = serde_json::json!({
                "provider": provider.as_str(),
                "pool": pool.as_str(),
                "key_id": key_id.as_str(),
                "from": self.instance,
            });
            // the receiver ends only with the runtime
            let _ = announcements.send(announcement.to_string());
        }
    }

    async fn start_listener(self: &Arc<Self>, connect_within: Duration) {
        if matches!(self.target, ListenTarget::None) {
            return;
        }
        if !self.started.swap(true, Ordering::SeqCst) {
            let (waits, target, first_connect, stop) = (
                Arc::downgrade(self),
                self.target.clone(),
                self.first_connect.clone(),
                self.stop.clone(),
            );
            self.supervisor.spawn("waits_listener", move || {
                listen(
                    waits.clone(),
                    target.clone(),
                    first_connect.clone(),
                    stop.clone(),
                )
            });
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

/// A waiter's place in the queues of its pools; dropping it leaves them, and hands a wake-up it
/// has not used to the next waiter.
#[derive(Debug)]
pub struct Registration {
    waits: Arc<Waits>,
    provider: ProviderName,
    keys: Vec<PoolKey>,
    ticket: u64,
    waiter: Arc<Waiter>,
}

/// A request that may wait for a slot, as its claims record it in `pool_waiters` (the claim
/// writes the row when it grants nothing and deletes it when it grants). Dropped with the
/// request: a row its claims left (its wait ended without a lease) is deleted then. A claim
/// whose answer its caller never read (it left while the claim ran, or before it read the
/// answer) deletes the row it wrote itself ([`super::groups`]).
#[derive(Debug)]
pub struct WaitingRequest {
    waits: Arc<Waits>,
    /// The request's id for its row.
    waiter: uuid::Uuid,
    /// The provider it waits for (its row's).
    provider: ProviderName,
    /// Its pool sequence.
    pools: Vec<PoolName>,
    /// When it arrived, on this process's monotonic clock (it counts durations; the database
    /// clock dates them).
    arrived: tokio::time::Instant,
    /// How long it may wait in all.
    wait: Duration,
    /// Whether its last claim may have left its row.
    recorded: AtomicBool,
}

impl WaitingRequest {
    /// What its next claim carries: how long it has waited, and how long it may still wait.
    pub fn claim(&self) -> ClaimWaiting {
        let waited = self.arrived.elapsed();
        ClaimWaiting {
            waiter: self.waiter,
            instance: self.waits.instance.clone(),
            pools: self.pools.clone(),
            waited,
            wait_left: self.wait.saturating_sub(waited),
        }
    }

    /// One of its claims ran: `recorded` when it left the request's row (it granted nothing and
    /// the request was not refused for its key or its request_id).
    pub fn claimed(&self, recorded: bool) {
        self.recorded.store(recorded, Ordering::SeqCst);
    }
}

impl Drop for WaitingRequest {
    fn drop(&mut self) {
        self.waits.waiting.fetch_sub(1, Ordering::SeqCst);
        let Some(db) = self.waits.shared.clone() else {
            return;
        };
        if !self.recorded.load(Ordering::SeqCst) {
            return;
        }
        // (a row that cannot be deleted is ignored once its wait is over, and deleted a minute
        // later by any process that says it is alive)
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (waiter, provider) = (self.waiter, self.provider.clone());
            runtime.spawn(async move {
                let deleted = async {
                    let mut work = db.work().await?;
                    crate::store::leases::forget_waiter(&mut *work, waiter, &provider).await?;
                    work.done().await
                };
                if let Err(error) = deleted.await {
                    tracing::debug!(error = %error, "waiting allocations: cannot delete a waiter's row");
                }
            });
        }
    }
}

impl Registration {
    /// Waits until woken; returns the pool and credential whose freed slot woke it, if that is
    /// why, and marks the waiter awake no more (a slot freed from now on may wake it again).
    pub async fn woken(&self) -> Option<Hint> {
        self.waiter.notify.notified().await;
        self.take_hint()
    }

    /// Whether this waiter has waited longest in one of its pools here: the one that claims
    /// again every [`RECHECK_EVERY`] whatever it was told (see [`Waits::released_here`]).
    pub fn first_in_line(&self) -> bool {
        let queues = self.waits.pools.lock().unwrap_or_else(|p| p.into_inner());
        self.keys.iter().any(|key| {
            queues
                .get(key)
                .and_then(|queue| queue.keys().next())
                .is_some_and(|first| *first == self.ticket)
        })
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

impl Registration {
    /// A hint this waiter took but did not use (it was served from another pool first): the
    /// freed slot goes to the next waiter. Call after dropping the registration.
    pub fn pass_on(waits: &Waits, provider: &ProviderName, hint: Hint) {
        waits.slot_freed(provider, &hint.0, &hint.1);
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.waits.remove(&self.keys, self.ticket);
        // woken by a freed slot, and leaving before it looked: the slot is somebody else's now
        let unused = self
            .waiter
            .woken
            .swap(false, Ordering::SeqCst)
            .then(|| {
                self.waiter
                    .hint
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
            })
            .flatten();
        if let Some(hint) = unused {
            Self::pass_on(&self.waits, &self.provider, hint);
        }
    }
}

/// The announcing task: sends what `announcements` receives, up to [`ANNOUNCE_BATCH`] per
/// statement (`credpool_announce_freed`), until every sender is gone.
async fn announce(db: Db, announcements: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<String>>>) {
    let mut announcements = announcements.lock().await;
    let mut batch = Vec::with_capacity(ANNOUNCE_BATCH);
    while announcements.recv_many(&mut batch, ANNOUNCE_BATCH).await > 0 {
        let mut pause = ANNOUNCE_RETRY.0;
        for attempt in 1..=ANNOUNCE_ATTEMPTS {
            let sent = async {
                let mut work = db.work().await?;
                sqlx::query_scalar!("SELECT credpool_announce_freed($1)", &batch[..])
                    .fetch_one(&mut *work)
                    .await?;
                work.done().await
            };
            match sent.await {
                Ok(()) => break,
                Err(error) if attempt < ANNOUNCE_ATTEMPTS => {
                    tracing::warn!(error = %error, slots = batch.len(), attempt,
                        "waiting allocations: cannot announce freed slots yet; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(ANNOUNCE_RETRY.1);
                }
                Err(error) => tracing::warn!(error = %error, slots = batch.len(),
                    "waiting allocations: cannot announce freed slots; other processes' waiters find them on their recheck"),
            }
        }
        batch.clear();
    }
}

/// Says this process is alive, every [`WAITERS_SEEN_EVERY`] while it has waiting requests, and
/// at once when the first one comes after none (`credpool_waiters_seen`, which also deletes rows
/// every process has long stopped keeping). Ends when the waits are dropped.
async fn keep_seen(
    db: Db,
    instance: String,
    waiting: Arc<AtomicU64>,
    first: Arc<Notify>,
    mut stop: watch::Receiver<()>,
) {
    loop {
        if waiting.load(Ordering::SeqCst) == 0 {
            tokio::select! {
                _ = stop.changed() => return,
                () = first.notified() => {}
            }
        }
        let seen = async {
            let mut work = db.work().await?;
            sqlx::query_scalar!("SELECT credpool_waiters_seen($1)", instance)
                .fetch_one(&mut *work)
                .await?;
            work.done().await
        };
        if let Err(error) = seen.await {
            tracing::warn!(error = %error, "waiting allocations: cannot say this process's waiting requests are alive");
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(WAITERS_SEEN_EVERY) => {}
        }
    }
}

/// The listener task: one connection, LISTEN on both channels, dispatch to the waits; on a lost
/// connection wake everybody (notifications may have been missed) and reconnect with backoff.
/// Ends when the waits are dropped.
async fn listen(
    waits: Weak<Waits>,
    target: ListenTarget,
    first_connect: watch::Sender<bool>,
    mut stop: watch::Receiver<()>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        // the listener, and the pool it came from (kept while it listens: on a multi-host
        // target, dropping it would stop the pool's search for the writable server)
        let connected = async {
            let own = match &target {
                ListenTarget::SameAs(db) => db.sibling(1),
                ListenTarget::Url(url) => {
                    let target = Target::parse(url)
                        .map_err(|error| sqlx::Error::Configuration(Box::new(error)))?;
                    let settings = PoolSettings {
                        max_connections: 1,
                        acquire_timeout: LISTEN_ACQUIRE_TIMEOUT,
                    };
                    Db::connect_lazy(&target, 0, &settings)
                }
                ListenTarget::None => return Err(sqlx::Error::PoolClosed),
            };
            let mut listener = PgListener::connect_with(own.pool()).await?;
            listener
                .listen_all([SLOT_FREED_CHANNEL, POOL_CHANGED_CHANNEL])
                .await?;
            Ok::<_, sqlx::Error>((listener, own))
        };
        let listener = tokio::select! {
            _ = stop.changed() => return,
            connected = connected => connected,
        };
        let (mut listener, _own) = match listener {
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
        crate::telemetry::waits_listening(true);
        tracing::info!("waiting allocations: listening for freed slots");
        // Anything freed before the LISTEN took effect was missed by the waiters queued so far:
        // wake them. Only then say the listener is up: a request that was waiting for that to
        // queue itself looks at the pool once queued, so it misses nothing and need not be woken
        // (waking it too would set it racing the earlier waiters for the next freed slot).
        if let Some(waits) = waits.upgrade() {
            waits.pool_changed(None);
        }
        first_connect.send_replace(true);
        loop {
            let received = tokio::select! {
                _ = stop.changed() => return,
                received = listener.try_recv() => received,
            };
            let Some(waits) = waits.upgrade() else { return };
            match received {
                Ok(Some(notification)) => {
                    match serde_json::from_str::<Announcement>(notification.payload()) {
                        // this process's own release: its waiter was woken at the release
                        Ok(Announcement {
                            from: Some(from), ..
                        }) if from == waits.instance => {}
                        Ok(Announcement {
                            provider,
                            pool,
                            key_id,
                            tenant: Some(tenant),
                            ..
                        }) => {
                            waits.wake_tenant(&provider, &pool, &tenant, key_id.as_ref());
                        }
                        Ok(Announcement {
                            provider,
                            pool,
                            key_id: Some(key_id),
                            ..
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
                    crate::telemetry::waits_listening(false);
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
    use crate::allocator::scoring::ScoringPolicy;
    use crate::domain::health::HealthPolicy;

    /// Waits with no listening connection and no views (every credential may serve any model).
    fn waits() -> Arc<Waits> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("a lazy pool");
        let views = CandidateViews::new(
            crate::store::Db::direct(pool),
            ScoringPolicy::default(),
            HealthPolicy::default(),
        );
        Waits::new(views, ListenTarget::None, None, Supervisor::new())
    }

    /// What `waiter` was woken with; panics unless it is woken within 10 seconds (a wake-up that
    /// never comes fails the test instead of hanging it).
    async fn woken(waiter: &Registration) -> Option<Hint> {
        tokio::time::timeout(Duration::from_secs(10), waiter.woken())
            .await
            .expect("the waiter was never woken")
    }

    /// Waits for `openai`'s `gpt-4o` in the default pool.
    struct Queues {
        waits: Arc<Waits>,
        provider: ProviderName,
        pool: PoolName,
        model: ModelName,
    }

    impl Queues {
        fn new() -> Self {
            Self {
                waits: waits(),
                provider: ProviderName::parse("openai").unwrap(),
                pool: PoolName::default_pool(),
                model: ModelName::parse("gpt-4o").unwrap(),
            }
        }

        /// A waiter in every pool of `pools`, behind those registered before it.
        async fn waiter_in(&self, pools: &[PoolName]) -> Registration {
            self.waits
                .register(&self.provider, pools, &self.model, None, Duration::ZERO)
                .await
        }

        /// A waiter in the default pool alone.
        async fn waiter(&self) -> Registration {
            self.waiter_in(std::slice::from_ref(&self.pool)).await
        }

        /// Frees a slot of credential `key_id` in the default pool; the hint a waiter gets.
        fn free(&self, key_id: &str) -> Option<Hint> {
            let key_id = KeyId::parse(key_id).unwrap();
            self.waits.slot_freed(&self.provider, &self.pool, &key_id);
            Some((self.pool.clone(), key_id))
        }
    }

    #[tokio::test]
    async fn freed_slots_go_one_each_to_the_longest_waiting_waiters() {
        let queues = Queues::new();
        let first = queues.waiter().await;
        let second = queues.waiter().await;
        let third = queues.waiter().await;
        let a = queues.free("a");
        let b = queues.free("b");
        assert_eq!(woken(&first).await, a);
        assert_eq!(woken(&second).await, b);
        assert_eq!(third.take_hint(), None, "two slots woke three waiters");
    }

    #[tokio::test]
    async fn a_slot_freed_right_after_a_wake_up_for_all_still_goes_to_the_first_waiter() {
        let queues = Queues::new();
        let first = queues.waiter().await;
        let second = queues.waiter().await;
        // the pool changed: everybody looks again; before either has, a slot is freed
        queues
            .waits
            .pool_changed(Some((&queues.provider, &queues.pool)));
        let a = queues.free("a");
        assert_eq!(woken(&first).await, a);
        assert_eq!(woken(&second).await, None);
    }

    #[tokio::test]
    async fn a_waiter_that_leaves_with_an_unused_wake_up_hands_it_to_the_next_waiter() {
        let queues = Queues::new();
        let leaving = queues.waiter().await;
        let next = queues.waiter().await;
        // the slot is freed while the first waiter's last claim is in flight; it then leaves
        let a = queues.free("a");
        drop(leaving);
        assert_eq!(woken(&next).await, a);

        // a waiter that took its wake-up and used it hands nothing on
        let third = queues.waiter().await;
        let b = queues.free("b");
        assert_eq!(woken(&next).await, b);
        drop(next);
        assert_eq!(third.take_hint(), None, "a used wake-up was handed on");
    }

    #[tokio::test]
    async fn stopping_the_waits_releases_current_and_later_waiters_at_once() {
        let waits = waits();
        let before = tokio::spawn({
            let waits = waits.clone();
            async move { waits.waiting_stopped().await }
        });
        tokio::task::yield_now().await;
        assert!(!before.is_finished(), "stopped before stop_waiting");
        waits.stop_waiting();
        tokio::time::timeout(Duration::from_secs(10), before)
            .await
            .expect("a waiter from before the stop still waits")
            .unwrap();
        // a waiter that comes later does not wait at all
        tokio::time::timeout(Duration::from_secs(10), waits.waiting_stopped())
            .await
            .expect("a waiter from after the stop waits");
    }

    #[tokio::test]
    async fn a_waiter_leaves_every_queue_when_dropped() {
        let queues = Queues::new();
        let gone = queues
            .waiter_in(&[PoolName::parse("vip").unwrap(), queues.pool.clone()])
            .await;
        let staying = queues.waiter().await;
        drop(gone);
        let a = queues.free("a");
        assert_eq!(woken(&staying).await, a);
        assert!(
            queues.waits.pools.lock().unwrap().len() == 1,
            "the vip queue was not removed"
        );
    }
}
