-- The claim: what makes a candidate eligible (usable, may serve, a free slot, a token that lasts
-- the lease), when a candidate frees, affinity's and fair share's helpers, and CLAIM itself.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one
-- transaction; every statement here must be safe to run again. Lock order and clocks:
-- docs/design.md ("Lock order", "Clocks").

-- DESIGN "Vocabulary": status says health only. `available` is usable; `rate_limited`, `cooldown`
-- and `exhausted` are usable once cooldown_until has passed (opportunistic recovery) and not
-- usable with an unknown cooldown_until; `pending` and `disabled` are not usable. `at` is the
-- decision clock of the caller.
CREATE OR REPLACE FUNCTION credential_usable(status text, cooldown_until timestamptz, at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT status = 'available'
        OR (status IN ('rate_limited', 'cooldown', 'exhausted')
            AND cooldown_until IS NOT NULL
            AND cooldown_until <= at)
$$;

-- When a credential that is not usable at `at` becomes usable on its own: the end of its cooldown;
-- NULL when it is usable now or needs an operator. Same rule as credential_usable.
CREATE OR REPLACE FUNCTION credential_recovers_at(status text, cooldown_until timestamptz, at timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN status IN ('rate_limited', 'cooldown', 'exhausted') AND cooldown_until > at THEN cooldown_until
    END
$$;

-- ROUTING: whether a row of provider `p_row_provider` is one for a statement about provider
-- `p_provider`, written on every table a lease-path statement reads by key. On plain PostgreSQL
-- always true, and inlined away: a credential's rows are reached by key, and a provider predicate
-- there only misleads the planner (measured: with it, a 64-claim group's pick on 64 credentials
-- started from every slot row of the provider, 1.4-2.7 s per pick statement instead of about
-- 13 ms). On Citus `credpool citus distribute` (and every later application of these files)
-- redefines it as `p_row_provider = p_provider` (store::schema::route_by_provider), which routes
-- the statement to the provider's worker.
CREATE OR REPLACE FUNCTION credpool_on_provider(p_row_provider text, p_provider text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT true
$$;

-- ROUTING of a tenant's rows (tenant_slots, tenant_windows), as credpool_on_provider routes a
-- provider's: true on plain PostgreSQL (inlined away); on Citus, where those tables are
-- distributed by tenant, `p_row_tenant = p_tenant` (store::schema::route_by_provider).
CREATE OR REPLACE FUNCTION credpool_on_tenant(p_row_tenant text, p_tenant text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT true
$$;

-- PASSES: the providers that statements about the rows of several providers run for, one
-- statement per pass, each naming its pass's provider through credpool_on_provider. On plain
-- PostgreSQL one pass, NULL, which is every provider at once (credpool_on_provider is true there:
-- a group of leases of several providers costs what one provider's costs, and a plain claim,
-- release or renewal runs the statements it ran before); on Citus, where credpool_on_provider is an equality, each provider
-- named, once, ascending (the lock order), each pass's statements routed to its provider's worker.
-- `p_providers`: distinct, ascending. (PL/pgSQL, whose test is a simple expression: on plain
-- PostgreSQL it runs no query.)
CREATE OR REPLACE FUNCTION credpool_provider_passes(p_providers text[])
RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF credpool_on_provider('', ' ') THEN
        RETURN ARRAY[NULL::text];
    END IF;
    RETURN p_providers;
END;
$$;

-- PASSES of tenants: the tenants statements about several tenants' rows run for, each naming
-- its pass's tenant through credpool_on_tenant (on plain PostgreSQL one pass, NULL: every tenant
-- at once). `p_tenants`: distinct, ascending (the lock order).
CREATE OR REPLACE FUNCTION credpool_tenant_passes(p_tenants text[])
RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF credpool_on_tenant('', ' ') THEN
        RETURN ARRAY[NULL::text];
    END IF;
    RETURN p_tenants;
END;
$$;

-- PASSES of tenants (credpool_tenant_passes) of claims `p_claims` (those numbered in `p_open`,
-- and of provider `p_provider`, when given). On plain PostgreSQL it reads nothing.
CREATE OR REPLACE FUNCTION credpool_claim_tenant_passes(p_claims credpool_claim[],
    p_open integer[], p_provider text)
RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF credpool_on_tenant('', ' ') THEN
        RETURN ARRAY[NULL::text];
    END IF;
    RETURN ARRAY(SELECT DISTINCT o.tenant FROM unnest(p_claims) AS o
                 WHERE o.tenant IS NOT NULL AND (p_open IS NULL OR o.n = ANY (p_open))
                   AND (p_provider IS NULL OR o.provider = p_provider)
                 ORDER BY 1);
END;
$$;

-- PASSES of tenants (credpool_tenant_passes) of the leases of slot rows `p_slots` that hold a
-- tenant slot row (capped tenants' leases). On plain PostgreSQL it reads nothing.
CREATE OR REPLACE FUNCTION credpool_slot_tenant_passes(p_slots lease_slots[])
RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF credpool_on_tenant('', ' ') THEN
        RETURN ARRAY[NULL::text];
    END IF;
    RETURN ARRAY(SELECT DISTINCT r.tenant_id FROM credpool_tenant_rows_of(p_slots) AS r ORDER BY 1);
END;
$$;

-- PASSES (credpool_provider_passes) of a call's jsonb array of objects with a "provider"
-- (releases, renewals).
CREATE OR REPLACE FUNCTION credpool_call_passes(p_items jsonb)
RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF credpool_on_provider('', ' ') THEN
        RETURN ARRAY[NULL::text];
    END IF;
    RETURN ARRAY(SELECT DISTINCT e ->> 'provider' FROM jsonb_array_elements(p_items) AS e
                 WHERE e ->> 'provider' IS NOT NULL ORDER BY 1);
END;
$$;

-- The row helpers below take their rows as `anyelement` (a second row type as `anycompatible`),
-- not as `credentials`, `lease_slots`, ...: on Citus a statement runs on a shard, whose rows are
-- of the shard's own type (`credentials_102008`), which a function of `credentials` would not
-- take. They are SQL functions that PostgreSQL inlines, so the plan is the same as with the
-- table's type. A row of a subquery is a `record`, whose fields an SQL function cannot name: a
-- caller passes it cast to its table's type. (The signatures they had are dropped first: an exact
-- match would win over them.)
DROP FUNCTION IF EXISTS credpool_slot_eligible(credentials, lease_slots, text, text, text,
                                               timestamptz, timestamptz);
DROP FUNCTION IF EXISTS credpool_may_serve(credentials, text, text, text, timestamptz);
DROP FUNCTION IF EXISTS credpool_token_lasts(credentials, timestamptz);
DROP FUNCTION IF EXISTS credpool_slot_open(lease_slots, text, timestamptz);
DROP FUNCTION IF EXISTS credpool_tenant_slot_open(tenant_slots, timestamptz);

-- Whether credential `c` may serve a claim for (provider, pool, model) at `p_at`: it is in the
-- pool, serves the model (directly or through an alias), is usable and is not drained.
CREATE OR REPLACE FUNCTION credpool_may_serve(
    c anyelement, p_provider text, p_pool text, p_model text, p_at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT c.provider = p_provider
       AND c.pool = p_pool
       AND (p_model = ANY (c.models) OR c.model_aliases ? p_model)
       AND credential_usable(c.status, c.cooldown_until, p_at)
       AND NOT c.draining
$$;

-- Whether credential `c`'s access token is still valid at `p_until` (the end of the lease a
-- claim would grant): always for a credential that is not OAuth (token_expires_at NULL). An OAuth
-- credential whose token would expire first is passed over until its refresh lands.
CREATE OR REPLACE FUNCTION credpool_token_lasts(c anyelement, p_until timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT c.token_expires_at IS NULL OR c.token_expires_at >= p_until
$$;

-- When credential `c`'s access token may last a lease that ends at `p_until`, judged at `p_at`:
-- `p_at` when it lasts already (or the credential is not OAuth); otherwise when its refresh is
-- expected to have landed: the refresh starts `refresh_before_seconds` before the token expires
-- (or when a failed attempt's backoff ends, or at once when it is due), and a token call takes
-- about a second. For the Retry-After of a claim that passed over the credential: the refresh,
-- not a slot, is what it waits for (`held_by` 'token_refresh'). A token a report rejected
-- (`auth_expired`, RELEASE) counts as expired, so it is due at once.
-- `p_next_attempt_at` and `p_refresh_before_seconds` are the credential's oauth_credentials
-- columns (the caller reads them with its credential row: on Citus a function that reads a
-- table cannot run inside the statement a worker runs).
DROP FUNCTION IF EXISTS credpool_token_refreshed_at(credentials, timestamptz, timestamptz);
CREATE OR REPLACE FUNCTION credpool_token_refreshed_at(c anyelement,
    p_next_attempt_at timestamptz, p_refresh_before_seconds integer, p_until timestamptz,
    p_at timestamptz)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN credpool_token_lasts(c, p_until) THEN p_at
        -- (no oauth_credentials row: no refresh is coming)
        WHEN p_refresh_before_seconds IS NULL THEN NULL
        ELSE greatest(p_at + interval '1 second', p_next_attempt_at,
                      c.token_expires_at - make_interval(secs => p_refresh_before_seconds))
    END
$$;

-- Whether slot `s` of a credential whose status is `p_status` is free for a claim at `p_at`: its
-- lease slot is empty or its lease has expired, and its gates are open (not a surplus row of a
-- lowered limit, not draining). A credential back from a cooldown (usable, status not yet
-- `available`) is half-open: only its slot 0 can be claimed, so it serves a single probe lease
-- at a time.
CREATE OR REPLACE FUNCTION credpool_slot_open(s anyelement, p_status text, p_at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (p_status = 'available' OR s.slot = 0)
       AND NOT s.surplus
       AND NOT s.draining
       AND (s.lease_id IS NULL OR s.lease_until <= p_at)
$$;

-- Whether tenant slot row `t` is free for a claim at `p_at` (CLAIM, "Tenants"): it holds no lease
-- or its lease has expired, and it is not beyond a lowered cap (`surplus`, see FIT TENANT: a row
-- within a lowered cap reopens when its lease ends, like a credential's). The tenant's
-- counterpart of credpool_slot_open; an SQL function that inlines into the statement.
CREATE OR REPLACE FUNCTION credpool_tenant_slot_open(t anyelement, p_at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT NOT t.surplus AND (t.lease_id IS NULL OR t.lease_until <= p_at)
$$;

-- When credential `c` (its windows `w`, or NULL; its slot rows `p_slots`) may next serve a claim
-- reserving `p_tokens`, judged at `p_at`: `at`, the latest of the end of its cooldown, the moment
-- one of its slots frees, and the moment its windows admit the claim (`p_at` when it may serve
-- now; NULL when nothing known ends: it waits for an operator, is over a lowered limit or
-- draining, or a window can never hold the reservation), and `held_by`, which of those it is:
-- 'slots', 'cooldown', 'requests_window' or 'tokens_window'. For the Retry-After of a claim that
-- granted nothing. The rows come from the caller's statement (a function that reads a table
-- cannot run inside a statement a Citus worker runs); `c` and `w` are polymorphic because a
-- worker's rows are of its shard's row type.
DROP FUNCTION IF EXISTS credpool_frees_at(credentials, lease_windows, bigint, timestamptz);
DROP FUNCTION IF EXISTS credpool_frees_at(anyelement, anycompatible, lease_slots[], bigint,
    timestamptz);
CREATE FUNCTION credpool_frees_at(c anyelement, w anycompatible, p_slots lease_slots[],
    p_tokens bigint, p_at timestamptz, OUT at timestamptz, OUT held_by text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_usable timestamptz;
    v_slot timestamptz;
    v_window timestamptz := p_at;
BEGIN
    v_usable := CASE WHEN credential_usable(c.status, c.cooldown_until, p_at) THEN p_at
                     ELSE credential_recovers_at(c.status, c.cooldown_until, p_at) END;
    IF v_usable IS NULL THEN
        RETURN;
    END IF;
    SELECT CASE WHEN bool_or(credpool_slot_open(s, c.status, greatest(p_at, v_usable))) THEN p_at
                ELSE min(s.lease_until) FILTER (
                         WHERE s.lease_until > p_at AND NOT s.surplus AND NOT s.draining
                           AND (c.status = 'available' OR s.slot = 0)) END
    INTO v_slot
    FROM unnest(p_slots) AS s;
    IF v_slot IS NULL THEN
        RETURN;
    END IF;
    IF w.key_id IS NOT NULL THEN
        v_window := nullif(credpool_window_frees_at(w, p_at, p_tokens), 'infinity');
        IF v_window IS NULL THEN
            RETURN;
        END IF;
    END IF;
    at := greatest(v_usable, v_slot, v_window);
    held_by := CASE
        WHEN v_window = at AND v_window > p_at THEN credpool_window_holding(w, p_at, p_tokens) || '_window'
        WHEN v_usable = at AND v_usable > p_at THEN 'cooldown'
        ELSE 'slots' END;
END;
$$;

-- AFFINITY: a grant's affinity result, for a claim that named `p_affinity_key`, whose
-- live binding was `p_bound` (NULL: none), served by `p_key_id`: 'hit' (the bound credential
-- served), 'moved' (another one did), 'new' (there was no live binding); NULL without an
-- affinity key.
CREATE OR REPLACE FUNCTION credpool_affinity_result(p_affinity_key text, p_bound text, p_key_id text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_affinity_key IS NULL THEN NULL
                WHEN p_bound = p_key_id THEN 'hit'
                WHEN p_bound IS NOT NULL THEN 'moved'
                ELSE 'new' END
$$;

-- AFFINITY: the advisory lock of one binding's key (transaction-scoped, only ever tried): held by
-- the claim that writes the binding and by the maintenance pass that deletes it, so neither ever
-- meets a row the other is writing.
CREATE OR REPLACE FUNCTION credpool_affinity_lock(p_tenant text, p_provider text, p_pool text,
    p_affinity_key text)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended(
        'credpool.affinity:' || p_tenant || '/' || p_provider || '/' || p_pool || '/' || p_affinity_key, 0)
$$;

-- FAIR SHARE (docs/design.md, "Fair share"): the tenant a waiting claim yields to, or
-- NULL. A claim of an allocation that waits (wait_ms) for a slot of p_pool, for p_model, made for
-- p_tenant whose request arrived at p_since, yields when another tenant waits for the same
-- provider, pool and model (a live pool_waiters row: its wait not over, its process alive within
-- the last 5 seconds) and stands further below its weighted share of the pool: its live leases in
-- the pool with the one it would get, divided by its weight, are fewer than the claim's tenant's
-- (ties: the tenant whose earliest waiter arrived first). Counting the lease to come is weighted
-- fair queuing's order (the next grant goes to the earliest virtual finish); it keeps the same
-- split (2:4:2 of 8 slots for weights 1:2:1) and, unlike leases / weight alone, leaves no tie
-- between tenants of unequal weights at that split, where a claim that read just before a release
-- committed would win the tie and take the releasing tenant's slot (measured: the tenant of
-- weight 2 got 45.5% of the grants instead of 50%). A tenant that cannot take the slot now (at
-- its own cap: no free tenant slot row; or a window of it without room for its smallest
-- waiter's reservation) is not yielded to, so no slot is ever held back for a tenant that cannot
-- use it. Read from
-- the claim's snapshot: a share is a preference between waiters, not a limit (nothing over any
-- limit can come of a stale read; two claims of one freed slot settle it on the slot row).
-- p_pending: the tenants of the claims of the same call, for the same pool, that went ahead
-- before this one (one entry per claim): counted as in flight, since the call's claims do not
-- see each other's grants (without it, every claim of a tenant one below its share would go
-- ahead in one call).
-- Costs one probe of pool_waiters; when another tenant waits, one read of the waiting tenants'
-- rows (per tenant on Citus) and one of the pool's live slot rows (lease_slots has no index on
-- the tenant: it would cost the hot updates of every grant).
DROP FUNCTION IF EXISTS credpool_fair_share_ahead(text, text, text, text, timestamptz, timestamptz);
CREATE OR REPLACE FUNCTION credpool_fair_share_ahead(p_provider text, p_pool text, p_model text,
    p_tenant text, p_since timestamptz, p_pending text[], p_now timestamptz)
RETURNS text
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_waiting text[];
    v_since timestamptz[];
    v_tokens bigint[];
    v_ahead text;
    v_tenant text;
    v_roomy text[] := '{}';
BEGIN
    SELECT array_agg(w.tenant ORDER BY w.tenant), array_agg(w.since ORDER BY w.tenant),
           array_agg(w.tokens ORDER BY w.tenant)
    INTO v_waiting, v_since, v_tokens
    FROM (
        SELECT w.tenant, min(w.since) AS since, min(w.tokens) AS tokens
        FROM pool_waiters w
        JOIN pool_waiter_processes p ON p.instance = w.instance
        WHERE w.provider = p_provider AND w.model = p_model AND p_pool = ANY (w.pools)
          AND w.until > p_now AND p.seen_at > p_now - interval '5 seconds'
          AND w.tenant <> p_tenant AND w.shares
        GROUP BY w.tenant
    ) AS w;
    IF v_waiting IS NULL THEN
        RETURN NULL;
    END IF;
    -- the waiting tenants that can take a slot now, read apart from the pool's slot rows, per
    -- pass of tenants (on Citus a tenant's rows are on its own worker)
    FOREACH v_tenant IN ARRAY credpool_tenant_passes(v_waiting) LOOP
        SELECT v_roomy || coalesce(array_agg(x.tenant), '{}') INTO v_roomy
        FROM unnest(v_waiting, v_tokens) AS x (tenant, tokens)
        JOIN tenants t ON t.tenant_id = x.tenant
        WHERE credpool_on_tenant(x.tenant, v_tenant)
          AND (t.max_concurrent_leases IS NULL
               OR EXISTS (SELECT 1 FROM tenant_slots ts
                          WHERE credpool_on_tenant(ts.tenant_id, v_tenant)
                            AND ts.tenant_id = t.tenant_id
                            AND credpool_tenant_slot_open(ts, p_now)))
          AND NOT EXISTS (SELECT 1 FROM tenant_windows tw
                          WHERE credpool_on_tenant(tw.tenant_id, v_tenant)
                            AND tw.tenant_id = t.tenant_id
                            AND NOT credpool_window_room(credpool_tenant_window(tw), p_now,
                                                         x.tokens));
    END LOOP;
    WITH counted AS (
        SELECT l.tenant, count(*) AS in_flight
        FROM (SELECT s.tenant
              FROM credentials c
              JOIN lease_slots s ON s.key_id = c.key_id
                  AND credpool_on_provider(s.provider, p_provider)
              WHERE c.provider = p_provider AND c.pool = p_pool AND s.lease_until > p_now
                AND (s.tenant = p_tenant OR s.tenant = ANY (v_waiting))
              UNION ALL
              SELECT u.tenant FROM unnest(p_pending) AS u (tenant)) AS l
        GROUP BY l.tenant
    ),
    shares AS (
        SELECT x.tenant, x.since, (coalesce(n.in_flight, 0) + 1)::numeric / t.weight AS share,
               x.tenant = ANY (v_roomy) AS has_room
        FROM unnest(v_waiting, v_since) AS x (tenant, since)
        JOIN tenants t ON t.tenant_id = x.tenant
        LEFT JOIN counted n ON n.tenant = x.tenant
    ),
    mine AS (
        SELECT (coalesce((SELECT n.in_flight FROM counted n WHERE n.tenant = p_tenant), 0) + 1)::numeric
               / t.weight AS share
        FROM tenants t
        WHERE t.tenant_id = p_tenant
    )
    SELECT s.tenant INTO v_ahead
    FROM shares s, mine m
    WHERE s.has_room AND (s.share < m.share OR (s.share = m.share AND s.since < p_since))
    ORDER BY s.share, s.since
    LIMIT 1;
    RETURN v_ahead;
END;
$$;

-- FAIR SHARE: whether a waiter's row is gone: its wait ended (`p_until`) or its process
-- (last seen at `p_seen_at`, NULL: never or no more) stopped saying it is alive, a minute before
-- `p_now`.
CREATE OR REPLACE FUNCTION credpool_waiter_gone(p_until timestamptz, p_seen_at timestamptz,
    p_now timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT p_until < p_now - interval '1 minute'
           OR coalesce(p_seen_at < p_now - interval '1 minute', true)
$$;

-- FAIR SHARE: a process with waiting requests says it is alive (every second while it has any),
-- and deletes the rows of waiters that are gone (credpool_waiter_gone; a row a claim is writing
-- is skipped, never waited for): read first, then deleted provider by provider, each row read
-- again under its lock (on Citus each provider's rows are on its worker, and a statement that
-- locks rows names one provider).
DROP FUNCTION IF EXISTS credpool_waiters_seen(text);
CREATE FUNCTION credpool_waiters_seen(p_instance text)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_gone record;
BEGIN
    INSERT INTO pool_waiter_processes (instance, seen_at) VALUES (p_instance, now())
    ON CONFLICT (instance) DO UPDATE SET seen_at = EXCLUDED.seen_at;
    FOR v_gone IN
        SELECT w.provider, array_agg(w.waiter) AS waiters
        FROM pool_waiters w
        LEFT JOIN pool_waiter_processes p ON p.instance = w.instance
        WHERE credpool_waiter_gone(w.until, p.seen_at, now())
        GROUP BY w.provider
        ORDER BY w.provider
    LOOP
        DELETE FROM pool_waiters
        WHERE provider = v_gone.provider
          AND waiter IN (SELECT w.waiter FROM pool_waiters w
                         LEFT JOIN pool_waiter_processes p ON p.instance = w.instance
                         WHERE w.provider = v_gone.provider AND w.waiter = ANY (v_gone.waiters)
                           AND credpool_waiter_gone(w.until, p.seen_at, now())
                         FOR UPDATE OF w SKIP LOCKED);
    END LOOP;
    DELETE FROM pool_waiter_processes WHERE seen_at < now() - interval '1 minute';
END;
$$;

-- Whether credential `c`'s slot `s` may take a claim for (provider, pool, model) made at `p_at`
-- whose lease would end at `p_until`: the one definition of an eligible candidate, for every shape
-- of PICK. The credential may serve it (credpool_may_serve), the slot is open
-- (credpool_slot_open), the credential row is the configuration the slot row was fitted to (the
-- GATES: a change committed after the claim's snapshot moved the slot row's config_version), and
-- an OAuth credential's token lasts the lease. Inlined into the statement.
CREATE OR REPLACE FUNCTION credpool_slot_eligible(c anyelement, s anycompatible, p_provider text,
    p_pool text, p_model text, p_at timestamptz, p_until timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT credpool_may_serve(c, p_provider, p_pool, p_model, p_at)
       AND credpool_slot_open(s, c.status, p_at)
       AND s.config_version = c.config_version
       AND credpool_token_lasts(c, p_until)
$$;

-- CLAIM (DESIGN "The protocol", step 1), for one request or for a group: the driver over the
-- phases below, each run only when a claim of the call needs it.
--
-- p_claims jsonb: an array of claims, each an object with credpool_claim's first attributes
-- (migration 20261204000018): "ranked" (key ids, best first: the Rust scoring), "provider",
-- "pool", "model" (a model or alias), "lease_id" (the new lease's uuid), "holder", "lease_seconds",
-- "tokens" (the reservation for token windows; 0 or absent: none), "request_id" with
-- "request_digest", "key_hash" (hex SHA-256 of the executor key presented; absent: the configured
-- internal key, tenant `default`), "windowed" (whether a candidate has rate windows, as the
-- service's view says; absent: the claim looks), the AFFINITY fields ("affinity_key",
-- "affinity_pools": the pool sequence of the pool asked for, that pool first; "affinity_ttl_seconds";
-- "affinity_mode": 'preferred' or 'strict') and "waiting" (the request waits for a slot: {"waiter"
-- (uuid), "instance" (its process), "pools" (its pool sequence), "waited_ms" and "wait_ms"
-- (milliseconds it has waited and may still wait: the claim dates them on its own clock)}).
--
-- Returns one row per claim, `claim` = its 1-based position: the pool's version (NULL when the
-- pool never had a credential), read before any candidate, so the caller learns whether its
-- candidate view is stale; the lease, NULL when no candidate could serve; `request`: NULL,
-- 'replayed' (the request_id's live lease, granted to an earlier attempt with the same
-- parameters), 'conflict' (its live lease was granted for other parameters), 'in_flight' (another
-- transaction is claiming for the same request_id right now), 'busy' (nothing granted, but a
-- candidate that may serve at once, read after the claim, was held by another transaction or
-- changed by one at that moment; or the tenant is being changed): for those two, claim again in a
-- moment; 'unauthorized' (no live key: nothing done); 'tenant_limit' (its tenant's cap or windows
-- hold it back, read after the claim); 'yield' (a waiting claim whose pool another tenant, further
-- below its share, waits for; `yield_to` names it). `frees_at`, when nothing was granted: the
-- earliest moment a candidate (or, for 'tenant_limit', the tenant) may serve it, and `held_by`
-- what holds it back (credpool_frees_at; 'tenant', 'tenant_window', 'token_refresh'), for the
-- answer's Retry-After, a waiting request's timer and the held-back metric. `tenant`: the tenant
-- the claim was made for; `db_now`: the call's clock; `affinity`: 'hit', 'new', 'moved' for a
-- grant, 'bound' for a strict claim that waits for its bound credential.
--
-- Phases, in order (a plain call, whose claims use no tenant cap or window, no rate window, no
-- affinity key, no request id and no wait, runs PARSE, PICK PLAIN, GRANT and ANSWERS: four
-- statements, and a fifth for the expired leases its slots still carried, when they do):
--   PARSE        the claims, their tenants (key, advisory lock in shared mode), pool versions
--   AFFINITY     bound credentials first in their claims' lists            (an affinity key)
--   REQUESTS     request ids: replayed, conflict, in_flight                 (a request id)
--   FAIR SHARE   a waiting claim yields to a tenant further below its share (a wait)
--   PICK, GRANT  rounds until no claim is left open: PICK PLAIN for the claims whose tenant
--                has no cap and no windows and whose candidates have no windows, PICK for the
--                others; GRANT begins the picked leases
--   REMEMBER     the request ids' rows                                      (a request id)
--   BIND         the grants' affinity bindings                              (an affinity key)
--   TENANT HELD  whether a tenant's cap or windows hold back a claim that got nothing (a gated
--                tenant)
--   WAIT         the waiting requests' pool_waiters rows                    (a wait)
--   FREES        when a candidate frees up, per provider     (a claim that got nothing)
--   ANSWERS      the grants' trail rows, and one row per claim
--
-- Why this cannot oversell: capacity is not counted, it is the set of slot rows, and a lease
-- exists only inside the slot row that holds it. Every condition that decides whether a grant
-- may happen is on a row the pick locks (the slot row: free, not surplus, not draining, its
-- windows gate, its config_version; the lease_windows row; the tenant slot and tenant_windows
-- rows), or was read by a later statement than the one that took the tenant's lock (whether the
-- tenant is capped or windowed). Under READ COMMITTED, when FOR UPDATE meets a row that another
-- transaction changed after the statement's snapshot, PostgreSQL re-evaluates the WHERE clause
-- against the newest version of the locked rows (EvalPlanQual): a slot a concurrent claim has just
-- filled, a window just charged, a slot a refit has just closed, no longer passes and is passed
-- over. SKIP LOCKED passes over rows another transaction holds right now, so concurrent claims
-- spread over the free slots instead of queueing. Two transactions never hold one slot row's
-- lock at once, so each slot carries at most one unexpired lease. (The trap in DESIGN — lock the
-- credential, count its leases in a subquery — fails because the count reads the statement's
-- snapshot, which EvalPlanQual does not refresh for rows other than the locked ones.) The claims
-- of one call do not see each other within one pick (one snapshot; a transaction's own locks do
-- not make it skip a row), so a round grants each credential (and tenant slot row, and windowed
-- tenant) to the first of its claims only; the others pick again in the next round, a new
-- statement that sees the grants before it. Every round grants at least one claim.
--
-- The credential row is read from the snapshot, not locked (locking it would make every claim on
-- a credential queue on one row); what the claim decides on it is gated through the slot row's
-- config_version (credpool_slot_eligible; GATES in sql/locks.sql). Only health written from
-- outcome reports is read from the snapshot without a gate: a report committed while the claim
-- runs may let this one grant through, never a grant over a limit or a window.
--
-- Locks: the tenant's advisory lock in shared mode, tried; slot, lease_windows, tenant slot and
-- tenant_windows rows with SKIP LOCKED; request ids' and affinity keys' advisory locks with a
-- try-lock; affinity_bindings rows with SKIP LOCKED. The call never waits for a lock, so any
-- number of claims can share a transaction without ever being part of a deadlock.
--
-- Clock: statement_timestamp(), the start of the call, decides usability, expiry and window room
-- (a lease that expires while the call runs is treated as still held). A grant's granted_at is
-- clock_timestamp(), read when its slot row is read, after the lock for a slot freed after the
-- snapshot: the trail never shows two leases of one slot overlapping.
--
-- Plans: index probes whatever the planner's statistics say (a pool just loaded, never
-- analyzed): the call runs with sequential and bitmap scans, hash and merge joins and
-- materialization turned off, joins in the order written, and keeps its plans
-- (plan_cache_mode = force_generic_plan). The settings are the driver's (SET clauses of the
-- phases would cost each call a save and restore of every one): the phases are planned under them
-- when the driver first runs them in a session, and only the driver calls them.
DROP FUNCTION IF EXISTS credpool_claim(jsonb);
DROP FUNCTION IF EXISTS credpool_begin_lease(lease_slots, uuid, text, text, text, integer,
    timestamptz, bigint, text, text, text, timestamptz, boolean);
CREATE FUNCTION credpool_claim(p_claims jsonb)
RETURNS TABLE (claim integer, pool_version bigint, key_id text, lease_id uuid, lease_pool text,
               granted_at timestamptz, lease_until timestamptz, probe boolean,
               provider_model text, sealed_secret bytea, pruned_expired boolean, fence bigint,
               request text, frees_at timestamptz, held_by text, tenant text, db_now timestamptz,
               affinity text, yield_to text)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan SET join_collapse_limit = 1 SET from_collapse_limit = 1
AS $$
DECLARE
    v_now timestamptz := statement_timestamp();
    v_claims credpool_claim[];
    v_gated boolean;
    v_windowed boolean;
    v_affine boolean;
    v_requested boolean;
    v_waiting boolean;
    v_grants credpool_grant[] := '{}';
    v_open integer[];
    v_plain integer[];
    v_rest integer[];
    v_picks credpool_pick[];
    v_regated integer[];
    v_parsed record;
    v_round record;
    v_providers text[];
    v_provider text;
    v_todo integer[];
    v_frees record;
    v_frees_n integer[] := '{}';
    v_frees_at timestamptz[] := '{}';
    v_frees_held text[] := '{}';
BEGIN
    -- (the phases are called in expressions, not statements: each costs a function call only)
    v_parsed := credpool_claim_parse(p_claims, v_now);
    v_claims := v_parsed.claims;
    v_open := v_parsed.open;
    v_gated := v_parsed.gated;
    v_windowed := v_parsed.windowed;
    v_affine := v_parsed.affine;
    v_requested := v_parsed.requested;
    v_waiting := v_parsed.waiting;
    v_providers := v_parsed.providers;
    IF v_claims IS NULL THEN
        RETURN;
    END IF;
    IF v_affine THEN
        v_claims := credpool_claim_affinity(v_claims, v_providers, v_now);
        -- (a bound credential with windows makes its claim a windowed one)
        v_windowed := v_windowed OR EXISTS (SELECT 1 FROM unnest(v_claims) AS c WHERE c.windowed);
    END IF;
    IF v_requested THEN
        v_round := credpool_claim_requests(v_claims, v_now);
        v_claims := v_round.claims;
        v_grants := v_round.grants;
    END IF;
    IF v_waiting THEN
        v_claims := credpool_claim_fair_share(v_claims, v_now);
    END IF;
    IF v_requested OR v_waiting THEN
        v_open := ARRAY(SELECT c.n FROM unnest(v_claims) AS c WHERE c.request IS NULL ORDER BY c.n);
    END IF;
    -- the open claims: to plain rounds those whose tenant looked ungated and whose candidates
    -- have no windows; the rest (and those whose tenant turns out gated) to the full rounds
    IF v_gated OR v_windowed THEN
        SELECT coalesce(array_agg(c.n ORDER BY c.n) FILTER (
                   WHERE NOT (c.capped OR c.tenant_windowed OR c.windowed)), '{}'),
               coalesce(array_agg(c.n ORDER BY c.n) FILTER (
                   WHERE c.capped OR c.tenant_windowed OR c.windowed), '{}')
        INTO v_plain, v_rest
        FROM unnest(v_claims) AS c
        WHERE c.n = ANY (v_open);
    ELSE
        v_plain := v_open;
        v_rest := '{}';
    END IF;
    -- provider by provider, ascending (each pick and grant names one provider: on Citus each
    -- runs on the worker that holds the provider's rows; a call of one provider runs as many
    -- statements as it would without)
    FOREACH v_provider IN ARRAY v_providers LOOP
        v_todo := v_plain;
        WHILE cardinality(v_todo) > 0 LOOP
            v_round := credpool_claim_pick_plain(v_claims, v_todo, v_provider, v_now);
            v_picks := v_round.picks;
            v_todo := v_round.lost;
            v_regated := v_round.regated;
            v_rest := v_rest || v_regated;
            v_gated := v_gated OR cardinality(v_regated) > 0;
            EXIT WHEN cardinality(v_picks) = 0;
            v_grants := v_grants || credpool_claim_grant(v_claims, v_picks, v_provider);
        END LOOP;
    END LOOP;
    IF cardinality(v_rest) > 0 THEN
        FOREACH v_provider IN ARRAY v_providers LOOP
            v_todo := v_rest;
            WHILE cardinality(v_todo) > 0 LOOP
                v_round := credpool_claim_pick(v_claims, v_todo, v_provider, v_now);
                v_picks := v_round.picks;
                v_todo := v_round.lost;
                EXIT WHEN cardinality(v_picks) = 0;
                v_grants := v_grants || credpool_claim_grant(v_claims, v_picks, v_provider);
            END LOOP;
        END LOOP;
    END IF;
    IF v_requested AND cardinality(v_grants) > 0 THEN
        PERFORM credpool_claim_remember(v_claims, v_grants);
    END IF;
    IF v_affine AND cardinality(v_grants) > 0 THEN
        PERFORM credpool_claim_bind(v_claims, v_grants, v_providers);
    END IF;
    IF v_gated THEN
        v_claims := credpool_claim_tenant_held(v_claims, v_grants, v_now);
    END IF;
    IF v_waiting THEN
        PERFORM credpool_claim_wait(v_claims, v_grants, v_providers, v_now);
    END IF;
    IF cardinality(v_grants) < cardinality(v_claims) THEN
        FOREACH v_provider IN ARRAY v_providers LOOP
            v_frees := credpool_claim_frees(v_claims, v_grants, v_provider, v_now);
            v_frees_n := v_frees_n || v_frees.claims;
            v_frees_at := v_frees_at || v_frees.frees_at;
            v_frees_held := v_frees_held || v_frees.held_by;
        END LOOP;
    END IF;
    RETURN QUERY SELECT * FROM credpool_claim_answers(v_claims, v_grants, v_frees_n, v_frees_at,
                                                      v_frees_held, v_now);
END;
$$;

-- PARSE: the claims of a call as the service sent them (credpool_claim's first attributes), each
-- with its place; its tenant (of the live key it presented, else `default`) and that tenant's
-- advisory lock in shared mode, tried (held to the commit, so no change of the tenant commits
-- before this call does: what the later statements read of it stays true; not held, a change is
-- in progress: 'busy'); its pool's version; a waiting request's arrival and end of wait, dated on
-- this clock. A claim without a live key is 'unauthorized'; one of a pool its tenant's `pools` no
-- longer admit (changed since the request arrived: a waiting request claims for up to its whole
-- wait) 'pool_not_allowed'; neither takes the tenant's lock. The scope is read in this
-- statement's snapshot and not read again after the lock: a change of `pools` applies to every
-- claim whose call starts after it committed (one in progress holds the lock: 'busy'); a call
-- that started just before the commit may still grant under the old scope. Returns the claims
-- still open, and
-- says which phases the call needs
-- (whether a tenant looks capped or windowed is read here BEFORE the lock was taken, so it is a
-- hint: PICK PLAIN reads it again).
DROP FUNCTION IF EXISTS credpool_claim_parse(jsonb, timestamptz);
CREATE FUNCTION credpool_claim_parse(p_claims jsonb, p_now timestamptz,
    OUT claims credpool_claim[], OUT open integer[], OUT gated boolean, OUT windowed boolean,
    OUT affine boolean, OUT requested boolean, OUT waiting boolean, OUT providers text[])
LANGUAGE plpgsql
AS $$
DECLARE
    v_probe boolean;
    v_windowed boolean;
BEGIN
    WITH x AS (
        SELECT x.*, x.ordinality::integer AS place
        FROM jsonb_populate_recordset(NULL::credpool_claim, p_claims) WITH ORDINALITY AS x
    ),
    versions AS (
        SELECT d.provider, d.pool, credpool_pool_version(d.provider, d.pool) AS version
        FROM (SELECT DISTINCT x.provider, x.pool FROM x) AS d
    )
    SELECT array_agg(ROW(
               x.ranked, x.provider, x.pool, x.model, x.lease_id, x.holder, x.lease_seconds,
               coalesce(x.tokens, 0), x.request_id, x.request_digest, x.key_hash, x.windowed,
               x.affinity_key, x.affinity_pools, coalesce(x.affinity_ttl_seconds, 3600),
               x.affinity_mode, x.waiting,
               x.place, t.tenant_id, t.steady, coalesce(t.capped, false),
               coalesce(t.windowed, false), 0, v.version,
               p_now - make_interval(secs => (x.waiting ->> 'waited_ms')::numeric / 1000),
               p_now + make_interval(secs => (x.waiting ->> 'wait_ms')::numeric / 1000),
               NULL, false,
               CASE WHEN t.tenant_id IS NULL THEN 'unauthorized'
                    WHEN NOT t.admitted THEN 'pool_not_allowed'
                    WHEN NOT t.steady THEN 'busy' END,
               NULL, false, NULL, false, NULL)::credpool_claim ORDER BY x.place),
           coalesce(array_agg(x.place ORDER BY x.place) FILTER (WHERE t.steady), '{}'),
           coalesce(bool_or(t.steady AND (t.capped OR t.windowed)), false),
           coalesce(bool_or(t.steady AND x.windowed), false),
           coalesce(bool_or(t.steady AND x.affinity_key IS NOT NULL), false),
           coalesce(bool_or(t.steady AND x.request_id IS NOT NULL), false),
           coalesce(bool_or(t.steady AND jsonb_typeof(x.waiting) = 'object'), false),
           coalesce(bool_or(x.windowed IS NULL), false),
           coalesce(array_agg(DISTINCT x.provider ORDER BY x.provider) FILTER (WHERE t.steady),
                    '{}')
    INTO claims, open, gated, windowed, affine, requested, waiting, v_probe, providers
    FROM x
    JOIN versions v ON v.provider = x.provider AND v.pool = x.pool
    LEFT JOIN LATERAL (
        SELECT t.tenant_id, t.max_concurrent_leases IS NOT NULL AS capped,
               -- (a tenant has its tenant_windows row exactly while its rate_limits has
               -- windows: FIT TENANT keeps them so, in the transaction that sets them; the
               -- tenants row is the one every node of a Citus cluster has)
               jsonb_array_length(t.rate_limits) > 0 AS windowed,
               s.admitted,
               s.admitted AND pg_try_advisory_xact_lock_shared(
                   hashtextextended('credpool.tenant:' || t.tenant_id, 0)) AS steady
        FROM credpool_key_tenant(x.key_hash) AS k (tenant)
        JOIN tenants t ON t.tenant_id = k.tenant
        -- (the configured internal key reaches every pool)
        CROSS JOIN LATERAL (
            SELECT x.key_hash IS NULL OR credpool_scope_admits(t.pools, x.provider, x.pool)
                   AS admitted
        ) AS s
    ) AS t ON true;
    -- "windowed" absent (a caller of the SQL API; the service always sends it): a probe per
    -- candidate, in a statement of its own, provider by provider, so that the service's claims
    -- pay nothing for it (and on Citus each probe reads its provider's worker only)
    IF v_probe THEN
        FOR i IN 1 .. cardinality(claims) LOOP
            CONTINUE WHEN claims[i].windowed IS NOT NULL;
            -- (a query of its own, not an assignment's expression, which Citus cannot send)
            -- (LIMIT 1 keeps the planner from reading credentials in search of the few with
            -- windows)
            SELECT EXISTS (
                       SELECT 1 FROM unnest(claims[i].ranked) AS r (key_id)
                       CROSS JOIN LATERAL (
                           SELECT c.rate_limits FROM credentials c
                           WHERE c.key_id = r.key_id
                             AND credpool_on_provider(c.provider, claims[i].provider)
                           LIMIT 1) AS c
                       WHERE c.rate_limits <> '[]'::jsonb)
            INTO v_windowed;
            claims[i].windowed := v_windowed;
            windowed := windowed OR (claims[i].windowed AND claims[i].n = ANY (open));
        END LOOP;
    END IF;
END;
$$;

-- AFFINITY, read: each claim's live binding (expires_at after the call's clock), its credential
-- put first in the claim's ranked list (and taken out of the rest of it): PICK tries it first,
-- under every gate of the locked row like any candidate, and passes over it when it cannot serve
-- now, so the next candidate serves in the same round (a binding is a preference, never a wait).
-- Strict, while the bound credential could serve but for its slots and windows (usable, not
-- drained, serves the model, in a pool of the request's sequence; read from this snapshot like
-- every candidate's credential row): that credential alone, in the claim of its pool; nothing in
-- the sequence's other pools ('bound' answers that the caller waits for it). A bound credential
-- with windows makes the claim a windowed one. Bindings are per tenant.
DROP FUNCTION IF EXISTS credpool_claim_affinity(credpool_claim[], timestamptz);
CREATE OR REPLACE FUNCTION credpool_claim_affinity(p_claims credpool_claim[], p_providers text[],
    p_now timestamptz)
RETURNS credpool_claim[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_claims credpool_claim[] := p_claims;
    v_provider text;
    r record;
BEGIN
    -- (one statement per pass, credpool_provider_passes: on Citus each reads its provider's
    -- bindings and credentials on its worker)
    FOREACH v_provider IN ARRAY credpool_provider_passes(p_providers) LOOP
    FOR r IN
        SELECT o.n, b.key_id AS bound, x.cred, coalesce(x.confined, false) AS confined
        FROM unnest(p_claims) AS o
        JOIN LATERAL (
            SELECT b.key_id FROM affinity_bindings b
            WHERE credpool_on_provider(b.provider, v_provider)
              AND b.tenant = o.tenant AND b.provider = o.provider AND b.pool = o.affinity_pools[1]
              AND b.affinity_key = o.affinity_key AND b.expires_at > p_now
            LIMIT 1
        ) AS b ON true
        LEFT JOIN LATERAL (
            SELECT ROW(c.*)::credentials AS cred,
                   o.affinity_mode = 'strict' AND c.pool = ANY (o.affinity_pools)
                   AND credpool_may_serve(c, o.provider, c.pool, o.model, p_now) AS confined
            FROM credentials c
            WHERE c.key_id = b.key_id AND credpool_on_provider(c.provider, v_provider)
            LIMIT 1
        ) AS x ON true
        WHERE credpool_on_provider(o.provider, v_provider)
          AND o.affinity_key IS NOT NULL AND o.request IS NULL
    LOOP
        v_claims[r.n].bound := r.bound;
        v_claims[r.n].bound_only := r.confined;
        v_claims[r.n].ranked := CASE
            WHEN NOT r.confined THEN r.bound || array_remove(v_claims[r.n].ranked, r.bound)
            WHEN (r.cred).pool = v_claims[r.n].pool THEN ARRAY[r.bound]
            ELSE '{}' END;
        v_claims[r.n].windowed := v_claims[r.n].windowed
                                  OR coalesce((r.cred).rate_limits <> '[]'::jsonb, false);
    END LOOP;
    END LOOP;
    RETURN v_claims;
END;
$$;

-- REQUESTS: request ids, each its tenant's. A claim whose request_id another transaction is
-- claiming for right now (its advisory lock, tried, is taken) is 'in_flight'; one whose
-- request_id has a live lease replays it ('replayed', a grant of the call) or, granted for other
-- parameters, is a 'conflict'; of the claims of this call that name one request_id, the first
-- claims and the others are 'in_flight' (claimed again, they replay its lease). The rows
-- (lease_requests) are written only under their advisory lock: REMEMBER, after the rounds.
CREATE OR REPLACE FUNCTION credpool_claim_requests(p_claims credpool_claim[], p_now timestamptz,
    OUT claims credpool_claim[], OUT grants credpool_grant[])
LANGUAGE plpgsql
AS $$
DECLARE
    v_locked text[];
    q record;
    prior record;
BEGIN
    claims := p_claims;
    grants := '{}';
    SELECT coalesce(array_agg(d.request), '{}') INTO v_locked
    FROM (SELECT DISTINCT c.tenant || '/' || c.request_id AS request
          FROM unnest(p_claims) AS c
          WHERE c.request_id IS NOT NULL AND c.request IS NULL) AS d
    WHERE pg_try_advisory_xact_lock(hashtextextended('credpool.request_id:' || d.request, 0));
    FOR q IN SELECT c.* FROM unnest(p_claims) AS c
             WHERE c.request_id IS NOT NULL AND c.request IS NULL ORDER BY c.n LOOP
        IF NOT (q.tenant || '/' || q.request_id) = ANY (v_locked)
           OR EXISTS (SELECT 1 FROM unnest(p_claims) AS e
                      WHERE e.n < q.n AND e.request IS NULL AND e.tenant = q.tenant
                        AND e.request_id = q.request_id) THEN
            claims[q.n].request := 'in_flight';
            CONTINUE;
        END IF;
        -- (on Citus, a statement on the claim's provider's worker: a request id is its tenant's
        -- and its provider's there, see docs/src/citus.md)
        SELECT ROW(s.*)::lease_slots AS s, r.request_digest = q.request_digest AS same_request,
               c.secret_ciphertext,
               coalesce(c.model_aliases ->> q.model, q.model) AS provider_model
        INTO prior
        FROM lease_requests r
        JOIN lease_slots s ON s.key_id = r.key_id AND s.lease_id = r.lease_id
            AND credpool_on_provider(s.provider, q.provider)
        JOIN credentials c ON c.key_id = s.key_id AND credpool_on_provider(c.provider, q.provider)
        WHERE r.tenant = q.tenant AND r.request_id = q.request_id
          AND credpool_on_provider(r.provider, q.provider) AND s.lease_until > p_now;
        IF FOUND THEN
            claims[q.n].request := CASE WHEN prior.same_request THEN 'replayed' ELSE 'conflict' END;
            IF prior.same_request THEN
                grants := grants
                    || ROW(q.n, prior.s, prior.secret_ciphertext, prior.provider_model, false)::credpool_grant;
            END IF;
        END IF;
    END LOOP;
END;
$$;

-- FAIR SHARE: a waiting claim yields to a tenant further below its weighted share that waits for
-- its pool (credpool_fair_share_ahead; the claims of this call for the same pool that go ahead
-- before it count as in flight): 'yield', and `yield_to` that tenant, whose waiter the caller
-- wakes in its stead. A claim that does not wait never yields.
CREATE OR REPLACE FUNCTION credpool_claim_fair_share(p_claims credpool_claim[], p_now timestamptz)
RETURNS credpool_claim[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_claims credpool_claim[] := p_claims;
    q record;
    v_ahead text;
BEGIN
    FOR q IN SELECT c.* FROM unnest(p_claims) AS c
             WHERE c.since IS NOT NULL AND c.request IS NULL ORDER BY c.n LOOP
        v_ahead := credpool_fair_share_ahead(q.provider, q.pool, q.model, q.tenant, q.since,
            ARRAY(SELECT e.tenant FROM unnest(v_claims) AS e
                  WHERE e.n < q.n AND e.since IS NOT NULL AND e.request IS NULL
                    AND e.provider = q.provider AND e.pool = q.pool),
            p_now);
        IF v_ahead IS NOT NULL THEN
            v_claims[q.n].request := 'yield';
            v_claims[q.n].yield_to := v_ahead;
        END IF;
    END LOOP;
    RETURN v_claims;
END;
$$;

-- PICK PLAIN: for each of `p_open`'s claims (its tenant has no cap and no windows, its candidates
-- no rate windows), its first candidate in its ranked order with an eligible slot
-- (credpool_slot_eligible) that does not gate windows, locked FOR UPDATE SKIP LOCKED: ONE
-- statement, which locks only slot rows. Of the claims that picked one slot, the first (in claim
-- order) wins it; the others are `lost` (they pick again in the next round, which sees the
-- grant). A slot's decision depends on its own row only (no windows, no tenant rows: a
-- recovering credential's single probe slot is one slot), so two claims of a round may take two
-- slots of one credential. Whether the tenant has a cap or windows is read again here, after the call took the
-- tenant's lock (PARSE read it before): a claim whose tenant turned out gated is `regated`, for
-- PICK. A claim that picked nothing is in neither list: nothing can serve it now.
DROP FUNCTION IF EXISTS credpool_claim_pick_plain(credpool_claim[], integer[], timestamptz);
CREATE OR REPLACE FUNCTION credpool_claim_pick_plain(p_claims credpool_claim[], p_open integer[],
    p_provider text, p_now timestamptz, OUT picks credpool_pick[], OUT lost integer[],
    OUT regated integer[])
LANGUAGE plpgsql
AS $$
BEGIN
    WITH open AS (
        SELECT o.*,
               EXISTS (SELECT 1 FROM tenants t
                       WHERE t.tenant_id = o.tenant
                         AND (t.max_concurrent_leases IS NOT NULL
                              OR jsonb_array_length(t.rate_limits) > 0)) AS gated
        FROM unnest(p_claims) AS o
        WHERE o.n = ANY (p_open) AND o.provider = p_provider
    ),
    picked AS (
        SELECT ROW(o.n, x.s, x.status, x.cooldown_until, x.at, x.secret_ciphertext,
                   x.provider_model, x.token_expires_at, false, NULL, false)::credpool_pick AS p,
               row_number() OVER (PARTITION BY (x.s).key_id, (x.s).slot ORDER BY o.n) = 1 AS first
        FROM open o
        CROSS JOIN LATERAL (
            SELECT ROW(s.*)::lease_slots AS s, c.status, c.cooldown_until, c.secret_ciphertext,
                   coalesce(c.model_aliases ->> o.model, o.model) AS provider_model,
                   clock_timestamp() AS at, c.token_expires_at
            FROM unnest(o.ranked) WITH ORDINALITY AS r (key_id, rank)
            CROSS JOIN LATERAL (SELECT * FROM credentials c
                                WHERE c.key_id = r.key_id
                                  AND credpool_on_provider(c.provider, p_provider)
                                LIMIT 1) AS c
            JOIN lease_slots s ON s.key_id = c.key_id
                AND credpool_on_provider(s.provider, p_provider)
            WHERE (SELECT credpool_test_hook('claim.before_lock'))
              AND credpool_slot_eligible(c::credentials, s, o.provider, o.pool, o.model,
                                         p_now, p_now + make_interval(secs => o.lease_seconds))
              AND NOT s.windowed
            -- (each claim starts at another slot: claims of one call that rank one credential
            -- first pick different slots of it, and all win the round)
            ORDER BY r.rank, (s.slot + o.n) % c.max_concurrent_uses
            LIMIT 1
            FOR UPDATE OF s SKIP LOCKED
        ) AS x
        WHERE NOT o.gated
    )
    SELECT coalesce((SELECT array_agg(p.p ORDER BY (p.p).n) FROM picked p WHERE p.first), '{}'),
           coalesce((SELECT array_agg((p.p).n ORDER BY (p.p).n) FROM picked p WHERE NOT p.first), '{}'),
           coalesce((SELECT array_agg(o.n ORDER BY o.n) FROM open o WHERE o.gated), '{}')
    INTO picks, lost, regated;
END;
$$;

-- PICK, for the claims whose tenant has a cap or windows or whose candidates have windows: two
-- statements. First, TENANCY, what each claim's tenant needs, read now (after the call took the
-- tenant's lock, so no change of the tenant can have overtaken this snapshot), in a statement of
-- its own per pass of tenants (credpool_tenant_passes: one on plain PostgreSQL; on Citus a
-- tenant's rows are on its own worker, and a statement locks rows of one worker): with a cap, a
-- free row of its tenant_slots (credpool_tenant_slot_open: no live lease, not surplus), searched
-- from a random row below the cap (the claims of one tenant in one call rarely meet on a row), locked FOR UPDATE
-- SKIP LOCKED (a row a concurrent claim filled after the snapshot fails the re-check of the
-- locked row: `tenants::a_claim_paused_before_the_tenant_lock...`); with windows, its
-- tenant_windows row, locked FOR UPDATE SKIP LOCKED only when every window has room
-- (credpool_window_room on the locked row). A claim of a capped or windowed tenant picks only
-- with them. Then, in the second statement, its first eligible slot (credpool_slot_eligible),
-- in one of two shapes: a claim none of whose candidates has windows locks only slot rows, and
-- passes over a slot whose
-- `windowed` gate says its credential has windows now; a claim with a windowed candidate locks
-- that credential's lease_windows row with the slot row, and only when every window has room for
-- it. Of the claims that picked one credential, one tenant slot row or one windowed tenant, the
-- first wins; the others are `lost` (they pick again next round).
DROP FUNCTION IF EXISTS credpool_claim_pick(credpool_claim[], integer[], timestamptz);
CREATE OR REPLACE FUNCTION credpool_claim_pick(p_claims credpool_claim[], p_open integer[],
    p_provider text, p_now timestamptz, OUT picks credpool_pick[], OUT lost integer[])
LANGUAGE plpgsql
AS $$
DECLARE
    v_tenant text;
    -- TENANCY, one entry per claim: its number, whether its tenant is capped, the tenant slot
    -- row it locked, whether its tenant has windows, and whether it locked their row
    v_n integer[] := '{}';
    v_capped boolean[] := '{}';
    v_slot integer[] := '{}';
    v_windowed boolean[] := '{}';
    v_held boolean[] := '{}';
BEGIN
    -- TENANCY: the tenants' rows, in a statement of their own per pass (on Citus a tenant's rows
    -- are on its own worker, and one statement locks rows of one worker only)
    FOREACH v_tenant IN ARRAY credpool_claim_tenant_passes(p_claims, p_open, p_provider) LOOP
        SELECT v_n || coalesce(array_agg((q.o).n ORDER BY (q.o).n), '{}'),
               v_capped || coalesce(array_agg(q.capped ORDER BY (q.o).n), '{}'),
               v_slot || coalesce(array_agg(q.tenant_slot ORDER BY (q.o).n), '{}'),
               v_windowed || coalesce(array_agg(q.tenant_windowed ORDER BY (q.o).n), '{}'),
               v_held || coalesce(array_agg(q.tenant_window_held ORDER BY (q.o).n), '{}')
        INTO v_n, v_capped, v_slot, v_windowed, v_held
        FROM (
            SELECT o, tn.capped, coalesce(ts_after.slot, ts_before.slot) AS tenant_slot,
                   coalesce(twx.windowed, false) AS tenant_windowed,
                   twl.tenant_id IS NOT NULL AS tenant_window_held
            FROM unnest(p_claims) AS o
            CROSS JOIN LATERAL (
                SELECT t.max_concurrent_leases IS NOT NULL AS capped,
                       floor(random() * coalesce(t.max_concurrent_leases, 0))::integer AS start
                FROM tenants t WHERE t.tenant_id = o.tenant LIMIT 1
            ) AS tn
            LEFT JOIN LATERAL (
                SELECT t.slot FROM tenant_slots t
                WHERE tn.capped AND (SELECT credpool_test_hook('claim.before_tenant_lock'))
                  AND t.tenant_id = o.tenant AND credpool_on_tenant(t.tenant_id, v_tenant)
                  AND t.slot >= tn.start
                  AND credpool_tenant_slot_open(t, p_now)
                ORDER BY t.slot LIMIT 1
                FOR UPDATE SKIP LOCKED
            ) AS ts_after ON true
            LEFT JOIN LATERAL (
                SELECT t.slot FROM tenant_slots t
                WHERE tn.capped AND ts_after.slot IS NULL
                  AND t.tenant_id = o.tenant AND credpool_on_tenant(t.tenant_id, v_tenant)
                  AND t.slot < tn.start
                  AND credpool_tenant_slot_open(t, p_now)
                ORDER BY t.slot LIMIT 1
                FOR UPDATE SKIP LOCKED
            ) AS ts_before ON true
            LEFT JOIN LATERAL (
                SELECT true AS windowed FROM tenant_windows tw
                WHERE tw.tenant_id = o.tenant AND credpool_on_tenant(tw.tenant_id, v_tenant)
                LIMIT 1
            ) AS twx ON true
            LEFT JOIN LATERAL (
                SELECT tw.tenant_id FROM tenant_windows tw
                WHERE twx.windowed AND tw.tenant_id = o.tenant
                  AND credpool_on_tenant(tw.tenant_id, v_tenant)
                  AND (SELECT credpool_test_hook('claim.before_tenant_window_lock'))
                  AND credpool_window_room(credpool_tenant_window(tw), p_now, o.tokens)
                LIMIT 1
                FOR UPDATE SKIP LOCKED
            ) AS twl ON true
            WHERE o.n = ANY (p_open) AND o.provider = p_provider
              AND credpool_on_tenant(o.tenant, v_tenant)
        ) AS q;
    END LOOP;
    WITH tenancy AS (
        SELECT o, q.capped, q.tenant_slot, q.tenant_windowed, q.tenant_window_held
        FROM unnest(v_n, v_capped, v_slot, v_windowed, v_held)
             AS q (n, capped, tenant_slot, tenant_windowed, tenant_window_held)
        JOIN unnest(p_claims) AS o ON o.n = q.n
    ),
    picked AS (
        SELECT ROW((q.o).n, x.s, x.status, x.cooldown_until, x.at, x.secret_ciphertext,
                   x.provider_model, x.token_expires_at, false, q.tenant_slot,
                   q.tenant_windowed)::credpool_pick AS p, (q.o).tenant
        FROM tenancy q
        CROSS JOIN LATERAL (
            SELECT ROW(s.*)::lease_slots AS s, c.status, c.cooldown_until, c.secret_ciphertext,
                   coalesce(c.model_aliases ->> (q.o).model, (q.o).model) AS provider_model,
                   clock_timestamp() AS at, c.token_expires_at
            FROM unnest((q.o).ranked) WITH ORDINALITY AS r (key_id, rank)
            CROSS JOIN LATERAL (SELECT * FROM credentials c
                                WHERE c.key_id = r.key_id
                                  AND credpool_on_provider(c.provider, p_provider)
                                LIMIT 1) AS c
            JOIN lease_slots s ON s.key_id = c.key_id
                AND credpool_on_provider(s.provider, p_provider)
            WHERE (NOT q.capped OR q.tenant_slot IS NOT NULL)
              AND (NOT q.tenant_windowed OR q.tenant_window_held)
              AND (SELECT credpool_test_hook('claim.before_lock'))
              AND credpool_slot_eligible(c::credentials, s, (q.o).provider, (q.o).pool,
                                         (q.o).model, p_now,
                                         p_now + make_interval(secs => (q.o).lease_seconds))
              AND NOT s.windowed
            ORDER BY r.rank, s.slot LIMIT 1
            FOR UPDATE OF s SKIP LOCKED
        ) AS x
        WHERE NOT (q.o).windowed
        UNION ALL
        SELECT ROW((q.o).n, x.s, x.status, x.cooldown_until, x.at, x.secret_ciphertext,
                   x.provider_model, x.token_expires_at, true, q.tenant_slot,
                   q.tenant_windowed)::credpool_pick AS p, (q.o).tenant
        FROM tenancy q
        CROSS JOIN LATERAL (
            SELECT ROW(s.*)::lease_slots AS s, c.status, c.cooldown_until, c.secret_ciphertext,
                   coalesce(c.model_aliases ->> (q.o).model, (q.o).model) AS provider_model,
                   clock_timestamp() AS at, c.token_expires_at
            FROM unnest((q.o).ranked) WITH ORDINALITY AS r (key_id, rank)
            CROSS JOIN LATERAL (SELECT * FROM credentials c
                                WHERE c.key_id = r.key_id
                                  AND credpool_on_provider(c.provider, p_provider)
                                LIMIT 1) AS c
            JOIN lease_windows w ON w.key_id = c.key_id
                AND credpool_on_provider(w.provider, p_provider)
            JOIN lease_slots s ON s.key_id = c.key_id
                AND credpool_on_provider(s.provider, p_provider)
            WHERE (NOT q.capped OR q.tenant_slot IS NOT NULL)
              AND (NOT q.tenant_windowed OR q.tenant_window_held)
              AND (SELECT credpool_test_hook('claim.before_lock'))
              AND credpool_slot_eligible(c::credentials, s, (q.o).provider, (q.o).pool,
                                         (q.o).model, p_now,
                                         p_now + make_interval(secs => (q.o).lease_seconds))
              AND credpool_window_room(w, p_now, (q.o).tokens)
            ORDER BY r.rank, s.slot LIMIT 1
            FOR UPDATE OF w, s SKIP LOCKED
        ) AS x
        WHERE (q.o).windowed
    ),
    ranked AS (
        SELECT p.p,
               row_number() OVER (PARTITION BY ((p.p).s).key_id ORDER BY (p.p).n) = 1
               AND row_number() OVER (PARTITION BY p.tenant, coalesce((p.p).tenant_slot, -(p.p).n)
                                      ORDER BY (p.p).n) = 1
               -- (one grant per round charges a tenant's windows, as a credential's)
               AND row_number() OVER (PARTITION BY p.tenant,
                                                   CASE WHEN NOT (p.p).tenant_windowed
                                                        THEN (p.p).n END
                                      ORDER BY (p.p).n) = 1 AS first
        FROM picked p
    )
    SELECT coalesce((SELECT array_agg(r.p ORDER BY (r.p).n) FROM ranked r WHERE r.first), '{}'),
           coalesce((SELECT array_agg((r.p).n ORDER BY (r.p).n) FROM ranked r WHERE NOT r.first), '{}')
    INTO picks, lost;
END;
$$;

-- GRANT: begins the leases of `p_picks` (their slot rows locked by the pick, all of provider
-- `p_provider`): each slot row takes its lease (lease_until: the claim's length from the clock
-- read with the slot row, never past an OAuth token's expiry) and its fence from lease_fence_seq,
-- in ONE statement (the `granted` trail rows are written by ANSWERS, for every grant of the call
-- at once: Citus refuses an INSERT fed by a modifying CTE); then, each in a statement of its own
-- run only when a pick needs it: the expired leases the slots still carried end in the trail (at
-- their own lease_until), the credentials' windows are charged, the tenant slot rows take their
-- leases and the tenants' windows are charged (per tenant on Citus), a probe lease of a
-- credential back from a cooldown is recorded. Returns the grants.
DROP FUNCTION IF EXISTS credpool_claim_grant(credpool_claim[], credpool_pick[]);
CREATE OR REPLACE FUNCTION credpool_claim_grant(p_claims credpool_claim[], p_picks credpool_pick[],
    p_provider text)
RETURNS credpool_grant[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_grants credpool_grant[];
    v_pruned boolean;
    v_tenant_rows boolean;
    v_windows boolean;
    v_tenant_windows boolean;
    v_probes boolean;
    v_fences bigint[] := '{}';
    v_tenant text;
    v_tenanted integer[];
BEGIN
    -- one fence per pick, each drawn in an expression of its own (no statement): Citus evaluates
    -- a nextval() of a statement it routes to a worker once, for all the statement's rows
    FOR i IN 1 .. cardinality(p_picks) LOOP
        v_fences := v_fences || nextval('lease_fence_seq');
    END LOOP;
    WITH granted AS (
        -- (the slot row is `ls` here: `s` is a field of the pick, the slot row as it was)
        UPDATE lease_slots ls
        SET lease_id = p.lease_id, pool = p.pool, holder = p.holder, granted_at = p.at,
            lease_until = p.lease_until, last_granted_at = p.at, probe = p.probe,
            fence = p.fence, reserved_tokens = p.tokens, tenant = p.tenant,
            tenant_slot = p.tenant_slot
        -- (every new value is computed in the subquery, which Citus evaluates on the
        -- coordinator: it refuses a stable function of a column (the lease's end) in the SET of
        -- an UPDATE of a distributed table)
        FROM (SELECT p.*, o.lease_id, o.pool, o.holder, o.tokens, o.tenant,
                     least(p.at + make_interval(secs => o.lease_seconds), p.token_expires_at)
                         AS lease_until,
                     p.status <> 'available' AS probe, f.fence
              FROM unnest(p_picks) WITH ORDINALITY AS p
              JOIN unnest(v_fences) WITH ORDINALITY AS f (fence, place) ON f.place = p.ordinality
              JOIN unnest(p_claims) AS o ON o.n = p.n) AS p
        WHERE credpool_on_provider(ls.provider, p_provider)
          AND ls.key_id = (p.s).key_id AND ls.slot = (p.s).slot
        RETURNING p.*, ROW(ls.*)::lease_slots AS granted
    )
    SELECT coalesce(array_agg(ROW(g.n, g.granted, g.secret, g.provider_model,
                                  (g.s).lease_id IS NOT NULL)::credpool_grant ORDER BY g.n), '{}'),
           coalesce(bool_or((g.s).lease_id IS NOT NULL), false),
           coalesce(bool_or(g.tenant_slot IS NOT NULL), false),
           coalesce(bool_or(g.windowed), false), coalesce(bool_or(g.tenant_windowed), false),
           coalesce(bool_or(g.status <> 'available'), false),
           coalesce(array_agg(g.n) FILTER (WHERE g.tenant_slot IS NOT NULL OR g.tenant_windowed),
                    '{}')
    INTO v_grants, v_pruned, v_tenant_rows, v_windows, v_tenant_windows, v_probes, v_tenanted
    FROM granted g;
    IF v_pruned THEN
        v_pruned := 0 < credpool_record_lease_ends(
            ARRAY(SELECT p.s FROM unnest(p_picks) AS p WHERE (p.s).lease_id IS NOT NULL),
            ARRAY(SELECT 'expired' FROM unnest(p_picks) AS p WHERE (p.s).lease_id IS NOT NULL),
            ARRAY(SELECT (p.s).lease_until FROM unnest(p_picks) AS p WHERE (p.s).lease_id IS NOT NULL));
    END IF;
    IF v_windows THEN
        UPDATE lease_windows lw
        SET (bucket_ids, bucket_charged) =
            (SELECT x.bucket_ids, x.bucket_charged
             FROM credpool_window_charge(lw, p.at, (g.s).reserved_tokens) AS x)
        FROM unnest(p_picks) AS p
        JOIN unnest(v_grants) AS g ON g.n = p.n
        WHERE p.windowed AND credpool_on_provider(lw.provider, p_provider)
          AND lw.key_id = (p.s).key_id
          AND cardinality(lw.window_kinds) > 0;
    END IF;
    -- the granted claims' tenants' rows, which PICK locked, per pass of those tenants (on Citus
    -- each tenant's rows are on its worker): a capped tenant's lease takes its tenant slot row,
    -- with the same end; a windowed tenant's windows are charged
    -- (a grant of no capped or windowed tenant, the hot path, calls nothing)
    IF v_tenant_rows OR v_tenant_windows THEN
        FOREACH v_tenant IN ARRAY credpool_claim_tenant_passes(p_claims, v_tenanted, NULL) LOOP
            IF v_tenant_rows THEN
                UPDATE tenant_slots t
                SET lease_id = (g.s).lease_id, key_id = (g.s).key_id, lease_until = (g.s).lease_until
                FROM unnest(v_grants) AS g
                WHERE credpool_on_tenant(t.tenant_id, v_tenant)
                  AND t.tenant_id = (g.s).tenant AND t.slot = (g.s).tenant_slot;
            END IF;
            IF v_tenant_windows THEN
                UPDATE tenant_windows tw
                SET (bucket_ids, bucket_charged) =
                    (SELECT x.bucket_ids, x.bucket_charged
                     FROM credpool_window_charge(credpool_tenant_window(tw), p.at,
                                                 (g.s).reserved_tokens) AS x)
                FROM unnest(p_picks) AS p
                JOIN unnest(v_grants) AS g ON g.n = p.n
                WHERE p.tenant_windowed AND credpool_on_tenant(tw.tenant_id, v_tenant)
                  AND tw.tenant_id = (g.s).tenant;
            END IF;
        END LOOP;
    END IF;
    IF v_probes THEN
        INSERT INTO credential_events
            (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at)
        SELECT (p.s).key_id, 'probe_granted', p.status, p.status,
               'cooldown ended; single probe lease granted', p.cooldown_until, (g.s).lease_id, p.at
        FROM unnest(p_picks) AS p
        JOIN unnest(v_grants) AS g ON g.n = p.n
        WHERE p.status <> 'available';
    END IF;
    RETURN v_grants;
END;
$$;

-- REMEMBER: each request id of the call's grants (not its replays) remembers its lease, in its
-- tenant's lease_requests row, written under the request id's advisory lock (REQUESTS took it),
-- so no two transactions ever write one row, and a claim never writes a slot row it did not claim.
CREATE OR REPLACE FUNCTION credpool_claim_remember(p_claims credpool_claim[], p_grants credpool_grant[])
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO lease_requests AS r (tenant, request_id, request_digest, lease_id, key_id, granted_at,
                                     provider)
    SELECT o.tenant, o.request_id, o.request_digest, (g.s).lease_id, (g.s).key_id, (g.s).granted_at,
           o.provider
    FROM unnest(p_grants) AS g
    JOIN unnest(p_claims) AS o ON o.n = g.n
    WHERE o.request_id IS NOT NULL AND o.request IS NULL
    ON CONFLICT ON CONSTRAINT lease_requests_pkey DO UPDATE
    SET request_digest = EXCLUDED.request_digest, lease_id = EXCLUDED.lease_id,
        key_id = EXCLUDED.key_id, granted_at = EXCLUDED.granted_at, provider = EXCLUDED.provider;
END;
$$;

-- BIND: the affinity bindings of the call's grants (not its replays), the last grant of each
-- affinity key in claim order: a hit refreshes last_hit_at and expires_at (the TTL counts from
-- the last hit), 'new' and 'moved' bind the credential that served. Never waited for: first the
-- affinity keys' advisory locks, tried, in a statement of their own, so that the later
-- statements' snapshots, taken after them, see every binding the lock's last holder wrote (a row
-- they do not see can only be inserted by a holder of the lock, so the INSERT never meets another
-- transaction's row in progress); then each existing row locked with SKIP LOCKED (a row another
-- transaction holds: a delete cascading, the maintenance pass, is left as it is: a binding is a
-- hint); then one statement writes the rows it locked and those that did not exist.
DROP FUNCTION IF EXISTS credpool_claim_bind(credpool_claim[], credpool_grant[]);
CREATE OR REPLACE FUNCTION credpool_claim_bind(p_claims credpool_claim[], p_grants credpool_grant[],
    p_providers text[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_bind integer[];
    v_write integer[] := '{}';
    v_provider text;
BEGIN
    SELECT coalesce(array_agg(d.n), '{}') INTO v_bind
    FROM (SELECT DISTINCT ON (o.tenant, o.provider, o.affinity_pools[1], o.affinity_key)
                 o.n, o.tenant, o.provider, o.affinity_pools[1] AS pool, o.affinity_key
          FROM unnest(p_grants) AS g
          JOIN unnest(p_claims) AS o ON o.n = g.n
          WHERE o.affinity_key IS NOT NULL AND o.request IS NULL
          ORDER BY o.tenant, o.provider, o.affinity_pools[1], o.affinity_key, o.n DESC) AS d
    WHERE pg_try_advisory_xact_lock(credpool_affinity_lock(d.tenant, d.provider, d.pool,
                                                           d.affinity_key));
    IF v_bind = '{}' THEN
        RETURN;
    END IF;
    -- the bindings it may write: those that do not exist and those it locked (one statement per
    -- pass, credpool_provider_passes; the lock and the write are two statements: Citus refuses an
    -- INSERT fed by a locking query)
    FOREACH v_provider IN ARRAY credpool_provider_passes(p_providers) LOOP
        v_write := v_write || ARRAY(
            SELECT o.n
            FROM unnest(p_claims) AS o
            LEFT JOIN LATERAL (
                SELECT true AS found FROM affinity_bindings b
                WHERE credpool_on_provider(b.provider, v_provider)
                  AND b.tenant = o.tenant AND b.provider = o.provider
                  AND b.pool = o.affinity_pools[1] AND b.affinity_key = o.affinity_key
                LIMIT 1
            ) AS e ON true
            LEFT JOIN LATERAL (
                SELECT true AS locked FROM affinity_bindings b
                WHERE credpool_on_provider(b.provider, v_provider)
                  AND b.tenant = o.tenant AND b.provider = o.provider
                  AND b.pool = o.affinity_pools[1] AND b.affinity_key = o.affinity_key
                FOR UPDATE SKIP LOCKED
            ) AS l ON e.found
            WHERE o.n = ANY (v_bind) AND credpool_on_provider(o.provider, v_provider)
              AND (e.found IS NULL OR l.locked));
    END LOOP;
    INSERT INTO affinity_bindings AS b
        (tenant, provider, pool, affinity_key, key_id, bound_at, last_hit_at, expires_at)
    SELECT o.tenant, o.provider, o.affinity_pools[1], o.affinity_key, (g.s).key_id,
           (g.s).granted_at, (g.s).granted_at,
           (g.s).granted_at + make_interval(secs => o.affinity_ttl_seconds)
    FROM unnest(p_grants) AS g
    JOIN unnest(p_claims) AS o ON o.n = g.n
    WHERE o.n = ANY (v_write)
    ON CONFLICT ON CONSTRAINT affinity_bindings_pkey DO UPDATE
    SET key_id = EXCLUDED.key_id,
        -- a hit keeps when the conversation was bound; a move or an expired binding starts anew
        bound_at = CASE WHEN b.key_id = EXCLUDED.key_id AND b.expires_at > EXCLUDED.bound_at
                        THEN b.bound_at ELSE EXCLUDED.bound_at END,
        last_hit_at = EXCLUDED.last_hit_at, expires_at = EXCLUDED.expires_at;
END;
$$;

-- TENANT HELD: for each claim that got nothing, of a capped tenant or one with windows, whether
-- its tenant holds it back, read now: at its cap when no row of the tenant is open (each within
-- the cap holds a live lease; it frees when the first of those ends); out of window room when a
-- window of it cannot take the claim's reservation now (it frees when it can; never: NULL).
CREATE OR REPLACE FUNCTION credpool_claim_tenant_held(p_claims credpool_claim[],
    p_grants credpool_grant[], p_now timestamptz)
RETURNS credpool_claim[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_claims credpool_claim[] := p_claims;
    v_tenant text;
    r record;
BEGIN
    -- per pass of tenants (on Citus each tenant's rows are on its worker)
    FOREACH v_tenant IN ARRAY credpool_claim_tenant_passes(p_claims, NULL, NULL) LOOP
        FOR r IN
            SELECT o.n, coalesce(tl.full, false) AS cap_full, tl.frees_at AS cap_frees,
                   coalesce(tw.full, false) AS window_full, tw.frees_at AS window_frees
            FROM unnest(p_claims) AS o
            -- (a tenant has slot rows while it has a cap, and a tenant_windows row while it has windows)
            LEFT JOIN LATERAL (
                SELECT NOT coalesce(bool_or(credpool_tenant_slot_open(t, p_now)), false) AS full,
                       min(t.lease_until) FILTER (WHERE t.lease_until > p_now AND NOT t.surplus) AS frees_at
                FROM tenant_slots t
                WHERE t.tenant_id = o.tenant AND credpool_on_tenant(t.tenant_id, v_tenant)
                HAVING count(*) > 0
            ) AS tl ON true
            LEFT JOIN LATERAL (
                SELECT NOT credpool_window_room(credpool_tenant_window(tw), p_now, o.tokens) AS full,
                       nullif(credpool_window_frees_at(credpool_tenant_window(tw), p_now, o.tokens),
                              'infinity') AS frees_at
                FROM tenant_windows tw
                WHERE tw.tenant_id = o.tenant AND credpool_on_tenant(tw.tenant_id, v_tenant)
            ) AS tw ON true
            WHERE o.request IS NULL AND credpool_on_tenant(o.tenant, v_tenant)
              AND NOT o.n = ANY (ARRAY(SELECT g.n FROM unnest(p_grants) AS g))
              AND (tl.full OR tw.full)
        LOOP
            v_claims[r.n].cap_full := r.cap_full;
            v_claims[r.n].cap_frees := r.cap_frees;
            v_claims[r.n].window_full := r.window_full;
            v_claims[r.n].window_frees := r.window_frees;
        END LOOP;
    END LOOP;
    RETURN v_claims;
END;
$$;

-- WAIT (fair share): a waiting claim that got nothing is (still) waiting: its request's
-- pool_waiters row written (kept as it is when there: its first arrival and end of wait), so
-- that a release of its pool announces the freed slot; one that got a lease (or replayed one)
-- waits no more: no row. Whether other tenants yield to it (`shares`) is decided at each claim:
-- not when its own tenant holds it back (its cap, its windows: it cannot take a slot, and is
-- never yielded to), nor for a strict affinity claim (it waits for one credential: other tenants'
-- claims must not yield every other slot of the pool to it). Only the request's own claims write
-- its row, one after the other, so the write never waits.
DROP FUNCTION IF EXISTS credpool_claim_wait(credpool_claim[], credpool_grant[], timestamptz);
CREATE OR REPLACE FUNCTION credpool_claim_wait(p_claims credpool_claim[], p_grants credpool_grant[],
    p_providers text[], p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_provider text;
BEGIN
    -- (one statement per pass, credpool_provider_passes)
    FOREACH v_provider IN ARRAY credpool_provider_passes(p_providers) LOOP
        DELETE FROM pool_waiters w
        WHERE credpool_on_provider(w.provider, v_provider)
          AND w.waiter IN (SELECT (o.waiting ->> 'waiter')::uuid
                           FROM unnest(p_claims) AS o
                           WHERE o.since IS NOT NULL AND credpool_on_provider(o.provider, v_provider)
                             AND o.n IN (SELECT g.n FROM unnest(p_grants) AS g));
    END LOOP;
    -- (the key named: on Citus it is (waiter, provider), under the same name)
    INSERT INTO pool_waiters AS w (waiter, instance, tenant, provider, pools, model, since, until,
                                   tokens, shares)
    SELECT (o.waiting ->> 'waiter')::uuid, o.waiting ->> 'instance', o.tenant, o.provider,
           ARRAY(SELECT jsonb_array_elements_text(o.waiting -> 'pools')), o.model, o.since,
           o.wait_until, o.tokens,
           o.affinity_mode IS DISTINCT FROM 'strict' AND NOT (o.cap_full OR o.window_full)
    FROM unnest(p_claims) AS o
    WHERE o.since IS NOT NULL AND o.tenant IS NOT NULL
      AND o.n NOT IN (SELECT g.n FROM unnest(p_grants) AS g)
      AND o.request IS DISTINCT FROM 'conflict' AND o.request IS DISTINCT FROM 'in_flight'
    ON CONFLICT ON CONSTRAINT pool_waiters_pkey DO UPDATE SET shares = EXCLUDED.shares
    WHERE w.shares IS DISTINCT FROM EXCLUDED.shares;
END;
$$;

-- FREES: for each claim of provider `p_provider` that got nothing (and that its tenant does not
-- hold back, TENANT HELD), when may a candidate serve it, read now (credpool_frees_at and
-- credpool_token_refreshed_at of its first candidate to free up): `claims` (their places),
-- `frees_at` and `held_by`, in one order; a claim none of whose candidates will free up on its own
-- is left out. ONE statement, run only when a claim of the call got nothing: a call that granted
-- every claim pays nothing for it.
DROP FUNCTION IF EXISTS credpool_claim_frees(credpool_claim[], credpool_grant[], text, timestamptz);
CREATE FUNCTION credpool_claim_frees(p_claims credpool_claim[], p_grants credpool_grant[],
    p_provider text, p_now timestamptz, OUT claims integer[], OUT frees_at timestamptz[],
    OUT held_by text[])
LANGUAGE plpgsql
AS $$
BEGIN
    SELECT coalesce(array_agg(o.n ORDER BY o.n), '{}'),
           coalesce(array_agg(f.at ORDER BY o.n), '{}'),
           coalesce(array_agg(f.held_by ORDER BY o.n), '{}')
    INTO claims, frees_at, held_by
    FROM unnest(p_claims) AS o
    CROSS JOIN LATERAL (
        SELECT greatest(f.at, t.at) AS at,
               CASE WHEN t.at > f.at THEN 'token_refresh' ELSE f.held_by END AS held_by
        FROM unnest(o.ranked) AS r (key_id)
        CROSS JOIN LATERAL (SELECT * FROM credentials c
                            WHERE c.key_id = r.key_id
                              AND credpool_on_provider(c.provider, p_provider)
                            LIMIT 1) AS c
        LEFT JOIN lease_windows w ON w.key_id = c.key_id
            AND credpool_on_provider(w.provider, p_provider)
        LEFT JOIN oauth_credentials oc ON oc.key_id = c.key_id
            AND credpool_on_provider(oc.provider, p_provider)
        CROSS JOIN LATERAL (
            SELECT array_agg(ROW(s.*)::lease_slots) AS slots
            FROM lease_slots s
            WHERE s.key_id = c.key_id AND credpool_on_provider(s.provider, p_provider)
        ) AS s
        CROSS JOIN LATERAL credpool_frees_at(c::credentials, w, s.slots, o.tokens, p_now) AS f
        CROSS JOIN LATERAL credpool_token_refreshed_at(
            c::credentials, oc.next_attempt_at, oc.refresh_before_seconds,
            p_now + make_interval(secs => o.lease_seconds), p_now) AS t (at)
        WHERE c.pool = o.pool AND (o.model = ANY (c.models) OR c.model_aliases ? o.model)
          AND NOT c.draining AND f.at IS NOT NULL AND t.at IS NOT NULL
        ORDER BY greatest(f.at, t.at)
        LIMIT 1
    ) AS f
    WHERE o.provider = p_provider AND o.request IS NULL AND NOT (o.cap_full OR o.window_full)
      AND NOT o.n = ANY (ARRAY(SELECT g.n FROM unnest(p_grants) AS g));
END;
$$;

-- ANSWERS: the `granted` trail rows of the call's grants (not its replays), and one row per
-- claim, in claim order (the columns of credpool_claim), in ONE statement; its words are those
-- of the enum types credpool_claim_state, credpool_held_by and credpool_affinity_answer, through
-- which they are cast (a new word must join its type, and the service's decoder). Nothing
-- granted: when may a candidate serve it (FREES: `p_frees_n`, `p_frees_at`, `p_frees_held`, one
-- entry per claim in the same order)? A candidate whose slot or window row another transaction
-- held (a concurrent claim, the reaper, an operator's change) was passed over without knowing
-- what that transaction leaves: if, read now, one may serve at once, the claim is 'busy' (the
-- caller claims again). A claim its tenant holds back (TENANT HELD) is 'tenant_limit', whatever
-- the credentials say (a tenant both at its cap and out of window room: the later of the two;
-- NULL when its window can never hold the reservation).
DROP FUNCTION IF EXISTS credpool_claim_answers(credpool_claim[], credpool_grant[], timestamptz);
CREATE OR REPLACE FUNCTION credpool_claim_answers(p_claims credpool_claim[],
    p_grants credpool_grant[], p_frees_n integer[], p_frees_at timestamptz[], p_frees_held text[], p_now timestamptz)
RETURNS TABLE (claim integer, pool_version bigint, key_id text, lease_id uuid, lease_pool text,
               granted_at timestamptz, lease_until timestamptz, probe boolean,
               provider_model text, sealed_secret bytea, pruned_expired boolean, fence bigint,
               request text, frees_at timestamptz, held_by text, tenant text, db_now timestamptz,
               affinity text, yield_to text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH trail AS (
        INSERT INTO lease_events
            (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, fence, tokens,
             tenant, affinity)
        SELECT 'granted', (g.s).lease_id, (g.s).key_id, (g.s).provider, (g.s).pool, (g.s).slot,
               (g.s).holder, (g.s).lease_until, (g.s).granted_at, (g.s).fence,
               (g.s).reserved_tokens, (g.s).tenant,
               -- AFFINITY: the grant's result, for the dashboard's hit ratio
               credpool_affinity_result(o.affinity_key, o.bound, (g.s).key_id)
        FROM unnest(p_grants) AS g
        JOIN unnest(p_claims) AS o ON o.n = g.n
        WHERE o.request IS NULL
    )
    SELECT o.n, o.pool_version, (g.s).key_id, (g.s).lease_id, (g.s).pool, (g.s).granted_at,
           (g.s).lease_until, (g.s).probe, g.provider_model, g.secret, g.pruned, (g.s).fence,
           (CASE WHEN o.request IS NOT NULL THEN o.request
                 WHEN o.cap_full OR o.window_full THEN 'tenant_limit'
                 WHEN g.n IS NULL AND f.at <= p_now THEN 'busy' END)::credpool_claim_state::text,
           CASE WHEN o.window_full AND o.window_frees IS NULL THEN NULL
                WHEN o.cap_full OR o.window_full
                    THEN greatest(CASE WHEN o.cap_full THEN o.cap_frees END,
                                  CASE WHEN o.window_full THEN o.window_frees END)
                ELSE f.at END,
           (CASE WHEN o.window_full
                      AND (o.window_frees IS NULL OR NOT o.cap_full
                           OR o.window_frees > o.cap_frees) THEN 'tenant_window'
                 WHEN o.cap_full THEN 'tenant' ELSE f.held_by END)::credpool_held_by::text,
           coalesce((g.s).tenant, o.tenant), p_now,
           -- AFFINITY: the grant's result (a replay says none); a strict claim confined to its
           -- bound credential that granted nothing: 'bound'
           (CASE WHEN g.n IS NOT NULL AND o.request IS NULL
                 THEN credpool_affinity_result(o.affinity_key, o.bound, (g.s).key_id)
                 WHEN g.n IS NULL AND o.bound_only THEN 'bound' END)::credpool_affinity_answer::text,
           o.yield_to
    FROM unnest(p_claims) AS o
    LEFT JOIN unnest(p_grants) AS g ON g.n = o.n
    LEFT JOIN unnest(p_frees_n, p_frees_at, p_frees_held) AS f (n, at, held_by)
        ON f.n = o.n AND g.n IS NULL
    ORDER BY o.n;
END;
$$;
