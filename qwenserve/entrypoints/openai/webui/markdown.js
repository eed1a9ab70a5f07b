// A small Markdown renderer for the chat's answers: paragraphs, emphasis, inline code, links, headings, lists,
// block quotes, rules, GFM tables and fenced code blocks (with a Copy button). The model's text is untrusted: every
// piece of it is HTML-escaped, raw HTML shows as text, links go only to http(s), mailto or relative targets, and
// images become links (an <img> would fetch whatever URL the text names). Each top-level block renders to one
// element, so a streamed answer re-renders by replacing only the blocks that changed (renderMarkdownInto).
"use strict";

const MD_ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const mdEscape = (s) => s.replace(/[&<>"']/g, (c) => MD_ESCAPES[c]);

// ---------------------------------------------------------------- links

// The URL to link to, or null: a scheme other than http, https or mailto (javascript:, data:, vbscript:) is refused.
// Browsers drop tabs, newlines and other controls inside a URL, so "java\tscript:" is checked without them.
function mdSafeUrl(url) {
  const scheme = url.replace(/[\u0000-\u0020\u007f]/g, "").match(/^([a-z][a-z0-9+.-]*):/i);
  if (scheme && !["http", "https", "mailto"].includes(scheme[1].toLowerCase())) return null;
  const href = url.trim().replace(/[\u0000-\u0020\u007f]/g, (c) => `%${c.charCodeAt(0).toString(16).padStart(2, "0")}`);
  return href || null;
}

function mdLink(url, labelHtml, title) {
  const href = mdSafeUrl(url);
  if (href === null) return labelHtml;  // the text stays; the target does not
  const t = title ? ` title="${mdEscape(title)}"` : "";
  return `<a href="${mdEscape(href)}"${t} target="_blank" rel="noopener noreferrer">${labelHtml}</a>`;
}

// ---------------------------------------------------------------- inline

const PUNCT = /[!-/:-@[-`{-~\p{P}\p{S}]/u;
const isSpace = (c) => c === undefined || /\s/.test(c);  // the text's ends count as space
const isPunct = (c) => c !== undefined && PUNCT.test(c);

// For each "[" of s, the index of its matching "]" (nesting counted, escaped brackets skipped), in one pass.
function matchBrackets(s) {
  const match = new Map(), open = [];
  for (let j = 0; j < s.length; j++) {
    if (s[j] === "\\") j++;
    else if (s[j] === "[") open.push(j);
    else if (s[j] === "]" && open.length) match.set(open.pop(), j);
  }
  return match;
}

// [label](destination "title") with its "[" at s[i]: {label, url, title, end} or null.
const DESTINATION = /\(\s*(?:<([^<>\n]*)>|((?:[^\s()\\]|\\.|\((?:[^\s()\\]|\\.)*\))*))(?:\s+("[^"]*"|'[^']*'))?\s*\)/y;

function mdParseLink(s, i, brackets) {
  const j = brackets.get(i);
  if (j === undefined) return null;
  DESTINATION.lastIndex = j + 1;
  const m = DESTINATION.exec(s);
  if (!m) return null;
  const url = (m[1] ?? m[2]).replace(/\\([!-/:-@[-`{-~])/g, "$1");
  return { label: s.slice(i + 1, j), url, title: m[3] ? m[3].slice(1, -1) : "", end: DESTINATION.lastIndex };
}

const AUTOLINK = /<((?:https?|mailto):[^\s<>]+)>/iy;
// a bare URL; its trailing punctuation is the sentence's, not the URL's
const BARE_URL = /https?:\/\/[^\s<>]*[^\s<>?!.,:;*_~'")\]]/y;

// One paragraph's (or heading's, or cell's) text as HTML. Code spans, links and escapes are read left to right;
// emphasis follows CommonMark's delimiter runs (flanking, the rule of three), strikethrough is GFM's ~~.
// Results are kept for the texts of recent calls: while an answer streams, its finished paragraphs come again on
// every render, unchanged. The cache is emptied past INLINE_CACHE_CHARS of text (the paragraph still streaming
// adds a longer key every frame).
const inlineCache = new Map();
const INLINE_CACHE_CHARS = 1 << 20;
let inlineCacheChars = 0;

function mdInline(s, inLink = false) {
  const key = (inLink ? "1" : "0") + s;
  let html = inlineCache.get(key);
  if (html === undefined) {
    html = mdInlineUncached(s, inLink);
    if (inlineCacheChars + key.length > INLINE_CACHE_CHARS) {
      inlineCache.clear();
      inlineCacheChars = 0;
    }
    inlineCache.set(key, html);
    inlineCacheChars += key.length;
  }
  return html;
}

const PLAIN = /[^\\\n`[!<h*_~]+/y;  // a run of characters none of the rules below starts at

function mdInlineUncached(s, inLink) {
  const nodes = [];  // HTML strings and delimiter runs {ch, n, orig, open, close, before, after}
  const noCloser = new Set();  // backtick run lengths with no closing run further on
  let brackets = null;  // matchBrackets(s), once a "[" needs it
  let i = 0, text = "";
  const flush = () => { if (text) { nodes.push(mdEscape(text)); text = ""; } };
  while (i < s.length) {
    PLAIN.lastIndex = i;
    if (PLAIN.test(s)) {
      text += s.slice(i, PLAIN.lastIndex);
      i = PLAIN.lastIndex;
      continue;
    }
    const c = s[i];
    if (c === "\\" && i + 1 < s.length && /[!-/:-@[-`{-~]/.test(s[i + 1])) {
      text += s[i + 1];
      i += 2;
    } else if (c === "\\" && s[i + 1] === "\n") {
      flush(); nodes.push("<br>");
      i += 2;
    } else if (c === "\n") {
      flush(); nodes.push("<br>");  // a chat answer's line breaks are meant: each one shows
      i += 1;
    } else if (c === "`") {
      let n = 1;
      while (s[i + n] === "`") n++;
      let close = -1;
      if (!noCloser.has(n)) {
        for (let j = s.indexOf("`", i + n); j >= 0; j = s.indexOf("`", j)) {
          let m = 1;
          while (s[j + m] === "`") m++;
          if (m === n) { close = j; break; }
          j += m;
        }
        if (close < 0) noCloser.add(n);
      }
      if (close < 0) {
        text += "`".repeat(n);
        i += n;
      } else {
        let code = s.slice(i + n, close).replace(/\n/g, " ");
        if (code.startsWith(" ") && code.endsWith(" ") && /[^ ]/.test(code)) code = code.slice(1, -1);
        flush(); nodes.push(`<code>${mdEscape(code)}</code>`);
        i = close + n;
      }
    } else if (!inLink && (c === "[" || (c === "!" && s[i + 1] === "["))) {
      const image = c === "!";
      brackets ??= matchBrackets(s);
      const link = mdParseLink(s, image ? i + 1 : i, brackets);
      if (!link) {
        text += c;
        i += 1;
      } else {
        flush();
        // an image is shown as a link to it, labelled with its alt text
        const label = image ? mdEscape(link.label || link.url) : mdInline(link.label, true);
        nodes.push(mdLink(link.url, label, link.title));
        i = link.end;
      }
    } else if (!inLink && c === "<" && (AUTOLINK.lastIndex = i, AUTOLINK.test(s))) {
      const url = s.slice(i + 1, AUTOLINK.lastIndex - 1);
      flush(); nodes.push(mdLink(url, mdEscape(url)));
      i = AUTOLINK.lastIndex;
    } else if (!inLink && c === "h" && !/\w/.test(s[i - 1] || "") && (BARE_URL.lastIndex = i, BARE_URL.test(s))) {
      const url = s.slice(i, BARE_URL.lastIndex);
      flush(); nodes.push(mdLink(url, mdEscape(url)));
      i = BARE_URL.lastIndex;
    } else if (c === "*" || c === "_" || c === "~") {
      let n = 1;
      while (s[i + n] === c) n++;
      const before = s[i - 1], after = s[i + n];
      const left = !isSpace(after) && (!isPunct(after) || isSpace(before) || isPunct(before));
      const right = !isSpace(before) && (!isPunct(before) || isSpace(after) || isPunct(after));
      let open = left, close = right;
      if (c === "_") {  // snake_case_words are not emphasis
        open = left && (!right || isPunct(before));
        close = right && (!left || isPunct(after));
      }
      if (c === "~" && n !== 2) open = close = false;
      flush();
      nodes.push({ ch: c, n, orig: n, open, close, before: "", after: "" });
      i += n;
    } else {
      text += c;
      i += 1;
    }
  }
  flush();
  mdEmphasis(nodes);
  return nodes.map((d) => (typeof d === "string" ? d : d.before + d.ch.repeat(d.n) + d.after)).join("");
}

