//! credpool on Citus: a real Citus cluster (a coordinator and two workers, each a private
//! PostgreSQL cluster started by credpool's embedded launcher) per test. The harness is
//! [`cluster::CitusCluster`]; a machine without Citus skips these tests with a `skipped:` line
//! (build Citus with `../shared/citus/build.sh`, see docs/src/citus.md), as does one with
//! `CREDPOOL_TEST_SKIP_CITUS=1`.

mod cluster;

use std::process::Command;
use std::time::Instant;

use cluster::{CitusCluster, connect};
use credpool::store::citus::{BY_TENANT, DISTRIBUTED, REFERENCE};
use credpool_test_support::oauth_mock::{ANSWERS, Mode, fast_refresher, mock_endpoint};
use credpool_test_support::{
    Answer, AppOptions, INTERNAL_KEY, Remote, Service, allocate_at_once, audit_verify_json_with,
    group_release, json_body, policy, release_body, renew_body, serve,
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
        DISTRIBUTED.len() + BY_TENANT.len()
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
    // the tenants' slot and window rows distributed by tenant, co-located with each other
    let by_tenant: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT p.logicalrelid::regclass::text, p.partmethod::text,
                column_to_column_name(p.logicalrelid, p.partkey)
         FROM pg_dist_partition p
         WHERE p.colocationid = (SELECT colocationid FROM pg_dist_partition
                                 WHERE logicalrelid = 'tenant_slots'::regclass)
         ORDER BY 1",
    )
    .fetch_all(&mut coordinator)
    .await
    .unwrap();
    let expected: Vec<(String, String, String)> = BY_TENANT
        .iter()
        .map(|t| (t.to_string(), "h".to_owned(), "tenant_id".to_owned()))
        .collect();
    assert_eq!(by_tenant, expected);
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

    // lowered past held leases (those above the new limit move to the free numbers below it),
    // then under them (the one that ends last stays within the limit, the other is surplus), then
    // raised again: the fit's statements on the provider's worker
    let ask = |seconds: u64| json!({"provider": first, "model": "m1", "lease_seconds": seconds});
    let mut held = Vec::new();
    for seconds in [600, 600, 300, 900] {
        held.push(app.lease(ask(seconds)).await);
    }
    let slot_of = |lease: &Value| {
        sqlx::query_scalar::<_, i32>(
            "SELECT slot FROM lease_slots WHERE provider = $1 AND lease_id = $2::text::uuid",
        )
        .bind(first.clone())
        .bind(lease["lease_id"].as_str().unwrap().to_owned())
    };
    let mut by_slot = Vec::new();
    for lease in held {
        by_slot.push((
            slot_of(&lease).fetch_one(&mut coordinator).await.unwrap(),
            lease,
        ));
    }
    by_slot.sort_by_key(|(slot, _)| *slot);
    let kept: Vec<Value> = by_slot.drain(2..).map(|(_, lease)| lease).collect();
    for (_, lease) in &by_slot {
        app.release_ok(lease, "success").await;
    }
    let rows = "SELECT count(*), count(lease_id), count(*) FILTER (WHERE NOT surplus)
                FROM lease_slots WHERE provider = $1";
    let counts = |limit: u32| {
        let (app, first) = (&app, &first);
        async move {
            app.patch_key("a-1", json!({"max_concurrent_uses": limit}))
                .ok_json()
                .await;
            sqlx::query_as::<_, (i64, i64, i64)>(rows).bind(first.clone())
        }
    };
    let moved = counts(2).await.fetch_one(&mut coordinator).await.unwrap();
    assert_eq!(moved, (2, 2, 2));
    for lease in &kept {
        assert!(slot_of(lease).fetch_one(&mut coordinator).await.unwrap() < 2);
    }
    let over = counts(1).await.fetch_one(&mut coordinator).await.unwrap();
    assert_eq!(over, (2, 2, 1));
    let within: bool = sqlx::query_scalar(
        "SELECT NOT surplus FROM lease_slots WHERE provider = $1 AND lease_id IS NOT NULL
         ORDER BY lease_until DESC LIMIT 1",
    )
    .bind(&first)
    .fetch_one(&mut coordinator)
    .await
    .unwrap();
    assert!(
        within,
        "the lease that ends last stays within the lowered limit"
    );
    let raised = counts(4).await.fetch_one(&mut coordinator).await.unwrap();
    assert_eq!(raised, (4, 2, 4));
    for lease in &kept {
        app.release_ok(lease, "success").await;
    }

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

    // the cleanup pass's steps run on the cluster
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
        "credpool_audit_advance('continuous', 1000)",
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
    // its slots (three and two: no oversell, no underuse), the others answer 429 with a
    // Retry-After; a second race while they are held grants nothing; then they are released,
    // and the next round races again
    let body = |provider: &str| json!({"provider": provider, "model": "m1", "lease_seconds": 60});
    const ROUNDS: usize = 6;
    let mut held = Vec::new();
    for round in 0..ROUNDS * 2 {
        let bodies = (0..12)
            .map(|i| body(if i % 2 == 0 { &first } else { &second }))
            .collect();
        let answers = allocate_at_once(&replicas, INTERNAL_KEY, bodies).await;
        let mut granted: std::collections::BTreeMap<String, Vec<(String, i64)>> =
            std::collections::BTreeMap::new();
        for answer in &answers {
            match answer.status {
                StatusCode::OK => {
                    granted
                        .entry(answer.body["provider"].as_str().unwrap().to_owned())
                        .or_default()
                        .push((
                            answer.body["key_id"].as_str().unwrap().to_owned(),
                            answer.body["fence"].as_i64().unwrap(),
                        ));
                    held.push(answer.body.clone());
                }
                StatusCode::TOO_MANY_REQUESTS => {
                    assert!(answer.retry_after.is_some(), "{}", answer.text);
                }
                status => panic!("round {round}: {status}: {}", answer.text),
            }
        }
        let on_first = granted.get(&first).cloned().unwrap_or_default();
        let on_second = granted.get(&second).cloned().unwrap_or_default();
        if round % 2 == 0 {
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
        if round % 2 == 1 {
            for (n, lease) in held.drain(..).enumerate() {
                replicas[n % 2].release_ok(&lease, "success").await;
            }
        }
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
    let trail: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT provider, count(*), count(DISTINCT fence) FROM lease_events
         WHERE event = 'granted' GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&mut coordinator)
    .await
    .unwrap();
    let (on_first, on_second) = (ROUNDS as i64 * 3, ROUNDS as i64 * 2 + 1);
    let mut expected = vec![
        (first.clone(), on_first, on_first),
        (second.clone(), on_second, on_second),
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

#[tokio::test(flavor = "multi_thread")]
async fn rate_windows_and_token_usage_hold_exactly_on_each_providers_worker() {
    let Some(mut s) = served().await else {
        return;
    };
    let providers = s.providers();
    for provider in &providers {
        // a requests window of 3 a minute, and a token window of 1,000 a minute, with slots to
        // spare: the windows are what holds the claims back
        for (pool, rate_limits) in [
            ("requests", json!([{"requests": 3, "seconds": 60}])),
            ("tokens", json!([{"tokens": 1000, "seconds": 60}])),
        ] {
            let key = format!("{provider}-{pool}");
            let response = s.replicas[0]
                .put_key_raw(
                    &key,
                    json!({"provider": provider, "pool": pool, "models": ["m1"],
                           "max_concurrent_uses": 100, "rate_limits": rate_limits,
                           "secret": {"api_key": format!("sk-{key}")}}),
                )
                .await;
            assert!(response.status().is_success(), "PUT {key}");
        }
    }
    let claim = |provider: &str, pool: &str, tokens: u64| {
        json!({"provider": provider, "model": "m1", "pool": pool, "lease_seconds": 60,
               "tokens": tokens})
    };

    // twelve claims at once over both replicas: each provider grants exactly its window's three,
    // the others answer 429; released, the window still counts them
    let bodies = (0..12)
        .map(|i| claim(&providers[i % 2], "requests", 0))
        .collect();
    let granted = granted_per_provider(&s.replicas, bodies, "pool_exhausted").await;
    assert_eq!(
        granted
            .iter()
            .map(|(p, l)| (p, l.len()))
            .collect::<Vec<_>>(),
        [(&providers[0], 3), (&providers[1], 3)]
    );
    for lease in granted.values().flatten() {
        s.replicas[1].release_ok(lease, "success").await;
    }
    for provider in &providers {
        s.replicas[0]
            .allocate(claim(provider, "requests", 0))
            .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
            .await;
    }

    // a token estimate of 600, released with a usage of 100: the window holds 900 more, so
    // nine claims of 100 of each provider's ten are granted
    for provider in &providers {
        let lease = s.replicas[0].lease(claim(provider, "tokens", 600)).await;
        let mut body = release_body(&lease, "success");
        body["usage"] = json!({"tokens": 100});
        assert_eq!(
            s.replicas[1].release(body).ok_json().await["released"],
            true
        );
    }
    let bodies = (0..20)
        .map(|i| claim(&providers[i % 2], "tokens", 100))
        .collect();
    let granted = granted_per_provider(&s.replicas, bodies, "pool_exhausted").await;
    assert_eq!(
        granted
            .iter()
            .map(|(p, l)| (p, l.len()))
            .collect::<Vec<_>>(),
        [(&providers[0], 9), (&providers[1], 9)]
    );

    // each provider's window rows say the same, on its worker: 3 requests; 100 + 900 tokens
    let used: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT provider, pool, (SELECT sum(c) FROM unnest(bucket_charged) AS c)::int8
         FROM lease_windows JOIN credentials USING (key_id, provider) ORDER BY 1, 2",
    )
    .fetch_all(&mut s.coordinator)
    .await
    .unwrap();
    let mut expected = Vec::new();
    for provider in &providers {
        expected.push((provider.clone(), "requests".to_owned(), 3));
        expected.push((provider.clone(), "tokens".to_owned(), 1000));
    }
    assert_eq!(used, expected);
    s.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_capped_with_leases_on_both_workers_adopts_them_and_is_held_to_its_cap() {
    let Some(mut s) = served().await else {
        return;
    };
    let providers = s.providers();
    s.put_keys("0", 3).await;
    let key = s.replicas[0].tenant_key("batch", json!({})).await;
    let claim = |provider: &str| json!({"provider": provider, "model": "m1", "lease_seconds": 60});
    let mut held = Vec::new();
    for provider in &providers {
        held.push(
            json_body(
                s.replicas[0].allocate_as(&key, claim(provider)).await,
                StatusCode::OK,
            )
            .await,
        );
    }
    // capped at 1 with a lease on each worker: both are adopted (one row each, over the cap),
    // and the tenant's next claim, for either provider, answers 429 tenant_limit
    s.replicas[1]
        .put_tenant("batch", json!({"max_concurrent_leases": 1}))
        .await;
    assert_eq!(s.replicas[0].tenant_line("batch").await["in_flight"], 2);
    let rows: Vec<(bool, bool)> = sqlx::query_as(
        "SELECT over_limit, lease_id IS NOT NULL FROM tenant_slots
         WHERE tenant_id = 'batch' ORDER BY slot",
    )
    .fetch_all(&mut s.coordinator)
    .await
    .unwrap();
    assert_eq!(rows, [(true, true), (true, true)]);
    for provider in &providers {
        s.replicas[0]
            .allocate_as(&key, claim(provider))
            .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
            .await;
    }
    // renewed over the lowered cap: the surplus lease (the one that ends first) is held to the
    // end of the lease within the cap, which is renewed as asked; each tenant slot row moves in
    // step with its lease
    let surplus: String = sqlx::query_scalar(
        "SELECT replace(lease_id::text, '-', '') FROM tenant_slots
         WHERE tenant_id = 'batch' AND surplus",
    )
    .fetch_one(&mut s.coordinator)
    .await
    .unwrap();
    let (short, within) = if held[0]["lease_id"] == surplus.as_str() {
        (&held[0], &held[1])
    } else {
        (&held[1], &held[0])
    };
    s.replicas[1]
        .renew_as(&key, renew_body(short, 600))
        .ok_json()
        .await;
    assert!(!ends_after(&mut s.coordinator, short, 120).await, "{short}");
    s.replicas[0]
        .renew_as(&key, renew_body(within, 600))
        .ok_json()
        .await;
    assert!(
        ends_after(&mut s.coordinator, within, 300).await,
        "{within}"
    );
    let mut ends = Vec::new();
    for table in ["tenant_slots WHERE tenant_id", "lease_slots WHERE tenant"] {
        let rows: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT lease_id::text, lease_until::text FROM {table} = 'batch'
             AND lease_id IS NOT NULL ORDER BY 1"
        )))
        .fetch_all(&mut s.coordinator)
        .await
        .unwrap();
        ends.push(rows);
    }
    assert_eq!(ends[0].len(), 2);
    assert_eq!(
        ends[0], ends[1],
        "tenant slot rows out of step with their leases"
    );
    // one released: still at its cap; both released: a claim is granted, and one more is not
    s.replicas[1].release_as_ok(&key, &held[0]).await;
    s.replicas[0]
        .allocate_as(&key, claim(&providers[1]))
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;
    s.replicas[1].release_as_ok(&key, &held[1]).await;
    let last = json_body(
        s.replicas[0].allocate_as(&key, claim(&providers[1])).await,
        StatusCode::OK,
    )
    .await;
    s.replicas[1]
        .allocate_as(&key, claim(&providers[0]))
        .refused(StatusCode::TOO_MANY_REQUESTS, "tenant_limit")
        .await;
    // a key revoked through one replica is refused at once by the other
    let (key_id, other_key) = s.replicas[0].mint_key("batch").await;
    let revoked = s.replicas[0]
        .admin(
            Method::DELETE,
            &format!("/api/admin/tenants/batch/keys/{key_id}"),
            None,
        )
        .await;
    assert_eq!(json_body(revoked, StatusCode::OK).await["revoked"], true);
    s.replicas[1]
        .allocate_as(&other_key, claim(&providers[0]))
        .refused(StatusCode::UNAUTHORIZED, "unauthorized")
        .await;
    // with a lease in flight the tenant cannot be deleted; released, it can, and its rows go
    let refused = s.replicas[0]
        .admin(Method::DELETE, "/api/admin/tenants/batch", None)
        .await;
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    s.replicas[1].release_as_ok(&key, &last).await;
    let deleted = s.replicas[0]
        .admin(Method::DELETE, "/api/admin/tenants/batch", None)
        .await;
    assert!(deleted.status().is_success(), "{}", deleted.status());
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tenant_slots WHERE tenant_id = 'batch'")
            .fetch_one(&mut s.coordinator)
            .await
            .unwrap();
    assert_eq!(rows, 0);
    s.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenants_cap_holds_exactly_over_providers_on_two_workers() {
    let Some(mut s) = served().await else {
        return;
    };
    let providers = s.providers();
    s.put_keys("0", 3).await;
    s.put_keys("1", 3).await;
    // a cap of 3 over both providers' 12 slots; another tenant without a cap
    let batch = s.replicas[0].capped_tenant("batch", 3).await;
    let web = s.replicas[1].tenant_key("web", json!({})).await;
    let claim = |provider: &str| json!({"provider": provider, "model": "m1", "lease_seconds": 60});
    // as many rounds as the claims' race (each is about a second here)
    for round in 0..6 {
        // twelve claims of the capped tenant at once, six for each provider, over both
        // replicas: exactly three granted in all, the rest 429 tenant_limit
        let bodies = (0..12).map(|i| claim(&providers[i % 2])).collect();
        let mut granted = tenant_race(&s.replicas, &batch, bodies).await;
        assert_eq!(granted.len(), 3, "round {round}: {granted:?}");
        // the uncapped tenant is served on both workers meanwhile
        let mut served = Vec::new();
        for provider in &providers {
            served.push(
                json_body(
                    s.replicas[round % 2]
                        .allocate_as(&web, claim(provider))
                        .await,
                    StatusCode::OK,
                )
                .await,
            );
        }
        // the tenant's slot rows hold its three leases, never more
        let live: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM tenant_slots
             WHERE tenant_id = 'batch' AND lease_id IS NOT NULL AND lease_until > now()",
        )
        .fetch_one(&mut s.coordinator)
        .await
        .unwrap();
        assert_eq!(live, 3, "round {round}");
        // one released: the tenant's next claim is granted, for whichever provider
        let freed = granted.pop().unwrap();
        s.replicas[1].release_as_ok(&batch, &freed).await;
        let other = if freed["provider"] == providers[0] {
            &providers[1]
        } else {
            &providers[0]
        };
        let again = json_body(
            s.replicas[0].allocate_as(&batch, claim(other)).await,
            StatusCode::OK,
        )
        .await;
        granted.push(again);
        for lease in &granted {
            s.replicas[round % 2].release_as_ok(&batch, lease).await;
        }
        for lease in &served {
            s.replicas[0].release_as_ok(&web, lease).await;
        }
    }
    s.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenants_token_window_holds_over_providers_on_two_workers() {
    let Some(mut s) = served().await else {
        return;
    };
    let providers = s.providers();
    s.put_keys("0", 16).await;
    // 1,000 tokens an hour over both providers' 32 slots
    let key = s.replicas[0]
        .tenant_key(
            "team",
            json!({"rate_limits": [{"tokens": 1000, "seconds": 3600}]}),
        )
        .await;
    let claim = |provider: &str| json!({"provider": provider, "model": "m1", "lease_seconds": 60, "tokens": 100});
    let bodies = |count: usize| (0..count).map(|i| claim(&providers[i % 2])).collect();
    // twenty claims of 100 tokens at once, ten for each provider, over both replicas: exactly
    // ten granted in all, the rest 429 tenant_limit
    let granted = tenant_race(&s.replicas, &key, bodies(20)).await;
    assert_eq!(granted.len(), 10, "{granted:?}");
    // five released with a usage of 20 give 400 tokens back: four more of eight are granted
    for (i, lease) in granted.iter().take(5).enumerate() {
        let mut release = release_body(lease, "success");
        release["usage"] = json!({"tokens": 20});
        let released = s.replicas[i % 2].release_as(&key, release).ok_json().await;
        assert_eq!(released["released"], true, "{released}");
    }
    let again = tenant_race(&s.replicas, &key, bodies(8)).await.len();
    assert_eq!(again, 4);
    // the tenant's window row, on the tenant's worker, holds the 1,000 tokens charged
    let charged: i64 = sqlx::query_scalar(
        "SELECT (SELECT sum(c) FROM unnest(bucket_charged) AS c)::int8 FROM tenant_windows
         WHERE tenant_id = 'team'",
    )
    .fetch_one(&mut s.coordinator)
    .await
    .unwrap();
    assert_eq!(charged, 1000);
    s.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_claim_yields_to_a_tenant_below_its_share_on_each_providers_worker() {
    let Some(mut s) = served().await else {
        return;
    };
    let providers = s.providers();
    let behind = s.replicas[0].tenant_key("behind", json!({})).await;
    let claim = |provider: &str, wait_ms: u64| json!({"provider": provider, "model": "m1", "lease_seconds": 60, "wait_ms": wait_ms});
    // tenant `behind` waits for each provider's pool (its waiter row on the provider's
    // worker); a waiting claim of another tenant (400 ms) yields the free slot to it while its
    // process is alive, and answers 429 at the end of its wait; one that does not wait is served;
    // nobody yields to it once its process has not said it is alive for 30 s
    s.put_keys("only", 1).await;
    for provider in &providers {
        waits_for(&mut s.coordinator, "behind", provider, 0).await;
        let yielded = s.replicas[1].allocate(claim(provider, 400)).await;
        assert_eq!(yielded.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(slot_leases(&mut s.coordinator, provider).await, 0);
        let at_once = s.replicas[0].lease(claim(provider, 0)).await;
        s.replicas[0].release_ok(&at_once, "success").await;

        waits_for(&mut s.coordinator, "behind", provider, 30).await;
        let lease = s.replicas[1].lease(claim(provider, 400)).await;
        assert_eq!(lease["tenant"], "default");
        s.replicas[1].release_ok(&lease, "success").await;
    }
    // a request window of one an hour, used: `behind` cannot take a slot, so nobody yields to
    // it, alive or not (its window row is on the tenant's worker, not the provider's)
    s.replicas[0]
        .put_tenant(
            "behind",
            json!({"rate_limits": [{"requests": 1, "seconds": 3600}]}),
        )
        .await;
    let used = json_body(
        s.replicas[0]
            .allocate_as(&behind, claim(&providers[0], 0))
            .await,
        StatusCode::OK,
    )
    .await;
    s.replicas[0].release_as_ok(&behind, &used).await;
    for provider in &providers {
        waits_for(&mut s.coordinator, "behind", provider, 0).await;
        let lease = s.replicas[1].lease(claim(provider, 400)).await;
        assert_eq!(lease["tenant"], "default");
        s.replicas[1].release_ok(&lease, "success").await;
    }
    s.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn audit_verify_judges_every_grant_of_both_workers_and_finds_each_rules_breach() {
    let Some(mut s) = served().await else {
        return;
    };
    let providers = s.providers();
    let keys = providers.clone().map(|provider| format!("{provider}-0"));
    for (provider, key) in providers.iter().zip(&keys) {
        let response = s.replicas[0]
            .put_key_raw(
                key,
                json!({"provider": provider, "pool": "default", "models": ["m1"],
                       "max_concurrent_uses": 2, "rate_limits": [{"requests": 5, "seconds": 3600}],
                       "secret": {"api_key": format!("sk-{key}")}}),
            )
            .await;
        assert!(response.status().is_success(), "PUT {key}");
    }
    let batch = s.replicas[0]
        .tenant_key(
            "batch",
            json!({"max_concurrent_leases": 3,
                   "rate_limits": [{"requests": 4, "seconds": 3600}]}),
        )
        .await;
    let claim = |provider: &str| json!({"provider": provider, "model": "m1", "lease_seconds": 60});

    // real traffic over both workers: the capped tenant holds three leases at once (two on the
    // first provider's credential, one on the second's) beside a lease of the internal key's
    // tenant; then the internal key takes both slots of each credential
    let mut held = Vec::new();
    for provider in [&providers[0], &providers[0], &providers[1]] {
        held.push((
            batch.clone(),
            json_body(
                s.replicas[0].allocate_as(&batch, claim(provider)).await,
                StatusCode::OK,
            )
            .await,
        ));
    }
    held.push((
        INTERNAL_KEY.to_owned(),
        s.replicas[1].lease(claim(&providers[1])).await,
    ));
    for (key, lease) in held.drain(..) {
        s.replicas[1].release_as_ok(&key, &lease).await;
    }
    for provider in [&providers[0], &providers[0], &providers[1], &providers[1]] {
        held.push((
            INTERNAL_KEY.to_owned(),
            s.replicas[0].lease(claim(provider)).await,
        ));
    }
    for (key, lease) in held.drain(..) {
        s.replicas[0].release_as_ok(&key, &lease).await;
    }
    let granted: i64 =
        sqlx::query_scalar("SELECT count(*) FROM lease_events WHERE event = 'granted'")
            .fetch_one(&mut s.coordinator)
            .await
            .unwrap();
    assert_eq!(granted, 8);

    // the proofs over the whole trail, three trail rows a chunk (the leases live at a chunk's end
    // carried into the next): every grant judged, each credential's and the tenant's counted
    // over both workers, nothing broken
    let report = verify(&s.cluster.coordinator_url(), true).await;
    assert_eq!(report["grants_over_limit"], 0, "{report:#}");
    assert_eq!(report["grants_over_window"], 0, "{report:#}");
    assert_eq!(report["grants_over_cap"], 0, "{report:#}");
    assert_eq!(report["grants_over_tenant_window"], 0, "{report:#}");
    assert!(report["chunks"].as_u64().unwrap() > 3, "{report:#}");
    for key in &keys {
        let line = line_of(&report["credentials"], "key_id", key);
        assert_eq!(
            (line["leases"].as_i64(), line["peak"].as_i64()),
            (Some(4), Some(2)),
            "{key}"
        );
        let window = line_of(&report["windows"], "key_id", key);
        assert_eq!(
            (window["grants"].as_i64(), window["peak"].as_i64()),
            (Some(4), Some(4))
        );
    }
    let line = line_of(&report["tenants"], "tenant_id", "batch");
    assert_eq!(
        (line["leases"].as_i64(), line["peak"].as_i64()),
        (Some(3), Some(3))
    );
    let window = line_of(&report["tenant_windows"], "tenant_id", "batch");
    assert_eq!(
        (window["grants"].as_i64(), window["peak"].as_i64()),
        (Some(3), Some(3))
    );

    // grants written straight into the trail (on the credentials' workers), as a bug in the
    // claim would have: two hours ago three leases at once on the first credential (limit 2);
    // 90 minutes ago two on each credential for the capped tenant (4 over its cap of 3, each
    // credential within its limit); from 70 minutes ago six of the tenant's one after the other
    // on the second credential (8 in its hour: 3 over its window of 5; 10 in the tenant's: 6 over
    // its window of 4)
    let plant = |key: &str, provider: &str, tenant: Option<&str>, minutes_ago: f64| {
        format!(
            "('granted', gen_random_uuid(), '{key}', '{provider}', 'default', 0, {}, \
             now() - interval '{} seconds' + interval '10 minutes', \
             now() - interval '{} seconds')",
            tenant.map_or("NULL".to_owned(), |t| format!("'{t}'")),
            minutes_ago * 60.0,
            minutes_ago * 60.0
        )
    };
    let mut rows = Vec::new();
    for _ in 0..3 {
        rows.push(plant(&keys[0], &providers[0], None, 120.0));
    }
    for (key, provider) in keys.iter().zip(&providers) {
        for _ in 0..2 {
            rows.push(plant(key, provider, Some("batch"), 90.0));
        }
    }
    for n in 0..6 {
        // (each ended before the next: one lease at a time)
        rows.push(
            plant(
                &keys[1],
                &providers[1],
                Some("batch"),
                70.0 - f64::from(n) / 3.0,
            )
            .replace("interval '10 minutes'", "interval '10 seconds'"),
        );
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, tenant,
                                   lease_until, at)
         VALUES {}",
        rows.join(", ")
    )))
    .execute(&mut s.coordinator)
    .await
    .unwrap();
    let report = verify(&s.cluster.coordinator_url(), false).await;
    assert_eq!(report["grants_over_limit"], 1, "{report:#}");
    assert_eq!(report["grants_over_cap"], 1, "{report:#}");
    assert_eq!(report["grants_over_window"], 3, "{report:#}");
    assert_eq!(report["grants_over_tenant_window"], 6, "{report:#}");
    let over = |lines: &Value, field: &str, id: &str, count: &str| {
        line_of(lines, field, id)[count].as_i64().unwrap()
    };
    assert_eq!(
        over(
            &report["credentials"],
            "key_id",
            &keys[0],
            "grants_over_limit"
        ),
        1
    );
    assert_eq!(
        over(
            &report["credentials"],
            "key_id",
            &keys[1],
            "grants_over_limit"
        ),
        0
    );
    assert_eq!(
        over(&report["windows"], "key_id", &keys[1], "grants_over_window"),
        3
    );
    assert_eq!(
        over(&report["tenants"], "tenant_id", "batch", "grants_over_cap"),
        1
    );
    s.close().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn oauth_tokens_on_both_workers_are_refreshed_once_per_generation_and_leased() {
    let mut options = AppOptions::default();
    options.settings.oauth = fast_refresher();
    let Some(mut s) = served_with(&options).await else {
        return;
    };
    let providers = s.providers();
    // one token endpoint per credential (each rotates its own refresh token); the second one
    // down at first
    let (first_endpoint, first_url) = mock_endpoint(ANSWERS, 3600).await;
    let (second_endpoint, second_url) = mock_endpoint(Mode::Unavailable, 3600).await;
    for (provider, url) in providers.iter().zip([&first_url, &second_url]) {
        let key = format!("{provider}-oauth");
        // a token that expires in 60 s, refreshed from 59 s before: due at once
        let expires_at = (time::OffsetDateTime::now_utc() + time::Duration::seconds(60))
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap();
        let response = s.replicas[0]
            .put_key_raw(
                &key,
                json!({"provider": provider, "pool": "default", "models": ["m1"],
                       "max_concurrent_uses": 2,
                       "secret": {"access_token": "at-0", "refresh_token": "rtok-0",
                                  "expires_at": expires_at},
                       "oauth": {"token_url": url, "client_id": "client-1",
                                 "client_secret": "cs-1", "refresh_before_seconds": 59}}),
            )
            .await;
        assert_eq!(response.status(), StatusCode::CREATED, "PUT {key}");
    }
    let generation = |provider: &str| {
        format!("SELECT generation FROM oauth_credentials WHERE provider = '{provider}'")
    };
    let token_of = async |s: &Served, provider: &str| {
        let lease = s.replicas[1]
            .lease(json!({"provider": provider, "model": "m1", "lease_seconds": 5}))
            .await;
        s.replicas[1].release_ok(&lease, "success").await;
        lease["credential"]["access_token"]
            .as_str()
            .unwrap()
            .to_owned()
    };

    // the first credential's token, on its worker, refreshed by one of the two replicas' refreshers
    // (its refresh marker, the new token and generation written there), and leased from then on
    assert!(
        waits_until(&mut s.coordinator, &generation(&providers[0]), 2).await,
        "the first credential was never refreshed"
    );
    assert_eq!(token_of(&s, &providers[0]).await, "at-1");
    // the second's endpoint answers 503: each failure recorded with a backoff (on the second
    // worker), and the valid token still leased
    let failures = format!(
        "SELECT count(*) FROM credential_events
         WHERE key_id = '{}-oauth' AND event = 'token_refresh_failed'",
        providers[1]
    );
    assert!(
        waits_until(&mut s.coordinator, &failures, 2).await,
        "no failed refresh recorded"
    );
    assert_eq!(token_of(&s, &providers[1]).await, "at-0");
    // back: refreshed once, then leased
    second_endpoint.set(ANSWERS);
    assert!(
        waits_until(&mut s.coordinator, &generation(&providers[1]), 2).await,
        "the second credential was never refreshed after its endpoint came back"
    );
    assert_eq!(token_of(&s, &providers[1]).await, "at-1");
    // one token call per generation: nothing refreshed twice, no rotated-away token presented
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(first_endpoint.calls(), 1);
    for endpoint in [&first_endpoint, &second_endpoint] {
        assert_eq!(endpoint.issued.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(endpoint.stale.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
    // the provider rejected the first credential's token (a lease released `auth_expired`):
    // refreshed at once, though not due, and the next lease carries the new token
    let lease = s.replicas[0]
        .lease(json!({"provider": providers[0], "model": "m1", "lease_seconds": 5}))
        .await;
    assert_eq!(lease["credential"]["access_token"], "at-1");
    s.replicas[1].release_ok(&lease, "auth_expired").await;
    assert!(
        waits_until(&mut s.coordinator, &generation(&providers[0]), 3).await,
        "an auth_expired report never refreshed the token"
    );
    assert_eq!(token_of(&s, &providers[0]).await, "at-2");
    assert_eq!(first_endpoint.calls(), 2);
    // the first grant revoked at its provider: due again, the refresh answers invalid_grant,
    // and the credential is disabled on its worker (its claims refused from then on)
    first_endpoint.set(Mode::InvalidGrant);
    sqlx::query("UPDATE oauth_credentials SET refresh_before_seconds = 86400 WHERE provider = $1")
        .bind(&providers[0])
        .execute(&mut s.coordinator)
        .await
        .unwrap();
    let disabled = format!(
        "SELECT count(*) FROM credentials WHERE provider = '{}' AND status = 'disabled'",
        providers[0]
    );
    assert!(
        waits_until(&mut s.coordinator, &disabled, 1).await,
        "invalid_grant never disabled the credential"
    );
    // (409 no_usable_credentials once the replica's pool view has the new status, 429
    // pool_exhausted until then: no pool-change notification reaches it on Citus)
    let refused = s.replicas[0]
        .allocate(json!({"provider": providers[0], "model": "m1", "lease_seconds": 5}))
        .await;
    let status = refused.status();
    let code = json_body(refused, status).await["error"]["code"].clone();
    assert!(
        matches!(
            (status, code.as_str()),
            (StatusCode::CONFLICT, Some("no_usable_credentials"))
                | (StatusCode::TOO_MANY_REQUESTS, Some("pool_exhausted"))
        ),
        "{status} {code}"
    );
    s.close().await;
}

/// Polls `query` (one integer) on the coordinator every 50 ms until it is at least `at_least`:
/// whether it got there within 30 s.
async fn waits_until(coordinator: &mut PgConnection, query: &str, at_least: i64) -> bool {
    for _ in 0..600 {
        let value: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(query))
            .fetch_optional(&mut *coordinator)
            .await
            .unwrap();
        if value.is_some_and(|v| v >= at_least) {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// `credpool audit verify --full --json` on `url`, three trail rows a chunk: its report, once it
/// has exited as `passes` says (failing: some grant broke a rule).
async fn verify(url: &str, passes: bool) -> Value {
    let flags = ["--full", "--chunk-rows", "3"];
    let ran = audit_verify_json_with(env!("CARGO_BIN_EXE_credpool"), url, &flags).await;
    assert_eq!(
        ran.success,
        passes,
        "credpool audit verify: {}",
        ran.printed()
    );
    ran.report()
}

/// The line of `lines` (a report's array) whose `field` is `id`.
fn line_of<'a>(lines: &'a Value, field: &str, id: &str) -> &'a Value {
    lines
        .as_array()
        .and_then(|lines| lines.iter().find(|l| l[field] == id))
        .unwrap_or_else(|| panic!("no line of {id} in {lines:#}"))
}

/// Makes `tenant` the one tenant waiting for `provider`'s default pool (model m1): its waiter
/// row, of a process last seen `seen_seconds_ago` seconds ago.
async fn waits_for(
    coordinator: &mut PgConnection,
    tenant: &str,
    provider: &str,
    seen_seconds_ago: i64,
) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DELETE FROM pool_waiters;
         INSERT INTO pool_waiter_processes (instance, seen_at)
         VALUES ('elsewhere', now() - interval '{seen_seconds_ago} seconds')
         ON CONFLICT (instance) DO UPDATE SET seen_at = EXCLUDED.seen_at;
         INSERT INTO pool_waiters (waiter, instance, tenant, provider, pools, model, since, until)
         VALUES (gen_random_uuid(), 'elsewhere', '{tenant}', '{provider}', '{{default}}', 'm1',
                 now() - interval '1 second', now() + interval '1 minute');"
    )))
    .execute(coordinator)
    .await
    .unwrap();
}

