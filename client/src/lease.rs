//! A lease from the executor's side: [`Client::lease`] takes a [`LeaseRequest`] and gives a
//! [`LeaseGuard`], which renews the lease in the background until it ends with an [`Outcome`].

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::api::{
    AffinityResult, Credential, DEFAULT_LEASE_SECONDS, LeaseRequest, LeaseState, Outcome, Released,
};
use crate::client::Client;
use crate::error::Error;
use crate::wire::Granted;

/// Renewals never come closer together than this, whatever the lease length and renew fraction.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(200);

/// The renewal gives up this long before the lease's local end: a tenth of the lease length, at
/// most 2 s, so that work is told to stop while the lease still holds.
const MAX_RENEW_MARGIN: Duration = Duration::from_secs(2);

impl Client {
    /// Leases a credential (`POST /api/internal/allocate-key`) and returns a guard that renews
    /// it in the background until [`LeaseGuard::finish`] (or drop) releases it.
    ///
    /// One random `request_id` (UUID v4) is made per call and sent with every attempt, so a
    /// retry after a lost answer gets the same lease back instead of taking a second slot.
    /// - A 503 or a transport error is retried under the [`RetryPolicy`](crate::RetryPolicy).
    /// - A 429 without [`LeaseRequest::wait`] returns [`Error::PoolExhausted`] at once. With a
    ///   wait, each request sends `wait_ms` = the time left of the wait (the server holds it
    ///   until a slot frees, up to its own cap), and a 429 is asked again while time is left. A
    ///   429 that came back at once (the server did not hold it) is asked again after a backoff
    ///   pause of at most `Retry-After`. When the wait is used up: [`Error::PoolExhausted`].
    /// - Every other error returns at once, as its [`Error`] variant.
    ///
    /// # Errors
    /// Any [`Error`]; [`Error::InvalidConfig`] when called outside a tokio runtime (the guard
    /// needs one to renew).
    #[tracing::instrument(skip_all, fields(provider = %request.provider, model = %request.model))]
    pub async fn lease(&self, request: LeaseRequest) -> Result<LeaseGuard, Error> {
        let runtime = Handle::try_current().map_err(|_| Error::InvalidConfig {
            message: "lease() must run inside a tokio runtime".into(),
        })?;
        let (granted, run_started) = self.allocate(&request).await?;
        Ok(LeaseGuard::start(
            self.clone(),
            granted,
            &request,
            run_started,
            runtime,
        ))
    }
}

/// A leased credential. Renews itself in the background while held.
///
/// - **Renewal**: a tokio task renews every [`LeaseGuard::lease_seconds`] `* renew_fraction`
///   (default a third of the lease; never more often than every 200 ms), sending the fence and
///   the requested `lease_seconds`, if any. A 410 (or any error the client does not retry)
///   loses the lease at once; a 503 or transport error is retried with backoff until the lease
///   would end by the local monotonic clock (its length from the send time of the last
///   successful renewal, less a tenth of the lease, at most 2 s), and loses it then.
/// - **Lost**: [`LeaseGuard::lost`] completes, [`LeaseGuard::lost_token`] is cancelled and
///   [`LeaseGuard::is_lost`] turns true. Stop using the credential at once: another executor
///   may hold its slot.
/// - **End**: [`LeaseGuard::finish`] releases with an outcome. Dropping the guard without it
///   releases with outcome `failure` in the background, on the tokio runtime the guard was made
///   on; if that runtime is gone, nothing is sent and the lease ends at `lease_until`.
///   [`LeaseGuard::abandon`] sends nothing.
///
/// `Debug` shows ids, fence and lease end, never the credential.
pub struct LeaseGuard {
    client: Client,
    lease: Arc<LeaseState>,
    credential: Credential,
    /// Cancelled by the renewal task when the lease is lost; users get child tokens, so they
    /// cannot fire it for each other.
    lost: CancellationToken,
    /// Cancelled when the guard is finished, abandoned or dropped: stops the renewal task.
    stop: CancellationToken,
    runtime: Handle,
    /// Set once a release was made (or deliberately skipped), so drop sends none.
    settled: bool,
}

