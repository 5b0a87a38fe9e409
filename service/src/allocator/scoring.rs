//! Scoring: the order in which the claim statement tries candidates. Pure: no I/O; the database
//! clock and the random source are parameters, so tests pin every term and the order exactly.
//!
//! ```text
//! score = capacity_weight   * capacity        (free share of the slots, as last seen)
//!       + idle_weight       * idle            (seconds since last_used_at / idle cap, at most 1)
//!       + success_weight    * success         (decayed success rate; 1.0 without history)
//!       - error_weight      * error_penalty   (decayed failures / error saturation, at most 1)
//!       - rate_limit_weight * rate_limit_penalty (decayed rate limits / saturation, at most 1)
//!       - cooldown_weight   * cooldown_penalty   (1 while recovering, fading to 0 over the
//!                                                 cooldown penalty window after recovery)
//!       - freshness_penalty                   (when the last success is missing or too old)
//!       + jitter                              (uniform in [0, jitter * score range))
//! ```
//!
//! The claim statement stays the truth at the moment of the claim; the score only decides order.

use rand::RngExt;
use time::OffsetDateTime;

use crate::domain::health::{Health, HealthPolicy};

/// Weights and shapes of the score. Defaults in [`ScoringPolicy::default`].
#[derive(Debug, Clone, PartialEq)]
pub struct ScoringPolicy {
    /// Weight of the free share of slots.
    pub capacity_weight: f64,
    /// Weight of idle time.
    pub idle_weight: f64,
    /// Weight of rate-window headroom: the share of its tightest window a credential has left (1
    /// without windows), so traffic spreads before a window fills.
    pub headroom_weight: f64,
    /// Weight of the success rate.
    pub success_weight: f64,
    /// Weight of recent failures.
    pub error_weight: f64,
    /// Weight of recent rate limits.
    pub rate_limit_weight: f64,
    /// Weight of a recent recovery from cooldown.
    pub cooldown_weight: f64,
    /// Flat penalty when the last success is missing or older than `freshness_max_age_seconds`.
    pub freshness_penalty: f64,
    /// Jitter amplitude relative to the score range (0 = deterministic order).
    pub jitter: f64,
    /// Idle time at which idle counts in full, in seconds.
    pub idle_cap_seconds: f64,
    /// Age beyond which a last success no longer counts as fresh, in seconds.
    pub freshness_max_age_seconds: f64,
    /// How long after a recovery the cooldown penalty takes to fade to zero, in seconds.
    pub cooldown_penalty_seconds: f64,
    /// Decayed failures that give the full error penalty.
    pub error_saturation: f64,
    /// Decayed rate limits that give the full rate-limit penalty.
    pub rate_limit_saturation: f64,
}

impl Default for ScoringPolicy {
    /// capacity 1, idle 1, headroom 1, success 2, error 1, rate limit 1, cooldown 1, freshness 0.5;
    /// jitter 0.01 of the range; idle cap 300 s; freshness age 600 s; cooldown penalty 300 s;
    /// saturation at 5 failures and 3 rate limits.
    fn default() -> Self {
        Self {
            capacity_weight: 1.0,
            idle_weight: 1.0,
            headroom_weight: 1.0,
            success_weight: 2.0,
            error_weight: 1.0,
            rate_limit_weight: 1.0,
            cooldown_weight: 1.0,
            freshness_penalty: 0.5,
            jitter: 0.01,
            idle_cap_seconds: 300.0,
            freshness_max_age_seconds: 600.0,
            cooldown_penalty_seconds: 300.0,
            error_saturation: 5.0,
            rate_limit_saturation: 3.0,
        }
    }
}

impl ScoringPolicy {
    /// Highest possible score minus lowest possible (before jitter): every term spans [0, 1]
    /// times its weight.
    pub fn range(&self) -> f64 {
        [
            self.capacity_weight,
            self.idle_weight,
            self.headroom_weight,
            self.success_weight,
            self.error_weight,
            self.rate_limit_weight,
            self.cooldown_weight,
            self.freshness_penalty,
        ]
        .iter()
        .map(|w| w.abs())
        .sum()
    }

    /// The jitter's upper bound: `jitter * range`.
    pub fn jitter_amplitude(&self) -> f64 {
        (self.jitter * self.range()).max(0.0)
    }
}

