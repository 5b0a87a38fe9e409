//! The operator commands (`credpool keys`, `credpool leases`, `credpool pools`, `credpool
//! audit`, ...): the same library functions as the operator API, straight against the database
//! (`DATABASE_URL` or the embedded default), with human-readable tables or `--json`. Each
//! command family run alone does its listing: `keys` lists the credentials, `leases` the leases
//! held, `audit` runs `verify`.

use std::collections::HashSet;
use std::io::Read;

use anyhow::{Context, bail};
use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
use serde::Serialize;

use std::process::ExitCode;

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::config::{
    AuditArgs, AuditCommand, CitusArgs, CitusCommand, CliArgs, CronArgs, CronCommand, KeysArgs,
    KeysCommand, LeasesArgs, LeasesCommand, MaintenanceRunArgs, RelayArgs, RelayCommand,
    VerifyArgs,
};
use credpool::allocator::health::HealthPolicy;
use credpool::allocator::windows::RateLimits;
use credpool::database::Database;
use credpool::domain::relay::{ApiStyle, UpstreamInput};
use credpool::domain::{KeyId, PoolName, ProviderName, Status};
use credpool::startup::{check_secret_config, prepare_keyring};
use credpool::store::audit::{self, Run};
use credpool::store::credentials::{
    self, Actor, CredentialInput, ListFilter, Patch, PatchOutcome, StateChange,
};
use credpool::store::{dashboard, maintenance};

fn actor(cli: &CliArgs) -> anyhow::Result<Actor> {
    let name = match &cli.operator {
        Some(name) => name.clone(),
        None => format!(
            "cli:{}",
            std::env::var("USER")
                .or_else(|_| std::env::var("LOGNAME"))
                .unwrap_or_else(|_| "unknown".into())
        ),
    };
    Actor::parse(name).map_err(anyhow::Error::msg)
}

fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints a command's answer: `json` with `--json`, else `text` on a line.
fn answer(
    cli: &CliArgs,
    json: &impl Serialize,
    text: impl std::fmt::Display,
) -> anyhow::Result<()> {
    if cli.json {
        print_json(json)
    } else {
        println!("{text}");
        Ok(())
    }
}

/// A table in the style of every CLI listing, with this header.
pub(crate) fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_style(UTF8_BORDERS_ONLY)
        .set_header(header.to_vec());
    table
}

/// Runs a command on an open database (with the operator's statement timeout), then closes it
/// whatever happened.
async fn with_database<T>(
    cli: &CliArgs,
    f: impl AsyncFnOnce(&Database) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let database = Database::open(&cli.database()).await?;
    let result = f(&database).await;
    database.close().await;
    result
}

