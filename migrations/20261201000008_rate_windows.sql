-- Rate windows: a credential's limits on requests and tokens per interval, beside its limit on
-- concurrent uses. Tables only; what uses them is in sql/lease.sql and sql/audit.sql.

-- The windows as the operator set them: a JSON array of {"requests": N, "seconds": S} and
-- {"tokens": N, "seconds": S} (validated by the service: 0 to 8 windows, S 1..=2678400,
-- N 1..=10^9).
ALTER TABLE credentials
    ADD COLUMN rate_limits jsonb NOT NULL DEFAULT '[]',
    ADD CONSTRAINT credentials_rate_limits_is_array CHECK (jsonb_typeof(rate_limits) = 'array');

-- What each credential's windows have counted, one row per credential (a credential without
-- windows has empty arrays). A claim of a credential with windows locks this row with its slot
-- row, so the state that decides whether the window has room is on a row the claim locks.
--
-- Each window counts in buckets of 1/16 of its length, kept in a ring of 17 (a window's length
-- spans at most 17 buckets): window i's bucket b is element i * 17 + b + 1 of the two bucket
-- arrays, holding the absolute bucket number (microseconds since the epoch / bucket length) and
-- what was charged in it (grants for `requests`, reserved-or-used tokens for `tokens`). A bucket
-- whose number is older than the last 17 is empty.
CREATE TABLE lease_windows (
    key_id         text      NOT NULL,
    -- the credential's rate_limits, one entry per window, in their order: kind, count, seconds
    window_kinds   text[]    NOT NULL DEFAULT '{}',
    window_counts  bigint[]  NOT NULL DEFAULT '{}',
    window_seconds integer[] NOT NULL DEFAULT '{}',
    bucket_ids     bigint[]  NOT NULL DEFAULT '{}',
    bucket_charged bigint[]  NOT NULL DEFAULT '{}',
    CONSTRAINT lease_windows_pkey PRIMARY KEY (key_id),
    CONSTRAINT lease_windows_key_id_fkey FOREIGN KEY (key_id)
        REFERENCES credentials (key_id) ON DELETE CASCADE,
    CONSTRAINT lease_windows_shape CHECK (
        cardinality(window_counts) = cardinality(window_kinds)
        AND cardinality(window_seconds) = cardinality(window_kinds)
        AND cardinality(bucket_ids) = 17 * cardinality(window_kinds)
        AND cardinality(bucket_charged) = 17 * cardinality(window_kinds)
        AND cardinality(window_kinds) <= 8),
    CONSTRAINT lease_windows_kinds_known CHECK (window_kinds <@ ARRAY['requests', 'tokens'])
);

INSERT INTO lease_windows (key_id) SELECT key_id FROM credentials;

-- A lease's token reservation (the estimate its allocate gave; 0 when none), which its release's
-- usage replaces, and the gate that tells a claim its credential has windows: `windowed` is a
-- copy of "rate_limits is not empty" written by credpool_fit_slots under the slot rows' locks, so
-- a claim that read before the windows were set passes over the slot.
ALTER TABLE lease_slots
    ADD COLUMN reserved_tokens bigint,
    ADD COLUMN windowed boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT lease_slots_reservation_with_lease CHECK (
        lease_id IS NOT NULL OR reserved_tokens IS NULL);

-- The trail keeps each grant's reservation (`granted`) and each report's usage (`released`,
-- `outcome_after_expiry`), for the window proof.
ALTER TABLE lease_events ADD COLUMN tokens bigint;

-- Superseded by versions that carry token counts (sql/lease.sql defines them); an older
-- definition left beside them would make calls ambiguous.
DROP FUNCTION IF EXISTS credpool_end_lease(lease_slots, text, timestamptz, text, text, text);
DROP FUNCTION IF EXISTS credpool_record_lease_end(lease_slots, text, timestamptz, text, text, text);
