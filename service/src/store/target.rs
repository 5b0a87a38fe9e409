//! Where PostgreSQL is: a `DATABASE_URL` that names one server, or several in libpq's multi-host
//! form, `postgres://user@host1:5432,host2:5433/db?target_session_attrs=read-write`, of which
//! credpool uses the one it can write to (`crate::store::failover` keeps it there).
//!
//! sqlx's connect options hold one host and its URL parser takes one, so [`Target::parse`] splits
//! the host list and gives sqlx one single-host URL per host, each with the rest of the URL as
//! written: user, password, database, percent-encoding and every query parameter but
//! `target_session_attrs` are parsed by sqlx exactly as for a single-host URL.
//!
//! # `target_session_attrs`
//! | value | one host | several hosts |
//! | --- | --- | --- |
//! | (absent) | no check: exactly as before | `read-write` |
//! | `read-write`, `primary` | checked | checked |
//! | `any` | no check | refused |
//! | `read-only`, `standby`, `prefer-standby` | refused | refused |
//!
//! "Checked" means a server credpool can write to: not in recovery and not read-only (libpq's
//! `read-write` tests `transaction_read_only`, its `primary` tests `pg_is_in_recovery()`; they
//! differ only on a primary whose transactions default to read-only, which a service that writes
//! cannot use either way, so credpool asks both of both). Every value that would let credpool land
//! on a standby is refused: credpool writes every lease.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

/// Which servers credpool may use (from `target_session_attrs`, see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAttrs {
    /// Whatever the one host is: no check (a single-host URL without `target_session_attrs`, or
    /// with `any`; the embedded default).
    Unchecked,
    /// Only a server credpool can write to: not in recovery, transactions not read-only
    /// (`read-write`, `primary`, and the default for several hosts).
    Writable,
}

/// A `DATABASE_URL` (or `--db-listen-url`) that does not say where a writable PostgreSQL is. The
/// message never quotes the URL (it may hold a password).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TargetError(String);

/// The servers a URL names, in its order, and which of them credpool may use.
#[derive(Clone)]
pub struct Target {
    hosts: Vec<PgConnectOptions>,
    attrs: SessionAttrs,
}

/// Names the servers (`host:port`), the user, the database and the session attributes, never
/// the password (sqlx's own `Debug` of the connect options shows it).
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|h| format!("{}:{}", h.get_host(), h.get_port()))
            .collect();
        let first = self.hosts.first();
        f.debug_struct("Target")
            .field("hosts", &hosts)
            .field("user", &first.map(|h| h.get_username()))
            .field("database", &first.and_then(|h| h.get_database()))
            .field("attrs", &self.attrs)
            .finish()
    }
}

/// The query parameter credpool reads itself (sqlx does not know it).
const SESSION_ATTRS: &str = "target_session_attrs";