impl LeaseGuard {
    /// Wraps a fresh grant and starts its renewal task on `runtime`. `started` is no later than
    /// the server's grant: the renewal clock counts from it.
    pub(crate) fn start(
        client: Client,
        granted: Granted,
        request: &LeaseRequest,
        started: Instant,
        runtime: Handle,
    ) -> LeaseGuard {
        // The server's word first: it may have granted its default, or less than 35 s.
        let lease_seconds = granted
            .lease_seconds
            .or(request.lease_seconds)
            .unwrap_or(DEFAULT_LEASE_SECONDS)
            .max(1);
        let lease = Arc::new(LeaseState {
            provider: granted.provider,
            pool: granted.pool,
            key_id: granted.key_id,
            lease_id: granted.lease_id,
            fence: granted.fence,
            provider_model: granted.provider_model,
            probe: granted.probe,
            affinity: granted.affinity.as_deref().map(AffinityResult::from_wire),
            requested_seconds: request.lease_seconds,
            lease_seconds,
            lease_until: Mutex::new(granted.lease_until),
        });
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let length = Duration::from_secs(u64::from(lease_seconds));
        runtime.spawn(keep_renewed(
            client.clone(),
            lease.clone(),
            length,
            started,
            stop.clone(),
            lost.clone(),
        ));
        LeaseGuard {
            client,
            lease,
            credential: Credential(granted.credential),
            lost,
            stop,
            runtime,
            settled: false,
        }
    }

    /// The credential's id.
    pub fn key_id(&self) -> &str {
        &self.lease.key_id
    }

    /// The lease's id (32 hex digits).
    pub fn lease_id(&self) -> &str {
        &self.lease.lease_id
    }

    /// The lease's fencing token, a positive integer issued by the server with the lease and
    /// sent back with every renewal and the release. Pass it to anything downstream that must
    /// refuse a stale holder (a later lease carries a larger fence).
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The provider.
    pub fn provider(&self) -> &str {
        &self.lease.provider
    }

    /// The pool that served (`default` after a `vip` fallback).
    pub fn pool(&self) -> &str {
        &self.lease.pool
    }

    /// The model name as this credential serves it (an alias resolved).
    pub fn provider_model(&self) -> &str {
        &self.lease.provider_model
    }

    /// True for the single probe lease of a credential back from a cooldown: report its outcome
    /// faithfully, it decides whether the credential returns to service.
    pub fn probe(&self) -> bool {
        self.lease.probe
    }

    /// With an [`LeaseRequest::affinity_key`]: whether the conversation's bound credential
    /// served this lease. `None` without one, and when the client's retry of the allocate was
    /// answered with the lease its first attempt got (the server does not repeat it).
    pub fn affinity(&self) -> Option<&AffinityResult> {
        self.lease.affinity.as_ref()
    }

    /// When the lease ends unless renewed (server clock): the latest known value, updated by
    /// each successful renewal.
    pub fn lease_until(&self) -> OffsetDateTime {
        self.lease.lease_until()
    }

    /// The lease's length in seconds, which each renewal extends it by: as the allocate answer
    /// says (`lease_seconds`), else as requested ([`LeaseRequest::lease_seconds`]) from a server
    /// that does not say, else [`DEFAULT_LEASE_SECONDS`]. Renewals come every
    /// `lease_seconds * renew_fraction`, and renewal failures lose the lease by the local end
    /// this length gives.
    pub fn lease_seconds(&self) -> u32 {
        self.lease.lease_seconds
    }

    /// The credential material.
    pub fn credential(&self) -> &Credential {
        &self.credential
    }

