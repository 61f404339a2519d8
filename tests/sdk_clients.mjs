// Real clients against ltg: the npm SDKs users point at it, each used as its documentation shows,
// unmodified but for the base URL, the key and its own retries turned off (ltg owns retries).
//
//   node tests/sdk_clients.mjs BASE_URL API_KEY WHICH      e.g. http://127.0.0.1:8080/v1 ltg_sk_... openai
//
// WHICH:
//   openai           the official `openai` SDK: chat (plain, stream), responses (plain, stream: true,
//                    responses.stream), completions (plain, stream), embeddings (the SDK's default
//                    base64), x-ltg-served-model / x-ltg-attempts through .withResponse()/.asResponse()
//   ai               the Vercel AI SDK (`ai` + `@ai-sdk/openai`): generateText and streamText with the
//                    default provider (the Responses API) and provider.chat(), embed()
//   langchain        `@langchain/openai`: ChatOpenAI invoke and stream (Chat Completions, and the
//                    Responses API with useResponsesApi), OpenAIEmbeddings
//   anthropic        `@anthropic-ai/sdk` (messages.create, messages.stream, messages.countTokens) and
//                    `@ai-sdk/anthropic` (generateText, streamText), against model Claude-M
//   failover-openai  one chat call (openai SDK) expected to have failed over: prints its headers
//   failover-ai      one generateText call (AI SDK, Responses API) expected to have failed over
//   usage-openai     one chat call (openai SDK, not streamed) whose upstream answer the caller scripted
//                    with cache counts: prints the SDK's completion.usage for the caller to check
//   usage-anthropic  one messages.create (@anthropic-ai/sdk, not streamed) on Claude-M, the same:
//                    prints the SDK's message.usage
//   translate-openai the openai SDK and the AI SDK on Claude-M, whose provider speaks Anthropic's
//                    API: chat.completions.create, a stream read by hand, the stream helper's
//                    finalChatCompletion() on a tool call (the caller scripts claude-mock: ok, ok,
//                    tool_call, ok, ok), provider.chat() generateText and streamText
//   translate-anthropic  @anthropic-ai/sdk and @ai-sdk/anthropic on Kimi-K3, whose provider speaks
//                    OpenAI chat: messages.create, messages.stream().finalMessage(), countTokens
//                    (ltg's estimate), generateText, streamText; with a tool call when WHICH is
//                    translate-anthropic-tools (the caller scripts kimi-k3: ok, ok, tool_call, tool_call)
//
// API_KEY is a token key whose group allows Kimi-K3 and GLM-5.3-Flash (and Claude-M for
// `anthropic`). The packages must be resolvable from tests/: tests/integration_sdks.py installs the
// versions it pins into tests/node_modules. Upstream is tests/mock, whose whole answers say
// "Hello from <upstream model>." and whose streams send "word " N times (3 by default).
//
// Prints one line per check passed, then `RESULT {json}` (what the headers said, for the caller to
// check); exits 0 when every check passes, 1 with `FAIL: <what>` otherwise.

const [baseURL, apiKey, which] = process.argv.slice(2);
if (!baseURL || !apiKey || !which) {
  console.error("usage: node sdk_clients.mjs BASE_URL API_KEY openai|ai|langchain|anthropic|failover-openai|failover-ai|usage-openai|usage-anthropic|translate-openai|translate-anthropic[-tools]");
  process.exit(2);
}

const result = {};               // what the caller checks: headers seen, per call
const HELLO_KIMI = "Hello from kimi-k3.";
const WORDS = /^(word )+$/;      // a mock stream's text

function check(cond, msg) {
  if (!cond) throw new Error(msg);
}

function ok(what) {
  console.log(`ok ${which}: ${what}`);
}

const show = (x) => {
  try {
    return JSON.stringify(x).slice(0, 400);
  } catch {
    return String(x);
  }
};

