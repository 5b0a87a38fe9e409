//! The `credpool` binary as a user runs it: two `serve` processes racing on one database, the
//! embedded default database, and the demo fleet.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::Barrier;

use crate::helpers::*;

const BIN: &str = env!("CARGO_BIN_EXE_credpool");

/// A running `credpool serve` process; killed when dropped.
struct ServeProcess {
    child: Child,
    base: String,
    /// Lines printed to stdout before "listening".
    banner: Vec<String>,
    _stdout: BufReader<ChildStdout>,
}

impl ServeProcess {
    /// `credpool serve ARGS` (with `--listen 127.0.0.1:0` unless ARGS name a listen address),
    /// run in `cwd` if given.
    async fn start_in(cwd: Option<&Path>, envs: &[(&str, String)], args: &[&str]) -> Self {
        let mut command = Command::new(BIN);
        command.arg("serve");
        if !args.contains(&"--listen") {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        if let Some(dir) = cwd {
            command.current_dir(dir);
        }
        command
            .args(args)
            .env_remove("DATABASE_URL")
            .env_remove("CREDPOOL_INTERNAL_KEY")
            .env_remove("CREDPOOL_ADMIN_KEY")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (name, value) in envs {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("spawn credpool serve");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut banner = Vec::new();
        let base = tokio::time::timeout(Duration::from_secs(120), async {
            loop {
                let mut line = String::new();
                if stdout.read_line(&mut line).await.unwrap() == 0 {
                    panic!("credpool serve exited before listening; it printed: {banner:?}");
                }
                if let Some(addr) = line.trim().strip_prefix("credpool listening on ") {
                    return addr.to_owned();
                }
                banner.push(line.trim_end().to_owned());
            }
        })
        .await
        .expect("credpool serve did not start listening");
        Self {
            child,
            base,
            banner,
            _stdout: stdout,
        }
    }

    async fn start(envs: &[(&str, String)], args: &[&str]) -> Self {
        Self::start_in(None, envs, args).await
    }

    /// SIGTERM, then wait for a clean exit.
    async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id().unwrap() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("credpool serve did not exit after SIGTERM")
            .unwrap()
    }
}

fn keyed_env(database: &TestDatabase) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", database.url()),
        ("CREDPOOL_INTERNAL_KEY", INTERNAL_KEY.to_owned()),
        ("CREDPOOL_ADMIN_KEY", ADMIN_KEY.to_owned()),
        ("CREDPOOL_DB_MAX_CONNECTIONS", "32".to_owned()),
    ]
}

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
    let first =
        ServeProcess::start_in(Some(Path::new("/tmp")), &[], &["--data-dir", relative]).await;
    let internal = key_from(&first.banner, "CREDPOOL_INTERNAL_KEY");
    let admin = key_from(&first.banner, "CREDPOOL_ADMIN_KEY");
    assert_ne!(internal, admin);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(dir.path().join("service-keys.json"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
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
