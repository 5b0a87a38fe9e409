//! Group claiming: group commit for leases.
//!
//! Every state change is one PostgreSQL transaction, and a durable commit costs a WAL flush: with
//! one transaction per request, the flushes, not Rust or HTTP, cap the requests per second
//! (issue 7 measured about 1,000 claim-and-release cycles/s on two cores). So claims, releases
//! and renewals that arrive while a transaction of their kind is in flight are queued, and the
//! next free group worker runs all of them, each with its own statement and its own result, in
//! ONE transaction with ONE commit. No request is answered before its group has committed, so a
//! lease is never reported that a crash could take back, and if the group's transaction fails
//! every request of it gets the error (503): nothing is half-written.
//!
//! A lone request waits for nothing: an idle worker takes it at once (groups form only from
//! requests that arrive while the workers are busy, unless [`GroupSettings::max_wait`] asks for
//! more), and a group of one runs as it would ungrouped.
//!
//! # Why grouped claims cannot oversell
//! Each claim is the same statement as ungrouped (in `credpool_claim`), and its argument
//! does not depend on transaction boundaries: a lease exists only inside the slot row that holds
//! it, and the claim takes that row's lock, which stays held until the group commits. A later
//! claim of the same group sees the earlier claims' writes (same transaction), so it never takes
//! a slot the group already filled; a claim in another transaction skips the locked row (SKIP
//! LOCKED) or, if it meets the row after the commit, re-checks it and finds it taken. Expiry is
//! judged on `statement_timestamp()`, not on the group's start time.
//!
//! # Why grouped operations cannot deadlock
//! A deadlock needs a cycle of transactions each waiting for a lock another holds.
//! - A claim never waits for a row lock: it takes its slot row with SKIP LOCKED and writes nothing
//!   else that is locked (the credential row is only read; inserts into the trail tables have no
//!   foreign keys and fresh random lease ids). A claim group therefore never waits, so it is in
//!   no cycle, whatever the order of its claims.
//! - A release group ([`leases::release_group_in`]) locks its leases' slot rows first, in
//!   ascending key_id order (one statement; the few leases it must diagnose afterwards, in
//!   ascending key_id order too), then the credential rows of the outcomes, in ascending key_id
//!   order (one statement). A renewal group locks one slot row per renewal, in ascending key_id
//!   order. A group admits at most one such operation per credential (`Operation::waits_on`; a
//!   second one waits for the next group), so each group takes its locks in one global order —
//!   slot rows by key_id, then credential rows by key_id — and transactions that take their locks
//!   in one global order cannot form a cycle among themselves.
//! - Single-credential transactions outside the groups (operator changes, refits) can still meet
//!   a group in the other order on one credential (credential row, then its slots); PostgreSQL
//!   detects such a deadlock and aborts one side, as it did before grouping.
//!
//! If PostgreSQL nevertheless aborts a group (a deadlock it detected, a timeout, a lost
//! connection), the whole group is rolled back and every request in it is answered 503.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::PgConnection;
use time::OffsetDateTime;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::domain::{Holder, KeyId, LeaseId, LeaseSeconds, ModelName, PoolName, ProviderName};
use crate::health::HealthPolicy;
use crate::store::leases::{
    self, ClaimRequest, ClaimResult, LeaseRef, ReleaseRequest, ReleaseResult, RequestKey,
    StagedRelease,
};
use crate::store::{Conn, Db};

/// How operations are grouped into transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSettings {
    /// Most operations in one transaction; 1 turns grouping off.
    pub max_size: usize,
    /// How long a group waits for more operations once it has its first; zero: it takes what is
    /// queued and leaves at once.
    pub max_wait: Duration,
    /// Group transactions of one kind (claims, releases, renewals) in flight at once, per
    /// process; each holds one database connection while it runs.
    pub transactions: usize,
}

impl Default for GroupSettings {
    /// Up to 64 operations per transaction, no waiting, 4 transactions of each kind at once.
    fn default() -> Self {
        Self {
            max_size: 64,
            max_wait: Duration::ZERO,
            transactions: 4,
        }
    }
}

/// The group queues of one service process: claims, releases and renewals. Cheap to clone; the
/// workers stop when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Groups {
    claims: Queue<Claim>,
    releases: Queue<Release>,
    renewals: Queue<Renewal>,
}

impl Groups {
    /// Starts the group workers over `db`. Must run in a Tokio runtime.
    pub fn start(db: Db, settings: GroupSettings) -> Self {
        Self {
            claims: Queue::start(&db, settings),
            releases: Queue::start(&db, settings),
            renewals: Queue::start(&db, settings),
        }
    }