/// `provider`'s live leases, counted on its slot rows.
async fn slot_leases(coordinator: &mut PgConnection, provider: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM lease_slots
         WHERE provider = $1 AND lease_id IS NOT NULL AND lease_until > now()",
    )
    .bind(provider)
    .fetch_one(coordinator)
    .await
    .unwrap()
}

/// Allocates every body of `bodies` at once with tenant key `key`, spread over `replicas`: the
/// leases granted; every other answer must be 429 `tenant_limit`. A claim that answered 429 for
/// another reason (on a loaded machine, its tenant's rows held by the others' transactions past
/// the service's patience for busy rows) is sent again, alone, once: it must then be granted or
/// answer `tenant_limit`, so the count of leases is still exact.
async fn tenant_race(replicas: &[Remote], key: &str, bodies: Vec<Value>) -> Vec<Value> {
    let mut granted = Vec::new();
    let answers = allocate_at_once(replicas, key, bodies.clone()).await;
    for (answer, body) in answers.into_iter().zip(bodies) {
        let answer = match answer.status {
            StatusCode::TOO_MANY_REQUESTS if answer.body["error"]["code"] != "tenant_limit" => {
                let again = replicas[0].allocate_as(key, body).await;
                (
                    again.status(),
                    again.json::<Value>().await.unwrap_or_default(),
                )
            }
            status => (status, answer.body),
        };
        match answer {
            (StatusCode::OK, lease) => granted.push(lease),
            (StatusCode::TOO_MANY_REQUESTS, refused) => {
                assert_eq!(refused["error"]["code"], "tenant_limit", "{refused}")
            }
            (other, body) => panic!("{other}: {body}"),
        }
    }
    granted
}

