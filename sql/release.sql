-- Ending leases: END (the one way a lease leaves its slot, with its trail row), usage charged to
-- windows, RELEASE (the executor's release and outcome report) and the health write.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one
-- transaction; every statement here must be safe to run again. Lock order and clocks:
-- docs/design.md ("Lock order", "Clocks").

-- The trail rows of leases that end: element i of each array is the i-th lease's. `p_events[i]`
-- is released, expired or force_released; `p_at[i]` when it took effect (an expired lease's own
-- lease_until); `p_outcomes`, `p_reasons`, `p_actors`, `p_tokens` (the usage its release
-- reported) may be NULL as a whole. Writes lease_events only; the caller holds the slot rows'
-- locks. Returns how many rows it wrote.
DROP FUNCTION IF EXISTS credpool_record_lease_end(lease_slots, text, timestamptz, text, text, text, bigint);
DROP FUNCTION IF EXISTS credpool_record_lease_ends(lease_slots[], text[], timestamptz[], text[],
    text[], text[], bigint[]);
CREATE FUNCTION credpool_record_lease_ends(
    p_slots lease_slots[], p_events text[], p_at timestamptz[], p_outcomes text[] DEFAULT NULL,
    p_reasons text[] DEFAULT NULL, p_actors text[] DEFAULT NULL, p_tokens bigint[] DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease_events
        (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at, reason,
         actor, tokens, tenant)
    SELECT p_events[i], (p_slots[i]).lease_id, (p_slots[i]).key_id, (p_slots[i]).provider,
           (p_slots[i]).pool, (p_slots[i]).slot, (p_slots[i]).holder, p_outcomes[i],
           (p_slots[i]).lease_until, p_at[i], p_reasons[i], p_actors[i], p_tokens[i],
           (p_slots[i]).tenant
    FROM generate_subscripts(p_slots, 1) AS i;
    RETURN cardinality(p_slots);
END;
$$;

-- END: the one way leases leave their slots, any number at once (element i of each array is the
-- i-th lease's: the slot row as the caller read it, and the trail row's values as for
-- credpool_record_lease_ends). Clears every lease column of each slot row (the slot keeps its
-- number, its last grant time and its gates) and writes the trail rows, in two statements
-- however many leases end. Only where the slot still holds that lease: ending twice ends once.
-- A row within a lowered limit (over_limit, not surplus) that frees while a surplus row of its
-- credential still holds a lease becomes surplus too: opened now, it would grant while the
-- surplus lease still counts (FIT says why rows within the limit may otherwise reopen on their
-- own). Such a row is over_limit, so the caller refits the credential (RELEASE's `refit`).
-- A lease of a capped tenant leaves its tenant slot row in the same call (the row's lock taken
-- here, after the slot rows, unless the caller took it right after them, as RELEASE and
-- credpool_lock_credentials do: a caller that holds a lease_windows or credentials row must have,
-- lock order 4), so the tenant's cap frees with the credential's slot: a tenant slot row holds a
-- lease exactly while the lease's slot row does (or until both have expired). A tenant slot row
-- within a lowered cap that frees while a surplus row of its tenant still holds a lease becomes
-- surplus too, for the credential's reason (FIT TENANT); the cleanup pass refits the tenant
-- (credpool_refit_tenants).
-- The caller has locked the slot rows (in the lock order) and decided, on its own clock, that the
-- leases end now. It announces nothing: the caller does when waiters must hear of it (a
-- release, a forced release). Every slot row is of credentials of provider `p_provider` (on
-- Citus the statements run on its worker alone; a caller with leases of several providers calls
-- once per provider, ascending). Returns the leases it ended.
DROP FUNCTION IF EXISTS credpool_end_lease(lease_slots, text, timestamptz, text, text, text, bigint);
DROP FUNCTION IF EXISTS credpool_end_leases(lease_slots[], text[], timestamptz[], text[], text[],
    text[], bigint[]);
CREATE OR REPLACE FUNCTION credpool_end_leases(p_provider text,
    p_slots lease_slots[], p_events text[], p_at timestamptz[], p_outcomes text[] DEFAULT NULL,
    p_reasons text[] DEFAULT NULL, p_actors text[] DEFAULT NULL, p_tokens bigint[] DEFAULT NULL)
RETURNS uuid[]
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_ended integer[];
    v_leases uuid[];
    v_tenant_rows boolean;
    v_ended_slots lease_slots[];
    v_tenant text;
    v_written integer;
BEGIN
    WITH cleared AS (
        UPDATE lease_slots s
        SET lease_id = NULL, pool = NULL, holder = NULL, granted_at = NULL,
            lease_until = NULL, probe = false, fence = NULL, reserved_tokens = NULL, tenant = NULL,
            tenant_slot = NULL,
            surplus = s.surplus
                      OR (s.over_limit
                          AND EXISTS (SELECT 1 FROM lease_slots o
                                      WHERE o.provider = p_provider AND o.key_id = s.key_id
                                        AND o.surplus AND o.lease_id IS NOT NULL
                                        AND o.slot <> s.slot))
        FROM generate_subscripts(p_slots, 1) AS i
        WHERE s.provider = p_provider
          AND s.key_id = (p_slots[i]).key_id AND s.slot = (p_slots[i]).slot
          AND s.lease_id = (p_slots[i]).lease_id
        RETURNING i
    )
    SELECT array_agg(i ORDER BY i), array_agg((p_slots[i]).lease_id ORDER BY i),
           coalesce(bool_or((p_slots[i]).tenant_slot IS NOT NULL), false)
    INTO v_ended, v_leases, v_tenant_rows
    FROM cleared;
    IF v_ended IS NULL THEN
        RETURN '{}';
    END IF;
    -- their tenant slot rows: locked in order (held already when the caller locked them after
    -- the slot rows), then cleared where they still hold the lease (a row whose expired lease a
    -- claim has replaced holds another lease now); leases of uncapped tenants, `default` among
    -- them, have no row: nothing more to do
    IF v_tenant_rows THEN
        v_ended_slots := ARRAY(SELECT p_slots[i] FROM unnest(v_ended) AS i);
        v_tenant_rows := credpool_lock_tenant_slots(v_ended_slots);
    END IF;
    IF v_tenant_rows THEN
        FOREACH v_tenant IN ARRAY credpool_slot_tenant_passes(v_ended_slots) LOOP
            UPDATE tenant_slots t
            SET lease_id = NULL, key_id = NULL, lease_until = NULL,
                surplus = t.surplus
                          OR (t.over_limit
                              AND EXISTS (SELECT 1 FROM tenant_slots o
                                          WHERE credpool_on_tenant(o.tenant_id, v_tenant)
                                            AND o.tenant_id = t.tenant_id AND o.surplus
                                            AND o.lease_id IS NOT NULL AND o.slot <> t.slot))
            FROM unnest(v_ended) AS i
            WHERE credpool_on_tenant(t.tenant_id, v_tenant)
              AND t.tenant_id = (p_slots[i]).tenant AND t.slot = (p_slots[i]).tenant_slot
              AND t.lease_id = (p_slots[i]).lease_id;
        END LOOP;
    END IF;
    IF cardinality(v_ended) = cardinality(p_slots) THEN
        v_written := credpool_record_lease_ends(p_slots, p_events, p_at, p_outcomes, p_reasons,
                                                p_actors, p_tokens);
    ELSE
        v_written := credpool_record_lease_ends(
            ARRAY(SELECT p_slots[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_events[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_at[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_outcomes[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_reasons[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_actors[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_tokens[i] FROM unnest(v_ended) AS i));
    END IF;
    RETURN v_leases;
END;
$$;

-- USAGE: the tokens a call really used replace its reservation in the token windows of its
-- credential `p_key_id` (of provider `p_provider`) and of its tenant `p_tenant` (a lease granted
-- at `p_granted_at`; `p_delta` = usage - reservation). The caller holds the lease_windows row's
-- lock and the tenant_windows row's.
DROP FUNCTION IF EXISTS credpool_charge_usage(text, timestamptz, bigint);
DROP FUNCTION IF EXISTS credpool_charge_usage(text, text, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_charge_usage(p_provider text, p_key_id text, p_tenant text,
    p_granted_at timestamptz, p_delta bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE lease_windows w
    SET (bucket_ids, bucket_charged) =
        (SELECT x.bucket_ids, x.bucket_charged FROM credpool_window_adjust(w, p_granted_at, p_delta) x)
    WHERE credpool_on_provider(w.provider, p_provider) AND w.key_id = p_key_id AND p_delta <> 0
      AND 'tokens' = ANY (w.window_kinds);
    UPDATE tenant_windows tw
    SET (bucket_ids, bucket_charged) =
        (SELECT x.bucket_ids, x.bucket_charged
         FROM credpool_window_adjust(credpool_tenant_window(tw), p_granted_at, p_delta) x)
    WHERE tw.tenant_id = p_tenant AND p_delta <> 0 AND 'tokens' = ANY (tw.window_kinds);
END;
$$;

-- RELEASE (DESIGN "The protocol", step 4), for one release or a group, in ONE statement: the
-- driver over the phases below, each run only when a release of the call needs it.
--
-- p_releases jsonb: an array of releases, each an object with credpool_release's first
-- attributes (migration 20261204000019): "lease_id", "key_id", "provider", "pool", "fence" (or
-- null), "outcome" (or null), "usage_tokens" (or null), "key_hash" (hex SHA-256 of the tenant key
-- the executor presented; null: the internal key, tenant `default`), "retry_after_seconds", and
-- "may_disable" (the reporter may take a credential out of traffic until an operator acts;
-- absent: the internal key may, a tenant's key may not). p_policy: the service's health policy
-- (credpool_health_apply).
--
-- For each release, in its slot row's lock: a key of another tenant than the lease's (its slot
-- row's `tenant`, or for a lease no longer in its slot, its `granted` row's) or no live key does
-- nothing ('unauthorized'); a live lease named by all of its values ends as `released` with the
-- outcome ('released'); one named by all of its values but expired ends as `expired` at its own
-- lease_until if it still sits in its slot ('expired'); one in a slot but named with another
-- key_id, provider, pool or fence is left alone ('mismatch'); one in no slot is 'not_found'. An
-- outcome or a usage for an expired or ended lease granted with the values given is recorded once
-- as `outcome_after_expiry` (under the lease's advisory lock: retries count once)
-- and still counts for health. A usage replaces the lease's reservation in its credential's and
-- tenant's token windows, once. A counted outcome changes the credential's health
-- (credpool_health_apply; several reports on one credential one after the other, in request
-- order), with a `status_changed` row for each transition naming the reporter's tenant. An
-- `auth_expired` report on a lease of an OAuth credential's current token generation takes that
-- token out of traffic and makes its refresh due (`token_rejected`).
--
-- Returns one row per release, in order: the verdict; the credential (key_id); `refit`: the slot
-- was over a lowered limit (the caller refits the credential in a transaction of its own once this
-- one has committed); `usage_granted_at`, `usage_delta`: when a usage replaced a reservation;
-- `counted` and the credential's health after the report (for the caller's view); `waiters`: a
-- released lease's pool has a request waiting for a slot on some service process (the caller
-- announces the freed slot after the commit, credpool_announce_freed; a slot freed as `expired`
-- is never announced: it was claimable from its lease_until on, and waiters keep a timer for it).
--
-- Phases: PARSE (and the slot rows, locked), USAGE LOCKS (a usage), REJECTS (an auth_expired
-- report), LOCK (tenant slot rows: a capped tenant's lease; windows rows: a usage), VERDICTS and
-- END, LATE (a report for an ended lease, a usage), HEALTH (a counted outcome), TOKENS (an
-- auth_expired report), ANSWERS. A plain release group (success reports of uncapped tenants'
-- live leases, no usage) runs PARSE, VERDICTS and END, HEALTH and ANSWERS.
--
-- Locks, in the lock order (docs/design.md): the usage tenants' advisory locks in shared mode;
-- for an `auth_expired` report on the caller's own lease of an OAuth credential, the operator
-- locks and every slot row, tenant slot row and lease_windows row of that credential
-- (credpool_lock_credentials without its credential row); the named leases' slot rows, ascending
-- (provider, key_id, slot), in one statement per pass; their tenant slot rows (credpool_lock_tenant_slots); the
-- lease_windows rows of the credentials named with a usage, then those leases' tenants'
-- tenant_windows rows; late reports' lease advisory locks, ascending lease_id; the credential
-- rows of counted outcomes, ascending (provider, key_id). Decision clock: clock_timestamp() after the slot
-- locks (`released` rows carry it as `at`), and for health after the credential rows' locks.
DROP FUNCTION IF EXISTS credpool_release(jsonb);
DROP FUNCTION IF EXISTS credpool_release(jsonb, boolean);
DROP FUNCTION IF EXISTS credpool_release(jsonb, jsonb);
DROP FUNCTION IF EXISTS credpool_write_health(jsonb, jsonb);
CREATE FUNCTION credpool_release(p_releases jsonb, p_policy jsonb)
RETURNS TABLE (release integer, verdict text, key_id text, refit boolean,
               usage_granted_at timestamptz, usage_delta bigint, counted boolean, status text,
               status_reason text, cooldown_until timestamptz, health_successes double precision,
               health_failures double precision, health_rate_limits double precision,
               health_decayed_at timestamptz, recent_failures timestamptz[],
               cooldowns_in_a_row integer, last_success_at timestamptz, recovered_at timestamptz,
               waiters boolean)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_parsed record;
    v_verdicts record;
    v_releases credpool_release[];
    v_usage boolean;
    v_rejects boolean;
    v_reject_keys text[] := '{}';
    v_slots lease_slots[];
    v_now timestamptz;
    v_late boolean;
    v_counted boolean;
    v_hooked boolean;
    v_passes text[] := credpool_call_passes(p_releases);
    v_provider text;
BEGIN
    -- (the phases are called in expressions, not statements: each costs a function call only)
    v_parsed := credpool_release_parse(p_releases, v_passes);
    v_releases := v_parsed.releases;
    v_usage := v_parsed.usage;
    v_rejects := v_parsed.rejects;
    IF v_releases IS NULL THEN
        RETURN;
    END IF;
    IF v_rejects THEN
        -- (the credentials' rows before every other row: their slot rows come first, in one
        -- order with the slot rows of the group's other leases)
        v_reject_keys := credpool_release_rejects(v_releases, v_passes);
        IF v_reject_keys <> '{}' THEN
            PERFORM credpool_lock_credentials(v_reject_keys, false,
                ARRAY(SELECT r.lease_id FROM unnest(v_releases) AS r),
                ARRAY(SELECT r.key_id FROM unnest(v_releases) AS r));
        END IF;
    END IF;
    v_slots := credpool_release_lock(v_releases, v_usage, v_parsed.usage_tenants, v_passes);
    v_hooked := credpool_test_hook('release.locked');
    v_now := clock_timestamp();
    v_verdicts := credpool_release_verdicts(v_releases, v_slots, v_usage, v_now, v_passes);
    v_releases := v_verdicts.releases;
    v_late := v_verdicts.late;
    v_counted := v_verdicts.counted;
    IF v_late THEN
        v_releases := credpool_release_late(v_releases, v_now);
        v_counted := EXISTS (SELECT 1 FROM unnest(v_releases) AS r WHERE r.counted);
    END IF;
    IF v_counted THEN
        v_releases := credpool_release_health(v_releases, v_reject_keys, p_policy, v_passes);
    END IF;
    IF v_reject_keys <> '{}' THEN
        v_hooked := credpool_release_tokens(v_releases, v_reject_keys, v_now, v_passes);
    END IF;
    -- (one query per pass: on Citus each reads its provider's waiters on its worker; the caller
    -- orders the rows)
    FOREACH v_provider IN ARRAY v_passes LOOP
    RETURN QUERY
    SELECT r.n, r.verdict, CASE WHEN r.verdict IN ('released', 'expired') OR r.counted
                                THEN r.key_id END,
           r.verdict IN ('released', 'expired') AND coalesce((r.slot).over_limit, false),
           r.usage_at, r.usage_delta, coalesce(r.counted, false), (r.health).status,
           (r.health).status_reason, (r.health).cooldown_until, (r.health).health_successes,
           (r.health).health_failures, (r.health).health_rate_limits,
           (r.health).health_decayed_at, (r.health).recent_failures,
           (r.health).cooldowns_in_a_row, (r.health).last_success_at, (r.health).recovered_at,
           r.verdict = 'released'
           AND EXISTS (SELECT 1 FROM pool_waiters w
                       WHERE credpool_on_provider(w.provider, v_provider)
                         AND w.provider = r.provider AND r.pool = ANY (w.pools) AND w.until > v_now)
    FROM unnest(v_releases) AS r
    WHERE credpool_on_provider(r.provider, v_provider)
    ORDER BY r.n;
    END LOOP;
END;
$$;

-- PARSE: the releases of a call as the service sent them, each with its key's tenant (NULL: no
-- live key; read by this statement, so no replica honours a key once its revoke has committed);
-- whether any reports a usage, and whether any reports `auth_expired`. With a usage, the tenants
-- of the leases it names (`usage_tenants`; read per pass, `p_passes`) take their
-- advisory locks in shared mode here, first of every lock (no change of one of them adds or
-- removes its tenant_windows row, or seeds a new window from the trail, while this call charges
-- its usage). (The locks are taken in a statement of their own: on Citus the reads run on the
-- workers, and an advisory lock taken there would not be the coordinator's.)
DROP FUNCTION IF EXISTS credpool_release_parse(jsonb);
CREATE OR REPLACE FUNCTION credpool_release_parse(p_releases jsonb, p_passes text[],
    OUT releases credpool_release[], OUT usage boolean, OUT rejects boolean,
    OUT usage_tenants text[])
LANGUAGE plpgsql
AS $$
DECLARE
    v_provider text;
BEGIN
    SELECT array_agg(ROW(x.lease_id, x.key_id, x.provider, x.pool, x.fence, x.outcome,
                         x.usage_tokens, x.key_hash, x.retry_after_seconds,
                         coalesce(x.may_disable, x.key_hash IS NULL), x.ordinality::integer,
                         k.tenant, NULL, NULL, NULL, NULL, false, NULL)::credpool_release
                     ORDER BY x.ordinality),
           coalesce(bool_or(x.usage_tokens IS NOT NULL), false),
           coalesce(bool_or(x.outcome = 'auth_expired'), false)
    INTO releases, usage, rejects
    FROM jsonb_populate_recordset(NULL::credpool_release, p_releases) WITH ORDINALITY AS x
    LEFT JOIN LATERAL credpool_key_tenant(x.key_hash) AS k (tenant) ON true;
    usage_tenants := '{}';
    IF usage THEN
        FOREACH v_provider IN ARRAY p_passes LOOP
            usage_tenants := usage_tenants || ARRAY(
                SELECT coalesce(s.tenant, g.tenant)
                FROM unnest(releases) AS r
                LEFT JOIN lease_slots s ON credpool_on_provider(s.provider, v_provider)
                    AND s.key_id = r.key_id AND s.lease_id = r.lease_id
                LEFT JOIN LATERAL (
                    SELECT g.tenant FROM lease_events g
                    WHERE s.lease_id IS NULL AND credpool_on_provider(g.provider, v_provider)
                      AND g.lease_id = r.lease_id AND g.event = 'granted'
                    LIMIT 1
                ) AS g ON true
                WHERE credpool_on_provider(r.provider, v_provider) AND r.usage_tokens IS NOT NULL
                  AND coalesce(s.tenant, g.tenant) IS NOT NULL);
        END LOOP;
        -- (the locks ascending; the tenants kept distinct and ascending, as passes)
        SELECT coalesce(array_agg(t.tenant ORDER BY t.tenant), '{}') INTO usage_tenants
        FROM (SELECT DISTINCT u AS tenant FROM unnest(usage_tenants) AS u ORDER BY 1) AS t
        CROSS JOIN LATERAL pg_advisory_xact_lock_shared(
            hashtextextended('credpool.tenant:' || t.tenant, 0)) AS l;
    END IF;
END;
$$;

-- REJECTS: the OAuth credentials whose tokens the call's `auth_expired` reports may reject,
-- ascending: only a reporting lease's own (the lease named sits on it: its slot row says so, or,
-- once it left it, its `granted` row; and the key presented is of the lease's tenant; read from
-- this snapshot: a lease's credential and tenant never change). A report naming any other
-- credential locks nothing of it.
DROP FUNCTION IF EXISTS credpool_release_rejects(credpool_release[]);
CREATE OR REPLACE FUNCTION credpool_release_rejects(p_releases credpool_release[],
    p_passes text[])
RETURNS text[]
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_keys text[] := '{}';
    v_provider text;
BEGIN
    FOREACH v_provider IN ARRAY p_passes LOOP
        v_keys := v_keys || ARRAY(
            SELECT r.key_id
            FROM unnest(p_releases) AS r
            JOIN oauth_credentials o
                ON credpool_on_provider(o.provider, v_provider) AND o.key_id = r.key_id
            LEFT JOIN lease_slots s ON credpool_on_provider(s.provider, v_provider)
                AND s.key_id = r.key_id AND s.lease_id = r.lease_id
            LEFT JOIN LATERAL (
                SELECT g.key_id, coalesce(g.tenant, 'default') AS tenant FROM lease_events g
                WHERE s.lease_id IS NULL AND credpool_on_provider(g.provider, v_provider)
                  AND g.lease_id = r.lease_id AND g.event = 'granted'
                LIMIT 1
            ) AS g ON true
            WHERE credpool_on_provider(r.provider, v_provider)
              AND r.outcome = 'auth_expired' AND r.tenant IS NOT NULL
              AND coalesce(s.key_id, g.key_id) = r.key_id
              AND coalesce(s.tenant, g.tenant) = r.tenant);
    END LOOP;
    RETURN ARRAY(SELECT DISTINCT k FROM unnest(v_keys) AS k ORDER BY 1);
END;
$$;

-- LOCK: the slot rows of the named leases, ascending (provider, key_id, slot), in one statement
-- per pass (`p_passes`, credpool_provider_passes; on Citus a release that names another provider
-- than its lease's finds no slot row: its provider's worker is asked): returned
-- as locked (their newest versions); their tenant slot rows right after (lock order 4: END
-- clears them), only when a lease has one; with a usage, the lease_windows rows of the
-- credentials named with one, then the tenant_windows rows of those leases' tenants
-- (`p_usage_tenants`, whose advisory locks PARSE took).
DROP FUNCTION IF EXISTS credpool_release_lock(credpool_release[], boolean);
DROP FUNCTION IF EXISTS credpool_release_lock(credpool_release[], boolean, text[]);
CREATE OR REPLACE FUNCTION credpool_release_lock(p_releases credpool_release[], p_usage boolean,
    p_usage_tenants text[], p_passes text[])
RETURNS lease_slots[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_slots lease_slots[] := '{}';
    v_found lease_slots[];
    v_capped boolean;
    v_tenant_rows boolean := false;
    v_provider text;
    v_tenant text;
BEGIN
    FOREACH v_provider IN ARRAY p_passes LOOP
        SELECT coalesce(array_agg(l.s), '{}'), coalesce(bool_or((l.s).tenant_slot IS NOT NULL), false)
        INTO v_found, v_capped
        FROM (SELECT ROW(s.*)::lease_slots AS s FROM lease_slots s
              WHERE credpool_on_provider(s.provider, v_provider)
                AND (s.key_id, s.lease_id) IN (SELECT r.key_id, r.lease_id FROM unnest(p_releases) AS r
                                               WHERE credpool_on_provider(r.provider, v_provider))
              ORDER BY s.provider, s.key_id, s.slot
              FOR UPDATE) AS l;
        v_slots := v_slots || v_found;
        v_tenant_rows := v_tenant_rows OR v_capped;
    END LOOP;
    IF v_tenant_rows THEN
        v_tenant_rows := credpool_lock_tenant_slots(v_slots);
    END IF;
    IF p_usage THEN
        FOREACH v_provider IN ARRAY p_passes LOOP
            PERFORM 1 FROM lease_windows w
            WHERE credpool_on_provider(w.provider, v_provider)
              AND w.key_id IN (SELECT r.key_id FROM unnest(p_releases) AS r
                               WHERE r.usage_tokens IS NOT NULL
                                 AND credpool_on_provider(r.provider, v_provider))
            ORDER BY w.provider, w.key_id
            FOR UPDATE;
        END LOOP;
        FOREACH v_tenant IN ARRAY credpool_tenant_passes(p_usage_tenants) LOOP
            PERFORM 1 FROM tenant_windows tw
            WHERE credpool_on_tenant(tw.tenant_id, v_tenant) AND tw.tenant_id = ANY (p_usage_tenants)
            ORDER BY tw.tenant_id
            FOR UPDATE;
        END LOOP;
    END IF;
    RETURN v_slots;
END;
$$;

-- VERDICTS and END: each release's verdict, decided on its lease's slot row as locked (`p_slots`)
-- and the clock read after the locks: a lease named twice in one call is ended by the first
-- request (in order) that names it by all of its values; the others find it gone. Then every
-- lease that ends, in one call of END: released now (with its outcome and usage), or found
-- expired in its slot (at its own lease_until). Says whether a late report or a usage is left
-- for LATE, and whether an outcome counts for HEALTH.
DROP FUNCTION IF EXISTS credpool_release_verdicts(credpool_release[], lease_slots[], boolean,
    timestamptz);
CREATE OR REPLACE FUNCTION credpool_release_verdicts(p_releases credpool_release[],
    p_slots lease_slots[], p_usage boolean, p_now timestamptz, p_passes text[],
    OUT releases credpool_release[], OUT late boolean, OUT counted boolean)
LANGUAGE plpgsql
AS $$
DECLARE
    v_providers text[] := '{}';
    v_provider text;
    v_part credpool_release[];
    v_late boolean;
    v_counted boolean;
    v_ending text[];
BEGIN
    releases := '{}';
    late := false;
    counted := false;
    -- (one statement per pass: on Citus the trail and the slot rows of a lease no longer in its
    -- slot are read on its provider's worker)
    FOREACH v_provider IN ARRAY p_passes LOOP
    SELECT coalesce(array_agg(ROW(j.lease_id, j.key_id, j.provider, j.pool, j.fence, j.outcome,
                         j.usage_tokens, j.key_hash, j.retry_after_seconds, j.may_disable, j.n,
                         j.tenant, j.s, j.decided, NULL, NULL,
                         j.decided = 'released' AND j.outcome IS NOT NULL, NULL)::credpool_release
                     ORDER BY j.n), '{}'),
           coalesce(bool_or(j.decided IN ('expired', 'not_found')
                            AND (j.outcome IS NOT NULL OR j.usage_tokens IS NOT NULL)
                            OR j.decided = 'released' AND j.usage_tokens IS NOT NULL), false),
           coalesce(bool_or(j.decided = 'released' AND j.outcome IS NOT NULL), false),
           coalesce(array_agg(DISTINCT (j.s).provider ORDER BY (j.s).provider)
                        FILTER (WHERE j.decided IN ('released', 'expired')), '{}')
    INTO v_part, v_late, v_counted, v_ending
    FROM (
        SELECT b.*,
               CASE WHEN NOT b.authorized THEN 'unauthorized'
                    WHEN (b.s).lease_id IS NOT NULL AND b.matches AND b.nth = 1 THEN
                        CASE WHEN (b.s).lease_until > p_now THEN 'released' ELSE 'expired' END
                    WHEN b.found AND NOT b.matches THEN 'mismatch'
                    ELSE 'not_found' END AS decided
        FROM (
        SELECT r.*, x AS s, a.authorized, a.found, a.matches,
               row_number() OVER (PARTITION BY r.lease_id, a.authorized, a.matches
                                  ORDER BY r.n) AS nth
        FROM unnest(p_releases) AS r
        LEFT JOIN unnest(p_slots) AS x ON x.key_id = r.key_id AND x.lease_id = r.lease_id
        -- for a lease no longer in the slot named: its `granted` row (its tenant; NULL there:
        -- granted before tenants existed, to `default`), and whether it sits in another slot
        LEFT JOIN LATERAL (
            SELECT coalesce(g.tenant, 'default') AS tenant,
                   EXISTS (SELECT 1 FROM lease_slots o
                           WHERE credpool_on_provider(o.provider, v_provider)
                             AND o.key_id = g.key_id AND o.lease_id = g.lease_id) AS elsewhere
            FROM lease_events g
            WHERE x.lease_id IS NULL AND credpool_on_provider(g.provider, v_provider)
              AND g.lease_id = r.lease_id AND g.event = 'granted'
            LIMIT 1
        ) AS g ON true
        CROSS JOIN LATERAL (
            -- the key must be live (absent: the configured internal key, tenant `default`) and
            -- of the lease's tenant: its slot row's, or its `granted` row's
            SELECT r.tenant IS NOT NULL
                   AND coalesce(x.tenant, g.tenant, r.tenant) = r.tenant AS authorized,
                   x.lease_id IS NOT NULL OR coalesce(g.elsewhere, false) AS found,
                   coalesce(x.provider = r.provider AND x.pool = r.pool
                            AND (r.fence IS NULL OR x.fence = r.fence), false) AS matches
        ) AS a
        WHERE credpool_on_provider(r.provider, v_provider)
        ) AS b
    ) AS j;
    releases := releases || v_part;
    late := late OR v_late;
    counted := counted OR v_counted;
    v_providers := v_providers || v_ending;
    END LOOP;
    IF cardinality(p_passes) > 1 THEN
        -- (the later phases find release n at place n)
        releases := ARRAY(SELECT r FROM unnest(releases) AS r ORDER BY r.n);
    END IF;
    -- (one call per provider of the leases that end, ascending: almost always one)
    FOREACH v_provider IN ARRAY v_providers LOOP
        PERFORM credpool_end_leases(
            v_provider,
            ARRAY(SELECT r.slot FROM unnest(releases) AS r
                  WHERE r.verdict IN ('released', 'expired') AND (r.slot).provider = v_provider
                  ORDER BY r.n),
            ARRAY(SELECT r.verdict FROM unnest(releases) AS r
                  WHERE r.verdict IN ('released', 'expired') AND (r.slot).provider = v_provider
                  ORDER BY r.n),
            ARRAY(SELECT CASE WHEN r.verdict = 'released' THEN p_now ELSE (r.slot).lease_until END
                  FROM unnest(releases) AS r
                  WHERE r.verdict IN ('released', 'expired') AND (r.slot).provider = v_provider
                  ORDER BY r.n),
            ARRAY(SELECT CASE WHEN r.verdict = 'released' THEN r.outcome END
                  FROM unnest(releases) AS r
                  WHERE r.verdict IN ('released', 'expired') AND (r.slot).provider = v_provider
                  ORDER BY r.n),
            NULL,
            NULL,
            CASE WHEN p_usage THEN
                ARRAY(SELECT CASE WHEN r.verdict = 'released' THEN r.usage_tokens END
                      FROM unnest(releases) AS r
                      WHERE r.verdict IN ('released', 'expired') AND (r.slot).provider = v_provider
                      ORDER BY r.n)
            END);
    END LOOP;
END;
$$;

-- LATE: what each release did for the windows, and the late reports: a released lease's usage
-- replaces its reservation; an outcome or usage for a lease that had ended (expired, or in no
-- slot: granted with the values given, by its `granted` row) is recorded once as
-- `outcome_after_expiry` and counts like a release's (after the ends, so a late report sees the
-- `released` row of a release of the same lease in the same call). Each late report takes its
-- lease's advisory lock first, in ascending lease_id (lock order 7): two groups reporting the same
-- leases wait for each other in one order, and the second finds the first's row.
CREATE OR REPLACE FUNCTION credpool_release_late(p_releases credpool_release[], p_now timestamptz)
RETURNS credpool_release[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_releases credpool_release[] := p_releases;
    r credpool_release;
    v_late record;
BEGIN
    FOR r IN SELECT x.* FROM unnest(p_releases) AS x ORDER BY x.lease_id, x.n LOOP
        IF r.verdict = 'released' AND r.usage_tokens IS NOT NULL THEN
            v_releases[r.n].usage_at := (r.slot).granted_at;
            v_releases[r.n].usage_delta := r.usage_tokens - coalesce((r.slot).reserved_tokens, 0);
            PERFORM credpool_charge_usage(r.provider, r.key_id, (r.slot).tenant, (r.slot).granted_at,
                                          r.usage_tokens - coalesce((r.slot).reserved_tokens, 0));
        ELSIF r.verdict IN ('expired', 'not_found')
              AND (r.outcome IS NOT NULL OR r.usage_tokens IS NOT NULL) THEN
            -- once per lease: under the lease's advisory lock, so the check below sees the
            -- row of any earlier holder (a retry in another group), committed
            PERFORM pg_advisory_xact_lock(hashtextextended('credpool.lease:' || r.lease_id, 0));
            -- (the lease's `granted` row and what its trail says since, read first and written
            -- after in a statement of its own: on Citus each is routed to the lease's provider's
            -- worker, which an INSERT fed by a query with subqueries of the trail is not)
            SELECT g.*, t.last_until, t.reported INTO v_late
            FROM (SELECT max(e.lease_until) AS last_until,
                         bool_or(e.event IN ('released', 'outcome_after_expiry')) AS reported
                  FROM lease_events e
                  WHERE credpool_on_provider(e.provider, r.provider) AND e.lease_id = r.lease_id) AS t
            CROSS JOIN LATERAL (
                SELECT g.lease_id, g.key_id, g.provider, g.pool, g.slot, g.holder, g.tenant,
                       g.at AS granted_at, g.tokens AS reserved
                FROM lease_events g
                WHERE credpool_on_provider(g.provider, r.provider)
                  AND g.lease_id = r.lease_id AND g.event = 'granted'
                  AND g.key_id = r.key_id AND g.provider = r.provider AND g.pool = r.pool
                  AND (r.fence IS NULL OR g.fence IS NULL OR g.fence = r.fence)
                LIMIT 1
            ) AS g
            WHERE NOT coalesce(t.reported, false);
            IF FOUND THEN
                INSERT INTO lease_events
                    (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until,
                     at, tokens, tenant)
                VALUES ('outcome_after_expiry', v_late.lease_id, v_late.key_id, v_late.provider,
                        v_late.pool, v_late.slot, v_late.holder, r.outcome, v_late.last_until,
                        p_now, r.usage_tokens, v_late.tenant);
                v_releases[r.n].counted := r.outcome IS NOT NULL;
                IF r.usage_tokens IS NOT NULL THEN
                    v_releases[r.n].usage_at := v_late.granted_at;
                    v_releases[r.n].usage_delta := r.usage_tokens - coalesce(v_late.reserved, 0);
                    PERFORM credpool_charge_usage(r.provider, r.key_id, v_late.tenant,
                                                  v_late.granted_at,
                                                  r.usage_tokens - coalesce(v_late.reserved, 0));
                END IF;
            END IF;
        END IF;
    END LOOP;
    RETURN v_releases;
END;
$$;

-- HEALTH: the credential rows of counted outcomes, locked (lock order 8: after the trail rows;
-- FOR UPDATE on the credentials whose slot rows an `auth_expired` report took, `p_reject_keys`,
-- whose token write follows, FOR NO KEY UPDATE on the others, one row at a time, ascending, when
-- the strengths differ), then each counted outcome applied in request order per credential
-- (credpool_health_apply, on the clock read after the locks; `auth_expired` on a credential that
-- is not OAuth is the provider refusing the key: `auth_error`), the rows written, and a
-- `status_changed` row for each transition, naming the reporter's tenant. Each release carries
-- its credential's health after its report.
DROP FUNCTION IF EXISTS credpool_release_health(credpool_release[], text[], jsonb);
CREATE OR REPLACE FUNCTION credpool_release_health(p_releases credpool_release[],
    p_reject_keys text[], p_policy jsonb, p_passes text[])
RETURNS credpool_release[]
LANGUAGE plpgsql
-- (health written from reports moves no configuration version: GATES, sql/locks.sql)
AS $$
DECLARE
    v_releases credpool_release[] := p_releases;
    v_rows credentials[] := '{}';
    v_written credentials[] := '{}';
    v_at integer := 0;
    v_current credentials;
    v_now timestamptz;
    v_events jsonb := '[]';
    v_key record;
    v_provider text;
    r credpool_release;
    a record;
BEGIN
    IF p_reject_keys <> '{}' THEN
        FOR v_key IN SELECT DISTINCT x.provider, x.key_id FROM unnest(p_releases) AS x
                     WHERE x.counted ORDER BY x.provider, x.key_id LOOP
            IF v_key.key_id = ANY (p_reject_keys) THEN
                v_rows := v_rows || ARRAY(SELECT ROW(c.*)::credentials FROM credentials c
                                          WHERE c.provider = v_key.provider
                                            AND c.key_id = v_key.key_id
                                          FOR UPDATE);
            ELSE
                v_rows := v_rows || ARRAY(SELECT ROW(c.*)::credentials FROM credentials c
                                          WHERE c.provider = v_key.provider
                                            AND c.key_id = v_key.key_id
                                          FOR NO KEY UPDATE);
            END IF;
        END LOOP;
    ELSE
        FOREACH v_provider IN ARRAY p_passes LOOP
            v_rows := v_rows || ARRAY(SELECT ROW(c.*)::credentials FROM credentials c
                                      WHERE credpool_on_provider(c.provider, v_provider)
                                        AND (c.provider, c.key_id) IN (
                                                SELECT x.provider, x.key_id
                                                FROM unnest(p_releases) AS x
                                                WHERE x.counted
                                                  AND credpool_on_provider(x.provider, v_provider))
                                      ORDER BY c.provider, c.key_id
                                      FOR NO KEY UPDATE);
        END LOOP;
    END IF;
    v_now := clock_timestamp();
    -- (both in ascending (provider, key_id): the rows are walked once, alongside the reports; a
    -- counted report named its lease's provider, which is its credential's)
    FOR r IN SELECT x.* FROM unnest(p_releases) AS x WHERE x.counted
             ORDER BY x.provider, x.key_id, x.n LOOP
        IF v_current.key_id IS DISTINCT FROM r.key_id THEN
            IF v_current.key_id IS NOT NULL THEN
                v_written := v_written || v_current;
            END IF;
            LOOP
                v_at := v_at + 1;
                EXIT WHEN v_at > cardinality(v_rows)
                          OR (v_rows[v_at].provider, v_rows[v_at].key_id) >= (r.provider, r.key_id);
            END LOOP;
            IF v_at > cardinality(v_rows)
               OR (v_rows[v_at].provider, v_rows[v_at].key_id) <> (r.provider, r.key_id) THEN
                -- deleted meanwhile: nothing to apply
                v_current := NULL;
                v_at := v_at - 1;
                v_releases[r.n].counted := false;
                CONTINUE;
            END IF;
            v_current := v_rows[v_at];
        END IF;
        a := credpool_health_apply(
            v_current,
            CASE WHEN r.outcome = 'auth_expired' AND v_current.token_expires_at IS NULL
                 THEN 'auth_error' ELSE r.outcome END,
            r.retry_after_seconds, coalesce((r.slot).probe, false), r.may_disable, v_now,
            p_policy);
        IF a.changed THEN
            v_events := v_events || jsonb_build_object(
                'key_id', r.key_id, 'old_status', v_current.status, 'new_status', (a.next).status,
                'reason', (a.next).status_reason, 'cooldown_until', (a.next).cooldown_until,
                'lease_id', r.lease_id, 'actor', 'tenant:' || r.tenant,
                'details', jsonb_build_object('tenant', r.tenant, 'outcome', r.outcome,
                                              'retry_after_seconds', r.retry_after_seconds,
                                              'clamped_from_seconds', a.clamped_from));
        END IF;
        v_current := a.next;
        v_releases[r.n].health := v_current;
    END LOOP;
    IF v_current.key_id IS NOT NULL THEN
        v_written := v_written || v_current;
    END IF;
    FOREACH v_provider IN ARRAY p_passes LOOP
        UPDATE credentials c
        SET status = n.status, status_reason = n.status_reason, cooldown_until = n.cooldown_until,
            health_successes = n.health_successes, health_failures = n.health_failures,
            health_rate_limits = n.health_rate_limits, health_decayed_at = n.health_decayed_at,
            recent_failures = n.recent_failures, cooldowns_in_a_row = n.cooldowns_in_a_row,
            last_success_at = n.last_success_at, recovered_at = n.recovered_at
        FROM unnest(v_written) AS n
        WHERE credpool_on_provider(c.provider, v_provider)
          AND credpool_on_provider(n.provider, v_provider) AND c.key_id = n.key_id;
    END LOOP;
    IF v_events <> '[]' THEN
        INSERT INTO credential_events
            (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at, actor,
             details)
        SELECT t.key_id, 'status_changed', t.old_status, t.new_status, t.reason, t.cooldown_until,
               t.lease_id, v_now, t.actor, t.details
        FROM jsonb_to_recordset(v_events) AS t (
            key_id text, old_status text, new_status text, reason text,
            cooldown_until timestamptz, lease_id uuid, actor text, details jsonb);
    END IF;
    RETURN v_releases;
END;
$$;

-- TOKENS: `auth_expired` on a lease of an OAuth credential's current generation (granted at or
-- after the generation began; the credential's operator locks and slot rows are held since REJECTS,
-- so no refresh or PUT is writing meanwhile, and its row since HEALTH): the token counts as
-- expired from now, so no claim grants it again (credpool_token_lasts, gated by config_version),
-- and the refresher finds it due at once, which refreshes it exactly once however many reports
-- arrive (the refresh is taken per generation, service/src/oauth.rs). A report on a lease of an
-- older generation says nothing about the current token.
DROP FUNCTION IF EXISTS credpool_release_tokens(credpool_release[], text[], timestamptz);
CREATE OR REPLACE FUNCTION credpool_release_tokens(p_releases credpool_release[],
    p_reject_keys text[], p_now timestamptz, p_passes text[])
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_provider text;
    v_rejected jsonb := '[]';
BEGIN
    -- (one statement per pass, the events written after: on Citus the credentials are written on
    -- their workers, and the events' table is the coordinator's)
    FOREACH v_provider IN ARRAY p_passes LOOP
        WITH expired AS (
            UPDATE credentials c
            SET token_expires_at = p_now
            FROM (
                SELECT DISTINCT ON (r.key_id) r.key_id, r.lease_id, o.generation
                FROM unnest(p_releases) AS r
                JOIN oauth_credentials o
                    ON credpool_on_provider(o.provider, v_provider) AND o.key_id = r.key_id
                CROSS JOIN LATERAL (
                    SELECT coalesce((r.slot).granted_at,
                                    (SELECT g.at FROM lease_events g
                                     WHERE credpool_on_provider(g.provider, v_provider)
                                       AND g.lease_id = r.lease_id AND g.event = 'granted'
                                     LIMIT 1)) AS granted_at
                ) AS g
                WHERE credpool_on_provider(r.provider, v_provider)
                  AND r.counted AND r.outcome = 'auth_expired' AND r.key_id = ANY (p_reject_keys)
                  AND g.granted_at >= o.generation_at
                ORDER BY r.key_id, g.granted_at
            ) AS r
            WHERE credpool_on_provider(c.provider, v_provider)
              AND c.key_id = r.key_id AND c.token_expires_at > p_now
            RETURNING c.key_id, r.lease_id, r.generation
        )
        SELECT v_rejected || coalesce(jsonb_agg(to_jsonb(e)), '[]') INTO v_rejected FROM expired AS e;
    END LOOP;
    INSERT INTO credential_events (key_id, event, reason, lease_id, actor, details, at)
    SELECT e.key_id, 'token_rejected',
           'auth_expired reported: the provider rejected the access token; refresh due now',
           e.lease_id, 'executor', jsonb_build_object('generation', e.generation), p_now
    FROM jsonb_to_recordset(v_rejected) AS e (key_id text, lease_id uuid, generation bigint);
    RETURN FOUND;
END;
$$;

-- HEALTH (docs/selection.md): credential `c`'s health after an outcome report at `p_now` under
-- policy `p_policy` (the service's: {"half_life_seconds", "failure_threshold",
-- "failure_window_seconds", "cooldown_seconds", "max_cooldown_seconds", "rate_limit_seconds",
-- "max_report_rest_seconds"}, seconds). `p_outcome` as the release applies it (`auth_expired` on a
-- credential that is not OAuth arrives as `auth_error`); `p_probe`: the lease was the probe of a
-- recovering credential; `p_may_disable`: the reporter may take the credential out of traffic
-- until an operator acts. The state machine of service/src/domain/health.rs, rule for rule (a
-- test holds the two equal on random reports): `next` is `c` with its health columns changed,
-- `changed` whether the status or the cooldown's end changed (a transition for the trail), and
-- `clamped_from` the retry_after a report asked for when it was longer than the longest rest a
-- report may give.
CREATE OR REPLACE FUNCTION credpool_health_apply(c credentials, p_outcome text,
    p_retry_after integer, p_probe boolean, p_may_disable boolean, p_now timestamptz,
    p_policy jsonb, OUT next credentials, OUT changed boolean, OUT clamped_from integer)
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_half float8 := (p_policy ->> 'half_life_seconds')::float8;
    v_keep integer := greatest((p_policy ->> 'failure_threshold')::integer, 1);
    v_window float8 := (p_policy ->> 'failure_window_seconds')::float8;
    v_max_rest float8 := (p_policy ->> 'max_report_rest_seconds')::float8;
    v_elapsed float8;
    v_factor float8 := 1;
    v_recovering boolean := c.status <> 'available'
                            AND credential_usable(c.status, c.cooldown_until, p_now);
    v_hold boolean := c.status IN ('disabled', 'pending');
    v_wait float8;
    v_rest float8;
    v_until timestamptz;
BEGIN
    next := c;
    IF c.health_decayed_at IS NOT NULL THEN
        v_elapsed := greatest(extract(epoch FROM p_now - c.health_decayed_at)::float8, 0);
        v_factor := CASE WHEN v_half > 0 THEN power(0.5::float8, v_elapsed / v_half)
                         WHEN v_elapsed > 0 THEN 0 ELSE 1 END;
    END IF;
    next.health_successes := c.health_successes * v_factor;
    next.health_failures := c.health_failures * v_factor;
    next.health_rate_limits := c.health_rate_limits * v_factor;
    next.health_decayed_at := p_now;
    IF p_outcome = 'success' THEN
        next.health_successes := next.health_successes + 1;
        next.last_success_at := p_now;
        IF v_recovering THEN
            next.status := 'available';
            next.cooldown_until := NULL;
            next.cooldowns_in_a_row := 0;
            next.recovered_at := p_now;
            next.status_reason := CASE WHEN p_probe THEN 'probe succeeded'
                                       ELSE 'success after the cooldown ended' END;
        END IF;
    ELSIF p_outcome = 'failure' THEN
        next.health_failures := next.health_failures + 1;
        next.recent_failures := (coalesce(c.recent_failures, '{}') || p_now)
            [greatest(cardinality(coalesce(c.recent_failures, '{}')) + 2 - v_keep, 1):];
        IF v_recovering AND p_probe THEN
            next := credpool_health_cooldown(next, p_now, p_policy, 'probe failed');
        ELSIF c.status = 'available'
              AND (SELECT count(*) FROM unnest(next.recent_failures) AS t
                   WHERE t > p_now - make_interval(secs => v_window)) >= v_keep THEN
            next := credpool_health_cooldown(next, p_now, p_policy,
                format('%s failures within %s s', v_keep, v_window));
        END IF;
    ELSIF p_outcome = 'rate_limited' THEN
        next.health_rate_limits := next.health_rate_limits + 1;
        IF NOT v_hold AND c.status <> 'exhausted' THEN
            -- 0 or absent means "use the default", never "no cooldown"
            IF p_retry_after >= 1 THEN
                v_wait := least(p_retry_after::float8, greatest(v_max_rest, 1));
                clamped_from := CASE WHEN p_retry_after > greatest(v_max_rest, 1) THEN p_retry_after END;
            ELSE
                v_wait := least((p_policy ->> 'rate_limit_seconds')::float8, v_max_rest);
            END IF;
            v_until := p_now + make_interval(secs => v_wait);
            IF v_recovering AND p_probe THEN
                v_until := greatest(v_until, p_now + credpool_health_backoff(p_policy, c.cooldowns_in_a_row));
                next.cooldowns_in_a_row := c.cooldowns_in_a_row + 1;
            END IF;
            -- a shorter report never shortens a longer cooldown
            next.status := 'rate_limited';
            next.cooldown_until := greatest(v_until, c.cooldown_until);
            next.status_reason := CASE WHEN clamped_from IS NULL
                THEN format('rate limited by the provider (rest %s s)', v_wait)
                ELSE format('rate limited by the provider (rest %s s: the report''s retry_after of %s s clamped by --max-report-rest-seconds)',
                            v_wait, clamped_from) END;
        END IF;
    ELSIF p_outcome = 'auth_error' AND p_may_disable THEN
        next.status := 'disabled';
        next.cooldown_until := NULL;
        next.status_reason := 'auth_error reported: the provider rejected the credential';
    ELSIF p_outcome = 'auth_error' THEN
        -- a reporter that may not disable: a failure that rests the credential for the backoff;
        -- its probe finds out again when the rest ends
        next.health_failures := next.health_failures + 1;
        IF NOT v_hold AND NOT (c.status = 'exhausted' AND c.cooldown_until IS NULL) THEN
            v_rest := least(extract(epoch FROM credpool_health_backoff(p_policy, c.cooldowns_in_a_row))::float8,
                            greatest(v_max_rest, 1));
            next.status := 'cooldown';
            next.cooldown_until := greatest(p_now + make_interval(secs => v_rest), c.cooldown_until);
            next.cooldowns_in_a_row := c.cooldowns_in_a_row + 1;
            next.recent_failures := '{}';
            next.status_reason := format(
                'auth_error reported by an executor that may not disable credentials; resting %s s',
                trunc(v_rest)::bigint);
        END IF;
    ELSIF p_outcome = 'quota_exhausted' THEN
        IF c.status <> 'disabled' THEN
            v_rest := CASE WHEN p_retry_after >= 1 THEN least(p_retry_after::float8, greatest(v_max_rest, 1))
                           WHEN NOT p_may_disable THEN v_max_rest END;
            clamped_from := CASE WHEN p_retry_after > greatest(v_max_rest, 1) THEN p_retry_after END;
            next.status := 'exhausted';
            next.cooldown_until := CASE WHEN v_rest IS NOT NULL
                                        THEN p_now + make_interval(secs => greatest(v_rest, 1)) END;
            next.status_reason := CASE
                WHEN v_rest IS NULL THEN 'quota exhausted; waiting for an operator'
                WHEN p_retry_after >= 1 AND clamped_from IS NULL
                    THEN 'quota exhausted until the provider''s retry_after'
                WHEN p_retry_after >= 1
                    THEN format('quota exhausted; the report''s retry_after of %s s clamped to %s s (--max-report-rest-seconds)',
                                p_retry_after, v_rest)
                ELSE format('quota exhausted; reported by an executor that may not rest a credential until an operator acts: resting %s s',
                            v_rest) END;
        END IF;
    END IF;
    -- (`auth_expired` on an OAuth credential: the token, not the credential; nothing changes)
    changed := (next.status, next.cooldown_until) IS DISTINCT FROM (c.status, c.cooldown_until);
    IF NOT changed THEN
        -- no transition: the stored reason stays as it was
        next.status_reason := c.status_reason;
    END IF;
END;
$$;

-- The cooldown after `p_cooldowns_in_a_row` earlier ones (credpool_health_apply): the policy's
-- cooldown doubled that many times (at most 30), at most its longest, at least a second.
CREATE OR REPLACE FUNCTION credpool_health_backoff(p_policy jsonb, p_cooldowns_in_a_row integer)
RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT make_interval(secs => greatest(least(
        (p_policy ->> 'cooldown_seconds')::float8 * power(2::float8, least(greatest(p_cooldowns_in_a_row, 0), 30)),
        (p_policy ->> 'max_cooldown_seconds')::float8), 1))
$$;

-- A cooldown begins (credpool_health_apply): `c` rests for the backoff, counts one more cooldown
-- in a row, forgets its recent failures, and says why and for how long.
CREATE OR REPLACE FUNCTION credpool_health_cooldown(c credentials, p_now timestamptz,
    p_policy jsonb, p_reason text)
RETURNS credentials
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_rest interval := credpool_health_backoff(p_policy, c.cooldowns_in_a_row);
BEGIN
    c.status := 'cooldown';
    c.cooldown_until := p_now + v_rest;
    c.cooldowns_in_a_row := c.cooldowns_in_a_row + 1;
    c.recent_failures := '{}';
    c.status_reason := format('%s; resting %s s', p_reason, trunc(extract(epoch FROM v_rest))::bigint);
    RETURN c;
END;
$$;
