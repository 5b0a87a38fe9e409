"""``from_env``: the clients configured by ``CREDPOOL_URL`` and ``CREDPOOL_INTERNAL_KEY``, and the
examples built on it, which name the missing variable and exit 2."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Type, Union

import pytest

from credpool import AsyncClient, Client, MissingSetting
from harness import FakeCredpool

CLIENT = Path(__file__).resolve().parents[1]

#: Each example and the library it needs besides credpool.
EXAMPLES = [
    ("lease_async.py", None),
    ("lease_sync.py", None),
    ("openai_sdk.py", "openai"),
    ("anthropic_sdk.py", "anthropic"),
    ("litellm_router.py", "litellm"),
]

MISSING_KEY = (
    "CREDPOOL_INTERNAL_KEY is not set: export the executor key first "
    '(`eval "$(credpool env)"` exports it for the embedded default)'
)


async def test_from_env_takes_the_url_and_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CREDPOOL_URL", "http://credpool.test:9000/prefix")
    monkeypatch.setenv("CREDPOOL_INTERNAL_KEY", "ik-from-env")
    fake = FakeCredpool()
    async with AsyncClient.from_env(transport=fake.transport()) as client:
        assert repr(client) == "AsyncClient(base_url='http://credpool.test:9000/prefix')"
        async with client.lease("openai", "gpt-4o"):
            pass
    with Client.from_env(transport=fake.transport()) as sync:
        assert repr(sync) == "Client(base_url='http://credpool.test:9000/prefix')"
        with sync.lease("openai", "gpt-4o"):
            pass
    assert {headers["x-internal-key"] for _, _, headers in fake.requests} == {"ik-from-env"}


@pytest.mark.parametrize("url", [None, ""])
def test_from_env_without_a_url_talks_to_the_local_default(
    monkeypatch: pytest.MonkeyPatch, url: Optional[str]
) -> None:
    if url is None:
        monkeypatch.delenv("CREDPOOL_URL", raising=False)
    else:
        monkeypatch.setenv("CREDPOOL_URL", url)
    monkeypatch.setenv("CREDPOOL_INTERNAL_KEY", "ik-from-env")
    with Client.from_env() as client:
        assert repr(client) == "Client(base_url='http://127.0.0.1:8080')"


@pytest.mark.parametrize("key", [None, ""])
@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_from_env_without_the_key_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    key: Optional[str],
    cls: Union[Type[Client], Type[AsyncClient]],
) -> None:
    if key is None:
        monkeypatch.delenv("CREDPOOL_INTERNAL_KEY", raising=False)
    else:
        monkeypatch.setenv("CREDPOOL_INTERNAL_KEY", key)
    with pytest.raises(MissingSetting) as missing:
        cls.from_env()
    assert isinstance(missing.value, ValueError)
    assert missing.value.variable == "CREDPOOL_INTERNAL_KEY"
    assert str(missing.value) == MISSING_KEY


@pytest.mark.parametrize(("example", "needs"), EXAMPLES)
def test_an_example_without_the_key_says_so_and_exits_2(example: str, needs: Optional[str]) -> None:
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{example} needs {needs}")
    env = {k: v for k, v in os.environ.items() if k != "CREDPOOL_INTERNAL_KEY"}
    env["PYTHONPATH"] = os.pathsep.join([str(CLIENT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(CLIENT / "examples" / example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == MISSING_KEY
    assert done.stdout == ""
