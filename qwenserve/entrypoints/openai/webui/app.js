// qwenserve's web UI: a chat playground and a live dashboard of /metrics. Plain JS, no build step: the server
// ships these files as they are. render.js, loaded first, renders the answers. Whatever comes from the network
// (answers, reasoning, tool calls, model names, errors) is shown as text, or as Markdown through render.js.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "qwenserve.apiKey";

// ---------------------------------------------------------------- API access

// The key lives in this tab's memory, and in sessionStorage only when the user asks to keep it for the tab: a
// script that got into the page must not find it in localStorage, where older versions kept it (removed here).
let apiKey = sessionStorage.getItem(KEY_STORE) || "";
localStorage.removeItem(KEY_STORE);

// Every call carries the key when one is set, so the UI works against a server started with --api-key.
function authHeaders(extra = {}) {
  return apiKey ? { ...extra, Authorization: `Bearer ${apiKey}` } : extra;
}

async function api(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: authHeaders(options.headers) });
  if (resp.status === 401) {
    showNotice("This server needs an API key: enter it at the top right and press Save.");
  }
  return resp;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return body.error?.message || JSON.stringify(body);  // the server's errors are OpenAI-shaped
  } catch {
    return `${resp.status} ${resp.statusText}`;
  }
}

function showNotice(text) {
  $("notice").textContent = capMarks(text);
  $("notice").hidden = !text;
}

// ---------------------------------------------------------------- tabs and the key

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  $("view-chat").hidden = name !== "chat";
  $("view-dashboard").hidden = name !== "dashboard";
  if (name === "dashboard") startPolling();
}

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => { location.hash = tab.dataset.view; });
}
window.addEventListener("hashchange", () => showView(location.hash === "#dashboard" ? "dashboard" : "chat"));

$("api-key").value = apiKey;
$("keep-key").checked = Boolean(apiKey);
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("api-key").value.trim();
  if ($("keep-key").checked && apiKey) sessionStorage.setItem(KEY_STORE, apiKey);
  else sessionStorage.removeItem(KEY_STORE);
  loadModels();
});

async function loadModels() {
  let resp;
  try {
    resp = await api("/v1/models");
  } catch (e) {
    showNotice(`Cannot reach the server: ${e.message}`);
    return;
  }
  if (!resp.ok) {
    if (resp.status !== 401) showNotice(`GET /v1/models: ${await errorText(resp)}`);
    return;
  }
  let listed;
  try {
    listed = (await resp.json())?.data;
  } catch {
    listed = null;  // not JSON
  }
  if (!Array.isArray(listed)) {
    showNotice("GET /v1/models: the server's answer has no list of models (no data array)");
    return;
  }
  const usable = listed.filter((m) => typeof m?.id === "string");
  showNotice(usable.length < listed.length
    ? `GET /v1/models: ${listed.length - usable.length} of the server's ${listed.length} entries have no model id `
      + "and are left out" : "");
  const select = $("model");
  const previous = select.value;
  models.clear();
  for (const m of usable) models.set(m.id, m);
  const ids = [...models.keys()];
  select.replaceChildren(...ids.map((id) => new Option(capMarks(id), id)));
  if (ids.includes(previous)) select.value = previous;
  showAttach();
}

const models = new Map();  // id -> its /v1/models entry
$("model").addEventListener("change", showAttach);

function takesImages() {
  return models.get($("model").value)?.capabilities?.vision === true;
}

// ---------------------------------------------------------------- chat

const history = [];       // this conversation's messages, without the system prompt (it is read at each send)
let controller = null;    // the AbortController of the answer being streamed
let conversation = 0;     // bumped by "New conversation": an answer of an older one must not land in the new one

