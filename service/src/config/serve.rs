//! `credpool serve`: the listener, request limits, database pool, claim batching, scoring,
//! health and cleanup settings, and the [`ServiceSettings`] the service is built from.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{DatabaseArgs, SecretArgs, load_secret_file};
use crate::allocator::ClaimSettings;
use crate::allocator::groups::GroupSettings;
use crate::allocator::scoring::ScoringPolicy;
use crate::domain::health::HealthPolicy;
use crate::http::server::HttpLimits;

/// How often the cleanup runs and what it keeps.
#[derive(Debug, Clone, Args)]
pub struct MaintenanceArgs {
    /// Seconds between cleanup passes run by the service itself (only where pg_cron does not run
    /// them; with several replicas, one runs each pass).
    #[arg(long, env = "CREDPOOL_MAINTENANCE_INTERVAL_SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub maintenance_interval_seconds: u64,

    /// Days of audit history to keep.
    #[arg(long, env = "CREDPOOL_AUDIT_RETENTION_DAYS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=36_500))]
    pub audit_retention_days: u64,
}

impl MaintenanceArgs {
    /// The retention as a duration.
    pub(crate) fn retention(&self) -> Duration {
        Duration::from_secs(self.audit_retention_days * 86_400)
    }
}

/// `credpool serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Database settings.
    #[command(flatten)]
    pub db: DatabaseArgs,

    /// Master keys.
    #[command(flatten)]
    pub secrets: SecretArgs,

    /// Cleanup schedule.
    #[command(flatten)]
    pub maintenance: MaintenanceArgs,

    /// Seconds after SIGINT/SIGTERM during which `/readyz` answers 503 `shutting_down` while
    /// every request is still served, so that load balancers stop routing here before the
    /// listener closes (the first phase of a shutdown; a second signal skips it).
    #[arg(long, env = "CREDPOOL_SHUTDOWN_DELAY_SECONDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub shutdown_delay_seconds: u64,

    /// Seconds in-flight requests get to finish once the listener has closed (after the delay);
    /// waiting allocations answer 429 when they are over, and the service stops.
    #[arg(long, env = "CREDPOOL_SHUTDOWN_DRAIN_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub shutdown_drain_seconds: u64,

    /// Seconds between samples of the per-pool gauges (leases in flight, free slots, credentials
    /// by status) from PostgreSQL.
    #[arg(long, env = "CREDPOOL_METRICS_SAMPLE_SECONDS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub metrics_sample_seconds: u64,

    /// Address to listen on, `host:port` (`localhost:8080`, `0.0.0.0:8080`, `[::1]:8080`); port
    /// 0 picks a free port, printed at start-up.
    #[arg(long, env = "CREDPOOL_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,

    /// The key executors send in `X-Internal-Key`. Required with DATABASE_URL; generated and
    /// stored in the data directory with the embedded default.
    #[arg(long, env = "CREDPOOL_INTERNAL_KEY", hide_env_values = true)]
    pub internal_key: Option<String>,

    /// The key operators send in `X-Admin-Key` (must differ from the internal key). Required with
    /// DATABASE_URL; generated and stored in the data directory with the embedded default.
    #[arg(long, env = "CREDPOOL_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,

    /// A file holding the internal key, instead of --internal-key: one line (a trailing newline is
    /// dropped), readable by its owner (and group) only.
    #[arg(
        long,
        env = "CREDPOOL_INTERNAL_KEY_FILE",
        conflicts_with = "internal_key"
    )]
    pub internal_key_file: Option<PathBuf>,

    /// A file holding the admin key, instead of --admin-key: one line (a trailing newline is
    /// dropped), readable by its owner (and group) only.
    #[arg(long, env = "CREDPOOL_ADMIN_KEY_FILE", conflicts_with = "admin_key")]
    pub admin_key_file: Option<PathBuf>,

    /// Service behaviour.
    #[command(flatten)]
    pub service: ServiceArgs,
}

impl ServeArgs {
    /// Reads the `_FILE` settings into the values they stand for.
    pub fn load_secret_files(&mut self) -> anyhow::Result<()> {
        self.db.load_secret_files()?;
        load_secret_file(
            &mut self.internal_key,
            &self.internal_key_file,
            "CREDPOOL_INTERNAL_KEY_FILE",
        )?;
        load_secret_file(
            &mut self.admin_key,
            &self.admin_key_file,
            "CREDPOOL_ADMIN_KEY_FILE",
        )
    }
}

