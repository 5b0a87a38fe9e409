//! `credpool bench --relay`: what the relay (`/relay/{provider}/{pool}/...`) adds to a call. A
//! mock upstream runs in this process on 127.0.0.1 (a minimal OpenAI-compatible
//! `POST /v1/chat/completions` that answers a fixed JSON body with `usage`, after `--hold-ms`);
//! the run sets it as the bench provider's upstream and the executors make the same call, with
//! the same HTTP client and loop, first to the mock directly (`direct`), then through the relay
//! (`relay`: a lease allocated, the call forwarded with the credential, the answer passed back
//! and the lease released with its usage). The report gives each mode's calls/s, latency and CPU
//! per call, and the relay's over the direct call's.
//!
//! The mock speaks just enough HTTP/1.1 for reqwest and the relay's client (keep-alive,
//! `Content-Length` bodies) on tokio alone: it costs both modes the same, and the command's
//! crate has no HTTP server of its own to build it with.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use reqwest::StatusCode;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use credpool::domain::ProviderName;
use credpool::domain::relay::{ApiStyle, UpstreamInput};
use credpool::store::Db;
use credpool::store::credentials::Actor;
use credpool::store::relay as upstreams;

use super::{
    Allocator, BenchArgs, Claimed, MODEL, Mode, ModeReport, PROVIDER, Percentiles, Plan, cpu,
    run_mode,
};

/// The mock's answer to a chat completion: OpenAI's shape, with the `usage` the relay reads
/// (10 tokens, which the relay's release reports).
const ANSWER: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}"#;
/// The mock's answer to a call without a bench credential (`Authorization: Bearer sk-bench-*`):
/// the relay forwarded the caller's key, or none.
const REFUSED: &str = r#"{"error":{"message":"no bench credential","type":"invalid_request_error","code":"invalid_api_key"}}"#;
/// The mock's answer to anything but `POST /v1/chat/completions`.
const NOT_FOUND: &str =
    r#"{"error":{"message":"unknown route","type":"invalid_request_error","code":"unknown_url"}}"#;
/// The longest request head the mock reads, in bytes.
const MAX_HEAD_BYTES: usize = 64 << 10;

/// The mock upstream, serving until dropped.
pub(super) struct MockUpstream {
    address: SocketAddr,
    /// The accept loop; its connections are tasks of a `JoinSet` it owns, so aborting it ends
    /// them too.
    accepting: tokio::task::JoinHandle<()>,
}

impl MockUpstream {
    /// Serves on a free port of 127.0.0.1, answering each call after `delay`.
    pub(super) async fn start(delay: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let accepting = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        connections.spawn(serve(stream, delay));
                    }
                    Err(error) => {
                        tracing::warn!(error = %error, "the mock upstream could not accept");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(Self { address, accepting })
    }

    /// `http://127.0.0.1:<port>`.
    pub(super) fn base_url(&self) -> String {
        format!("http://{}", self.address)
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// What the mock reads from one request.
struct MockRequest {
    /// `POST /v1/chat/completions`.
    completion: bool,
    /// `Authorization: Bearer sk-bench-...` (a bench credential's key).
    credential: bool,
    /// `Connection: close`.
    close: bool,
}

/// One connection's requests, answered in turn until the client closes it.
async fn serve(mut stream: TcpStream, delay: Duration) {
    let mut buffer = Vec::with_capacity(4096);
    loop {
        let request = match read_request(&mut stream, &mut buffer).await {
            Ok(Some(request)) => request,
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(error = %error, "the mock upstream could not read a request");
                return;
            }
        };
        let (status, body) = match (request.completion, request.credential) {
            (false, _) => ("404 Not Found", NOT_FOUND),
            (true, false) => ("401 Unauthorized", REFUSED),
            (true, true) => ("200 OK", ANSWER),
        };
        // a zero delay does not sleep: tokio would round it up to a millisecond
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let answer = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(answer.as_bytes()).await.is_err() || request.close {
            return;
        }
    }
}

/// The next request on the connection (its body read and discarded), `None` when the client
/// closed it. Bodies come with `Content-Length` (reqwest and the relay send no others).
async fn read_request(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
) -> std::io::Result<Option<MockRequest>> {
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if buffer.len() > MAX_HEAD_BYTES {
            return Err(invalid("request head too long"));
        }
        if stream.read_buf(buffer).await? == 0 {
            return Ok(None);
        }
    };
    let head = std::str::from_utf8(&buffer[..head_end]).map_err(|_| invalid("head not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let completion = lines
        .next()
        .is_some_and(|line| line.starts_with("POST /v1/chat/completions "));
    let (mut length, mut credential, mut close) = (0, false, false);
    for (name, value) in lines.filter_map(|line| line.split_once(':')) {
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            length = value.parse().map_err(|_| invalid("bad content-length"))?;
        } else if name.eq_ignore_ascii_case("authorization") {
            credential = value.starts_with("Bearer sk-bench-");
        } else if name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(invalid("chunked request bodies are not supported"));
        }
    }
    while buffer.len() < head_end + length {
        if stream.read_buf(buffer).await? == 0 {
            return Ok(None);
        }
    }
    buffer.drain(..head_end + length);
    Ok(Some(MockRequest {
        completion,
        credential,
        close,
    }))
}

