//! credpool on Citus: a real Citus cluster (a coordinator and two workers, each a private
//! PostgreSQL cluster started by credpool's embedded launcher) per test. The harness is
//! [`cluster::CitusCluster`]; a machine without Citus skips these tests with a `skipped:` line
//! (build Citus with `../shared/citus/build.sh`, see docs/src/citus.md), as does one with
//! `CREDPOOL_TEST_SKIP_CITUS=1`.

mod cluster;

use std::process::Command;
use std::time::Instant;

use cluster::{CitusCluster, connect};
use credpool::store::citus::{DISTRIBUTED, REFERENCE};
use credpool_test_support::{
    Answer, AppOptions, INTERNAL_KEY, Remote, Service, allocate_at_once, group_release, json_body,
    policy, release_body, renew_body, serve,
};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};

/// The tables that hold one credential's rows, by provider, checked for where they live.
const PER_CREDENTIAL: [&str; 3] = ["credentials", "lease_slots", "lease_windows"];

#[tokio::test(flavor = "multi_thread")]
async fn a_credpool_database_distributes_by_provider_once_and_keeps_its_rows() {
    let Some((cluster, url, db, mut coordinator)) = migrated_cluster().await else {
        return;
    };
    let (first, second) = database_in_use(&mut coordinator).await;
    let before = row_counts(&mut coordinator).await;
    assert_eq!(before[1], 3 * 2 + 3 * 3, "slot rows before: {before:?}");

    let report = distribute(&url);
    assert_eq!(
        report["distributed"].as_array().unwrap().len(),
        DISTRIBUTED.len()
    );
    assert_eq!(
        report["reference"].as_array().unwrap().len(),
        REFERENCE.len()
    );
    assert_eq!(report["workers"], 2);
    // the claim's, the release's and END's functions plan per call on Citus
    assert!(report["per_call_plans"].as_i64().unwrap() >= 3, "{report}");

    // every lease table hash-distributed and co-located with credentials; the tenant tables on
    // every node
    let colocated: Vec<(String, String)> = sqlx::query_as(
        "SELECT p.logicalrelid::regclass::text, p.partmethod::text
         FROM pg_dist_partition p, pg_dist_partition c
         WHERE c.logicalrelid = 'credentials'::regclass AND p.colocationid = c.colocationid",
    )
    .fetch_all(&mut coordinator)
    .await
    .unwrap();
    for table in DISTRIBUTED {
        assert!(
            colocated.iter().any(|(t, m)| t == table && m == "h"),
            "{table} is not distributed with credentials: {colocated:?}"
        );
    }
    for table in REFERENCE {
        let replicated: Option<String> = sqlx::query_scalar(
            "SELECT repmodel::text FROM pg_dist_partition WHERE logicalrelid = $1::regclass",
        )
        .bind(table)
        .fetch_one(&mut coordinator)
        .await
        .unwrap();
        assert_eq!(replicated.as_deref(), Some("t"), "{table}");
    }

    // each provider's rows of every table live on one worker, and the two providers' on two
    let mut homes = Vec::new();
    for provider in [&first, &second] {
        let nodes: Vec<i32> = sqlx::query_scalar(
            "SELECT DISTINCT s.nodeport FROM unnest($1::text[]) AS t (name)
             JOIN citus_shards s ON s.table_name = t.name::regclass
                AND s.shardid = get_shard_id_for_distribution_column(t.name, $2)",
        )
        .bind(PER_CREDENTIAL)
        .bind(provider)
        .fetch_all(&mut coordinator)
        .await
        .unwrap();
        assert_eq!(nodes.len(), 1, "{provider}'s rows are on {nodes:?}");
        homes.push(nodes[0]);
        let mut worker = connect(&cluster.worker_url(worker_of(&cluster, nodes[0]))).await;
        let shard: String = sqlx::query_scalar(
            "SELECT shard_name FROM citus_shards
             WHERE table_name = 'lease_slots'::regclass
               AND shardid = get_shard_id_for_distribution_column('lease_slots', $1)",
        )
        .bind(provider)
        .fetch_one(&mut coordinator)
        .await
        .unwrap();
        let slots: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {shard} WHERE provider = $1"
        )))
        .bind(provider)
        .fetch_one(&mut worker)
        .await
        .unwrap();
        let expected = if provider == &first { 6 } else { 9 };
        assert_eq!(slots, expected, "{provider}'s slot rows on its worker");
        let _ = worker.close().await;
    }
    assert_ne!(homes[0], homes[1]);
    // nothing lost or doubled on the way
    assert_eq!(row_counts(&mut coordinator).await, before);

    // again: nothing left to do
    let again = distribute(&url);
    assert!(
        again["distributed"].as_array().unwrap().is_empty()
            && again["reference"].as_array().unwrap().is_empty()
            && again["keys"].as_array().unwrap().is_empty(),
        "{again}"
    );
    assert_eq!(row_counts(&mut coordinator).await, before);

    // a stopped worker takes its providers' rows away, and no others
    let mut cluster = cluster;
    let down = worker_of(&cluster, homes[1]);
    cluster.stop_worker(down).await;
    let mut coordinator = connect(&url).await;
    assert_eq!(slot_rows(&mut coordinator, &first).await.unwrap(), 6);
    assert!(slot_rows(&mut coordinator, &second).await.is_err());
    cluster.start_worker(down).await;
    let mut coordinator = connect(&url).await;
    assert_eq!(slot_rows(&mut coordinator, &second).await.unwrap(), 9);
    let _ = coordinator.close().await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slot_pick_for_one_provider_runs_on_its_worker_alone_and_skips_held_slots() {
    let Some((_cluster, url, db, mut coordinator)) = migrated_cluster().await else {
        return;
    };
    let (first, _) = database_in_use(&mut coordinator).await;
    distribute(&url);

    // the claim's pick as credpool_claim_pick_plain writes it (credpool's own eligibility rule,
    // the slot row locked SKIP LOCKED), for one provider named as a value: Citus plans one task,
    // on that provider's worker
    let pick = format!(
        "SELECT s.key_id, s.slot
         FROM credentials c
         JOIN lease_slots s ON s.key_id = c.key_id AND s.provider = c.provider
         WHERE c.provider = '{first}' AND s.provider = '{first}'
           AND credpool_slot_eligible(c, s, '{first}', 'default', 'm1', now(),
                                      now() + interval '1 minute')
         ORDER BY s.key_id, s.slot
         LIMIT 1
         FOR UPDATE OF s SKIP LOCKED"
    );
    let plan: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (COSTS OFF) {pick}")))
            .fetch_all(&mut coordinator)
            .await
            .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("Task Count: 1"), "{plan}");

    // six transactions at once take the provider's six slots, each a different one; a seventh
    // finds none free
    let mut holders = Vec::new();
    let mut taken = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let mut conn = connect(&url).await;
        sqlx::raw_sql("BEGIN").execute(&mut conn).await.unwrap();
        let slot: (String, i32) = sqlx::query_as(sqlx::AssertSqlSafe(pick.clone()))
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert!(taken.insert(slot.clone()), "{slot:?} picked twice");
        holders.push(conn);
    }
    let mut seventh = connect(&url).await;
    let none: Option<(String, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(pick.clone()))
        .fetch_optional(&mut seventh)
        .await
        .unwrap();
    assert_eq!(none, None);
    for conn in holders {
        let _ = conn.close().await;
    }
    let _ = coordinator.close().await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_manages_credentials_of_two_workers_through_the_api() {
    let Some((_cluster, url, db, mut coordinator)) = migrated_cluster().await else {
        return;
    };
    let (first, second) = providers_on_different_workers(&mut coordinator).await;
    distribute(&url);
    let (addr, _stop) = serve(db.clone(), &AppOptions::default()).await;
    let app = Remote::at(addr);

    // created: each credential's rows on its provider's worker, counted through the coordinator
    app.put_key("a-1", &first, "default", &["m1"], 2).await;
    app.put_key("b-1", &second, "default", &["m1"], 3).await;
    assert_eq!(slot_rows(&mut coordinator, &first).await.unwrap(), 2);
    assert_eq!(slot_rows(&mut coordinator, &second).await.unwrap(), 3);

    // replaced with a higher limit: the fit adds the slot rows; moved to another provider:
    // refused, nothing changes
    app.put_key("a-1", &first, "default", &["m1"], 4).await;
    assert_eq!(slot_rows(&mut coordinator, &first).await.unwrap(), 4);
    let moved = json!({"provider": second, "pool": "default", "models": ["m1"],
                       "max_concurrent_uses": 1, "secret": {"api_key": "sk-moved"}});
    app.put_key_raw("a-1", moved)
        .refused(StatusCode::CONFLICT, "provider_changed")
        .await;
    assert_eq!(slot_rows(&mut coordinator, &first).await.unwrap(), 4);

    // a lease that ran out in its slot is ended by the next fit, in the trail (END: a statement
    // that joins, planned for the provider's value)
    sqlx::query(
        "UPDATE lease_slots
         SET lease_id = 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', pool = 'default', holder = 'h',
             granted_at = '2026-01-01 00:00Z', lease_until = '2026-01-01 00:01Z', fence = 1
         WHERE provider = $1 AND key_id = 'a-1' AND slot = 0",
    )
    .bind(&first)
    .execute(&mut coordinator)
    .await
    .unwrap();
    app.put_key("a-1", &first, "default", &["m1"], 4).await;
    let ended: Vec<(String, String)> =
        sqlx::query_as("SELECT event, key_id FROM lease_events WHERE provider = $1")
            .bind(&first)
            .fetch_all(&mut coordinator)
            .await
            .unwrap();
    assert_eq!(ended, [("expired".to_owned(), "a-1".to_owned())]);
    assert_eq!(app.credential("a-1").await["leases"], json!([]));

    // drained, lowered, given rate windows: every slot row follows, and the window row is there
    let patched = app
        .patch_key(
            "b-1",
            json!({"state": "drain", "max_concurrent_uses": 2,
                   "rate_limits": [{"requests": 5, "seconds": 60}, {"tokens": 1000, "seconds": 60}]}),
        )
        .ok_json()
        .await;
    assert_eq!(patched["draining"], true);
    assert_eq!(patched["windows"].as_array().unwrap().len(), 2, "{patched}");
    let (slots, draining, windowed): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE draining), count(*) FILTER (WHERE windowed)
         FROM lease_slots WHERE provider = $1",
    )
    .bind(&second)
    .fetch_one(&mut coordinator)
    .await
    .unwrap();
    assert_eq!((slots, draining, windowed), (2, 2, 2));

    // read back: the list, one credential, the pools
    let listed = app.admin_get("/api/admin/keys").await;
    let keys: Vec<&str> = listed["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key_id"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["a-1", "b-1"]);
    assert_eq!(app.credential("a-1").await["max_concurrent_uses"], 4);
    let pools = app.admin_get("/api/admin/pools").await;
    let total: Vec<i64> = pools["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["total_slots"].as_i64().unwrap())
        .collect();
    assert_eq!(total.iter().sum::<i64>(), 4 + 2, "{pools}");

    // deleted: its rows go, its departure is noted, the other provider's stay
    let deleted = app.admin(Method::DELETE, "/api/admin/keys/b-1", None).await;
    assert_eq!(deleted.status(), StatusCode::OK);
    assert_eq!(slot_rows(&mut coordinator, &second).await.unwrap(), 0);
    assert_eq!(slot_rows(&mut coordinator, &first).await.unwrap(), 4);
    let departed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM credential_departures WHERE provider = $1")
            .bind(&second)
            .fetch_one(&mut coordinator)
            .await
            .unwrap();
    assert_eq!(departed, 1);

    // the cleanup pass's steps run on the cluster (all but the audit proof's advance)
    for step in [
        "credpool_reap_expired_leases(1000)",
        "credpool_refit_over_limit(100)",
        "credpool_refit_tenants(100)",
        "credpool_recover_cooldowns(1000)",
        "credpool_purge_audit('30 days', 10000)",
        "credpool_purge_requests('1 hour', 10000)",
        "credpool_compact_pool_versions()",
        "credpool_purge_affinity(NULL, 10000)",
        "credpool_make_trail_days(7)",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {step}")))
            .execute(&mut coordinator)
            .await
            .unwrap_or_else(|e| panic!("{step}: {e}"));
    }
    let _ = coordinator.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_for_providers_on_two_workers_are_granted_exactly_to_their_limits_and_replayed() {
    let Some(Served {
        cluster: _cluster,
        db,
        mut coordinator,
        first,
        second,
        replicas,
        addrs: _addrs,
        _stops,
    }) = served().await
    else {
        return;
    };
    replicas[0]
        .put_key("a-1", &first, "default", &["m1"], 2)
        .await;
    replicas[0]
        .put_key("a-2", &first, "default", &["m1"], 1)
        .await;
    replicas[0]
        .put_key("b-1", &second, "default", &["m1"], 2)
        .await;

    // six claims for each provider at once, over both replicas: each provider grants exactly
    // its three slots (no oversell, no underuse), the others answer 429 with a Retry-After
    let body = |provider: &str| json!({"provider": provider, "model": "m1", "lease_seconds": 60});
    for round in 0..3 {
        let bodies = (0..12)
            .map(|i| body(if i % 2 == 0 { &first } else { &second }))
            .collect();
        let answers = allocate_at_once(&replicas, INTERNAL_KEY, bodies).await;
        let mut granted: std::collections::BTreeMap<String, Vec<(String, i64)>> =
            std::collections::BTreeMap::new();
        for answer in &answers {
            match answer.status {
                StatusCode::OK => granted
                    .entry(answer.body["provider"].as_str().unwrap().to_owned())
                    .or_default()
                    .push((
                        answer.body["key_id"].as_str().unwrap().to_owned(),
                        answer.body["fence"].as_i64().unwrap(),
                    )),
                StatusCode::TOO_MANY_REQUESTS => {
                    assert!(answer.retry_after.is_some(), "{}", answer.text);
                }
                status => panic!("round {round}: {status}: {}", answer.text),
            }
        }
        let on_first = granted.get(&first).cloned().unwrap_or_default();
        let on_second = granted.get(&second).cloned().unwrap_or_default();
        if round == 0 {
            assert_eq!(on_first.len(), 3, "round {round}: {answers:?}");
            assert_eq!(on_second.len(), 2, "round {round}: {answers:?}");
            let per_key = |key: &str| on_first.iter().filter(|(k, _)| k == key).count();
            assert_eq!((per_key("a-1"), per_key("a-2")), (2, 1));
        } else {
            // every slot is held: nothing more is granted, whatever the replica
            assert!(granted.is_empty(), "round {round}: {granted:?}");
        }
        // the slot rows say the same as the answers: one live lease per slot, never more
        let live: Vec<(String, i64)> = sqlx::query_as(
            "SELECT provider, count(*) FROM lease_slots
             WHERE lease_id IS NOT NULL AND lease_until > now()
             GROUP BY provider ORDER BY provider",
        )
        .fetch_all(&mut coordinator)
        .await
        .unwrap();
        let mut expected = vec![(first.clone(), 3), (second.clone(), 2)];
        expected.sort();
        assert_eq!(live, expected, "round {round}");
    }

    // a request id on the second provider's worker: a retry replays its lease, other
    // parameters are a conflict, and its row stays on that worker (in its provider's shard)
    replicas[0]
        .put_key("b-2", &second, "default", &["m1"], 1)
        .await;
    let asked = json!({"provider": second, "model": "m1", "lease_seconds": 60,
                       "request_id": "req-1"});
    let first_answer = replicas[0].lease(asked.clone()).await;
    let retried = replicas[1].lease(asked).await;
    assert_eq!(retried["lease_id"], first_answer["lease_id"]);
    assert_eq!(retried["fence"], first_answer["fence"]);
    replicas[1]
        .allocate(
            json!({"provider": second, "model": "m1", "lease_seconds": 30,
                         "request_id": "req-1"}),
        )
        .refused(StatusCode::CONFLICT, "request_id_conflict")
        .await;
    let remembered: Vec<String> =
        sqlx::query_scalar("SELECT provider FROM lease_requests WHERE request_id = 'req-1'")
            .fetch_all(&mut coordinator)
            .await
            .unwrap();
    assert_eq!(remembered, std::slice::from_ref(&second));

    // every grant is in the trail on its provider's worker, each with its own fence
    let trail: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT provider, event, count(DISTINCT fence) FROM lease_events GROUP BY 1, 2 ORDER BY 1",
    )
    .fetch_all(&mut coordinator)
    .await
    .unwrap();
    let mut expected = vec![
        (first.clone(), "granted".to_owned(), 3),
        (second.clone(), "granted".to_owned(), 3),
    ];
    expected.sort();
    assert_eq!(trail, expected);
    let _ = coordinator.close().await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn leases_on_two_workers_are_renewed_and_released_with_their_outcomes_counted() {
    let Some(Served {
        mut cluster,
        db,
        mut coordinator,
        first,
        second,
        replicas,
        addrs: _addrs,
        _stops,
    }) = served().await
    else {
        return;
    };
    replicas[0]
        .put_key("a-1", &first, "default", &["m1"], 2)
        .await;
    replicas[0]
        .put_key("b-1", &second, "default", &["m1"], 2)
        .await;
    let body = |provider: &str| json!({"provider": provider, "model": "m1", "lease_seconds": 60});

    // a lease on each worker, renewed through the other replica: it ends later; a renewal
    // with another fence finds no lease
    let a = replicas[0].lease(body(&first)).await;
    let b = replicas[0].lease(body(&second)).await;
    for lease in [&a, &b] {
        replicas[1].renew(renew_body(lease, 600)).ok_json().await;
        assert!(
            ends_after(&mut coordinator, lease, 300).await,
            "not renewed: {lease}"
        );
        let mut fenced = renew_body(lease, 900);
        fenced["fence"] = json!(lease["fence"].as_i64().unwrap() + 1_000);
        replicas[1]
            .renew(fenced)
            .refused(StatusCode::GONE, "lease_lost")
            .await;
    }

    // a group of both providers' leases, renewed and then released in one call each (one
    // statement per provider: each runs on its worker)
    let a2 = replicas[1].lease(body(&first)).await;
    let b2 = replicas[1].lease(body(&second)).await;
    let renewals = json!([
        {"lease_id": a2["lease_id"], "key_id": "a-1", "provider": first, "pool": "default",
         "fence": a2["fence"], "lease_seconds": 700, "key_hash": null},
        {"lease_id": b2["lease_id"], "key_id": "b-1", "provider": second, "pool": "default",
         "fence": b2["fence"], "lease_seconds": 700, "key_hash": null},
    ]);
    let renewed: Vec<Option<String>> =
        sqlx::query_scalar("SELECT lease_until::text FROM credpool_renew($1) ORDER BY renewal")
            .bind(&renewals)
            .fetch_all(&mut coordinator)
            .await
            .unwrap();
    assert!(renewed.iter().all(Option::is_some), "{renewed:?}");
    for lease in [&a2, &b2] {
        assert!(ends_after(&mut coordinator, lease, 600).await, "{lease}");
    }
    let verdicts: Vec<String> =
        sqlx::query_scalar("SELECT verdict FROM credpool_release($1, $2) ORDER BY release")
            .bind(json!([
                group_release(&a2, "success"),
                group_release(&b2, "success")
            ]))
            .bind(policy())
            .fetch_all(&mut coordinator)
            .await
            .unwrap();
    assert_eq!(verdicts, ["released", "released"]);

    // releases through the service: a success, then the same release again (nothing left to
    // release), and a rate limit that rests the second provider's credential without moving
    // its configuration version (claims in flight on it stay valid)
    let version = |key: &'static str| {
        sqlx::query_scalar::<_, i64>("SELECT config_version FROM credentials WHERE key_id = $1")
            .bind(key)
    };
    let before = version("b-1").fetch_one(&mut coordinator).await.unwrap();
    replicas[1].release_ok(&a, "success").await;
    let again = replicas[0]
        .release(release_body(&a, "success"))
        .ok_json()
        .await;
    assert_eq!(
        (&again["released"], &again["reason"]),
        (&json!(false), &json!("not_found"))
    );
    // a lease that expired in its slot: its release finds it expired, and its report counts
    // once however often it is sent (on the lease's provider's worker)
    let late = replicas[0].lease(body(&first)).await;
    sqlx::query(
        "UPDATE lease_slots
         SET granted_at = now() - interval '2 seconds', lease_until = now() - interval '1 second'
         WHERE lease_id = $1::uuid",
    )
    .bind(late["lease_id"].as_str().unwrap())
    .execute(&mut coordinator)
    .await
    .unwrap();
    let mut reasons = Vec::new();
    for replica in &replicas {
        let answer = replica
            .release(release_body(&late, "failure"))
            .ok_json()
            .await;
        reasons.push(answer["reason"].clone());
    }
    assert_eq!(reasons, [json!("expired"), json!("not_found")]);
    let reported: Vec<(String, String)> = sqlx::query_as(
        "SELECT provider, event FROM lease_events
         WHERE lease_id = $1::uuid AND event IN ('expired', 'outcome_after_expiry') ORDER BY event",
    )
    .bind(late["lease_id"].as_str().unwrap())
    .fetch_all(&mut coordinator)
    .await
    .unwrap();
    assert_eq!(
        reported,
        [
            (first.clone(), "expired".to_owned()),
            (first.clone(), "outcome_after_expiry".to_owned())
        ]
    );
    let mut limited = release_body(&b, "rate_limited");
    limited["retry_after_seconds"] = json!(120);
    let answer = replicas[0].release(limited).ok_json().await;
    assert_eq!(answer["released"], true, "{answer}");
    let (status, after): (String, i64) =
        sqlx::query_as("SELECT status, config_version FROM credentials WHERE key_id = 'b-1'")
            .fetch_one(&mut coordinator)
            .await
            .unwrap();
    assert_eq!((status.as_str(), after), ("rate_limited", before));
    let changed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM credential_events WHERE key_id = 'b-1' AND event = 'status_changed'",
    )
    .fetch_one(&mut coordinator)
    .await
    .unwrap();
    assert_eq!(changed, 1);

    // every slot of the first provider is free again; the second's credential rests
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(replicas[0].lease(body(&first)).await);
    }
    let refused = replicas[1].allocate(body(&second)).await;
    assert_ne!(refused.status(), StatusCode::OK);

    // the trail on each provider's worker: two grants, two renewals, two releases each
    let trail: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT provider, event, count(*) FROM lease_events
         WHERE event IN ('renewed', 'released') GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(&mut coordinator)
    .await
    .unwrap();
    let mut expected = vec![
        (first.clone(), "released".to_owned(), 2),
        (first.clone(), "renewed".to_owned(), 2),
        (second.clone(), "released".to_owned(), 2),
        (second.clone(), "renewed".to_owned(), 2),
    ];
    expected.sort();
    assert_eq!(trail, expected);

    // the second provider's worker stopped: the first provider's leases are still released,
    // renewed and granted; a claim for the second answers 503
    replicas[0]
        .put_key("b-2", &second, "default", &["m1"], 1)
        .await;
    let home: i32 = sqlx::query_scalar(
        "SELECT nodeport FROM citus_shards
         WHERE table_name = 'credentials'::regclass
           AND shardid = get_shard_id_for_distribution_column('credentials', $1)",
    )
    .bind(&second)
    .fetch_one(&mut coordinator)
    .await
    .unwrap();
    let _ = coordinator.close().await;
    cluster.stop_worker(worker_of(&cluster, home)).await;
    replicas[0].release_ok(&held[0], "success").await;
    replicas[1].renew(renew_body(&held[1], 600)).ok_json().await;
    replicas[1].lease(body(&first)).await;
    replicas[0]
        .allocate(body(&second))
        .refused(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
        .await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn conversations_keep_their_credential_on_each_providers_worker() {
    let Some(Served {
        cluster: _cluster,
        db,
        mut coordinator,
        first,
        second,
        replicas,
        addrs: _addrs,
        _stops,
    }) = served().await
    else {
        return;
    };
    for provider in [&first, &second] {
        for key in 0..3 {
            replicas[0]
                .put_key(
                    &format!("{provider}-{key}"),
                    provider,
                    "default",
                    &["m1"],
                    2,
                )
                .await;
        }
    }
    let call = |provider: &str, conversation: &str| {
        json!({"provider": provider, "model": "m1", "lease_seconds": 60,
               "affinity_key": conversation})
    };
    // each conversation's first call binds the credential that served it; every later call,
    // through either replica, is served by it again (a hit), its binding on its provider's worker
    for provider in [&first, &second] {
        for c in 0..3 {
            let conversation = format!("conversation-{c}");
            let mut served = Vec::new();
            for i in 0..4 {
                let replica = &replicas[i % 2];
                let lease = replica.lease(call(provider, &conversation)).await;
                replica.release_ok(&lease, "success").await;
                served.push((
                    lease["key_id"].as_str().unwrap().to_owned(),
                    lease["affinity"].as_str().unwrap_or("absent").to_owned(),
                ));
            }
            let bound = &served[0].0;
            assert_eq!(served[0].1, "new", "{served:?}");
            assert!(
                served[1..].iter().all(|(k, a)| k == bound && a == "hit"),
                "{provider} {conversation}: {served:?}"
            );
            let row: (String, String) = sqlx::query_as(
                "SELECT provider, key_id FROM affinity_bindings
                 WHERE tenant = 'default' AND provider = $1 AND affinity_key = $2",
            )
            .bind(provider)
            .bind(&conversation)
            .fetch_one(&mut coordinator)
            .await
            .unwrap();
            assert_eq!(row, (provider.clone(), bound.clone()));
        }
    }
    let _ = coordinator.close().await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_claim_takes_the_slot_a_release_frees_on_its_providers_worker() {
    let Some(Served {
        cluster: _cluster,
        db,
        mut coordinator,
        first,
        second,
        replicas,
        addrs,
        _stops,
    }) = served().await
    else {
        return;
    };
    for provider in [&first, &second] {
        replicas[0]
            .put_key(&format!("{provider}-only"), provider, "default", &["m1"], 1)
            .await;
    }
    for provider in [&first, &second] {
        let held = replicas[0]
            .lease(json!({"provider": provider, "model": "m1", "lease_seconds": 60}))
            .await;
        // a claim that waits, on the other replica: its waiter row is on its provider's worker
        let waiting = {
            let body = json!({"provider": provider, "model": "m1", "lease_seconds": 60,
                              "wait_ms": 30_000, "holder": "waiter"});
            tokio::spawn(async move { Remote::at(addrs[1]).allocate(body).await })
        };
        assert!(
            waiters_become(&mut coordinator, provider, 1).await,
            "no waiter row"
        );
        // the release frees the slot, and the waiter takes it
        replicas[0].release_ok(&held, "success").await;
        let lease = json_body(waiting.await.unwrap(), StatusCode::OK).await;
        assert_eq!(lease["key_id"], format!("{provider}-only"));
        let holder: String =
            sqlx::query_scalar("SELECT holder FROM lease_slots WHERE lease_id = $1::uuid")
                .bind(lease["lease_id"].as_str().unwrap())
                .fetch_one(&mut coordinator)
                .await
                .unwrap();
        assert_eq!(holder, "waiter");
        // its wait over, its row is gone
        assert!(
            waiters_become(&mut coordinator, provider, 0).await,
            "the waiter row stayed"
        );
    }
    let _ = coordinator.close().await;
    db.close().await;
}

/// Whether `provider`'s waiter rows come to number `count` within about ten seconds.
async fn waiters_become(coordinator: &mut PgConnection, provider: &str, count: i64) -> bool {
    for _ in 0..100 {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pool_waiters WHERE provider = $1")
            .bind(provider)
            .fetch_one(&mut *coordinator)
            .await
            .unwrap();
        if rows == count {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

/// Whether `lease`'s slot row holds it until more than `seconds` from now.
async fn ends_after(coordinator: &mut PgConnection, lease: &Value, seconds: i64) -> bool {
    sqlx::query_scalar(
        "SELECT coalesce(bool_and(lease_until > now() + make_interval(secs => $2)), false)
         FROM lease_slots WHERE lease_id = $1::uuid",
    )
    .bind(lease["lease_id"].as_str().unwrap())
    .bind(seconds as f64)
    .fetch_one(coordinator)
    .await
    .unwrap()
}

/// A credpool database on a started cluster, distributed by provider: two providers whose rows
/// are on different workers, and two replicas of the service on the coordinator, as executors'
/// calls spread over them (they stop when this drops).
struct Served {
    cluster: CitusCluster,
    db: PgPool,
    coordinator: PgConnection,
    first: String,
    second: String,
    replicas: [Remote; 2],
    addrs: [std::net::SocketAddr; 2],
    _stops: [tokio::sync::oneshot::Sender<()>; 2],
}

/// [`Served`]; `None` where the suite is skipped (the `skipped:` line is printed).
async fn served() -> Option<Served> {
    let (cluster, url, db, mut coordinator) = migrated_cluster().await?;
    let (first, second) = providers_on_different_workers(&mut coordinator).await;
    distribute(&url);
    let (one, stop_one) = serve(db.clone(), &AppOptions::default()).await;
    let (two, stop_two) = serve(db.clone(), &AppOptions::default()).await;
    Some(Served {
        cluster,
        db,
        coordinator,
        first,
        second,
        replicas: [Remote::at(one), Remote::at(two)],
        addrs: [one, two],
        _stops: [stop_one, stop_two],
    })
}

/// A started cluster whose coordinator holds a migrated credpool database: the cluster (its nodes
/// stop when it drops), the coordinator's URL, a pool and a connection to it. `None` where the
/// suite is skipped (the `skipped:` line is printed).
async fn migrated_cluster() -> Option<(CitusCluster, String, PgPool, PgConnection)> {
    let started = Instant::now();
    let cluster = CitusCluster::start().await?;
    eprintln!(
        "the Citus cluster started in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let url = cluster.coordinator_url();
    let db = PgPool::connect(&url).await.unwrap();
    credpool::store::migrate(&db).await.unwrap();
    let coordinator = connect(&url).await;
    Some((cluster, url, db, coordinator))
}

/// `provider`'s slot rows, counted through the coordinator (a query Citus sends to one worker).
async fn slot_rows(coordinator: &mut PgConnection, provider: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM lease_slots WHERE provider = $1")
        .bind(provider)
        .fetch_one(coordinator)
        .await
}

/// Fills a migrated database as one in use: two providers (on different workers, once
/// distributed) with three credentials each (limits 2 and 3, a requests window each) and their
/// slot rows, and a capped tenant. Returns the two providers.
async fn database_in_use(coordinator: &mut PgConnection) -> (String, String) {
    let (first, second) = providers_on_different_workers(coordinator).await;
    for (n, provider) in [&first, &second].into_iter().enumerate() {
        for key in 0..3 {
            let key_id = format!("{provider}-key-{key}");
            sqlx::query(
                "INSERT INTO credentials (key_id, provider, pool, models, max_concurrent_uses,
                                          secret, rate_limits)
                 VALUES ($1, $2, 'default', ARRAY['m1'], $3, '{}',
                         '[{\"kind\": \"requests\", \"count\": 60, \"seconds\": 60}]')",
            )
            .bind(&key_id)
            .bind(provider)
            .bind(2 + n as i32)
            .execute(&mut *coordinator)
            .await
            .unwrap();
            sqlx::query("SELECT credpool_fit_slots($1)")
                .bind(&key_id)
                .execute(&mut *coordinator)
                .await
                .unwrap();
        }
    }
    sqlx::raw_sql(
        "INSERT INTO tenants (tenant_id, max_concurrent_leases) VALUES ('capped', 2);
         SELECT credpool_fit_tenant('capped');",
    )
    .execute(&mut *coordinator)
    .await
    .unwrap();
    (first, second)
}

/// Runs `credpool citus distribute --json` on `url`, which must succeed: what it reported.
fn distribute(url: &str) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_credpool"))
        .args(["citus", "--database-url", url, "distribute", "--json"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "credpool citus distribute: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "credpool citus distribute --json printed {}: {e}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Rows of credentials, lease_slots, lease_windows and tenant_slots, as the coordinator counts
/// them.
async fn row_counts(coordinator: &mut PgConnection) -> [i64; 4] {
    let counts: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM credentials), (SELECT count(*) FROM lease_slots),
                (SELECT count(*) FROM lease_windows), (SELECT count(*) FROM tenant_slots)",
    )
    .fetch_one(coordinator)
    .await
    .unwrap();
    [counts.0, counts.1, counts.2, counts.3]
}

/// Two provider names whose rows Citus will put on different workers: the worker of a value is
/// decided by its hash alone, so the coordinator can say it before anything is distributed (by
/// a throwaway table distributed the way `credpool citus distribute` distributes credentials).
async fn providers_on_different_workers(coordinator: &mut PgConnection) -> (String, String) {
    sqlx::raw_sql(
        "CREATE TABLE provider_probe (provider text NOT NULL);
         SELECT create_distributed_table('provider_probe', 'provider');",
    )
    .execute(&mut *coordinator)
    .await
    .unwrap();
    let mut first: Option<(String, i32)> = None;
    let mut found = None;
    for n in 0..64 {
        let provider = format!("provider-{n}");
        let node: i32 = sqlx::query_scalar(
            "SELECT nodeport FROM citus_shards
             WHERE table_name = 'provider_probe'::regclass
               AND shardid = get_shard_id_for_distribution_column('provider_probe', $1)",
        )
        .bind(&provider)
        .fetch_one(&mut *coordinator)
        .await
        .unwrap();
        match &first {
            None => first = Some((provider, node)),
            Some((one, at)) if *at != node => {
                found = Some((one.clone(), provider));
                break;
            }
            Some(_) => {}
        }
    }
    // (kept: credentials, distributed the same way, joins its co-location group, so the probe's
    // placements are the ones credentials gets)
    found.expect("64 providers, all on one worker: the cluster does not spread shards")
}

/// Which of the cluster's workers listens on `port`.
fn worker_of(cluster: &CitusCluster, port: i32) -> usize {
    (0..2)
        .find(|&i| i32::from(cluster.worker_port(i)) == port)
        .unwrap_or_else(|| panic!("no worker on port {port}"))
}
