// The web chat: one v2 WebSocket session per conversation (the servers' caches keep the turns,
// so each turn sends only its new tokens), answers streamed piece by piece, and a warning when
// the swarm lacks blocks. With several models served in full, a picker chooses one (a new
// conversation each time). Text goes into the page with textContent only, never as HTML.
"use strict";

const SESSION_MAX_LENGTH = 2048;
const STATUS_EVERY_MS = 15000;

const $ = (id) => document.getElementById(id);
// model: the name picked (null: the gateway's default model).
const state = { socket: null, opening: null, reply: null, model: null };

function wsUrl() {
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  return scheme + location.host + "/api/v2/generate";
}

function addMessage(role, text) {
  $("welcome")?.remove();
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  box.appendChild(body);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

function showWarning(text) {
  const warning = $("swarm-warning");
  warning.textContent = text || "";
  warning.hidden = !text;
}

async function refreshStatus() {
  try {
    const response = await apiKey.fetch("/api/status");
    const status = await response.json();
    if (!status.ok) {
      $("model").textContent = "daemon unavailable";
      showWarning(status.traceback);
      return;
    }
    const models = status.models || [{ name: status.model, num_blocks: status.num_blocks }];
    showModels(models);
    const shown = models.find((m) => m.name === state.model) || models[0];
    $("model").textContent = `${shown.name} · ${shown.num_blocks} blocks`;
    const servers = status.servers.filter((s) => s.state === "online").length;
    $("swarm").textContent = `${servers} server${servers === 1 ? "" : "s"} online`;
    showWarning(status.message ? `The swarm lacks blocks: ${status.message}.` : "");
  } catch (error) {
    $("model").textContent = "gateway unreachable";
    showWarning(`Cannot reach the gateway: ${error}`);
  }
}

function showModels(models) {
  // The picker lists the models the gateway offers; it shows only when there are several.
  const picker = $("model-picker");
  const names = models.map((m) => m.name);
  if (state.model !== null && !names.includes(state.model)) state.model = null;
  const current = Array.from(picker.options, (o) => o.value);
  if (current.join("\n") !== names.join("\n")) {
    picker.replaceChildren(...names.map((name) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      return option;
    }));
  }
  picker.value = state.model ?? names[0];
  $("model-choice").hidden = names.length < 2;
}

function pickModel() {
  const picked = $("model-picker").value;
  if (picked === (state.model ?? $("model-picker").options[0]?.value)) return;
  state.model = picked;
  newChat();  // a conversation runs on one model
  refreshStatus();
}

function openSession() {
  // Resolves with an open socket whose inference session is ready.
  return new Promise((resolve, reject) => {
    const socket = new WebSocket(wsUrl(), apiKey.protocols());
    let opened = false;
    socket.onopen = () => {
      const opening = { type: "open_inference_session", max_length: SESSION_MAX_LENGTH };
      if (state.model !== null) opening.model = state.model;
      socket.send(JSON.stringify(opening));
    };
    socket.onmessage = (event) => {
      const data = JSON.parse(event.data);
      if (!opened) {
        if (data.ok) {
          opened = true;
          resolve(socket);
        } else {
          reject(new Error(data.traceback));
          socket.close();
        }
        return;
      }
      onStep(data);
    };
    socket.onclose = () => {
      if (state.socket === socket) state.socket = null;
      if (!opened) reject(new Error("the gateway closed the connection"));
      else if (state.reply) finishReply("the connection to the gateway closed");
    };
  });
}

async function session() {
  if (state.socket && state.socket.readyState === WebSocket.OPEN) return state.socket;
  if (!state.opening) {
    state.opening = openSession().finally(() => { state.opening = null; });
  }
  state.socket = await state.opening;
  return state.socket;
}

function settings() {
  const number = (id) => Number($(id).value);
  const request = {
    max_new_tokens: number("max-new-tokens"),
    do_sample: $("do-sample").checked,
    repetition_penalty: number("repetition-penalty"),
  };
  if (request.do_sample) {
    request.temperature = number("temperature");
    request.top_p = number("top-p");
    if (number("top-k") > 0) request.top_k = number("top-k");
  }
  return request;
}

function updateStats() {
  // Speed counts from the first piece: before it the route opens and the prompt goes through.
  const reply = state.reply;
  const now = performance.now();
  if (reply.firstAt === null) reply.firstAt = now;
  const waited = (reply.firstAt - reply.started) / 1000;
  const speed = (reply.tokens - reply.firstTokens) / Math.max((now - reply.firstAt) / 1000, 1e-3);
  let text = `${reply.tokens} tokens · first after ${waited.toFixed(1)} s`;
  if (reply.tokens > reply.firstTokens) text += ` · ${speed.toFixed(1)} tokens/s`;
  reply.stats.textContent = text;
}

function finishReply(error) {
  const reply = state.reply;
  if (!reply) return;
  reply.box.classList.remove("streaming");
  if (error) {
    const line = document.createElement("span");
    line.className = "error";
    line.textContent = error;
    reply.box.appendChild(line);
    refreshStatus();
  }
  state.reply = null;
  setBusy(false);
  $("prompt").focus();
}

function onStep(data) {
  const reply = state.reply;
  if (!reply) return;
  if (!data.ok) {
    let error = data.traceback;
    if (data.code === "context_length_exceeded") error += ' — press "New chat" to start over.';
    finishReply(error);
    return;
  }
  reply.text.textContent += data.outputs;
  if (reply.firstAt === null) reply.firstTokens = data.token_count || 0;
  reply.tokens += data.token_count || 0;
  updateStats();
  reply.box.scrollIntoView({ block: "end" });
  if (data.stop) finishReply(data.reason === "cancelled" ? "(stopped)" : null);
}

async function send(text) {
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const stats = document.createElement("span");
  stats.className = "stats";
  box.appendChild(stats);
  state.reply = {
    box, stats, text: box.querySelector(".text"),
    tokens: 0, firstTokens: 0, started: performance.now(), firstAt: null,
  };
  setBusy(true);
  try {
    const socket = await session();
    socket.send(JSON.stringify({ type: "generate", inputs: text, chat: true, stream: true, ...settings() }));
  } catch (error) {
    finishReply(error.message);
  }
}

function newChat() {
  if (state.socket) state.socket.close();  // frees the session and the servers' caches
  state.socket = null;
  state.reply = null;
  setBusy(false);
  $("messages").replaceChildren();
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  $("session-length").textContent = SESSION_MAX_LENGTH;
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.reply) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (state.socket) state.socket.send(JSON.stringify({ type: "cancel" }));
  });
  $("new-chat").addEventListener("click", newChat);
  $("model-picker").addEventListener("change", pickModel);
  refreshStatus();
  setInterval(refreshStatus, STATUS_EVERY_MS);
  $("prompt").focus();
});
