//! Operating credpool: health and readiness, request ids, the OpenAPI document, metrics that keep
//! "no capacity" and "store down" apart, and the request timeout.

use std::collections::BTreeSet;
use std::time::Duration;

use credpool::embedded::EmbeddedCluster;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use credpool_test_support::*;

#[tokio::test]
async fn liveness_readiness_and_the_old_health_name_answer_without_a_key() {
    let app = TestApp::spawn().await;
    // /healthz is the older name of /livez and answers the same
    for path in ["/livez", "/healthz"] {
        let health = app.get(path).ok_json().await;
        assert_eq!(health, json!({"status": "ok"}), "{path}");
    }
    let ready = app.get("/readyz").ok_json().await;
    assert_eq!(ready, json!({"status": "ready"}));
}

/// `/readyz` says "not ready" while the database is behind this binary: its newest migration not
/// applied, or an SQL file (`sql/claim.sql`, ...) not this binary's version; and ready again
/// once it has caught up. (A load balancer then keeps traffic on the replicas that match the
/// database during a rolling upgrade.)
#[tokio::test]
async fn readiness_is_refused_while_the_database_lacks_a_migration_or_an_sql_file_of_this_binary() {
    let app = TestApp::spawn().await;
    let readyz = async || app.get("/readyz").await;
    readyz().ok_json().await;

    // the newest migration not (successfully) applied
    let newest: i64 = app
        .scalar("SELECT max(version) FROM _sqlx_migrations")
        .await;
    let mark = async |success: bool| {
        sqlx::query("UPDATE _sqlx_migrations SET success = $2 WHERE version = $1")
            .bind(newest)
            .bind(success)
            .execute(&app.db)
            .await
            .unwrap();
    };
    mark(false).await;
    let body = readyz()
        .refused(StatusCode::SERVICE_UNAVAILABLE, "not_ready")
        .await;
    assert!(error_message(&body).contains("not been migrated"), "{body}");
    mark(true).await;
    readyz().ok_json().await;

    // an SQL file another binary of the same revision applied: not this binary's functions
    let checksum: Vec<u8> = app
        .scalar("SELECT checksum FROM credpool_sql_files WHERE name = 'claim.sql'")
        .await;
    let set = async |value: &[u8]| {
        app.run_sql_with(
            "UPDATE credpool_sql_files SET checksum = $1 WHERE name = 'claim.sql'",
            value,
        )
        .await;
    };
    set(&[0; 32]).await;
    readyz()
        .refused(StatusCode::SERVICE_UNAVAILABLE, "not_ready")
        .await;
    set(&checksum).await;
    readyz().ok_json().await;
}

#[tokio::test]
async fn every_response_carries_a_request_id_taken_from_the_request_or_generated() {
    let app = TestApp::spawn().await;
    let echoed = app
        .client
        .get(app.url("/healthz"))
        .header("x-request-id", "trace-me-42")
        .send()
        .await
        .unwrap();
    assert_eq!(echoed.headers()["x-request-id"], "trace-me-42");
    let generated = app.get("/no/such/route").await;
    let id = generated.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(id.len(), 36, "{id}");
    let other = app.get("/healthz").await;
    assert_ne!(other.headers()["x-request-id"].to_str().unwrap(), id);
}