/// Behaviour of the lease API.
#[derive(Debug, Clone, Args)]
pub struct ServiceArgs {
    /// Longest lease (and renewal) an executor may ask for, in seconds.
    #[arg(long, env = "CREDPOOL_MAX_LEASE_SECONDS", default_value_t = ServiceSettings::default().max_lease_seconds,
          value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub max_lease_seconds: u32,

    /// Candidates handed to the first claim statement (the top of the ranking); a request that
    /// misses retries while its view shows untried free candidates, doubling the batch.
    #[arg(long, env = "CREDPOOL_CLAIM_BATCH", default_value_t = ServiceSettings::default().claims.batch as u32,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub claim_batch: u32,

    /// Claims a request makes on candidates its view believes full (in case the view is stale)
    /// before answering 429.
    #[arg(long, env = "CREDPOOL_CLAIM_ATTEMPTS", default_value_t = ServiceSettings::default().claims.attempts as u32,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub claim_attempts: u32,

    /// Milliseconds a request may take before it is answered 503 `store_unavailable` (a slow or
    /// unreachable database never hangs a caller longer).
    #[arg(long, env = "CREDPOOL_REQUEST_TIMEOUT_MS", default_value_t = ServiceSettings::default().request_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub request_timeout_ms: u64,

    /// Longest wait for a slot an allocate may ask for (`wait_ms`), in milliseconds; longer asks
    /// wait this long. 0 turns waiting off.
    #[arg(long, env = "CREDPOOL_MAX_WAIT_MS", default_value_t = ServiceSettings::default().max_wait.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub max_wait_ms: u64,

    /// PostgreSQL URL of the one connection each service process LISTENs on for freed slots
    /// (waiting allocations). Default: a connection like the service's others. With `--db-pooler
    /// transaction` set it to a URL that reaches PostgreSQL directly (a transaction pooler cannot
    /// carry LISTEN); without it, waiting allocations there wake on their timers and this
    /// process's own releases only.
    #[arg(long, env = "CREDPOOL_DB_LISTEN_URL", hide_env_values = true)]
    pub db_listen_url: Option<String>,

    /// Free candidates one ranking considers: a pool with more free credentials is ranked over a
    /// window of this many, starting at a random place, so allocation cost stays flat with pool
    /// size.
    #[arg(long, env = "CREDPOOL_RANK_WINDOW", default_value_t = ServiceSettings::default().claims.rank_window as u32,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub rank_window: u32,

    /// How often each candidate view is re-read from the database, in milliseconds (it is also
    /// re-read whenever a claim reports that its pool changed).
    #[arg(long, env = "CREDPOOL_VIEW_REFRESH_MS", default_value_t = ServiceSettings::default().view_refresh.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub view_refresh_ms: u64,

    /// Most claims (or releases, or renewals) run in one transaction with one commit (group
    /// claiming); 1 turns grouping off.
    #[arg(long, env = "CREDPOOL_GROUP_MAX_SIZE", default_value_t = GroupSettings::default().max_size as u32,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub group_max_size: u32,

    /// Microseconds a group waits for more operations once it has its first, while another group
    /// of its kind is in flight; 0 sends what is queued at once. A lone request is never delayed.
    #[arg(long, env = "CREDPOOL_GROUP_WAIT_US", default_value_t = GroupSettings::default().max_wait.as_micros() as u64,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub group_wait_us: u64,

    /// Group transactions of each kind (claims, releases, renewals) in flight at once; each holds
    /// one database connection while it runs.
    #[arg(long, env = "CREDPOOL_GROUP_TRANSACTIONS", default_value_t = GroupSettings::default().transactions as u32,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub group_transactions: u32,

    /// How often each service process looks for OAuth access tokens due for a refresh, in
    /// milliseconds.
    #[arg(long, env = "CREDPOOL_OAUTH_CHECK_MS", default_value_t = crate::oauth::OAuthSettings::default().check_every.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub oauth_check_ms: u64,

    /// The longest a call to an OAuth token endpoint may take, connect included, in seconds. The
    /// "refresh in progress" marker that keeps other replicas off lasts three times this (at
    /// least 30 s), so that it only expires under a writer that stopped.
    #[arg(long, env = "CREDPOOL_OAUTH_CALL_TIMEOUT_SECONDS", default_value_t = crate::oauth::OAuthSettings::default().call_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=300))]
    pub oauth_call_timeout_seconds: u64,

