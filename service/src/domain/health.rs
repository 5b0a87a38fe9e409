//! Credential health: how an executor's outcome report changes a credential's state. Pure: the
//! database clock and the policy are parameters; the store applies the result in the same
//! transaction as the release.
//!
//! The state machine (also in `docs/selection.md`), for a report on a lease of a credential whose
//! status is S ("recovering" = S is `rate_limited`, `cooldown` or `exhausted` and its
//! cooldown_until has passed, so it is serving its single probe lease):
//!
//! | outcome | S = available | S recovering | S cooling (cooldown_until in the future) | S disabled / pending |
//! | --- | --- | --- | --- | --- |
//! | success | counts | -> available (recovered; backoff resets) | counts | counts |
//! | failure | counts; the Nth failure within the window -> cooldown for the backoff | the probe's failure -> cooldown for the next, longer backoff; other leases count | counts | counts |
//! | rate_limited | -> rate_limited until max(cooldown_until, now + retry_after or default) | same, at least the next backoff if it was the probe | same (never shortens) | counts |
//! | auth_error, may disable | -> disabled | -> disabled | -> disabled | -> disabled (stays) |
//! | auth_error, may not | counts as a failure; -> cooldown for the backoff | same | same (never shortens) | counts |
//! | auth_expired (OAuth) | stays | stays | stays | stays |
//! | quota_exhausted | -> exhausted until now + retry_after, or (may disable) until an operator acts, or (may not) for the longest rest | same | same | disabled stays; pending -> exhausted |
//!
//! **Reach**: a report is an executor's word, and an executor of one tenant must not
//! take every other tenant's credentials out of traffic. So a report rests a credential for at
//! most [`HealthPolicy::max_report_rest_seconds`] (a longer `retry_after_seconds` is clamped, and
//! the transition says so: [`Transition::clamped_from`]), and only a reporter the operator allows
//! ([`Report::may_disable`]: the configured internal key, or a tenant with `reports_may_disable`)
//! may take a credential out of traffic until an operator acts. A credential that stays bad is
//! found again by its probe lease when the rest ends, and rested again.
//!
//! `auth_expired` on an OAuth credential says its access token was rejected, not the credential:
//! the release takes that token out of traffic until its refresh (sql/release.sql, RELEASE), and
//! health does not change. On any other credential the store applies it as `auth_error`.
//!
//! "counts" means the decaying counters (successes, failures, rate limits) and the liveness time
//! move, and the status does not. `exhausted` without a retry_after stays until an operator acts.

use time::{Duration, OffsetDateTime};

use crate::domain::{Outcome, Status};

/// How outcome reports turn into health. Defaults in [`HealthPolicy::default`].
#[derive(Debug, Clone, PartialEq)]
pub struct HealthPolicy {
    /// Half-life of the outcome counters, in seconds: a report counts half as much after this long.
    pub half_life_seconds: f64,
    /// Failures within [`HealthPolicy::failure_window_seconds`] that put a credential in cooldown.
    pub failure_threshold: u32,
    /// The window of the failure rule, in seconds.
    pub failure_window_seconds: f64,
    /// The first cooldown after failures (or a failed probe), in seconds; each further cooldown
    /// without a recovery in between doubles it.
    pub cooldown_seconds: f64,
    /// The longest cooldown the backoff reaches, in seconds.
    pub max_cooldown_seconds: f64,
    /// The rest after a `rate_limited` report without `retry_after_seconds`, in seconds.
    pub rate_limit_seconds: f64,
    /// The longest rest one report may give a credential, in seconds: a `retry_after_seconds`
    /// beyond it is clamped to it (`rate_limited`, `quota_exhausted`), and it is the rest of a
    /// `quota_exhausted` without one from a reporter that may not disable.
    pub max_report_rest_seconds: f64,
}

impl Default for HealthPolicy {
    /// Half-life 600 s; 5 failures within 60 s; cooldown 60 s doubling up to 900 s; rate limits
    /// rest 30 s unless the report says otherwise; no report rests a credential longer than an
    /// hour.
    fn default() -> Self {
        Self {
            half_life_seconds: 600.0,
            failure_threshold: 5,
            failure_window_seconds: 60.0,
            cooldown_seconds: 60.0,
            max_cooldown_seconds: 900.0,
            rate_limit_seconds: 30.0,
            max_report_rest_seconds: 3600.0,
        }
    }
}

