//! Judging a pool from its candidate view: the classification of an allocation that can find
//! nothing there (404, 409, 429) and otherwise the best candidates to claim, best first. Pure:
//! the view, the clock reading in it and the random generator are passed in.

use std::collections::HashSet;

use rand::RngExt;
use time::OffsetDateTime;

use super::candidates::{PoolView, unix_seconds};
use super::scoring::{self, ScoringPolicy};
use crate::domain::windows::WindowKind;
use crate::domain::{HeldBy, KeyId, ModelName};

/// What one pool of the sequence can offer, judged from its candidate view. Pure.
#[derive(Debug)]
pub(super) enum PoolVerdict {
    NotFound,
    ModelNotSupported,
    /// Credentials serve the model, but a token window of every one of them is smaller than the
    /// request's estimate: waiting cannot help.
    TokensExceedBudget,
    NoUsableCredentials,
    /// Try the claim over `batch` (may be empty: everything is busy or cooling, or tried).
    Try {
        batch: Vec<KeyId>,
        /// Whether the view shows an untried candidate with a free slot and window room (the
        /// batch starts with it).
        free_seen: bool,
        /// The earliest moment a candidate may serve again (a lease ends, a cooldown ends, a
        /// window frees), and the view's clock when judged.
        frees_at: Option<(OffsetDateTime, OffsetDateTime)>,
        /// What holds back the candidate that frees first.
        held_by: Option<HeldBy>,
    },
}

impl PoolVerdict {
    /// How a failed verdict ranks when the pool sequence has several: the most actionable answer
    /// wins (busy beats unusable beats too small beats model-less beats absent).
    pub(super) fn precedence(&self) -> u8 {
        match self {
            PoolVerdict::Try { .. } => 4,
            PoolVerdict::NoUsableCredentials => 3,
            PoolVerdict::TokensExceedBudget => 2,
            PoolVerdict::ModelNotSupported => 1,
            PoolVerdict::NotFound => 0,
        }
    }

    pub(super) fn conclusive_without_claim(&self) -> bool {
        !matches!(self, PoolVerdict::Try { .. })
    }
}

/// Judges a pool from its view for a request for `model` reserving `tokens`: classification, and
/// the best `take` candidates not in `tried` among (at most) `window` free ones.
#[allow(clippy::too_many_arguments)]
pub(super) fn judge<R: rand::Rng + ?Sized>(
    view: &PoolView,
    model: &ModelName,
    tokens: u64,
    tried: &HashSet<KeyId>,
    take: usize,
    window: usize,
    scoring_policy: &ScoringPolicy,
    rng: &mut R,
) -> PoolVerdict {
    if view.entries.is_empty() {
        return PoolVerdict::NotFound;
    }
    let now = view.now();
    let serving = view.serving(model.as_str());
    if serving.is_empty() {
        return PoolVerdict::ModelNotSupported;
    }
    let now_unix = unix_seconds(now);
    let mut any_usable = false;
    let mut any_able = false;
    let mut best = scoring::TopK::new(take, scoring_policy);
    let (capacity_weight, idle_weight, headroom_weight) = (
        scoring_policy.capacity_weight,
        scoring_policy.idle_weight,
        scoring_policy.headroom_weight,
    );
    let inv_idle_cap = if scoring_policy.idle_cap_seconds > 0.0 {
        1.0 / scoring_policy.idle_cap_seconds
    } else {
        f64::INFINITY
    };
    let mut free_seen = false;
    // the earliest moment a candidate may serve again, Unix seconds, and what holds it back
    let mut frees_at = f64::INFINITY;
    let mut held_by = None;
    let mut sooner = |at: f64, why: HeldBy| {
        if at < frees_at {
            frees_at = at;
            held_by = Some(why);
        }
    };
    // Start at a random place and stop after `window` free candidates: ranking costs O(window),
    // not O(pool), and a pool with fewer free candidates than that is ranked exactly.
    // (without jitter, always from the first: the order is then fully deterministic)
    let start = if serving.is_empty() || scoring_policy.jitter_amplitude() == 0.0 {
        0
    } else {
        rng.random_range(0..serving.len())
    };
    let mut free_found = 0;
    for &index in serving[start..].iter().chain(&serving[..start]) {
        if free_found >= window {
            break;
        }
        let row = &view.rows[index];
        let windows = &view.entries[index].facts.windows;
        if row.windowed && windows.never_admits(tokens) {
            // a token window smaller than the estimate: this credential can never serve it
            continue;
        }
        any_able = true;
        if !row.usable(now_unix) {
            // cooling down: usable again, on its own, at the end of its cooldown (+inf: never)
            sooner(row.usable_from, HeldBy::Cooldown);
            continue;
        }
        any_usable = true;
        let mut free_slots = row.free_slots(now_unix);
        let mut headroom = 1.0;
        if row.windowed {
            headroom = windows.headroom(now);
            if !windows.room(now, tokens) {
                // a full window: not free, and it frees when both a slot and the window do
                let window_frees = windows
                    .frees_at(now, tokens)
                    .map_or(f64::INFINITY, unix_seconds);
                let slot_frees = if free_slots > 0 {
                    now_unix
                } else {
                    row.next_lease_end
                };
                let why = match windows.holding(now, tokens).map(|w| w.kind) {
                    Some(WindowKind::Tokens) => HeldBy::TokensWindow,
                    _ => HeldBy::RequestsWindow,
                };
                if window_frees >= slot_frees {
                    sooner(window_frees, why);
                } else {
                    sooner(slot_frees, HeldBy::Slots);
                }
                free_slots = 0;
            } else {
                sooner(row.next_lease_end, HeldBy::Slots);
            }
        } else {
            sooner(row.next_lease_end, HeldBy::Slots);
        }
        if !tried.is_empty() && tried.contains(&view.entries[index].facts.key_id) {
            continue;
        }
        // the score of `Scored::score`, from parts precomputed for this loop
        let capacity = (free_slots as f64 * row.inv_limit).min(1.0);
        let idle = if row.last_used.is_nan() {
            1.0
        } else {
            ((now_unix - row.last_used) * inv_idle_cap).clamp(0.0, 1.0)
        };
        let score = row.health_score
            + capacity_weight * capacity
            + idle_weight * idle
            + headroom_weight * headroom;
        if free_slots > 0 {
            free_seen = true;
            free_found += 1;
        }
        best.offer_scored(index, free_slots > 0, score, index, rng);
    }
    if !any_able {
        return PoolVerdict::TokensExceedBudget;
    }
    if !any_usable && frees_at.is_infinite() {
        return PoolVerdict::NoUsableCredentials;
    }
    let frees_at = frees_at
        .is_finite()
        .then(|| OffsetDateTime::from_unix_timestamp_nanos((frees_at * 1e9) as i128).ok())
        .flatten();
    let batch = best
        .into_keys()
        .into_iter()
        .map(|i| view.entries[i].facts.key_id.clone())
        .collect();
    PoolVerdict::Try {
        batch,
        free_seen,
        frees_at: frees_at.map(|at| (at, now)),
        held_by,
    }
}

