//! The bottom floor: pure values and rules that import nothing else of the service, so that
//! every layer above (store, allocator, telemetry, HTTP) can use them. Validated newtypes for
//! every id and name that crosses the API, so a handler cannot hold an unvalidated value (each
//! validates in `parse` and deserializes through it); [`health`], the outcome -> health state
//! machine; [`windows`], the rate windows' arithmetic; [`oauth`], an OAuth credential's
//! configuration; [`HeldBy`], what holds a claim back.
//!
//! Character sets (documented in docs/src/operating.md, "Names"):
//! - `key_id`: 1..=128 characters from `A-Z a-z 0-9 . _ : @ -`, starting with a letter or digit.
//! - provider and pool: 1..=64 characters from `a-z 0-9 . _ -`, starting with a letter or digit.
//! - model: 1..=200 characters from `A-Z a-z 0-9 . _ : / @ + -`.
//! - holder: 1..=200 characters, no control characters.
//! - a tenant's pool pattern: `provider/pool`, each half a name or `*`.

pub mod health;
pub mod oauth;
pub mod relay;
pub mod windows;

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A value that failed validation: which field and why. The message never echoes the value,
/// so it is safe to return to clients and to log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct InvalidValue {
    /// The field name as the API spells it (`key_id`, `provider`, ...).
    pub field: &'static str,
    /// What a valid value looks like.
    pub reason: String,
}

impl InvalidValue {
    pub(crate) fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

/// `value` of `field` is 1..=`max_len` characters, each `allowed`; the error names the field and
/// `rule`, never the value.
pub(crate) fn check_name(
    field: &'static str,
    value: &str,
    max_len: usize,
    allowed: impl Fn(char) -> bool,
    rule: &str,
) -> Result<(), InvalidValue> {
    let len = value.chars().count();
    if len == 0 || len > max_len {
        return Err(InvalidValue::new(
            field,
            format!("must be 1 to {max_len} characters"),
        ));
    }
    if !value.chars().all(allowed) {
        return Err(InvalidValue::new(field, format!("may contain only {rule}")));
    }
    Ok(())
}

fn starts_alphanumeric(field: &'static str, value: &str) -> Result<(), InvalidValue> {
    if value.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        Ok(())
    } else {
        Err(InvalidValue::new(
            field,
            "must start with a letter or a digit",
        ))
    }
}

