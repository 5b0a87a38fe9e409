-- credpool lease core: credentials, one row per concurrency slot, and the append-only trail of
-- lease events. Every time decision uses the database clock (now() / clock_timestamp()).
--
-- Lock order, everywhere a transaction takes more than one row lock: a credential's slot rows
-- (ascending slot), then the credential row. The claim statement, release and credpool_fit_slots
-- all follow it, so they cannot deadlock with each other.

CREATE TABLE credentials (
    key_id              text        NOT NULL,
    provider            text        NOT NULL,
    pool                text        NOT NULL,
    -- model names this credential serves, exactly as the upstream provider spells them
    models              text[]      NOT NULL,
    max_concurrent_uses integer     NOT NULL,
    -- health only, never occupancy (occupancy lives in lease_slots)
    status              text        NOT NULL DEFAULT 'available',
    cooldown_until      timestamptz,
    -- when the latest lease on this credential was granted (database clock)
    last_used_at        timestamptz,
    -- true while more leases are in flight than max_concurrent_uses allows (the limit was lowered
    -- under load): the claim statement skips the credential until credpool_fit_slots finds the
    -- in-flight count back under the limit.
    slots_over_limit    boolean     NOT NULL DEFAULT false,
    -- the credential material handed to executors with a lease; never logged or audited
    secret              jsonb       NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT credentials_pkey PRIMARY KEY (key_id),
    -- the character sets of src/domain.rs (KeyId, ProviderName, PoolName)
    CONSTRAINT credentials_key_id_format CHECK (key_id ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$'),
    CONSTRAINT credentials_provider_format CHECK (provider ~ '^[a-z0-9][a-z0-9._-]{0,63}$'),
    CONSTRAINT credentials_pool_format CHECK (pool ~ '^[a-z0-9][a-z0-9._-]{0,63}$'),
    CONSTRAINT credentials_max_concurrent_uses_range CHECK (max_concurrent_uses BETWEEN 1 AND 10000),
    CONSTRAINT credentials_status_known CHECK (
        status IN ('available', 'rate_limited', 'cooldown', 'pending', 'disabled', 'exhausted')),
    CONSTRAINT credentials_models_not_empty CHECK (cardinality(models) >= 1),
    CONSTRAINT credentials_secret_is_object CHECK (jsonb_typeof(secret) = 'object')
);

-- Serves the candidate read of one (provider, pool).
CREATE INDEX credentials_provider_pool_idx ON credentials (provider, pool);

-- One row per concurrency slot: a credential with max_concurrent_uses = N has slots 0..N-1 (more
-- only while slots_over_limit is set). A slot is free when lease_id is NULL or its lease_until has
-- passed; otherwise it holds exactly one lease. The claim locks the slot row itself, so the row
-- whose state decides capacity is the row PostgreSQL re-checks after taking the lock.
CREATE TABLE lease_slots (
    key_id      text        NOT NULL,
    slot        integer     NOT NULL,
    lease_id    uuid,
    -- the provider and pool the lease was granted from (release must name the same)
    provider    text,
    pool        text,
    holder      text,
    granted_at  timestamptz,
    lease_until timestamptz,
    CONSTRAINT lease_slots_pkey PRIMARY KEY (key_id, slot),
    CONSTRAINT lease_slots_key_id_fkey FOREIGN KEY (key_id)
        REFERENCES credentials (key_id) ON DELETE CASCADE,
    CONSTRAINT lease_slots_slot_non_negative CHECK (slot >= 0),
    CONSTRAINT lease_slots_lease_complete CHECK (
        (lease_id IS NULL AND provider IS NULL AND pool IS NULL AND holder IS NULL
            AND granted_at IS NULL AND lease_until IS NULL)
        OR (lease_id IS NOT NULL AND provider IS NOT NULL AND pool IS NOT NULL
            AND granted_at IS NOT NULL AND lease_until > granted_at))
);

-- Release and renew find a lease by its id; lease ids are never reused.
CREATE UNIQUE INDEX lease_slots_lease_id_key ON lease_slots (lease_id) WHERE lease_id IS NOT NULL;

-- The append-only trail of lease events, written in the same statement or transaction as the
-- state change it records. Never holds credential material.
CREATE TABLE lease_events (
    event_id    bigint      GENERATED ALWAYS AS IDENTITY,
    event       text        NOT NULL,
    lease_id    uuid        NOT NULL,
    -- no foreign key: history outlives the credential
    key_id      text        NOT NULL,
    provider    text        NOT NULL,
    pool        text        NOT NULL,
    slot        integer     NOT NULL,
    holder      text,
    -- the executor's report on release: success, failure, rate_limited, auth_error, quota_exhausted
    outcome     text,
    -- granted / renewed: the new lease_until; released / expired: the lease_until at that moment
    lease_until timestamptz NOT NULL,
    -- when the event took effect: grant time, renewal time, release time, or for `expired` the
    -- lease_until that passed
    at          timestamptz NOT NULL,
    -- when the row was written
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT lease_events_pkey PRIMARY KEY (event_id),
    CONSTRAINT lease_events_event_known CHECK (event IN ('granted', 'renewed', 'released', 'expired')),
    CONSTRAINT lease_events_outcome_known CHECK (
        outcome IS NULL
        OR outcome IN ('success', 'failure', 'rate_limited', 'auth_error', 'quota_exhausted'))
);

CREATE INDEX lease_events_lease_id_idx ON lease_events (lease_id);
CREATE INDEX lease_events_key_id_at_idx ON lease_events (key_id, at);

-- The trail is append-only: rows are inserted, and later removed only by retention; never edited.
CREATE FUNCTION lease_events_forbid_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'lease_events is append-only'
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER lease_events_append_only
    BEFORE UPDATE ON lease_events
    FOR EACH ROW EXECUTE FUNCTION lease_events_forbid_update();

-- DESIGN.md "Vocabulary": status says health only. `available` is usable; `rate_limited` and
-- `cooldown` are usable once cooldown_until has passed (opportunistic recovery) and not usable with
-- an unknown cooldown_until; `pending`, `disabled` and `exhausted` are not usable.
-- `at` is the database clock of the caller's statement.
CREATE FUNCTION credential_usable(status text, cooldown_until timestamptz, at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT status = 'available'
        OR (status IN ('rate_limited', 'cooldown')
            AND cooldown_until IS NOT NULL
            AND cooldown_until <= at)
$$;

-- When a credential that is not usable now becomes usable on its own: the end of its cooldown for
-- `rate_limited` / `cooldown` with a future cooldown_until; NULL when it is usable now or needs an
-- operator. Used for the Retry-After of a 429. Same rule as credential_usable.
CREATE FUNCTION credential_recovers_at(status text, cooldown_until timestamptz, at timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN status IN ('rate_limited', 'cooldown') AND cooldown_until > at THEN cooldown_until
    END
$$;

-- Brings a credential's slot rows in line with its max_concurrent_uses, in the caller's
-- transaction. Called after every change of the limit and whenever a credential flagged
-- slots_over_limit may have dropped back under its limit.
--
-- The in-flight count taken here is exact: every slot row of the credential and the credential
-- row are locked (in the global lock order), and the count is a later statement than the locks, so
-- under READ COMMITTED it sees every commit that preceded them.
--
-- Afterwards either
--   * in-flight <= limit: slot rows are exactly 0..limit-1, every in-flight lease sits in one of
--     them (leases above the new limit move into free lower slots), slots_over_limit = false; or
--   * in-flight > limit: every free slot row is deleted and slots_over_limit = true, so no lease is
--     granted until in-flight falls under the limit and this function runs again. Lowering the
--     limit revokes nothing.
-- Expired leases found on the way are ended in the trail (`expired`) and their slots freed.
CREATE FUNCTION credpool_fit_slots(p_key_id text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_limit integer;
    v_in_flight integer;
    v_free_slot integer;
    r record;
BEGIN
    PERFORM 1 FROM lease_slots WHERE key_id = p_key_id ORDER BY slot FOR UPDATE;
    SELECT max_concurrent_uses INTO v_limit FROM credentials WHERE key_id = p_key_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;

    WITH ended AS (
        SELECT key_id, slot, lease_id, provider, pool, holder, lease_until
        FROM lease_slots
        WHERE key_id = p_key_id AND lease_id IS NOT NULL AND lease_until <= now()
    ), trail AS (
        INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
        SELECT 'expired', lease_id, key_id, provider, pool, slot, holder, lease_until, lease_until
        FROM ended
    )
    UPDATE lease_slots s
    SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
        granted_at = NULL, lease_until = NULL
    FROM ended
    WHERE s.key_id = ended.key_id AND s.slot = ended.slot;

    SELECT count(*) INTO v_in_flight
    FROM lease_slots WHERE key_id = p_key_id AND lease_id IS NOT NULL;

    IF v_in_flight > v_limit THEN
        DELETE FROM lease_slots WHERE key_id = p_key_id AND lease_id IS NULL;
        UPDATE credentials SET slots_over_limit = true
        WHERE key_id = p_key_id AND NOT slots_over_limit;
        RETURN;
    END IF;

    -- Move leases that sit at or above the limit into the lowest free slots below it; there are
    -- enough because in-flight <= limit.
    FOR r IN
        SELECT slot, lease_id, provider, pool, holder, granted_at, lease_until
        FROM lease_slots
        WHERE key_id = p_key_id AND slot >= v_limit AND lease_id IS NOT NULL
        ORDER BY slot
    LOOP
        DELETE FROM lease_slots WHERE key_id = p_key_id AND slot = r.slot;
        SELECT g INTO v_free_slot
        FROM generate_series(0, v_limit - 1) AS g
        WHERE NOT EXISTS (
            SELECT 1 FROM lease_slots s
            WHERE s.key_id = p_key_id AND s.slot = g AND s.lease_id IS NOT NULL)
        ORDER BY g
        LIMIT 1;
        INSERT INTO lease_slots (key_id, slot, lease_id, provider, pool, holder, granted_at, lease_until)
        VALUES (p_key_id, v_free_slot, r.lease_id, r.provider, r.pool, r.holder, r.granted_at, r.lease_until)
        ON CONFLICT ON CONSTRAINT lease_slots_pkey DO UPDATE
        SET lease_id = EXCLUDED.lease_id, provider = EXCLUDED.provider, pool = EXCLUDED.pool,
            holder = EXCLUDED.holder, granted_at = EXCLUDED.granted_at,
            lease_until = EXCLUDED.lease_until;
    END LOOP;

    DELETE FROM lease_slots WHERE key_id = p_key_id AND slot >= v_limit;
    INSERT INTO lease_slots (key_id, slot)
    SELECT p_key_id, g FROM generate_series(0, v_limit - 1) AS g
    ON CONFLICT ON CONSTRAINT lease_slots_pkey DO NOTHING;
    UPDATE credentials SET slots_over_limit = false
    WHERE key_id = p_key_id AND slots_over_limit;
END;
$$;