impl HealthPolicy {
    /// The cooldown after `cooldowns_in_a_row` earlier ones: base x 2^n, capped.
    pub fn backoff(&self, cooldowns_in_a_row: i32) -> Duration {
        let doubled = self.cooldown_seconds * 2f64.powi(cooldowns_in_a_row.clamp(0, 30));
        Duration::seconds_f64(doubled.min(self.max_cooldown_seconds).max(1.0))
    }

    /// The rest a report's `retry_after_seconds` gives, in seconds: `seconds`, at most
    /// [`HealthPolicy::max_report_rest_seconds`]; sets `clamped_from` when it was longer.
    fn clamp_rest(&self, seconds: u32, clamped_from: &mut Option<u32>) -> f64 {
        let bound = self.max_report_rest_seconds.max(1.0);
        if f64::from(seconds) > bound {
            *clamped_from = Some(seconds);
            bound
        } else {
            f64::from(seconds)
        }
    }

    /// `0.5^(elapsed / half-life)`: what a count is worth after `elapsed`.
    pub fn decay_factor(&self, elapsed: Duration) -> f64 {
        let seconds = elapsed.as_seconds_f64().max(0.0);
        if self.half_life_seconds <= 0.0 {
            return if seconds > 0.0 { 0.0 } else { 1.0 };
        }
        0.5f64.powf(seconds / self.half_life_seconds)
    }
}

/// A credential's health, as stored in its row.
#[derive(Debug, Clone, PartialEq)]
pub struct Health {
    /// Health status.
    pub status: Status,
    /// Why the status is what it is.
    pub status_reason: Option<String>,
    /// When a cooling credential may be probed again.
    pub cooldown_until: Option<OffsetDateTime>,
    /// Decaying count of successes, as of `decayed_at`.
    pub successes: f64,
    /// Decaying count of failures, as of `decayed_at`.
    pub failures: f64,
    /// Decaying count of rate limits, as of `decayed_at`.
    pub rate_limits: f64,
    /// When the counters were last decayed.
    pub decayed_at: Option<OffsetDateTime>,
    /// The most recent failure times (at most the failure threshold), oldest first.
    pub recent_failures: Vec<OffsetDateTime>,
    /// Cooldowns since the credential last recovered.
    pub cooldowns_in_a_row: i32,
    /// The last successful use or probe.
    pub last_success_at: Option<OffsetDateTime>,
    /// When it last recovered from a cooldown.
    pub recovered_at: Option<OffsetDateTime>,
}

impl Health {
    /// A credential nobody has reported on yet.
    pub fn new(status: Status) -> Self {
        Self {
            status,
            status_reason: None,
            cooldown_until: None,
            successes: 0.0,
            failures: 0.0,
            rate_limits: 0.0,
            decayed_at: None,
            recent_failures: Vec::new(),
            cooldowns_in_a_row: 0,
            last_success_at: None,
            recovered_at: None,
        }
    }

    /// Whether the credential may be leased at `now` (the SQL function `credential_usable`).
    pub fn usable(&self, now: OffsetDateTime) -> bool {
        match self.usable_from() {
            UsableFrom::Always => true,
            UsableFrom::At(at) => at <= now,
            UsableFrom::Never => false,
        }
    }

    /// From when the credential may be leased, under the rule of [`status_usable`].
    pub fn usable_from(&self) -> UsableFrom {
        match self.status {
            Status::Available => UsableFrom::Always,
            Status::RateLimited | Status::Cooldown | Status::Exhausted => self
                .cooldown_until
                .map_or(UsableFrom::Never, UsableFrom::At),
            Status::Pending | Status::Disabled => UsableFrom::Never,
        }
    }

    /// Whether the credential is back from a cooldown but has not proven itself yet: it serves a
    /// single probe lease at a time.
    pub fn recovering(&self, now: OffsetDateTime) -> bool {
        self.status != Status::Available && self.usable(now)
    }

