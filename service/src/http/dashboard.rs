//! The operator dashboard: a live web page of pools, credentials, leases and recent events.
//!
//! `GET /dashboard` serves a shell page that holds no data and needs no key (a browser cannot
//! put `X-Admin-Key` on a navigation). Its script keeps the admin key the operator pastes in
//! `sessionStorage`, polls `GET /dashboard/fragments/{pools,credentials,leases,events}` every
//! 3 s with `X-Admin-Key` (the same [`AdminKey`] check as `/api/admin`: 401 / 403 in the API's
//! error shape), swaps the server-rendered HTML in, and calls the operator API for drain, enable,
//! disable and forced releases. Templates, script and style are embedded in the binary: the page
//! works offline and references nothing outside credpool.
//!
//! No fragment carries credential material: the reads select no secret column, and the tests
//! look for a known secret in every response.

use std::sync::LazyLock;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use minijinja::value::Serde;
use minijinja::{Environment, context};
use serde::Serialize;
use time::OffsetDateTime;

use super::{AdminKey, ApiError, AppState};
use crate::store::{self, credentials::ListFilter};

/// Most credentials the credentials fragment lists (in key_id order).
pub const MAX_CREDENTIALS: u32 = 1000;

/// Minutes of history in a pool's utilization sparkline.
const SPARK_MINUTES: usize = 60;

static TEMPLATES: LazyLock<Environment<'static>> = LazyLock::new(|| {
    let mut env = Environment::new();
    for (name, source) in [
        ("pools.html", include_str!("dashboard/pools.html")),
        (
            "credentials.html",
            include_str!("dashboard/credentials.html"),
        ),
        ("leases.html", include_str!("dashboard/leases.html")),
        ("events.html", include_str!("dashboard/events.html")),
    ] {
        env.add_template(name, source)
            .expect("the dashboard's embedded templates parse");
    }
    env
});

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/dashboard", get(shell))
        .route("/dashboard/assets/dashboard.js", get(script))
        .route("/dashboard/assets/dashboard.css", get(style))
        .route("/dashboard/fragments/pools", get(pools))
        .route("/dashboard/fragments/credentials", get(credentials))
        .route("/dashboard/fragments/leases", get(leases))
        .route("/dashboard/fragments/events", get(events))
}

/// Only credpool's own script and style, no framing, no referrer: the page holds the admin key.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut response = ([(header::CONTENT_TYPE, content_type)], body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// The shell page: layout and the key form, no data.
async fn shell() -> Response {
    page(
        "text/html; charset=utf-8",
        include_str!("dashboard/shell.html"),
    )
}

async fn script() -> Response {
    page(
        "text/javascript; charset=utf-8",
        include_str!("dashboard/dashboard.js"),
    )
}

async fn style() -> Response {
    page(
        "text/css; charset=utf-8",
        include_str!("dashboard/dashboard.css"),
    )
}

/// Renders a fragment, never cached (it is live data behind the admin key).
fn render(name: &str, context: minijinja::Value) -> Result<Response, ApiError> {
    let html = TEMPLATES
        .get_template(name)
        .and_then(|template| template.render(context))
        .map_err(|error| {
            tracing::error!(template = name, error = %error, "dashboard template failed");
            ApiError::Internal
        })?;
    Ok(([(header::CACHE_CONTROL, "no-store")], Html(html)).into_response())
}

/// A duration for people: `42 s`, `3 m 05 s`, `2 h 07 m`. Negative counts as 0.
fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as i64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} m {:02} s", s / 60, s % 60),
        _ => format!("{} h {:02} m", s / 3600, s % 3600 / 60),
    }
}

fn seconds_between(from: OffsetDateTime, to: OffsetDateTime) -> f64 {
    (to - from).as_seconds_f64()
}

/// One tenant's line: its leases in flight against its cap.
#[derive(Debug, Serialize)]
struct TenantView {
    tenant_id: String,
    in_flight: i64,
    /// Its cap on live leases; `None`: no cap.
    cap: Option<i32>,
    /// In flight as a share of the cap, in percent (0 without a cap).
    percent: i64,
    /// At its cap: its next allocate answers `tenant_limit`.
    at_cap: bool,
}

