//! Credential secrets at rest: sealed with XChaCha20-Poly1305 (RustCrypto's `chacha20poly1305`)
//! under a master key from configuration. Each secret gets its own random 192-bit nonce, and the
//! credential's `key_id` is the associated data, so a ciphertext copied into another row fails to
//! open.
//!
//! Sealed format (the `credentials.secret_ciphertext` column):
//! `b"cp1"` | the master key's fingerprint (8 bytes) | nonce (24 bytes) | ciphertext and tag.
//! The fingerprint (the first 8 bytes of SHA-256 of the key) picks the key that opens it, which
//! makes rotation possible: configure the new key as current and the old one as previous, run
//! `credpool keys reencrypt`, then drop the old key.

use std::fmt;

use base64::Engine;
use chacha20poly1305::aead::{Aead, Payload};
use chacha20poly1305::{KeyInit, XChaCha20Poly1305, XNonce};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::domain::{KeyId, Secret};

const MAGIC: &[u8; 3] = b"cp1";
const FINGERPRINT_LEN: usize = 8;
const NONCE_LEN: usize = 24;
const HEADER_LEN: usize = MAGIC.len() + FINGERPRINT_LEN + NONCE_LEN;

/// Why a master key or a sealed secret was refused. Never carries key or secret material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretsError {
    /// A master key is not 32 bytes written as 64 hex digits or base64.
    #[error("a master key must be 32 bytes, written as 64 hexadecimal digits or in base64")]
    BadMasterKey,
    /// The sealed bytes are not in credpool's format.
    #[error("the stored secret is not in credpool's sealed format")]
    Malformed,
    /// The secret was sealed under a master key that is not configured.
    #[error("the stored secret was sealed under master key {fingerprint}, which is not configured")]
    UnknownKey {
        /// The fingerprint of the key it needs (hex).
        fingerprint: String,
    },
    /// Authentication failed: wrong key, tampered bytes, or a ciphertext moved to another row.
    #[error("the stored secret failed authentication (tampered, or moved from another credential)")]
    Forged,
}

/// A 256-bit master key. `Debug` shows only its fingerprint; the bytes are wiped on drop.
#[derive(Clone)]
pub struct MasterKey {
    bytes: Zeroizing<[u8; 32]>,
    fingerprint: [u8; FINGERPRINT_LEN],
}

impl MasterKey {
    /// Parses 64 hex digits or standard base64 of 32 bytes (surrounding whitespace ignored).
    pub fn parse(text: &str) -> Result<Self, SecretsError> {
        let text = text.trim();
        let decoded = Zeroizing::new(
            if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
                hex::decode(text).map_err(|_| SecretsError::BadMasterKey)?
            } else {
                base64::engine::general_purpose::STANDARD
                    .decode(text)
                    .map_err(|_| SecretsError::BadMasterKey)?
            },
        );
        let bytes: [u8; 32] = decoded
            .as_slice()
            .try_into()
            .map_err(|_| SecretsError::BadMasterKey)?;
        Ok(Self::from_bytes(bytes))
    }

    /// A fresh random key.
    pub fn generate() -> Self {
        Self::from_bytes(rand::random())
    }

    fn from_bytes(bytes: [u8; 32]) -> Self {
        let digest = Sha256::digest(bytes);
        let mut fingerprint = [0; FINGERPRINT_LEN];
        fingerprint.copy_from_slice(&digest[..FINGERPRINT_LEN]);
        Self {
            bytes: Zeroizing::new(bytes),
            fingerprint,
        }
    }

    /// The key as 64 hex digits, for writing a generated key to its file.
    pub fn to_hex(&self) -> Zeroizing<String> {
        Zeroizing::new(hex::encode(*self.bytes))
    }

    /// The fingerprint in hex (safe to log: it identifies the key, it does not reveal it).
    pub fn fingerprint(&self) -> String {
        hex::encode(self.fingerprint)
    }

    fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new(&(*self.bytes).into())
    }
}

impl fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MasterKey(fingerprint {})", self.fingerprint())
    }
}

/// The master keys a service knows: the current one seals; it and the previous ones open.
#[derive(Debug, Clone)]
pub struct Keyring {
    current: MasterKey,
    previous: Vec<MasterKey>,
}

impl Keyring {
    /// A keyring that seals with `current` and also opens what `previous` sealed.
    pub fn new(current: MasterKey, previous: Vec<MasterKey>) -> Self {
        Self { current, previous }
    }