    /// When a credential that is not usable now becomes usable on its own: the end of its
    /// cooldown (the SQL function `credential_recovers_at`); `None` when usable now or when it
    /// waits for an operator.
    pub fn recovers_at(&self, now: OffsetDateTime) -> Option<OffsetDateTime> {
        match self.usable_from() {
            UsableFrom::At(at) if at > now => Some(at),
            _ => None,
        }
    }

    /// The counters (successes, failures, rate limits) decayed to `now`.
    pub fn counters_at(&self, now: OffsetDateTime, policy: &HealthPolicy) -> (f64, f64, f64) {
        let factor = self
            .decayed_at
            .map_or(1.0, |at| policy.decay_factor(now - at));
        (
            self.successes * factor,
            self.failures * factor,
            self.rate_limits * factor,
        )
    }
}

/// The usability rule of docs/design.md "Vocabulary" and of the SQL function `credential_usable`:
/// `available`; or `rate_limited` / `cooldown` / `exhausted` whose cooldown_until is known and has
/// passed. A test checks this against the SQL function for every status.
pub fn status_usable(
    status: Status,
    cooldown_until: Option<OffsetDateTime>,
    now: OffsetDateTime,
) -> bool {
    Health {
        cooldown_until,
        ..Health::new(status)
    }
    .usable(now)
}

/// From when a credential may be leased.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsableFrom {
    /// Now and always (`available`).
    Always,
    /// From the end of its cooldown on.
    At(OffsetDateTime),
    /// Not until an operator acts.
    Never,
}

/// An executor's report on one lease.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// What happened upstream.
    pub outcome: Outcome,
    /// The provider's `Retry-After`, in whole seconds (>= 1), if the executor passed it on.
    pub retry_after_seconds: Option<u32>,
    /// Whether the lease was the probe of a recovering credential.
    pub probe: bool,
    /// Whether the reporter may take the credential out of traffic until an operator acts
    /// (`auth_error` disables; `quota_exhausted` without a retry_after has no end): the
    /// configured internal key, or a tenant the operator allowed (`reports_may_disable`).
    pub may_disable: bool,
}

/// A change of status (or of a cooldown's end) that a report caused; written to the trail.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// Status before.
    pub old_status: Status,
    /// Status after.
    pub new_status: Status,
    /// Why, in words an operator reads.
    pub reason: String,
    /// The cooldown's end after the change.
    pub cooldown_until: Option<OffsetDateTime>,
    /// The `retry_after_seconds` the report asked for, when it was longer than
    /// [`HealthPolicy::max_report_rest_seconds`] and clamped to it.
    pub clamped_from: Option<u32>,
}