/// One pool's line.
#[derive(Debug, Serialize)]
struct PoolView {
    provider: String,
    pool: String,
    credentials: i64,
    /// `available: 2, disabled: 1`.
    by_status: String,
    draining: i64,
    cooling_down: i64,
    /// Credentials with rate windows, and those a full window holds back now.
    windowed: i64,
    windows_full: i64,
    total_slots: i64,
    in_flight: i64,
    free: i64,
    /// in_flight / total_slots, 0..=100 (a limit lowered under load can leave more in flight).
    percent: i64,
    saturated: bool,
    /// The sparkline's polyline points (`x,y` pairs in a 120 x 24 box), one per minute.
    spark: String,
    /// The highest per-minute utilization of the hour, 0..=100.
    peak_percent: i64,
    /// Conversation affinity over the last hour (grants with an affinity key served from this
    /// pool): `hit / (hit + moved)` in whole percent, or `None` without such grants or when every
    /// one was a conversation's first.
    affinity_percent: Option<i64>,
    /// `"870 hit, 30 moved, 100 new"`; empty without such grants.
    affinity: String,
    /// Relay calls that ended over the last hour (all outcomes), and `"110 success, 5
    /// rate_limited"`; 0 and empty without any.
    relay_calls: i64,
    relay: String,
}