/// `credpool keys ...`.
pub async fn keys(args: KeysArgs) -> anyhow::Result<()> {
    let cli = &args.cli;
    let actor = actor(cli)?;
    let policy = HealthPolicy::default();
    let command = args.command.clone().unwrap_or(KeysCommand::List {
        provider: None,
        pool: None,
        status: None,
    });
    match &command {
        KeysCommand::Import { file } => {
            check_secret_config(&cli.secrets, &cli.db)?;
            let text = read_input(file)?;
            let inputs = parse_import(&text)?;
            with_database(cli, async |db| {
                let keyring = prepare_keyring(&cli.secrets, db).await?;
                let specs = inputs
                    .into_iter()
                    .map(|(key_id, input)| input.into_spec(key_id, &keyring))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(anyhow::Error::msg)?;
                let (created, updated) = credentials::import(&db.pool, &specs, &actor).await?;
                let text = format!(
                    "imported {} credentials: {created} created, {updated} updated",
                    specs.len()
                );
                answer(
                    cli,
                    &serde_json::json!({"created": created, "updated": updated}),
                    text,
                )
            })
            .await
        }
        KeysCommand::List {
            provider,
            pool,
            status,
        } => {
            let filter = ListFilter {
                provider: provider
                    .clone()
                    .map(ProviderName::parse)
                    .transpose()
                    .map_err(anyhow::Error::msg)?,
                pool: pool
                    .clone()
                    .map(PoolName::parse)
                    .transpose()
                    .map_err(anyhow::Error::msg)?,
                status: status
                    .as_deref()
                    .map(Status::parse)
                    .transpose()
                    .map_err(anyhow::Error::msg)?,
                after: None,
                limit: 1000,
            };
            with_database(cli, async |db| {
                let mut all = Vec::new();
                let mut filter = filter;
                loop {
                    let page = credentials::list(&db.pool, &filter, &policy).await?;
                    let full = page.len() == filter.limit as usize;
                    filter.after = page
                        .last()
                        .map(|k| KeyId::parse(k.key_id.clone()))
                        .transpose()
                        .map_err(anyhow::Error::msg)?;
                    all.extend(page);
                    if !full {
                        break;
                    }
                }
                if cli.json {
                    return print_json(&all);
                }
                let mut out = table(&[
                    "key_id",
                    "provider",
                    "pool",
                    "status",
                    "in flight / limit",
                    "cooldown until",
                    "success rate",
                    "draining",
                    "rate windows (used / count)",
                ]);
                for k in &all {
                    out.add_row(vec![
                        k.key_id.clone(),
                        k.provider.clone(),
                        k.pool.clone(),
                        k.status.clone(),
                        format!("{} / {}", k.in_flight, k.max_concurrent_uses),
                        k.cooldown_until.map(|t| t.to_string()).unwrap_or_default(),
                        format!("{:.0}%", k.health.success_rate * 100.0),
                        if k.draining {
                            "yes".into()
                        } else {
                            String::new()
                        },
                        k.windows
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(", "),
                    ]);
                }
                println!("{out}");
                Ok(())
            })
            .await
        }
        KeysCommand::Disable { key_id, reason } => {
            change_state(cli, key_id, StateChange::Disable, reason.clone(), &actor).await
        }
        KeysCommand::Enable { key_id } => {
            change_state(cli, key_id, StateChange::Enable, None, &actor).await
        }
        KeysCommand::Drain { key_id, reason } => {
            change_state(cli, key_id, StateChange::Drain, reason.clone(), &actor).await
        }
        KeysCommand::RateLimits { key_id, windows } => {
            let windows: serde_json::Value = serde_json::from_str(windows)
                .context("WINDOWS must be JSON, like '[{\"requests\": 500, \"seconds\": 60}]'")?;
            let rate_limits = RateLimits::from_json(windows).map_err(anyhow::Error::msg)?;
            let patch = Patch {
                rate_limits: Some(rate_limits),
                ..Patch::default()
            };
            apply_patch(cli, key_id, &patch, &actor).await
        }
        KeysCommand::Rm { key_id } => {
            let key_id = KeyId::parse(key_id.clone()).map_err(anyhow::Error::msg)?;
            with_database(cli, async |db| {
                let Some(released) = credentials::delete(&db.pool, &key_id, &actor).await? else {
                    bail!("no credential {key_id}");
                };
                let text = format!(
                    "deleted {key_id} ({} in-flight leases force-released)",
                    released.len()
                );
                answer(
                    cli,
                    &serde_json::json!({"deleted": key_id.as_str(), "force_released": released}),
                    text,
                )
            })
            .await
        }
        KeysCommand::Reencrypt => {
            check_secret_config(&cli.secrets, &cli.db)?;
            with_database(cli, async |db| {
                let keyring = prepare_keyring(&cli.secrets, db).await?;
                let resealed = credentials::reseal(&db.pool, &keyring, false, &actor).await?;
                let fingerprint = keyring.current().fingerprint();
                let text = format!("resealed {resealed} secrets under master key {fingerprint}");
                answer(
                    cli,
                    &serde_json::json!({"resealed": resealed, "master_key": fingerprint}),
                    text,
                )
            })
            .await
        }
    }
}

async fn change_state(
    cli: &CliArgs,
    key_id: &str,
    state: StateChange,
    reason: Option<String>,
    actor: &Actor,
) -> anyhow::Result<()> {
    let patch = Patch {
        state: Some(state),
        reason,
        ..Patch::default()
    };
    apply_patch(cli, key_id, &patch, actor).await
}

async fn apply_patch(
    cli: &CliArgs,
    key_id: &str,
    patch: &Patch,
    actor: &Actor,
) -> anyhow::Result<()> {
    let key_id = KeyId::parse(key_id.to_owned()).map_err(anyhow::Error::msg)?;
    with_database(cli, async |db| {
        match credentials::patch(&db.pool, &key_id, patch, actor, &HealthPolicy::default()).await? {
            PatchOutcome::Changed(detail) => {
                if cli.json {
                    print_json(&detail)
                } else {
                    let windows = detail
                        .rate_limits
                        .windows()
                        .iter()
                        .map(|w| w.describe())
                        .collect::<Vec<_>>();
                    println!(
                        "{key_id}: status {}{}{}",
                        detail.status,
                        if detail.draining { ", draining" } else { "" },
                        if windows.is_empty() {
                            String::new()
                        } else {
                            format!(", rate windows: {}", windows.join(", "))
                        }
                    );
                    Ok(())
                }
            }
            PatchOutcome::Invalid(invalid) => bail!("{invalid}"),
            PatchOutcome::NotFound => bail!("no credential {key_id}"),
        }
    })
    .await
}