/// The terms of one credential's score, each in [0, 1] before weighting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Terms {
    /// Free share of slots.
    pub capacity: f64,
    /// Idle time over the cap.
    pub idle: f64,
    /// Decayed success rate (1.0 without history).
    pub success: f64,
    /// Decayed failures over saturation.
    pub error_penalty: f64,
    /// Decayed rate limits over saturation.
    pub rate_limit_penalty: f64,
    /// 1 while recovering; fading after a recovery.
    pub cooldown_penalty: f64,
    /// 1 when the last success is missing or stale.
    pub stale: f64,
}

impl Terms {
    /// The weighted sum, without jitter.
    pub fn score(&self, policy: &ScoringPolicy) -> f64 {
        policy.capacity_weight * self.capacity
            + policy.idle_weight * self.idle
            + policy.success_weight * self.success
            - policy.error_weight * self.error_penalty
            - policy.rate_limit_weight * self.rate_limit_penalty
            - policy.cooldown_weight * self.cooldown_penalty
            - policy.freshness_penalty * self.stale
    }
}

/// The health part of the terms (everything but capacity and idle), which changes only with
/// reports and slowly with time; a candidate view computes it once per refresh.
pub fn health_terms(
    health: &Health,
    now: OffsetDateTime,
    scoring: &ScoringPolicy,
    decay: &HealthPolicy,
) -> Terms {
    let (successes, failures, rate_limits) = health.counters_at(now, decay);
    let reports = successes + failures;
    let success = if reports < 1e-9 {
        1.0
    } else {
        successes / reports
    };
    let saturating = |count: f64, at: f64| {
        if at <= 0.0 {
            0.0
        } else {
            (count / at).min(1.0)
        }
    };
    let cooldown_penalty = if health.recovering(now) {
        1.0
    } else {
        match health.recovered_at {
            Some(at) if scoring.cooldown_penalty_seconds > 0.0 => {
                let since = (now - at).as_seconds_f64().max(0.0);
                (1.0 - since / scoring.cooldown_penalty_seconds).clamp(0.0, 1.0)
            }
            _ => 0.0,
        }
    };
    let fresh = health
        .last_success_at
        .is_some_and(|at| (now - at).as_seconds_f64() <= scoring.freshness_max_age_seconds);
    Terms {
        capacity: 0.0,
        idle: 0.0,
        success,
        error_penalty: saturating(failures, scoring.error_saturation),
        rate_limit_penalty: saturating(rate_limits, scoring.rate_limit_saturation),
        cooldown_penalty,
        stale: if fresh { 0.0 } else { 1.0 },
    }
}

/// Idle over the cap: `idle_seconds` (since the last lease was granted), capped, as a share;
/// never used (`None`) counts as fully idle.
pub fn idle_term(idle_seconds: Option<f64>, policy: &ScoringPolicy) -> f64 {
    match idle_seconds {
        None => 1.0,
        Some(_) if policy.idle_cap_seconds <= 0.0 => 1.0,
        Some(seconds) => (seconds / policy.idle_cap_seconds).clamp(0.0, 1.0),
    }
}

/// Seconds from `at` to `now` (`None` when `at` is), for [`idle_term`].
pub fn seconds_since(at: Option<OffsetDateTime>, now: OffsetDateTime) -> Option<f64> {
    at.map(|at| (now - at).as_seconds_f64())
}

/// Free share of `limit` slots with `in_flight` leases as last seen.
pub fn capacity_term(free_slots: i64, limit: i32) -> f64 {
    if limit <= 0 {
        0.0
    } else {
        (free_slots as f64 / f64::from(limit)).clamp(0.0, 1.0)
    }
}

/// A candidate ready for ranking: its health score part (from [`health_terms`]) plus what
/// changes between refreshes.
#[derive(Debug, Clone, Copy)]
pub struct Scored<K> {
    /// Whatever identifies the candidate to the caller.
    pub key: K,
    /// `success - error - rate limit - cooldown - freshness`, weighted.
    pub health_score: f64,
    /// Free slots as last seen.
    pub free_slots: i64,
    /// Its limit.
    pub limit: i32,
    /// Seconds since its latest lease was granted; `None` if never.
    pub idle_seconds: Option<f64>,
}

