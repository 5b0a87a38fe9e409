//! The operator dashboard: the shell page and its assets, the fragments behind the admin key,
//! what each fragment shows, that no response carries a secret, and an end-to-end run in a real
//! headless chromium (Debian's `chromium` and `chromium-driver`) through WebDriver.

use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use credpool_test_support::*;

/// Every fragment the page polls.
const FRAGMENTS: [&str; 4] = ["pools", "credentials", "leases", "events"];

/// What `put_key` stores as every credential's secret starts with this.
const SECRET_MARK: &str = "sk-test";

/// The dashboard's requests, on the harness's app.
trait DashboardRequests {
    /// `GET path`, with `key` as the admin key if given.
    async fn dashboard_get(&self, path: &str, key: Option<&str>) -> reqwest::Response;
    /// The HTML of fragment `name`, checked for the headers every fragment carries.
    async fn fragment(&self, name: &str) -> String;
    /// The shell, its assets and every fragment, each checked for credential material.
    async fn assert_no_secret_in_any_dashboard_response(&self);
    /// An admin API call that must answer 200; its JSON body.
    async fn admin_json(&self, method: Method, path: &str, body: Option<Value>) -> Value;
}

impl DashboardRequests for TestApp {
    async fn dashboard_get(&self, path: &str, key: Option<&str>) -> reqwest::Response {
        let mut request = self.client.get(self.url(path));
        if let Some(key) = key {
            request = request.header("x-admin-key", key);
        }
        request.send().await.expect("dashboard request")
    }

    async fn fragment(&self, name: &str) -> String {
        let response = self
            .dashboard_get(&format!("/dashboard/fragments/{name}"), Some(ADMIN_KEY))
            .await;
        assert_eq!(response.status(), StatusCode::OK, "fragment {name}");
        assert_eq!(
            response.headers()["content-type"],
            "text/html; charset=utf-8"
        );
        assert_eq!(response.headers()["cache-control"], "no-store");
        response.text().await.unwrap()
    }

    async fn assert_no_secret_in_any_dashboard_response(&self) {
        let mut paths: Vec<String> = [
            "/dashboard",
            "/dashboard/assets/dashboard.js",
            "/dashboard/assets/dashboard.css",
        ]
        .map(String::from)
        .into();
        paths.extend(FRAGMENTS.map(|name| format!("/dashboard/fragments/{name}")));
        for path in paths {
            let response = self.dashboard_get(&path, Some(ADMIN_KEY)).await;
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            let body = response.text().await.unwrap();
            assert!(
                !body.contains(SECRET_MARK),
                "{path} shows a secret:\n{body}"
            );
        }
    }

    async fn admin_json(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let mut request = self
            .client
            .request(method, self.url(path))
            .header("x-admin-key", ADMIN_KEY);
        if let Some(body) = body {
            request = request.json(&body);
        }
        json_body(request.send().await.unwrap(), StatusCode::OK).await
    }
}

fn allocation(pool: &str, holder: &str) -> Value {
    json!({"provider": "openai", "pool": pool, "model": "gpt-4o", "lease_seconds": 600, "holder": holder})
}

#[tokio::test]
async fn shell_and_assets_need_no_key_and_hold_no_data() {
    let app = TestApp::with_credential("key-a", 2).await;

    let shell = app.dashboard_get("/dashboard", None).await;
    assert_eq!(shell.status(), StatusCode::OK);
    assert_eq!(shell.headers()["content-type"], "text/html; charset=utf-8");
    let csp = shell.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    let html = shell.text().await.unwrap();
    assert!(html.contains("id=\"key-input\""), "{html}");
    assert!(!html.contains("key-a"), "the shell holds no data: {html}");
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "no CDN: {html}"
    );

    for (path, content_type) in [
        (
            "/dashboard/assets/dashboard.js",
            "text/javascript; charset=utf-8",
        ),
        ("/dashboard/assets/dashboard.css", "text/css; charset=utf-8"),
    ] {
        let response = app.dashboard_get(path, None).await;
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        assert_eq!(response.headers()["content-type"], content_type);
        let body = response.text().await.unwrap();
        assert!(
            !body.contains("https://"),
            "{path} references nothing outside credpool"
        );
    }
}

