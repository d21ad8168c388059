// The page's entry point: wires settings, the API-key field, the conversation list, the chat
// playground (chat.js) and the live dashboard (dashboard.js). Event handlers are attached here
// with addEventListener; the page has no inline script or handler (its CSP forbids them).

import { apiFetch, apiKey, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";
import { Store } from "./store.js";

const EXAMPLE_TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Weather forecast for a city",
      parameters: {
        type: "object",
        properties: { city: { type: "string" }, days: { type: "integer" } },
        required: ["city"],
      },
    },
  },
];
const SETTING_INPUTS = {
  system: "system-prompt",
  temperature: "temperature",
  top_p: "top-p",
  max_tokens: "max-tokens",
  tools: "tools",
};

const byId = (id) => document.getElementById(id);
const store = new Store();

function readSettings() {
  const settings = {};
  for (const [name, id] of Object.entries(SETTING_INPUTS)) settings[name] = byId(id).value;
  return settings;
}

function setupSettings() {
  const saved = store.settings();
  for (const [name, id] of Object.entries(SETTING_INPUTS)) {
    byId(id).value = saved[name];
    byId(id).addEventListener("input", () => store.saveSettings(readSettings()));
  }
  byId("tools-example").addEventListener("click", () => {
    byId("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
    store.saveSettings(readSettings());
  });
}

// The key panel shows when the server refuses us without a key (or with a wrong one).
async function checkKey(hint) {
  let response;
  try {
    response = await apiFetch("/v1/models", { cache: "no-store" });
  } catch (_) {
    setTimeout(() => checkKey(), 2000);
    return;
  }
  if (response.status === 503) {
    setTimeout(() => checkKey(), 2000);
    return;
  }
  const refused = response.status === 401;
  byId("key-panel").hidden = !refused && !apiKey();
  byId("key-hint").textContent = refused
    ? (apiKey() ? "That key was refused." : hint || "This server needs an API key.")
    : "Key accepted.";
  byId("key-panel").dataset.state = refused ? "needed" : "ok";
}

function setupKey() {
  const input = byId("api-key");
  input.value = apiKey();
  const use = () => {
    setApiKey(input.value.trim());
    checkKey();
  };
  byId("key-save").addEventListener("click", use);
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") use();
  });
  checkKey();
}

function renderConversations(chat) {
  const list = byId("conversations");
  list.replaceChildren(...store.conversations.map((conversation) => {
    const item = document.createElement("li");
    if (conversation.id === store.currentId) item.className = "current";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conversation.title || "New chat";
    open.title = conversation.title || "";
    open.addEventListener("click", () => {
      if (chat.busy) chat.stop();
      store.select(conversation.id);
      chat.render();
      renderConversations(chat);
    });
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.title = "Delete this conversation";
    remove.addEventListener("click", () => {
      if (chat.busy && conversation.id === store.currentId) chat.stop();
      store.remove(conversation.id);
      chat.render();
      renderConversations(chat);
    });
    item.append(open, remove);
    return item;
  }));
}

function showHealth(health) {
  const status = byId("server-status");
  const state = health.status === "ok" ? "ok" : health.status;
  status.dataset.state = state;
  status.textContent = state === "ok" ? "ready" : state;
  status.title = health.error ? health.error.message : "";
  if (health.model) byId("model-name").textContent = health.model;
}

function main() {
  setupSettings();
  const chat = new Chat({
    store,
    settings: readSettings,
    onUnauthorized: () => checkKey(),
    onConversationsChanged: () => renderConversations(chat),
  });
  byId("new-chat").addEventListener("click", () => {
    if (chat.busy) chat.stop();
    store.startNew();
    chat.render();
    renderConversations(chat);
    byId("chat-input").focus();
  });
  setupKey();
  chat.render();
  renderConversations(chat);
  new Dashboard(showHealth).start();
  byId("chat-input").focus();
}

main();