// The user's text shows as typed, with the images it carries; an answer is rendered as Markdown.
function addMessage(role, text, images = []) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const content = document.createElement(role === "assistant" ? "div" : "span");
  content.className = role === "assistant" ? "content markdown" : "content";
  content.textContent = text;
  div.append(content);
  if (images.length) {
    const strip = document.createElement("div");
    strip.className = "images";
    const img = (url) => Object.assign(document.createElement("img"), { src: url, alt: "attached image" });
    strip.append(...images.map(img));
    div.append(strip);
  }
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// Draws a streaming value (the answer, its reasoning, its tool calls) at most once per animation frame, and less
// often when one draw takes long (it then gets at most a fifth of the time, the layout it causes included), so a
// long answer costs no more than that however fast tokens come.
function frameThrottled(bubble, draw) {
  let value, updated = false, frame = 0, next = 0;
  const run = (now) => {
    if (now < next) {
      frame = requestAnimationFrame(run);
      return;
    }
    frame = 0;
    const start = performance.now();
    draw(value);
    bubble.scrollIntoView({ block: "end" });  // lays the page out: that is part of the draw's cost
    next = start + 5 * (performance.now() - start);
  };
  return {
    update(v) { value = v; updated = true; frame ||= requestAnimationFrame(run); },
    finish(v = value) { this.cancel(); if (updated || v) draw(v); },  // the whole value, at once
    cancel() { cancelAnimationFrame(frame); frame = 0; },
  };
}

// The text box of an answer's reasoning or tool calls, made on first use: plain text (textContent), never HTML.
function sideText(bubble, className, label) {
  let box = bubble.querySelector(`.${className}`);
  if (!box) {
    box = Object.assign(document.createElement("details"), { className });
    box.append(Object.assign(document.createElement("summary"), { textContent: label }),
      Object.assign(document.createElement("div"), { className: "side-text" }));
    bubble.querySelector(".content").before(box);
  }
  return box.querySelector(".side-text");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);  // empty: the server's default
}

// Server-sent events from a fetch() body: yields each `data:` payload parsed as JSON, until [DONE], and sets
// stream.done when [DONE] came (a body that just ends was cut short: a proxy's timeout, a restarted server). Each
// character is scanned once and each event sliced out once, however the body is split into reads.
async function* sseEvents(body, stream = {}) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const from = Math.max(0, buffer.length - 1);  // the rest held no "\n\n"; one may straddle the reads
    buffer += value.replace(/\r/g, "");
    let start = 0;
    for (let end = buffer.indexOf("\n\n", from); end >= 0; end = buffer.indexOf("\n\n", start)) {
      const block = buffer.slice(start, end);
      start = end + 2;
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") {
        stream.done = true;
        return;
      }
      if (data) yield parseEvent(data);
    }
    buffer = buffer.slice(start);
  }
}

function parseEvent(data) {
  try {
    return JSON.parse(data);
  } catch {
    throw new Error(`the server sent an event that is not JSON: ${data.slice(0, 200)}`);
  }
}

// An error event's message: OpenAI's shape is {"error": {"message": ...}}; anything else is shown as it came.
function errorMessage(error) {
  if (typeof error?.message === "string" && error.message) return error.message;
  const text = typeof error === "string" ? error : JSON.stringify(error);
  return text ? text.slice(0, 2000) : "the server sent an error without a message";
}

// Shows that the server sent something the page skipped (it goes on with the rest of the answer).
function malformed(what, value) {
  showNotice(`The server sent ${what}; it is left out: ${String(JSON.stringify(value)).slice(0, 200)}`);
}