/// One executor's calls: a chat completion POSTed to `url` with `authorization`, answered 200
/// and read whole, or a failure. A call is the cycle: there is nothing to release.
pub(super) struct CallAllocator<'a> {
    client: &'a reqwest::Client,
    url: &'a str,
    authorization: &'a str,
    body: &'a str,
}

impl<'a> CallAllocator<'a> {
    pub(super) fn new(
        client: &'a reqwest::Client,
        url: &'a str,
        authorization: &'a str,
        body: &'a str,
    ) -> Self {
        Self {
            client,
            url,
            authorization,
            body,
        }
    }
}

impl Allocator for CallAllocator<'_> {
    async fn allocate(&mut self, _plan: &Plan) -> Claimed {
        let sent = self
            .client
            .post(self.url)
            .header(reqwest::header::AUTHORIZATION, self.authorization)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(self.body.to_owned())
            .send()
            .await;
        match sent {
            Ok(response) if response.status() == StatusCode::OK => match response.bytes().await {
                Ok(_) => Claimed::Leased,
                Err(error) => {
                    tracing::debug!(error = %error, "a bench call's answer broke off");
                    Claimed::Failed
                }
            },
            Ok(response) => {
                tracing::debug!(status = %response.status(), "a bench call was refused");
                Claimed::Failed
            }
            Err(error) => {
                tracing::debug!(error = %error, "a bench call failed");
                Claimed::Failed
            }
        }
    }

    async fn release(&mut self, _plan: &Plan) -> bool {
        true
    }
}

/// The chat completion every executor sends: the bench model, which every serving credential
/// serves (the relay reads `model` to allocate).
fn call_body() -> String {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
        .to_string()
}

/// Runs the mock upstream, sets it as the bench provider's relay upstream (no wait for a free
/// credential: a call that would wait is refused and counted as an error, since the run
/// measures overhead, not contention), and measures `direct` then `relay`. The provider's
/// upstream is put back as it was afterwards (removed, if it had none), whatever happened.
/// `base`: the service's base URL; `executor_key`: what the relay calls present as their API key.
pub(super) async fn measure(
    args: &BenchArgs,
    db: &Db,
    plan: &std::sync::Arc<Plan>,
    base: &str,
    executor_key: &str,
) -> anyhow::Result<Vec<ModeReport>> {
    let mock = MockUpstream::start(Duration::from_millis(args.hold_ms))
        .await
        .context("starting the mock upstream")?;
    let provider = ProviderName::parse(PROVIDER).map_err(anyhow::Error::msg)?;
    let actor = Actor::parse("bench").map_err(anyhow::Error::msg)?;
    let upstream = UpstreamInput {
        base_url: mock.base_url(),
        api: ApiStyle::OpenAi,
        credential_header: None,
        wait_ms: Some(0),
        affinity_header: None,
        timeout_seconds: Some(30),
    }
    .check(provider.clone())
    .map_err(anyhow::Error::msg)?;
    let before = upstreams::get(db, &provider).await?;
    upstreams::put(db, &upstream, &actor).await?;
    let body = call_body();
    let measured = async {
        let direct = Mode::Call {
            client: super::http_client(args)?,
            url: format!("{}/v1/chat/completions", mock.base_url()),
            authorization: "Bearer sk-bench-0".to_owned(),
            body: body.clone(),
            name: "direct",
        };
        let (direct, _) = run_mode(args, plan, direct).await?;
        let relay = Mode::Call {
            client: super::http_client(args)?,
            url: format!(
                "{base}/relay/{PROVIDER}/{}/v1/chat/completions",
                plan.pool.as_str()
            ),
            authorization: format!("Bearer {executor_key}"),
            body,
            name: "relay",
        };
        let (relay, _) = run_mode(args, plan, relay).await?;
        anyhow::Ok(vec![direct, relay])
    }
    .await;
    let restored = match before {
        Some(before) => upstreams::put(db, &before, &actor).await.map(|_| ()),
        None => upstreams::remove(db, &provider, &actor).await.map(|_| ()),
    };
    let reports = measured?;
    restored.context("putting the bench provider's relay upstream back")?;
    Ok(reports)
}