#[tokio::test]
async fn fragments_refuse_a_missing_wrong_or_executor_key_like_the_operator_api() {
    let app = TestApp::spawn().await;
    for name in FRAGMENTS {
        let path = format!("/dashboard/fragments/{name}");
        app.dashboard_get(&path, None)
            .refused(StatusCode::UNAUTHORIZED, "unauthorized")
            .await;
        app.dashboard_get(&path, Some("wrong-key"))
            .refused(StatusCode::UNAUTHORIZED, "unauthorized")
            .await;
        app.dashboard_get(&path, Some(INTERNAL_KEY))
            .refused(StatusCode::FORBIDDEN, "forbidden")
            .await;
    }
    app.dashboard_get("/dashboard/fragments/secrets", Some(ADMIN_KEY))
        .refused(StatusCode::NOT_FOUND, "route_not_found")
        .await;
}

#[tokio::test]
async fn fragments_show_pools_credentials_leases_and_events_but_never_a_secret() {
    let app = TestApp::with_credential("key-a", 2).await;
    app.put_gpt4o_key("key-b", "batch", 1).await;
    let pools = app.fragment("pools").await;
    assert!(pools.contains("openai / default"), "{pools}");
    assert!(pools.contains("<polyline points=\"0.0,23.0 "), "{pools}");

    let first = app.lease(allocation("default", "worker-1")).await;
    let second = app.lease(allocation("default", "worker-2")).await;
    let crashed = app.lease(allocation("batch", "worker-9")).await;
    // worker-9 crashed: its lease ran out without a release
    expire(&app, crashed["lease_id"].as_str().unwrap()).await;
    app.admin_json(
        Method::PATCH,
        "/api/admin/keys/key-b",
        Some(json!({"state": "drain", "reason": "rotating"})),
    )
    .await;
    app.force_release(second["lease_id"].as_str().unwrap(), "stuck worker")
        .ok_json()
        .await;

    // a lease held for the whole minute that began 10 minutes ago: half of the pool's 2 slots
    app.run_sql("WITH minute AS (SELECT date_trunc('minute', now()) - interval '10 minutes' AS at)
         INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
         SELECT event, '00000000-0000-0000-0000-0000000000aa', 'key-a', 'openai', 'default', 1,
                'worker-0', minute.at + interval '1 minute', minute.at + offset_by
         FROM minute, (VALUES ('granted', interval '0'), ('released', interval '1 minute'))
             AS e (event, offset_by)").await;

    let pools = app.fragment("pools").await;
    let default = pools
        .split("data-pool=\"openai/default\"")
        .nth(1)
        .expect("the default pool's card");
    assert!(
        default.contains("<dd class=\"in-flight\">1</dd>")
            && default.contains("<dd class=\"free\">1</dd>"),
        "{pools}"
    );
    assert!(pools.contains("draining: 1"), "{pools}");
    assert!(
        default.contains(",12.0 "),
        "the sparkline shows the minute at 50 %: {pools}"
    );

    let credentials = app.fragment("credentials").await;
    assert!(
        credentials.contains("data-key-id=\"key-a\""),
        "{credentials}"
    );
    assert!(credentials.contains("1 / 2"), "{credentials}");
    assert!(
        credentials.contains("<span class=\"badge draining\">draining</span>"),
        "{credentials}"
    );
    assert!(
        credentials.contains("data-action=\"disable\" data-key-id=\"key-a\""),
        "{credentials}"
    );

    let leases = app.fragment("leases").await;
    let held = first["lease_id"].as_str().unwrap();
    assert!(
        leases.contains(&format!("data-lease-id=\"{held}\">")),
        "{leases}"
    );
    assert!(leases.contains("worker-1"), "{leases}");
    assert!(
        !leases.contains("worker-2"),
        "force-released leases are gone: {leases}"
    );
    let expired = crashed["lease_id"].as_str().unwrap();
    assert!(
        leases.contains(&format!("data-lease-id=\"{expired}\" class=\"expired\"")),
        "the crashed executor's lease is highlighted: {leases}"
    );
    assert!(leases.contains("expired 1"), "{leases}");

    let events = app.fragment("events").await;
    assert!(events.contains("force released"), "{events}");
    assert!(events.contains("stuck worker"), "{events}");
    assert!(events.contains("rotating"), "{events}");

    app.assert_no_secret_in_any_dashboard_response().await;
}

/// Ends a lease as a crashed executor would: granted 70 s ago, run out 10 s ago, never released.
async fn expire(app: &TestApp, lease_id: &str) {
    app.run_sql_with(
        "UPDATE lease_slots SET granted_at = now() - interval '70 seconds',
             lease_until = now() - interval '10 seconds'
         WHERE lease_id = $1::text::uuid",
        lease_id,
    )
    .await;
}

/// Writes an hour of finished leases on `key_id` to the trail: each minute 2 to 58 minutes ago,
/// 1 to 5 leases (a sawtooth with a 15-minute period) held for 50 s.
async fn seed_history(app: &TestApp, key_id: &str, pool: &str) {
    sqlx::query(
        "INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
         SELECT e.event, md5(m::text || '/' || n::text)::uuid, $1, 'openai', $2, n, 'worker-' || n,
                date_trunc('minute', now()) - make_interval(mins => m) + interval '50 seconds',
                date_trunc('minute', now()) - make_interval(mins => m) + e.offset_by
         FROM generate_series(2, 58) AS m, generate_series(0, 4) AS n,
              (VALUES ('granted', interval '0'), ('released', interval '50 seconds')) AS e (event, offset_by)
         WHERE n <= (m % 15) / 3",
    )
    .bind(key_id)
    .bind(pool)
    .execute(&app.db)
    .await
    .unwrap();
}

/// `chromium` and `chromedriver` from Debian's packages, or a panic that names them.
fn browser_binaries() -> (&'static str, &'static str) {
    let chromium = "/usr/bin/chromium";
    let chromedriver = "/usr/bin/chromedriver";
    assert!(
        std::path::Path::new(chromium).exists() && std::path::Path::new(chromedriver).exists(),
        "the dashboard's browser test needs {chromium} and {chromedriver}: \
         apt-get install -y chromium chromium-driver"
    );
    (chromium, chromedriver)
}

/// chromedriver on a free port, ended when dropped, with chromium's profile and every temporary
/// file of both in a directory of their own that goes with it: left to themselves they leave
/// `org.chromium.Chromium.*` directories in /tmp after every run.
struct ChromeDriver {
    // declared first, so dropped first: chromedriver ends before its directory is removed
    _child: tokio::process::Child,
    url: String,
    dir: tempfile::TempDir,
}

impl ChromeDriver {
    async fn start(binary: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::Builder::new()
            .prefix("credpool-chromium-")
            .tempdir()
            .unwrap();
        let child = tokio::process::Command::new(binary)
            .arg(format!("--port={port}"))
            // chromium inherits it and keeps its temporary files there
            .env("TMPDIR", dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("starting chromedriver");
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while client().get(format!("{url}/status")).send().await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "chromedriver did not answer on {url}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self {
            _child: child,
            url,
            dir,
        }
    }

    async fn browser(&self, chromium: &str) -> Client {
        let mut capabilities = fantoccini::wd::Capabilities::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1440,1200",
                         format!("--user-data-dir={}", self.dir.path().join("profile").display())],
            }),
        );
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&self.url)
            .await
            .expect("a chromium session through chromedriver")
    }
}

