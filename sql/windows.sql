-- Rate windows: the arithmetic of a credential's windows (table lease_windows) and a tenant's
-- (table tenant_windows, the same columns), pure functions of a window row and a time. The claim
-- (sql/claim.sql) decides with them; service/src/domain/windows.rs is the same rule in Rust
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

-- A tenant's windows (table tenant_windows, the same columns under tenant_id, and no provider: a
-- tenant's windows span providers) as a lease_windows row.
--
-- The functions below take any row with the columns of lease_windows (`anyelement`): a
-- lease_windows row, a tenant's as this function gives it, and on Citus a row of a shard, which
-- is of the shard's own type (`lease_windows_102072`).
DROP FUNCTION IF EXISTS credpool_tenant_window(tenant_windows);
CREATE OR REPLACE FUNCTION credpool_tenant_window(tw anyelement) RETURNS lease_windows
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ROW(tw.tenant_id, tw.window_kinds, tw.window_counts, tw.window_seconds, tw.bucket_ids,
               tw.bucket_charged, NULL)::lease_windows
$$;

-- The bucket of `p_at` for a window of `p_seconds`.
CREATE OR REPLACE FUNCTION credpool_window_bucket(p_at timestamptz, p_seconds integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT floor(extract(epoch FROM p_at) * 1000000 / (p_seconds::bigint * 62500))::bigint
$$;

-- What window `p_window` (1-based) of `w` counts at `p_at`.
DROP FUNCTION IF EXISTS credpool_window_used(lease_windows, integer, timestamptz);
CREATE OR REPLACE FUNCTION credpool_window_used(w anyelement, p_window integer, p_at timestamptz)
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
DROP FUNCTION IF EXISTS credpool_window_amount(lease_windows, integer, bigint);
CREATE OR REPLACE FUNCTION credpool_window_amount(w anyelement, p_window integer, p_tokens bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE w.window_kinds[p_window] WHEN 'requests' THEN 1 ELSE p_tokens END
$$;

-- ROOM: whether every window of `w` admits, at `p_at`, one more grant reserving `p_tokens`.
DROP FUNCTION IF EXISTS credpool_window_room(lease_windows, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_window_room(w anyelement, p_at timestamptz, p_tokens bigint)
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

-- CHARGE: the buckets of `w` with a grant at `p_at` reserving `p_tokens` counted in every window.
DROP FUNCTION IF EXISTS credpool_window_charge(lease_windows, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_window_charge(w anyelement, p_at timestamptz, p_tokens bigint,
    OUT bucket_ids bigint[], OUT bucket_charged bigint[])
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_bucket bigint;
    v_index integer;
BEGIN
    bucket_ids := w.bucket_ids;
    bucket_charged := w.bucket_charged;
    FOR i IN 1 .. coalesce(cardinality(w.window_kinds), 0) LOOP
        v_bucket := credpool_window_bucket(p_at, w.window_seconds[i]);
        v_index := (i - 1) * 17 + (v_bucket % 17)::integer + 1;
        IF bucket_ids[v_index] >= v_bucket THEN
            bucket_charged[v_index] := bucket_charged[v_index] + credpool_window_amount(w, i, p_tokens);
        ELSE
            bucket_ids[v_index] := v_bucket;
            bucket_charged[v_index] := credpool_window_amount(w, i, p_tokens);
        END IF;
    END LOOP;
END;
$$;

-- USAGE: the buckets of `w` with the token windows' charge of a grant made at `p_granted_at`
-- changed by `p_delta` (usage reported minus the reservation), if that grant's bucket is still
-- counted (an older one has left every window: nothing to change). Never below zero.
DROP FUNCTION IF EXISTS credpool_window_adjust(lease_windows, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_window_adjust(w anyelement, p_granted_at timestamptz,
    p_delta bigint, OUT bucket_ids bigint[], OUT bucket_charged bigint[])
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_bucket bigint;
    v_index integer;
BEGIN
    bucket_ids := w.bucket_ids;
    bucket_charged := w.bucket_charged;
    FOR i IN 1 .. coalesce(cardinality(w.window_kinds), 0) LOOP
        CONTINUE WHEN w.window_kinds[i] <> 'tokens';
        v_bucket := credpool_window_bucket(p_granted_at, w.window_seconds[i]);
        v_index := (i - 1) * 17 + (v_bucket % 17)::integer + 1;
        IF bucket_ids[v_index] = v_bucket THEN
            bucket_charged[v_index] := greatest(bucket_charged[v_index] + p_delta, 0);
        END IF;
    END LOOP;
END;
$$;

-- FREES: the earliest moment from `p_at` on when every window of `w` admits a grant reserving
-- `p_tokens` (`p_at` itself when they do now; 'infinity' when a window's count is smaller than
-- the reservation: it never will). A bucket b leaves its window at (b + 17) * S/16.
DROP FUNCTION IF EXISTS credpool_window_frees_at(lease_windows, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_window_frees_at(w anyelement, p_at timestamptz, p_tokens bigint)
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
DROP FUNCTION IF EXISTS credpool_window_holding(lease_windows, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_window_holding(w anyelement, p_at timestamptz, p_tokens bigint)
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

-- Seeding a new window from the trail, and fitting a window row to a configuration.

-- (the tokens of one grant as the trail stood at a moment: folded into SEED below)
DROP FUNCTION IF EXISTS credpool_grant_tokens(uuid, bigint, timestamptz);

-- What a new window of `p_kind` and `p_seconds` has counted at `p_now`, from the trail: the
-- grants of credential `p_key_id` (or, when it is NULL, of tenant `p_tenant`) in the buckets it
-- counts (a grant's tokens: the usage its release reported, else its reservation), as the 17
-- bucket numbers and charges of its ring (an empty bucket holds number 0, older than any).
-- `p_upto`: the trail as it stood at that moment (grants and reports after it left out).
-- `p_after`: only what changed after that moment, to add to a seed taken up to it: the grants
-- made after it, and, for a grant made before it, its usage reported after it in place of its
-- reservation. It reads only the trail after `p_after` (SEED TENANT WINDOWS takes the long seed
-- without the tenant's lock; FIT TENANT adds this under it).
DROP FUNCTION IF EXISTS credpool_seed_window(text, text, integer, timestamptz);
DROP FUNCTION IF EXISTS credpool_seed_window(text, text, text, integer, timestamptz);
DROP FUNCTION IF EXISTS credpool_seed_window(text, text, text, integer, timestamptz, timestamptz,
    timestamptz);
-- (`p_provider`: the credential's, with `p_key_id`. PL/pgSQL, in three steps: the grants, their
-- reported usage, then the ring from those two alone. Citus plans no SQL function with
-- parameters that reads a distributed table, nor a function that reads one called from a
-- statement that runs on a worker.)
CREATE OR REPLACE FUNCTION credpool_seed_window(
    p_key_id text, p_provider text, p_tenant text, p_kind text, p_seconds integer,
    p_now timestamptz, p_after timestamptz DEFAULT NULL, p_upto timestamptz DEFAULT NULL,
    OUT ids bigint[], OUT charged bigint[])
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_since timestamptz := p_now - make_interval(secs => p_seconds * 17.0 / 16);
    v_after timestamptz := coalesce(p_after, '-infinity');
    v_upto timestamptz := coalesce(p_upto, 'infinity');
    v_leases uuid[];
    v_at timestamptz[];
    v_reserved bigint[];
    v_used_leases uuid[] := '{}';
    v_used_at timestamptz[] := '{}';
    v_used bigint[] := '{}';
BEGIN
    -- the grants made after p_after (a credential's through its (key_id, at) index, a tenant's
    -- through the trail's time index) and, with p_after, a token window's grants made up to it
    -- whose usage was reported after it
    IF p_key_id IS NOT NULL THEN
        SELECT coalesce(array_agg(g.lease_id), '{}'), coalesce(array_agg(g.at), '{}'),
               coalesce(array_agg(g.tokens), '{}')
        INTO v_leases, v_at, v_reserved
        FROM (SELECT g.lease_id, g.at, g.tokens FROM lease_events g
              WHERE g.provider = p_provider AND g.key_id = p_key_id AND g.event = 'granted'
                AND g.at >= v_since AND g.at > v_after AND g.at <= v_upto
              UNION ALL
              SELECT g.lease_id, g.at, g.tokens
              FROM lease_events r
              JOIN lease_events g
                ON g.provider = r.provider AND g.lease_id = r.lease_id AND g.event = 'granted'
              WHERE p_after IS NOT NULL AND p_kind = 'tokens'
                AND r.provider = p_provider AND r.key_id = p_key_id
                AND r.event IN ('released', 'outcome_after_expiry') AND r.tokens IS NOT NULL
                AND r.at > p_after AND r.at <= v_upto
                AND g.at <= p_after AND g.at >= v_since) AS g;
    ELSE
        SELECT coalesce(array_agg(g.lease_id), '{}'), coalesce(array_agg(g.at), '{}'),
               coalesce(array_agg(g.tokens), '{}')
        INTO v_leases, v_at, v_reserved
        FROM (SELECT g.lease_id, g.at, g.tokens FROM lease_events g
              WHERE g.tenant = p_tenant AND g.event = 'granted'
                AND g.at >= v_since AND g.at > v_after AND g.at <= v_upto
              UNION ALL
              SELECT g.lease_id, g.at, g.tokens
              FROM lease_events r
              JOIN lease_events g
                ON g.provider = r.provider AND g.lease_id = r.lease_id AND g.event = 'granted'
              WHERE p_after IS NOT NULL AND p_kind = 'tokens' AND r.tenant = p_tenant
                AND r.event IN ('released', 'outcome_after_expiry') AND r.tokens IS NOT NULL
                AND r.at > p_after AND r.at <= v_upto
                AND g.at <= p_after AND g.at >= v_since) AS g;
    END IF;
    -- a token window counts a grant's usage as its release (or late report) reported it by
    -- p_upto, else its reservation (a lease's usage is reported once)
    IF p_kind = 'tokens' AND cardinality(v_leases) > 0 THEN
        SELECT coalesce(array_agg(e.lease_id), '{}'), coalesce(array_agg(e.at), '{}'),
               coalesce(array_agg(e.tokens), '{}')
        INTO v_used_leases, v_used_at, v_used
        FROM lease_events e
        WHERE e.lease_id = ANY (v_leases) AND e.tokens IS NOT NULL
          AND e.event IN ('released', 'outcome_after_expiry') AND e.at <= v_upto;
    END IF;
    WITH usage AS (
        SELECT DISTINCT ON (u.lease_id) u.lease_id, u.at, u.tokens
        FROM unnest(v_used_leases, v_used_at, v_used) AS u (lease_id, at, tokens)
        ORDER BY u.lease_id, u.at
    ),
    grants AS (
        -- each grant's amount as of p_upto, less what a seed up to p_after counted of it
        SELECT credpool_window_bucket(g.at, p_seconds) AS bucket,
               CASE WHEN p_kind = 'requests' THEN 1
                    WHEN g.at > v_after THEN coalesce(u.tokens, g.reserved, 0)
                    ELSE coalesce(u.tokens, g.reserved, 0)
                         - coalesce(CASE WHEN u.at <= v_after THEN u.tokens END, g.reserved, 0)
               END AS amount
        FROM unnest(v_leases, v_at, v_reserved) AS g (lease_id, at, reserved)
        LEFT JOIN usage u ON u.lease_id = g.lease_id
    ),
    buckets AS (
        SELECT bucket, sum(amount)::bigint AS amount
        FROM grants
        WHERE bucket >= credpool_window_bucket(p_now, p_seconds) - 16
        GROUP BY bucket
    )
    SELECT array_agg(coalesce(b.bucket, 0) ORDER BY ring.slot),
           array_agg(coalesce(b.amount, 0) ORDER BY ring.slot)
    INTO ids, charged
    FROM generate_series(0, 16) AS ring (slot)
    LEFT JOIN buckets b ON b.bucket % 17 = ring.slot;
END;
$$;

-- Two rings of the same window added bucket by bucket: a bucket number both hold, their charges
-- summed; else the newer number's (the older one is at least 17 buckets older, out of the window).
CREATE OR REPLACE FUNCTION credpool_window_ring_sum(p_ids bigint[], p_charged bigint[],
    p_more_ids bigint[], p_more_charged bigint[], OUT ids bigint[], OUT charged bigint[])
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT array_agg(greatest(p_ids[i], p_more_ids[i]) ORDER BY i),
           array_agg(CASE WHEN p_ids[i] = p_more_ids[i] THEN p_charged[i] + p_more_charged[i]
                          WHEN p_ids[i] > p_more_ids[i] THEN p_charged[i]
                          ELSE p_more_charged[i] END ORDER BY i)
    FROM generate_subscripts(p_ids, 1) AS i
$$;

-- Windows `p_old` brought in line with `p_rate_limits` at `p_now`: a window kept (same kind and
-- length) keeps its buckets, whatever its count; a new one is seeded from the trail of credential
-- `p_key_id` (or, when it is NULL, of tenant `p_tenant`): credpool_seed_window, as the trail
-- stood at `p_upto` (NULL: now). `p_seeded`: windows already seeded from the trail as it stood
-- at `p_cut` (SEED TENANT WINDOWS); a new window among them takes that seed plus what changed
-- since. `p_old` unchanged when the configuration is.
DROP FUNCTION IF EXISTS credpool_windows_fitted(lease_windows, jsonb, text, text, timestamptz);
CREATE OR REPLACE FUNCTION credpool_windows_fitted(p_old lease_windows, p_rate_limits jsonb,
    p_key_id text, p_tenant text, p_now timestamptz, p_upto timestamptz DEFAULT NULL,
    p_seeded lease_windows DEFAULT NULL, p_cut timestamptz DEFAULT NULL)
RETURNS lease_windows
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_new lease_windows := p_old;
    v_config record;
    v_seed record;
    v_kept integer;
    v_seeded integer;
BEGIN
    v_config := credpool_window_config(p_rate_limits);
    IF (p_old.window_kinds, p_old.window_counts, p_old.window_seconds)
       IS NOT DISTINCT FROM (v_config.kinds, v_config.counts, v_config.seconds) THEN
        RETURN p_old;
    END IF;
    v_new.window_kinds := v_config.kinds;
    v_new.window_counts := v_config.counts;
    v_new.window_seconds := v_config.seconds;
    v_new.bucket_ids := '{}';
    v_new.bucket_charged := '{}';
    FOR i IN 1 .. coalesce(cardinality(v_config.kinds), 0) LOOP
        v_kept := credpool_window_index(p_old, v_config.kinds[i], v_config.seconds[i]);
        v_seeded := credpool_window_index(p_seeded, v_config.kinds[i], v_config.seconds[i]);
        IF v_kept IS NOT NULL THEN
            v_new.bucket_ids := v_new.bucket_ids || p_old.bucket_ids[(v_kept - 1) * 17 + 1 : v_kept * 17];
            v_new.bucket_charged := v_new.bucket_charged
                || p_old.bucket_charged[(v_kept - 1) * 17 + 1 : v_kept * 17];
        ELSIF v_seeded IS NOT NULL THEN
            v_seed := credpool_seed_window(p_key_id, p_old.provider, p_tenant, v_config.kinds[i],
                                           v_config.seconds[i], p_now, p_after => p_cut,
                                           p_upto => p_upto);
            v_seed := credpool_window_ring_sum(
                p_seeded.bucket_ids[(v_seeded - 1) * 17 + 1 : v_seeded * 17],
                p_seeded.bucket_charged[(v_seeded - 1) * 17 + 1 : v_seeded * 17],
                v_seed.ids, v_seed.charged);
            v_new.bucket_ids := v_new.bucket_ids || v_seed.ids;
            v_new.bucket_charged := v_new.bucket_charged || v_seed.charged;
        ELSE
            v_seed := credpool_seed_window(p_key_id, p_old.provider, p_tenant, v_config.kinds[i],
                                           v_config.seconds[i], p_now, p_upto => p_upto);
            v_new.bucket_ids := v_new.bucket_ids || v_seed.ids;
            v_new.bucket_charged := v_new.bucket_charged || v_seed.charged;
        END IF;
    END LOOP;
    RETURN v_new;
END;
$$;

-- The 1-based position of the window of `p_kind` and `p_seconds` among windows `w`; NULL when
-- `w` has none (or is NULL).
DROP FUNCTION IF EXISTS credpool_window_index(lease_windows, text, integer);
CREATE OR REPLACE FUNCTION credpool_window_index(w anyelement, p_kind text, p_seconds integer)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT min(i)::integer FROM generate_subscripts(w.window_kinds, 1) AS i
    WHERE w.window_kinds[i] = p_kind AND w.window_seconds[i] = p_seconds
$$;

-- Brings the lease_windows row of credential `p_key_id` of provider `p_provider` in line with its
-- rate_limits (see credpool_fit_slots, which calls it holding the row's lock). Returns whether the
-- credential has windows.
DROP FUNCTION IF EXISTS credpool_fit_windows(text, jsonb, timestamptz);
CREATE OR REPLACE FUNCTION credpool_fit_windows(p_key_id text, p_provider text, p_rate_limits jsonb,
    p_now timestamptz)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_old lease_windows;
    v_new lease_windows;
BEGIN
    SELECT * INTO v_old FROM lease_windows WHERE provider = p_provider AND key_id = p_key_id;
    IF NOT FOUND THEN
        INSERT INTO lease_windows (key_id, provider) VALUES (p_key_id, p_provider)
        RETURNING * INTO v_old;
    END IF;
    v_new := credpool_windows_fitted(v_old, p_rate_limits, p_key_id, NULL, p_now);
    IF v_new IS DISTINCT FROM v_old THEN
        UPDATE lease_windows
        SET window_kinds = v_new.window_kinds, window_counts = v_new.window_counts,
            window_seconds = v_new.window_seconds, bucket_ids = v_new.bucket_ids,
            bucket_charged = v_new.bucket_charged
        WHERE provider = p_provider AND key_id = p_key_id;
    END IF;
    RETURN cardinality(v_new.window_kinds) > 0;
END;
$$;
