-- Fitting a credential's slot rows to its limit, drain state and windows (FIT), an operator's
-- forced release, and the cleanup pass's reaper and refit.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one
-- transaction; every statement here must be safe to run again. Lock order and clocks:
-- docs/design.md ("Lock order", "Clocks").

-- FIT: brings a credential's slot rows in line with its max_concurrent_uses, its drain state and
-- its rate windows, in the caller's transaction. Called after every change of the limit, of
-- draining or of the windows, after a release freed a slot that was over a lowered limit, and by
-- the cleanup pass for credentials back under their limit.
--
-- Locks, in the lock order (credpool_lock_credentials): every slot row of the credential,
-- ascending slot, then its lease_windows row, then the credential row. The in-flight count is
-- exact: it is taken after the locks, on clock_timestamp() read after them, and nobody else can
-- fill or free a slot while they are held.
--
-- Afterwards, with in-flight <= limit: the slot rows are exactly 0..limit-1, every live lease sits
-- in one of them (a lease at or above the new limit moves into a free lower number: its slot's
-- key changes by UPDATE, so a release or renewal waiting for the row follows it), no slot is over
-- the limit. With in-flight > limit (lowered under load): every free slot row is deleted and
-- every remaining one is marked over_limit; the `limit` rows whose leases end last stay within
-- the limit, the others are `surplus` (never claimed; gone at the next fit). A row within the
-- limit reopens to claims on its own when its lease ends (expiry on the database clock: nothing
-- has to run), and exactly back up to the limit: every surplus lease ends no later than every
-- lease within the limit (ranked so here; RENEW caps a surplus lease at them; END closes a row
-- within the limit that frees while a surplus lease is held), so when k of those rows have
-- reopened, at most limit - k leases count. Lowering the limit revokes nothing. Either way every
-- slot row carries the credential's `draining`, `windowed` (it has rate windows) and
-- configuration version. Expired leases found on the way are ended (`expired`). A change of the
-- over-limit state moves the pool's version.
--
-- Windows: the lease_windows row follows the credential's rate_limits. A window kept (same kind
-- and length) keeps what it counted; a new one starts from the trail (the grants of its last
-- length, with their usage where a release reported one, else their reservation), so a window set
-- on a busy credential holds at once.
CREATE OR REPLACE FUNCTION credpool_fit_slots(p_key_id text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_limit integer;
    v_draining boolean;
    v_provider text;
    v_pool text;
    v_version bigint;
    v_now timestamptz;
    v_live integer;
    v_was_over boolean;
    v_rate_limits jsonb;
    v_windowed boolean;
    v_expired lease_slots[];
    v_last_kept record;
    v_movers integer[];
    v_targets integer[];
    v_moves jsonb;
BEGIN
    IF credpool_lock_credentials(ARRAY[p_key_id]) = 0 THEN
        RETURN;
    END IF;
    SELECT max_concurrent_uses, draining, provider, pool, rate_limits, config_version
    INTO v_limit, v_draining, v_provider, v_pool, v_rate_limits, v_version
    FROM credentials WHERE key_id = p_key_id;
    PERFORM credpool_test_hook('fit.locked');
    v_now := clock_timestamp();
    v_windowed := credpool_fit_windows(p_key_id, v_provider, v_rate_limits, v_now);

    -- (every statement below names the credential's provider: on Citus it runs on the
    -- provider's worker alone)
    -- (the rows first, END in a statement of its own: on Citus a function called in a statement
    -- that reads a shard runs on the shard's worker; the row is rebuilt from its columns, as a
    -- row read from a shard is of the shard's own type)
    SELECT array_agg(ROW(s.*)::lease_slots ORDER BY s.slot) INTO v_expired
    FROM lease_slots s
    WHERE s.provider = v_provider AND s.key_id = p_key_id AND s.lease_id IS NOT NULL
      AND s.lease_until <= v_now;
    IF v_expired IS NOT NULL THEN
        PERFORM credpool_end_leases(v_provider, v_expired,
                                    array_fill('expired'::text, ARRAY[cardinality(v_expired)]),
                                    ARRAY(SELECT x.lease_until FROM unnest(v_expired) AS x));
    END IF;

    SELECT count(*) FILTER (WHERE lease_id IS NOT NULL), coalesce(bool_or(over_limit), false)
    INTO v_live, v_was_over
    FROM lease_slots WHERE provider = v_provider AND key_id = p_key_id;

    -- (Each step below is a statement over the credential's rows alone, with what it needs from
    -- the others read first into plain values: a join of the rows to a subquery of themselves may
    -- be planned, for a credential or table that has grown since its plan was made, as a loop
    -- that runs the subquery once per row; docs/reliability.md, "Fuzzing".)
    IF v_live > v_limit THEN
        DELETE FROM lease_slots
        WHERE provider = v_provider AND key_id = p_key_id AND lease_id IS NULL;
        -- every row holds a live lease now; the `limit` rows whose leases end last, ranked by
        -- (lease_until DESC, slot), stay within the limit: the last of them is read, and a row
        -- ranked after it is surplus
        SELECT lease_until, slot INTO v_last_kept
        FROM lease_slots WHERE provider = v_provider AND key_id = p_key_id
        ORDER BY lease_until DESC, slot
        OFFSET v_limit - 1 LIMIT 1;
        UPDATE lease_slots s
        SET over_limit = true,
            surplus = (s.lease_until, -s.slot) < (v_last_kept.lease_until, -v_last_kept.slot),
            draining = v_draining, windowed = v_windowed, config_version = v_version
        WHERE s.provider = v_provider AND s.key_id = p_key_id
          AND (NOT s.over_limit
               OR s.surplus IS DISTINCT FROM
                  ((s.lease_until, -s.slot) < (v_last_kept.lease_until, -v_last_kept.slot))
               OR s.draining IS DISTINCT FROM v_draining OR s.windowed IS DISTINCT FROM v_windowed
               OR s.config_version IS DISTINCT FROM v_version);
        IF NOT v_was_over THEN
            PERFORM credpool_bump_pool_version(v_provider, v_pool);
        END IF;
        PERFORM credpool_test_hook('fit.done');
        RETURN;
    END IF;

    -- The live leases at or above the limit, lowest first, move into the numbers below it that no
    -- live lease holds, lowest first (there are enough: in-flight <= limit). Every number up to
    -- the last of those targets that no live lease holds is a target, so the free rows there make
    -- way by a range; each mover finds its target by its own number in a map.
    SELECT array_agg(slot ORDER BY slot) INTO v_movers
    FROM lease_slots
    WHERE provider = v_provider AND key_id = p_key_id AND slot >= v_limit AND lease_id IS NOT NULL;
    IF v_movers IS NOT NULL THEN
        SELECT array_agg(t.slot ORDER BY t.slot) INTO v_targets
        FROM (SELECT g FROM generate_series(0, v_limit - 1) AS g
              EXCEPT
              SELECT slot FROM lease_slots
              WHERE provider = v_provider AND key_id = p_key_id AND slot < v_limit
                AND lease_id IS NOT NULL
              ORDER BY 1 LIMIT cardinality(v_movers)) AS t (slot);
        DELETE FROM lease_slots
        WHERE provider = v_provider AND key_id = p_key_id
          AND slot <= v_targets[cardinality(v_targets)] AND lease_id IS NULL;
        SELECT jsonb_object_agg(f, t) INTO v_moves FROM unnest(v_movers, v_targets) AS x (f, t);
        UPDATE lease_slots s
        SET slot = (v_moves ->> s.slot::text)::integer
        WHERE s.provider = v_provider AND s.key_id = p_key_id AND s.slot >= v_limit
          AND s.lease_id IS NOT NULL;
    END IF;

    DELETE FROM lease_slots WHERE provider = v_provider AND key_id = p_key_id AND slot >= v_limit;
    INSERT INTO lease_slots (key_id, slot, provider, draining, windowed, config_version)
    SELECT p_key_id, g, v_provider, v_draining, v_windowed, v_version
    FROM generate_series(0, v_limit - 1) AS g
    ON CONFLICT ON CONSTRAINT lease_slots_pkey DO NOTHING;
    UPDATE lease_slots
    SET over_limit = false, surplus = false, draining = v_draining, windowed = v_windowed,
        config_version = v_version
    WHERE provider = v_provider AND key_id = p_key_id
      AND (over_limit OR draining IS DISTINCT FROM v_draining OR windowed IS DISTINCT FROM v_windowed
           OR config_version IS DISTINCT FROM v_version);
    IF v_was_over THEN
        PERFORM credpool_bump_pool_version(v_provider, v_pool);
    END IF;
    PERFORM credpool_test_hook('fit.done');
END;
$$;

-- FORCE RELEASE: an operator ends leases: one (p_lease_id), or every live lease of a credential
-- (p_key_id), each as `force_released` with the operator's reason and name, and announces the
-- freed slots to the waiting allocations of every process (at the commit). Returns the leases
-- ended. Locks the whole credential first (credpool_lock_credentials: every slot row, the windows
-- row, the credential row), so that a credential over a lowered limit is refitted in the same
-- transaction and reopens at once. Decision clock: clock_timestamp() after the locks (`at` of the
-- trail rows).
DROP FUNCTION IF EXISTS credpool_force_release(text, uuid, text, text);
CREATE FUNCTION credpool_force_release(p_key_id text, p_lease_id uuid, p_reason text, p_actor text)
RETURNS TABLE (lease_id uuid, key_id text, holder text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_key text := p_key_id;
    v_provider text;
    v_now timestamptz;
    v_slots lease_slots[];
    v_ended uuid[];
BEGIN
    IF v_key IS NULL THEN
        -- the lease's credential, when not given: its `granted` row in the trail names it
        SELECT g.key_id INTO v_key
        FROM lease_events g WHERE g.lease_id = p_lease_id AND g.event = 'granted' LIMIT 1;
    END IF;
    IF v_key IS NULL OR credpool_lock_credentials(ARRAY[v_key]) = 0 THEN
        RETURN;
    END IF;
    v_now := clock_timestamp();
    SELECT c.provider INTO v_provider FROM credentials c WHERE c.key_id = v_key;
    SELECT coalesce(array_agg(ROW(s.*)::lease_slots ORDER BY s.slot), '{}') INTO v_slots
    FROM lease_slots s
    WHERE s.provider = v_provider AND s.key_id = v_key AND s.lease_id IS NOT NULL
      AND s.lease_until > v_now AND (p_lease_id IS NULL OR s.lease_id = p_lease_id);
    v_ended := credpool_end_leases(
        v_provider,
        v_slots,
        array_fill('force_released'::text, ARRAY[cardinality(v_slots)]),
        array_fill(v_now, ARRAY[cardinality(v_slots)]),
        NULL,
        array_fill(p_reason, ARRAY[cardinality(v_slots)]),
        array_fill(p_actor, ARRAY[cardinality(v_slots)]));
    IF EXISTS (SELECT 1 FROM unnest(v_slots) AS x WHERE x.over_limit) THEN
        PERFORM credpool_fit_slots(v_key);
    END IF;
    -- the freed slots, to every process's waiters of the pool, at the commit
    PERFORM pg_notify('credpool_slot_freed', json_build_object(
                'provider', x.provider, 'pool', x.pool, 'key_id', x.key_id, 'slot', x.slot)::text)
    FROM unnest(v_slots) AS x
    WHERE x.lease_id = ANY (v_ended);
    RETURN QUERY
    SELECT x.lease_id, x.key_id, x.holder
    FROM unnest(v_slots) AS x
    WHERE x.lease_id = ANY (v_ended)
    ORDER BY x.slot;
END;
$$;

-- REAP: ends up to p_batch expired leases (`expired`, at their own lease_until) and frees their
-- slots. Correctness never depends on it (a claim treats an expired lease as free and reuses its
-- slot); it keeps the trail complete and "leases in flight" honest. Takes slot rows with SKIP
-- LOCKED, deciding on statement_timestamp(); END then takes the leases' tenant rows (lock order
-- 4), which it may wait for while a claim that locked one commits (milliseconds). Leaves the rows within a lowered limit (over_limit, not
-- surplus) to claims and to REFIT: ended here, END would close them while a surplus row still
-- holds its (expired) lease. Returns how many leases it ended.
-- The leases, oldest first, are read; then, provider by provider (on Citus each provider's
-- statements run on its worker), their slot rows are locked, the lease's expiry checked again on
-- the locked row, and ended.
CREATE OR REPLACE FUNCTION credpool_reap_expired_leases(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_doomed record;
    v_provider text;
    v_slots lease_slots[];
    v_ended integer := 0;
BEGIN
    SELECT coalesce(array_agg(s.provider), '{}') AS providers,
           coalesce(array_agg(s.key_id), '{}') AS keys, coalesce(array_agg(s.slot), '{}') AS slots
    INTO v_doomed
    FROM (SELECT s.provider, s.key_id, s.slot
          FROM lease_slots s
          WHERE s.lease_id IS NOT NULL AND s.lease_until <= statement_timestamp()
            AND (s.surplus OR NOT s.over_limit)
          ORDER BY s.lease_until
          LIMIT p_batch) AS s;
    FOR v_provider IN SELECT DISTINCT x FROM unnest(v_doomed.providers) AS x ORDER BY 1 LOOP
        SELECT array_agg(ROW(s.*)::lease_slots ORDER BY s.key_id, s.slot) INTO v_slots
        FROM (SELECT s.*
              FROM lease_slots s
              JOIN unnest(v_doomed.providers, v_doomed.keys, v_doomed.slots)
                   AS d (provider, key_id, slot) ON s.key_id = d.key_id AND s.slot = d.slot
              WHERE s.provider = v_provider AND d.provider = v_provider
                AND s.lease_id IS NOT NULL AND s.lease_until <= statement_timestamp()
                AND (s.surplus OR NOT s.over_limit)
              FOR UPDATE OF s SKIP LOCKED) AS s;
        CONTINUE WHEN v_slots IS NULL;
        v_ended := v_ended + cardinality(credpool_end_leases(
            v_provider,
            v_slots,
            array_fill('expired'::text, ARRAY[cardinality(v_slots)]),
            ARRAY(SELECT x.lease_until FROM unnest(v_slots) AS x)));
    END LOOP;
    RETURN v_ended;
END;
$$;

-- REFIT, in the cleanup pass: fits the slots of up to p_batch credentials that are over a lowered
-- limit with fewer leases in flight than the limit (their releases normally refit them at once;
-- this catches a service that stopped in between, and removes the surplus rows once their leases
-- have ended). Never waits for a slot or credential row: a credential whose slot rows or row
-- another transaction holds is left for the next pass (its rows within the limit reopen on their
-- own meanwhile). It may wait for the tenant slot rows of the leases it ends
-- (credpool_lock_credentials, lock order 4), which a claim holds until it commits: never for
-- long, and never in a cycle, since a claim takes no slot or credential row it waits for.
-- Returns how many credentials it fitted.
CREATE OR REPLACE FUNCTION credpool_refit_over_limit(p_batch integer DEFAULT 100) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_fitted integer := 0;
    r record;
BEGIN
    FOR r IN
        SELECT c.key_id, c.provider
        FROM credentials c
        WHERE EXISTS (SELECT 1 FROM lease_slots s
                      WHERE s.provider = c.provider AND s.key_id = c.key_id AND s.over_limit)
          AND (SELECT count(*) FROM lease_slots s
               WHERE s.provider = c.provider AND s.key_id = c.key_id AND s.lease_id IS NOT NULL
                 AND s.lease_until > statement_timestamp()) < c.max_concurrent_uses
        ORDER BY c.key_id
        LIMIT p_batch
    LOOP
        -- all or nothing, without waiting: the operator lock (before any row: FIT takes it), every
        -- slot row, the windows row and the credential row, or skip it
        IF pg_try_advisory_xact_lock(credpool_operator_lock(r.key_id))
           AND (SELECT count(*) FROM (SELECT 1 FROM lease_slots s
                                      WHERE s.provider = r.provider AND s.key_id = r.key_id
                                      ORDER BY s.slot FOR UPDATE SKIP LOCKED) locked)
               = (SELECT count(*) FROM lease_slots s
                  WHERE s.provider = r.provider AND s.key_id = r.key_id)
           AND (SELECT count(*) FROM (SELECT 1 FROM lease_windows w
                                      WHERE w.provider = r.provider AND w.key_id = r.key_id
                                      FOR UPDATE SKIP LOCKED) locked)
               = (SELECT count(*) FROM lease_windows w
                  WHERE w.provider = r.provider AND w.key_id = r.key_id)
           AND EXISTS (SELECT 1 FROM credentials c
                       WHERE c.provider = r.provider AND c.key_id = r.key_id
                       FOR UPDATE SKIP LOCKED)
        THEN
            PERFORM credpool_fit_slots(r.key_id);
            v_fitted := v_fitted + 1;
        END IF;
    END LOOP;
    RETURN v_fitted;
END;
$$;