/// `credpool leases ...`.
pub async fn leases(args: LeasesArgs) -> anyhow::Result<()> {
    let cli = &args.cli;
    match args.command.as_ref().unwrap_or(&LeasesCommand::List) {
        LeasesCommand::List => list_leases(cli).await,
        LeasesCommand::ReleaseAll { key_id, reason } => {
            let actor = actor(cli)?;
            let key_id = KeyId::parse(key_id.clone()).map_err(anyhow::Error::msg)?;
            if reason.trim().is_empty() {
                bail!("--reason must not be empty");
            }
            with_database(cli, async |db| {
                let Some(released) =
                    credentials::release_all(&db.pool, &key_id, reason, &actor).await?
                else {
                    bail!("no credential {key_id}");
                };
                let text = format!("{key_id}: {} leases force-released", released.len());
                answer(
                    cli,
                    &serde_json::json!({"released": released.len(), "leases": released}),
                    text,
                )
            })
            .await
        }
    }
}

/// `credpool relay ...`: the relay's upstreams, with the admin API's checks and trail.
pub async fn relay(args: RelayArgs) -> anyhow::Result<()> {
    let cli = &args.cli;
    match args.command.clone().unwrap_or(RelayCommand::List) {
        RelayCommand::List => {
            with_database(cli, async |db| {
                let upstreams = credpool::store::relay::list(&db.pool).await?;
                if cli.json {
                    return print_json(&serde_json::json!({ "upstreams": upstreams }));
                }
                let mut t = table(&[
                    "provider",
                    "base_url",
                    "api",
                    "credential",
                    "wait_ms",
                    "affinity",
                    "timeout_s",
                    "set by",
                ]);
                for u in &upstreams {
                    t.add_row(vec![
                        u.provider.clone(),
                        u.base_url.clone(),
                        u.api.as_str().to_owned(),
                        u.credential_header.clone(),
                        u.wait_ms.to_string(),
                        u.affinity_header.clone().unwrap_or_default(),
                        u.timeout_seconds.to_string(),
                        u.updated_by.clone(),
                    ]);
                }
                println!("{t}");
                Ok(())
            })
            .await
        }
        RelayCommand::Set {
            provider,
            base_url,
            api,
            credential_header,
            wait_ms,
            affinity_header,
            timeout_seconds,
        } => {
            let actor = actor(cli)?;
            let provider = ProviderName::parse(provider).map_err(anyhow::Error::msg)?;
            let upstream = UpstreamInput {
                base_url,
                api: ApiStyle::parse(&api).context("--api is openai or anthropic")?,
                credential_header,
                wait_ms,
                affinity_header,
                timeout_seconds,
            }
            .check(provider)
            .map_err(anyhow::Error::msg)?;
            with_database(cli, async |db| {
                let (detail, created) =
                    credpool::store::relay::put(&db.pool, &upstream, &actor).await?;
                let verb = if created { "set" } else { "replaced" };
                let text = format!(
                    "{}: relay upstream {verb}: {}",
                    detail.provider, detail.base_url
                );
                answer(cli, &detail, text)
            })
            .await
        }
        RelayCommand::Remove { provider } => {
            let actor = actor(cli)?;
            let provider = ProviderName::parse(provider).map_err(anyhow::Error::msg)?;
            with_database(cli, async |db| {
                if !credpool::store::relay::remove(&db.pool, &provider, &actor).await? {
                    bail!("no relay upstream for {provider}");
                }
                println!("{provider}: relay upstream removed");
                Ok(())
            })
            .await
        }
    }
}

/// A lease as `credpool leases --json` prints it.
#[derive(Debug, Serialize)]
struct HeldLease {
    #[serde(flatten)]
    holding: dashboard::LeaseHolding,
    granted_at: Option<String>,
    lease_until: String,
    probe: bool,
    fence: Option<i64>,
}

