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

-- Whether credential `c` may serve a claim for (provider, pool, model) at `p_at`: it is in the
-- pool, serves the model (directly or through an alias), is usable and is not drained.
CREATE OR REPLACE FUNCTION credpool_may_serve(
    c credentials, p_provider text, p_pool text, p_model text, p_at timestamptz)
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
-- credential whose token would expire first is passed over until its refresh lands (issue 28).
CREATE OR REPLACE FUNCTION credpool_token_lasts(c credentials, p_until timestamptz)
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
CREATE OR REPLACE FUNCTION credpool_token_refreshed_at(c credentials, p_until timestamptz,
    p_at timestamptz)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN credpool_token_lasts(c, p_until) THEN p_at
        ELSE (SELECT greatest(p_at + interval '1 second', o.next_attempt_at,
                              c.token_expires_at - make_interval(secs => o.refresh_before_seconds))
              FROM oauth_credentials o
              WHERE o.key_id = c.key_id)
    END
$$;

-- Whether slot `s` of a credential whose status is `p_status` is free for a claim at `p_at`: its
-- lease slot is empty or its lease has expired, and its gates are open (not a surplus row of a
-- lowered limit, not draining). A credential back from a cooldown (usable, status not yet
-- `available`) is half-open: only its slot 0 can be claimed, so it serves a single probe lease
-- at a time.
CREATE OR REPLACE FUNCTION credpool_slot_open(s lease_slots, p_status text, p_at timestamptz)
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
CREATE OR REPLACE FUNCTION credpool_tenant_slot_open(t tenant_slots, p_at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT NOT t.surplus AND (t.lease_id IS NULL OR t.lease_until <= p_at)
$$;

-- When credential `c` (its windows `w`, or NULL) may next serve a claim reserving `p_tokens`,
-- judged at `p_at`: `at`, the latest of the end of its cooldown, the moment one of its slots
-- frees, and the moment its windows admit the claim (`p_at` when it may serve now; NULL when
-- nothing known ends: it waits for an operator, is over a lowered limit or draining, or a window
-- can never hold the reservation), and `held_by`, which of those it is: 'slots', 'cooldown',
-- 'requests_window' or 'tokens_window'. For the Retry-After of a claim that granted nothing.
DROP FUNCTION IF EXISTS credpool_frees_at(credentials, lease_windows, bigint, timestamptz);
CREATE FUNCTION credpool_frees_at(c credentials, w lease_windows, p_tokens bigint, p_at timestamptz,
    OUT at timestamptz, OUT held_by text)
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
    FROM lease_slots s
    WHERE s.key_id = c.key_id;
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

-- AFFINITY (issue 30): a grant's affinity result, for a claim that named `p_affinity_key`, whose
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

-- FAIR SHARE (issue 29; docs/design.md "Fair share"): the tenant a waiting claim yields to, or
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
-- Costs one probe of pool_waiters; when another tenant waits, one read of the pool's live slot
-- rows (lease_slots has no index on the tenant: it would cost the hot updates of every grant).
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
          AND w.tenant <> p_tenant
        GROUP BY w.tenant
    ) AS w;
    IF v_waiting IS NULL THEN
        RETURN NULL;
    END IF;
    WITH counted AS (
        SELECT l.tenant, count(*) AS in_flight
        FROM (SELECT s.tenant
              FROM credentials c
              JOIN lease_slots s ON s.key_id = c.key_id
              WHERE c.provider = p_provider AND c.pool = p_pool AND s.lease_until > p_now
                AND (s.tenant = p_tenant OR s.tenant = ANY (v_waiting))
              UNION ALL
              SELECT u.tenant FROM unnest(p_pending) AS u (tenant)) AS l
        GROUP BY l.tenant
    ),
    shares AS (
        SELECT x.tenant, x.since, (coalesce(n.in_flight, 0) + 1)::numeric / t.weight AS share,
               (t.max_concurrent_leases IS NULL
                OR EXISTS (SELECT 1 FROM tenant_slots ts
                           WHERE ts.tenant_id = t.tenant_id
                             AND credpool_tenant_slot_open(ts, p_now)))
               AND NOT EXISTS (SELECT 1 FROM tenant_windows tw
                               WHERE tw.tenant_id = t.tenant_id
                                 AND NOT credpool_window_room(credpool_tenant_window(tw), p_now,
                                                              x.tokens)) AS has_room
        FROM unnest(v_waiting, v_since, v_tokens) AS x (tenant, since, tokens)
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

-- FAIR SHARE: a process with waiting requests says it is alive (every second while it has any),
-- and deletes the rows of waiters whose process stopped saying so a minute ago or whose wait
-- ended a minute ago (a row a claim is writing is skipped, never waited for).
CREATE OR REPLACE FUNCTION credpool_waiters_seen(p_instance text)
RETURNS void
LANGUAGE sql
AS $$
    INSERT INTO pool_waiter_processes (instance, seen_at) VALUES (p_instance, now())
    ON CONFLICT (instance) DO UPDATE SET seen_at = EXCLUDED.seen_at;
    DELETE FROM pool_waiters
    WHERE waiter IN (SELECT w.waiter FROM pool_waiters w
                     LEFT JOIN pool_waiter_processes p ON p.instance = w.instance
                     WHERE w.until < now() - interval '1 minute'
                        OR coalesce(p.seen_at < now() - interval '1 minute', true)
                     FOR UPDATE OF w SKIP LOCKED);
    DELETE FROM pool_waiter_processes WHERE seen_at < now() - interval '1 minute';
$$;

-- CLAIM (DESIGN "The protocol", step 1), for one request or for a group.
--
-- p_claims jsonb: an array of claims, each {"ranked": [key_id, ...] (best first, the Rust
-- scoring), "provider", "pool", "model" (a model or alias), "lease_id" (the new lease's uuid),
-- "holder" (or null), "lease_seconds", "tokens" (the reservation for token windows; 0 or absent:
-- none), optionally "request_id" with "request_digest", "key_hash" (hex SHA-256 of the
-- executor key presented; absent: the configured internal key, tenant `default`), optionally
-- "waiting" (the request waits for a slot: {"waiter" (uuid, the request's), "instance" (its
-- process), "pools" (its pool sequence), "waited_ms" and "wait_ms" (milliseconds it has waited
-- and may still wait: the claim dates its arrival and the end of its wait on its own clock)};
-- FAIR SHARE, below), and
-- optionally the AFFINITY fields (below)}. Returns one row per claim, `claim` =
-- its 1-based position: the pool's version (NULL when the pool never had a credential), read
-- before any candidate, so the caller learns whether its candidate view is stale, and the lease,
-- NULL when no candidate could serve. `request` is NULL, 'replayed' (the request_id's live lease,
-- granted to an earlier attempt with the same parameters: no slot taken), 'conflict' (its live
-- lease was granted for other parameters), 'in_flight' (another transaction is claiming for the
-- same request_id right now) or 'busy' (nothing granted, but a candidate that may serve at once,
-- read after the claim, was held by another transaction or changed by one at that moment): for
-- the last two, claim again in a moment; 'unauthorized' (its key_hash names no live key: nothing
-- done) or 'tenant_limit' (nothing granted: every slot row of its tenant holds a live lease, or a
-- window of its tenant has no room, read after the claim) or 'yield' (nothing looked at: a waiting claim whose pool another tenant, further
-- below its share, waits for; `yield_to` names that tenant). `frees_at`, when nothing was granted: the earliest moment a candidate may
-- serve it (for 'tenant_limit': the earliest end of the tenant's leases, or when its windows
-- have room), and `held_by` what holds that candidate back (credpool_frees_at; 'tenant',
-- 'tenant_window'), for the answer's Retry-After, a
-- waiting request's timer and the held-back metric. `tenant` is the tenant the claim was made
-- for, `db_now` the call's clock.
--
-- AFFINITY (issue 30; docs/design.md "Affinity"). A claim may name "affinity_key" (a conversation
-- id), "affinity_pools" (the pool sequence of the pool asked for, that pool first: the binding's
-- pool), "affinity_ttl_seconds" and "affinity_mode" ('preferred' or 'strict'). Its live binding
-- (affinity_bindings, expires_at after the call's clock) is read once, after the parse, and its
-- credential put first in the claim's ranked list (and taken out of the rest of it): PICK tries
-- it first, under every gate of the locked row like any candidate, and passes over it when it
-- cannot serve now (full, its windows full, disabled, drained, cooling down, in another pool,
-- its token expiring), so the claim is served by the next candidate in the same round: a binding
-- is a preference, never a wait. `strict`: while the bound credential could serve but for its
-- slots and windows, the claim considers it alone (in the pool of the sequence it is in; the
-- other pools' claims rank nothing) and answers `affinity` 'bound' when it granted nothing, so
-- the caller waits for that credential (or answers 429); when it could not serve at all, strict
-- is preferred. The answer's `affinity`, for a grant (not a replay): 'hit' (the bound credential
-- served), 'moved' (a live binding existed, another credential served) or 'new' (no live
-- binding); the `granted` trail row carries it too. After the rounds, ONE statement writes the
-- bindings of the call's grants (a hit refreshes last_hit_at and expires_at; new and moved bind
-- the credential that served), each only if this call got its affinity key's advisory lock with
-- a try-lock, and only where the binding's row, if it exists, could be locked with SKIP LOCKED:
-- a binding this call cannot write is left as it is (it is a hint), so the write never waits.
-- Nothing granted: no binding is written. Bindings are per tenant: a conversation key of one
-- tenant never reads or moves another tenant's binding.
--
-- A group of claims is one call: one round trip and, outside an explicit transaction, one commit.
-- Its claims are decided together, in rounds, each round two statements whatever the number of
-- claims (and one more for each thing only some winners need: ending the expired leases their
-- slots carry, charging windows, request ids' rows, probes' trail rows). PICK takes, for every
-- claim still open, the first candidate in its own ranked order that may serve it
-- (credpool_may_serve), whose token (OAuth) lasts the lease (credpool_token_lasts), and that has
-- a free slot (credpool_slot_open) and, if it has rate windows, room in every window
-- (credpool_window_room, sql/windows.sql), and locks that slot row (and the credential's
-- lease_windows row); of the claims that picked one credential, the first in array order wins
-- it, the others are open again in the next round. GRANT then begins the
-- winners' leases (the expired lease a slot still carries ended in the trail, the lease in the
-- slot, the windows charged, the request_id's row, the `granted` trail row, `probe_granted` for a
-- probe). Each round is a new statement, so it sees the grants of the rounds before it (and what
-- other transactions committed meanwhile); a credential is granted at most once per round, so
-- every grant and every window charge is decided on the slot and window rows as the grants before
-- it left them: the same as claiming one after the other, in array order, at a fraction of the
-- statements. A claim that picked nothing is not granted. Every round grants at least one claim,
-- so there are at most as many rounds as claims, and in practice one or two.
--
-- Why this cannot oversell: capacity is not counted, it is the set of slot rows, and a lease
-- exists only inside the slot row that holds it. Every condition that decides whether a grant may
-- happen is on a row PICK locks: whether the slot is free, whether its credential is over a
-- lowered limit, draining or has rate windows (credpool_fit_slots writes those gates into every
-- slot row under the rows' locks), and how much room its windows have (its lease_windows row).
-- Under READ COMMITTED, when FOR UPDATE meets a row that another transaction changed after this
-- statement's snapshot, PostgreSQL re-evaluates the WHERE clause against the newest version of the
-- locked rows (EvalPlanQual): a slot that a concurrent claim has just filled, a window a concurrent
-- claim has just charged, a slot a refit has just closed, no longer passes and is passed over.
-- SKIP LOCKED passes over rows another transaction holds right now, so concurrent claims spread
-- over the free slots instead of queueing. Two transactions can never both hold one slot row's
-- lock, so each slot carries at most one unexpired lease; nor one lease_windows row's, so each
-- window charge sees every charge before it. (The trap in DESIGN — lock the credential, count its
-- leases in a subquery — fails because the count reads the statement's snapshot, which
-- EvalPlanQual does not refresh for rows other than the locked ones.) Within one PICK, the claims
-- of this call do not see each other (one snapshot, and a transaction's own locks do not make it
-- skip a row): two of them may pick the same slot, which is why only one claim per credential
-- wins a round.
--
-- The credential row is read from the snapshot, not locked (locking it would make every claim on
-- a credential queue on one row). What the claim decides on it — provider, pool, models and
-- aliases, the secret it hands out, an operator's status — is gated through the slot row: every
-- change of those moves credentials.config_version and, in the same transaction, writes the new
-- version into every slot row of the credential (trigger credentials_config_version, above). The
-- claim grants only where `s.config_version = c.config_version`. A change committed after the
-- claim's snapshot and before its lock changed the slot row, so EvalPlanQual re-checks it: the
-- locked row's new version against the snapshot's old credential row, unequal, and the candidate
-- is passed over (the caller claims again and reads the new configuration). A change still in
-- progress holds the slot rows (operators lock all of them first), so SKIP LOCKED passes over
-- them; a change that starts after the lock waits for this claim's commit, and the grant comes
-- before it. Only health written from outcome reports (a cooldown, a status an outcome sets) is
-- read from the snapshot without a gate: a report committed while the claim runs may let this one
-- grant through, never a grant over a limit or a window.
--
-- OAuth (issue 28): a credential whose access token expires before the lease would end
-- (credentials.token_expires_at < the call's clock + lease_seconds) is passed over, and its
-- `frees_at` is when its refresh should land (credpool_token_refreshed_at; it waits for its
-- refresh, not for a slot, so the caller does not claim it again at once). The expiry is a column of the credential row, read from the snapshot like the secret it
-- belongs to, and gated the same way: a refresh writes a new secret and expiry together, which
-- moves config_version into every slot row. A winner's lease_until is never later than its
-- token's expiry: `at` (read when the slot row is read) may be a little after the call's clock,
-- so the grant takes the earlier of the two.
--
-- Tenants (issue 29): the key_hash names the tenant (a revoked key names none: read by the call's
-- first statement, so a request that starts after the revoke committed is refused on every
-- replica). That statement also tries the tenant's advisory lock in shared mode, which every
-- change of the tenant (an operator's PUT or DELETE, a fit) takes exclusively: held, no change of
-- the tenant commits until this call has, so PICK, a later statement with a later snapshot, reads
-- the tenant's cap and windows as they will stay until the grant commits, and a change waits
-- for the grant and counts it (a cap adopts its lease, a new window seeds it from the trail). Not
-- held (a change is in progress): the claim answers 'busy', and the caller claims again.
--
-- A claim of a tenant with a cap (max_concurrent_leases) takes, in PICK, a free row of the
-- tenant's `tenant_slots` (no lease, or an expired one; not over a lowered cap) with FOR UPDATE
-- SKIP LOCKED, before its credential slot, and grants only with one: the tenant's capacity is
-- that set of rows, decided on rows the claim locks exactly like a credential's (a row a
-- concurrent claim has just filled fails the re-check of the locked row and is passed over;
-- `tenants::a_claim_paused_before_the_tenant_lock...` holds a claim there). Within one PICK two
-- claims of the call may pick the same tenant row, so a claim wins a round only as the first of
-- its credential and the first of its tenant row; each claim starts its search at a random row
-- below the cap (wrapping around), so that the claims of one tenant in one call rarely meet on a
-- row and rarely need another round. A tenant row held by another transaction is skipped; if,
-- read after the claim, the tenant still has a free row, the answer is not 'tenant_limit' but
-- what the credentials say ('busy' when one may serve at once: the caller claims again), so a
-- claim racing its own tenant's claims gets no false 429.
--
-- Tenant windows: a claim of a tenant with rate windows (a `tenant_windows` row) locks that row
-- in PICK with FOR UPDATE SKIP LOCKED when every window has room for it
-- (credpool_window_room, on the locked row: a window a concurrent claim has just charged fails
-- the re-check; `tenant_windows::a_claim_paused_before_the_tenant_window_lock...`), and grants
-- only with it; GRANT charges it as a credential's. One claim of a tenant with windows wins a
-- round (the next round sees its charge). A row held by another transaction is skipped, and the
-- answer is 'tenant_limit' only if, read after the claim, a window has no room ('tenant_window'
-- with the moment it frees; NULL when a window can never hold the reservation). The claims of a
-- tenant with windows queue on its row as those of a credential with windows do; a tenant
-- without windows has no row, and its claims lock nothing of it.
--
-- FAIR SHARE (issue 29): a claim with "waiting" (its request waits up to wait_ms; not a request
-- that answers at once: nobody is refused while a slot is free) yields, before any pick, when
-- another tenant waits for its pool further below its weighted share (credpool_fair_share_ahead):
-- its answer is 'yield' and `yield_to` that tenant, whose waiter the caller wakes in its stead.
-- Decided on this call's snapshot: a share is an order among waiters, never a limit. A waiting
-- claim that got nothing writes its request's pool_waiters row (a later claim of the same request
-- finds it there; a strict affinity claim, which waits for one credential, writes none); one that
-- got a lease deletes it. Only the request's own claims write its row
-- (one after the other), so that write never waits.
--
-- Two shapes of pick, one for each shape of candidate list: a claim none of whose candidates has
-- windows locks only the slot row (a credential without windows must not make concurrent claims
-- queue on one row), and passes over a slot whose `windowed` gate says its credential has windows
-- now; a claim with a candidate that has windows locks that credential's lease_windows row with
-- the slot row (candidates without windows in the same list lock their empty row too).
--
-- Locks: the tenant's advisory lock in shared mode, tried; the tenant slot row and the
-- tenant_windows row, the slot row (and the lease_windows row), with SKIP LOCKED; request
-- ids' and affinity keys' advisory locks with a try-lock; affinity_bindings rows with SKIP LOCKED
-- (and the key share lock of the binding's foreign key on the credential row of a slot this call
-- holds, which no transaction holding a conflicting lock can have: docs/design.md "Lock order").
-- The call never waits for a lock, so any number of claims can share a
-- transaction without ever being part of a deadlock.
--
-- Clock: statement_timestamp(), the start of the call, decides usability, expiry and window room
-- (a lease that expires while the call runs is treated as still held). granted_at is
-- clock_timestamp(), read once per claim when its slot row is read, which for a slot freed after
-- the snapshot is after the lock: the slot was freed by a transaction that committed before this
-- claim saw it free, so the trail never shows two leases of one slot overlapping.
--
-- Plans: index probes whatever the planner's statistics say (a pool just loaded, never analyzed):
-- one primary-key probe per candidate into credentials (the LATERAL ... LIMIT 1 keeps the planner
-- from scanning the pool through its (provider, pool) index), lease_windows and lease_slots, and
-- the function's settings rule out the scans, joins and materializations that read whole tables
-- (a generic plan, which PL/pgSQL uses from a statement's sixth run on, would otherwise read the
-- slots table once into memory rather than probe it per candidate when it has no statistics).
DROP FUNCTION IF EXISTS credpool_claim(jsonb);
DROP FUNCTION IF EXISTS credpool_begin_lease(lease_slots, uuid, text, text, text, integer,
    timestamptz, bigint, text, text, text, timestamptz, boolean);
CREATE FUNCTION credpool_claim(p_claims jsonb)
RETURNS TABLE (claim integer, pool_version bigint, key_id text, lease_id uuid, lease_pool text,
               granted_at timestamptz, lease_until timestamptz, probe boolean,
               provider_model text, sealed_secret bytea, pruned_expired boolean, fence bigint,
               request text, frees_at timestamptz, held_by text, tenant text, db_now timestamptz,
               -- AFFINITY: 'hit', 'new', 'moved' for a grant; 'bound' for a strict claim that
               -- waits for its bound credential; NULL without an affinity_key
               affinity text,
               -- FAIR SHARE: with request 'yield', the tenant yielded to
               yield_to text)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan SET join_collapse_limit = 1 SET from_collapse_limit = 1
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := statement_timestamp();
    v_count integer := jsonb_array_length(p_claims);
    -- the claims; v_number: each one's place in p_claims (the answer's `claim`)
    v_number integer[];
    v_ranked jsonb[];
    v_provider text[];
    v_pool text[];
    v_model text[];
    v_lease uuid[];
    v_holder text[];
    v_seconds integer[];
    v_tokens bigint[];
    v_request_id text[];
    v_digest text[];
    v_windowed boolean[];
    v_pool_version bigint[];
    -- each claim's tenant (NULL: its key is unknown or revoked)
    v_tenant text[];
    -- whether the call holds each claim's tenant's advisory lock in shared mode (tried)
    v_steady boolean[];
    -- where each claim of a capped tenant starts looking for a free tenant slot row: a random
    -- row below the cap, so that the claims of one call rarely pick the same row (of the claims
    -- that pick one row, only the first wins the round; starting all at row 0 made a call of n
    -- claims of one tenant take n rounds)
    v_tenant_start integer[];
    -- claims answered before any pick (request ids), and their `request`
    v_done boolean[];
    v_request text[];
    -- the claims the next round picks for
    v_open integer[];
    -- whether a winner of this round ends an expired lease to take its slot, names a request_id,
    -- is a probe
    v_pruned boolean;
    v_requested boolean;
    v_probed boolean;
    -- one round's winners (claim order): the claim, its slot row as picked, what the grant and
    -- the answer need of its credential
    w_claim integer[];
    w_slot lease_slots[];
    w_status text[];
    w_cooldown timestamptz[];
    w_at timestamptz[];
    w_charge boolean[];
    w_secret bytea[];
    w_model text[];
    w_token timestamptz[];
    w_tenant_slot integer[];
    w_tenant_charge boolean[];
    -- every lease the call answers with (granted, or replayed): the claim, the slot row as
    -- granted, the sealed secret and the provider's model handed out, whether an expired lease
    -- was ended to make room
    g_claim integer[] := '{}';
    g_slot lease_slots[] := '{}';
    g_secret bytea[] := '{}';
    g_model text[] := '{}';
    g_pruned boolean[] := '{}';
    v_requests text[];
    q record;
    prior record;
    -- AFFINITY: each claim's affinity_key (NULL: none), the pool sequence it asked for (its
    -- first pool is the binding's), TTL in seconds, whether strict; its live binding's key_id,
    -- whether strict confines it to that credential; whether any claim names an affinity_key;
    -- the grants (positions in g_claim) whose binding this call writes
    v_affinity_key text[];
    v_affinity_pools jsonb[];
    v_affinity_ttl integer[];
    v_affinity_strict boolean[];
    v_bound text[];
    v_bound_only boolean[];
    v_affine boolean;
    v_bind integer[];
    -- FAIR SHARE: each waiting claim's "waiting" and its request's arrival (NULL: it does not
    -- wait), and the tenant each yielding claim yields to
    v_waiting jsonb[];
    v_since timestamptz[];
    v_yield_to text[];
    -- TENANT: for each claim that got nothing, whether its tenant's cap or windows hold it back
    -- (read after the rounds), and when each frees
    v_cap_full boolean[];
    v_cap_frees timestamptz[];
    v_window_full boolean[];
    v_window_frees timestamptz[];
BEGIN
    IF v_count = 0 THEN
        RETURN;
    END IF;
    -- The claims, read once, in one statement: each claim's pool version, read before any
    -- candidate, and whether a candidate of it has rate windows (the slots' `windowed` gate covers
    -- a credential given windows since). From here on a claim is its position in these arrays
    -- (its place in p_claims, as the rows are read in that order); the answer names each by
    -- v_number, so it never depends on that order.
    WITH e AS (
        SELECT x.n::integer AS n, x.c, x.c ->> 'provider' AS provider, x.c ->> 'pool' AS pool
        FROM jsonb_array_elements(p_claims) WITH ORDINALITY AS x (c, n)
    ),
    pv AS (
        SELECT d.provider, d.pool, credpool_pool_version(d.provider, d.pool) AS version
        FROM (SELECT DISTINCT e.provider, e.pool FROM e) AS d
    )
    SELECT array_agg(o.c -> 'ranked'), array_agg(o.provider), array_agg(o.pool),
           array_agg(o.c ->> 'model'), array_agg((o.c ->> 'lease_id')::uuid),
           array_agg(o.c ->> 'holder'), array_agg((o.c ->> 'lease_seconds')::integer),
           array_agg(coalesce((o.c ->> 'tokens')::bigint, 0)), array_agg(o.c ->> 'request_id'),
           array_agg(o.c ->> 'request_digest'), array_agg(o.version), array_agg(o.windowed),
           array_agg(o.n), array_agg(o.tenant),
           array_agg(floor(random() * coalesce(o.cap, 0))::integer),
           -- AFFINITY: the claim's affinity fields
           array_agg(o.c ->> 'affinity_key'), array_agg(o.c -> 'affinity_pools'),
           array_agg(coalesce((o.c ->> 'affinity_ttl_seconds')::integer, 3600)),
           array_agg(coalesce(o.c ->> 'affinity_mode' = 'strict', false)),
           -- FAIR SHARE: the request's arrival, on this clock: as long before it as the request
           -- has waited (the service counts durations, never dates)
           array_agg(o.c -> 'waiting'),
           array_agg(v_now - make_interval(secs => (o.c -> 'waiting' ->> 'waited_ms')::numeric / 1000)),
           array_agg(o.steady)
    INTO v_ranked, v_provider, v_pool, v_model, v_lease, v_holder, v_seconds, v_tokens,
         v_request_id, v_digest, v_pool_version, v_windowed, v_number, v_tenant,
         v_tenant_start, v_affinity_key, v_affinity_pools, v_affinity_ttl, v_affinity_strict,
         v_waiting, v_since, v_steady
    FROM (
        SELECT e.n, e.c, e.provider, e.pool, pv.version, t.tenant_id AS tenant, t.steady,
               t.max_concurrent_leases AS cap,
               -- (a probe per candidate: LIMIT 1 keeps the planner from reading credentials
               -- in search of the few with windows)
               EXISTS (SELECT 1
                       FROM jsonb_array_elements_text(e.c -> 'ranked') AS r (key_id)
                       CROSS JOIN LATERAL (
                           SELECT c.rate_limits FROM credentials c WHERE c.key_id = r.key_id LIMIT 1
                       ) AS c
                       WHERE c.rate_limits <> '[]'::jsonb) AS windowed
        FROM e
        JOIN pv ON pv.provider = e.provider AND pv.pool = e.pool
        -- the tenant: of the live key the claim presented, else (the internal key) `default`
        -- and its advisory lock in shared mode, tried: held, no change of the tenant commits
        -- before this call does, so what the later statements read of it stays true
        LEFT JOIN LATERAL (
            SELECT t.tenant_id, t.max_concurrent_leases,
                   pg_try_advisory_xact_lock_shared(
                       hashtextextended('credpool.tenant:' || t.tenant_id, 0)) AS steady
            FROM credpool_key_tenant(e.c ->> 'key_hash') AS k (tenant)
            JOIN tenants t ON t.tenant_id = k.tenant
        ) AS t ON true
        ORDER BY e.n
    ) AS o;

    -- AFFINITY, read: each claim's live binding, its credential first in the claim's ranked list
    -- (taken out of the rest); a claim whose list had no candidate with windows but whose bound
    -- credential has them picks with the windows' shape. Strict, while the bound credential
    -- could serve but for slots and windows (read from this snapshot, like every candidate's
    -- credential row): that credential alone, in its own pool; nothing in the sequence's others.
    -- Run only when a claim names an affinity_key.
    v_affine := array_remove(v_affinity_key, NULL) <> '{}';
    IF v_affine THEN
        SELECT array_agg(b.key_id ORDER BY k.n),
               array_agg(CASE
                   WHEN b.key_id IS NULL THEN v_ranked[k.n]
                   WHEN x.confined THEN CASE WHEN (x.c).pool = v_pool[k.n]
                                             THEN jsonb_build_array(b.key_id) ELSE '[]' END
                   ELSE jsonb_build_array(b.key_id) || (v_ranked[k.n] - b.key_id) END ORDER BY k.n),
               array_agg(v_windowed[k.n] OR coalesce((x.c).rate_limits <> '[]'::jsonb, false)
                         ORDER BY k.n),
               array_agg(coalesce(x.confined, false) ORDER BY k.n)
        INTO v_bound, v_ranked, v_windowed, v_bound_only
        FROM generate_subscripts(v_affinity_key, 1) AS k (n)
        LEFT JOIN LATERAL (
            SELECT b.key_id
            FROM affinity_bindings b
            WHERE b.tenant = v_tenant[k.n] AND b.provider = v_provider[k.n]
              AND b.pool = v_affinity_pools[k.n] ->> 0 AND b.affinity_key = v_affinity_key[k.n]
              AND b.expires_at > v_now
            LIMIT 1
        ) AS b ON v_affinity_key[k.n] IS NOT NULL
        LEFT JOIN LATERAL (
            SELECT c,
                   v_affinity_strict[k.n] AND v_affinity_pools[k.n] ? c.pool
                   AND credpool_may_serve(c, v_provider[k.n], c.pool, v_model[k.n], v_now) AS confined
            FROM credentials c
            WHERE c.key_id = b.key_id
            LIMIT 1
        ) AS x ON true;
    END IF;

    -- Request ids: a claim whose request_id another transaction is claiming for right now is
    -- 'in_flight'; one whose request_id has a live lease replays it (or is a 'conflict'); of the
    -- claims of this call that name one request_id, the first claims and the others are
    -- 'in_flight' (claimed again, they replay its lease).
    v_done := array_fill(false, ARRAY[v_count]);
    v_request := array_fill(NULL::text, ARRAY[v_count]);
    -- a claim without a tenant presented no live key: refused, nothing looked at; one whose
    -- tenant an operator is changing right now (its advisory lock held): 'busy', claim again
    FOR q IN SELECT k AS n FROM generate_subscripts(v_tenant, 1) AS k
             WHERE v_tenant[k] IS NULL OR NOT v_steady[k] LOOP
        v_request[q.n] := CASE WHEN v_tenant[q.n] IS NULL THEN 'unauthorized' ELSE 'busy' END;
        v_done[q.n] := true;
        v_request_id[q.n] := NULL;
    END LOOP;
    IF array_remove(v_request_id, NULL) <> '{}' THEN
        SELECT coalesce(array_agg(ids.request_id), '{}') INTO v_requests
        FROM (SELECT DISTINCT r AS request_id FROM unnest(v_request_id) AS r WHERE r IS NOT NULL) AS ids
        WHERE pg_try_advisory_xact_lock(hashtextextended('credpool.request_id:' || ids.request_id, 0));
        FOR q IN SELECT k AS n FROM generate_subscripts(v_request_id, 1) AS k
                 WHERE v_request_id[k] IS NOT NULL ORDER BY k LOOP
            IF NOT v_request_id[q.n] = ANY (v_requests)
               OR v_request_id[q.n] = ANY (v_request_id[:q.n - 1]) THEN
                v_request[q.n] := 'in_flight';
                v_done[q.n] := true;
                CONTINUE;
            END IF;
            -- (a request id names a lease of one tenant: another tenant's request conflicts)
            SELECT s, r.request_digest = v_digest[q.n] AND s.tenant IS NOT DISTINCT FROM v_tenant[q.n]
                          AS same_request, c.secret_ciphertext,
                   coalesce(c.model_aliases ->> v_model[q.n], v_model[q.n]) AS provider_model
            INTO prior
            FROM lease_requests r
            JOIN lease_slots s ON s.key_id = r.key_id AND s.lease_id = r.lease_id
            JOIN credentials c ON c.key_id = s.key_id
            WHERE r.request_id = v_request_id[q.n] AND s.lease_until > v_now;
            IF FOUND THEN
                v_done[q.n] := true;
                IF prior.same_request THEN
                    v_request[q.n] := 'replayed';
                    g_claim := g_claim || q.n;
                    g_slot := g_slot || prior.s;
                    g_secret := g_secret || prior.secret_ciphertext;
                    g_model := g_model || prior.provider_model;
                    g_pruned := g_pruned || false;
                ELSE
                    v_request[q.n] := 'conflict';
                END IF;
            END IF;
        END LOOP;
    END IF;

    -- FAIR SHARE: a waiting claim yields to a tenant further below its share waiting for its pool
    -- (the claims of this call for the same pool that go ahead before it count as in flight)
    IF array_remove(v_since, NULL) <> '{}' THEN
        FOR q IN SELECT k AS n FROM generate_subscripts(v_since, 1) AS k
                 WHERE v_since[k] IS NOT NULL AND NOT v_done[k] ORDER BY k LOOP
            v_yield_to[q.n] := credpool_fair_share_ahead(v_provider[q.n], v_pool[q.n], v_model[q.n],
                v_tenant[q.n], v_since[q.n],
                ARRAY(SELECT v_tenant[j] FROM generate_subscripts(v_since, 1) AS j
                      WHERE j < q.n AND v_since[j] IS NOT NULL AND NOT v_done[j]
                        AND v_provider[j] = v_provider[q.n] AND v_pool[j] = v_pool[q.n]),
                v_now);
            IF v_yield_to[q.n] IS NOT NULL THEN
                v_request[q.n] := 'yield';
                v_done[q.n] := true;
            END IF;
        END LOOP;
    END IF;

    v_open := ARRAY(SELECT k FROM generate_subscripts(v_done, 1) AS k WHERE NOT v_done[k] ORDER BY k);
    WHILE cardinality(v_open) > 0 LOOP
        -- PICK: each open claim's first candidate with room, locked; the first claim (in array
        -- order) that picked a credential wins it, the others are open again
        SELECT coalesce(array_agg(p.n) FILTER (WHERE p.first), '{}'),
               array_agg(p.s) FILTER (WHERE p.first),
               array_agg(p.status) FILTER (WHERE p.first),
               array_agg(p.cooldown_until) FILTER (WHERE p.first),
               array_agg(p.at) FILTER (WHERE p.first),
               array_agg(p.windowed) FILTER (WHERE p.first),
               array_agg(p.secret_ciphertext) FILTER (WHERE p.first),
               array_agg(p.provider_model) FILTER (WHERE p.first),
               array_agg(p.token_expires_at) FILTER (WHERE p.first),
               coalesce(array_agg(p.n) FILTER (WHERE NOT p.first), '{}'),
               coalesce(bool_or((p.s).lease_id IS NOT NULL) FILTER (WHERE p.first), false),
               coalesce(bool_or(v_request_id[p.n] IS NOT NULL) FILTER (WHERE p.first), false),
               coalesce(bool_or(p.status <> 'available') FILTER (WHERE p.first), false),
               array_agg(p.tenant_slot) FILTER (WHERE p.first),
               array_agg(p.tenant_windowed) FILTER (WHERE p.first)
        INTO w_claim, w_slot, w_status, w_cooldown, w_at, w_charge, w_secret, w_model, w_token,
             v_open, v_pruned, v_requested, v_probed, w_tenant_slot, w_tenant_charge
        FROM (
            SELECT o.*,
                   row_number() OVER (PARTITION BY (o.s).key_id ORDER BY o.n) = 1
                   AND row_number() OVER (PARTITION BY v_tenant[o.n], coalesce(o.tenant_slot, -o.n)
                                          ORDER BY o.n) = 1
                   -- (one grant per round charges a tenant's windows, as a credential's)
                   AND row_number() OVER (PARTITION BY v_tenant[o.n],
                                                       CASE WHEN NOT o.tenant_windowed THEN o.n END
                                          ORDER BY o.n) = 1 AS first
            FROM (
                -- what each claim's tenant needs, as it is now (this statement's snapshot, taken
                -- after the call holds the tenant's advisory lock in shared mode, so a change of
                -- the tenant either committed before it or waits for this call): with a cap, a
                -- free row of its tenant_slots, from this claim's starting row on, else (only
                -- then) the first before it ("Tenants" above); with windows, its tenant_windows
                -- row, locked, when every window has room ("Tenant windows" above)
                WITH tenancy AS (
                    SELECT q.n, tn.capped, ts.slot AS tenant_slot,
                           coalesce(twx.windowed, false) AS tenant_windowed,
                           twl.tenant_id IS NOT NULL AS tenant_window_held
                    FROM unnest(v_open) AS q (n)
                    CROSS JOIN LATERAL (
                        SELECT t.max_concurrent_leases IS NOT NULL AS capped
                        FROM tenants t WHERE t.tenant_id = v_tenant[q.n] LIMIT 1
                    ) AS tn
                    LEFT JOIN LATERAL (
                        SELECT t.slot
                        FROM tenant_slots t
                        WHERE tn.capped AND (SELECT credpool_test_hook('claim.before_tenant_lock'))
                          AND t.tenant_id = v_tenant[q.n] AND t.slot >= v_tenant_start[q.n]
                          AND credpool_tenant_slot_open(t, v_now)
                        ORDER BY t.slot
                        LIMIT 1
                        FOR UPDATE SKIP LOCKED
                    ) AS ts_after ON true
                    LEFT JOIN LATERAL (
                        SELECT t.slot
                        FROM tenant_slots t
                        WHERE tn.capped AND ts_after.slot IS NULL
                          AND t.tenant_id = v_tenant[q.n] AND t.slot < v_tenant_start[q.n]
                          AND credpool_tenant_slot_open(t, v_now)
                        ORDER BY t.slot
                        LIMIT 1
                        FOR UPDATE SKIP LOCKED
                    ) AS ts_before ON true
                    CROSS JOIN LATERAL (SELECT coalesce(ts_after.slot, ts_before.slot) AS slot) AS ts
                    LEFT JOIN LATERAL (
                        SELECT true AS windowed FROM tenant_windows tw
                        WHERE tw.tenant_id = v_tenant[q.n] LIMIT 1
                    ) AS twx ON true
                    LEFT JOIN LATERAL (
                        SELECT tw.tenant_id
                        FROM tenant_windows tw
                        WHERE twx.windowed AND tw.tenant_id = v_tenant[q.n]
                          AND (SELECT credpool_test_hook('claim.before_tenant_window_lock'))
                          AND credpool_window_room(credpool_tenant_window(tw), v_now, v_tokens[q.n])
                        LIMIT 1
                        FOR UPDATE SKIP LOCKED
                    ) AS twl ON true
                )
                SELECT q.n, x.*, false AS windowed, q.tenant_slot, q.tenant_windowed
                FROM tenancy q
                CROSS JOIN LATERAL (
                    SELECT s, c.status, c.cooldown_until, c.secret_ciphertext,
                           coalesce(c.model_aliases ->> v_model[q.n], v_model[q.n]) AS provider_model,
                           clock_timestamp() AS at, c.token_expires_at
                    FROM jsonb_array_elements_text(v_ranked[q.n]) WITH ORDINALITY AS r (key_id, rank)
                    CROSS JOIN LATERAL (
                        SELECT * FROM credentials c WHERE c.key_id = r.key_id LIMIT 1
                    ) c
                    JOIN lease_slots s ON s.key_id = c.key_id
                    WHERE (NOT q.capped OR q.tenant_slot IS NOT NULL)
                      AND (NOT q.tenant_windowed OR q.tenant_window_held)
                      AND (SELECT credpool_test_hook('claim.before_lock'))
                      AND credpool_may_serve(c, v_provider[q.n], v_pool[q.n], v_model[q.n], v_now)
                      AND credpool_slot_open(s, c.status, v_now)
                      AND s.config_version = c.config_version
                      AND credpool_token_lasts(c, v_now + make_interval(secs => v_seconds[q.n]))
                      AND NOT s.windowed
                    ORDER BY r.rank, s.slot
                    LIMIT 1
                    FOR UPDATE OF s SKIP LOCKED
                ) AS x
                WHERE NOT v_windowed[q.n]
                UNION ALL
                SELECT q.n, x.*, true AS windowed, q.tenant_slot, q.tenant_windowed
                FROM tenancy q
                CROSS JOIN LATERAL (
                    SELECT s, c.status, c.cooldown_until, c.secret_ciphertext,
                           coalesce(c.model_aliases ->> v_model[q.n], v_model[q.n]) AS provider_model,
                           clock_timestamp() AS at, c.token_expires_at
                    FROM jsonb_array_elements_text(v_ranked[q.n]) WITH ORDINALITY AS r (key_id, rank)
                    CROSS JOIN LATERAL (
                        SELECT * FROM credentials c WHERE c.key_id = r.key_id LIMIT 1
                    ) c
                    JOIN lease_windows w ON w.key_id = c.key_id
                    JOIN lease_slots s ON s.key_id = c.key_id
                    WHERE (NOT q.capped OR q.tenant_slot IS NOT NULL)
                      AND (NOT q.tenant_windowed OR q.tenant_window_held)
                      AND (SELECT credpool_test_hook('claim.before_lock'))
                      AND credpool_may_serve(c, v_provider[q.n], v_pool[q.n], v_model[q.n], v_now)
                      AND credpool_slot_open(s, c.status, v_now)
                      AND s.config_version = c.config_version
                      AND credpool_token_lasts(c, v_now + make_interval(secs => v_seconds[q.n]))
                      AND credpool_window_room(w, v_now, v_tokens[q.n])
                    ORDER BY r.rank, s.slot
                    LIMIT 1
                    FOR UPDATE OF w, s SKIP LOCKED
                ) AS x
                WHERE v_windowed[q.n]
            ) AS o
            ORDER BY o.n
        ) AS p;
        EXIT WHEN cardinality(w_claim) = 0;

        -- GRANT: the expired leases the winners' slots still carry end in the trail (at their
        -- own lease_until); then every winner's lease begins (slot row and `granted` trail row),
        -- in one statement
        IF v_pruned THEN
            PERFORM credpool_record_lease_ends(
                ARRAY(SELECT s FROM unnest(w_slot) AS s WHERE s.lease_id IS NOT NULL),
                ARRAY(SELECT 'expired' FROM unnest(w_slot) AS s WHERE s.lease_id IS NOT NULL),
                ARRAY(SELECT s.lease_until FROM unnest(w_slot) AS s WHERE s.lease_id IS NOT NULL));
        END IF;
        WITH won AS (
            SELECT w_claim[i] AS n, (w_slot[i]).key_id, (w_slot[i]).slot,
                   (w_slot[i]).lease_id IS NOT NULL AS pruned, w_status[i] AS status,
                   w_at[i] AS at, w_secret[i] AS secret, w_model[i] AS model,
                   w_token[i] AS token_expires_at, v_lease[w_claim[i]] AS lease_id,
                   v_provider[w_claim[i]] AS provider, v_pool[w_claim[i]] AS pool,
                   v_holder[w_claim[i]] AS holder, v_seconds[w_claim[i]] AS seconds,
                   v_tokens[w_claim[i]] AS tokens, v_tenant[w_claim[i]] AS tenant,
                   w_tenant_slot[i] AS tenant_slot
            FROM generate_subscripts(w_claim, 1) AS i
        ),
        granted AS (
            UPDATE lease_slots s
            SET lease_id = won.lease_id, provider = won.provider, pool = won.pool,
                holder = won.holder, granted_at = won.at,
                lease_until = least(won.at + make_interval(secs => won.seconds), won.token_expires_at),
                last_granted_at = won.at, probe = won.status <> 'available',
                fence = nextval('lease_fence_seq'), reserved_tokens = won.tokens,
                tenant = won.tenant, tenant_slot = won.tenant_slot
            FROM won
            WHERE s.key_id = won.key_id AND s.slot = won.slot
            RETURNING won.n, s, won.secret, won.model, won.pruned, won.tenant_slot
        ),
        -- a capped tenant's lease takes the tenant slot row PICK locked, with the same end
        tenant_held AS (
            UPDATE tenant_slots t
            SET lease_id = (g.s).lease_id, key_id = (g.s).key_id, lease_until = (g.s).lease_until
            FROM granted g
            WHERE t.tenant_id = (g.s).tenant AND t.slot = g.tenant_slot
        ),
        trail AS (
            INSERT INTO lease_events
                (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, fence, tokens,
                 tenant, affinity)
            SELECT 'granted', (g.s).lease_id, (g.s).key_id, (g.s).provider, (g.s).pool, (g.s).slot,
                   (g.s).holder, (g.s).lease_until, (g.s).granted_at, (g.s).fence,
                   (g.s).reserved_tokens, (g.s).tenant,
                   -- AFFINITY: the grant's result, for the dashboard's hit ratio
                   credpool_affinity_result(v_affinity_key[g.n], v_bound[g.n], (g.s).key_id)
            FROM granted g
        )
        SELECT g_claim || array_agg(g.n), g_slot || array_agg(g.s), g_secret || array_agg(g.secret),
               g_model || array_agg(g.model), g_pruned || array_agg(g.pruned)
        INTO g_claim, g_slot, g_secret, g_model, g_pruned
        FROM granted g;
        -- what only some winners need, each in a statement of its own run only then (a part of
        -- the statement above costs its start-up whether or not a row needs it): the windows
        -- charged (the credentials', the tenants'), the request ids' rows, the probes' trail rows
        IF true = ANY (w_charge) THEN
            UPDATE lease_windows lw
            SET (bucket_ids, bucket_charged) =
                (SELECT x.bucket_ids, x.bucket_charged
                 FROM credpool_window_charge(lw, w_at[i], v_tokens[w_claim[i]]) AS x)
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE w_charge[i] AND lw.key_id = (w_slot[i]).key_id
              AND cardinality(lw.window_kinds) > 0;
        END IF;
        IF true = ANY (w_tenant_charge) THEN
            UPDATE tenant_windows tw
            SET (bucket_ids, bucket_charged) =
                (SELECT x.bucket_ids, x.bucket_charged
                 FROM credpool_window_charge(credpool_tenant_window(tw), w_at[i],
                                             v_tokens[w_claim[i]]) AS x)
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE w_tenant_charge[i] AND tw.tenant_id = v_tenant[w_claim[i]];
        END IF;
        IF v_requested THEN
            INSERT INTO lease_requests AS r (request_id, request_digest, lease_id, key_id, granted_at)
            SELECT v_request_id[w_claim[i]], v_digest[w_claim[i]], v_lease[w_claim[i]],
                   (w_slot[i]).key_id, w_at[i]
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE v_request_id[w_claim[i]] IS NOT NULL
            ON CONFLICT ON CONSTRAINT lease_requests_pkey DO UPDATE
            SET request_digest = EXCLUDED.request_digest, lease_id = EXCLUDED.lease_id,
                key_id = EXCLUDED.key_id, granted_at = EXCLUDED.granted_at;
        END IF;
        IF v_probed THEN
            INSERT INTO credential_events
                (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at)
            SELECT (w_slot[i]).key_id, 'probe_granted', w_status[i], w_status[i],
                   'cooldown ended; single probe lease granted', w_cooldown[i],
                   v_lease[w_claim[i]], w_at[i]
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE w_status[i] <> 'available';
        END IF;
    END LOOP;

    -- AFFINITY, write: the bindings of this call's grants (not replays), in one statement, the
    -- last grant of each affinity key in claim order. First the affinity keys' advisory locks,
    -- tried, in a statement of their own, so that the write's snapshot, taken after them, sees
    -- every binding the lock's last holder wrote: a row the write does not see then can only be
    -- inserted by a holder of the lock, so its INSERT never meets another transaction's row in
    -- progress. Then each existing row is locked with SKIP LOCKED (a row another transaction
    -- holds: an operator's delete cascading, the maintenance pass, a claim's write is left as
    -- it is), and the write touches only rows it locked or that do not exist.
    IF v_affine AND cardinality(g_claim) > 0 THEN
        SELECT coalesce(array_agg(d.i ORDER BY d.i), '{}')
        INTO v_bind
        FROM (
            SELECT DISTINCT ON (v_tenant[g_claim[i]], v_provider[g_claim[i]],
                                v_affinity_pools[g_claim[i]] ->> 0, v_affinity_key[g_claim[i]]) i
            FROM generate_subscripts(g_claim, 1) AS i
            WHERE v_affinity_key[g_claim[i]] IS NOT NULL AND v_request[g_claim[i]] IS NULL
            ORDER BY v_tenant[g_claim[i]], v_provider[g_claim[i]], v_affinity_pools[g_claim[i]] ->> 0,
                     v_affinity_key[g_claim[i]], g_claim[i] DESC
        ) AS d
        WHERE pg_try_advisory_xact_lock(credpool_affinity_lock(v_tenant[g_claim[d.i]], v_provider[g_claim[d.i]],
                  v_affinity_pools[g_claim[d.i]] ->> 0, v_affinity_key[g_claim[d.i]]));
        IF v_bind <> '{}' THEN
            WITH wanted AS (
                SELECT v_tenant[n] AS tenant, v_provider[n] AS provider,
                       v_affinity_pools[n] ->> 0 AS pool, v_affinity_key[n] AS affinity_key,
                       (g_slot[i]).key_id, (g_slot[i]).granted_at AS at, v_affinity_ttl[n] AS ttl
                FROM unnest(v_bind) AS i
                CROSS JOIN LATERAL (SELECT g_claim[i] AS n) AS x
            ),
            found AS (
                SELECT w.*, e.found, l.locked
                FROM wanted w
                LEFT JOIN LATERAL (
                    SELECT true AS found FROM affinity_bindings b
                    WHERE b.tenant = w.tenant AND b.provider = w.provider AND b.pool = w.pool
                      AND b.affinity_key = w.affinity_key
                    LIMIT 1
                ) AS e ON true
                LEFT JOIN LATERAL (
                    SELECT true AS locked FROM affinity_bindings b
                    WHERE b.tenant = w.tenant AND b.provider = w.provider AND b.pool = w.pool
                      AND b.affinity_key = w.affinity_key
                    FOR UPDATE SKIP LOCKED
                ) AS l ON e.found
            )
            INSERT INTO affinity_bindings AS b
                (tenant, provider, pool, affinity_key, key_id, bound_at, last_hit_at, expires_at)
            SELECT f.tenant, f.provider, f.pool, f.affinity_key, f.key_id, f.at, f.at,
                   f.at + make_interval(secs => f.ttl)
            FROM found f
            WHERE f.found IS NULL OR f.locked
            ON CONFLICT ON CONSTRAINT affinity_bindings_pkey DO UPDATE
            SET key_id = EXCLUDED.key_id,
                -- a hit keeps when the conversation was bound; a move or an expired binding
                -- starts anew
                bound_at = CASE WHEN b.key_id = EXCLUDED.key_id AND b.expires_at > EXCLUDED.bound_at
                                THEN b.bound_at ELSE EXCLUDED.bound_at END,
                last_hit_at = EXCLUDED.last_hit_at, expires_at = EXCLUDED.expires_at;
        END IF;
    END IF;

    -- TENANT: a claim that got nothing, of a capped tenant or one with windows: does its tenant
    -- hold it back, read now? At its cap when no row of the tenant is open (each within the cap
    -- holds a live lease; frees when the first of those ends); out of window room when a window
    -- of it cannot take the claim's reservation now (frees when it can; never: NULL).
    SELECT array_agg(coalesce(tl.full, false) ORDER BY k.n), array_agg(tl.frees_at ORDER BY k.n),
           array_agg(coalesce(tw.full, false) ORDER BY k.n), array_agg(tw.frees_at ORDER BY k.n)
    INTO v_cap_full, v_cap_frees, v_window_full, v_window_frees
    FROM generate_subscripts(v_done, 1) AS k (n)
    -- (a tenant has slot rows while it has a cap, and a tenant_windows row while it has windows)
    LEFT JOIN LATERAL (
        SELECT NOT coalesce(bool_or(credpool_tenant_slot_open(t, v_now)), false) AS full,
               min(t.lease_until) FILTER (WHERE t.lease_until > v_now AND NOT t.surplus) AS frees_at
        FROM tenant_slots t
        WHERE NOT k.n = ANY (g_claim) AND NOT v_done[k.n] AND t.tenant_id = v_tenant[k.n]
        HAVING count(*) > 0
    ) AS tl ON true
    LEFT JOIN LATERAL (
        SELECT NOT credpool_window_room(credpool_tenant_window(tw), v_now, v_tokens[k.n]) AS full,
               nullif(credpool_window_frees_at(credpool_tenant_window(tw), v_now, v_tokens[k.n]),
                      'infinity') AS frees_at
        FROM tenant_windows tw
        WHERE NOT k.n = ANY (g_claim) AND NOT v_done[k.n] AND tw.tenant_id = v_tenant[k.n]
    ) AS tw ON true;

    -- FAIR SHARE: a waiting claim that got nothing for want of a slot is (still) waiting: its
    -- request's row written (kept as it is when there, with its first claim's arrival and end of
    -- wait, dated on this clock); one that got a lease (or replayed one), or that its own tenant
    -- holds back (its cap, its windows: not the pool), waits for no slot: no row (a tenant that
    -- cannot take a slot is never yielded to)
    IF array_remove(v_since, NULL) <> '{}' THEN
        DELETE FROM pool_waiters w
        WHERE w.waiter IN (SELECT (v_waiting[k] ->> 'waiter')::uuid
                           FROM generate_subscripts(v_since, 1) AS k
                           WHERE v_since[k] IS NOT NULL
                             AND (k = ANY (g_claim) OR v_cap_full[k] OR v_window_full[k]));
        INSERT INTO pool_waiters (waiter, instance, tenant, provider, pools, model, since, until,
                                  tokens)
        SELECT (v_waiting[k] ->> 'waiter')::uuid, v_waiting[k] ->> 'instance', v_tenant[k],
               v_provider[k], ARRAY(SELECT jsonb_array_elements_text(v_waiting[k] -> 'pools')),
               v_model[k], v_since[k],
               v_now + make_interval(secs => (v_waiting[k] ->> 'wait_ms')::numeric / 1000),
               v_tokens[k]
        FROM generate_subscripts(v_since, 1) AS k
        WHERE v_since[k] IS NOT NULL AND v_tenant[k] IS NOT NULL AND NOT k = ANY (g_claim)
          AND NOT (v_cap_full[k] OR v_window_full[k])
          AND v_request[k] IS DISTINCT FROM 'conflict' AND v_request[k] IS DISTINCT FROM 'in_flight'
          -- (a strict affinity waits for one credential: other tenants' claims must not yield
          -- every other slot of the pool to it)
          AND NOT v_affinity_strict[k]
        ON CONFLICT (waiter) DO NOTHING;
    END IF;

    -- The answers, in claim order. Nothing granted: when may a candidate serve it (read now)? A
    -- candidate whose slot or window row another transaction held (a concurrent claim, the
    -- reaper, an operator's change) was passed over without knowing what that transaction
    -- leaves: if, read now, one may serve at once, say so ('busy': the caller claims again).
    -- A claim its tenant holds back (TENANT, above) is 'tenant_limit', whatever the credentials
    -- say.
    RETURN QUERY
    SELECT v_number[k.n], v_pool_version[k.n], (g_slot[g.i]).key_id, (g_slot[g.i]).lease_id,
           (g_slot[g.i]).pool, (g_slot[g.i]).granted_at, (g_slot[g.i]).lease_until,
           (g_slot[g.i]).probe, g_model[g.i], g_secret[g.i], g_pruned[g.i], (g_slot[g.i]).fence,
           CASE WHEN v_request[k.n] IS NOT NULL THEN v_request[k.n]
                WHEN v_cap_full[k.n] OR v_window_full[k.n] THEN 'tenant_limit'
                WHEN g.i IS NULL AND f.at <= v_now THEN 'busy' END,
           -- (a tenant both at its cap and out of window room: the later of the two; NULL when
           -- its window can never hold the reservation)
           CASE WHEN v_window_full[k.n] AND v_window_frees[k.n] IS NULL THEN NULL
                WHEN v_cap_full[k.n] OR v_window_full[k.n]
                    THEN greatest(CASE WHEN v_cap_full[k.n] THEN v_cap_frees[k.n] END,
                                  CASE WHEN v_window_full[k.n] THEN v_window_frees[k.n] END)
                ELSE f.at END,
           CASE WHEN v_window_full[k.n]
                     AND (v_window_frees[k.n] IS NULL OR NOT v_cap_full[k.n]
                          OR v_window_frees[k.n] > v_cap_frees[k.n]) THEN 'tenant_window'
                WHEN v_cap_full[k.n] THEN 'tenant' ELSE f.held_by END,
           coalesce((g_slot[g.i]).tenant, v_tenant[k.n]), v_now,
           -- AFFINITY: the grant's result (a replay says none); a strict claim confined to its
           -- bound credential that granted nothing: 'bound'
           CASE WHEN g.i IS NOT NULL AND v_request[k.n] IS NULL
                THEN credpool_affinity_result(v_affinity_key[k.n], v_bound[k.n], (g_slot[g.i]).key_id)
                WHEN g.i IS NULL AND v_bound_only[k.n] THEN 'bound' END,
           v_yield_to[k.n]
    FROM generate_subscripts(v_done, 1) AS k (n)
    CROSS JOIN LATERAL (SELECT array_position(g_claim, k.n) AS i) AS g
    LEFT JOIN LATERAL (
        SELECT greatest(f.at, t.at) AS at,
               CASE WHEN t.at > f.at THEN 'token_refresh' ELSE f.held_by END AS held_by
        FROM jsonb_array_elements_text(v_ranked[k.n]) AS r (key_id)
        JOIN credentials c ON c.key_id = r.key_id
        LEFT JOIN lease_windows w ON w.key_id = c.key_id
        CROSS JOIN LATERAL credpool_frees_at(c, w, v_tokens[k.n], v_now) AS f
        CROSS JOIN LATERAL credpool_token_refreshed_at(
            c, v_now + make_interval(secs => v_seconds[k.n]), v_now) AS t (at)
        WHERE g.i IS NULL AND NOT v_done[k.n]
          AND c.provider = v_provider[k.n] AND c.pool = v_pool[k.n]
          AND (v_model[k.n] = ANY (c.models) OR c.model_aliases ? v_model[k.n])
          AND NOT c.draining AND f.at IS NOT NULL AND t.at IS NOT NULL
        ORDER BY greatest(f.at, t.at)
        LIMIT 1
    ) AS f ON true
    ORDER BY k.n;
END;
$$;
