-- What the proofs of sql/audit.sql have proven, so that each run proves only what the trail
-- gained since (credpool_audit_advance): per run and proof, up to which time every grant was
-- judged, what was found, per subject, and the leases still live at that time, which the grants
-- after it must count.
--
-- A run is the continuous proof (`continuous`: the maintenance pass and `credpool audit verify`
-- advance it as the trail grows) or one `credpool audit verify --since/--until/--full` over a
-- range (`range:` and its start), kept so that an interrupted run resumes.

-- A lease live at a checkpoint: the key_id (oversell proof) or tenant (tenant cap proof) it
-- counts for, when it was granted, and the latest lease_until it was granted or renewed to
-- before the checkpoint.
CREATE TYPE audit_live_lease AS (
    lease_id    uuid,
    subject     text,
    granted_at  timestamptz,
    lease_until timestamptz
);

CREATE TABLE audit_checkpoints (
    run                text        NOT NULL,
    proof              text        NOT NULL,
    -- grants at or after `since` are judged
    since              timestamptz NOT NULL,
    -- where the run stops; NULL: it follows the trail (the continuous proof)
    until_target       timestamptz,
    -- every grant in [since, proven_until) has been judged; before `since` while the run is
    -- still reading the leases live at its start (the concurrency proofs)
    proven_until       timestamptz NOT NULL,
    -- the leases live at proven_until (the oversell and tenant cap proofs; empty for windows)
    live_leases        audit_live_lease[] NOT NULL DEFAULT '{}',
    -- what was found in [since, proven_until): the sums of audit_checkpoint_subjects
    grants             bigint      NOT NULL DEFAULT 0,
    violations         bigint      NOT NULL DEFAULT 0,
    first_violation_at timestamptz,
    -- trail rows read and chunks run, for progress and figures
    rows_read          bigint      NOT NULL DEFAULT 0,
    chunks             bigint      NOT NULL DEFAULT 0,
    started_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT audit_checkpoints_pkey PRIMARY KEY (run, proof),
    CONSTRAINT audit_checkpoints_proof_known CHECK (
        proof IN ('oversell', 'windows', 'tenant_cap', 'tenant_windows')),
    CONSTRAINT audit_checkpoints_target_after_since CHECK (until_target >= since)
);

-- One line per subject (a credential, or a tenant) and window (kind and length; '' and 0 for the
-- concurrency proofs) with grants judged in the run: the figures of the proof functions,
-- combined over the chunks (sums, maxima, the earliest violation).
CREATE TABLE audit_checkpoint_subjects (
    run                text        NOT NULL,
    proof              text        NOT NULL,
    subject            text        NOT NULL,
    kind               text        NOT NULL DEFAULT '',
    seconds            integer     NOT NULL DEFAULT 0,
    -- windows: the largest count in force at a judged grant
    window_count       bigint,
    grants             bigint      NOT NULL,
    peak               bigint      NOT NULL,
    violations         bigint      NOT NULL,
    first_violation_at timestamptz,
    CONSTRAINT audit_checkpoint_subjects_pkey PRIMARY KEY (run, proof, subject, kind, seconds),
    CONSTRAINT audit_checkpoint_subjects_checkpoint_fkey FOREIGN KEY (run, proof)
        REFERENCES audit_checkpoints (run, proof) ON DELETE CASCADE
);