// images: data: URLs, sent after the text as OpenAI content parts.
async function send(text, images = []) {
  const parts = [...(text ? [{ type: "text", text }] : []),
    ...images.map((url) => ({ type: "image_url", image_url: { url } }))];
  history.push({ role: "user", content: images.length ? parts : text });
  addMessage("user", text, images);
  const bubble = addMessage("assistant", "");
  const content = bubble.querySelector(".content");
  const renderer = frameThrottled(bubble, (t) => renderMarkdownInto(content, t));
  const reasoningView = frameThrottled(bubble, (t) => {
    sideText(bubble, "reasoning", "Reasoning").textContent = capMarks(t);
  });
  const calls = new Map();  // index -> {name, arguments}, as their pieces stream in
  const callsView = frameThrottled(bubble, () => {
    sideText(bubble, "tool-calls", "Tool calls").textContent =
      capMarks([...calls.values()].map((c) => `${c.name}(${c.arguments})`).join("\n"));
  });
  const system = $("system").value.trim();
  const request = {
    model: $("model").value || undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true,
    stream_options: { include_usage: true },  // the last chunk then carries the exact token counts
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),
  };
  if ($("ignore-eos").checked) request.ignore_eos = true;

  controller = new AbortController();
  const started = conversation;
  setBusy(true);
  const start = performance.now();
  let first = null, chunks = 0, usage = null, finish = null, answer = "", thought = "", stopped = false;
  const stream = { done: false };
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const event of sseEvents(resp.body, stream)) {
      if (event === null || typeof event !== "object") {
        malformed("an event that is not an object", event);
        continue;
      }
      if (event.error) throw new Error(errorMessage(event.error));  // an engine failure after the headers went out
      if (Number.isInteger(event.usage?.completion_tokens)) usage = event.usage;
      const choice = event.choices?.[0];
      if (choice?.finish_reason) finish = choice.finish_reason;
      const delta = choice?.delta || {};
      const reasoning = delta.reasoning_content ?? delta.reasoning;
      if (typeof reasoning === "string" && reasoning) reasoningView.update(thought += reasoning);
      for (const call of Array.isArray(delta.tool_calls) ? delta.tool_calls : []) {
        if (call === null || typeof call !== "object") {
          malformed("a tool call that is not an object", call);
          continue;
        }
        if (!calls.has(call.index)) calls.set(call.index, { name: "", arguments: "" });
        const c = calls.get(call.index);
        if (typeof call.function?.name === "string") c.name += call.function.name;
        if (typeof call.function?.arguments === "string") c.arguments += call.function.arguments;
        callsView.update(calls);
      }
      if (typeof delta.content === "string" && delta.content) {
        first ??= performance.now();
        chunks += 1;
        answer += delta.content;
        renderer.update(answer);
        bubble.dataset.chunks = chunks;
      }
    }
    renderer.finish(answer);
    if (!stream.done) {  // it looks complete, but the server never said it was
      bubble.classList.add("error");
      content.append(Object.assign(document.createElement("p"),
        { textContent: "[connection closed before the answer finished]" }));
    }
  } catch (e) {
    renderer.finish(answer);
    if (e.name === "AbortError") {
      stopped = true;  // Stop pressed: the server sees the connection close and aborts the request
    } else {
      bubble.classList.add("error");
      const line = document.createElement("p");
      line.textContent = capMarks(answer ? `[error: ${e.message}]` : `Error: ${e.message}`);
      content.append(line);
    }
  } finally {
    reasoningView.finish();
    callsView.finish();
    controller = null;
    setBusy(false);
  }
  const end = performance.now();
  if (started !== conversation) return;
  if (answer) history.push({ role: "assistant", content: answer });
  else history.pop();  // nothing came back: the user can send the message again
  if (stopped && !answer) content.textContent = "(stopped before the first token)";
  else if (finish && !answer) content.textContent = `(no text: finish ${finish})`;  // e.g. EOS at once
  if (first !== null) showStats(bubble, start, first, end, usage, chunks, stopped ? "stopped" : finish);
}

