//! Group claiming: group commit for leases.
//!
//! Every state change is one PostgreSQL transaction, and a durable commit costs a WAL flush: with
//! one transaction per request, the flushes, not Rust or HTTP, cap the requests per second
//! (one cycle per transaction measured about 1,000 claim-and-release cycles/s on two cores). So claims, releases
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
//! A deadlock needs a cycle of transactions each waiting for a lock another holds. Every kind of
//! group is one call of its SQL function (`sql/`), and those follow one lock order
//! (docs/design.md, "Lock order"):
//! - A claim group never waits for a lock: each claim takes its slot row (and, for a capped
//!   tenant, a tenant slot row; for a credential with rate windows, its lease_windows row) with
//!   SKIP LOCKED, request ids' and affinity keys' advisory locks with a try-lock, and writes
//!   nothing else that another transaction holds (the credential row is only read; trail rows
//!   are fresh inserts; affinity bindings only where their rows were locked with SKIP LOCKED or
//!   do not exist, and the key share lock a new binding's foreign key takes on the credential
//!   row conflicts only with transactions that hold every slot row of that credential first,
//!   which cannot run while this claim holds one). A claim group is therefore in no cycle,
//!   whatever the order of its claims.
//! - A release group (with an `auth_expired` report: after the operator locks and every slot,
//!   tenant slot and lease_windows row of the credentials it names) locks its leases' slot rows
//!   in ascending (provider, key_id, slot) order in one statement, then their tenant slot rows
//!   in ascending (tenant_id, slot) order, then the lease_windows rows of the usage it reports
//!   in ascending (provider, key_id) order, then trail rows guarded by unique indexes in lease_id
//!   order, then the credential rows of the outcomes in ascending (provider, key_id) order. A renewal
//!   group locks its leases' slot rows, then their tenant slot rows, each kind sorted in one
//!   statement. Every other transaction (operator changes, refits, tenant fits, the cleanup
//!   pass) takes its locks in the same order (operator locks, a tenant's advisory lock, slot
//!   rows, tenant slot rows, lease_windows rows, credential rows, OAuth rows: docs/design.md,
//!   "Lock order"), each kind sorted; pool versions are per backend and never waited for. Transactions that take their
//!   locks in one global order cannot form a cycle.
//!
//! If PostgreSQL nevertheless aborts a group (a timeout, a lost connection), the whole group is
//! rolled back and every request in it is answered 503.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::PgConnection;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::waiting::Waits;
use crate::background::Supervisor;
use crate::domain::health::HealthPolicy;
use crate::domain::{LeaseSeconds, TenantKeyHash};
use crate::store::leases::{
    self, Claim, ClaimAnswer, ClaimOutcome, LeaseRef, ReleaseRequest, ReleaseResult, Renewed,
    StagedRelease,
};
use crate::store::{Conn, Db};

/// How operations are grouped into transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSettings {
    /// Most operations in one transaction; 1 turns grouping off.
    pub max_size: usize,
    /// How long a group waits for more operations once it has its first, while another group of
    /// its kind is in flight (a lone operation never waits); zero: it takes what is queued and
    /// leaves at once.
    pub max_wait: Duration,
    /// Group transactions of one kind (claims, releases, renewals) in flight at once, per
    /// process; each holds one database connection while it runs.
    pub transactions: usize,
}

impl Default for GroupSettings {
    /// Up to 64 operations per transaction, a wait of 300 µs for company while another group of
    /// the kind runs, 4 transactions of each kind at once.
    ///
    /// The wait: under load each commit waits for its WAL flush anyway, and a group that leaves
    /// with the one or two operations queued at that instant makes more, smaller commits than the
    /// flushes can keep up with; gathering for 300 µs made a 64-executor benchmark a third
    /// faster (docs/src/performance.md). Without other groups in flight there is no queue to wait
    /// for, so a lone request is not delayed.
    fn default() -> Self {
        Self {
            max_size: 64,
            max_wait: Duration::from_micros(300),
            transactions: 4,
        }
    }
}

