// The chat playground: renders a conversation, streams a reply from /v1/chat/completions
// (fetch + SSE, stream_options.include_usage for the token count) into the page as it arrives,
// and aborts it on Stop. Model output only ever reaches the page as textContent (markdown.js).

import { apiFetch, errorMessage, sseBatches } from "./api.js";
import { renderMarkdown } from "./markdown.js";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function number(value, parse) {
  const text = String(value ?? "").trim();
  if (!text) return undefined;
  const parsed = parse(text);
  return Number.isFinite(parsed) ? parsed : undefined;
}

// The tools textarea as a list, or an Error naming what is wrong with it.
export function parseTools(text) {
  if (!text.trim()) return [];
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (e) {
    return new Error("Tools: not valid JSON (" + e.message + ")");
  }
  if (!Array.isArray(tools)) return new Error("Tools: expected a JSON array of tool definitions");
  return tools;
}

function formatArguments(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch (_) {
    return text;
  }
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [(stats.approx ? "~" : "") + stats.tokens + " tokens"];
  if (stats.tps != null) parts.push(stats.tps.toFixed(1) + " tok/s");
  if (stats.ttft_ms != null) parts.push("first token " + Math.round(stats.ttft_ms) + " ms");
  if (stats.stopped) parts.push("stopped");
  else if (stats.finish && stats.finish !== "stop") parts.push(stats.finish);
  return parts.join(" · ");
}

class AssistantView {
  constructor() {
    this.root = el("div", "msg msg-assistant");
    this.root.dataset.testid = "chat-message-assistant";
    this.root.dataset.done = "false";
    this.reasoning = el("details", "reasoning");
    this.reasoning.hidden = true;
    this.reasoning.open = true;
    this.summary = el("summary", "", "Reasoning");
    this.reasoningBody = el("div", "reasoning-body");
    this.reasoning.append(this.summary, this.reasoningBody);
    this.content = el("div", "content markdown");
    this.tools = el("div", "tool-calls");
    this.error = el("div", "error");
    this.error.hidden = true;
    this.meta = el("div", "meta");
    this.root.append(this.reasoning, this.content, this.tools, this.error, this.meta);
    this.shown = { content: null, reasoning: null, tools: null };
  }

  update(message) {
    if (message.reasoning !== this.shown.reasoning) {
      this.shown.reasoning = message.reasoning;
      this.reasoning.hidden = !message.reasoning;
      this.reasoningBody.textContent = message.reasoning;
    }
    if (message.content !== this.shown.content) {
      // Fold the reasoning away once the answer starts, as a reader expects.
      if (!this.shown.content && message.content && message.reasoning) this.reasoning.open = false;
      this.shown.content = message.content;
      this.content.replaceChildren(renderMarkdown(message.content));
    }
    const calls = JSON.stringify(message.tool_calls);
    if (calls !== this.shown.tools) {
      this.shown.tools = calls;
      this.tools.replaceChildren(...message.tool_calls.map((call) => {
        const box = el("div", "tool-call");
        box.dataset.testid = "tool-call";
        box.append(el("div", "tool-name", "tool call: " + call.function.name));
        box.append(el("pre", "tool-args", formatArguments(call.function.arguments)));
        return box;
      }));
    }
  }

  finish(message) {
    this.update(message);
    const characters = message.reasoning.length;
    this.summary.textContent = characters ? "Reasoning (" + characters + " characters)" : "Reasoning";
    this.error.hidden = !message.error;
    this.error.textContent = message.error || "";
    this.meta.textContent = statsText(message.stats);
    this.root.dataset.done = "true";
  }
}

export class Chat {
  constructor({ store, settings, onUnauthorized, onConversationsChanged }) {
    this.store = store;
    this.settings = settings; // () => settings object
    this.onUnauthorized = onUnauthorized;
    this.onConversationsChanged = onConversationsChanged;
    this.messages = document.getElementById("messages");
    this.input = document.getElementById("chat-input");
    this.sendButton = document.getElementById("chat-send");
    this.stopButton = document.getElementById("chat-stop");
    this.toolsError = document.getElementById("tools-error");
    this.controller = null;
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    this.sendButton.addEventListener("click", () => this.send());
    this.stopButton.addEventListener("click", () => this.stop());
  }

  get busy() {
    return this.controller !== null;
  }

  render() {
    const conversation = this.store.current();
    const views = [];
    for (const message of conversation ? conversation.messages : []) {
      if (message.role === "user") {
        views.push(this.userView(message.content));
      } else {
        const view = new AssistantView();
        view.finish(message);
        views.push(view.root);
      }
    }
    if (!views.length) {
      views.push(el("p", "empty", "Send a message to start. Enter sends, Shift+Enter adds a new line."));
    }
    this.messages.replaceChildren(...views);
    this.scroll(true);
  }

