// llama.cpp's greedy continuations of kvlab's GGUF exports, through node-llama-cpp's prebuilt
// CPU binaries (no build, no network, no GPU).
// Usage: node greedy.mjs JOBS.json OUT.json
// JOBS.json: [{"model": path, "prompt": [ids] or "text": string, "new_tokens": n,
//              "threads": t, "forced": [ids] (optional), "tokenize": [strings] (optional),
//              "tokenize_special": [strings] (optional)}, ...]
// OUT.json:  [{"tokens": [ids], "logprobs": [[log p of each vocabulary id], ...],
//              "forced_logprobs": [[...], ...] (with "forced"),
//              "prompt": [ids], "continuation": string (with "text"),
//              "tokenized": [[ids], ...] (with "tokenize"),
//              "tokenized_special": [[ids], ...] (with "tokenize_special")}, ...], one row of
// log-probabilities per generated token: the distribution it was chosen from. With "forced",
// the prompt is followed by those tokens one decode step at a time instead of llama.cpp's own
// choices (teacher forcing), and "forced_logprobs" holds the distribution before each of them:
// the two engines are then compared at every step, also after their greedy texts part. A
// "text" prompt and the "tokenize" strings are tokenized by llama.cpp as text (special tokens'
// text not parsed; the "text" prompt after the BOS token where the vocabulary asks for one, as
// llama.cpp tokenizes a prompt, when the job says "bos": true), and the greedy tokens
// detokenized into "continuation". The "tokenize_special" strings are tokenized with special
// tokens' text parsed as those tokens (as llama.cpp's server tokenizes a rendered chat), without
// BOS or EOS added.
// A job {"model": path, "controls": true, "vocab_size": n} reads the file's vocabulary alone
// and gives
// {"bos", "eos" (ids or null), "add_bos", "add_eos", "eog": [every id llama.cpp ends a
// generation at]}.
import {readFileSync, writeFileSync} from "node:fs";
import {getLlama} from "node-llama-cpp";

const [jobsPath, outPath] = process.argv.slice(2);
const jobs = JSON.parse(readFileSync(jobsPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error", progressLogs: false});
const greedyOptions = {temperature: 0, topK: 0, topP: 1, minP: 0};
const logRow = (probabilities) => {
  const row = [];
  for (const [id, p] of probabilities) row[id] = Math.log(p);
  return row;
};
const results = [];
for (const job of jobs) {
  if (job.controls) {
    const vocab = await llama.loadModel({modelPath: job.model, gpuLayers: 0, vocabOnly: true});
    const eog = [];
    for (let id = 0; id < job.vocab_size; ++id) if (vocab.isEogToken(id)) eog.push(id);
    results.push({bos: vocab.tokens.bos, eos: vocab.tokens.eos,
                  add_bos: vocab.tokens.shouldPrependBosToken,
                  add_eos: vocab.tokens.shouldAppendEosToken, eog});
    await vocab.dispose();
    continue;
  }
  const model = await llama.loadModel({modelPath: job.model, gpuLayers: 0});
  const textPrompt = job.text !== undefined;
  if (textPrompt) {
    job.prompt = Array.from(model.tokenize(job.text, false));
    if (job.bos && model.tokens.shouldPrependBosToken) job.prompt.unshift(model.tokens.bos);
  }
  const newContext = () => model.createContext({
    contextSize: job.prompt.length + job.new_tokens + 1, sequences: 1, threads: job.threads,
    batchSize: job.prompt.length + 1,
    // An f32 cache and no flash attention (which rounds the queries to f16): llama.cpp then
    // computes in f32 throughout, as kvlab does.
    experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32", flashAttention: false,
  });
  let context = await newContext();
  const tokens = [], logprobs = [];
  // Temperature 0 is greedy; an end-of-generation token is yielded like any other.
  for await (const out of context.getSequence().evaluateWithMetadata(
      job.prompt, {probabilities: true}, {...greedyOptions, yieldEogToken: true})) {
    tokens.push(out.token);
    logprobs.push(logRow(out.probabilities));
    if (tokens.length >= job.new_tokens) break;
  }
  const result = {tokens, logprobs};
  if (textPrompt) {
    result.prompt = job.prompt;
    result.continuation = model.detokenize(tokens);
  }
  if (job.tokenize) result.tokenized = job.tokenize.map((t) => Array.from(model.tokenize(t, false)));
  if (job.tokenize_special)
    result.tokenized_special = job.tokenize_special.map((t) => Array.from(model.tokenize(t, true)));
  await context.dispose();
  if (job.forced) {
    context = await newContext();
    const sequence = context.getSequence();
    const next = {generateNext: {probabilities: true, options: greedyOptions}};
    // The prompt in one batch, as above, then one forced token per step.
    let input = job.prompt.map((t, i) => (i + 1 === job.prompt.length ? [t, next] : t));
    result.forced_logprobs = [];
    for (const t of job.forced) {
      const out = await sequence.controlledEvaluate(input);
      result.forced_logprobs.push(logRow(out[input.length - 1].next.probabilities));
      input = [[t, next]];
    }
    await context.dispose();
  }
  results.push(result);
  await model.dispose();
}
writeFileSync(outPath, JSON.stringify(results));
