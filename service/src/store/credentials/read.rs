//! Credentials as operators read them: one with its leases, a page, and pool summaries.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use sqlx::PgConnection;
use time::OffsetDateTime;

use crate::domain::health::HealthPolicy;
use crate::domain::windows::{RING, RateLimits, WindowKind, WindowState};
use crate::domain::{KeyId, LeaseId, PoolName, ProviderName, Status};
use crate::store::Db;
use crate::store::leases::decoded;

/// One in-flight lease of a credential, as operators see it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LeaseView {
    /// The lease.
    pub lease_id: LeaseId,
    /// The pool it was granted from.
    pub pool: String,
    /// The executor that holds it.
    pub holder: Option<String>,
    /// When it was granted.
    #[serde(with = "time::serde::rfc3339")]
    pub granted_at: OffsetDateTime,
    /// When it stops counting unless renewed.
    #[serde(with = "time::serde::rfc3339")]
    pub lease_until: OffsetDateTime,
    /// Whether it is a recovering credential's probe.
    pub probe: bool,
}

/// Outcome counters decayed to the moment of reading.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HealthFigures {
    /// Decayed successes.
    pub successes: f64,
    /// Decayed failures.
    pub failures: f64,
    /// Decayed rate limits.
    pub rate_limits: f64,
    /// successes / (successes + failures); 1.0 without history.
    pub success_rate: f64,
    /// Cooldowns since the last recovery (the backoff's exponent).
    pub cooldowns_in_a_row: i32,
    /// The last successful use or probe.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_success_at: Option<OffsetDateTime>,
    /// The last recovery from a cooldown.
    #[serde(with = "time::serde::rfc3339::option")]
    pub recovered_at: Option<OffsetDateTime>,
}

/// A credential as operators see it: configuration, status, health, in-flight leases. Never the
/// secret.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct CredentialDetail {
    /// The operator's id.
    pub key_id: String,
    /// Its provider.
    pub provider: String,
    /// Its pool.
    pub pool: String,
    /// The models it serves.
    pub models: Vec<String>,
    /// Request model name -> one of `models`.
    #[schema(value_type = Object)]
    pub aliases: serde_json::Value,
    /// Its concurrency limit.
    pub max_concurrent_uses: i32,
    /// Its health status.
    pub status: String,
    /// Why the status is what it is.
    pub status_reason: Option<String>,
    /// When its cooldown ends (database clock), if it has one.
    #[serde(with = "time::serde::rfc3339::option")]
    pub cooldown_until: Option<OffsetDateTime>,
    /// Drained: no new leases while the current ones finish.
    pub draining: bool,
    /// Its rate windows as configured.
    pub rate_limits: RateLimits,
    /// What each window has counted now, in the order of `rate_limits`.
    pub windows: Vec<WindowUsage>,
    /// When its latest lease was granted.
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_used_at: Option<OffsetDateTime>,
    /// Outcome figures.
    pub health: HealthFigures,
    /// Unexpired leases.
    pub in_flight: usize,
    /// The unexpired leases, oldest first.
    pub leases: Vec<LeaseView>,
    /// When it was first stored.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// When its configuration last changed.
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
    /// Its OAuth state, for an OAuth credential (never a token or the client secret).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oauth: Option<OAuthView>,
}

/// An OAuth credential as operators see it: its configuration and its access token's state,
/// never a token or the client secret.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OAuthView {
    /// The token endpoint.
    pub token_url: String,
    /// The client id.
    pub client_id: String,
    /// The scope sent with refreshes.
    pub scope: Option<String>,
    /// Seconds before expiry at which the refresh starts.
    pub refresh_before_seconds: i32,
    /// When the current access token expires.
    #[serde(with = "time::serde::rfc3339::option")]
    pub token_expires_at: Option<OffsetDateTime>,
    /// +1 per new access token (a refresh, or an operator's PUT).
    pub generation: i64,
    /// The last refresh failure (`invalid_grant: ...` when the refresh token was rejected);
    /// `null` after a successful refresh or a PUT.
    pub last_error: Option<String>,
    /// When the last refresh landed.
    #[serde(with = "time::serde::rfc3339::option")]
    pub refreshed_at: Option<OffsetDateTime>,
}