/// Every route the service serves, as (method, path template); the relay's own route
/// (`/relay/{provider}/{pool}/...`, any method) passes an upstream API through and is not in the
/// document.
const ROUTES: [(&str, &str); 23] = [
    ("post", "/api/internal/allocate-key"),
    ("post", "/api/internal/release-key"),
    ("post", "/api/internal/renew-lease"),
    ("get", "/api/admin/keys"),
    ("put", "/api/admin/keys/{key_id}"),
    ("get", "/api/admin/keys/{key_id}"),
    ("patch", "/api/admin/keys/{key_id}"),
    ("delete", "/api/admin/keys/{key_id}"),
    ("post", "/api/admin/keys/{key_id}/release-all"),
    ("post", "/api/admin/leases/{lease_id}/release"),
    ("get", "/api/admin/pools"),
    ("get", "/api/admin/tenants"),
    ("put", "/api/admin/tenants/{tenant_id}"),
    ("delete", "/api/admin/tenants/{tenant_id}"),
    ("post", "/api/admin/tenants/{tenant_id}/keys"),
    ("delete", "/api/admin/tenants/{tenant_id}/keys/{key_id}"),
    ("get", "/api/admin/relay/upstreams"),
    ("put", "/api/admin/relay/upstreams/{provider}"),
    ("delete", "/api/admin/relay/upstreams/{provider}"),
    ("get", "/livez"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
];

#[tokio::test]
async fn the_openapi_document_covers_every_served_route_with_its_status_codes() {
    let app = TestApp::spawn().await;
    let doc = app.get("/openapi.json").ok_json().await;
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .map(move |m| (m.clone(), path.clone()))
        })
        .collect();
    let mut expected: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    expected.insert(("get".into(), "/openapi.json".into()));
    assert_eq!(documented, expected);

    // every documented operation is really served: a request reaches its handler (whatever it
    // then answers), never the router's "no such route" or "method not allowed"
    for (method, path) in &documented {
        let concrete = path
            .replace("{key_id}", "some-key")
            .replace("{lease_id}", &"ab".repeat(16));
        let response = app
            .client
            .request(method.to_uppercase().parse().unwrap(), app.url(&concrete))
            .header("x-admin-key", ADMIN_KEY)
            .header("x-internal-key", INTERNAL_KEY)
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        let code = body["error"]["code"].as_str().unwrap_or_default();
        assert!(
            code != "route_not_found" && code != "method_not_allowed",
            "{method} {path}: {code}"
        );
    }

    // every executor and operator route documents its error codes in the shared error shape
    for (method, path) in ROUTES.iter().filter(|(_, p)| p.starts_with("/api/")) {
        let responses = &doc["paths"][path][method]["responses"];
        for status in ["401", "503"] {
            let schema = &responses[status]["content"]["application/json"]["schema"]["$ref"];
            assert_eq!(
                schema, "#/components/schemas/ErrorBody",
                "{method} {path} {status}"
            );
        }
    }
    let allocate = &doc["paths"]["/api/internal/allocate-key"]["post"]["responses"];
    for status in [
        "200", "400", "401", "404", "409", "413", "415", "429", "500", "503",
    ] {
        assert!(
            allocate.get(status).is_some(),
            "allocate does not document {status}"
        );
    }
    assert!(allocate["429"]["headers"].get("Retry-After").is_some());
    assert!(
        allocate["409"]["description"]
            .as_str()
            .unwrap()
            .contains("model_not_supported")
    );
    assert!(
        doc["paths"]["/api/internal/renew-lease"]["post"]["responses"]
            .get("410")
            .is_some()
    );
    assert!(
        doc["components"]["securitySchemes"]
            .get("internal_key")
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_database_is_store_unavailable_and_never_pool_exhausted_and_readiness_follows_it()
{
    let dir = tmp_dir("credpool-outage-");
    let cluster = EmbeddedCluster::start(dir.path(), None).await.unwrap();
    let options = cluster.connect_options();
    credpool::store::migrate(&sqlx::PgPool::connect_with(options.clone()).await.unwrap())
        .await
        .unwrap();
    let pool = lazy_pool(options, 4, Duration::from_millis(500));
    let (addr, _stop) = serve(pool, &AppOptions::default()).await;
    let service = Remote::at(addr);
    let (client, base) = (&service.client, &service.base);
    let provider = format!("outage{}", hex::encode(rand::random::<[u8; 3]>()));
    let put = service
        .put_key_raw(
            "outage-key",
            json!({"provider": provider, "models": ["gpt-4o"], "max_concurrent_uses": 1, "secret": {"api_key": "sk"}}),
        )
        .await;
    assert!(put.status().is_success());
    let body = json!({"provider": provider, "model": "gpt-4o", "lease_seconds": 600});
    let allocate = || service.allocate(body.clone());
    let held = allocate().ok_json().await;
    allocate()
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    let before = service.metrics().await;
    assert_eq!(allocations(&before, &provider, "pool_exhausted"), 1.0);
    assert_eq!(allocations(&before, &provider, "store_unavailable"), 0.0);

    // the relay's calls of the provider too (its upstream answers nothing: none reaches it)
    let upstream = json!({"base_url": "http://127.0.0.1:9", "api": "openai"});
    let path = format!("/api/admin/relay/upstreams/{provider}");
    let set = service.admin(Method::PUT, &path, Some(upstream)).await;
    assert_eq!(set.status(), StatusCode::CREATED);

    cluster.stop().await;
    for _ in 0..3 {
        allocate()
            .refused(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
            .await;
    }
    let relayed = client
        .post(format!(
            "{base}/relay/{provider}/default/v1/chat/completions"
        ))
        .bearer_auth(INTERNAL_KEY)
        .json(&json!({"model": "gpt-4o", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(relayed.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = relayed.json().await.unwrap();
    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
    assert_eq!(
        body["error"]["type"], "server_error",
        "OpenAI's shape: {body}"
    );
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_error(ready, StatusCode::SERVICE_UNAVAILABLE, "not_ready").await;
    // liveness touches no database: the process is alive, and must not be restarted for this
    let live = client.get(format!("{base}/livez")).send().await.unwrap();
    assert_eq!(
        json_body(live, StatusCode::OK).await,
        json!({"status": "ok"})
    );

    let during = service.metrics().await;
    assert_eq!(allocations(&during, &provider, "store_unavailable"), 3.0);
    assert_eq!(
        allocations(&during, &provider, "pool_exhausted"),
        1.0,
        "a store outage counted as no capacity"
    );
    assert!(
        during.contains("credpool_db_acquire_timeouts_total")
            || during.contains("credpool_db_acquire_seconds")
    );

    // the database comes back: the service recovers without a restart, and the lease granted
    // before the outage still holds its slot
    let cluster = EmbeddedCluster::start(dir.path(), None).await.unwrap();
    let mut ready = false;
    for _ in 0..50 {
        if client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status()
            == StatusCode::OK
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ready, "readiness did not recover");
    allocate()
        .refused(StatusCode::TOO_MANY_REQUESTS, "pool_exhausted")
        .await;
    let released = service.release(release_body(&held, "success")).await;
    assert_eq!(json_body(released, StatusCode::OK).await["released"], true);
    allocate().ok_json().await;
    cluster.stop().await;
}

#[tokio::test]
async fn a_request_stuck_on_the_database_is_answered_503_within_the_request_timeout() {
    let mut options = AppOptions::default();
    options.settings.request_timeout = Duration::from_millis(500);
    let app = TestApp::spawn_with(options).await;
    app.put_gpt4o_key("key-a", "default", 1).await;
    let lease: Value = app.lease(gpt4o_for(60)).await;
    // another session holds the lease's slot row: the renewal waits for it
    let tx = holding(
        &app,
        &["SELECT 1 FROM lease_slots WHERE key_id = 'key-a' FOR UPDATE"],
    )
    .await;
    let renew = lease_ref(&lease);
    app.renew(renew.clone())
        .refused(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
        .await;
    tx.rollback().await.unwrap();
    app.renew(renew).ok_json().await;
}
