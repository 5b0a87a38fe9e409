//! The service's configuration: every setting is a flag and an environment variable (clap with
//! `env`); `credpool --help` and the book's "Configuration" (docs/src/configuration.md) list them with defaults and units.
//!
//! `serve.rs` holds the service's settings (listener, limits, scoring, health, cleanup),
//! `database.rs` the database and master-key settings every command that reaches the database
//! shares. This file reads the `_FILE` settings: secrets from mounted files.

mod database;
mod serve;

use std::path::PathBuf;

pub use database::{DatabaseArgs, DbPooler, SecretArgs};
pub use serve::{
    HealthArgs, MaintenanceArgs, ScoringArgs, ServeArgs, ServiceArgs, ServiceSettings,
};

/// Sets `value` from the file at `path`, when one is named (`setting` names it in errors).
fn load_secret_file(
    value: &mut Option<String>,
    path: &Option<PathBuf>,
    setting: &str,
) -> anyhow::Result<()> {
    if let Some(path) = path {
        let text = read_secret_file(path, setting)?;
        let line = text.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            anyhow::bail!("{setting}: {} is empty", path.display());
        }
        if line.contains(['\n', '\r']) {
            anyhow::bail!(
                "{setting}: {} holds more than one line (it must hold the value alone)",
                path.display()
            );
        }
        *value = Some(line.to_owned());
    }
    Ok(())
}

/// The contents of a file holding a secret (`setting` names it in errors), refused when users
/// other than its owner and its group may read or write it, or its group may write it
/// (`mode & 0o027 != 0`): `chmod 600`, `400`, or `640`/`440` where a group must read it (a
/// Kubernetes pod's `fsGroup`). The mode is that of the file a symbolic link leads to (a
/// Kubernetes secret volume's files are links). Errors name the file and its mode, never its
/// contents.
pub fn read_secret_file(
    path: &std::path::Path,
    setting: &str,
) -> anyhow::Result<zeroize::Zeroizing<String>> {
    use std::os::unix::fs::PermissionsExt;
    let metadata = std::fs::metadata(path)
        .map_err(|e| anyhow::anyhow!("{setting}: cannot read {}: {e}", path.display()))?;
    if !metadata.is_file() {
        anyhow::bail!("{setting}: {} is not a file", path.display());
    }
    let mode = metadata.permissions().mode() & 0o777;
    if mode & 0o027 != 0 {
        anyhow::bail!(
            "{setting}: {} may be read or written by other users, or written by its group (mode \
             {mode:04o}); a file with a secret must be readable by its owner (and group) only: \
             chmod 600 {} (or 640 where a group must read it; on a Kubernetes secret volume, \
             defaultMode: 0400, or 0440 with the pod's fsGroup)",
            path.display(),
            path.display()
        );
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("{setting}: cannot read {}: {e}", path.display()))?;
    Ok(zeroize::Zeroizing::new(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn secret_file(contents: &str, mode: u32) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), contents).unwrap();
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        file
    }

    #[test]
    fn a_secret_file_gives_its_line_without_the_trailing_newline() {
        for contents in ["s3cret\n", "s3cret", "s3cret\r\n"] {
            let file = secret_file(contents, 0o600);
            let mut value = None;
            load_secret_file(&mut value, &Some(file.path().to_owned()), "X_FILE").unwrap();
            assert_eq!(value.as_deref(), Some("s3cret"), "{contents:?}");
        }
        // owner only, or owner and group (a Kubernetes secret volume with the pod's fsGroup)
        for mode in [0o400, 0o640, 0o440] {
            let file = secret_file("s3cret\n", mode);
            let mut value = None;
            load_secret_file(&mut value, &Some(file.path().to_owned()), "X_FILE").unwrap();
            assert_eq!(value.as_deref(), Some("s3cret"), "{mode:04o}");
        }
    }

    #[test]
    fn a_secret_file_others_may_read_is_refused_without_quoting_it() {
        for mode in [0o604, 0o644, 0o660, 0o606, 0o620, 0o601] {
            let file = secret_file("s3cret-value\n", mode);
            let mut value = None;
            let error = load_secret_file(&mut value, &Some(file.path().to_owned()), "X_FILE")
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("X_FILE") && error.contains("chmod 600"),
                "{error}"
            );
            assert!(error.contains(&format!("{mode:04o}")), "{error}");
            assert!(!error.contains("s3cret-value"), "{error}");
            assert_eq!(value, None);
        }
    }

    #[test]
    fn an_empty_or_multi_line_secret_file_is_refused() {
        for contents in ["", "\n", "one\ntwo\n"] {
            let file = secret_file(contents, 0o600);
            let mut value = None;
            assert!(
                load_secret_file(&mut value, &Some(file.path().to_owned()), "X_FILE").is_err(),
                "{contents:?}"
            );
        }
        let mut value = None;
        let missing = std::path::PathBuf::from("/nonexistent/credpool-secret");
        assert!(load_secret_file(&mut value, &Some(missing), "X_FILE").is_err());
    }
}