macro_rules! string_newtype {
    ($(#[$doc:meta])* $name:ident, $field:literal, $pattern:literal, |$v:ident| $check:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates `value`; the error names the field and the rule, never the value.
            pub fn parse(value: impl Into<String>) -> Result<Self, InvalidValue> {
                let $v: String = value.into();
                $check?;
                Ok(Self($v))
            }

            /// The validated value.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The API field name this value travels under.
            pub const FIELD: &'static str = $field;
        }

        impl TryFrom<String> for $name {
            type Error = InvalidValue;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::parse(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl utoipa::PartialSchema for $name {
            /// A string matching the type's rule (the same rule `parse` checks).
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .pattern(Some($pattern))
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}
    };
}

string_newtype!(
    /// The operator's id of one credential (`key_01HZX...`): 1..=128 characters from
    /// `A-Z a-z 0-9 . _ : @ -`, starting with a letter or digit.
    KeyId,
    "key_id",
    "^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$",
    |v| check_name("key_id", &v, 128, |c| c.is_ascii_alphanumeric() || "._:@-".contains(c), "letters, digits and . _ : @ -")
        .and_then(|()| starts_alphanumeric("key_id", &v))
);

string_newtype!(
    /// An upstream provider (`openai`, `anthropic`, ...): 1..=64 characters from `a-z 0-9 . _ -`,
    /// starting with a letter or digit.
    ProviderName,
    "provider",
    "^[a-z0-9][a-z0-9._-]{0,63}$",
    |v| check_lower_name("provider", &v)
);

string_newtype!(
    /// A pool of credentials within a provider (`default`, `vip`, ...): 1..=64 characters from
    /// `a-z 0-9 . _ -`, starting with a letter or digit.
    PoolName,
    "pool",
    "^[a-z0-9][a-z0-9._-]{0,63}$",
    |v| check_lower_name("pool", &v)
);

string_newtype!(
    /// A model name (`gpt-4o`, `claude-3-5-sonnet@20240620`): 1..=200 characters from
    /// `A-Z a-z 0-9 . _ : / @ + -`.
    ModelName,
    "model",
    "^[A-Za-z0-9._:/@+-]{1,200}$",
    |v| check_name("model", &v, 200, |c| c.is_ascii_alphanumeric() || "._:/@+-".contains(c), "letters, digits and . _ : / @ + -")
);

string_newtype!(
    /// The executor that holds a lease, as it names itself (`worker-7`): 1..=200 characters,
    /// no control characters. Recorded on the lease and in the trail.
    Holder,
    "holder",
    "^[^\\u0000-\\u001f\\u007f-\\u009f]{1,200}$",
    |v| check_name("holder", &v, 200, |c| !c.is_control(), "printable characters")
);

string_newtype!(
    /// A client's idempotency key for one allocation (`7f9c0c1e-...`): 1..=128 characters from
    /// `A-Z a-z 0-9 . _ : -`. A retry with the same request_id and parameters gets the same
    /// lease while it lives (docs/executor-protocol.md).
    RequestId,
    "request_id",
    "^[A-Za-z0-9._:-]{1,128}$",
    |v| check_name("request_id", &v, 128, |c| c.is_ascii_alphanumeric() || "._:-".contains(c), "letters, digits and . _ : -")
);

string_newtype!(
    /// A tenant: who holds a lease (a team, a product), known from the executor key it presents
    /// (`default` for the configured internal key): 1..=64 characters from `a-z 0-9 . _ -`,
    /// starting with a letter or digit. Tenants are configured (`PUT /api/admin/tenants/{id}`),
    /// so a tenant id is a bounded metric label.
    TenantId,
    "tenant_id",
    "^[a-z0-9][a-z0-9._-]{0,63}$",
    |v| check_lower_name("tenant_id", &v)
);

impl TenantId {
    /// The tenant of the configured internal key.
    pub fn default_tenant() -> Self {
        Self("default".to_owned())
    }
}

string_newtype!(
    /// Where a tenant may lease (`PUT /api/admin/tenants/{id}`, `pools`): `provider/pool`, each
    /// half a name (as [`ProviderName`] and [`PoolName`] spell them) or `*` for any:
    /// `openai/default`, `openai/*`, `*/*` (everything).
    PoolPattern,
    "pools",
    "^([a-z0-9][a-z0-9._-]{0,63}|\\*)/([a-z0-9][a-z0-9._-]{0,63}|\\*)$",
    |v| check_pool_pattern(&v)
);

fn check_pool_pattern(value: &str) -> Result<(), InvalidValue> {
    let refuse = || {
        InvalidValue::new(
            "pools",
            "each entry must be provider/pool, each half a name (lowercase letters, digits and . _ -) or * (openai/*, */*)",
        )
    };
    let (provider, pool) = value.split_once('/').ok_or_else(refuse)?;
    let half = |name: &str| name == "*" || check_lower_name("pools", name).is_ok();
    if half(provider) && half(pool) {
        Ok(())
    } else {
        Err(refuse())
    }
}

impl PoolPattern {
    /// Whether this pattern admits `provider`/`pool`.
    pub fn admits(&self, provider: &ProviderName, pool: &PoolName) -> bool {
        let (p, q) = self.0.split_once('/').unwrap_or_default();
        (p == "*" || p == provider.as_str()) && (q == "*" || q == pool.as_str())
    }
}

/// The pools a tenant may lease from: the union of its [`PoolPattern`]s. Empty: none (a tenant
/// created without `pools`). Decided by the allocate handler from what the key look-up returned,
/// before any candidate is read, so a refusal says nothing about what exists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantScope(Vec<PoolPattern>);

impl TenantScope {
    /// The most patterns a tenant may have.
    pub const MAX_PATTERNS: usize = 64;

    /// A scope of `patterns`: at most [`TenantScope::MAX_PATTERNS`].
    pub fn new(patterns: Vec<PoolPattern>) -> Result<Self, InvalidValue> {
        if patterns.len() > Self::MAX_PATTERNS {
            return Err(InvalidValue::new(
                "pools",
                format!("at most {} entries", Self::MAX_PATTERNS),
            ));
        }
        Ok(Self(patterns))
    }

    /// Every provider and pool (`*/*`): the configured internal key's, and existing tenants'
    /// after the upgrade that introduced scopes.
    pub fn everything() -> Self {
        Self(vec![PoolPattern("*/*".to_owned())])
    }

    /// Whether some pattern admits `provider`/`pool`.
    pub fn admits(&self, provider: &ProviderName, pool: &PoolName) -> bool {
        self.0.iter().any(|p| p.admits(provider, pool))
    }

    /// The patterns, as stored.
    pub fn patterns(&self) -> &[PoolPattern] {
        &self.0
    }
}

/// The prefix of every tenant executor key, so that a key pasted into the wrong place is
/// recognizable (and a secret scanner can find one).
pub const TENANT_KEY_PREFIX: &str = "cpk_";

/// A tenant's executor key as presented: `cpk_` and 64 hex digits (256 random bits). Only its
/// SHA-256 ([`TenantKeyHash`]) is kept anywhere; `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct TenantKey(String);

impl TenantKey {
    /// A new key: 256 bits from `rand`'s thread generator (a CSPRNG seeded from the operating
    /// system).
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        Self(format!("{TENANT_KEY_PREFIX}{}", hex::encode(bytes)))
    }

    /// A presented key, if it has a tenant key's shape (otherwise it cannot be one: 401 without
    /// asking the store).
    pub fn parse(value: &str) -> Option<Self> {
        let hex = value.strip_prefix(TENANT_KEY_PREFIX)?;
        (hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
        .then(|| Self(value.to_owned()))
    }

    /// The key, to hand to the operator once.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What the store keeps and looks keys up by.
    pub fn hash(&self) -> TenantKeyHash {
        use sha2::Digest;
        TenantKeyHash(sha2::Sha256::digest(self.0.as_bytes()).into())
    }
}

impl fmt::Debug for TenantKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TenantKey(<redacted>)")
    }
}