/// One rate window of a credential now.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct WindowUsage {
    /// `requests` or `tokens`.
    pub kind: WindowKind,
    /// Its count.
    pub count: u64,
    /// Its length in seconds.
    pub seconds: u32,
    /// What it counts now (grants, or reserved-or-used tokens, in its last length; in buckets of
    /// 1/16 of it: docs/design.md, "Rate windows").
    pub used: i64,
    /// `count - used`, at least 0.
    pub headroom: i64,
    /// When it next admits a request (reserving no tokens), if it is full now.
    #[serde(with = "time::serde::rfc3339::option")]
    pub frees_at: Option<OffsetDateTime>,
}

/// `used / count kind per seconds s`, as the CLI and the dashboard show a window.
impl std::fmt::Display for WindowUsage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} / {} {} per {} s",
            self.used,
            self.count,
            self.kind.as_str(),
            self.seconds
        )
    }
}

/// What `state`'s windows count at `now`.
fn window_usage(state: &WindowState, now: OffsetDateTime) -> Vec<WindowUsage> {
    state
        .windows
        .iter()
        .enumerate()
        .map(|(i, window)| {
            let used = state.used(i, now);
            let alone = WindowState {
                windows: vec![*window],
                bucket_ids: state.bucket_ids[i * RING..(i + 1) * RING].to_vec(),
                bucket_charged: state.bucket_charged[i * RING..(i + 1) * RING].to_vec(),
            };
            let frees_at = (!alone.room(now, 0))
                .then(|| alone.frees_at(now, 0))
                .flatten();
            WindowUsage {
                kind: window.kind,
                count: window.count,
                seconds: window.seconds,
                used,
                headroom: (window.count as i64 - used).max(0),
                frees_at,
            }
        })
        .collect()
}

/// Which credentials to list: filters, and keyset pagination by key_id.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this provider.
    pub provider: Option<ProviderName>,
    /// Only this pool.
    pub pool: Option<PoolName>,
    /// Only this status.
    pub status: Option<Status>,
    /// Only key_ids after this one (the previous page's last).
    pub after: Option<KeyId>,
    /// At most this many (1..=1000).
    pub limit: u32,
}

