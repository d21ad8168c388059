"""Fixtures of the agent tests: the agent test models (written once under the test cache, in
seconds, fp4serve_tools/agent_model.py), a real server running one of them with the parsers the
README tells agents to use, behind a recording proxy, and the CLIs installed from npm."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fp4serve_tools.agent_model import JSON_FORMAT, XML_FORMAT, ensure_agent_model
from tests.agents.clis import install_clis
from tests.agents.harness import AgentServer, agent_server


@pytest.fixture(scope="session")
def agent_model() -> Path:
    return ensure_agent_model(JSON_FORMAT)


@pytest.fixture(scope="session")
def agent_model_xml() -> Path:
    return ensure_agent_model(XML_FORMAT)


@pytest.fixture(scope="session")
def cli_bin() -> Path:
    return install_clis() / "node_modules" / ".bin"


# One server for every test of this folder (it idles to the end of the session): the model tests
# only read, and each CLI test clears the proxy and reads only the log lines after its own start.
@pytest.fixture(scope="session")
def served_agent(agent_model: Path) -> Iterator[AgentServer]:
    with agent_server(agent_model) as server:
        yield server
