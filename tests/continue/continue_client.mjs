// Stock Continue's side of the loop, from its PUBLISHED npm package @continuedev/config-yaml (pinned in
// package.json): parseConfigYaml loads the config we print, and devDataVersionedSchemas build each dev-data event
// exactly as Continue's DataLogger (core/data/log.ts in continuedev/continue) does before it POSTs it:
//   - skip the event unless the destination's `events` lists its name (no `events`: every event goes);
//   - add the base values (eventName, schema, timestamp, userId, userAgent, selectedProfileId) the versioned
//     schema has, parse with devDataVersionedSchemas[schema][level][name] (zod: unknown keys dropped);
//   - POST {name, data, schema, level, profileId} to `destination` with Content-Type: application/json,
//     Authorization: Bearer <apiKey> and requestOptions.headers; only response.ok is checked.
// The schemas and the parser are Continue's code; only those few lines of log.ts are restated here.
//
//
// Completions, for the config's autocomplete model, through Continue's published request code (`completions`):
//   - "continue": what stock Continue's autocomplete sends for a `provider: openai` model. CompletionProvider sets
//     useLegacyCompletionsEndpoint and temperature 0.01 (unless set); templating adds getStopTokens' common stops to
//     the model's; BaseLLM.streamComplete(prompt, {raw: true}) -> OpenAI._streamComplete -> _streamChat ->
//     _legacystreamComplete: POST new URL("completions", apiBase + "/") with _getHeaders() and toChatBody's fields
//     plus the prompt, stream: true, sent by BaseLLM.fetch = fetchwithRequestOptions(url, init, requestOptions) and
//     read with streamSse, both from the PUBLISHED @continuedev/fetch (the package core imports them from). Those
//     core classes (core/llm/llms/OpenAI.ts, core/llm/index.ts, core/autocomplete/) are not published on npm, so
//     their few lines that build the URL, headers and body are restated here; sending and parsing are the package's.
//   - "adapter": the PUBLISHED @continuedev/openai-adapters OpenAIApi (constructLlmApi, provider openai), the path
//     BaseLLM.streamComplete takes for providers whose adapter serves "streamComplete": completionStream with
//     toCompleteBody's fields and stream: true, or completionNonStream with stream: false (Continue's
//     `stream: false` completion option). It sends through the openai SDK with fetchwithRequestOptions.
//
// Usage: node continue_client.mjs < request.json, where request is
//   {"config": "<config.yaml text>", "destination": {...overrides of data[0]...}, "events": [{"name", "data"}],
//    "configs": ["<more config.yaml texts to parse>"],
//    "completions": [{"prompt": "...", "via": "continue" | "adapter", "stream": true | false}]}
// Prints {"config": <parsed> | null, "error": "<parser message>" | null, "posts": [{"status", "body", "sent"} | null],
//         "many": [{"config", "error"} for each of configs],
//         "completions": [{"text", "chunks", "status", "headers", "sent": {"url", "headers", "body"}, "error"}]}.
import { readFileSync } from "node:fs";
import { devDataVersionedSchemas, parseConfigYaml } from "@continuedev/config-yaml";
import { fetchwithRequestOptions, streamSse } from "@continuedev/fetch";
import { constructLlmApi } from "@continuedev/openai-adapters";

function parse(text) {
  try {
    return { config: parseConfigYaml(text), error: null };
  } catch (e) {
    return { config: null, error: e.message };
  }
}

const request = JSON.parse(readFileSync(0, "utf8"));
const out = { ...parse(request.config ?? ""), posts: [], many: (request.configs ?? []).map(parse) };

function parseEventData(event, schema, level) {
  const versionSchemas = devDataVersionedSchemas[schema];
  if (!versionSchemas) throw new Error(`Continue has no dev data schema version ${schema}`);
  const eventSchema = versionSchemas[level]?.[event.name];
  if (!eventSchema) throw new Error(`Continue has no schema for ${event.name} at ${schema}/${level}`);
  const base = {
    eventName: event.name,
    schema,
    timestamp: new Date().toISOString(),
    userId: event.data.uniqueId ?? "user",
    userAgent: "Visual Studio Code/1.96.0 (Continue/1.3.9)",
    selectedProfileId: "local",
  };
  const withBase = { ...event.data };
  for (const [key, value] of Object.entries(base)) {
    if (key in eventSchema.shape) withBase[key] = value;
  }
  return eventSchema.parse(withBase);
}