/// SHA-256 of a [`TenantKey`]: 32 bytes. A fast hash is right here: the key is 256 random bits,
/// so no dictionary or brute force can reach it, and a deliberately slow hash (bcrypt, argon2)
/// would only add its cost to every executor call.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TenantKeyHash(pub [u8; 32]);

impl TenantKeyHash {
    /// Lowercase hex, as the claim's JSON carries it.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for TenantKeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TenantKeyHash(<redacted>)")
    }
}

string_newtype!(
    /// A conversation's affinity key (`conv_8f2c...`, any id the executor chooses): 1..=256
    /// printable characters (no control characters). Requests with the same key prefer the
    /// credential that served the last of them (docs/design.md "Affinity").
    AffinityKey,
    "affinity_key",
    "^[^\\u0000-\\u001f\\u007f-\\u009f]{1,256}$",
    |v| check_name("affinity_key", &v, 256, |c| !c.is_control(), "printable characters")
);

fn check_lower_name(field: &'static str, value: &str) -> Result<(), InvalidValue> {
    check_name(
        field,
        value,
        64,
        |c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c),
        "lowercase letters, digits and . _ -",
    )?;
    starts_alphanumeric(field, value)
}

impl PoolName {
    /// The pool every other pool may fall back to (`default`).
    pub fn default_pool() -> Self {
        Self("default".to_owned())
    }

    /// The pool sequence an allocation tries, in order (docs/design.md "The protocol", step 1):
    /// `vip` tries `vip` then `default`; every other pool, `default` included, only itself.
    pub fn sequence(&self) -> Vec<PoolName> {
        if self.0 == "vip" {
            vec![self.clone(), Self::default_pool()]
        } else {
            vec![self.clone()]
        }
    }
}

impl Default for PoolName {
    fn default() -> Self {
        Self::default_pool()
    }
}

/// The id of one lease: 128 bits, shown as 32 lowercase hex digits. The first 48 bits are the
/// millisecond it was made (since the Unix epoch), the other 80 random: unguessable, so it
/// doubles as the executor's proof that it holds the lease, and ordered by time, so the audit
/// trail's lease_id indexes take each new lease at their right edge. (With all 128 bits random,
/// every grant and release wrote to a random page of indexes as large as the trail: with
/// 5,000,000 trail rows, 2.4 buffer reads per lease, the one cost that grew with history.)
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LeaseId(Uuid);