/// Allocates every body of `bodies` at once, spread over `replicas`: the leases granted, by
/// provider (ascending). Any refusal but a 429 with error code `refused` panics.
async fn granted_per_provider(
    replicas: &[Remote],
    bodies: Vec<Value>,
    refused: &str,
) -> std::collections::BTreeMap<String, Vec<Value>> {
    let mut granted = std::collections::BTreeMap::<String, Vec<Value>>::new();
    for answer in allocate_at_once(replicas, INTERNAL_KEY, bodies).await {
        match answer.status {
            StatusCode::OK => granted
                .entry(answer.body["provider"].as_str().unwrap().to_owned())
                .or_default()
                .push(answer.body),
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(answer.body["error"]["code"], refused, "{}", answer.text)
            }
            other => panic!("{other}: {}", answer.text),
        }
    }
    granted
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

impl Served {
    /// Closes the test's coordinator connection and pool (the replicas stop when this drops).
    async fn close(self) {
        let Served {
            db, coordinator, ..
        } = self;
        let _ = coordinator.close().await;
        db.close().await;
    }

    /// The two providers: the first's rows on one worker, the second's on the other.
    fn providers(&self) -> [String; 2] {
        [self.first.clone(), self.second.clone()]
    }

    /// Puts a credential `{provider}-{suffix}` of `limit` slots (pool `default`, model `m1`) for
    /// each of the two providers.
    async fn put_keys(&self, suffix: &str, limit: u32) {
        for provider in self.providers() {
            self.replicas[0]
                .put_key(
                    &format!("{provider}-{suffix}"),
                    &provider,
                    "default",
                    &["m1"],
                    limit,
                )
                .await;
        }
    }
}

/// [`Served`]; `None` where the suite is skipped (the `skipped:` line is printed).
async fn served() -> Option<Served> {
    served_with(&AppOptions::default()).await
}

/// [`served`], the replicas run with `options`.
async fn served_with(options: &AppOptions) -> Option<Served> {
    let (cluster, url, db, mut coordinator) = migrated_cluster().await?;
    let (first, second) = providers_on_different_workers(&mut coordinator).await;
    distribute(&url);
    let (one, stop_one) = serve(db.clone(), options).await;
    let (two, stop_two) = serve(db.clone(), options).await;
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
