-- Rate windows: the arithmetic of a credential's windows (table lease_windows) and a tenant's
-- (table tenant_windows, the same columns), pure functions of a window row and a time. The claim
-- (sql/lease.sql) decides with them; service/src/allocator/windows.rs is the same rule in Rust
-- for ranking and Retry-After estimates, and a test holds the two equal.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one transaction;
-- every statement here must be safe to run again.
--
-- The rule, exact: a window of length S and count N never has more than N grants (for
-- `requests`), or more than N reserved-or-used tokens (for `tokens`), in any interval of length S.
-- Each window counts in 16 buckets per length S (bucket b covers [b * S/16, (b + 1) * S/16) in
-- microseconds since the epoch) kept in a ring of 17. At time t a window counts every bucket
-- from floor(t / (S/16)) - 16 on: these cover (t - S, t] and at most one bucket more, so the count
-- is never less than what the last S seconds charged, and a grant admitted when the count plus
-- its own charge is at most N keeps the rule. The price of the buckets: a window frees at most
-- S/16 later than its oldest counted grant leaves it.
--
-- A window that is full blocks also a request that charges it nothing (a token window when the
-- allocate estimated 0 tokens): full means its count has reached N.

-- A tenant's windows (table tenant_windows, the same columns under tenant_id) as the row type
-- every function below takes.
CREATE OR REPLACE FUNCTION credpool_tenant_window(tw tenant_windows) RETURNS lease_windows
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ROW(tw.tenant_id, tw.window_kinds, tw.window_counts, tw.window_seconds, tw.bucket_ids,
               tw.bucket_charged)::lease_windows
$$;

-- The bucket of `p_at` for a window of `p_seconds`.
CREATE OR REPLACE FUNCTION credpool_window_bucket(p_at timestamptz, p_seconds integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT floor(extract(epoch FROM p_at) * 1000000 / (p_seconds::bigint * 62500))::bigint
$$;

-- What window `p_window` (1-based) of `w` counts at `p_at`.
CREATE OR REPLACE FUNCTION credpool_window_used(w lease_windows, p_window integer, p_at timestamptz)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_from bigint := credpool_window_bucket(p_at, w.window_seconds[p_window]) - 16;
    v_used bigint := 0;
BEGIN
    FOR b IN (p_window - 1) * 17 + 1 .. p_window * 17 LOOP
        IF w.bucket_ids[b] >= v_from THEN
            v_used := v_used + w.bucket_charged[b];
        END IF;
    END LOOP;
    RETURN v_used;
END;
$$;

-- What one grant charges window `p_window`: one request, or its token reservation.
CREATE OR REPLACE FUNCTION credpool_window_amount(w lease_windows, p_window integer, p_tokens bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE w.window_kinds[p_window] WHEN 'requests' THEN 1 ELSE p_tokens END
$$;

-- ROOM: whether every window of `w` admits, at `p_at`, one more grant reserving `p_tokens`.
CREATE OR REPLACE FUNCTION credpool_window_room(w lease_windows, p_at timestamptz, p_tokens bigint)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_used bigint;
    v_amount bigint;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(w.window_kinds), 0) LOOP
        v_used := credpool_window_used(w, i, p_at);
        v_amount := credpool_window_amount(w, i, p_tokens);
        IF v_used + v_amount > w.window_counts[i] OR v_used >= w.window_counts[i] THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END;
$$;

-- CHARGE: `w` with a grant at `p_at` reserving `p_tokens` counted in every window.
CREATE OR REPLACE FUNCTION credpool_window_charge(w lease_windows, p_at timestamptz, p_tokens bigint)
RETURNS lease_windows
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_bucket bigint;
    v_index integer;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(w.window_kinds), 0) LOOP
        v_bucket := credpool_window_bucket(p_at, w.window_seconds[i]);
        v_index := (i - 1) * 17 + (v_bucket % 17)::integer + 1;
        IF w.bucket_ids[v_index] >= v_bucket THEN
            w.bucket_charged[v_index] := w.bucket_charged[v_index] + credpool_window_amount(w, i, p_tokens);
        ELSE
            w.bucket_ids[v_index] := v_bucket;
            w.bucket_charged[v_index] := credpool_window_amount(w, i, p_tokens);
        END IF;
    END LOOP;
    RETURN w;