/// The group queues of one service process: claims, releases and renewals. Cheap to clone; the
/// workers stop when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Groups {
    claims: Queue<Arc<Claim>>,
    releases: Queue<Release>,
    renewals: Queue<Renewal>,
}

impl Groups {
    /// Starts the group workers over `db`, under `supervisor` (a worker that panics is made
    /// again; the operations of its group were answered with an error). Must run in a Tokio
    /// runtime.
    pub fn start(db: Db, settings: GroupSettings, supervisor: &Supervisor) -> Self {
        Self {
            claims: Queue::start(&db, settings, supervisor),
            releases: Queue::start(&db, settings, supervisor),
            renewals: Queue::start(&db, settings, supervisor),
        }
    }

    /// Runs `claim` ([`leases::claim_slots`]) in the next claim group. If the caller is gone
    /// before its group runs, nothing is claimed; if it is gone when its group has committed, or
    /// leaves before it has read the answer, the lease it got is released at once rather than
    /// stranded until lease_until (and a waiting request's row is deleted).
    /// (Shared, not copied: a caller that claims again after `in_flight` or `busy` sends the
    /// same claim.)
    pub async fn claim(&self, claim: Arc<Claim>) -> Result<ClaimAnswer, sqlx::Error> {
        self.claims.run(claim).await
    }

    /// Releases a lease ([`leases::release`]) in the next release group. Once the group has
    /// committed, a freed slot is announced to `waits` (this process's waiters, and through it
    /// every other process's), whether or not the caller is still there to hear the answer.
    pub async fn release(
        &self,
        request: ReleaseRequest,
        policy: &HealthPolicy,
        waits: &Arc<Waits>,
    ) -> Result<ReleaseResult, sqlx::Error> {
        self.releases
            .run(Release {
                request,
                policy: policy.clone(),
                waits: waits.clone(),
            })
            .await
    }

    /// Renews a lease ([`leases::renew_group`]) in the next renewal group, for the executor that
    /// presented tenant key `caller` (`None`: the internal key).
    pub async fn renew(
        &self,
        lease: LeaseRef,
        lease_seconds: LeaseSeconds,
        caller: Option<TenantKeyHash>,
    ) -> Result<Renewed, sqlx::Error> {
        self.renewals
            .run(Renewal {
                lease,
                lease_seconds,
                caller,
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
    /// The name its workers run under in the [`Supervisor`] (a metric label).
    const TASK: &'static str;

    /// Does the work of a whole group, in order, in ONE statement (one call of the kind's SQL
    /// function), which needs no explicit transaction: a group of one costs one round trip, as
    /// ungrouped. One result per operation.
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

    /// The caller left without reading its answer `output`: what undoes what it would have had to
    /// undo, run on a connection of `db`'s; `None` when nothing is to be undone.
    fn abandoned(self, _output: Self::Output, _db: Db) -> Option<BoxFuture<'static, ()>> {
        None
    }
}

impl Operation for Arc<Claim> {
    type Staged = ClaimAnswer;
    type Output = ClaimAnswer;
    const KIND: &'static str = "claim";
    const TASK: &'static str = "claim_group";

    /// The whole group's claims in one statement (`credpool_claim` runs them in order).
    fn stage_group<'a>(
        group: Vec<&'a Self>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<Vec<ClaimAnswer>, sqlx::Error>> {
        Box::pin(async move {
            let claims: Vec<&Claim> = group.iter().map(|claim| &***claim).collect();
            leases::claim_slots(tx, &claims).await
        })
    }

    fn finish<'a>(
        &'a self,
        staged: ClaimAnswer,
        _: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, ClaimAnswer> {
        Box::pin(async move { staged })
    }

    fn abandoned(self, output: ClaimAnswer, db: Db) -> Option<BoxFuture<'static, ()>> {
        let (ClaimOutcome::Granted(granted) | ClaimOutcome::Replayed(granted)) = output.outcome
        else {
            // A waiting request's claim that granted nothing recorded the request as waiting (or
            // left its row there); its caller is gone, and its own goodbye may have run before
            // this claim committed: without this, the row would outlive the caller until the end
            // of its wait, and other tenants would yield to nobody.
            let (waiter, provider) = (self.waiting.as_ref()?.waiter, self.provider.clone());
            return Some(Box::pin(async move {
                let forgotten = async {
                    let mut work = db.work().await?;
                    leases::forget_waiter(&mut *work, waiter, &provider).await?;
                    work.done().await
                };
                if let Err(error) = forgotten.await {
                    tracing::debug!(error = %error, "cannot delete a departed waiter's row");
                }
            }));
        };
        if self.request.is_some() {
            // A retry of the same request_id may be waiting for this very lease (its first
            // attempt timed out on the client's side): given back, the retry would be answered
            // with a lease the server had already ended while the first attempt's caller may
            // still use the credential upstream. It stays the request's until lease_until.
            tracing::info!(lease_id = %granted.lease_id,
                "lease of a departed caller kept for a retry of its request_id");
            return None;
        }
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
            usage_tokens: None,
            // the claim's own key: a lease is released only by a key of its tenant
            caller: self.caller,
            may_disable: true,
        };
        Some(Box::pin(async move {
            let released = async {
                let mut conn = db.acquire().await?;
                leases::release_on(&mut conn, &release, &HealthPolicy::default()).await
            };
            match released.await {
                Ok(_) => {
                    tracing::info!(lease_id = %release.lease.lease_id, "lease of a departed caller given back")
                }
                Err(error) => tracing::warn!(lease_id = %release.lease.lease_id, error = %error,
                    "could not give back the lease of a departed caller; it frees at lease_until"),
            }
        }))
    }
}