// A fetch Headers object, or the plain object of lowercased names the AI SDK gives.
function header(h, name) {
  if (!h) return undefined;
  if (typeof h.get === "function") return h.get(name) ?? undefined;
  return h[name] ?? h[name.toLowerCase()];
}

function checkLtgHeaders(h, what, served, attempts = "1") {
  const s = header(h, "x-ltg-served-model");
  const a = header(h, "x-ltg-attempts");
  check(s === served, `${what}: x-ltg-served-model ${show(s)}, expected ${served}`);
  check(a === attempts, `${what}: x-ltg-attempts ${show(a)}, expected ${attempts}`);
  check(header(h, "x-ltg-request-id"), `${what}: no x-ltg-request-id`);
  result[what] = { served: s, attempts: a };
}

// ---- the official openai SDK ---------------------------------------------------------------------

async function openaiClient() {
  const { default: OpenAI } = await import("openai");
  return new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30_000 });
}

async function runOpenAI() {
  const client = await openaiClient();
  const messages = [{ role: "user", content: "Hello" }];

  // chat, plain: the answer and its headers.
  {
    const { data, response } = await client.chat.completions.create({ model: "Kimi-K3", messages }).withResponse();
    const text = data.choices?.[0]?.message?.content;
    check(text === HELLO_KIMI, `chat: content ${show(text)}`);
    check(data.usage?.prompt_tokens > 0 && data.usage?.completion_tokens === 3, `chat: usage ${show(data.usage)}`);
    checkLtgHeaders(response.headers, "chat", "Kimi-K3");
    ok("chat.completions.create");
  }
  // chat, stream: deltas, finish_reason, and (asked for) the usage chunk.
  {
    const { data: s, response } = await client.chat.completions
      .create({ model: "Kimi-K3", messages, stream: true, stream_options: { include_usage: true } })
      .withResponse();
    checkLtgHeaders(response.headers, "chat stream", "Kimi-K3");
    let text = "", finish = null, usage = null;
    for await (const chunk of s) {
      const c = chunk.choices?.[0];
      if (c?.delta?.content) text += c.delta.content;
      if (c?.finish_reason) finish = c.finish_reason;
      if (chunk.usage) usage = chunk.usage;
    }
    check(WORDS.test(text), `chat stream: text ${show(text)}`);
    check(finish === "stop", `chat stream: finish_reason ${show(finish)}`);
    check(usage?.completion_tokens > 0, `chat stream: usage ${show(usage)}`);
    ok("chat.completions.create stream");
  }
  // responses, plain: output_text (the SDK's convenience) and usage.
  {
    const { data, response } = await client.responses.create({ model: "Kimi-K3", input: "Hello" }).withResponse();
    check(data.object === "response", `responses: object ${show(data.object)}`);
    check(data.output_text === HELLO_KIMI, `responses: output_text ${show(data.output_text)} of ${show(data)}`);
    check(data.usage?.input_tokens > 0 && data.usage?.output_tokens > 0, `responses: usage ${show(data.usage)}`);
    checkLtgHeaders(response.headers, "responses", "Kimi-K3");
    ok("responses.create");
  }
  // responses, stream: true: the events, the text deltas, response.completed with usage.
  {
    const { data: s, response } = await client.responses
      .create({ model: "Kimi-K3", input: "Hello", stream: true })
      .withResponse();
    checkLtgHeaders(response.headers, "responses stream", "Kimi-K3");
    const types = [];
    let text = "", done = null;
    for await (const ev of s) {
      types.push(ev.type);
      if (ev.type === "response.output_text.delta") text += ev.delta;
      if (ev.type === "response.completed") done = ev.response;
    }
    check(types[0] === "response.created", `responses stream: first event ${show(types[0])}`);
    check(types.at(-1) === "response.completed", `responses stream: last event ${show(types.at(-1))}`);
    check(WORDS.test(text), `responses stream: text ${show(text)}`);
    check(done?.usage?.output_tokens > 0, `responses stream: usage ${show(done?.usage)}`);
    ok("responses.create stream: true");
  }
  // responses.stream(): the helper's accumulated final response.
  {
    const stream = client.responses.stream({ model: "Kimi-K3", input: "Hello" });
    let deltas = "";
    stream.on("response.output_text.delta", (e) => (deltas += e.delta));
    const final = await stream.finalResponse();
    check(WORDS.test(deltas), `responses.stream: deltas ${show(deltas)}`);
    check(final.output_text === deltas, `responses.stream: output_text ${show(final.output_text)} != deltas ${show(deltas)}`);
    check(final.usage?.output_tokens > 0, `responses.stream: usage ${show(final.usage)}`);
    ok("responses.stream");
  }
  // completions (legacy), plain and stream; headers through .asResponse().
  {
    const { data, response } = await client.completions
      .create({ model: "Kimi-K3", prompt: "Say hi", max_tokens: 16 })
      .withResponse();
    const text = data.choices?.[0]?.text;
    check(typeof text === "string" && text.length > 0, `completions: text ${show(text)} of ${show(data)}`);
    check(data.usage?.completion_tokens > 0, `completions: usage ${show(data.usage)}`);
    checkLtgHeaders(response.headers, "completions", "Kimi-K3");
    const raw = await client.completions.create({ model: "GLM-5.3-Flash", prompt: "Say hi", max_tokens: 16 }).asResponse();
    checkLtgHeaders(raw.headers, "completions asResponse", "GLM-5.3-Flash");
    const j = await raw.json();
    check(j.model === "glm-5.3-flash", `completions asResponse: body ${show(j)}`);
    const s = await client.completions.create({ model: "Kimi-K3", prompt: "Say hi", stream: true });
    let st = "";
    for await (const chunk of s) st += chunk.choices?.[0]?.text ?? "";
    check(st.length > 0, `completions stream: text ${show(st)}`);
    ok("completions.create (plain, asResponse, stream)");
  }
  // embeddings with the SDK's default (it asks for base64 and decodes the float32s).
  {
    const { data: e, response } = await client.embeddings.create({ model: "GLM-5.3-Flash", input: "hello" }).withResponse();
    const v = e.data?.[0]?.embedding;
    const want = [0.1, 0.2, 0.3].map(Math.fround);
    check(Array.isArray(v) && v.length === 3 && v.every((x, i) => x === want[i]), `embeddings: ${show(e)}`);
    check(e.usage?.prompt_tokens > 0, `embeddings: usage ${show(e.usage)}`);
    checkLtgHeaders(response.headers, "embeddings", "GLM-5.3-Flash");
    ok("embeddings.create (default base64)");
  }
}

