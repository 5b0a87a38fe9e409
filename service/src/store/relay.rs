//! The relay's upstreams (`relay_upstreams`): where each provider's relay calls are forwarded,
//! as an operator sets them, with a `relay_upstream_events` row per change in the same
//! transaction. Read once per relay call (one primary-key look-up).

use serde::Serialize;
use time::OffsetDateTime;

use super::Db;
use super::credentials::Actor;
use crate::domain::ProviderName;
use crate::domain::relay::{ApiStyle, Upstream};

/// A provider's upstream as the admin API and the CLI show it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct UpstreamDetail {
    /// The provider.
    #[schema(value_type = String)]
    pub provider: String,
    /// Where its calls go.
    pub base_url: String,
    /// `openai` or `anthropic`.
    pub api: ApiStyle,
    /// The header the leased credential goes in.
    pub credential_header: String,
    /// How long a call waits for a free credential by default, in milliseconds.
    pub wait_ms: u32,
    /// The header that names a call's conversation, if any.
    pub affinity_header: Option<String>,
    /// The longest wait for the answer to start, and between two of its chunks, in seconds.
    pub timeout_seconds: u32,
    /// When it was last set.
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
    /// Who set it (`X-Operator`, `admin-key` or `cli:<user>`).
    pub updated_by: String,
}

/// A stored row, as read.
struct Row {
    provider: String,
    base_url: String,
    api: String,
    credential_header: String,
    wait_ms: i32,
    affinity_header: Option<String>,
    timeout_seconds: i32,
    updated_at: OffsetDateTime,
    updated_by: String,
}

impl Row {
    /// The row as the API shows it.
    fn detail(self) -> UpstreamDetail {
        UpstreamDetail {
            provider: self.provider,
            base_url: self.base_url,
            // the table's check admits these two only
            api: ApiStyle::parse(&self.api).unwrap_or(ApiStyle::OpenAi),
            credential_header: self.credential_header,
            wait_ms: u32::try_from(self.wait_ms).unwrap_or(0),
            affinity_header: self.affinity_header,
            timeout_seconds: u32::try_from(self.timeout_seconds).unwrap_or(1),
            updated_at: self.updated_at,
            updated_by: self.updated_by,
        }
    }
}

