// Requests to this server only: relative paths resolved against the page's own origin, with the
// API key (kept in sessionStorage, this tab only) added as a Bearer token. The CSP's connect-src
// 'self' enforces the same rule in the browser.

const KEY_STORAGE = "fp4serve.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

export function apiFetch(path, init = {}) {
  const url = new URL(path, window.location.origin);
  if (url.origin !== window.location.origin) {
    throw new Error("refusing to send a request to another origin: " + url.origin);
  }
  const headers = new Headers(init.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", "Bearer " + key);
  return fetch(url, { ...init, headers, credentials: "same-origin", referrerPolicy: "no-referrer" });
}

// An OpenAI-style error body's message, or the status line.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    // not JSON: fall through
  }
  return "HTTP " + response.status + " " + response.statusText;
}

// The `data:` payloads of a server-sent-event stream, yielded as one array per network read,
// so that the caller renders once per read however many events it held.
export async function* sseBatches(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    const batch = [];
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) batch.push(data);
    }
    if (batch.length) yield batch;
  }
}