// TTFT is the browser's wait for the first text; tok/s counts the tokens after the first over the time after
// it (the decode speed). Without usage (a stopped answer) the streamed chunks stand in for tokens.
function showStats(bubble, start, first, end, usage, chunks, finish) {
  const tokens = usage ? usage.completion_tokens : chunks;
  const approx = usage ? "" : "~";
  const rate = tokens > 1 && end > first ? (tokens - 1) / ((end - first) / 1000) : null;
  const stats = document.createElement("span");
  stats.className = "stats";
  stats.textContent = [
    `TTFT ${Math.round(first - start)} ms`,
    rate === null ? "– tok/s" : `${approx}${rate.toFixed(1)} tok/s`,
    `${approx}${tokens} tokens`,
    finish ? `finish: ${finish}` : "",
  ].filter(Boolean).join(" · ");
  bubble.append(stats);
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if ((!text && !attached.length) || controller) return;
  $("prompt").value = "";
  send(text, attached.splice(0));
  showAttachments();
});
// Enter sends, Shift+Enter is a new line; an Enter that confirms an input method's composition (Chinese, Japanese,
// Korean) only ends it.
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
    e.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", () => {
  controller?.abort();
  conversation += 1;
  history.length = 0;
  $("messages").replaceChildren();
});

// ---------------------------------------------------------------- images for the next message

const attached = [];  // data: URLs of the images the next message carries

// The attach button, paste and drop work only while the chosen model reads images.
function showAttach() {
  $("attach").hidden = !takesImages();
  if (!takesImages()) attached.length = 0;
  showAttachments();
}

function showAttachments() {
  $("attachments").hidden = !attached.length;
  $("attachments").replaceChildren(...attached.map((url, k) => {
    const thumb = document.createElement("div");
    thumb.className = "thumb";
    const img = Object.assign(document.createElement("img"), { src: url, alt: `image ${k + 1}` });
    const remove = Object.assign(document.createElement("button"),
      { type: "button", className: "remove", textContent: "×", title: "Remove this image" });
    remove.addEventListener("click", () => { attached.splice(k, 1); showAttachments(); });
    thumb.append(img, remove);
    return thumb;
  }));
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  if (!images.length || !takesImages()) return;
  attached.push(...await Promise.all(images.map(readAsDataUrl)));
  showAttachments();
}

$("attach").addEventListener("click", () => $("attach-input").click());
$("attach-input").addEventListener("change", async (e) => {
  await attachFiles(e.target.files);
  e.target.value = "";  // the same file again is a change too
});
$("prompt").addEventListener("paste", (e) => {  // a screenshot on the clipboard; the text of a paste goes on
  const files = [...(e.clipboardData?.items || [])].filter((item) => item.kind === "file")
    .map((item) => item.getAsFile()).filter(Boolean);
  if (files.length) attachFiles(files);
});
$("chat-form").addEventListener("dragover", (e) => { if (takesImages()) e.preventDefault(); });
$("chat-form").addEventListener("drop", (e) => {
  if (!takesImages() || !e.dataTransfer.files.length) return;  // dropped text goes into the message box
  e.preventDefault();
  attachFiles(e.dataTransfer.files);
});

// ---------------------------------------------------------------- dashboard: Prometheus text

// name -> [{labels, value}] for every sample line of the exposition text.
function parseMetrics(text) {
  const metrics = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
    if (!metrics.has(m[1])) metrics.set(m[1], []);
    metrics.get(m[1]).push({ labels, value: parseValue(m[3]) });
  }
  return metrics;
}

function parseValue(s) {
  if (s === "+Inf") return Infinity;
  if (s === "-Inf") return -Infinity;
  return Number(s);
}

// Sum over label sets: with data-parallel replicas a series comes once per `replica`.
function sum(metrics, name) {
  const samples = metrics.get(name);
  return samples ? samples.reduce((a, s) => a + s.value, 0) : null;
}

// Fractions (KV usage, hit rate) average over replicas instead: a sum of fractions is not a fraction.
function mean(metrics, name) {
  const samples = metrics.get(name);
  return samples?.length ? sum(metrics, name) / samples.length : null;
}

// One counter over another, both summed over replicas (the prefix cache's hits over its queries); null before any.
function ratio(metrics, part, whole) {
  const a = sum(metrics, part), b = sum(metrics, whole);
  return a === null || !b ? null : a / b;
}

