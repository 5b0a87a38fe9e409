//! The executor API's JSON: request bodies, and the parsing of answers.
//!
//! Answers are read into a `serde_json::Value` first and then picked apart by hand, so that a
//! parse error can name the field that was wrong without quoting its value (a derived
//! `Deserialize` would say `invalid type: string "sk-..."`, and the value may be a secret).

use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::api::{NotReleased, Released};

/// `POST /api/internal/allocate-key` body.
#[derive(Debug, Serialize)]
pub(crate) struct AllocateBody<'a> {
    pub provider: &'a str,
    pub model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_seconds: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder: Option<&'a str>,
    pub request_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_ttl_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_mode: Option<&'static str>,
}

/// The lease a renewal or a release names, with the fence it was granted: the fields both
/// bodies open with.
#[derive(Debug, Serialize)]
pub(crate) struct LeaseBody<'a> {
    pub provider: &'a str,
    pub pool: &'a str,
    pub key_id: &'a str,
    pub lease_id: &'a str,
    pub fence: u64,
}

/// `POST /api/internal/renew-lease` body.
#[derive(Debug, Serialize)]
pub(crate) struct RenewBody<'a> {
    #[serde(flatten)]
    pub lease: LeaseBody<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_seconds: Option<u32>,
}

/// `POST /api/internal/release-key` body.
#[derive(Debug, Serialize)]
pub(crate) struct ReleaseBody<'a> {
    #[serde(flatten)]
    pub lease: LeaseBody<'a>,
    pub outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
}

/// A release's `usage`: the tokens the call really used.
#[derive(Debug, Serialize)]
pub(crate) struct UsageBody {
    pub tokens: u64,
}

/// A 200 answer to allocate, checked.
#[derive(Debug)]
pub(crate) struct Granted {
    pub key_id: String,
    pub lease_id: String,
    pub fence: u64,
    pub provider: String,
    pub pool: String,
    pub provider_model: String,
    pub lease_until: OffsetDateTime,
    pub probe: bool,
    /// The length, in seconds, the server granted the lease for (and extends it by on each
    /// renewal that names none); `None` from servers that do not send it.
    pub lease_seconds: Option<u32>,
    /// `hit`, `new`, `moved` (a request with an affinity key); `None` when absent.
    pub affinity: Option<String>,
    /// Always a JSON object.
    pub credential: Value,
}

/// Parses a 200 answer to allocate. The error says which field was wrong, never its value.
pub(crate) fn parse_granted(body: &[u8]) -> Result<Granted, String> {
    let mut object = object_of(body)?;
    let credential = match object.remove("credential") {
        Some(value @ Value::Object(_)) => value,
        Some(_) => return Err("field `credential` is not a JSON object".into()),
        None => return Err("field `credential` is missing".into()),
    };
    let lease_id = text(&object, "lease_id")?;
    if lease_id.len() != 32 || !lease_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("field `lease_id` is not 32 hex digits".into());
    }
    let fence = object
        .get("fence")
        .and_then(Value::as_u64)
        .filter(|&fence| fence > 0)
        .ok_or("field `fence` is missing or not a positive integer")?;
    let key_id = text(&object, "key_id")?;
    if key_id.is_empty() {
        return Err("field `key_id` is empty".into());
    }
    Ok(Granted {
        key_id: key_id.to_owned(),
        lease_id: lease_id.to_owned(),
        fence,
        provider: text(&object, "provider")?.to_owned(),
        pool: text(&object, "pool")?.to_owned(),
        provider_model: text(&object, "provider_model")?.to_owned(),
        lease_until: instant(&object, "lease_until")?,
        probe: object
            .get("probe")
            .and_then(Value::as_bool)
            .ok_or("field `probe` is missing or not a boolean")?,
        lease_seconds: granted_seconds(&object)?,
        affinity: match object.get("affinity") {
            None | Some(Value::Null) => None,
            Some(Value::String(result)) => Some(result.clone()),
            Some(_) => return Err("field `affinity` is not a string".into()),
        },
        credential,
    })
}

