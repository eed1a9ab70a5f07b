// Renders the model's answers. An answer is hostile input (a pasted document, a web page or tool result the model
// read, a prompt injection can steer it), so: markdown-it parses it (CommonMark + GFM tables and strikethrough,
// raw HTML off: it shows as text), DOMPurify keeps only the elements and attributes below, and every href is judged
// on the URL as the browser parses it and then written back as that URL. Images are links to them, never loaded.
// The page's own chrome (code-block head, Copy button, table wrapper) is added afterwards with DOM calls.
// Loaded after vendor/markdown-it.min.js and vendor/purify.min.js.
"use strict";

const ANSWER_TAGS = ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "em", "strong", "s", "code", "pre",
  "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td"];
const ANSWER_ATTRS = ["href", "title", "start", "class"];
const LINK_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);  // and relative: it resolves to the page's http(s)
// the only classes markdown-it writes: a fence's language, and a table column's alignment (made from its style)
const ANSWER_CLASS = /^(?:language-[\w+#.-]{1,40}|align-(?:left|center|right))$/;
// Parsing recurses once per container level, and the HTML parser slows down with depth: containers nested deeper
// than BLOCK_DEPTH show their content as plain text (markdown-it itself drops what lies past MAX_NESTING), inline
// elements deeper than INLINE_DEPTH show their delimiters, and MAX_NESTING bounds markdown-it's recursion into link
// labels (its scans grow with it; 20 is its CommonMark preset's).
const BLOCK_DEPTH = 16;
const INLINE_DEPTH = 16;
const MAX_NESTING = 20;
const MAX_NODES = 12000;
// Combining marks kept on one character: the browser lays out one long cluster in quadratic time (20,000 marks,
// one token each, take seconds), and no script stacks more than a few.
const MAX_MARKS = 16;
const EXTRA_MARKS = new RegExp(`(\\p{M}{${MAX_MARKS}})\\p{M}+`, "gu");

// `text` with at most MAX_MARKS combining marks on each character (for everything the page shows of an answer).
function capMarks(text) {
  return text.replace(EXTRA_MARKS, "$1");
}

// The URL `href` names as the browser parses it (absolute), or null when it is not http(s), mailto or relative.
function safeHref(href) {
  let url;
  try {
    url = new URL(href, document.baseURI);
  } catch {
    return null;
  }
  return LINK_PROTOCOLS.has(url.protocol) ? url.href : null;
}

// ---------------------------------------------------------------- parser

const md = window.markdownit({ html: false, linkify: true, breaks: true, typographer: false, maxNesting: MAX_NESTING });
md.linkify.set({ fuzzyLink: false, fuzzyEmail: false, fuzzyIP: false });  // only URLs that say their scheme

// A bare URL with a user name or password (http://user:pass@host/) stays text: linkify-it links only its start
// (http://user), and such a URL is a way to dress one host up as another.
md.core.ruler.after("linkify", "linkify_userinfo", (state) => {
  for (const token of state.tokens) {
    const children = (token.type === "inline" && token.children) || [];
    for (let i = 0; i + 3 < children.length; i++) {
      const [open, , close, after] = children.slice(i, i + 4);
      if (open.type === "link_open" && open.markup === "linkify" && close.type === "link_close"
          && after.type === "text" && /^[:@]\S/.test(after.content)) {
        asText(open);
        asText(close);
      }
    }
  }
});

// A container at BLOCK_DEPTH takes the rest of its lines as one paragraph of text.
md.block.ruler.before("table", "depth_cap", (state, startLine, endLine, silent) => {
  if (state.level < BLOCK_DEPTH) return false;
  if (silent) return true;
  state.push("paragraph_open", "p", 1);
  state.push("text", "", 0).content = state.getLines(startLine, endLine, state.blkIndent, false);
  state.push("paragraph_close", "p", -1);
  state.line = endLine;
  return true;
});

// Emphasis, strikethrough and links nested deeper than INLINE_DEPTH show their delimiters as text: the HTML parser's
// work on nested formatting elements grows with their depth.
md.core.ruler.push("inline_depth", (state) => {
  for (const token of state.tokens) {
    if (token.type !== "inline" || !token.children) continue;
    const kept = [];  // for each open tag still open: whether it stays a tag
    let depth = 0;
    for (const child of token.children) {
      if (child.nesting === 1) {
        const keep = depth < INLINE_DEPTH;
        kept.push(keep);
        if (keep) depth++;
        else asText(child);
      } else if (child.nesting === -1) {
        if (kept.pop()) depth--;
        else asText(child);
      }
    }
  }
});

function asText(token) {
  token.content = token.type.startsWith("link_") ? "" : token.markup;
  token.type = "text";
  token.tag = "";
  token.nesting = 0;
  token.attrs = null;
}

// A table column's alignment as a class: the CSP refuses style attributes.
md.core.ruler.push("align_class", (state) => {
  for (const token of state.tokens) {
    const style = (token.type === "th_open" || token.type === "td_open") && token.attrGet("style");
    if (style) token.attrs = [["class", `align-${style.replace("text-align:", "")}`]];
  }
});

// An image is a link to it, labelled with its alt text: an <img> would fetch whatever URL the answer names.
md.renderer.rules.image = (tokens, idx, options, env, self) => {
  const token = tokens[idx];
  const src = token.attrGet("src") || "";
  const alt = self.renderInlineAsText(token.children, options, env);
  const title = token.attrGet("title");
  const esc = md.utils.escapeHtml;
  return `<a href="${esc(src)}"${title ? ` title="${esc(title)}"` : ""}>${esc(alt || src)}</a>`;
};

// About how many DOM nodes a token becomes (the sanitizer's work, and the page's): an opening tag one element, a
// text one node, code two, a code block its chrome too; a closing tag none. A link counts three: its URL is parsed
// and it gets two more attributes.
function nodeCost(token) {
  if (token.type === "inline" || token.nesting === -1) return 0;  // an inline token's children are counted
  if (token.type === "fence" || token.type === "code_block") return 8;
  if (token.type === "link_open" || token.type === "image") return 3;
  return token.type === "text" || token.nesting === 1 ? 1 : 2;
}

// The answer as top-level blocks, each one HTML string: a streamed answer re-renders only the blocks that changed.
// Past MAX_NODES nodes the rest of the answer is one block of plain text, so however the answer is shaped the
// sanitizer and the page get at most about that many nodes from it.
function markdownBlocks(text) {
  // markdown-it's line breaks, so that its line numbers index these lines
  text = capMarks(text.replace(/\r\n?/g, "\n"));
  const env = {};
  const tokens = md.parse(text, env);
  const blocks = [];
  let start = 0, nodes = 0;
  for (let i = 0; i < tokens.length; i++) {
    nodes += nodeCost(tokens[i]);
    for (const child of tokens[i].children || []) nodes += nodeCost(child);
    if (tokens[i].level !== 0 || tokens[i].nesting === 1) continue;
    nodes += 1;  // a top-level block ends with this token: its wrapper while it is sanitized
    if (nodes > MAX_NODES) {
      blocks.push(plainRest(text, tokens[start].map ? tokens[start].map[0] : 0));
      break;
    }
    // without the newlines markdown-it puts between tags (half the nodes of a list or table): every < and > of
    // the answer's text is escaped, so ">\n<" is always between two tags
    blocks.push(md.renderer.render(tokens.slice(start, i + 1), md.options, env).replace(/>\n</g, "><"));
    start = i + 1;
  }
  return blocks;
}

// The text from `line` on, as a code block (monospace, with Copy).
function plainRest(text, line) {
  let at = 0;
  for (let k = 0; k < line && at >= 0; k++) at = text.indexOf("\n", at) + 1 || -1;
  return `<pre><code>${md.utils.escapeHtml(at >= 0 ? text.slice(at) : "")}</code></pre>\n`;
}

// ---------------------------------------------------------------- sanitizer

const purifier = window.DOMPurify(window);  // an instance of our own: its hooks apply to answers only
const PURIFY = { ALLOWED_TAGS: ANSWER_TAGS, ALLOWED_ATTR: ANSWER_ATTRS, ALLOW_DATA_ATTR: false,
  ALLOW_ARIA_ATTR: false, RETURN_DOM_FRAGMENT: true };
const PURIFY_BATCH = { ...PURIFY, ALLOWED_TAGS: [...ANSWER_TAGS, "section"] };  // markdown-it never writes one

purifier.addHook("uponSanitizeAttribute", (node, data) => {
  if (data.attrName === "class" && !ANSWER_CLASS.test(data.attrValue)) data.keepAttr = false;
  if (data.attrName === "start" && !(node.nodeName === "OL" && /^\d{1,9}$/.test(data.attrValue))) {
    data.keepAttr = false;
  }
});

purifier.addHook("afterSanitizeAttributes", (node) => {
  if (node.nodeName !== "A") return;
  const href = node.hasAttribute("href") ? safeHref(node.getAttribute("href")) : null;
  if (href === null) {
    node.removeAttribute("href");  // the text stays; the target does not
    return;
  }
  node.setAttribute("href", href);
  node.setAttribute("target", "_blank");
  node.setAttribute("rel", "noopener noreferrer");
});

// ---------------------------------------------------------------- the page's chrome around blocks

function codeBlock(pre) {
  const code = pre.querySelector("code");
  const last = code?.lastChild;  // a fence's text ends with the newline before its closing fence: not code
  if (last?.nodeType === Node.TEXT_NODE && last.data.endsWith("\n")) last.data = last.data.slice(0, -1);
  const lang = (code?.className.match(/^language-(.*)$/) || ["", ""])[1];
  const block = Object.assign(document.createElement("div"), { className: "code-block" });
  const head = Object.assign(document.createElement("div"), { className: "code-head" });
  head.append(Object.assign(document.createElement("span"), { className: "code-lang", textContent: lang }),
    Object.assign(document.createElement("button"), { type: "button", className: "copy-code", textContent: "Copy" }));
  pre.replaceWith(block);
  block.append(head, pre);
  return block;
}

function tableWrap(table) {
  const wrap = Object.assign(document.createElement("div"), { className: "table-wrap" });
  table.replaceWith(wrap);
  wrap.append(table);
  return wrap;
}

// Blocks' HTML (from markdownBlocks) as one sanitized element each, in one call of the sanitizer (a call has a
// fixed cost, and an answer can have many blocks): each block goes in wrapped in a <section>, unwrapped after.
function blockElements(htmls) {
  if (!htmls.length) return [];
  const fragment = purifier.sanitize(htmls.map((h) => `<section>${h}</section>`).join(""), PURIFY_BATCH);
  const sections = [...fragment.children];
  if (sections.length !== htmls.length || sections.some((s) => s.tagName !== "SECTION")) {
    return htmls.map((h) => oneElement(purifier.sanitize(h, PURIFY), h));  // never expected: one call per block
  }
  return sections.map((section, k) => oneElement(section, htmls[k]));
}

// A sanitized block as one element, with the page's chrome around code blocks and tables (`html`, the block's
// markup, says whether it has any: most blocks have none).
function oneElement(parent, html) {
  if (html.includes("<pre")) for (const pre of parent.querySelectorAll("pre")) codeBlock(pre);
  if (html.includes("<table")) for (const table of parent.querySelectorAll("table")) tableWrap(table);
  if (parent.childElementCount === 1) return parent.firstElementChild;
  const div = document.createElement("div");  // a block the sanitizer split or emptied
  div.append(...parent.children);
  return div;
}

// ---------------------------------------------------------------- entry points

// The sanitized HTML of `text` rendered whole (for tests and readers).
function renderMarkdown(text) {
  const el = document.createElement("div");
  renderMarkdownInto(el, text);
  return el.innerHTML;
}

// Renders `text` into `el`, keeping the elements of blocks that have not changed since the last call: while an
// answer streams only its last block or two are sanitized and rebuilt, and a selection or a Copy button under the
// pointer in an earlier block stays. el.markdownSource is the text it shows.
function renderMarkdownInto(el, text) {
  const blocks = markdownBlocks(text);
  const old = [...el.children];
  const changed = blocks.map((_, k) => k).filter((k) => old[k]?.markdownHtml !== blocks[k]);
  const nodes = blockElements(changed.map((k) => blocks[k]));
  const tail = document.createDocumentFragment();  // the new blocks past the old ones, appended at once
  changed.forEach((k, j) => {
    nodes[j].markdownHtml = blocks[k];
    if (old[k]) old[k].replaceWith(nodes[j]);
    else tail.append(nodes[j]);
  });
  el.append(tail);
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
  area.className = "copy-source";
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