impl Target {
    /// Parses a `postgres://` or `postgresql://` URL with one host or a comma-separated list of
    /// `host[:port]` (IPv6 in brackets; a host without a port gets sqlx's default, `PGPORT` or
    /// 5432), and `target_session_attrs` as the module docs say.
    ///
    /// # Errors
    /// A URL sqlx cannot parse (for any of its hosts), a refused or unknown
    /// `target_session_attrs`, and with several hosts a `host`, `hostaddr` or `port` query
    /// parameter (it would point every entry of the list at one server).
    pub fn parse(url: &str) -> Result<Self, TargetError> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            TargetError("DATABASE_URL is not a valid PostgreSQL URL: expected postgres://…".into())
        })?;
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, host_list) = match authority.rfind('@') {
            Some(at) => authority.split_at(at + 1),
            None => ("", authority),
        };
        let (path, query, fragment) = split_tail(tail);
        let entries: Vec<&str> = host_list.split(',').collect();
        let multi = entries.len() > 1;

        let mut attrs = None;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let (key, value) = (percent_decoded(key), percent_decoded(value));
            match key.as_str() {
                SESSION_ATTRS => {
                    attrs = Some(value);
                    continue;
                }
                "host" | "hostaddr" | "port" if multi => {
                    return Err(TargetError(format!(
                        "a DATABASE_URL with several hosts names each host and its port in the \
                         host list (postgres://user@host1:5432,host2:5433/db): drop its `{key}` \
                         parameter"
                    )));
                }
                "host" | "hostaddr" | "port" if value.contains(',') => {
                    return Err(TargetError(format!(
                        "several hosts in the `{key}` parameter are not supported: list them in \
                         the URL's host list instead (postgres://user@host1:5432,host2:5433/db)"
                    )));
                }
                _ => kept.push(pair),
            }
        }
        let attrs = match attrs.as_deref() {
            None if multi => SessionAttrs::Writable,
            None => SessionAttrs::Unchecked,
            Some("any") if !multi => SessionAttrs::Unchecked,
            Some("read-write" | "primary") => SessionAttrs::Writable,
            Some(refused @ ("any" | "read-only" | "standby" | "prefer-standby")) => {
                return Err(TargetError(format!(
                    "target_session_attrs={refused} would let credpool use a server it cannot \
                     write to, and credpool writes every lease: use read-write or primary (the \
                     default for a URL with several hosts is read-write)"
                )));
            }
            Some(other) => {
                return Err(TargetError(format!(
                    "target_session_attrs={other} is not one of libpq's values; credpool accepts \
                     read-write or primary (any, with one host)"
                )));
            }
        };

        let query = if kept.is_empty() {
            String::new()
        } else {
            format!("?{}", kept.join("&"))
        };
        let hosts = entries
            .iter()
            .map(|entry| {
                let single = format!("{scheme}://{userinfo}{entry}{path}{query}{fragment}");
                PgConnectOptions::from_str(&single).map_err(|error| {
                    let which = if multi {
                        format!(" (host `{entry}`)")
                    } else {
                        String::new()
                    };
                    TargetError(format!(
                        "DATABASE_URL is not a valid PostgreSQL URL{which}: {error}"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { hosts, attrs })
    }

    /// One server, used as it is (no check): the embedded default.
    pub fn single(options: PgConnectOptions) -> Self {
        Self {
            hosts: vec![options],
            attrs: SessionAttrs::Unchecked,
        }
    }

    /// The servers' connect options, in the URL's order (at least one).
    pub fn hosts(&self) -> &[PgConnectOptions] {
        &self.hosts
    }

    /// Which servers credpool may use.
    pub fn attrs(&self) -> SessionAttrs {
        self.attrs
    }

    /// Whether connections must be checked (and the writable server searched for).
    pub fn checks(&self) -> bool {
        self.attrs == SessionAttrs::Writable
    }

    /// The same target with `change` applied to every server's options (a statement timeout,
    /// no statement cache).
    pub fn map(self, change: impl Fn(PgConnectOptions) -> PgConnectOptions) -> Self {
        Self {
            hosts: self.hosts.into_iter().map(change).collect(),
            attrs: self.attrs,
        }
    }

    /// `host:port` of every server, for logs and errors.
    pub fn describe(&self) -> String {
        self.hosts
            .iter()
            .map(host_port)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `host:port` (or the socket directory) of one server's options, for logs and errors.
pub(crate) fn host_port(options: &PgConnectOptions) -> String {
    match options.get_socket() {
        Some(socket) => format!("{}:{}", socket.display(), options.get_port()),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    }
}

/// Splits what follows the authority into path (with its `/`), query (without its `?`) and
/// fragment (with its `#`).
fn split_tail(tail: &str) -> (&str, &str, &str) {
    let (rest, fragment) = match tail.find('#') {
        Some(at) => tail.split_at(at),
        None => (tail, ""),
    };
    match rest.split_once('?') {
        Some((path, query)) => (path, query, fragment),
        None => (rest, "", fragment),
    }
}

/// `%XX` escapes decoded (what sqlx does to query keys and values); anything malformed is kept.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(high), Some(low)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((high * 16 + low) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Target {
        Target::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    fn refusal(url: &str) -> String {
        match Target::parse(url) {
            Err(TargetError(message)) => message,
            Ok(target) => panic!("{url} was accepted: {target:?}"),
        }
    }

    fn ends(target: &Target) -> Vec<(String, u16)> {
        target
            .hosts()
            .iter()
            .map(|o| (o.get_host().to_owned(), o.get_port()))
            .collect()
    }

    #[test]
    fn a_single_host_url_is_sqlx_s_own_parse_and_unchecked() {
        let url = "postgres://credpool:secret@db.internal:6543/leases?sslmode=disable&application_name=cp";
        let target = parse(url);
        assert_eq!(target.attrs(), SessionAttrs::Unchecked);
        assert_eq!(target.hosts().len(), 1);
        let ours = format!("{:?}", target.hosts()[0]);
        let sqlx = format!("{:?}", PgConnectOptions::from_str(url).unwrap());
        assert_eq!(ours, sqlx, "the same options as sqlx's own parse");
    }

    #[test]
    fn several_hosts_keep_their_order_and_ports_and_default_to_read_write() {
        let target = parse("postgres://u@h1:5432,h2:5433,[::1]:5434/db");
        assert_eq!(target.attrs(), SessionAttrs::Writable);
        assert_eq!(
            ends(&target),
            [
                ("h1".into(), 5432),
                ("h2".into(), 5433),
                ("[::1]".into(), 5434)
            ]
        );
        assert_eq!(target.describe(), "h1:5432, h2:5433, [::1]:5434");
    }

    #[test]
    fn a_host_without_a_port_gets_sqlx_s_default_port() {
        let default = PgConnectOptions::new().get_port();
        let target = parse("postgresql://u@h1,h2:5433/db");
        assert_eq!(ends(&target), [("h1".into(), default), ("h2".into(), 5433)]);
    }

    #[test]
    fn user_password_database_and_parameters_reach_every_host_decoded() {
        let target = parse(
            "postgres://us%40er:p%3Ass%2Fw@h1:1,h2:2/my%20db?sslmode=disable\
             &application_name=credpool&options=-c%20search_path%3Dcp&target_session_attrs=primary",
        );
        assert_eq!(target.attrs(), SessionAttrs::Writable);
        for host in target.hosts() {
            assert_eq!(host.get_username(), "us@er");
            assert_eq!(host.get_database(), Some("my db"));
            assert!(matches!(
                host.get_ssl_mode(),
                sqlx::postgres::PgSslMode::Disable
            ));
            assert_eq!(host.get_application_name(), Some("credpool"));
            assert_eq!(host.get_options(), Some("-c search_path=cp"));
        }
        // the password is passed through too (sqlx has no getter; its Debug shows it)
        assert!(format!("{:?}", target.hosts()[1]).contains("p:ss/w"));
    }

    #[test]
    fn target_session_attrs_is_read_here_and_not_passed_to_sqlx() {
        let target = parse("postgres://u@h1:1/db?target_session_attrs=read-write&sslmode=require");
        assert_eq!(target.attrs(), SessionAttrs::Writable);
        assert!(matches!(
            target.hosts()[0].get_ssl_mode(),
            sqlx::postgres::PgSslMode::Require
        ));
        let percent = parse("postgres://u@h1:1,h2:2/db?target_session_attrs=read%2Dwrite");
        assert_eq!(percent.attrs(), SessionAttrs::Writable);
        let any = parse("postgres://u@h1:1/db?target_session_attrs=any");
        assert_eq!(any.attrs(), SessionAttrs::Unchecked);
    }

    #[test]
    fn values_that_allow_a_standby_are_refused() {
        for value in ["read-only", "standby", "prefer-standby"] {
            let message = refusal(&format!(
                "postgres://u@h1:1/db?target_session_attrs={value}"
            ));
            assert!(
                message.contains(value) && message.contains("read-write"),
                "{message}"
            );
        }
        let message = refusal("postgres://u@h1:1,h2:2/db?target_session_attrs=any");
        assert!(message.contains("any"), "{message}");
        let message = refusal("postgres://u@h1:1/db?target_session_attrs=sometimes");
        assert!(message.contains("not one of libpq's values"), "{message}");
    }

    #[test]
    fn host_and_port_parameters_cannot_mix_with_a_host_list() {
        let message = refusal("postgres://u@h1:1,h2:2/db?port=5432");
        assert!(message.contains("`port`"), "{message}");
        let message = refusal("postgres://u@localhost/db?host=h1,h2");
        assert!(message.contains("several hosts"), "{message}");
        // one socket directory in `host` is still sqlx's business
        let socket = parse("postgres://u@localhost/db?host=/run/postgresql&port=5433");
        assert_eq!(
            socket.hosts()[0]
                .get_socket()
                .map(|p| p.display().to_string()),
            Some("/run/postgresql".into())
        );
    }

    #[test]
    fn its_debug_form_names_the_hosts_but_never_the_password() {
        let target = Target::parse(
            "postgres://app:s3cr3t-pw@db1:5432,db2:5433/pool?target_session_attrs=primary",
        )
        .unwrap();
        let shown = format!("{target:?}");
        assert!(
            shown.contains("db1:5432") && shown.contains("db2:5433"),
            "{shown}"
        );
        assert!(!shown.contains("s3cr3t-pw"), "{shown}");
    }

    #[test]
    fn errors_name_the_bad_host_but_never_the_password() {
        let message = refusal("postgres://u:hunter2@h1:1,h2:notaport/db");
        assert!(message.contains("h2:notaport"), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
        let message = refusal("mysql-ish");
        assert!(message.contains("postgres://"), "{message}");
    }

    #[test]
    fn percent_decoding_keeps_malformed_escapes() {
        assert_eq!(percent_decoded("read%2Dwrite"), "read-write");
        assert_eq!(percent_decoded("100%"), "100%");
        assert_eq!(percent_decoded("%zz%4"), "%zz%4");
    }
}
