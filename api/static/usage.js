// The dashboard's "Usage by key" table: GET /v1/usage with the page's API key, so the server's
// own rule decides what shows (an admin key: every key; another key: its own; no keys configured:
// the one "default" key). /stats stays open and never carries per-key numbers. Cells are text only.

import { apiFetch, apiKey } from "./api.js";

const COLUMNS = ["requests", "prompt_tokens", "completion_tokens"];

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function row(usage) {
  const tr = document.createElement("tr");
  tr.dataset.key = usage.key;
  const name = document.createElement("th");
  name.scope = "row";
  name.textContent = usage.key;
  const ttft = usage.mean_ttft_seconds == null ? "–" : String(Math.round(usage.mean_ttft_seconds * 1000));
  tr.append(name, ...COLUMNS.map((column) => cell(String(usage[column]))), cell(ttft));
  return tr;
}

export class UsageTable {
  constructor(body, hint) {
    this.body = body;
    this.hint = hint;
    this.refusedKey = null; // the key /v1/usage last refused: not asked again until it changes
  }

  async refresh() {
    const key = apiKey();
    if (key === this.refusedKey) return;
    const response = await apiFetch("/v1/usage", { cache: "no-store" });
    if (response.status === 401) {
      this.refusedKey = key;
      this.body.replaceChildren();
      this.hint.textContent = "Enter an API key to see its usage.";
      return;
    }
    if (!response.ok) return;
    this.refusedKey = null;
    const usage = await response.json();
    this.body.replaceChildren(...usage.data.map(row));
    this.hint.textContent = usage.data.length === 1 && usage.data[0].key === usage.key
      ? `This page's key ("${usage.key}") since start.`
      : `${usage.data.length} keys since start (seen with the admin key "${usage.key}").`;
  }
}
