-- Claim one concurrency slot for a new lease, in ONE statement (DESIGN.md "The protocol", step 1).
--
-- $1 text[]  ranked candidate key_ids, best first (the Rust scoring)
-- $2 text    provider            $3 text  pool            $4 text  requested model (or alias)
-- $5 uuid    the new lease_id    $6 text  holder or NULL  $7 int4  lease length in seconds
--
-- Takes the first candidate, in array order, that belongs to the provider and pool, serves the
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
-- "Now" is statement_timestamp(), not now(): in a group transaction (src/groups.rs) now() is when the
-- group began, and a lease that expired since must count as expired.
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
-- a row lock, so any number of claims can share a transaction (group claiming, src/groups.rs)
-- without ever being part of a deadlock. The credential row is only read; the time of the grant
-- is kept on the slot (last_granted_at).
--
-- Always returns one row: the pool's version (pool_versions; NULL when the pool never had a
-- credential), so the caller learns whether its candidate view is stale, and the lease columns,
-- NULL when no candidate had a free slot.
WITH ranked AS (
    SELECT r.key_id, r.rank
    FROM unnest($1::text[]) WITH ORDINALITY AS r (key_id, rank)
),
claimed AS (
    SELECT s.key_id, s.slot,
           s.lease_id AS old_lease_id, s.provider AS old_provider, s.pool AS old_pool,
           s.holder AS old_holder, s.lease_until AS old_lease_until,
           c.status <> 'available' AS probe,
           c.status AS credential_status, c.cooldown_until, c.secret_ciphertext,
           coalesce(c.model_aliases ->> $4, $4) AS provider_model
    FROM ranked r
    JOIN credentials c ON c.key_id = r.key_id
    JOIN lease_slots s ON s.key_id = c.key_id
    WHERE c.provider = $2
      AND c.pool = $3
      AND ($4 = ANY (c.models) OR c.model_aliases ? $4)
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
    SET lease_id = $5,
        provider = $2,
        pool = $3,
        holder = $6,
        granted_at = clock_timestamp(),
        lease_until = clock_timestamp() + make_interval(secs => $7::int4),
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
    SELECT 'granted', lease_id, key_id, $2, $3, slot, $6, lease_until, granted_at
    FROM granted
)
SELECT (SELECT v.version FROM pool_versions v WHERE v.provider = $2 AND v.pool = $3) AS pool_version,
       granted.key_id AS "key_id?",
       granted.lease_id AS "lease_id?",
       granted.granted_at AS "granted_at?",
       granted.lease_until AS "lease_until?",
       granted.probe AS "probe?",
       claimed.provider_model AS "provider_model?",
       claimed.secret_ciphertext AS "sealed_secret?",
       claimed.old_lease_id IS NOT NULL AS "pruned_expired?"
FROM (SELECT 1) AS always_one_row
LEFT JOIN granted ON true
LEFT JOIN claimed ON claimed.key_id = granted.key_id
