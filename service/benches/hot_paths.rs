//! Micro-benchmarks of the two CPU costs on every allocation that are not PostgreSQL's: ranking
//! the candidates of a pool, and parsing the request. `cargo bench` runs them (not part of the
//! tests); the service's end-to-end figures come from `credpool bench`.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use time::OffsetDateTime;

use credpool::allocator::PoolView;
use credpool::allocator::health::{Health, HealthPolicy};
use credpool::allocator::rank;
use credpool::allocator::scoring::ScoringPolicy;
use credpool::domain::{KeyId, ModelName, Status};
use credpool::store::candidates::{CredentialFacts, PoolSnapshot};

/// A pool of `n` credentials of limit 4 serving `gpt-4o`, with varied occupancy, recency and
/// health, as a candidate view.
fn view(n: usize) -> PoolView {
    let now = OffsetDateTime::now_utc();
    let credentials = (0..n)
        .map(|i| {
            let mut health = Health::new(Status::Available);
            health.successes = (i % 50) as f64;
            health.failures = (i % 7) as f64;
            health.rate_limits = (i % 13 == 0) as u8 as f64;
            CredentialFacts {
                key_id: KeyId::parse(format!("key-{i:05}")).unwrap(),
                models: vec!["gpt-4o".into(), "gpt-4o-mini".into()],
                aliases: Default::default(),
                max_concurrent_uses: 4,
                health,
                slots_over_limit: false,
                draining: false,
                in_flight: (i % 5) as i64,
                slot0_free: i % 5 == 0,
                next_lease_end: None,
                last_used_at: Some(now - time::Duration::seconds((i % 400) as i64)),
                windows: Default::default(),
            }
        })
        .collect();
    let snapshot = PoolSnapshot {
        version: Some(1),
        db_now: now,
        read_at: Instant::now(),
        xmin: 0,
        credentials,
        departed: Vec::new(),
    };
    PoolView::from_snapshot(
        snapshot,
        &ScoringPolicy::default(),
        &HealthPolicy::default(),
    )
}

fn ranking(c: &mut Criterion) {
    let view = view(10_000);
    let model = ModelName::parse("gpt-4o").unwrap();
    let policy = ScoringPolicy::default();
    let mut rng = SmallRng::seed_from_u64(7);
    // every free candidate scored: the cost of ranking a 10,000-credential pool exactly
    c.bench_function("rank 10,000 candidates, best 8", |b| {
        b.iter(|| black_box(rank(&view, &model, 8, usize::MAX, &policy, &mut rng)))
    });
    // what an allocation does by default: a window of 256 free candidates
    c.bench_function("rank 10,000 candidates, window 256, best 8", |b| {
        b.iter(|| black_box(rank(&view, &model, 8, 256, &policy, &mut rng)))
    });
}

fn parsing(c: &mut Criterion) {
    let body = br#"{"provider":"openai","model":"gpt-4o","pool":"default","lease_seconds":60,"holder":"executor-17"}"#;
    c.bench_function("parse an allocate request", |b| {
        b.iter(|| {
            black_box(
                credpool::http::parse_allocate(
                    black_box(body),
                    3600,
                    std::time::Duration::from_secs(30),
                )
                .unwrap(),
            )
        })
    });
}

criterion_group!(benches, ranking, parsing);
criterion_main!(benches);