// CommonMark's "process emphasis", simplified: each closer, left to right, takes the nearest opener of its kind.
// Matched characters turn into tags on the runs (opening tags after the opener's chars, closing ones before the
// closer's); runs between a matched pair can no longer match.
function mdEmphasis(nodes) {
  const bottom = new Map();  // per kind of closer: no opener lies below this index
  for (let c = 0; c < nodes.length; c++) {
    const closer = nodes[c];
    if (typeof closer === "string" || !closer.close) continue;
    const kind = `${closer.ch}${closer.open}${closer.orig % 3}`;
    while (closer.n > 0) {
      let o = c - 1;
      for (; o >= (bottom.get(kind) ?? 0); o--) {
        const d = nodes[o];
        if (typeof d === "string" || !d.open || d.ch !== closer.ch || d.n === 0) continue;
        if (closer.ch === "~" && d.n !== closer.n) continue;
        const odd = (d.close || closer.open) && (d.orig + closer.orig) % 3 === 0 && (d.orig % 3 || closer.orig % 3);
        if (!odd) break;
      }
      if (o < (bottom.get(kind) ?? 0)) {
        bottom.set(kind, c);
        break;
      }
      const opener = nodes[o];
      const use = closer.ch === "~" ? 2 : opener.n >= 2 && closer.n >= 2 ? 2 : 1;
      const tag = closer.ch === "~" ? "del" : use === 2 ? "strong" : "em";
      opener.n -= use;
      closer.n -= use;
      opener.after = `<${tag}>` + opener.after;
      closer.before += `</${tag}>`;
      for (let k = o + 1; k < c; k++) if (typeof nodes[k] !== "string") nodes[k].open = nodes[k].close = false;
    }
  }
}

