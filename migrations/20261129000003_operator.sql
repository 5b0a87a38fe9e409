-- Operator side: secrets sealed at rest, draining, forced releases, and who did what.

-- Secrets are sealed by the service (XChaCha20-Poly1305 under its master key; src/secrets.rs)
-- before they reach the database. `secret` (plaintext JSON) remains only for rows written before
-- this migration; the service seals them at start-up and clears the column.
ALTER TABLE credentials
    ADD COLUMN secret_ciphertext bytea,
    ALTER COLUMN secret DROP NOT NULL,
    ADD CONSTRAINT credentials_secret_stored CHECK ((secret IS NULL) <> (secret_ciphertext IS NULL)),
    -- drained by an operator: no new leases while the current ones finish
    ADD COLUMN draining boolean NOT NULL DEFAULT false;

-- Draining changes who may be leased: it bumps the pool version like the other columns.
DROP TRIGGER credentials_selection_changed ON credentials;
CREATE TRIGGER credentials_selection_changed
    AFTER UPDATE ON credentials
    FOR EACH ROW
    WHEN ((OLD.provider, OLD.pool, OLD.models, OLD.model_aliases, OLD.max_concurrent_uses,
           OLD.status, OLD.cooldown_until, OLD.slots_over_limit, OLD.draining)
          IS DISTINCT FROM
          (NEW.provider, NEW.pool, NEW.models, NEW.model_aliases, NEW.max_concurrent_uses,
           NEW.status, NEW.cooldown_until, NEW.slots_over_limit, NEW.draining))
    EXECUTE FUNCTION credentials_bump_pool_version();

-- `force_released`: an operator ended the lease (one lease, all of a credential's, or by deleting
-- the credential); `reason` is theirs, `actor` who they are.
ALTER TABLE lease_events
    ADD COLUMN reason text,
    ADD COLUMN actor text,
    DROP CONSTRAINT lease_events_event_known,
    ADD CONSTRAINT lease_events_event_known CHECK (
        event IN ('granted', 'renewed', 'released', 'expired', 'outcome_after_expiry', 'force_released'));

-- A lease is released once: by its executor or by an operator, never both. (An executor's late
-- outcome for a force-released lease still counts for health, once:
-- lease_events_one_report_per_lease.)
CREATE UNIQUE INDEX lease_events_one_release_per_lease ON lease_events (lease_id)
    WHERE event IN ('released', 'force_released');

-- Operator actions on credentials, with who (`actor`) and the old and new values (`details`,
-- never the secret: a secret change is recorded as `"secret": "changed"`).
ALTER TABLE credential_events
    ADD COLUMN actor text,
    ADD COLUMN details jsonb,
    DROP CONSTRAINT credential_events_event_known,
    ADD CONSTRAINT credential_events_event_known CHECK (
        event IN ('status_changed', 'probe_granted', 'created', 'updated', 'deleted',
                  'leases_released', 'secret_resealed'));
