//! Candidate views: each service process keeps, per (provider, pool), the credentials of the pool
//! with their health and occupancy as last seen, so that ranking does not read the whole pool
//! from PostgreSQL on every allocation.
//!
//! A view is loaded on first use, reloaded when the claim statement reports a newer pool version
//! (any change to membership, models, limits, status or cooldowns bumps it, in the same
//! transaction as the change), updated locally by this process's own grants and releases, and
//! refreshed periodically as a safety net (occupancy and health figures changed by other
//! replicas). A stale view can only cost a retry: every grant is decided by the claim statement
//! against the database, a 404 or 409 is answered only after a read, and a 429 only from
//! occupancy read whole in the last second ([`PoolView::counted_at`]; the rule is the
//! allocator's `attempt` module's) or read during the request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use super::scoring::{self, ScoringPolicy};
use crate::domain::health::{Health, HealthPolicy, UsableFrom};
use crate::domain::{KeyId, ModelName, PoolName, ProviderName};
use crate::store::Db;
use crate::store::candidates::{self, CredentialFacts, PoolSnapshot};
use crate::store::leases::{GrantedLease, NotReleased};

/// One credential in a view, with the health part of its score precomputed.
#[derive(Debug, Clone)]
pub struct Entry {
    /// What the candidate read saw, adjusted by this process's own grants and releases.
    pub facts: CredentialFacts,
    /// The weighted health terms of its score ([`scoring::health_score`]), as of the last
    /// (re)load or report.
    pub health_score: f64,
    /// A claim found no free slot on it since the last load or release: treat it as full. Kept
    /// apart from `facts.in_flight` so that a grant noted after it (the grant that took the last
    /// slot, committed later) does not count twice and outlive its release.
    pub claimed_full: bool,
    /// The database clock of the read that brought `facts` (the whole read, or a later read of
    /// changes): a grant made no later than this may be counted in them already.
    pub as_of: OffsetDateTime,
}

/// `at` as Unix seconds.
pub fn unix_seconds(at: OffsetDateTime) -> f64 {
    at.unix_timestamp_nanos() as f64 / 1e9
}

/// What ranking reads of one entry, packed small and contiguous: ranking a pool of thousands
/// touches these rows only, not the entries (whose strings and maps would cost a cache miss each).
#[derive(Debug, Clone, Copy)]
pub struct RankRow {
    /// [`Entry::health_score`].
    pub health_score: f64,
    /// Unix seconds of the latest grant; NaN if never.
    pub last_used: f64,
    /// Unix seconds from which the credential is usable: -inf for `available`, the cooldown end
    /// for a cooling credential, +inf when it waits for an operator ([`Health::usable_from`]).
    pub usable_from: f64,
    /// Unix seconds of the earliest end among its leases; +inf if none.
    pub next_lease_end: f64,
    /// Unexpired leases as last seen.
    pub in_flight: i64,
    /// Its limit.
    pub limit: i32,
    /// 1 / limit.
    pub inv_limit: f64,
    /// Status is `available` (usable and not in the probe stage).
    pub available: bool,
    /// Slot 0 (the probe slot) is free.
    pub slot0_free: bool,
    /// More leases than its limit.
    pub over_limit: bool,
    /// It has rate windows (their state is in the entry's facts).
    pub windowed: bool,
}

impl RankRow {
    fn of(entry: &Entry) -> Self {
        let facts = &entry.facts;
        Self {
            health_score: entry.health_score,
            last_used: facts.last_used_at.map_or(f64::NAN, unix_seconds),
            // a drained credential waits for an operator, like a disabled one
            usable_from: match facts.health.usable_from() {
                _ if facts.draining => f64::INFINITY,
                UsableFrom::Always => f64::NEG_INFINITY,
                UsableFrom::At(at) => unix_seconds(at),
                UsableFrom::Never => f64::INFINITY,
            },
            next_lease_end: facts.next_lease_end.map_or(f64::INFINITY, unix_seconds),
            in_flight: if entry.claimed_full {
                facts.in_flight.max(i64::from(facts.max_concurrent_uses))
            } else {
                facts.in_flight
            },
            limit: facts.max_concurrent_uses,
            inv_limit: 1.0 / f64::from(facts.max_concurrent_uses.max(1)),
            available: facts.health.status == crate::domain::Status::Available,
            slot0_free: facts.slot0_free && !entry.claimed_full,
            over_limit: facts.slots_over_limit,
            windowed: !facts.windows.is_empty(),
        }
    }

