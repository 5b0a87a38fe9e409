-- Executor protocol (issue 9): fencing tokens, idempotent allocation, and notifications that
-- wake allocations waiting for a slot.

-- ---------------------------------------------------------------------------------------------
-- Fencing tokens. Every grant takes the next value of ONE sequence: values are never reused
-- (a sequence never goes back, also across restarts and crashes), so per credential they
-- strictly increase with each grant. Two grants of one slot are ordered by the slot's row lock:
-- the later grant's nextval runs after the earlier lease's slot was freed and committed.
-- An executor passes its lease's fence upstream where the upstream can check it (docs/executor-protocol.md).
CREATE SEQUENCE lease_fence_seq AS bigint;

ALTER TABLE lease_slots
    ADD COLUMN fence bigint,
    -- idempotent allocation: the client's request_id and a digest of the request's parameters
    -- (provider, pool asked for, model, lease_seconds, holder; computed by the service)
    ADD COLUMN request_id text,
    ADD COLUMN request_digest text;

UPDATE lease_slots SET fence = nextval('lease_fence_seq') WHERE lease_id IS NOT NULL;

ALTER TABLE lease_slots
    ADD CONSTRAINT lease_slots_fence_with_lease CHECK ((lease_id IS NULL) = (fence IS NULL)),
    ADD CONSTRAINT lease_slots_request_with_lease CHECK (
        (request_id IS NULL AND request_digest IS NULL)
        OR (lease_id IS NOT NULL AND request_digest IS NOT NULL
            AND request_id ~ '^[A-Za-z0-9._:-]{1,128}$'));

-- One live lease per request_id, whatever the replica and however many retries race: a lease
-- holds its request_id only while it sits in its slot (release, expiry and force release clear
-- it), so after the lease has ended the request_id may be used again.
CREATE UNIQUE INDEX lease_slots_request_id_key ON lease_slots (request_id) WHERE request_id IS NOT NULL;

-- `granted` rows carry the lease's fence (NULL on every other event, and on grants from before
-- this migration).
ALTER TABLE lease_events ADD COLUMN fence bigint;

-- ---------------------------------------------------------------------------------------------
-- Notifications for waiting allocations (`wait_ms`). Each service process LISTENs on one
-- connection. Payloads are JSON; channel names and shapes are documented in docs/executor-protocol.md.
--   credpool_slot_freed   {"provider","pool","key_id","slot"}: a slot's lease ended (release,
--                         force release, reaper, refit); sent at commit, one per slot.
--   credpool_pool_changed {"provider","pool"}: the pool's version moved (a credential was added,
--                         enabled, raised, drained, ...): every waiter of the pool looks again.
-- A lease that expires while nothing frees its slot sends nothing at that moment: waiters know
-- when each lease and each cooldown ends and set their own timers for it.
CREATE FUNCTION lease_slots_notify_freed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('credpool_slot_freed', json_build_object(
        'provider', OLD.provider, 'pool', OLD.pool, 'key_id', OLD.key_id, 'slot', OLD.slot)::text);
    RETURN NULL;
END;
$$;

CREATE TRIGGER lease_slots_freed
    AFTER UPDATE ON lease_slots
    FOR EACH ROW
    WHEN (OLD.lease_id IS NOT NULL AND NEW.lease_id IS NULL)
    EXECUTE FUNCTION lease_slots_notify_freed();

CREATE FUNCTION pool_versions_notify_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('credpool_pool_changed', json_build_object(
        'provider', NEW.provider, 'pool', NEW.pool)::text);
    RETURN NULL;
END;
$$;

CREATE TRIGGER pool_versions_changed
    AFTER INSERT OR UPDATE ON pool_versions
    FOR EACH ROW
    EXECUTE FUNCTION pool_versions_notify_changed();