/// How one mode's calls fared.
#[derive(Debug, Clone, serde::Serialize)]
struct CallReport {
    /// `direct` or `relay`.
    mode: &'static str,
    /// Completed calls per second.
    calls_per_second: f64,
    /// Call latency, milliseconds: from sending the request to the answer's last byte.
    call_ms: Percentiles,
    /// Calls that failed (any status but 200, a transport error, an answer cut short).
    errors: u64,
    /// CPU per completed call in the measured window, per process group (Linux): everything
    /// each group did meanwhile, other users' work on the server included.
    cpu: Option<cpu::CpuPerCycle>,
}

impl CallReport {
    fn of(report: &ModeReport) -> Self {
        Self {
            mode: report.mode,
            calls_per_second: report.cycles_per_second,
            call_ms: report.allocate_ms,
            errors: report.errors,
            cpu: report.cpu,
        }
    }
}

/// The relay against the direct call, in the same run.
#[derive(Debug, Clone, serde::Serialize)]
struct Overhead {
    /// `direct`.
    baseline: &'static str,
    /// The relay's calls/s over the direct calls'.
    calls: f64,
    /// The relay's call p50 over the direct call's.
    latency_p50: f64,
    /// The relay's call p99 over the direct call's.
    latency_p99: f64,
    /// What the relay adds to a call at p50, milliseconds.
    added_ms_p50: f64,
    /// What the relay adds to a call at p99, milliseconds.
    added_ms_p99: f64,
    /// The CPU of a relay call (the client and the mock, plus `service_us` and `postgres_us`)
    /// over the direct call's (the client and the mock).
    cpu: Option<f64>,
    /// The service's CPU per relay call, microseconds: this process's over what a direct call
    /// costs it (the in-process service's share), or with `--url` the service processes' less
    /// their background (below).
    service_us: Option<f64>,
    /// PostgreSQL's CPU per relay call, microseconds, less its background: the direct calls use
    /// no database, so what the server spent per second during them (other users, the service's
    /// own timers) is subtracted at the same rate.
    postgres_us: Option<f64>,
}

impl Overhead {
    fn of(direct: &CallReport, relay: &CallReport) -> Self {
        let (direct_ms, relay_ms) = (&direct.call_ms, &relay.call_ms);
        // the client's and the mock's CPU per call: a direct call's, or with the service apart
        // all of this process's per relay call
        let cpu = direct
            .cpu
            .zip(relay.cpu)
            .filter(|(d, _)| d.generator_us > 0.0)
            .map(|(d, r)| {
                let (service, postgres) = Self::relay_cpu(direct, relay, d, r);
                let calling = if r.service_us.is_some() {
                    r.generator_us
                } else {
                    d.generator_us
                };
                (
                    (calling + service + postgres) / d.generator_us,
                    service,
                    postgres,
                )
            });
        Self {
            baseline: direct.mode,
            calls: relay.calls_per_second / direct.calls_per_second,
            latency_p50: relay_ms.p50 / direct_ms.p50,
            latency_p99: relay_ms.p99 / direct_ms.p99,
            added_ms_p50: relay_ms.p50 - direct_ms.p50,
            added_ms_p99: relay_ms.p99 - direct_ms.p99,
            cpu: cpu.map(|c| c.0),
            service_us: cpu.map(|c| c.1),
            postgres_us: cpu.map(|c| c.2),
        }
    }

