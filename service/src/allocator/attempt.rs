//! One request's attempt at one pool, as a small state machine: after each ranking it says
//! whether to claim (and which candidates), to read the pool again, or to answer. Pure: the
//! [`super::Allocator`] runs the reads and claims it asks for.

use std::collections::HashSet;
use std::time::Duration;

use time::OffsetDateTime;

use super::ClaimSettings;
use super::ranking::PoolVerdict;
use crate::domain::HeldBy;
use crate::domain::KeyId;

/// Largest batch a retried claim grows to.
const MAX_BATCH: usize = 1024;

/// Claim statements one request may run on one pool, whatever its view says: a bound on the work
/// a request does even while other replicas keep changing the pool under it.
const MAX_CLAIMS_PER_POOL: usize = 16;

/// The oldest view a 429 may be answered from without reading the pool again, counted from its
/// latest whole read (a read of changes refreshes only the credentials that changed). A view
/// misses what it was not told: leases that ran out, renewals, other replicas' releases.
/// Answering "every slot is busy" from such a view would be a 429 while slots are free; reading
/// the pool first costs at most one read of a busy pool per second and process (concurrent
/// callers share it).
const MAX_VIEW_AGE_FOR_429: Duration = Duration::from_secs(1);

/// One request's attempt at one pool: what it has tried and learnt so far, and the rule for what
/// to do next. Pure: [`Allocator::allocate_in`] runs the reads and claims each step asks for.
#[derive(Debug)]
pub(super) struct PoolAttempt {
    /// Candidates a claim was made on without a grant: full, for the rest of this attempt.
    pub(super) tried: HashSet<KeyId>,
    /// Whether the view was read from the database during this attempt, whole or its changes (a
    /// 404 or 409 is only answered from a fresh view).
    fresh: bool,
    /// Whether the whole pool was read during this attempt: its occupancy confirmed, so a 429 may
    /// be answered from it whatever happened before (a read of changes brings only the
    /// credentials whose configuration or health moved).
    counted: bool,
    /// Claims made while the view showed no free candidate (bounded by `ClaimSettings::attempts`).
    attempts: usize,
    /// Candidates the next ranking takes: the configured batch, doubled after each miss up to
    /// [`MAX_BATCH`].
    pub(super) batch_size: usize,
    /// Rankings that reached the claim decision (bounded by [`MAX_CLAIMS_PER_POOL`]).
    claims: usize,
    /// When the last claim that granted nothing said a candidate may serve (database clock), and
    /// what held it back.
    database_frees: Option<(OffsetDateTime, Option<HeldBy>)>,
    /// A credential whose slot was just freed for this (waiting) request: claimed first, once.
    hint: Option<KeyId>,
}

/// What a [`PoolAttempt`] does with the verdict of its latest ranking.
#[derive(Debug)]
pub(super) enum Step {
    /// Read the pool from the database and judge again: the verdict is a 404 or 409, and the view
    /// it came from may be stale.
    Reload,
    /// Read the whole pool unless the view has been read whole since, and judge again: the answer
    /// would be a 429, and the view may be behind: its occupancy is older than
    /// [`MAX_VIEW_AGE_FOR_429`], or it expected a lease to have ended by now (a
    /// renewal moved that end, or the lease ran out; neither reaches the view), so its "full"
    /// and its Retry-After may both be wrong.
    CatchUp,
    /// Answer with this verdict (after [`PoolAttempt::date_database_frees`], which dates it when a claim said
    /// when a candidate frees).
    Answer(PoolVerdict),
    /// Run the claim statement over `batch`, best first.
    Claim {
        batch: Vec<KeyId>,
        /// Whether the view showed a free candidate in the batch.
        free_seen: bool,
    },
}

impl PoolAttempt {
    pub(super) fn new(claims: &ClaimSettings, hint: Option<KeyId>) -> Self {
        Self {
            tried: HashSet::new(),
            fresh: false,
            counted: false,
            attempts: 0,
            batch_size: claims.batch.max(1),
            claims: 0,
            database_frees: None,
            hint,
        }
    }

