//! The OAuth refresher's statements (service/src/oauth.rs says how they fit together): which
//! tokens are due, taking one generation's refresh, and writing its result.
//!
//! Exactly one writer per generation: [`take_refresh`] is one `UPDATE` of the credential's
//! `oauth_credentials` row that requires the generation the caller saw and no live marker. Two
//! writers racing for it meet on that row's lock; under READ COMMITTED the second re-checks the
//! WHERE clause against the first's committed row (a live marker), and takes nothing. Writing a
//! result re-reads the generation and the marker's holder on the locked row, after taking the
//! credential's locks in the lock order (`credpool_lock_credentials`; oauth_credentials rows come
//! after credentials rows): a writer whose marker expired and was taken over writes nothing.
//! No transaction stays open across the call to the token endpoint.

use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use crate::domain::oauth::OAuthSpec;
use crate::domain::{KeyId, ProviderName};
use crate::store::Db;
use crate::store::credentials::{self, Actor};

/// Who the trail names for the refresher's events.
const ACTOR: &str = "oauth-refresher";

/// Most credentials one pass refreshes (the soonest to expire first).
const DUE_PER_PASS: i64 = 32;

/// A refresh this process took: the generation it replaces and what the call needs.
#[derive(Debug)]
pub struct RefreshTaken {
    /// The credential's provider (every statement of the refresh names it: on Citus it runs on
    /// the provider's worker).
    pub provider: ProviderName,
    /// The generation of the access token being replaced.
    pub generation: i64,
    /// When the refresh was taken (database clock): the new token's lifetime counts from here,
    /// so its `expires_at` is never later than the endpoint's.
    pub started_at: OffsetDateTime,
    /// The token endpoint.
    pub token_url: String,
    /// The client id.
    pub client_id: String,
    /// The scope, if configured.
    pub scope: Option<String>,
    /// The sealed `{"refresh_token", "client_secret"?}`.
    pub sealed_grant: Vec<u8>,
    /// Failed attempts of this generation so far.
    pub failed_attempts: i32,
}

/// How a refresh failed.
#[derive(Debug)]
pub enum Failure {
    /// Retry after `after` (backoff); the credential keeps serving while its token is valid.
    Retry {
        /// What went wrong (never a token).
        error: String,
        /// The delay before the next attempt.
        after: Duration,
    },
    /// The refresh token was rejected: the credential is disabled until an operator PUTs a new
    /// secret.
    InvalidGrant {
        /// What went wrong (names `invalid_grant`; never a token).
        error: String,
    },
}

/// The OAuth credentials whose access token is within its `refresh_before_seconds` of expiring
/// (database clock), not disabled, not in backoff and not being refreshed, soonest first, with
/// its provider and the generation each was seen at (at most 32).
pub async fn due(db: &Db) -> Result<Vec<(KeyId, ProviderName, i64)>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        SELECT o.key_id, o.provider, o.generation
        FROM oauth_credentials o
        JOIN credentials c ON c.key_id = o.key_id AND c.provider = o.provider
        WHERE c.status <> 'disabled'
          AND c.token_expires_at - make_interval(secs => o.refresh_before_seconds) <= now()
          AND o.next_attempt_at <= now()
          AND (o.refreshing_until IS NULL OR o.refreshing_until <= now())
        ORDER BY c.token_expires_at
        LIMIT $1
        "#,
        DUE_PER_PASS,
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            let provider = ProviderName::parse(r.provider).ok()?;
            KeyId::parse(r.key_id)
                .ok()
                .map(|k| (k, provider, r.generation))
        })
        .collect())
}