    /// The key new secrets are sealed with.
    pub fn current(&self) -> &MasterKey {
        &self.current
    }

    /// Every key this keyring opens with.
    pub fn keys(&self) -> impl Iterator<Item = &MasterKey> {
        std::iter::once(&self.current).chain(&self.previous)
    }

    /// Seals `secret` for the credential `key_id` under the current key, with a fresh nonce.
    pub fn seal(&self, key_id: &KeyId, secret: &Secret) -> Vec<u8> {
        self.seal_with(key_id.as_str().as_bytes(), secret)
    }

    /// Seals the OAuth grant material of `key_id` (refresh token, client secret): associated
    /// data `<key_id>/oauth`, so that it never opens as the secret executors receive, and the
    /// executors' secret never opens as it.
    pub fn seal_oauth(&self, key_id: &KeyId, secret: &Secret) -> Vec<u8> {
        self.seal_with(oauth_aad(key_id).as_bytes(), secret)
    }

    /// Opens what [`Keyring::seal_oauth`] sealed for `key_id`.
    pub fn open_oauth(&self, key_id: &KeyId, sealed: &[u8]) -> Result<Secret, SecretsError> {
        self.open_with(oauth_aad(key_id).as_bytes(), sealed)
    }

    fn seal_with(&self, aad: &[u8], secret: &Secret) -> Vec<u8> {
        let plaintext = Zeroizing::new(serde_json::to_vec(secret.expose()).unwrap_or_default());
        let nonce_bytes: [u8; NONCE_LEN] = rand::random();
        let nonce = XNonce::from(nonce_bytes);
        let ciphertext = self
            .current
            .cipher()
            .encrypt(
                &nonce,
                Payload {
                    msg: &plaintext,
                    aad,
                },
            )
            .expect("XChaCha20-Poly1305 encryption of an in-memory buffer cannot fail");
        let mut sealed = Vec::with_capacity(HEADER_LEN + ciphertext.len());
        sealed.extend_from_slice(MAGIC);
        sealed.extend_from_slice(&self.current.fingerprint);
        sealed.extend_from_slice(&nonce_bytes);
        sealed.extend_from_slice(&ciphertext);
        sealed
    }

    /// Opens a secret sealed for `key_id`.
    pub fn open(&self, key_id: &KeyId, sealed: &[u8]) -> Result<Secret, SecretsError> {
        self.open_with(key_id.as_str().as_bytes(), sealed)
    }

    fn open_with(&self, aad: &[u8], sealed: &[u8]) -> Result<Secret, SecretsError> {
        let fingerprint = sealed_fingerprint(sealed)?;
        let key = self
            .keys()
            .find(|k| k.fingerprint == fingerprint)
            .ok_or_else(|| SecretsError::UnknownKey {
                fingerprint: hex::encode(fingerprint),
            })?;
        let nonce_bytes: [u8; NONCE_LEN] = sealed[MAGIC.len() + FINGERPRINT_LEN..HEADER_LEN]
            .try_into()
            .map_err(|_| SecretsError::Malformed)?;
        let plaintext = Zeroizing::new(
            key.cipher()
                .decrypt(
                    &XNonce::from(nonce_bytes),
                    Payload {
                        msg: &sealed[HEADER_LEN..],
                        aad,
                    },
                )
                .map_err(|_| SecretsError::Forged)?,
        );
        let value: serde_json::Value =
            serde_json::from_slice(&plaintext).map_err(|_| SecretsError::Malformed)?;
        Secret::parse(value).map_err(|_| SecretsError::Malformed)
    }

    /// Whether `sealed` is sealed under the current key (else `credpool keys reencrypt` would
    /// reseal it).
    pub fn is_current(&self, sealed: &[u8]) -> bool {
        sealed_fingerprint(sealed).is_ok_and(|f| f == self.current.fingerprint)
    }

    /// Whether some key of this keyring can open `sealed` (checked at start-up for every row).
    pub fn knows(&self, sealed: &[u8]) -> bool {
        sealed_fingerprint(sealed).is_ok_and(|f| self.keys().any(|k| k.fingerprint == f))
    }
}

fn oauth_aad(key_id: &KeyId) -> String {
    format!("{}/oauth", key_id.as_str())
}