impl LeaseId {
    /// A fresh id: the current millisecond, then 80 bits from the thread's cryptographically
    /// secure generator (seeded from the operating system).
    pub fn generate() -> Self {
        let millis = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_millis());
        let random = rand::random::<u128>() >> 48;
        Self(Uuid::from_u128((millis & ((1 << 48) - 1)) << 80 | random))
    }

    /// Parses exactly 32 hexadecimal digits (either case).
    pub fn parse(value: &str) -> Result<Self, InvalidValue> {
        if value.len() != 32 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(InvalidValue::new(
                "lease_id",
                "must be 32 hexadecimal digits",
            ));
        }
        let bits = u128::from_str_radix(value, 16)
            .map_err(|_| InvalidValue::new("lease_id", "must be 32 hexadecimal digits"))?;
        Ok(Self(Uuid::from_u128(bits)))
    }

    /// The id as stored in PostgreSQL (`uuid` column).
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl From<Uuid> for LeaseId {
    fn from(value: Uuid) -> Self {
        Self(value)
    }
}

impl TryFrom<String> for LeaseId {
    type Error = InvalidValue;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<LeaseId> for String {
    fn from(value: LeaseId) -> String {
        value.to_string()
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.simple())
    }
}

impl utoipa::PartialSchema for LeaseId {
    /// 32 hexadecimal digits.
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some("^[0-9a-fA-F]{32}$"))
            .into()
    }
}

impl utoipa::ToSchema for LeaseId {}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({self})")
    }
}

/// A credential's health (never its occupancy). See docs/design.md "Vocabulary" and the SQL
/// function `credential_usable` for which states may be leased.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Usable.
    Available,
    /// Told to back off by the provider; usable again once `cooldown_until` passes.
    RateLimited,
    /// Resting after repeated failures; usable again once `cooldown_until` passes.
    Cooldown,
    /// Loaded but not yet cleared for traffic.
    Pending,
    /// Taken out of traffic (by an operator or an auth error).
    Disabled,
    /// Out of quota.
    Exhausted,
}

impl Status {
    /// Every status, in the order of docs/design.md.
    pub const ALL: [Status; 6] = [
        Status::Available,
        Status::RateLimited,
        Status::Cooldown,
        Status::Pending,
        Status::Disabled,
        Status::Exhausted,
    ];

    /// Parses the stored spelling.
    pub fn parse(value: &str) -> Result<Self, InvalidValue> {
        Status::ALL
            .into_iter()
            .find(|s| s.as_str() == value)
            .ok_or_else(|| InvalidValue::new("status", "must be one of available, rate_limited, cooldown, pending, disabled, exhausted"))
    }

    /// The spelling stored in `credentials.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Available => "available",
            Status::RateLimited => "rate_limited",
            Status::Cooldown => "cooldown",
            Status::Pending => "pending",
            Status::Disabled => "disabled",
            Status::Exhausted => "exhausted",
        }
    }
}

/// What the executor reports about its upstream call when it releases a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The call succeeded.
    Success,
    /// The call failed for a reason other than those below.
    Failure,
    /// The provider rate-limited the call (HTTP 429 upstream).
    RateLimited,
    /// The provider rejected the credential.
    AuthError,
    /// The provider rejected an OAuth access token (HTTP 401 upstream): the token of the lease's
    /// generation is taken out of traffic and refreshed once. On a credential that is not OAuth
    /// it counts as [`Outcome::AuthError`].
    AuthExpired,
    /// The credential's quota is used up.
    QuotaExhausted,
}

impl Outcome {
    /// The spelling stored in `lease_events.outcome`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure => "failure",
            Outcome::RateLimited => "rate_limited",
            Outcome::AuthError => "auth_error",
            Outcome::AuthExpired => "auth_expired",
            Outcome::QuotaExhausted => "quota_exhausted",
        }
    }
}

/// How strongly an allocation keeps to its conversation's bound credential.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AffinityMode {
    /// The bound credential is tried first when it can serve now; otherwise another credential
    /// serves in the same request and the binding moves to it. Never waits for the binding.
    #[default]
    Preferred,
    /// While the bound credential could serve but for its slots and windows, only it is
    /// considered: the request waits for it (up to `wait_ms`) or answers 429. A binding whose
    /// credential cannot serve at all (disabled, drained, cooling down, in another pool, gone)
    /// is treated as under `preferred`.
    Strict,
}

