// The official OpenAI node SDK against ltg: what a user's code does, end to end.
//
//   node tests/sdk_test.mjs BASE_URL API_KEY      e.g. http://127.0.0.1:8080/v1 ltg_sk_...
//
// API_KEY is a token key whose group allows Kimi-K3 and GLM-5.3-Flash.
//
// Needs `openai` resolvable from tests/: the t_sdk test in tests/integration.py installs the
// version it pins (OPENAI_SDK_VERSION) into tests/node_modules. SDK retries are off
// (maxRetries: 0), as ltg's README tells clients: ltg owns retries and fallbacks.
// Exits 0 when every check passes, 1 with a message otherwise.

import OpenAI from "openai";

const [baseURL, apiKey] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error("usage: node sdk_test.mjs BASE_URL API_KEY");
  process.exit(2);
}

function check(cond, msg) {
  if (!cond) throw new Error(msg);
}

const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30_000 });

async function nonStream() {
  const { data, response } = await client.chat.completions
    .create({ model: "Kimi-K3", messages: [{ role: "user", content: "Hello" }] })
    .withResponse();
  const content = data.choices?.[0]?.message?.content;
  check(content === "Hello from kimi-k3.", `non-stream content: ${JSON.stringify(content)}`);
  check(data.model === "kimi-k3", `non-stream model: ${data.model}`);
  check(response.status === 200, `non-stream status ${response.status}`);
  const served = response.headers.get("x-ltg-served-model");
  check(served === "Kimi-K3", `x-ltg-served-model: ${served}`);
  check(response.headers.get("x-ltg-attempts") === "1",
        `x-ltg-attempts: ${response.headers.get("x-ltg-attempts")}`);
  check(response.headers.get("x-ltg-request-id"), "x-ltg-request-id missing");
}

async function stream() {
  const { data: s, response } = await client.chat.completions
    .create({ model: "Kimi-K3", messages: [{ role: "user", content: "Stream please" }], stream: true })
    .withResponse();
  check(response.headers.get("x-ltg-served-model") === "Kimi-K3",
        `stream x-ltg-served-model: ${response.headers.get("x-ltg-served-model")}`);
  let text = "";
  let finish = null;
  let chunks = 0;
  for await (const chunk of s) {
    chunks++;
    const choice = chunk.choices?.[0];
    if (choice?.delta?.content) text += choice.delta.content;
    if (choice?.finish_reason) finish = choice.finish_reason;
  }
  check(chunks >= 2, `stream: only ${chunks} chunks`);
  check(text.length > 0, "stream: no content deltas");
  check(finish === "stop", `stream: finish_reason ${finish}`);
}

// The mock's embedding is the floats 0.1, 0.2, 0.3.
const FLOATS = [0.1, 0.2, 0.3];
const FLOAT32S = FLOATS.map(Math.fround);        // the same after a trip through float32
const sameNumbers = (a, b) => Array.isArray(a) && a.length === b.length && a.every((x, i) => x === b[i]);

async function embeddings() {
  // The SDK's defaults: it asks for "encoding_format":"base64" and decodes the base64 string of
  // little-endian float32s into numbers, so they come back as float32 values (Math.fround(0.1),
  // not 0.1). An upstream that answers a JSON array instead fails here: older SDKs decode the
  // array to [] (the bug users saw: empty embeddings), newer ones pass it through as 0.1 exactly.
  const e = await client.embeddings.create({ model: "GLM-5.3-Flash", input: "hello" });
  check(sameNumbers(e.data?.[0]?.embedding, FLOAT32S),
        `embeddings (SDK default, base64): ${JSON.stringify(e).slice(0, 200)}`);
  check(e.model === "glm-5.3-flash", `embeddings model: ${e.model}`);

  // Asked for explicitly, each format comes back as sent: numbers, or the base64 string itself.
  const f = await client.embeddings.create({ model: "GLM-5.3-Flash", input: "hello", encoding_format: "float" });
  check(sameNumbers(f.data?.[0]?.embedding, FLOATS), `embeddings (float): ${JSON.stringify(f).slice(0, 200)}`);
  const b = await client.embeddings.create({ model: "GLM-5.3-Flash", input: "hello", encoding_format: "base64" });
  const raw = b.data?.[0]?.embedding;
  check(typeof raw === "string", `embeddings (base64): ${JSON.stringify(b).slice(0, 200)}`);
  const buf = Buffer.from(raw, "base64");
  check(sameNumbers(Array.from({ length: buf.length / 4 }, (_, i) => buf.readFloatLE(4 * i)), FLOAT32S),
        `embeddings (base64): ${raw} is not the float32s ${FLOATS}`);
}

async function errors() {
  // A model outside the key's group's allowed_models (here: not in the catalog at all): 403
  // model_not_allowed, which the SDK raises as its usual PermissionDeniedError.
  try {
    await client.chat.completions.create({ model: "No-Such-Model", messages: [{ role: "user", content: "x" }] });
    throw new Error("unknown model: no error raised");
  } catch (e) {
    check(e instanceof OpenAI.PermissionDeniedError, `unknown model: ${e?.constructor?.name}: ${e?.message}`);
    check(e.status === 403, `unknown model: status ${e.status}`);
    check(e.code === "model_not_allowed", `unknown model: error code ${e.code}`);
  }
  // A wrong key: AuthenticationError.
  const bad = new OpenAI({ baseURL, apiKey: apiKey + "-wrong", maxRetries: 0, timeout: 30_000 });
  try {
    await bad.chat.completions.create({ model: "Kimi-K3", messages: [{ role: "user", content: "x" }] });
    throw new Error("wrong key: no error raised");
  } catch (e) {
    check(e instanceof OpenAI.AuthenticationError, `wrong key: ${e?.constructor?.name}: ${e?.message}`);
    check(e.code === "invalid_api_key", `wrong key: error code ${e.code}`);
  }
}

try {
  await nonStream();
  await stream();
  await embeddings();
  await errors();
  console.log("sdk: ok");
  process.exit(0);
} catch (e) {
  console.error(`sdk: FAIL: ${e?.message ?? e}`);
  process.exit(1);
}