/// Takes the refresh of `key_id`'s (of `provider`) token of `generation` for `holder`, for
/// `claim_for`: `None` when the generation moved, another writer's marker is live, or the
/// credential is in backoff.
///
/// The refresh's statements date what they write at their own start (`statement_timestamp()`,
/// after the locks of the statements before them): Citus takes no volatile function such as
/// `clock_timestamp()` in an `UPDATE` of a distributed table. A marker's end compared at the
/// statement's start is compared earlier than after its row lock, which only ever finds a live
/// marker live. The marker written ends `claim_for` after that start, so a take that waited for
/// the row's lock returns a marker with less left, or lapsed already: the caller measures the
/// take from when it sent it, and keeps the marker ([`keep_refresh`]) before it relies on it.
pub async fn take_refresh(
    db: &Db,
    key_id: &KeyId,
    provider: &ProviderName,
    generation: i64,
    holder: Uuid,
    claim_for: Duration,
) -> Result<Option<RefreshTaken>, sqlx::Error> {
    let mut work = db.work().await?;
    let taken = sqlx::query!(
        r#"
        UPDATE oauth_credentials o
        SET refreshing_holder = $3,
            refreshing_until = statement_timestamp() + make_interval(secs => $4)
        WHERE o.provider = $5 AND o.key_id = $1 AND o.generation = $2
          AND (o.refreshing_until IS NULL OR o.refreshing_until <= statement_timestamp())
          AND o.next_attempt_at <= statement_timestamp()
        RETURNING o.generation, o.refreshing_until AS "refreshing_until!", o.token_url,
                  o.client_id, o.scope, o.refresh_ciphertext, o.failed_attempts
        "#,
        key_id.as_str(),
        generation,
        holder,
        claim_for.as_secs_f64(),
        provider.as_str(),
    )
    .fetch_optional(&mut *work)
    .await?;
    work.done().await?;
    Ok(taken.map(|r| RefreshTaken {
        provider: provider.clone(),
        generation: r.generation,
        // the statement's start, from the marker's end (Citus takes no function but an
        // immutable one in RETURNING)
        started_at: r.refreshing_until - claim_for,
        token_url: r.token_url,
        client_id: r.client_id,
        scope: r.scope,
        sealed_grant: r.refresh_ciphertext,
        failed_attempts: r.failed_attempts,
    }))
}

/// Keeps `holder`'s marker on `key_id`'s refresh of `generation` for another `claim_for` from
/// now, while it is still live and `holder`'s: `false` when it is not (written, given up, or
/// taken over: there is nothing left to keep). One `UPDATE` of the `oauth_credentials` row alone,
/// in its own transaction, like the marker's first take.
pub async fn keep_refresh(
    db: &Db,
    key_id: &KeyId,
    provider: &ProviderName,
    generation: i64,
    holder: Uuid,
    claim_for: Duration,
) -> Result<bool, sqlx::Error> {
    let mut work = db.work().await?;
    let kept = sqlx::query!(
        r#"
        UPDATE oauth_credentials
        SET refreshing_until = statement_timestamp() + make_interval(secs => $4)
        WHERE provider = $5 AND key_id = $1 AND generation = $2 AND refreshing_holder = $3
          AND refreshing_until > statement_timestamp()
        "#,
        key_id.as_str(),
        generation,
        holder,
        claim_for.as_secs_f64(),
        provider.as_str(),
    )
    .execute(&mut *work)
    .await?
    .rows_affected();
    work.done().await?;
    Ok(kept > 0)
}

/// Locks `key_id`'s rows in the lock order and re-reads whether `holder` still holds the refresh
/// of `taken`'s generation.
async fn still_ours(
    conn: &mut sqlx::PgConnection,
    key_id: &KeyId,
    taken: &RefreshTaken,
    holder: Uuid,
) -> Result<bool, sqlx::Error> {
    credentials::lock_credential(conn, key_id).await?;
    let row = sqlx::query!(
        "SELECT generation, refreshing_holder FROM oauth_credentials
         WHERE provider = $2 AND key_id = $1 FOR UPDATE",
        key_id.as_str(),
        taken.provider.as_str(),
    )
    .fetch_optional(&mut *conn)
    .await?;
    Ok(
        row.is_some_and(|r| {
            r.generation == taken.generation && r.refreshing_holder == Some(holder)
        }),
    )
}

