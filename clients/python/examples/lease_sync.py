"""One lease, start to end, with threads: ``credpool.Client``, the synchronous twin of
``AsyncClient``, renews the lease from a background thread while the block runs.

Against a service that holds a credential for openai/gpt-4o in pool ``default`` (the README's
Quickstart, steps 3 to 5), after ``pip install ./clients/python``::

    CREDPOOL_INTERNAL_KEY=... python clients/python/examples/lease_sync.py

``CREDPOOL_URL`` names another service than http://127.0.0.1:8080. The upstream call is a
stand-in defined below: replace it with your SDK's.
"""

import sys
import time

from credpool import Client, MissingSetting


def call_upstream(api_key: str) -> str:
    """A stand-in for the upstream call made with the leased credential (an LLM request)."""
    time.sleep(0.1)
    return "the upstream answered" if api_key else "no api_key in the credential"


def main() -> None:
    # the service and the executor key: CREDPOOL_URL and CREDPOOL_INTERNAL_KEY
    with Client.from_env() as client:
        with client.lease("openai", "gpt-4o", wait=5.0) as lease:
            answer = call_upstream(lease.credential["api_key"])
        print(answer)
        print(f"released: {lease.released}")


if __name__ == "__main__":
    try:
        main()
    except MissingSetting as e:  # no CREDPOOL_INTERNAL_KEY: say so, and exit 2
        print(e, file=sys.stderr)
        sys.exit(2)
