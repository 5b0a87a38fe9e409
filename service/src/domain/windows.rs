//! Rate windows: a credential's limits on requests and tokens per interval
//! (`{"requests": 500, "seconds": 60}`, `{"tokens": 200000, "seconds": 60}`), and the arithmetic
//! of what they have counted.
//!
//! The database decides every grant (`credpool_window_room` in `sql/windows.sql`, inside the
//! claim); this module is the same rule in Rust, without I/O, for what the service estimates from
//! its candidate view: a window's headroom (a scoring term), whether a candidate has room (to rank
//! it as free), and when a full window frees (the 429's `Retry-After` and a waiting request's
//! timer). `tests/api/windows.rs` holds the two implementations equal.
//!
//! The rule, exact (docs/design.md, "Rate windows"): a window of length S and count N never has
//! more than N grants (`requests`), or more than N reserved-or-used tokens (`tokens`), in any
//! interval of length S. Each window counts in buckets of S/16, kept in a ring of 17; at time t
//! it counts every bucket from the one 16 buckets before t's on, which covers (t - S, t] and at
//! most one bucket more: a grant admitted while that count plus its charge is at most N keeps the
//! rule, and a full window frees at most S/16 after its oldest counted grant leaves it. A full
//! window (its count reached N) also holds back a request that would charge it nothing.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::domain::InvalidValue;

/// Buckets per window length.
pub const BUCKETS: i64 = 16;
/// Buckets a window keeps: a window's length spans at most this many.
pub const RING: usize = 17;

/// Most windows a credential may have.
pub const MAX_WINDOWS: usize = 8;
/// Longest window, in seconds (31 days).
pub const MAX_WINDOW_SECONDS: u32 = 2_678_400;
/// Largest count of a window, and largest token estimate or usage.
pub const MAX_COUNT: u64 = 1_000_000_000;

/// What a window counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WindowKind {
    /// Grants: one per lease.
    Requests,
    /// Tokens: each lease's reservation (its allocate's estimate), replaced by its release's usage.
    Tokens,
}

impl WindowKind {
    /// The kind as the API and the database spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowKind::Requests => "requests",
            WindowKind::Tokens => "tokens",
        }
    }

    /// Parses the database's spelling.
    pub fn parse(value: &str) -> Result<Self, InvalidValue> {
        match value {
            "requests" => Ok(WindowKind::Requests),
            "tokens" => Ok(WindowKind::Tokens),
            _ => Err(InvalidValue::new(
                "rate_limits",
                "kind must be requests or tokens",
            )),
        }
    }
}

/// One window of a credential: at most `count` requests or tokens in any `seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RateLimit {
    /// What it counts.
    pub kind: WindowKind,
    /// How many, 1..=10^9.
    pub count: u64,
    /// Its length in whole seconds, 1..=2,678,400 (31 days).
    pub seconds: u32,
}

/// The JSON shape of a window: exactly one of `requests` and `tokens`, and `seconds`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = RateLimit)]
struct RateLimitJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1_000_000_000)]
    requests: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1_000_000_000)]
    tokens: Option<u64>,
    #[schema(minimum = 1, maximum = 2_678_400)]
    seconds: u64,
}

impl RateLimit {
    fn from_json(json: RateLimitJson) -> Result<Self, InvalidValue> {
        let (kind, count) = match (json.requests, json.tokens) {
            (Some(n), None) => (WindowKind::Requests, n),
            (None, Some(n)) => (WindowKind::Tokens, n),
            _ => {
                return Err(InvalidValue::new(
                    "rate_limits",
                    "each window has exactly one of requests and tokens, and seconds",
                ));
            }
        };
        if !(1..=MAX_COUNT).contains(&count) {
            return Err(InvalidValue::new(
                "rate_limits",
                format!("a window's count must be an integer from 1 to {MAX_COUNT}"),
            ));
        }
        let seconds = u32::try_from(json.seconds)
            .ok()
            .filter(|s| (1..=MAX_WINDOW_SECONDS).contains(s))
            .ok_or_else(|| {
                InvalidValue::new(
                    "rate_limits",
                    format!(
                        "a window's seconds must be a whole number from 1 to {MAX_WINDOW_SECONDS}"
                    ),
                )
            })?;
        Ok(Self {
            kind,
            count,
            seconds,
        })
    }