/// `credpool leases` (`list`): the leases held now, oldest grant first (the dashboard's read, so
/// at most its first [`dashboard::MAX_HELD_LEASES`]), and how many are held in all.
async fn list_leases(cli: &CliArgs) -> anyhow::Result<()> {
    with_database(cli, async |db| {
        let (rows, _now) = dashboard::leases(&db.pool).await?;
        let held: i64 = credentials::pools(&db.pool)
            .await?
            .iter()
            .map(|p| p.in_flight)
            .sum();
        let format = |t: OffsetDateTime| t.format(&Rfc3339);
        let leases = rows
            .into_iter()
            .filter(|r| !r.expired)
            .map(|r| {
                Ok(HeldLease {
                    granted_at: r.granted_at.map(format).transpose()?,
                    lease_until: format(r.lease_until)?,
                    holding: r.holding,
                    probe: r.probe,
                    fence: r.fence,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        if cli.json {
            return print_json(&serde_json::json!({"held": held, "leases": leases}));
        }
        if leases.is_empty() && held == 0 {
            println!("held now: 0");
            return Ok(());
        }
        let mut out = table(&[
            "lease_id",
            "key_id",
            "provider",
            "pool",
            "slot",
            "holder",
            "granted at",
            "lease until",
            "fence",
        ]);
        for l in &leases {
            let h = &l.holding;
            out.add_row(vec![
                h.lease_id.clone(),
                h.key_id.clone(),
                h.provider.clone(),
                h.pool.clone(),
                h.slot.to_string(),
                h.holder.clone().unwrap_or_default(),
                l.granted_at.clone().unwrap_or_default(),
                l.lease_until.clone(),
                l.fence.map(|f| f.to_string()).unwrap_or_default(),
            ]);
        }
        println!("{out}");
        if (leases.len() as i64) < held {
            println!(
                "held now: {held} (listed: the {} granted first)",
                leases.len()
            );
        } else {
            println!("held now: {held}");
        }
        Ok(())
    })
    .await
}

/// `credpool pools`.
pub async fn pools(cli: CliArgs) -> anyhow::Result<()> {
    with_database(&cli, async |db| {
        let pools = credentials::pools(&db.pool).await?;
        if cli.json {
            return print_json(&pools);
        }
        let mut out = table(&[
            "provider",
            "pool",
            "credentials",
            "by status",
            "draining",
            "cooling down",
            "slots",
            "in flight",
        ]);
        for p in &pools {
            let by_status = p.by_status_line(" ");
            out.add_row(vec![
                p.provider.clone(),
                p.pool.clone(),
                p.credentials.to_string(),
                by_status,
                p.draining.to_string(),
                p.cooling_down.to_string(),
                p.total_slots.to_string(),
                p.in_flight.to_string(),
            ]);
        }
        println!("{out}");
        Ok(())
    })
    .await
}

/// `credpool audit ...`; the exit code is non-zero when a proof finds a grant over a credential's
/// limit or rate window, or over a tenant's cap or rate window.
pub async fn audit(args: AuditArgs) -> anyhow::Result<ExitCode> {
    let cli = &args.cli;
    let command = match args.command.clone() {
        Some(command) => command,
        None => AuditCommand::Verify(VerifyArgs::defaults()?),
    };
    match &command {
        AuditCommand::Verify(VerifyArgs {
            since,
            until,
            full,
            chunk_rows,
        }) => {
            let parse = |label: &str,
                         text: &Option<String>|
             -> anyhow::Result<Option<OffsetDateTime>> {
                text.as_deref()
                    .map(|t| {
                        OffsetDateTime::parse(t, &Rfc3339).with_context(|| {
                            format!("--{label} must be an RFC 3339 time, like 2026-11-29T14:02:00Z")
                        })
                    })
                    .transpose()
            };
            let (since, until) = (parse("since", since)?, parse("until", until)?);
            with_database(cli, async |db| {
                let (run, resumed) = match (since, until, full) {
                    (None, None, false) => (Run::Continuous, true),
                    _ => {
                        let mut work = db.pool.work().await?;
                        // the end of the trail is where it is settled when each chunk runs:
                        // later grants are for the next run
                        let until = match until {
                            Some(until) => until,
                            None => audit::database_now(&mut *work).await?,
                        };
                        let start = match since {
                            Some(since) => since,
                            // the whole trail; an empty one has nothing before now
                            None if *full => audit::oldest_trail_row(&mut *work)
                                .await?
                                .unwrap_or(until)
                                .min(until),
                            None => until - time::Duration::days(1),
                        };
                        if until < start {
                            bail!("--until must not be before --since");
                        }
                        let resumed = audit::open_range(&mut *work, start, until).await?;
                        work.done().await?;
                        (Run::Range { since: start }, resumed)
                    }
                };
                let proven = prove(db, &run, resumed, *chunk_rows, !cli.json).await?;
                report(db, cli, &run, &proven).await
            })
            .await
        }
    }
}

/// What one `credpool audit verify` did to its run.
struct Proven {
    /// Where the run stood when this command took it over, when it continued one (the latest
    /// checkpoint of its proofs); `None`: it started afresh.
    resumed_from: Option<OffsetDateTime>,
    /// Trail rows this command proved (each chunk's rows once, however many proofs read it).
    rows_read: i64,
    /// Calls of `credpool_audit_advance` (each one chunk per proof, one statement, one commit).
    chunks: u64,
    /// How long it took.
    elapsed: std::time::Duration,
}

/// Advances `run` chunk by chunk (at most `chunk_rows` trail rows each) until every proof has
/// reached its target or the end of the settled trail, with a progress bar on a terminal when
/// `show`. A chunk is committed as it finishes; another session advancing the same run (the
/// maintenance pass) is waited for, its chunks counting for this run too. `resumed`: the run
/// existed before this command (an interrupted range, or the continuous proof).
async fn prove(
    db: &Database,
    run: &Run,
    resumed: bool,
    chunk_rows: u32,
    show: bool,
) -> anyhow::Result<Proven> {
    let started = std::time::Instant::now();
    let (before, now) = {
        let mut work = db.pool.work().await?;
        let before = audit::checkpoints(&mut *work, run).await?;
        let now = audit::database_now(&mut *work).await?;
        work.done().await?;
        (before, now)
    };
    let resumed_from = before
        .iter()
        .map(|c| c.proven_until)
        .max()
        .filter(|_| resumed);
    // the bar's axis: seconds of trail from the slowest proof's point to its target
    let from = before.iter().map(|c| c.proven_until).min().unwrap_or(now);
    let target = |checkpoints: &[audit::Checkpoint]| {
        checkpoints
            .iter()
            .map(|c| c.until_target.map_or(now, |t| t.min(now)))
            .min()
            .unwrap_or(now)
    };
    let bar = if show {
        indicatif::ProgressBar::new(1)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "  proving [{bar:30}] {percent:>3}%  {msg}  (eta {eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let mut proven = Proven {
        resumed_from,
        rows_read: 0,
        chunks: 0,
        elapsed: std::time::Duration::ZERO,
    };
    loop {
        let mut work = db.pool.work().await?;
        let advanced = audit::advance(&mut *work, run, chunk_rows).await?;
        work.done().await?;
        let Some(advanced) = advanced else {
            bar.set_message("waiting for another session's chunk of this proof");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            continue;
        };
        proven.rows_read += advanced.rows_read;
        proven.chunks += 1;
        // where the proofs stand, for the bar only (the report reads them once at the end)
        if show {
            let mut work = db.pool.work().await?;
            let checkpoints = audit::checkpoints(&mut *work, run).await?;
            work.done().await?;
            let at = checkpoints
                .iter()
                .map(|c| c.proven_until)
                .min()
                .unwrap_or(now);
            let span = (target(&checkpoints) - from).whole_milliseconds().max(1) as u64;
            bar.set_length(span);
            bar.set_position(((at - from).whole_milliseconds().max(0) as u64).min(span));
            bar.set_message(format!(
                "{} trail rows, up to {}",
                proven.rows_read,
                at.format(&Rfc3339)?
            ));
        }
        if !advanced.more {
            break;
        }
    }
    bar.finish_and_clear();
    proven.elapsed = started.elapsed();
    Ok(proven)
}

/// Prints what `run` has found (tables, or `--json`) and a summary of the run and of the
/// continuous proof; the exit code says whether any grant broke a rule.
async fn report(
    db: &Database,
    cli: &CliArgs,
    run: &Run,
    proven: &Proven,
) -> anyhow::Result<ExitCode> {
    let mut work = db.pool.work().await?;
    let checkpoints = audit::checkpoints(&mut *work, run).await?;
    let found = audit::findings(&mut work, run).await?;
    let continuous = match run {
        Run::Continuous => checkpoints.clone(),
        Run::Range { .. } => audit::checkpoints(&mut *work, &Run::Continuous).await?,
    };
    let now = audit::database_now(&mut *work).await?;
    work.done().await?;
    let since = checkpoints.iter().map(|c| c.since).min().unwrap_or(now);
    let until = checkpoints
        .iter()
        .map(|c| c.proven_until)
        .min()
        .unwrap_or(since)
        .max(since);
    let violations = |proof: &str| {
        checkpoints
            .iter()
            .filter(|c| c.proof == proof)
            .map(|c| c.violations)
            .sum::<i64>()
    };
    let (over_limit, over_window, over_cap, over_tenant_window) = (
        violations("oversell"),
        violations("windows"),
        violations("tenant_cap"),
        violations("tenant_windows"),
    );
    let total = over_limit + over_window + over_cap + over_tenant_window;
    let continuous = ContinuousState::of(&continuous, now);
    if cli.json {
        print_json(&serde_json::json!({
            "run": run.name(),
            "since": since.format(&Rfc3339)?, "until": until.format(&Rfc3339)?,
            "credentials": found.credentials, "grants_over_limit": over_limit,
            "windows": found.windows, "grants_over_window": over_window,
            "tenants": found.tenants, "grants_over_cap": over_cap,
            "tenant_windows": found.tenant_windows,
            "grants_over_tenant_window": over_tenant_window,
            "checkpoints": checkpoints,
            "resumed_from": proven.resumed_from.map(|t| t.format(&Rfc3339)).transpose()?,
            "rows_read": proven.rows_read,
            "chunks": proven.chunks,
            "seconds": proven.elapsed.as_secs_f64(),
            "continuous": continuous,
        }))?;
    } else {
        print_findings(&found, since, until, over_limit, over_cap)?;
        println!(
            "{}: every grant from {} to {} judged; this run read {} trail rows in {} chunks ({:.1} s){}",
            match run {
                Run::Continuous => "continuous proof",
                Run::Range { .. } => "proof of the range",
            },
            since.format(&Rfc3339)?,
            until.format(&Rfc3339)?,
            proven.rows_read,
            proven.chunks,
            proven.elapsed.as_secs_f64(),
            match proven.resumed_from {
                Some(at) => format!(", from {}", at.format(&Rfc3339)?),
                None => String::new(),
            }
        );
        match &continuous {
            Some(state) => println!(
                "continuous proof: proven up to {} ({:.0} s behind the trail), {} grants over a \
                 limit, cap or window since {}",
                state.proven_until.format(&Rfc3339)?,
                state.lag_seconds,
                state.violations,
                state.since.format(&Rfc3339)?,
            ),
            None => println!("continuous proof: not started (the maintenance pass starts it)"),
        }
    }
    Ok(if total == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The tables of `credpool audit verify`: credentials, their windows, tenants, their windows,
/// each with its verdict over `[since, until)`.
fn print_findings(
    found: &audit::Findings,
    since: OffsetDateTime,
    until: OffsetDateTime,
    over_limit: i64,
    over_cap: i64,
) -> anyhow::Result<()> {
    print_proof_table(
        &["key_id", "limit", "leases", "peak"],
        "limit",
        found.credentials.iter().map(|r| {
            let limit = r.max_concurrent_uses.map(|l| l.to_string());
            let cells = [
                r.key_id.clone(),
                limit.unwrap_or_else(|| "(deleted)".into()),
            ];
            proof_row(
                cells,
                r.leases,
                r.peak,
                r.grants_over_limit,
                r.first_violation_at,
            )
        }),
    );
    println!(
        "{} credentials with leases between {} and {}: {}",
        found.credentials.len(),
        since.format(&Rfc3339)?,
        until.format(&Rfc3339)?,
        verdict(over_limit, "a limit")
    );
    print_windows(&found.windows, "key_id", "rate windows", "a window");
    if !found.tenants.is_empty() {
        print_proof_table(
            &["tenant", "cap", "leases", "peak"],
            "cap",
            found.tenants.iter().map(|r| {
                let cap = r.max_concurrent_leases.map(|c| c.to_string());
                let cells = [r.tenant_id.clone(), cap.unwrap_or_else(|| "none".into())];
                proof_row(
                    cells,
                    r.leases,
                    r.peak,
                    r.grants_over_cap,
                    r.first_violation_at,
                )
            }),
        );
        println!("tenants: {}", verdict(over_cap, "a tenant's cap"));
    }
    print_windows(
        &found.tenant_windows,
        "tenant",
        "tenant rate windows",
        "a tenant's window",
    );
    Ok(())
}

/// A table of `credpool audit verify`: `columns`, then `grants over {rule}` and `first at`; a
/// row each of `rows` ([`proof_row`]).
fn print_proof_table(columns: &[&str], rule: &str, rows: impl Iterator<Item = Vec<String>>) {
    let over = format!("grants over {rule}");
    let mut out = table(&[columns, &[over.as_str(), "first at"]].concat());
    for row in rows {
        out.add_row(row);
    }
    println!("{out}");
}

/// A row of a proof's table: who and under which rule (`subject`), then its leases (or grants),
/// their peak, the grants over the rule and when the first of them was (empty: none).
fn proof_row(
    subject: [String; 2],
    leases: i64,
    peak: i64,
    over: i64,
    first_at: Option<OffsetDateTime>,
) -> Vec<String> {
    let [who, rule] = subject;
    vec![
        who,
        rule,
        leases.to_string(),
        peak.to_string(),
        over.to_string(),
        first_at.map(|t| t.to_string()).unwrap_or_default(),
    ]
}

/// A proof's verdict on its `over` grants over `what` (`a limit`, `a tenant's cap`, ...).
fn verdict(over: i64, what: &str) -> String {
    if over == 0 {
        format!("no grant ever exceeded {what}")
    } else {
        format!("{over} grants exceeded {what}")
    }
}

/// Where the continuous proof stands (`continuous` in `credpool audit verify --json`).
#[derive(Debug, Serialize)]
struct ContinuousState {
    /// Where it began.
    #[serde(with = "time::serde::rfc3339")]
    since: OffsetDateTime,
    /// Every grant before this moment has been judged (the slowest proof's checkpoint).
    #[serde(with = "time::serde::rfc3339")]
    proven_until: OffsetDateTime,
    /// Seconds between `proven_until` and now (database clock).
    lag_seconds: f64,
    /// Grants it has found breaking a rule, over its proofs.
    violations: i64,
}

impl ContinuousState {
    /// From its checkpoints (`None`: it has not started).
    fn of(checkpoints: &[audit::Checkpoint], now: OffsetDateTime) -> Option<Self> {
        let proven_until = checkpoints.iter().map(|c| c.proven_until).min()?;
        Some(Self {
            since: checkpoints.iter().map(|c| c.since).min()?,
            proven_until,
            lag_seconds: (now - proven_until).as_seconds_f64().max(0.0),
            violations: checkpoints.iter().map(|c| c.violations).sum(),
        })
    }
}

/// Prints the lines of a window proof (`credpool audit verify`) under a column `who` (the
/// credential or the tenant), then `label`: whether any grant exceeded `what`. Nothing when no
/// window had grants.
fn print_windows(rows: &[audit::WindowRow], who: &str, label: &str, what: &str) {
    if rows.is_empty() {
        return;
    }
    print_proof_table(
        &[who, "window", "grants", "peak"],
        "window",
        rows.iter().map(|r| {
            let window = format!("{} {} / {} s", r.window_count, r.kind, r.seconds);
            let cells = [r.subject.id().to_owned(), window];
            proof_row(
                cells,
                r.grants,
                r.peak,
                r.grants_over_window,
                r.first_violation_at,
            )
        }),
    );
    let over: i64 = rows.iter().map(|r| r.grants_over_window).sum();
    println!("{label}: {}", verdict(over, what));
}

/// `credpool cron ...`.
pub async fn cron(args: CronArgs) -> anyhow::Result<()> {
    let cli = &args.cli;
    with_database(cli, async |db| match &args.command {
        CronCommand::Install {
            audit_retention_days,
        } => {
            let retention = std::time::Duration::from_secs(audit_retention_days * 86_400);
            let jobs = maintenance::install_cron(&db.pool, &db.options, retention).await?;
            let text = format!("scheduled in pg_cron: {}", jobs.join(", "));
            answer(cli, &serde_json::json!({"installed": jobs}), text)
        }
        CronCommand::Uninstall => {
            let removed = maintenance::uninstall_cron(&db.pool, &db.options).await?;
            let text =
                format!("removed {removed} pg_cron jobs; credpool services run the cleanup again");
            answer(cli, &serde_json::json!({"removed": removed}), text)
        }
    })
    .await
}

/// `credpool citus distribute`.
pub async fn citus(args: CitusArgs) -> anyhow::Result<()> {
    let cli = &args.cli;
    let CitusCommand::Distribute { shard_count } = args.command;
    with_database(cli, async |db| {
        let done = credpool::store::citus::distribute(&db.pool, shard_count).await?;
        let text = if done.was_done() {
            format!(
                "already distributed (Citus {}, {} workers): nothing to do",
                done.citus_version, done.workers
            )
        } else {
            format!(
                "distributed by provider on Citus {} ({} workers): {}; reference tables: {}; \
                 keys with the provider: {}; functions on every node: {}; functions planned \
                 per call: {}",
                done.citus_version,
                done.workers,
                list_or_none(&done.distributed),
                list_or_none(&done.reference),
                list_or_none(&done.keys),
                done.functions,
                done.per_call_plans
            )
        };
        answer(cli, &serde_json::to_value(&done)?, text)
    })
    .await
}

/// `items` joined with commas, or `none`.
fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

/// `credpool maintenance`: one pass now, whoever else runs them (the functions are safe to run
/// concurrently).
pub async fn maintenance(args: MaintenanceRunArgs) -> anyhow::Result<()> {
    let cli = &args.cli;
    let retention = std::time::Duration::from_secs(args.audit_retention_days * 86_400);
    with_database(cli, async |db| {
        // a step another session runs right now is skipped: its work is being done
        let report = maintenance::run_steps(&db.pool, retention)
            .await?
            .unwrap_or_default();
        if cli.json {
            print_json(&report)
        } else {
            println!(
                "reaped {} expired leases, refitted {} credentials, recorded {} ended cooldowns, \
                 purged {} audit rows and {} request ids, folded {} pool version rows, \
                 refitted {} tenants, purged {} affinity bindings, made {} trail days ahead, \
                 proved {} trail rows, dropped {} trail days",
                report.expired_leases_reaped,
                report.credentials_refitted,
                report.cooldowns_recorded,
                report.audit_rows_purged,
                report.request_ids_purged,
                report.pool_versions_folded,
                report.tenants_refitted,
                report.affinity_bindings_purged,
                report.trail_days_made,
                report.audit_rows_proven,
                report.trail_days_dropped
            );
            Ok(())
        }
    })
    .await
}

fn read_input(file: &std::path::Path) -> anyhow::Result<String> {
    let mut text = String::new();
    if file.as_os_str() == "-" {
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading stdin")?;
    } else {
        text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    }
    Ok(text)
}

/// Parses an import file — a JSON array, or one JSON object per line — and validates every entry
/// before anything is written. Every problem is reported (with its entry number), never a secret.
pub fn parse_import(text: &str) -> anyhow::Result<Vec<(KeyId, CredentialInput)>> {
    let trimmed = text.trim_start();
    let raw: Vec<(usize, Result<CredentialInput, String>)> = if trimmed.starts_with('[') {
        let values: Vec<serde_json::Value> = serde_json::from_str(trimmed)
            .map_err(|e| anyhow::anyhow!("the file is not a JSON array: {e}"))?;
        values
            .into_iter()
            .enumerate()
            .map(|(i, v)| (i + 1, serde_json::from_value(v).map_err(|e| e.to_string())))
            .collect()
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(i, line)| (i + 1, serde_json::from_str(line).map_err(|e| e.to_string())))
            .collect()
    };
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    let mut entries = Vec::new();
    for (number, entry) in raw {
        match entry {
            Err(error) => problems.push(format!("entry {number}: {error}")),
            Ok(input) => match input.key_id.clone() {
                None => problems.push(format!("entry {number}: missing field `key_id`")),
                Some(key_id) if !seen.insert(key_id.clone()) => {
                    problems.push(format!("entry {number}: key_id {key_id} appears twice"))
                }
                Some(key_id) => {
                    if let Err(invalid) = credentials::check_models(&input.models, &input.aliases)
                        .and_then(|()| {
                            credentials::check_limit(input.max_concurrent_uses).map(|_| ())
                        })
                    {
                        problems.push(format!("entry {number} ({key_id}): {invalid}"));
                    }
                    entries.push((key_id, input));
                }
            },
        }
    }
    if !problems.is_empty() {
        bail!(
            "nothing imported; {} problem(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    if entries.is_empty() {
        bail!("nothing to import: the file holds no entries");
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn import_accepts_an_array_or_json_lines() {
        let one = r#"{"key_id":"a","provider":"openai","models":["gpt-4o"],"max_concurrent_uses":1,"secret":{"api_key":"sk-1"}}"#;
        let two = r#"{"key_id":"b","provider":"openai","models":["gpt-4o"],"max_concurrent_uses":2,"secret":{"api_key":"sk-2"}}"#;
        assert_eq!(parse_import(&format!("{one}\n\n{two}\n")).unwrap().len(), 2);
        assert_eq!(parse_import(&format!("[{one}, {two}]")).unwrap().len(), 2);
    }

    #[test]
    fn import_reports_every_problem_and_never_a_secret() {
        let text = [
            r#"{"key_id":"a","provider":"openai","models":["gpt-4o"],"max_concurrent_uses":0,"secret":{"api_key":"sk-secret-a"}}"#,
            r#"{"key_id":"a","provider":"openai","models":["gpt-4o"],"max_concurrent_uses":1,"secret":{"api_key":"sk-secret-b"}}"#,
            r#"{"provider":"openai","models":["gpt-4o"],"max_concurrent_uses":1,"secret":"sk-secret-c"}"#,
            r#"not json sk-secret-d"#,
        ]
        .join("\n");
        let error = parse_import(&text).unwrap_err().to_string();
        assert!(error.contains("4 problem(s)"), "{error}");
        assert!(
            error.contains("entry 1 (a)") && error.contains("appears twice"),
            "{error}"
        );
        assert!(!error.contains("sk-secret"), "{error}");
    }
}