async function runFailoverOpenAI() {
  const client = await openaiClient();
  const { data, response } = await client.chat.completions
    .create({ model: "Kimi-K3", messages: [{ role: "user", content: "Hello" }] })
    .withResponse();
  const text = data.choices?.[0]?.message?.content;
  check(text === "Hello from glm-5.3-flash.", `failover chat: content ${show(text)}`);
  checkLtgHeaders(response.headers, "failover chat", "GLM-5.3-Flash", "2");
  ok("failover seen through .withResponse()");
}

// The relayed usage as the SDK parsed it (the caller scripted the counts and checks them).
async function runUsageOpenAI() {
  const client = await openaiClient();
  const completion = await client.chat.completions.create({ model: "Kimi-K3", messages: [{ role: "user", content: "Hello" }] });
  check(completion.choices?.[0]?.message?.content === HELLO_KIMI, `usage chat: ${show(completion)}`);
  result.usage = completion.usage ?? null;
  ok("chat.completions.create: completion.usage read");
}

// ---- the Vercel AI SDK ---------------------------------------------------------------------------

async function aiProvider() {
  const { createOpenAI } = await import("@ai-sdk/openai");
  return createOpenAI({ baseURL, apiKey });
}

async function runAI() {
  const { generateText, streamText, embed } = await import("ai");
  const provider = await aiProvider();
  const errors = [];
  const onError = ({ error }) => errors.push(error);

  // generateText, the default provider: the Responses API.
  {
    const r = await generateText({ model: provider("Kimi-K3"), prompt: "Hello", maxRetries: 0 });
    check(r.text === HELLO_KIMI, `generateText (responses): text ${show(r.text)}`);
    check(r.usage?.inputTokens > 0 && r.usage?.outputTokens > 0, `generateText (responses): usage ${show(r.usage)}`);
    checkLtgHeaders(r.response?.headers, "ai generateText responses", "Kimi-K3");
    ok("generateText, default provider (Responses API)");
  }
  // streamText, the default provider.
  {
    const r = streamText({ model: provider("Kimi-K3"), prompt: "Hello", maxRetries: 0, onError });
    let text = "";
    for await (const t of r.textStream) text += t;
    check(!errors.length, `streamText (responses): error ${errors[0]?.message ?? show(errors[0])}`);
    check(WORDS.test(text), `streamText (responses): text ${show(text)}`);
    const usage = await r.usage;
    check(usage?.outputTokens > 0, `streamText (responses): usage ${show(usage)}`);
    checkLtgHeaders((await r.response)?.headers, "ai streamText responses", "Kimi-K3");
    ok("streamText, default provider (Responses API)");
  }
  // provider.chat(): Chat Completions, plain and stream.
  {
    const r = await generateText({ model: provider.chat("Kimi-K3"), prompt: "Hello", maxRetries: 0 });
    check(r.text === HELLO_KIMI, `generateText (chat): text ${show(r.text)}`);
    check(r.usage?.outputTokens === 3, `generateText (chat): usage ${show(r.usage)}`);
    checkLtgHeaders(r.response?.headers, "ai generateText chat", "Kimi-K3");
    const s = streamText({ model: provider.chat("GLM-5.3-Flash"), prompt: "Hello", maxRetries: 0, onError });
    let text = "";
    for await (const t of s.textStream) text += t;
    check(!errors.length, `streamText (chat): error ${errors[0]?.message ?? show(errors[0])}`);
    check(WORDS.test(text), `streamText (chat): text ${show(text)}`);
    checkLtgHeaders((await s.response)?.headers, "ai streamText chat", "GLM-5.3-Flash");
    ok("generateText and streamText, provider.chat() (Chat Completions)");
  }
  // embed(): the provider's embedding model (it asks for encoding_format "float").
  {
    const model = (provider.embedding ?? provider.textEmbeddingModel).call(provider, "GLM-5.3-Flash");
    const r = await embed({ model, value: "hello", maxRetries: 0 });
    check(show(r.embedding) === show([0.1, 0.2, 0.3]), `embed: ${show(r.embedding)}`);
    checkLtgHeaders(r.response?.headers, "ai embed", "GLM-5.3-Flash");
    ok("embed");
  }
}

