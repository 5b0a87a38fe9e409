-- Tenants (issue 29, first slice): who holds a lease, known from the executor key it presents,
-- and a cap on the live leases each may hold across every replica.
--
-- The cap is decided the way a credential's limit is (docs/design.md, "Gates on the locked
-- row"): capacity is a set of rows, one `tenant_slots` row per unit of a tenant's cap, and a
-- lease of a capped tenant lives in one of them as well as in its credential's slot row. The
-- claim locks a free tenant slot with SKIP LOCKED in the same statement as the credential slot
-- (sql/lease.sql, CLAIM); END frees both; RENEW moves both ends in step.

CREATE TABLE tenants (
    tenant_id             text        NOT NULL,
    -- live leases the tenant may hold at once over every credential; NULL: no cap
    max_concurrent_leases integer,
    -- its share of a saturated pool (fair share: a later slice); stored now
    weight                integer     NOT NULL DEFAULT 1,
    -- windows like a credential's ({"requests"|"tokens": N, "seconds": S}); stored and validated
    -- now, enforced by a later slice
    rate_limits           jsonb       NOT NULL DEFAULT '[]',
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT tenants_pkey PRIMARY KEY (tenant_id),
    CONSTRAINT tenants_cap_range CHECK (max_concurrent_leases BETWEEN 0 AND 100000),
    CONSTRAINT tenants_weight_range CHECK (weight BETWEEN 1 AND 1000),
    CONSTRAINT tenants_rate_limits_array CHECK (jsonb_typeof(rate_limits) = 'array')
);

-- The configured internal key's tenant: existing deployments keep working, uncapped.
INSERT INTO tenants (tenant_id) VALUES ('default');

-- Executor keys. Only a hash is stored: SHA-256 of the key. A key is 256 random bits, so no
-- guess can reach it and a slow (salted, stretched) hash would buy nothing but latency on every
-- executor call; a fast hash keeps the lookup one index probe. Revoking deletes nothing of the
-- history: `revoked_at` is set, and every statement that checks a key reads it.
CREATE TABLE tenant_keys (
    key_id      uuid        NOT NULL,
    tenant_id   text        NOT NULL,
    key_hash    bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,
    CONSTRAINT tenant_keys_pkey PRIMARY KEY (key_id),
    CONSTRAINT tenant_keys_key_hash_key UNIQUE (key_hash),
    CONSTRAINT tenant_keys_tenant_id_fkey FOREIGN KEY (tenant_id)
        REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    CONSTRAINT tenant_keys_hash_length CHECK (octet_length(key_hash) = 32)
);
CREATE INDEX tenant_keys_tenant_id_idx ON tenant_keys (tenant_id);

-- One row per unit of a capped tenant's cap. A row is free when it holds no lease or its
-- lease's lease_until has passed (the same database clock as the credential slot it mirrors).
-- `over_limit`: the cap was lowered below the leases in flight; such a row is never claimed,
-- and the tenant is refitted (credpool_fit_tenant) when its leases end.
CREATE TABLE tenant_slots (
    tenant_id   text        NOT NULL,
    slot        integer     NOT NULL,
    lease_id    uuid,
    -- the credential of the lease (for people reading the table; END matches on lease_id)
    key_id      text,
    lease_until timestamptz,
    over_limit  boolean     NOT NULL DEFAULT false,
    CONSTRAINT tenant_slots_pkey PRIMARY KEY (tenant_id, slot),
    CONSTRAINT tenant_slots_tenant_id_fkey FOREIGN KEY (tenant_id)
        REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    CONSTRAINT tenant_slots_lease_complete CHECK (
        (lease_id IS NULL AND key_id IS NULL AND lease_until IS NULL)
        OR (lease_id IS NOT NULL AND key_id IS NOT NULL AND lease_until IS NOT NULL))
) WITH (fillfactor = 25);

-- The tenant holding each lease, on the lease and in the trail. Leases granted before tenants
-- existed were granted to the internal key: `default`.
ALTER TABLE lease_slots ADD COLUMN tenant text;
UPDATE lease_slots SET tenant = 'default' WHERE lease_id IS NOT NULL;
ALTER TABLE lease_slots
    ADD CONSTRAINT lease_slots_tenant_with_lease CHECK (lease_id IS NOT NULL OR tenant IS NULL);
ALTER TABLE lease_events ADD COLUMN tenant text;

-- The tenants' own trail: configuration changes (with the configuration they set, so that
-- `credpool audit verify` judges each grant by the cap in force then) and keys minted and
-- revoked (the key's id, never the key or its hash). Append-only (sql/audit.sql).
CREATE TABLE tenant_events (
    event_id              bigint      GENERATED ALWAYS AS IDENTITY,
    tenant_id             text        NOT NULL,
    event                 text        NOT NULL,
    max_concurrent_leases integer,
    weight                integer,
    rate_limits           jsonb,
    key_id                uuid,
    actor                 text,
    -- when the change took effect: clock_timestamp() after the change's locks
    at                    timestamptz NOT NULL,
    CONSTRAINT tenant_events_pkey PRIMARY KEY (event_id),
    CONSTRAINT tenant_events_event_known CHECK (
        event IN ('created', 'updated', 'deleted', 'key_created', 'key_revoked'))
);
CREATE INDEX tenant_events_tenant_at_idx ON tenant_events (tenant_id, at);
INSERT INTO tenant_events (tenant_id, event, weight, rate_limits, actor, at)
VALUES ('default', 'created', 1, '[]', 'credpool', now());