/// Applies `report` at `now` (database clock). Returns the new health and the transition, if the
/// status or the cooldown changed.
pub fn apply(
    health: &Health,
    report: Report,
    now: OffsetDateTime,
    policy: &HealthPolicy,
) -> (Health, Option<Transition>) {
    let (successes, failures, rate_limits) = health.counters_at(now, policy);
    let mut next = Health {
        successes,
        failures,
        rate_limits,
        decayed_at: Some(now),
        ..health.clone()
    };
    let recovering = health.recovering(now);
    let operator_hold = matches!(health.status, Status::Disabled | Status::Pending);
    let mut clamped_from = None;

    match report.outcome {
        Outcome::Success => {
            next.successes += 1.0;
            next.last_success_at = Some(now);
            if recovering {
                next.status = Status::Available;
                next.cooldown_until = None;
                next.cooldowns_in_a_row = 0;
                next.recovered_at = Some(now);
                next.status_reason = Some(if report.probe {
                    "probe succeeded".into()
                } else {
                    "success after the cooldown ended".into()
                });
            }
        }
        Outcome::Failure => {
            next.failures += 1.0;
            next.recent_failures.push(now);
            let keep = policy.failure_threshold.max(1) as usize;
            let excess = next.recent_failures.len().saturating_sub(keep);
            next.recent_failures.drain(..excess);
            let window_start = now - Duration::seconds_f64(policy.failure_window_seconds);
            let in_window = next
                .recent_failures
                .iter()
                .filter(|t| **t > window_start)
                .count();
            if recovering && report.probe {
                start_cooldown(&mut next, now, policy, "probe failed".into());
            } else if health.status == Status::Available && in_window >= keep {
                let reason = format!("{keep} failures within {} s", policy.failure_window_seconds);
                start_cooldown(&mut next, now, policy, reason);
            }
        }
        Outcome::RateLimited => {
            next.rate_limits += 1.0;
            if !operator_hold && health.status != Status::Exhausted {
                // 0 or absent means "use the default", never "no cooldown"
                let wait = match report.retry_after_seconds {
                    Some(seconds) if seconds >= 1 => policy.clamp_rest(seconds, &mut clamped_from),
                    _ => policy
                        .rate_limit_seconds
                        .min(policy.max_report_rest_seconds),
                };
                let mut until = now + Duration::seconds_f64(wait);
                if recovering && report.probe {
                    until = until.max(now + policy.backoff(health.cooldowns_in_a_row));
                    next.cooldowns_in_a_row = health.cooldowns_in_a_row.saturating_add(1);
                }
                // a shorter report never shortens a longer cooldown
                if let Some(existing) = health.cooldown_until {
                    until = until.max(existing);
                }
                next.status = Status::RateLimited;
                next.cooldown_until = Some(until);
                next.status_reason = Some(match clamped_from {
                    Some(asked) => format!(
                        "rate limited by the provider (rest {wait} s: the report's retry_after of {asked} s clamped by --max-report-rest-seconds)"
                    ),
                    None => format!("rate limited by the provider (rest {wait} s)"),
                });
            }
        }
        Outcome::AuthError if report.may_disable => {
            next.status = Status::Disabled;
            next.cooldown_until = None;
            next.status_reason =
                Some("auth_error reported: the provider rejected the credential".into());
        }
        // a reporter that may not disable: a failure that rests the credential for the backoff;
        // its probe finds out again when the rest ends
        Outcome::AuthError => {
            next.failures += 1.0;
            let waits_for_operator =
                health.status == Status::Exhausted && health.cooldown_until.is_none();
            if !operator_hold && !waits_for_operator {
                let rest = policy
                    .backoff(health.cooldowns_in_a_row)
                    .min(Duration::seconds_f64(
                        policy.max_report_rest_seconds.max(1.0),
                    ));
                let until = health
                    .cooldown_until
                    .map_or(now + rest, |e| e.max(now + rest));
                next.status = Status::Cooldown;
                next.cooldown_until = Some(until);
                next.cooldowns_in_a_row = health.cooldowns_in_a_row.saturating_add(1);
                next.recent_failures.clear();
                next.status_reason = Some(format!(
                    "auth_error reported by an executor that may not disable credentials; resting {} s",
                    rest.whole_seconds()
                ));
            }
        }
        // the token, not the credential: the release took the token out of traffic
        Outcome::AuthExpired => {}
        Outcome::QuotaExhausted => {
            if health.status != Status::Disabled {
                let rest = match report.retry_after_seconds.filter(|s| *s >= 1) {
                    Some(seconds) => Some(policy.clamp_rest(seconds, &mut clamped_from)),
                    None if report.may_disable => None,
                    None => Some(policy.max_report_rest_seconds),
                };
                next.status = Status::Exhausted;
                next.cooldown_until = rest.map(|s| now + Duration::seconds_f64(s.max(1.0)));
                next.status_reason = Some(match (rest, report.retry_after_seconds) {
                    (Some(_), Some(s)) if s >= 1 && clamped_from.is_none() => {
                        "quota exhausted until the provider's retry_after".into()
                    }
                    (Some(rest), Some(s)) if s >= 1 => format!(
                        "quota exhausted; the report's retry_after of {s} s clamped to {rest} s (--max-report-rest-seconds)"
                    ),
                    (Some(rest), _) => format!(
                        "quota exhausted; reported by an executor that may not rest a credential until an operator acts: resting {rest} s"
                    ),
                    (None, _) => "quota exhausted; waiting for an operator".into(),
                });
            }
        }
    }

    let transition = (next.status != health.status || next.cooldown_until != health.cooldown_until)
        .then(|| Transition {
            old_status: health.status,
            new_status: next.status,
            reason: next.status_reason.clone().unwrap_or_default(),
            cooldown_until: next.cooldown_until,
            clamped_from,
        });
    if transition.is_none() {
        // no transition: keep the stored reason as it was
        next.status_reason = health.status_reason.clone();
    }
    (next, transition)
}

