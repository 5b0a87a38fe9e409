-- The lease trail partitioned by UTC day of `at`, so that retention drops whole days (DROP TABLE
-- of a day's partition, credpool_drop_trail_days) instead of deleting rows one by one, and a
-- proof or a query over a time range reads only the days it names.
--
-- The rows already written stay where they are: the existing table becomes the partition of
-- everything before tomorrow (`lease_events_before`, from MINVALUE), and is dropped whole once
-- retention has passed its last day; until then the purge deletes its old rows in batches, as
-- before. The days from tomorrow on are partitions of their own (`lease_events_pYYYYMMDD`),
-- created a week ahead here and then by every maintenance pass (credpool_make_trail_days).
--
-- What the trail keeps, and why (each index is used by a query that would otherwise scan the
-- trail; docs/design.md, "The trail"):
--   lease_id        a lease's own rows: a report or a usage for a lease no longer in its slot
--                   (its `granted` row), the audit of one lease, the window proof's usage rows;
--   (key_id, at)    one credential's rows in a time range: window seeding, the dashboard, the
--                   audit of one credential;
--   at              a time range of the whole trail in order: the proofs' chunks, the dashboard's
--                   recent rows.
-- Dropped: the primary key on event_id (no query looks a row up by it; the id stays, from a
-- sequence, as the order of rows written at one instant), and the two unique partial indexes on
-- lease_id (a unique index of a partitioned table must include `at`, which would no longer make a
-- lease's release or report unique). A lease ends once because its slot row is locked while it
-- ends; a report for a lease no longer in its slot is recorded once under the lease's advisory
-- lock (credpool_release_late).

ALTER TABLE lease_events RENAME TO lease_events_before;
DROP TRIGGER lease_events_append_only ON lease_events_before;
ALTER TABLE lease_events_before DROP CONSTRAINT lease_events_pkey;
DROP INDEX lease_events_one_release_per_lease;
DROP INDEX lease_events_one_report_per_lease;
ALTER INDEX lease_events_lease_id_idx RENAME TO lease_events_before_lease_id_idx;
ALTER INDEX lease_events_key_id_at_idx RENAME TO lease_events_before_key_id_at_idx;
ALTER INDEX lease_events_at_idx RENAME TO lease_events_before_at_idx;
-- the constraint was added NOT VALID; a partition must hold its parent's constraints validated
ALTER TABLE lease_events_before VALIDATE CONSTRAINT lease_events_affinity_known;

-- event_id: an identity column cannot be attached to a partitioned table (PostgreSQL 15), so the
-- ids continue from a sequence of their own
CREATE SEQUENCE lease_events_event_ids AS bigint;
SELECT setval('lease_events_event_ids', coalesce((SELECT max(event_id) FROM lease_events_before), 0) + 1,
              false);
ALTER TABLE lease_events_before ALTER COLUMN event_id DROP IDENTITY;

CREATE TABLE lease_events (
    event_id    bigint      NOT NULL DEFAULT nextval('lease_events_event_ids'),
    event       text        NOT NULL,
    lease_id    uuid        NOT NULL,
    -- no foreign key: history outlives the credential
    key_id      text        NOT NULL,
    provider    text        NOT NULL,
    pool        text        NOT NULL,
    slot        integer     NOT NULL,
    holder      text,
    -- the executor's report on release (`outcome_after_expiry`: after its lease ended)
    outcome     text,
    -- granted / renewed: the new lease_until; released / expired: the lease_until at that moment
    lease_until timestamptz NOT NULL,
    -- when the event took effect: grant time, renewal time, release time, or for `expired` the
    -- lease_until that passed; the partition key
    at          timestamptz NOT NULL,
    -- when the row was written
    recorded_at timestamptz NOT NULL DEFAULT now(),
    -- force_released: why, and the operator who did it
    reason      text,
    actor       text,
    fence       bigint,
    -- granted: the reservation; released / outcome_after_expiry: the usage reported
    tokens      bigint,
    tenant      text,
    affinity    text,
    CONSTRAINT lease_events_event_known CHECK (
        event IN ('granted', 'renewed', 'released', 'expired', 'outcome_after_expiry',
                  'force_released')),
    CONSTRAINT lease_events_outcome_known CHECK (
        outcome IS NULL
        OR outcome IN ('success', 'failure', 'rate_limited', 'auth_error', 'auth_expired',
                       'quota_exhausted')),
    CONSTRAINT lease_events_affinity_known CHECK (affinity IN ('hit', 'new', 'moved'))
) PARTITION BY RANGE (at);
ALTER SEQUENCE lease_events_event_ids OWNED BY lease_events.event_id;

CREATE INDEX lease_events_lease_id_idx ON lease_events (lease_id);
CREATE INDEX lease_events_key_id_at_idx ON lease_events (key_id, at);
CREATE INDEX lease_events_at_idx ON lease_events (at);

CREATE TRIGGER lease_events_append_only BEFORE UPDATE ON lease_events
    FOR EACH ROW EXECUTE FUNCTION lease_events_forbid_update();

DO $$
DECLARE
    v_tomorrow timestamptz := (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day')
                              AT TIME ZONE 'UTC';
    v_day timestamptz;
BEGIN
    EXECUTE format('ALTER TABLE lease_events ATTACH PARTITION lease_events_before
                    FOR VALUES FROM (MINVALUE) TO (%L)', v_tomorrow);
    FOR i IN 0..6 LOOP
        v_day := v_tomorrow + make_interval(days => i);
        EXECUTE format('CREATE TABLE %I PARTITION OF lease_events FOR VALUES FROM (%L) TO (%L)',
                       'lease_events_p' || to_char(v_day AT TIME ZONE 'UTC', 'YYYYMMDD'),
                       v_day, v_day + interval '1 day');
    END LOOP;
END;
$$;