struct Release {
    request: ReleaseRequest,
    policy: HealthPolicy,
    /// Told of the slot once the release has committed.
    waits: Arc<Waits>,
}

impl Operation for Release {
    type Staged = StagedRelease;
    type Output = ReleaseResult;
    const KIND: &'static str = "release";
    const TASK: &'static str = "release_group";

    /// The whole group in one statement ([`leases::release_group`]).
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
            // the freed slots are announced by `finish`, after the commit: a NOTIFY in this
            // transaction would make release groups commit one at a time
            leases::release_group(tx, &requests, &first.policy).await
        })
    }

    fn finish<'a>(
        &'a self,
        staged: StagedRelease,
        conn: &'a mut Conn<'static>,
    ) -> BoxFuture<'a, ReleaseResult> {
        if staged.result().released.is_ok() {
            let lease = &self.request.lease;
            self.waits.released_here(
                &lease.provider,
                &lease.pool,
                &lease.key_id,
                staged.result().waiters,
            );
        }
        Box::pin(staged.committed(conn))
    }
}

struct Renewal {
    lease: LeaseRef,
    lease_seconds: LeaseSeconds,
    caller: Option<TenantKeyHash>,
}

impl Operation for Renewal {
    type Staged = Renewed;
    type Output = Renewed;
    const KIND: &'static str = "renewal";
    const TASK: &'static str = "renewal_group";

    /// The whole group in one statement ([`leases::renew_group`]).
    fn stage_group<'a>(
        group: Vec<&'a Self>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<Vec<Renewed>, sqlx::Error>> {
        Box::pin(async move {
            let renewals: Vec<_> = group
                .iter()
                .map(|r| (&r.lease, r.lease_seconds, r.caller))
                .collect();
            leases::renew_group(tx, &renewals).await
        })
    }

    fn finish<'a>(&'a self, staged: Renewed, _: &'a mut Conn<'static>) -> BoxFuture<'a, Renewed> {
        Box::pin(async move { staged })
    }
}

/// An operation waiting for its group, and where its answer goes.
struct Pending<O: Operation> {
    operation: O,
    reply: oneshot::Sender<Result<Answer<O>, sqlx::Error>>,
}

