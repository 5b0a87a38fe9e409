"""One lease, start to end, with asyncio: allocate a credential, use it in an upstream call
while the client renews the lease, and release it with the call's outcome.

Against a service that holds a credential for openai/gpt-4o in pool ``default`` (the README's
Quickstart, steps 3 to 5), after ``pip install ./clients/python``::

    CREDPOOL_INTERNAL_KEY=... python clients/python/examples/lease_async.py

``CREDPOOL_URL`` names another service than http://127.0.0.1:8080. The upstream call is a
stand-in defined below: replace it with your SDK's.
"""

import asyncio
import sys

from credpool import AsyncClient, MissingSetting, PoolExhausted


class UpstreamRateLimit(Exception):
    """What the stand-in upstream raises for a 429, like an SDK's rate-limit error."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"rate limited; retry after {retry_after} s")
        self.retry_after = retry_after


async def call_upstream(api_key: str) -> str:
    """A stand-in for the upstream call made with the leased credential (an LLM request)."""
    await asyncio.sleep(0.1)
    if not api_key:
        raise UpstreamRateLimit(retry_after=5.0)
    return "the upstream answered"


async def main() -> None:
    # the service and the executor key: CREDPOOL_URL and CREDPOOL_INTERNAL_KEY
    async with AsyncClient.from_env() as client:
        try:
            async with client.lease(
                "openai", "gpt-4o", pool="default", holder="worker-7", lease_seconds=35, wait=5.0
            ) as lease:
                # also lease.key_id, .lease_id, .fence, .pool, .provider_model, .lease_until, .probe
                api_key = lease.credential["api_key"]
                try:
                    answer = await call_upstream(api_key)
                except UpstreamRateLimit as e:
                    # the outcome sent at release
                    lease.report("rate_limited", retry_after=e.retry_after)
                    raise
                print(answer)
            # leaving the block released: the reported outcome, else "success", else "failure"
            # if the block raised
            print(f"released: {lease.released}")
        except PoolExhausted as e:
            print(f"nothing freed within 5 s; retry after {e.retry_after} s")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except MissingSetting as e:  # no CREDPOOL_INTERNAL_KEY: say so, and exit 2
        print(e, file=sys.stderr)
        sys.exit(2)