    /// Usable at `now` (Unix seconds).
    pub fn usable(&self, now: f64) -> bool {
        now >= self.usable_from
    }

    /// Slots this view believes free at `now`: one (slot 0) at most while the credential is
    /// recovering; while it is over a lowered limit, none until the first lease within the limit
    /// ends (its row then reopens: `credpool_fit_slots`), one after.
    pub fn free_slots(&self, now: f64) -> i64 {
        if self.over_limit {
            i64::from(now >= self.next_lease_end)
        } else if !self.available && self.usable(now) {
            i64::from(self.slot0_free)
        } else {
            (i64::from(self.limit) - self.in_flight).max(0)
        }
    }
}

/// How old a view may be and still be brought up to date by reading only what changed since its
/// read: a pool's departures are kept ten minutes (`credentials_note_departure`), and the view
/// refresher reads every pool whole far more often than this.
pub const INCREMENTAL_MAX_AGE: Duration = Duration::from_secs(300);

/// The credentials of one (provider, pool) as last seen.
#[derive(Debug, Clone)]
pub struct PoolView {
    /// The pool version this view reflects.
    pub version: Option<i64>,
    /// Every credential of the pool.
    pub entries: Vec<Entry>,
    /// `rows[i]` is what ranking reads of `entries[i]`.
    pub rows: Vec<RankRow>,
    index: HashMap<KeyId, usize>,
    /// Request model name (a model or an alias) -> the entries that serve it, so that ranking
    /// compares no strings per candidate.
    by_model: HashMap<String, Vec<usize>>,
    db_now: OffsetDateTime,
    /// When the latest read of the pool (whole, or of its changes) was sent.
    loaded: Instant,
    /// When the latest whole read was sent: the occupancy of a credential no read of changes
    /// brought (they bring only credentials whose configuration or health moved) is as old as it.
    counted: Instant,
    xmin: i64,
}

impl PoolView {
    /// A view of `snapshot` (a read of the whole pool), with each credential's health score
    /// precomputed under `scoring` and `health`.
    pub fn from_snapshot(
        snapshot: PoolSnapshot,
        scoring: &ScoringPolicy,
        health: &HealthPolicy,
    ) -> Self {
        let mut view = Self {
            version: snapshot.version,
            entries: Vec::new(),
            rows: Vec::new(),
            index: HashMap::new(),
            by_model: HashMap::new(),
            db_now: snapshot.db_now,
            loaded: snapshot.read_at,
            counted: snapshot.read_at,
            xmin: snapshot.xmin,
        };
        view.entries = snapshot
            .credentials
            .into_iter()
            .map(|facts| view.entry(facts, scoring, health))
            .collect();
        view.reindex();
        view
    }

    /// Brings the view up to `changes` (a read of what changed in the pool since this view's
    /// xmin): the credentials that left are dropped, the changed ones replaced or added (health
    /// scored under `scoring` and `health`); the rest keep what the view knew of them, so
    /// [`PoolView::counted_at`] stays the whole read's. Cost:
    /// O(changes) for the changed entries, and an in-memory pass over the pool for its indexes.
    pub fn apply(&mut self, changes: PoolSnapshot, scoring: &ScoringPolicy, health: &HealthPolicy) {
        self.version = changes.version;
        self.db_now = changes.db_now;
        self.loaded = changes.read_at;
        self.xmin = changes.xmin;
        if !changes.departed.is_empty() {
            let departed: std::collections::HashSet<&KeyId> = changes.departed.iter().collect();
            self.entries.retain(|e| !departed.contains(&e.facts.key_id));
            self.reindex();
        }
        let mut added = false;
        for facts in changes.credentials {
            let entry = self.entry(facts, scoring, health);
            match self.index.get(&entry.facts.key_id) {
                Some(&i) => self.entries[i] = entry,
                None => {
                    self.entries.push(entry);
                    added = true;
                }
            }
        }
        if added {
            // in key order, as a whole read has them
            self.entries
                .sort_by(|a, b| a.facts.key_id.cmp(&b.facts.key_id));
        }
        self.reindex();
    }