    /// The longest delay between retries of a failing OAuth refresh, in seconds (the first retry
    /// comes after 1 s, each next one after twice as long, with jitter).
    #[arg(long, env = "CREDPOOL_OAUTH_BACKOFF_MAX_SECONDS", default_value_t = crate::oauth::OAuthSettings::default().backoff_max.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub oauth_backoff_max_seconds: u64,

    /// Lets an OAuth credential's https `token_url` reach a private (RFC 1918, unique local),
    /// loopback, link-local (cloud metadata services answer there) or otherwise non-public
    /// address: its host as stored, and every address its name resolves to at each refresh.
    /// Off by default: an operator's typo or a hostile PUT cannot point the refresher at an
    /// internal service. (http on a loopback address is always allowed, for local token
    /// proxies and tests.)
    #[arg(long, env = "CREDPOOL_OAUTH_ALLOW_PRIVATE_TOKEN_URLS")]
    pub oauth_allow_private_token_urls: bool,

    /// Seconds a client has to send a request head whole, from its first byte; also how long a
    /// new connection may stay silent before its first request. Then the service closes the
    /// connection (sockets that send nothing or half a request cannot hold descriptors).
    #[arg(long, env = "CREDPOOL_HTTP_HEADER_READ_TIMEOUT_SECONDS", default_value_t = HttpLimits::default().header_read_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub http_header_read_timeout_seconds: u64,

    /// Seconds a keep-alive connection stays open with no request before the service closes it.
    /// Keep it longer than the idle timeout of the load balancer in front (60 s on many), so that
    /// the balancer closes first.
    #[arg(long, env = "CREDPOOL_HTTP_IDLE_TIMEOUT_SECONDS", default_value_t = HttpLimits::default().idle_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub http_idle_timeout_seconds: u64,

    /// HTTP connections open at once. At the cap, a new connection closes the oldest one that
    /// has no request in flight (so probes and executors get in however many idle sockets are
    /// open); when every one has a request in flight, accepting waits. Lowered at start-up to fit
    /// the open-file limit (`ulimit -n`) less the database pool and 64 for the rest.
    #[arg(long, env = "CREDPOOL_HTTP_MAX_CONNECTIONS", default_value_t = HttpLimits::default().max_connections as u32,
          value_parser = clap::value_parser!(u32).range(16..=1_000_000))]
    pub http_max_connections: u32,

    /// Scoring weights.
    #[command(flatten)]
    pub scoring: ScoringArgs,

    /// How outcome reports change health.
    #[command(flatten)]
    pub health: HealthArgs,
}

impl ServiceArgs {
    /// The settings these flags describe.
    pub fn settings(&self) -> ServiceSettings {
        ServiceSettings {
            max_lease_seconds: self.max_lease_seconds,
            claims: ClaimSettings {
                batch: self.claim_batch as usize,
                attempts: self.claim_attempts as usize,
                rank_window: self.rank_window as usize,
            },
            view_refresh: Duration::from_millis(self.view_refresh_ms),
            groups: GroupSettings {
                max_size: self.group_max_size as usize,
                max_wait: Duration::from_micros(self.group_wait_us),
                transactions: self.group_transactions as usize,
            },
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            max_wait: Duration::from_millis(self.max_wait_ms),
            listen_url: self.db_listen_url.clone(),
            http: HttpLimits {
                header_read_timeout: Duration::from_secs(self.http_header_read_timeout_seconds),
                idle_timeout: Duration::from_secs(self.http_idle_timeout_seconds),
                max_connections: self.http_max_connections as usize,
            },
            scoring: self.scoring.policy(),
            health: self.health.policy(),
            oauth: crate::oauth::OAuthSettings {
                check_every: Duration::from_millis(self.oauth_check_ms),
                call_timeout: Duration::from_secs(self.oauth_call_timeout_seconds),
                claim_for: Duration::from_secs((3 * self.oauth_call_timeout_seconds).max(30)),
                backoff_max: Duration::from_secs(self.oauth_backoff_max_seconds),
                allow_private_token_urls: self.oauth_allow_private_token_urls,
                ..crate::oauth::OAuthSettings::default()
            },
        }
    }
}

