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
// Usage: node continue_client.mjs < request.json, where request is
//   {"config": "<config.yaml text>", "destination": {...overrides of data[0]...}, "events": [{"name", "data"}],
//    "configs": ["<more config.yaml texts to parse>"]}
// Prints {"config": <parsed> | null, "error": "<parser message>" | null, "posts": [{"status", "body", "sent"} | null],
//         "many": [{"config", "error"} for each of configs]}.
import { readFileSync } from "node:fs";
import { devDataVersionedSchemas, parseConfigYaml } from "@continuedev/config-yaml";

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
process.stdout.write(JSON.stringify(out));