/// The best `take` candidates of `view` for `model`, best first, ranked over at most `window`
/// free ones (the ranking every allocation runs; public for the ranking benchmark). Empty when
/// the view has no usable candidate serving the model.
pub fn rank<R: rand::Rng + ?Sized>(
    view: &PoolView,
    model: &ModelName,
    take: usize,
    window: usize,
    scoring_policy: &ScoringPolicy,
    rng: &mut R,
) -> Vec<KeyId> {
    match judge(
        view,
        model,
        0,
        &HashSet::new(),
        take,
        window,
        scoring_policy,
        rng,
    ) {
        PoolVerdict::Try { batch, .. } => batch,
        _ => Vec::new(),
    }
}

/// Whole seconds from `now` until `at` of `soonest = (at, now)`, rounded up, at least 1 (the
/// `Retry-After` rule); 1 when nothing is known to end (a claim lost a race for a free slot).
pub(super) fn retry_after_seconds(soonest: Option<(OffsetDateTime, OffsetDateTime)>) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Status;
    use crate::domain::health::HealthPolicy;
    use crate::store::candidates::{CredentialFacts, PoolSnapshot};
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use time::Duration;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn facts(id: &str, models: &[&str]) -> CredentialFacts {
        CredentialFacts::idle(id, models, 2)
    }

    fn view(credentials: Vec<CredentialFacts>) -> PoolView {
        PoolView::from_snapshot(
            PoolSnapshot {
                version: Some(1),
                db_now: now(),
                read_at: std::time::Instant::now(),
                xmin: 0,
                credentials,
                departed: Vec::new(),
            },
            &ScoringPolicy::default(),
            &HealthPolicy::default(),
        )
    }

    fn judged(credentials: Vec<CredentialFacts>, model: &str) -> PoolVerdict {
        judge(
            &view(credentials),
            &ModelName::parse(model).unwrap(),
            0,
            &HashSet::new(),
            8,
            256,
            &ScoringPolicy::default(),
            &mut StdRng::seed_from_u64(1),
        )
    }

    #[test]
    fn empty_pool_is_not_found() {
        assert!(matches!(judged(vec![], "gpt-4o"), PoolVerdict::NotFound));
    }

    #[test]
    fn pool_without_the_model_or_an_alias_for_it_is_model_not_supported() {
        assert!(matches!(
            judged(vec![facts("a", &["o3"])], "gpt-4o"),
            PoolVerdict::ModelNotSupported
        ));
        let mut aliased = facts("a", &["gpt-4o-2024-08-06"]);
        aliased
            .aliases
            .insert("gpt-4o".into(), "gpt-4o-2024-08-06".into());
        assert!(matches!(
            judged(vec![aliased], "gpt-4o"),
            PoolVerdict::Try { .. }
        ));
    }

    #[test]
    fn only_disabled_exhausted_or_pending_credentials_is_no_usable_credentials() {
        let mut rows = Vec::new();
        for (id, status) in [
            ("d", Status::Disabled),
            ("e", Status::Exhausted),
            ("p", Status::Pending),
        ] {
            let mut row = facts(id, &["gpt-4o"]);
            row.health.status = status;
            rows.push(row);
        }
        assert!(matches!(
            judged(rows, "gpt-4o"),
            PoolVerdict::NoUsableCredentials
        ));
    }

    #[test]
    fn cooling_credentials_are_busy_until_their_cooldown_ends() {
        let mut row = facts("a", &["gpt-4o"]);
        row.health.status = Status::RateLimited;
        row.health.cooldown_until = Some(now() + Duration::seconds(30));
        match judged(vec![row], "gpt-4o") {
            PoolVerdict::Try {
                batch,
                frees_at: Some((at, _)),
                ..
            } => {
                assert!(batch.is_empty());
                assert_eq!(at, now() + Duration::seconds(30));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_credential_over_a_lowered_limit_is_never_believed_free() {
        // back under its limit in the view, but its slots are still closed until a refit
        let mut over = facts("over", &["gpt-4o"]);
        over.slots_over_limit = true;
        over.in_flight = 1;
        match judged(vec![over.clone()], "gpt-4o") {
            PoolVerdict::Try { free_seen, .. } => assert!(!free_seen),
            other => panic!("{other:?}"),
        }
        match judged(vec![over, facts("open", &["gpt-4o"])], "gpt-4o") {
            PoolVerdict::Try {
                batch, free_seen, ..
            } => {
                assert!(free_seen);
                assert_eq!(batch[0], KeyId::parse("open").unwrap());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_large_pool_is_ranked_over_a_window_of_free_candidates_and_a_small_one_exactly() {
        let rows: Vec<_> = (0..100)
            .map(|i| facts(&format!("k{i:03}"), &["gpt-4o"]))
            .collect();
        let mut exact = view(rows);
        // one clearly best credential: an exact ranking finds it every time
        exact.entries[57].health_score += 5.0;
        exact.rows[57].health_score += 5.0;
        let model = ModelName::parse("gpt-4o").unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        // the batch's first candidate and whether a free one was seen, ranked over `window`
        let mut first_of_batch = |window| match judge(
            &exact,
            &model,
            0,
            &HashSet::new(),
            1,
            window,
            &ScoringPolicy::default(),
            &mut rng,
        ) {
            PoolVerdict::Try {
                batch, free_seen, ..
            } => (batch[0].clone(), free_seen),
            other => panic!("{other:?}"),
        };
        let found = (0..50)
            .filter(|_| first_of_batch(256).0.as_str() == "k057")
            .count();
        assert_eq!(found, 50);
        // with a window of 10 the best is found only when the window covers it (about 1 in 10)
        let mut found = 0;
        for _ in 0..1000 {
            let (first, free_seen) = first_of_batch(10);
            assert!(free_seen);
            found += usize::from(first.as_str() == "k057");
        }
        assert!((50..200).contains(&found), "{found}");
    }

    #[test]
    fn tried_candidates_are_not_offered_again() {
        let rows = vec![facts("a", &["gpt-4o"]), facts("b", &["gpt-4o"])];
        let tried: HashSet<KeyId> = [KeyId::parse("a").unwrap()].into();
        let verdict = judge(
            &view(rows),
            &ModelName::parse("gpt-4o").unwrap(),
            0,
            &tried,
            8,
            256,
            &ScoringPolicy::default(),
            &mut StdRng::seed_from_u64(1),
        );
        match verdict {
            PoolVerdict::Try { batch, .. } => assert_eq!(batch, vec![KeyId::parse("b").unwrap()]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        let now = OffsetDateTime::now_utc();
        let after = |ms| retry_after_seconds(Some((now + time::Duration::milliseconds(ms), now)));
        assert_eq!(after(1_200), 2);
        assert_eq!(after(10), 1);
        assert_eq!(after(-5_000), 1);
        assert_eq!(retry_after_seconds(None), 1);
    }
}
