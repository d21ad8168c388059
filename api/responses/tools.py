"""The Responses API's `tools`, as the functions the model sees (`ResponsesTools`): plain
`function` tools, and the functions inside a `namespace` tool (Codex sends its sub-agent tools as
`{"type": "namespace", "name": "multi_agent_v1", "tools": [...]}`), flattened into one list.

A namespaced function keeps its own name where no other tool has it (the model and the agent's
prompt both call it `spawn_agent`), else `<namespace>__<name>`. A call to it comes back as Codex
reads it: a `function_call` item with the function's own `name` and a separate `namespace` field
(codex-rs builds its handler key as `ToolName::new(namespace, name)` from those two fields, so a
flattened name would be unroutable). Replayed `function_call` items carry the same two fields.

Hosted tools (web_search, file_search, code_interpreter, image_generation, computer use, mcp,
local_shell, custom grammar tools, tool_search) are accepted as OpenAI accepts them, but this server
runs none of them: the model never sees them, and each request that sends some gets one WARNING
line naming their types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api.errors import bad_request
from api.request.messages import function_tool

NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True)
class ResponsesTools:
    tools: list[dict[str, Any]] | None  # in chat's nested shape, as the template and grammars read them
    # visible name -> (namespace, the function's own name), for namespaced functions only
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()  # the types of the tools the model does not see

    @staticmethod
    def parse(raw: Any) -> ResponsesTools:
        if raw is None:
            return ResponsesTools(None)
        if not isinstance(raw, list):
            raise bad_request("tools must be an array of tool objects", "tools")
        entries: list[tuple[str | None, dict[str, Any], str]] = []  # (namespace, function, param)
        dropped: list[str] = []
        for i, tool in enumerate(raw):
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise bad_request(f"tools[{i}] must be an object with a type", f"tools[{i}]")
            if tool["type"] == "function":
                entries.append((None, tool, f"tools[{i}]"))
            elif tool["type"] == "namespace":
                entries.extend(_namespace(tool, f"tools[{i}]"))
            else:
                dropped.append(tool["type"])
        plain = {function.get("name") for namespace, function, _ in entries if namespace is None}
        inner = [function.get("name") for namespace, function, _ in entries if namespace is not None]
        tools, namespaced = [], {}
        for namespace, function, param in entries:
            spec = {k: function[k] for k in ("name", "description", "parameters") if function.get(k) is not None}
            if namespace is not None and isinstance(spec.get("name"), str):
                own = spec["name"]
                shared = own in plain or inner.count(own) > 1
                spec["name"] = f"{namespace}{NAMESPACE_SEPARATOR}{own}" if shared else own
                namespaced[spec["name"]] = (namespace, own)
            tools.append(function_tool(spec, f"{param}.name", f"{param}.parameters"))
        return ResponsesTools(tools or None, namespaced, tuple(dict.fromkeys(dropped)))

    def visible_name(self, name: str, namespace: str | None) -> str:
        """The name the model sees for a function the client names (a replayed call, tool_choice)."""
        if namespace is None:
            return name
        return next(
            (v for v, key in self.namespaced.items() if key == (namespace, name)),
            f"{namespace}{NAMESPACE_SEPARATOR}{name}",
        )

    def wire_name(self, visible: str) -> tuple[str, str | None]:
        """(name, namespace) of a call the model made, as the client reads it back."""
        namespace, own = self.namespaced.get(visible, (None, visible))
        return own, namespace

    def tool_choice(self, raw: Any) -> Any:
        """Responses' `tool_choice` in chat's shape: a function named by its own name (with or
        without its `namespace`) becomes the name the model sees."""
        if not (isinstance(raw, dict) and raw.get("type") == "function" and "function" not in raw):
            return raw
        name, namespace = raw.get("name"), raw.get("namespace")
        if isinstance(name, str) and namespace is None and name not in self.namespaced:
            owners = [v for v, (_, own) in self.namespaced.items() if own == name]
            plain = any(t["function"]["name"] == name for t in self.tools or [])
            if len(owners) == 1 and not plain:
                name = owners[0]
        elif isinstance(name, str) and isinstance(namespace, str):
            name = self.visible_name(name, namespace)
        return {"type": "function", "function": {"name": name}}


def _namespace(tool: dict[str, Any], param: str) -> list[tuple[str | None, dict[str, Any], str]]:
    name, members = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{param}.name must be a non-empty string", f"{param}.name")
    if not isinstance(members, list):
        raise bad_request(f"{param}.tools must be an array of function tools", f"{param}.tools")
    out: list[tuple[str | None, dict[str, Any], str]] = []
    for j, member in enumerate(members):
        if not isinstance(member, dict) or member.get("type", "function") != "function":
            raise bad_request(f"{param}.tools[{j}] must be a function tool", f"{param}.tools[{j}]")
        out.append((name, member, f"{param}.tools[{j}]"))
    return out