/// The grant's optional `lease_seconds`: absent from servers older than the field, else a
/// positive integer that fits a `u32` (the server's own limit is a day).
fn granted_seconds(object: &Map<String, Value>) -> Result<Option<u32>, String> {
    let Some(value) = object.get("lease_seconds") else {
        return Ok(None);
    };
    value
        .as_u64()
        .filter(|&seconds| seconds > 0)
        .and_then(|seconds| u32::try_from(seconds).ok())
        .map(Some)
        .ok_or_else(|| "field `lease_seconds` is not a positive integer below 2^32".into())
}

/// Parses a 200 answer to renew: the lease's new end.
pub(crate) fn parse_renewed(body: &[u8]) -> Result<OffsetDateTime, String> {
    instant(&object_of(body)?, "lease_until")
}

/// Parses a 200 answer to release. An unknown `reason` is kept as [`NotReleased::Other`].
pub(crate) fn parse_released(body: &[u8]) -> Result<Released, String> {
    let object = object_of(body)?;
    let released = object
        .get("released")
        .and_then(Value::as_bool)
        .ok_or("field `released` is missing or not a boolean")?;
    let reason = match object.get("reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(reason)) => Some(NotReleased::from_wire(reason)),
        Some(_) => return Err("field `reason` is not a string".into()),
    };
    Ok(Released { released, reason })
}

/// The `(code, message)` of a credpool error body `{"error":{"code","message"}}`, or `None` when
/// the body is not one (HTML from a proxy, no code, ...). A missing message is empty.
pub(crate) fn parse_error_body(body: &[u8]) -> Option<(String, String)> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let error = value.get("error")?;
    let code = error
        .get("code")?
        .as_str()
        .filter(|code| !code.is_empty())?;
    let message = error.get("message").and_then(Value::as_str).unwrap_or("");
    Some((code.to_owned(), message.to_owned()))
}

/// A 429's `Retry-After` in whole seconds, at least 1 s. A missing header, an HTTP date or
/// anything else that is not a number of seconds counts as 1 s: credpool always sends seconds.
pub(crate) fn retry_after(header: Option<&str>) -> Duration {
    let seconds = header
        .and_then(|value| value.trim().parse::<u64>().ok())
        .unwrap_or(1);
    Duration::from_secs(seconds.max(1))
}

fn object_of(body: &[u8]) -> Result<Map<String, Value>, String> {
    // serde_json's syntax errors give a position, never the input.
    match serde_json::from_slice(body) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(_) => Err("the body is JSON but not an object".into()),
        Err(error) => Err(format!("the body is not JSON ({error})")),
    }
}

fn text<'a>(object: &'a Map<String, Value>, field: &str) -> Result<&'a str, String> {
    object
        .get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("field `{field}` is missing or not a string"))
}

