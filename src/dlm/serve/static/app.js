// The dlm serve page: sends a streamed request with dlm_steps, reads the SSE stream with fetch + ReadableStream
// (EventSource cannot POST) and draws each denoising step of choice 0; the committed text streams below it.
"use strict";
const $ = (id) => document.getElementById(id);
const OPTIONS = { masked: ["policy", "reveal_count", "confidence_threshold", "block_size"],
                  simplex: ["inference_steps", "top_p"], autoregressive: [] };
let info = null;        // the served model, as /v1/models describes it
let controller = null;  // aborts the running request
let queue = [];         // events waiting to be shown, in stream order
let draining = false;   // whether the loop that shows them is running
let drained = Promise.resolve();  // ... and its promise
// A server started with --api-key: open the page as /#key=KEY (a fragment never leaves the browser).
const KEY = new URLSearchParams(location.hash.slice(1)).get("key");
const AUTH = KEY ? { Authorization: `Bearer ${KEY}` } : {};

async function init() {
  const r = await fetch("/v1/models", { headers: AUTH });
  if (!r.ok) throw new Error((await r.json()).error.message + (r.status === 401 ? " (open this page as /#key=KEY)" : ""));
  info = (await r.json()).data[0];
  const family = info.dlm.family;
  $("model").textContent = info.id;
  $("family").textContent = `${family} · ${info.dlm.attention}` + (info.dlm.block_size ? ` · blocks of ${info.dlm.block_size}` : "");
  for (const fs of document.querySelectorAll("fieldset.family")) fs.hidden = fs.dataset.family !== family;
  for (const [k, v] of Object.entries(info.dlm.sampling_defaults)) if ($(k) && v !== null) $(k).value = v;
  $("max_tokens").value = info.dlm.default_max_tokens;
  if (info.dlm.block_size) $("block_size").placeholder = `the model's (${info.dlm.block_size})`;
  if (family === "simplex") $("temperature").disabled = true;
  if (family === "masked") { $("policy").addEventListener("change", usedByPolicy); usedByPolicy(); }
  $("status").textContent = "ready";
}

function usedByPolicy() {  // the server refuses an option the chosen policy does not read: disable it here
  const uses = info.dlm.policy_uses[$("policy").value] || [];
  for (const k of ["reveal_count", "confidence_threshold"]) $(k).disabled = !uses.includes(k);
}

function request() {
  const body = { model: info.id, stream: true, max_tokens: Number($("max_tokens").value) };
  if (info.dlm.family !== "autoregressive") body.dlm_steps = true;
  if (info.dlm.family !== "simplex") body.temperature = Number($("temperature").value);
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  for (const k of OPTIONS[info.dlm.family]) {
    const el = $(k);
    if (el.value === "" || el.disabled) continue;  // a policy option the chosen policy does not read is left out
    body[k] = el.tagName === "SELECT" ? el.value : Number(el.value);
  }
  const chat = $("mode").value === "chat";
  if (chat) body.messages = [{ role: "user", content: $("prompt").value }];
  else body.prompt = $("prompt").value;
  return [chat ? "/v1/chat/completions" : "/v1/completions", body];
}

function reset() {
  queue = [];
  $("canvas").replaceChildren();
  $("text").textContent = "";
  $("error").hidden = true;
  for (const id of ["steps", "nfe", "revealed"]) $(id).textContent = "0";
  $("timestep-box").hidden = true;
}

async function run(event) {
  event.preventDefault();
  reset();
  const [url, body] = request();
  controller = new AbortController();
  $("run").disabled = true; $("stop").disabled = false;
  $("status").textContent = "waiting";
  try {
    const res = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json", ...AUTH },
                                   body: JSON.stringify(body), signal: controller.signal });
    if (!res.ok) { const err = await res.json(); fail(err.error.message); return; }
    $("status").textContent = "decoding";
    await read(res.body.getReader());
  } catch (err) {
    if (err.name === "AbortError") $("status").textContent = "stopped"; else fail(String(err));
  } finally {
    $("run").disabled = false; $("stop").disabled = true;
  }
}

async function read(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (line.startsWith("data: ")) push(line.slice(6));
    }
  }
  await drained;
}

function push(data) {
  queue.push(data === "[DONE]" ? { done: true } : JSON.parse(data));
  if (!draining) drained = drain();
}

async function drain() {  // show events in order; a step waits `delay` ms so the denoising can be followed
  draining = true;
  while (queue.length) {  // `draining` turns false in the same turn as the queue is found empty
    try { await show(queue.shift()); } catch (err) { fail(String(err)); }
  }
  draining = false;
}

async function show(ev) {
  if (ev.done) { if ($("status").textContent === "decoding") $("status").textContent = "done"; return; }
  if (ev.error) { fail(ev.error.message); return; }
  if (ev.object === "dlm.denoise.step") {
    if (ev.index !== 0) return;
    drawStep(ev);
    const delay = Number($("delay").value) || 0;
    if (delay > 0) await new Promise((r) => setTimeout(r, delay));
    return;
  }
  for (const c of ev.choices || []) {
    if (c.index !== 0) continue;
    const piece = c.delta ? c.delta.content : c.text;
    if (piece) $("text").textContent += piece;
  }
  if (ev.usage && ev.nfe) $("nfe").textContent = ev.nfe[0];
}

function visible(piece) {  // newlines and control characters as visible marks, inside one cell
  return piece.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/[\x00-\x1f\x7f]/g, (c) =>
    String.fromCharCode(0x2400 + (c === "\x7f" ? 0x21 : c.charCodeAt(0))));
}

function drawStep(ev) {
  const canvas = $("canvas");
  if (canvas.children.length !== ev.tokens.length) {
    canvas.replaceChildren(...ev.tokens.map((_, i) => {
      const cell = document.createElement("span");
      cell.className = "cell masked";
      if (ev.block_size && i > 0 && i % ev.block_size === 0) cell.dataset.blockStart = "1";
      return cell;
    }));
  }
  const fresh = new Set(ev.new || []);
  let revealed = 0;
  ev.tokens.forEach((_, i) => {
    const cell = canvas.children[i];
    const classes = ["cell"];
    if (cell.dataset.blockStart) classes.push("block-start");
    if (ev.masked[i]) { classes.push("masked"); cell.textContent = "░"; }
    else {
      revealed += 1;
      const isEos = ev.eos === i;
      cell.textContent = isEos ? "⟨eos⟩" : visible(ev.pieces[i]) || "·";
      cell.style.setProperty("--c", ev.confidence[i]);
      if (isEos) classes.push("eos");
      if (fresh.has(i)) classes.push("new");
      if (ev.eos !== null && i > ev.eos) classes.push("after-eos");
    }
    cell.className = classes.join(" ");
  });
  $("steps").textContent = Number($("steps").textContent) + 1;
  $("nfe").textContent = ev.nfe;
  $("revealed").textContent = `${revealed}/${ev.tokens.length}`;
  if (ev.timestep !== undefined) { $("timestep-box").hidden = false; $("timestep").textContent = ev.timestep; }
}

function fail(message) {
  $("error").textContent = message;
  $("error").hidden = false;
  $("status").textContent = "error";
}

$("form").addEventListener("submit", run);
$("stop").addEventListener("click", () => controller && controller.abort());
init().catch((err) => fail(`cannot read /v1/models: ${err}`));
