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
-- locks.
DROP FUNCTION IF EXISTS credpool_record_lease_end(lease_slots, text, timestamptz, text, text, text, bigint);
CREATE OR REPLACE FUNCTION credpool_record_lease_ends(
    p_slots lease_slots[], p_events text[], p_at timestamptz[], p_outcomes text[] DEFAULT NULL,
    p_reasons text[] DEFAULT NULL, p_actors text[] DEFAULT NULL, p_tokens bigint[] DEFAULT NULL)
RETURNS void
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
-- lock order 1b), so the tenant's cap frees with the credential's slot: a tenant slot row holds a
-- lease exactly while the lease's slot row does (or until both have expired). A tenant slot row
-- within a lowered cap that frees while a surplus row of its tenant still holds a lease becomes
-- surplus too, for the credential's reason (FIT TENANT); the cleanup pass refits the tenant
-- (credpool_refit_tenants).
-- The caller has locked the slot rows (in the lock order) and decided, on its own clock, that the
-- leases end now. A freed slot announces itself (trigger lease_slots_freed). Returns the leases
-- it ended.
DROP FUNCTION IF EXISTS credpool_end_lease(lease_slots, text, timestamptz, text, text, text, bigint);
CREATE OR REPLACE FUNCTION credpool_end_leases(
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
BEGIN
    WITH cleared AS (
        UPDATE lease_slots s
        SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL, granted_at = NULL,
            lease_until = NULL, probe = false, fence = NULL, reserved_tokens = NULL, tenant = NULL,
            tenant_slot = NULL,
            surplus = s.surplus
                      OR (s.over_limit
                          AND EXISTS (SELECT 1 FROM lease_slots o
                                      WHERE o.key_id = s.key_id AND o.surplus
                                        AND o.lease_id IS NOT NULL AND o.slot <> s.slot))
        FROM generate_subscripts(p_slots, 1) AS i
        WHERE s.key_id = (p_slots[i]).key_id AND s.slot = (p_slots[i]).slot
          AND s.lease_id = (p_slots[i]).lease_id
        RETURNING i
    )
    SELECT array_agg(i ORDER BY i) INTO v_ended FROM cleared;
    IF v_ended IS NULL THEN
        RETURN '{}';
    END IF;
    -- their tenant slot rows: locked in order (held already when the caller locked them after
    -- the slot rows), then cleared where they still hold the lease (a row whose expired lease a
    -- claim has replaced holds another lease now); leases of uncapped tenants, `default` among
    -- them, have no row: nothing more to do
    IF credpool_lock_tenant_slots(ARRAY(SELECT p_slots[i] FROM unnest(v_ended) AS i)) THEN
        UPDATE tenant_slots t
        SET lease_id = NULL, key_id = NULL, lease_until = NULL,
            surplus = t.surplus
                      OR (t.over_limit
                          AND EXISTS (SELECT 1 FROM tenant_slots o
                                      WHERE o.tenant_id = t.tenant_id AND o.surplus
                                        AND o.lease_id IS NOT NULL AND o.slot <> t.slot))
        FROM unnest(v_ended) AS i
        WHERE t.tenant_id = (p_slots[i]).tenant AND t.slot = (p_slots[i]).tenant_slot
          AND t.lease_id = (p_slots[i]).lease_id;
    END IF;
    IF cardinality(v_ended) = cardinality(p_slots) THEN
        PERFORM credpool_record_lease_ends(p_slots, p_events, p_at, p_outcomes, p_reasons,
                                           p_actors, p_tokens);
    ELSE
        PERFORM credpool_record_lease_ends(
            ARRAY(SELECT p_slots[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_events[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_at[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_outcomes[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_reasons[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_actors[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_tokens[i] FROM unnest(v_ended) AS i));
    END IF;
    RETURN ARRAY(SELECT (p_slots[i]).lease_id FROM unnest(v_ended) AS i);
END;
$$;

-- USAGE: the tokens a call really used replace its reservation in the token windows of its
-- credential `p_key_id` and of its tenant `p_tenant` (a lease granted at `p_granted_at`;
-- `p_delta` = usage - reservation). The caller holds the lease_windows row's lock and the
-- tenant_windows row's.
DROP FUNCTION IF EXISTS credpool_charge_usage(text, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_charge_usage(p_key_id text, p_tenant text,
    p_granted_at timestamptz, p_delta bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE lease_windows w
    SET (bucket_ids, bucket_charged) =
        (SELECT x.bucket_ids, x.bucket_charged FROM credpool_window_adjust(w, p_granted_at, p_delta) x)
    WHERE w.key_id = p_key_id AND p_delta <> 0 AND 'tokens' = ANY (w.window_kinds);
    UPDATE tenant_windows tw
    SET (bucket_ids, bucket_charged) =
        (SELECT x.bucket_ids, x.bucket_charged
         FROM credpool_window_adjust(credpool_tenant_window(tw), p_granted_at, p_delta) x)
    WHERE tw.tenant_id = p_tenant AND p_delta <> 0 AND 'tokens' = ANY (tw.window_kinds);
END;
$$;

-- RELEASE, for one lease or a group: p_releases jsonb is an array of {"lease_id", "key_id",
-- "provider", "pool", "fence" (or null), "outcome" (or null), "usage_tokens" (or null),
-- "key_hash" (hex SHA-256 of the tenant key the executor presented, or null: the internal key,
-- tenant `default`)}. A release whose key_hash names no live key, or a key of another tenant than
-- the lease's (its slot row's `tenant`, or for a lease no longer in its slot, its `granted` trail
-- row's), does nothing (verdict 'unauthorized': no release, no late report; the key is read by this
-- call, so no replica honours a key once its revoke has committed). For each other, in the slot
-- row's lock:
--   * live and named by all of its values: ended as `released` with the outcome (verdict
--     'released');
--   * named by all of its values but expired: ended as `expired` at its own lease_until if it still
--     sits in its slot (verdict 'expired');
--   * in a slot but named with another key_id, provider, pool or fence: nothing (verdict
--     'mismatch');
--   * in no slot (never granted, released, reaped, reused): nothing (verdict 'not_found').
-- An outcome or a usage for an expired or ended lease that was granted with the values given is
-- recorded once as `outcome_after_expiry` (unique index lease_events_one_report_per_lease:
-- retries count once); the outcome still counts for health. A usage (tokens the call really used)
-- replaces the lease's reservation in its credential's token windows, once.
--
-- Returns one row per release, in order: the verdict; the credential (key_id); whether the lease
-- was a probe; `refit`: the slot was over a lowered limit, so the credential may be back under it
-- (the caller runs credpool_fit_slots in a transaction of its own once this one has committed);
-- `usage_granted_at`, `usage_delta`: when a usage replaced a reservation, the lease's grant time
-- and usage - reservation (for the caller's view of the windows); `counted`: the outcome is to be
-- applied to health. For counted rows, the credential's health
-- columns, read under its row lock, and db_now, the clock after that lock: the caller computes
-- the new health (service/src/allocator/health.rs) and writes it with credpool_write_health in
-- the same transaction.
--
-- `auth_expired` on a lease of an OAuth credential's current token generation takes that token
-- out of traffic and makes its refresh due (below; a `token_rejected` row in
-- credential_events). `oauth`: the credential is an OAuth credential (for health: `auth_expired`
-- on any other credential is the provider refusing the key, as `auth_error`).
--
-- Locks, in the lock order: with an `auth_expired` report on a lease of an OAuth credential (the
-- caller's own lease), first the operator locks and every slot row, tenant slot row and
-- lease_windows row of that credential (credpool_lock_credentials without its credential row); the named leases' slot rows,
-- ascending (key_id, slot), in one statement; their tenant slot rows, ascending (tenant_id, slot)
-- (credpool_lock_tenant_slots); the lease_windows rows of the credentials named with a usage,
-- ascending key_id; the tenant_windows rows of those leases' tenants, ascending tenant_id (whose
-- advisory locks, in shared mode, it takes before anything else); trail rows guarded by unique
-- indexes, ascending lease_id; then the credential
-- rows of counted outcomes, ascending key_id, in one statement (FOR NO KEY UPDATE; FOR UPDATE with
-- an `auth_expired` report, whose token write follows). Decision clock: clock_timestamp() after
-- the slot locks (`released` rows carry it as `at`).
--
-- p_caller_announces: the caller announces the slots its `released` rows freed once its
-- transaction has committed (credpool_announce_freed), so nothing in this transaction sends a
-- notification for them. A slot freed as `expired` is not announced at all: it was claimable
-- from its lease_until on, and waiters keep a timer for that moment.
DROP FUNCTION IF EXISTS credpool_release(jsonb);
DROP FUNCTION IF EXISTS credpool_release(jsonb, boolean);
CREATE FUNCTION credpool_release(p_releases jsonb, p_caller_announces boolean DEFAULT false)
RETURNS TABLE (release integer, verdict text, key_id text, probe boolean, refit boolean,
               usage_granted_at timestamptz, usage_delta bigint,
               counted boolean, status text, status_reason text, cooldown_until timestamptz,
               health_successes double precision, health_failures double precision,
               health_rate_limits double precision, health_decayed_at timestamptz,
               recent_failures timestamptz[], cooldowns_in_a_row integer,
               last_success_at timestamptz, recovered_at timestamptz, db_now timestamptz,
               oauth boolean)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_health_now timestamptz;
    v_rejects boolean;
    -- the credentials whose tokens the call's `auth_expired` reports may reject (their own
    -- leases' OAuth credentials), ascending
    v_reject_keys text[];
    v_locked text;
    -- per release: the grant time of a lease whose `auth_expired` report counts (else NULL)
    v_rejected_granted_at timestamptz[];
    -- one element per release, in request order (n): what it asked and what it found
    v_n integer[];
    v_lease uuid[];
    v_asked_key text[];
    v_provider text[];
    v_pool text[];
    v_fence bigint[];
    v_outcome text[];
    v_usage bigint[];
    v_slot lease_slots[];
    v_verdict text[];
    -- and what it did
    v_key text[];
    v_probe boolean[];
    v_refit boolean[];
    v_counted boolean[];
    v_usage_at timestamptz[];
    v_usage_delta bigint[];
    v_late record;
    v_counted_keys text[];
    v_usage_tenants text[];
    i integer;
BEGIN
    -- The tenants of the leases named with a usage (the lease's slot row says which, or, for a
    -- lease no longer in it, its `granted` row; a lease's tenant never changes, so this read
    -- needs no lock), ascending: their advisory locks in shared mode, before any other lock (no
    -- transaction takes an operator lock before a tenant's), so that no change of one of them
    -- adds or removes its tenant_windows row, or seeds a new window from the trail, while this
    -- release charges its usage: the rows locked below are the rows the usage is charged to.
    v_usage_tenants := ARRAY(
        SELECT DISTINCT coalesce(s.tenant, g.tenant)
        FROM jsonb_array_elements(p_releases) AS e
        LEFT JOIN lease_slots s
            ON s.key_id = e ->> 'key_id' AND s.lease_id = (e ->> 'lease_id')::uuid
        LEFT JOIN LATERAL (
            SELECT g.tenant FROM lease_events g
            WHERE s.lease_id IS NULL AND g.lease_id = (e ->> 'lease_id')::uuid
              AND g.event = 'granted'
            LIMIT 1
        ) AS g ON true
        WHERE e ->> 'usage_tokens' IS NOT NULL AND coalesce(s.tenant, g.tenant) IS NOT NULL
        ORDER BY 1);
    IF v_usage_tenants <> '{}' THEN
        PERFORM pg_advisory_xact_lock_shared(hashtextextended('credpool.tenant:' || t.tenant, 0))
        FROM unnest(v_usage_tenants) WITH ORDINALITY AS t (tenant, n);
    END IF;
    IF p_caller_announces THEN
        -- the caller announces the released slots after its commit (credpool_announce_freed):
        -- no NOTIFY from this transaction (see lease_slots_notify_freed)
        PERFORM set_config('credpool.caller_announces_freed', 'on', true);
    END IF;
    -- An `auth_expired` report on a lease of an OAuth credential may take its token out of
    -- traffic, a write of the credential row that moves config_version into every slot row of
    -- the credential: so every slot row of that credential first (with its tenant and windows
    -- rows, in the lock order: credpool_lock_credentials), and its credential row only after the
    -- trail rows, below. Only the reporting lease's own credential: the lease it names sits on
    -- that credential (its slot row says so, or, once it left it, its `granted` row) and the key
    -- presented is of the lease's tenant (read from this snapshot: a lease's credential and
    -- tenant never change). A report naming any other credential locks nothing of it: an
    -- executor's report reaches only its own lease's credential. Rare; a call without such a
    -- report locks only its leases' rows.
    v_reject_keys := ARRAY(
        SELECT DISTINCT e ->> 'key_id'
        FROM jsonb_array_elements(p_releases) AS e
        JOIN oauth_credentials o ON o.key_id = e ->> 'key_id'
        LEFT JOIN lease_slots s
            ON s.key_id = e ->> 'key_id' AND s.lease_id = (e ->> 'lease_id')::uuid
        LEFT JOIN LATERAL (
            SELECT g.key_id, coalesce(g.tenant, 'default') AS tenant
            FROM lease_events g
            WHERE s.lease_id IS NULL AND g.lease_id = (e ->> 'lease_id')::uuid
              AND g.event = 'granted'
            LIMIT 1
        ) AS g ON true
        JOIN LATERAL credpool_key_tenant(e ->> 'key_hash') AS k (tenant) ON true
        WHERE e ->> 'outcome' = 'auth_expired'
          AND coalesce(s.key_id, g.key_id) = e ->> 'key_id'
          AND coalesce(s.tenant, g.tenant) = k.tenant
        ORDER BY 1);
    v_rejects := v_reject_keys <> '{}';
    IF v_rejects THEN
        PERFORM credpool_lock_credentials(v_reject_keys, false);
    END IF;
    PERFORM 1
    FROM lease_slots s
    WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_releases) AS e))
      AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid FROM jsonb_array_elements(p_releases) AS e))
    ORDER BY s.key_id, s.slot
    FOR UPDATE;
    -- their tenant slot rows (END clears them), right after the slot rows, before the windows
    PERFORM credpool_lock_tenant_slots(ARRAY(
        SELECT s FROM lease_slots s
        WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_releases) AS e))
          AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid
                                      FROM jsonb_array_elements(p_releases) AS e))));
    PERFORM 1
    FROM lease_windows w
    WHERE w.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_releases) AS e
                                WHERE e ->> 'usage_tokens' IS NOT NULL))
    ORDER BY w.key_id
    FOR UPDATE;
    PERFORM credpool_test_hook('release.locked');
    -- the tenant_windows rows of the tenants of the leases named with a usage (their advisory
    -- locks held since the top)
    IF v_usage_tenants <> '{}' THEN
        PERFORM 1
        FROM tenant_windows tw
        WHERE tw.tenant_id = ANY (v_usage_tenants)
        ORDER BY tw.tenant_id
        FOR UPDATE;
    END IF;
    v_now := clock_timestamp();

    -- The verdicts, in one statement (the aggregates read its rows in request order). A lease
    -- named twice in one call is ended by the first request (in order) that names it by all of
    -- its values; the others find it gone.
    SELECT array_agg(j.n), array_agg(j.lease_id), array_agg(j.key_id), array_agg(j.provider),
           array_agg(j.pool), array_agg(j.fence), array_agg(j.outcome), array_agg(j.usage_tokens),
           array_agg(j.slot_row),
           array_agg(CASE
                         WHEN NOT j.authorized THEN 'unauthorized'
                         WHEN j.found AND j.matches AND j.nth = 1 THEN
                             CASE WHEN (j.slot_row).lease_until > v_now THEN 'released'
                                  ELSE 'expired' END
                         WHEN j.found AND NOT j.matches THEN 'mismatch'
                         ELSE 'not_found'
                     END)
    INTO v_n, v_lease, v_asked_key, v_provider, v_pool, v_fence, v_outcome, v_usage, v_slot,
         v_verdict
    FROM (
        SELECT w.n::integer AS n, w.lease_id, w.key_id, w.provider, w.pool, w.fence, w.outcome,
               w.usage_tokens, s AS slot_row, a.authorized,
               -- in a slot of the credential named, or (named with another key_id) of its own,
               -- which its `granted` row in the trail names
               s.lease_id IS NOT NULL
                   OR EXISTS (SELECT 1
                              FROM lease_events g
                              JOIN lease_slots o ON o.key_id = g.key_id AND o.lease_id = g.lease_id
                              WHERE g.lease_id = w.lease_id AND g.event = 'granted') AS found,
               coalesce(s.provider = w.provider AND s.pool = w.pool
                        AND (w.fence IS NULL OR s.fence = w.fence), false) AS matches,
               row_number() OVER (
                   PARTITION BY w.lease_id, a.authorized,
                                coalesce(s.provider = w.provider AND s.pool = w.pool
                                         AND (w.fence IS NULL OR s.fence = w.fence), false)
                   ORDER BY w.n) AS nth
        FROM ROWS FROM (jsonb_to_recordset(p_releases) AS (
                 lease_id uuid, key_id text, provider text, pool text, fence bigint, outcome text,
                 usage_tokens bigint, key_hash text))
             WITH ORDINALITY AS w (lease_id, key_id, provider, pool, fence, outcome, usage_tokens,
                                   key_hash, n)
        LEFT JOIN lease_slots s ON s.key_id = w.key_id AND s.lease_id = w.lease_id
        -- the key must be live (absent: the configured internal key, tenant `default`; read by
        -- this statement, so a release that starts after a revoke committed is refused) and of
        -- the lease's tenant: its slot row's, or (a lease no longer in the slot named) its
        -- `granted` row's (NULL there: granted before tenants existed, to `default`)
        LEFT JOIN LATERAL credpool_key_tenant(w.key_hash) AS k (tenant) ON true
        LEFT JOIN LATERAL (
            SELECT coalesce(g.tenant, 'default') AS tenant
            FROM lease_events g
            WHERE s.lease_id IS NULL AND g.lease_id = w.lease_id AND g.event = 'granted'
            LIMIT 1
        ) AS g ON true
        CROSS JOIN LATERAL (
            SELECT k.tenant IS NOT NULL
                   AND coalesce(s.tenant, g.tenant, k.tenant) = k.tenant AS authorized
        ) AS a
        ORDER BY w.n
    ) AS j;

    -- Every lease that ends, in one call: released now, or found expired in its slot.
    PERFORM credpool_end_leases(
        ARRAY(SELECT v_slot[k] FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        ARRAY(SELECT v_verdict[k] FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        ARRAY(SELECT CASE WHEN v_verdict[k] = 'released' THEN v_now ELSE (v_slot[k]).lease_until END
              FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        ARRAY(SELECT CASE WHEN v_verdict[k] = 'released' THEN v_outcome[k] END
              FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        NULL,
        NULL,
        ARRAY(SELECT CASE WHEN v_verdict[k] = 'released' THEN v_usage[k] END
              FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k));

    -- What each did for health and the windows: a released outcome counts, and its usage replaces
    -- its reservation; an outcome or usage for a lease that had ended counts once, as a late
    -- report (after the ends above, so a release and a late report of one lease in one call
    -- meet the unique index in that order).
    v_key := array_fill(NULL::text, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_probe := array_fill(NULL::boolean, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_refit := v_probe; v_counted := v_probe;
    v_usage_at := array_fill(NULL::timestamptz, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_usage_delta := array_fill(NULL::bigint, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_rejected_granted_at := v_usage_at;
    -- in ascending lease_id (the lock order of the trail's unique indexes: two groups reporting
    -- the same leases wait for each other's trail rows in one order)
    FOR i IN SELECT k FROM generate_subscripts(v_n, 1) AS k ORDER BY v_lease[k], k LOOP
        v_key[i] := CASE WHEN v_verdict[i] IN ('released', 'expired') THEN v_asked_key[i] END;
        v_probe[i] := v_verdict[i] = 'released' AND (v_slot[i]).probe;
        v_refit[i] := v_verdict[i] IN ('released', 'expired') AND (v_slot[i]).over_limit;
        v_counted[i] := v_verdict[i] = 'released' AND v_outcome[i] IS NOT NULL;
        v_usage_at[i] := NULL;
        v_usage_delta[i] := NULL;
        IF v_counted[i] AND v_outcome[i] = 'auth_expired' THEN
            v_rejected_granted_at[i] := (v_slot[i]).granted_at;
        END IF;
        IF v_verdict[i] = 'released' AND v_usage[i] IS NOT NULL THEN
            v_usage_at[i] := (v_slot[i]).granted_at;
            v_usage_delta[i] := v_usage[i] - coalesce((v_slot[i]).reserved_tokens, 0);
            PERFORM credpool_charge_usage(v_asked_key[i], (v_slot[i]).tenant, v_usage_at[i],
                                          v_usage_delta[i]);
        ELSIF v_verdict[i] IN ('expired', 'not_found')
              AND (v_outcome[i] IS NOT NULL OR v_usage[i] IS NOT NULL) THEN
            INSERT INTO lease_events
                (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at,
                 tokens, tenant)
            SELECT 'outcome_after_expiry', g.lease_id, g.key_id, g.provider, g.pool, g.slot, g.holder,
                   v_outcome[i],
                   (SELECT max(e.lease_until) FROM lease_events e WHERE e.lease_id = v_lease[i]),
                   v_now, v_usage[i], g.tenant
            FROM lease_events g
            WHERE g.lease_id = v_lease[i] AND g.event = 'granted'
              AND g.key_id = v_asked_key[i] AND g.provider = v_provider[i] AND g.pool = v_pool[i]
              AND (v_fence[i] IS NULL OR g.fence IS NULL OR g.fence = v_fence[i])
            LIMIT 1
            ON CONFLICT (lease_id) WHERE event IN ('released', 'outcome_after_expiry') DO NOTHING
            RETURNING (SELECT g2.at FROM lease_events g2
                       WHERE g2.lease_id = v_lease[i] AND g2.event = 'granted' LIMIT 1) AS granted_at,
                      (SELECT g2.tokens FROM lease_events g2
                       WHERE g2.lease_id = v_lease[i] AND g2.event = 'granted' LIMIT 1) AS reserved,
                      tenant
            INTO v_late;
            IF FOUND THEN
                v_key[i] := v_asked_key[i];
                v_counted[i] := v_outcome[i] IS NOT NULL;
                IF v_outcome[i] = 'auth_expired' THEN
                    v_rejected_granted_at[i] := v_late.granted_at;
                END IF;
                IF v_usage[i] IS NOT NULL THEN
                    v_usage_at[i] := v_late.granted_at;
                    v_usage_delta[i] := v_usage[i] - coalesce(v_late.reserved, 0);
                    PERFORM credpool_charge_usage(v_asked_key[i], v_late.tenant, v_usage_at[i],
                                                  v_usage_delta[i]);
                END IF;
            END IF;
        END IF;
    END LOOP;

    -- The credential rows of counted outcomes (lock order 4: after the trail rows), for the
    -- health write, FOR NO KEY UPDATE; FOR UPDATE, the strength credpool_lock_credentials takes
    -- for a write of the token, on the credentials whose slot rows the `auth_expired` reports
    -- took above (only those: a claim binding a conversation holds one slot row of the
    -- credential and a key share lock on its row, which FOR UPDATE conflicts with). One row at
    -- a time, ascending key_id, when the strengths differ.
    v_counted_keys := ARRAY(SELECT k FROM unnest(v_key, v_counted) AS x (k, counted) WHERE x.counted);
    IF v_rejects THEN
        FOR v_locked IN SELECT DISTINCT k FROM unnest(v_counted_keys) AS k ORDER BY k LOOP
            IF v_locked = ANY (v_reject_keys) THEN
                PERFORM 1 FROM credentials c WHERE c.key_id = v_locked FOR UPDATE;
            ELSE
                PERFORM 1 FROM credentials c WHERE c.key_id = v_locked FOR NO KEY UPDATE;
            END IF;
        END LOOP;
    ELSE
        PERFORM 1 FROM credentials c WHERE c.key_id = ANY (v_counted_keys) ORDER BY c.key_id
        FOR NO KEY UPDATE;
    END IF;
    v_health_now := clock_timestamp();

    -- `auth_expired` on a lease of the current generation (granted at or after the generation
    -- began; the credentials' operator locks and slot rows are held since the top, so no refresh
    -- or PUT is writing meanwhile, and their rows since the statement above): the token counts
    -- as expired from now, so no claim grants it again (credpool_token_lasts, gated by
    -- config_version) and the refresher finds it due at once, which refreshes it exactly once
    -- however many reports arrive (the refresh is taken per generation, service/src/oauth.rs).
    -- A report on a lease of an older generation says nothing about the current token.
    IF v_rejects THEN
        WITH rejected AS (
            SELECT DISTINCT ON (x.key_id) x.key_id, x.lease_id, o.generation
            FROM unnest(v_key, v_lease, v_rejected_granted_at) AS x (key_id, lease_id, granted_at)
            JOIN oauth_credentials o ON o.key_id = x.key_id
            WHERE x.granted_at >= o.generation_at AND x.key_id = ANY (v_reject_keys)
            ORDER BY x.key_id, x.granted_at
        ),
        expired AS (
            UPDATE credentials c
            SET token_expires_at = v_now
            FROM rejected r
            WHERE c.key_id = r.key_id AND c.token_expires_at > v_now
            RETURNING c.key_id
        )
        INSERT INTO credential_events (key_id, event, reason, lease_id, actor, details, at)
        SELECT r.key_id, 'token_rejected',
               'auth_expired reported: the provider rejected the access token; refresh due now',
               r.lease_id, 'executor', jsonb_build_object('generation', r.generation), v_now
        FROM rejected r
        JOIN expired e ON e.key_id = r.key_id;
    END IF;

    RETURN QUERY
    SELECT v.n, v.verdict, v.key_id, v.probe, v.refit, v.usage_at, v.usage_delta,
           v.counted AND c.key_id IS NOT NULL,
           c.status, c.status_reason, c.cooldown_until, c.health_successes, c.health_failures,
           c.health_rate_limits, c.health_decayed_at, c.recent_failures, c.cooldowns_in_a_row,
           c.last_success_at, c.recovered_at, v_health_now, c.token_expires_at IS NOT NULL
    FROM unnest(v_n, v_verdict, v_key, v_probe, v_refit, v_counted, v_usage_at, v_usage_delta)
         AS v (n, verdict, key_id, probe, refit, counted, usage_at, usage_delta)
    LEFT JOIN credentials c ON c.key_id = v.key_id AND v.counted
    ORDER BY v.n;
END;
$$;

-- HEALTH: writes the health that applying outcome reports produced (service/src/allocator/health.rs computes it
-- from the rows credpool_release returned) and the status transitions to credential_events, in
-- one statement. p_next: [{"key_id", "status", "status_reason", "cooldown_until",
-- "health_successes", "health_failures", "health_rate_limits", "health_decayed_at",
-- "recent_failures", "cooldowns_in_a_row", "last_success_at", "recovered_at"}]; p_transitions:
-- [{"key_id", "old_status", "new_status", "reason", "cooldown_until", "lease_id", "at"}]. The
-- caller holds the credential rows' locks (credpool_release took them, ascending key_id). A
-- credential deleted meanwhile is skipped, with its transitions.
CREATE OR REPLACE FUNCTION credpool_write_health(p_next jsonb, p_transitions jsonb) RETURNS integer
LANGUAGE plpgsql
SET credpool.health_write = 'on'
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_updated integer;
BEGIN
    WITH next AS (
        SELECT *
        FROM jsonb_to_recordset(p_next) AS n (
            key_id text, status text, status_reason text, cooldown_until timestamptz,
            health_successes double precision, health_failures double precision,
            health_rate_limits double precision, health_decayed_at timestamptz,
            recent_failures timestamptz[], cooldowns_in_a_row integer,
            last_success_at timestamptz, recovered_at timestamptz)
    ),
    updated AS (
        UPDATE credentials c
        SET status = n.status, status_reason = n.status_reason,
            cooldown_until = n.cooldown_until, health_successes = n.health_successes,
            health_failures = n.health_failures, health_rate_limits = n.health_rate_limits,
            health_decayed_at = n.health_decayed_at, recent_failures = n.recent_failures,
            cooldowns_in_a_row = n.cooldowns_in_a_row, last_success_at = n.last_success_at,
            recovered_at = n.recovered_at
        FROM next n
        WHERE c.key_id = n.key_id
        RETURNING c.key_id
    ),
    transitions AS (
        INSERT INTO credential_events
            (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at)
        SELECT t.key_id, 'status_changed', t.old_status, t.new_status, t.reason, t.cooldown_until,
               t.lease_id, coalesce(t.at, statement_timestamp())
        FROM jsonb_to_recordset(p_transitions) AS t (
            key_id text, old_status text, new_status text, reason text,
            cooldown_until timestamptz, lease_id uuid, at timestamptz)
        WHERE t.key_id IN (SELECT key_id FROM updated)
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_updated FROM updated;
    RETURN v_updated;
END;
$$;
