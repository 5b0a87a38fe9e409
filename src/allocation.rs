//! Allocation: the pool sequence, the candidate read, the ranking and the one-statement claim,
//! and the classification of an allocation that found nothing (DESIGN.md "Error semantics").

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::domain::{
    Holder, KeyId, LeaseId, LeaseSeconds, ModelName, PoolName, ProviderName, Secret,
};
use crate::ranking::{self, Candidate};
use crate::store::leases::{self, Candidates, ClaimRequest};

/// An executor's request for a lease.
#[derive(Debug, Clone)]
pub struct AllocateRequest {
    /// The provider wanted.
    pub provider: ProviderName,
    /// The model wanted.
    pub model: ModelName,
    /// The pool asked for; the pool sequence may serve it from another (`vip` -> `default`).
    pub pool: PoolName,
    /// How long the lease lasts unless renewed.
    pub lease_seconds: LeaseSeconds,
    /// The executor's name for itself.
    pub holder: Option<Holder>,
}

/// A granted lease, as the executor receives it.
#[derive(Debug, Clone)]
pub struct Allocation {
    /// The credential leased.
    pub key_id: KeyId,
    /// The lease, to renew and release with.
    pub lease_id: LeaseId,
    /// The provider.
    pub provider: ProviderName,
    /// The pool that served (differs from the pool asked for after a `vip` -> `default` fallback).
    pub pool: PoolName,
    /// The model name as the credential serves it.
    pub provider_model: ModelName,
    /// When the lease stops counting unless renewed (database clock).
    pub lease_until: OffsetDateTime,
    /// The credential material (redacted in `Debug`).
    pub credential: Secret,
}

/// Why an allocation granted nothing. Each variant is one row of DESIGN.md's error table.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// 404: the provider/pool (and every pool of its sequence) has no credentials at all.
    #[error("no credentials for this provider and pool")]
    PoolNotFound,
    /// 409: the pool has credentials but none serves the model.
    #[error("no credential in this pool serves the model")]
    ModelNotSupported,
    /// 409: credentials serve the model but every one is disabled, exhausted or pending.
    #[error("every credential that serves the model is disabled, exhausted or pending")]
    NoUsableCredentials,
    /// 429: candidates exist but none is free now; one may free in `retry_after_seconds`
    /// (whole seconds, at least 1: the earliest lease end or cooldown end among the candidates).
    #[error("every candidate credential is busy or cooling down")]
    PoolExhausted {
        /// Seconds until the earliest lease or cooldown among the candidates ends (>= 1).
        retry_after_seconds: u64,
    },
    /// 503: PostgreSQL failed or could not be reached in time.
    #[error("store unavailable")]
    Store(#[from] sqlx::Error),
}

/// What one pool of the sequence can offer, judged from its candidate read. Pure.
#[derive(Debug)]
enum PoolVerdict {
    NotFound,
    ModelNotSupported,
    NoUsableCredentials,
    /// Try the claim over `candidates` (may be empty: everything is busy or cooling).
    Try {
        candidates: Vec<Candidate>,
        /// Over-limit credentials that look back under their limit: fit their slots first.
        refit: Vec<KeyId>,
        /// The earliest moment a lease or cooldown among the candidates ends.
        frees_at: Option<OffsetDateTime>,
    },
}

impl PoolVerdict {
    /// How a failed verdict ranks when the pool sequence has several: the most actionable answer
    /// wins (busy beats unusable beats model-less beats absent).
    fn precedence(&self) -> u8 {
        match self {
            PoolVerdict::Try { .. } => 3,
            PoolVerdict::NoUsableCredentials => 2,
            PoolVerdict::ModelNotSupported => 1,
            PoolVerdict::NotFound => 0,
        }
    }
}