    /// Runs the claim statement ([`leases::claim_slot`]) in the next claim group. If the caller
    /// is gone before its group runs, nothing is claimed; if it is gone when its group has
    /// committed, the lease it got is released at once rather than stranded until lease_until.
    pub async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimResult, sqlx::Error> {
        self.claims
            .run(Claim {
                ranked: request.ranked.to_vec(),
                provider: request.provider.clone(),
                pool: request.pool.clone(),
                model: request.model.clone(),
                lease_id: request.lease_id,
                holder: request.holder.cloned(),
                lease_seconds: request.lease_seconds,
                request: request.request.cloned(),
            })
            .await
    }

    /// Releases a lease ([`leases::release`]) in the next release group.
    pub async fn release(
        &self,
        request: ReleaseRequest,
        policy: &HealthPolicy,
    ) -> Result<ReleaseResult, sqlx::Error> {
        self.releases
            .run(Release {
                request,
                policy: policy.clone(),
            })
            .await
    }

    /// Renews a lease ([`leases::renew`]) in the next renewal group: the new lease_until, or
    /// `None` when the lease is lost.
    pub async fn renew(
        &self,
        lease: LeaseRef,
        lease_seconds: LeaseSeconds,
    ) -> Result<Option<OffsetDateTime>, sqlx::Error> {
        self.renewals
            .run(Renewal {
                lease,
                lease_seconds,
            })
            .await
    }
}

/// One kind of operation that can share a transaction with others of its kind.
trait Operation: Send + Sync + Sized + 'static {
    /// What the operation left for after the commit.
    type Staged: Send;
    /// What the caller gets.
    type Output: Send + 'static;
    /// The `kind` label of the group-size metric.
    const KIND: &'static str;

    /// Whether [`Operation::stage_group`] writes a group of `operations` in one statement, so that
    /// it needs no explicit transaction (a group of one then costs one round trip, as ungrouped).
    fn one_statement(operations: usize) -> bool;

    /// The credential whose rows this operation may wait for, if any: a group holds at most one
    /// operation per such credential and runs them in ascending key_id order.
    fn waits_on(&self) -> Option<&KeyId>;

    /// Does the work of a whole group, in order, inside its transaction (or, when
    /// [`Operation::one_statement`], as one statement); one result per operation.
    fn stage_group<'a>(
        group: Vec<&'a Self>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<Vec<Self::Staged>, sqlx::Error>>;

    /// After the commit: whatever follows it, and the caller's result.
    fn finish<'a>(
        &'a self,
        staged: Self::Staged,
        conn: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, Self::Output>;

    /// The caller left before it could be answered: undo what it would have had to undo.
    fn abandoned<'a>(
        &'a self,
        _output: Self::Output,
        _conn: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
}

struct Claim {
    ranked: Vec<KeyId>,
    provider: ProviderName,
    pool: PoolName,
    model: ModelName,
    lease_id: LeaseId,
    holder: Option<Holder>,
    lease_seconds: LeaseSeconds,
    request: Option<RequestKey>,
}

impl Claim {
    fn request(&self) -> ClaimRequest<'_> {
        ClaimRequest {
            ranked: &self.ranked,
            provider: &self.provider,
            pool: &self.pool,
            model: &self.model,
            lease_id: self.lease_id,
            holder: self.holder.as_ref(),
            lease_seconds: self.lease_seconds,
            request: self.request.as_ref(),
        }
    }
}

impl Operation for Claim {
    type Staged = ClaimResult;
    type Output = ClaimResult;
    const KIND: &'static str = "claim";

    fn one_statement(_: usize) -> bool {
        true
    }

    fn waits_on(&self) -> Option<&KeyId> {
        None
    }

    /// The whole group's claims in one statement (`credpool_claim` runs them in order).
    fn stage_group<'a>(
        group: Vec<&'a Self>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<Vec<ClaimResult>, sqlx::Error>> {
        Box::pin(async move {
            let requests: Vec<ClaimRequest<'_>> = group.iter().map(|c| c.request()).collect();
            leases::claim_slots(tx, &requests).await
        })
    }

    fn finish<'a>(
        &'a self,
        staged: ClaimResult,
        _: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, ClaimResult> {
        Box::pin(async move { staged })
    }

    fn abandoned<'a>(
        &'a self,
        output: ClaimResult,
        conn: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Some(granted) = output.granted else {
                return;
            };
            let release = ReleaseRequest {
                lease: LeaseRef {
                    key_id: granted.key_id,
                    provider: self.provider.clone(),
                    pool: granted.pool,
                    lease_id: granted.lease_id,
                    fence: Some(granted.fence),
                },
                outcome: None,
                retry_after_seconds: None,
            };
            match leases::release_on(conn, &release, &HealthPolicy::default()).await {
                Ok(_) => {
                    tracing::info!(lease_id = %release.lease.lease_id, "lease of a departed caller given back")
                }
                Err(error) => tracing::warn!(lease_id = %release.lease.lease_id, error = %error,
                    "could not give back the lease of a departed caller; it frees at lease_until"),
            }
        })
    }
}

