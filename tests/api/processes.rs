//! The `credpool` binary as a user runs it: two `serve` processes racing on one database, the
//! embedded default database, and the demo fleet.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::process::Command;
use tokio::sync::Barrier;

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_service_processes_on_one_database_never_oversell_a_limit_1_credential() {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let env = keyed_env(&database);
    let (a, b) = tokio::join!(
        ServeProcess::start(&env, &[]),
        ServeProcess::start(&env, &[])
    );
    let bases = Arc::new([a.base.clone(), b.base.clone()]);
    let client = client();
    for round in 0..race_rounds() {
        let key = format!("duo-{round}");
        let response = client
            .put(format!("{}/api/admin/keys/{key}", bases[round % 2]))
            .header("x-admin-key", ADMIN_KEY)
            .json(&json!({"provider": "openai", "pool": key, "models": ["gpt-4o"], "max_concurrent_uses": 1,
                          "secret": {"api_key": "sk-duo"}}))
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
        let barrier = Arc::new(Barrier::new(64));
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let (client, bases, barrier, key) = (client.clone(), bases.clone(), barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let url = format!("{}/api/internal/allocate-key", bases[i % 2]);
                    let body = json!({"provider": "openai", "model": "gpt-4o", "pool": key, "lease_seconds": 600});
                    post_json(&client, &url, ("x-internal-key", INTERNAL_KEY), body).await.status()
                })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            match task.await.unwrap() {
                StatusCode::OK => won += 1,
                StatusCode::TOO_MANY_REQUESTS => {}
                other => panic!("round {round}: unexpected {other}"),
            }
        }
        assert_eq!(won, 1, "round {round}: {won} winners across two processes");
    }
    assert!(a.terminate().await.success());
    assert!(b.terminate().await.success());
}

fn key_from(banner: &[String], name: &str) -> String {
    banner
        .iter()
        .find_map(|line| {
            line.trim()
                .strip_prefix(&format!("{name}="))
                .map(str::to_owned)
        })
        .unwrap_or_else(|| panic!("{name} not printed; banner: {banner:?}"))
}

fn postmaster_running(data_dir: &Path) -> bool {
    data_dir.join("pgdata/postmaster.pid").exists()
}

#[tokio::test]
async fn serve_without_database_url_runs_on_the_embedded_default_and_stops_it_on_exit() {
    let dir = tempfile::Builder::new()
        .prefix("credpool-embedded-")
        .tempdir_in("/tmp")
        .unwrap();
    let data_dir = dir.path().to_str().unwrap();

    // a relative --data-dir, resolved against the working directory
    let relative = dir.path().file_name().unwrap().to_str().unwrap();
    let first = ServeProcess::start_in(
        Some(Path::new("/tmp")),
        Stdio::inherit(),
        &[],
        &["--data-dir", relative],
    )
    .await;
    let internal = key_from(&first.banner, "CREDPOOL_INTERNAL_KEY");
    let admin = key_from(&first.banner, "CREDPOOL_ADMIN_KEY");
    assert_ne!(internal, admin);
    // the generated API keys and master key are readable by their owner only
    for file in ["service-keys.json", "master.key"] {
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir.path().join(file))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600, "{file}");
    }
    assert!(
        first
            .banner
            .iter()
            .any(|l| l.contains("generated a master key")),
        "{:?}",
        first.banner
    );
    assert!(postmaster_running(dir.path()));

    let client = client();
    let put = client
        .put(format!("{}/api/admin/keys/local-1", first.base))
        .header("x-admin-key", &admin)
        .json(&json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 1, "secret": {"api_key": "sk-local"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::CREATED);
    let allocate = |base: String, key: String| {
        let client = client.clone();
        async move {
            let body = json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 1});
            post_json(
                &client,
                &format!("{base}/api/internal/allocate-key"),
                ("x-internal-key", &key),
                body,
            )
            .await
        }
    };
    json_body(
        allocate(first.base.clone(), internal.clone()).await,
        StatusCode::OK,
    )
    .await;
    assert!(first.terminate().await.success());
    assert!(
        !postmaster_running(dir.path()),
        "the embedded PostgreSQL was left running"
    );

    // a second start reuses the cluster, its data and the stored keys
    let second =
        ServeProcess::start(&[], &["--data-dir", data_dir, "--listen", "localhost:0"]).await;
    assert!(
        second.banner.iter().any(|l| l.contains("API keys from")),
        "{:?}",
        second.banner
    );
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    json_body(
        allocate(second.base.clone(), internal).await,
        StatusCode::OK,
    )
    .await;
    assert!(second.terminate().await.success());
    assert!(!postmaster_running(dir.path()));
}

#[tokio::test]
async fn serve_with_database_url_and_no_keys_refuses_to_start() {
    let database = TestDatabase::create().await;
    let output = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", database.url())
        .env_remove("CREDPOOL_INTERNAL_KEY")
        .env_remove("CREDPOOL_ADMIN_KEY")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("CREDPOOL_INTERNAL_KEY"), "{stderr}");
}