  userView(text) {
    const root = el("div", "msg msg-user");
    root.dataset.testid = "chat-message-user";
    root.append(el("div", "bubble", text));
    return root;
  }

  scroll(force) {
    const box = this.messages;
    if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  }

  requestBody(conversation) {
    const s = this.settings();
    const messages = [];
    if (s.system.trim()) messages.push({ role: "system", content: s.system });
    for (const m of conversation.messages) {
      if (m.role === "user") {
        messages.push({ role: "user", content: m.content });
      } else if (m.content || m.tool_calls.length) {
        const turn = { role: "assistant", content: m.content };
        if (m.tool_calls.length) turn.tool_calls = m.tool_calls;
        messages.push(turn);
      }
    }
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    const temperature = number(s.temperature, parseFloat);
    const topP = number(s.top_p, parseFloat);
    const maxTokens = number(s.max_tokens, (t) => parseInt(t, 10));
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    const tools = parseTools(s.tools);
    if (tools.length) body.tools = tools;
    return body;
  }

  async send() {
    const text = this.input.value;
    if (this.busy || !text.trim()) return;
    const tools = parseTools(this.settings().tools);
    this.toolsError.hidden = !(tools instanceof Error);
    if (tools instanceof Error) {
      this.toolsError.textContent = tools.message;
      return;
    }
    const conversation = this.store.ensureCurrent();
    if (!conversation.messages.length) this.messages.replaceChildren();
    conversation.messages.push({ role: "user", content: text });
    if (!conversation.title) conversation.title = text.trim().slice(0, 48);
    const body = this.requestBody(conversation);
    this.input.value = "";
    this.messages.append(this.userView(text));
    const message = { role: "assistant", content: "", reasoning: "", tool_calls: [], stats: null, error: null };
    conversation.messages.push(message);
    this.store.save();
    this.onConversationsChanged();
    const view = new AssistantView();
    this.messages.append(view.root);
    this.scroll(true);
    await this.stream(body, message, view);
    this.store.save();
  }

  async stream(body, message, view) {
    this.controller = new AbortController();
    this.sendButton.disabled = true;
    this.stopButton.disabled = false;
    const started = performance.now();
    let first = null, last = null, chunks = 0, usage = null, finish = null, stopped = false;
    try {
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: this.controller.signal,
      });
      if (!response.ok) {
        if (response.status === 401) this.onUnauthorized();
        throw new Error(await errorMessage(response));
      }
      for await (const batch of sseBatches(response)) {
        for (const data of batch) {
          if (data === "[DONE]") continue;
          const event = JSON.parse(data);
          if (event.error) throw new Error(event.error.message || "the stream ended with an error");
          if (event.usage) usage = event.usage;
          for (const choice of event.choices || []) {
            if (this.applyDelta(message, choice.delta || {})) {
              chunks += 1;
              last = performance.now();
              if (first === null) first = last;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
        view.update(message);
        this.scroll(false);
      }
    } catch (error) {
      if (error.name === "AbortError") stopped = true;
      else message.error = error.message || String(error);
    } finally {
      const tokens = usage ? usage.completion_tokens : chunks;
      message.stats = chunks || usage ? {
        tokens,
        approx: !usage,
        tps: first !== null && last > first && tokens > 1 ? ((tokens - 1) * 1000) / (last - first) : null,
        ttft_ms: first === null ? null : first - started,
        finish,
        stopped,
      } : (stopped ? { tokens: 0, approx: true, tps: null, ttft_ms: null, finish, stopped } : null);
      view.finish(message);
      this.controller = null;
      this.sendButton.disabled = false;
      this.stopButton.disabled = true;
      this.scroll(false);
    }
  }

  // True when the delta carried output (content, reasoning or a tool call).
  applyDelta(message, delta) {
    let output = false;
    if (delta.content) {
      message.content += delta.content;
      output = true;
    }
    if (delta.reasoning_content) {
      message.reasoning += delta.reasoning_content;
      output = true;
    }
    for (const call of delta.tool_calls || []) {
      const index = call.index ?? 0;
      const slot = message.tool_calls[index] ||= { id: "", type: "function", function: { name: "", arguments: "" } };
      if (call.id) slot.id = call.id;
      if (call.function?.name) slot.function.name += call.function.name;
      if (call.function?.arguments) slot.function.arguments += call.function.arguments;
      output = true;
    }
    return output;
  }

  stop() {
    if (this.controller) this.controller.abort();
  }
}
