//! `--baseline redis`: the original article's Redis + Lua design, the other figure a user
//! compares credpool with.
//!
//! The article's ALLOCATE and RELEASE scripts (`allocate.lua`, `release.lua`; their comments say
//! where the article's text had to be filled in) run with EVALSHA (loaded once before the
//! measured window; [`redis::Script`] loads again should the server's script cache be flushed).
//! The credentials are loaded as the article's `sync_key` writes them: the provider/pool's
//! candidate ZSET and one HASH per credential, all under a run-specific key prefix
//! (`credpool-bench:{run}:`) that [`remove`] deletes afterwards. Each executor has its own
//! connection, ranks a window of [`CANDIDATES`] credentials at a random place and passes the
//! client's clock in unix seconds, as the article's Python does. Not measured: the article's
//! steps outside the scripts (the database re-check after a grant, the `sync_key` repair and
//! second EVAL after an empty answer): the scripts alone are the allocator.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, Script};

use super::{Allocator, Claimed, PROVIDER, Plan};

/// Candidates each ALLOCATE passes: the article's example sizes its list at 20.
pub(super) const CANDIDATES: usize = 20;

/// Credentials written per pipeline when loading.
const LOAD_CHUNK: usize = 1000;

/// What the executors of a run share: the server, the loaded scripts and the run's key names.
pub(super) struct RedisBaseline {
    client: Client,
    allocate: Script,
    release: Script,
    /// Prefix of every key of this run.
    prefix: String,
    /// KEYS[1] of ALLOCATE: the candidate ZSET of the bench provider and the run's pool.
    candidates: String,
}

/// The key prefix of a run.
pub(super) fn prefix(run_id: &str) -> String {
    format!("credpool-bench:{run_id}:")
}

fn client(url: &str) -> anyhow::Result<Client> {
    Client::open(url).map_err(|e| anyhow::anyhow!("--redis-url {url}: {e}"))
}

fn config() -> AsyncConnectionConfig {
    // the crate's default response timeout (500 ms) is shorter than a loaded 2-core machine
    // can promise; the HTTP client waits 30 s, so does this
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(30)))
}

async fn connect(client: &Client) -> redis::RedisResult<MultiplexedConnection> {
    client
        .get_multiplexed_async_connection_with_config(&config())
        .await
}

/// Whether Redis answers at `url` (PING), before anything is loaded anywhere.
pub(super) async fn check(url: &str) -> anyhow::Result<()> {
    let client = client(url)?;
    let answered = async {
        let mut conn = connect(&client).await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    answered
        .await
        .map_err(|e| anyhow::anyhow!("--baseline redis: Redis at {url} does not answer: {e}"))?;
    Ok(())
}

/// Loads the run's credentials (`key_ids`, each of limit `limit`, available, in `pool`) as the
/// article's `sync_key` does, and the two scripts.
pub(super) async fn load(
    url: &str,
    run_id: &str,
    pool: &str,
    key_ids: &[String],
    limit: u32,
) -> anyhow::Result<RedisBaseline> {
    let client = client(url)?;
    let mut conn = connect(&client).await?;
    let prefix = prefix(run_id);
    let candidates = format!("{prefix}provider:{PROVIDER}:pool:{pool}:keys");
    for chunk in key_ids.chunks(LOAD_CHUNK) {
        let mut pipe = redis::pipe();
        for key_id in chunk {
            // the ZSET's score is not read by the script (the caller's order decides); the
            // article keeps it for operators and as the application's scoring input
            pipe.cmd("ZADD")
                .arg(&candidates)
                .arg(1.0)
                .arg(key_id)
                .ignore();
            // no cooldown and never used: empty strings, the encoding is_usable reads
            pipe.cmd("HSET")
                .arg(format!("{prefix}key:{key_id}"))
                .arg(&[
                    ("provider", PROVIDER.to_owned()),
                    ("status", "available".to_owned()),
                    ("cooldown_until", String::new()),
                    ("last_used_at", String::new()),
                    ("max_concurrent_uses", limit.max(1).to_string()),
                ])
                .ignore();
        }
        pipe.query_async::<()>(&mut conn).await?;
    }
    let allocate = Script::new(include_str!("allocate.lua"));
    let release = Script::new(include_str!("release.lua"));
    allocate.prepare_invoke().load_async(&mut conn).await?;
    release.prepare_invoke().load_async(&mut conn).await?;
    Ok(RedisBaseline {
        client,
        allocate,
        release,
        prefix,
        candidates,
    })
}

/// Deletes every key of the run (SCAN for the prefix, then UNLINK); returns how many.
pub(super) async fn remove(url: &str, run_id: &str) -> anyhow::Result<u64> {
    let client = client(url)?;
    let mut conn = connect(&client).await?;
    let pattern = format!("{}*", prefix(run_id));
    let mut keys: Vec<String> = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        keys.extend(found);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    // SCAN may return a key twice
    keys.sort_unstable();
    keys.dedup();
    let mut removed = 0;
    for chunk in keys.chunks(LOAD_CHUNK) {
        removed += redis::cmd("UNLINK")
            .arg(chunk)
            .query_async::<u64>(&mut conn)
            .await?;
    }
    Ok(removed)
}

/// EVALSHA calls and their server time so far (`INFO commandstats`, `cmdstat_evalsha`): calls
/// and microseconds, for the whole server.
pub(super) async fn evalsha_stats(url: &str) -> anyhow::Result<(u64, u64)> {
    let client = client(url)?;
    let mut conn = connect(&client).await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    Ok(parse_evalsha_stats(&info))
}

/// `(calls, usec)` of the `cmdstat_evalsha` line of `INFO commandstats` (zeros before the first
/// EVALSHA).
fn parse_evalsha_stats(info: &str) -> (u64, u64) {
    let Some(line) = info
        .lines()
        .find_map(|line| line.trim().strip_prefix("cmdstat_evalsha:"))
    else {
        return (0, 0);
    };
    let field = |name: &str| {
        line.split(',')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .and_then(|value| value.parse().ok())
            .unwrap_or(0)
    };
    (field("calls"), field("usec"))
}

/// One executor of the baseline, on its own connection.
pub(super) struct RedisAllocator<'a> {
    baseline: &'a RedisBaseline,
    conn: MultiplexedConnection,
    /// key_id and lease_id of the lease held.
    lease: Option<(String, String)>,
}

