// The swarm monitor: polls /api/v1/swarm and draws, per model, a blocks x servers grid (red
// where no online server holds a block) and a table of servers. No framework, no build step.
"use strict";

let refreshMs = 5000;
let timer = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

const short = (peer) => "…" + peer.slice(-10);

function blockRow(model) {
  const row = el("tr", {class: "coverage-row"}, el("th", {class: "peer", text: "served"}));
  for (const block of model.blocks) {
    const servers = block.servers.length;
    const title = block.covered
      ? `block ${block.index}: ${servers} server(s), ${block.throughput.toFixed(1)} tokens/s`
      : `block ${block.index}: nobody serves it`;
    const cell = el("td", {
      class: "block " + (block.covered ? "covered" : "uncovered"),
      "data-block": String(block.index),
      title,
      text: block.covered ? String(servers) : "✕",
    });
    if (block.covered) {
      // Darker green for more throughput, relative to the best block of this model.
      const best = Math.max(...model.blocks.map((b) => b.throughput), 1e-9);
      cell.style.opacity = String(0.45 + 0.55 * (block.throughput / best));
    }
    row.append(cell);
  }
  return row;
}

function throughputRow(model) {
  const row = el("tr", {}, el("th", {class: "peer", text: "tokens/s"}));
  for (const block of model.blocks) {
    row.append(el("td", {class: "throughput", text: block.throughput ? block.throughput.toFixed(0) : ""}));
  }
  return row;
}

function serverRow(model, server) {
  const row = el("tr", {"data-peer": server.peer_id}, el("th", {class: "peer", title: server.peer_id, text: short(server.peer_id)}));
  for (const block of model.blocks) {
    const inside = block.index >= server.start && block.index < server.end;
    const kind = inside ? `span ${server.relayed ? "relayed" : "direct"} ${server.state}` : "";
    row.append(el("td", {class: kind}));
  }
  return row;
}

function serverTable(model) {
  const head = el("tr", {}, ...["peer", "blocks", "state", "tokens/s", "link", "rtt ms", "free cache", "version"]
    .map((name) => el("th", {text: name})));
  const table = el("table", {class: "servers"}, el("thead", {}, head));
  const body = el("tbody");
  for (const s of model.servers) {
    const link = s.relayed ? "relayed" : "direct";
    body.append(el("tr", {"data-peer": s.peer_id},
      el("td", {title: s.peer_id, text: (s.public_name ? `${s.public_name}: ` : "") + s.peer_id +
        (s.is_this_daemon ? " (this daemon)" : "")}),
      el("td", {text: `${s.start}:${s.end}`}),
      el("td", {text: s.state}),
      el("td", {class: "num", text: s.throughput.toFixed(1)}),
      el("td", {}, el("span", {class: `badge ${link}`, text: link})),
      el("td", {class: "num", text: s.rtt_ms === null ? "-" : s.rtt_ms.toFixed(1)}),
      el("td", {class: "num", text: String(s.free_cache_tokens)}),
      el("td", {text: s.version})));
  }
  table.append(body);
  return table;
}

function drawModel(model) {
  const ok = model.missing_blocks.length === 0;
  const summary = el("p", {
    class: "coverage " + (ok ? "ok" : "bad"),
    text: `${model.covered_blocks} of ${model.num_blocks} blocks served` + (ok ? "" : ` — ${model.message}`),
  });
  const header = el("tr", {}, el("th", {class: "peer", text: "block"}));
  for (const block of model.blocks) header.append(el("th", {class: "block", text: String(block.index)}));
  const grid = el("table", {class: "blocks"}, el("thead", {}, header));
  const body = el("tbody", {}, blockRow(model), throughputRow(model));
  for (const server of model.servers) body.append(serverRow(model, server));
  grid.append(body);
  return el("section", {class: "model", "data-model": model.model},
    el("h2", {text: model.model}), summary, el("div", {class: "grid-wrap"}, grid), serverTable(model));
}

async function refreshSwarm() {
  const error = document.getElementById("error");
  try {
    const response = await apiKey.fetch("/api/v1/swarm", {cache: "no-store"});
    const data = await response.json();
    if (!response.ok) throw new Error(data.traceback || JSON.stringify(data));
    refreshMs = Math.max(100, data.refresh_s * 1000);
    document.getElementById("refresh").textContent = String(data.refresh_s);
    document.getElementById("models").replaceChildren(...data.models.map(drawModel));
    const when = new Date(data.updated_at * 1000).toLocaleTimeString();
    document.getElementById("updated").textContent =
      `seen by ${short(data.peer_id)} at ${when}, refreshing every ${data.refresh_s} s`;
    error.hidden = true;
  } catch (e) {
    error.textContent = `cannot read the swarm from the gateway: ${e.message}`;
    error.hidden = false;
  }
  clearTimeout(timer);
  timer = setTimeout(refreshSwarm, refreshMs);
}

refreshSwarm();