async function runFailoverAI() {
  const { generateText } = await import("ai");
  const provider = await aiProvider();
  const r = await generateText({ model: provider("Kimi-K3"), prompt: "Hello", maxRetries: 0 });
  check(r.text === "Hello from glm-5.3-flash.", `failover generateText: text ${show(r.text)}`);
  checkLtgHeaders(r.response?.headers, "failover ai generateText", "GLM-5.3-Flash", "2");
  ok("failover seen in result.response.headers");
}

// ---- LangChain -----------------------------------------------------------------------------------

async function runLangChain() {
  const { ChatOpenAI, OpenAIEmbeddings } = await import("@langchain/openai");
  const configuration = { baseURL };
  // LangChain does not expose response headers: the texts and the usage only.
  for (const useResponsesApi of [false, true]) {
    const api = useResponsesApi ? "responses" : "chat";
    const chat = new ChatOpenAI({ model: "Kimi-K3", apiKey, configuration, maxRetries: 0, useResponsesApi });
    const m = await chat.invoke("Hello");
    const text = typeof m.content === "string" ? m.content : m.text;
    check(text === HELLO_KIMI, `ChatOpenAI invoke (${api}): content ${show(m.content)}`);
    check(m.usage_metadata?.input_tokens > 0 && m.usage_metadata?.output_tokens > 0,
          `ChatOpenAI invoke (${api}): usage_metadata ${show(m.usage_metadata)}`);
    let st = "", usage = null;
    for await (const chunk of await chat.stream("Hello")) {
      st += typeof chunk.content === "string" ? chunk.content : chunk.text ?? "";
      if (chunk.usage_metadata) usage = chunk.usage_metadata;
    }
    check(WORDS.test(st), `ChatOpenAI stream (${api}): text ${show(st)}`);
    check(usage?.output_tokens > 0, `ChatOpenAI stream (${api}): usage_metadata ${show(usage)}`);
    ok(`ChatOpenAI invoke and stream (${api})`);
  }
  const emb = new OpenAIEmbeddings({ model: "GLM-5.3-Flash", apiKey, configuration, maxRetries: 0 });
  const q = await emb.embedQuery("hello");
  const want = [0.1, 0.2, 0.3].map(Math.fround);
  check(Array.isArray(q) && q.length === 3 && q.every((x, i) => Math.abs(x - want[i]) < 1e-6), `OpenAIEmbeddings embedQuery: ${show(q)}`);
  // One document: the mock answers every request with one embedding (data[0]), whatever the input.
  const d = await emb.embedDocuments(["a document"]);
  check(d.length === 1 && d[0].length === 3, `OpenAIEmbeddings embedDocuments: ${show(d)}`);
  ok("OpenAIEmbeddings embedQuery and embedDocuments");
}

