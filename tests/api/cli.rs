//! The operator CLI against a real database, master-key rotation, and the search for leaked
//! secrets in every log line (at `trace`) and every row of the database.

use std::process::Stdio;

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

impl Output {
    /// Its `--json` report (stdout).
    fn report<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("{e}: {}{}", self.stdout, self.stderr))
    }

    /// Panics unless the command failed and said `why` on stderr.
    fn failed_saying(&self, why: &str) {
        assert!(!self.success, "succeeded: {}", self.stdout);
        assert!(
            self.stderr.contains(why),
            "{why:?} missing from {}",
            self.stderr
        );
    }

    /// Panics unless stdout says each of `phrases`.
    fn says(&self, phrases: &[&str]) {
        for said in phrases {
            assert!(
                self.stdout.contains(said),
                "{said:?} missing from {}",
                self.stdout
            );
        }
    }
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

/// `credpool ARGS` against `database` with the tests' master key alone and nothing on stdin, as
/// an operator runs it; panics unless it succeeds.
async fn operator(database: &TestDatabase, args: &[&str]) -> Output {
    let out = credpool(database, MASTER_KEY, None, args, None).await;
    assert!(out.success, "credpool {args:?}: {}", out.stderr);
    out
}

fn entry(key_id: &str, pool: &str, limit: u32) -> String {
    json!({"key_id": key_id, "provider": "openai", "pool": pool, "models": ["gpt-4o"],
           "max_concurrent_uses": limit, "secret": {"api_key": format!("sk-cli-{key_id}")}})
    .to_string()
}

async fn listed(database: &TestDatabase) -> Vec<Value> {
    operator(database, &["keys", "list", "--json"])
        .await
        .report()
}

