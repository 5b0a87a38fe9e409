//! The claim's answers as the service decodes them: every word the claim statement can say (the
//! members of the enum types its answers are cast through) maps to an outcome, and a word it
//! cannot say is refused rather than read as something else.

use credpool::domain::{AffinityResult, HeldBy, KeyId, LeaseId, PoolName};
use credpool::store::leases::{ClaimOutcome, GrantedLease, Missed};
use credpool_test_support::TestApp;
use time::OffsetDateTime;

async fn words(db: &sqlx::PgPool, enum_type: &str) -> Vec<String> {
    // (the type's name as a value: its members are read from the catalog)
    let words: Vec<String> = sqlx::query_scalar(
        "SELECT e.enumlabel::text FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid
         WHERE t.typname = $1 ORDER BY e.enumsortorder",
    )
    .bind(enum_type)
    .fetch_all(db)
    .await
    .unwrap();
    assert!(!words.is_empty(), "{enum_type} has no members");
    words
}

fn lease() -> GrantedLease {
    GrantedLease {
        key_id: KeyId::parse("key-a").unwrap(),
        lease_id: LeaseId::generate(),
        granted_at: OffsetDateTime::now_utc(),
        lease_until: OffsetDateTime::now_utc(),
        probe: false,
        provider_model: "gpt-4o".into(),
        sealed_secret: Vec::new(),
        pruned_expired: false,
        pool: PoolName::default_pool(),
        fence: 1,
        tenant: "default".into(),
        affinity: None,
    }
}

#[tokio::test]
async fn every_word_the_claim_can_answer_decodes_to_its_outcome() {
    let app = TestApp::spawn().await;
    let at = Some(OffsetDateTime::now_utc());

    for state in words(&app.db, "credpool_claim_state").await {
        let held_by = (state == "tenant_limit").then_some("tenant");
        let granted = (state == "replayed").then(lease);
        let yield_to = (state == "yield").then(|| "team-b".to_owned());
        let outcome = ClaimOutcome::decode(Some(&state), held_by, None, at, yield_to, granted)
            .unwrap_or_else(|e| panic!("state {state:?}: {e}"));
        let expected = match state.as_str() {
            "replayed" => matches!(outcome, ClaimOutcome::Replayed(_)),
            "conflict" => matches!(outcome, ClaimOutcome::Conflict),
            "in_flight" => matches!(outcome, ClaimOutcome::InFlight),
            "busy" => matches!(outcome, ClaimOutcome::Busy { bound: false, .. }),
            "unauthorized" => matches!(outcome, ClaimOutcome::Unauthorized),
            "pool_not_allowed" => matches!(outcome, ClaimOutcome::PoolNotAllowed),
            "tenant_limit" => matches!(outcome, ClaimOutcome::TenantLimit { window: false, .. }),
            "yield" => matches!(&outcome, ClaimOutcome::Yield { to } if to == "team-b"),
            other => panic!("a claim state this test does not know: {other:?}"),
        };
        assert!(expected, "state {state:?} decoded as {outcome:?}");
    }

    for held_by in words(&app.db, "credpool_held_by").await {
        let outcome = match held_by.as_str() {
            "tenant" | "tenant_window" => {
                ClaimOutcome::decode(Some("tenant_limit"), Some(&held_by), None, at, None, None)
            }
            _ => ClaimOutcome::decode(None, Some(&held_by), None, at, None, None),
        }
        .unwrap_or_else(|e| panic!("held_by {held_by:?}: {e}"));
        match outcome {
            ClaimOutcome::TenantLimit { window, frees_at } => {
                assert_eq!(window, held_by == "tenant_window");
                assert_eq!(frees_at, at);
            }
            ClaimOutcome::Nothing(Missed {
                held_by: Some(read),
                frees_at,
            }) => {
                assert_eq!(read.as_str(), held_by, "{held_by:?} read back");
                assert_eq!(frees_at, at);
            }
            other => panic!("held_by {held_by:?} decoded as {other:?}"),
        }
    }

    for affinity in words(&app.db, "credpool_affinity_answer").await {
        if affinity == "bound" {
            let outcome =
                ClaimOutcome::decode(None, Some("slots"), Some("bound"), at, None, None).unwrap();
            assert!(
                matches!(
                    outcome,
                    ClaimOutcome::Bound(Missed {
                        held_by: Some(HeldBy::Slots),
                        ..
                    })
                ),
                "{outcome:?}"
            );
        } else {
            let result = AffinityResult::parse(&affinity)
                .unwrap_or_else(|| panic!("affinity {affinity:?} does not parse"));
            assert_eq!(result.as_str(), affinity);
            let outcome =
                ClaimOutcome::decode(None, None, Some(&affinity), None, None, Some(lease()))
                    .unwrap();
            assert!(matches!(outcome, ClaimOutcome::Granted(_)), "{outcome:?}");
        }
    }
}

#[test]
fn a_word_the_claim_cannot_say_is_refused_not_read_as_another() {
    let at = Some(OffsetDateTime::now_utc());
    for (state, held_by, affinity) in [
        (Some("granted_twice"), None, None),
        (None, Some("moon_phase"), None),
        (Some("busy"), Some("moon_phase"), None),
        (Some("tenant_limit"), Some("slots"), None),
        (Some("tenant_limit"), None, None),
        (None, None, Some("sticky")),
    ] {
        let decoded = ClaimOutcome::decode(state, held_by, affinity, at, None, None);
        assert!(
            decoded.is_err(),
            "{state:?}/{held_by:?}/{affinity:?} decoded as {decoded:?}"
        );
    }
    // a grant can only be new or replayed
    let decoded = ClaimOutcome::decode(Some("conflict"), None, None, None, None, Some(lease()));
    assert!(decoded.is_err(), "{decoded:?}");
    // a yield names the tenant yielded to
    let decoded = ClaimOutcome::decode(Some("yield"), None, None, None, None, None);
    assert!(decoded.is_err(), "{decoded:?}");
}
