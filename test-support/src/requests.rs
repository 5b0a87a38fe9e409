//! Request bodies of the executor API the suites send again and again.

use serde_json::{Value, json};

/// An allocate body: gpt-4o from openai, the service's default pool and lease length.
pub fn gpt4o() -> Value {
    json!({"provider": "openai", "model": "gpt-4o"})
}

/// An allocate body: gpt-4o from openai's default pool, for `lease_seconds` seconds.
pub fn gpt4o_for(lease_seconds: u64) -> Value {
    json!({"provider": "openai", "model": "gpt-4o", "lease_seconds": lease_seconds})
}

/// An allocate body: gpt-4o from openai's pool `pool`, the service's default lease length.
pub fn gpt4o_in(pool: &str) -> Value {
    json!({"provider": "openai", "model": "gpt-4o", "pool": pool})
}

/// An allocate body: gpt-4o from openai's pool `pool`, for `lease_seconds` seconds.
pub fn gpt4o_in_for(pool: &str, lease_seconds: u64) -> Value {
    json!({"provider": "openai", "model": "gpt-4o", "pool": pool, "lease_seconds": lease_seconds})
}

/// A lease as renew and release name it (provider, pool, key id, lease id), from a lease as
/// allocate answered it; a test adds `fence`, `outcome` or `lease_seconds` as it needs.
pub fn lease_ref(lease: &Value) -> Value {
    json!({"provider": lease["provider"], "pool": lease["pool"], "key_id": lease["key_id"],
           "lease_id": lease["lease_id"]})
}

/// The release body for a granted lease (as returned by allocate): [`lease_ref`] reporting
/// `outcome`.
pub fn release_body(lease: &Value, outcome: &str) -> Value {
    let mut body = lease_ref(lease);
    body["outcome"] = json!(outcome);
    body
}

/// The renewal body for a granted lease: [`lease_ref`] for `lease_seconds` more seconds.
pub fn renew_body(lease: &Value, lease_seconds: u64) -> Value {
    let mut body = lease_ref(lease);
    body["lease_seconds"] = json!(lease_seconds);
    body
}