struct Release {
    request: ReleaseRequest,
    policy: HealthPolicy,
}

impl Operation for Release {
    type Staged = StagedRelease;
    type Output = ReleaseResult;
    const KIND: &'static str = "release";

    fn one_statement(_: usize) -> bool {
        false
    }

    fn waits_on(&self) -> Option<&KeyId> {
        Some(&self.request.lease.key_id)
    }

    /// The whole group in a fixed number of statements ([`leases::release_group_in`]).
    fn stage_group<'a>(
        group: Vec<&'a Self>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<Vec<StagedRelease>, sqlx::Error>> {
        Box::pin(async move {
            let requests: Vec<&ReleaseRequest> = group.iter().map(|r| &r.request).collect();
            // one policy per process: every release of a group carries the same
            let Some(first) = group.first() else {
                return Ok(Vec::new());
            };
            leases::release_group_in(tx, &requests, &first.policy).await
        })
    }

    fn finish<'a>(
        &'a self,
        staged: StagedRelease,
        conn: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, ReleaseResult> {
        Box::pin(staged.committed(conn))
    }
}

struct Renewal {
    lease: LeaseRef,
    lease_seconds: LeaseSeconds,
}

impl Operation for Renewal {
    type Staged = Option<OffsetDateTime>;
    type Output = Option<OffsetDateTime>;
    const KIND: &'static str = "renewal";

    /// A lone renewal writes with one UPDATE (its retries re-run it; its diagnosis only reads).
    fn one_statement(operations: usize) -> bool {
        operations == 1
    }

    fn waits_on(&self) -> Option<&KeyId> {
        Some(&self.lease.key_id)
    }

    /// Each renewal in turn.
    fn stage_group<'a>(
        group: Vec<&'a Self>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<Vec<Option<OffsetDateTime>>, sqlx::Error>> {
        Box::pin(async move {
            let mut renewed = Vec::with_capacity(group.len());
            for renewal in group {
                renewed.push(leases::renew(&mut *tx, &renewal.lease, renewal.lease_seconds).await?);
            }
            Ok(renewed)
        })
    }

    fn finish<'a>(
        &'a self,
        staged: Option<OffsetDateTime>,
        _: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, Option<OffsetDateTime>> {
        Box::pin(async move { staged })
    }
}

/// An operation waiting for its group, and where its answer goes.
struct Pending<O: Operation> {
    operation: O,
    reply: oneshot::Sender<Result<O::Output, sqlx::Error>>,
}

/// The queue of one kind of operation; its workers share the receiving end.
struct Queue<O: Operation> {
    sender: mpsc::UnboundedSender<Pending<O>>,
}

impl<O: Operation> Clone for Queue<O> {
    fn clone(&self) -> Self {
        Self {
            sender: self.sender.clone(),
        }
    }
}

impl<O: Operation> std::fmt::Debug for Queue<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").field("kind", &O::KIND).finish()
    }
}

impl<O: Operation> Queue<O> {
    fn start(db: &Db, settings: GroupSettings) -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..settings.transactions.max(1) {
            tokio::spawn(work(db.clone(), receiver.clone(), settings));
        }
        Self { sender }
    }

    async fn run(&self, operation: O) -> Result<O::Output, sqlx::Error> {
        let (reply, answer) = oneshot::channel();
        self.sender
            .send(Pending { operation, reply })
            .map_err(|_| sqlx::Error::PoolClosed)?;
        answer.await.map_err(|_| sqlx::Error::PoolClosed)?
    }
}

/// One group worker: takes the operations queued (the first one waited for), runs them as one
/// transaction, answers each, and starts over; stops when every sender is gone.
async fn work<O: Operation>(
    db: Db,
    receiver: Arc<Mutex<mpsc::UnboundedReceiver<Pending<O>>>>,
    settings: GroupSettings,
) {
    // operations that met another on the same credential wait for this worker's next group
    let mut carried: Vec<Pending<O>> = Vec::new();
    loop {
        let mut forming = Forming::new(settings.max_size);
        for pending in std::mem::take(&mut carried) {
            forming.admit(pending, &mut carried);
        }
        // with carried operations in hand, never wait for the queue: another worker may be
        // holding it while it waits for the next operation
        let receiver = if forming.group.is_empty() {
            Some(receiver.lock().await)
        } else {
            receiver.try_lock().ok()
        };
        if let Some(mut receiver) = receiver {
            if forming.group.is_empty() {
                match receiver.recv().await {
                    Some(pending) => forming.admit(pending, &mut carried),
                    None => return,
                }
            }
            let deadline = tokio::time::Instant::now() + settings.max_wait;
            while !forming.full() {
                let pending = match receiver.try_recv() {
                    Ok(pending) => pending,
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                    Err(mpsc::error::TryRecvError::Empty) if settings.max_wait.is_zero() => break,
                    Err(mpsc::error::TryRecvError::Empty) => {
                        match tokio::time::timeout_at(deadline, receiver.recv()).await {
                            Ok(Some(pending)) => pending,
                            _ => break,
                        }
                    }
                };
                forming.admit(pending, &mut carried);
            }
        }
        run_group(&db, forming.group).await;
    }
}

