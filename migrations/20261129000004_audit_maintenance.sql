-- Audit in SQL and the cleanup functions that pg_cron (or the service itself) runs.
--
-- Every function here is safe to run concurrently with itself and with allocation: it takes row
-- locks with SKIP LOCKED (never waiting behind a claim), works in bounded batches, returns how
-- much it did, and doing it twice does nothing more the second time.

-- The reaper finds expired leases by their end.
CREATE INDEX lease_slots_lease_until_idx ON lease_slots (lease_until) WHERE lease_id IS NOT NULL;
-- Retention and time-range audit queries scan the trails by time.
CREATE INDEX lease_events_at_idx ON lease_events (at);
CREATE INDEX credential_events_at_idx ON credential_events (at);
-- The oversell proof looks up each credential's limit history (its created / updated rows).
CREATE INDEX credential_events_configuration_idx ON credential_events (key_id, at)
    WHERE event IN ('created', 'updated');

ALTER TABLE credential_events
    DROP CONSTRAINT credential_events_event_known,
    ADD CONSTRAINT credential_events_event_known CHECK (
        event IN ('status_changed', 'probe_granted', 'cooldown_ended', 'created', 'updated',
                  'deleted', 'leases_released', 'secret_resealed'));

-- Who runs the cleanup functions on a schedule: a row ('pg_cron') once `credpool cron install`
-- (or a DBA applying docs/cron.sql) has scheduled them in pg_cron; absent, each credpool service
-- runs them itself (one replica per tick, under a transaction-scoped advisory lock).
CREATE TABLE maintenance_schedule (
    scheduler    text        NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT maintenance_schedule_pkey PRIMARY KEY (scheduler),
    CONSTRAINT maintenance_schedule_scheduler_known CHECK (scheduler IN ('pg_cron'))
);