// ---- Anthropic's API (POST /v1/messages, /v1/messages/count_tokens) ---------------------------------

async function runAnthropic() {
  const { default: Anthropic } = await import("@anthropic-ai/sdk");
  // Anthropic's SDK adds /v1/messages to its base URL: ltg's root. The token key goes as apiKey
  // (the SDK sends it as x-api-key).
  const root = baseURL.replace(/\/v1\/?$/, "");
  const client = new Anthropic({ baseURL: root, apiKey, maxRetries: 0, timeout: 30_000 });
  const HELLO = "Hello from claude-mock.";
  const messages = [{ role: "user", content: "Hello" }];
  const failures = [];
  const step = async (what, fn) => {
    try {
      await fn();
      ok(what);
    } catch (e) {
      failures.push(`${what}: ${e?.constructor?.name}: ${e?.message ?? e}`);
      console.log(`FAIL ${which}: ${what}: ${e?.message ?? e}`);
    }
  };

  await step("anthropic messages.create", async () => {
    const { data, response } = await client.messages.create({ model: "Claude-M", max_tokens: 64, messages }).withResponse();
    const text = data.content?.filter((b) => b.type === "text").map((b) => b.text).join("");
    check(data.type === "message" && text === HELLO, `messages.create: ${show(data)}`);
    check(data.usage?.input_tokens > 0 && data.usage?.output_tokens > 0, `messages.create: usage ${show(data.usage)}`);
    checkLtgHeaders(response.headers, "anthropic messages", "Claude-M");
  });
  await step("anthropic messages.stream", async () => {
    const stream = client.messages.stream({ model: "Claude-M", max_tokens: 64, messages });
    let deltas = "";
    stream.on("text", (t) => (deltas += t));
    const final = await stream.finalMessage();
    const text = final.content?.filter((b) => b.type === "text").map((b) => b.text).join("");
    check(WORDS.test(deltas) && text === deltas, `messages.stream: deltas ${show(deltas)}, final ${show(final)}`);
    check(final.usage?.output_tokens > 0, `messages.stream: usage ${show(final.usage)}`);
    const { response } = await stream.withResponse();
    checkLtgHeaders(response.headers, "anthropic messages stream", "Claude-M");
  });
  await step("anthropic messages.countTokens", async () => {
    const r = await client.messages.countTokens({ model: "Claude-M", messages });
    check(Number.isInteger(r.input_tokens) && r.input_tokens > 0, `countTokens: ${show(r)}`);
  });
  await step("anthropic errors: a wrong key is AuthenticationError", async () => {
    const bad = new Anthropic({ baseURL: root, apiKey: apiKey + "-wrong", maxRetries: 0, timeout: 30_000 });
    let err = null;
    try {
      await bad.messages.create({ model: "Claude-M", max_tokens: 16, messages });
    } catch (e) {
      err = e;
    }
    check(err instanceof Anthropic.AuthenticationError, `wrong key: ${err?.constructor?.name}: ${err?.message}`);
  });

  const { createAnthropic } = await import("@ai-sdk/anthropic");
  const { generateText, streamText } = await import("ai");
  const anth = createAnthropic({ baseURL, apiKey });       // this one adds /messages to .../v1
  await step("@ai-sdk/anthropic generateText", async () => {
    const r = await generateText({ model: anth("Claude-M"), prompt: "Hello", maxRetries: 0 });
    check(r.text === HELLO, `generateText: text ${show(r.text)}`);
    check(r.usage?.outputTokens > 0, `generateText: usage ${show(r.usage)}`);
    checkLtgHeaders(r.response?.headers, "ai anthropic generateText", "Claude-M");
  });
  await step("@ai-sdk/anthropic streamText", async () => {
    const errors = [];
    const r = streamText({ model: anth("Claude-M"), prompt: "Hello", maxRetries: 0, onError: ({ error }) => errors.push(error) });
    let text = "";
    for await (const t of r.textStream) text += t;
    check(!errors.length, `streamText: error ${errors[0]?.message ?? show(errors[0])}`);
    check(WORDS.test(text), `streamText: text ${show(text)}`);
    checkLtgHeaders((await r.response)?.headers, "ai anthropic streamText", "Claude-M");
  });
  check(!failures.length, failures.join("; "));
}

