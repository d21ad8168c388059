"""The four coding-agent CLIs the agent tests drive: installed once from npm into the cache
(`~/.cache/fp4serve/agents/clis-...`, pinned versions), and each one's headless command line,
environment and config files, pointed at an fp4serve base URL with only the settings each CLI
documents (no login, no telemetry, no update checks). The README's "Coding agents" section shows
the same settings."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.host.cache_folder import build_once

# Pinned to the versions issue 26 was found with: a new CLI version changes what it sends.
# NOTE: newer Claude Code (2.1.3xx) and qwen-code (0.2x) need Node 22; these run on Node 20.
PACKAGES = {
    "claude": ("@anthropic-ai/claude-code", "2.1.197"),
    "codex": ("@openai/codex", "0.169.0"),
    "qwen": ("@qwen-code/qwen-code", "0.15.10"),
    "opencode": ("opencode-ai", "1.18.33"),
}
INSTALL_TIMEOUT_S = 900
# What npm prints when the registry cannot be reached (then the tests skip, saying so).
_OFFLINE_WORDS = (
    "ENOTFOUND",
    "EAI_AGAIN",
    "ECONNREFUSED",
    "ETIMEDOUT",
    "ENETUNREACH",
    "ECONNRESET",
    "network request",
    "getaddrinfo",
    "socket hang up",
)
API_KEY = "fp4serve-agent-tests"  # the test server's --api-key


def cli_cache_root() -> Path:
    """`$FP4SERVE_AGENT_CLI_CACHE`, else `~/.cache/fp4serve/agents`: one install per machine, not
    the per-checkout test cache, since the four CLIs take ~1.1 GB."""
    env = os.environ.get("FP4SERVE_AGENT_CLI_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp4serve" / "agents"


def install_clis() -> Path:
    """The folder whose node_modules/.bin holds the four CLIs, installed with npm on first use (one
    process installs while the others wait on a lock); a skip saying why when npm or the registry
    cannot be reached."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("the agent CLI tests install the CLIs with npm, and npm is not on PATH")
    specs = sorted(f"{name}@{version}" for name, version in PACKAGES.values())
    digest = hashlib.sha256(" ".join(specs).encode()).hexdigest()[:12]
    final = cli_cache_root() / f"clis-{digest}"
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".agent-clis-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: blocks while another test process installs

        def build(staging: Path) -> None:
            print(f"\ninstalling the agent CLIs with npm into {final} (first use only, ~1.3 GB): {' '.join(specs)}")
            command = [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--loglevel=error", *specs]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired:
                pytest.skip(f"`npm install` of the agent CLIs took over {INSTALL_TIMEOUT_S} s")
            if done.returncode != 0:
                output = (done.stderr or done.stdout)[-1500:]
                if any(word in output for word in _OFFLINE_WORDS):
                    pytest.skip(f"the npm registry is unreachable, so the agent CLIs cannot be installed: {output}")
                raise RuntimeError(f"`{' '.join(command)}` exited {done.returncode}:\n{output}")

        return build_once(final, build)


def cli_version(bin_dir: Path, name: str) -> str:
    done = subprocess.run(
        [str(bin_dir / name), "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": os.environ["PATH"], "HOME": str(bin_dir)},
    )
    return (done.stdout or done.stderr).strip().splitlines()[0]


@dataclass
class AgentRun:
    """One headless run of a CLI: its argv, environment and working folder."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    files: dict[str, str] = field(default_factory=dict)  # config files written, path -> text (for the README)
    stdin: str | None = None  # the prompt, for a CLI that takes it there

    def run(self, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=self.stdin if self.stdin is not None else "",
            check=False,
        )


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: a fresh HOME (no user config, no login), the PATH, a plain terminal."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        "CI": "1",
    }


def _write(files: dict[str, str], path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    files[str(path)] = text


def claude_code(bin_dir: Path, base_url: str, model: str, workdir: Path, home: Path, prompt: str) -> AgentRun:
    """Claude Code (`claude -p`): the Messages API at ANTHROPIC_BASE_URL (no /v1)."""
    env = _base_env(home) | {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": API_KEY,  # sent as a Bearer token; no login
        "ANTHROPIC_MODEL": model,
        # Its background calls ask for the "small" model, and subagents for the others.
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, error reports, update checks
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
    }
    argv = [
        str(bin_dir / "claude"),
        "-p",
        prompt,
        "--allowedTools",
        "Read",
        "--max-turns",
        "4",
        "--output-format",
        "json",
    ]
    return AgentRun(argv, env, workdir)


def codex(bin_dir: Path, base_url: str, model: str, workdir: Path, home: Path, prompt: str) -> AgentRun:
    """Codex CLI (`codex exec`): the Responses API of a `model_providers` entry in config.toml."""
    files: dict[str, str] = {}
    codex_home = home / ".codex"
    _write(
        files,
        codex_home / "config.toml",
        f'''model = "{model}"
model_provider = "fp4serve"
check_for_update_on_startup = false

[model_providers.fp4serve]
name = "fp4serve"
base_url = "{base_url}/v1"
env_key = "FP4SERVE_API_KEY"
wire_api = "responses"

[analytics]
enabled = false
''',
    )
    env = _base_env(home) | {"CODEX_HOME": str(codex_home), "FP4SERVE_API_KEY": API_KEY}
    argv = [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "read-only", prompt]
    return AgentRun(argv, env, workdir, files)


def qwen_code(bin_dir: Path, base_url: str, model: str, workdir: Path, home: Path, prompt: str) -> AgentRun:
    """qwen-code (`qwen -p`): chat completions at OPENAI_BASE_URL."""
    files: dict[str, str] = {}
    _write(
        files,
        home / ".qwen" / "settings.json",
        json.dumps(
            {
                "security": {"auth": {"selectedType": "openai"}},
                "privacy": {"usageStatisticsEnabled": False},
                "telemetry": {"enabled": False},
                "general": {"enableAutoUpdate": False},
            },
            indent=2,
        )
        + "\n",
    )
    env = _base_env(home) | {
        "OPENAI_BASE_URL": f"{base_url}/v1",
        "OPENAI_API_KEY": API_KEY,
        "OPENAI_MODEL": model,
        "QWEN_CODE_DISABLE_PRECONNECT": "1",
        # Its default request timeout is 120 s: a CPU server's first prefill of its ~17k-token
        # prompt can take longer (it then aborts and retries, from scratch).
        "QWEN_CODE_API_TIMEOUT_MS": "600000",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    }
    argv = [str(bin_dir / "qwen"), "-p", prompt, "--approval-mode", "yolo"]
    return AgentRun(argv, env, workdir, files)


def opencode(bin_dir: Path, base_url: str, model: str, workdir: Path, home: Path, prompt: str) -> AgentRun:
    """opencode (`opencode run`): chat completions through its `@ai-sdk/openai-compatible` provider."""
    files: dict[str, str] = {}
    _write(
        files,
        workdir / "opencode.json",
        json.dumps(
            {
                "$schema": "https://opencode.ai/config.json",
                "provider": {
                    "fp4serve": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "fp4serve",
                        "options": {"baseURL": f"{base_url}/v1", "apiKey": "{env:FP4SERVE_API_KEY}"},
                        "models": {model: {"name": model}},
                    }
                },
                "model": f"fp4serve/{model}",
                "small_model": f"fp4serve/{model}",
                "autoupdate": False,
                "share": "disabled",
            },
            indent=2,
        )
        + "\n",
    )
    env = _base_env(home) | {
        "FP4SERVE_API_KEY": API_KEY,
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # no models.dev download: the bundled snapshot
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    }
    # NOTE: the prompt goes in on stdin: `opencode run MESSAGE` wraps a message that holds spaces in
    # double quotes and escapes the quotes inside it, so the model would see `{\"name\": ...}`.
    argv = [str(bin_dir / "opencode"), "run"]
    return AgentRun(argv, env, workdir, files, stdin=prompt)


Setup = Callable[[Path, str, str, Path, Path, str], AgentRun]
SETUPS: dict[str, Setup] = {"claude": claude_code, "codex": codex, "qwen": qwen_code, "opencode": opencode}
