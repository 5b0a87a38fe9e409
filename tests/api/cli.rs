//! The operator CLI against a real database, master-key rotation, and the search for leaked
//! secrets in every log line (at `trace`) and every row of the database.

use std::process::Stdio;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use credpool_test_support::*;

use crate::BIN;

const OTHER_MASTER_KEY: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

struct Output {
    success: bool,
    stdout: String,
    stderr: String,
}

/// `credpool ARGS` against `database` with `master_key`, feeding `stdin`.
async fn credpool(
    database: &TestDatabase,
    master_key: &str,
    previous: Option<&str>,
    args: &[&str],
    stdin: Option<&str>,
) -> Output {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env("DATABASE_URL", database.url())
        .env("CREDPOOL_MASTER_KEY", master_key)
        .env("CREDPOOL_OPERATOR", "ops-bot")
        .env("RUST_LOG", "warn")
        .env_remove("CREDPOOL_PREVIOUS_MASTER_KEYS")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(previous) = previous {
        command.env("CREDPOOL_PREVIOUS_MASTER_KEYS", previous);
    }
    let mut child = command.spawn().expect("spawn credpool");
    let mut input = child.stdin.take().unwrap();
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .await
        .unwrap();
    drop(input);
    let output = child.wait_with_output().await.unwrap();
    Output {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn entry(key_id: &str, pool: &str, limit: u32) -> String {
    json!({"key_id": key_id, "provider": "openai", "pool": pool, "models": ["gpt-4o"],
           "max_concurrent_uses": limit, "secret": {"api_key": format!("sk-cli-{key_id}")}})
    .to_string()
}

async fn listed(database: &TestDatabase) -> Vec<Value> {
    let out = credpool(
        database,
        MASTER_KEY,
        None,
        &["keys", "list", "--json"],
        None,
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap()
}

#[tokio::test]
async fn the_cli_imports_lists_changes_releases_and_removes_credentials() {
    let database = TestDatabase::create().await;
    let lines = [
        entry("cli-a", "default", 2),
        entry("cli-b", "default", 1),
        entry("cli-c", "vip", 3),
    ]
    .join("\n");
    let out = credpool(
        &database,
        MASTER_KEY,
        None,
        &["keys", "import", "-"],
        Some(&lines),
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    assert!(out.stdout.contains("3 created"), "{}", out.stdout);
    let keys = listed(&database).await;
    assert_eq!(keys.len(), 3);
    assert!(!serde_json::to_string(&keys).unwrap().contains("sk-cli"));

    // the table form names every credential
    let table = credpool(&database, MASTER_KEY, None, &["keys", "list"], None).await;
    assert!(
        ["cli-a", "cli-b", "cli-c"]
            .iter()
            .all(|k| table.stdout.contains(k)),
        "{}",
        table.stdout
    );

    let out = credpool(
        &database,
        MASTER_KEY,
        None,
        &["keys", "disable", "cli-a", "--reason", "audit"],
        None,
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    let out = credpool(
        &database,
        MASTER_KEY,
        None,
        &["keys", "drain", "cli-b"],
        None,
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    let keys = listed(&database).await;
    assert_eq!(keys[0]["status"], "disabled");
    assert_eq!(keys[1]["draining"], true);
    assert!(
        credpool(
            &database,
            MASTER_KEY,
            None,
            &["keys", "enable", "cli-a"],
            None
        )
        .await
        .success
    );
    assert_eq!(listed(&database).await[0]["status"], "available");

    // a lease taken through the service, force-released through the CLI
    let pool = database.pool(2).await;
    let app_pool = credpool::store::connect_lazy(
        database.options.clone(),
        &credpool::store::PoolSettings {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(5),
        },
    );
    let (addr, _stop) = serve(app_pool, &AppOptions::default()).await;
    let lease = post_json(
        &client(),
        &format!("http://{addr}/api/internal/allocate-key"),
        ("x-internal-key", INTERNAL_KEY),
        json!({"provider": "openai", "model": "gpt-4o", "pool": "vip", "lease_seconds": 600}),
    )
    .await;
    let lease = json_body(lease, StatusCode::OK).await;
    assert_eq!(lease["credential"]["api_key"], "sk-cli-cli-c");
    let out = credpool(
        &database,
        MASTER_KEY,
        None,
        &[
            "leases",
            "release-all",
            "cli-c",
            "--reason",
            "rotation",
            "--json",
        ],
        None,
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    assert_eq!(
        serde_json::from_str::<Value>(&out.stdout).unwrap()["released"],
        1
    );
    let actor: String =
        sqlx::query_scalar("SELECT actor FROM lease_events WHERE event = 'force_released'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(actor, "ops-bot");

    let pools = credpool(&database, MASTER_KEY, None, &["pools", "--json"], None).await;
    let pools: Vec<Value> = serde_json::from_str(&pools.stdout).unwrap();
    assert_eq!(pools.len(), 2);
    assert_eq!(pools[0]["total_slots"], 3);

    let out = credpool(&database, MASTER_KEY, None, &["keys", "rm", "cli-b"], None).await;
    assert!(out.success, "{}", out.stderr);
    assert_eq!(listed(&database).await.len(), 2);
    let missing = credpool(&database, MASTER_KEY, None, &["keys", "rm", "cli-b"], None).await;
    assert!(!missing.success);
    assert!(
        missing.stderr.contains("no credential cli-b"),
        "{}",
        missing.stderr
    );
}

/// Imports `entries` through `credpool keys import -`.
async fn import(database: &TestDatabase, entries: &[String]) {
    let out = credpool(
        database,
        MASTER_KEY,
        None,
        &["keys", "import", "-"],
        Some(&entries.join("\n")),
    )
    .await;
    assert!(out.success, "{}", out.stderr);
}

#[tokio::test]
async fn bare_keys_lists_every_credential() {
    // before, `credpool keys` alone printed its help and exited 2
    let database = TestDatabase::create().await;
    import(
        &database,
        &[entry("bare-a", "default", 2), entry("bare-b", "vip", 1)],
    )
    .await;
    let out = credpool(&database, MASTER_KEY, None, &["keys"], None).await;
    assert!(out.success, "{}", out.stderr);
    for said in ["key_id", "bare-a", "bare-b", "0 / 2", "0 / 1"] {
        assert!(
            out.stdout.contains(said),
            "{said:?} missing from {}",
            out.stdout
        );
    }
    let out = credpool(&database, MASTER_KEY, None, &["keys", "--json"], None).await;
    assert!(out.success, "{}", out.stderr);
    let keys: Vec<Value> = serde_json::from_str(&out.stdout).unwrap();
    let ids: Vec<&str> = keys.iter().map(|k| k["key_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["bare-a", "bare-b"]);
}

#[tokio::test]
async fn bare_leases_lists_the_leases_held_now() {
    // before, `credpool leases` alone printed its help and exited 2 (and no command listed leases)
    let database = TestDatabase::create().await;
    import(&database, &[entry("held-a", "default", 2)]).await;
    let app_pool = credpool::store::connect_lazy(
        database.options.clone(),
        &credpool::store::PoolSettings {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(5),
        },
    );
    let (addr, _stop) = serve(app_pool, &AppOptions::default()).await;
    let mut leases = Vec::new();
    for holder in ["worker-1", "worker-2"] {
        let lease = post_json(
            &client(),
            &format!("http://{addr}/api/internal/allocate-key"),
            ("x-internal-key", INTERNAL_KEY),
            json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600,
                   "holder": holder}),
        )
        .await;
        leases.push(json_body(lease, StatusCode::OK).await);
    }
    // a lease released is no longer listed
    let gone = &leases[1];
    let released = post_json(
        &client(),
        &format!("http://{addr}/api/internal/release-key"),
        ("x-internal-key", INTERNAL_KEY),
        json!({"provider": gone["provider"], "pool": gone["pool"], "key_id": gone["key_id"],
               "lease_id": gone["lease_id"], "outcome": "success"}),
    )
    .await;
    assert_eq!(json_body(released, StatusCode::OK).await["released"], true);
    let held = leases[0]["lease_id"].as_str().unwrap().replace('-', "");
    let gone = gone["lease_id"].as_str().unwrap().replace('-', "");

    let out = credpool(&database, MASTER_KEY, None, &["leases"], None).await;
    assert!(out.success, "{}", out.stderr);
    for said in [
        "lease_id",
        held.as_str(),
        "held-a",
        "worker-1",
        "held now: 1",
    ] {
        assert!(
            out.stdout.contains(said),
            "{said:?} missing from {}",
            out.stdout
        );
    }
    assert!(!out.stdout.contains(&gone), "{}", out.stdout);
    assert!(!out.stdout.contains("worker-2"), "{}", out.stdout);
    let out = credpool(&database, MASTER_KEY, None, &["leases", "--json"], None).await;
    assert!(out.success, "{}", out.stderr);
    let listed: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(listed["held"], 1, "{listed}");
    assert_eq!(listed["leases"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["leases"][0]["lease_id"], held.as_str(), "{listed}");
    assert_eq!(listed["leases"][0]["holder"], "worker-1", "{listed}");
    assert!(!out.stdout.contains("sk-cli"), "{}", out.stdout);
}

#[tokio::test]
async fn bare_audit_runs_the_continuous_proof() {
    // before, `credpool audit` alone printed its help and exited 2; now it is `audit verify`
    let database = TestDatabase::create().await;
    import(&database, &[entry("proof-a", "default", 1)]).await;
    let app_pool = credpool::store::connect_lazy(
        database.options.clone(),
        &credpool::store::PoolSettings {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(5),
        },
    );
    let (addr, _stop) = serve(app_pool, &AppOptions::default()).await;
    let lease = post_json(
        &client(),
        &format!("http://{addr}/api/internal/allocate-key"),
        ("x-internal-key", INTERNAL_KEY),
        json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600}),
    )
    .await;
    json_body(lease, StatusCode::OK).await;

    let out = credpool(&database, MASTER_KEY, None, &["audit"], None).await;
    assert!(out.success, "{}", out.stderr);
    for said in [
        "proof-a",
        "no grant ever exceeded a limit",
        "continuous proof: every grant from",
    ] {
        assert!(
            out.stdout.contains(said),
            "{said:?} missing from {}",
            out.stdout
        );
    }
    let out = credpool(&database, MASTER_KEY, None, &["audit", "--json"], None).await;
    assert!(out.success, "{}", out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["run"], "continuous", "{report}");
    assert_eq!(report["grants_over_limit"], 0, "{report}");
    assert_eq!(report["credentials"][0]["key_id"], "proof-a", "{report}");
}

#[tokio::test]
async fn the_maintenance_command_reports_every_step_of_the_pass() {
    // One step with work to do that the report left out before: a request id whose lease ended
    // two hours ago (`request_ids_purged`). The JSON carries every step of
    // credpool_maintenance_step, the text says each; before, 3 of the 8 steps were missing from
    // the JSON and 5 from the text.
    let database = TestDatabase::create().await;
    sqlx::query(
        "INSERT INTO lease_requests (tenant, request_id, request_digest, lease_id, key_id, granted_at)
         VALUES ('default', 'long-gone', 'digest', gen_random_uuid(), 'k', now() - interval '2 hours')",
    )
    .execute(&database.pool(1).await)
    .await
    .unwrap();
    let out = credpool(
        &database,
        MASTER_KEY,
        None,
        &["maintenance", "--json"],
        None,
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    let report: Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let steps: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM generate_series(1, 100) AS i,
                LATERAL credpool_maintenance_step(i, interval '30 days') WHERE name IS NOT NULL
         ORDER BY i",
    )
    .fetch_all(&database.pool(1).await)
    .await
    .unwrap();
    assert_eq!(steps.len(), 11, "{steps:?}");
    let reported: Vec<&String> = report.as_object().unwrap().keys().collect();
    for step in &steps {
        assert!(reported.contains(&step), "{step} missing from {report}");
    }
    assert_eq!(report["request_ids_purged"], 1, "{report}");

    let out = credpool(&database, MASTER_KEY, None, &["maintenance"], None).await;
    assert!(out.success, "{}", out.stderr);
    for said in [
        "reaped 0 expired leases",
        "refitted 0 credentials",
        "recorded 0 ended cooldowns",
        "purged 0 audit rows and 0 request ids",
        "pool version rows",
        "refitted 0 tenants",
        "purged 0 affinity bindings",
        "made 0 trail days ahead",
        "trail rows",
        "dropped 0 trail days",
    ] {
        assert!(
            out.stdout.contains(said),
            "{said:?} missing from {}",
            out.stdout
        );
    }
}

#[tokio::test]
async fn an_import_with_any_bad_entry_writes_nothing() {
    let database = TestDatabase::create().await;
    let mut bad = serde_json::from_str::<Value>(&entry("bad", "default", 1)).unwrap();
    bad["max_concurrent_uses"] = json!(0);
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        serde_json::to_string(&json!([
            serde_json::from_str::<Value>(&entry("good", "default", 1)).unwrap(),
            bad,
        ]))
        .unwrap(),
    )
    .unwrap();
    let out = credpool(
        &database,
        MASTER_KEY,
        None,
        &["keys", "import", file.path().to_str().unwrap()],
        None,
    )
    .await;
    assert!(!out.success);
    assert!(
        out.stderr.contains("nothing imported") && out.stderr.contains("entry 2"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("sk-cli"), "{}", out.stderr);
    assert!(listed(&database).await.is_empty());
}

#[tokio::test]
async fn rotating_the_master_key_reseals_every_secret_and_the_old_key_can_then_go() {
    let database = TestDatabase::create().await;
    let lines = [entry("rot-a", "default", 1), entry("rot-b", "default", 1)].join("\n");
    assert!(
        credpool(
            &database,
            MASTER_KEY,
            None,
            &["keys", "import", "-"],
            Some(&lines)
        )
        .await
        .success
    );

    // the new key alone cannot open what the old one sealed: refuse to start, naming the problem
    let refused = credpool(
        &database,
        OTHER_MASTER_KEY,
        None,
        &["keys", "reencrypt"],
        None,
    )
    .await;
    assert!(!refused.success);
    assert!(
        refused.stderr.contains("not configured"),
        "{}",
        refused.stderr
    );

    let out = credpool(
        &database,
        OTHER_MASTER_KEY,
        Some(MASTER_KEY),
        &["keys", "reencrypt", "--json"],
        None,
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    assert_eq!(
        serde_json::from_str::<Value>(&out.stdout).unwrap()["resealed"],
        2
    );

    // now the new key alone serves them
    let serve = ServeWithKey::start(&database, OTHER_MASTER_KEY).await;
    let lease = post_json(
        &client(),
        &format!("{}/api/internal/allocate-key", serve.base),
        ("x-internal-key", INTERNAL_KEY),
        json!({"provider": "openai", "model": "gpt-4o"}),
    )
    .await;
    let lease = json_body(lease, StatusCode::OK).await;
    assert!(
        lease["credential"]["api_key"]
            .as_str()
            .unwrap()
            .starts_with("sk-cli-rot-")
    );
}

/// `credpool serve` with a master key, on a free port; killed when dropped.
struct ServeWithKey {
    base: String,
    _child: tokio::process::Child,
}

impl ServeWithKey {
    async fn start(database: &TestDatabase, master_key: &str) -> Self {
        use tokio::io::AsyncBufReadExt;
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env("DATABASE_URL", database.url())
            .env("CREDPOOL_MASTER_KEY", master_key)
            .env("CREDPOOL_INTERNAL_KEY", INTERNAL_KEY)
            .env("CREDPOOL_ADMIN_KEY", ADMIN_KEY)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let base = loop {
            let line = lines.next_line().await.unwrap().expect("serve exited");
            if let Some(addr) = line.strip_prefix("credpool listening on ") {
                break addr.to_owned();
            }
        };
        Self {
            base,
            _child: child,
        }
    }
}