async function runUsageAnthropic() {
  const { default: Anthropic } = await import("@anthropic-ai/sdk");
  const client = new Anthropic({ baseURL: baseURL.replace(/\/v1\/?$/, ""), apiKey, maxRetries: 0, timeout: 30_000 });
  const message = await client.messages.create({ model: "Claude-M", max_tokens: 64, messages: [{ role: "user", content: "Hello" }] });
  check(message.type === "message", `usage messages.create: ${show(message)}`);
  result.usage = message.usage ?? null;
  ok("messages.create: message.usage read");
}

// ---- translated: an SDK of one API on a model of the other (README "One API for every model") ----

async function runTranslateOpenAI() {
  const client = await openaiClient();
  const messages = [{ role: "system", content: "Be brief." }, { role: "user", content: "Hello" }];
  const HELLO = "Hello from claude-mock.";
  const { data, response } = await client.chat.completions.create({ model: "Claude-M", messages }).withResponse();
  check(data.object === "chat.completion" && data.choices?.[0]?.message?.content === HELLO &&
        data.choices[0].finish_reason === "stop", `create: ${show(data)}`);
  check(data.usage?.prompt_tokens > 0 && data.usage?.completion_tokens > 0 &&
        data.usage.total_tokens === data.usage.prompt_tokens + data.usage.completion_tokens, `create: usage ${show(data.usage)}`);
  checkLtgHeaders(response.headers, "translated chat", "Claude-M");
  ok("chat.completions.create on an Anthropic model");
  const stream = await client.chat.completions.create({ model: "Claude-M", messages, stream: true,
                                                        stream_options: { include_usage: true } });
  let text = "", finish = null, usage = null;
  for await (const chunk of stream) {
    text += chunk.choices?.[0]?.delta?.content ?? "";
    finish = chunk.choices?.[0]?.finish_reason ?? finish;
    usage = chunk.usage ?? usage;
  }
  check(WORDS.test(text) && finish === "stop" && usage?.completion_tokens > 0, `stream: ${show({ text, finish, usage })}`);
  ok("a stream read chunk by chunk: text, finish_reason, the usage chunk");
  const tools = [{ type: "function", function: { name: "Bash", description: "run a command",
                   parameters: { type: "object", properties: { command: { type: "string" } }, required: ["command"] } } }];
  const runner = client.chat.completions.stream({ model: "Claude-M", messages, tools });
  const final = await runner.finalChatCompletion();
  const call = final.choices?.[0]?.message?.tool_calls?.[0];
  check(final.choices[0].finish_reason === "tool_calls" && call?.function?.name === "Bash" &&
        JSON.parse(call.function.arguments).command?.includes("mock-tool"), `stream helper: ${show(final)}`);
  ok("the stream helper's finalChatCompletion(): a tool call, its arguments whole");
  const { createOpenAI } = await import("@ai-sdk/openai");
  const { generateText, streamText } = await import("ai");
  const provider = createOpenAI({ baseURL, apiKey });
  const g = await generateText({ model: provider.chat("Claude-M"), prompt: "Hello", maxRetries: 0 });
  check(g.text === HELLO && g.usage?.outputTokens > 0, `generateText: ${show({ text: g.text, usage: g.usage })}`);
  const errors = [];
  const st = streamText({ model: provider.chat("Claude-M"), prompt: "Hello", maxRetries: 0, onError: ({ error }) => errors.push(error) });
  let t2 = "";
  for await (const t of st.textStream) t2 += t;
  check(!errors.length && WORDS.test(t2), `streamText: ${show({ t2, error: errors[0]?.message })}`);
  ok("the AI SDK's provider.chat(): generateText and streamText");
}