impl<'a> RedisAllocator<'a> {
    pub(super) async fn connect(baseline: &'a RedisBaseline) -> redis::RedisResult<Self> {
        Ok(Self {
            baseline,
            conn: connect(&baseline.client).await?,
            lease: None,
        })
    }
}

impl Allocator for RedisAllocator<'_> {
    async fn allocate(&mut self, plan: &Plan) -> Claimed {
        // the article's lease id: uuid4().hex, 32 hex digits
        let lease_id = hex::encode(rand::random::<[u8; 16]>());
        let now_ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut invocation = self.baseline.allocate.prepare_invoke();
        invocation
            .key(&self.baseline.candidates)
            .arg(now_ts)
            .arg(plan.lease_seconds.max(1))
            .arg(PROVIDER)
            .arg(plan.pool.as_str())
            .arg(&lease_id)
            .arg(&self.baseline.prefix);
        for key_id in plan.window(CANDIDATES) {
            invocation.arg(key_id.as_str());
        }
        // nil: this ranked list has no free slot now (the article's 429)
        let answer = invocation
            .invoke_async::<Option<String>>(&mut self.conn)
            .await;
        Claimed::of_baseline(
            answer,
            lease_id,
            &mut self.lease,
            "redis baseline ALLOCATE failed",
        )
    }

    async fn release(&mut self, plan: &Plan) -> bool {
        let Some((key_id, lease_id)) = self.lease.take() else {
            return false;
        };
        let released = self
            .baseline
            .release
            .arg(PROVIDER)
            .arg(plan.pool.as_str())
            .arg(&key_id)
            .arg(&lease_id)
            .arg(&self.baseline.prefix)
            .invoke_async::<i64>(&mut self.conn)
            .await;
        match released {
            Ok(released) => released == 1,
            Err(error) => {
                tracing::debug!(error = %error, "redis baseline RELEASE failed");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evalsha_stats_are_read_from_their_line() {
        let info = "# Commandstats\r\ncmdstat_eval:calls=3,usec=9,usec_per_call=3.00\r\n\
                    cmdstat_evalsha:calls=120,usec=4800,usec_per_call=40.00,rejected_calls=0,failed_calls=1\r\n";
        assert_eq!(parse_evalsha_stats(info), (120, 4800));
        assert_eq!(parse_evalsha_stats("# Commandstats\r\n"), (0, 0));
    }
}