    /// The next step for `verdict`, judged from a view whose occupancy was read whole from the
    /// database `age` ago (just now, by this ranking, when `loaded`).
    pub(super) fn decide(
        &mut self,
        verdict: PoolVerdict,
        loaded: bool,
        age: Duration,
        settings: &ClaimSettings,
    ) -> Step {
        self.fresh |= loaded;
        self.counted |= loaded;
        if verdict.conclusive_without_claim() {
            // never answer 404/409 from a stale view
            return if self.fresh {
                Step::Answer(verdict)
            } else {
                Step::Reload
            };
        }
        let PoolVerdict::Try {
            mut batch,
            mut free_seen,
            frees_at,
            held_by,
        } = verdict
        else {
            unreachable!("conclusive verdicts returned above")
        };
        // a freed slot woke this (waiting) request: that credential first
        if let Some(hinted) = self.hint.take()
            && !self.tried.contains(&hinted)
        {
            batch.retain(|k| *k != hinted);
            batch.insert(0, hinted);
            free_seen = true;
        }
        self.claims += 1;
        // A view with no claimable candidate at all (every one cooling down) is still checked by
        // one claim when nothing in this request has reached the database yet: a claim of no
        // candidate grants nothing but reads the pool's version, so a stale view is reloaded and
        // judged again, and an unreachable database answers 503. A 429 is never given from the
        // cached view alone: a 429 says the pool is busy, a 503 that the store is unreachable,
        // and only the database can tell the two apart.
        let confirm_empty = batch.is_empty() && self.claims == 1 && !self.fresh;
        if !confirm_empty
            && (batch.is_empty()
                || (!free_seen && self.attempts >= settings.attempts)
                || self.claims > MAX_CLAIMS_PER_POOL)
        {
            // A 429 only from a view the database confirmed: read whole during this attempt, or
            // recently and not known to be behind. (A claim's word on its batch does not vouch
            // for the rest of the view.)
            let behind = frees_at.is_some_and(|(at, now)| at <= now);
            if !self.counted && (behind || age > MAX_VIEW_AGE_FOR_429) {
                return Step::CatchUp;
            }
            return Step::Answer(PoolVerdict::Try {
                batch,
                free_seen,
                frees_at,
                held_by,
            });
        }
        if !free_seen {
            self.attempts += 1;
        }
        Step::Claim { batch, free_seen }
    }

    /// The whole pool was read from the database.
    pub(super) fn reloaded(&mut self) {
        self.fresh = true;
        self.counted = true;
    }

    /// The view was brought up to the pool's version (a read of what changed, if anything): its
    /// membership is fresh, its occupancy not.
    pub(super) fn changes_read(&mut self) {
        self.fresh = true;
    }

    /// A claim over `batch` granted nothing; the database said a candidate may serve at
    /// `frees_at` (its clock), held back by `held_by`. The batch counts as full from now on, and
    /// the next ranking takes twice as many candidates.
    pub(super) fn missed(
        &mut self,
        batch: &[KeyId],
        frees_at: Option<OffsetDateTime>,
        held_by: Option<HeldBy>,
    ) {
        self.database_frees = frees_at.map(|at| (at, held_by));
        self.tried.extend(batch.iter().cloned());
        self.batch_size = (self.batch_size * 2).min(MAX_BATCH);
    }

