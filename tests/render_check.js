// Loaded into the web UI's page by tests/test_web_ui.py: renders hostile answers with the page's own renderer
// (renderMarkdownInto, as a streamed answer is rendered: prefix by prefix into one element, then whole) and
// audits the DOM after every render against the allowlist. renderCorpus(items, options) -> report; options:
// everyPrefixUpTo and prefixes (where answers are cut), mustShow ({name: a text its whole render shows}).
"use strict";

window.renderCheck = (() => {
  // tag -> attribute -> a test of its value (the answer's own elements, and the chrome render.js adds around them)
  const any = () => true;
  const ALLOWED = {
    P: {}, BR: {}, HR: {}, H1: {}, H2: {}, H3: {}, H4: {}, H5: {}, H6: {}, EM: {}, STRONG: {}, S: {}, PRE: {},
    BLOCKQUOTE: {}, UL: {}, LI: {}, TABLE: {}, THEAD: {}, TBODY: {}, TR: {},
    CODE: { class: (v) => /^language-[\w+#.-]+$/.test(v) },
    OL: { start: (v) => /^\d+$/.test(v) },
    TH: { class: (v) => /^align-(left|center|right)$/.test(v) },
    TD: { class: (v) => /^align-(left|center|right)$/.test(v) },
    A: { href: any, title: any, target: (v) => v === "_blank", rel: (v) => v === "noopener noreferrer" },
    DIV: { class: (v) => ["code-block", "code-head", "table-wrap"].includes(v) },
    SPAN: { class: (v) => v === "code-lang" },
    BUTTON: { type: (v) => v === "button", class: (v) => v === "copy-code" },
  };
  const PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

  // Findings in el's subtree: elements and attributes off the allowlist, hrefs the browser would parse to another
  // scheme, links that would open in this tab or tell the opener.
  function audit(el) {
    const found = [];
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_ELEMENT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const rules = ALLOWED[node.tagName];
      if (!rules) {
        found.push(`element <${node.tagName.toLowerCase()}>`);
        continue;
      }
      for (const { name, value } of node.attributes) {
        if (!(name in rules) || !rules[name](value)) found.push(`${node.tagName.toLowerCase()} ${name}="${value}"`);
      }
      if (node.tagName === "A" && node.hasAttribute("href")) {
        let protocol = null;
        try { protocol = new URL(node.getAttribute("href"), document.baseURI).protocol; } catch { /* none */ }
        if (!PROTOCOLS.has(protocol) || !PROTOCOLS.has(node.protocol)) found.push(`href ${node.getAttribute("href")}`);
        if (node.target !== "_blank" || node.rel !== "noopener noreferrer") found.push("link without target/rel");
      }
    }
    return found;
  }

  // Where a text of `length` characters is cut to stand for the answer as it streams in.
  function cuts(length, options) {
    if (length <= options.everyPrefixUpTo) return Array.from({ length }, (_, k) => k + 1);
    const step = length / options.prefixes;
    return Array.from({ length: options.prefixes }, (_, k) => Math.max(1, Math.floor((k + 1) * step)));
  }

  function renderCorpus(items, options) {
    const report = { items: items.length, renders: 0, slowest: [0, "", 0], errors: [], findings: [],
      wholeMs: {} };
    const messages = document.getElementById("messages");
    for (const [name, text] of items) {
      const bubble = document.createElement("div");
      bubble.className = "msg assistant";
      const el = document.createElement("div");
      el.className = "content markdown";
      bubble.append(el);
      messages.append(bubble);
      for (const cut of new Set([...cuts(text.length, options), text.length])) {
        const whole = cut === text.length;
        let ms;
        try {
          const start = performance.now();
          renderMarkdownInto(el, text.slice(0, cut));
          ms = performance.now() - start;
        } catch (e) {
          report.errors.push(`${name} at ${cut}: ${e}`);
          continue;
        }
        report.renders += 1;
        if (ms > report.slowest[0]) report.slowest = [ms, name, cut];
        if (whole) report.wholeMs[name] = ms;
        if (whole && name in options.mustShow && !el.textContent.includes(options.mustShow[name])) {
          report.findings.push(`${name}: "${options.mustShow[name]}" is not shown`);
        }
        for (const f of audit(el)) {
          if (report.findings.length < 200) report.findings.push(`${name} at ${cut}: ${f}`);
        }
      }
      bubble.remove();
    }
    return report;
  }

  return { audit, renderCorpus };
})();