#[tokio::test]
async fn migrate_applies_the_schema_to_an_empty_database() {
    let database = TestDatabase::create().await;
    // start from nothing: drop what the harness applied
    let pool = database.pool(1).await;
    sqlx::raw_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public;")
        .execute(&pool)
        .await
        .unwrap();
    let output = Command::new(BIN)
        .arg("migrate")
        .env("DATABASE_URL", database.url())
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('credentials', 'lease_slots', 'lease_events')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(tables, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_fleet_runs_and_no_credential_exceeds_its_limit() {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let output = Command::new(BIN)
        .args([
            "demo",
            "--duration-seconds",
            "4",
            "--executors",
            "32",
            "--lease-seconds",
            "2",
        ])
        .env("DATABASE_URL", database.url())
        .env("CREDPOOL_MASTER_KEY", MASTER_KEY)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("peak"), "{stdout}");

    // the summary's claim, checked independently of its SQL: rebuild every lease's lifetime from
    // the raw trail and sweep it in Rust
    let pool = database.pool(1).await;
    let events: Vec<(
        String,
        uuid::Uuid,
        String,
        time::OffsetDateTime,
        time::OffsetDateTime,
    )> = sqlx::query_as(
        "SELECT key_id, lease_id, event, at, lease_until FROM lease_events ORDER BY event_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let limits: std::collections::HashMap<String, i32> =
        sqlx::query_as::<_, (String, i32)>("SELECT key_id, max_concurrent_uses FROM credentials")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    // lease -> (key, start, release time, last lease_until)
    let mut spans: std::collections::HashMap<
        uuid::Uuid,
        (
            String,
            Option<time::OffsetDateTime>,
            Option<time::OffsetDateTime>,
            time::OffsetDateTime,
        ),
    > = Default::default();
    for (key, lease, event, at, lease_until) in events {
        let span = spans.entry(lease).or_insert((key, None, None, lease_until));
        match event.as_str() {
            "granted" => span.1 = Some(at),
            "released" => span.2 = Some(at),
            _ => {}
        }
        if event == "granted" || event == "renewed" {
            span.3 = span.3.max(lease_until);
        }
    }
    assert!(spans.len() > 50, "only {} leases in the trail", spans.len());
    let mut edges: std::collections::HashMap<String, Vec<(time::OffsetDateTime, i32)>> =
        Default::default();
    for (key, start, released, last_until) in spans.into_values() {
        let start = start.expect("every lease has a granted event");
        let end = released.unwrap_or(last_until);
        assert!(end > start);
        edges.entry(key.clone()).or_default().push((start, 1));
        edges.entry(key).or_default().push((end, -1));
    }
    for (key, mut points) in edges {
        points.sort();
        let (mut held, mut peak) = (0, 0);
        for (_, delta) in points {
            held += delta;
            peak = peak.max(held);
        }
        assert!(
            peak <= limits[&key],
            "{key}: peak {peak} over limit {}",
            limits[&key]
        );
    }
}

/// Every table's rows as text.
async fn all_rows(pool: &sqlx::PgPool) -> String {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut text = String::new();
    for table in tables {
        let rows: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT string_agg(t::text, E'\\n') FROM \"{table}\" t"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        text.push_str(&rows.unwrap_or_default());
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_a_log_line_or_a_database_row_even_at_trace_level() {
    let database = TestDatabase::create().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut env = keyed_env(&database);
    env.push(("RUST_LOG", "trace".to_owned()));
    let serve = ServeProcess::start_in(None, Stdio::from(log.reopen().unwrap()), &env, &[]).await;
    let client = client();
    let base = serve.base.clone();
    let url = |path: &str| format!("{base}{path}");
    let nonce = hex::encode(rand::random::<[u8; 6]>());
    let secrets: Vec<String> = (0..3).map(|i| format!("sk-leak-{nonce}-{i}")).collect();
    let refresh = format!("rt-leak-{nonce}");

    for (i, secret) in secrets.iter().enumerate() {
        let response = client
            .put(url(&format!("/api/admin/keys/leak-{i}")))
            .header("x-admin-key", ADMIN_KEY)
            .json(
                &json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 2,
                          "secret": {"api_key": secret, "oauth": {"refresh_token": refresh}}}),
            )
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
    }
    // a malformed secret: the 400 must not quote it
    let bad = client
        .put(url("/api/admin/keys/leak-bad"))
        .header("x-admin-key", ADMIN_KEY)
        .json(&json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 1, "secret": secrets[0]}))
        .send()
        .await
        .unwrap();
    assert!(!bad.text().await.unwrap().contains(&secrets[0]));

    let internal = |path: &str, body: Value| {
        let client = client.clone();
        let url = url(path);
        async move { post_json(&client, &url, ("x-internal-key", INTERNAL_KEY), body).await }
    };
    let mut leases = Vec::new();
    for _ in 0..4 {
        let lease = internal("/api/internal/allocate-key", json!({"provider": "openai", "model": "gpt-4o", "holder": "leaky", "lease_seconds": 60})).await;
        leases.push(json_body(lease, StatusCode::OK).await);
    }
    let reference = |l: &Value| json!({"provider": l["provider"], "pool": l["pool"], "key_id": l["key_id"], "lease_id": l["lease_id"]});
    let mut renew = reference(&leases[0]);
    renew["lease_seconds"] = json!(30);
    json_body(
        internal("/api/internal/renew-lease", renew).await,
        StatusCode::OK,
    )
    .await;
    for (l, outcome) in leases.iter().take(2).zip(["success", "rate_limited"]) {
        let mut release = reference(l);
        release["outcome"] = json!(outcome);
        json_body(
            internal("/api/internal/release-key", release).await,
            StatusCode::OK,
        )
        .await;
    }
    let admin = |method: reqwest::Method, path: &str, body: Option<Value>| {
        let mut request = client
            .request(method, url(path))
            .header("x-admin-key", ADMIN_KEY);
        if let Some(body) = body {
            request = request.json(&body);
        }
        request.send()
    };
    for path in [
        "/api/admin/keys",
        "/api/admin/keys/leak-0",
        "/api/admin/pools",
    ] {
        let text = admin(reqwest::Method::GET, path, None)
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            !secrets.iter().any(|s| text.contains(s.as_str())),
            "{path} returned a secret"
        );
    }
    admin(
        reqwest::Method::PATCH,
        "/api/admin/keys/leak-1",
        Some(json!({"state": "drain"})),
    )
    .await
    .unwrap();
    admin(
        reqwest::Method::POST,
        "/api/admin/keys/leak-2/release-all",
        Some(json!({"reason": "test"})),
    )
    .await
    .unwrap();
    admin(reqwest::Method::DELETE, "/api/admin/keys/leak-1", None)
        .await
        .unwrap();
    assert!(serve.terminate().await.success());

    let mut logged = String::new();
    std::io::Read::read_to_string(&mut log.reopen().unwrap(), &mut logged).unwrap();
    assert!(
        logged.lines().count() > 50,
        "expected a trace-level log, got:\n{logged}"
    );
    let pool = database.pool(1).await;
    let rows = all_rows(&pool).await;
    assert!(
        rows.contains("leaky"),
        "the row dump should include the holder names"
    );
    for secret in secrets.iter().chain([&refresh]) {
        assert!(
            !logged.contains(secret.as_str()),
            "{secret} appeared in the log"
        );
        assert!(
            !rows.contains(secret.as_str()),
            "{secret} appeared in a database row"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_request_finish_then_exits_with_json_logs_carrying_the_request_id()
 {
    let database = TestDatabase::create().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut env = keyed_env(&database);
    env.push(("RUST_LOG", "credpool=info".to_owned()));
    let serve = ServeProcess::start_in(
        None,
        Stdio::from(log.reopen().unwrap()),
        &env,
        &["--log-format", "json"],
    )
    .await;
    let client = client();
    let base = serve.base.clone();
    let put = client
        .put(format!("{base}/api/admin/keys/drain-key"))
        .header("x-admin-key", ADMIN_KEY)
        .json(&json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 1, "secret": {"api_key": "sk"}}))
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success());
    let lease = client
        .post(format!("{base}/api/internal/allocate-key"))
        .header("x-internal-key", INTERNAL_KEY)
        .header("x-request-id", "req-allocate-7")
        .json(&json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 60}))
        .send()
        .await
        .unwrap();
    let lease = json_body(lease, StatusCode::OK).await;

    // hold the lease's slot row so that a renewal is in flight when SIGTERM arrives
    let pool = database.pool(1).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM lease_slots WHERE key_id = 'drain-key' FOR UPDATE")
        .execute(&mut *tx)
        .await
        .unwrap();
    let renew = {
        let client = client.clone();
        let url = format!("{base}/api/internal/renew-lease");
        let body = json!({"provider": "openai", "pool": "default", "key_id": "drain-key", "lease_id": lease["lease_id"], "lease_seconds": 60});
        tokio::spawn(async move {
            post_json(&client, &url, ("x-internal-key", INTERNAL_KEY), body)
                .await
                .status()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = nix::unistd::Pid::from_raw(serve.child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // no new connections once draining
    let refused = reqwest::Client::new()
        .get(format!("{base}/healthz"))
        .send()
        .await;
    assert!(
        refused.is_err(),
        "a new connection was accepted after SIGTERM"
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        renew.await.unwrap(),
        StatusCode::OK,
        "the in-flight renewal did not finish"
    );
    assert!(serve.terminate().await.success());

    let mut logged = String::new();
    std::io::Read::read_to_string(&mut log.reopen().unwrap(), &mut logged).unwrap();
    let lines: Vec<Value> = logged
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}"))
        })
        .collect();
    let granted = lines
        .iter()
        .find(|l| l["fields"]["message"] == "lease granted")
        .expect("a `lease granted` line");
    // the request's span, with its id, is on the line
    let spans = granted["spans"].as_array().unwrap();
    assert!(
        spans.iter().any(|s| s["request_id"] == "req-allocate-7"),
        "{granted}"
    );
    assert_eq!(granted["fields"]["lease_id"], lease["lease_id"]);
}