/// How long a binding lives after the grant that wrote it (refreshed on each hit), in whole
/// seconds, 1..=86,400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffinityTtl(u32);

impl AffinityTtl {
    /// One hour: Anthropic's longest prompt cache, longer than OpenAI's.
    pub const DEFAULT: AffinityTtl = AffinityTtl(3600);
    /// One day.
    pub const MAX: u32 = 86_400;

    /// Accepts 1..=86,400 seconds.
    pub fn parse(value: u64) -> Result<Self, InvalidValue> {
        match u32::try_from(value) {
            Ok(v) if (1..=Self::MAX).contains(&v) => Ok(Self(v)),
            _ => Err(InvalidValue::new(
                "affinity_ttl_seconds",
                format!("must be an integer from 1 to {}", Self::MAX),
            )),
        }
    }

    /// The TTL in seconds.
    pub fn get(self) -> u32 {
        self.0
    }
}

/// What an allocation with an `affinity_key` found: whether the bound credential served it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AffinityResult {
    /// The credential bound to the key served it; the binding's TTL starts again.
    Hit,
    /// The key had no live binding; it is now bound to the credential that served.
    New,
    /// The bound credential could not serve now; the key is now bound to the one that did.
    Moved,
}

impl AffinityResult {
    /// Parses the claim statement's spelling (`hit`, `new`, `moved`).
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "hit" => Some(Self::Hit),
            "new" => Some(Self::New),
            "moved" => Some(Self::Moved),
            _ => None,
        }
    }

    /// The spelling of the API, the metrics' `result` label and `lease_events.affinity`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hit => "hit",
            Self::New => "new",
            Self::Moved => "moved",
        }
    }
}

/// The proofs of `credpool audit verify`, in the order they are reported: `oversell` (credentials'
/// limits), `windows` (credentials' rate windows), `tenant_cap`, `tenant_windows`. Each has a
/// checkpoint per run (SQL table `audit_checkpoints`); the label values of the audit metrics.
pub const AUDIT_PROOFS: [&str; 4] = ["oversell", "windows", "tenant_cap", "tenant_windows"];

/// What holds back the candidate that frees first, when none can serve now: the `held_by` label
/// of `credpool_allocations_held_back_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldBy {
    /// Every slot is leased.
    Slots,
    /// Cooling down after rate limits or failures.
    Cooldown,
    /// A requests window is full.
    RequestsWindow,
    /// A tokens window has no room for the estimate.
    TokensWindow,
    /// An OAuth access token that would expire before the lease ends (or that an executor
    /// reported rejected), waiting for its refresh.
    TokenRefresh,
    /// A waiting request yielded to another tenant further below its weighted share of the pool
    /// (docs/design.md "Fair share").
    FairShare,
}

impl HeldBy {
    /// Parses the database's spelling (`credpool_frees_at`, and the claim's answers); `None`
    /// for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "slots" => Some(HeldBy::Slots),
            "cooldown" => Some(HeldBy::Cooldown),
            "requests_window" => Some(HeldBy::RequestsWindow),
            "tokens_window" => Some(HeldBy::TokensWindow),
            "token_refresh" => Some(HeldBy::TokenRefresh),
            "fair_share" => Some(HeldBy::FairShare),
            _ => None,
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            HeldBy::Slots => "slots",
            HeldBy::Cooldown => "cooldown",
            HeldBy::RequestsWindow => "requests_window",
            HeldBy::TokensWindow => "tokens_window",
            HeldBy::TokenRefresh => "token_refresh",
            HeldBy::FairShare => "fair_share",
        }
    }
}

/// A lease length in whole seconds, validated against the service's maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSeconds(u32);

impl LeaseSeconds {
    /// The lease length when a request names none: 35 seconds (a 30-second upstream call plus
    /// time to report).
    pub const DEFAULT: LeaseSeconds = LeaseSeconds(35);