    fn to_json(self) -> RateLimitJson {
        let count = Some(self.count);
        RateLimitJson {
            requests: count.filter(|_| self.kind == WindowKind::Requests),
            tokens: count.filter(|_| self.kind == WindowKind::Tokens),
            seconds: u64::from(self.seconds),
        }
    }

    /// "600 requests / 60 s", for messages and labels.
    pub fn describe(&self) -> String {
        format!("{} {} / {} s", self.count, self.kind.as_str(), self.seconds)
    }
}

/// A credential's windows: at most 8, no two of the same kind and length. Empty: none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLimits(Vec<RateLimit>);

impl RateLimits {
    /// Validates a list of windows.
    pub fn new(windows: Vec<RateLimit>) -> Result<Self, InvalidValue> {
        if windows.len() > MAX_WINDOWS {
            return Err(InvalidValue::new(
                "rate_limits",
                format!("at most {MAX_WINDOWS} windows"),
            ));
        }
        for (i, window) in windows.iter().enumerate() {
            if windows[..i]
                .iter()
                .any(|w| w.kind == window.kind && w.seconds == window.seconds)
            {
                return Err(InvalidValue::new(
                    "rate_limits",
                    "two windows of the same kind and length",
                ));
            }
        }
        Ok(Self(windows))
    }

    /// The windows, in the order given.
    pub fn windows(&self) -> &[RateLimit] {
        &self.0
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// As stored in `credentials.rate_limits` and shown by the API.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }

    /// Parses the stored or submitted JSON array.
    pub fn from_json(value: serde_json::Value) -> Result<Self, InvalidValue> {
        serde_json::from_value(value).map_err(|_| {
            InvalidValue::new(
                "rate_limits",
                "must be a list of {\"requests\" or \"tokens\": count, \"seconds\": length}",
            )
        })
    }
}

impl Serialize for RateLimits {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let windows: Vec<RateLimitJson> = self.0.iter().map(|w| w.to_json()).collect();
        windows.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for RateLimits {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let windows = Vec::<RateLimitJson>::deserialize(deserializer)?;
        let windows = windows
            .into_iter()
            .map(RateLimit::from_json)
            .collect::<Result<Vec<_>, _>>()
            .map_err(serde::de::Error::custom)?;
        RateLimits::new(windows).map_err(serde::de::Error::custom)
    }
}

impl utoipa::PartialSchema for RateLimits {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ArrayBuilder::new()
            .items(<RateLimitJson as utoipa::PartialSchema>::schema())
            .max_items(Some(MAX_WINDOWS))
            .description(Some(
                "rate windows: at most `requests` grants, or `tokens` reserved-or-used, in any `seconds`",
            ))
            .into()
    }
}

impl utoipa::ToSchema for RateLimits {}

/// What a credential's windows have counted, as the database holds it (`lease_windows`): per
/// window its configuration, and a ring of [`RING`] buckets (absolute bucket number, charged).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WindowState {
    /// The windows, in order.
    pub windows: Vec<RateLimit>,
    /// Window i's bucket b is element `i * RING + b`: the bucket's absolute number.
    pub bucket_ids: Vec<i64>,
    /// What was charged in it.
    pub bucket_charged: Vec<i64>,
}

/// Microseconds since the epoch.
fn micros(at: OffsetDateTime) -> i64 {
    (at.unix_timestamp_nanos() / 1_000) as i64
}

/// A bucket's length for a window of `seconds`, in microseconds.
fn bucket_micros(seconds: u32) -> i64 {
    i64::from(seconds) * 1_000_000 / BUCKETS
}

/// The bucket `at` falls in, for a window of `seconds`.
pub fn bucket(at: OffsetDateTime, seconds: u32) -> i64 {
    micros(at).div_euclid(bucket_micros(seconds))
}

