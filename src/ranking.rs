//! Ranking: the order in which the claim statement tries candidates. Pure: no I/O; the database
//! clock and the random source are parameters, so tests pin the order exactly.
//!
//! This is the least-recently-used ranking of the lease core: credentials with a free slot (as
//! last seen) first, then the longest idle first, with a small uniform jitter so that equally idle
//! credentials share traffic and concurrent requests do not all try the same credential first.
//! The claim statement stays the truth at the moment of the claim; the ranking only decides order.

use rand::RngExt;
use time::OffsetDateTime;

use crate::domain::KeyId;

/// Idle time beyond which credentials count as equally idle, in seconds. A credential never used
/// counts as idle this long.
pub const IDLE_CAP_SECONDS: f64 = 300.0;

/// One usable credential as the candidate read saw it.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The credential.
    pub key_id: KeyId,
    /// When its latest lease was granted (database clock); `None` if never.
    pub last_used_at: Option<OffsetDateTime>,
    /// Slots that were free when the candidates were read (may be stale by the time of the claim).
    pub free_slots: i64,
}

/// Orders candidates for the claim statement: those with a free slot first, then by idle time
/// (seconds since `last_used_at`, capped at [`IDLE_CAP_SECONDS`]) plus uniform jitter in
/// `[0, jitter_seconds)`, longest idle first. `now` is the database clock.
pub fn rank_least_recently_used<R: rand::Rng + ?Sized>(
    candidates: Vec<Candidate>,
    now: OffsetDateTime,
    jitter_seconds: f64,
    rng: &mut R,
) -> Vec<KeyId> {
    let mut scored: Vec<(bool, f64, KeyId)> = candidates
        .into_iter()
        .map(|c| {
            let idle = c
                .last_used_at
                .map(|t| (now - t).as_seconds_f64().clamp(0.0, IDLE_CAP_SECONDS))
                .unwrap_or(IDLE_CAP_SECONDS);
            let jitter = if jitter_seconds > 0.0 {
                rng.random_range(0.0..jitter_seconds)
            } else {
                0.0
            };
            (c.free_slots > 0, idle + jitter, c.key_id)
        })
        .collect();
    // Free before full; then longest idle first; the key id breaks exact ties so that a jitter of
    // zero gives a deterministic order.
    scored.sort_by(|a, b| {
        b.0.cmp(&a.0)
            .then(b.1.total_cmp(&a.1))
            .then_with(|| a.2.cmp(&b.2))
    });
    scored.into_iter().map(|(_, _, key_id)| key_id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use time::Duration;

    fn candidate(
        id: &str,
        idle_seconds: Option<i64>,
        free_slots: i64,
        now: OffsetDateTime,
    ) -> Candidate {
        Candidate {
            key_id: KeyId::parse(id).unwrap(),
            last_used_at: idle_seconds.map(|s| now - Duration::seconds(s)),
            free_slots,
        }
    }

    fn ids(keys: &[KeyId]) -> Vec<&str> {
        keys.iter().map(KeyId::as_str).collect()
    }

    #[test]
    fn longest_idle_first_and_never_used_counts_as_fully_idle() {
        let now = OffsetDateTime::now_utc();
        let ranked = rank_least_recently_used(
            vec![
                candidate("recent", Some(1), 1, now),
                candidate("older", Some(60), 1, now),
                candidate("never", None, 1, now),
            ],
            now,
            0.0,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(ids(&ranked), ["never", "older", "recent"]);
    }

    #[test]
    fn full_candidates_go_last_however_idle() {
        let now = OffsetDateTime::now_utc();
        let ranked = rank_least_recently_used(
            vec![
                candidate("full", None, 0, now),
                candidate("free", Some(1), 2, now),
            ],
            now,
            0.0,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(ids(&ranked), ["free", "full"]);
    }

    #[test]
    fn zero_jitter_is_deterministic_and_jitter_spreads_equal_candidates() {
        let now = OffsetDateTime::now_utc();
        let equal = || {
            (0..8)
                .map(|i| candidate(&format!("k{i}"), None, 1, now))
                .collect::<Vec<_>>()
        };
        let mut rng = StdRng::seed_from_u64(7);
        let first = rank_least_recently_used(equal(), now, 0.0, &mut rng);
        for _ in 0..20 {
            assert_eq!(rank_least_recently_used(equal(), now, 0.0, &mut rng), first);
        }
        let mut leaders = std::collections::HashSet::new();
        for _ in 0..200 {
            leaders.insert(rank_least_recently_used(equal(), now, 1.0, &mut rng)[0].clone());
        }
        assert_eq!(
            leaders.len(),
            8,
            "every equal candidate should lead sometimes"
        );
    }

    #[test]
    fn jitter_does_not_override_a_real_idle_difference() {
        let now = OffsetDateTime::now_utc();
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..100 {
            let ranked = rank_least_recently_used(
                vec![
                    candidate("busy", Some(0), 1, now),
                    candidate("idle", Some(30), 1, now),
                ],
                now,
                1.0,
                &mut rng,
            );
            assert_eq!(ids(&ranked), ["idle", "busy"]);
        }
    }
}