-- ---------------------------------------------------------------------------------------------
-- Every statement that ends a lease clears the new columns too (the CHECKs above refuse a free
-- slot that keeps them). Same functions as before otherwise.
CREATE OR REPLACE FUNCTION credpool_reap_expired_leases(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE sql AS $$
    WITH stale AS (
        SELECT key_id, slot, lease_id, provider, pool, holder, lease_until
        FROM lease_slots
        WHERE lease_id IS NOT NULL AND lease_until <= now()
        ORDER BY lease_until
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    ),
    freed AS (
        UPDATE lease_slots s
        SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
            granted_at = NULL, lease_until = NULL, probe = false,
            fence = NULL, request_id = NULL, request_digest = NULL
        FROM stale
        WHERE s.key_id = stale.key_id AND s.slot = stale.slot
        RETURNING stale.*
    ),
    trail AS (
        INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
        SELECT 'expired', lease_id, key_id, provider, pool, slot, holder, lease_until, lease_until
        FROM freed
    )
    SELECT count(*)::integer FROM freed
$$;

-- As in 20261129000001_lease_core.sql (read its comment), and a lease moved below a lowered
-- limit keeps every column of its slot (probe, fence, request_id; before, it lost its probe
-- flag), and an expired probe lease pruned here no longer leaves its probe flag behind.
CREATE OR REPLACE FUNCTION credpool_fit_slots(p_key_id text) RETURNS void
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
        granted_at = NULL, lease_until = NULL, probe = false,
        fence = NULL, request_id = NULL, request_digest = NULL
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
        SELECT *
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
        INSERT INTO lease_slots (key_id, slot, lease_id, provider, pool, holder, granted_at,
                                 lease_until, probe, fence, request_id, request_digest,
                                 last_granted_at)
        VALUES (p_key_id, v_free_slot, r.lease_id, r.provider, r.pool, r.holder, r.granted_at,
                r.lease_until, r.probe, r.fence, r.request_id, r.request_digest, r.last_granted_at)
        ON CONFLICT ON CONSTRAINT lease_slots_pkey DO UPDATE
        SET lease_id = EXCLUDED.lease_id, provider = EXCLUDED.provider, pool = EXCLUDED.pool,
            holder = EXCLUDED.holder, granted_at = EXCLUDED.granted_at,
            lease_until = EXCLUDED.lease_until, probe = EXCLUDED.probe, fence = EXCLUDED.fence,
            request_id = EXCLUDED.request_id, request_digest = EXCLUDED.request_digest,
            last_granted_at = greatest(lease_slots.last_granted_at, EXCLUDED.last_granted_at);
    END LOOP;

    DELETE FROM lease_slots WHERE key_id = p_key_id AND slot >= v_limit;
    INSERT INTO lease_slots (key_id, slot)
    SELECT p_key_id, g FROM generate_series(0, v_limit - 1) AS g
    ON CONFLICT ON CONSTRAINT lease_slots_pkey DO NOTHING;
    UPDATE credentials SET slots_over_limit = false
    WHERE key_id = p_key_id AND slots_over_limit;
END;
$$;

-- ---------------------------------------------------------------------------------------------
-- credpool_claim, as in 20261130000005_performance.sql (read its comment: why the claim cannot
-- oversell and never waits for a row lock), with fencing tokens and idempotent allocation.
--
-- Each claim may carry "request_id" and "request_digest". Such a claim first looks for the lease
-- its request_id already holds:
--   * a live lease with the same digest: the claim answers with that lease (same lease_id, its
--     current lease_until, its fence; `request` = 'replayed') and takes no slot;
--   * a live lease with another digest: `request` = 'conflict', no lease;
--   * an expired lease: its slot is free like any expired one; the request_id is taken off it and
--     the claim goes on as a new one.
-- Concurrent attempts of one request (a client's retries, on any replica) are serialized by a
-- transaction-scoped advisory lock per request_id, so the later one sees the earlier one's lease.
-- The locks of a call are all taken at its start, in one global order (of their keys), so two
-- claim groups cannot wait for each other; claims without a request_id take none and still never
-- wait. The unique index lease_slots_request_id_key is the guarantee behind the locks.
--
-- New columns returned: lease_pool (the pool of the lease: the pool tried, or for a replay the
-- pool that served the first attempt), fence, and request (NULL, 'replayed' or 'conflict').
DROP FUNCTION credpool_claim(jsonb);

CREATE FUNCTION credpool_claim(p_claims jsonb)
RETURNS TABLE (claim integer, pool_version bigint, key_id text, lease_id uuid, lease_pool text,
               granted_at timestamptz, lease_until timestamptz, probe boolean,
               provider_model text, sealed_secret bytea, pruned_expired boolean, fence bigint,
               request text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q record;
    prior record;
BEGIN
    PERFORM pg_advisory_xact_lock(locks.key)
    FROM (SELECT DISTINCT hashtextextended('credpool.request_id:' || (e ->> 'request_id'), 0) AS key
          FROM jsonb_array_elements(p_claims) AS e
          WHERE e ->> 'request_id' IS NOT NULL
          ORDER BY 1) AS locks;

    FOR q IN
        SELECT e.n::integer AS claim,
               ARRAY(SELECT jsonb_array_elements_text(e.c -> 'ranked')) AS ranked,
               e.c ->> 'provider' AS provider, e.c ->> 'pool' AS pool, e.c ->> 'model' AS model,
               (e.c ->> 'lease_id')::uuid AS lease_id, e.c ->> 'holder' AS holder,
               (e.c ->> 'lease_seconds')::integer AS lease_seconds,
               e.c ->> 'request_id' AS request_id, e.c ->> 'request_digest' AS request_digest
        FROM jsonb_array_elements(p_claims) WITH ORDINALITY AS e (c, n)
        ORDER BY e.n
    LOOP
        IF q.request_id IS NOT NULL THEN
            SELECT s.key_id, s.slot, s.lease_id, s.pool, s.granted_at, s.lease_until, s.probe,
                   s.fence, s.request_digest = q.request_digest AS same_request,
                   s.lease_until > statement_timestamp() AS live,
                   c.secret_ciphertext,
                   coalesce(c.model_aliases ->> q.model, q.model) AS provider_model
            INTO prior
            FROM lease_slots s
            JOIN credentials c ON c.key_id = s.key_id
            WHERE s.request_id = q.request_id;
            IF FOUND AND prior.live THEN
                IF prior.same_request THEN
                    RETURN QUERY
                    SELECT q.claim,
                           (SELECT v.version FROM pool_versions v WHERE v.provider = q.provider AND v.pool = q.pool),
                           prior.key_id, prior.lease_id, prior.pool, prior.granted_at,
                           prior.lease_until, prior.probe, prior.provider_model,
                           prior.secret_ciphertext, false, prior.fence, 'replayed'::text;
                ELSE
                    RETURN QUERY
                    SELECT q.claim,
                           (SELECT v.version FROM pool_versions v WHERE v.provider = q.provider AND v.pool = q.pool),
                           NULL::text, NULL::uuid, NULL::text, NULL::timestamptz, NULL::timestamptz,
                           NULL::boolean, NULL::text, NULL::bytea, NULL::boolean, NULL::bigint,
                           'conflict'::text;
                END IF;
                CONTINUE;
            ELSIF FOUND THEN
                UPDATE lease_slots s
                SET request_id = NULL, request_digest = NULL
                WHERE s.key_id = prior.key_id AND s.slot = prior.slot AND s.request_id = q.request_id;
            END IF;
        END IF;

        RETURN QUERY
        WITH ranked AS (
            SELECT r.key_id, r.rank
            FROM unnest(q.ranked) WITH ORDINALITY AS r (key_id, rank)
        ),
        claimed AS (
            SELECT s.key_id, s.slot,
                   s.lease_id AS old_lease_id, s.provider AS old_provider, s.pool AS old_pool,
                   s.holder AS old_holder, s.lease_until AS old_lease_until,
                   c.status <> 'available' AS probe,
                   c.status AS credential_status, c.cooldown_until, c.secret_ciphertext,
                   coalesce(c.model_aliases ->> q.model, q.model) AS provider_model
            FROM ranked r
            -- one primary-key probe per candidate, whatever the pool's size: the LIMIT keeps the planner
            -- from turning this into a scan of the whole pool through its (provider, pool) index, which a
            -- generic plan did (9 ms per claim on a pool of 10,000)
            CROSS JOIN LATERAL (
                SELECT * FROM credentials c WHERE c.key_id = r.key_id LIMIT 1
            ) c
            JOIN lease_slots s ON s.key_id = c.key_id
            WHERE c.provider = q.provider
              AND c.pool = q.pool
              AND (q.model = ANY (c.models) OR c.model_aliases ? q.model)
              AND credential_usable(c.status, c.cooldown_until, statement_timestamp())
              AND (c.status = 'available' OR s.slot = 0)
              AND NOT c.slots_over_limit
              AND NOT c.draining
              AND (s.lease_id IS NULL OR s.lease_until <= statement_timestamp())
            ORDER BY r.rank, s.slot
            LIMIT 1
            FOR UPDATE OF s SKIP LOCKED
        ),
        granted AS (
            UPDATE lease_slots s
            SET lease_id = q.lease_id,
                provider = q.provider,
                pool = q.pool,
                holder = q.holder,
                granted_at = clock_timestamp(),
                lease_until = clock_timestamp() + make_interval(secs => q.lease_seconds),
                last_granted_at = clock_timestamp(),
                probe = claimed.probe,
                fence = nextval('lease_fence_seq'),
                request_id = q.request_id,
                request_digest = q.request_digest
            FROM claimed
            WHERE s.key_id = claimed.key_id AND s.slot = claimed.slot
            RETURNING s.key_id, s.slot, s.lease_id, s.granted_at, s.lease_until, s.probe, s.fence
        ),
        probe_trail AS (
            INSERT INTO credential_events (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at)
            SELECT claimed.key_id, 'probe_granted', claimed.credential_status, claimed.credential_status,
                   'cooldown ended; single probe lease granted', claimed.cooldown_until, granted.lease_id,
                   granted.granted_at
            FROM claimed JOIN granted ON granted.key_id = claimed.key_id
            WHERE claimed.probe
        ),
        expired_trail AS (
            INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
            SELECT 'expired', old_lease_id, key_id, old_provider, old_pool, slot, old_holder,
                   old_lease_until, old_lease_until
            FROM claimed
            WHERE old_lease_id IS NOT NULL
        ),
        granted_trail AS (
            INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, fence)
            SELECT 'granted', lease_id, key_id, q.provider, q.pool, slot, q.holder, lease_until, granted_at, fence
            FROM granted
        )
        SELECT q.claim,
               (SELECT v.version FROM pool_versions v WHERE v.provider = q.provider AND v.pool = q.pool),
               granted.key_id, granted.lease_id, q.pool, granted.granted_at, granted.lease_until,
               granted.probe, claimed.provider_model, claimed.secret_ciphertext,
               claimed.old_lease_id IS NOT NULL, granted.fence, NULL::text
        FROM (SELECT 1) AS always_one_row
        LEFT JOIN granted ON true
        LEFT JOIN claimed ON claimed.key_id = granted.key_id;
    END LOOP;
END;
$$;