/// An operation's answer on its way to its caller. Dropped unread, it is undone
/// ([`Operation::abandoned`], in a task of its own): the caller left after its group had
/// committed, whether before the answer was sent or after, while it waited in the channel (the
/// group cannot tell the second from a caller that read it).
struct Answer<O: Operation> {
    output: Option<O::Output>,
    operation: Option<O>,
    db: Db,
}

impl<O: Operation> Answer<O> {
    /// The answer, read by its caller: nothing to undo.
    fn read(mut self) -> O::Output {
        self.output
            .take()
            .expect("an answer is made with its output")
    }
}

impl<O: Operation> Drop for Answer<O> {
    fn drop(&mut self) {
        let (Some(output), Some(operation)) = (self.output.take(), self.operation.take()) else {
            return;
        };
        if let Some(undo) = operation.abandoned(output, self.db.clone())
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(undo);
        }
    }
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
    fn start(db: &Db, settings: GroupSettings, supervisor: &Supervisor) -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        let running = Arc::new(AtomicUsize::new(0));
        for _ in 0..settings.transactions.max(1) {
            let (db, receiver, running) = (db.clone(), receiver.clone(), running.clone());
            supervisor.spawn(O::TASK, move || {
                work(db.clone(), receiver.clone(), running.clone(), settings)
            });
        }
        Self { sender }
    }

    async fn run(&self, operation: O) -> Result<O::Output, sqlx::Error> {
        let (reply, answer) = oneshot::channel();
        self.sender
            .send(Pending { operation, reply })
            .map_err(|_| sqlx::Error::PoolClosed)?;
        Ok(answer.await.map_err(|_| sqlx::Error::PoolClosed)??.read())
    }
}

/// One group worker: takes the operations queued (the first one waited for; then, while another
/// worker of the kind is running a group, more for up to `max_wait`), runs them as one
/// transaction, answers each, and starts over; stops when every sender is gone. `running`
/// counts the kind's workers running a group.
async fn work<O: Operation>(
    db: Db,
    receiver: Arc<Mutex<mpsc::UnboundedReceiver<Pending<O>>>>,
    running: Arc<AtomicUsize>,
    settings: GroupSettings,
) {
    let max_size = settings.max_size.max(1);
    loop {
        let mut group = Vec::new();
        {
            let mut receiver = receiver.lock().await;
            match receiver.recv().await {
                Some(pending) => group.push(pending),
                None => return,
            }
            // company is worth waiting for only when there is load: alone, go at once
            let wait = if running.load(Ordering::Relaxed) > 0 {
                settings.max_wait
            } else {
                Duration::ZERO
            };
            let deadline = tokio::time::Instant::now() + wait;
            while group.len() < max_size {
                let pending = match receiver.try_recv() {
                    Ok(pending) => pending,
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                    Err(mpsc::error::TryRecvError::Empty) if wait.is_zero() => break,
                    Err(mpsc::error::TryRecvError::Empty) => {
                        match tokio::time::timeout_at(deadline, receiver.recv()).await {
                            Ok(Some(pending)) => pending,
                            _ => break,
                        }
                    }
                };
                group.push(pending);
            }
        }
        running.fetch_add(1, Ordering::Relaxed);
        // counted down also if the group panics (its worker is then made again)
        let _running = Running(&running);
        run_group(&db, group).await;
    }
}