/// Imports `entries` through `credpool keys import -`: what it printed.
async fn import(database: &TestDatabase, entries: &[String]) -> Output {
    let out = credpool(
        database,
        MASTER_KEY,
        None,
        &["keys", "import", "-"],
        Some(&entries.join("\n")),
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    out
}

/// A fresh database with `entries` imported through the CLI.
async fn imported(entries: &[String]) -> TestDatabase {
    let database = TestDatabase::create().await;
    import(&database, entries).await;
    database
}

/// The app served in-process over `database` once the CLI has filled it.
async fn serve_over(database: TestDatabase) -> TestApp {
    TestApp::spawn_on(database, AppOptions::default()).await
}

#[tokio::test]
async fn the_cli_imports_lists_changes_releases_and_removes_credentials() {
    let database = TestDatabase::create().await;
    let entries = [
        entry("cli-a", "default", 2),
        entry("cli-b", "default", 1),
        entry("cli-c", "vip", 3),
    ];
    let out = import(&database, &entries).await;
    assert!(out.stdout.contains("3 created"), "{}", out.stdout);
    let keys = listed(&database).await;
    assert_eq!(keys.len(), 3);
    assert!(!serde_json::to_string(&keys).unwrap().contains("sk-cli"));

    // the table form names every credential
    operator(&database, &["keys", "list"])
        .await
        .says(&["cli-a", "cli-b", "cli-c"]);

    operator(
        &database,
        &["keys", "disable", "cli-a", "--reason", "audit"],
    )
    .await;
    operator(&database, &["keys", "drain", "cli-b"]).await;
    let keys = listed(&database).await;
    assert_eq!(keys[0]["status"], "disabled");
    assert_eq!(keys[1]["draining"], true);
    operator(&database, &["keys", "enable", "cli-a"]).await;
    assert_eq!(listed(&database).await[0]["status"], "available");

    // a lease taken through the service, force-released through the CLI
    let app = serve_over(database).await;
    let database = &app.database;
    let lease = app.lease(gpt4o_in_for("vip", 600)).await;
    assert_eq!(lease["credential"]["api_key"], "sk-cli-cli-c");
    let released: Value = operator(
        database,
        &[
            "leases",
            "release-all",
            "cli-c",
            "--reason",
            "rotation",
            "--json",
        ],
    )
    .await
    .report();
    assert_eq!(released["released"], 1);
    let actor: String = app
        .scalar("SELECT actor FROM lease_events WHERE event = 'force_released'")
        .await;
    assert_eq!(actor, "ops-bot");

    let pools: Vec<Value> = operator(database, &["pools", "--json"]).await.report();
    assert_eq!(pools.len(), 2);
    assert_eq!(pools[0]["total_slots"], 3);

    operator(database, &["keys", "rm", "cli-b"]).await;
    assert_eq!(listed(database).await.len(), 2);
    credpool(database, MASTER_KEY, None, &["keys", "rm", "cli-b"], None)
        .await
        .failed_saying("no credential cli-b");
}

#[tokio::test]
async fn bare_keys_lists_every_credential() {
    // before, `credpool keys` alone printed its help and exited 2
    let database = imported(&[entry("bare-a", "default", 2), entry("bare-b", "vip", 1)]).await;
    operator(&database, &["keys"])
        .await
        .says(&["key_id", "bare-a", "bare-b", "0 / 2", "0 / 1"]);
    let keys: Vec<Value> = operator(&database, &["keys", "--json"]).await.report();
    let ids: Vec<&str> = keys.iter().map(|k| k["key_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["bare-a", "bare-b"]);
}

#[tokio::test]
async fn bare_leases_lists_the_leases_held_now() {
    // before, `credpool leases` alone printed its help and exited 2 (and no command listed leases)
    let database = imported(&[entry("held-a", "default", 2)]).await;
    let app = serve_over(database).await;
    let mut leases = Vec::new();
    for holder in ["worker-1", "worker-2"] {
        let body = json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": 600,
                          "holder": holder});
        leases.push(app.lease(body).await);
    }
    // a lease released is no longer listed
    let gone = &leases[1];
    app.release_ok(gone, "success").await;
    let held = leases[0]["lease_id"].as_str().unwrap().replace('-', "");
    let gone = gone["lease_id"].as_str().unwrap().replace('-', "");

    let out = operator(&app.database, &["leases"]).await;
    out.says(&[
        "lease_id",
        held.as_str(),
        "held-a",
        "worker-1",
        "held now: 1",
    ]);
    assert!(!out.stdout.contains(&gone), "{}", out.stdout);
    assert!(!out.stdout.contains("worker-2"), "{}", out.stdout);
    let out = operator(&app.database, &["leases", "--json"]).await;
    let listed: Value = out.report();
    assert_eq!(listed["held"], 1, "{listed}");
    assert_eq!(listed["leases"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["leases"][0]["lease_id"], held.as_str(), "{listed}");
    assert_eq!(listed["leases"][0]["holder"], "worker-1", "{listed}");
    assert!(!out.stdout.contains("sk-cli"), "{}", out.stdout);
}

#[tokio::test]
async fn bare_audit_runs_the_continuous_proof() {
    // before, `credpool audit` alone printed its help and exited 2; now it is `audit verify`
    let database = imported(&[entry("proof-a", "default", 1)]).await;
    let app = serve_over(database).await;
    app.lease(gpt4o_for(600)).await;

    operator(&app.database, &["audit"]).await.says(&[
        "proof-a",
        "no grant ever exceeded a limit",
        "continuous proof: every grant from",
    ]);
    let report: Value = operator(&app.database, &["audit", "--json"]).await.report();
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
    let db = database.pool(1).await;
    db.run_sql(
        "INSERT INTO lease_requests
             (tenant, request_id, request_digest, lease_id, key_id, granted_at, provider)
         VALUES ('default', 'long-gone', 'digest', gen_random_uuid(), 'k', now() - interval '2 hours',
                 'openai')",
    )
    .await;
    let report: Value = operator(&database, &["maintenance", "--json"])
        .await
        .report();
    let steps: Vec<String> = db
        .scalars(
            "SELECT name FROM generate_series(1, 100) AS i,
                LATERAL credpool_maintenance_step(i, interval '30 days') WHERE name IS NOT NULL
         ORDER BY i",
        )
        .await;
    assert_eq!(steps.len(), 11, "{steps:?}");
    let reported: Vec<&String> = report.as_object().unwrap().keys().collect();
    for step in &steps {
        assert!(reported.contains(&step), "{step} missing from {report}");
    }
    assert_eq!(report["request_ids_purged"], 1, "{report}");

    operator(&database, &["maintenance"]).await.says(&[
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
    ]);
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
    out.failed_saying("nothing imported");
    out.failed_saying("entry 2");
    assert!(!out.stderr.contains("sk-cli"), "{}", out.stderr);
    assert!(listed(&database).await.is_empty());
}

#[tokio::test]
async fn rotating_the_master_key_reseals_every_secret_and_the_old_key_can_then_go() {
    let database = imported(&[entry("rot-a", "default", 1), entry("rot-b", "default", 1)]).await;

    // the new key alone cannot open what the old one sealed: refuse to start, naming the problem
    credpool(
        &database,
        OTHER_MASTER_KEY,
        None,
        &["keys", "reencrypt"],
        None,
    )
    .await
    .failed_saying("not configured");

    let out = credpool(
        &database,
        OTHER_MASTER_KEY,
        Some(MASTER_KEY),
        &["keys", "reencrypt", "--json"],
        None,
    )
    .await;
    assert!(out.success, "{}", out.stderr);
    assert_eq!(out.report::<Value>()["resealed"], 2);

    // now the new key alone serves them
    let mut env = keyed_env(&database);
    env.retain(|(name, _)| *name != "CREDPOOL_MASTER_KEY");
    env.push(("CREDPOOL_MASTER_KEY", OTHER_MASTER_KEY.to_owned()));
    let serve = ServeProcess::start(BIN, &env, &[]).await;
    let lease = serve.lease(gpt4o()).await;
    assert!(
        lease["credential"]["api_key"]
            .as_str()
            .unwrap()
            .starts_with("sk-cli-rot-")
    );
}

#[tokio::test]
async fn citus_distribute_refuses_a_database_without_citus_and_changes_nothing() {
    let database = TestDatabase::create().await;
    let db = database.pool(1).await;
    credpool(&database, MASTER_KEY, None, &["citus", "distribute"], None)
        .await
        .failed_saying("this database has no Citus extension");
    // the keys are as plain PostgreSQL has them, and no setting was left behind
    let key: String = db
        .scalar(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint
             WHERE conname = 'credentials_pkey'",
        )
        .await;
    assert_eq!(key, "PRIMARY KEY (key_id)");
    let settings: i64 = db
        .scalar(
            "SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase
             WHERE d.datname = current_database()",
        )
        .await;
    assert_eq!(settings, 0);
}