/// Waits (up to 15 s, the page polls every 3 s) until the text of the element at `css` is
/// `expected`.
async fn wait_for_text(browser: &Client, css: &str, expected: &str) {
    let started = Instant::now();
    loop {
        let text = match browser.find(Locator::Css(css)).await {
            Ok(element) => element.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if text == expected {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{css} shows {text:?}, not {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Clicks the element at `css`, again if a refresh replaced it between finding and clicking.
async fn click(browser: &Client, css: &str) {
    let started = Instant::now();
    loop {
        let clicked = match browser.find(Locator::Css(css)).await {
            Ok(element) => element.click().await.is_ok(),
            Err(_) => false,
        };
        if clicked {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "cannot click {css}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Accepts the page's `confirm()` once it is up.
async fn accept_confirm(browser: &Client) -> String {
    let started = Instant::now();
    loop {
        if let Ok(text) = browser.get_alert_text().await {
            browser
                .accept_alert()
                .await
                .expect("accepting the confirm()");
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no confirm() came up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the operator API until `check` holds for the credential (up to 10 s).
async fn wait_for_credential(app: &TestApp, key_id: &str, check: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let detail = app
            .admin_json(Method::GET, &format!("/api/admin/keys/{key_id}"), None)
            .await;
        if check(&detail) {
            return detail;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{detail}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn screenshot_path() -> std::path::PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("dashboard-screenshot.png")
}

#[tokio::test]
async fn browser_shows_live_pools_drains_from_the_page_and_never_shows_a_secret() {
    let (chromium, chromedriver) = browser_binaries();
    let app = TestApp::with_credential("key-a", 3).await;
    app.put_gpt4o_key("key-b", "default", 2).await;
    app.put_gpt4o_key("solo", "solo", 2).await;
    app.put_gpt4o_key("key-c", "batch", 4).await;
    let driver = ChromeDriver::start(chromedriver).await;
    let browser = driver.browser(chromium).await;

    browser.goto(&app.url("/dashboard")).await.unwrap();
    browser
        .wait()
        .for_element(Locator::Css("#key-input"))
        .await
        .unwrap()
        .send_keys(ADMIN_KEY)
        .await
        .unwrap();
    click(&browser, "#login button[type=submit]").await;
    let default_in_flight = "[data-pool=\"openai/default\"] .in-flight";
    wait_for_text(&browser, default_in_flight, "0").await;

    // leases taken over the API show up without a reload
    for holder in ["worker-1", "worker-2", "worker-3", "worker-4"] {
        app.lease(allocation("default", holder)).await;
    }
    app.lease(allocation("solo", "worker-5")).await;
    wait_for_text(&browser, default_in_flight, "4").await;
    wait_for_text(&browser, "[data-pool=\"openai/default\"] .free", "1").await;
    wait_for_text(&browser, "tr[data-key-id=\"solo\"] .in-flight", "1 / 2").await;

    // the rest of a busy hour: history in the trail, a crashed executor, a forced release, a
    // credential cooling down
    seed_history(&app, "key-a", "default").await;
    let crashed = app.lease(allocation("solo", "worker-6")).await;
    expire(&app, crashed["lease_id"].as_str().unwrap()).await;
    let stuck = app.lease(allocation("batch", "worker-7")).await;
    app.force_release(stuck["lease_id"].as_str().unwrap(), "worker-7 hung")
        .ok_json()
        .await;
    app.set_status("key-c", "rate_limited", Some(90.0)).await;
    wait_for_text(&browser, "tr[data-key-id=\"key-c\"] .badge", "rate_limited").await;
    browser
        .wait()
        .at_most(Duration::from_secs(15))
        .for_element(Locator::Css(&format!(
            "tr.expired[data-lease-id=\"{}\"]",
            crashed["lease_id"].as_str().unwrap()
        )))
        .await
        .expect("the crashed executor's lease, highlighted");
    let spark = browser
        .find(Locator::Css("[data-pool=\"openai/default\"] polyline"))
        .await
        .unwrap()
        .attr("points")
        .await
        .unwrap()
        .unwrap_or_default();
    assert!(
        spark.split(' ').any(|point| !point.ends_with(",23.0")),
        "the sparkline shows the hour's leases: {spark}"
    );

    let path = screenshot_path();
    let png = browser.screenshot().await.expect("a screenshot");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, png).unwrap();
    println!("dashboard screenshot under load: {}", path.display());

    // drain from the page: the API refuses new leases on the credential
    click(
        &browser,
        "tr[data-key-id=\"solo\"] button[data-action=\"drain\"]",
    )
    .await;
    wait_for_credential(&app, "solo", |c| c["draining"] == true).await;
    let refused = app.allocate(allocation("solo", "worker-6")).await;
    assert_ne!(
        refused.status(),
        StatusCode::OK,
        "a drained credential got a lease"
    );
    assert_eq!(
        app.in_flight("solo").await,
        1,
        "the drained credential kept its lease"
    );
    wait_for_text(
        &browser,
        "tr[data-key-id=\"solo\"] .badge.draining",
        "draining",
    )
    .await;

    // a destructive action asks first
    click(
        &browser,
        "tr[data-key-id=\"key-b\"] button[data-action=\"disable\"]",
    )
    .await;
    let question = accept_confirm(&browser).await;
    assert!(question.contains("Disable key-b"), "{question}");
    wait_for_credential(&app, "key-b", |c| c["status"] == "disabled").await;

    // force-release one lease from the page: its holder loses it
    let solo_lease = wait_for_credential(&app, "solo", |c| c["in_flight"] == 1).await["leases"][0]
        ["lease_id"]
        .as_str()
        .unwrap()
        .to_owned();
    click(
        &browser,
        &format!("tr[data-lease-id=\"{solo_lease}\"] button[data-action=\"release\"]"),
    )
    .await;
    let question = accept_confirm(&browser).await;
    assert!(question.contains(&solo_lease), "{question}");
    wait_for_credential(&app, "solo", |c| c["in_flight"] == 0).await;
    wait_for_text(&browser, "tr[data-key-id=\"solo\"] .in-flight", "0 / 2").await;

    // the table filters on the client
    browser
        .find(Locator::Css("#filter"))
        .await
        .unwrap()
        .send_keys("key-")
        .await
        .unwrap();
    let solo_row = browser
        .find(Locator::Css("tr[data-key-id=\"solo\"]"))
        .await
        .unwrap();
    assert!(
        !solo_row.is_displayed().await.unwrap(),
        "the filter hides solo"
    );

    // the page's HTML after its fragments loaded, and every response it uses
    let source = browser.source().await.unwrap();
    assert!(
        source.contains("worker-1"),
        "the page shows the leases: {source}"
    );
    assert!(
        !source.contains(SECRET_MARK),
        "the page shows a secret:\n{source}"
    );
    app.assert_no_secret_in_any_dashboard_response().await;
    browser.close().await.unwrap();
}

/// Holders, reasons and names come from executors and operators: the fragments escape them, so a
/// holder cannot run script in an operator's browser (where the admin key lives).
#[tokio::test]
async fn fragments_escape_what_executors_and_operators_wrote() {
    let app = TestApp::with_credential("k1", 2).await;
    let hostile = "<img src=x onerror=alert(1)>";
    app.lease(allocation("default", hostile)).await;
    app.admin_json(
        Method::PATCH,
        "/api/admin/keys/k1",
        Some(json!({"state": "disable", "reason": hostile})),
    )
    .await;
    for name in FRAGMENTS {
        let html = app.fragment(name).await;
        assert!(!html.contains(hostile), "{name} shows raw markup:\n{html}");
    }
    assert!(
        app.fragment("leases")
            .await
            .contains("&lt;img src=x onerror=alert(1)&gt;")
    );
}