// ---------------------------------------------------------------- blocks

const FENCE = /^( {0,3})(`{3,}|~{3,})(.*)$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( {0,3})([-*+]|(\d{1,9})[.)])([ \t]+|$)/;
const TABLE_DELIMITER = /^ {0,3}\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const isBlank = (line) => /^\s*$/.test(line);

function isFence(line) {
  const m = line.match(FENCE);
  return m && !(m[2][0] === "`" && m[3].includes("`"));
}

// Whether `line` starts a block that ends the paragraph before it.
function interruptsParagraph(line) {
  if (isFence(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)) return true;
  const item = line.match(ITEM);  // a list interrupts only with text, and a numbered one only from 1
  return Boolean(item && item[4] && !isBlank(line.slice(item[0].length)) && (item[3] === undefined || item[3] === "1"));
}

function splitCells(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  const cells = [];
  let cell = "";
  for (let k = 0; k < row.length; k++) {
    if (row[k] === "\\" && row[k + 1] === "|") { cell += "|"; k++; }
    else if (row[k] === "|") { cells.push(cell.trim()); cell = ""; }
    else cell += row[k];
  }
  cells.push(cell.trim());
  return cells;
}

function isTableStart(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && TABLE_DELIMITER.test(lines[i + 1])
    && lines[i + 1].includes("-") && splitCells(lines[i]).length === splitCells(lines[i + 1]).length;
}

function codeBlock(code, info) {
  const lang = (info.match(/^[\w+#.-]+/) || [""])[0];
  const cls = lang ? ` class="language-${mdEscape(lang)}"` : "";
  return `<div class="code-block"><div class="code-head"><span class="code-lang">${mdEscape(lang)}</span>`
    + `<button type="button" class="copy-code">Copy</button></div>`
    + `<pre><code${cls}>${mdEscape(code)}</code></pre></div>`;
}

// Lines to top-level blocks, each one HTML string with one root element. `tight`: paragraphs without <p> (the
// items of a list with no blank line between them).
function mdBlocks(lines, tight = false) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (isBlank(line)) {
      i++;
    } else if (isFence(line)) {  // runs to its closing fence, or to the end while it is still streaming
      m = line.match(FENCE);
      const indent = m[1].length, fence = m[2];
      const body = [];
      for (i++; i < lines.length; i++) {
        const close = lines[i].match(/^ {0,3}(`{3,}|~{3,})[ \t]*$/);
        if (close && close[1][0] === fence[0] && close[1].length >= fence.length) { i++; break; }
        body.push(lines[i].replace(new RegExp(`^ {0,${indent}}`), ""));
      }
      out.push(codeBlock(body.join("\n"), m[3].trim()));
    } else if ((m = line.match(HEADING))) {
      const level = m[1].length;
      const text = (m[2] || "").replace(/(^|[ \t]+)#+$/, "");
      out.push(`<h${level}>${mdInline(text)}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) inner.push(lines[i].replace(QUOTE, ""));
      out.push(`<blockquote>${mdBlocks(inner).join("")}</blockquote>`);
    } else if ((m = line.match(ITEM))) {
      const list = mdList(lines, i);
      out.push(list.html);
      i = list.end;
    } else if (isTableStart(lines, i)) {
      const aligns = splitCells(lines[i + 1]).map((c) =>
        c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
      const row = (cells, tag) => "<tr>" + aligns.map((a, k) =>
        `<${tag}${a ? ` style="text-align:${a}"` : ""}>${mdInline(cells[k] ?? "")}</${tag}>`).join("") + "</tr>";
      let html = `<div class="table-wrap"><table><thead>${row(splitCells(lines[i]), "th")}</thead><tbody>`;
      for (i += 2; i < lines.length && !isBlank(lines[i]) && lines[i].includes("|"); i++) {
        html += row(splitCells(lines[i]), "td");
      }
      out.push(html + "</tbody></table></div>");
    } else {
      const para = [line.trim()];
      for (i++; i < lines.length && !isBlank(lines[i]) && !interruptsParagraph(lines[i]) && !isTableStart(lines, i);
        i++) para.push(lines[i].trim());
      const html = mdInline(para.join("\n"));
      out.push(tight ? `<span>${html}</span>` : `<p>${html}</p>`);
    }
  }
  return out;
}

// The list starting at lines[start]: its items run on while the next item has the same kind of marker; an item's
// own lines are those indented to its text (and unindented lines that continue its paragraph).
function mdList(lines, start) {
  const first = lines[start].match(ITEM);
  const ordered = first[3] !== undefined;
  const marker = ordered ? first[2].slice(-1) : first[2];
  const items = [];
  let i = start, loose = false, gap = false;
  while (i < lines.length && !RULE.test(lines[i])) {
    const m = lines[i].match(ITEM);
    if (!m || (m[3] !== undefined) !== ordered || (ordered ? m[2].slice(-1) : m[2]) !== marker) break;
    if (gap) loose = true;  // a blank line between items
    const spaces = m[4].length;
    const width = m[1].length + m[2].length + (spaces === 0 || spaces > 4 ? 1 : spaces);
    const body = [lines[i].slice(m[0].length - (spaces > 4 ? spaces - 1 : 0))];
    let blankBefore = false;
    for (i++; i < lines.length; i++) {
      const line = lines[i];
      if (isBlank(line)) { body.push(""); blankBefore = true; continue; }
      const indent = line.match(/^ */)[0].length;
      if (indent >= width) body.push(line.slice(width));
      else if (!blankBefore && !ITEM.test(line) && !interruptsParagraph(line)) body.push(line);  // lazy line
      else break;
      if (blankBefore) loose = true;  // a blank line inside an item
      blankBefore = false;
    }
    while (body.length && isBlank(body[body.length - 1])) body.pop();
    items.push(body);
    gap = blankBefore;  // the list goes on after a blank line only with its next item
    if (gap && !(i < lines.length && ITEM.test(lines[i]))) break;
  }
  const tag = ordered ? "ol" : "ul";
  const from = ordered && Number(first[3]) !== 1 ? ` start="${Number(first[3])}"` : "";
  const html = `<${tag}${from}>` + items.map((body) => `<li>${mdBlocks(body, !loose).join("")}</li>`).join("")
    + `</${tag}>`;
  return { html, end: i };
}

// ---------------------------------------------------------------- entry points

function markdownBlocks(text) {
  return mdBlocks(text.replace(/\r\n?/g, "\n").split("\n"));
}

function renderMarkdown(text) {
  return markdownBlocks(text).join("");
}

const mdTemplate = document.createElement("template");

// Renders `text` into `el`, keeping the elements of blocks that have not changed since the last call: while an
// answer streams only its last block or two are rebuilt, and a selection or a Copy button under the pointer in an
// earlier block stays. el.markdownSource is the text it shows.
function renderMarkdownInto(el, text) {
  const blocks = markdownBlocks(text);
  const old = [...el.children];
  blocks.forEach((html, k) => {
    if (old[k]?.markdownHtml === html) return;
    mdTemplate.innerHTML = html;
    const node = mdTemplate.content.firstElementChild;
    node.markdownHtml = html;
    if (old[k]) old[k].replaceWith(node);
    else el.append(node);
  });
  for (const extra of old.slice(blocks.length)) extra.remove();
  el.markdownSource = text;
}

// ---------------------------------------------------------------- copy buttons

// navigator.clipboard needs a secure context (https, or localhost); over plain http from another machine the page
// falls back to a selected, hidden textarea and the old copy command.
async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch { /* e.g. permission refused: try the old way */ }
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.cssText = "position:fixed;top:0;left:0;opacity:0";
  document.body.append(area);
  area.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch { ok = false; }
  area.remove();
  return ok;
}

document.addEventListener("click", async (e) => {
  const button = e.target.closest?.(".copy-code");
  if (!button) return;
  const ok = await copyText(button.closest(".code-block").querySelector("code").textContent);
  button.textContent = ok ? "Copied" : "Copy failed";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
});
