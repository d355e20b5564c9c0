// Shared by the status and chat pages: the bearer token and fetching with it.
// Where the server has --auth-token (the page's trinity-auth meta tag says so), the page asks
// for the token before its first call, keeps it in this tab's sessionStorage and sends it as an
// Authorization header: never in a URL. A 401 forgets it and asks again.
"use strict";

const Auth = {
  needed: document.querySelector('meta[name="trinity-auth"]').content === "bearer",
  key: "trinity-token",

  get token() { return sessionStorage.getItem(this.key); },

  headers(extra) {
    const headers = Object.assign({}, extra || {});
    if (this.needed && this.token) headers.Authorization = "Bearer " + this.token;
    return headers;
  },

  // Show the token form with `message`; resolves once a token is given.
  ask(message) {
    const form = document.getElementById("auth"), input = document.getElementById("auth-token");
    document.getElementById("auth-message").textContent = message;
    form.hidden = false;
    input.value = "";
    input.focus();
    return new Promise((resolve) => {
      form.onsubmit = (event) => {
        event.preventDefault();
        if (!input.value) return;
        sessionStorage.setItem(this.key, input.value);
        form.hidden = true;
        resolve();
      };
    });
  },
};

// Auth.ask, unless `signal` (options.signal: the chat's Stop) aborts first.
function askUnlessAborted(message, signal) {
  if (!signal) return Auth.ask(message);
  const aborted = new Promise((resolve, reject) => signal.addEventListener(
    "abort", () => reject(new DOMException("stopped", "AbortError")), { once: true }));
  return Promise.race([Auth.ask(message), aborted]);
}

// fetch() with the token; asks for it first where needed, and again after a 401.
async function authorizedFetch(url, options) {
  options = options || {};
  for (;;) {
    if (Auth.needed && !Auth.token) {
      await askUnlessAborted("This server needs its access token (--auth-token).", options.signal);
    }
    const response = await fetch(url, Object.assign({}, options, { headers: Auth.headers(options.headers) }));
    if (response.status !== 401) return response;
    sessionStorage.removeItem(Auth.key);
    await askUnlessAborted("The server refused that token. Enter it again.", options.signal);
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