/// Sets `upstream` as its provider's, with a `set` event by `actor`, in one transaction. Returns
/// the upstream as stored, and whether the provider had none before (created). Errors: the
/// store's.
#[tracing::instrument(skip_all, fields(provider = %upstream.provider))]
pub async fn put(
    db: &Db,
    upstream: &Upstream,
    actor: &Actor,
) -> Result<(UpstreamDetail, bool), sqlx::Error> {
    let mut tx = db.begin().await?;
    let stored = sqlx::query!(
        r#"INSERT INTO relay_upstreams AS u
               (provider, base_url, api, credential_header, wait_ms, affinity_header,
                timeout_seconds, updated_by)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
           ON CONFLICT (provider) DO UPDATE
              SET base_url = EXCLUDED.base_url, api = EXCLUDED.api,
                  credential_header = EXCLUDED.credential_header, wait_ms = EXCLUDED.wait_ms,
                  affinity_header = EXCLUDED.affinity_header,
                  timeout_seconds = EXCLUDED.timeout_seconds, updated_at = now(),
                  updated_by = EXCLUDED.updated_by
           RETURNING provider, base_url, api, credential_header, wait_ms, affinity_header,
                     timeout_seconds, updated_at, updated_by, (xmax = 0) AS "created!""#,
        upstream.provider.as_str(),
        upstream.base_url.as_str(),
        upstream.api.as_str(),
        upstream.credential_header.as_str(),
        upstream.wait_ms as i32,
        upstream.affinity_header.as_ref().map(|h| h.as_str()),
        upstream.timeout_seconds as i32,
        actor.as_str(),
    )
    .fetch_one(&mut *tx)
    .await?;
    let detail = Row {
        provider: stored.provider,
        base_url: stored.base_url,
        api: stored.api,
        credential_header: stored.credential_header,
        wait_ms: stored.wait_ms,
        affinity_header: stored.affinity_header,
        timeout_seconds: stored.timeout_seconds,
        updated_at: stored.updated_at,
        updated_by: stored.updated_by,
    }
    .detail();
    // the event keeps the settings; its own columns say which provider, when and who
    let settings = serde_json::json!({
        "base_url": detail.base_url, "api": detail.api,
        "credential_header": detail.credential_header, "wait_ms": detail.wait_ms,
        "affinity_header": detail.affinity_header, "timeout_seconds": detail.timeout_seconds,
    });
    sqlx::query!(
        "INSERT INTO relay_upstream_events (provider, event, upstream, actor)
         VALUES ($1, 'set', $2, $3)",
        upstream.provider.as_str(),
        settings,
        actor.as_str(),
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((detail, stored.created))
}

/// Removes `provider`'s upstream, with a `removed` event by `actor`, in one transaction: its relay
/// calls are refused from then on (calls already forwarded run to their end). Returns whether it
/// had one. Errors: the store's.
#[tracing::instrument(skip_all, fields(provider = %provider))]
pub async fn remove(db: &Db, provider: &ProviderName, actor: &Actor) -> Result<bool, sqlx::Error> {
    let mut tx = db.begin().await?;
    let removed = sqlx::query!(
        "DELETE FROM relay_upstreams WHERE provider = $1",
        provider.as_str()
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        > 0;
    if removed {
        sqlx::query!(
            "INSERT INTO relay_upstream_events (provider, event, actor) VALUES ($1, 'removed', $2)",
            provider.as_str(),
            actor.as_str(),
        )
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(removed)
}

/// Every provider's upstream, by provider. Errors: the store's.
#[tracing::instrument(skip_all)]
pub async fn list(db: &Db) -> Result<Vec<UpstreamDetail>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query_as!(
        Row,
        "SELECT provider, base_url, api, credential_header, wait_ms, affinity_header,
                timeout_seconds, updated_at, updated_by
           FROM relay_upstreams ORDER BY provider"
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows.into_iter().map(Row::detail).collect())
}

/// `provider`'s upstream, as the relay uses it; `None` when none is set (or a stored value no
/// longer passes this version's checks: the call is refused as for none, and logged). Errors: the
/// store's.
#[tracing::instrument(skip_all, fields(provider = %provider))]
pub async fn get(db: &Db, provider: &ProviderName) -> Result<Option<Upstream>, sqlx::Error> {
    let mut work = db.work().await?;
    let row = sqlx::query_as!(
        Row,
        "SELECT provider, base_url, api, credential_header, wait_ms, affinity_header,
                timeout_seconds, updated_at, updated_by
           FROM relay_upstreams WHERE provider = $1",
        provider.as_str()
    )
    .fetch_optional(&mut *work)
    .await?;
    work.done().await?;
    Ok(row.and_then(|row| {
        let detail = row.detail();
        let input = crate::domain::relay::UpstreamInput {
            base_url: detail.base_url,
            api: detail.api,
            credential_header: Some(detail.credential_header),
            wait_ms: Some(u64::from(detail.wait_ms)),
            affinity_header: detail.affinity_header,
            timeout_seconds: Some(u64::from(detail.timeout_seconds)),
        };
        input
            .check(provider.clone())
            .inspect_err(|error| tracing::error!(error = %error, "a stored relay upstream no longer passes its checks; set it again"))
            .ok()
    }))
}

/// One provider's and pool's relay calls that ended over the last hour, by `outcome` (the one
/// reported at release; `none` for calls whose client went away, or that ended without a
/// release).
#[derive(Debug, Clone)]
pub struct RelayCalls {
    /// The provider.
    pub provider: String,
    /// The pool that served.
    pub pool: String,
    /// `success`, `rate_limited`, ..., or `none`.
    pub outcome: String,
    /// How many.
    pub calls: i64,
}

/// The relay calls that ended over the last hour, per provider, pool and outcome, from the trail
/// (the leases of holder `relay` or `relay:<name>`): every replica's calls, unlike a process's
/// counters. Errors: the store's.
#[tracing::instrument(skip_all, err(level = "debug"))]
pub async fn calls_last_hour(db: &Db) -> Result<Vec<RelayCalls>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query_as!(
        RelayCalls,
        r#"
        SELECT e.provider AS "provider!", e.pool AS "pool!",
               coalesce(e.outcome, 'none') AS "outcome!", count(*) AS "calls!"
        FROM lease_events e
        WHERE e.at > now() - interval '1 hour'
          AND e.event IN ('released', 'expired', 'force_released')
          AND (e.holder = 'relay' OR e.holder LIKE 'relay:%')
        GROUP BY e.provider, e.pool, 3
        ORDER BY e.provider, e.pool, 3
        "#
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows)
}