// the openai SDK's Responses API on a chat-only model and on Claude: create, and the stream
// helper's accumulated final response
async function runTranslateResponses() {
  const client = await openaiClient();
  for (const model of ["GLM-Chat", "Claude-M"]) {
    const { data, response } = await client.responses.create({ model, input: "Hello", instructions: "Be brief." })
                                           .withResponse();
    check(data.object === "response" && /^Hello from /.test(data.output_text) && data.usage?.output_tokens > 0 &&
          data.id?.startsWith("resp_"), `responses.create on ${model}: ${show(data)}`);
    checkLtgHeaders(response.headers, `translated responses ${model}`, model);
    ok(`responses.create on ${model}`);
    const stream = client.responses.stream({ model, input: "Hello" });
    let deltas = "";
    stream.on("response.output_text.delta", (e) => (deltas += e.delta));
    const final = await stream.finalResponse();
    check(WORDS.test(deltas) && final.output_text === deltas && final.usage?.output_tokens > 0 &&
          final.id?.startsWith("resp_"), `responses.stream on ${model}: ${show({ deltas, final })}`);
    ok(`responses.stream on ${model}: the helper's final response`);
  }
}

async function runTranslateAnthropic() {
  const { default: Anthropic } = await import("@anthropic-ai/sdk");
  const root = baseURL.replace(/\/v1\/?$/, "");
  const client = new Anthropic({ baseURL: root, apiKey, maxRetries: 0, timeout: 30_000 });
  const messages = [{ role: "user", content: "Hello" }];
  const { data, response } = await client.messages.create({ model: "Kimi-K3", max_tokens: 64, system: "Be brief.", messages }).withResponse();
  const text = data.content?.filter((b) => b.type === "text").map((b) => b.text).join("");
  check(data.type === "message" && text === HELLO_KIMI && data.stop_reason === "end_turn", `create: ${show(data)}`);
  check(data.usage?.input_tokens > 0 && data.usage?.output_tokens > 0, `create: usage ${show(data.usage)}`);
  checkLtgHeaders(response.headers, "translated messages", "Kimi-K3");
  ok("messages.create on a chat model");
  const stream = client.messages.stream({ model: "Kimi-K3", max_tokens: 64, messages });
  let deltas = "";
  stream.on("text", (t) => (deltas += t));
  const final = await stream.finalMessage();
  const ftext = final.content?.filter((b) => b.type === "text").map((b) => b.text).join("");
  check(WORDS.test(deltas) && ftext === deltas && final.stop_reason === "end_turn" && final.usage?.output_tokens > 0,
        `stream: ${show({ deltas, final })}`);
  result.stream_usage = final.usage;
  ok("messages.stream().finalMessage(): text, stop_reason, the provider's usage");
  const c = await client.messages.countTokens({ model: "Kimi-K3", messages });
  check(Number.isInteger(c.input_tokens) && c.input_tokens > 0, `countTokens: ${show(c)}`);
  ok("countTokens: ltg's estimate");
  if (which === "translate-anthropic-tools") {
    const tools = [{ name: "Bash", description: "run a command",
                     input_schema: { type: "object", properties: { command: { type: "string" } }, required: ["command"] } }];
    const m = await client.messages.create({ model: "Kimi-K3", max_tokens: 64, messages, tools });
    const tu = m.content?.find((b) => b.type === "tool_use");
    check(m.stop_reason === "tool_use" && tu?.name === "Bash" && tu.input?.command?.includes("mock-tool"), `tool create: ${show(m)}`);
    const s2 = client.messages.stream({ model: "Kimi-K3", max_tokens: 64, messages, tools });
    const f2 = await s2.finalMessage();
    const tu2 = f2.content?.find((b) => b.type === "tool_use");
    check(f2.stop_reason === "tool_use" && tu2?.name === "Bash" && tu2.input?.command?.includes("mock-tool"), `tool stream: ${show(f2)}`);
    ok("a tool call, whole and streamed: tool_use with its input object");
    return;
  }
  const { createAnthropic } = await import("@ai-sdk/anthropic");
  const { generateText, streamText } = await import("ai");
  const anth = createAnthropic({ baseURL, apiKey });
  const g = await generateText({ model: anth("Kimi-K3"), prompt: "Hello", maxRetries: 0 });
  check(g.text === HELLO_KIMI && g.usage?.outputTokens > 0, `generateText: ${show({ text: g.text, usage: g.usage })}`);
  const errors = [];
  const st = streamText({ model: anth("Kimi-K3"), prompt: "Hello", maxRetries: 0, onError: ({ error }) => errors.push(error) });
  let t2 = "";
  for await (const t of st.textStream) t2 += t;
  check(!errors.length && WORDS.test(t2), `streamText: ${show({ t2, error: errors[0]?.message })}`);
  ok("@ai-sdk/anthropic on a chat model: generateText and streamText");
}