// A histogram's cumulative buckets as [[upper bound, count]], sorted, summed over the other labels.
function buckets(metrics, name) {
  const byBound = new Map();
  for (const s of metrics.get(`${name}_bucket`) || []) {
    const le = parseValue(s.labels.le);
    byBound.set(le, (byBound.get(le) || 0) + s.value);
  }
  return [...byBound.entries()].sort((a, b) => a[0] - b[0]);
}

// Prometheus's histogram_quantile: linear interpolation inside the bucket the rank falls in.
function quantile(q, cumulative) {
  if (!cumulative.length) return null;
  const total = cumulative[cumulative.length - 1][1];
  if (!(total > 0)) return null;
  const rank = q * total;
  let lower = 0, below = 0;
  for (const [upper, count] of cumulative) {
    if (count >= rank) {
      if (upper === Infinity) return lower;  // past the last finite bound: the best estimate is that bound
      return lower + (upper - lower) * (count > below ? (rank - below) / (count - below) : 0);
    }
    lower = upper;
    below = count;
  }
  return lower;
}

// ---------------------------------------------------------------- dashboard: polling and series

const SPAN_S = 120;          // the charts show the last two minutes
const RATE_WINDOW_S = 10;    // tokens/s over this window (the counters move when requests finish)
const LATENCY_WINDOW_S = 60; // TTFT/TPOT percentiles over the requests finished in this window
const samples = [];          // {t: seconds, m: parsed metrics}
let polling = false;

function startPolling() {
  if (polling) return;
  polling = true;
  poll();
}

async function poll() {
  try {
    const resp = await api("/metrics");
    if (resp.ok) {
      samples.push({ t: performance.now() / 1000, m: parseMetrics(await resp.text()) });
      const keep = samples[samples.length - 1].t - SPAN_S - LATENCY_WINDOW_S;  // windows reach back this far
      while (samples[0].t < keep) samples.shift();
      $("dash-status").textContent = `updated ${new Date().toLocaleTimeString()}`;
      drawDashboard();
    } else {
      $("dash-status").textContent = resp.status === 401 ? "401: the server needs an API key" : await errorText(resp);
    }
  } catch (e) {
    $("dash-status").textContent = `cannot reach the server: ${e.message}`;
  }
  if (!$("view-dashboard").hidden) setTimeout(poll, 1000);
  else polling = false;  // resumes when the tab is shown again
}

// The sample nearest to `seconds` before sample i (the oldest one we have when history is shorter).
function earlier(i, seconds) {
  let j = i;
  while (j > 0 && samples[j - 1].t >= samples[i].t - seconds) j--;
  return j < i ? samples[j] : (i > 0 ? samples[i - 1] : null);
}

function rate(i, name) {
  const now = samples[i], then = earlier(i, RATE_WINDOW_S);
  if (!then) return null;
  const a = sum(then.m, name), b = sum(now.m, name);
  if (a === null || b === null || b < a) return null;  // b < a: the server restarted
  return (b - a) / (now.t - then.t);
}

// Percentiles in ms of the observations made between the sample LATENCY_WINDOW_S ago and sample i.
function percentiles(i, name) {
  const then = earlier(i, LATENCY_WINDOW_S);
  if (!then) return [null, null, null];
  const now = buckets(samples[i].m, name);
  const old = new Map(buckets(then.m, name));
  const delta = now.map(([le, c]) => [le, c - (old.get(le) || 0)]);
  return [0.5, 0.9, 0.99].map((q) => { const v = quantile(q, delta); return v === null ? null : v * 1000; });
}

