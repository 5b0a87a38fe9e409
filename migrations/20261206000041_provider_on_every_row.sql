-- The provider on every row a lease touches, so that a distribution by provider (Citus:
-- docs/src/citus.md) can keep each provider's rows together on one worker: a table is
-- distributed by a column its rows carry, never NULL. On one PostgreSQL the keys stay as they
-- are; `credpool citus distribute` puts the provider into them where Citus asks for it.

-- A slot row's provider is its credential's, free or leased (it was the lease's, NULL on a free
-- slot; a claim only ever leases a credential for its own provider, so a lease's provider was its
-- credential's already). Slot fitting keeps it equal to the credential's.
ALTER TABLE lease_slots DROP CONSTRAINT lease_slots_lease_complete;
UPDATE lease_slots s SET provider = c.provider
FROM credentials c
WHERE c.key_id = s.key_id AND s.provider IS DISTINCT FROM c.provider;
ALTER TABLE lease_slots
    ALTER COLUMN provider SET NOT NULL,
    ADD CONSTRAINT lease_slots_lease_complete CHECK (
        (lease_id IS NULL AND pool IS NULL AND holder IS NULL
            AND granted_at IS NULL AND lease_until IS NULL)
        OR (lease_id IS NOT NULL AND pool IS NOT NULL
            AND granted_at IS NOT NULL AND lease_until > granted_at));

-- A credential's rate windows and its OAuth refresh state carry its provider.
ALTER TABLE lease_windows ADD COLUMN provider text;
UPDATE lease_windows w SET provider = c.provider FROM credentials c WHERE c.key_id = w.key_id;
ALTER TABLE lease_windows ALTER COLUMN provider SET NOT NULL;

ALTER TABLE oauth_credentials ADD COLUMN provider text;
UPDATE oauth_credentials o SET provider = c.provider FROM credentials c WHERE c.key_id = o.key_id;
ALTER TABLE oauth_credentials ALTER COLUMN provider SET NOT NULL;

-- A remembered request carries the provider it was granted for (from its grant in the trail; a
-- request whose grant has left the trail is past any retry and is forgotten here).
ALTER TABLE lease_requests ADD COLUMN provider text;
UPDATE lease_requests r SET provider = e.provider
FROM lease_events e
WHERE e.lease_id = r.lease_id AND e.event = 'granted';
DELETE FROM lease_requests WHERE provider IS NULL;
ALTER TABLE lease_requests ALTER COLUMN provider SET NOT NULL;
