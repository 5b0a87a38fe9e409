-- The oversell proof, same rule and output as in 20261129000004_audit_maintenance.sql, with each
-- grant's limit looked up through credential_events_configuration_idx instead of a range join
-- against every limit period: the planner cannot estimate the lifetimes a set-returning function
-- yields, and for a busy range it chose a nested loop over (grants x limit periods) that took
-- 10.7 s for 25,000 grants on 1,000 credentials. With the lookup the cost is one index probe per
-- grant.
CREATE OR REPLACE FUNCTION credpool_oversell_check(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (
    key_id text, max_concurrent_uses integer, leases bigint, peak bigint, grants_over_limit bigint,
    first_violation_at timestamptz)
LANGUAGE sql STABLE AS $$
    WITH lives AS (
        SELECT * FROM credpool_lease_lifetimes(p_since, p_until)
    ),
    edges AS (
        SELECT l.key_id, l.granted_at AS at, 1 AS delta FROM lives l
        UNION ALL
        SELECT l.key_id, coalesce(l.ended_at, 'infinity'::timestamptz), -1 FROM lives l
    ),
    running AS (
        SELECT e.key_id, e.at, e.delta,
               sum(e.delta) OVER (PARTITION BY e.key_id ORDER BY e.at, e.delta
                                  ROWS UNBOUNDED PRECEDING) AS held
        FROM edges e
    ),
    grants AS (
        SELECT r.key_id, r.at, r.held,
               coalesce(
                   (SELECT (ce.details -> 'new' ->> 'max_concurrent_uses')::integer
                    FROM credential_events ce
                    WHERE ce.key_id = r.key_id
                      AND ce.event IN ('created', 'updated')
                      AND ce.at <= r.at
                    ORDER BY ce.at DESC
                    LIMIT 1),
                   (SELECT c.max_concurrent_uses FROM credentials c WHERE c.key_id = r.key_id)
               ) AS limit_then
        FROM running r
        WHERE r.delta = 1 AND r.at >= p_since AND r.at < p_until
    )
    SELECT g.key_id,
           (SELECT c.max_concurrent_uses FROM credentials c WHERE c.key_id = g.key_id),
           count(*),
           max(g.held),
           count(*) FILTER (WHERE g.held > g.limit_then),
           min(g.at) FILTER (WHERE g.held > g.limit_then)
    FROM grants g
    GROUP BY g.key_id
    ORDER BY g.key_id
$$;

-- Group claiming (src/groups.rs) runs many claim statements in one transaction, in whatever order
-- requests arrive. That is deadlock-free only if a claim never waits for a row lock: it takes its
-- slot row with SKIP LOCKED, so the one row lock it may not wait for is the credential row it
-- used to update for `last_used_at`. The time of a credential's latest grant now lives on the
-- slot that granted it (`last_granted_at`, kept when the lease ends), and a credential's
-- last_used_at is the latest of its slots'. A claim updates its slot row and nothing else.
ALTER TABLE lease_slots ADD COLUMN last_granted_at timestamptz;

UPDATE lease_slots s
SET last_granted_at = c.last_used_at
FROM credentials c
WHERE c.key_id = s.key_id AND s.slot = 0 AND c.last_used_at IS NOT NULL;

ALTER TABLE credentials DROP COLUMN last_used_at;

-- credpool_claim: the claim (DESIGN.md "The protocol", step 1), for one request or for a group.
--
-- p_claims jsonb: an array of claims, each {"ranked": [key_id, ...] (best first, the Rust
-- scoring), "provider", "pool", "model" (a model or alias), "lease_id" (the new lease's uuid),
-- "holder" (or null), "lease_seconds"}. Returns one row per claim, `claim` = its 1-based position.
--
-- Each claim is ONE statement (the RETURN QUERY below), run in array order; a group of claims
-- (src/groups.rs) is one call, so one round trip and, outside an explicit transaction, one
-- commit. A later claim sees the earlier claims' writes; a volatile function takes a new snapshot
-- per statement, so each claim also sees what other transactions committed before it ran.
--
-- The statement takes the first candidate, in array order, that belongs to the provider and pool, serves the
-- model (directly or through an alias), is usable (credential_usable, database clock) and is not
-- over its limit or drained, and locks ONE of its free slot rows: a slot whose lease_id is NULL or whose
-- lease has expired. A credential back from a cooldown (usable, status not yet `available`) is
-- half-open: only its slot 0 can be claimed, so it serves a single probe lease at a time, and the
-- grant is written to credential_events as `probe_granted`.
--
-- Why this cannot oversell: capacity is not counted, it is the set of slot rows (exactly
-- max_concurrent_uses rows per credential while slots_over_limit is false), and a lease exists
-- only inside the slot row that holds it. The row this statement locks is the row whose own state
-- decides whether it is free. Under READ COMMITTED, when `FOR UPDATE` meets a row that another
-- transaction changed after this statement's snapshot, PostgreSQL waits for it, then re-evaluates
-- the WHERE clause against the newest version of that row (EvalPlanQual): a slot that a concurrent
-- claim has just filled no longer passes `lease_id IS NULL OR lease_until <= now()` and is passed
-- over. SKIP LOCKED passes over slots that another claim is taking right now, so concurrent
-- claims spread over the free slots instead of queueing behind one. Two transactions can never both
-- hold the same slot row's lock, so each slot carries at most one unexpired lease, and a
-- credential at most max_concurrent_uses. (The trap in DESIGN.md — lock the credential row, count
-- its leases in a subquery — fails because the count reads the statement's snapshot, which
-- EvalPlanQual does not refresh for rows other than the locked one.)
--
-- "Now" is statement_timestamp(): the start of the call, shared by a group's claims. A lease that
-- expires while the call runs is treated as still held: it waits for the next claim.
--
-- Expired leases are reused here, in the same statement: the slot's old lease is ended in the trail
-- (`expired`, at its own lease_until) before the new lease replaces it. No cleanup job is needed
-- for an expired lease to stop counting.
--
-- granted_at is clock_timestamp(), read after the slot lock is taken: the slot was freed by a
-- transaction that committed before this one could see it free, so granted_at is later than that
-- release's time and the trail never shows two leases of one slot overlapping.
--
-- Locks: the one slot row, taken with SKIP LOCKED, and nothing else: the statement never waits for
-- a row lock, so any number of claims can share a transaction without ever being part of a
-- deadlock. The credential row is only read; the time of the grant
-- is kept on the slot (last_granted_at).
--
-- Always returns one row per claim: the pool's version (pool_versions; NULL when the pool never had a
-- credential), so the caller learns whether its candidate view is stale, and the lease columns,
-- NULL when no candidate had a free slot.
CREATE FUNCTION credpool_claim(p_claims jsonb)
RETURNS TABLE (claim integer, pool_version bigint, key_id text, lease_id uuid,
               granted_at timestamptz, lease_until timestamptz, probe boolean,
               provider_model text, sealed_secret bytea, pruned_expired boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q record;
BEGIN
    FOR q IN
        SELECT e.n::integer AS claim,
               ARRAY(SELECT jsonb_array_elements_text(e.c -> 'ranked')) AS ranked,
               e.c ->> 'provider' AS provider, e.c ->> 'pool' AS pool, e.c ->> 'model' AS model,
               (e.c ->> 'lease_id')::uuid AS lease_id, e.c ->> 'holder' AS holder,
               (e.c ->> 'lease_seconds')::integer AS lease_seconds
        FROM jsonb_array_elements(p_claims) WITH ORDINALITY AS e (c, n)
        ORDER BY e.n
    LOOP
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
                probe = claimed.probe
            FROM claimed
            WHERE s.key_id = claimed.key_id AND s.slot = claimed.slot
            RETURNING s.key_id, s.slot, s.lease_id, s.granted_at, s.lease_until, s.probe
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
            INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
            SELECT 'granted', lease_id, key_id, q.provider, q.pool, slot, q.holder, lease_until, granted_at
            FROM granted
        )
        SELECT q.claim,
               (SELECT v.version FROM pool_versions v WHERE v.provider = q.provider AND v.pool = q.pool),
               granted.key_id, granted.lease_id, granted.granted_at, granted.lease_until, granted.probe,
               claimed.provider_model, claimed.secret_ciphertext, claimed.old_lease_id IS NOT NULL
        FROM (SELECT 1) AS always_one_row
        LEFT JOIN granted ON true
        LEFT JOIN claimed ON claimed.key_id = granted.key_id;
    END LOOP;
END;
$$;
