// llama.cpp's greedy continuations of kvlab's GGUF exports, through node-llama-cpp's prebuilt
// CPU binaries (no build, no network, no GPU).
// Usage: node greedy.mjs JOBS.json OUT.json
// JOBS.json: [{"model": path, "prompt": [ids], "new_tokens": n, "threads": t}, ...]
// OUT.json:  [{"tokens": [ids], "logprobs": [[log p of each vocabulary id], ...]}, ...], one row
// of log-probabilities per generated token: the distribution it was chosen from.
import {readFileSync, writeFileSync} from "node:fs";
import {getLlama} from "node-llama-cpp";

const [jobsPath, outPath] = process.argv.slice(2);
const jobs = JSON.parse(readFileSync(jobsPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error", progressLogs: false});
const results = [];
for (const job of jobs) {
  const model = await llama.loadModel({modelPath: job.model, gpuLayers: 0});
  const context = await model.createContext({
    contextSize: job.prompt.length + job.new_tokens + 1, sequences: 1, threads: job.threads,
    batchSize: job.prompt.length + 1,
    // An f32 cache and no flash attention (which rounds the queries to f16): llama.cpp then
    // computes in f32 throughout, as kvlab does.
    experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32", flashAttention: false,
  });
  const sequence = context.getSequence();
  const tokens = [], logprobs = [];
  // Temperature 0 is greedy; an end-of-generation token is yielded like any other.
  for await (const out of sequence.evaluateWithMetadata(job.prompt, {probabilities: true},
                                                         {temperature: 0, topK: 0, topP: 1, minP: 0, yieldEogToken: true})) {
    tokens.push(out.token);
    const row = [];
    for (const [id, p] of out.probabilities) row[id] = Math.log(p);
    logprobs.push(row);
    if (tokens.length >= job.new_tokens) break;
  }
  results.push({tokens, logprobs});
  await context.dispose();
  await model.dispose();
}
writeFileSync(outPath, JSON.stringify(results));
