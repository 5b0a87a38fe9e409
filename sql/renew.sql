-- The renewal: a live lease gets a later lease_until, never past what a lowered limit or cap
-- allows (credpool_renewal_end).
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one
-- transaction; every statement here must be safe to run again. Lock order and clocks:
-- docs/design.md ("Lock order", "Clocks").

-- The end a renewal gives a lease that asked for `p_wanted`. Keeps the invariant a lowered limit
-- or cap rests on (FIT, FIT TENANT): every surplus lease ends no later than every lease within
-- the limit. So a surplus lease is renewed at most to `p_limit_floor`, the earliest end among the
-- rows within the limit of its credential (NULL: its slot row is not surplus), and to
-- `p_tenant_floor`, the same among its tenant's rows (NULL: its tenant slot row, if any, is not
-- surplus); and a lease within a lowered limit or cap (`p_within_lowered`: its slot row, or its
-- tenant slot row, is over_limit and not surplus) never ends earlier than it did
-- (`p_lease_until`): a short renewal of it would otherwise reopen its row while a surplus lease
-- still counts. The caller reads the floors in its statement's snapshot: the ends within the limit
-- only move later (this rule), and a row leaves that set only by FIT, which needs this lease's
-- row, or by END, which then closes it while a surplus lease is held. (Of plain values, not of
-- rows: on Citus the caller's statement runs on a shard, whose rows are of the shard's type.)
DROP FUNCTION IF EXISTS credpool_renewal_end(lease_slots, tenant_slots, timestamptz);
CREATE OR REPLACE FUNCTION credpool_renewal_end(p_lease_until timestamptz,
    p_within_lowered boolean, p_wanted timestamptz, p_limit_floor timestamptz,
    p_tenant_floor timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_within_lowered
                THEN greatest(p_lease_until, least(p_wanted, p_limit_floor, p_tenant_floor))
                ELSE least(p_wanted, p_limit_floor, p_tenant_floor) END
$$;

-- RENEW, for one lease or a group: p_renewals jsonb is an array of {"lease_id", "key_id",
-- "provider", "pool", "fence" (or null), "lease_seconds", "key_hash" (as for RELEASE)}. A live
-- lease named by all of its values gets lease_until = now + lease_seconds and a `renewed` trail
-- row. Returns one row per renewal, in order: the new lease_until, or NULL when the lease is lost
-- (expired, released, unknown, or named with another key_id, provider, pool or fence), and
-- `authorized`: false when its key_hash names no live key, or a key of another tenant than the
-- lease's (credpool_key_tenant; lease_slots.tenant): nothing renewed. Never resurrects an expired
-- lease, even if its slot is still free: expiry is judged after the slot row's lock is taken, on
-- clock_timestamp(). A lease named more than once in one call is renewed by the first renewal
-- that names it by all of its values (as RELEASE's VERDICTS decide).
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
-- Locks: the named leases' slot rows, ascending (provider, key_id, slot), in one statement per
-- pass (credpool_provider_passes: one on plain PostgreSQL, one per provider on Citus); then their
-- tenant slot rows, ascending (tenant_id, slot) (credpool_lock_tenant_slots), only when a lease
-- has one, then read in a statement of their own. Every statement of a capped tenant's rows runs
-- per pass of tenants (credpool_slot_tenant_passes: one on plain PostgreSQL). On Citus a renewal
-- that names another provider than its lease's finds no lease: its provider's worker is asked.
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
    v_passes text[] := credpool_call_passes(p_renewals);
    v_provider text;
    v_slots lease_slots[] := '{}';
    v_found lease_slots[];
    v_renewed lease_slots[] := '{}';
    v_tenant_rows boolean := false;
    v_capped boolean;
    v_authorized boolean[];
    v_now timestamptz;
    v_tenant text;
    v_tenant_leases uuid[] := '{}';
    v_tenant_within boolean[] := '{}';
    v_tenant_floors timestamptz[] := '{}';
BEGIN
    FOREACH v_provider IN ARRAY v_passes LOOP
        SELECT coalesce(array_agg(l.s), '{}'), coalesce(bool_or((l.s).tenant_slot IS NOT NULL), false)
        INTO v_found, v_capped
        FROM (SELECT ROW(s.*)::lease_slots AS s
              FROM lease_slots s
              WHERE credpool_on_provider(s.provider, v_provider)
                AND s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_renewals) AS e
                                          WHERE credpool_on_provider(e ->> 'provider', v_provider)))
                AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid
                                            FROM jsonb_array_elements(p_renewals) AS e
                                            WHERE credpool_on_provider(e ->> 'provider', v_provider)))
              ORDER BY s.provider, s.key_id, s.slot
              FOR UPDATE) AS l;
        v_slots := v_slots || v_found;
        v_tenant_rows := v_tenant_rows OR v_capped;
    END LOOP;
    IF v_tenant_rows THEN
        v_tenant_rows := credpool_lock_tenant_slots(v_slots);
    END IF;
    IF v_tenant_rows THEN
        -- the tenant slot rows, read apart from the slot rows' UPDATE (on Citus a tenant's rows
        -- are on the tenant's worker): whether each is within a lowered cap, and a surplus
        -- row's floor (the earliest end of its tenant's leases within the cap)
        FOREACH v_tenant IN ARRAY credpool_slot_tenant_passes(v_slots) LOOP
            SELECT v_tenant_leases || coalesce(array_agg(t.lease_id), '{}'),
                   v_tenant_within || coalesce(array_agg(t.over_limit AND NOT t.surplus), '{}'),
                   v_tenant_floors || coalesce(array_agg(
                       (SELECT min(o.lease_until) FROM tenant_slots o
                        WHERE t.surplus AND credpool_on_tenant(o.tenant_id, v_tenant)
                          AND o.tenant_id = t.tenant_id AND NOT o.surplus
                          AND o.lease_id IS NOT NULL)), '{}')
            INTO v_tenant_leases, v_tenant_within, v_tenant_floors
            FROM tenant_slots t
            WHERE credpool_on_tenant(t.tenant_id, v_tenant)
              AND (t.tenant_id, t.slot, t.lease_id) IN (
                      SELECT * FROM credpool_tenant_rows_of(v_slots));
        END LOOP;
    END IF;
    v_now := clock_timestamp();
    -- each renewal's key must be live (absent: the configured internal key, tenant `default`)
    -- and of the lease's tenant: a key of another tenant renews nothing, as an unknown key (read
    -- in a statement of its own, on the coordinator: on Citus a statement routed to a worker
    -- cannot read the keys)
    SELECT array_agg(k.tenant IS NOT NULL AND coalesce(x.tenant, k.tenant) = k.tenant ORDER BY w.n)
    INTO v_authorized
    FROM ROWS FROM (jsonb_to_recordset(p_renewals) AS (lease_id uuid, key_id text, key_hash text))
         WITH ORDINALITY AS w (lease_id, key_id, key_hash, n)
    LEFT JOIN LATERAL credpool_key_tenant(w.key_hash) AS k (tenant) ON true
    LEFT JOIN unnest(v_slots) AS x ON x.key_id = w.key_id AND x.lease_id = w.lease_id;

    FOREACH v_provider IN ARRAY v_passes LOOP
        WITH renewed AS (
            UPDATE lease_slots ls
            SET lease_until = n.lease_until
            -- (the new ends are computed in the subquery: Citus refuses a stable function of a
            -- column in the SET of an UPDATE of a distributed table)
            FROM (
                SELECT DISTINCT ON (x.lease_id) x.key_id, x.slot, x.lease_id,
                       credpool_renewal_end(
                           x.lease_until,
                           coalesce((x.over_limit AND NOT x.surplus) OR t.within, false),
                           least(v_now + make_interval(secs => w.lease_seconds),
                                 -- OAuth: never past the expiry of the token the lease holds
                                 -- (and never shorter than the lease already is, for the
                                 -- token's sake)
                                 coalesce((SELECT greatest(x.lease_until,
                                                           CASE WHEN x.granted_at >= o.generation_at
                                                                THEN c.token_expires_at
                                                                ELSE x.lease_until END)
                                           FROM oauth_credentials o
                                           JOIN credentials c ON c.key_id = o.key_id
                                               AND credpool_on_provider(c.provider, v_provider)
                                           WHERE o.key_id = x.key_id
                                             AND credpool_on_provider(o.provider, v_provider)),
                                          'infinity')),
                           (SELECT min(o.lease_until) FROM lease_slots o
                            WHERE x.surplus AND credpool_on_provider(o.provider, v_provider)
                              AND o.key_id = x.key_id AND NOT o.surplus AND o.lease_id IS NOT NULL),
                           t.floor) AS lease_until
                FROM ROWS FROM (jsonb_to_recordset(p_renewals) AS (
                         lease_id uuid, key_id text, provider text, pool text, fence bigint,
                         lease_seconds integer))
                     WITH ORDINALITY AS w (lease_id, key_id, provider, pool, fence, lease_seconds, n)
                JOIN unnest(v_slots) AS x ON x.key_id = w.key_id AND x.lease_id = w.lease_id
                LEFT JOIN unnest(v_tenant_leases, v_tenant_within, v_tenant_floors)
                    AS t (lease_id, within, floor) ON t.lease_id = x.lease_id
                WHERE credpool_on_provider(x.provider, v_provider) AND v_authorized[w.n::integer]
                  AND x.provider = w.provider AND x.pool = w.pool
                  AND (w.fence IS NULL OR x.fence = w.fence) AND x.lease_until > v_now
                ORDER BY x.lease_id, w.n
            ) AS n
            WHERE credpool_on_provider(ls.provider, v_provider)
              AND ls.key_id = n.key_id AND ls.slot = n.slot AND ls.lease_id = n.lease_id
            RETURNING ROW(ls.*)::lease_slots AS s
        )
        SELECT v_renewed || coalesce(array_agg(r.s), '{}') INTO v_renewed FROM renewed AS r;
    END LOOP;
    IF v_tenant_rows THEN
        -- a lease of a capped tenant moves its tenant slot row's end in step
        FOREACH v_tenant IN ARRAY credpool_slot_tenant_passes(v_renewed) LOOP
            UPDATE tenant_slots t
            SET lease_until = (v_renewed[i]).lease_until
            FROM generate_subscripts(v_renewed, 1) AS i
            WHERE credpool_on_tenant(t.tenant_id, v_tenant)
              AND t.tenant_id = (v_renewed[i]).tenant AND t.slot = (v_renewed[i]).tenant_slot
              AND t.lease_id = (v_renewed[i]).lease_id;
        END LOOP;
    END IF;

    RETURN QUERY
    WITH trail AS (
        -- (the rows by their fields, each read where it is used: Citus, which sends this
        -- statement's trail rows to the workers, does not take `unnest` of a table's rows once
        -- the table has a dropped column, and sends a CTE that two parts read to every worker)
        INSERT INTO lease_events
            (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, tenant)
        SELECT 'renewed', (v_renewed[i]).lease_id, (v_renewed[i]).key_id,
               (v_renewed[i]).provider, (v_renewed[i]).pool, (v_renewed[i]).slot,
               (v_renewed[i]).holder, (v_renewed[i]).lease_until, v_now, (v_renewed[i]).tenant
        FROM generate_subscripts(v_renewed, 1) AS i
    )
    SELECT w.n::integer,
           (SELECT (v_renewed[i]).lease_until FROM generate_subscripts(v_renewed, 1) AS i
            WHERE (v_renewed[i]).lease_id = w.lease_id AND (v_renewed[i]).key_id = w.key_id
              AND (v_renewed[i]).provider = w.provider AND (v_renewed[i]).pool = w.pool
              AND (w.fence IS NULL OR (v_renewed[i]).fence = w.fence)),
           v_authorized[w.n::integer]
    FROM ROWS FROM (jsonb_to_recordset(p_renewals) AS (
             lease_id uuid, key_id text, provider text, pool text, fence bigint))
         WITH ORDINALITY AS w (lease_id, key_id, provider, pool, fence, n)
    ORDER BY w.n;
END;
$$;