impl WindowState {
    /// Whether the credential has windows at all.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    fn ring(&self, window: usize) -> std::ops::Range<usize> {
        window * RING..(window + 1) * RING
    }

    /// What window `window` counts at `at`.
    pub fn used(&self, window: usize, at: OffsetDateTime) -> i64 {
        let from = bucket(at, self.windows[window].seconds) - (RING as i64 - 1);
        self.ring(window)
            .filter(|&b| self.bucket_ids[b] >= from)
            .map(|b| self.bucket_charged[b])
            .sum()
    }

    fn amount(&self, window: usize, tokens: u64) -> i64 {
        match self.windows[window].kind {
            WindowKind::Requests => 1,
            WindowKind::Tokens => tokens as i64,
        }
    }

    fn admits(&self, window: usize, used: i64, tokens: u64) -> bool {
        let count = self.windows[window].count as i64;
        used + self.amount(window, tokens) <= count && used < count
    }

    /// Whether every window admits, at `at`, one more grant reserving `tokens`.
    pub fn room(&self, at: OffsetDateTime, tokens: u64) -> bool {
        (0..self.windows.len()).all(|i| self.admits(i, self.used(i, at), tokens))
    }

    /// Whether some window can never admit a grant reserving `tokens` (its count is smaller).
    pub fn never_admits(&self, tokens: u64) -> bool {
        (0..self.windows.len()).any(|i| self.amount(i, tokens) > self.windows[i].count as i64)
    }

    /// Counts a grant at `at` reserving `tokens` in every window.
    pub fn charge(&mut self, at: OffsetDateTime, tokens: u64) {
        for i in 0..self.windows.len() {
            let b = bucket(at, self.windows[i].seconds);
            let index = i * RING + b.rem_euclid(RING as i64) as usize;
            let amount = self.amount(i, tokens);
            if self.bucket_ids[index] >= b {
                self.bucket_charged[index] += amount;
            } else {
                self.bucket_ids[index] = b;
                self.bucket_charged[index] = amount;
            }
        }
    }

    /// Changes the token windows' charge of a grant made at `granted_at` by `delta` (usage minus
    /// reservation), if its bucket is still counted; never below zero.
    pub fn adjust(&mut self, granted_at: OffsetDateTime, delta: i64) {
        for i in 0..self.windows.len() {
            if self.windows[i].kind != WindowKind::Tokens {
                continue;
            }
            let b = bucket(granted_at, self.windows[i].seconds);
            let index = i * RING + b.rem_euclid(RING as i64) as usize;
            if self.bucket_ids[index] == b {
                self.bucket_charged[index] = (self.bucket_charged[index] + delta).max(0);
            }
        }
    }

    /// The earliest moment from `at` on when every window admits a grant reserving `tokens`
    /// (`at` when they do now); `None` when one never will (its count is smaller).
    pub fn frees_at(&self, at: OffsetDateTime, tokens: u64) -> Option<OffsetDateTime> {
        let mut frees = at;
        for i in 0..self.windows.len() {
            if self.amount(i, tokens) > self.windows[i].count as i64 {
                return None;
            }
            let mut used = self.used(i, at);
            if self.admits(i, used, tokens) {
                continue;
            }
            let seconds = self.windows[i].seconds;
            let from = bucket(at, seconds) - (RING as i64 - 1);
            let mut buckets: Vec<(i64, i64)> = self
                .ring(i)
                .filter(|&b| self.bucket_ids[b] >= from && self.bucket_charged[b] > 0)
                .map(|b| (self.bucket_ids[b], self.bucket_charged[b]))
                .collect();
            buckets.sort_unstable();
            for (id, charged) in buckets {
                used -= charged;
                if self.admits(i, used, tokens) {
                    let leaves = (id + RING as i64) * bucket_micros(seconds);
                    let leaves =
                        OffsetDateTime::from_unix_timestamp_nanos(i128::from(leaves) * 1_000)
                            .unwrap_or(at);
                    frees = frees.max(leaves);
                    break;
                }
            }
        }
        Some(frees)
    }

    /// The share of the tightest window left at `at`, in [0, 1] (1 without windows): the
    /// scoring term that spreads traffic before a window fills.
    pub fn headroom(&self, at: OffsetDateTime) -> f64 {
        (0..self.windows.len())
            .map(|i| {
                let count = self.windows[i].count as f64;
                (1.0 - self.used(i, at) as f64 / count).clamp(0.0, 1.0)
            })
            .fold(1.0, f64::min)
    }

    /// The window that holds back a grant reserving `tokens` at `at`, if one does (the first in
    /// order), for messages and metrics.
    pub fn holding(&self, at: OffsetDateTime, tokens: u64) -> Option<RateLimit> {
        (0..self.windows.len())
            .find(|&i| !self.admits(i, self.used(i, at), tokens))
            .map(|i| self.windows[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: f64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
            + time::Duration::microseconds((seconds * 1e6).round() as i64)
    }

    fn state(windows: &[(WindowKind, u64, u32)]) -> WindowState {
        WindowState {
            windows: windows
                .iter()
                .map(|&(kind, count, seconds)| RateLimit {
                    kind,
                    count,
                    seconds,
                })
                .collect(),
            bucket_ids: vec![0; windows.len() * RING],
            bucket_charged: vec![0; windows.len() * RING],
        }
    }

    #[test]
    fn a_request_window_admits_its_count_then_frees_one_length_and_a_bucket_later() {
        let mut w = state(&[(WindowKind::Requests, 10, 2)]);
        for _ in 0..10 {
            assert!(w.room(at(0.0), 0));
            w.charge(at(0.0), 0);
        }
        assert!(!w.room(at(0.0), 0));
        assert!(!w.room(at(1.99), 0));
        let frees = w.frees_at(at(0.0), 0).unwrap();
        // the grants' bucket [0, 0.125) leaves the window at 2.125 s at the latest
        assert!(frees > at(2.0) && frees <= at(2.125), "{frees}");
        assert!(w.room(frees, 0));
        assert!(!w.room(frees - time::Duration::microseconds(1), 0));
    }

    #[test]
    fn in_any_interval_of_its_length_a_window_never_admits_more_than_its_count() {
        // grants as fast as the window admits them, at irregular times, for 20 lengths
        let mut w = state(&[(WindowKind::Requests, 7, 3)]);
        let mut granted = Vec::new();
        let mut t = 0.0;
        while t < 60.0 {
            if w.room(at(t), 0) {
                w.charge(at(t), 0);
                granted.push(t);
            }
            t += 0.0137;
        }
        for (i, &start) in granted.iter().enumerate() {
            let within = granted[i..]
                .iter()
                .take_while(|&&g| g < start + 3.0)
                .count();
            assert!(within <= 7, "{within} grants in the 3 s from {start}");
        }
        // and it is not too strict: at least 7 per length minus a bucket on average
        assert!(
            granted.len() >= 7 * 60 / 3 * 16 / 17 - 7,
            "{}",
            granted.len()
        );
    }

    #[test]
    fn token_windows_count_reservations_and_usage_replaces_them() {
        let mut w = state(&[(WindowKind::Tokens, 1000, 60)]);
        w.charge(at(0.0), 600);
        assert!(w.room(at(1.0), 400));
        assert!(!w.room(at(1.0), 401));
        // the call used 100 tokens, not 600
        w.adjust(at(0.0), 100 - 600);
        assert!(w.room(at(1.0), 900));
        // an estimate above the count never fits; 0 fits until the window is full
        assert!(w.never_admits(1001));
        assert_eq!(w.frees_at(at(1.0), 1001), None);
        w.charge(at(2.0), 900);
        assert!(
            !w.room(at(3.0), 0),
            "a full token window let a grant through"
        );
        assert_eq!(
            w.holding(at(3.0), 0).map(|l| l.kind),
            Some(WindowKind::Tokens)
        );
        assert!(w.headroom(at(3.0)) < 0.01);
    }

    #[test]
    fn rate_limits_parse_from_the_api_shape_and_refuse_what_the_rules_refuse() {
        let ok: RateLimits = serde_json::from_value(serde_json::json!([
            {"requests": 500, "seconds": 60}, {"tokens": 200000, "seconds": 60},
            {"requests": 10000, "seconds": 86400}
        ]))
        .unwrap();
        assert_eq!(ok.windows().len(), 3);
        assert_eq!(
            ok.to_json()[1],
            serde_json::json!({"tokens": 200000, "seconds": 60})
        );
        for bad in [
            serde_json::json!([{"requests": 0, "seconds": 60}]),
            serde_json::json!([{"requests": 1, "seconds": 0}]),
            serde_json::json!([{"requests": 1, "seconds": 2678401}]),
            serde_json::json!([{"tokens": 1000000001, "seconds": 1}]),
            serde_json::json!([{"requests": 1, "tokens": 1, "seconds": 1}]),
            serde_json::json!([{"seconds": 1}]),
            serde_json::json!([{"requests": 1, "seconds": 1, "burst": 2}]),
            serde_json::json!([{"requests": 1, "seconds": 1}, {"requests": 2, "seconds": 1}]),
            serde_json::json!(
                (0..9)
                    .map(|i| serde_json::json!({"requests": 1, "seconds": i + 1}))
                    .collect::<Vec<_>>()
            ),
        ] {
            assert!(
                serde_json::from_value::<RateLimits>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }
}
