-- The relay (`/relay/{provider}/{pool}/...`): where each provider's calls are forwarded, as an
-- operator sets it, and the trail of those settings. A provider without a row is not relayed
-- (every relay call for it is refused before anything is leased or sent).
CREATE TABLE relay_upstreams (
    provider          text        NOT NULL,
    -- https, or http on a loopback host; no user info, query or fragment (checked by the service)
    base_url          text        NOT NULL,
    -- the API the upstream speaks, for credpool's own refusals in its error shape
    api               text        NOT NULL,
    -- where the leased credential goes: `authorization` (as a bearer token) or a header of its
    -- own that carries the credential as it is (`x-api-key`)
    credential_header text        NOT NULL,
    -- how long a call waits for a free credential by default, in milliseconds
    wait_ms           integer     NOT NULL,
    -- the request header whose value is the call's affinity key, if any
    affinity_header   text,
    -- the longest the upstream may take to start its answer, and between two of its chunks
    timeout_seconds   integer     NOT NULL,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    updated_by        text        NOT NULL,
    CONSTRAINT relay_upstreams_pkey PRIMARY KEY (provider),
    CONSTRAINT relay_upstreams_api_known CHECK (api IN ('openai', 'anthropic')),
    CONSTRAINT relay_upstreams_wait_ms_range CHECK (wait_ms BETWEEN 0 AND 600000),
    CONSTRAINT relay_upstreams_timeout_range CHECK (timeout_seconds BETWEEN 1 AND 3600)
);

CREATE TABLE relay_upstream_events (
    event_id  bigint      GENERATED ALWAYS AS IDENTITY,
    provider  text        NOT NULL,
    event     text        NOT NULL,
    -- the upstream as set (`set`); null for `removed`
    upstream  jsonb,
    actor     text        NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT relay_upstream_events_pkey PRIMARY KEY (event_id),
    CONSTRAINT relay_upstream_events_event_known CHECK (event IN ('set', 'removed'))
);