const RUN = {
  openai: runOpenAI,
  ai: runAI,
  langchain: runLangChain,
  anthropic: runAnthropic,
  "failover-openai": runFailoverOpenAI,
  "failover-ai": runFailoverAI,
  "usage-openai": runUsageOpenAI,
  "usage-anthropic": runUsageAnthropic,
  "translate-openai": runTranslateOpenAI,
  "translate-anthropic": runTranslateAnthropic,
  "translate-responses": runTranslateResponses,
  "translate-anthropic-tools": runTranslateAnthropic,
};

if (!RUN[which]) {
  console.error(`unknown WHICH ${which}: one of ${Object.keys(RUN).join(", ")}`);
  process.exit(2);
}
try {
  await RUN[which]();
  console.log("RESULT " + JSON.stringify(result));
  process.exit(0);
} catch (e) {
  console.log("RESULT " + JSON.stringify(result));
  const status = e?.status ? ` (HTTP ${e.status}${e?.error ? " " + show(e.error) : ""})` : "";
  const url = e?.url ? ` [${e.url}]` : "";
  const body = e?.responseBody ? ` body ${String(e.responseBody).slice(0, 300)}` : "";
  console.log(`FAIL: ${e?.constructor?.name}: ${e?.message ?? e}${status}${url}${body}`);
  process.exit(1);
}
