// The baselines of bench/compare_bpe.sh, one timed round per call, printing JSON:
//   node bpe_baselines.js train CORPUS       Hugging Face tokenizers (bench/hf_tokenizers):
//                                             byte-level BPE trained on CORPUS
//   node bpe_baselines.js encode ENCODING FILE tiktoken (tests/data/tiktoken): FILE's text
//                                             encoded (encode_ordinary)
//   node bpe_baselines.js llama-cpp VOCAB FILE llama.cpp's tokenizer (node-llama-cpp's prebuilt
//                                             library, tests/infer/llama_cpp) with a GGUF
//                                             vocabulary: FILE's text tokenized as text
// Only the work is timed: loading the package, the vocabulary and the text is not.
'use strict';
const fs = require('fs');
const path = require('path');

const seconds = (t0) => Number(process.hrtime.bigint() - t0) / 1e9;
const [command, ...args] = process.argv.slice(2);
if (command === 'train') {
  const hf = require(path.join(__dirname, 'hf_tokenizers/node_modules/tokenizers'));
  const [corpus] = args;
  // The node binding trains with its model's default trainer: BpeTrainer::default(), whose
  // vocab_size is 30000 and which the binding cannot change.
  const tok = new hf.Tokenizer(hf.BPE.empty());
  // Byte-level with GPT-2's regex (kvlab's --pattern gpt2): the binding's split
  // pre-tokenizer takes its pattern as a literal string, not a regex.
  tok.setPreTokenizer(hf.byteLevelPreTokenizer(false, true));
  const t0 = process.hrtime.bigint();
  tok.train([corpus]);
  const s = seconds(t0);
  const bytes = fs.statSync(corpus).size;
  process.stdout.write(JSON.stringify({side: 'hf_tokenizers', version: '0.23.2', seconds: s,
    bytes, mb_per_s: bytes / 1e6 / s, vocab_size: tok.getVocabSize(false)}) + '\n');
} else if (command === 'encode') {
  const {get_encoding} = require(path.join(__dirname, '../tests/data/tiktoken/node_modules/tiktoken'));
  const [encoding, file] = args;
  const enc = get_encoding(encoding);
  const text = fs.readFileSync(file, 'utf8');
  const t0 = process.hrtime.bigint();
  const ids = enc.encode_ordinary(text);
  const s = seconds(t0);
  const bytes = Buffer.byteLength(text);
  process.stdout.write(JSON.stringify({side: 'tiktoken', version: '1.0.22', seconds: s, bytes,
    mb_per_s: bytes / 1e6 / s, tokens: ids.length}) + '\n');
  enc.free();
} else if (command === 'llama-cpp') {
  const [vocab, file] = args;
  const url = require('url').pathToFileURL(path.join(
      __dirname, '../tests/infer/llama_cpp/node_modules/node-llama-cpp/dist/index.js')).href;
  (async () => {
    const {getLlama} = await import(url);
    const llama = await getLlama({gpu: false, build: 'never', logLevel: 'error', progressLogs: false});
    const model = await llama.loadModel({modelPath: vocab, vocabOnly: true});
    const text = fs.readFileSync(file, 'utf8');
    const t0 = process.hrtime.bigint();
    const ids = model.tokenize(text, false);
    const s = seconds(t0);
    const bytes = Buffer.byteLength(text);
    process.stdout.write(JSON.stringify({side: 'llama.cpp', version: 'node-llama-cpp 3.21.1',
      seconds: s, bytes, mb_per_s: bytes / 1e6 / s, tokens: ids.length}) + '\n');
    await model.dispose();
  })();
} else {
  throw new Error('usage: node bpe_baselines.js train CORPUS | encode ENCODING FILE | ' +
                  'llama-cpp VOCAB FILE');
}
