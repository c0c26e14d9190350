// tiktoken (the npm package, WASM) as the reference for kvlab's BPE tests:
//   node reference.js ranks ENCODING OUT   writes ENCODING's rank file ("<base64> <rank>" lines)
//   node reference.js encode ENCODING FILE prints the ids of FILE's text (encode_ordinary) as JSON
//   node reference.js specials ENCODING    prints {text: id} of ENCODING's special tokens
// ENCODING is gpt2 or cl100k_base.
'use strict';
const fs = require('fs');
const {get_encoding} = require('tiktoken');

const [command, name, path] = process.argv.slice(2);
const enc = get_encoding(name);
if (command === 'ranks') {
  // Ordinary tokens have ranks 0..N-1, below <|endoftext|>; cl100k leaves one id unused
  // before it, which throws (and leaves the encoder unusable, so it is not freed).
  const end = enc.encode('<|endoftext|>', 'all')[0];
  const lines = [];
  for (let rank = 0; rank < end; ++rank) {
    let bytes;
    try {
      bytes = enc.decode_single_token_bytes(rank);
    } catch (e) {
      break;
    }
    lines.push(Buffer.from(bytes).toString('base64') + ' ' + rank);
  }
  fs.writeFileSync(path, lines.join('\n') + '\n');
} else if (command === 'encode') {
  const text = fs.readFileSync(path, 'utf8');
  process.stdout.write(JSON.stringify(Array.from(enc.encode_ordinary(text))) + '\n');
  enc.free();
} else if (command === 'specials') {
  // Every special token of gpt2 and cl100k_base; one that is not ENCODING's encodes to
  // several ordinary ids and is left out.
  const names = ['<|endoftext|>', '<|fim_prefix|>', '<|fim_middle|>', '<|fim_suffix|>',
                 '<|endofprompt|>'];
  const out = {};
  for (const name of names) {
    const ids = enc.encode(name, 'all');
    if (ids.length === 1) out[name] = ids[0];
  }
  process.stdout.write(JSON.stringify(out) + '\n');
  enc.free();
} else {
  throw new Error('usage: node reference.js ranks|encode|specials ENCODING [PATH]');
}