/// One group in flight, counted in its kind's `running` until dropped.
struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs one group: every operation's work in one statement (one transaction, one commit), then
/// each operation's follow-up and answer. A group of one runs the same way. Without BEGIN and
/// COMMIT, except behind a transaction pooler. Every answer is sent after the commit.
async fn run_group<O: Operation>(db: &Db, mut group: Vec<Pending<O>>) {
    // a caller that is gone (timed out, disconnected) gets nothing done: a claim takes no slot
    group.retain(|pending| !pending.reply.is_closed());
    if group.is_empty() {
        return;
    }
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
        // direct: the statement alone, which commits itself; behind a transaction pooler:
        // inside BEGIN and COMMIT, like every statement there
        let mut work = conn.work().await?;
        let staged = O::stage_group(operations, &mut work).await?;
        work.done().await?;
        Ok::<_, sqlx::Error>(staged)
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
        // (not sent, or never read: undone by its drop)
        let _ = reply.send(Ok(Answer {
            output: Some(output),
            operation: Some(operation),
            db: db.clone(),
        }));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An operation whose undo notes its output: asked for at once (`asked`), done in its task
    /// (`undone`).
    struct Noted {
        asked: Arc<std::sync::Mutex<Vec<u32>>>,
        undone: Arc<std::sync::Mutex<Vec<u32>>>,
    }

    impl Operation for Noted {
        type Staged = u32;
        type Output = u32;
        const KIND: &'static str = "noted";
        const TASK: &'static str = "noted_group";

        fn stage_group<'a>(
            group: Vec<&'a Self>,
            _: &'a mut PgConnection,
        ) -> BoxFuture<'a, Result<Vec<u32>, sqlx::Error>> {
            Box::pin(async move { Ok(vec![0; group.len()]) })
        }

        fn finish<'a>(&'a self, staged: u32, _: &'a mut Conn<'static>) -> BoxFuture<'a, u32> {
            Box::pin(async move { staged })
        }

        fn abandoned(self, output: u32, _: Db) -> Option<BoxFuture<'static, ()>> {
            self.asked.lock().unwrap().push(output);
            Some(Box::pin(
                async move { self.undone.lock().unwrap().push(output) },
            ))
        }
    }

    /// A channel as a group answers on, an answer `output` of a [`Noted`], and the undos it
    /// asked for and did.
    #[allow(clippy::type_complexity)]
    fn answering(
        output: u32,
    ) -> (
        oneshot::Sender<Result<Answer<Noted>, sqlx::Error>>,
        oneshot::Receiver<Result<Answer<Noted>, sqlx::Error>>,
        Answer<Noted>,
        Noted,
    ) {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("a lazy pool");
        let noted = Noted {
            asked: Arc::default(),
            undone: Arc::default(),
        };
        let answer = Answer {
            output: Some(output),
            operation: Some(Noted {
                asked: noted.asked.clone(),
                undone: noted.undone.clone(),
            }),
            db: Db::direct(pool),
        };
        let (reply, receiver) = oneshot::channel();
        (reply, receiver, answer, noted)
    }

    /// What was undone once the spawned undo had its turn (at most 10 seconds).
    async fn undone_after(undone: &std::sync::Mutex<Vec<u32>>, expected: usize) -> Vec<u32> {
        for _ in 0..1_000 {
            if undone.lock().unwrap().len() >= expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        undone.lock().unwrap().clone()
    }

    #[tokio::test]
    async fn an_answer_its_caller_reads_is_not_undone() {
        let (reply, receiver, answer, noted) = answering(7);
        assert!(reply.send(Ok(answer)).is_ok());
        assert_eq!(receiver.await.unwrap().unwrap().read(), 7);
        // (the read answer is dropped inside `read`: an undo would have been asked for by now)
        assert_eq!(*noted.asked.lock().unwrap(), Vec::<u32>::new());
    }

    #[tokio::test]
    async fn an_answer_sent_but_never_read_is_undone() {
        // the caller left after the send and before it read: the answer dies in the channel
        let (reply, receiver, answer, noted) = answering(7);
        assert!(reply.send(Ok(answer)).is_ok(), "the caller was still there");
        drop(receiver);
        assert_eq!(undone_after(&noted.undone, 1).await, [7]);
    }

    #[tokio::test]
    async fn an_answer_whose_caller_left_before_it_was_sent_is_undone() {
        let (reply, receiver, answer, noted) = answering(7);
        drop(receiver);
        assert!(reply.send(Ok(answer)).is_err(), "the caller was gone");
        assert_eq!(undone_after(&noted.undone, 1).await, [7]);
    }
}