    /// Accepts 1..=`max` seconds.
    pub fn parse(value: u64, max: u32) -> Result<Self, InvalidValue> {
        match u32::try_from(value) {
            Ok(v) if (1..=max).contains(&v) => Ok(Self(v)),
            _ => Err(InvalidValue::new(
                "lease_seconds",
                format!(
                    "must be an integer from 1 to {max} (the service's --max-lease-seconds \
                     raises the maximum)"
                ),
            )),
        }
    }

    /// [`LeaseSeconds::DEFAULT`], or `max` when the service allows less than that.
    pub fn default_within(max: u32) -> Self {
        Self(Self::DEFAULT.0.min(max).max(1))
    }

    /// The length in seconds.
    pub fn get(self) -> u32 {
        self.0
    }
}

/// Credential material handed to the executor with a lease (a JSON object such as
/// `{"api_key": "sk-..."}`). Its `Debug` output is redacted so it cannot reach a log by accident.
#[derive(Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Secret(serde_json::Value);

impl Secret {
    /// Accepts any JSON object; the error never echoes the value.
    pub fn parse(value: serde_json::Value) -> Result<Self, InvalidValue> {
        if value.is_object() {
            Ok(Self(value))
        } else {
            Err(InvalidValue::new("secret", "must be a JSON object"))
        }
    }

    /// The material itself, for storage and for the executor that holds the lease.
    pub fn expose(&self) -> &serde_json::Value {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Deserialize as any JSON value first so that a type error can never quote the material.
        let value = serde_json::Value::deserialize(deserializer)?;
        Secret::parse(value).map_err(serde::de::Error::custom)
    }
}

impl utoipa::PartialSchema for Secret {
    /// Any JSON object.
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Object)
            .description(Some(
                "credential material: any JSON object, e.g. {\"api_key\": \"sk-...\"}",
            ))
            .into()
    }
}