/// How the lease API behaves: the parsed form of [`ServiceArgs`]. The defaults of every flag come
/// from here and from the policies' defaults.
#[derive(Debug, Clone)]
pub struct ServiceSettings {
    /// Longest lease (and renewal) an executor may ask for, in seconds.
    pub max_lease_seconds: u32,
    /// Candidates per claim statement, and claims per pool and request.
    pub claims: ClaimSettings,
    /// How often candidate views are re-read.
    pub view_refresh: Duration,
    /// How claims, releases and renewals are grouped into transactions.
    pub groups: GroupSettings,
    /// The longest a request may take before it is answered 503.
    pub request_timeout: Duration,
    /// The longest an allocate may wait for a slot.
    pub max_wait: Duration,
    /// Where waiting allocations LISTEN (`None`: a connection like the service's others).
    pub listen_url: Option<String>,
    /// The limits on HTTP connections.
    pub http: HttpLimits,
    /// Scoring weights.
    pub scoring: ScoringPolicy,
    /// How outcome reports change health.
    pub health: HealthPolicy,
    /// How OAuth access tokens are refreshed.
    pub oauth: crate::oauth::OAuthSettings,
}

impl Default for ServiceSettings {
    /// Leases up to 3600 s; 8 candidates in the first claim; views re-read every 5 s; the
    /// grouping defaults; requests
    /// answered within 10 s; waits of up to 30 s; the policies' defaults.
    fn default() -> Self {
        Self {
            max_lease_seconds: 3600,
            claims: ClaimSettings::default(),
            view_refresh: Duration::from_secs(5),
            groups: GroupSettings::default(),
            request_timeout: Duration::from_secs(10),
            max_wait: Duration::from_secs(30),
            listen_url: None,
            http: HttpLimits::default(),
            scoring: ScoringPolicy::default(),
            health: HealthPolicy::default(),
            oauth: crate::oauth::OAuthSettings::default(),
        }
    }
}

fn non_negative(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("`{value}` is not a finite number >= 0")),
    }
}