impl<K> Scored<K> {
    /// The full score, without jitter.
    pub fn score(&self, policy: &ScoringPolicy) -> f64 {
        self.health_score
            + policy.capacity_weight * capacity_term(self.free_slots, self.limit)
            + policy.idle_weight * idle_term(self.idle_seconds, policy)
    }
}

/// The weighted health part of a score: [`Terms::score`] without capacity and idle.
pub fn health_score(terms: &Terms, policy: &ScoringPolicy) -> f64 {
    Terms {
        capacity: 0.0,
        idle: 0.0,
        ..*terms
    }
    .score(policy)
}

/// The `take` best candidates, best first: score plus uniform jitter in `[0, jitter_amplitude)`.
/// Candidates with no free slot as last seen rank after all others. Ties (possible only with zero
/// jitter) keep the input order.
pub fn top<K: Copy, R: rand::Rng + ?Sized>(
    candidates: &[Scored<K>],
    take: usize,
    policy: &ScoringPolicy,
    rng: &mut R,
) -> Vec<K> {
    let mut best = TopK::new(take, policy);
    for candidate in candidates {
        best.offer(candidate, rng);
    }
    best.into_keys()
}

/// A running selection of the `k` best candidates of a stream, so that ranking a large pool
/// allocates nothing per candidate: O(n) for a small `k` (a candidate that does not beat the
/// current k-th best costs one comparison).
#[derive(Debug)]
pub struct TopK<'p, K> {
    k: usize,
    policy: &'p ScoringPolicy,
    amplitude: f64,
    offered: usize,
    /// (has a free slot, score with jitter, tie-break) best first, at most `k`.
    best: Vec<(bool, f64, usize, K)>,
}

impl<'p, K: Copy> TopK<'p, K> {
    /// An empty selection of at most `k`.
    pub fn new(k: usize, policy: &'p ScoringPolicy) -> Self {
        Self {
            k,
            policy,
            amplitude: policy.jitter_amplitude(),
            offered: 0,
            best: Vec::with_capacity(k.min(1024) + 1),
        }
    }

    /// Scores `candidate` (with jitter drawn from `rng`) and keeps it if it is among the best.
    pub fn offer<R: rand::Rng + ?Sized>(&mut self, candidate: &Scored<K>, rng: &mut R) {
        let tie = self.offered;
        self.offer_scored(
            candidate.key,
            candidate.free_slots > 0,
            candidate.score(self.policy),
            tie,
            rng,
        );
    }

    /// Like [`TopK::offer`] for a score the caller computed (without jitter) — the hot loop of
    /// ranking a large pool computes it from precomputed parts. Equal scores (possible only
    /// without jitter) are ordered by `tie`, lowest first.
    pub fn offer_scored<R: rand::Rng + ?Sized>(
        &mut self,
        key: K,
        free: bool,
        score: f64,
        tie: usize,
        rng: &mut R,
    ) {
        let jitter = if self.amplitude > 0.0 {
            rng.random::<f64>() * self.amplitude
        } else {
            0.0
        };
        let item = (free, score + jitter, tie, key);
        self.offered += 1;
        if self.k == 0 {
            return;
        }
        // better = free first, then higher score, then the lower tie-break
        let better = |a: &(bool, f64, usize, K), b: &(bool, f64, usize, K)| {
            (a.0, a.1) > (b.0, b.1) || ((a.0, a.1) == (b.0, b.1) && a.2 < b.2)
        };
        if self.best.len() == self.k && !better(&item, &self.best[self.k - 1]) {
            return;
        }
        let at = self.best.partition_point(|kept| better(kept, &item));
        self.best.insert(at, item);
        self.best.truncate(self.k);
    }