END;
$$;

-- USAGE: `w` with the token windows' charge of a grant made at `p_granted_at` changed by
-- `p_delta` (usage reported minus the reservation), if that grant's bucket is still counted
-- (an older one has left every window: nothing to change). Never below zero.
CREATE OR REPLACE FUNCTION credpool_window_adjust(w lease_windows, p_granted_at timestamptz, p_delta bigint)
RETURNS lease_windows
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_bucket bigint;
    v_index integer;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(w.window_kinds), 0) LOOP
        CONTINUE WHEN w.window_kinds[i] <> 'tokens';
        v_bucket := credpool_window_bucket(p_granted_at, w.window_seconds[i]);
        v_index := (i - 1) * 17 + (v_bucket % 17)::integer + 1;
        IF w.bucket_ids[v_index] = v_bucket THEN
            w.bucket_charged[v_index] := greatest(w.bucket_charged[v_index] + p_delta, 0);
        END IF;
    END LOOP;
    RETURN w;
END;
$$;

-- FREES: the earliest moment from `p_at` on when every window of `w` admits a grant reserving
-- `p_tokens` (`p_at` itself when they do now; 'infinity' when a window's count is smaller than
-- the reservation: it never will). A bucket b leaves its window at (b + 17) * S/16.
CREATE OR REPLACE FUNCTION credpool_window_frees_at(w lease_windows, p_at timestamptz, p_tokens bigint)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_frees timestamptz := p_at;
    v_used bigint;
    v_amount bigint;
    v_count bigint;
    v_micros bigint;
    v_from bigint;
    r record;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(w.window_kinds), 0) LOOP
        v_count := w.window_counts[i];
        v_amount := credpool_window_amount(w, i, p_tokens);
        IF v_amount > v_count THEN
            RETURN 'infinity';
        END IF;
        v_used := credpool_window_used(w, i, p_at);
        CONTINUE WHEN v_used + v_amount <= v_count AND v_used < v_count;
        v_micros := w.window_seconds[i]::bigint * 62500;
        v_from := credpool_window_bucket(p_at, w.window_seconds[i]) - 16;
        FOR r IN
            SELECT b.id, b.charged
            FROM unnest(w.bucket_ids[(i - 1) * 17 + 1 : i * 17],
                        w.bucket_charged[(i - 1) * 17 + 1 : i * 17]) AS b (id, charged)
            WHERE b.id >= v_from AND b.charged > 0
            ORDER BY b.id
        LOOP
            v_used := v_used - r.charged;
            IF v_used + v_amount <= v_count AND v_used < v_count THEN
                v_frees := greatest(v_frees, to_timestamp(((r.id + 17) * v_micros)::numeric / 1000000));
                EXIT;
            END IF;
        END LOOP;
    END LOOP;
    RETURN v_frees;
END;
$$;

-- The windows of a credential's `rate_limits` (a JSON array of {"requests"|"tokens": N,
-- "seconds": S}) as the three configuration arrays of lease_windows, in order.
CREATE OR REPLACE FUNCTION credpool_window_config(p_rate_limits jsonb,
    OUT kinds text[], OUT counts bigint[], OUT seconds integer[])
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(array_agg(CASE WHEN l ? 'requests' THEN 'requests' ELSE 'tokens' END ORDER BY n), '{}'),
           coalesce(array_agg(coalesce((l ->> 'requests')::bigint, (l ->> 'tokens')::bigint) ORDER BY n), '{}'),
           coalesce(array_agg((l ->> 'seconds')::integer ORDER BY n), '{}')
    FROM jsonb_array_elements(p_rate_limits) WITH ORDINALITY AS e (l, n)
$$;

-- HOLDING: the kind of the first window of `w` that does not admit, at `p_at`, a grant reserving
-- `p_tokens` ('requests' or 'tokens'); NULL when every one does.
CREATE OR REPLACE FUNCTION credpool_window_holding(w lease_windows, p_at timestamptz, p_tokens bigint)
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_used bigint;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(w.window_kinds), 0) LOOP
        v_used := credpool_window_used(w, i, p_at);
        IF v_used + credpool_window_amount(w, i, p_tokens) > w.window_counts[i]
           OR v_used >= w.window_counts[i] THEN
            RETURN w.window_kinds[i];
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;
