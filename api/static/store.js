// Conversations and settings in the browser's localStorage (the API key is not here: api.js
// keeps it in sessionStorage).

const CONVERSATIONS = "fp4serve.conversations";
const CURRENT = "fp4serve.current";
const SETTINGS = "fp4serve.settings";
const MAX_CONVERSATIONS = 100;

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value == null ? fallback : value;
  } catch (_) {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (_) {
    // storage full or disabled: the page still works, it just forgets
  }
}

export const DEFAULT_SETTINGS = { system: "", temperature: "0.7", top_p: "", max_tokens: "512", tools: "" };

export class Store {
  constructor() {
    this.conversations = read(CONVERSATIONS, []).filter((c) => c && Array.isArray(c.messages));
    this.currentId = read(CURRENT, null);
    if (!this.current()) this.currentId = null;
  }

  current() {
    return this.conversations.find((c) => c.id === this.currentId) || null;
  }

  // The current conversation, created on first use.
  ensureCurrent() {
    let conversation = this.current();
    if (!conversation) {
      conversation = { id: String(Date.now()) + Math.random().toString(36).slice(2, 8), title: "", messages: [] };
      this.conversations.unshift(conversation);
      this.conversations.length = Math.min(this.conversations.length, MAX_CONVERSATIONS);
      this.currentId = conversation.id;
    }
    return conversation;
  }

  select(id) {
    this.currentId = id;
    this.save();
  }

  startNew() {
    this.currentId = null;
    this.save();
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = null;
    this.save();
  }

  save() {
    write(CONVERSATIONS, this.conversations);
    write(CURRENT, this.currentId);
  }

  settings() {
    return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
  }

  saveSettings(settings) {
    write(SETTINGS, settings);
  }
}
