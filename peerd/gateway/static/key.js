// The gateway's API key, when it has one (`peerd gateway --api-key`): asked for when the gateway
// answers 401, kept in this browser's localStorage for this origin only, and sent as
// `Authorization: Bearer KEY` on fetch and as the WebSocket subprotocol `peerd.key.KEY` beside
// `peerd` (a browser's WebSocket cannot set headers). Without a key configured, nothing is sent.
"use strict";

const apiKey = {
  STORAGE: "peerd-api-key",

  get() {
    return localStorage.getItem(this.STORAGE) || "";
  },

  headers() {
    const key = this.get();
    return key ? { Authorization: `Bearer ${key}` } : {};
  },

  protocols() {
    const key = this.get();
    return key ? ["peerd", `peerd.key.${key}`] : [];
  },

  ask() {
    const key = (window.prompt("This gateway needs its API key (ask whoever runs it):") || "").trim();
    if (key) localStorage.setItem(this.STORAGE, key);
    else localStorage.removeItem(this.STORAGE);
    return Boolean(key);
  },

  async fetch(url, options = {}) {
    const send = () => fetch(url, { ...options, headers: { ...(options.headers || {}), ...this.headers() } });
    let response = await send();
    if (response.status === 401 && this.ask()) response = await send();
    return response;
  },
};