const CHARTS = [
  { id: "chart-requests", series: [
    ["running", "#2f6fdf", (i) => sum(samples[i].m, "vllm:num_requests_running")],
    ["waiting", "#e0742b", (i) => sum(samples[i].m, "vllm:num_requests_waiting")]] },
  { id: "chart-kv", max: 100, series: [
    ["KV blocks in use", "#7a3fd1", (i) => pct(mean(samples[i].m, "vllm:kv_cache_usage_perc"))]] },
  { id: "chart-prefix", max: 100, series: [
    ["hit rate", "#1c9a5b", (i) => pct(ratio(samples[i].m, "vllm:prefix_cache_hits_total",
                                             "vllm:prefix_cache_queries_total"))]] },
  { id: "chart-tokens", series: [
    ["generated", "#2f6fdf", (i) => rate(i, "vllm:generation_tokens_total")],
    ["prompt", "#e0742b", (i) => rate(i, "vllm:prompt_tokens_total")]] },
  { id: "chart-ttft", latency: "vllm:time_to_first_token_seconds" },
  { id: "chart-tpot", latency: "vllm:time_per_output_token_seconds" },
];
for (const chart of CHARTS) {  // the latency charts: one line per percentile
  if (chart.latency) {
    chart.series = [["p50", "#1c9a5b"], ["p90", "#e0a020"], ["p99", "#d23b3b"]]
      .map(([name, color], k) => [name, color, (i) => percentiles(i, chart.latency)[k]]);
  }
}

function pct(fraction) { return fraction === null ? null : 100 * fraction; }

function drawDashboard() {
  const newest = samples[samples.length - 1].t;
  const first = samples.findIndex((s) => s.t >= newest - SPAN_S);
  for (const chart of CHARTS) {
    const series = chart.series.map(([name, color, value]) => ({
      name, color, points: samples.slice(first).map((s, k) => [s.t - newest, value(first + k)]),
    }));
    drawChart($(chart.id), series, chart.max);
  }
}

// ---------------------------------------------------------------- dashboard: drawing

function niceMax(v) {  // the axis top: 1, 2 or 5 times a power of ten
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= v);
}

function format(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2);
}

// Lines of [x = seconds before now, y] on a canvas; a gap in time or a null value breaks the line.
function drawChart(canvas, series, fixedMax) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  const left = 44, right = 8, top = 8, bottom = 20;
  const values = series.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null && Number.isFinite(v));
  const yMax = fixedMax ?? niceMax(Math.max(0, ...values));
  const x = (t) => left + (width - left - right) * (1 + t / SPAN_S);
  const y = (v) => top + (height - top - bottom) * (1 - Math.min(v, yMax) / yMax);

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#667";
  ctx.strokeStyle = "#e3e5ea";
  ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {  // horizontal grid with its values
    const v = (yMax * k) / 4;
    ctx.beginPath();
    ctx.moveTo(left, y(v));
    ctx.lineTo(width - right, y(v));
    ctx.stroke();
    ctx.fillText(format(v), 4, y(v) + 4);
  }
  ctx.fillText(`-${SPAN_S} s`, left, height - 5);
  ctx.fillText("now", width - right - 22, height - 5);

  let drawn = 0;
  ctx.lineWidth = 2;
  for (const s of series) {
    ctx.strokeStyle = ctx.fillStyle = s.color;
    ctx.beginPath();
    let previous = null;
    for (const [t, v] of s.points) {
      if (v === null || !Number.isFinite(v)) { previous = null; continue; }
      if (previous === null || t - previous > 3) {
        ctx.moveTo(x(t), y(v));
        ctx.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3);  // a lone point still shows
      } else {
        ctx.lineTo(x(t), y(v));
      }
      previous = t;
      drawn += 1;
    }
    ctx.stroke();
  }
  canvas.dataset.points = drawn;  // for tests and curious readers: how many points are on the chart

  const legend = canvas.nextElementSibling;
  legend.replaceChildren(...series.flatMap((s, k) => {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = s.color;
    const last = [...s.points].reverse().find((p) => p[1] !== null);
    item.append(swatch, `${s.name} ${format(last ? last[1] : null)}`);
    return k ? [" ", item] : [item];  // a space between items: the legend reads (and copies) as text
  }));
}

// ---------------------------------------------------------------- start

showView(location.hash === "#dashboard" ? "dashboard" : "chat");
loadModels();
