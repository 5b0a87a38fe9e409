//! Resealing secrets under the current master key, and which keys sealed them.

use super::{Actor, audit, lock_credentials};
use crate::domain::KeyId;
use crate::secrets::Keyring;
use crate::store::Db;
use crate::store::leases::decoded;

/// Seals under the keyring's current key every secret still stored as plaintext (written before
/// secrets were sealed) and, unless `plaintext_only`, every secret and every OAuth grant sealed
/// under an older master key; in batches of 500, one transaction each. Returns how many were
/// resealed (secrets and grants). Audited `secret_resealed`.
pub async fn reseal(
    db: &Db,
    keyring: &Keyring,
    plaintext_only: bool,
    actor: &Actor,
) -> Result<usize, sqlx::Error> {
    let mut resealed = 0;
    let mut after = String::new();
    loop {
        let mut tx = db.begin().await?;
        // a new secret is a gate of the claim (trigger credentials_config_version writes the
        // version into the slot rows): lock in the lock order, slot rows first
        let batch = sqlx::query_scalar!(
            r#"SELECT key_id AS "key_id!" FROM credentials WHERE key_id > $1 ORDER BY key_id LIMIT 500"#,
            after
        )
        .fetch_all(&mut *tx)
        .await?;
        let Some(last) = batch.last() else { break };
        after = last.clone();
        let batch: Vec<&str> = batch.iter().map(String::as_str).collect();
        lock_credentials(&mut tx, &batch).await?;
        let rows = sqlx::query!(
            r#"
            SELECT key_id, secret, secret_ciphertext
            FROM credentials
            WHERE key_id = ANY ($1)
            ORDER BY key_id
            "#,
            &batch as &[&str]
        )
        .fetch_all(&mut *tx)
        .await?;
        for row in rows {
            let key_id = decoded(KeyId::parse(row.key_id))?;
            let secret = match (row.secret, row.secret_ciphertext) {
                (Some(plain), _) => decoded(crate::domain::Secret::parse(plain))?,
                (None, Some(sealed)) if !plaintext_only && !keyring.is_current(&sealed) => keyring
                    .open(&key_id, &sealed)
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                _ => continue,
            };
            let sealed = keyring.seal(&key_id, &secret);
            sqlx::query!(
                "UPDATE credentials SET secret = NULL, secret_ciphertext = $2 WHERE key_id = $1",
                key_id.as_str(),
                &sealed
            )
            .execute(&mut *tx)
            .await?;
            let details = serde_json::json!({"master_key": keyring.current().fingerprint()});
            audit(
                &mut tx,
                &key_id,
                "secret_resealed",
                actor,
                "secret sealed under the current master key",
                details,
            )
            .await?;
            resealed += 1;
        }
        // the OAuth grants (refresh token, client secret) of the batch: their rows come after
        // the credential rows in the lock order; a refresher's write waits for this commit
        if !plaintext_only {
            let grants = sqlx::query!(
                r#"
                SELECT key_id, refresh_ciphertext FROM oauth_credentials
                WHERE key_id = ANY ($1)
                ORDER BY key_id
                FOR UPDATE
                "#,
                &batch as &[&str]
            )
            .fetch_all(&mut *tx)
            .await?;
            for grant in grants {
                if keyring.is_current(&grant.refresh_ciphertext) {
                    continue;
                }
                let key_id = decoded(KeyId::parse(grant.key_id))?;
                let opened = keyring
                    .open_oauth(&key_id, &grant.refresh_ciphertext)
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
                sqlx::query!(
                    "UPDATE oauth_credentials SET refresh_ciphertext = $2 WHERE key_id = $1",
                    key_id.as_str(),
                    &keyring.seal_oauth(&key_id, &opened)
                )
                .execute(&mut *tx)
                .await?;
                let details = serde_json::json!({"master_key": keyring.current().fingerprint(),
                                                 "sealed": "oauth_grant"});
                audit(
                    &mut tx,
                    &key_id,
                    "secret_resealed",
                    actor,
                    "OAuth grant sealed under the current master key",
                    details,
                )
                .await?;
                resealed += 1;
            }
        }
        tx.commit().await?;
    }
    Ok(resealed)
}

/// Master key fingerprints (hex) that sealed secrets and OAuth grants need, with how many sealed
/// values need each.
pub async fn sealing_keys(db: &Db) -> Result<Vec<(String, i64)>, sqlx::Error> {
    let mut work = db.work().await?;
    let rows = sqlx::query!(
        r#"
        SELECT encode(substring(sealed FROM 4 FOR 8), 'hex') AS "fingerprint!", count(*) AS "count!"
        FROM (SELECT secret_ciphertext AS sealed FROM credentials WHERE secret_ciphertext IS NOT NULL
              UNION ALL
              SELECT refresh_ciphertext FROM oauth_credentials) AS s
        GROUP BY 1
        "#
    )
    .fetch_all(&mut *work)
    .await?;
    work.done().await?;
    Ok(rows.into_iter().map(|r| (r.fingerprint, r.count)).collect())
}