fn sealed_fingerprint(sealed: &[u8]) -> Result<[u8; FINGERPRINT_LEN], SecretsError> {
    if sealed.len() < HEADER_LEN + 16 || &sealed[..MAGIC.len()] != MAGIC {
        return Err(SecretsError::Malformed);
    }
    sealed[MAGIC.len()..MAGIC.len() + FINGERPRINT_LEN]
        .try_into()
        .map_err(|_| SecretsError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> Secret {
        Secret::parse(serde_json::json!({"api_key": "sk-top-secret-1234"})).unwrap()
    }

    fn key_id(id: &str) -> KeyId {
        KeyId::parse(id).unwrap()
    }

    #[test]
    fn sealed_secrets_open_and_never_contain_the_plaintext() {
        let ring = Keyring::new(MasterKey::generate(), vec![]);
        let sealed = ring.seal(&key_id("a"), &secret());
        assert!(!sealed.windows(6).any(|w| w == b"sk-top"));
        assert_eq!(ring.open(&key_id("a"), &sealed).unwrap(), secret());
    }

    #[test]
    fn every_seal_uses_a_fresh_nonce() {
        let ring = Keyring::new(MasterKey::generate(), vec![]);
        assert_ne!(
            ring.seal(&key_id("a"), &secret()),
            ring.seal(&key_id("a"), &secret())
        );
    }

    #[test]
    fn a_ciphertext_moved_to_another_credential_fails_to_open() {
        let ring = Keyring::new(MasterKey::generate(), vec![]);
        let sealed = ring.seal(&key_id("a"), &secret());
        assert_eq!(ring.open(&key_id("b"), &sealed), Err(SecretsError::Forged));
    }

    #[test]
    fn oauth_material_and_the_executors_secret_never_open_as_each_other() {
        let ring = Keyring::new(MasterKey::generate(), vec![]);
        let grant = ring.seal_oauth(&key_id("a"), &secret());
        assert_eq!(ring.open_oauth(&key_id("a"), &grant).unwrap(), secret());
        assert_eq!(ring.open(&key_id("a"), &grant), Err(SecretsError::Forged));
        let lease_secret = ring.seal(&key_id("a"), &secret());
        assert_eq!(
            ring.open_oauth(&key_id("a"), &lease_secret),
            Err(SecretsError::Forged)
        );
    }

    #[test]
    fn tampered_bytes_fail_to_open() {
        let ring = Keyring::new(MasterKey::generate(), vec![]);
        let mut sealed = ring.seal(&key_id("a"), &secret());
        let last = sealed.len() - 1;
        sealed[last] ^= 1;
        assert_eq!(ring.open(&key_id("a"), &sealed), Err(SecretsError::Forged));
        assert_eq!(
            ring.open(&key_id("a"), b"cp1short"),
            Err(SecretsError::Malformed)
        );
    }

    #[test]
    fn rotation_opens_old_secrets_and_seals_new_ones_under_the_new_key() {
        let old = MasterKey::generate();
        let sealed_old = Keyring::new(old.clone(), vec![]).seal(&key_id("a"), &secret());
        let new = MasterKey::generate();
        let rotated = Keyring::new(new.clone(), vec![old]);
        assert!(!rotated.is_current(&sealed_old));
        assert_eq!(rotated.open(&key_id("a"), &sealed_old).unwrap(), secret());
        let resealed = rotated.seal(&key_id("a"), &secret());
        assert!(rotated.is_current(&resealed));
        let new_only = Keyring::new(new, vec![]);
        assert!(matches!(
            new_only.open(&key_id("a"), &sealed_old),
            Err(SecretsError::UnknownKey { .. })
        ));
        assert_eq!(new_only.open(&key_id("a"), &resealed).unwrap(), secret());
    }

    #[test]
    fn master_keys_parse_from_hex_or_base64_and_debug_shows_only_the_fingerprint() {
        let key = MasterKey::generate();
        let hex_text = key.to_hex();
        let parsed = MasterKey::parse(&hex_text).unwrap();
        assert_eq!(parsed.fingerprint(), key.fingerprint());
        let b64 = base64::engine::general_purpose::STANDARD
            .encode(hex::decode(hex_text.as_str()).unwrap());
        assert_eq!(
            MasterKey::parse(&b64).unwrap().fingerprint(),
            key.fingerprint()
        );
        assert!(!format!("{key:?}").contains(hex_text.as_str()));
        assert!(matches!(
            MasterKey::parse("too short"),
            Err(SecretsError::BadMasterKey)
        ));
    }
}