    /// What the database said of the candidates it was asked about beats the view's estimate
    /// (windows charged by other replicas, renewals): `verdict` gets the database's moment,
    /// dated against the view's clock `now`, and its reason when it gave one.
    pub(super) fn date_database_frees(&self, verdict: &mut PoolVerdict, now: OffsetDateTime) {
        if let Some((at, why)) = self.database_frees
            && let PoolVerdict::Try {
                frees_at, held_by, ..
            } = verdict
        {
            *frees_at = Some((at, now));
            *held_by = why.or(*held_by);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::Duration;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    /// The age of a view just read.
    const YOUNG: std::time::Duration = std::time::Duration::ZERO;

    fn keys(ids: &[&str]) -> Vec<KeyId> {
        ids.iter().map(|id| KeyId::parse(*id).unwrap()).collect()
    }

    /// A `Try` verdict over `batch`, held back by slots.
    fn try_verdict(
        batch: &[&str],
        free_seen: bool,
        frees_at: Option<(OffsetDateTime, OffsetDateTime)>,
    ) -> PoolVerdict {
        PoolVerdict::Try {
            batch: keys(batch),
            free_seen,
            frees_at,
            held_by: Some(HeldBy::Slots),
        }
    }

    fn settings(attempts: usize) -> ClaimSettings {
        ClaimSettings {
            batch: 8,
            attempts,
            rank_window: 256,
        }
    }

    /// The batch of a `Claim` step; panics on any other step.
    fn claimed(step: Step) -> (Vec<KeyId>, bool) {
        match step {
            Step::Claim { batch, free_seen } => (batch, free_seen),
            other => panic!("expected a claim, got {other:?}"),
        }
    }

    /// The batch of a `Claim` step; panics unless it claims `batch`, in that order, and saw a
    /// free candidate exactly when `free_seen`.
    fn assert_claims(step: Step, batch: &[&str], free_seen: bool) -> Vec<KeyId> {
        let (claimed, saw_free) = claimed(step);
        assert_eq!(claimed, keys(batch));
        assert_eq!(saw_free, free_seen, "free_seen");
        claimed
    }

    /// Panics unless `step` answers with the pool's `Try` verdict.
    fn assert_answers_try(step: &Step) {
        assert!(
            matches!(step, Step::Answer(PoolVerdict::Try { .. })),
            "{step:?}"
        );
    }

    /// The attempt of a waiter woken for the freed credential `key_id`.
    fn woken_for(key_id: &str, settings: &ClaimSettings) -> PoolAttempt {
        PoolAttempt::new(settings, Some(KeyId::parse(key_id).unwrap()))
    }

    impl PoolAttempt {
        /// [`PoolAttempt::decide`] on a view just read that the ranking did not load itself.
        fn decide_young(&mut self, verdict: PoolVerdict, settings: &ClaimSettings) -> Step {
            self.decide(verdict, false, YOUNG, settings)
        }
    }

    #[test]
    fn a_404_or_409_from_a_stale_view_reads_the_pool_before_it_is_answered() {
        let settings = settings(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        let step = attempt.decide_young(PoolVerdict::NotFound, &settings);
        assert!(matches!(step, Step::Reload), "{step:?}");
        attempt.reloaded();
        let step = attempt.decide_young(PoolVerdict::NotFound, &settings);
        assert!(
            matches!(step, Step::Answer(PoolVerdict::NotFound)),
            "{step:?}"
        );

        // a view the ranking itself just loaded is fresh
        let mut attempt = PoolAttempt::new(&settings, None);
        let step = attempt.decide(PoolVerdict::ModelNotSupported, true, YOUNG, &settings);
        assert!(
            matches!(step, Step::Answer(PoolVerdict::ModelNotSupported)),
            "{step:?}"
        );
    }

    #[test]
    fn a_free_candidate_is_claimed_without_using_up_an_attempt() {
        let settings = settings(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        let step = attempt.decide_young(try_verdict(&["key-a", "key-b"], true, None), &settings);
        assert_claims(step, &["key-a", "key-b"], true);
        assert_eq!(attempt.attempts, 0);
    }

    #[test]
    fn an_empty_batch_is_checked_by_one_claim_unless_the_view_is_fresh() {
        let settings = settings(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        let (batch, _) = claimed(attempt.decide_young(try_verdict(&[], false, None), &settings));
        assert!(batch.is_empty());
        let step = attempt.decide_young(try_verdict(&[], false, None), &settings);
        assert_answers_try(&step);

        let mut attempt = PoolAttempt::new(&settings, None);
        let step = attempt.decide(try_verdict(&[], false, None), true, YOUNG, &settings);
        assert_answers_try(&step);
    }

    #[test]
    fn candidates_believed_full_get_the_configured_attempts_then_the_answer() {
        let settings = settings(2);
        let mut attempt = PoolAttempt::new(&settings, None);
        for key in ["key-a", "key-b"] {
            let (batch, free_seen) =
                claimed(attempt.decide_young(try_verdict(&[key], false, None), &settings));
            assert!(!free_seen);
            attempt.missed(&batch, None, None);
        }
        let step = attempt.decide_young(try_verdict(&["key-c"], false, None), &settings);
        assert_answers_try(&step);
        assert_eq!(attempt.attempts, 2);
    }

    #[test]
    fn claims_per_pool_are_bounded_even_while_the_view_keeps_showing_free_candidates() {
        let settings = settings(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        for _ in 0..MAX_CLAIMS_PER_POOL {
            let (batch, _) =
                claimed(attempt.decide_young(try_verdict(&["key-a"], true, None), &settings));
            attempt.missed(&batch, None, None);
        }
        let step = attempt.decide_young(try_verdict(&["key-a"], true, None), &settings);
        assert_answers_try(&step);
    }

    #[test]
    fn the_freed_credential_of_a_wake_up_is_claimed_first_once_and_counts_as_free() {
        let settings = settings(1);
        let mut attempt = woken_for("key-h", &settings);
        let step = attempt.decide_young(try_verdict(&["key-a", "key-h"], false, None), &settings);
        let batch = assert_claims(step, &["key-h", "key-a"], true);
        assert_eq!(attempt.attempts, 0);
        attempt.missed(&batch, None, None);
        // the hint is spent: the next ranking is taken as it is
        let step = attempt.decide_young(try_verdict(&["key-b"], false, None), &settings);
        assert_claims(step, &["key-b"], false);
    }

    #[test]
    fn a_wake_up_for_a_credential_already_tried_is_ignored() {
        let settings = settings(1);
        let mut attempt = woken_for("key-h", &settings);
        attempt.missed(&keys(&["key-h"]), None, None);
        let step = attempt.decide_young(try_verdict(&["key-a"], false, None), &settings);
        assert_claims(step, &["key-a"], false);
    }

    #[test]
    fn a_full_pool_whose_view_expected_a_lease_end_by_now_is_read_once_before_answering() {
        let settings = settings(0);
        let passed = Some((now() - Duration::seconds(1), now()));
        let mut attempt = PoolAttempt::new(&settings, None);
        let step = attempt.decide_young(try_verdict(&["key-a"], false, passed), &settings);
        assert!(matches!(step, Step::CatchUp), "{step:?}");
        attempt.reloaded();
        let step = attempt.decide_young(try_verdict(&["key-a"], false, passed), &settings);
        assert_answers_try(&step);

        // a claim's word on when its batch frees says nothing of the rest of the view
        let settings = self::settings(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        let (batch, _) =
            claimed(attempt.decide_young(try_verdict(&["key-a"], false, None), &settings));
        attempt.missed(
            &batch,
            Some(now() + Duration::seconds(5)),
            Some(HeldBy::Slots),
        );
        let step = attempt.decide_young(try_verdict(&["key-b"], false, passed), &settings);
        assert!(matches!(step, Step::CatchUp), "{step:?}");
    }

    #[test]
    fn a_429_from_a_view_older_than_a_second_reads_the_pool_once_before_answering() {
        let settings = settings(1);
        let later = Some((now() + Duration::seconds(20), now()));
        let old = MAX_VIEW_AGE_FOR_429 + std::time::Duration::from_millis(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        let (batch, _) =
            claimed(attempt.decide(try_verdict(&["key-a"], false, later), false, old, &settings));
        attempt.missed(
            &batch,
            Some(now() + Duration::seconds(20)),
            Some(HeldBy::Slots),
        );
        let step = attempt.decide(try_verdict(&["key-b"], false, later), false, old, &settings);
        assert!(matches!(step, Step::CatchUp), "{step:?}");
        attempt.reloaded();
        // read once per attempt: the fresh view's word is the answer
        let step = attempt.decide(try_verdict(&["key-b"], false, later), false, old, &settings);
        assert_answers_try(&step);

        // a young view that expects nothing to have ended is answered from
        let mut attempt = PoolAttempt::new(&settings, None);
        let (batch, _) = claimed(attempt.decide(
            try_verdict(&["key-a"], false, later),
            false,
            MAX_VIEW_AGE_FOR_429,
            &settings,
        ));
        attempt.missed(&batch, None, None);
        let step = attempt.decide(
            try_verdict(&["key-b"], false, later),
            false,
            MAX_VIEW_AGE_FOR_429,
            &settings,
        );
        assert_answers_try(&step);
    }

    #[test]
    fn a_read_of_changes_does_not_confirm_an_old_views_occupancy_for_a_429() {
        let settings = settings(0);
        let later = Some((now() + Duration::seconds(20), now()));
        let old = MAX_VIEW_AGE_FOR_429 + std::time::Duration::from_millis(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        attempt.changes_read();
        let step = attempt.decide(try_verdict(&["key-a"], false, later), false, old, &settings);
        assert!(matches!(step, Step::CatchUp), "{step:?}");
        attempt.reloaded();
        let step = attempt.decide(try_verdict(&["key-a"], false, later), false, old, &settings);
        assert_answers_try(&step);
    }

    #[test]
    fn a_read_of_changes_makes_a_404_answerable() {
        let settings = settings(1);
        let mut attempt = PoolAttempt::new(&settings, None);
        attempt.changes_read();
        let step = attempt.decide_young(PoolVerdict::NotFound, &settings);
        assert!(
            matches!(step, Step::Answer(PoolVerdict::NotFound)),
            "{step:?}"
        );
    }

    #[test]
    fn a_miss_marks_its_batch_tried_and_doubles_the_next_batch_up_to_the_maximum() {
        let mut attempt = PoolAttempt::new(&settings(1), None);
        assert_eq!(attempt.batch_size, 8);
        attempt.missed(&keys(&["key-a", "key-b"]), None, None);
        assert_eq!(attempt.batch_size, 16);
        assert!(attempt.tried.contains(&KeyId::parse("key-a").unwrap()));
        assert!(attempt.tried.contains(&KeyId::parse("key-b").unwrap()));
        for _ in 0..10 {
            attempt.missed(&[], None, None);
        }
        assert_eq!(attempt.batch_size, MAX_BATCH);

        let none = ClaimSettings {
            batch: 0,
            ..settings(1)
        };
        assert_eq!(PoolAttempt::new(&none, None).batch_size, 1);
    }

    #[test]
    fn the_databases_word_on_when_a_candidate_frees_beats_the_views_estimate() {
        let mut attempt = PoolAttempt::new(&settings(1), None);
        let estimate = Some((now() + Duration::seconds(1), now()));
        let mut verdict = try_verdict(&["key-a"], false, estimate);
        attempt.date_database_frees(&mut verdict, now());
        assert!(matches!(
            verdict,
            PoolVerdict::Try { frees_at, held_by: Some(HeldBy::Slots), .. } if frees_at == estimate
        ));

        let at = now() + Duration::seconds(30);
        attempt.missed(&keys(&["key-a"]), Some(at), Some(HeldBy::TokensWindow));
        attempt.date_database_frees(&mut verdict, now());
        let mut not_found = PoolVerdict::NotFound;
        attempt.date_database_frees(&mut not_found, now());
        assert!(matches!(not_found, PoolVerdict::NotFound));
        assert!(matches!(
            verdict,
            PoolVerdict::Try {
                frees_at: Some((a, n)),
                held_by: Some(HeldBy::TokensWindow),
                ..
            } if a == at && n == now()
        ));

        // no reason given: the view's stays
        let mut verdict = try_verdict(&["key-a"], false, estimate);
        attempt.missed(&keys(&["key-a"]), Some(at), None);
        attempt.date_database_frees(&mut verdict, now());
        assert!(matches!(
            verdict,
            PoolVerdict::Try { held_by: Some(HeldBy::Slots), frees_at: Some((a, _)), .. } if a == at
        ));
    }
}