    /// The service's and PostgreSQL's CPU per relay call, microseconds, each less its
    /// background (`d`: per direct call, `r`: per relay call).
    fn relay_cpu(
        direct: &CallReport,
        relay: &CallReport,
        d: cpu::CpuPerCycle,
        r: cpu::CpuPerCycle,
    ) -> (f64, f64) {
        // a group's CPU per direct call, as microseconds per relay call at the same rate per second
        let background = |us: f64| us * direct.calls_per_second / relay.calls_per_second;
        let service = match r.service_us {
            Some(us) => us - background(d.service_us.unwrap_or(0.0)),
            None => r.generator_us - d.generator_us,
        };
        let postgres = r.postgres_us - background(d.postgres_us);
        (service.max(0.0), postgres.max(0.0))
    }
}

/// The relay run's table, its ratios and its JSON line.
pub(super) fn print_report(
    args: &BenchArgs,
    reports: &[ModeReport],
    oversold: i64,
    rss_peak_mb: Option<f64>,
) {
    let calls: Vec<CallReport> = reports.iter().map(CallReport::of).collect();
    let mut table = crate::operator::table(&[
        "mode",
        "calls/s",
        "call p50/p90/p99/max ms",
        "errors",
        "CPU µs/call: service / PostgreSQL / generator",
    ]);
    for call in &calls {
        let p = &call.call_ms;
        table.add_row([
            call.mode.to_owned(),
            format!("{:.0}", call.calls_per_second),
            format!("{:.2} / {:.2} / {:.2} / {:.1}", p.p50, p.p90, p.p99, p.max),
            call.errors.to_string(),
            call.cpu.map_or_else(
                || "-".to_owned(),
                |c| {
                    let service = match (call.mode, c.service_us) {
                        ("relay", Some(us)) => format!("{us:.0}"),
                        ("relay", None) => "(in generator)".to_owned(),
                        _ => "-".to_owned(),
                    };
                    format!("{service} / {:.0} / {:.0}", c.postgres_us, c.generator_us)
                },
            ),
        ]);
    }
    println!(
        "relay overhead: {}, the mock upstream answers after {} ms",
        super::run_shape(args, " per mode"),
        args.hold_ms,
    );
    println!("{table}");
    let overhead = match calls.as_slice() {
        [direct, relay] if direct.calls_per_second > 0.0 && direct.call_ms.p50 > 0.0 => {
            Some(Overhead::of(direct, relay))
        }
        _ => None,
    };
    if let Some(o) = &overhead {
        println!(
            "relay / direct: {:.2}x the latency at p50 (+{:.2} ms), {:.2}x at p99 (+{:.2} ms), {:.2}x the calls/s",
            o.latency_p50, o.added_ms_p50, o.latency_p99, o.added_ms_p99, o.calls
        );
        if let (Some(cpu), Some(service), Some(postgres)) = (o.cpu, o.service_us, o.postgres_us) {
            let whose = if args.url.is_some() {
                "its processes"
            } else {
                "in this process, over the direct call's"
            };
            println!(
                "the relay's CPU per call: the service {service:.0} µs ({whose}), PostgreSQL {postgres:.0} µs (less its background during the direct calls); {cpu:.1}x the direct call's CPU"
            );
        }
    }
    super::print_oversell_check(oversold, "this run's credentials");
    if let Some(mb) = rss_peak_mb {
        println!("peak RSS of this process: {mb:.0} MB");
    }
    let line = json!({
        "relay": true,
        "executors": args.executors,
        "duration_seconds": args.duration_seconds,
        "credentials": args.credentials,
        "limit": args.limit,
        "hot_spot": args.hot_spot,
        "upstream_delay_ms": args.hold_ms,
        "results": calls,
        "ratios": overhead.into_iter().collect::<Vec<_>>(),
        "grants_over_limit": oversold,
        "rss_peak_mb": rss_peak_mb,
        "in_process": args.url.is_none(),
    });
    println!("{line}");
}