-- Ends up to p_batch expired leases: writes each one's `expired` row to the trail (at its own
-- lease_until) and frees its slot. Correctness never depends on this (allocation treats expired
-- leases as free and reuses their slots); it keeps the trail complete and "active leases" honest.
-- Returns how many leases it ended.
CREATE FUNCTION credpool_reap_expired_leases(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE sql AS $$
    WITH stale AS (
        SELECT key_id, slot, lease_id, provider, pool, holder, lease_until
        FROM lease_slots
        WHERE lease_id IS NOT NULL AND lease_until <= now()
        ORDER BY lease_until
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    ),
    freed AS (
        UPDATE lease_slots s
        SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL,
            granted_at = NULL, lease_until = NULL, probe = false
        FROM stale
        WHERE s.key_id = stale.key_id AND s.slot = stale.slot
        RETURNING stale.*
    ),
    trail AS (
        INSERT INTO lease_events (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at)
        SELECT 'expired', lease_id, key_id, provider, pool, slot, holder, lease_until, lease_until
        FROM freed
    )
    SELECT count(*)::integer FROM freed
$$;

-- Records, once per cooldown, that a credential's cooldown has ended (`cooldown_ended`). The
-- credential is usable again from that moment without this job (credential_usable); it stays
-- half-open — its next lease is a single probe, and its status returns to `available` when the
-- probe succeeds — so this job does not change the status, it makes the recovery visible in the
-- trail. Returns how many credentials it recorded.
CREATE FUNCTION credpool_recover_cooldowns(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE sql AS $$
    WITH due AS (
        SELECT c.key_id, c.status, c.cooldown_until
        FROM credentials c
        WHERE c.status IN ('rate_limited', 'cooldown', 'exhausted')
          AND c.cooldown_until <= now()
          AND NOT EXISTS (
              SELECT 1 FROM credential_events e
              WHERE e.key_id = c.key_id AND e.event = 'cooldown_ended'
                AND e.cooldown_until = c.cooldown_until)
        ORDER BY c.cooldown_until
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    ),
    recorded AS (
        INSERT INTO credential_events (key_id, event, old_status, new_status, reason, cooldown_until, at)
        SELECT key_id, 'cooldown_ended', status, status,
               'cooldown ended: usable again, half-open (the next lease is a single probe)',
               cooldown_until, now()
        FROM due
        RETURNING 1
    )
    SELECT count(*)::integer FROM recorded
$$;

-- Deletes up to p_batch rows of each trail older than p_retention. Never touches the history of
-- a lease that still holds a slot. Returns how many rows it deleted.
CREATE FUNCTION credpool_purge_audit(p_retention interval DEFAULT '30 days', p_batch integer DEFAULT 10000)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_leases integer;
    v_credentials integer;
BEGIN
    WITH doomed AS (
        SELECT e.event_id
        FROM lease_events e
        WHERE e.at < now() - p_retention
          AND NOT EXISTS (SELECT 1 FROM lease_slots s WHERE s.lease_id = e.lease_id)
        ORDER BY e.at
        LIMIT p_batch
    )
    DELETE FROM lease_events WHERE event_id IN (SELECT event_id FROM doomed);
    GET DIAGNOSTICS v_leases = ROW_COUNT;

    WITH doomed AS (
        SELECT event_id FROM credential_events
        WHERE at < now() - p_retention
        ORDER BY at
        LIMIT p_batch
    )
    DELETE FROM credential_events WHERE event_id IN (SELECT event_id FROM doomed);
    GET DIAGNOSTICS v_credentials = ROW_COUNT;
    RETURN v_leases + v_credentials;
END;
$$;

-- One maintenance pass, as the schedulers run it: reap, record recoveries, purge.
CREATE FUNCTION credpool_maintenance(p_retention interval DEFAULT '30 days') RETURNS jsonb
LANGUAGE sql AS $$
    SELECT jsonb_build_object(
        'expired_leases_reaped', credpool_reap_expired_leases(1000),
        'cooldowns_recorded', credpool_recover_cooldowns(1000),
        'audit_rows_purged', credpool_purge_audit(p_retention, 10000))
$$;

-- Leases in flight now: per credential, with holder and time left.
CREATE VIEW active_leases AS
SELECT s.key_id, s.provider, s.pool, s.slot,
       replace(s.lease_id::text, '-', '') AS lease_id,
       s.holder, s.granted_at, s.lease_until,
       round(extract(epoch FROM s.lease_until - now()), 1) AS seconds_left,
       s.probe
FROM lease_slots s
WHERE s.lease_id IS NOT NULL AND s.lease_until > now();

-- One row per lease whose life overlaps [p_since, p_until), rebuilt from the trail alone: when
-- it was granted and how it ended (`released`, `force_released`, `expired`, or NULL while still
-- held), the outcome, the renewals and how long it was held. A lease's end is its release, or
-- else the last lease_until it was granted or renewed to. Leases granted up to a day before
-- p_since are considered (a lease held longer than a day through renewals is missed by a window
-- that starts after its first day). With p_key_id, one credential (index lease_events_key_id_at_idx).
CREATE FUNCTION credpool_lease_lifetimes(p_since timestamptz, p_until timestamptz, p_key_id text DEFAULT NULL)
RETURNS TABLE (
    lease_id text, key_id text, provider text, pool text, slot integer, holder text,
    granted_at timestamptz, ended_at timestamptz, ended_by text, outcome text, renewals bigint,
    held_seconds numeric)
LANGUAGE sql STABLE AS $$
    WITH granted AS (
        SELECT e.lease_id
        FROM lease_events e
        WHERE e.event = 'granted'
          AND e.at >= p_since - interval '1 day' AND e.at < p_until
          AND (p_key_id IS NULL OR e.key_id = p_key_id)
    ),
    lives AS (
        SELECT e.lease_id,
               min(e.key_id) AS key_id, min(e.provider) AS provider, min(e.pool) AS pool,
               min(e.slot) AS slot, min(e.holder) AS holder,
               min(e.at) FILTER (WHERE e.event = 'granted') AS granted_at,
               min(e.at) FILTER (WHERE e.event IN ('released', 'force_released')) AS released_at,
               min(e.event) FILTER (WHERE e.event IN ('released', 'force_released')) AS released_by,
               max(e.lease_until) FILTER (WHERE e.event IN ('granted', 'renewed')) AS last_until,
               min(e.outcome) FILTER (WHERE e.outcome IS NOT NULL) AS outcome,
               count(*) FILTER (WHERE e.event = 'renewed') AS renewals
        FROM lease_events e
        -- a lease's events all come at or after its grant: the time bound lets the index on
        -- `at` serve this scan instead of a pass over the whole trail
        WHERE e.at >= p_since - interval '1 day'
          AND e.lease_id IN (SELECT lease_id FROM granted)
        GROUP BY e.lease_id
    )
    SELECT replace(l.lease_id::text, '-', ''), l.key_id, l.provider, l.pool, l.slot, l.holder,
           l.granted_at,
           CASE WHEN l.released_at IS NOT NULL THEN l.released_at
                WHEN l.last_until <= now() THEN l.last_until END,
           CASE WHEN l.released_at IS NOT NULL THEN l.released_by
                WHEN l.last_until <= now() THEN 'expired' END,
           l.outcome, l.renewals,
           round(extract(epoch FROM least(coalesce(l.released_at, l.last_until), now()) - l.granted_at), 3)
    FROM lives l
    WHERE l.granted_at < p_until
      AND coalesce(l.released_at, l.last_until) > p_since
$$;

-- The oversell proof, from the trail alone: for every credential with leases granted in
-- [p_since, p_until), how many, the most leases held at one moment, and every grant that took a credential beyond
-- its limit at that moment. The limit at a moment is the one its latest `created` / `updated`
-- audit row set (else the current one). Lowering a limit under load revokes nothing, so more
-- leases than a lowered limit may be held for a while; what may never happen is a GRANT that
-- leaves more leases held than the limit allows — `grants_over_limit` counts those.
-- At equal times an end sorts before a start: a slot handed straight from one lease to the next
-- does not count twice.
CREATE FUNCTION credpool_oversell_check(p_since timestamptz, p_until timestamptz)
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
    -- each credential's limit over time: [from_at, to_at) per created / updated audit row
    limits AS (
        SELECT ce.key_id, ce.at AS from_at,
               lead(ce.at, 1, 'infinity') OVER (PARTITION BY ce.key_id ORDER BY ce.at) AS to_at,
               (ce.details -> 'new' ->> 'max_concurrent_uses')::integer AS max_concurrent_uses
        FROM credential_events ce
        WHERE ce.event IN ('created', 'updated')
          AND ce.key_id IN (SELECT DISTINCT l.key_id FROM lives l)
    ),
    grants AS (
        SELECT r.key_id, r.at, r.held,
               coalesce(lim.max_concurrent_uses, c.max_concurrent_uses) AS limit_then
        FROM running r
        LEFT JOIN limits lim ON lim.key_id = r.key_id AND r.at >= lim.from_at AND r.at < lim.to_at
        LEFT JOIN credentials c ON c.key_id = r.key_id
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

-- Utilization per credential and hour, for every credential that exists now: lease-seconds held
-- / slot-seconds available (its current limit x the seconds of the hour inside [p_since,
-- p_until)). Sum both columns over a pool for the pool's utilization.
CREATE FUNCTION credpool_utilization(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (key_id text, provider text, pool text, hour timestamptz, lease_seconds numeric,
               slot_seconds numeric, utilization numeric)
LANGUAGE sql STABLE AS $$
    WITH lives AS (
        SELECT l.key_id, l.granted_at, coalesce(l.ended_at, now()) AS ended_at
        FROM credpool_lease_lifetimes(p_since, p_until) l
    ),
    hours AS (
        SELECT h AS hour, greatest(h, p_since) AS from_at, least(h + interval '1 hour', p_until) AS to_at
        FROM generate_series(date_trunc('hour', p_since), p_until - interval '1 microsecond', interval '1 hour') h
    ),
    held AS (
        SELECT l.key_id, h.hour,
               sum(extract(epoch FROM least(l.ended_at, h.to_at) - greatest(l.granted_at, h.from_at))) AS lease_seconds
        FROM lives l
        JOIN hours h ON l.granted_at < h.to_at AND l.ended_at > h.from_at
        GROUP BY l.key_id, h.hour
    )
    SELECT c.key_id, c.provider, c.pool, h.hour,
           round(coalesce(held.lease_seconds, 0), 1),
           round(c.max_concurrent_uses * extract(epoch FROM h.to_at - h.from_at), 1),
           round(coalesce(held.lease_seconds, 0)
                 / nullif(c.max_concurrent_uses * extract(epoch FROM h.to_at - h.from_at), 0), 4)
    FROM credentials c
    CROSS JOIN hours h
    LEFT JOIN held ON held.key_id = c.key_id AND held.hour = h.hour
    ORDER BY h.hour, c.key_id
$$;