    /// The read's snapshot xmin this view reflects (see [`PoolSnapshot::xmin`]).
    pub fn xmin(&self) -> i64 {
        self.xmin
    }

    fn entry(
        &self,
        facts: CredentialFacts,
        scoring: &ScoringPolicy,
        health: &HealthPolicy,
    ) -> Entry {
        Entry {
            health_score: health_score(&facts.health, self.db_now, scoring, health),
            facts,
            claimed_full: false,
            as_of: self.db_now,
        }
    }

    /// Rebuilds what is derived from `entries`: the key index, the entries by model (a model or an
    /// alias) and the rows ranking reads.
    fn reindex(&mut self) {
        self.index = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.facts.key_id.clone(), i))
            .collect();
        let mut by_model: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, entry) in self.entries.iter().enumerate() {
            let names = entry.facts.models.iter().chain(entry.facts.aliases.keys());
            for name in names {
                let served = by_model.entry(name.clone()).or_default();
                if served.last() != Some(&i) {
                    served.push(i);
                }
            }
        }
        self.by_model = by_model;
        self.rows = self.entries.iter().map(RankRow::of).collect();
    }

    /// When the whole read this view's occupancy comes from was sent (a read of changes since
    /// does not move it). A 429 is answered from the view only while this is recent
    /// (`allocator::attempt`).
    pub fn counted_at(&self) -> Instant {
        self.counted
    }

    /// An estimate of the database clock: its reading at load plus the time elapsed here since the
    /// read was sent (so never behind by the read's own duration, which under load would make
    /// `Retry-After` overshoot). Good enough for ranking; every decision that counts uses the
    /// database's own clock.
    pub fn now(&self) -> OffsetDateTime {
        self.db_now + self.loaded.elapsed()
    }

    /// Whether any of `key_ids` has rate windows, as this view knows it (a credential it does not
    /// know counts as windowed: the claim then looks for itself).
    pub fn any_windowed<'a>(&self, mut key_ids: impl Iterator<Item = &'a KeyId>) -> bool {
        key_ids.any(|k| self.index.get(k).is_none_or(|&i| self.rows[i].windowed))
    }

    /// The entries that serve `model` (directly or through an alias), in key order.
    pub fn serving(&self, model: &str) -> &[usize] {
        self.by_model.get(model).map_or(&[], Vec::as_slice)
    }

    /// Changes one entry and its rank row.
    fn change(&mut self, key_id: &KeyId, f: impl FnOnce(&mut Entry, OffsetDateTime)) {
        let now = self.now();
        if let Some(&i) = self.index.get(key_id) {
            f(&mut self.entries[i], now);
            self.rows[i] = RankRow::of(&self.entries[i]);
        }
    }
}

fn health_score(
    health: &Health,
    now: OffsetDateTime,
    scoring: &ScoringPolicy,
    decay: &HealthPolicy,
) -> f64 {
    scoring::health_score(&scoring::health_terms(health, now, scoring, decay), scoring)
}

#[derive(Debug, Default)]
struct PoolSlot {
    view: RwLock<Option<PoolView>>,
    reloading: tokio::sync::Mutex<()>,
    /// While a reload reads the pool: the credentials this process freed a slot of meanwhile.
    /// Locked only while holding `view`'s write lock.
    freed_while_reading: Mutex<Option<Vec<KeyId>>>,
    last_used: Mutex<Option<Instant>>,
}

/// Ends a reload's recording of releases, also when the reload fails or is cancelled.
struct ReadingReleases<'a>(&'a PoolSlot);

impl<'a> ReadingReleases<'a> {
    fn start(slot: &'a PoolSlot) -> Self {
        let _view = slot.view.write().unwrap_or_else(|p| p.into_inner());
        *slot
            .freed_while_reading
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
        Self(slot)
    }
}