/// A group being formed.
struct Forming<O: Operation> {
    group: Vec<Pending<O>>,
    credentials: HashSet<KeyId>,
    max_size: usize,
}

impl<O: Operation> Forming<O> {
    fn new(max_size: usize) -> Self {
        Self {
            group: Vec::new(),
            credentials: HashSet::new(),
            max_size: max_size.max(1),
        }
    }

    fn full(&self) -> bool {
        self.group.len() >= self.max_size
    }

    /// Takes `pending` into the group, or into `carried` when the group is full or already has
    /// an operation on the same credential.
    fn admit(&mut self, pending: Pending<O>, carried: &mut Vec<Pending<O>>) {
        let fits = !self.full()
            && pending
                .operation
                .waits_on()
                .is_none_or(|key_id| self.credentials.insert(key_id.clone()));
        if fits {
            self.group.push(pending);
        } else {
            carried.push(pending);
        }
    }
}

/// Runs one group: every operation's statements in one transaction (in ascending key_id order,
/// see the module comment), one commit, then each operation's follow-up and answer. A group of
/// one runs the same way. Without BEGIN and COMMIT when the writes are one statement (a group of
/// claims always, a single renewal), except behind a transaction pooler. Every answer is sent
/// after the commit.
async fn run_group<O: Operation>(db: &Db, mut group: Vec<Pending<O>>) {
    // a caller that is gone (timed out, disconnected) gets nothing done: a claim takes no slot
    group.retain(|pending| !pending.reply.is_closed());
    if group.is_empty() {
        return;
    }
    group.sort_by(|a, b| a.operation.waits_on().cmp(&b.operation.waits_on()));
    crate::telemetry::group(O::KIND, group.len());
    let started = std::time::Instant::now();

    let mut conn = match db.acquire().await {
        Ok(conn) => conn,
        Err(error) => return fail(group, &error),
    };
    // and one that gave up while the connection was awaited (a database coming back from an
    // outage) gets nothing done either
    group.retain(|pending| !pending.reply.is_closed());
    if group.is_empty() {
        return;
    }
    let operations: Vec<&O> = group.iter().map(|pending| &pending.operation).collect();
    let staged = async {
        if O::one_statement(operations.len()) {
            // direct: the statement alone, which commits itself; behind a transaction pooler:
            // inside BEGIN and COMMIT, like every statement there
            let mut work = conn.work().await?;
            let staged = O::stage_group(operations, &mut work).await?;
            work.done().await?;
            Ok(staged)
        } else {
            let mut tx = conn.begin().await?;
            let staged = O::stage_group(operations, &mut tx).await?;
            tx.commit().await?;
            Ok(staged)
        }
    }
    .await;
    let staged = match staged {
        Ok(staged) => staged,
        Err(error) => return fail(group, &error),
    };
    tracing::debug!(
        kind = O::KIND,
        operations = group.len(),
        elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
        "group committed"
    );
    for (Pending { operation, reply }, staged) in group.into_iter().zip(staged) {
        let output = operation.finish(staged, &mut conn).await;
        if let Err(Ok(output)) = reply.send(Ok(output)) {
            operation.abandoned(output, &mut conn).await;
        }
    }
}

/// Answers every operation of a failed group with the group's error.
fn fail<O: Operation>(group: Vec<Pending<O>>, error: &sqlx::Error) {
    tracing::warn!(kind = O::KIND, operations = group.len(), error = %error, "group transaction failed");
    for pending in group {
        let _ = pending.reply.send(Err(copy_error(error)));
    }
}

/// An error to hand to each caller of a failed group (`sqlx::Error` is not `Clone`): the same
/// kind where the kind matters to the caller, else the message. Every one of them answers 503.
fn copy_error(error: &sqlx::Error) -> sqlx::Error {
    match error {
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        sqlx::Error::PoolClosed => sqlx::Error::PoolClosed,
        other => sqlx::Error::Io(std::io::Error::other(format!(
            "the group transaction failed: {other}"
        ))),
    }
}