impl utoipa::ToSchema for Secret {}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Whether `url` may be an endpoint the service calls (an OAuth token endpoint, a relay upstream):
/// https to any host, or http on a loopback host (127.0.0.0/8, ::1, `localhost`: tests and local
/// gateways), at most 2048 characters, without control characters or user info. The error names
/// `field` and the rule, never the URL.
pub fn check_endpoint_url(field: &'static str, url: &str) -> Result<url::Url, InvalidValue> {
    let refuse = || {
        InvalidValue::new(
            field,
            "must be an https URL, or http on a loopback address (127.0.0.1, ::1, localhost)",
        )
    };
    // the URL parser would percent-encode a control character of the path, but the URL is
    // stored as given
    if url.len() > 2048 || url.chars().any(char::is_control) {
        return Err(refuse());
    }
    let parsed = url::Url::parse(url).map_err(|_| refuse())?;
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(refuse());
    }
    let loopback = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(name)) => name.eq_ignore_ascii_case("localhost"),
        None => false,
    };
    match parsed.scheme() {
        "https" if parsed.host().is_some() => Ok(parsed),
        "http" if loopback => Ok(parsed),
        _ => Err(refuse()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_id_accepts_documented_characters_and_rejects_others() {
        assert!(KeyId::parse("key_01HZX:prod@eu-1.a").is_ok());
        assert!(KeyId::parse("").is_err());
        assert!(KeyId::parse("-leading-dash").is_err());
        assert!(KeyId::parse("has space").is_err());
        assert!(KeyId::parse("semi;colon").is_err());
        assert!(KeyId::parse("x".repeat(128)).is_ok());
        assert!(KeyId::parse("x".repeat(129)).is_err());
    }

    #[test]
    fn provider_and_pool_are_lowercase_names() {
        assert!(ProviderName::parse("openai").is_ok());
        assert!(ProviderName::parse("OpenAI").is_err());
        assert!(PoolName::parse("vip").is_ok());
        assert!(PoolName::parse("x".repeat(65)).is_err());
        assert!(PoolName::parse("a'b").is_err());
    }

    #[test]
    fn invalid_value_message_never_echoes_the_value() {
        let err = KeyId::parse("sk-secret value").unwrap_err();
        assert!(!err.to_string().contains("sk-secret"), "{err}");
    }

    #[test]
    fn pool_patterns_admit_their_provider_and_pool_or_any() {
        let openai = ProviderName::parse("openai").unwrap();
        let anthropic = ProviderName::parse("anthropic").unwrap();
        let (default, vip) = (PoolName::default_pool(), PoolName::parse("vip").unwrap());
        let scope = |patterns: &[&str]| {
            TenantScope::new(
                patterns
                    .iter()
                    .map(|p| PoolPattern::parse(*p).unwrap())
                    .collect(),
            )
            .unwrap()
        };
        let only_openai_vip = scope(&["openai/vip"]);
        assert!(only_openai_vip.admits(&openai, &vip));
        assert!(!only_openai_vip.admits(&openai, &default));
        assert!(!only_openai_vip.admits(&anthropic, &vip));
        let all_openai = scope(&["openai/*"]);
        assert!(all_openai.admits(&openai, &default) && all_openai.admits(&openai, &vip));
        assert!(!all_openai.admits(&anthropic, &default));
        let every_default = scope(&["*/default"]);
        assert!(every_default.admits(&anthropic, &default));
        assert!(!every_default.admits(&anthropic, &vip));
        assert!(TenantScope::everything().admits(&anthropic, &vip));
        assert!(!TenantScope::default().admits(&openai, &default));
        for bad in [
            "openai",
            "openai/",
            "/vip",
            "open*/vip",
            "openai/v*",
            "OpenAI/vip",
            "a/b/c",
            "*",
            "openai/vip\u{0}",
            "",
        ] {
            assert!(PoolPattern::parse(bad).is_err(), "{bad:?}");
        }
        let too_many = vec![PoolPattern::parse("*/*").unwrap(); TenantScope::MAX_PATTERNS + 1];
        assert!(TenantScope::new(too_many).is_err());
    }

    #[test]
    fn vip_falls_back_to_default_and_default_never_borrows_from_vip() {
        let vip = PoolName::parse("vip").unwrap();
        let names = |p: &PoolName| {
            p.sequence()
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&vip), ["vip", "default"]);
        assert_eq!(names(&PoolName::default_pool()), ["default"]);
        assert_eq!(names(&PoolName::parse("batch").unwrap()), ["batch"]);
    }

    #[test]
    fn lease_ids_follow_the_clock_and_differ_in_their_random_bits() {
        let first = LeaseId::generate();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let later = LeaseId::generate();
        assert!(first.0 < later.0, "{first} made before {later}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis();
        let made = later.0.as_u128() >> 80;
        assert!(
            made <= now && now - made < 1_000,
            "{later} is not dated now"
        );
        // made within one millisecond, two ids still differ in their 80 random bits
        let (a, b) = (LeaseId::generate(), LeaseId::generate());
        assert_ne!(
            a.0.as_u128() & ((1 << 80) - 1),
            b.0.as_u128() & ((1 << 80) - 1)
        );
    }

    #[test]
    fn lease_id_round_trips_as_32_lowercase_hex() {
        let id = LeaseId::generate();
        let shown = id.to_string();
        assert_eq!(shown.len(), 32);
        assert!(
            shown
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        assert_eq!(LeaseId::parse(&shown).unwrap(), id);
        assert_eq!(LeaseId::parse(&shown.to_uppercase()).unwrap(), id);
        assert!(LeaseId::parse(&shown[..31]).is_err());
        assert!(LeaseId::parse("g0000000000000000000000000000000").is_err());
        assert!(LeaseId::parse("+0000000000000000000000000000000").is_err());
    }

    #[test]
    fn lease_seconds_range_is_inclusive() {
        assert!(LeaseSeconds::parse(0, 3600).is_err());
        assert_eq!(LeaseSeconds::parse(1, 3600).unwrap().get(), 1);
        assert_eq!(LeaseSeconds::parse(3600, 3600).unwrap().get(), 3600);
        assert!(LeaseSeconds::parse(3601, 3600).is_err());
        assert!(LeaseSeconds::parse(u64::MAX, 3600).is_err());
    }

    #[test]
    fn secret_debug_is_redacted_and_type_errors_do_not_quote_it() {
        let secret = Secret::parse(serde_json::json!({"api_key": "sk-live-123"})).unwrap();
        assert_eq!(format!("{secret:?}"), "Secret(<redacted>)");
        let err = serde_json::from_str::<Secret>(r#""sk-live-123""#).unwrap_err();
        assert!(!err.to_string().contains("sk-live"), "{err}");
    }
}
