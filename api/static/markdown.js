// A small Markdown renderer for model output that builds DOM nodes and sets only textContent:
// no string is ever parsed as HTML, so `<script>` in a reply is shown as text. It handles what
// chat models write: fenced code (also unclosed, while streaming), headings, lists, quotes, rules,
// paragraphs, and inline code, bold, italic and http(s) links.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s*>\s?(.*)$/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
// Alternatives, in order: `code`, **bold**, *italic*, [label](target).
const INLINE = new RegExp([
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source,
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source,
  /\*(?=[^\s*])([^*]*?[^\s*])\*/.source,
  /\[([^\]\n]+)\]\(([^()\s]+)\)/.source,
].join("|"));

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function renderInline(text, parent) {
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) {
      parent.append(document.createTextNode(rest));
      return;
    }
    if (m.index > 0) parent.append(document.createTextNode(rest.slice(0, m.index)));
    if (m[1] !== undefined) {
      parent.append(el("code", "inline", m[2]));
    } else if (m[3] !== undefined) {
      const strong = el("strong");
      renderInline(m[3], strong);
      parent.append(strong);
    } else if (m[4] !== undefined) {
      const em = el("em");
      renderInline(m[4], em);
      parent.append(em);
    } else {
      parent.append(link(m[5], m[6]));
    }
    rest = rest.slice(m.index + m[0].length);
  }
}

function link(label, target) {
  let url = null;
  try {
    url = new URL(target);
  } catch (_) {
    // not an absolute URL: shown as text
  }
  if (!url || (url.protocol !== "https:" && url.protocol !== "http:")) {
    return document.createTextNode("[" + label + "](" + target + ")");
  }
  const a = el("a", "", label);
  a.href = url.href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  a.title = url.href;
  return a;
}

function codeBlock(lang, lines, closed) {
  const wrap = el("div", "code-block");
  const head = el("div", "code-head");
  head.append(el("span", "code-lang", lang || "code"));
  const copy = el("button", "copy", "copy");
  copy.type = "button";
  const body = lines.join("\n");
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(body).then(() => { copy.textContent = "copied"; }, () => {});
  });
  head.append(copy);
  const pre = el("pre");
  const code = el("code", "", body);
  if (/^[\w+#.-]+$/.test(lang)) code.dataset.lang = lang;
  if (!closed) pre.classList.add("open");
  pre.append(code);
  wrap.append(head, pre);
  return wrap;
}

function listBlock(items, ordered) {
  const list = el(ordered ? "ol" : "ul");
  for (const item of items) {
    const li = el("li");
    item.forEach((line, i) => {
      if (i > 0) li.append(el("br"));
      renderInline(line, li);
    });
    list.append(li);
  }
  return list;
}

function paragraph(lines) {
  const p = el("p");
  lines.forEach((line, i) => {
    if (i > 0) p.append(el("br"));
    renderInline(line, p);
  });
  return p;
}

// A DocumentFragment for `text`.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const marker = fence[1];
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(marker)) body.push(lines[i++]);
      const closed = i < lines.length;
      i += 1;
      out.append(codeBlock(fence[2], body, closed));
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const h = el("h" + Math.min(heading[1].length + 2, 6), "md-heading");
      renderInline(heading[2], h);
      out.append(h);
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      out.append(el("hr"));
      i += 1;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(QUOTE.exec(lines[i++])[1]);
      const q = el("blockquote");
      q.append(renderMarkdown(quoted.join("\n")));
      out.append(q);
      continue;
    }
    const first = LIST_ITEM.exec(line);
    if (first) {
      const ordered = /\d/.test(first[2]);
      const items = [];
      while (i < lines.length) {
        const item = LIST_ITEM.exec(lines[i]);
        if (item && /\d/.test(item[2]) === ordered) {
          items.push([item[3]]);
        } else if (items.length && lines[i].trim() && /^\s+/.test(lines[i]) && !FENCE.test(lines[i])) {
          items[items.length - 1].push(lines[i].trim());
        } else {
          break;
        }
        i += 1;
      }
      out.append(listBlock(items, ordered));
      continue;
    }
    const para = [];
    while (
      i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) &&
      !QUOTE.test(lines[i]) && !LIST_ITEM.test(lines[i]) && !RULE.test(lines[i])
    ) {
      para.push(lines[i++]);
    }
    out.append(paragraph(para));
  }
  return out;
}
