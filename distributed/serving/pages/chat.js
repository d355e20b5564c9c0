// The chat page: each message streams from POST /v1/chat/completions (server-sent events
// read from fetch's body, since EventSource cannot POST nor send the bearer header). Stop
// aborts the fetch: the server sees its client go and cancels the request. Reasoning
// (reasoning_content deltas, for checkpoints that think) is shown apart from the answer.
"use strict";

const history = []; // the conversation sent with each message (OpenAI's messages)
let controller = null; // the running reply's AbortController

const $ = (id) => document.getElementById(id);

function bubble(role, text) {
  const node = el("div", "message " + role);
  if (text !== undefined) node.append(el("div", "content", text));
  $("messages").append(node);
  return node;
}

function stats(reply) {
  const seconds = reply.last && reply.first ? (reply.last - reply.first) / 1000 : 0;
  const tokens = reply.usage ? reply.usage.completion_tokens : reply.chunks;
  const cached = reply.usage ? reply.usage.prompt_tokens_details.cached_tokens : null;
  const parts = [tokens + " tokens"];
  if (seconds > 0 && tokens > 1) parts.push(((tokens - 1) / seconds).toFixed(1) + " tok/s");
  if (reply.first) parts.push("first token after " + (reply.first - reply.sent).toFixed(0) + " ms");
  if (reply.usage) parts.push(reply.usage.prompt_tokens + " prompt tokens, " + cached + " cached");
  parts.push(reply.finish || "streaming");
  return parts.join(" · ");
}

// Each `data:` event of a server-sent event stream, as it comes.
async function* events(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

function apply(reply, chunk) {
  if (chunk.usage) reply.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    if (delta.reasoning_content) {
      reply.reasoning += delta.reasoning_content;
      reply.reasoningNode.hidden = false;
      reply.reasoningNode.querySelector(".text").textContent = reply.reasoning;
    }
    if (delta.content) {
      reply.content += delta.content;
      reply.contentNode.textContent = reply.content;
    }
    if (delta.content || delta.reasoning_content) {
      reply.chunks += 1;
      reply.first = reply.first || performance.now();
      reply.last = performance.now();
    }
    if (choice.finish_reason) reply.finish = choice.finish_reason;
  }
}

async function send(text) {
  const system = $("system").value.trim();
  history.push({ role: "user", content: text });
  bubble("user", text);
  const node = bubble("assistant");
  const reasoningNode = el("details");
  reasoningNode.hidden = true;
  reasoningNode.append(el("summary", "", "reasoning"), el("div", "text"));
  const reply = { reasoning: "", content: "", chunks: 0, sent: performance.now(), first: 0, last: 0, usage: null,
                  finish: null, reasoningNode, contentNode: el("div", "content"), statsNode: el("div", "stats") };
  node.append(reasoningNode, reply.contentNode, reply.statsNode);
  const body = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  controller = new AbortController();
  setRunning(true);
  try {
    const response = await authorizedFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json();
      throw new Error(error.error ? error.error.message : response.statusText);
    }
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      apply(reply, chunk);
      reply.statsNode.textContent = stats(reply);
    }
  } catch (error) {
    if (error.name === "AbortError") reply.finish = "stopped";
    else node.append(el("div", "error", String(error.message || error)));
  } finally {
    controller = null;
    setRunning(false);
    reply.statsNode.textContent = stats(reply);
    node.dataset.finish = reply.finish || "error";
    if (reply.content || reply.reasoning) {
      const turn = { role: "assistant", content: reply.content };
      if (reply.reasoning) turn.reasoning_content = reply.reasoning;
      history.push(turn);
    } else {
      history.pop(); // nothing came back: the message is not part of the conversation
    }
  }
}

function setRunning(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
}

$("compose").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || controller) return;
  $("message").value = "";
  send(text);
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("compose").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("reset").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("messages").replaceChildren();
});
if (Auth.needed && !Auth.token) Auth.ask("This server needs its access token (--auth-token).");
