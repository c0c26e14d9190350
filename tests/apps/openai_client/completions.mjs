// Drives `kvlab serve` with the official openai client: model listing, a seeded completion
// (plain and streamed) that must match `kvlab generate`, a chat completion (plain and streamed)
// that must match `kvlab generate --chat`, and rejected bad requests.
// Env: KVLAB_BASE_URL (http://127.0.0.1:PORT/v1), KVLAB_EXPECTED_TEXT, KVLAB_EXPECTED_CHAT.
import assert from "node:assert/strict";
import OpenAI from "openai";

const baseURL = process.env.KVLAB_BASE_URL;
const expected = process.env.KVLAB_EXPECTED_TEXT;
const expectedChat = process.env.KVLAB_EXPECTED_CHAT;
if (!baseURL || expected === undefined || expectedChat === undefined) {
  console.error("completions.mjs: set KVLAB_BASE_URL, KVLAB_EXPECTED_TEXT and KVLAB_EXPECTED_CHAT");
  process.exit(2);
}

// KVLAB_API_KEY: the server's key (the client sends it as "Authorization: Bearer").
const apiKey = process.env.KVLAB_API_KEY;
const client = new OpenAI({ baseURL, apiKey: apiKey ?? "unused", maxRetries: 0, timeout: 60_000 });
let current = "setup";

async function check(name, fn) {
  current = name;
  await fn();
  console.log(`ok: ${name}`);
}

try {
  let model;
  await check("models.list", async () => {
    const page = await client.models.list();
    assert.ok(page.data.length > 0, "no models listed");
    model = page.data[0].id;
    assert.equal(typeof model, "string");
    assert.ok(model.length > 0, "empty model id");
  });

  const args = { model, prompt: "the lord", max_tokens: 8, temperature: 1, seed: 7 };

  await check("completions.create", async () => {
    const res = await client.completions.create(args);
    assert.ok(res.choices.length > 0, "no choices");
    assert.equal(res.choices[0].text, expected, "text differs from kvlab generate");
    assert.equal(res.choices[0].finish_reason, "length", "finish_reason");
    assert.ok(res.usage, "no usage");
    assert.equal(res.usage.prompt_tokens, 8, "usage.prompt_tokens");
    assert.equal(res.usage.completion_tokens, 8, "usage.completion_tokens");
    assert.equal(res.usage.total_tokens, 16, "usage.total_tokens");
  });

  await check("completions.create stream", async () => {
    const stream = await client.completions.create({ ...args, stream: true });
    let text = "";
    let last = null;
    for await (const chunk of stream) {
      // A usage-only chunk may carry no choices.
      if (!chunk.choices || chunk.choices.length === 0) continue;
      text += chunk.choices[0].text ?? "";
      last = chunk.choices[0];
    }
    assert.ok(last, "stream had no choice chunks");
    assert.equal(text, expected, "streamed text differs from kvlab generate");
    assert.equal(last.finish_reason, "length", "finish_reason of the last choice chunk");
  });

  const chat = {
    model,
    messages: [
      { role: "system", content: "the" },
      { role: "user", content: [{ type: "text", text: "lord" }] },
    ],
    max_tokens: 4,
    temperature: 1,
    seed: 7,
  };

  await check("chat.completions.create", async () => {
    const res = await client.chat.completions.create(chat);
    assert.equal(res.object, "chat.completion");
    assert.ok(res.id.startsWith("chatcmpl-"), `id ${res.id}`);
    assert.equal(res.choices.length, 1, "one choice");
    assert.equal(res.choices[0].message.role, "assistant");
    assert.equal(res.choices[0].message.content, expectedChat, "reply differs from kvlab generate --chat");
    assert.equal(res.choices[0].finish_reason, "length", "finish_reason");
    assert.equal(res.usage.completion_tokens, 4, "usage.completion_tokens");
    // "the; lord i": a character each
    assert.equal(res.usage.prompt_tokens, 11, "usage.prompt_tokens");
  });

  await check("chat.completions.create stream", async () => {
    const stream = await client.chat.completions.create({
      ...chat, stream: true, stream_options: { include_usage: true },
    });
    let text = "";
    let role = null;
    let finish = null;
    let usage = null;
    for await (const chunk of stream) {
      assert.equal(chunk.object, "chat.completion.chunk");
      if (chunk.usage) usage = chunk.usage;
      if (!chunk.choices || chunk.choices.length === 0) continue;
      const delta = chunk.choices[0].delta;
      if (delta.role) role = role ?? delta.role;
      text += delta.content ?? "";
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    assert.equal(role, "assistant", "the first delta's role");
    assert.equal(text, expectedChat, "streamed reply differs from kvlab generate --chat");
    assert.equal(finish, "length", "finish_reason");
    assert.equal(usage?.completion_tokens, 4, "usage.completion_tokens");
  });

  await check("a malformed chat message rejected with 400 naming messages", async () => {
    await assert.rejects(
      client.chat.completions.create({ ...chat, messages: [{ content: "no role" }] }),
      (err) => {
        assert.ok(err instanceof OpenAI.BadRequestError, `not a BadRequestError: ${err}`);
        assert.equal(err.param, "messages", "error.param");
        return true;
      },
    );
  });

  await check("bad request rejected with 400", async () => {
    await assert.rejects(
      client.completions.create({ ...args, max_tokens: -1 }),
      (err) => {
        assert.ok(err instanceof OpenAI.APIError, `not an APIError: ${err}`);
        assert.equal(err.status, 400, "HTTP status");
        return true;
      },
    );
  });

  await check("a range the API refuses names its field", async () => {
    await assert.rejects(client.completions.create({ ...args, temperature: 3 }), (err) => {
      assert.ok(err instanceof OpenAI.BadRequestError, `not a BadRequestError: ${err}`);
      assert.equal(err.param, "temperature", "error.param");
      return true;
    });
  });

  if (apiKey) {
    await check("a wrong API key rejected with 401", async () => {
      const wrong = new OpenAI({ baseURL, apiKey: `${apiKey}x`, maxRetries: 0, timeout: 60_000 });
      for (const call of [() => wrong.models.list(), () => wrong.completions.create(args)]) {
        await assert.rejects(call(), (err) => {
          assert.ok(err instanceof OpenAI.AuthenticationError, `not an AuthenticationError: ${err}`);
          assert.equal(err.status, 401, "HTTP status");
          assert.equal(err.type, "invalid_request_error", "error.type");
          return true;
        });
      }
    });

    await check("/health open without a key", async () => {
      const res = await fetch(new URL("../health", `${baseURL}/`));
      assert.equal(res.status, 200, "HTTP status");
    });
  }
} catch (err) {
  console.error(`FAIL: ${current}: ${err?.message ?? err}`);
  process.exit(1);
}
console.log("openai client: all checks passed");
