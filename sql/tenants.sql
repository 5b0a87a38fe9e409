-- Tenants: the key's tenant, a tenant's slot rows fitted to its cap and its windows to its
-- rate_limits (FIT TENANT, with the windows seeded before the tenant's lock: CUT, SEED TENANT
-- WINDOWS), its usage, and the cleanup pass's refit.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one
-- transaction; every statement here must be safe to run again. Lock order and clocks:
-- docs/design.md ("Lock order", "Clocks").

-- The tenant of the executor key whose hash (hex SHA-256) is `p_key_hash`: one row, the key's
-- tenant, while the key is live; no row for a key that is unknown or revoked. NULL: the configured
-- internal key, whose tenant is `default`. Read by the statement that decides, so a call that
-- starts after a revoke committed is refused on every replica. A set-returning SQL function, so
-- that it inlines where it is joined (`LEFT JOIN LATERAL credpool_key_tenant(...) ON true`): one
-- probe of tenant_keys' unique key_hash index. (On Citus, which refuses it inlined, it is made a
-- PL/pgSQL function with the same query: store::schema::look_up_keys_apart.)
CREATE OR REPLACE FUNCTION credpool_key_tenant(p_key_hash text)
RETURNS SETOF text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT 'default'::text WHERE p_key_hash IS NULL
    UNION ALL
    SELECT k.tenant_id FROM tenant_keys k
    WHERE k.key_hash = decode(p_key_hash, 'hex') AND k.revoked_at IS NULL
$$;

-- Whether a tenant's `pools` (patterns `provider/pool`, `*` for any provider or any pool) admit
-- `p_provider`/`p_pool`: the rule the service applies when a request arrives, applied again by
-- each claim.
CREATE OR REPLACE FUNCTION credpool_scope_admits(p_pools text[], p_provider text, p_pool text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT EXISTS (SELECT 1 FROM unnest(p_pools) AS p (pattern)
                   WHERE split_part(p.pattern, '/', 1) IN ('*', p_provider)
                     AND split_part(p.pattern, '/', 2) IN ('*', p_pool))
$$;

-- CUT, the first step of a change of tenant `p_tenant_id`'s windows, in a transaction of its own:
-- waits for the tenant's claims and usage reports in flight (its advisory lock, exclusively: they
-- hold it shared) and returns the moment it got it. Every grant and report of the tenant dated
-- up to that moment has committed once this transaction ends (the ones in flight were waited for;
-- one that starts later takes the lock after it and is dated after it), so a seed taken up to it
-- without the lock (SEED TENANT WINDOWS) misses nothing, and FIT TENANT adds what came after.
CREATE OR REPLACE FUNCTION credpool_tenant_cut(p_tenant_id text) RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('credpool.tenant:' || p_tenant_id, 0));
    RETURN clock_timestamp();
END;
$$;

-- SEED TENANT WINDOWS: the windows of `p_rate_limits` of tenant `p_tenant_id` seeded from the
-- trail as it stood at `p_cut` (credpool_tenant_cut), taken WITHOUT the tenant's lock: reading a
-- busy tenant's grants of a long window takes seconds, and under the lock every claim of the
-- tenant would answer `busy` meanwhile. Returns {"cut", "windows"} for credpool_fit_tenant, which
-- adds what came after the cut under the lock.
CREATE OR REPLACE FUNCTION credpool_seed_tenant_windows(p_tenant_id text, p_rate_limits jsonb,
    p_cut timestamptz)
RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_seeded lease_windows;
BEGIN
    PERFORM credpool_test_hook('tenant.seeding');
    v_seeded := credpool_windows_fitted(ROW(p_tenant_id, '{}', '{}', '{}', '{}', '{}', NULL)::lease_windows,
                                        p_rate_limits, NULL, p_tenant_id, clock_timestamp(),
                                        p_upto => p_cut);
    RETURN jsonb_build_object('cut', p_cut, 'windows', to_jsonb(v_seeded));
END;
$$;