    /// Completes when the lease is lost (see the type's docs); pending forever while it holds.
    pub fn lost(&self) -> impl Future<Output = ()> + Send + '_ {
        self.lost.cancelled()
    }

    /// A token cancelled when the lease is lost, for `tokio::select!` or to hand to other
    /// tasks. Cancelling it yourself affects only that token.
    pub fn lost_token(&self) -> CancellationToken {
        self.lost.child_token()
    }

    /// True once the lease is lost.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Stops renewing and releases the lease with `outcome` (and its `retry_after`, for
    /// [`Outcome::RateLimited`] and [`Outcome::QuotaExhausted`]) and the fence, retrying 503s
    /// and transport errors under the retry policy. A lease that was already lost is still
    /// reported; the server then answers `released: false`.
    ///
    /// If this future is dropped before it completes, the guard's drop releases with `failure`.
    ///
    /// # Errors
    /// Any [`Error`] of the release call, after retries.
    #[tracing::instrument(skip_all, fields(key_id = %self.lease.key_id, outcome = ?outcome))]
    pub async fn finish(self, outcome: Outcome) -> Result<Released, Error> {
        self.release(outcome, None).await
    }

    /// [`LeaseGuard::finish`], reporting the tokens the call really used: they replace the
    /// lease's [`LeaseRequest::tokens`] reservation in the credential's token windows.
    ///
    /// # Errors
    /// Any [`Error`] of the release call, after retries.
    pub async fn finish_with_usage(
        self,
        outcome: Outcome,
        usage_tokens: u64,
    ) -> Result<Released, Error> {
        self.release(outcome, Some(usage_tokens)).await
    }

    async fn release(
        mut self,
        outcome: Outcome,
        usage_tokens: Option<u64>,
    ) -> Result<Released, Error> {
        self.stop.cancel();
        let released = self
            .client
            .release(&self.lease, outcome, usage_tokens)
            .await;
        self.settle();
        released
    }

    /// Stops renewing and does NOT release: the lease runs out at `lease_until` and its slot
    /// stays taken until then. Meant for demos and tests that act out a crashed executor; real
    /// executors call [`LeaseGuard::finish`].
    pub fn abandon(mut self) {
        self.stop.cancel();
        self.settle();
    }

    /// Marks the guard as released (or deliberately not), so its drop sends nothing.
    fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.stop.cancel();
        if self.settled {
            return;
        }
        let client = self.client.clone();
        let lease = self.lease.clone();
        tracing::debug!(key_id = %lease.key_id, "lease guard dropped without finish: releasing with outcome failure");
        // A runtime that has shut down drops the task unrun; nothing panics.
        drop(self.runtime.spawn(async move {
            match client.release(&lease, Outcome::Failure, None).await {
                Ok(released) => {
                    tracing::debug!(key_id = %lease.key_id, ?released, "released on drop");
                }
                Err(error) => {
                    tracing::warn!(key_id = %lease.key_id, %error, "release on drop failed; the lease ends at lease_until");
                }
            }
        }));
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("key_id", &self.lease.key_id)
            .field("lease_id", &self.lease.lease_id)
            .field("fence", &self.lease.fence)
            .field("provider", &self.lease.provider)
            .field("pool", &self.lease.pool)
            .field("provider_model", &self.lease.provider_model)
            .field("probe", &self.lease.probe)
            .field("lease_until", &self.lease.lease_until())
            .field("lease_seconds", &self.lease.lease_seconds)
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

/// The renewal task: renews `lease` every `length * renew_fraction` counted from the send time of
/// the last successful renewal (`renewed_at`, first the allocation's start), until `stop` is
/// cancelled or the lease is lost (then it cancels `lost`).
async fn keep_renewed(
    client: Client,
    lease: Arc<LeaseState>,
    length: Duration,
    mut renewed_at: Instant,
    stop: CancellationToken,
    lost: CancellationToken,
) {
    let interval = length
        .mul_f64(client.renew_fraction())
        .max(MIN_RENEW_INTERVAL);
    let margin = (length / 10).min(MAX_RENEW_MARGIN);
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(renewed_at + interval) => {}
        }
        let ends = renewed_at + length - margin;
        let renewed = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            renewed = client.renew(&lease, ends) => renewed,
        };
        match renewed {
            Ok((lease_until, sent_at)) => {
                lease.set_lease_until(lease_until);
                renewed_at = sent_at;
            }
            Err(error) => {
                tracing::warn!(key_id = %lease.key_id, lease_id = %lease.lease_id, %error, "lease lost: stop using the credential");
                lost.cancel();
                return;
            }
        }
    }
}