if (out.config && request.events) {
  const dest = { ...out.config.data[0], ...(request.destination ?? {}) };
  for (const event of request.events) {
    if (dest.events && !dest.events.includes(event.name)) {
      out.posts.push(null); // Continue would not send it
      continue;
    }
    const level = dest.level ?? "all";
    // a schema Continue does not know is never posted by it; the tests send such a body with `rawSchema`
    const data = event.rawSchema ? event.data : parseEventData(event, dest.schema, level);
    const headers = { "Content-Type": "application/json", ...(dest.requestOptions?.headers ?? {}) };
    if (dest.apiKey) headers.Authorization = `Bearer ${dest.apiKey}`;
    const body = { name: event.name, data, schema: event.rawSchema ?? dest.schema, level, profileId: "local" };
    const response = await fetch(dest.destination, { method: "POST", headers, body: JSON.stringify(body) });
    const text = await response.text();
    out.posts.push({ status: response.status, ok: response.ok, sent: body, body: JSON.parse(text) });
  }
}
// --- completions -------------------------------------------------------------------------------------------------
const COMMON_STOPS = ["/src/", "#- coding: utf-8", "```"]; // core/autocomplete/templating/getStopTokens.ts

function autocompleteModel(config) {
  const model = (config.models ?? []).find((m) => (m.roles ?? []).includes("autocomplete"));
  if (!model) throw new Error("the config has no model with role autocomplete");
  const apiBase = model.apiBase.endsWith("/") ? model.apiBase : `${model.apiBase}/`; // BaseLLM's constructor
  const options = { ...(model.defaultCompletionOptions ?? {}) };
  if (options.temperature === undefined) options.temperature = 0.01; // CompletionProvider
  return { model, apiBase, options };
}

function completionBody(model, options, prompt, stream) {
  // The completion fields of core/llm/openaiTypeConverters.ts (toChatBody and toCompleteBody send the same ones for a
  // prompt); the stops are the model's plus getStopTokens' common ones. JSON.stringify drops the undefined fields.
  const body = {
    model: model.model,
    max_tokens: options.maxTokens,
    temperature: options.temperature,
    top_p: options.topP,
    frequency_penalty: options.frequencyPenalty,
    presence_penalty: options.presencePenalty,
    stop: [...(options.stop ?? []), ...COMMON_STOPS],
    prompt,
    stream,
  };
  return JSON.parse(JSON.stringify(body));
}

async function continueAutocomplete(config, prompt) {
  const { model, apiBase, options } = autocompleteModel(config);
  const url = new URL("completions", apiBase); // OpenAI._getEndpoint("completions")
  const headers = {
    "Content-Type": "application/json",
    ...(model.apiKey && { Authorization: `Bearer ${model.apiKey}` }),
    "api-key": model.apiKey ?? "",
  }; // OpenAI._getHeaders
  // toChatBody([], options) with messages dropped, then the prompt and stream: true (OpenAI._legacystreamComplete)
  const body = completionBody(model, options, prompt, true);
  const init = { method: "POST", headers, body: JSON.stringify(body) };
  const response = await fetchwithRequestOptions(url, init, model.requestOptions);
  const out = { sent: { url: url.href, headers, body }, status: response.status, headers: {}, chunks: [], text: "" };
  response.headers.forEach((value, key) => (out.headers[key] = value));
  if (!response.ok) {
    out.error = await response.text(); // BaseLLM.fetch raises this as the error the editor logs
    return out;
  }
  for await (const value of streamSse(response)) {
    if (value.choices?.[0]?.text && value.finish_reason !== "eos") {
      out.chunks.push(value.choices[0].text);
    }
  }
  out.text = out.chunks.join("");
  return out;
}

async function adapterCompletion(config, prompt, stream) {
  const { model, apiBase, options } = autocompleteModel(config);
  const api = constructLlmApi({
    provider: "openai",
    apiBase,
    apiKey: model.apiKey,
    requestOptions: model.requestOptions,
  });
  // core/llm/openaiTypeConverters.ts toCompleteBody(prompt, options), then stream as BaseLLM.streamComplete sets it
  const body = completionBody(model, options, prompt, stream);
  const out = { sent: { url: new URL("completions", apiBase).href, body }, chunks: [], text: "", status: 200 };
  const signal = new AbortController().signal;
  try {
    if (stream) {
      for await (const chunk of api.completionStream(body, signal)) {
        out.chunks.push(chunk.choices[0]?.text ?? "");
      }
      out.text = out.chunks.join("");
    } else {
      const response = await api.completionNonStream(body, signal);
      out.text = response.choices[0]?.text ?? "";
      out.chunks = [out.text];
    }
  } catch (e) {
    out.status = e.status ?? 0; // the openai SDK's APIError carries the HTTP status
    out.error = e.message;
  }
  return out;
}

if (out.config && request.completions) {
  out.completions = [];
  for (const c of request.completions) {
    out.completions.push(
      c.via === "adapter"
        ? await adapterCompletion(out.config, c.prompt, c.stream ?? true)
        : await continueAutocomplete(out.config, c.prompt),
    );
  }
}
process.stdout.write(JSON.stringify(out));