/// Reads credentials matching `key_id` (one) or `filter` (a page), with their leases.
pub(super) async fn details(
    conn: &mut PgConnection,
    key_id: Option<&KeyId>,
    filter: &ListFilter,
    policy: &HealthPolicy,
) -> Result<Vec<CredentialDetail>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT key_id, provider, pool, models, model_aliases, max_concurrent_uses, status,
               status_reason, cooldown_until, draining, rate_limits,
               (SELECT max(s.last_granted_at) FROM lease_slots s
                WHERE s.key_id = credentials.key_id AND s.provider = credentials.provider)
                   AS last_used_at,
               last_success_at, recovered_at,
               health_successes, health_failures, health_rate_limits, health_decayed_at,
               recent_failures, cooldowns_in_a_row, created_at, updated_at, now() AS "db_now!",
               w.window_kinds AS "window_kinds?", w.window_counts AS "window_counts?",
               w.window_seconds AS "window_seconds?", w.bucket_ids AS "bucket_ids?",
               w.bucket_charged AS "bucket_charged?",
               token_expires_at, o.token_url AS "token_url?", o.client_id AS "client_id?",
               o.scope AS "scope?", o.refresh_before_seconds AS "refresh_before_seconds?",
               o.generation AS "generation?", o.last_error AS "last_error?",
               o.refreshed_at AS "refreshed_at?"
        FROM credentials
        LEFT JOIN lease_windows w USING (key_id, provider)
        LEFT JOIN oauth_credentials o USING (key_id, provider)
        WHERE ($1::text IS NULL OR key_id = $1)
          AND ($2::text IS NULL OR provider = $2)
          AND ($3::text IS NULL OR pool = $3)
          AND ($4::text IS NULL OR status = $4)
          AND ($5::text IS NULL OR key_id > $5)
        ORDER BY key_id
        LIMIT $6
        "#,
        key_id.map(KeyId::as_str),
        filter.provider.as_ref().map(ProviderName::as_str),
        filter.pool.as_ref().map(PoolName::as_str),
        filter.status.map(Status::as_str),
        filter.after.as_ref().map(KeyId::as_str),
        i64::from(filter.limit.max(1)),
    )
    .fetch_all(&mut *conn)
    .await?;
    let ids: Vec<String> = rows.iter().map(|r| r.key_id.clone()).collect();
    let mut leases: HashMap<String, Vec<LeaseView>> = HashMap::new();
    for lease in sqlx::query!(
        r#"
        SELECT key_id, lease_id AS "lease_id!", pool AS "pool!", holder,
               granted_at AS "granted_at!", lease_until AS "lease_until!", probe
        FROM lease_slots
        WHERE key_id = ANY ($1) AND lease_id IS NOT NULL AND lease_until > now()
        ORDER BY granted_at
        "#,
        &ids,
    )
    .fetch_all(&mut *conn)
    .await?
    {
        leases.entry(lease.key_id).or_default().push(LeaseView {
            lease_id: LeaseId::from(lease.lease_id),
            pool: lease.pool,
            holder: lease.holder,
            granted_at: lease.granted_at,
            lease_until: lease.lease_until,
            probe: lease.probe,
        });
    }
    rows.into_iter()
        .map(|r| {
            let health = crate::store::health_of_row!(r)?;
            let (successes, failures, rate_limits) = health.counters_at(r.db_now, policy);
            let leases = leases.remove(&r.key_id).unwrap_or_default();
            let state = crate::store::candidates::window_state(
                r.window_kinds.unwrap_or_default(),
                r.window_counts.unwrap_or_default(),
                r.window_seconds.unwrap_or_default(),
                r.bucket_ids.unwrap_or_default(),
                r.bucket_charged.unwrap_or_default(),
            )?;
            Ok(CredentialDetail {
                key_id: r.key_id,
                provider: r.provider,
                pool: r.pool,
                models: r.models,
                aliases: r.model_aliases,
                max_concurrent_uses: r.max_concurrent_uses,
                status: r.status,
                status_reason: health.status_reason,
                cooldown_until: r.cooldown_until,
                draining: r.draining,
                rate_limits: decoded(RateLimits::from_json(r.rate_limits))?,
                windows: window_usage(&state, r.db_now),
                last_used_at: r.last_used_at,
                health: HealthFigures {
                    successes,
                    failures,
                    rate_limits,
                    success_rate: if successes + failures < 1e-9 {
                        1.0
                    } else {
                        successes / (successes + failures)
                    },
                    cooldowns_in_a_row: r.cooldowns_in_a_row,
                    last_success_at: r.last_success_at,
                    recovered_at: r.recovered_at,
                },
                in_flight: leases.len(),
                leases,
                created_at: r.created_at,
                updated_at: r.updated_at,
                oauth: r.token_url.map(|token_url| OAuthView {
                    token_url,
                    client_id: r.client_id.unwrap_or_default(),
                    scope: r.scope,
                    refresh_before_seconds: r.refresh_before_seconds.unwrap_or_default(),
                    token_expires_at: r.token_expires_at,
                    generation: r.generation.unwrap_or_default(),
                    last_error: r.last_error,
                    refreshed_at: r.refreshed_at,
                }),
            })
        })
        .collect()
}

/// One credential with its leases, or `None`.
pub async fn get(
    db: &Db,
    key_id: &KeyId,
    policy: &HealthPolicy,
) -> Result<Option<CredentialDetail>, sqlx::Error> {
    let mut work = db.work().await?;
    let filter = ListFilter {
        limit: 1,
        ..ListFilter::default()
    };
    let detail = details(&mut work, Some(key_id), &filter, policy)
        .await?
        .pop();
    work.done().await?;
    Ok(detail)
}

