//! The `credpool` binary as a user runs it: two `serve` processes racing on one database, the
//! embedded default database, and the demo fleet.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::process::Command;
use tokio::sync::Barrier;

use credpool_test_support::*;

use crate::BIN;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_service_processes_on_one_database_never_oversell_a_limit_1_credential() {
    let _turn = race_turn().await;
    let database = TestDatabase::create().await;
    let env = keyed_env(&database);
    let (a, b) = tokio::join!(
        ServeProcess::start(BIN, &env, &[]),
        ServeProcess::start(BIN, &env, &[])
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
                let (client, bases, barrier, key) =
                    (client.clone(), bases.clone(), barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let url = format!("{}/api/internal/allocate-key", bases[i % 2]);
                    let body = gpt4o_in_for(&key, 600);
                    post_json(&client, &url, ("x-internal-key", INTERNAL_KEY), body)
                        .await
                        .status()
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
                .strip_prefix(&format!("export {name}="))
                .map(str::to_owned)
        })
        .unwrap_or_else(|| panic!("{name} not printed; banner: {banner:?}"))
}

fn postmaster_running(data_dir: &Path) -> bool {
    data_dir.join("pgdata/postmaster.pid").exists()
}

#[tokio::test]
async fn serve_without_database_url_runs_on_the_embedded_default_and_stops_it_on_exit() {
    let dir = tmp_dir("credpool-embedded-");
    let data_dir = dir.path().to_str().unwrap();

    // a relative --data-dir, resolved against the working directory
    let relative = dir.path().file_name().unwrap().to_str().unwrap();
    let first = ServeProcess::start_in(
        BIN,
        Some(Path::new("/tmp")),
        Stdio::inherit(),
        &[],
        &["--data-dir", relative],
    )
    .await;
    let internal = key_from(&first.banner, "CREDPOOL_INTERNAL_KEY");
    let admin = key_from(&first.banner, "CREDPOOL_ADMIN_KEY");
    assert_ne!(internal, admin);
    // `credpool env` prints them again, for a shell to eval
    let eval = r#"eval "$("$0" env --data-dir "$1")" && echo "$CREDPOOL_INTERNAL_KEY $CREDPOOL_ADMIN_KEY""#;
    let mut sh = Command::new("sh");
    sh.args(["-c", eval, BIN, data_dir])
        .env_remove("CREDPOOL_DATA_DIR");
    let exported = run(&mut sh).await;
    assert!(exported.success, "{}", exported.stderr);
    assert_eq!(exported.stdout.trim(), format!("{internal} {admin}"));
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
            let body = gpt4o_for(1);
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
    let second = ServeProcess::start(
        BIN,
        &[],
        &["--data-dir", data_dir, "--listen", "localhost:0"],
    )
    .await;
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
async fn serve_refuses_a_key_shorter_than_16_characters_without_quoting_it() {
    // Configured keys had no minimum length: `CREDPOOL_ADMIN_KEY=admin` started a service
    // whose operator routes a guess would open.
    let database = TestDatabase::create().await;
    for (internal, admin) in [
        (INTERNAL_KEY, "short-admin-key"),
        ("short-exec-key", ADMIN_KEY),
    ] {
        let output = tokio::time::timeout(
            Duration::from_secs(60),
            Command::new(BIN)
                .args(["serve", "--listen", "127.0.0.1:0"])
                .env("DATABASE_URL", database.url())
                .env("CREDPOOL_INTERNAL_KEY", internal)
                .env("CREDPOOL_ADMIN_KEY", admin)
                .env("CREDPOOL_MASTER_KEY", MASTER_KEY)
                .env("CREDPOOL_SHUTDOWN_DELAY_SECONDS", "0")
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("credpool serve started with a 15-character key");
        let output = output.unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("at least 16 characters"), "{stderr}");
        assert!(!stderr.contains("short-"), "the key is quoted: {stderr}");
    }
}

#[tokio::test]
async fn env_without_generated_keys_says_where_they_would_be() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(BIN)
        .args(["env", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("service-keys.json does not exist"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_database_url_naming_a_missing_database_is_refused_with_a_clean_message() {
    let database = TestDatabase::create().await;
    let missing = format!("{}_missing", database.name);
    let output = Command::new(BIN)
        .arg("migrate")
        .env("DATABASE_URL", url_for(&database.options, &missing))
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.trim(),
        format!(
            "credpool: connecting to PostgreSQL: database \"{missing}\" does not exist; credpool \
             does not create the database of DATABASE_URL: create it first (`createdb {missing}`, \
             or `CREATE DATABASE {missing}` in psql)"
        )
    );
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
    let migrated = run(credpool_command(BIN, &database.url()).arg("migrate")).await;
    assert!(migrated.success, "{}", migrated.stderr);
    let tables: i64 = pool.scalar("SELECT count(*) FROM information_schema.tables WHERE table_name IN ('credentials', 'lease_slots', 'lease_events')").await;
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
async fn no_secret_reaches_a_log_line_a_metric_or_a_database_row_even_at_trace_level() {
    let database = TestDatabase::create().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let nonce = hex::encode(rand::random::<[u8; 6]>());
    // the service's own secrets come from files, the database URL with a password (the test
    // server trusts local connections, so any password will do)
    let internal_key = format!("ik-leak-{nonce}");
    let admin_key = format!("ak-leak-{nonce}");
    let password = format!("pw-leak-{nonce}");
    let user = database.options.get_username().to_owned();
    let url_with_password =
        database
            .url()
            .replacen(&format!("://{user}@"), &format!("://{user}:{password}@"), 1);
    assert!(url_with_password.contains(&password));
    let files = tempfile::tempdir().unwrap();
    let mut env: Vec<(&str, String)> = keyed_env(&database)
        .into_iter()
        .filter(|(name, _)| {
            !matches!(
                *name,
                "DATABASE_URL" | "CREDPOOL_INTERNAL_KEY" | "CREDPOOL_ADMIN_KEY"
            )
        })
        .collect();
    for (name, value) in [
        ("CREDPOOL_INTERNAL_KEY_FILE", &internal_key),
        ("CREDPOOL_ADMIN_KEY_FILE", &admin_key),
        ("DATABASE_URL_FILE", &url_with_password),
    ] {
        env.push((
            name,
            secret_file(files.path(), name, &format!("{value}\n"), 0o600),
        ));
    }
    env.push(("RUST_LOG", "trace".to_owned()));
    let serve =
        ServeProcess::start_in(BIN, None, Stdio::from(log.reopen().unwrap()), &env, &[]).await;
    let client = client();
    let base = serve.base.clone();
    let url = |path: &str| format!("{base}{path}");
    let secrets: Vec<String> = (0..3).map(|i| format!("sk-leak-{nonce}-{i}")).collect();
    let refresh = format!("rt-leak-{nonce}");

    for (i, secret) in secrets.iter().enumerate() {
        let response = client
            .put(url(&format!("/api/admin/keys/leak-{i}")))
            .header("x-admin-key", &admin_key)
            .json(
                &json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 2,
                          "secret": {"api_key": secret, "oauth": {"refresh_token": refresh}}}),
            )
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
    }
    // an OAuth credential, due for its refresh at once, against a token endpoint of
    // the test's own that rotates the refresh token: neither refresh token, the client secret
    // nor either access token may reach a log line, a metric or a row
    let oauth_secrets = [
        format!("at-leak-{nonce}-0"),
        format!("rt-leak-{nonce}-0"),
        format!("cs-leak-{nonce}"),
        format!("at-leak-{nonce}-1"),
        format!("rt-leak-{nonce}-1"),
    ];
    let answer = json!({"access_token": oauth_secrets[3], "token_type": "Bearer",
                        "expires_in": 3600, "refresh_token": oauth_secrets[4]});
    let token_endpoint = axum::Router::new().route(
        "/token",
        axum::routing::post(move || {
            let answer = answer.clone();
            async move { axum::Json(answer) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let token_url = format!("http://{}/token", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, token_endpoint).await });
    let expires_at = (time::OffsetDateTime::now_utc() + time::Duration::seconds(100))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let response = client
        .put(url("/api/admin/keys/leak-oauth"))
        .header("x-admin-key", &admin_key)
        .json(&json!({"provider": "openai", "pool": "oauth", "models": ["gpt-4o"], "max_concurrent_uses": 2,
                      "secret": {"access_token": oauth_secrets[0], "refresh_token": oauth_secrets[1],
                                 "expires_at": expires_at},
                      "oauth": {"token_url": token_url, "client_id": "leak-client",
                                "client_secret": oauth_secrets[2], "refresh_before_seconds": 200}}))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success());
    for _ in 0..600 {
        let detail: Value = client
            .get(url("/api/admin/keys/leak-oauth"))
            .header("x-admin-key", &admin_key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if detail["oauth"]["generation"] == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // a malformed secret: the 400 must not quote it
    let bad = client
        .put(url("/api/admin/keys/leak-bad"))
        .header("x-admin-key", &admin_key)
        .json(&json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 1, "secret": secrets[0]}))
        .send()
        .await
        .unwrap();
    assert!(!bad.text().await.unwrap().contains(&secrets[0]));

    let internal = |path: &str, body: Value| {
        let request = client
            .post(url(path))
            .header("x-internal-key", &internal_key)
            // a gateway's trace context: it lands on spans and log lines, the keys never do
            .header(
                "traceparent",
                format!("00-{nonce}{nonce}{}-{nonce}0000-01", &nonce[..8]),
            )
            .json(&body);
        async move { request.send().await.expect("POST") }
    };
    let mut leases = Vec::new();
    for _ in 0..4 {
        let lease = internal("/api/internal/allocate-key", json!({"provider": "openai", "model": "gpt-4o", "holder": "leaky", "lease_seconds": 60})).await;
        leases.push(json_body(lease, StatusCode::OK).await);
    }
    let reference = |l: &Value| json!({"provider": l["provider"], "pool": l["pool"], "key_id": l["key_id"], "lease_id": l["lease_id"]});
    // a lease of the refreshed token, released as the provider's 401 would have it
    let oauth_lease = json_body(
        internal(
            "/api/internal/allocate-key",
            json!({"provider": "openai", "pool": "oauth", "model": "gpt-4o", "lease_seconds": 60}),
        )
        .await,
        StatusCode::OK,
    )
    .await;
    assert_eq!(oauth_lease["credential"]["access_token"], oauth_secrets[3]);
    let mut release = reference(&oauth_lease);
    release["outcome"] = json!("auth_expired");
    json_body(
        internal("/api/internal/release-key", release).await,
        StatusCode::OK,
    )
    .await;
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
    let admin = |method: Method, path: &str, body: Option<Value>| {
        let mut request = client
            .request(method, url(path))
            .header("x-admin-key", &admin_key);
        if let Some(body) = body {
            request = request.json(&body);
        }
        request.send()
    };
    // what an operator's GET answers, as text, whatever its status
    let admin_text = async |path: &str| {
        let response = admin(Method::GET, path, None).await.unwrap();
        response.text().await.unwrap()
    };
    for path in [
        "/api/admin/keys",
        "/api/admin/keys/leak-0",
        "/api/admin/keys/leak-oauth",
        "/api/admin/pools",
    ] {
        let text = admin_text(path).await;
        assert!(
            !secrets
                .iter()
                .chain(&oauth_secrets)
                .any(|s| text.contains(s.as_str())),
            "{path} returned a secret"
        );
    }
    // an operator drains, force-releases and removes credentials
    for (method, path, body) in [
        (
            Method::PATCH,
            "/api/admin/keys/leak-1",
            Some(json!({"state": "drain"})),
        ),
        (
            Method::POST,
            "/api/admin/keys/leak-2/release-all",
            Some(json!({"reason": "test"})),
        ),
        (Method::DELETE, "/api/admin/keys/leak-1", None),
    ] {
        admin(method, path, body).await.unwrap();
    }
    // a wrong key is refused without being echoed
    let wrong = client
        .post(url("/api/internal/allocate-key"))
        .header("x-internal-key", format!("{internal_key}-wrong"))
        .json(&gpt4o())
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    // a tenant's executor key: minted (its one appearance), used, listed, revoked, refused (on a
    // credential of its own: the others are busy, cooling down or gone by now)
    let put = client
        .put(url("/api/admin/keys/leak-tenant"))
        .header("x-admin-key", &admin_key)
        .json(
            &json!({"provider": "openai", "pool": "tenants", "models": ["gpt-4o"],
                      "max_concurrent_uses": 2, "secret": {"api_key": secrets[0]}}),
        )
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success());
    let tenant = admin(
        Method::PUT,
        "/api/admin/tenants/leaky",
        Some(json!({"max_concurrent_leases": 2, "pools": ["*/*"]})),
    )
    .await
    .unwrap();
    assert!(tenant.status().is_success());
    let minted = admin(Method::POST, "/api/admin/tenants/leaky/keys", None)
        .await
        .unwrap();
    let minted: Value = minted.json().await.unwrap();
    let tenant_key = minted["key"].as_str().unwrap().to_owned();
    let as_tenant = |path: &str, body: Value| {
        client
            .post(url(path))
            .header("x-internal-key", &tenant_key)
            .json(&body)
            .send()
    };
    let lease = json_body(
        as_tenant("/api/internal/allocate-key", json!({"provider": "openai", "pool": "tenants", "model": "gpt-4o", "holder": "leaky", "lease_seconds": 60}))
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    let mut renew = reference(&lease);
    renew["lease_seconds"] = json!(30);
    json_body(
        as_tenant("/api/internal/renew-lease", renew).await.unwrap(),
        StatusCode::OK,
    )
    .await;
    json_body(
        as_tenant("/api/internal/release-key", reference(&lease))
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    let listed = admin_text("/api/admin/tenants").await;
    assert!(
        !listed.contains(&tenant_key),
        "the tenant list returned a key"
    );
    admin(
        Method::DELETE,
        &format!(
            "/api/admin/tenants/leaky/keys/{}",
            minted["key_id"].as_str().unwrap()
        ),
        None,
    )
    .await
    .unwrap();
    let revoked = as_tenant(
        "/api/internal/allocate-key",
        json!({"provider": "openai", "pool": "tenants", "model": "gpt-4o"}),
    )
    .await
    .unwrap();
    assert_eq!(revoked.status(), StatusCode::UNAUTHORIZED);
    assert!(!revoked.text().await.unwrap().contains(&tenant_key));
    // the operations routes: metrics (after all of the above), probes, the API description
    let mut served = String::new();
    for path in ["/metrics", "/livez", "/readyz", "/healthz", "/openapi.json"] {
        let response = client.get(url(path)).send().await.unwrap();
        assert!(response.status().is_success(), "{path}");
        served.push_str(&response.text().await.unwrap());
    }
    assert!(served.contains("credpool_allocations_total"));
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
    assert!(
        logged.contains(&format!("{nonce}{nonce}")),
        "the trace id should be on the log lines"
    );
    assert!(
        rows.contains("token_refreshed") && rows.contains("token_rejected"),
        "the OAuth credential was refreshed and its token reported rejected"
    );
    for secret in secrets.iter().chain(&oauth_secrets).chain([
        &refresh,
        &internal_key,
        &admin_key,
        &password,
        &tenant_key,
    ]) {
        assert!(
            !logged.contains(secret.as_str()),
            "{secret} appeared in the log"
        );
        assert!(
            !served.contains(secret.as_str()),
            "{secret} appeared in /metrics, a probe or the API description"
        );
        assert!(
            !rows.contains(secret.as_str()),
            "{secret} appeared in a database row"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_request_finish_then_exits_with_json_logs_carrying_the_request_id_and_trace()
 {
    let database = TestDatabase::create().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut env = keyed_env(&database);
    env.push(("RUST_LOG", "credpool=info".to_owned()));
    let serve = ServeProcess::start_in(
        BIN,
        None,
        Stdio::from(log.reopen().unwrap()),
        &env,
        &["--log-format", "json"],
    )
    .await;
    let client = client();
    let base = serve.base.clone();
    // a malformed traceparent is ignored, not refused
    let put = client
        .put(format!("{base}/api/admin/keys/drain-key"))
        .header("x-admin-key", ADMIN_KEY)
        .header("x-request-id", "req-put-6")
        .header("traceparent", "00-not-a-trace-01")
        .json(&json!({"provider": "openai", "models": ["gpt-4o"], "max_concurrent_uses": 1, "secret": {"api_key": "sk"}}))
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success());
    // a gateway's trace continues through credpool: its trace context is on the request's span
    let lease = client
        .post(format!("{base}/api/internal/allocate-key"))
        .header("x-internal-key", INTERNAL_KEY)
        .header("x-request-id", "req-allocate-7")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .json(&gpt4o_for(60))
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
    let request = spans
        .iter()
        .find(|s| s["request_id"] == "req-allocate-7")
        .unwrap_or_else(|| panic!("{granted}"));
    assert_eq!(granted["fields"]["lease_id"], lease["lease_id"]);
    assert_eq!(
        request["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736",
        "{granted}"
    );
    assert_eq!(request["parent_span_id"], "00f067aa0ba902b7", "{granted}");
    let stored = lines
        .iter()
        .find(|l| l["fields"]["message"] == "credential stored")
        .expect("a `credential stored` line");
    let request = stored["spans"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["request_id"] == "req-put-6")
        .unwrap_or_else(|| panic!("{stored}"));
    assert!(
        request.get("trace_id").is_none() && request.get("parent_span_id").is_none(),
        "a malformed traceparent reached the span: {stored}"
    );
}

/// What one request of a load got: a status (and error code), or a transport error.
#[derive(Debug)]
enum Answer {
    Status(StatusCode, String),
    Transport(String),
}

/// One request of a load: what it was, when it was sent, what it got.
#[derive(Debug)]
struct Sent {
    what: &'static str,
    at: std::time::Instant,
    answer: Answer,
}

async fn send(request: reqwest::RequestBuilder, what: &'static str) -> (Sent, Option<Value>) {
    let at = std::time::Instant::now();
    match request.send().await {
        Ok(response) => {
            let status = response.status();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            let code = body["error"]["code"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let answer = Answer::Status(status, code);
            (Sent { what, at, answer }, Some(body))
        }
        Err(error) => {
            let answer = Answer::Transport(format!("{error:?}"));
            (Sent { what, at, answer }, None)
        }
    }
}

/// A rolling update, from the pod's side: SIGTERM while executors allocate and release, a
/// readiness probe polls, and allocations wait on a full pool. Timing margins: the service
/// closes its listener `DELAY` after it *handles* the signal, which is after `sigterm_at`; the
/// test holds it to "no request fails" only for requests sent before `sigterm_at + DELAY - 1 s`
/// (a second for a loaded machine to connect), and to "readiness is 503" only for probes sent
/// after `sigterm_at + 1 s` (a second to handle the signal). The waiting allocations' answers
/// are bounded from below only (the drain cannot end early), never from above.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_load_keeps_serving_through_the_delay_and_answers_waiting_allocations_429_at_drain_end()
 {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    const DELAY: Duration = Duration::from_secs(4);
    const DRAIN: Duration = Duration::from_secs(3);
    const MARGIN: Duration = Duration::from_secs(1);
    const WAITERS: usize = 3;

    let database = TestDatabase::create().await;
    let mut env = keyed_env(&database);
    env.push((
        "CREDPOOL_SHUTDOWN_DELAY_SECONDS",
        DELAY.as_secs().to_string(),
    ));
    env.push((
        "CREDPOOL_SHUTDOWN_DRAIN_SECONDS",
        DRAIN.as_secs().to_string(),
    ));
    env.push(("CREDPOOL_MAX_WAIT_MS", "120000".to_owned()));
    let serve = ServeProcess::start(BIN, &env, &[]).await;
    let base = serve.base.clone();
    let http = client();
    // `busy`: one slot, held throughout, so that allocations on its pool wait; `churn-*`: the
    // load's (16 slots for 4 executors: the load never waits)
    let mut keys = vec![("busy".to_owned(), "busy", 1)];
    keys.extend((0..4).map(|i| (format!("churn-{i}"), "default", 4)));
    for (key, pool, limit) in &keys {
        let put = http
            .put(format!("{base}/api/admin/keys/{key}"))
            .header("x-admin-key", ADMIN_KEY)
            .json(
                &json!({"provider": "openai", "pool": pool, "models": ["gpt-4o"],
                          "max_concurrent_uses": limit, "secret": {"api_key": "sk-drain"}}),
            )
            .send()
            .await
            .unwrap();
        assert!(put.status().is_success());
    }
    let allocate_url = format!("{base}/api/internal/allocate-key");
    let held = post_json(
        &http,
        &allocate_url,
        ("x-internal-key", INTERNAL_KEY),
        gpt4o_in_for("busy", 600),
    )
    .await;
    json_body(held, StatusCode::OK).await;

    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let request = http
                .post(&allocate_url)
                .header("x-internal-key", INTERNAL_KEY)
                .json(
                    &json!({"provider": "openai", "model": "gpt-4o", "pool": "busy",
                              "lease_seconds": 60, "wait_ms": 120000}),
                );
            tokio::spawn(async move {
                let response = request.send().await;
                let finished = Instant::now();
                let answer = match response {
                    Ok(response) => {
                        let retry_after = response.headers().get("retry-after").cloned();
                        let status = response.status();
                        let body: Value = response.json().await.unwrap_or(Value::Null);
                        Ok((status, body, retry_after))
                    }
                    Err(error) => Err(format!("{error:?}")),
                };
                (finished, answer)
            })
        })
        .collect();
    let mut waiting = 0.0;
    for _ in 0..300 {
        let page = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        waiting = sample(&page, "credpool_allocations_waiting");
        if waiting == WAITERS as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(waiting, WAITERS as f64, "the allocations are not waiting");

    // the load: executors allocate and release, a readiness probe polls; each stops at its
    // first transport error (the listener has closed) or when told
    let stop = Arc::new(AtomicBool::new(false));
    let executors: Vec<_> = (0..4)
        .map(|_| {
            let (stop, base) = (stop.clone(), base.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::builder()
                    .timeout(Duration::from_secs(30))
                    .build()
                    .unwrap();
                let mut sent = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let allocate = http
                        .post(format!("{base}/api/internal/allocate-key"))
                        .header("x-internal-key", INTERNAL_KEY)
                        .json(&gpt4o_for(30));
                    let (granted, lease) = send(allocate, "allocate").await;
                    let failed = matches!(granted.answer, Answer::Transport(_));
                    sent.push(granted);
                    if failed {
                        break;
                    }
                    if let Some(lease) = lease.filter(|l| l["lease_id"].is_string()) {
                        let release = http
                            .post(format!("{base}/api/internal/release-key"))
                            .header("x-internal-key", INTERNAL_KEY)
                            .json(&release_body(&lease, "success"));
                        let (released, _) = send(release, "release").await;
                        let failed = matches!(released.answer, Answer::Transport(_));
                        sent.push(released);
                        if failed {
                            break;
                        }
                    }
                    let (live, _) = send(http.get(format!("{base}/livez")), "livez").await;
                    let failed = matches!(live.answer, Answer::Transport(_));
                    sent.push(live);
                    if failed {
                        break;
                    }
                }
                sent
            })
        })
        .collect();
    let probe = {
        let (stop, base) = (stop.clone(), base.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut sent = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let (ready, _) = send(http.get(format!("{base}/readyz")), "readyz").await;
                let failed = matches!(ready.answer, Answer::Transport(_));
                sent.push(ready);
                if failed {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            sent
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;

    let sigterm_at = Instant::now();
    let pid = nix::unistd::Pid::from_raw(serve.child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();

    let mut answered = Vec::new();
    for waiter in waiters {
        answered.push(waiter.await.unwrap());
    }
    let mut child = serve.child;
    let exit = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("credpool serve did not exit")
        .unwrap();
    stop.store(true, Ordering::SeqCst);
    let mut load = Vec::new();
    for executor in executors {
        load.extend(executor.await.unwrap());
    }
    let probes = probe.await.unwrap();

    // 1. during the delay everything is served: no request sent before the listener could have
    //    closed failed, and the load really ran then
    let serving_until = sigterm_at + DELAY - MARGIN;
    for sent in load.iter().filter(|s| s.at < serving_until) {
        let after = sent.at.saturating_duration_since(sigterm_at);
        match &sent.answer {
            Answer::Status(StatusCode::OK, _) => {}
            Answer::Status(status, code) => {
                panic!(
                    "{} sent {after:?} after SIGTERM got {status} {code}",
                    sent.what
                )
            }
            Answer::Transport(error) => panic!(
                "{} sent {after:?} after SIGTERM failed to connect: {error}",
                sent.what
            ),
        }
    }
    let during_delay = load
        .iter()
        .filter(|s| s.at >= sigterm_at && s.at < serving_until)
        .count();
    assert!(
        during_delay >= 8,
        "only {during_delay} requests during the delay"
    );

    // 2. readiness: 200 before the signal, 503 shutting_down during the delay, never 200 again
    assert!(
        probes
            .iter()
            .any(|p| p.at < sigterm_at && matches!(p.answer, Answer::Status(StatusCode::OK, _))),
        "never ready before SIGTERM: {probes:?}"
    );
    let in_delay: Vec<&Sent> = probes
        .iter()
        .filter(|p| p.at >= sigterm_at + MARGIN && p.at < serving_until)
        .collect();
    assert!(!in_delay.is_empty(), "no probe during the delay");
    for p in in_delay {
        match &p.answer {
            Answer::Status(StatusCode::SERVICE_UNAVAILABLE, code) if code == "shutting_down" => {}
            other => panic!("readiness during the delay: {other:?}"),
        }
    }
    let first_not_ready = probes
        .iter()
        .position(|p| !matches!(p.answer, Answer::Status(StatusCode::OK, _)))
        .expect("readiness never changed");
    assert!(
        probes[first_not_ready..]
            .iter()
            .all(|p| !matches!(p.answer, Answer::Status(StatusCode::OK, _))),
        "ready again after SIGTERM: {probes:?}"
    );

    // 3. the waiting allocations were answered 429 (not a reset connection), once the drain
    //    was over, and the process then exited cleanly
    for (finished, answer) in answered {
        let (status, body, retry_after) = answer.unwrap_or_else(|e| {
            panic!("a waiting allocation got a transport error instead of 429: {e}")
        });
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        assert_eq!(body["error"]["code"], "pool_exhausted", "{body}");
        assert!(retry_after.is_some(), "429 without Retry-After");
        assert!(
            finished >= sigterm_at + DELAY + DRAIN,
            "a waiting allocation was answered {:?} after SIGTERM, before the drain was over",
            finished - sigterm_at
        );
    }
    assert!(exit.success(), "credpool serve exited with {exit}");
}

#[tokio::test]
async fn serve_refuses_a_secret_file_others_can_read_and_a_secret_given_both_ways() {
    let files = tempfile::tempdir().unwrap();
    let run = |envs: Vec<(&'static str, String)>| async move {
        let mut command = Command::new(BIN);
        command
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env_remove("DATABASE_URL")
            .env_remove("CREDPOOL_INTERNAL_KEY")
            .env_remove("CREDPOOL_ADMIN_KEY")
            .env("CREDPOOL_MASTER_KEY", MASTER_KEY);
        for (name, value) in envs {
            command.env(name, value);
        }
        let output = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .expect("credpool serve did not stop")
            .unwrap();
        assert!(!output.status.success(), "credpool serve started");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let owner_only = secret_file(files.path(), "admin", "admin-key-value-0\n", 0o600);
    let url = secret_file(
        files.path(),
        "url",
        "postgres://u:url-password@127.0.0.1:1/db\n",
        0o600,
    );
    for (setting, mode) in [
        ("CREDPOOL_INTERNAL_KEY_FILE", 0o644),
        ("DATABASE_URL_FILE", 0o604),
    ] {
        let readable = secret_file(files.path(), setting, "readable-secret-value\n", mode);
        let mut envs = vec![
            ("CREDPOOL_ADMIN_KEY_FILE", owner_only.clone()),
            (setting, readable),
        ];
        if setting != "DATABASE_URL_FILE" {
            envs.push(("DATABASE_URL_FILE", url.clone()));
        } else {
            envs.push(("CREDPOOL_INTERNAL_KEY", "internal-key-value".to_owned()));
        }
        let stderr = run(envs).await;
        assert!(
            stderr.contains(setting) && stderr.contains(&format!("{mode:04o}")),
            "{stderr}"
        );
        assert!(stderr.contains("chmod 600"), "{stderr}");
        for secret in ["readable-secret-value", "admin-key-value-0", "url-password"] {
            assert!(!stderr.contains(secret), "{secret} in the error: {stderr}");
        }
    }
    // a value and a file for the same secret: refused, whichever way each is given
    let stderr = run(vec![
        ("CREDPOOL_ADMIN_KEY", "admin-key-value-0".to_owned()),
        ("CREDPOOL_ADMIN_KEY_FILE", owner_only.clone()),
    ])
    .await;
    assert!(stderr.contains("--admin-key"), "{stderr}");
    assert!(!stderr.contains("admin-key-value-0"), "{stderr}");
}