fn start_cooldown(next: &mut Health, now: OffsetDateTime, policy: &HealthPolicy, reason: String) {
    let rest = policy.backoff(next.cooldowns_in_a_row);
    next.status = Status::Cooldown;
    next.cooldown_until = Some(now + rest);
    next.cooldowns_in_a_row = next.cooldowns_in_a_row.saturating_add(1);
    next.recent_failures.clear();
    next.status_reason = Some(format!("{reason}; resting {} s", rest.whole_seconds()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn report(outcome: Outcome) -> Report {
        Report {
            outcome,
            retry_after_seconds: None,
            probe: false,
            may_disable: true,
        }
    }

    /// What `report` makes of an available credential at `now()`.
    fn from_available(report: Report, policy: &HealthPolicy) -> (Health, Option<Transition>) {
        apply(&Health::new(Status::Available), report, now(), policy)
    }

    /// An available credential after `count` failures, one every `every_seconds` from `now()`;
    /// panics if any of them changes its status.
    fn failures_without_a_transition(
        count: i64,
        every_seconds: i64,
        policy: &HealthPolicy,
    ) -> Health {
        let mut health = Health::new(Status::Available);
        for i in 0..count {
            let at = now() + Duration::seconds(i * every_seconds);
            let (next, transition) = apply(&health, report(Outcome::Failure), at, policy);
            assert!(transition.is_none(), "failure {i}");
            health = next;
        }
        health
    }

    fn cooling(status: Status, ends_in_seconds: i64) -> Health {
        Health {
            cooldown_until: Some(now() + Duration::seconds(ends_in_seconds)),
            ..Health::new(status)
        }
    }

    #[test]
    fn success_counts_and_refreshes_liveness_without_a_transition() {
        let (next, transition) = from_available(report(Outcome::Success), &HealthPolicy::default());
        assert_eq!(next.successes, 1.0);
        assert_eq!(next.last_success_at, Some(now()));
        assert_eq!(next.status, Status::Available);
        assert!(transition.is_none());
    }

    #[test]
    fn counters_halve_after_one_half_life() {
        let policy = HealthPolicy::default();
        let mut health = Health::new(Status::Available);
        health.failures = 4.0;
        health.decayed_at = Some(now());
        let later = now() + Duration::seconds_f64(policy.half_life_seconds);
        let (_, failures, _) = health.counters_at(later, &policy);
        assert!((failures - 2.0).abs() < 1e-9, "{failures}");
    }

    #[test]
    fn a_single_failure_does_not_cool_a_credential_down() {
        let (next, transition) = from_available(report(Outcome::Failure), &HealthPolicy::default());
        assert_eq!(next.status, Status::Available);
        assert_eq!(next.failures, 1.0);
        assert!(transition.is_none());
    }

    #[test]
    fn the_fifth_failure_within_sixty_seconds_starts_a_cooldown() {
        let policy = HealthPolicy::default();
        let health = failures_without_a_transition(4, 10, &policy);
        let at = now() + Duration::seconds(45);
        let (next, transition) = apply(&health, report(Outcome::Failure), at, &policy);
        assert_eq!(next.status, Status::Cooldown);
        assert_eq!(next.cooldown_until, Some(at + Duration::seconds(60)));
        assert_eq!(next.cooldowns_in_a_row, 1);
        assert!(next.recent_failures.is_empty());
        let transition = transition.unwrap();
        assert_eq!(
            (transition.old_status, transition.new_status),
            (Status::Available, Status::Cooldown)
        );
    }

    #[test]
    fn failures_spread_wider_than_the_window_do_not_cool_down() {
        let health = failures_without_a_transition(10, 20, &HealthPolicy::default());
        assert_eq!(health.recent_failures.len(), 5);
    }

    #[test]
    fn rate_limit_uses_retry_after_or_the_default_and_never_shortens_a_cooldown() {
        let policy = HealthPolicy::default();
        let limited = |health: &Health, retry_after| {
            apply(
                health,
                Report {
                    outcome: Outcome::RateLimited,
                    retry_after_seconds: retry_after,
                    probe: false,
                    may_disable: true,
                },
                now(),
                &policy,
            )
            .0
        };
        let next = limited(&Health::new(Status::Available), Some(120));
        assert_eq!(next.status, Status::RateLimited);
        assert_eq!(next.cooldown_until, Some(now() + Duration::seconds(120)));
        // absent and 0 both mean the default, never "no cooldown"
        assert_eq!(
            limited(&Health::new(Status::Available), None).cooldown_until,
            Some(now() + Duration::seconds(30))
        );
        assert_eq!(
            limited(&Health::new(Status::Available), Some(0)).cooldown_until,
            Some(now() + Duration::seconds(30))
        );
        // max-merge: a 10 s report does not shorten a 120 s rest, a 300 s one extends it
        assert_eq!(
            limited(&next, Some(10)).cooldown_until,
            Some(now() + Duration::seconds(120))
        );
        assert_eq!(
            limited(&next, Some(300)).cooldown_until,
            Some(now() + Duration::seconds(300))
        );
    }

    #[test]
    fn auth_error_disables_and_quota_exhaustion_waits_for_retry_after_or_an_operator() {
        let policy = HealthPolicy::default();
        let (next, transition) = from_available(report(Outcome::AuthError), &policy);
        assert_eq!(next.status, Status::Disabled);
        assert!(next.status_reason.unwrap().contains("auth_error"));
        assert!(transition.is_some());

        let (next, _) = from_available(report(Outcome::QuotaExhausted), &policy);
        assert_eq!(
            (next.status, next.cooldown_until),
            (Status::Exhausted, None)
        );
        assert!(!next.usable(now() + Duration::days(365)));
        let with_retry = Report {
            outcome: Outcome::QuotaExhausted,
            retry_after_seconds: Some(3600),
            probe: false,
            may_disable: true,
        };
        let (next, _) = from_available(with_retry, &policy);
        assert_eq!(next.cooldown_until, Some(now() + Duration::hours(1)));
        assert!(next.usable(now() + Duration::hours(1)));
    }

    /// A report of a reporter that may not disable (a tenant's, by default).
    fn tenants(outcome: Outcome, retry_after_seconds: Option<u32>) -> Report {
        Report {
            outcome,
            retry_after_seconds,
            probe: false,
            may_disable: false,
        }
    }

    #[test]
    fn a_report_rests_a_credential_at_most_the_bound_and_says_it_clamped() {
        let policy = HealthPolicy::default();
        let month = 31 * 86_400;
        for outcome in [Outcome::RateLimited, Outcome::QuotaExhausted] {
            for may_disable in [false, true] {
                let report = Report {
                    may_disable,
                    ..tenants(outcome, Some(month))
                };
                let (next, transition) = from_available(report, &policy);
                assert_eq!(
                    next.cooldown_until,
                    Some(now() + Duration::hours(1)),
                    "{outcome:?}, may_disable {may_disable}"
                );
                let transition = transition.unwrap();
                assert_eq!(transition.clamped_from, Some(month), "{outcome:?}");
                assert!(
                    transition.reason.contains("clamped"),
                    "{}",
                    transition.reason
                );
            }
            // within the bound: as asked, and nothing clamped
            let (next, transition) = from_available(tenants(outcome, Some(600)), &policy);
            assert_eq!(next.cooldown_until, Some(now() + Duration::minutes(10)));
            assert_eq!(transition.unwrap().clamped_from, None);
        }
    }

    #[test]
    fn auth_error_of_a_reporter_that_may_not_disable_rests_for_the_backoff() {
        let policy = HealthPolicy::default();
        let (next, transition) = from_available(tenants(Outcome::AuthError, None), &policy);
        assert_eq!(next.status, Status::Cooldown);
        assert_eq!(next.cooldown_until, Some(now() + Duration::seconds(60)));
        assert_eq!(next.failures, 1.0);
        assert!(next.usable(now() + Duration::seconds(60)));
        assert!(transition.unwrap().reason.contains("may not disable"));
        // the backoff doubles, and never beyond the longest rest of a report
        let mut again = next.clone();
        again.cooldowns_in_a_row = 30;
        let tight = HealthPolicy {
            max_cooldown_seconds: 86_400.0,
            max_report_rest_seconds: 120.0,
            ..HealthPolicy::default()
        };
        let (next, _) = apply(&again, tenants(Outcome::AuthError, None), now(), &tight);
        assert_eq!(next.cooldown_until, Some(now() + Duration::seconds(120)));
        // an operator's hold stays
        let (next, transition) = apply(
            &Health::new(Status::Disabled),
            tenants(Outcome::AuthError, None),
            now(),
            &policy,
        );
        assert_eq!((next.status, transition), (Status::Disabled, None));
    }

    #[test]
    fn quota_exhausted_without_retry_after_waits_for_an_operator_only_if_the_reporter_may_disable()
    {
        let policy = HealthPolicy::default();
        let (next, _) = from_available(tenants(Outcome::QuotaExhausted, None), &policy);
        assert_eq!(next.status, Status::Exhausted);
        assert_eq!(next.cooldown_until, Some(now() + Duration::hours(1)));
        let (next, _) = from_available(report(Outcome::QuotaExhausted), &policy);
        assert_eq!(
            (next.status, next.cooldown_until),
            (Status::Exhausted, None)
        );
    }

    #[test]
    fn a_disabled_credential_stays_disabled_whatever_executors_report() {
        let policy = HealthPolicy::default();
        let disabled = Health::new(Status::Disabled);
        for outcome in [
            Outcome::Success,
            Outcome::Failure,
            Outcome::RateLimited,
            Outcome::QuotaExhausted,
        ] {
            let (next, transition) = apply(&disabled, report(outcome), now(), &policy);
            assert_eq!(next.status, Status::Disabled, "{outcome:?}");
            assert!(transition.is_none(), "{outcome:?}");
        }
    }

    #[test]
    fn a_successful_probe_restores_full_capacity_and_resets_the_backoff() {
        let mut health = cooling(Status::Cooldown, -1);
        health.cooldowns_in_a_row = 3;
        assert!(health.recovering(now()));
        let probe = Report {
            outcome: Outcome::Success,
            retry_after_seconds: None,
            probe: true,
            may_disable: true,
        };
        let (next, transition) = apply(&health, probe, now(), &HealthPolicy::default());
        assert_eq!(next.status, Status::Available);
        assert_eq!((next.cooldown_until, next.cooldowns_in_a_row), (None, 0));
        assert_eq!(next.recovered_at, Some(now()));
        assert_eq!(transition.unwrap().reason, "probe succeeded");
    }

    #[test]
    fn a_failed_probe_starts_a_longer_capped_cooldown() {
        let policy = HealthPolicy::default();
        let probe = Report {
            outcome: Outcome::Failure,
            retry_after_seconds: None,
            probe: true,
            may_disable: true,
        };
        let mut health = cooling(Status::Cooldown, -1);
        health.cooldowns_in_a_row = 1;
        let (next, _) = apply(&health, probe, now(), &policy);
        assert_eq!(next.status, Status::Cooldown);
        assert_eq!(next.cooldown_until, Some(now() + Duration::seconds(120)));
        health.cooldowns_in_a_row = 10;
        let (next, _) = apply(&health, probe, now(), &policy);
        assert_eq!(next.cooldown_until, Some(now() + Duration::seconds(900)));
    }

    #[test]
    fn a_late_failure_of_an_old_lease_does_not_end_a_recovery() {
        let health = cooling(Status::Cooldown, -1);
        let (next, transition) = apply(
            &health,
            report(Outcome::Failure),
            now(),
            &HealthPolicy::default(),
        );
        assert_eq!(next.status, Status::Cooldown);
        assert!(transition.is_none());
    }

    #[test]
    fn usable_rule_matches_design() {
        let t = now();
        assert!(status_usable(Status::Available, None, t));
        for status in [Status::RateLimited, Status::Cooldown, Status::Exhausted] {
            assert!(
                !status_usable(status, None, t),
                "{status:?} with unknown end"
            );
            assert!(!status_usable(status, Some(t + Duration::seconds(1)), t));
            assert!(status_usable(status, Some(t), t));
        }
        for status in [Status::Pending, Status::Disabled] {
            assert!(!status_usable(status, Some(t - Duration::hours(1)), t));
        }
    }
}