    /// The kept candidates, best first.
    pub fn into_keys(self) -> Vec<K> {
        self.best.into_iter().map(|(_, _, _, key)| key).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Status;
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use time::Duration;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn healthy() -> Health {
        Health {
            last_success_at: Some(now()),
            ..Health::new(Status::Available)
        }
    }

    fn terms(health: &Health) -> Terms {
        health_terms(
            health,
            now(),
            &ScoringPolicy::default(),
            &HealthPolicy::default(),
        )
    }

    #[test]
    fn capacity_is_the_free_share_of_slots() {
        assert_eq!(capacity_term(4, 4), 1.0);
        assert_eq!(capacity_term(1, 4), 0.25);
        assert_eq!(capacity_term(0, 4), 0.0);
        assert_eq!(capacity_term(-2, 4), 0.0);
    }

    #[test]
    fn idle_is_capped_at_five_minutes_and_never_used_counts_as_fully_idle() {
        let policy = ScoringPolicy::default();
        assert_eq!(idle_term(None, &policy), 1.0);
        assert_eq!(idle_term(Some(0.0), &policy), 0.0);
        assert_eq!(
            idle_term(
                seconds_since(Some(now() - Duration::seconds(150)), now()),
                &policy
            ),
            0.5
        );
        assert_eq!(idle_term(Some(7200.0), &policy), 1.0);
    }

    #[test]
    fn success_rate_is_one_without_history_and_decays_toward_it() {
        assert_eq!(terms(&Health::new(Status::Available)).success, 1.0);
        let mut half = healthy();
        half.successes = 5.0;
        half.failures = 5.0;
        half.decayed_at = Some(now());
        assert_eq!(terms(&half).success, 0.5);
        // the rate itself is a ratio of decayed counts; new successes outweigh old failures
        let later = now() + Duration::seconds(600);
        let (next, _) = crate::domain::health::apply(
            &half,
            crate::domain::health::Report {
                outcome: crate::domain::Outcome::Success,
                retry_after_seconds: None,
                probe: false,
                may_disable: true,
            },
            later,
            &HealthPolicy::default(),
        );
        let rate = health_terms(
            &next,
            later,
            &ScoringPolicy::default(),
            &HealthPolicy::default(),
        )
        .success;
        assert!((rate - 3.5 / 6.0).abs() < 1e-9, "{rate}");
    }

    #[test]
    fn error_and_rate_limit_penalties_saturate() {
        let mut health = healthy();
        health.failures = 2.5;
        health.rate_limits = 6.0;
        health.decayed_at = Some(now());
        let t = terms(&health);
        assert_eq!(t.error_penalty, 0.5);
        assert_eq!(t.rate_limit_penalty, 1.0);
    }

    #[test]
    fn cooldown_penalty_is_full_while_recovering_and_fades_after_recovery() {
        let mut recovering = healthy();
        recovering.status = Status::Cooldown;
        recovering.cooldown_until = Some(now() - Duration::seconds(1));
        assert_eq!(terms(&recovering).cooldown_penalty, 1.0);
        let mut recovered = healthy();
        recovered.recovered_at = Some(now() - Duration::seconds(60));
        assert!((terms(&recovered).cooldown_penalty - 0.8).abs() < 1e-9);
        recovered.recovered_at = Some(now() - Duration::seconds(600));
        assert_eq!(terms(&recovered).cooldown_penalty, 0.0);
        assert_eq!(terms(&healthy()).cooldown_penalty, 0.0);
    }

    #[test]
    fn freshness_penalises_a_missing_or_old_last_success() {
        assert_eq!(terms(&healthy()).stale, 0.0);
        assert_eq!(terms(&Health::new(Status::Available)).stale, 1.0);
        let mut old = healthy();
        old.last_success_at = Some(now() - Duration::seconds(601));
        assert_eq!(terms(&old).stale, 1.0);
    }

    #[test]
    fn score_weighs_every_term() {
        let policy = ScoringPolicy::default();
        let t = Terms {
            capacity: 0.5,
            idle: 1.0,
            success: 0.75,
            error_penalty: 0.2,
            rate_limit_penalty: 0.1,
            cooldown_penalty: 0.0,
            stale: 1.0,
        };
        let expected = 0.5 + 1.0 + 2.0 * 0.75 - 0.2 - 0.1 - 0.0 - 0.5;
        assert!((t.score(&policy) - expected).abs() < 1e-12);
        // the weights of every term, headroom's included (scored apart: it moves with each grant)
        assert_eq!(policy.range(), 8.5);
        assert!((policy.jitter_amplitude() - 0.085).abs() < 1e-12);
    }

    fn scored(key: usize, health: &Health) -> Scored<usize> {
        Scored {
            key,
            health_score: health_score(&terms(health), &ScoringPolicy::default()),
            free_slots: 1,
            limit: 1,
            idle_seconds: None,
        }
    }

    #[test]
    fn zero_jitter_gives_a_deterministic_order() {
        let policy = ScoringPolicy {
            jitter: 0.0,
            ..ScoringPolicy::default()
        };
        let candidates: Vec<_> = (0..8).map(|i| scored(i, &healthy())).collect();
        let mut rng = StdRng::seed_from_u64(1);
        let first = top(&candidates, 8, &policy, &mut rng);
        assert_eq!(first, (0..8).collect::<Vec<_>>());
        for _ in 0..50 {
            assert_eq!(top(&candidates, 8, &policy, &mut rng), first);
        }
    }

    #[test]
    fn full_candidates_rank_last_and_top_takes_the_best() {
        let policy = ScoringPolicy::default();
        let mut candidates: Vec<_> = (0..10).map(|i| scored(i, &healthy())).collect();
        candidates[0].free_slots = 0;
        candidates[7].health_score += 3.0;
        let best = top(&candidates, 3, &policy, &mut StdRng::seed_from_u64(2));
        assert_eq!(best.len(), 3);
        assert_eq!(best[0], 7);
        assert!(!best.contains(&0));
        let all = top(&candidates, 10, &policy, &mut StdRng::seed_from_u64(2));
        assert_eq!(all.last(), Some(&0));
    }

    /// Sequential allocate + release simulated on the scoring alone: each cycle leases the top
    /// candidate, then releases it with the credential's outcome, 10 ms apart.
    fn simulate(
        healths: &mut [Health],
        fails: impl Fn(usize, &mut StdRng) -> bool,
        cycles: usize,
    ) -> Vec<usize> {
        let scoring = ScoringPolicy::default();
        let decay = HealthPolicy::default();
        let mut rng = StdRng::seed_from_u64(42);
        let mut last_used: Vec<Option<OffsetDateTime>> = vec![None; healths.len()];
        let mut counts = vec![0; healths.len()];
        for cycle in 0..cycles {
            let at = now() + Duration::milliseconds(10 * cycle as i64);
            let candidates: Vec<_> = healths
                .iter()
                .enumerate()
                .filter(|(_, h)| h.usable(at))
                .map(|(i, h)| Scored {
                    key: i,
                    health_score: health_score(&health_terms(h, at, &scoring, &decay), &scoring),
                    free_slots: 1,
                    limit: 1,
                    idle_seconds: seconds_since(last_used[i], at),
                })
                .collect();
            let chosen = top(&candidates, 1, &scoring, &mut rng)[0];
            counts[chosen] += 1;
            last_used[chosen] = Some(at);
            let outcome = if fails(chosen, &mut rng) {
                crate::domain::Outcome::Failure
            } else {
                crate::domain::Outcome::Success
            };
            let report = crate::domain::health::Report {
                outcome,
                retry_after_seconds: None,
                probe: false,
                may_disable: true,
            };
            healths[chosen] = crate::domain::health::apply(&healths[chosen], report, at, &decay).0;
        }
        counts
    }

    #[test]
    fn equal_credentials_share_ten_thousand_sequential_leases_evenly() {
        let mut healths = vec![healthy(); 8];
        let counts = simulate(&mut healths, |_, _| false, 10_000);
        for (i, n) in counts.iter().enumerate() {
            let share = *n as f64 / 100.0;
            assert!(
                (share - 12.5).abs() <= 3.0,
                "credential {i} got {share}% ({counts:?})"
            );
        }
    }

    #[test]
    fn a_credential_failing_half_its_calls_gets_clearly_less_traffic() {
        let mut healths = vec![healthy(); 8];
        let counts = simulate(
            &mut healths,
            |i, rng| i == 0 && rng.random_bool(0.5),
            10_000,
        );
        let healthy_mean = counts[1..].iter().sum::<usize>() as f64 / 7.0;
        assert!(
            (counts[0] as f64) < healthy_mean / 2.0,
            "flaky credential got {} leases, healthy ones {healthy_mean} on average ({counts:?})",
            counts[0]
        );
    }

    #[test]
    fn jitter_does_not_override_a_real_quality_difference() {
        let policy = ScoringPolicy::default();
        let mut worse = healthy();
        worse.failures = 1.0;
        worse.successes = 3.0;
        worse.decayed_at = Some(now());
        let candidates = vec![scored(0, &worse), scored(1, &healthy())];
        let mut rng = StdRng::seed_from_u64(9);
        for _ in 0..1000 {
            assert_eq!(top(&candidates, 1, &policy, &mut rng), vec![1]);
        }
    }
}