fn judge(read: &Candidates) -> PoolVerdict {
    if read.rows.is_empty() {
        return PoolVerdict::NotFound;
    }
    let serving: Vec<_> = read.rows.iter().filter(|r| r.serves_model).collect();
    if serving.is_empty() {
        return PoolVerdict::ModelNotSupported;
    }
    let mut candidates = Vec::new();
    let mut refit = Vec::new();
    let mut frees_at: Option<OffsetDateTime> = None;
    let mut earliest = |t: Option<OffsetDateTime>| {
        if let Some(t) = t {
            frees_at = Some(frees_at.map_or(t, |f| f.min(t)));
        }
    };
    for row in serving {
        if row.usable {
            earliest(row.next_lease_end);
            let free_slots = i64::from(row.max_concurrent_uses) - row.in_flight;
            if row.slots_over_limit {
                if free_slots <= 0 {
                    continue;
                }
                refit.push(row.key_id.clone());
            }
            candidates.push(Candidate {
                key_id: row.key_id.clone(),
                last_used_at: row.last_used_at,
                free_slots: free_slots.max(0),
            });
        } else if row.recovers_at.is_some() {
            earliest(row.recovers_at);
        }
    }
    if candidates.is_empty() && frees_at.is_none() {
        return PoolVerdict::NoUsableCredentials;
    }
    PoolVerdict::Try {
        candidates,
        refit,
        frees_at,
    }
}

/// Whole seconds from `now` until `at` of `soonest = (at, now)`, rounded up, at least 1 (the
/// `Retry-After` rule); 1 when nothing is known to end (a claim lost a race for a free slot).
fn retry_after_seconds(soonest: Option<(OffsetDateTime, OffsetDateTime)>) -> u64 {
    match soonest {
        Some((at, now)) => {
            let seconds = (at - now).as_seconds_f64().ceil();
            if seconds.is_finite() && seconds >= 1.0 {
                seconds as u64
            } else {
                1
            }
        }
        _ => 1,
    }
}

/// Grants leases. Cheap to clone; holds the connection pool and the ranking settings.
#[derive(Debug, Clone)]
pub struct Allocator {
    db: PgPool,
    jitter_seconds: f64,
}

impl Allocator {
    /// `jitter_seconds`: amplitude of the uniform noise added to idle time when ranking.
    pub fn new(db: PgPool, jitter_seconds: f64) -> Self {
        Self { db, jitter_seconds }
    }