fn instant(object: &Map<String, Value>, field: &str) -> Result<OffsetDateTime, String> {
    OffsetDateTime::parse(text(object, field)?, &Rfc3339)
        .map_err(|_| format!("field `{field}` is not an RFC 3339 timestamp"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn granted() -> Value {
        json!({
            "key_id": "k1", "lease_id": "0123456789abcdef0123456789ABCDEF", "fence": 7,
            "provider": "openai", "pool": "default", "provider_model": "gpt-4o",
            "lease_until": "2030-01-01T00:00:35Z", "probe": false,
            "credential": {"api_key": "sk-SECRET"}
        })
    }

    fn parse(value: &Value) -> Result<Granted, String> {
        parse_granted(value.to_string().as_bytes())
    }

    #[test]
    fn a_well_formed_grant_parses() {
        let granted = parse(&granted()).expect("parses");
        assert_eq!(granted.fence, 7);
        assert_eq!(granted.pool, "default");
        assert_eq!(granted.credential["api_key"], "sk-SECRET");
        assert_eq!(granted.lease_seconds, None, "older servers do not send it");
    }

    #[test]
    fn the_granted_lease_length_is_read_when_present() {
        let mut body = granted();
        body["lease_seconds"] = json!(6);
        assert_eq!(parse(&body).expect("parses").lease_seconds, Some(6));
        body["lease_seconds"] = json!(u32::MAX);
        assert_eq!(parse(&body).expect("parses").lease_seconds, Some(u32::MAX));
    }

    #[test]
    fn malformed_grants_name_the_field_but_never_the_value() {
        let cases: Vec<(&str, Value)> = vec![
            ("fence", json!(null)),
            ("fence", json!(0)),
            ("fence", json!(-3)),
            ("fence", json!("sk-SECRET")),
            ("lease_id", json!("sk-SECRET")),
            ("lease_id", json!("0123456789abcdef0123456789abcdeg")),
            ("lease_until", json!("sk-SECRET")),
            ("credential", json!("sk-SECRET")),
            ("key_id", json!("")),
            ("probe", json!("yes")),
            ("lease_seconds", json!(0)),
            ("lease_seconds", json!(-6)),
            ("lease_seconds", json!(6.5)),
            ("lease_seconds", json!("sk-SECRET")),
            ("lease_seconds", json!(null)),
            ("lease_seconds", json!(true)),
            ("lease_seconds", json!(1_u64 << 32)),
        ];
        for (field, bad) in cases {
            let mut body = granted();
            body[field] = bad.clone();
            let detail = parse(&body).expect_err(field);
            assert!(detail.contains(field), "{field}={bad}: {detail}");
            assert!(!detail.contains("SECRET"), "{detail}");
        }
        let mut body = granted();
        body.as_object_mut().map(|o| o.remove("fence"));
        assert!(parse(&body).is_err());
        assert!(parse_granted(b"<html>sk-SECRET</html>").is_err());
        assert!(parse_granted(b"[1,2]").is_err());
    }

    #[test]
    fn release_reasons_parse_and_unknown_ones_are_kept() {
        let parsed = |body: &str| parse_released(body.as_bytes()).expect(body);
        assert_eq!(
            parsed(r#"{"released":true}"#),
            Released {
                released: true,
                reason: None
            }
        );
        assert_eq!(
            parsed(r#"{"released":false,"reason":"expired"}"#).reason,
            Some(NotReleased::Expired)
        );
        assert_eq!(
            parsed(r#"{"released":false,"reason":"mismatch"}"#).reason,
            Some(NotReleased::Mismatch)
        );
        assert_eq!(
            parsed(r#"{"released":false,"reason":"not_found"}"#).reason,
            Some(NotReleased::NotFound)
        );
        assert_eq!(
            parsed(r#"{"released":false,"reason":"moon_phase"}"#).reason,
            Some(NotReleased::Other("moon_phase".into()))
        );
        assert!(parse_released(br#"{"reason":"expired"}"#).is_err());
    }

    #[test]
    fn error_bodies_need_a_code() {
        assert_eq!(
            parse_error_body(br#"{"error":{"code":"lease_lost","message":"gone"}}"#),
            Some(("lease_lost".into(), "gone".into()))
        );
        assert_eq!(
            parse_error_body(br#"{"error":{"code":"lease_lost"}}"#),
            Some(("lease_lost".into(), String::new()))
        );
        assert_eq!(parse_error_body(br#"{"error":{"message":"x"}}"#), None);
        assert_eq!(parse_error_body(br#"{"error":{"code":""}}"#), None);
        assert_eq!(parse_error_body(b"<html></html>"), None);
    }

    #[test]
    fn bodies_leave_out_unset_fields() {
        let body = AllocateBody {
            provider: "openai",
            model: "gpt-4o",
            pool: None,
            lease_seconds: None,
            holder: None,
            request_id: "r",
            wait_ms: None,
            tokens: None,
            affinity_key: None,
            affinity_ttl_seconds: None,
            affinity_mode: None,
        };
        assert_eq!(
            serde_json::to_value(&body).expect("serializes"),
            json!({"provider": "openai", "model": "gpt-4o", "request_id": "r"})
        );
    }
}