impl Drop for ReadingReleases<'_> {
    fn drop(&mut self) {
        let _view = self.0.view.write().unwrap_or_else(|p| p.into_inner());
        *self
            .0
            .freed_while_reading
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }
}

type PoolKey = (ProviderName, PoolName);

/// The candidate views of one service process. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct CandidateViews {
    db: Db,
    scoring: ScoringPolicy,
    health: HealthPolicy,
    pools: Mutex<HashMap<PoolKey, Arc<PoolSlot>>>,
}

impl CandidateViews {
    /// Views over `db`, scoring with `scoring` and decaying health with `health`.
    pub fn new(db: Db, scoring: ScoringPolicy, health: HealthPolicy) -> Arc<Self> {
        Arc::new(Self {
            db,
            scoring,
            health,
            pools: Mutex::new(HashMap::new()),
        })
    }

    /// The scoring policy the views rank with.
    pub fn scoring(&self) -> &ScoringPolicy {
        &self.scoring
    }

    /// Reloads every view used within the last `forget_after` every `interval`, and forgets the
    /// others, as task `view_refresher` of `supervisor`. Stops when the views are dropped.
    pub fn spawn_refresher(
        self: &Arc<Self>,
        interval: Duration,
        forget_after: Duration,
        supervisor: &crate::background::Supervisor,
    ) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(self);
        supervisor.spawn("view_refresher", move || {
            let weak = weak.clone();
            async move {
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker.tick().await;
                loop {
                    ticker.tick().await;
                    let Some(views) = weak.upgrade() else { return };
                    for key in views.live_pools(forget_after) {
                        if let Err(error) = views.reload(&key.0, &key.1, None).await {
                            tracing::warn!(provider = %key.0, pool = %key.1, error = %error, "candidate view refresh failed");
                        }
                    }
                }
            }
        })
    }

    fn live_pools(&self, forget_after: Duration) -> Vec<PoolKey> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.retain(|_, slot| {
            let last = *slot.last_used.lock().unwrap_or_else(|p| p.into_inner());
            last.is_some_and(|t| t.elapsed() < forget_after)
        });
        pools.keys().cloned().collect()
    }

    fn slot(&self, provider: &ProviderName, pool: &PoolName) -> Arc<PoolSlot> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools
            .entry((provider.clone(), pool.clone()))
            .or_default()
            .clone()
    }

    fn existing(&self, provider: &ProviderName, pool: &PoolName) -> Option<Arc<PoolSlot>> {
        let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.get(&(provider.clone(), pool.clone())).cloned()
    }

    /// Runs `f` on the view of `provider`/`pool`, loading it first if this process has none.
    /// Returns `f`'s result and whether the view was loaded by this call.
    pub async fn with_view<R>(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        f: impl FnOnce(&PoolView) -> R,
    ) -> Result<(R, bool), sqlx::Error> {
        let slot = self.slot(provider, pool);
        *slot.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        let mut loaded = false;
        if slot
            .view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
        {
            // the first requests of a pool all get here: one of them reads it, the others use that
            // read (a pool of 10,000 credentials takes ~100 ms to read)
            self.load(provider, pool, false, |view| view.is_none())
                .await?;
            loaded = true;
        }
        let guard = slot.view.read().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(view) => Ok((f(view), loaded)),
            // only if the view was dropped between the load and now: treat as an empty pool read
            None => Err(sqlx::Error::PoolClosed),
        }
    }

    /// Brings the view up to the pool's version `at_least` (a version the caller saw), unless it
    /// already reflects it: a read of what changed since the view's read when there is a view
    /// younger than [`INCREMENTAL_MAX_AGE`], else of the whole pool (`at_least` `None`: always the
    /// whole pool). Concurrent reloads of one pool coalesce.
    pub async fn reload(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        at_least: Option<i64>,
    ) -> Result<(), sqlx::Error> {
        self.load(provider, pool, at_least.is_some(), |view| match at_least {
            Some(wanted) => view.and_then(|v| v.version).is_none_or(|v| v < wanted),
            None => true,
        })
        .await
    }

    /// Reads the whole pool again unless the view has been replaced by a whole read sent after
    /// `counted` (the [`PoolView::counted_at`] of the view the caller judged stale): callers that
    /// saw the same stale view share one read.
    pub async fn reload_unless_newer(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        counted: Instant,
    ) -> Result<(), sqlx::Error> {
        self.load(provider, pool, false, |view| {
            view.is_none_or(|v| v.counted <= counted)
        })
        .await
    }

    /// Reads the pool and replaces its view (or, `changes_only`, brings it up to what changed
    /// since its read, when it is younger than [`INCREMENTAL_MAX_AGE`]) if `needed` says so of the
    /// view as it is once this call's turn to read has come (reads of one pool run one at a time).
    async fn load(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        changes_only: bool,
        needed: impl FnOnce(Option<&PoolView>) -> bool,
    ) -> Result<(), sqlx::Error> {
        let slot = self.slot(provider, pool);
        let _one_at_a_time = slot.reloading.lock().await;
        let since = {
            let guard = slot.view.read().unwrap_or_else(|p| p.into_inner());
            if !needed(guard.as_ref()) {
                return Ok(());
            }
            guard
                .as_ref()
                .filter(|view| changes_only && view.loaded.elapsed() < INCREMENTAL_MAX_AGE)
                .map(PoolView::xmin)
        };
        let started = Instant::now();
        let reading = ReadingReleases::start(&slot);
        let mut work = self.db.work().await?;
        let snapshot = candidates::load_pool(&mut work, provider, pool, since).await?;
        work.done().await?;
        // a whole view is built before the lock is taken; changes are applied under it
        let read = match since {
            None => Ok(PoolView::from_snapshot(
                snapshot,
                &self.scoring,
                &self.health,
            )),
            Some(_) => Err(snapshot),
        };
        let mut guard = slot.view.write().unwrap_or_else(|p| p.into_inner());
        let view = match read {
            Ok(whole) => guard.insert(whole),
            Err(changes) => match guard.as_mut() {
                Some(view) => {
                    view.apply(changes, &self.scoring, &self.health);
                    view
                }
                // the view went while the changes were read: the next use reads the whole pool
                None => return Ok(()),
            },
        };
        // A release this process made while the read ran may have committed after the read's
        // snapshot: the new view would show its slot taken until the next reload, and enough
        // such slots answer 429 with credentials free. Apply them again. One the snapshot already
        // saw is then counted twice, which errs the safe way (a view that thinks a slot free costs
        // one claim; one that thinks it taken hides it).
        let freed = slot
            .freed_while_reading
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default();
        for key_id in &freed {
            view.change(key_id, |entry, _| {
                entry.facts.in_flight = (entry.facts.in_flight - 1).max(0);
                entry.claimed_full = false;
            });
        }
        drop(guard);
        drop(reading);
        tracing::debug!(provider = %provider, pool = %pool, incremental = since.is_some(),
            seconds = started.elapsed().as_secs_f64(), "candidate view reloaded");
        Ok(())
    }

    fn update(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        key_id: &KeyId,
        f: impl FnOnce(&mut Entry, OffsetDateTime),
    ) {
        if let Some(slot) = self.existing(provider, pool) {
            let mut guard = slot.view.write().unwrap_or_else(|p| p.into_inner());
            if let Some(view) = guard.as_mut() {
                view.change(key_id, f);
            }
        }
    }

    /// Whether this process's view of `provider`/`pool` holds a credential, as the last read of
    /// the pool found it; `false` without a view. Never reads the database: for metric labels,
    /// which name a pool only when it exists ([`crate::telemetry::allocation`]).
    pub fn has_credentials(&self, provider: &ProviderName, pool: &PoolName) -> bool {
        self.existing(provider, pool).is_some_and(|slot| {
            let guard = slot.view.read().unwrap_or_else(|p| p.into_inner());
            guard.as_ref().is_some_and(|view| !view.entries.is_empty())
        })
    }

    /// Whether `key_id` of `provider`/`pool` serves `model` (directly or through an alias), as
    /// far as this process's view knows; `None` when it has no view of the pool or the credential.
    /// Never reads the database.
    pub fn serves(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        key_id: &KeyId,
        model: &ModelName,
    ) -> Option<bool> {
        let slot = self.existing(provider, pool)?;
        let guard = slot.view.read().unwrap_or_else(|p| p.into_inner());
        let view = guard.as_ref()?;
        let &index = view.index.get(key_id)?;
        Some(view.serving(model.as_str()).contains(&index))
    }

    /// This process granted a lease on `key_id`, reserving `tokens` in its token windows.
    pub fn note_grant(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        lease: &GrantedLease,
        tokens: u64,
    ) {
        let Some(slot) = self.existing(provider, pool) else {
            return;
        };
        let mut guard = slot.view.write().unwrap_or_else(|p| p.into_inner());
        let Some(view) = guard.as_mut() else {
            return;
        };
        view.change(&lease.key_id, |entry, _| {
            // A read after the grant's statement began may count the grant already (a read that
            // ran between the commit and this note): counting it again would show the slot taken
            // after its release, until the next whole read. Skipped when in doubt, which errs the
            // safe way (a view that thinks a slot free costs one claim). Judged by the read that
            // brought this credential: a read of changes leaves the others as the whole read saw
            // them, and a grant on one of them since was not counted.
            if lease.granted_at <= entry.as_of {
                return;
            }
            let facts = &mut entry.facts;
            facts.in_flight += 1;
            facts.last_used_at = Some(lease.granted_at);
            facts.next_lease_end = Some(
                facts
                    .next_lease_end
                    .map_or(lease.lease_until, |t| t.min(lease.lease_until)),
            );
            if lease.probe {
                facts.slot0_free = false;
            }
            if !facts.windows.is_empty() {
                facts.windows.charge(lease.granted_at, tokens);
            }
        });
    }

    /// The claim statement found no free slot on these credentials: treat them as full until the
    /// next load.
    pub fn note_full(&self, provider: &ProviderName, pool: &PoolName, key_ids: &[KeyId]) {
        for key_id in key_ids {
            self.update(provider, pool, key_id, |entry, _| {
                entry.claimed_full = true;
            });
        }
    }

    /// This process made a release on `key_id`: `released` says whether it freed a slot; the
    /// outcome it applied moved the credential's health to `health`, and/or its usage replaced
    /// the reservation of a lease granted at `usage.0` (`usage.1` = usage - reservation).
    ///
    /// A release answered that its lease was already gone (`NotFound`, `Expired`) frees a slot in
    /// the view too: the view may still count that lease (its grant was noted here, and whatever
    /// ended it was not: an earlier attempt of the release whose answer was lost in an outage,
    /// another replica, an operator, its lease_until), and enough such leases would answer 429
    /// with slots free. When the view did not count it, this errs the safe way: a view that
    /// thinks a slot free costs one claim.
    pub fn note_release(
        &self,
        provider: &ProviderName,
        pool: &PoolName,
        key_id: &KeyId,
        released: Result<(), NotReleased>,
        health: Option<Health>,
        usage: Option<(OffsetDateTime, i64)>,
    ) {
        let Some(slot) = self.existing(provider, pool) else {
            return;
        };
        let freed = matches!(
            released,
            Ok(()) | Err(NotReleased::NotFound | NotReleased::Expired)
        );
        let (scoring, decay) = (&self.scoring, &self.health);
        let mut guard = slot.view.write().unwrap_or_else(|p| p.into_inner());
        if let Some(view) = guard.as_mut() {
            view.change(key_id, |entry, now| {
                if freed {
                    entry.facts.in_flight = (entry.facts.in_flight - 1).max(0);
                    entry.claimed_full = false;
                }
                if let Some(health) = health {
                    entry.health_score = health_score(&health, now, scoring, decay);
                    entry.facts.health = health;
                }
                if let Some((granted_at, delta)) = usage {
                    entry.facts.windows.adjust(granted_at, delta);
                }
            });
        }
        if freed
            && let Some(freed_while_reading) = slot
                .freed_while_reading
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_mut()
        {
            freed_while_reading.push(key_id.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::LeaseId;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    /// Views holding one limit-1 credential `a`, free, in openai/default (never read from a
    /// database: the pool is lazy and unused).
    fn views_with_one_credential() -> (Arc<CandidateViews>, ProviderName, PoolName, KeyId) {
        let db = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let views =
            CandidateViews::new(db.into(), ScoringPolicy::default(), HealthPolicy::default());
        let (provider, pool) = (
            ProviderName::parse("openai").unwrap(),
            PoolName::default_pool(),
        );
        let snapshot = snapshot(&[("a", "gpt-4o", 1)], &[], 1);
        let view = PoolView::from_snapshot(snapshot, &views.scoring, &views.health);
        *views.slot(&provider, &pool).view.write().unwrap() = Some(view);
        (views, provider, pool, KeyId::parse("a").unwrap())
    }

    /// A read of version and xmin `version` sent now: idle credentials as (key_id, the one model
    /// it serves, limit), and those that left.
    fn snapshot(
        credentials: &[(&str, &str, i32)],
        departed: &[&str],
        version: i64,
    ) -> PoolSnapshot {
        PoolSnapshot {
            version: Some(version),
            db_now: now(),
            read_at: Instant::now(),
            xmin: version,
            credentials: credentials
                .iter()
                .map(|&(key_id, model, limit)| CredentialFacts::idle(key_id, &[model], limit))
                .collect(),
            departed: departed.iter().map(|&k| KeyId::parse(k).unwrap()).collect(),
        }
    }

    /// A 600-second lease granted now on `key_id` of `pool`.
    fn granted_lease(key_id: &KeyId, pool: &PoolName) -> GrantedLease {
        GrantedLease {
            key_id: key_id.clone(),
            lease_id: LeaseId::generate(),
            granted_at: now(),
            lease_until: now() + time::Duration::seconds(600),
            probe: false,
            provider_model: "gpt-4o".into(),
            sealed_secret: vec![],
            pruned_expired: false,
            pool: pool.clone(),
            fence: 1,
            tenant: "default".into(),
            affinity: None,
        }
    }

    fn free_slots(views: &CandidateViews, provider: &ProviderName, pool: &PoolName) -> i64 {
        let slot = views.existing(provider, pool).unwrap();
        let guard = slot.view.read().unwrap();
        let view = guard.as_ref().unwrap();
        view.rows[0].free_slots(unix_seconds(view.now()))
    }

    #[tokio::test]
    async fn a_slot_seen_taken_before_its_grant_is_noted_is_free_again_after_the_release() {
        let (views, provider, pool, key_id) = views_with_one_credential();
        assert_eq!(free_slots(&views, &provider, &pool), 1);
        // another request's claim found the slot locked by a grant not yet committed...
        views.note_full(&provider, &pool, std::slice::from_ref(&key_id));
        assert_eq!(free_slots(&views, &provider, &pool), 0);
        // ...then that grant committed and was noted...
        let lease = granted_lease(&key_id, &pool);
        views.note_grant(&provider, &pool, &lease, 0);
        assert_eq!(free_slots(&views, &provider, &pool), 0);
        // ...and released: the credential is free, not counted busy until the next reload
        views.note_release(&provider, &pool, &key_id, Ok(()), None, None);
        assert_eq!(free_slots(&views, &provider, &pool), 1);
    }

    #[tokio::test]
    async fn a_release_of_a_lease_already_gone_frees_its_slot_in_the_view() {
        let (views, provider, pool, key_id) = views_with_one_credential();
        // (granted after the view's read: counted)
        let lease = GrantedLease {
            granted_at: now() + time::Duration::seconds(1),
            ..granted_lease(&key_id, &pool)
        };
        // a release that did not match its lease says nothing of it; one that found it gone
        // (released by an earlier attempt whose answer was lost, or run out) frees its slot
        for gone in [NotReleased::NotFound, NotReleased::Expired] {
            views.note_grant(&provider, &pool, &lease, 0);
            assert_eq!(free_slots(&views, &provider, &pool), 0);
            views.note_release(
                &provider,
                &pool,
                &key_id,
                Err(NotReleased::Mismatch),
                None,
                None,
            );
            assert_eq!(free_slots(&views, &provider, &pool), 0);
            views.note_release(&provider, &pool, &key_id, Err(gone), None, None);
            assert_eq!(free_slots(&views, &provider, &pool), 1, "{gone:?}");
        }
    }

    #[tokio::test]
    async fn a_read_of_changes_leaves_the_occupancy_as_old_as_the_whole_read() {
        let (views, provider, pool, _) = views_with_one_credential();
        let slot = views.existing(&provider, &pool).unwrap();
        let mut guard = slot.view.write().unwrap();
        let view = guard.as_mut().unwrap();
        let counted = view.counted_at();
        view.apply(snapshot(&[], &[], 2), &views.scoring, &views.health);
        assert_eq!(view.version, Some(2));
        assert_eq!(view.counted_at(), counted);
    }

    #[tokio::test]
    async fn a_grant_after_the_whole_read_is_counted_on_a_credential_a_read_of_changes_left_alone()
    {
        let (views, provider, pool, a) = views_with_one_credential();
        let b = KeyId::parse("b").unwrap();
        {
            let slot = views.existing(&provider, &pool).unwrap();
            let mut guard = slot.view.write().unwrap();
            let view = guard.as_mut().unwrap();
            // a read of changes two seconds after the whole read brings b only
            let changes = PoolSnapshot {
                db_now: now() + time::Duration::seconds(2),
                ..snapshot(&[("b", "gpt-4o", 1)], &[], 2)
            };
            view.apply(changes, &views.scoring, &views.health);
        }
        let in_flight = |key_id: &KeyId| {
            let slot = views.existing(&provider, &pool).unwrap();
            let guard = slot.view.read().unwrap();
            let view = guard.as_ref().unwrap();
            view.entries[view.index[key_id]].facts.in_flight
        };
        // granted a second after the whole read, before the read of changes
        let granted_at = now() + time::Duration::seconds(1);
        for key_id in [&a, &b] {
            let lease = GrantedLease {
                granted_at,
                ..granted_lease(key_id, &pool)
            };
            views.note_grant(&provider, &pool, &lease, 0);
        }
        // a was read before the grant: not counted there, so counted now
        assert_eq!(in_flight(&a), 1);
        // b was read after it: that read may count it already, so it is not counted again
        assert_eq!(in_flight(&b), 0);
    }

    #[test]
    fn changes_bring_a_view_to_what_a_whole_read_would_show() {
        let (scoring, health) = (ScoringPolicy::default(), HealthPolicy::default());
        let from_snapshot = |snapshot| PoolView::from_snapshot(snapshot, &scoring, &health);
        let mut view = from_snapshot(snapshot(
            &[("a", "gpt-4o", 1), ("b", "gpt-4o", 1), ("c", "o1", 1)],
            &[],
            1,
        ));
        // b now serves o1 with limit 3, c left the pool, d joined it, a is as it was
        view.apply(
            snapshot(&[("d", "gpt-4o", 2), ("b", "o1", 3)], &["c"], 2),
            &scoring,
            &health,
        );
        let whole = from_snapshot(snapshot(
            &[("a", "gpt-4o", 1), ("b", "o1", 3), ("d", "gpt-4o", 2)],
            &[],
            2,
        ));
        let keys = |v: &PoolView, model: &str| -> Vec<(String, i32)> {
            v.serving(model)
                .iter()
                .map(|&i| {
                    let f = &v.entries[i].facts;
                    (f.key_id.to_string(), f.max_concurrent_uses)
                })
                .collect()
        };
        for model in ["gpt-4o", "o1"] {
            assert_eq!(keys(&view, model), keys(&whole, model), "{model}");
        }
        assert_eq!(view.version, Some(2));
        assert_eq!(view.xmin(), 2);
        assert!(
            view.any_windowed([KeyId::parse("c").unwrap()].iter()),
            "c is gone"
        );
        // a credential that left and came back in the same changes is there
        view.apply(snapshot(&[("c", "o1", 1)], &["c"], 3), &scoring, &health);
        assert_eq!(keys(&view, "o1"), [("b".into(), 3), ("c".into(), 1)]);
    }
}