/// The actor the trail names for the refresher's events.
fn actor() -> Actor {
    Actor::parse(ACTOR).expect("a valid actor name")
}

/// Writes a refreshed access token (sealed as executors receive it), its expiry, the (rotated)
/// sealed grant and generation + 1, in one transaction, with a `token_refreshed` trail row.
/// Returns false, writing nothing, when `holder` no longer holds the refresh of `taken`'s
/// generation (taken over, or an operator PUT a new secret meanwhile).
pub async fn write_token(
    db: &Db,
    key_id: &KeyId,
    taken: &RefreshTaken,
    holder: Uuid,
    sealed_secret: &[u8],
    sealed_grant: &[u8],
    expires_at: OffsetDateTime,
) -> Result<bool, sqlx::Error> {
    let mut tx = db.begin().await?;
    if !still_ours(&mut tx, key_id, taken, holder).await? {
        return Ok(false);
    }
    // a new secret and expiry: moves config_version into every slot row (held since the lock)
    sqlx::query!(
        r#"
        UPDATE credentials
        SET secret = NULL, secret_ciphertext = $2, token_expires_at = $3, updated_at = now()
        WHERE provider = $4 AND key_id = $1
        "#,
        key_id.as_str(),
        sealed_secret,
        expires_at,
        taken.provider.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!(
        r#"
        UPDATE oauth_credentials
        SET refresh_ciphertext = $2, generation = generation + 1,
            generation_at = statement_timestamp(), refreshing_holder = NULL,
            refreshing_until = NULL, failed_attempts = 0, next_attempt_at = '-infinity',
            last_error = NULL, refreshed_at = statement_timestamp()
        WHERE provider = $3 AND key_id = $1
        "#,
        key_id.as_str(),
        sealed_grant,
        taken.provider.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    credentials::audit(
        &mut tx,
        key_id,
        "token_refreshed",
        &actor(),
        "access token refreshed",
        serde_json::json!({"generation": taken.generation + 1, "token_expires_at": expires_at}),
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// Records a failed refresh of `taken`'s generation with a `token_refresh_failed` trail row:
/// a retry after the backoff, or (`invalid_grant`) the credential disabled with the error as its
/// status reason. Does nothing when `holder` no longer holds the refresh.
pub async fn write_failure(
    db: &Db,
    key_id: &KeyId,
    taken: &RefreshTaken,
    holder: Uuid,
    failure: &Failure,
) -> Result<(), sqlx::Error> {
    let mut tx = db.begin().await?;
    let (error, retry_after) = match failure {
        Failure::Retry { error, after } => (error, Some(after.as_secs_f64())),
        Failure::InvalidGrant { error } => (error, None),
    };
    if retry_after.is_none() {
        // the status changes: the credential's locks first, in the lock order
        if !still_ours(&mut tx, key_id, taken, holder).await? {
            return Ok(());
        }
        let old_status = sqlx::query_scalar!(
            "SELECT status FROM credentials WHERE provider = $2 AND key_id = $1",
            key_id.as_str(),
            taken.provider.as_str()
        )
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query!(
            r#"
            UPDATE credentials
            SET status = 'disabled', status_reason = $2, cooldown_until = NULL, updated_at = now()
            WHERE provider = $3 AND key_id = $1
            "#,
            key_id.as_str(),
            error,
            taken.provider.as_str(),
        )
        .execute(&mut *tx)
        .await?;
        credentials::audit(
            &mut tx,
            key_id,
            "status_changed",
            &actor(),
            error,
            serde_json::json!({"old": {"status": old_status}, "new": {"status": "disabled"},
                               "generation": taken.generation}),
        )
        .await?;
    }
    // the next attempt, read first: Citus takes no function but an immutable one in a CASE of
    // an UPDATE (NULL: no retry, the attempt time stays)
    let next_attempt_at = sqlx::query_scalar!(
        "SELECT statement_timestamp() + make_interval(secs => $1::float8)",
        retry_after,
    )
    .fetch_one(&mut *tx)
    .await?;
    let recorded = sqlx::query!(
        r#"
        UPDATE oauth_credentials
        SET refreshing_holder = NULL, refreshing_until = NULL,
            failed_attempts = failed_attempts + 1, last_error = $4,
            next_attempt_at = coalesce($5, next_attempt_at)
        WHERE provider = $6 AND key_id = $1 AND generation = $2 AND refreshing_holder = $3
        "#,
        key_id.as_str(),
        taken.generation,
        holder,
        error,
        next_attempt_at,
        taken.provider.as_str(),
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if recorded == 0 {
        return Ok(());
    }
    credentials::audit(
        &mut tx,
        key_id,
        "token_refresh_failed",
        &actor(),
        error,
        serde_json::json!({"generation": taken.generation, "retry_in_seconds": retry_after}),
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The token generation of OAuth credential `key_id`, its row locked (`None`: not an OAuth
/// credential). The caller holds the credential's locks (the lock order puts this row last).
pub(crate) async fn locked_generation(
    conn: &mut sqlx::PgConnection,
    key_id: &KeyId,
    provider: &ProviderName,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT generation FROM oauth_credentials WHERE provider = $2 AND key_id = $1 FOR UPDATE",
        key_id.as_str(),
        provider.as_str()
    )
    .fetch_optional(&mut *conn)
    .await
}

/// Stores an operator's OAuth configuration and grant for `key_id` (PUT), or removes it
/// (`None`: the credential is not OAuth any more). A new grant is a new access token:
/// generation + 1 with `generation_at` read under the locks (every lease granted at or after it
/// holds the new token, every lease before it an older one: what an `auth_expired` report is
/// judged by), and any refresh in progress loses its marker (its write is refused). The caller
/// holds the credential's locks and has written `credentials.token_expires_at`; `provider` is
/// the credential's (every statement names it: on Citus it runs on the provider's worker).
pub(crate) async fn store_config(
    conn: &mut sqlx::PgConnection,
    key_id: &KeyId,
    provider: &ProviderName,
    spec: Option<&OAuthSpec>,
) -> Result<(), sqlx::Error> {
    let Some(spec) = spec else {
        sqlx::query!(
            "DELETE FROM oauth_credentials WHERE provider = $2 AND key_id = $1",
            key_id.as_str(),
            provider.as_str()
        )
        .execute(&mut *conn)
        .await?;
        return Ok(());
    };
    sqlx::query!(
        r#"
        INSERT INTO oauth_credentials AS o
            (key_id, provider, token_url, client_id, scope, refresh_before_seconds,
             refresh_ciphertext, generation_at)
        VALUES ($1, $7, $2, $3, $4, $5, $6, clock_timestamp())
        ON CONFLICT ON CONSTRAINT oauth_credentials_pkey DO UPDATE
        SET token_url = EXCLUDED.token_url, client_id = EXCLUDED.client_id,
            scope = EXCLUDED.scope, refresh_before_seconds = EXCLUDED.refresh_before_seconds,
            refresh_ciphertext = EXCLUDED.refresh_ciphertext, generation = o.generation + 1,
            -- (the clock read for the inserted row: Citus takes no function but an immutable
            -- one here)
            generation_at = EXCLUDED.generation_at,
            refreshing_holder = NULL, refreshing_until = NULL, failed_attempts = 0,
            next_attempt_at = '-infinity', last_error = NULL
        "#,
        key_id.as_str(),
        spec.token_url,
        spec.client_id,
        spec.scope,
        spec.refresh_before_seconds,
        spec.sealed_grant,
        provider.as_str(),
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}