    /// Tries each pool of the request's pool sequence in turn: reads its candidates, ranks them,
    /// and runs the one-statement claim. The first grant wins. When nothing is granted, answers
    /// with the most actionable failure of the sequence.
    ///
    /// Every failure leaves the database unchanged (the claim writes only when it grants).
    pub async fn allocate(&self, request: &AllocateRequest) -> Result<Allocation, AllocateError> {
        let mut failure: Option<PoolVerdict> = None;
        // The earliest moment something frees up, with the database clock it was judged at.
        let mut soonest: Option<(OffsetDateTime, OffsetDateTime)> = None;

        for pool in request.pool.sequence() {
            let read =
                leases::read_candidates(&self.db, &request.provider, &pool, &request.model).await?;
            let verdict = judge(&read);
            if let PoolVerdict::Try {
                candidates,
                refit,
                frees_at,
            } = &verdict
            {
                for key_id in refit {
                    let mut tx = self.db.begin().await?;
                    leases::fit_slots(&mut *tx, key_id).await?;
                    tx.commit().await?;
                }
                if !candidates.is_empty() {
                    let ranked = ranking::rank_least_recently_used(
                        candidates.clone(),
                        read.db_now.unwrap_or_else(OffsetDateTime::now_utc),
                        self.jitter_seconds,
                        &mut rand::rng(),
                    );
                    let claim = ClaimRequest {
                        ranked: &ranked,
                        provider: &request.provider,
                        pool: &pool,
                        model: &request.model,
                        lease_id: LeaseId::generate(),
                        holder: request.holder.as_ref(),
                        lease_seconds: request.lease_seconds,
                    };
                    if let Some(granted) = leases::claim_slot(&self.db, &claim).await? {
                        tracing::info!(
                            key_id = %granted.key_id,
                            lease_id = %granted.lease_id,
                            served_pool = %pool,
                            pruned_expired = granted.pruned_expired,
                            "lease granted"
                        );
                        return Ok(Allocation {
                            key_id: granted.key_id,
                            lease_id: granted.lease_id,
                            provider: request.provider.clone(),
                            pool,
                            provider_model: request.model.clone(),
                            lease_until: granted.lease_until,
                            credential: granted.secret,
                        });
                    }
                }
                if let (Some(at), Some(now)) = (*frees_at, read.db_now)
                    && soonest.is_none_or(|(s, _)| at < s)
                {
                    soonest = Some((at, now));
                }
            }
            if failure
                .as_ref()
                .is_none_or(|f| verdict.precedence() > f.precedence())
            {
                failure = Some(verdict);
            }
        }

        Err(match failure {
            Some(PoolVerdict::Try { .. }) => AllocateError::PoolExhausted {
                retry_after_seconds: retry_after_seconds(soonest),
            },
            Some(PoolVerdict::NoUsableCredentials) => AllocateError::NoUsableCredentials,
            Some(PoolVerdict::ModelNotSupported) => AllocateError::ModelNotSupported,
            Some(PoolVerdict::NotFound) | None => AllocateError::PoolNotFound,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::leases::CandidateRow;
    use time::Duration;

    fn row(id: &str) -> CandidateRow {
        CandidateRow {
            key_id: KeyId::parse(id).unwrap(),
            max_concurrent_uses: 2,
            serves_model: true,
            usable: true,
            recovers_at: None,
            last_used_at: None,
            slots_over_limit: false,
            in_flight: 0,
            next_lease_end: None,
        }
    }

    fn read(rows: Vec<CandidateRow>) -> Candidates {
        Candidates {
            rows,
            db_now: Some(OffsetDateTime::now_utc()),
        }
    }

    #[test]
    fn empty_pool_is_not_found() {
        assert!(matches!(judge(&read(vec![])), PoolVerdict::NotFound));
    }

    #[test]
    fn pool_without_the_model_is_model_not_supported() {
        let mut r = row("a");
        r.serves_model = false;
        assert!(matches!(
            judge(&read(vec![r])),
            PoolVerdict::ModelNotSupported
        ));
    }

    #[test]
    fn only_disabled_credentials_are_no_usable_credentials() {
        let mut r = row("a");
        r.usable = false;
        assert!(matches!(
            judge(&read(vec![r])),
            PoolVerdict::NoUsableCredentials
        ));
    }

    #[test]
    fn cooling_credentials_are_busy_until_their_cooldown_ends() {
        let now = OffsetDateTime::now_utc();
        let mut r = row("a");
        r.usable = false;
        r.recovers_at = Some(now + Duration::seconds(30));
        match judge(&read(vec![r])) {
            PoolVerdict::Try {
                candidates,
                frees_at,
                ..
            } => {
                assert!(candidates.is_empty());
                assert_eq!(frees_at, Some(now + Duration::seconds(30)));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn over_limit_credential_is_refit_only_when_back_under_its_limit() {
        let mut full = row("full");
        full.slots_over_limit = true;
        full.in_flight = 3;
        let mut under = row("under");
        under.slots_over_limit = true;
        under.in_flight = 1;
        match judge(&read(vec![full, under])) {
            PoolVerdict::Try {
                candidates, refit, ..
            } => {
                assert_eq!(refit, vec![KeyId::parse("under").unwrap()]);
                assert_eq!(candidates.len(), 1);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        let now = OffsetDateTime::now_utc();
        let after = |ms| retry_after_seconds(Some((now + Duration::milliseconds(ms), now)));
        assert_eq!(after(1_200), 2);
        assert_eq!(after(10), 1);
        assert_eq!(after(-5_000), 1);
        assert_eq!(retry_after_seconds(None), 1);
    }
}