/// Polyline points of per-minute utilization (0..=1) in a 120 x 24 box, oldest minute left.
fn sparkline(utilization: &[f64]) -> String {
    let step = 120.0 / (SPARK_MINUTES.max(2) - 1) as f64;
    utilization
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let y = 23.0 - u.clamp(0.0, 1.0) * 22.0;
            format!("{:.1},{:.1}", i as f64 * step, y)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Pools: slots, in flight, free, credentials by status, utilization over the last hour; and the
/// tenants, each one's leases in flight against its cap.
async fn pools(State(state): State<AppState>, _admin: AdminKey) -> Result<Response, ApiError> {
    let summaries = store::credentials::pools(&state.db).await?;
    let minutes = store::dashboard::utilization(&state.db).await?;
    let affinity = store::dashboard::affinity(&state.db).await?;
    let relayed = store::relay::calls_last_hour(&state.db).await?;
    let views: Vec<PoolView> = summaries
        .into_iter()
        .map(|p| {
            let slots = p.total_slots.max(1) as f64;
            let series: Vec<f64> = minutes
                .iter()
                .filter(|m| m.provider == p.provider && m.pool == p.pool)
                .map(|m| m.lease_seconds / m.minute_seconds.max(1.0) / slots)
                .collect();
            let peak = series.iter().copied().fold(0.0, f64::max);
            let bound = affinity
                .iter()
                .find(|a| a.provider == p.provider && a.pool == p.pool);
            let affinity_percent = bound
                .filter(|a| a.hit + a.moved > 0)
                .map(|a| (a.hit * 100) / (a.hit + a.moved));
            let affinity_counts = bound.map_or_else(String::new, |a| {
                format!("{} hit, {} moved, {} new", a.hit, a.moved, a.new)
            });
            let relay: Vec<_> = relayed
                .iter()
                .filter(|r| r.provider == p.provider && r.pool == p.pool)
                .collect();
            let by_status = p.by_status_line(": ");
            PoolView {
                by_status,
                draining: p.draining,
                cooling_down: p.cooling_down,
                windowed: p.windowed,
                windows_full: p.windows_full,
                free: (p.total_slots - p.in_flight).max(0),
                percent: (p.in_flight * 100 / p.total_slots.max(1)).min(100),
                saturated: p.in_flight >= p.total_slots,
                spark: sparkline(&series),
                peak_percent: (peak * 100.0).round() as i64,
                affinity_percent,
                affinity: affinity_counts,
                relay_calls: relay.iter().map(|r| r.calls).sum(),
                relay: relay
                    .iter()
                    .map(|r| format!("{} {}", r.calls, r.outcome))
                    .collect::<Vec<_>>()
                    .join(", "),
                credentials: p.credentials,
                total_slots: p.total_slots,
                in_flight: p.in_flight,
                provider: p.provider,
                pool: p.pool,
            }
        })
        .collect();
    let tenants: Vec<TenantView> = store::tenants::list(&state.db)
        .await?
        .into_iter()
        .map(|t| TenantView {
            percent: t.max_concurrent_leases.map_or(0, |cap| {
                (t.in_flight * 100 / i64::from(cap.max(1))).min(100)
            }),
            at_cap: t
                .max_concurrent_leases
                .is_some_and(|cap| t.in_flight >= i64::from(cap)),
            cap: t.max_concurrent_leases,
            in_flight: t.in_flight,
            tenant_id: t.tenant_id,
        })
        .collect();
    render(
        "pools.html",
        context!(pools => Serde(&views), tenants => Serde(&tenants)),
    )
}

/// One credential's row. `*_sort` fields are the numbers the table sorts by.
#[derive(Debug, Serialize)]
struct CredentialView {
    key_id: String,
    provider: String,
    pool: String,
    status: String,
    draining: bool,
    status_reason: Option<String>,
    cooldown: Option<String>,
    cooldown_sort: f64,
    in_flight: usize,
    max_concurrent_uses: i32,
    success_rate: String,
    success_sort: f64,
    rate_limits: String,
    rate_limits_sort: f64,
    last_used: Option<String>,
    last_used_sort: f64,
    /// "used / count unit per seconds", one per rate window; the tightest window's share left.
    windows: Vec<String>,
    windows_full: bool,
    headroom_sort: f64,
    /// OAuth credentials: "in 42 min" or "expired 3 s ago", with the generation; absent otherwise.
    token: Option<String>,
    /// Seconds until the access token expires (negative: expired); `f64::MAX` without OAuth.
    token_sort: f64,
    /// The last refresh failure of an OAuth credential.
    token_error: Option<String>,
}

/// Credentials: status, cooldown left, in flight / limit, success rate, last use, recent rate
/// limits (the decaying counter), rate windows, an OAuth token's expiry, and the action buttons.
async fn credentials(
    State(state): State<AppState>,
    _admin: AdminKey,
) -> Result<Response, ApiError> {
    let filter = ListFilter {
        limit: MAX_CREDENTIALS,
        ..ListFilter::default()
    };
    let list = store::credentials::list(&state.db, &filter, &state.health).await?;
    let now = store::audit::now(&state.db).await?;
    let truncated = list.len() >= MAX_CREDENTIALS as usize;
    let views: Vec<CredentialView> = list
        .into_iter()
        .map(|c| {
            let cooldown_left = c
                .cooldown_until
                .map(|until| seconds_between(now, until))
                .filter(|left| *left > 0.0);
            let idle = c.last_used_at.map(|at| seconds_between(at, now));
            let token_left = c
                .oauth
                .as_ref()
                .and_then(|o| o.token_expires_at)
                .map(|at| seconds_between(now, at));
            let headroom = c
                .windows
                .iter()
                .map(|w| w.headroom as f64 / w.count as f64)
                .fold(1.0, f64::min);
            CredentialView {
                windows: c.windows.iter().map(ToString::to_string).collect(),
                windows_full: c.windows.iter().any(|w| w.frees_at.is_some()),
                headroom_sort: headroom,
                cooldown: cooldown_left.map(duration),
                cooldown_sort: cooldown_left.unwrap_or(0.0),
                in_flight: c.in_flight,
                max_concurrent_uses: c.max_concurrent_uses,
                success_rate: format!("{:.1} %", c.health.success_rate * 100.0),
                success_sort: c.health.success_rate,
                rate_limits: format!("{:.1}", c.health.rate_limits),
                rate_limits_sort: c.health.rate_limits,
                last_used: idle.map(|s| format!("{} ago", duration(s))),
                last_used_sort: idle.unwrap_or(f64::MAX),
                token: c.oauth.as_ref().zip(token_left).map(|(o, left)| {
                    let when = if left > 0.0 {
                        format!("in {}", duration(left))
                    } else {
                        format!("expired {} ago", duration(-left))
                    };
                    format!("{when} (generation {})", o.generation)
                }),
                token_sort: token_left.unwrap_or(f64::MAX),
                token_error: c.oauth.as_ref().and_then(|o| o.last_error.clone()),
                key_id: c.key_id,
                provider: c.provider,
                pool: c.pool,
                status: c.status,
                draining: c.draining,
                status_reason: c.status_reason,
            }
        })
        .collect();
    render(
        "credentials.html",
        context!(credentials => Serde(&views), truncated, max => MAX_CREDENTIALS),
    )
}

/// One lease's row.
#[derive(Debug, Serialize)]
struct LeaseViewRow {
    #[serde(flatten)]
    holding: store::dashboard::LeaseHolding,
    age: Option<String>,
    left: String,
    probe: bool,
    fence: Option<i64>,
    expired: bool,
}

/// Leases: held ones with holder, age and time left; ones that expired without a release in the
/// last hour, highlighted (their executor likely crashed).
async fn leases(State(state): State<AppState>, _admin: AdminKey) -> Result<Response, ApiError> {
    let (rows, now) = store::dashboard::leases(&state.db).await?;
    let views: Vec<LeaseViewRow> = rows
        .into_iter()
        .map(|l| LeaseViewRow {
            age: l.granted_at.map(|at| duration(seconds_between(at, now))),
            left: if l.expired {
                format!(
                    "expired {} ago",
                    duration(seconds_between(l.lease_until, now))
                )
            } else {
                duration(seconds_between(now, l.lease_until))
            },
            holding: l.holding,
            probe: l.probe,
            fence: l.fence,
            expired: l.expired,
        })
        .collect();
    let held = views.iter().filter(|l| !l.expired).count();
    render(
        "leases.html",
        context!(leases => Serde(&views), held, max_held => store::dashboard::MAX_HELD_LEASES),
    )
}

/// One event's row.
#[derive(Debug, Serialize)]
struct EventView {
    at: String,
    key_id: String,
    event: String,
    change: Option<String>,
    reason: Option<String>,
    actor: Option<String>,
    lease_id: Option<String>,
}

/// Recent events: health transitions, operator actions and forced releases, newest first.
async fn events(State(state): State<AppState>, _admin: AdminKey) -> Result<Response, ApiError> {
    let clock = time::macros::format_description!("[hour]:[minute]:[second]");
    let views: Vec<EventView> = store::dashboard::events(&state.db)
        .await?
        .into_iter()
        .map(|e| EventView {
            at: e.at.format(&clock).unwrap_or_default(),
            change: match (&e.old_status, &e.new_status) {
                (Some(old), Some(new)) if old != new => Some(format!("{old} → {new}")),
                (_, Some(new)) => Some(new.clone()),
                _ => None,
            },
            key_id: e.key_id,
            event: e.event,
            reason: e.reason,
            actor: e.actor,
            lease_id: e.lease_id,
        })
        .collect();
    render("events.html", context!(events => Serde(&views)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_template_parses_and_renders_empty() {
        for name in [
            "pools.html",
            "credentials.html",
            "leases.html",
            "events.html",
        ] {
            let template = TEMPLATES.get_template(name).unwrap();
            template.render(context!()).unwrap();
        }
    }

    #[test]
    fn durations_read_as_seconds_minutes_hours() {
        assert_eq!(duration(-3.0), "0 s");
        assert_eq!(duration(42.4), "42 s");
        assert_eq!(duration(185.0), "3 m 05 s");
        assert_eq!(duration(7620.0), "2 h 07 m");
    }

    #[test]
    fn sparkline_spans_the_box_and_clamps() {
        let points = sparkline(&[0.0; SPARK_MINUTES]);
        assert!(points.starts_with("0.0,23.0 "), "{points}");
        assert!(points.ends_with(" 120.0,23.0"), "{points}");
        assert_eq!(sparkline(&[2.0]), "0.0,1.0");
    }
}
