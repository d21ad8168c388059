// The live dashboard: /stats once a second (open, like /metrics), /health for the model,
// device and backend, and /v1/usage (with the page's key) for the usage by key. Percentiles come from the server (over its last minute); the charts keep
// the last five minutes of them here.

import { LineChart } from "./chart.js";
import { UsageTable } from "./usage.js";

const POLL_MS = 1000;
const HEALTH_EVERY = 5; // polls between /health reads
const SPAN_MS = 5 * 60 * 1000;
const PERCENTILES = [
  { name: "p50", color: "#2f7d4f" },
  { name: "p90", color: "#c98a12" },
  { name: "p99", color: "#b23b3b" },
];

function byId(id) {
  return document.getElementById(id);
}

function setText(id, text) {
  const node = byId(id);
  if (node.textContent !== text) node.textContent = text;
}

function ms(seconds) {
  return seconds == null ? null : seconds * 1000;
}

function percent(ratio) {
  return ratio == null ? "–" : (100 * ratio).toFixed(1) + "%";
}

function legend(id, latency) {
  const node = byId(id);
  node.replaceChildren();
  for (const p of PERCENTILES) {
    const item = document.createElement("span");
    item.className = "legend-" + p.name;
    const value = latency[p.name];
    item.textContent = p.name + " " + (value == null ? "–" : Math.round(value * 1000));
    node.append(item);
  }
}

export class Dashboard {
  constructor(onHealth) {
    this.onHealth = onHealth;
    this.polls = 0;
    this.ttft = new LineChart(byId("ttft-chart"), PERCENTILES, SPAN_MS);
    this.itl = new LineChart(byId("itl-chart"), PERCENTILES, SPAN_MS);
    this.rate = new LineChart(byId("rate-chart"), [{ name: "tok/s", color: "#2f5d8a" }], SPAN_MS);
    this.usage = new UsageTable(byId("usage-rows"), byId("usage-hint"));
  }

  start() {
    this.tick();
  }

  async tick() {
    try {
      if (document.hidden) return; // a background tab costs the server nothing
      if (this.polls % HEALTH_EVERY === 0) await this.readHealth();
      await this.readStats();
      await this.usage.refresh();
    } catch (error) {
      this.onHealth({ status: "unreachable", error: { message: String(error) } });
    } finally {
      this.polls += 1;
      setTimeout(() => this.tick(), POLL_MS);
    }
  }

  async readHealth() {
    const response = await fetch("/health", { cache: "no-store" });
    const health = await response.json();
    this.onHealth(health);
    if (health.status !== "ok") return;
    setText("info-model", health.model);
    setText("info-device", health.device);
    setText("info-backend", health.attention_backend);
    setText("info-dtype", health.dtype);
    setText("info-context", health.max_model_len.toLocaleString("en-US") + " tokens");
  }

  async readStats() {
    const response = await fetch("/stats", { cache: "no-store" });
    if (!response.ok) return;
    const s = await response.json();
    setText("metric-running", String(s.requests.running));
    setText("metric-waiting", String(s.requests.waiting));
    setText("metric-kv-usage", percent(s.kv_cache.usage));
    byId("kv-bar").style.width = Math.min(100, 100 * s.kv_cache.usage).toFixed(1) + "%";
    setText("metric-prefix-hit-rate", percent(s.prefix_cache.hit_rate));
    const host = s.host_kv; // --kv-offloading-size: what the host tier holds and served
    byId("tile-host-kv").hidden = !host;
    if (host) {
      const mib = (bytes) => (bytes / 1048576).toFixed(bytes < 10485760 ? 1 : 0);
      setText("metric-host-kv", `${mib(host.used_bytes)} / ${mib(host.capacity_bytes)} MiB`);
      byId("host-kv-bar").style.width = Math.min(100, (100 * host.used_bytes) / host.capacity_bytes).toFixed(1) + "%";
      byId("tile-host-kv").title =
        `${host.pages} pages, ${host.snapshots} snapshots; ${host.hit_tokens} prompt tokens served, ` +
        `${host.page_loads} pages loaded, ${host.page_spills} spilled`;
    }
    setText("metric-generation-rate", s.tokens.generation_per_s.toFixed(1));
    setText("metric-generation-tokens", String(s.tokens.generation_total));
    const now = Date.now();
    const { ttft_s: ttft, itl_s: itl } = s.latency;
    this.ttft.push(now, PERCENTILES.map((p) => ms(ttft[p.name])));
    this.itl.push(now, PERCENTILES.map((p) => ms(itl[p.name])));
    this.rate.push(now, [s.tokens.generation_per_s]);
    legend("ttft-legend", ttft);
    legend("itl-legend", itl);
    setText(
      "window-hint",
      `Percentiles over the last ${Math.round(s.latency.window_s)} s (${ttft.count} TTFT and ` +
        `${itl.count} ITL samples); charts show up to the last 5 minutes.`,
    );
  }
}