-- Brings a tenant's tenant_windows row in line with its rate_limits (credpool_fit_tenant calls
-- it holding the tenant's advisory lock): a tenant with windows has its row, one without none.
-- `p_seed`: what SEED TENANT WINDOWS returned (NULL: new windows are seeded here, from the whole
-- trail).
DROP FUNCTION IF EXISTS credpool_fit_tenant_windows(text, jsonb, timestamptz);
CREATE OR REPLACE FUNCTION credpool_fit_tenant_windows(p_tenant_id text, p_rate_limits jsonb,
    p_now timestamptz, p_seed jsonb DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_old lease_windows;
    v_new lease_windows;
BEGIN
    SELECT (credpool_tenant_window(tw)).* INTO v_old
    FROM tenant_windows tw WHERE tw.tenant_id = p_tenant_id FOR UPDATE;
    IF NOT FOUND THEN
        v_old := ROW(p_tenant_id, '{}', '{}', '{}', '{}', '{}', NULL)::lease_windows;
    END IF;
    v_new := credpool_windows_fitted(
        v_old, p_rate_limits, NULL, p_tenant_id, p_now,
        p_seeded => jsonb_populate_record(NULL::lease_windows, p_seed -> 'windows'),
        p_cut => (p_seed ->> 'cut')::timestamptz);
    IF cardinality(v_new.window_kinds) = 0 THEN
        DELETE FROM tenant_windows WHERE tenant_id = p_tenant_id;
    ELSIF v_new IS DISTINCT FROM v_old THEN
        INSERT INTO tenant_windows AS tw (tenant_id, window_kinds, window_counts, window_seconds,
                                          bucket_ids, bucket_charged)
        VALUES (p_tenant_id, v_new.window_kinds, v_new.window_counts, v_new.window_seconds,
                v_new.bucket_ids, v_new.bucket_charged)
        ON CONFLICT ON CONSTRAINT tenant_windows_pkey DO UPDATE
        SET window_kinds = EXCLUDED.window_kinds, window_counts = EXCLUDED.window_counts,
            window_seconds = EXCLUDED.window_seconds, bucket_ids = EXCLUDED.bucket_ids,
            bucket_charged = EXCLUDED.bucket_charged;
    END IF;
END;
$$;

-- FIT TENANT: brings tenant `p_tenant_id`'s slot rows in line with its cap
-- (max_concurrent_leases), and its tenant_windows row with its rate_limits
-- (credpool_fit_tenant_windows; `p_seed`: what SEED TENANT WINDOWS returned, or NULL), in the
-- caller's transaction. Called by an operator's PUT of the tenant and by the cleanup pass.
--
-- Invariant kept: a capped tenant's live leases never exceed its cap at a grant. Capacity is the
-- set of its tenant_slots rows a claim may take (not surplus); every live lease of the tenant
-- sits in one row. Afterwards, with `live` leases in flight (counted after the locks, on
-- clock_timestamp()): free rows are deleted; if live <= cap, every row is open and cap - live
-- free rows are added, so exactly cap leases may be held; if live > cap (lowered under load),
-- every row is over_limit, and the `cap` rows whose leases end last stay within the cap while the
-- others are `surplus` (never claimed; gone at the next fit), as FIT does for a credential. A row
-- within the cap reopens on its own when its lease ends (on the database clock: nothing has to
-- run), and exactly back up to the cap: every surplus lease ends no later than every lease within
-- it (ranked so here; RENEW keeps it, credpool_renewal_end; END closes a row within the cap that
-- frees while a surplus lease is held), so when k of those rows have reopened, at most cap - k
-- leases count. Lowering a cap revokes nothing. A tenant without a cap keeps no rows.
--
-- A tenant given a cap while it holds leases (none of them in rows: it had no cap) adopts them:
-- their slot rows are locked first (lock order: slot rows, then tenant rows), so none of them
-- ends or is renewed unseen, and each gets a row. A claim in flight holds the tenant's advisory
-- lock in shared mode until it commits, so its lease is among them (CLAIM, "Tenants").
--
-- Locks: the tenant's advisory lock (one fit of a tenant at a time: rows are only inserted and
-- deleted here; claims of the tenant hold it in shared mode, tried), then (adopting) the slot
-- rows of its leases, then every tenant_slots row of it, ascending slot, then its
-- tenant_windows row.
DROP FUNCTION IF EXISTS credpool_fit_tenant(text);
CREATE OR REPLACE FUNCTION credpool_fit_tenant(p_tenant_id text, p_seed jsonb DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
    v_rate_limits jsonb;
    v_now timestamptz;
    v_live integer;
    v_provider text;
    v_keys text[];
    v_leases uuid[];
    v_ends timestamptz[];
    v_providers text[];
    v_last_kept record;
    v_free integer[];
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('credpool.tenant:' || p_tenant_id, 0));
    SELECT max_concurrent_leases, rate_limits INTO v_cap, v_rate_limits
    FROM tenants WHERE tenant_id = p_tenant_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_cap IS NOT NULL AND NOT EXISTS (SELECT 1 FROM tenant_slots WHERE tenant_id = p_tenant_id) THEN
        -- provider by provider (PASSES; no lease of the tenant can be granted meanwhile: its
        -- claims hold the advisory lock this fit holds exclusively)
        FOREACH v_provider IN ARRAY credpool_provider_passes(ARRAY(
            SELECT DISTINCT s.provider FROM lease_slots s
            WHERE s.tenant = p_tenant_id AND s.lease_id IS NOT NULL ORDER BY 1))
        LOOP
            PERFORM 1 FROM lease_slots s
            WHERE s.tenant = p_tenant_id AND s.lease_id IS NOT NULL
              AND credpool_on_provider(s.provider, v_provider)
            ORDER BY s.provider, s.key_id, s.slot
            FOR UPDATE;
        END LOOP;
        -- each adopted lease gets a row, and names it on its slot row, as a grant's does (the
        -- rows as columns: Citus sends no table's row type to a worker whole)
        SELECT coalesce(array_agg(s.key_id ORDER BY s.key_id, s.slot), '{}'),
               coalesce(array_agg(s.lease_id ORDER BY s.key_id, s.slot), '{}'),
               coalesce(array_agg(s.lease_until ORDER BY s.key_id, s.slot), '{}'),
               coalesce(array_agg(DISTINCT s.provider), '{}')
        INTO v_keys, v_leases, v_ends, v_providers
        FROM lease_slots s
        WHERE s.tenant = p_tenant_id AND s.lease_id IS NOT NULL
          AND s.lease_until > clock_timestamp();
        INSERT INTO tenant_slots (tenant_id, slot, lease_id, key_id, lease_until)
        SELECT p_tenant_id, (a.n - 1)::integer, a.lease_id, a.key_id, a.lease_until
        FROM unnest(v_keys, v_leases, v_ends) WITH ORDINALITY AS a (key_id, lease_id, lease_until, n);
        FOREACH v_provider IN ARRAY credpool_provider_passes(v_providers) LOOP
            UPDATE lease_slots s
            SET tenant_slot = (a.n - 1)::integer
            FROM unnest(v_keys, v_leases) WITH ORDINALITY AS a (key_id, lease_id, n)
            WHERE s.key_id = a.key_id AND s.lease_id = a.lease_id
              AND credpool_on_provider(s.provider, v_provider);
        END LOOP;
    END IF;
    PERFORM 1 FROM tenant_slots t WHERE t.tenant_id = p_tenant_id ORDER BY t.slot FOR UPDATE;
    -- its windows, after its slot rows (the lock order): the row is taken by claims (with SKIP
    -- LOCKED, never waited for) and by releases reporting usage, for the milliseconds of their
    -- statements
    PERFORM credpool_fit_tenant_windows(p_tenant_id, v_rate_limits, clock_timestamp(), p_seed);
    v_now := clock_timestamp();
    IF v_cap IS NULL THEN
        DELETE FROM tenant_slots WHERE tenant_id = p_tenant_id;
        RETURN;
    END IF;
    DELETE FROM tenant_slots
    WHERE tenant_id = p_tenant_id AND (lease_id IS NULL OR lease_until <= v_now);
    SELECT count(*)::integer INTO v_live FROM tenant_slots WHERE tenant_id = p_tenant_id;
    -- (as in FIT: what a step needs from the other rows is read first, and each change is a
    -- statement of the tenant's rows alone, which no plan can turn into a subquery per row)
    IF v_live > v_cap THEN
        -- every row holds a live lease; the `cap` rows that end last, ranked by
        -- (lease_until DESC, slot), stay within the cap: a row ranked after the last of them is
        -- surplus (with a cap of 0, after an end no lease has: every row)
        IF v_cap = 0 THEN
            SELECT 'infinity'::timestamptz AS lease_until, 0 AS slot INTO v_last_kept;
        ELSE
            SELECT lease_until, slot INTO v_last_kept
            FROM tenant_slots WHERE tenant_id = p_tenant_id
            ORDER BY lease_until DESC, slot
            OFFSET v_cap - 1 LIMIT 1;
        END IF;
        UPDATE tenant_slots t
        SET over_limit = true,
            surplus = (t.lease_until, -t.slot) < (v_last_kept.lease_until, -v_last_kept.slot)
        WHERE t.tenant_id = p_tenant_id
          AND (NOT t.over_limit
               OR t.surplus IS DISTINCT FROM
                  ((t.lease_until, -t.slot) < (v_last_kept.lease_until, -v_last_kept.slot)));
        RETURN;
    END IF;
    UPDATE tenant_slots SET over_limit = false, surplus = false
    WHERE tenant_id = p_tenant_id AND (over_limit OR surplus);
    -- the lowest numbers no live lease holds, cap - live of them
    SELECT coalesce(array_agg(f.slot), '{}') INTO v_free
    FROM (SELECT g FROM generate_series(0, v_cap + v_live) AS g
          EXCEPT
          SELECT slot FROM tenant_slots WHERE tenant_id = p_tenant_id
          ORDER BY 1 LIMIT v_cap - v_live) AS f (slot);
    INSERT INTO tenant_slots (tenant_id, slot)
    SELECT p_tenant_id, f.slot FROM unnest(v_free) AS f (slot);
END;
$$;

-- A tenant's leases in flight now (live: lease_until after the clock) and its cap, for the admin
-- list: every lease of the tenant, capped or not, read from the slot rows (a tenant's usage is a
-- read, not a decision: the claim decides on tenant_slots). The counts are grouped subqueries,
-- not correlated ones: Citus takes no correlated subquery of a distributed table under a reference
-- table's rows, and a list of every tenant reads the slot rows once.
CREATE OR REPLACE VIEW tenant_usage AS
SELECT t.tenant_id, t.max_concurrent_leases, t.weight, t.rate_limits,
       coalesce(f.in_flight, 0) AS in_flight, coalesce(k.live_keys, 0) AS live_keys,
       t.created_at, t.updated_at
FROM tenants t
LEFT JOIN (SELECT s.tenant, count(*) AS in_flight FROM lease_slots s
           WHERE s.lease_id IS NOT NULL AND s.lease_until > now()
           GROUP BY s.tenant) AS f ON f.tenant = t.tenant_id
LEFT JOIN (SELECT k.tenant_id, count(*) AS live_keys FROM tenant_keys k
           WHERE k.revoked_at IS NULL
           GROUP BY k.tenant_id) AS k ON k.tenant_id = t.tenant_id;

-- REFIT TENANTS, in the cleanup pass: fits up to p_batch tenants over a lowered cap that are
-- back under it (their rows within the cap reopen on their own as their leases end, see FIT
-- TENANT; this removes the surplus rows). A tenant whose advisory lock another transaction holds
-- (an operator's change; a claim of the tenant, in shared mode, for the milliseconds of its
-- transaction) is left for the next pass: waiting for it while holding the rows of a tenant
-- fitted before would break the lock order, and nothing but tidiness waits for the fit. The fit
-- waits only for tenant rows a claim, renewal or release holds for the milliseconds of its
-- statement. Returns how many tenants it fitted.
CREATE OR REPLACE FUNCTION credpool_refit_tenants(p_batch integer DEFAULT 100) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_fitted integer := 0;
    r record;
BEGIN
    FOR r IN
        -- (grouped by tenant, not correlated: on Citus the tenant rows are distributed by
        -- tenant, and no correlated subquery of them is taken under the tenants' rows)
        SELECT n.tenant_id
        FROM tenants n
        JOIN (SELECT t.tenant_id,
                     count(*) FILTER (WHERE t.lease_id IS NOT NULL
                                        AND t.lease_until > statement_timestamp()) AS live
              FROM tenant_slots t
              GROUP BY t.tenant_id
              HAVING bool_or(t.over_limit)) AS t ON t.tenant_id = n.tenant_id
        WHERE t.live <= coalesce(n.max_concurrent_leases, 2147483647)
        ORDER BY n.tenant_id LIMIT p_batch
    LOOP
        IF pg_try_advisory_xact_lock(hashtextextended('credpool.tenant:' || r.tenant_id, 0)) THEN
            PERFORM credpool_fit_tenant(r.tenant_id);
            v_fitted := v_fitted + 1;
        END IF;
    END LOOP;
    RETURN v_fitted;
END;
$$;

-- Upgrading to tenant windows (migration 20261203000016), once the functions above are in place,
-- in the transaction that puts them there; nothing to do on a later run. Leases in flight of
-- capped tenants name their tenant slot rows (lease_slots.tenant_slot); tenants given windows
-- before windows were enforced get their tenant_windows rows, seeded from the trail like a window
-- set now (credpool_fit_tenant, under the tenant's advisory lock).
-- (Not on a distributed database: it is distributed after its migrations, this one among them;
-- and its joins of slot rows to tenant rows span workers there.)
DO $$
BEGIN
    IF credpool_is_distributed('lease_slots') THEN
        RETURN;
    END IF;
    UPDATE lease_slots s
    SET tenant_slot = t.slot
    FROM tenant_slots t
    WHERE t.tenant_id = s.tenant AND t.lease_id = s.lease_id AND s.tenant_slot IS DISTINCT FROM t.slot;
    PERFORM credpool_fit_tenant(t.tenant_id)
    FROM tenants t
    WHERE t.rate_limits <> '[]'::jsonb
      AND NOT EXISTS (SELECT 1 FROM tenant_windows w WHERE w.tenant_id = t.tenant_id);
END
$$;
