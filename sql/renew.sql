-- The renewal: a live lease gets a later lease_until, never past what a lowered limit or cap
-- allows (credpool_renewal_end).
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one
-- transaction; every statement here must be safe to run again. Lock order and clocks:
-- docs/design.md ("Lock order", "Clocks").

-- The end a renewal gives the lease of slot row `s` (and of its tenant slot row `t`, or NULL),
-- which asked for `p_wanted`. Keeps the invariant a lowered limit or cap rests on (FIT, FIT
-- TENANT): every surplus lease ends no later than every lease within the limit. So a surplus
-- lease is renewed at most to the earliest end among the rows within the limit (of its
-- credential; of its tenant), and a lease within a lowered limit (or cap) never ends earlier
-- than it did: a short renewal of it would otherwise reopen its row while a surplus lease still
-- counts. Read from the caller's snapshot: the ends within the limit only move later (this rule),
-- and a row leaves that set only by FIT, which needs this lease's row, or by END, which then
-- closes it while a surplus lease is held.
CREATE OR REPLACE FUNCTION credpool_renewal_end(s lease_slots, t tenant_slots, p_wanted timestamptz)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN (s.over_limit AND NOT s.surplus) OR (t.over_limit AND NOT t.surplus)
                THEN greatest(s.lease_until, x.capped) ELSE x.capped END
    FROM (SELECT least(
              p_wanted,
              (SELECT min(o.lease_until) FROM lease_slots o
               WHERE s.surplus AND o.key_id = s.key_id AND NOT o.surplus AND o.lease_id IS NOT NULL),
              (SELECT min(o.lease_until) FROM tenant_slots o
               WHERE t.surplus AND o.tenant_id = t.tenant_id AND NOT o.surplus
                 AND o.lease_id IS NOT NULL)) AS capped) AS x
$$;

-- RENEW, for one lease or a group: p_renewals jsonb is an array of {"lease_id", "key_id",
-- "provider", "pool", "fence" (or null), "lease_seconds", "key_hash" (as for RELEASE)}. A live
-- lease named by all of its values gets lease_until = now + lease_seconds and a `renewed` trail
-- row. Returns one row per renewal, in order: the new lease_until, or NULL when the lease is lost
-- (expired, released, unknown, or named with another key_id, provider, pool or fence), and
-- `authorized`: false when its key_hash names no live key, or a key of another tenant than the
-- lease's (credpool_key_tenant; lease_slots.tenant): nothing renewed. Never resurrects an expired
-- lease, even if its slot is still free: expiry is judged after the slot row's lock is taken, on
-- clock_timestamp().
-- Over a lowered limit or cap, the new end keeps the invariant FIT and FIT TENANT rest on (every
-- surplus lease ends no later than every lease within the limit): credpool_renewal_end.
-- An OAuth credential's lease is renewed at most to the expiry of the access token it holds:
-- the credential's token_expires_at when the lease was granted on the current generation
-- (granted_at >= oauth_credentials.generation_at), else its own lease_until (an older token,
-- whose expiry its lease_until already respects: no extension). So a lease never outlives its
-- token; the executor sees lease_until come back earlier than it asked and allocates again for
-- the refreshed token. (Read from this statement's snapshot: a refresh committed after it
-- began wrote a token this lease does not hold.)
-- A lease of a capped tenant moves its tenant slot row's lease_until in step (the row frees when
-- the lease does; see CLAIM, "Tenants").
-- Locks: the named leases' slot rows, ascending (provider, key_id, slot), in one statement; then their
-- tenant slot rows, ascending (tenant_id, slot) (credpool_lock_tenant_slots).
DROP FUNCTION IF EXISTS credpool_renew(jsonb);
CREATE FUNCTION credpool_renew(p_renewals jsonb)
RETURNS TABLE (renewal integer, lease_until timestamptz, authorized boolean)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
BEGIN
    PERFORM 1
    FROM lease_slots s
    WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_renewals) AS e))
      AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid FROM jsonb_array_elements(p_renewals) AS e))
    ORDER BY s.provider, s.key_id, s.slot
    FOR UPDATE;
    PERFORM credpool_lock_tenant_slots(ARRAY(
        SELECT s FROM lease_slots s
        WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_renewals) AS e))
          AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid
                                      FROM jsonb_array_elements(p_renewals) AS e))));
    v_now := clock_timestamp();

    RETURN QUERY
    WITH wanted AS (
        SELECT w.*, a.authorized
        FROM ROWS FROM (jsonb_to_recordset(p_renewals) AS (
                 lease_id uuid, key_id text, provider text, pool text, fence bigint, lease_seconds integer,
                 key_hash text))
             WITH ORDINALITY AS w (lease_id, key_id, provider, pool, fence, lease_seconds, key_hash, n)
        -- the key must be live (absent: the configured internal key, tenant `default`) and of the
        -- lease's tenant: a key of another tenant renews nothing, as an unknown key
        LEFT JOIN LATERAL credpool_key_tenant(w.key_hash) AS k (tenant) ON true
        LEFT JOIN lease_slots s ON s.key_id = w.key_id AND s.lease_id = w.lease_id
        CROSS JOIN LATERAL (
            SELECT k.tenant IS NOT NULL AND coalesce(s.tenant, k.tenant) = k.tenant AS authorized
        ) AS a
    ),
    renewed AS (
        UPDATE lease_slots s
        SET lease_until = (
                SELECT credpool_renewal_end(s, t, least(
                           v_now + make_interval(secs => w.lease_seconds),
                           -- OAuth: never past the expiry of the token the lease holds (and never
                           -- shorter than the lease already is, for the token's sake)
                           coalesce((SELECT greatest(s.lease_until,
                                                     CASE WHEN s.granted_at >= o.generation_at
                                                          THEN c.token_expires_at
                                                          ELSE s.lease_until END)
                                     FROM oauth_credentials o
                                     JOIN credentials c ON c.key_id = o.key_id
                                     WHERE o.key_id = s.key_id), 'infinity')))
                FROM (SELECT) AS one
                LEFT JOIN tenant_slots t
                    ON t.tenant_id = s.tenant AND t.slot = s.tenant_slot AND t.lease_id = s.lease_id)
        FROM (SELECT DISTINCT ON (wanted.lease_id) * FROM wanted WHERE wanted.authorized
              ORDER BY wanted.lease_id, wanted.n) AS w
        WHERE s.lease_id = w.lease_id AND s.key_id = w.key_id AND s.provider = w.provider
          AND s.pool = w.pool AND (w.fence IS NULL OR s.fence = w.fence)
          AND s.lease_until > v_now
        RETURNING s.key_id, s.slot, s.lease_id, s.provider, s.pool, s.holder, s.lease_until, s.fence,
                  s.tenant, s.tenant_slot
    ),
    tenant_renewed AS (
        UPDATE tenant_slots t
        SET lease_until = r.lease_until
        FROM renewed r
        WHERE t.tenant_id = r.tenant AND t.slot = r.tenant_slot AND t.lease_id = r.lease_id
    ),
    trail AS (
        INSERT INTO lease_events
            (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, tenant)
        SELECT 'renewed', lease_id, key_id, provider, pool, slot, holder, lease_until, v_now, tenant
        FROM renewed
    )
    SELECT w.n::integer, r.lease_until, w.authorized
    FROM wanted w
    LEFT JOIN renewed r
        ON r.lease_id = w.lease_id AND r.key_id = w.key_id AND r.provider = w.provider
       AND r.pool = w.pool AND (w.fence IS NULL OR r.fence = w.fence)
    ORDER BY w.n;
END;
$$;