/// A page of credentials in key_id order.
pub async fn list(
    db: &Db,
    filter: &ListFilter,
    policy: &HealthPolicy,
) -> Result<Vec<CredentialDetail>, sqlx::Error> {
    let mut work = db.work().await?;
    let page = details(&mut work, None, filter, policy).await?;
    work.done().await?;
    Ok(page)
}

pub(super) async fn details_one(
    conn: &mut PgConnection,
    key_id: &KeyId,
    policy: &HealthPolicy,
) -> Result<Option<CredentialDetail>, sqlx::Error> {
    let filter = ListFilter {
        limit: 1,
        ..ListFilter::default()
    };
    Ok(details(conn, Some(key_id), &filter, policy).await?.pop())
}

/// One (provider, pool) at a glance.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PoolSummary {
    /// The provider.
    pub provider: String,
    /// The pool.
    pub pool: String,
    /// Credentials in it.
    pub credentials: i64,
    /// Credentials by status.
    pub by_status: BTreeMap<String, i64>,
    /// Credentials draining.
    pub draining: i64,
    /// Credentials cooling down now (status rate_limited, cooldown or exhausted with a cooldown
    /// end in the future).
    pub cooling_down: i64,
    /// Credentials with rate windows.
    pub windowed: i64,
    /// Credentials a full rate window holds back now (for a request reserving no tokens).
    pub windows_full: i64,
    /// Sum of their limits.
    pub total_slots: i64,
    /// Unexpired leases.
    pub in_flight: i64,
    /// Seconds until the earliest access token of its OAuth credentials (not disabled) expires
    /// (negative: already expired); `null` without OAuth credentials.
    pub oauth_expires_in_seconds: Option<f64>,
}

impl PoolSummary {
    /// Its credentials by status on one line, in the order of the statuses: each status, then
    /// `between`, then its count, joined by `, ` (`available: 3, disabled: 1` with `": "`).
    pub fn by_status_line(&self, between: &str) -> String {
        self.by_status
            .iter()
            .map(|(status, n)| format!("{status}{between}{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Every (provider, pool) with its counts, in order.
pub async fn pools(db: &Db) -> Result<Vec<PoolSummary>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        SELECT c.provider, c.pool,
               count(*) AS "credentials!",
               count(*) FILTER (WHERE c.draining) AS "draining!",
               count(*) FILTER (WHERE credential_recovers_at(c.status, c.cooldown_until, now()) IS NOT NULL)
                   AS "cooling_down!",
               count(*) FILTER (WHERE cardinality(w.window_kinds) > 0) AS "windowed!",
               count(*) FILTER (WHERE cardinality(w.window_kinds) > 0
                                  AND NOT credpool_window_room(w, now(), 0)) AS "windows_full!",
               sum(c.max_concurrent_uses)::int8 AS "total_slots!",
               coalesce(sum(s.in_flight), 0)::int8 AS "in_flight!",
               array_agg(c.status) AS "statuses!",
               extract(epoch FROM min(c.token_expires_at) FILTER (WHERE c.status <> 'disabled')
                                  - now())::float8 AS oauth_expires_in_seconds
        FROM credentials c
        LEFT JOIN (
            SELECT key_id, provider, count(*) AS in_flight
            FROM lease_slots
            WHERE lease_id IS NOT NULL AND lease_until > now()
            GROUP BY key_id, provider
        ) s ON s.key_id = c.key_id AND s.provider = c.provider
        LEFT JOIN lease_windows w ON w.key_id = c.key_id AND w.provider = c.provider
        GROUP BY c.provider, c.pool
        ORDER BY c.provider, c.pool
        "#
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let mut by_status = BTreeMap::new();
            for status in r.statuses {
                *by_status.entry(status).or_insert(0) += 1;
            }
            PoolSummary {
                provider: r.provider,
                pool: r.pool,
                credentials: r.credentials,
                by_status,
                draining: r.draining,
                cooling_down: r.cooling_down,
                windowed: r.windowed,
                windows_full: r.windows_full,
                total_slots: r.total_slots,
                in_flight: r.in_flight,
                oauth_expires_in_seconds: r.oauth_expires_in_seconds,
            }
        })
        .collect())
}