fn positive(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{value}` is not a finite number > 0")),
    }
}

/// The weights of the score (see `docs/selection.md`). Defaults: [`ScoringPolicy::default`].
#[derive(Debug, Clone, Args)]
pub struct ScoringArgs {
    /// Weight of the free share of a credential's slots.
    #[arg(long, env = "CREDPOOL_SCORE_CAPACITY_WEIGHT", default_value_t = ScoringPolicy::default().capacity_weight, value_parser = non_negative)]
    pub score_capacity_weight: f64,
    /// Weight of idle time (since the last lease, capped).
    #[arg(long, env = "CREDPOOL_SCORE_IDLE_WEIGHT", default_value_t = ScoringPolicy::default().idle_weight, value_parser = non_negative)]
    pub score_idle_weight: f64,
    /// Weight of rate-window headroom (the share of its tightest window a credential has left).
    #[arg(long, env = "CREDPOOL_SCORE_HEADROOM_WEIGHT", default_value_t = ScoringPolicy::default().headroom_weight, value_parser = non_negative)]
    pub score_headroom_weight: f64,
    /// Weight of the decayed success rate.
    #[arg(long, env = "CREDPOOL_SCORE_SUCCESS_WEIGHT", default_value_t = ScoringPolicy::default().success_weight, value_parser = non_negative)]
    pub score_success_weight: f64,
    /// Weight of recent failures.
    #[arg(long, env = "CREDPOOL_SCORE_ERROR_WEIGHT", default_value_t = ScoringPolicy::default().error_weight, value_parser = non_negative)]
    pub score_error_weight: f64,
    /// Weight of recent rate limits.
    #[arg(long, env = "CREDPOOL_SCORE_RATE_LIMIT_WEIGHT", default_value_t = ScoringPolicy::default().rate_limit_weight, value_parser = non_negative)]
    pub score_rate_limit_weight: f64,
    /// Weight of a recent recovery from cooldown.
    #[arg(long, env = "CREDPOOL_SCORE_COOLDOWN_WEIGHT", default_value_t = ScoringPolicy::default().cooldown_weight, value_parser = non_negative)]
    pub score_cooldown_weight: f64,
    /// Flat penalty when a credential's last success is missing or older than the freshness age.
    #[arg(long, env = "CREDPOOL_SCORE_FRESHNESS_PENALTY", default_value_t = ScoringPolicy::default().freshness_penalty, value_parser = non_negative)]
    pub score_freshness_penalty: f64,
    /// Jitter amplitude, relative to the score range (0 = deterministic order).
    #[arg(long, env = "CREDPOOL_SCORE_JITTER", default_value_t = ScoringPolicy::default().jitter, value_parser = non_negative)]
    pub score_jitter: f64,
    /// Idle time at which idle counts in full, in seconds.
    #[arg(long, env = "CREDPOOL_SCORE_IDLE_CAP_SECONDS", default_value_t = ScoringPolicy::default().idle_cap_seconds, value_parser = positive)]
    pub score_idle_cap_seconds: f64,
    /// Age beyond which a last success is no longer fresh, in seconds.
    #[arg(long, env = "CREDPOOL_SCORE_FRESHNESS_MAX_AGE_SECONDS", default_value_t = ScoringPolicy::default().freshness_max_age_seconds, value_parser = positive)]
    pub score_freshness_max_age_seconds: f64,
    /// Seconds over which the penalty of a recent recovery fades.
    #[arg(long, env = "CREDPOOL_SCORE_COOLDOWN_PENALTY_SECONDS", default_value_t = ScoringPolicy::default().cooldown_penalty_seconds, value_parser = positive)]
    pub score_cooldown_penalty_seconds: f64,
}

impl ScoringArgs {
    /// The policy these flags describe.
    pub(crate) fn policy(&self) -> ScoringPolicy {
        ScoringPolicy {
            capacity_weight: self.score_capacity_weight,
            idle_weight: self.score_idle_weight,
            headroom_weight: self.score_headroom_weight,
            success_weight: self.score_success_weight,
            error_weight: self.score_error_weight,
            rate_limit_weight: self.score_rate_limit_weight,
            cooldown_weight: self.score_cooldown_weight,
            freshness_penalty: self.score_freshness_penalty,
            jitter: self.score_jitter,
            idle_cap_seconds: self.score_idle_cap_seconds,
            freshness_max_age_seconds: self.score_freshness_max_age_seconds,
            cooldown_penalty_seconds: self.score_cooldown_penalty_seconds,
            ..ScoringPolicy::default()
        }
    }
}

/// How outcome reports change health (see `docs/selection.md`). Defaults:
/// [`HealthPolicy::default`].
#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// Half-life of the outcome counters, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_HALF_LIFE_SECONDS", default_value_t = HealthPolicy::default().half_life_seconds, value_parser = positive)]
    pub health_half_life_seconds: f64,
    /// Failures within the failure window that put a credential in cooldown.
    #[arg(long, env = "CREDPOOL_HEALTH_FAILURE_THRESHOLD", default_value_t = HealthPolicy::default().failure_threshold,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub health_failure_threshold: u32,
    /// The failure window, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_FAILURE_WINDOW_SECONDS", default_value_t = HealthPolicy::default().failure_window_seconds, value_parser = positive)]
    pub health_failure_window_seconds: f64,
    /// The first cooldown, in seconds; doubles with each cooldown before a recovery.
    #[arg(long, env = "CREDPOOL_HEALTH_COOLDOWN_SECONDS", default_value_t = HealthPolicy::default().cooldown_seconds, value_parser = positive)]
    pub health_cooldown_seconds: f64,
    /// The longest cooldown, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_MAX_COOLDOWN_SECONDS", default_value_t = HealthPolicy::default().max_cooldown_seconds, value_parser = positive)]
    pub health_max_cooldown_seconds: f64,
    /// Rest after a `rate_limited` report without retry_after_seconds, in seconds.
    #[arg(long, env = "CREDPOOL_HEALTH_RATE_LIMIT_SECONDS", default_value_t = HealthPolicy::default().rate_limit_seconds, value_parser = positive)]
    pub health_rate_limit_seconds: f64,
    /// The longest one outcome report may rest a credential, in seconds (1..=2,678,400): a
    /// release's `retry_after_seconds` beyond it is clamped to it (the trail records the clamp),
    /// and it is the rest of a `quota_exhausted` report without one from a tenant whose reports
    /// may not disable. Keeps one tenant's reports from resting every credential for a month.
    #[arg(long, env = "CREDPOOL_MAX_REPORT_REST_SECONDS", default_value_t = HealthPolicy::default().max_report_rest_seconds as u32,
          value_parser = clap::value_parser!(u32).range(1..=2_678_400))]
    pub max_report_rest_seconds: u32,
}

impl HealthArgs {
    /// The policy these flags describe.
    pub(crate) fn policy(&self) -> HealthPolicy {
        HealthPolicy {
            half_life_seconds: self.health_half_life_seconds,
            failure_threshold: self.health_failure_threshold,
            failure_window_seconds: self.health_failure_window_seconds,
            cooldown_seconds: self.health_cooldown_seconds,
            max_cooldown_seconds: self.health_max_cooldown_seconds,
            rate_limit_seconds: self.health_rate_limit_seconds,
            max_report_rest_seconds: f64::from(self.max_report_rest_seconds),
        }
    }
}
